//! The headless Service of a multi-worker attempt.

use headroom_api::{LABEL_JOB, MemoryAwareTrainingJob, PIPELINE_PORT};
use k8s_openapi::api::core::v1::{Service, ServicePort, ServiceSpec};
use kube::ResourceExt;

use super::names::service_name;
use super::skeleton::{Component, job_labels, meta};

/// Stable DNS names for the stages of a multi-worker plan (`s<k>.<service>`).
pub fn headless_service(job: &MemoryAwareTrainingJob) -> Service {
    Service {
        metadata: meta(job, service_name(job), job_labels(job, Component::Worker)),
        spec: Some(ServiceSpec {
            cluster_ip: Some("None".into()),
            selector: Some(
                [(LABEL_JOB.to_string(), job.name_any())]
                    .into_iter()
                    .collect(),
            ),
            publish_not_ready_addresses: Some(true),
            ports: Some(vec![ServicePort {
                name: Some("pipeline".into()),
                port: i32::from(PIPELINE_PORT),
                ..ServicePort::default()
            }]),
            ..ServiceSpec::default()
        }),
        ..Service::default()
    }
}
