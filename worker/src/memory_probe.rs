//! Memory sampling: the container's cgroup, the process, the backend
//! allocator and (with the `cuda` feature) NVIDIA GPUs through NVML.
//!
//! Every source is optional and degrades to `None`: outside a container there
//! may be no memory cgroup of our own, flex has no pooled allocator, a CPU
//! node has no NVML. What a sample cannot read it leaves out rather than
//! guessing.
//!
//! `peak_bytes` (what the operator compares with the plan's prediction) is the
//! peak of the memory the plan budgets. On the CPU (flex: the device is the
//! host) that is the highest of the process high-water mark (VmHWM: the
//! planner's model is of the process) and the allocator's reserved bytes. On
//! a GPU ([`MemoryProbe::device_peak`]) it is the highest of the allocator's
//! reserved bytes and NVML's used bytes (which also count the CUDA context);
//! the process's host memory is reported beside it but budgeted separately
//! (the pod's host memory limit), so a large host-side checkpoint load does
//! not read as a GPU peak. GPU figures are sampled, not a hardware
//! high-water mark: cubecl's pool keeps the pages it reserved, so the
//! reserved bytes a sample sees after a step include that step's transient
//! peak. The cgroup figures are reported beside it; they also count page
//! cache and other processes in the container, which the planner does not
//! model.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use headroom_api::{GpuMemory, MemorySample};

/// Where a cgroup's memory counters live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CgroupFiles {
    /// 1 or 2.
    pub version: u8,
    /// v2 `memory.current` / v1 `memory.usage_in_bytes`.
    pub current: PathBuf,
    /// v2 `memory.peak` (kernel ≥ 5.19) / v1 `memory.max_usage_in_bytes`.
    pub peak: PathBuf,
}

impl CgroupFiles {
    /// This process's memory cgroup, under `/sys/fs/cgroup`.
    pub fn of_this_process() -> Option<CgroupFiles> {
        let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        CgroupFiles::detect(&text, Path::new("/sys/fs/cgroup"))
    }

    /// Finds this process's memory cgroup from `/proc/self/cgroup` text and a
    /// cgroup filesystem root (normally `/sys/fs/cgroup`). Tries v2 (unified,
    /// also mounted at `unified/` in hybrid setups), then v1; first the
    /// namespaced root (a container with its own cgroup namespace sees its
    /// cgroup at the root), then the path `/proc/self/cgroup` names.
    pub fn detect(proc_self_cgroup: &str, root: &Path) -> Option<CgroupFiles> {
        let mut v2_path = None;
        let mut v1_path = None;
        for line in proc_self_cgroup.lines() {
            let mut parts = line.splitn(3, ':');
            let (Some(id), Some(controllers), Some(path)) =
                (parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            if id == "0" && controllers.is_empty() {
                v2_path = Some(path.trim_start_matches('/').to_string());
            } else if controllers.split(',').any(|c| c == "memory") {
                v1_path = Some(path.trim_start_matches('/').to_string());
            }
        }
        let v2 = |base: PathBuf| {
            let current = base.join("memory.current");
            current.is_file().then(|| CgroupFiles {
                version: 2,
                peak: base.join("memory.peak"),
                current,
            })
        };
        let v1 = |base: PathBuf| {
            let current = base.join("memory.usage_in_bytes");
            current.is_file().then(|| CgroupFiles {
                version: 1,
                peak: base.join("memory.max_usage_in_bytes"),
                current,
            })
        };
        if let Some(p) = &v2_path {
            for base in [root.join(p), root.join("unified").join(p)] {
                if let Some(found) = v2(base) {
                    return Some(found);
                }
            }
        }
        if let Some(p) = &v1_path {
            // The named path first: a v1 root is the whole machine's counter.
            for base in [root.join("memory").join(p), root.join("memory")] {
                if let Some(found) = v1(base) {
                    return Some(found);
                }
            }
        }
        None
    }
}

/// Resident and high-water bytes from `/proc/self/status` text.
pub fn parse_proc_status(text: &str) -> (Option<u64>, Option<u64>) {
    let field = |name: &str| {
        text.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.trim();
            let kib: u64 = rest.strip_suffix("kB")?.trim().parse().ok()?;
            Some(kib * 1024)
        })
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The process's current and peak resident bytes (Linux).
pub fn process_memory() -> (Option<u64>, Option<u64>) {
    std::fs::read_to_string("/proc/self/status")
        .map(|t| parse_proc_status(&t))
        .unwrap_or((None, None))
}

/// A GPU `CUDA_VISIBLE_DEVICES` names: an index or a `GPU-…`/`MIG-…` UUID.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum VisibleGpu {
    Index(u32),
    Uuid(String),
}

/// The GPUs a `CUDA_VISIBLE_DEVICES` value lets this process use, in its
/// order; `None` when unset (every GPU NVML sees: a pod sees only its own).
/// As CUDA does, the list ends at the first entry that is neither an index
/// nor a UUID, so an empty or invalid value leaves no GPU. NVML numbers
/// GPUs in PCI bus order; CUDA does so with `CUDA_DEVICE_ORDER=PCI_BUS_ID`,
/// which whoever sets indices here must set too (gpu-check's 2-GPU rows do).
pub fn visible_gpus(value: Option<&str>) -> Option<Vec<VisibleGpu>> {
    let value = value?;
    let mut out = Vec::new();
    for entry in value.split(',').map(str::trim) {
        if let Ok(index) = entry.parse::<u32>() {
            out.push(VisibleGpu::Index(index));
        } else if entry.starts_with("GPU-") || entry.starts_with("MIG-") {
            out.push(VisibleGpu::Uuid(entry.to_string()));
        } else {
            break;
        }
    }
    Some(out)
}

/// Samples memory from every source this worker has.
pub struct MemoryProbe {
    cgroup: Option<CgroupFiles>,
    proc_status: PathBuf,
    /// Device whose allocator to ask (`None`: skip).
    device: Option<Device>,
    #[cfg(feature = "cuda")]
    nvml: Option<nvml_wrapper::Nvml>,
    /// The GPUs NVML reports for this process (`CUDA_VISIBLE_DEVICES`):
    /// on a machine with several, the others are not this worker's.
    #[cfg(feature = "cuda")]
    visible: Option<Vec<VisibleGpu>>,
    /// Whether the budgeted memory is the GPU's rather than the process's.
    device_peak: bool,
    peak: u64,
    cgroup_peak_seen: u64,
}

impl std::fmt::Debug for MemoryProbe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemoryProbe")
            .field("cgroup", &self.cgroup)
            .field("proc_status", &self.proc_status)
            .field("peak", &self.peak)
            .finish_non_exhaustive()
    }
}

impl MemoryProbe {
    /// Probes this process: its cgroup under `/sys/fs/cgroup`, `/proc/self/status`,
    /// `device`'s allocator and, with the `cuda` feature, NVML.
    pub fn for_this_process(device: Option<Device>) -> Self {
        MemoryProbe::new(
            CgroupFiles::of_this_process(),
            PathBuf::from("/proc/self/status"),
            device,
        )
    }

    pub fn new(cgroup: Option<CgroupFiles>, proc_status: PathBuf, device: Option<Device>) -> Self {
        MemoryProbe {
            cgroup,
            proc_status,
            device,
            #[cfg(feature = "cuda")]
            nvml: match nvml_wrapper::Nvml::init() {
                Ok(nvml) => Some(nvml),
                Err(e) => {
                    tracing::info!("NVML unavailable ({e}); GPU memory will not be reported");
                    None
                }
            },
            #[cfg(feature = "cuda")]
            visible: visible_gpus(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref()),
            device_peak: false,
            peak: 0,
            cgroup_peak_seen: 0,
        }
    }

    /// The peak this probe keeps is the GPU's (allocator reserved, NVML
    /// used), not the process's: for a worker whose plan budgets GPU memory.
    pub fn device_peak(mut self) -> Self {
        self.device_peak = true;
        self
    }

    pub fn cgroup(&self) -> Option<&CgroupFiles> {
        self.cgroup.as_ref()
    }

    /// Highest `peak_bytes` of any sample so far.
    pub fn peak(&self) -> u64 {
        self.peak
    }

    /// One sample of every source.
    pub fn sample(&mut self) -> MemorySample {
        let (rss, hwm) = std::fs::read_to_string(&self.proc_status)
            .map(|t| parse_proc_status(&t))
            .unwrap_or((None, None));
        let (cgroup_current, cgroup_peak) = match &self.cgroup {
            Some(files) => {
                let current = read_u64(&files.current);
                if let Some(c) = current {
                    self.cgroup_peak_seen = self.cgroup_peak_seen.max(c);
                }
                // Kernels before 5.19 have no memory.peak: fall back to the highest sample.
                let peak = read_u64(&files.peak)
                    .or((self.cgroup_peak_seen > 0).then_some(self.cgroup_peak_seen));
                (current, peak)
            }
            None => (None, None),
        };
        let pool = self.device.as_ref().and_then(|d| d.memory_pool_usage());
        let gpus = self.gpus();
        let gpu_used = gpus.iter().map(|g| g.used_bytes).max();
        let host = if self.device_peak { None } else { hwm.or(rss) };
        let now = [host, pool.as_ref().map(|p| p.bytes_reserved), gpu_used]
            .into_iter()
            .flatten()
            .max()
            .unwrap_or(0);
        self.peak = self.peak.max(now);
        MemorySample {
            cgroup_current_bytes: cgroup_current,
            cgroup_peak_bytes: cgroup_peak,
            process_rss_bytes: rss,
            allocator_in_use_bytes: pool.as_ref().map(|p| p.bytes_in_use),
            allocator_reserved_bytes: pool.as_ref().map(|p| p.bytes_reserved),
            gpus,
            peak_bytes: self.peak,
        }
    }

    #[cfg(feature = "cuda")]
    fn gpus(&self) -> Vec<GpuMemory> {
        let Some(nvml) = &self.nvml else {
            return vec![];
        };
        let devices: Vec<_> = match &self.visible {
            None => (0..nvml.device_count().unwrap_or(0))
                .filter_map(|i| nvml.device_by_index(i).ok())
                .collect(),
            Some(visible) => visible
                .iter()
                .filter_map(|g| match g {
                    VisibleGpu::Index(i) => nvml.device_by_index(*i).ok(),
                    VisibleGpu::Uuid(u) => nvml.device_by_uuid(u.as_str()).ok(),
                })
                .collect(),
        };
        devices
            .iter()
            .filter_map(|device| {
                let info = device.memory_info().ok()?;
                Some(GpuMemory {
                    index: device.index().ok()?,
                    used_bytes: info.used,
                    total_bytes: info.total,
                })
            })
            .collect()
    }

    #[cfg(not(feature = "cuda"))]
    fn gpus(&self) -> Vec<GpuMemory> {
        vec![]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_visible_devices_names_the_gpus_cuda_would_use() {
        use VisibleGpu::{Index, Uuid};
        assert_eq!(visible_gpus(None), None);
        assert_eq!(visible_gpus(Some("1")), Some(vec![Index(1)]));
        assert_eq!(
            visible_gpus(Some("2, GPU-8d3f0c1e-aaaa-bbbb-cccc-0123456789ab")),
            Some(vec![
                Index(2),
                Uuid("GPU-8d3f0c1e-aaaa-bbbb-cccc-0123456789ab".into())
            ])
        );
        // CUDA stops at the first invalid entry; none valid, no GPU.
        assert_eq!(visible_gpus(Some("0,x,1")), Some(vec![Index(0)]));
        assert_eq!(visible_gpus(Some("")), Some(vec![]));
        assert_eq!(visible_gpus(Some("-1")), Some(vec![]));
    }

    fn fake_root(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("headroom-cgroup-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("tmp");
        dir
    }

    #[test]
    fn cgroup_v2_namespaced_root() {
        let root = fake_root("v2");
        std::fs::write(root.join("memory.current"), "1048576\n").expect("write");
        std::fs::write(root.join("memory.peak"), "2097152\n").expect("write");
        let found = CgroupFiles::detect("0::/\n", &root).expect("v2");
        assert_eq!(found.version, 2);
        let mut probe = MemoryProbe::new(Some(found), root.join("no-status"), None);
        let s = probe.sample();
        assert_eq!(s.cgroup_current_bytes, Some(1 << 20));
        assert_eq!(s.cgroup_peak_bytes, Some(2 << 20));
        assert_eq!(s.process_rss_bytes, None);
    }

    #[test]
    fn cgroup_v2_without_memory_peak_tracks_the_highest_sample() {
        let root = fake_root("v2-old-kernel");
        let dir = root.join("kubepods/pod1/c1");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("memory.current"), "300").expect("write");
        let found = CgroupFiles::detect("0::/kubepods/pod1/c1\n", &root).expect("v2");
        let mut probe = MemoryProbe::new(Some(found), root.join("none"), None);
        assert_eq!(probe.sample().cgroup_peak_bytes, Some(300));
        std::fs::write(dir.join("memory.current"), "100").expect("write");
        let s = probe.sample();
        assert_eq!(
            (s.cgroup_current_bytes, s.cgroup_peak_bytes),
            (Some(100), Some(300))
        );
    }

    #[test]
    fn cgroup_v1_named_path_then_root() {
        let root = fake_root("v1");
        let dir = root.join("memory/kubepods/burstable/pod9");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("memory.usage_in_bytes"), "4096").expect("write");
        std::fs::write(dir.join("memory.max_usage_in_bytes"), "8192").expect("write");
        let text = "12:pids:/x\n4:memory:/kubepods/burstable/pod9\n0::/\n";
        let found = CgroupFiles::detect(text, &root).expect("v1");
        assert_eq!(found.version, 1);
        assert!(found.current.ends_with("pod9/memory.usage_in_bytes"));
        let mut probe = MemoryProbe::new(Some(found), root.join("none"), None);
        let s = probe.sample();
        assert_eq!(
            (s.cgroup_current_bytes, s.cgroup_peak_bytes),
            (Some(4096), Some(8192))
        );
        assert!(CgroupFiles::detect("0::/\n", &fake_root("none")).is_none());
    }

    #[test]
    fn proc_status_fields_in_bytes() {
        let text = "Name:\tworker\nVmPeak:\t  999 kB\nVmHWM:\t    2048 kB\nVmRSS:\t    1024 kB\n";
        assert_eq!(
            parse_proc_status(text),
            (Some(1024 * 1024), Some(2048 * 1024))
        );
        assert_eq!(parse_proc_status("garbage"), (None, None));
    }

    #[test]
    fn a_device_peak_leaves_the_process_memory_out() {
        let mut host = MemoryProbe::for_this_process(None);
        let mut device = MemoryProbe::for_this_process(None).device_peak();
        let (h, d) = (host.sample(), device.sample());
        assert!(h.peak_bytes > 0, "the host probe keeps VmHWM");
        assert!(
            d.process_rss_bytes.unwrap_or(0) > 0,
            "RSS is still reported"
        );
        // No allocator and (here) no GPU: nothing on the device to peak.
        if d.gpus.is_empty() {
            assert_eq!(d.peak_bytes, 0);
        }
    }

    #[test]
    fn this_process_reports_rss_and_a_monotone_peak() {
        let mut probe = MemoryProbe::for_this_process(Some(Device::flex()));
        let a = probe.sample();
        assert!(a.process_rss_bytes.unwrap_or(0) > 0);
        assert_eq!(
            a.allocator_in_use_bytes, None,
            "flex has no pooled allocator"
        );
        let b = probe.sample();
        assert!(b.peak_bytes >= a.peak_bytes && a.peak_bytes > 0);
    }
}
