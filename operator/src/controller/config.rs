//! Operator-wide settings (flags / Helm values) of the controller and of the
//! children it creates.

use std::time::Duration;

/// Controller settings (flags / Helm values).
#[derive(Clone, Debug)]
pub struct ControllerConfig {
    pub children: ChildConfig,
    pub unschedulable_grace: Duration,
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
}

impl Default for ChildConfig {
    fn default() -> Self {
        ChildConfig {
            checkpoint_storage_class: None,
            checkpoint_size: "1Gi".into(),
            checkpoint_access: CheckpointAccess::default(),
            gpu_host_memory: "16Gi".into(),
        }
    }
}

impl ChildConfig {
    /// `gpu_host_memory` in bytes (checked when the operator starts; 0 if unreadable).
    pub fn gpu_host_memory_bytes(&self) -> u64 {
        headroom_api::quantity::parse_bytes(&self.gpu_host_memory).unwrap_or(0)
    }
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
