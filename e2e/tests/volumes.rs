//! Volumes come and go as on a real cluster: more claims than the old
//! pre-made pool of 32 local volumes are provisioned, used by a pod, and
//! deleted with their directories, in rounds (`make e2e`; ignored otherwise).
//! Before the dynamic provisioner (e2e/cluster/lib/storage.sh) the 33rd claim
//! waited for ever.

use std::time::Duration;

use headroom_e2e::{E2E, TestNs, pod_phase};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, PostParams};

/// Claims in all: above the old pool's 32.
const CLAIMS: usize = 36;
const ROUND: usize = 12;
const WAIT: Duration = Duration::from_secs(240);

/// An image every node of the local cluster has (its sandbox image): the pod
/// only holds the claim. Override for other clusters.
fn idle_image() -> String {
    std::env::var("HEADROOM_E2E_IDLE_IMAGE")
        .unwrap_or_else(|_| "localhost/headroom-pause:3.10".into())
}

fn claim(name: &str) -> PersistentVolumeClaim {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Mi"}}}
    }))
    .expect("claim")
}

fn holder(name: &str, image: &str) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": false,
            "securityContext": {"runAsNonRoot": true, "runAsUser": 65535, "seccompProfile": {"type": "RuntimeDefault"}},
            "containers": [{
                "name": "hold", "image": image, "imagePullPolicy": "IfNotPresent",
                "securityContext": {"allowPrivilegeEscalation": false, "capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": true},
                "volumeMounts": [{"name": "data", "mountPath": "/data"}]
            }],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": name}}]
        }
    }))
    .expect("pod")
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn more_claims_than_the_old_pool_are_provisioned_and_cleaned_up() {
    let ns = TestNs::new(E2E, "e2e-volumes").await;
    let claims: Api<PersistentVolumeClaim> = Api::namespaced(ns.client.clone(), &ns.name);
    let volumes: Api<PersistentVolume> = Api::all(ns.client.clone());
    let pods = ns.pods();
    let image = idle_image();
    let pp = PostParams::default();
    for round in 0..CLAIMS / ROUND {
        let names: Vec<String> = (0..ROUND)
            .map(|i| format!("c{}", round * ROUND + i))
            .collect();
        for name in &names {
            claims.create(&pp, &claim(name)).await.expect("claim");
            pods.create(&pp, &holder(name, &image)).await.expect("pod");
        }
        ns.wait_for(
            &format!("round {round}: {ROUND} pods running on their volumes"),
            WAIT,
            || async {
                let list = ns.pod_list().await;
                (list.iter().filter(|p| pod_phase(p) == "Running").count() == ROUND).then_some(())
            },
        )
        .await;
        // Each claim got a volume of its own: a directory on the node.
        let mut bound = vec![];
        for name in &names {
            let c = claims.get(name).await.expect("claim");
            let pv = c.spec.and_then(|s| s.volume_name).expect("bound");
            let v = volumes.get(&pv).await.expect("volume");
            let spec = v.spec.expect("spec");
            let path = spec
                .host_path
                .map(|h| h.path)
                .or(spec.local.map(|l| l.path))
                .expect("a node path");
            bound.push((pv, std::path::PathBuf::from(path)));
        }
        for name in &names {
            let _ = pods
                .delete(name, &DeleteParams::default().grace_period(0))
                .await;
            let _ = claims.delete(name, &DeleteParams::default()).await;
        }
        ns.wait_for(
            &format!("round {round}: volumes deleted with their claims"),
            WAIT,
            || async {
                for (pv, path) in &bound {
                    if volumes.get_opt(pv).await.ok()?.is_some() {
                        return None;
                    }
                    // The node is this machine on the local cluster; elsewhere
                    // (kind) the directory lives in the node's container.
                    if path.parent().is_some_and(|p| p.exists()) && path.exists() {
                        return None;
                    }
                }
                Some(())
            },
        )
        .await;
    }
    ns.cleanup().await;
}
