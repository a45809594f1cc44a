//! Operator-wide settings (flags / Helm values) of the controller and of the
//! children it creates.

use std::time::Duration;

use headroom_api::{MemoryAwareTrainingJobSpec, SpecError};
use headroom_planner::Backend;

/// How long one job's planning may take before the job fails, so that a
/// job whose search would run long holds no reconcile worker for good.
/// The largest searches take 0.2–0.4 s in a debug build (70B parameters
/// over 1,000 nodes of six GPU types, up to 64 GPUs; 227 µs in release,
/// docs/benchmarks.md) and the operator plans at most 8 GPUs a job.
pub const DEFAULT_PLANNING_BUDGET: Duration = Duration::from_secs(5);

/// Controller settings (flags / Helm values).
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    pub children: ChildConfig,
    pub unschedulable_grace: Duration,
    /// How long one job's planning may take ([`DEFAULT_PLANNING_BUDGET`]).
    pub planning_budget: Duration,
    /// Re-check every job at least this often.
    pub resync: Duration,
    pub concurrency: u16,
    /// Watch only this namespace (all namespaces when None).
    pub namespace: Option<String>,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            children: ChildConfig::default(),
            unschedulable_grace: Duration::from_secs(120),
            planning_budget: DEFAULT_PLANNING_BUDGET,
            resync: Duration::from_secs(300),
            concurrency: 8,
            namespace: None,
        }
    }
}

/// Operator-wide settings that shape children (from flags / Helm values).
#[derive(Clone, Debug, PartialEq)]
pub struct ChildConfig {
    /// StorageClass of the checkpoint PVC (cluster default when None).
    pub checkpoint_storage_class: Option<String>,
    /// Size of the checkpoint PVC, e.g. `1Gi`.
    pub checkpoint_size: String,
    /// Access mode of the checkpoint PVC; with ReadWriteOnce every stage of
    /// a pipeline runs on one node, since they all write to it.
    pub checkpoint_access: CheckpointAccess,
    /// Host memory limit of GPU worker pods when the job does not set `resources.gpu.hostMemory`.
    pub gpu_host_memory: String,
    /// Images for jobs that name none (`spec.worker.image` unset), by backend.
    pub worker_images: WorkerImages,
    /// How often each worker writes its telemetry into the job's status.
    pub telemetry_interval: Duration,
    /// The URL workers reach the operator's worker API at
    /// ([`crate::worker_api`]); None: workers only log their telemetry and
    /// find pipeline peers by DNS.
    pub worker_api_url: Option<String>,
    /// The CA certificate (PEM) of an `https` worker API: workers trust
    /// only it for that API ([`headroom_api::WORKER_API_CA_ENV`]).
    pub worker_api_ca: Option<String>,
    /// The shared model cache (`model.pretrained.huggingFace.cache`).
    pub model_cache: ModelCacheConfig,
}

/// The shared model cache's settings (Helm `modelCache.*`).
#[derive(Clone, Debug, PartialEq)]
pub struct ModelCacheConfig {
    /// False: every job downloads its own copy, whatever its spec says.
    pub enabled: bool,
    /// Size of a cache claim when it is made (before the download's size is
    /// known; a claim whose class allows expansion is grown when the
    /// download does not fit), e.g. `20Gi`.
    pub size: String,
    /// StorageClass of cache claims (the checkpoint claims' when None); a
    /// ReadOnlyMany-capable class lets jobs on several nodes read one copy.
    pub storage_class: Option<String>,
    /// How long a cache claim no job uses is kept before it is deleted.
    pub idle: Duration,
}

impl Default for ModelCacheConfig {
    fn default() -> Self {
        ModelCacheConfig {
            enabled: true,
            size: "20Gi".into(),
            storage_class: None,
            idle: Duration::from_secs(24 * 3600),
        }
    }
}

impl Default for ChildConfig {
    fn default() -> Self {
        ChildConfig {
            checkpoint_storage_class: None,
            checkpoint_size: "1Gi".into(),
            checkpoint_access: CheckpointAccess::default(),
            gpu_host_memory: "16Gi".into(),
            worker_images: WorkerImages::default(),
            telemetry_interval: Duration::from_secs(10),
            worker_api_url: None,
            worker_api_ca: None,
            model_cache: ModelCacheConfig::default(),
        }
    }
}

impl ChildConfig {
    /// `gpu_host_memory` in bytes (checked when the operator starts; 0 if unreadable).
    pub fn gpu_host_memory_bytes(&self) -> u64 {
        headroom_api::quantity::parse_bytes(&self.gpu_host_memory).unwrap_or(0)
    }

    /// The default checkpoint claim size, bytes (`checkpoint_size`).
    pub fn checkpoint_size_bytes(&self) -> u64 {
        headroom_api::quantity::parse_bytes(&self.checkpoint_size).unwrap_or(0)
    }
}

/// The operator's worker images for jobs whose `spec.worker.image` is unset,
/// one per backend (`--worker-image`, `--cuda-worker-image`; Helm
/// `workerImages.cpu`, `workerImages.cuda`). Either may be absent: a job that
/// needs a missing one and names no image of its own fails with a spec error.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerImages {
    /// The CPU worker (burn's flex backend).
    pub flex: Option<String>,
    /// The CUDA worker (built with `--features cuda`).
    pub cuda: Option<String>,
}

impl WorkerImages {
    /// From the operator's flags, each checked with [`check_image_reference`];
    /// the error names the flag.
    pub fn from_flags(flex: Option<String>, cuda: Option<String>) -> Result<Self, String> {
        for (flag, image) in [("--worker-image", &flex), ("--cuda-worker-image", &cuda)] {
            if let Some(image) = image {
                check_image_reference(image).map_err(|e| {
                    format!("{flag} {image:?}: {e} (e.g. registry.example.com/headroom-worker:0.1)")
                })?;
            }
        }
        Ok(WorkerImages { flex, cuda })
    }

    /// The default image for `backend`, if the operator has one.
    pub fn for_backend(&self, backend: Backend) -> Option<&str> {
        match backend {
            Backend::Flex => self.flex.as_deref(),
            Backend::Cuda => self.cuda.as_deref(),
        }
    }

    /// The image a job's pods (workers and initializer) run: the job's own
    /// `spec.worker.image`, else this operator's default for the job's
    /// backend ([`MemoryAwareTrainingJobSpec::backend`]). Without either, a
    /// spec error on `worker.image` that says what would work.
    pub fn resolve(&self, spec: &MemoryAwareTrainingJobSpec) -> Result<String, SpecError> {
        if let Some(image) = &spec.worker.image {
            return Ok(image.clone());
        }
        let backend = spec.backend();
        self.for_backend(backend)
            .map(str::to_string)
            .ok_or_else(|| SpecError {
                field: "worker.image".into(),
                problem: format!(
                    "required: this operator has no default image for backend {backend} (install the chart with workerImages.{value}, which sets --{flag}, or set spec.worker.image)",
                    value = match backend {
                        Backend::Flex => "cpu",
                        Backend::Cuda => "cuda",
                    },
                    flag = match backend {
                        Backend::Flex => "worker-image",
                        Backend::Cuda => "cuda-worker-image",
                    },
                ),
            })
    }
}

/// Whether `image` can be an image reference (`[registry/]repository[:tag][@digest]`):
/// not empty, and no whitespace or control characters. The registry has
/// the last word on the rest.
pub fn check_image_reference(image: &str) -> Result<(), &'static str> {
    if image.is_empty() {
        return Err("an image reference cannot be empty");
    }
    if image.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err("an image reference has no whitespace or control characters");
    }
    Ok(())
}

/// Access mode of each job's checkpoint volume. All stages of a pipeline
/// write their parts of a step to the one volume, so a ReadWriteOnce volume
/// (one node attaches it) confines a job's stages to one node, and only a
/// ReadWriteMany one (NFS, CephFS, a cloud file store) lets them spread.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CheckpointAccess {
    #[default]
    #[value(name = "ReadWriteOnce")]
    ReadWriteOnce,
    #[value(name = "ReadWriteMany")]
    ReadWriteMany,
}

impl CheckpointAccess {
    pub fn as_str(self) -> &'static str {
        match self {
            CheckpointAccess::ReadWriteOnce => "ReadWriteOnce",
            CheckpointAccess::ReadWriteMany => "ReadWriteMany",
        }
    }

    /// Whether a job's stages must share a node.
    pub fn stages_share_a_node(self) -> bool {
        self == CheckpointAccess::ReadWriteOnce
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::controller::pods::tests::{both_images, job};

    fn gpu_job_without_image_or_backend() -> MemoryAwareTrainingJobSpec {
        let mut spec = job(include_str!(
            "../../../samples/gpu-finetune-llama-3.2-1b.yaml"
        ))
        .spec;
        spec.worker.image = None;
        spec.worker.backend = None;
        assert!(spec.resources.gpu.is_some(), "the premise: a GPU job");
        spec
    }

    fn cpu_job_without_image() -> MemoryAwareTrainingJobSpec {
        let mut spec = job(include_str!("../../../samples/cpu-tiny.yaml")).spec;
        spec.worker.image = None;
        spec
    }

    #[test]
    fn the_jobs_own_image_wins_over_any_default() {
        let spec = job(include_str!("../../../samples/cpu-tiny.yaml")).spec;
        for images in [WorkerImages::default(), both_images()] {
            assert_eq!(
                images.resolve(&spec).as_deref(),
                Ok("localhost/headroom-worker:dev")
            );
        }
    }

    #[test]
    fn a_cpu_job_without_an_image_gets_the_cpu_default() {
        assert_eq!(
            both_images().resolve(&cpu_job_without_image()).as_deref(),
            Ok("registry.example/headroom-worker:2")
        );
    }

    #[test]
    fn a_gpu_job_with_backend_unset_gets_the_cuda_default() {
        let spec = gpu_job_without_image_or_backend();
        assert_eq!(
            both_images().resolve(&spec).as_deref(),
            Ok("registry.example/headroom-worker-cuda:2")
        );
        // The CPU image would refuse a cuda plan: never a fallback.
        let cpu_only = WorkerImages {
            cuda: None,
            ..both_images()
        };
        let err = cpu_only.resolve(&spec).expect_err("no cuda default");
        assert_eq!(err.field, "worker.image");
        assert_eq!(
            err.to_string(),
            "spec.worker.image: required: this operator has no default image for backend cuda (install the chart with workerImages.cuda, which sets --cuda-worker-image, or set spec.worker.image)"
        );
    }

    #[test]
    fn a_missing_default_is_a_spec_error_naming_the_field_and_the_way_out() {
        let cuda_only = WorkerImages {
            flex: None,
            ..both_images()
        };
        let err = cuda_only
            .resolve(&cpu_job_without_image())
            .expect_err("no cpu default");
        assert_eq!(err.field, "worker.image");
        assert_eq!(
            err.to_string(),
            "spec.worker.image: required: this operator has no default image for backend flex (install the chart with workerImages.cpu, which sets --worker-image, or set spec.worker.image)"
        );
    }

    #[test]
    fn image_flags_are_checked_and_errors_name_the_flag() {
        assert_eq!(
            WorkerImages::from_flags(None, None),
            Ok(WorkerImages::default())
        );
        assert_eq!(
            WorkerImages::from_flags(
                Some("ghcr.io/acme/headroom-worker:0.1".into()),
                Some("registry:5000/headroom-worker-cuda@sha256:abc".into())
            ),
            Ok(WorkerImages {
                flex: Some("ghcr.io/acme/headroom-worker:0.1".into()),
                cuda: Some("registry:5000/headroom-worker-cuda@sha256:abc".into()),
            })
        );
        let empty = WorkerImages::from_flags(Some(String::new()), None).expect_err("empty");
        assert!(
            empty.starts_with("--worker-image \"\": an image reference cannot be empty"),
            "{empty}"
        );
        let spaced = WorkerImages::from_flags(None, Some("headroom-worker-cuda 0.1".into()))
            .expect_err("whitespace");
        assert!(
            spaced.starts_with("--cuda-worker-image \"headroom-worker-cuda 0.1\": an image reference has no whitespace"),
            "{spaced}"
        );
        assert!(check_image_reference("a\tb").is_err());
        assert!(check_image_reference("headroom-worker").is_ok());
    }
}
