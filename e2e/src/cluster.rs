//! The cluster under test of the e2e suite: its kubectl and where the
//! Headroom operator runs.
//!
//! Settings (environment):
//! * `KUBECTL`: the kubectl binary for the tests that run it (default: `kubectl` on `PATH`;
//!   `make e2e` sets the one built by e2e/cluster/build-binaries.sh).
//! * `HEADROOM_NAMESPACE` / `HEADROOM_OPERATOR_DEPLOYMENT`: where the operator runs
//!   (defaults: `headroom-system` / `headroom-operator`, the Helm chart's).

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ListParams};
use kube::{Client, ResourceExt};

/// The kubectl binary: `$KUBECTL`, else `kubectl` on `PATH`.
pub fn kubectl() -> std::path::PathBuf {
    std::env::var_os("KUBECTL")
        .filter(|k| !k.is_empty())
        .map_or_else(|| "kubectl".into(), Into::into)
}

/// Namespace of the Headroom operator (`$HEADROOM_NAMESPACE`, default `headroom-system`).
pub fn operator_namespace() -> String {
    std::env::var("HEADROOM_NAMESPACE").unwrap_or_else(|_| "headroom-system".into())
}

/// The operator's Deployment (`$HEADROOM_OPERATOR_DEPLOYMENT`, default the
/// chart's `headroom-operator`).
pub fn operator_deployment() -> String {
    std::env::var("HEADROOM_OPERATOR_DEPLOYMENT").unwrap_or_else(|_| "headroom-operator".into())
}

/// Label selector of the operator's pods, read from its Deployment.
pub async fn operator_selector(client: &Client) -> String {
    let deployment = Api::<Deployment>::namespaced(client.clone(), &operator_namespace())
        .get(&operator_deployment())
        .await
        .unwrap_or_else(|e| {
            panic!(
                "deployment {}/{}: {e}",
                operator_namespace(),
                operator_deployment()
            )
        });
    deployment
        .spec
        .and_then(|s| s.selector.match_labels)
        .unwrap_or_default()
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(",")
}

/// The operator's `--checkpoint-access-mode` (Helm `checkpoints.accessMode`),
/// read from its Deployment: whether pipeline stages must share a node.
pub async fn operator_checkpoint_access(client: &Client) -> String {
    let deployment = Api::<Deployment>::namespaced(client.clone(), &operator_namespace())
        .get(&operator_deployment())
        .await
        .unwrap_or_else(|e| panic!("deployment {}: {e}", operator_deployment()));
    deployment
        .spec
        .and_then(|s| s.template.spec)
        .into_iter()
        .flat_map(|s| s.containers)
        .flat_map(|c| c.args.unwrap_or_default())
        .find_map(|a| {
            a.strip_prefix("--checkpoint-access-mode=")
                .map(String::from)
        })
        .unwrap_or_else(|| "ReadWriteOnce".into())
}

/// Whether the node's Ready condition is True.
pub fn node_ready(node: &Node) -> bool {
    node.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The nodes pods may be scheduled to: Ready, without a NoSchedule taint, by name.
pub async fn schedulable_nodes(nodes: &Api<Node>) -> Vec<Node> {
    let mut schedulable: Vec<Node> = nodes
        .list(&ListParams::default())
        .await
        .expect("list nodes")
        .items
        .into_iter()
        .filter(|n| {
            let no_schedule = n
                .spec
                .as_ref()
                .and_then(|s| s.taints.as_ref())
                .is_some_and(|t| t.iter().any(|t| t.effect == "NoSchedule"));
            node_ready(n) && !no_schedule
        })
        .collect();
    schedulable.sort_by_key(ResourceExt::name_any);
    schedulable
}
