//! The retry ladder after out-of-memory failures.

mod common;
use common::*;
use headroom_planner::*;

fn first_cpu_plan() -> (JobRequest, Plan) {
    let mut job = cpu_job(transformer(6, 512, 8, 256, 8000), 32, 2 * GI, 3);
    job.pinned_micro_batch = Some(32);
    job.pinned_checkpointing = Some(false);
    let plan = plan(&job, &Inventory::default()).expect("pinned plan");
    (job, plan)
}

#[test]
fn host_oom_climbs_to_a_stricter_plan_that_keeps_the_global_batch() {
    let (job, failed) = first_cpu_plan();
    let failure = MemoryFailure {
        kind: MemoryFailureKind::HostOom,
        observed_peak_bytes: Some(2 * GI),
        trained: false,
    };
    let next = next_stricter_plan(&job, &Inventory::default(), &failed, &failure)
        .expect("a stricter plan");
    assert_eq!(next.global_batch, failed.global_batch);
    assert!(next.fits());
    assert!(!next.rungs_applied.is_empty());
    assert_eq!(next.rungs_applied[0], RetryRung::ActivationCheckpointing);
    assert!(next.settings.activation_checkpointing);
    assert!(next.correction_factor >= 1.0);
}

/// The corrected factor makes the failed stage's estimated terms explain
/// what the failure proved: counted + factor × estimated = the proven peak.
#[test]
fn correction_puts_the_over_run_on_the_estimated_terms() {
    let (_, failed) = first_cpu_plan();
    let m = failed
        .stages
        .iter()
        .map(|s| s.memory)
        .max_by_key(|m| m.total)
        .expect("a stage");
    let counted = (m.training_total() - m.estimated()) as f64;
    let explains = |f: f64| counted + f * m.estimated() as f64;
    let observed = failed.predicted_peak_bytes * 3;
    let f = ladder::corrected_factor(
        &failed,
        &MemoryFailure {
            kind: MemoryFailureKind::DeviceOom,
            observed_peak_bytes: Some(observed),
            trained: false,
        },
        0,
    );
    assert!((explains(f) - observed as f64).abs() < 1.0, "{f}");
    assert!(f > 3.0, "the estimated terms carry the whole over-run: {f}");
    // An OOM proves at least the usable capacity was needed, even without telemetry.
    let usable = failed.predicted_peak_bytes * 2;
    let g = ladder::corrected_factor(
        &failed,
        &MemoryFailure {
            kind: MemoryFailureKind::HostOom,
            observed_peak_bytes: None,
            trained: false,
        },
        usable,
    );
    assert!((explains(g) - usable as f64).abs() < 1.0, "{g}");
}

#[test]
fn forbidden_rungs_are_skipped() {
    let (mut job, failed) = first_cpu_plan();
    job.allowed_rungs = vec![RetryRung::HalveMicroBatch];
    let failure = MemoryFailure {
        kind: MemoryFailureKind::HostOom,
        observed_peak_bytes: None,
        trained: false,
    };
    let next =
        next_stricter_plan(&job, &Inventory::default(), &failed, &failure).expect("halving helps");
    assert_eq!(next.rungs_applied, vec![RetryRung::HalveMicroBatch]);
    assert!(!next.settings.activation_checkpointing);
    assert!(next.settings.micro_batch < failed.settings.micro_batch);
    assert_eq!(next.global_batch, 32);
}

#[test]
fn more_stages_when_the_observed_peak_shows_one_worker_is_too_small() {
    let model = transformer(8, 1024, 8, 128, 8000);
    // Fewest workers: the fastest plan would take the four as replicas.
    let job = JobRequest {
        objective: Objective::FewestGpus,
        ..cpu_job(model, 8, 4 * GI, 4)
    };
    let failed = plan(&job, &Inventory::default()).expect("fits one worker on paper");
    assert_eq!(failed.workers, 1);
    let mut stages_only = job.clone();
    stages_only.allowed_rungs = vec![RetryRung::MorePipelineStages];
    let observed = failed.predicted_peak_bytes * 2;
    let failure = MemoryFailure {
        kind: MemoryFailureKind::HostOom,
        observed_peak_bytes: Some(observed),
        trained: false,
    };
    let next = next_stricter_plan(&stages_only, &Inventory::default(), &failed, &failure)
        .expect("more stages fit");
    assert!(next.workers >= 2, "{next:?}");
    assert_eq!(next.rungs_applied, vec![RetryRung::MorePipelineStages]);
    // Twice the whole prediction, put on the estimated terms alone: their
    // factor is above 2 (the counted weights and gradients take none of it).
    assert!(next.correction_factor > 2.0, "{}", next.correction_factor);
    assert!(next.predicted_peak_bytes <= next.budget_bytes);
}

#[test]
fn larger_gpu_rung_moves_to_a_bigger_type() {
    let inv = Inventory::from_nodes(&[
        gpu_node("t4", "Tesla-T4", 15360, 1),
        gpu_node("a100", "NVIDIA-A100-SXM4-80GB", 81920, 1),
    ]);
    let mut job = gpu_job(transformer(12, 768, 12, 1024, 50257), 1, 1);
    let failed = plan(&job, &inv).expect("plan");
    assert_eq!(failed.device, "Tesla-T4", "ties go to the smaller device");
    job.allowed_rungs = vec![RetryRung::LargerGpu];
    let failure = MemoryFailure {
        kind: MemoryFailureKind::DeviceOom,
        observed_peak_bytes: None,
        trained: false,
    };
    let next = next_stricter_plan(&job, &inv, &failed, &failure).expect("A100 fits");
    assert_eq!(next.device, "NVIDIA-A100-SXM4-80GB");
    assert_eq!(next.settings, failed.settings);
}

#[test]
fn exhausted_ladder_explains_every_rung() {
    let (mut job, failed) = first_cpu_plan();
    job.target = Target::Cpu {
        memory_limit_bytes: 64 * 1024 * 1024,
        max_workers: 1,
    };
    let err = next_stricter_plan(
        &job,
        &Inventory::default(),
        &failed,
        &MemoryFailure {
            kind: MemoryFailureKind::HostOom,
            observed_peak_bytes: None,
            trained: false,
        },
    )
    .expect_err("64 MiB cannot hold it");
    let text = err.to_string();
    for rung in RetryRung::DEFAULT {
        assert!(text.contains(&rung.to_string()), "missing {rung} in {text}");
    }
    // A CPU worker has nothing to offload, and the ladder says so.
    assert!(
        text.contains("offloadOptimizer: not applicable on the flex backend"),
        "{text}"
    );
}

#[test]
fn a_rung_that_does_not_apply_to_cpu_workers_is_never_applied() {
    let (mut job, failed) = first_cpu_plan();
    job.allowed_rungs = vec![RetryRung::OffloadOptimizer, RetryRung::HalveMicroBatch];
    let failure = MemoryFailure {
        kind: MemoryFailureKind::HostOom,
        observed_peak_bytes: None,
        trained: false,
    };
    let next =
        next_stricter_plan(&job, &Inventory::default(), &failed, &failure).expect("halving helps");
    assert_eq!(next.rungs_applied, vec![RetryRung::HalveMicroBatch]);
    assert_eq!(next.settings.optimizer, failed.settings.optimizer);

    job.allowed_rungs = vec![RetryRung::OffloadOptimizer];
    let err = next_stricter_plan(&job, &Inventory::default(), &failed, &failure)
        .expect_err("nothing to offer");
    assert!(
        err.details.contains(
            &"offloadOptimizer: not applicable on the flex backend: a CPU worker's optimizer state is in host memory already".into()
        ),
        "{err}"
    );
}

#[test]
fn pinned_stages_hold_on_the_first_attempt_and_a_retry_adds_stages() {
    // Fits on 2 workers, not on 1.
    let model = transformer(6, 512, 8, 64, 4096);
    let mut job = cpu_job(model, 8, 350 << 20, 3);
    job.allowed_rungs = vec![RetryRung::MorePipelineStages];
    let free = plan(&job, &Inventory::default()).expect("fits split");
    assert!(free.workers >= 2);
    job.pinned_stages = Some(1);
    let pinned = plan(&job, &Inventory::default()).expect("pinned plan");
    assert_eq!(pinned.workers, 1);
    assert!(!pinned.fits());
    assert!(
        pinned.warnings.iter().any(|w| w.contains("pinned")),
        "{:?}",
        pinned.warnings
    );
    let failure = MemoryFailure {
        kind: MemoryFailureKind::HostOom,
        observed_peak_bytes: None,
        trained: false,
    };
    let next = next_stricter_plan(&job, &Inventory::default(), &pinned, &failure)
        .expect("more stages fit");
    assert!(next.workers >= 2 && next.fits(), "{next:?}");
    assert_eq!(next.rungs_applied, vec![RetryRung::MorePipelineStages]);
    assert_eq!(next.settings.global_batch(), 8);
    // A pin above what the target allows is clamped, never exceeded.
    job.pinned_stages = Some(9);
    assert!(plan(&job, &Inventory::default()).expect("plan").workers <= 3);
}

/// A GPU job whose device ran out of memory with its gradients and
/// optimizer state on the device: the `offloadGradients` rung moves both to
/// the host (checkpointing on, as backward then runs block by block), and
/// the retry's device peak drops by the gradients it no longer keeps.
#[test]
fn a_device_oom_retry_offloads_the_gradients() {
    let inv = Inventory::from_nodes(&[gpu_node("a100", "NVIDIA-A100-SXM4-40GB", 40960, 1)]);
    let mut job = gpu_job(transformer(24, 2048, 16, 1024, 50257), 8, 1);
    job.allowed_rungs = vec![RetryRung::OffloadGradients];
    let failed = plan(&job, &inv).expect("fits on paper with everything on the device");
    assert!(!failed.settings.offload_gradients && !failed.settings.offload_optimizer);
    let failure = MemoryFailure {
        kind: MemoryFailureKind::DeviceOom,
        observed_peak_bytes: Some(failed.budget_bytes + failed.budget_bytes / 10),
        trained: false,
    };
    let next = next_stricter_plan(&job, &inv, &failed, &failure).expect("offloading helps");
    assert_eq!(next.rungs_applied, vec![RetryRung::OffloadGradients]);
    let s = &next.settings;
    assert!(s.offload_gradients && s.offload_optimizer && s.activation_checkpointing);
    assert_eq!(next.global_batch, failed.global_batch);
    assert!(next.fits(), "{}", next.fit);
    let m = &next.stages[0].memory;
    assert!(
        m.gradients < failed.stages[0].memory.gradients / 10,
        "{m:?}"
    );
    assert_eq!(m.optimizer_state, 0);
    assert!(m.host_bytes > failed.stages[0].memory.optimizer_state);
}
