//! The cluster under test of the e2e suite: its kubectl and where the
//! Headroom operator runs.
//!
//! Settings (environment):
//! * `KUBECTL`: the kubectl binary for the tests that run it (default: `kubectl` on `PATH`;
//!   `make e2e` sets the one built by e2e/cluster/build-binaries.sh).
//! * `HEADROOM_NAMESPACE` / `HEADROOM_OPERATOR_DEPLOYMENT`: where the operator runs
//!   (defaults: `headroom-system` / `headroom-operator`, the Helm chart's).

use k8s_openapi::api::apps::v1::Deployment;
use kube::Client;
use kube::api::Api;

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
