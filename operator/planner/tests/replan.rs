//! `replan`: the next attempt's plan for every way an attempt can end.

mod common;
use common::*;
use headroom_planner::*;

fn two_type_cluster() -> Inventory {
    Inventory::from_nodes(&[
        gpu_node("t4", "Tesla-T4", 15360, 1),
        gpu_node("a100", "NVIDIA-A100-SXM4-80GB", 81920, 1),
    ])
}

#[test]
fn out_of_memory_climbs_the_ladder() {
    let mut job = cpu_job(transformer(6, 512, 8, 256, 8000), 32, 2 * GI, 3);
    job.pinned_micro_batch = Some(32);
    job.pinned_checkpointing = Some(false);
    let inv = Inventory::default();
    let ended = plan(&job, &inv).expect("pinned plan");
    let failure = MemoryFailure {
        kind: MemoryFailureKind::HostOom,
        observed_peak_bytes: Some(2 * GI),
        trained: false,
    };
    let next =
        replan(&job, &inv, &ended, &FailureCause::OutOfMemory(failure)).expect("a stricter plan");
    assert_eq!(
        next,
        next_stricter_plan(&job, &inv, &ended, &failure).expect("the ladder's plan")
    );
    assert_eq!(next.rungs_applied[0], RetryRung::ActivationCheckpointing);
    assert_eq!(next.global_batch, ended.global_batch);
}

#[test]
fn unschedulable_plans_again_without_the_excluded_types() {
    let inv = two_type_cluster();
    let mut job = gpu_job(transformer(12, 768, 12, 1024, 50257), 1, 1);
    // Pins held on the first attempt; a retry plans freely.
    job.pinned_checkpointing = Some(true);
    let mut ended = plan(&job, &inv).expect("plan");
    assert_eq!(ended.device, "Tesla-T4");
    assert!(ended.settings.activation_checkpointing);
    // What an earlier out-of-memory failure proved carries over.
    ended.correction_factor = 1.25;
    let cause = FailureCause::Unschedulable {
        excluded_devices: vec!["Tesla-T4".into()],
    };
    let next = replan(&job, &inv, &ended, &cause).expect("the A100 is left");
    assert_eq!(next.device, "NVIDIA-A100-SXM4-80GB");
    assert_eq!(next.correction_factor, 1.25);
    assert!(
        !next.settings.activation_checkpointing,
        "the pin is not honoured on a retry: {next:?}"
    );
    assert!(next.rungs_applied.is_empty());

    // The ended device is never planned again, even when the list misses it.
    let missed = FailureCause::Unschedulable {
        excluded_devices: vec![],
    };
    assert_eq!(
        replan(&job, &inv, &ended, &missed)
            .expect("the A100 is left")
            .device,
        "NVIDIA-A100-SXM4-80GB"
    );
}

#[test]
fn unschedulable_with_nothing_left_says_which_device_failed() {
    let inv = two_type_cluster();
    let job = gpu_job(transformer(12, 768, 12, 1024, 50257), 1, 1);
    let ended = plan(&job, &inv).expect("plan");
    let cause = FailureCause::Unschedulable {
        excluded_devices: vec!["NVIDIA-A100-SXM4-80GB".into(), "Tesla-T4".into()],
    };
    let err = replan(&job, &inv, &ended, &cause).expect_err("every type excluded");
    assert!(
        err.summary.starts_with("Tesla-T4 was unschedulable; "),
        "{}",
        err.summary
    );
    assert!(err.to_string().contains("unschedulable"), "{err}");
}

#[test]
fn any_other_failure_runs_the_same_settings_again() {
    let inv = two_type_cluster();
    let job = gpu_job(transformer(12, 768, 12, 1024, 50257), 1, 1);
    let mut ended = plan(&job, &inv).expect("plan");
    ended.rungs_applied = vec![RetryRung::HalveMicroBatch];
    ended.warnings = vec!["retry after HostOom: …".into()];
    ended.correction_factor = 1.5;
    let same = replan(&job, &inv, &ended, &FailureCause::Other).expect("same plan");
    assert!(same.rungs_applied.is_empty());
    assert!(same.warnings.is_empty());
    assert_eq!(
        same,
        Plan {
            rungs_applied: vec![],
            warnings: vec![],
            ..ended
        }
    );
}
