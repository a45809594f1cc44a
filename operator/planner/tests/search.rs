//! Plan search behaviour on realistic inventories.

mod common;
use common::*;
use headroom_planner::units::format_bytes;
use headroom_planner::*;

#[test]
fn small_model_fits_one_small_gpu_without_checkpointing() {
    let inv = Inventory::from_nodes(&six_type_cluster(12));
    let mut job = gpu_job(transformer(12, 768, 12, 1024, 50257), 32, 8);
    job.objective = Objective::FewestGpus;
    let plan = plan(&job, &inv).expect("fits");
    assert_eq!(plan.workers, 1);
    assert!(plan.fits());
    assert_eq!(plan.global_batch, 32);
    assert_eq!(plan.stages.len(), 1);
    assert_eq!(
        (plan.stages[0].layer_start, plan.stages[0].layer_end),
        (0, 12)
    );
}

#[test]
fn model_70b_needs_a_pipeline_and_every_stage_fits() {
    let inv = Inventory::from_nodes(&six_type_cluster(1000));
    let mut job = gpu_job(model_70b(), 1024, 64);
    job.objective = Objective::FewestGpus;
    let plan = plan(&job, &inv).expect("a 70B plan exists");
    let params = model_70b().total_params();
    assert!((69e9..71e9).contains(&(params as f64)), "{params}");
    // The CUDA worker's bf16 weights, gradients and AdamW moments, 8
    // bytes/param, need > 560 GB: more than 7 80-GB GPUs.
    assert!(plan.workers >= 8, "{} workers", plan.workers);
    assert!(plan.device.contains("80GB"), "{}", plan.device);
    for stage in &plan.stages {
        assert!(
            stage.memory.total <= plan.budget_bytes,
            "stage {} {}",
            stage.index,
            format_bytes(stage.memory.total)
        );
    }
    let layers: u32 = plan
        .stages
        .iter()
        .map(|s| s.layer_end - s.layer_start)
        .sum();
    assert_eq!(layers, 86);
    // Stages are contiguous.
    for pair in plan.stages.windows(2) {
        assert_eq!(pair[0].layer_end, pair[1].layer_start);
    }
    // One fewer stage must not fit on any allowed type (cheapest in GPUs).
    let mut fewer = gpu_job(model_70b(), 1024, plan.workers - 1);
    fewer.allowed_rungs.clear();
    fewer.objective = Objective::FewestGpus;
    assert!(headroom_planner::plan(&fewer, &inv).is_err());
}

#[test]
fn first_stage_holds_the_most_in_flight_micro_batches() {
    let inv = Inventory::from_nodes(&six_type_cluster(1000));
    let plan = plan(&gpu_job(model_70b(), 1024, 64), &inv).expect("fits");
    let p = plan.stage_count();
    assert_eq!(
        plan.stages[0].in_flight_micro_batches,
        p.min(plan.settings.gradient_accumulation)
    );
    assert_eq!(
        plan.stages.last().map(|s| s.in_flight_micro_batches),
        Some(1)
    );
}

#[test]
fn allowed_types_are_respected() {
    let inv = Inventory::from_nodes(&six_type_cluster(12));
    let mut job = gpu_job(transformer(24, 2048, 16, 2048, 50257), 64, 8);
    if let Target::Gpu { allowed_types, .. } = &mut job.target {
        *allowed_types = vec!["NVIDIA-A100-SXM4-40GB".into()];
    }
    let plan = plan(&job, &inv).expect("fits");
    assert_eq!(plan.device, "NVIDIA-A100-SXM4-40GB");
}

#[test]
fn nothing_fits_explains_with_numbers() {
    let inv = Inventory::from_nodes(&six_type_cluster(6)); // 6 nodes: one of each type, 8 GPUs each
    // With its gradients and state in host memory (nodes without a known
    // size) 70B fits 4 A100s; this job keeps them on the devices.
    let mut job = gpu_job(model_70b(), 1024, 4);
    job.allowed_rungs
        .retain(|r| *r != RetryRung::OffloadGradients);
    let err = plan(&job, &inv).expect_err("70B cannot fit 4 GPUs");
    let text = err.to_string();
    assert!(text.contains("no feasible plan"), "{text}");
    assert!(text.contains("GiB"), "{text}");
    assert!(text.contains("NVIDIA-A100-SXM4-80GB"), "{text}");
    assert_eq!(err.details.len(), 6, "{text}");
}

#[test]
fn unknown_gpu_type_is_explained() {
    let inv = Inventory::from_nodes(&six_type_cluster(6));
    let mut job = gpu_job(transformer(2, 64, 2, 16, 100), 4, 1);
    job.target = Target::Gpu {
        allowed_types: vec!["NVIDIA-B200".into()],
        max_gpus: 1,
        host_baseline_bytes: None,
    };
    let err = plan(&job, &inv).expect_err("no such type");
    assert!(err.summary.contains("NVIDIA-B200"), "{err}");
}

#[test]
fn cpu_job_uses_its_memory_limit_and_splits_when_needed() {
    let model = transformer(8, 512, 8, 256, 8000);
    let small_limit = 512 * 1024 * 1024;
    let one = plan(
        &cpu_job(model.clone(), 16, 4 * GI, 1),
        &Inventory::default(),
    )
    .expect("fits 4 GiB");
    assert_eq!((one.device.as_str(), one.workers), ("cpu", 1));
    assert_eq!(one.budget_bytes, (4.0 * GI as f64 * 0.9) as u64);
    let split = plan(&cpu_job(model, 16, small_limit, 4), &Inventory::default());
    match split {
        Ok(p) => assert!(p.workers > 1 && p.fits(), "{p:?}"),
        Err(e) => panic!("expected a split plan: {e}"),
    }
}

#[test]
fn pinned_settings_are_kept_with_a_warning_when_over_budget() {
    let model = transformer(4, 256, 4, 256, 1000);
    let mut job = cpu_job(model, 64, 256 * 1024 * 1024, 1);
    job.pinned_micro_batch = Some(64);
    job.pinned_checkpointing = Some(false);
    let plan = plan(&job, &Inventory::default()).expect("pinned plan is returned");
    assert_eq!(plan.settings.micro_batch, 64);
    assert!(!plan.settings.activation_checkpointing);
    assert!(!plan.fits());
    assert!(
        plan.warnings.iter().any(|w| w.contains("pinned")),
        "{:?}",
        plan.warnings
    );
}

#[test]
fn unsupported_precision_on_cpu_is_a_clear_error() {
    let mut job = cpu_job(transformer(2, 64, 2, 16, 100), 4, GI, 1);
    job.precision = Precision::Bf16;
    let err = plan(&job, &Inventory::default()).expect_err("flex is fp32-only");
    assert!(
        err.summary.contains("bf16") && err.summary.contains("fp32"),
        "{err}"
    );
}

#[test]
fn lower_precision_is_used_only_when_allowed_and_needed() {
    // Size a GPU between the leanest fp32 and the leanest bf16 peaks of one model.
    let model = transformer(12, 768, 12, 4096, 50257);
    let lean_peak = |precision: Precision| {
        let huge = Inventory::from_nodes(&[gpu_node("big", "Huge", 1 << 30, 1)]);
        let mut job = gpu_job(model.clone(), 8, 1);
        job.precision = precision;
        job.pinned_micro_batch = Some(1);
        job.pinned_checkpointing = Some(true);
        plan(&job, &huge)
            .expect("fits a huge GPU")
            .predicted_peak_bytes
    };
    let (fp32, bf16) = (lean_peak(Precision::Fp32), lean_peak(Precision::Bf16));
    assert!(bf16 < fp32, "bf16 {bf16} fp32 {fp32}");
    // budget = memory × 0.99 × 0.9 must land between the two peaks.
    let mib = ((bf16 + fp32) / 2) as f64 / (0.99 * 0.9) / (1 << 20) as f64;
    let inv = Inventory::from_nodes(&[gpu_node("mid", "Mid-GPU", mib as u64, 1)]);
    let mut job = gpu_job(model, 8, 1);
    job.precision = Precision::Fp32;
    job.allowed_rungs = vec![];
    assert!(plan(&job, &inv).is_err(), "fp32 must not fit");
    job.allowed_rungs = vec![RetryRung::LowerPrecision];
    let p = plan(&job, &inv).expect("bf16 fits");
    assert_eq!(p.settings.precision, Precision::Bf16);
    assert_eq!(p.rungs_applied, vec![RetryRung::LowerPrecision]);
    assert!(
        p.warnings
            .iter()
            .any(|w| w.contains("nothing fits at fp32")),
        "{:?}",
        p.warnings
    );
}

/// Busy is not impossible: a job that needs 4 A100s on a cluster of 8 where
/// 6 are held by other pods gets no plan now, but learns it waits for
/// capacity; one that needs more than the cluster has never gets that.
#[test]
fn waiting_for_capacity_is_told_from_never_fitting() {
    let model = transformer(48, 5632, 44, 2048, 32000); // ~18B: several 80-GB GPUs
    let mut busy = gpu_node("a100", "NVIDIA-A100-SXM4-80GB", 81920, 8);
    busy.in_use.insert("nvidia.com/gpu".into(), 6);
    let inv = Inventory::from_nodes([&busy]);
    // Offloaded optimizer state (or gradients) would fit it on 2 (see
    // `offload_needs_nodes_with_the_host_memory_for_it`); this job does not allow it.
    let mut job = gpu_job(model.clone(), 64, 8);
    job.allowed_rungs
        .retain(|r| *r != RetryRung::OffloadOptimizer && *r != RetryRung::OffloadGradients);
    let need = plan(
        &job,
        &Inventory::from_nodes([&gpu_node("idle", "NVIDIA-A100-SXM4-80GB", 81920, 8)]),
    )
    .expect("fits an idle node");
    assert!(
        need.workers > 2,
        "the test needs more GPUs than are free: {}",
        need.workers
    );

    let err = plan(&job, &inv).expect_err("only 2 free");
    let waits = err.waits_for.expect("fits once the busy GPUs are free");
    assert!(
        waits.contains("NVIDIA-A100-SXM4-80GB") && waits.contains("2 free of 8"),
        "{waits}"
    );

    // A cluster with too few such GPUs in all: no waiting helps.
    let small = Inventory::from_nodes([&gpu_node("small", "NVIDIA-A100-SXM4-80GB", 81920, 2)]);
    let never = plan(&job, &small).expect_err("2 GPUs are too few");
    assert_eq!(never.waits_for, None, "{never}");
}

/// The same 18B job with offload allowed: 2 A100s hold it with the
/// optimizer state in host memory — on nodes that can hold that state.
#[test]
fn offload_needs_nodes_with_the_host_memory_for_it() {
    let model = transformer(48, 5632, 44, 2048, 32000);
    let mut job = gpu_job(model, 64, 8);
    job.target = Target::Gpu {
        allowed_types: vec![],
        max_gpus: 8,
        host_baseline_bytes: Some(16 << 30),
    };
    let node = |host_gib: u64| {
        let mut n = gpu_node("a100", "NVIDIA-A100-SXM4-80GB", 81920, 2);
        n.host_memory_bytes = Some(host_gib << 30);
        Inventory::from_nodes([&n])
    };
    let big = plan(&job, &node(1024)).expect("2 GPUs with the state on the host");
    assert_eq!(big.workers, 2);
    assert!(big.settings.offload_optimizer, "{big:?}");
    let host = big
        .stages
        .iter()
        .map(|s| s.memory.host_bytes)
        .max()
        .expect("stages");
    assert!(
        host > 96 << 30,
        "fp32 moments and master weights of ~9B parameters: {host}"
    );

    // 96 GiB: 8-bit moments make the state fit.
    let mid = plan(&job, &node(96)).expect("8-bit state on the host");
    assert!(mid.settings.offload_optimizer, "{mid:?}");
    assert_eq!(mid.settings.optimizer, Optimizer::Adamw8bit, "{mid:?}");

    let err = plan(&job, &node(48)).expect_err("48 GiB of host memory holds no stage's state");
    let detail = err.details.join("\n");
    assert!(
        detail.contains("of host memory each") && detail.contains("allocates 48.0 GiB"),
        "{err}"
    );
}
