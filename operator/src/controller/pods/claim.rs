//! The job's checkpoint claim: one volume for all its attempts, and what
//! lets it outlive the job.

use std::collections::BTreeMap;

use headroom_api::{
    ANNOTATION_JOB_UID, ClaimRetention, LABEL_RETAINED_FROM, MemoryAwareTrainingJob,
    MemoryAwareTrainingJobStatus,
};
use headroom_planner::disk::quantity;
use headroom_planner::{DataOnClaim, DiskInputs, Plan};
use k8s_openapi::api::core::v1::{
    PersistentVolumeClaim, PersistentVolumeClaimSpec, VolumeResourceRequirements,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::ResourceExt;

use super::names::checkpoint_claim_name;
use super::skeleton::{Component, job_labels, meta};
use crate::controller::config::ChildConfig;

/// Where a job's files are, as the planner's disk count needs it: a hub
/// model and hub data are downloaded onto the checkpoint claim (the model's
/// size once the initializer has measured it), and a pretrained model's
/// output goes there unless `spec.output` names another claim.
pub fn disk_inputs(
    job: &MemoryAwareTrainingJob,
    status: &MemoryAwareTrainingJobStatus,
) -> DiskInputs {
    let pretrained = job.spec.model.pretrained.as_ref();
    DiskInputs {
        // A model in the shared cache is on the cache's claim, not this one.
        model_on_claim: pretrained.is_some_and(|p| p.hugging_face.is_some())
            && status.model_cache.is_none(),
        model_file_bytes: status.model.as_ref().map(|m| m.bytes),
        // The initializer reports the data's tokens, not its files' bytes.
        data: match (
            job.spec.data.as_ref().and_then(|d| d.hugging_face.as_ref()),
            &status.data,
        ) {
            (None, _) => DataOnClaim::None,
            (Some(_), Some(read)) => DataOnClaim::Tokens(read.tokens),
            (Some(_), None) => DataOnClaim::Unknown,
        },
        output_on_claim: pretrained.is_some() && job.spec.output.is_none(),
    }
}

/// The size the job's claim is made with, bytes and as a quantity:
/// `spec.checkpoints.size`, else what `plan` keeps on it (its
/// [`headroom_planner::DiskBreakdown::claim_bytes`]) when that is more than
/// the operator's default (`checkpoint_size`), else the default.
/// `plan`: `None` for a claim made before the job is planned (a pretrained
/// model's initializer downloads into it).
pub fn claim_size(
    job: &MemoryAwareTrainingJob,
    config: &ChildConfig,
    plan: Option<&Plan>,
) -> String {
    if let Some(size) = &job.spec.checkpoints.size {
        return size.clone();
    }
    let default = config.checkpoint_size_bytes();
    match plan.and_then(|p| p.disk.as_ref()) {
        Some(disk) if disk.claim_bytes > default => quantity(disk.claim_bytes),
        _ => config.checkpoint_size.clone(),
    }
}

/// One volume for all attempts, so a retry resumes from the last checkpoint,
/// of [`claim_size`]. Annotated with the job's uid (a kept claim outlives
/// its job); owned by the job (deleted with it) unless
/// `spec.checkpoints.retention` is `Retain`. `RetainOnSuccess` claims are
/// released when the job succeeds ([`release_claim_patch`]).
pub fn checkpoint_claim(
    job: &MemoryAwareTrainingJob,
    config: &ChildConfig,
    plan: Option<&Plan>,
) -> PersistentVolumeClaim {
    let mut metadata = meta(
        job,
        checkpoint_claim_name(job),
        job_labels(job, Component::Worker),
    );
    metadata.annotations = Some(
        [(
            ANNOTATION_JOB_UID.to_string(),
            job.uid().unwrap_or_default(),
        )]
        .into_iter()
        .collect(),
    );
    if job.spec.checkpoints.retention == ClaimRetention::Retain {
        metadata.owner_references = None;
        release_labels(job, &mut metadata);
    }
    PersistentVolumeClaim {
        metadata,
        spec: Some(PersistentVolumeClaimSpec {
            access_modes: Some(vec![config.checkpoint_access.as_str().into()]),
            storage_class_name: config.checkpoint_storage_class.clone(),
            resources: Some(VolumeResourceRequirements {
                requests: Some(
                    [(
                        "storage".to_string(),
                        Quantity(claim_size(job, config, plan)),
                    )]
                    .into_iter()
                    .collect(),
                ),
                ..VolumeResourceRequirements::default()
            }),
            ..PersistentVolumeClaimSpec::default()
        }),
        ..PersistentVolumeClaim::default()
    }
}

fn release_labels(job: &MemoryAwareTrainingJob, metadata: &mut ObjectMeta) {
    metadata
        .labels
        .get_or_insert_with(BTreeMap::new)
        .insert(LABEL_RETAINED_FROM.into(), job.name_any());
}

/// The merge patch that lets a claim outlive its job: no owner (garbage
/// collection leaves it), labelled with the job's name for finding it.
pub fn release_claim_patch(job: &MemoryAwareTrainingJob) -> serde_json::Value {
    serde_json::json!({
        "metadata": {
            "ownerReferences": null,
            "labels": {LABEL_RETAINED_FROM: job.name_any()},
        }
    })
}

/// Whether an existing claim holds this job's checkpoints (and not those of
/// an earlier job of the same name, kept after it ended).
/// `claim`: the claim or its metadata (the claim cache holds only that).
pub fn claim_belongs_to(claim: &impl ResourceExt, job: &MemoryAwareTrainingJob) -> bool {
    let Some(uid) = job.uid() else {
        return true;
    };
    let annotated = claim
        .annotations()
        .get(ANNOTATION_JOB_UID)
        .map(|u| *u == uid);
    let owned = claim.owner_references().iter().any(|o| o.uid == uid);
    // Claims made before the annotation existed are recognised by their owner.
    annotated.unwrap_or(owned)
}
