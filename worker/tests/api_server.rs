//! Telemetry reaches `status.workers[<pod>]` of a job on a real kube-apiserver
//! (the e2e control-plane harness), written by the worker binary itself with
//! its own field manager; two workers keep their own entries.
//!
//! Ignored by plain `cargo test`. Run with the control plane up:
//!   e2e/cluster/controlplane.sh up
//!   KUBECONFIG=~/.cache/headroom/state/controlplane/kubeconfig \
//!     cargo test -p headroom-worker --test api_server -- --ignored --test-threads=1

use std::process::Command;

use headroom_api::{
    CHECKPOINT_DIR_ENV, MemoryAwareTrainingJob, PLAN_JSON_ENV, POD_NAME_ENV,
    TELEMETRY_INTERVAL_ENV, WorkerAssignment, exit_code,
};
use headroom_e2e::fixtures::CPU_TINY;
use headroom_e2e::{API_SERVER, TestNs};
use headroom_planner::Inventory;
use headroom_worker::run::TERMINATION_MESSAGE_PATH_ENV;

/// The sample CPU job under `name`, shrunk so the worker trains it in seconds.
async fn create_job(ns: &TestNs, name: &str) -> MemoryAwareTrainingJob {
    let mut job: MemoryAwareTrainingJob = serde_yaml::from_str(CPU_TINY).expect("sample parses");
    job.metadata.name = Some(name.into());
    let t = job
        .spec
        .model
        .transformer
        .as_mut()
        .expect("transformer sample");
    (t.layers, t.hidden, t.heads, t.sequence_length, t.vocabulary) = (2, 32, 4, 16, 32);
    job.spec.training.global_batch = 4;
    job.spec.training.steps = 30;
    ns.apply(job).await
}

fn assignment(job: &MemoryAwareTrainingJob) -> WorkerAssignment {
    let req = job.spec.job_request().expect("valid spec");
    WorkerAssignment {
        job: job.metadata.name.clone().expect("name"),
        namespace: job.metadata.namespace.clone().expect("namespace"),
        attempt: 1,
        stage: 0,
        model: req.model.clone(),
        plan: headroom_planner::plan(&req, &Inventory::default()).expect("plan"),
        steps: job.spec.training.steps,
        learning_rate: job.spec.training.learning_rate,
        checkpoint_every_steps: job.spec.training.checkpoint_every_steps,
        seed: job.spec.training.seed,
        files: None,
    }
}

fn run_worker(assignment: &WorkerAssignment, pod: &str) -> std::process::Output {
    let dir = std::env::temp_dir().join(format!("headroom-api-{pod}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("tmp");
    let out = Command::new(env!("CARGO_BIN_EXE_headroom-worker"))
        .env(
            PLAN_JSON_ENV,
            serde_json::to_string(assignment).expect("json"),
        )
        .env(CHECKPOINT_DIR_ENV, dir.join("checkpoints"))
        .env(TERMINATION_MESSAGE_PATH_ENV, dir.join("termination-log"))
        .env(POD_NAME_ENV, pod)
        .env(TELEMETRY_INTERVAL_ENV, "0.2")
        .output()
        .expect("run the worker");
    let _ = std::fs::remove_dir_all(&dir);
    out
}

#[tokio::test]
#[ignore = "needs the control plane"]
async fn telemetry_reaches_the_job_status_with_the_workers_own_field_manager() {
    let ns = TestNs::new(API_SERVER, "hr-telemetry").await;
    let job = create_job(&ns, "telemetry-tiny").await;
    let a = assignment(&job);

    let pods = ["telemetry-tiny-a1-s0", "telemetry-tiny-a1-s0-twin"];
    for pod in pods {
        let a = a.clone();
        let out = tokio::task::spawn_blocking(move || run_worker(&a, pod))
            .await
            .expect("join");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(exit_code::SUCCESS), "{stderr}");
        assert!(!stderr.contains("telemetry not written"), "{stderr}");
    }

    let stored = ns.jobs().get_status("telemetry-tiny").await.expect("job");
    let status = stored.status.expect("status written");
    for pod in pods {
        let entry = status
            .workers
            .iter()
            .find(|w| w.name == pod)
            .unwrap_or_else(|| panic!("no status.workers entry for {pod}: {:?}", status.workers));
        assert_eq!(entry.step, a.steps, "the final write carries the last step");
        assert_eq!(
            (
                entry.attempt,
                entry.stage,
                entry.layer_start,
                entry.layer_end
            ),
            (1, 0, 0, 2)
        );
        assert!(entry.loss.is_some_and(f64::is_finite));
        assert!(entry.tokens_per_second.is_some_and(|t| t > 0.0));
        assert!(entry.memory.peak_bytes > 1 << 20, "{:?}", entry.memory);
        assert!(entry.memory.process_rss_bytes.is_some());
    }
    let managers: Vec<String> = stored
        .metadata
        .managed_fields
        .unwrap_or_default()
        .into_iter()
        .filter_map(|m| m.manager)
        .collect();
    for pod in pods {
        let manager = format!("headroom-worker/{pod}");
        assert!(managers.contains(&manager), "{manager} not in {managers:?}");
    }
    ns.cleanup().await;
}
