//! Devices the cluster offers, read from Node facts the way GPU Feature
//! Discovery publishes them, or a CPU budget taken from the job itself.
//!
//! Labels read, as GPU Feature Discovery writes them (NVIDIA/k8s-device-plugin
//! `internal/lm/mig-strategy.go`, `internal/lm/resource.go` and their tests;
//! the GFD README's "MIG 'single' strategy" and "MIG 'mixed' strategy" tables):
//! * no MIG (`none`), or the `single` strategy: `nvidia.com/gpu.product`
//!   (single: the slice, e.g. `NVIDIA-A100-SXM4-40GB-MIG-1g.5gb`),
//!   `nvidia.com/gpu.memory` (MiB per device), `nvidia.com/gpu.count`; the
//!   device plugin advertises `nvidia.com/gpu`;
//! * the `mixed` strategy (`nvidia.com/mig.strategy=mixed`): per profile
//!   `nvidia.com/mig-<profile>.count|.memory|.product` (`.product` is
//!   `<GPU model>-MIG-<profile>`; GFD releases before the device plugin's
//!   labeller do not write it), advertised as `nvidia.com/mig-<profile>`. GFD
//!   still writes the `nvidia.com/gpu.*` labels of the MIG-enabled physical
//!   GPUs (with `nvidia.com/gpu.replicas=0`), but the device plugin does not
//!   advertise them: they are not devices a pod can get.
//!
//! So a device exists only where the node can allocate it: when the node
//! reports `status.allocatable`, counts come from there alone (labels without
//! an allocatable resource are phantoms). Labels give the counts only for node
//! descriptions without allocatable figures (e.g. a `--nodes` file), and then
//! `nvidia.com/gpu.replicas=0` marks GPUs GFD labelled but cannot be handed out
//! whole. [`device_placement`] gives the labels a pod selects to land where a
//! device type was counted.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::units::MIB;

pub const LABEL_GPU_PRODUCT: &str = "nvidia.com/gpu.product";
pub const LABEL_GPU_MEMORY_MIB: &str = "nvidia.com/gpu.memory";
pub const LABEL_GPU_COUNT: &str = "nvidia.com/gpu.count";
pub const LABEL_MIG_STRATEGY: &str = "nvidia.com/mig.strategy";
/// GFD writes `0` for MIG-enabled GPUs (not shareable, not allocatable whole).
pub const LABEL_GPU_REPLICAS: &str = "nvidia.com/gpu.replicas";
pub const RESOURCE_GPU: &str = "nvidia.com/gpu";
const MIG_PREFIX: &str = "nvidia.com/mig-";

/// What the planner needs to know about one node; the operator fills it from
/// a `Node` object and the pods bound to it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    /// Allocatable extended resources by name (device counts), e.g. `nvidia.com/gpu: 8`.
    pub allocatable: BTreeMap<String, u64>,
    /// Devices already requested by pods on this node, by resource name.
    pub in_use: BTreeMap<String, u64>,
    /// False for cordoned or NotReady nodes: their devices count as present, not free.
    pub schedulable: bool,
    /// Whether the node reported `status.allocatable` at all: then a device
    /// type missing from `allocatable` is not allocatable there, whatever its
    /// labels say. False for label-only descriptions (counts from labels).
    pub allocatable_reported: bool,
    /// Allocatable host memory (`status.allocatable.memory`), bytes; `None`
    /// when the node does not say (label-only descriptions).
    pub host_memory_bytes: Option<u64>,
}

#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum DeviceKind {
    Gpu,
    Cpu,
}

/// One kind of device and how many of it the cluster has.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceType {
    /// GPU product as GFD labels it (e.g. `NVIDIA-A100-SXM4-80GB`; MIG slices
    /// e.g. `NVIDIA-A100-SXM4-80GB-MIG-1g.10gb`, see [`device_placement`]), or `cpu`.
    pub name: String,
    pub kind: DeviceKind,
    /// Resource a pod requests one of per stage: `nvidia.com/gpu`, `nvidia.com/mig-1g.10gb`; `memory` for CPU.
    pub resource: String,
    /// Nominal memory of one device in bytes (for CPU: the per-worker memory limit).
    pub memory_bytes: u64,
    /// Devices on schedulable nodes not requested by any pod.
    pub free: u32,
    /// The most of those free devices on any one node: the ceiling on
    /// stages when every stage must share a node (see [`Inventory::on_one_node`]).
    pub free_on_one_node: u32,
    /// Devices in the cluster.
    pub total: u32,
    /// The most of them on any one node (free or not).
    pub total_on_one_node: u32,
    /// Allocatable host memory of the smallest node offering this type,
    /// bytes (`None`: no node said): a GPU worker's pod requests its
    /// host-side bytes (offloaded optimizer state, the checkpoint load) from
    /// it, so a plan whose pods a node cannot hold is not a fit there. Like
    /// `memory_bytes`, the smallest node decides.
    pub host_memory_bytes: Option<u64>,
}

impl DeviceType {
    /// How many a job could ever get at once: every device of the type, or
    /// one node's when its stages must share a node (`one_node`).
    pub fn reachable(&self, one_node: bool) -> u32 {
        if one_node {
            self.total_on_one_node
        } else {
            self.total
        }
    }
}

/// Device types sorted by memory (smallest first), then name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Inventory {
    pub devices: Vec<DeviceType>,
    /// Set by [`Inventory::on_one_node`]: `free` counts one node's devices.
    pub one_node: bool,
    /// GPU nodes left out because the job's pods may not be placed there,
    /// each with why (filled by the operator; quoted when nothing fits).
    pub left_out: Vec<String>,
}

impl Inventory {
    /// Aggregates nodes into device types. Nodes without GFD memory labels
    /// are skipped: a GPU of unknown size cannot be planned for.
    pub fn from_nodes<'a>(nodes: impl IntoIterator<Item = &'a NodeFacts>) -> Self {
        let mut by_key: BTreeMap<(String, String), DeviceType> = BTreeMap::new();
        for node in nodes {
            for found in node_devices(node) {
                let entry = by_key
                    .entry((found.resource.clone(), found.name.clone()))
                    .or_insert_with(|| DeviceType {
                        free: 0,
                        free_on_one_node: 0,
                        total: 0,
                        total_on_one_node: 0,
                        ..found.clone()
                    });
                // Heterogeneous memory under one product name: plan for the smallest.
                entry.memory_bytes = entry.memory_bytes.min(found.memory_bytes);
                entry.host_memory_bytes = match (entry.host_memory_bytes, found.host_memory_bytes) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
                entry.free += found.free;
                entry.free_on_one_node = entry.free_on_one_node.max(found.free);
                entry.total += found.total;
                entry.total_on_one_node = entry.total_on_one_node.max(found.total);
            }
        }
        let mut devices: Vec<DeviceType> = by_key.into_values().collect();
        devices.sort_by(|a, b| {
            a.memory_bytes
                .cmp(&b.memory_bytes)
                .then_with(|| a.name.cmp(&b.name))
        });
        Inventory {
            devices,
            one_node: false,
            left_out: vec![],
        }
    }

    /// A CPU job: every worker gets `memory_limit_bytes`, up to `max_workers` workers.
    pub fn cpu(memory_limit_bytes: u64, max_workers: u32) -> Self {
        Inventory {
            devices: vec![DeviceType {
                name: "cpu".into(),
                kind: DeviceKind::Cpu,
                resource: "memory".into(),
                memory_bytes: memory_limit_bytes,
                free: max_workers,
                free_on_one_node: max_workers,
                total: max_workers,
                total_on_one_node: max_workers,
                // A CPU worker's memory is its budget (`memory_bytes`).
                host_memory_bytes: None,
            }],
            one_node: false,
            left_out: vec![],
        }
    }

    /// The devices one job may use when all its stages must run on one node
    /// (the checkpoint volume is ReadWriteOnce): each type's free count
    /// becomes the most free on a single node, so the planner never picks
    /// more stages than a node can hold.
    pub fn on_one_node(mut self) -> Self {
        for device in &mut self.devices {
            device.free = device.free_on_one_node;
        }
        self.one_node = true;
        self
    }

    /// The same cluster with every device free (busy ones and those of
    /// cordoned nodes included): what a job could get by waiting.
    pub fn idle(&self) -> Self {
        let mut idle = self.clone();
        for d in &mut idle.devices {
            d.free = d.reachable(self.one_node);
            d.free_on_one_node = d.total_on_one_node;
        }
        idle
    }
}

fn label_u64(node: &NodeFacts, key: &str) -> Option<u64> {
    node.labels.get(key)?.trim().parse().ok()
}

fn count_of(node: &NodeFacts, resource: &str, label_count: Option<u64>) -> (u32, u32) {
    let allocatable = node.allocatable.get(resource).copied();
    let total = if node.allocatable_reported {
        allocatable.unwrap_or(0)
    } else {
        allocatable.or(label_count).unwrap_or(0)
    };
    let used = node.in_use.get(resource).copied().unwrap_or(0);
    let free = if node.schedulable {
        total.saturating_sub(used)
    } else {
        0
    };
    (clamp_u32(free), clamp_u32(total))
}

fn clamp_u32(x: u64) -> u32 {
    u32::try_from(x).unwrap_or(u32::MAX)
}

/// The device types one node contributes (full GPUs or MIG slices).
fn node_devices(node: &NodeFacts) -> Vec<DeviceType> {
    let mut out = Vec::new();
    let product = node
        .labels
        .get(LABEL_GPU_PRODUCT)
        .map(String::as_str)
        .filter(|p| !p.trim().is_empty());
    let mixed_mig = node
        .labels
        .get(LABEL_MIG_STRATEGY)
        .is_some_and(|s| s == "mixed");

    // Full GPUs, or MIG slices under the "single" strategy (GFD relabels product and memory).
    if let (Some(name), Some(mib)) = (product, label_u64(node, LABEL_GPU_MEMORY_MIB)) {
        // Counting from labels (no allocatable figures): GPUs GFD labels with
        // replicas 0 are MIG-enabled ones the device plugin does not hand out whole.
        let whole = node
            .labels
            .get(LABEL_GPU_REPLICAS)
            .is_none_or(|r| r.trim() != "0");
        let label_count = label_u64(node, LABEL_GPU_COUNT).filter(|_| whole);
        let (free, total) = count_of(node, RESOURCE_GPU, label_count);
        if total > 0 {
            out.push(DeviceType {
                name: name.to_string(),
                kind: DeviceKind::Gpu,
                resource: RESOURCE_GPU.into(),
                memory_bytes: mib * MIB,
                free,
                free_on_one_node: free,
                total,
                total_on_one_node: total,
                host_memory_bytes: node.host_memory_bytes,
            });
        }
    }

    if mixed_mig {
        for (key, value) in &node.labels {
            let Some(profile) = key
                .strip_prefix(MIG_PREFIX)
                .and_then(|k| k.strip_suffix(".memory"))
            else {
                continue;
            };
            let Ok(mib) = value.trim().parse::<u64>() else {
                continue;
            };
            // A slice no label names cannot be told from other GPUs' slices
            // of the same profile, nor selected by a pod.
            let Some(name) = mig_name(node, product, profile) else {
                continue;
            };
            let resource = format!("{MIG_PREFIX}{profile}");
            let (free, total) = count_of(
                node,
                &resource,
                label_u64(node, &format!("{resource}.count")),
            );
            if total > 0 {
                out.push(DeviceType {
                    name,
                    kind: DeviceKind::Gpu,
                    resource,
                    memory_bytes: mib * MIB,
                    free,
                    free_on_one_node: free,
                    total,
                    total_on_one_node: total,
                    host_memory_bytes: node.host_memory_bytes,
                });
            }
        }
    }
    out
}

/// A mixed-strategy MIG device's name: GFD's `nvidia.com/mig-<profile>.product`
/// (e.g. `NVIDIA-A100-SXM4-80GB-MIG-1g.10gb`); without it (GFD before the
/// device plugin's labeller), the GPU product plus `-MIG-<profile>`, never
/// doubling a `-MIG-…` suffix already there; `None` with neither label.
fn mig_name(node: &NodeFacts, product: Option<&str>, profile: &str) -> Option<String> {
    if let Some(name) = node
        .labels
        .get(&format!("{MIG_PREFIX}{profile}.product"))
        .filter(|n| !n.trim().is_empty())
    {
        return Some(name.clone());
    }
    let product = product?;
    let base = product.split_once("-MIG-").map_or(product, |(b, _)| b);
    Some(format!("{base}-MIG-{profile}"))
}

/// One condition on a node's labels.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LabelRequirement {
    /// The node has label `key` with value `value`.
    Equals { key: String, value: String },
    /// The node has no label `key`.
    Absent { key: String },
}

impl LabelRequirement {
    pub fn holds(&self, labels: &BTreeMap<String, String>) -> bool {
        match self {
            LabelRequirement::Equals { key, value } => labels.get(key) == Some(value),
            LabelRequirement::Absent { key } => !labels.contains_key(key),
        }
    }
}

/// Where a pod requesting one `resource` finds a device of type `device` (a
/// name [`Inventory::from_nodes`] gave): alternatives, any one of which a node
/// must meet in full (as Kubernetes ORs node-selector terms and ANDs the
/// requirements of one). The labels are those the name was read from:
/// * `nvidia.com/gpu` (full GPUs, single-strategy slices): `nvidia.com/gpu.product=<device>`;
/// * `nvidia.com/mig-<profile>` (mixed strategy): `nvidia.com/mig-<profile>.product=<device>`,
///   or, on nodes without that label (the name was built), none of it and
///   `nvidia.com/gpu.product=<device less -MIG-<profile>>`.
///
/// The resource request itself keeps the pod off nodes that do not advertise it.
pub fn device_placement(resource: &str, device: &str) -> Vec<Vec<LabelRequirement>> {
    let equals = |key: &str, value: &str| LabelRequirement::Equals {
        key: key.into(),
        value: value.into(),
    };
    let Some(profile) = resource.strip_prefix(MIG_PREFIX) else {
        return vec![vec![equals(LABEL_GPU_PRODUCT, device)]];
    };
    let product_label = format!("{resource}.product");
    let mut terms = vec![vec![equals(&product_label, device)]];
    if let Some(model) = device.strip_suffix(&format!("-MIG-{profile}")) {
        terms.push(vec![
            LabelRequirement::Absent { key: product_label },
            equals(LABEL_GPU_PRODUCT, model),
        ]);
    }
    terms
}

/// Whether a node with `labels` meets one of `placement`'s alternatives.
pub fn placement_admits(
    placement: &[Vec<LabelRequirement>],
    labels: &BTreeMap<String, String>,
) -> bool {
    placement
        .iter()
        .any(|term| term.iter().all(|r| r.holds(labels)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, labels: &[(&str, &str)], alloc: &[(&str, u64)]) -> NodeFacts {
        NodeFacts {
            name: name.into(),
            labels: labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            allocatable: alloc.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
            in_use: BTreeMap::new(),
            schedulable: true,
            allocatable_reported: !alloc.is_empty(),
            host_memory_bytes: None,
        }
    }

    #[test]
    fn aggregates_gfd_labels_and_allocatable() {
        let a100 = [
            (LABEL_GPU_PRODUCT, "NVIDIA-A100-SXM4-80GB"),
            (LABEL_GPU_MEMORY_MIB, "81920"),
            (LABEL_GPU_COUNT, "8"),
        ];
        let t4 = [
            (LABEL_GPU_PRODUCT, "Tesla-T4"),
            (LABEL_GPU_MEMORY_MIB, "15360"),
            (LABEL_GPU_COUNT, "4"),
        ];
        let mut busy = node("a2", &a100, &[(RESOURCE_GPU, 8)]);
        busy.in_use.insert(RESOURCE_GPU.into(), 3);
        let mut cordoned = node("t2", &t4, &[(RESOURCE_GPU, 4)]);
        cordoned.schedulable = false;
        let nodes = vec![
            node("a1", &a100, &[(RESOURCE_GPU, 8)]),
            busy,
            node("t1", &t4, &[]),
            cordoned,
            node("cpu", &[], &[]),
        ];
        let inv = Inventory::from_nodes(&nodes);
        assert_eq!(inv.devices.len(), 2);
        let t4 = &inv.devices[0];
        assert_eq!(
            (t4.name.as_str(), t4.free, t4.total, t4.memory_bytes),
            ("Tesla-T4", 4, 8, 15360 * MIB)
        );
        let a = &inv.devices[1];
        assert_eq!(
            (a.name.as_str(), a.free, a.total),
            ("NVIDIA-A100-SXM4-80GB", 13, 16)
        );

        // Stages confined to one node: 8 A100s free on a1 (5 on a2), 4 T4s on t1.
        let one = inv.on_one_node();
        let free: Vec<_> = one
            .devices
            .iter()
            .map(|d| (d.name.as_str(), d.free))
            .collect();
        assert_eq!(free, vec![("Tesla-T4", 4), ("NVIDIA-A100-SXM4-80GB", 8)]);
    }

    /// Label sets as GPU Feature Discovery writes them, with real product
    /// names and sizes. Sources: NVIDIA/k8s-device-plugin
    /// `internal/lm/mig-strategy_test.go` (none/single label sets; a
    /// MIG-enabled GPU's `nvidia.com/gpu.*` labels with `replicas: 0`),
    /// `internal/lm/resource.go` + `resource_test.go` (mixed: per profile
    /// `.count`, `.replicas`, `.memory`, `.product` = `<model>-MIG-<profile>`,
    /// `.multiprocessors`, `.slices.*`, `.engines.*`), the GFD README tables
    /// ("MIG 'single' strategy": `A100-SXM4-40GB-MIG-1g.5gb`, 56 devices of
    /// 5120 MiB on 8 GPUs), and the standalone NVIDIA/gpu-feature-discovery
    /// `cmd/gpu-feature-discovery/mig-strategy.go` (mixed without `.product`).
    mod gfd {
        /// `none`: eight A100-80GB, whole.
        pub const NONE_A100: &[(&str, &str)] = &[
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
            ("nvidia.com/gpu.count", "8"),
            ("nvidia.com/gpu.replicas", "1"),
            ("nvidia.com/gpu.memory", "81920"),
            ("nvidia.com/gpu.family", "ampere"),
            ("nvidia.com/gpu.compute.major", "8"),
            ("nvidia.com/gpu.compute.minor", "0"),
        ];
        /// `single`: 8 A100-40GB × 7 slices of 1g.5gb, advertised as `nvidia.com/gpu: 56`.
        pub const SINGLE_A100: &[(&str, &str)] = &[
            ("nvidia.com/mig.strategy", "single"),
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb"),
            ("nvidia.com/gpu.count", "56"),
            ("nvidia.com/gpu.replicas", "1"),
            ("nvidia.com/gpu.memory", "5120"),
            ("nvidia.com/gpu.multiprocessors", "14"),
            ("nvidia.com/gpu.slices.gi", "1"),
            ("nvidia.com/gpu.slices.ci", "1"),
            ("nvidia.com/gpu.engines.copy", "1"),
            ("nvidia.com/gpu.engines.decoder", "0"),
            ("nvidia.com/gpu.engines.encoder", "0"),
            ("nvidia.com/gpu.engines.jpeg", "0"),
            ("nvidia.com/gpu.engines.ofa", "0"),
        ];
        /// `mixed`: one A100-80GB cut into seven 1g.10gb slices, advertised
        /// as `nvidia.com/mig-1g.10gb: 7` (no `nvidia.com/gpu`).
        pub const MIXED_A100: &[(&str, &str)] = &[
            ("nvidia.com/mig.strategy", "mixed"),
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-80GB"),
            ("nvidia.com/gpu.count", "1"),
            ("nvidia.com/gpu.replicas", "0"),
            ("nvidia.com/gpu.memory", "81920"),
            (
                "nvidia.com/mig-1g.10gb.product",
                "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
            ),
            ("nvidia.com/mig-1g.10gb.count", "7"),
            ("nvidia.com/mig-1g.10gb.replicas", "1"),
            ("nvidia.com/mig-1g.10gb.memory", "9728"),
            ("nvidia.com/mig-1g.10gb.multiprocessors", "14"),
            ("nvidia.com/mig-1g.10gb.slices.gi", "1"),
            ("nvidia.com/mig-1g.10gb.slices.ci", "1"),
            ("nvidia.com/mig-1g.10gb.engines.copy", "1"),
            ("nvidia.com/mig-1g.10gb.engines.decoder", "0"),
            ("nvidia.com/mig-1g.10gb.engines.encoder", "0"),
            ("nvidia.com/mig-1g.10gb.engines.jpeg", "0"),
            ("nvidia.com/mig-1g.10gb.engines.ofa", "0"),
        ];
        /// `mixed` as the standalone GFD wrote it (no `.product`, no
        /// `.replicas`): one A100-40GB as 2 × 3g.20gb.
        pub const MIXED_A100_OLD_GFD: &[(&str, &str)] = &[
            ("nvidia.com/mig.strategy", "mixed"),
            ("nvidia.com/gpu.product", "NVIDIA-A100-SXM4-40GB"),
            ("nvidia.com/gpu.count", "1"),
            ("nvidia.com/gpu.memory", "40960"),
            ("nvidia.com/mig-3g.20gb.count", "2"),
            ("nvidia.com/mig-3g.20gb.memory", "19968"),
            ("nvidia.com/mig-3g.20gb.multiprocessors", "42"),
            ("nvidia.com/mig-3g.20gb.slices.gi", "3"),
            ("nvidia.com/mig-3g.20gb.slices.ci", "3"),
            ("nvidia.com/mig-3g.20gb.engines.copy", "3"),
        ];
    }

    /// A Node that reports allocatable (a real one always does: cpu, memory, pods).
    fn reported(name: &str, labels: &[(&str, &str)], alloc: &[(&str, u64)]) -> NodeFacts {
        let mut n = node(name, labels, alloc);
        n.allocatable_reported = true;
        n
    }

    fn summary(inv: &Inventory) -> Vec<(&str, &str, u32, u64)> {
        inv.devices
            .iter()
            .map(|d| {
                (
                    d.name.as_str(),
                    d.resource.as_str(),
                    d.total,
                    d.memory_bytes / MIB,
                )
            })
            .collect()
    }

    #[test]
    fn none_strategy_gpus_are_nvidia_gpu_devices_counted_from_allocatable() {
        // Allocatable wins over the label: one GPU is not handed out (e.g. unhealthy).
        let n = reported("none", gfd::NONE_A100, &[(RESOURCE_GPU, 7)]);
        assert_eq!(
            summary(&Inventory::from_nodes([&n])),
            [("NVIDIA-A100-SXM4-80GB", RESOURCE_GPU, 7, 81920)]
        );
    }

    #[test]
    fn single_strategy_slices_are_nvidia_gpu_devices() {
        let n = reported("single", gfd::SINGLE_A100, &[(RESOURCE_GPU, 56)]);
        assert_eq!(
            summary(&Inventory::from_nodes([&n])),
            [("NVIDIA-A100-SXM4-40GB-MIG-1g.5gb", RESOURCE_GPU, 56, 5120)]
        );
    }

    #[test]
    fn mixed_mig_nodes_offer_their_slices_and_no_phantom_gpu() {
        let n = reported("mixed", gfd::MIXED_A100, &[("nvidia.com/mig-1g.10gb", 7)]);
        assert_eq!(
            summary(&Inventory::from_nodes([&n])),
            [(
                "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
                "nvidia.com/mig-1g.10gb",
                7,
                9728
            )],
            "no full A100 that the device plugin does not advertise"
        );
    }

    #[test]
    fn a_label_only_mixed_node_offers_no_whole_gpu() {
        // A `--nodes` file without allocatable figures: counts from labels,
        // but GFD's replicas 0 says the labelled GPU is MIG-enabled.
        let n = node("mixed", gfd::MIXED_A100, &[]);
        assert!(!n.allocatable_reported);
        assert_eq!(
            summary(&Inventory::from_nodes([&n])),
            [(
                "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
                "nvidia.com/mig-1g.10gb",
                7,
                9728
            )]
        );
        // Whole GPUs in the same file still count from their labels.
        let whole = node("none", gfd::NONE_A100, &[]);
        assert_eq!(Inventory::from_nodes([&whole]).devices[0].total, 8);
    }

    #[test]
    fn mig_names_come_from_the_product_label_and_never_double_the_suffix() {
        // The .product label wins over anything built from the GPU product.
        let mut n = reported("mixed", gfd::MIXED_A100, &[("nvidia.com/mig-1g.10gb", 7)]);
        n.labels.insert(
            "nvidia.com/mig-1g.10gb.product".into(),
            "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED".into(),
        );
        assert_eq!(
            Inventory::from_nodes([&n]).devices[0].name,
            "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb-SHARED"
        );
        // Without it, built from a product label that already carries a MIG suffix.
        n.labels.remove("nvidia.com/mig-1g.10gb.product");
        n.labels.insert(
            LABEL_GPU_PRODUCT.into(),
            "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb".into(),
        );
        assert_eq!(
            Inventory::from_nodes([&n]).devices[0].name,
            "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
        );
        // Neither label: nothing names the slices, so they are not offered.
        n.labels.remove(LABEL_GPU_PRODUCT);
        assert!(Inventory::from_nodes([&n]).devices.is_empty());
    }

    #[test]
    fn a_labelled_gpu_the_node_cannot_allocate_is_not_there() {
        // GFD labels, but no device plugin (or it advertises nothing yet).
        let mut n = reported(
            "no-plugin",
            &[
                (LABEL_GPU_PRODUCT, "NVIDIA-L4"),
                (LABEL_GPU_MEMORY_MIB, "23034"),
                (LABEL_GPU_COUNT, "4"),
            ],
            &[],
        );
        assert!(Inventory::from_nodes([&n]).devices.is_empty());
        // A label-only description (no allocatable figures) counts from labels.
        n.allocatable_reported = false;
        assert_eq!(Inventory::from_nodes([&n]).devices[0].total, 4);
    }

    #[test]
    fn reads_mixed_mig_slices_labelled_without_a_product() {
        let mut labels = gfd::MIXED_A100_OLD_GFD.to_vec();
        labels.extend([
            ("nvidia.com/mig-1g.5gb.count", "1"),
            ("nvidia.com/mig-1g.5gb.memory", "4864"),
        ]);
        let n = reported(
            "mig",
            &labels,
            &[("nvidia.com/mig-1g.5gb", 1), ("nvidia.com/mig-3g.20gb", 2)],
        );
        assert_eq!(
            summary(&Inventory::from_nodes([&n])),
            [
                (
                    "NVIDIA-A100-SXM4-40GB-MIG-1g.5gb",
                    "nvidia.com/mig-1g.5gb",
                    1,
                    4864
                ),
                (
                    "NVIDIA-A100-SXM4-40GB-MIG-3g.20gb",
                    "nvidia.com/mig-3g.20gb",
                    2,
                    19968
                ),
            ]
        );
    }

    /// A pod placed by [`device_placement`] lands on the node each device
    /// type was counted on, and not on another product's node with the same
    /// slice profile (the resource name alone would allow it).
    #[test]
    fn every_device_type_is_placed_where_it_was_counted() {
        let nodes = [
            reported("none", gfd::NONE_A100, &[(RESOURCE_GPU, 8)]),
            reported("single", gfd::SINGLE_A100, &[(RESOURCE_GPU, 56)]),
            reported("mixed", gfd::MIXED_A100, &[("nvidia.com/mig-1g.10gb", 7)]),
            reported(
                "old",
                gfd::MIXED_A100_OLD_GFD,
                &[("nvidia.com/mig-3g.20gb", 2)],
            ),
        ];
        // The same labels on an H100 node: another device type.
        let renamed = |labels: &BTreeMap<String, String>| -> BTreeMap<String, String> {
            labels
                .iter()
                .map(|(k, v)| {
                    let v = v
                        .replace("NVIDIA-A100-SXM4-80GB", "NVIDIA-H100-80GB-HBM3")
                        .replace("NVIDIA-A100-SXM4-40GB", "NVIDIA-H100-80GB-HBM3");
                    (k.clone(), v)
                })
                .collect()
        };
        for n in &nodes {
            let devices = Inventory::from_nodes([n]).devices;
            assert_eq!(devices.len(), 1, "{}", n.name);
            let d = &devices[0];
            let placement = device_placement(&d.resource, &d.name);
            assert!(
                placement_admits(&placement, &n.labels),
                "{}: {placement:?}",
                n.name
            );
            let h100 = renamed(&n.labels);
            assert!(
                !placement_admits(&placement, &h100),
                "{}: {placement:?} admits {h100:?}",
                n.name
            );
        }
        assert_eq!(
            device_placement(
                "nvidia.com/mig-1g.10gb",
                "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
            ),
            [
                vec![LabelRequirement::Equals {
                    key: "nvidia.com/mig-1g.10gb.product".into(),
                    value: "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb".into()
                }],
                vec![
                    LabelRequirement::Absent {
                        key: "nvidia.com/mig-1g.10gb.product".into()
                    },
                    LabelRequirement::Equals {
                        key: LABEL_GPU_PRODUCT.into(),
                        value: "NVIDIA-A100-SXM4-80GB".into()
                    }
                ]
            ]
        );
    }
}
