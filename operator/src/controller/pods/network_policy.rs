//! The NetworkPolicy of a multi-worker attempt: its workers' pipeline and
//! replica ports take connections from the job's own workers only.
//!
//! A fence, not the lock: the links authenticate each other with the job's
//! key whether or not the cluster enforces NetworkPolicies (SECURITY.md).
//! Where it does, no other pod gets as far as a handshake. A single-worker
//! attempt listens on nothing and gets none (no API write for it).

use headroom_api::{
    COMPONENT_WORKER, LABEL_COMPONENT, LABEL_JOB, MemoryAwareTrainingJob, PIPELINE_PORT,
    REPLICA_PORT,
};
use k8s_openapi::api::networking::v1::{
    NetworkPolicy, NetworkPolicyIngressRule, NetworkPolicyPeer, NetworkPolicyPort,
    NetworkPolicySpec,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use kube::ResourceExt;

use super::names::service_name;
use super::skeleton::{Component, job_labels, meta};

/// Ingress to the job's workers: only from the job's workers, only on the
/// pipeline and replica ports. Named like the job's headless Service.
pub fn peer_network_policy(job: &MemoryAwareTrainingJob) -> NetworkPolicy {
    let workers = LabelSelector {
        match_labels: Some(
            [
                (LABEL_JOB.to_string(), job.name_any()),
                (LABEL_COMPONENT.to_string(), COMPONENT_WORKER.to_string()),
            ]
            .into_iter()
            .collect(),
        ),
        ..LabelSelector::default()
    };
    let port = |p: u16| NetworkPolicyPort {
        port: Some(IntOrString::Int(i32::from(p))),
        protocol: Some("TCP".into()),
        ..NetworkPolicyPort::default()
    };
    NetworkPolicy {
        metadata: meta(job, service_name(job), job_labels(job, Component::Worker)),
        spec: Some(NetworkPolicySpec {
            pod_selector: Some(workers.clone()),
            policy_types: Some(vec!["Ingress".into()]),
            ingress: Some(vec![NetworkPolicyIngressRule {
                from: Some(vec![NetworkPolicyPeer {
                    pod_selector: Some(workers),
                    ..NetworkPolicyPeer::default()
                }]),
                ports: Some(vec![port(PIPELINE_PORT), port(REPLICA_PORT)]),
            }]),
            ..NetworkPolicySpec::default()
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::pods::tests::job;

    #[test]
    fn only_the_jobs_own_workers_reach_its_link_ports() {
        let j = job(include_str!("../../../../samples/cpu-pipeline.yaml"));
        let policy = peer_network_policy(&j);
        assert_eq!(
            policy
                .metadata
                .owner_references
                .as_ref()
                .map(|o| o[0].uid.as_str()),
            Some("0000-1111"),
            "owned by the job, deleted with it"
        );
        let spec = policy.spec.expect("spec");
        let selected = spec
            .pod_selector
            .expect("selector")
            .match_labels
            .expect("labels");
        assert_eq!(selected[LABEL_JOB], j.name_any());
        assert_eq!(selected[LABEL_COMPONENT], "worker");
        assert_eq!(spec.policy_types, Some(vec!["Ingress".to_string()]));
        let rules = spec.ingress.expect("ingress");
        assert_eq!(rules.len(), 1, "nothing else is let in");
        let from = rules[0].from.as_ref().expect("from");
        assert_eq!(from.len(), 1);
        assert_eq!(from[0].namespace_selector, None, "this namespace only");
        assert_eq!(
            from[0]
                .pod_selector
                .as_ref()
                .and_then(|s| s.match_labels.as_ref()),
            Some(&selected)
        );
        let ports: Vec<_> = rules[0]
            .ports
            .iter()
            .flatten()
            .map(|p| (p.port.clone(), p.protocol.clone()))
            .collect();
        assert_eq!(
            ports,
            [
                (Some(IntOrString::Int(29_500)), Some("TCP".to_string())),
                (Some(IntOrString::Int(29_501)), Some("TCP".to_string()))
            ]
        );
    }
}
