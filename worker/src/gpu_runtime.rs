//! The GPU runtime's settings, applied before the device opens: cubecl's
//! allocator and persistent memory as the plan recorded them (the memory
//! model counted for them), its autotune level, and where it keeps what it
//! learns.
//!
//! **Why the worker sets them.** cubecl reads `cubecl.toml` from the
//! working directory, or takes its defaults, the first time a device asks
//! for its configuration. A pod has no such file, and a plan's prediction
//! holds only for the allocator settings the planner assumed
//! ([`headroom_planner::GpuRuntime`], recorded in `status.plan.gpuRuntime`),
//! so the worker installs them itself, once per process, before
//! [`crate::train::training_device`] opens the GPU. cubecl's debug switches
//! from the environment (`CUBECL_DEBUG_LOG`, `CUBECL_DEBUG_OPTION`) still
//! apply; the plan's settings override the rest.
//!
//! **Why a cache on the checkpoint volume.** Before its first step a
//! worker compiles every kernel it meets (with `fusion`, many) and, with
//! `autotune`, times the candidates of each new shape: on an H200 that made
//! a small GPT's first step take 40-85 s and a 110M Llama's more than
//! 90 s, in every process (docs/gpu.md). cubecl keeps the compiled kernels
//! and the tuning results in an "environment" database (burn's
//! `persistence` feature, on in the `cuda` and `wgpu` builds), by default
//! under the working directory's Cargo target or the user's cache: inside
//! a pod, a read-only root or an `emptyDir` that dies with the attempt. The
//! worker puts it on the job's checkpoint claim instead, one directory per
//! pipeline slot (a database has one writer; replicas may share a
//! ReadWriteMany claim) and one environment per GPU product, so a retry, a
//! resumed job or a re-planned split on the same GPU type starts with its
//! kernels compiled and tuned.

use std::path::{Path, PathBuf};

use headroom_planner::{Backend, GpuRuntime};

/// The directory, under the checkpoint directory, that holds cubecl's
/// environments (autotune results and compiled kernels).
pub const CACHE_DIR: &str = "gpu-runtime";

/// What the worker applies: the plan's settings and where cubecl keeps its
/// environment.
#[derive(Clone, Debug, PartialEq)]
pub struct RuntimeSettings {
    pub runtime: GpuRuntime,
    /// The environment's directory ([`cache_dir`]); `None` leaves cubecl's
    /// default (a benchmark in a scratch directory).
    pub cache: Option<PathBuf>,
    /// The environment's name: the GPU product the plan chose, since tuned
    /// kernels are only good for the card they were timed on.
    pub environment: String,
}

impl RuntimeSettings {
    /// The settings of a plan that runs on `backend` (`None` on the CPU): the
    /// plan's own, or for a plan made before they were recorded, the ones the
    /// backend's profile chooses today.
    pub fn for_plan(
        backend: Backend,
        recorded: Option<GpuRuntime>,
        device: &str,
        cache: Option<PathBuf>,
    ) -> Option<Self> {
        let runtime = recorded.or(backend.profile().gpu_runtime)?;
        Some(RuntimeSettings {
            runtime,
            cache,
            environment: device.to_string(),
        })
    }
}

/// Where slot (`stage`, `replica`) keeps cubecl's environment under the
/// job's checkpoint directory.
pub fn cache_dir(checkpoint_dir: &Path, stage: u32, replica: u32) -> PathBuf {
    checkpoint_dir
        .join(CACHE_DIR)
        .join(format!("stage-{stage}-replica-{replica}"))
}

/// Installs `settings` as cubecl's configuration for this process. Must run
/// before the first GPU device opens; `Err` when something already read or
/// set the configuration (the process then runs with that one). A cache
/// directory that cannot be made is a warning: cubecl then keeps its
/// environment where it would have anyway.
#[cfg(any(feature = "cuda", feature = "wgpu"))]
pub fn install(settings: &RuntimeSettings) -> Result<(), String> {
    use burn::cubecl::config::autotune::AutotuneLevel as Level;
    use burn::cubecl::config::cache::CacheConfig;
    use burn::cubecl::config::memory::{CudaAllocator, PersistentMemory as Persistent};
    use burn::cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    use headroom_planner::backend::{AutotuneLevel, GpuAllocator, PersistentMemory};

    let mut config = CubeClRuntimeConfig::default().override_from_env();
    let r = &settings.runtime;
    // Read by the CUDA runtime only; wgpu's pools take their pages from
    // wgpu buffers whatever it says.
    config.memory.cuda.allocator = match r.allocator {
        GpuAllocator::Sync => CudaAllocator::Sync,
        GpuAllocator::Async => CudaAllocator::Async,
    };
    config.memory.persistent_memory = match r.persistent_memory {
        PersistentMemory::Enabled => Persistent::Enabled,
        PersistentMemory::SizeMatch => Persistent::SizeMatch,
        PersistentMemory::Disabled => Persistent::Disabled,
    };
    config.autotune.level = match r.autotune {
        AutotuneLevel::Minimal => Level::Minimal,
        AutotuneLevel::Balanced => Level::Balanced,
        AutotuneLevel::Extensive => Level::Extensive,
        AutotuneLevel::Full => Level::Full,
    };
    config.environment.name.clone_from(&settings.environment);
    if let Some(dir) = &settings.cache {
        // Without it the job still runs, tuning again on a retry.
        match std::fs::create_dir_all(dir) {
            Ok(()) => {
                config.environment.path = CacheConfig::Directory(dir.clone());
                // Off by default in cubecl: without it only the tuning
                // results persist, and compiling is most of a cold start.
                config.compilation.cache = true;
            }
            Err(e) => tracing::warn!(
                "cannot create the GPU runtime cache {}: {e}; autotune results and compiled \
                 kernels will not outlive this process",
                dir.display()
            ),
        }
    }
    if CubeClRuntimeConfig::try_set(config) {
        Ok(())
    } else {
        Err("cubecl's configuration was already read or set in this process".into())
    }
}

/// Without a cubecl runtime (the `cuda` or `wgpu` feature) there is no GPU
/// runtime to configure.
#[cfg(not(any(feature = "cuda", feature = "wgpu")))]
pub fn install(settings: &RuntimeSettings) -> Result<(), String> {
    let _ = settings;
    Err("this worker binary was built without the `cuda` or `wgpu` feature".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use headroom_planner::backend::{AutotuneLevel, GpuAllocator, PersistentMemory};

    #[test]
    fn cpu_plans_configure_nothing() {
        assert_eq!(
            RuntimeSettings::for_plan(Backend::Flex, None, "cpu", None),
            None
        );
    }

    #[test]
    fn a_plan_without_recorded_settings_gets_the_profiles() {
        let s = RuntimeSettings::for_plan(Backend::Cuda, None, "NVIDIA-H100-80GB-HBM3", None)
            .expect("a CUDA plan has GPU runtime settings");
        assert_eq!(Some(s.runtime), Backend::Cuda.profile().gpu_runtime);
        assert_eq!(s.environment, "NVIDIA-H100-80GB-HBM3");
    }

    #[test]
    fn the_plans_recorded_settings_win() {
        let recorded = GpuRuntime {
            allocator: GpuAllocator::Async,
            persistent_memory: PersistentMemory::SizeMatch,
            autotune: AutotuneLevel::Minimal,
        };
        let s = RuntimeSettings::for_plan(Backend::Cuda, Some(recorded), "A100", None)
            .expect("a CUDA plan");
        assert_eq!(s.runtime, recorded);
    }

    #[test]
    fn each_slot_has_its_own_cache_on_the_checkpoint_volume() {
        let a = cache_dir(Path::new("/checkpoints"), 0, 1);
        assert_eq!(a, Path::new("/checkpoints/gpu-runtime/stage-0-replica-1"));
        assert_ne!(a, cache_dir(Path::new("/checkpoints"), 1, 0));
    }
}
