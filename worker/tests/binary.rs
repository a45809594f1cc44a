//! The `headroom-worker` binary end to end on the CPU backend: exit codes,
//! termination messages, checkpoints and resume across processes.

use std::path::{Path, PathBuf};
use std::process::Command;

use headroom_api::{
    CHECKPOINT_DIR_ENV, PEER_KEY_ENV, PLAN_JSON_ENV, POD_NAME_ENV, TerminationMessage,
    WORKER_API_ENV, WorkerAssignment, WorkerOutcome, exit_code,
};
use headroom_planner::{
    Inventory, JobRequest, ModelShape, Optimizer, Precision, RetryRung, Target, TransformerShape,
    plan,
};
use headroom_worker::run::{DEVICE_MEMORY_LIMIT_ENV, TERMINATION_MESSAGE_PATH_ENV};

mod common;
use common::tiny_shape;

/// The peer key every worker these tests start is given.
const TEST_PEER_KEY: &str = "5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e5e";

fn assignment(steps: u64, micro_batch: Option<u32>) -> WorkerAssignment {
    assignment_for(
        ModelShape::Transformer(tiny_shape()),
        8,
        steps,
        micro_batch,
        None,
    )
}

fn assignment_for(
    model: ModelShape,
    global_batch: u32,
    steps: u64,
    micro_batch: Option<u32>,
    checkpointing: Option<bool>,
) -> WorkerAssignment {
    let req = JobRequest {
        model,
        global_batch,
        precision: Precision::Fp32,
        optimizer: Optimizer::Adamw,
        pinned_micro_batch: micro_batch,
        pinned_checkpointing: checkpointing,
        pinned_stages: None,
        pinned_replicas: None,
        objective: Default::default(),
        target: Target::Cpu {
            memory_limit_bytes: 2 << 30,
            max_workers: 1,
        },
        headroom_fraction: 0.1,
        allowed_rungs: RetryRung::ALL.to_vec(),
        adapters: None,
        base_format: headroom_planner::BaseFormat::Dense,
    };
    WorkerAssignment {
        job: "tiny".into(),
        namespace: "default".into(),
        attempt: 1,
        stage: 0,
        replica: 0,
        model: req.model.clone(),
        plan: plan(&req, &Inventory::default()).expect("plan"),
        recipe: headroom_api::Recipe::constant(1e-2, steps),
        checkpoint_every_steps: 5,
        seed: 3,
        files: None,
        memory_guard: None,
    }
}

struct Run {
    code: i32,
    message: TerminationMessage,
    stderr: String,
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-bin-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn run_worker(dir: &Path, plan_json: &str, extra: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_headroom-worker"));
    worker_env(&mut cmd, dir, plan_json, extra);
    let out = cmd.output().expect("run the worker");
    Run {
        code: out.status.code().expect("exit code"),
        message: termination_message(dir),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// The worker's environment for a run in `dir` (no worker API, so its
/// telemetry stays local), `extra` on top; clears an old termination message.
fn worker_env(cmd: &mut Command, dir: &Path, plan_json: &str, extra: &[(&str, &str)]) {
    let termination = dir.join("termination-log");
    let _ = std::fs::remove_file(&termination);
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        // No worker API (HEADROOM_WORKER_API cleared): telemetry stays local.
        .env("HOME", dir)
        .env(PLAN_JSON_ENV, plan_json)
        .env(CHECKPOINT_DIR_ENV, dir.join("checkpoints"))
        .env(TERMINATION_MESSAGE_PATH_ENV, &termination)
        .env(POD_NAME_ENV, "tiny-a1-s0")
        // The peer key of multi-worker runs (no worker API to hand one out);
        // unused by a single worker.
        .env(PEER_KEY_ENV, TEST_PEER_KEY);
    for (k, v) in extra {
        cmd.env(k, v);
    }
}

fn termination_message(dir: &Path) -> TerminationMessage {
    let text = std::fs::read_to_string(dir.join("termination-log"))
        .expect("every exit writes a termination message");
    serde_json::from_str(&text).expect("termination message is JSON")
}

#[test]
fn trains_checkpoints_and_resumes_across_processes() {
    let dir = temp_dir("resume");
    let first = run_worker(
        &dir,
        &serde_json::to_string(&assignment(10, None)).expect("json"),
        &[],
    );
    assert_eq!(first.code, exit_code::SUCCESS, "{}", first.stderr);
    assert_eq!(first.message.outcome, WorkerOutcome::Succeeded);
    assert_eq!(first.message.step, Some(10));
    assert!(
        first.message.peak_bytes.unwrap_or(0) > 1 << 20,
        "{:?}",
        first.message
    );
    assert!(
        dir.join("checkpoints/step-000000000010/stage-0000-0002/meta.json")
            .is_file()
    );

    // A later attempt with a smaller pinned micro-batch continues to 15.
    let second = run_worker(
        &dir,
        &serde_json::to_string(&assignment(15, Some(2))).expect("json"),
        &[],
    );
    assert_eq!(second.code, exit_code::SUCCESS, "{}", second.stderr);
    assert_eq!(second.message.step, Some(15));
    assert!(second.stderr.contains("resumed"), "{}", second.stderr);
    // One info line per optimizer step, counted from the checkpoint's step.
    for step in 11..=15 {
        assert_eq!(
            second
                .stderr
                .matches(&format!("step {step}/15 loss "))
                .count(),
            1,
            "step {step}: {}",
            second.stderr
        );
    }
    assert!(!second.stderr.contains("step 10/15"), "{}", second.stderr);
    let last = second
        .stderr
        .lines()
        .find(|l| l.contains("step 15/15 loss "))
        .expect("the last step's line");
    assert!(
        last.ends_with(" eta 0s") && !last.contains("loss n/a"),
        "{last}"
    );
    assert!(dir.join("checkpoints/step-000000000015").is_dir());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn invalid_plans_exit_with_invalid_plan() {
    let dir = temp_dir("invalid");
    let garbage = run_worker(&dir, "{\"job\": 1}", &[]);
    assert_eq!(garbage.code, exit_code::INVALID_PLAN);
    assert_eq!(garbage.message.outcome, WorkerOutcome::InvalidPlan);

    let mut two_stages = assignment(4, None);
    let mut second = two_stages.plan.stages[0].clone();
    two_stages.plan.stages[0].layer_end = 1;
    second.index = 1;
    second.layer_start = 1;
    two_stages.plan.stages.push(second);
    two_stages.plan.workers = 2;
    let pipeline = run_worker(
        &dir,
        &serde_json::to_string(&two_stages).expect("json"),
        &[],
    );
    assert_eq!(
        pipeline.code,
        exit_code::INVALID_PLAN,
        "{}",
        pipeline.stderr
    );
    assert!(
        pipeline.message.reason.contains("HEADROOM_PIPELINE_PODS"),
        "{}",
        pipeline.message.reason
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_device_out_of_memory_exits_with_its_code_and_the_peak() {
    let dir = temp_dir("oom");
    let run = run_worker(
        &dir,
        &serde_json::to_string(&assignment(4, None)).expect("json"),
        &[(DEVICE_MEMORY_LIMIT_ENV, "1048576")],
    );
    assert_eq!(run.code, exit_code::DEVICE_OUT_OF_MEMORY, "{}", run.stderr);
    assert_eq!(run.message.outcome, WorkerOutcome::DeviceOutOfMemory);
    assert_eq!(run.message.step, Some(0));
    assert!(run.message.peak_bytes.unwrap_or(0) > 1_048_576);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn activation_checkpointing_lowers_the_measured_peak() {
    // Activations dominate this model (long sequence, small hidden size), so
    // keeping only block inputs must show in the process's peak.
    let shape = TransformerShape {
        layers: 4,
        hidden: 32,
        heads: 4,
        sequence_length: 128,
        vocabulary: 64,
        feed_forward: None,
        tied_embeddings: true,
    };
    let peak = |checkpointing: bool| {
        let dir = temp_dir(if checkpointing { "ckpt-on" } else { "ckpt-off" });
        let a = assignment_for(
            ModelShape::Transformer(shape.clone()),
            8,
            1,
            Some(8),
            Some(checkpointing),
        );
        assert_eq!(a.plan.settings.activation_checkpointing, checkpointing);
        let run = run_worker(&dir, &serde_json::to_string(&a).expect("json"), &[]);
        assert_eq!(run.code, exit_code::SUCCESS, "{}", run.stderr);
        let _ = std::fs::remove_dir_all(&dir);
        run.message.peak_bytes.expect("peak")
    };
    let (off, on) = (peak(false), peak(true));
    eprintln!("peak without checkpointing {off} B, with {on} B");
    let predicted = |ckpt: bool| {
        let a = assignment_for(
            ModelShape::Transformer(shape.clone()),
            8,
            1,
            Some(8),
            Some(ckpt),
        );
        a.plan.stages[0].memory.activations
    };
    // The planner's activation saving, and at least a third of it measured.
    let saving = predicted(false) - predicted(true);
    assert!(
        off > on + saving / 3,
        "peak without checkpointing {off} B, with {on} B; predicted activation saving {saving} B"
    );
}

#[test]
fn resuming_holds_the_optimizer_state_once() {
    // Optimizer state dominates this model (AdamW's moments are twice the
    // weights; a short sequence keeps activations small), so loading it
    // twice over while resuming would show in the process's peak.
    let shape = TransformerShape {
        layers: 2,
        hidden: 256,
        heads: 4,
        sequence_length: 8,
        vocabulary: 8192,
        feed_forward: None,
        tied_embeddings: true,
    };
    let dir = temp_dir("resume-peak");
    let run = |steps: u64| {
        let a = assignment_for(
            ModelShape::Transformer(shape.clone()),
            2,
            steps,
            Some(1),
            None,
        );
        let run = run_worker(&dir, &serde_json::to_string(&a).expect("json"), &[]);
        assert_eq!(run.code, exit_code::SUCCESS, "{}", run.stderr);
        (run, a.plan.stages[0].memory.optimizer_state)
    };
    let (fresh, state) = run(5);
    let (resumed, _) = run(7);
    assert!(resumed.stderr.contains("resum"), "{}", resumed.stderr);
    assert_eq!(resumed.message.step, Some(7));
    let (fresh, resumed) = (
        fresh.message.peak_bytes.expect("peak"),
        resumed.message.peak_bytes.expect("peak"),
    );
    eprintln!(
        "peak fresh {fresh} B, resumed {resumed} B ({:+} B); predicted optimizer state {state} B",
        resumed as i64 - fresh as i64
    );
    // Merging the state into an in-memory pack before loading it put the
    // resumed peak 27-35 MB (about the whole state) above the fresh one.
    assert!(
        resumed < fresh + state / 2,
        "peak fresh {fresh} B, resumed {resumed} B; optimizer state {state} B"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_saves_a_checkpoint_and_exits() {
    let dir = temp_dir("sigterm");
    let termination = dir.join("termination-log");
    let a = assignment(1_000_000, None);
    let child = Command::new(env!("CARGO_BIN_EXE_headroom-worker"))
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("KUBECONFIG", dir.join("no-kubeconfig"))
        .env("HOME", &dir)
        .env(PLAN_JSON_ENV, serde_json::to_string(&a).expect("json"))
        .env(CHECKPOINT_DIR_ENV, dir.join("checkpoints"))
        .env(TERMINATION_MESSAGE_PATH_ENV, &termination)
        .env(POD_NAME_ENV, "tiny-a1-s0")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the worker");
    // Let it get past the first periodic checkpoint (every 5 steps).
    let first = dir.join("checkpoints/step-000000000005");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !first.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    assert!(first.exists(), "no checkpoint within 20 s");
    std::thread::sleep(std::time::Duration::from_millis(150));
    let killed = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(killed.success());
    let out = child.wait_with_output().expect("wait");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(exit_code::TERMINATED), "{stderr}");
    assert!(
        !stderr.contains('\u{1b}'),
        "logs to a pipe carry no colour codes: {stderr}"
    );
    let message: TerminationMessage =
        serde_json::from_str(&std::fs::read_to_string(&termination).expect("message"))
            .expect("json");
    assert!(message.reason.contains("SIGTERM"), "{}", message.reason);
    assert_eq!(message.outcome, WorkerOutcome::Terminated);
    let step = message.step.expect("step");
    assert!(step >= 5);
    // The work up to the signal is on disk: the newest checkpoint is at that step.
    let newest = dir.join(format!("checkpoints/step-{step:012}"));
    assert!(
        newest.join("stage-0000-0002/meta.json").is_file(),
        "{message:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A 2-stage plan for [`tiny_shape`]: blocks 0..1 and 1..2.
fn two_stage(steps: u64, stage: u32) -> WorkerAssignment {
    let mut a = assignment(steps, Some(2));
    let mut second = a.plan.stages[0].clone();
    a.plan.stages[0].layer_end = 1;
    second.index = 1;
    second.layer_start = 1;
    a.plan.stages.push(second);
    a.plan.workers = 2;
    a.stage = stage;
    a
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port()
}

/// Runs both stages of a 2-stage plan as two processes over loopback.
fn run_two_stages(name: &str, steps: u64, stage1_extra: &[(&'static str, String)]) -> [Run; 2] {
    let root = temp_dir(name);
    let addresses = format!("127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let checkpoints = root.join("checkpoints");
    let runs: Vec<Run> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2u32)
            .map(|k| {
                let dir = root.join(format!("s{k}"));
                std::fs::create_dir_all(&dir).expect("dir");
                let json = serde_json::to_string(&two_stage(steps, k)).expect("json");
                let mut extra = vec![
                    (headroom_api::PIPELINE_ADDRESSES_ENV, addresses.clone()),
                    (CHECKPOINT_DIR_ENV, checkpoints.display().to_string()),
                    (headroom_api::PIPELINE_TIMEOUT_ENV, "60".to_string()),
                ];
                if k == 1 {
                    extra.extend(stage1_extra.iter().cloned());
                }
                scope.spawn(move || {
                    let extra: Vec<(&str, &str)> =
                        extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    run_worker(&dir, &json, &extra)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("stage"))
            .collect()
    });
    let mut runs = runs.into_iter();
    [runs.next().expect("stage 0"), runs.next().expect("stage 1")]
}

#[test]
fn two_stage_processes_train_together_over_tcp() {
    let [s0, s1] = run_two_stages("pipeline", 6, &[]);
    for (k, run) in [&s0, &s1].iter().enumerate() {
        assert_eq!(run.code, exit_code::SUCCESS, "stage {k}: {}", run.stderr);
        assert_eq!(run.message.step, Some(6));
    }
    assert!(
        s1.message.reason.contains("last loss"),
        "{}",
        s1.message.reason
    );
    assert!(
        s0.stderr.contains("connected to the next stage"),
        "{}",
        s0.stderr
    );
    // Only the last stage computes the loss; both log every step.
    assert!(s0.stderr.contains("step 6/6 loss n/a "), "{}", s0.stderr);
    assert!(s1.stderr.contains("step 6/6 loss "), "{}", s1.stderr);
    assert!(!s1.stderr.contains("loss n/a"), "{}", s1.stderr);
}

#[test]
fn a_stage_that_fails_takes_its_neighbour_down_as_peer_lost() {
    // Stage 1 passes its (tiny) device limit in step 1 and exits with the
    // device-OOM code; stage 0 sees the connection close and says so.
    let [s0, s1] = run_two_stages("peerlost", 6, &[(DEVICE_MEMORY_LIMIT_ENV, "1".into())]);
    assert_eq!(s1.code, exit_code::DEVICE_OUT_OF_MEMORY, "{}", s1.stderr);
    assert_eq!(s0.code, exit_code::PEER_LOST, "{}", s0.stderr);
    assert_eq!(s0.message.outcome, WorkerOutcome::PeerLost);
    assert!(
        s0.message.reason.contains("stage 1"),
        "{}",
        s0.message.reason
    );
    // Stage 0 was still at the start of step 1 (no update): it saved it.
    assert!(
        s0.message.reason.contains("checkpoint at step 1 saved"),
        "{}",
        s0.message.reason
    );
}

/// Replica `replica` of a 1-stage plan with two replicas: micro-batch 2 ×
/// 2 micro-batches each, the global batch of [`assignment`] (8).
fn two_replica(steps: u64, replica: u32) -> WorkerAssignment {
    let mut a = assignment(steps, Some(2));
    assert_eq!(
        a.plan.settings.gradient_accumulation, 4,
        "{:?}",
        a.plan.settings
    );
    a.plan.settings.gradient_accumulation = 2;
    a.plan.replicas = 2;
    a.plan.workers = 2;
    a.replica = replica;
    a
}

/// Runs both replicas of a 2-replica plan as two processes over loopback,
/// checkpointing into `root/checkpoints`.
fn run_two_replicas(
    root: &Path,
    steps: u64,
    replica1_extra: &[(&'static str, String)],
) -> [Run; 2] {
    run_replicas(
        root,
        [two_replica(steps, 0), two_replica(steps, 1)],
        replica1_extra,
    )
}

/// Runs `replicas` (replica 0 and 1 of one plan) as two processes over
/// loopback, checkpointing into `root/checkpoints`.
fn run_replicas(
    root: &Path,
    replicas: [WorkerAssignment; 2],
    replica1_extra: &[(&'static str, String)],
) -> [Run; 2] {
    let addresses = format!("127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let checkpoints = root.join("checkpoints");
    let runs: Vec<Run> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..2u32)
            .map(|r| {
                let dir = root.join(format!("r{r}"));
                std::fs::create_dir_all(&dir).expect("dir");
                let json = serde_json::to_string(&replicas[r as usize]).expect("json");
                let mut extra = vec![
                    (headroom_api::REPLICA_ADDRESSES_ENV, addresses.clone()),
                    (CHECKPOINT_DIR_ENV, checkpoints.display().to_string()),
                    (headroom_api::PIPELINE_TIMEOUT_ENV, "60".to_string()),
                ];
                if r == 1 {
                    extra.extend(replica1_extra.iter().cloned());
                }
                scope.spawn(move || {
                    let extra: Vec<(&str, &str)> =
                        extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
                    run_worker(&dir, &json, &extra)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("replica"))
            .collect()
    });
    let mut runs = runs.into_iter();
    [
        runs.next().expect("replica 0"),
        runs.next().expect("replica 1"),
    ]
}

#[test]
fn two_replica_processes_train_together_and_a_single_worker_resumes() {
    let root = temp_dir("replicas");
    let [r0, r1] = run_two_replicas(&root, 5, &[]);
    for (r, run) in [&r0, &r1].iter().enumerate() {
        assert_eq!(run.code, exit_code::SUCCESS, "replica {r}: {}", run.stderr);
        assert_eq!(run.message.step, Some(5));
    }
    // Both report the loss of the whole global batch.
    assert!(
        r0.message.reason.contains("last loss"),
        "{}",
        r0.message.reason
    );
    assert_eq!(r0.message.reason, r1.message.reason);
    assert!(
        r0.stderr.contains("optimizer state sharded"),
        "{}",
        r0.stderr
    );
    let step = root.join("checkpoints/step-000000000005");
    for r in 0..2 {
        assert!(
            step.join(format!("stage-0000-0002-r{r:04}-of-0002/meta.json"))
                .is_file()
        );
    }
    // A replica started again after the others finished (its pod was
    // deleted as they ended) resumes at the last step: it has nothing left
    // to exchange and its peer is gone, so it connects to no ring and ends.
    let dir = root.join("late");
    std::fs::create_dir_all(&dir).expect("dir");
    let checkpoints = root.join("checkpoints").display().to_string();
    let nobody = format!("127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let late = run_worker(
        &dir,
        &serde_json::to_string(&two_replica(5, 1)).expect("json"),
        &[
            (CHECKPOINT_DIR_ENV, checkpoints.as_str()),
            (headroom_api::REPLICA_ADDRESSES_ENV, nobody.as_str()),
            (headroom_api::PIPELINE_TIMEOUT_ENV, "2"),
        ],
    );
    assert_eq!(late.code, exit_code::SUCCESS, "{}", late.stderr);
    assert_eq!(late.message.step, Some(5));
    // A retry with one worker (d = 2 → 1) resumes from both shards.
    let dir = root.join("single");
    std::fs::create_dir_all(&dir).expect("dir");
    let single = run_worker(
        &dir,
        &serde_json::to_string(&assignment(8, Some(2))).expect("json"),
        &[(CHECKPOINT_DIR_ENV, checkpoints.as_str())],
    );
    assert_eq!(single.code, exit_code::SUCCESS, "{}", single.stderr);
    assert_eq!(single.message.step, Some(8));
    assert!(single.stderr.contains("× 2 replicas"), "{}", single.stderr);
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_replica_that_fails_takes_the_other_down_as_peer_lost() {
    // Replica 1 passes its (tiny) device limit after step 1 and exits with
    // the device-OOM code; replica 0 loses it in step 2's exchange.
    let root = temp_dir("replica-lost");
    let [r0, r1] = run_two_replicas(&root, 6, &[(DEVICE_MEMORY_LIMIT_ENV, "1".into())]);
    assert_eq!(r1.code, exit_code::DEVICE_OUT_OF_MEMORY, "{}", r1.stderr);
    assert_eq!(r0.code, exit_code::PEER_LOST, "{}", r0.stderr);
    assert_eq!(r0.message.outcome, WorkerOutcome::PeerLost);
    assert!(
        r0.message
            .reason
            .starts_with("data-parallel replicas: replica 1"),
        "{}",
        r0.message.reason
    );
    // Replica 0 failed before its update: it saved its shard of step 1.
    assert!(
        r0.message.reason.contains("checkpoint at step 1 saved"),
        "{}",
        r0.message.reason
    );
    let _ = std::fs::remove_dir_all(&root);
}

/// A replica listed under a port nobody answers: it exits as `PEER_LOST`
/// when the rendezvous times out.
#[test]
fn a_replica_whose_ring_never_comes_up_is_peer_lost() {
    let dir = temp_dir("replica-alone");
    let addresses = format!("127.0.0.1:{},127.0.0.1:{}", free_port(), free_port());
    let run = run_worker(
        &dir,
        &serde_json::to_string(&two_replica(3, 0)).expect("json"),
        &[
            (headroom_api::REPLICA_ADDRESSES_ENV, addresses.as_str()),
            (headroom_api::PIPELINE_TIMEOUT_ENV, "2"),
        ],
    );
    assert_eq!(run.code, exit_code::PEER_LOST, "{}", run.stderr);
    assert!(
        run.message.reason.starts_with("data-parallel replicas: "),
        "{}",
        run.message.reason
    );
    // Without the replica peers the plan cannot run.
    let run = run_worker(
        &dir,
        &serde_json::to_string(&two_replica(3, 0)).expect("json"),
        &[],
    );
    assert_eq!(run.code, exit_code::INVALID_PLAN, "{}", run.stderr);
    assert!(
        run.message.reason.contains(headroom_api::REPLICA_PODS_ENV),
        "{}",
        run.message.reason
    );
    // Nor without a peer key (neither the override nor a worker API), nor
    // with one that is not 64 hex digits.
    for (key, says) in [("", WORKER_API_ENV), ("abc", "64 hex digits")] {
        let run = run_worker(
            &dir,
            &serde_json::to_string(&two_replica(3, 0)).expect("json"),
            &[
                (headroom_api::REPLICA_ADDRESSES_ENV, addresses.as_str()),
                (PEER_KEY_ENV, key),
            ],
        );
        assert_eq!(run.code, exit_code::INVALID_PLAN, "{}", run.stderr);
        for needle in [PEER_KEY_ENV, says] {
            assert!(
                run.message.reason.contains(needle),
                "{needle}: {}",
                run.message.reason
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A Llama-family assignment over the transformers-made tiny checkpoint and
/// the sample text, writing its output under `dir`.
fn llama_assignment(dir: &Path, steps: u64) -> WorkerAssignment {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/tiny-llama");
    let config = std::fs::read_to_string(fixtures.join("config.json")).expect("config.json");
    let shape = headroom_planner::LlamaShape::from_hf_config(&config, 32).expect("shape");
    let mut a = assignment_for(ModelShape::Llama(shape), 4, steps, Some(2), Some(true));
    a.job = "tiny-llama".into();
    a.recipe.learning_rate = 3e-3;
    a.checkpoint_every_steps = 2;
    a.files = Some(headroom_api::PayloadFiles {
        model_dir: fixtures.display().to_string(),
        data_file: Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../samples/data/declaration-of-independence.jsonl")
            .display()
            .to_string(),
        data_format: headroom_api::DataFormat::Jsonl {
            field: "text".into(),
        },
        train_on: headroom_api::TrainOn::Auto,
        data_split: None,
        packing: headroom_api::Packing::Stream,
        output_dir: dir.join("output").display().to_string(),
        hub_model: None,
    });
    a
}

#[test]
fn fine_tunes_a_llama_checkpoint_resumes_and_writes_it_out() {
    let dir = temp_dir("llama");
    let first = run_worker(
        &dir,
        &serde_json::to_string(&llama_assignment(&dir, 4)).expect("json"),
        &[],
    );
    assert_eq!(first.code, exit_code::SUCCESS, "{}", first.stderr);
    assert!(
        first.message.reason.contains("model written to"),
        "{:?}",
        first.message
    );
    // A longer run resumes from step 4's checkpoint, not from the pretrained
    // weights; it evaluates on a held-out share of the text every 2 steps
    // and at the end, and writes the last eval loss beside the weights.
    let mut longer = llama_assignment(&dir, 6);
    longer.recipe.evaluation = Some(headroom_api::EvaluationSpec {
        held_out_fraction: 0.2,
        every_steps: 2,
        samples: 4,
    });
    let second = run_worker(&dir, &serde_json::to_string(&longer).expect("json"), &[]);
    assert_eq!(second.code, exit_code::SUCCESS, "{}", second.stderr);
    assert_eq!(second.message.step, Some(6));
    assert!(second.stderr.contains("resumed"), "{}", second.stderr);
    let out = dir.join("output");
    for file in ["model.safetensors", "config.json", "tokenizer.json"] {
        assert!(out.join(file).is_file(), "{file} in the output");
    }
    let results: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("eval_results.json")).expect("eval_results.json"),
    )
    .expect("json");
    assert_eq!(results["step"], 6, "{results}");
    let eval_loss = results["eval_loss"].as_f64().expect("eval_loss");
    assert!(eval_loss.is_finite() && eval_loss > 0.0, "{results}");
    assert!(
        second.stderr.contains("evaluation on the held-out samples"),
        "{}",
        second.stderr
    );
}

/// A chat checkpoint (tiny-llama with a ChatML template and a license)
/// fine-tuned on the assistant turns of Parquet conversations: the worker
/// renders them, trains, and writes a model that carries the template,
/// the generation config and the license.
#[test]
fn fine_tunes_on_parquet_conversations_and_the_output_keeps_the_chat_template() {
    let dir = temp_dir("chat");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).expect("model dir");
    for file in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
    ] {
        std::fs::copy(
            fixtures.join("llama/tiny-llama").join(file),
            model.join(file),
        )
        .expect(file);
    }
    let template = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
    let config =
        serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": template});
    std::fs::write(model.join("tokenizer_config.json"), config.to_string()).expect("config");
    std::fs::write(model.join("LICENSE"), "the base's terms").expect("license");
    let mut a = llama_assignment(&dir, 2);
    a.files = a.files.map(|f| headroom_api::PayloadFiles {
        model_dir: model.display().to_string(),
        data_file: fixtures
            .join("chat/conversations.parquet")
            .display()
            .to_string(),
        data_format: headroom_api::DataFormat::Parquet {
            field: "text".into(),
        },
        train_on: headroom_api::TrainOn::Assistant,
        ..f
    });
    let run = run_worker(&dir, &serde_json::to_string(&a).expect("json"), &[]);
    assert_eq!(run.code, exit_code::SUCCESS, "{}", run.stderr);
    let out = dir.join("output");
    let written: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("tokenizer_config.json")).expect("tokenizer_config.json"),
    )
    .expect("json");
    assert_eq!(written["chat_template"], template);
    for file in ["model.safetensors", "generation_config.json", "LICENSE"] {
        assert!(out.join(file).is_file(), "{file} in the output");
    }
    // Without a template the same data is refused, naming the checkpoint.
    std::fs::remove_file(model.join("tokenizer_config.json")).expect("remove");
    let refused = run_worker(
        &temp_dir("chat-bare"),
        &serde_json::to_string(&a).expect("json"),
        &[],
    );
    assert_eq!(refused.code, exit_code::INVALID_PLAN, "{}", refused.stderr);
    assert!(
        refused.message.reason.contains("no chat template")
            && refused.message.reason.contains("conversations.parquet:1"),
        "{}",
        refused.message.reason
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two replicas fine-tune the tiny Llama checkpoint together; replica 0
/// alone writes the trained model (the replicas' weights are the same), so
/// the output is written once, not raced over.
#[test]
fn two_replicas_fine_tune_a_llama_checkpoint_and_one_writes_it_out() {
    let root = temp_dir("llama-replicas");
    let replica = |r: u32| {
        let mut a = llama_assignment(&root, 4);
        a.plan.settings.gradient_accumulation = 1;
        a.plan.replicas = 2;
        a.plan.workers = 2;
        a.replica = r;
        a
    };
    let [r0, r1] = run_replicas(&root, [replica(0), replica(1)], &[]);
    for (r, run) in [&r0, &r1].iter().enumerate() {
        assert_eq!(run.code, exit_code::SUCCESS, "replica {r}: {}", run.stderr);
        assert_eq!(run.message.step, Some(4));
    }
    assert!(
        r0.message.reason.contains("model written to"),
        "{}",
        r0.message.reason
    );
    assert!(
        r1.message.reason.contains("replica 1: replica 0 writes"),
        "{}",
        r1.message.reason
    );
    assert!(
        !r1.stderr.contains("trained weights written"),
        "{}",
        r1.stderr
    );
    let output = root.join("output");
    let weights: Vec<_> = std::fs::read_dir(&output)
        .expect("output dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    assert!(
        !weights.is_empty(),
        "{:?}",
        std::fs::read_dir(&output).map(|d| d.count())
    );
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn a_llama_assignment_without_its_files_is_an_invalid_plan() {
    let dir = temp_dir("llama-nofiles");
    let mut a = llama_assignment(&dir, 2);
    a.files = None;
    let run = run_worker(&dir, &serde_json::to_string(&a).expect("json"), &[]);
    assert_eq!(run.code, exit_code::INVALID_PLAN, "{}", run.stderr);
    assert!(run.message.reason.contains("files"), "{:?}", run.message);
    // A data file that is not there is named.
    let mut a = llama_assignment(&dir, 2);
    if let Some(f) = a.files.as_mut() {
        f.data_file = "/nonexistent/corpus.jsonl".into();
    }
    let run = run_worker(&dir, &serde_json::to_string(&a).expect("json"), &[]);
    assert_eq!(run.code, exit_code::INVALID_PLAN, "{}", run.stderr);
    assert!(
        run.message.reason.contains("/nonexistent/corpus.jsonl"),
        "{:?}",
        run.message
    );
}

/// Activations dominate this model (long sequence, small hidden size): a
/// micro-batch of 16 needs several times the memory of one of 2.
fn activation_heavy() -> ModelShape {
    ModelShape::Transformer(TransformerShape {
        layers: 4,
        hidden: 64,
        heads: 4,
        sequence_length: 128,
        vocabulary: 64,
        feed_forward: None,
        tied_embeddings: true,
    })
}

/// glibc's malloc as the operator sets it in every worker pod.
const POD_MALLOC: &[(&str, &str)] = &[
    (
        headroom_api::MALLOC_ARENA_MAX_ENV,
        headroom_api::WORKER_MALLOC_ARENAS,
    ),
    (
        headroom_api::MALLOC_TUNABLES_ENV,
        headroom_api::WORKER_MALLOC_TUNABLES,
    ),
];

/// `micro_batch` of a global batch of 16, the guard on (stepping down in
/// place or not).
fn guarded(steps: u64, micro_batch: u32, step_down_in_place: bool) -> WorkerAssignment {
    let mut a = assignment_for(
        activation_heavy(),
        16,
        steps,
        Some(micro_batch),
        Some(false),
    );
    a.memory_guard = Some(headroom_api::MemoryGuardSettings {
        margin_percent: 3,
        step_down_in_place,
    });
    a
}

/// The activation-heavy job at `micro_batch` for `steps`, without a guard
/// or a limit, in a directory of its own: it must succeed.
fn unguarded(name: &str, steps: u64, micro_batch: u32) -> TerminationMessage {
    let dir = temp_dir(name);
    let mut a = guarded(steps, micro_batch, false);
    a.memory_guard = None;
    let run = run_worker(&dir, &serde_json::to_string(&a).expect("json"), POD_MALLOC);
    assert_eq!(run.code, exit_code::SUCCESS, "{}", run.stderr);
    let _ = std::fs::remove_dir_all(&dir);
    run.message
}

/// `a` in `dir` under the soft `limit`, with the pods' malloc settings.
fn run_under(dir: &Path, a: &WorkerAssignment, limit: u64) -> Run {
    let limit = limit.to_string();
    run_worker(
        dir,
        &serde_json::to_string(a).expect("json"),
        &[
            (DEVICE_MEMORY_LIMIT_ENV, &limit),
            POD_MALLOC[0],
            POD_MALLOC[1],
        ],
    )
}

/// A limit a micro-batch of 4 fits under and one of 16 does not: two
/// thirds of the way up from the smaller peak. Not half way: a fresh
/// process's first step keeps memory it takes once (the thread pool, the
/// matmuls' per-thread buffers; about 11 MB here), which the guard's
/// prediction for the second step counts again, and a smaller retry must
/// still fit under it. The runs go in directories named after `test`,
/// since tests run at once in one process.
fn limit_between_micro_batches(test: &str) -> u64 {
    let peak = |micro| {
        unguarded(&format!("{test}-peak-{micro}"), 2, micro)
            .peak_bytes
            .expect("peak")
    };
    let (small, large) = (peak(4), peak(16));
    eprintln!("peaks without the guard: micro-batch 4 {small} B, 16 {large} B");
    assert!(
        large > small + (20 << 20),
        "the activations dominate: {small} B vs {large} B"
    );
    small + (large - small) * 2 / 3
}

#[test]
fn the_guard_steps_down_in_place_before_the_limit_and_keeps_the_global_batch() {
    let limit = limit_between_micro_batches("guard-step-down");
    let dir = temp_dir("guard-step-down");
    let run = run_under(&dir, &guarded(3, 16, true), limit);
    // Stepped down and finished in this pod (the worker ran itself again):
    // no new attempt, no kill.
    assert_eq!(run.code, exit_code::SUCCESS, "{}", run.stderr);
    assert!(
        run.stderr.contains("stepping down in place"),
        "{}",
        run.stderr
    );
    assert!(
        run.message.peak_bytes.expect("peak") <= limit,
        "peak {:?} B over the limit {limit} B",
        run.message.peak_bytes
    );
    // The global batch is the same: the loss equals a run that started at
    // the micro-batch the guard ended at (only the sums' order differs).
    let last = run
        .stderr
        .lines()
        .rfind(|l| l.contains("stepping down in place"))
        .expect("a step-down line");
    let micro: u32 = last
        .split("micro_batch=")
        .nth(1)
        .and_then(|r| r.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|d| d.parse().ok())
        .expect("the micro-batch stepped down to");
    assert!(micro < 16, "{last}");
    let loss = |reason: &str| -> f64 {
        reason
            .split("last loss ")
            .nth(1)
            .and_then(|r| r.split(';').next())
            .and_then(|l| l.trim().parse().ok())
            .unwrap_or_else(|| panic!("a loss in {reason}"))
    };
    let same_from_start = loss(&unguarded("guard-step-down-reference", 3, micro).reason);
    let guarded_loss = loss(&run.message.reason);
    // Both are printed to 4 decimals; the accumulation's order moves the
    // 7th digit of an f32 sum at most.
    assert!(
        (guarded_loss - same_from_start).abs() <= 1.5e-4,
        "{guarded_loss} vs {same_from_start}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_trip_without_stepping_down_exits_near_oom_and_the_retry_resumes() {
    let limit = limit_between_micro_batches("guard-trip");
    let dir = temp_dir("guard-trip");
    let run = run_under(&dir, &guarded(3, 16, false), limit);
    assert_eq!(run.code, exit_code::NEAR_OUT_OF_MEMORY, "{}", run.stderr);
    assert_eq!(run.message.outcome, WorkerOutcome::NearOutOfMemory);
    let m = &run.message;
    eprintln!("limit {limit} B: {}", m.reason);
    assert!(
        m.reason.starts_with("memory guard: step 1 stopped before "),
        "{}",
        m.reason
    );
    assert_eq!(m.step, Some(0));
    // What it would have reached, over the limit; what it asked for.
    assert!(m.peak_bytes.expect("peak") > limit * 97 / 100, "{m:?}");
    assert!(m.requested_bytes.expect("increment") > 0);
    assert!(
        !run.stderr.contains("panicked"),
        "a trip is not a panic: {}",
        run.stderr
    );
    // The stricter attempt (a smaller micro-batch) resumes and finishes.
    let run = run_under(&dir, &guarded(3, 2, false), limit);
    assert_eq!(run.code, exit_code::SUCCESS, "{}", run.stderr);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A memory cgroup of the test's own (v2, or v1's memory hierarchy), with
/// a limit the kernel enforces and no swap; removed on drop. Needs root.
struct TestCgroup {
    dir: PathBuf,
    version: u8,
}

impl TestCgroup {
    fn new(name: &str, limit: u64) -> TestCgroup {
        let root = Path::new("/sys/fs/cgroup");
        let (base, version) = if root.join("cgroup.controllers").is_file() {
            // v2: the root cgroup may hand the memory controller to children.
            let subtree = root.join("cgroup.subtree_control");
            if !std::fs::read_to_string(&subtree)
                .unwrap_or_default()
                .split_whitespace()
                .any(|c| c == "memory")
            {
                let _ = std::fs::write(&subtree, "+memory");
            }
            (root.to_path_buf(), 2)
        } else {
            (root.join("memory"), 1)
        };
        let dir = base.join(format!("headroom-test-{name}-{}", std::process::id()));
        std::fs::create_dir(&dir).unwrap_or_else(|e| {
            panic!(
                "this test needs root and a memory cgroup it can create ({}): {e}",
                dir.display()
            )
        });
        let (limit_file, no_swap) = if version == 2 {
            ("memory.max", "memory.swap.max")
        } else {
            ("memory.limit_in_bytes", "memory.swappiness")
        };
        std::fs::write(dir.join(limit_file), limit.to_string())
            .unwrap_or_else(|e| panic!("{}/{limit_file}: {e}", dir.display()));
        // Without swap the kernel's answer to the limit is the OOM killer.
        let _ = std::fs::write(dir.join(no_swap), "0");
        TestCgroup { dir, version }
    }

    /// `program` started inside this cgroup: a shell moves itself in, then
    /// becomes the program (same process, so everything it allocates counts).
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.arg("-c")
            .arg("echo $$ > \"$0\" && exec \"$@\"")
            .arg(self.dir.join("cgroup.procs"))
            .arg(program);
        cmd
    }

    /// The highest memory the cgroup was charged, bytes.
    fn peak(&self) -> u64 {
        let file = if self.version == 2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        std::fs::read_to_string(self.dir.join(file))
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or_else(|| panic!("no {file} in {}", self.dir.display()))
    }

    /// Processes the kernel's OOM killer killed in this cgroup.
    fn oom_kills(&self) -> u64 {
        let file = if self.version == 2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        let text = std::fs::read_to_string(self.dir.join(file)).expect("the cgroup's OOM events");
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or_else(|| panic!("no oom_kill count in {file}: {text}"))
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// What a run under a [`TestCgroup`] with a growing ballast did.
struct BallastRun {
    status: std::process::ExitStatus,
    stderr: String,
    oom_kills: u64,
    /// The cgroup's peak charge, bytes.
    peak: u64,
}

/// Runs assignment `a` in `dir` inside a fresh cgroup with `limit`; once
/// the worker logs step 2, a second process in the cgroup (another consumer
/// in the same container) fills a tmpfs file by 1 MiB every `per_mib` up
/// to `ballast` bytes (none when 0): memory the worker does not hold but
/// the limit counts. The caller paces it so that between two of the
/// guard's checks it grows by less than the guard's margin: a consumer
/// that jumps by more than that between two checks is beyond any guard.
/// Without a guard, the kernel kills whatever crosses the limit.
fn run_with_growing_ballast(
    name: &str,
    dir: &Path,
    a: &WorkerAssignment,
    limit: u64,
    (ballast, per_mib): (u64, std::time::Duration),
) -> BallastRun {
    use std::io::{BufRead, BufReader};
    assert!(
        std::fs::read_to_string("/proc/mounts")
            .expect("mounts")
            .lines()
            .any(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                f.get(1) == Some(&"/dev/shm") && f.get(2) == Some(&"tmpfs")
            }),
        "the ballast needs /dev/shm on tmpfs (its pages are charged to the writer's cgroup and cannot be reclaimed without swap)"
    );
    // The worker's executable (hundreds of MB in a debug build) is read
    // into the page cache here first, charged to the test's own cgroup:
    // otherwise the pages a run faults in are charged to that run's cgroup
    // or not, as the cache happens to hold them, and the peaks that size
    // the scenario move by tens of MB from run to run.
    std::fs::read(env!("CARGO_BIN_EXE_headroom-worker")).expect("the worker's executable");
    let cgroup = TestCgroup::new(name, limit);
    let file = PathBuf::from(format!(
        "/dev/shm/headroom-test-{name}-{}",
        std::process::id()
    ));
    let mut cmd = cgroup.command(env!("CARGO_BIN_EXE_headroom-worker"));
    worker_env(
        &mut cmd,
        dir,
        &serde_json::to_string(a).expect("json"),
        &[POD_MALLOC[0], POD_MALLOC[1]],
    );
    let mut worker = cmd
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start the worker");
    let (step2, at_step2) = std::sync::mpsc::channel();
    let stderr = worker.stderr.take().expect("stderr");
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        let mut told = false;
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if !told && line.contains("step 2/") {
                told = step2.send(()).is_ok();
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let mut filler = None;
    if ballast > 0
        && at_step2
            .recv_timeout(std::time::Duration::from_secs(300))
            .is_ok()
    {
        let mib = ballast >> 20;
        let script = format!(
            "i=0; while [ $i -lt {mib} ]; do dd if=/dev/zero of='{}' bs=1M count=1 seek=$i conv=notrunc status=none || exit 1; i=$((i+1)); sleep {:.3}; done",
            file.display(),
            per_mib.as_secs_f64()
        );
        filler = Some(
            cgroup
                .command("sh")
                .args(["-c", &script])
                .spawn()
                .expect("start the ballast"),
        );
    }
    let status = worker.wait().expect("the worker's exit");
    if let Some(mut f) = filler {
        let _ = f.kill();
        let _ = f.wait();
    }
    let (oom_kills, peak) = (cgroup.oom_kills(), cgroup.peak());
    let _ = std::fs::remove_file(&file);
    BallastRun {
        status,
        stderr: reader.join().expect("stderr reader"),
        oom_kills,
        peak,
    }
}

/// A trip after completed steps, under a real cgroup limit the kernel
/// enforces: the worker trains at micro-batch 32 with room to spare until
/// another consumer in its cgroup grows past what that micro-batch leaves.
/// Without the guard the kernel kills the worker; with it, the step under
/// way is stopped before the line, the last completed step (no periodic
/// checkpoint yet) is checkpointed, the worker steps down in place, and
/// every step of the run is computed exactly once.
#[test]
#[ignore = "needs root and a memory cgroup of its own: make test-apiserver runs it"]
fn a_trip_after_completed_steps_loses_none_of_them() {
    const STEPS: u64 = 10;
    // The activation-heavy model at a global batch of 32, one micro-batch
    // of 32 per step; no periodic checkpoint before the end.
    let at = |micro| assignment_for(activation_heavy(), 32, STEPS, Some(micro), Some(false));
    let mut a = at(32);
    a.checkpoint_every_steps = 1000;
    // A wider margin than the default 3 %: the ballast may grow by a tenth
    // of the activations' spread during the longest part of a step.
    a.memory_guard = Some(headroom_api::MemoryGuardSettings {
        margin_percent: 10,
        step_down_in_place: true,
    });
    // Peaks as the limit counts them: the cgroup's charge, without a limit
    // in reach or a guard; and the time a step takes (the run's, over its
    // two steps: a little more than a step).
    let peak = |micro| {
        let dir = temp_dir(&format!("ballast-peak-{micro}"));
        let mut b = at(micro);
        b.recipe = headroom_api::Recipe::constant(1e-2, 2);
        let began = std::time::Instant::now();
        let run = run_with_growing_ballast(
            &format!("peak-{micro}"),
            &dir,
            &b,
            8 << 30,
            (0, std::time::Duration::ZERO),
        );
        assert!(run.status.success(), "{}", run.stderr);
        let _ = std::fs::remove_dir_all(&dir);
        (run.peak, began.elapsed() / 2)
    };
    let ((small, _), (large, step)) = (peak(4), peak(32));
    let spread = large.saturating_sub(small);
    assert!(
        spread > 16 << 20,
        "the activations dominate: {small} B vs {large} B"
    );
    // Micro-batch 32 fits with three quarters of the activations' spread
    // to spare; the full ballast (the whole spread) leaves it a quarter of
    // the spread short, and leaves micro-batch 4 where 32 was.
    let limit = large + spread * 3 / 4;
    // The ballast fills in six steps' time, paced by this machine's step:
    // the control reaches the line about 4.5 steps after step 2, well
    // before the last step, on a fast machine or a slow one. The longest
    // part of a step (the backward) is under 60 % of it, so the ballast
    // grows by under a tenth of the spread between two checks, and the
    // 10 % margin is at least 0.175 of it (the limit is at least 1.75
    // spreads).
    let ballast = (spread, step * 6 / u32::try_from(spread >> 20).expect("MiB"));
    eprintln!(
        "cgroup peaks: micro-batch 4 {small} B, 32 {large} B; limit {limit} B, ballast {} B at 1 MiB per {:?} (a step: {step:?})",
        ballast.0, ballast.1
    );

    // The control: without the guard, the kernel kills the worker.
    let dir = temp_dir("ballast-unguarded");
    let mut off = a.clone();
    off.memory_guard = None;
    let run = run_with_growing_ballast("unguarded", &dir, &off, limit, ballast);
    assert!(
        run.oom_kills >= 1 && !run.status.success(),
        "without the guard the ballast must bring the kernel's OOM killer ({run_status:?}, {} kills): {}",
        run.oom_kills,
        run.stderr,
        run_status = run.status
    );
    eprintln!(
        "without the guard: {} OOM kill(s), {:?}, last step logged: {:?}",
        run.oom_kills,
        run.status,
        run.stderr
            .lines()
            .rfind(|l| l.contains(&format!("/{STEPS} loss ")))
    );
    let _ = std::fs::remove_dir_all(&dir);

    let dir = temp_dir("ballast-guarded");
    let run = run_with_growing_ballast("guarded", &dir, &a, limit, ballast);
    assert_eq!(run.oom_kills, 0, "the kernel killed: {}", run.stderr);
    assert!(run.status.success(), "{:?}: {}", run.status, run.stderr);
    let m = termination_message(&dir);
    assert_eq!(m.outcome, WorkerOutcome::Succeeded, "{m:?}");
    assert_eq!(m.step, Some(STEPS));
    eprintln!("with the guard: cgroup peak {} B of {limit} B", run.peak);
    for line in run.stderr.lines().filter(|l| {
        l.contains("memory guard: step") || l.contains("resumed") || l.contains("memory guard: ")
    }) {
        eprintln!("  {line}");
    }
    // The guard stopped a step after some were completed...
    let trip = run
        .stderr
        .lines()
        .find(|l| l.contains("memory guard: step "))
        .unwrap_or_else(|| panic!("no trip: {}", run.stderr));
    let tripped: u64 = trip
        .split("memory guard: step ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("the stopped step");
    assert!(tripped >= 3, "the trip came after step 2: {trip}");
    assert!(
        trip.contains(&format!("step {} checkpointed to", tripped - 1)),
        "the last completed step is kept: {trip}"
    );
    assert!(run.stderr.contains("stepping down in place"), "{trip}");
    // ...and the fresh process resumed from it: each step ran once.
    for step in 1..=STEPS {
        let lines = run
            .stderr
            .lines()
            .filter(|l| l.contains(&format!("step {step}/{STEPS} loss ")))
            .count();
        assert_eq!(
            lines, 1,
            "step {step} computed {lines} times: {}",
            run.stderr
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
