//! Where a job's files are inside its pods (pure): the job's checkpoint
//! claim, and for a fine-tuning job the claims its spec names.
//!
//! Every pod of a job mounts the job's checkpoint claim at the contract's
//! checkpoint directory ([`job_volumes`]). A `model.pretrained` job reads a
//! checkpoint and a data file and writes a fine-tuned model. Every claim the
//! spec names is mounted once, at `/var/lib/headroom/claims/<claim>`
//! (read-only unless the output goes there), so the same claim can hold the
//! model, the data and the output ([`claim_mounts`]). A checkpoint from the
//! Hugging Face hub is downloaded into the job's own checkpoint claim
//! (`model/`), which outlives attempts, so retries never download it again;
//! the output defaults to `output/` on that claim, which is kept when the
//! job succeeds.
//!
//! The initializer pod fetches and checks what the job names before
//! anything is planned; the worker pods get the same mounts and the paths in
//! their assignment ([`payload_files`]).

use std::collections::BTreeMap;

use headroom_api::{
    DEFAULT_CHECKPOINT_DIR, DataFormat, DataSplit, HubDataFiles, HubModel, HuggingFaceDataFile,
    MemoryAwareTrainingJob, PayloadFiles, TextFormat, VolumePath,
};
use k8s_openapi::api::core::v1::{PersistentVolumeClaimVolumeSource, Volume, VolumeMount};

use super::names::checkpoint_claim_name;

/// Where the claims a job names are mounted.
const CLAIMS_DIR: &str = "/var/lib/headroom/claims";

/// The in-pod path of a file or directory on a claim.
fn claim_path(v: &VolumePath) -> String {
    let path = v.path.trim_matches('/');
    if path.is_empty() {
        format!("{CLAIMS_DIR}/{}", v.claim_name)
    } else {
        format!("{CLAIMS_DIR}/{}/{path}", v.claim_name)
    }
}

/// The files of a `model.pretrained` job as its pods see them; `None` for
/// any other job.
pub(super) fn payload_files(job: &MemoryAwareTrainingJob) -> Option<PayloadFiles> {
    let spec = &job.spec;
    let pretrained = spec.model.pretrained.as_ref()?;
    let data = spec.data.as_ref()?;
    let model_dir = match (&pretrained.volume, model_cache_path(job)) {
        (Some(v), _) => claim_path(v),
        (None, Some(cache)) => claim_path(&cache),
        (None, None) => format!("{DEFAULT_CHECKPOINT_DIR}/model"),
    };
    let output_dir = match &spec.output {
        Some(o) => claim_path(&o.volume),
        None => format!("{DEFAULT_CHECKPOINT_DIR}/output"),
    };
    let (data_file, data_split) = match (&data.volume, &data.hugging_face) {
        (Some(v), _) => (claim_path(v), None),
        // Downloaded by the initializer into the job's checkpoint volume,
        // where every attempt's workers read it.
        (None, Some(hf)) => match hub_data_files(hf) {
            HubDataFiles::File(file) => (format!("{}/{file}", hub_data_dir()), None),
            HubDataFiles::Split(split) => (hub_data_dir(), Some(split)),
        },
        (None, None) => return None,
    };
    Some(PayloadFiles {
        model_dir,
        data_file,
        data_format: match data.format {
            TextFormat::Jsonl => DataFormat::Jsonl {
                field: data.field.clone(),
            },
            TextFormat::Text => DataFormat::Text,
            TextFormat::Parquet => DataFormat::Parquet {
                field: data.field.clone(),
            },
        },
        train_on: data.train_on,
        data_split,
        packing: data.packing,
        output_dir,
        hub_model: pretrained.hugging_face.as_ref().map(|hf| HubModel {
            repo: hf.repo.clone(),
            revision: hf.revision.clone(),
        }),
    })
}

/// The shared model cache claim's checkpoint, when the job reads it
/// (`status.modelCache`, which the decision sets before the first
/// initializer).
pub(super) fn model_cache_path(job: &MemoryAwareTrainingJob) -> Option<VolumePath> {
    let claim = job.status.as_ref()?.model_cache.as_ref()?;
    Some(VolumePath {
        claim_name: claim.clone(),
        path: super::model_cache::CACHE_MODEL_PATH.into(),
    })
}

/// Where the initializer downloads a hub dataset's files, keeping their
/// paths in the repository.
pub(super) fn hub_data_dir() -> String {
    format!("{DEFAULT_CHECKPOINT_DIR}/data")
}

/// The files of a hub dataset the job reads: `file` (a path or a glob), or
/// `split` (default `train`) of `subset`.
pub(super) fn hub_data_files(hf: &HuggingFaceDataFile) -> HubDataFiles {
    match &hf.file {
        Some(file) => HubDataFiles::File(file.clone()),
        None => HubDataFiles::Split(DataSplit {
            subset: hf.subset.clone(),
            split: hf.split.clone().unwrap_or_else(|| "train".into()),
        }),
    }
}

/// Where the output is, for the status: `<claim>:<path>`.
pub fn output_location(job: &MemoryAwareTrainingJob) -> Option<String> {
    job.spec.model.pretrained.as_ref()?;
    Some(match &job.spec.output {
        Some(o) => format!("{}:{}", o.volume.claim_name, o.volume.path),
        None => format!("{}:output", checkpoint_claim_name(job)),
    })
}

/// The user's claims a job's pods mount (besides the job's checkpoint
/// claim): each once, writable only if the output goes there.
pub(super) fn claim_mounts(job: &MemoryAwareTrainingJob) -> (Vec<Volume>, Vec<VolumeMount>) {
    let spec = &job.spec;
    let mut claims: BTreeMap<String, bool> = BTreeMap::new(); // name → writable
    let mut add = |v: &VolumePath, writable: bool| {
        *claims.entry(v.claim_name.clone()).or_insert(false) |= writable;
    };
    if let Some(v) = spec
        .model
        .pretrained
        .as_ref()
        .and_then(|p| p.volume.as_ref())
    {
        add(v, false);
    }
    // Read-only for the workers; the initializer that fills it makes its
    // mount writable (`initializer_pod`).
    if let Some(v) = model_cache_path(job) {
        add(&v, false);
    }
    if let Some(v) = spec.data.as_ref().and_then(|d| d.volume.as_ref()) {
        add(v, false);
    }
    if let Some(o) = &spec.output {
        add(&o.volume, true);
    }
    claims.remove(&checkpoint_claim_name(job)); // already mounted, writable
    claims
        .into_iter()
        .enumerate()
        .map(|(i, (claim, writable))| {
            let name = format!("claim-{i}");
            (
                Volume {
                    name: name.clone(),
                    persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                        claim_name: claim.clone(),
                        read_only: Some(!writable),
                    }),
                    ..Volume::default()
                },
                VolumeMount {
                    name,
                    mount_path: format!("{CLAIMS_DIR}/{claim}"),
                    read_only: Some(!writable),
                    ..VolumeMount::default()
                },
            )
        })
        .unzip()
}

/// The volumes every pod of a job mounts: the job's checkpoint claim at the
/// contract's checkpoint directory and a scratch `/tmp` (the root is
/// read-only), then the user's claims ([`claim_mounts`]).
pub(super) fn job_volumes(job: &MemoryAwareTrainingJob) -> (Vec<Volume>, Vec<VolumeMount>) {
    let (mut volumes, mut mounts) = (
        vec![
            Volume {
                name: "checkpoints".into(),
                persistent_volume_claim: Some(PersistentVolumeClaimVolumeSource {
                    claim_name: checkpoint_claim_name(job),
                    ..PersistentVolumeClaimVolumeSource::default()
                }),
                ..Volume::default()
            },
            Volume {
                name: "tmp".into(),
                empty_dir: Some(Default::default()),
                ..Volume::default()
            },
        ],
        vec![
            VolumeMount {
                name: "checkpoints".into(),
                mount_path: DEFAULT_CHECKPOINT_DIR.into(),
                ..VolumeMount::default()
            },
            VolumeMount {
                name: "tmp".into(),
                mount_path: "/tmp".into(),
                ..VolumeMount::default()
            },
        ],
    );
    let (claim_volumes, claim_mounts) = claim_mounts(job);
    volumes.extend(claim_volumes);
    mounts.extend(claim_mounts);
    (volumes, mounts)
}

#[cfg(test)]
mod tests {
    use super::super::tests::job;
    use super::*;

    fn finetune(yaml_extra: &str) -> MemoryAwareTrainingJob {
        let base = include_str!("../../../../samples/cpu-finetune-tiny-llama.yaml");
        job(&format!("{base}{yaml_extra}"))
    }

    #[test]
    fn files_are_on_the_named_claims_and_only_the_output_claim_is_writable() {
        let j = finetune("  output:\n    volume: {claimName: models, path: tuned/tiny}\n");
        let files = payload_files(&j).expect("a fine-tuning job");
        assert_eq!(
            files.model_dir,
            "/var/lib/headroom/claims/models/tiny-llama"
        );
        assert_eq!(
            files.data_file,
            "/var/lib/headroom/claims/datasets/declaration-of-independence.jsonl"
        );
        assert_eq!(
            files.output_dir,
            "/var/lib/headroom/claims/models/tuned/tiny"
        );
        assert_eq!(
            files.hub_model, None,
            "a model from a volume names its directory"
        );
        let (volumes, mounts) = claim_mounts(&j);
        assert_eq!(volumes.len(), 2, "each claim once");
        let writable: Vec<_> = mounts
            .iter()
            .map(|m| (m.mount_path.as_str(), m.read_only))
            .collect();
        assert_eq!(
            writable,
            vec![
                ("/var/lib/headroom/claims/datasets", Some(true)),
                ("/var/lib/headroom/claims/models", Some(false)),
            ]
        );
        // No output named: the job's own claim, kept on success.
        let j = finetune("");
        assert_eq!(
            payload_files(&j).expect("files").output_dir,
            format!("{DEFAULT_CHECKPOINT_DIR}/output")
        );
        assert_eq!(
            output_location(&j).as_deref(),
            Some("finetune-tiny-llama-checkpoints:output")
        );
    }
    /// The names and mount paths a user's volumes must keep clear of
    /// (`headroom_api::RESERVED_*`, which the CEL rules list) cover every
    /// volume and mount the operator gives a pod: the checkpoint claim,
    /// scratch, the user's data and output claims, the worker-API token.
    #[test]
    fn the_reserved_names_and_paths_cover_the_operators_volumes() {
        use headroom_api::{RESERVED_MOUNT_PATHS, RESERVED_VOLUME_NAMES, RESERVED_VOLUME_PREFIXES};
        let job = finetune("  output:\n    volume: {claimName: models, path: tuned/tiny}\n");
        let (mut volumes, mut mounts) = job_volumes(&job);
        let config = crate::controller::config::ChildConfig {
            worker_api_url: Some("http://10.96.0.20:8081".into()),
            ..Default::default()
        };
        let (_, api_volumes, api_mounts) = super::super::skeleton::worker_api_access(&config);
        volumes.extend(api_volumes);
        mounts.extend(api_mounts);
        assert!(volumes.len() >= 4, "claims and the token too: {volumes:?}");
        for v in &volumes {
            assert!(
                RESERVED_VOLUME_NAMES.contains(&v.name.as_str())
                    || RESERVED_VOLUME_PREFIXES
                        .iter()
                        .any(|p| v.name.starts_with(p)),
                "{} is not reserved",
                v.name
            );
        }
        for m in &mounts {
            assert!(
                RESERVED_MOUNT_PATHS
                    .iter()
                    .any(|r| m.mount_path == *r || m.mount_path.starts_with(&format!("{r}/"))),
                "{} is not reserved",
                m.mount_path
            );
        }
    }
}
