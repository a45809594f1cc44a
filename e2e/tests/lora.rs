//! LoRA and QLoRA on real pods (`make e2e`).
//!
//! A random 17-million-parameter Llama checkpoint (bf16 on disk, 16 blocks
//! of hidden 256: its block linears are most of its memory, which is what
//! quantizing a base saves) is served by the test kit's stand-in for the
//! Hugging Face hub.
//!
//! * A LoRA job pins settings whose dense fp32 base the kernel OOM-kills
//!   under its 85Mi limit; the retry ladder (only `quantizeBase` allowed)
//!   stores the base in int8 on attempt 2, which is evicted after a few
//!   steps; attempt 3 resumes the adapters from attempt 2's checkpoint,
//!   finishes, and writes a PEFT adapter (`adapter_config.json`,
//!   `adapter_model.safetensors` with PEFT's tensor names and shapes; that
//!   PEFT loads what the worker writes and gives its logits is checked
//!   against PEFT itself in worker/tests/lora_peft.rs and its fixtures).
//! * A QLoRA job on an int4 base succeeds on its first attempt.
//! * A LoRA job runs as two data-parallel replicas; replica 0 writes the
//!   adapter.
//! * Two LoRA jobs on the same base in one namespace download it once:
//!   the first into the shared model cache claim, the second reads that
//!   claim and makes no request to the hub.

use std::time::Duration;

use headroom_api::{AttemptOutcome, MemoryAwareTrainingJobStatus};
use headroom_e2e::checkpoint::RandomLlama;
use headroom_e2e::hub::{HubRepo, HubRepos, LocalHub};
use headroom_e2e::payload::{claim_output, final_loss, hub_host, load_claims};
use headroom_e2e::{E2E, TestNs, telemetry_step};
use headroom_planner::BaseFormat;
use kube::api::EvictParams;

const RUN: Duration = Duration::from_secs(600);
const REPO: &str = "headroom/random-llama-17m";
const MODEL: RandomLlama = RandomLlama {
    hidden: 256,
    intermediate: 1024,
    layers: 16,
    heads: 4,
    kv_heads: 4,
};
const RANK: usize = 8;

/// The hub stand-in serving a freshly written random checkpoint as `REPO`;
/// `test` names the directory it is written to (tests run in parallel).
fn hub(test: &str) -> LocalHub {
    let dir = std::env::temp_dir().join(format!("headroom-e2e-{test}-{}", std::process::id()));
    MODEL.write(&dir, 17).expect("random checkpoint");
    let mut repos = HubRepos::new();
    repos.insert(
        REPO.into(),
        HubRepo::from_dir(&dir).expect("checkpoint files"),
    );
    let _ = std::fs::remove_dir_all(&dir);
    LocalHub::start("0.0.0.0:0", repos)
}

/// A job on the random checkpoint: four 32-token samples a step, so a step
/// costs little CPU; `training` is the method-specific part.
fn job(name: &str, endpoint: &str, training: &str, limit: &str, extra: &str) -> String {
    format!(
        r#"apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata:
  name: {name}
spec:
  model:
    pretrained:
      # The hub stand-in serves plain HTTP on the node's address: opted in.
      huggingFace: {{repo: {REPO}, endpoint: "{endpoint}", allowInsecureHttp: true}}
      sequenceLength: 32
  data:
    volume: {{claimName: datasets, path: declaration-of-independence.jsonl}}
  training:
{training}
    globalBatch: 4
    steps: 12
    learningRate: 0.003
    checkpointEverySteps: 100
  resources:
    cpu: {{memoryLimit: {limit}, cores: 500m, maxWorkers: 1}}
    headroomFraction: 0.05
{extra}
  worker:
    image: localhost/headroom-worker:dev
"#
    )
}

/// The adapter the job wrote to its output: `adapter_config.json` and the
/// safetensors header of `adapter_model.safetensors`, read by a pod.
async fn written_adapter(
    ns: &TestNs,
    job: &str,
    status: &MemoryAwareTrainingJobStatus,
) -> (serde_json::Value, serde_json::Value, Vec<String>) {
    let output = status.output.clone().expect("status.output");
    let (claim, path) = output.split_once(':').expect("claim:path");
    let script = format!(
        "cd /claim/{path} && ls && echo '--config--' && cat adapter_config.json && echo && echo '--header--' \
         && n=$(od -An -t u8 -N8 adapter_model.safetensors | tr -d ' ') \
         && dd if=adapter_model.safetensors bs=1 skip=8 count=$n 2>/dev/null && echo"
    );
    let log = claim_output(ns, &format!("{job}-read-adapter"), claim, &script).await;
    let (listing, rest) = log
        .split_once("--config--")
        .unwrap_or_else(|| panic!("{log}"));
    let (config, header) = rest
        .split_once("--header--")
        .unwrap_or_else(|| panic!("{log}"));
    let config: serde_json::Value =
        serde_json::from_str(config.trim()).unwrap_or_else(|e| panic!("{e}: {log}"));
    let header: serde_json::Value =
        serde_json::from_str(header.trim()).unwrap_or_else(|e| panic!("{e}: {log}"));
    let files = listing.split_whitespace().map(String::from).collect();
    (config, header, files)
}

/// PEFT's names and shapes for rank-`RANK` adapters on q_proj and v_proj of
/// every block: `lora_A.weight` [r, d_in], `lora_B.weight` [d_out, r].
fn check_peft_adapter(config: &serde_json::Value, header: &serde_json::Value) {
    assert_eq!(config["peft_type"], "LORA", "{config}");
    assert_eq!(config["task_type"], "CAUSAL_LM", "{config}");
    assert_eq!(config["r"], RANK, "{config}");
    assert_eq!(config["lora_alpha"].as_f64(), Some(16.0), "{config}");
    let mut targets: Vec<&str> = config["target_modules"]
        .as_array()
        .expect("target_modules")
        .iter()
        .filter_map(|t| t.as_str())
        .collect();
    targets.sort_unstable();
    assert_eq!(targets, ["q_proj", "v_proj"], "{config}");
    let tensors = header
        .as_object()
        .expect("header")
        .keys()
        .filter(|k| *k != "__metadata__")
        .count();
    assert_eq!(tensors, 4 * MODEL.layers, "{header}");
    let (h, kv) = (MODEL.hidden, MODEL.kv_heads * MODEL.head_dim());
    for layer in 0..MODEL.layers {
        for (module, d_out) in [("q_proj", h), ("v_proj", kv)] {
            let name = |f: &str| {
                format!("base_model.model.model.layers.{layer}.self_attn.{module}.{f}.weight")
            };
            assert_eq!(
                header[name("lora_A")]["shape"],
                serde_json::json!([RANK, h]),
                "{header}"
            );
            assert_eq!(
                header[name("lora_B")]["shape"],
                serde_json::json!([d_out, RANK]),
                "{header}"
            );
        }
    }
}

/// Steps of the job that is evicted mid-run. An int8-base step takes 0.7–2 s
/// on the e2e node, so attempt 2 trains for well over 15 s: far longer than
/// the telemetry interval (1 s, `e2e/install.sh`) plus the eviction call,
/// which must land while it is still training.
const EVICTED_JOB_STEPS: u64 = 24;

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_lora_job_oom_killed_on_its_dense_base_retries_on_int8_and_resumes_its_adapters() {
    let ns = TestNs::new(E2E, "e2e-lora").await;
    let hub = hub("lora");
    let endpoint = hub.endpoint_on(&hub_host(&ns).await);
    load_claims(&ns, false).await;

    // Pinned: micro-batch 4 with checkpointing on a dense fp32 base under a
    // 68Mi limit; the ladder may only quantize the base. Measured without a
    // limit, the dense run holds 82-84 MiB of anonymous memory while it
    // trains (RssAnon; 124 MiB cgroup peak with file pages), so the kernel
    // kills it as it loads or in its first step. (At 85Mi it was a coin
    // toss: the kernel reclaimed file pages instead, training crawled on and
    // the kill came only while merging the adapter into the output, after
    // the last step.) The int8 retry peaks at 46 MiB of cgroup memory.
    let name = "lora-dense-then-int8";
    ns.apply_job(&job(
        name,
        &endpoint,
        "    method: lora\n    lora: {rank: 8, alpha: 16, targetModules: [q_proj, v_proj]}\n    microBatch: 4\n    activationCheckpointing: true",
        "68Mi",
        "  memoryPolicy: {maxAttempts: 4, backoffSeconds: 1, allowedRungs: [quantizeBase], guard: {enabled: false}}",
    )
    .replace("steps: 12", &format!("steps: {EVICTED_JOB_STEPS}")))
    .await;
    let running = ns
        .wait_job(name, "attempt 2 at step 3", RUN, |j| {
            telemetry_step(j, 2).is_some_and(|s| s >= 3)
        })
        .await;
    let reached = telemetry_step(&running, 2).expect("step");
    ns.pods()
        .evict(&format!("{name}-a2-s0"), &EvictParams::default())
        .await
        .expect("evict attempt 2's worker");

    let status = ns.wait_succeeded(name, RUN).await;
    assert_eq!(
        status.model.as_ref().map(|m| m.parameters),
        Some(MODEL.parameters())
    );
    let outcomes: Vec<AttemptOutcome> = status.attempts.iter().map(|a| a.outcome).collect();
    assert_eq!(
        outcomes,
        [
            AttemptOutcome::HostOutOfMemory,
            AttemptOutcome::Disrupted,
            AttemptOutcome::Succeeded
        ],
        "{:#?}",
        status.attempts
    );
    let formats: Vec<BaseFormat> = status
        .attempts
        .iter()
        .map(|a| a.settings.base_format)
        .collect();
    assert_eq!(
        formats,
        [BaseFormat::Dense, BaseFormat::Int8, BaseFormat::Int8],
        "only the base format changes"
    );
    for attempt in &status.attempts {
        let s = &attempt.settings;
        assert_eq!((s.micro_batch, s.activation_checkpointing), (4, true));
    }
    let plan = status.plan.as_ref().expect("status.plan");
    assert_eq!(plan.adapters.as_ref().map(|a| a.rank), Some(8));
    assert_eq!(status.attempts[2].last_step, Some(EVICTED_JOB_STEPS));
    let resumed = ns
        .resumed_step()
        .await
        .expect("attempt 3's worker log says it resumed");
    assert!(
        resumed >= reached && resumed < EVICTED_JOB_STEPS,
        "resumed at step {resumed}; attempt 2 had reached step {reached}"
    );
    let loss = final_loss(&status);
    assert!(loss.is_finite() && loss < 512f64.ln(), "loss {loss}");

    let (config, header, files) = written_adapter(&ns, name, &status).await;
    check_peft_adapter(&config, &header);
    assert!(
        !files.iter().any(|f| f == "merged"),
        "no merged weights over a quantized base: {files:?}"
    );
    ns.cleanup().await;
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_qlora_job_on_the_default_nf4_base_succeeds_first_time() {
    let ns = TestNs::new(E2E, "e2e-qlora").await;
    let hub = hub("qlora");
    let endpoint = hub.endpoint_on(&hub_host(&ns).await);
    load_claims(&ns, false).await;

    // No baseFormat: a qlora job starts from nf4, as PEFT's QLoRA does.
    let name = "qlora-nf4";
    ns.apply_job(&job(
        name,
        &endpoint,
        "    method: qlora\n    lora: {rank: 8, alpha: 16, targetModules: [q_proj, v_proj]}",
        "200Mi",
        "  memoryPolicy: {maxAttempts: 2, backoffSeconds: 1}",
    ))
    .await;
    let status = ns.wait_succeeded(name, RUN).await;
    let outcomes: Vec<AttemptOutcome> = status.attempts.iter().map(|a| a.outcome).collect();
    assert_eq!(
        outcomes,
        [AttemptOutcome::Succeeded],
        "{:#?}",
        status.attempts
    );
    assert_eq!(status.attempts[0].settings.base_format, BaseFormat::Nf4);
    let loss = final_loss(&status);
    assert!(loss.is_finite() && loss < 512f64.ln(), "loss {loss}");
    let (config, header, _) = written_adapter(&ns, name, &status).await;
    check_peft_adapter(&config, &header);
    ns.cleanup().await;
}

/// LoRA with data-parallel replicas, the common case: two replicas fine-tune
/// the dense base together (each half of every step's samples, the adapters'
/// gradients summed over the ring, their optimizer state sharded), and the
/// adapter is written once, by replica 0.
#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_lora_job_trains_as_two_replicas_and_writes_one_adapter() {
    let ns = TestNs::new(E2E, "e2e-lora-dp").await;
    let hub = hub("lora-dp");
    let endpoint = hub.endpoint_on(&hub_host(&ns).await);
    load_claims(&ns, false).await;

    let name = "lora-replicas";
    let manifest = job(
        name,
        &endpoint,
        "    method: lora\n    lora: {rank: 8, alpha: 16, targetModules: [q_proj, v_proj]}\n    dataParallelReplicas: 2",
        "200Mi",
        "  memoryPolicy: {maxAttempts: 2, backoffSeconds: 1}",
    )
    .replace("maxWorkers: 1}", "maxWorkers: 2}");
    assert!(manifest.contains("maxWorkers: 2}"), "job() changed");
    ns.apply_job(&manifest).await;
    let status = ns.wait_succeeded(name, RUN).await;
    let outcomes: Vec<AttemptOutcome> = status.attempts.iter().map(|a| a.outcome).collect();
    assert_eq!(
        outcomes,
        [AttemptOutcome::Succeeded],
        "{:#?}",
        status.attempts
    );
    let plan = status.plan.as_ref().expect("status.plan");
    assert_eq!((plan.stage_count(), plan.replicas, plan.workers), (1, 2, 2));
    assert_eq!(plan.adapters.as_ref().map(|a| a.rank), Some(8));
    // Both replicas trained and reported; the attempt ran to the last step.
    let reports: Vec<_> = status.workers.iter().filter(|w| w.attempt == 1).collect();
    assert_eq!(reports.len(), 2, "{reports:#?}");
    for w in &reports {
        assert!(w.step > 0 && w.memory.peak_bytes > 0, "{w:?}");
    }
    assert_eq!(status.attempts[0].last_step, Some(12));
    let loss = final_loss(&status);
    assert!(loss.is_finite() && loss < 512f64.ln(), "loss {loss}");
    let (config, header, _) = written_adapter(&ns, name, &status).await;
    check_peft_adapter(&config, &header);
    ns.cleanup().await;
}

/// The shared model cache (docs/model-cache.md): a second LoRA job on the
/// base a first one downloaded reads the first's cache claim, read-only;
/// the hub stand-in sees no request from it, and neither job's own claim
/// is sized for the model.
#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_second_lora_job_on_the_same_base_downloads_nothing() {
    let ns = TestNs::new(E2E, "e2e-lora-cache").await;
    let hub = hub("lora-cache");
    let endpoint = hub.endpoint_on(&hub_host(&ns).await);
    load_claims(&ns, false).await;
    let lora = "    method: lora\n    lora: {rank: 8, alpha: 16, targetModules: [q_proj, v_proj]}";
    let policy = "  memoryPolicy: {maxAttempts: 3, backoffSeconds: 1}";

    ns.apply_job(&job("cache-first", &endpoint, lora, "300Mi", policy))
        .await;
    let first = ns.wait_succeeded("cache-first", RUN).await;
    let cache = first
        .model_cache
        .clone()
        .expect("a LoRA job reads the shared model cache");
    let served: Vec<_> = hub
        .take_requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.starts_with("/cdn/"))
        .collect();
    assert!(!served.is_empty(), "the first job downloads the weights");

    ns.apply_job(&job("cache-second", &endpoint, lora, "300Mi", policy))
        .await;
    let second = ns.wait_succeeded("cache-second", RUN).await;
    assert_eq!(second.model_cache.as_ref(), Some(&cache), "one copy");
    // One question, no file: which commit `main` names now (the same as
    // the claim's, so the copy is read).
    let asked: Vec<_> = hub.take_requests().into_iter().map(|r| r.path).collect();
    assert!(
        asked.len() == 1 && asked[0].starts_with(&format!("/api/models/{REPO}/revision/main")),
        "the second job asked the hub for {asked:?}"
    );
    for status in [&first, &second] {
        let disk = status
            .plan
            .as_ref()
            .and_then(|p| p.disk.as_ref())
            .expect("status.plan.disk");
        assert_eq!(disk.model_bytes, 0, "the model is on the cache claim");
        let loss = final_loss(status);
        assert!(loss.is_finite() && loss < 512f64.ln(), "loss {loss}");
    }
    let claim: k8s_openapi::api::core::v1::PersistentVolumeClaim =
        kube::Api::namespaced(ns.client.clone(), &ns.name)
            .get(&cache)
            .await
            .expect("the cache claim");
    assert_eq!(
        claim
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get("headroom.dev/cache-state"))
            .map(String::as_str),
        Some("ready")
    );
    ns.cleanup().await;
}
