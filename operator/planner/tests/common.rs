//! Shared fixtures for the planner's integration tests and benchmark.
#![allow(dead_code)]

use std::collections::BTreeMap;

use headroom_planner::inventory::{
    LABEL_GPU_COUNT, LABEL_GPU_MEMORY_MIB, LABEL_GPU_PRODUCT, RESOURCE_GPU,
};
use headroom_planner::units::GIB;
use headroom_planner::*;

pub fn transformer(layers: u32, hidden: u32, heads: u32, seq: u32, vocab: u32) -> ModelShape {
    ModelShape::Transformer(TransformerShape {
        layers,
        hidden,
        heads,
        sequence_length: seq,
        vocabulary: vocab,
        feed_forward: None,
        tied_embeddings: true,
    })
}

pub fn gpu_job(model: ModelShape, global_batch: u32, max_gpus: u32) -> JobRequest {
    JobRequest {
        model,
        global_batch,
        precision: Precision::Bf16,
        optimizer: Optimizer::Adamw,
        pinned_micro_batch: None,
        pinned_checkpointing: None,
        pinned_stages: None,
        pinned_replicas: None,
        objective: Default::default(),
        target: Target::Gpu {
            allowed_types: vec![],
            max_gpus,
            host_baseline_bytes: None,
        },
        headroom_fraction: 0.1,
        allowed_rungs: RetryRung::DEFAULT.to_vec(),
        adapters: None,
        base_format: headroom_planner::BaseFormat::Dense,
    }
}

pub fn cpu_job(
    model: ModelShape,
    global_batch: u32,
    limit_bytes: u64,
    max_workers: u32,
) -> JobRequest {
    JobRequest {
        precision: Precision::Fp32,
        target: Target::Cpu {
            memory_limit_bytes: limit_bytes,
            max_workers,
        },
        ..gpu_job(model, global_batch, 1)
    }
}

pub fn gpu_node(name: &str, product: &str, memory_mib: u64, count: u64) -> NodeFacts {
    let labels: BTreeMap<String, String> = [
        (LABEL_GPU_PRODUCT, product.to_string()),
        (LABEL_GPU_MEMORY_MIB, memory_mib.to_string()),
        (LABEL_GPU_COUNT, count.to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    NodeFacts {
        name: name.into(),
        labels,
        allocatable: [(RESOURCE_GPU.to_string(), count)].into_iter().collect(),
        in_use: BTreeMap::new(),
        schedulable: true,
        allocatable_reported: true,
        host_memory_bytes: None,
    }
}

/// Six GPU types, `n` nodes round-robin over them, 8 GPUs each.
pub fn six_type_cluster(n: usize) -> Vec<NodeFacts> {
    const TYPES: [(&str, u64); 6] = [
        ("Tesla-T4", 15360),
        ("NVIDIA-L4", 23034),
        ("NVIDIA-A10G", 23028),
        ("NVIDIA-A100-SXM4-40GB", 40960),
        ("NVIDIA-A100-SXM4-80GB", 81920),
        ("NVIDIA-H100-80GB-HBM3", 81559),
    ];
    (0..n)
        .map(|i| {
            let (product, mib) = TYPES[i % TYPES.len()];
            gpu_node(&format!("node-{i}"), product, mib, 8)
        })
        .collect()
}

/// A GPT-style model of about 70e9 parameters (h = 8192, 86 blocks).
pub fn model_70b() -> ModelShape {
    transformer(86, 8192, 64, 4096, 32000)
}

pub const GI: u64 = GIB;
