//! Fine-tuning a real (tiny) Hugging Face checkpoint on real pods (`make e2e`).
//!
//! From a claim: the transformers-made tiny-llama and the public-domain
//! sample text are put on claims, `samples/cpu-finetune-tiny-llama.yaml` is
//! applied, the initializer reads them, the worker trains (the loss falls)
//! and writes the fine-tuned model; a second job fine-tunes *that output*
//! over two pipeline stages, each writing its part; a third job's
//! initializer then proves in the cluster that what the two stages wrote is
//! one complete checkpoint of the same model (every tensor, shape and dtype
//! against config.json).
//!
//! From the hub: the same checkpoint served by the test kit's stand-in for
//! the Hugging Face hub, which an initializer pod reaches over the node's
//! address (`HF_ENDPOINT`-style `endpoint`); the job's pinned settings are
//! OOM-killed by the kernel on attempt 1, attempt 2 runs stricter and is
//! evicted, attempt 3 resumes from attempt 2's checkpoint and finishes; the
//! weights were downloaded once.
//!
//! Not only Llama: the transformers-made tiny Qwen3 (q/k norms, a head_dim
//! that is not hidden / heads) from the hub stand-in is fine-tuned, and a
//! second job's initializer and worker load what it wrote.

use std::time::Duration;

use headroom_api::{AttemptOutcome, JobPhase, MemoryAwareTrainingJobStatus};
use headroom_e2e::fixtures::{CPU_FINETUNE as FINETUNE, workspace_root};
use headroom_e2e::hub::{HubRepo, HubRepos, LocalHub};
use headroom_e2e::payload::{TINY_LLAMA, final_loss, hub_host, load_claims};
use headroom_e2e::{E2E, TestNs, telemetry_step};
use headroom_planner::LlamaArchitecture;
use kube::api::EvictParams;

const RUN: Duration = Duration::from_secs(600);

/// samples/cpu-finetune-tiny-llama.yaml with half a core requested per
/// worker, so a two-stage job and the suite's other workers share the
/// 2-core node instead of waiting for each other.
fn finetune() -> String {
    let manifest = FINETUNE.replace("cores: \"1\"", "cores: 500m");
    assert!(
        manifest.contains("cores: 500m"),
        "samples/cpu-finetune-tiny-llama.yaml changed"
    );
    manifest
}
const FIXTURE: &str = TINY_LLAMA;
/// Parameters of the tiny-llama fixture.
const PARAMETERS: u64 = 214_592;

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_hugging_face_checkpoint_is_fine_tuned_and_its_output_is_a_checkpoint_again() {
    let ns = TestNs::new(E2E, "e2e-finetune").await;
    load_claims(&ns, true).await;

    ns.apply_job(&finetune()).await;
    let status = ns.wait_succeeded("finetune-tiny-llama", RUN).await;
    let model = status
        .model
        .as_ref()
        .expect("status.model from the initializer");
    assert_eq!(model.parameters, PARAMETERS);
    assert_eq!(model.dtype, "F32");
    let data = status.data.as_ref().expect("status.data");
    assert!(data.samples > 0 && data.tokens > data.samples, "{data:?}");
    let last = status.attempts.last().expect("an attempt");
    assert_eq!(last.outcome, AttemptOutcome::Succeeded);
    assert_eq!(
        status.output.as_deref(),
        Some("finetune-tiny-llama-checkpoints:output")
    );
    // transformers initialises the fixture near uniform (initializer_range
    // 0.02): its loss starts at about ln(vocabulary) = ln 512 ≈ 6.24.
    let loss = final_loss(&status);
    let uniform = 512f64.ln();
    assert!(
        loss < 0.8 * uniform,
        "after 30 steps the loss is {loss:.3}, not below 0.8 × ln 512 = {:.3}",
        0.8 * uniform
    );

    // The output, fine-tuned again over two pipeline stages: each stage
    // writes its part of the model.
    let two_stages = finetune()
        .replace("name: finetune-tiny-llama", "name: finetune-two-stages")
        .replace(
            "volume: {claimName: models, path: tiny-llama}",
            "volume: {claimName: finetune-tiny-llama-checkpoints, path: output}",
        )
        .replace("steps: 30", "steps: 4\n    pipelineStages: 2")
        .replace("maxWorkers: 1", "maxWorkers: 2");
    assert!(two_stages.contains("pipelineStages: 2") && two_stages.contains("maxWorkers: 2"));
    ns.apply_job(&two_stages).await;
    let status = ns.wait_succeeded("finetune-two-stages", RUN).await;
    assert_eq!(
        status.model.as_ref().map(|m| m.parameters),
        Some(PARAMETERS)
    );
    let plan = status.plan.as_ref().expect("status.plan");
    let ranges: Vec<(u32, u32)> = plan
        .stages
        .iter()
        .map(|s| (s.layer_start, s.layer_end))
        .collect();
    assert_eq!(ranges, [(0, 2), (2, 4)], "{plan:?}");

    // What the two stages wrote, read back by a third job's initializer, is
    // one complete checkpoint of the same model.
    let again = finetune()
        .replace("name: finetune-tiny-llama", "name: finetune-again")
        .replace(
            "volume: {claimName: models, path: tiny-llama}",
            "volume: {claimName: finetune-two-stages-checkpoints, path: output}",
        )
        .replace("steps: 30", "steps: 2");
    ns.apply_job(&again).await;
    let status = ns.wait_succeeded("finetune-again", RUN).await;
    assert_eq!(status.phase, Some(JobPhase::Succeeded));
    assert_eq!(
        status.model.as_ref().map(|m| m.parameters),
        Some(PARAMETERS),
        "the two stages' output is a complete checkpoint of the same model"
    );
    ns.cleanup().await;
}

/// A job that downloads the tiny-llama from the hub stand-in at `endpoint`,
/// with settings pinned far over its 200Mi limit: micro-batch 64 of 256
/// tokens without checkpointing.
fn hub_job(endpoint: &str) -> String {
    format!(
        r#"apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata:
  name: hub-oom-then-fit
spec:
  model:
    pretrained:
      # The hub stand-in serves plain HTTP on the node's address: opted in.
      huggingFace: {{repo: headroom/tiny-llama, endpoint: "{endpoint}", allowInsecureHttp: true}}
      sequenceLength: 256
  data:
    volume: {{claimName: datasets, path: declaration-of-independence.jsonl}}
  training:
    globalBatch: 64
    microBatch: 64
    activationCheckpointing: false
    steps: 24
    learningRate: 0.003
    checkpointEverySteps: 100
  resources:
    cpu: {{memoryLimit: 200Mi, cores: 500m, maxWorkers: 1}}
    headroomFraction: 0.1
  # The guard off: this scenario is the kernel's kill path.
  memoryPolicy: {{maxAttempts: 4, backoffSeconds: 1, guard: {{enabled: false}}}}
  # No image: the operator's default for flex jobs (install.sh sets the
  # chart's workerImages.cpu to localhost/headroom-worker:dev).
  worker: {{}}
"#
    )
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_checkpoint_from_the_hub_is_oom_killed_then_fits_and_resumes_after_an_eviction() {
    let ns = TestNs::new(E2E, "e2e-hub").await;
    let mut repos = HubRepos::new();
    repos.insert(
        "headroom/tiny-llama".into(),
        HubRepo::from_dir(&workspace_root().join(FIXTURE)).expect("fixture files"),
    );
    let hub = LocalHub::start("0.0.0.0:0", repos);
    let endpoint = hub.endpoint_on(&hub_host(&ns).await);
    load_claims(&ns, false).await;

    ns.apply_job(&hub_job(&endpoint)).await;
    // Attempt 1 runs the pinned settings and is OOM-killed; attempt 2 runs
    // stricter. Evict it once it has trained a few steps: it saves a
    // checkpoint on SIGTERM, and attempt 3 resumes from it.
    let running = ns
        .wait_job("hub-oom-then-fit", "attempt 2 at step 3", RUN, |j| {
            telemetry_step(j, 2).is_some_and(|s| s >= 3)
        })
        .await;
    let reached = telemetry_step(&running, 2).expect("step");
    ns.pods()
        .evict("hub-oom-then-fit-a2-s0", &EvictParams::default())
        .await
        .expect("evict attempt 2's worker");

    let status = ns.wait_succeeded("hub-oom-then-fit", RUN).await;
    assert_eq!(
        status.model.as_ref().map(|m| m.parameters),
        Some(PARAMETERS)
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
    let (first, second) = (&status.attempts[0], &status.attempts[1]);
    assert!(
        second.settings.micro_batch < first.settings.micro_batch
            || second.settings.activation_checkpointing,
        "attempt 2 runs stricter: {first:?} then {second:?}"
    );
    assert_eq!(status.attempts[2].last_step, Some(24));
    let resumed = ns
        .resumed_step()
        .await
        .expect("attempt 3's worker log says it resumed");
    assert!(
        resumed >= reached && resumed < 24,
        "resumed at step {resumed}; attempt 2 had reached step {reached}"
    );
    assert!(final_loss(&status) < 0.8 * 512f64.ln());

    // The initializer ran once, before attempt 1: the weights came from the
    // CDN once, whatever happened to the attempts after.
    let requests = hub.take_requests();
    let weights = requests
        .iter()
        .filter(|r| {
            r.method == "GET"
                && r.path.ends_with("/model.safetensors")
                && r.path.starts_with("/cdn/")
        })
        .count();
    assert_eq!(weights, 1, "{requests:#?}");
    ns.cleanup().await;
}

/// The transformers-made tiny Qwen3 (weights and config), served with a
/// character tokenizer whose 96 ids fit its vocabulary.
const QWEN3: &str = "worker/tests/fixtures/llama/qwen3-gqa-tied";
const QWEN3_TOKENIZER: &str = "e2e/testdata/qwen3-tokenizer";
/// Parameters of the tiny Qwen3 (tied head).
const QWEN3_PARAMETERS: u64 = 26_336;

/// A job fine-tuning the tiny Qwen3 from `model` on the sample text.
fn qwen3_job(name: &str, model: &str, steps: u32) -> String {
    format!(
        r#"apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata:
  name: {name}
spec:
  model:
    pretrained:
      {model}
      sequenceLength: 64
  data:
    volume: {{claimName: datasets, path: declaration-of-independence.jsonl}}
  training:
    globalBatch: 8
    steps: {steps}
    learningRate: 0.01
    checkpointEverySteps: 100
  resources:
    cpu: {{memoryLimit: 1Gi, cores: 500m, maxWorkers: 1}}
  # No image: the operator's default for flex jobs.
  worker: {{}}
"#
    )
}

#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_qwen3_checkpoint_from_the_hub_is_fine_tuned_and_its_output_reloads() {
    let ns = TestNs::new(E2E, "e2e-qwen3").await;
    let root = workspace_root();
    let mut repo = HubRepo::from_dir(&root.join(QWEN3)).expect("fixture files");
    let tokenizer = HubRepo::from_dir(&root.join(QWEN3_TOKENIZER)).expect("tokenizer files");
    repo.files.extend(tokenizer.files);
    let mut repos = HubRepos::new();
    repos.insert("headroom/tiny-qwen3".into(), repo);
    let hub = LocalHub::start("0.0.0.0:0", repos);
    let endpoint = hub.endpoint_on(&hub_host(&ns).await);
    load_claims(&ns, false).await;

    let from_hub = format!(
        r#"huggingFace: {{repo: headroom/tiny-qwen3, endpoint: "{endpoint}", allowInsecureHttp: true}}"#
    );
    ns.apply_job(&qwen3_job("qwen3-from-hub", &from_hub, 30))
        .await;
    let status = ns.wait_succeeded("qwen3-from-hub", RUN).await;
    let qwen3 = |status: &MemoryAwareTrainingJobStatus| {
        let model = status.model.as_ref().expect("status.model");
        (model.shape.architecture, model.parameters)
    };
    assert_eq!(qwen3(&status), (LlamaArchitecture::Qwen3, QWEN3_PARAMETERS));
    assert_eq!(
        status.output.as_deref(),
        Some("qwen3-from-hub-checkpoints:output")
    );
    // Near uniform at first (initializer_range 0.02): ln 96 ≈ 4.56; 2.5
    // after 30 steps.
    let uniform = 96f64.ln();
    let loss = final_loss(&status);
    assert!(
        loss < 0.8 * uniform,
        "after 30 steps the loss is {loss:.3}, not below 0.8 × ln 96 = {:.3}",
        0.8 * uniform
    );

    // What it wrote is a Qwen3 checkpoint again: the next job's initializer
    // checks every tensor (q_norm and k_norm included) against config.json,
    // and its worker loads and trains it.
    let output = "volume: {claimName: qwen3-from-hub-checkpoints, path: output}";
    ns.apply_job(&qwen3_job("qwen3-reloaded", output, 2)).await;
    let status = ns.wait_succeeded("qwen3-reloaded", RUN).await;
    assert_eq!(qwen3(&status), (LlamaArchitecture::Qwen3, QWEN3_PARAMETERS));
    // The fine-tuned weights, not a fresh model's (which starts at ≈ ln 96).
    let reloaded = final_loss(&status);
    assert!(
        reloaded < 0.8 * uniform,
        "the reloaded model's loss is {reloaded:.3}, not below 0.8 × ln 96"
    );
    ns.cleanup().await;
}

/// A dataset card as `push_to_hub` writes one: the split's files by pattern.
const CHAT_CARD: &str = "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n  - split: test\n    path: data/test-*\n---\n# Conversations\n";
/// A ChatML template (as Qwen's checkpoints carry one).
const CHATML: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

/// A chat fine-tune as people bring one: the tiny Llama with a ChatML
/// template, and a conversational dataset in the hub's layout (a card whose
/// `configs` name each split's Parquet shards), both from the hub stand-in;
/// the job names the dataset by `split` and trains on the assistant turns.
/// The initializer downloads the card and the train shard (not the test
/// split), reports the share of masked targets, and the worker trains.
#[tokio::test]
#[ignore = "needs a cluster with Headroom installed: make e2e"]
async fn a_chat_model_is_fine_tuned_on_the_assistant_turns_of_a_parquet_split_from_the_hub() {
    let ns = TestNs::new(E2E, "e2e-chat").await;
    let root = workspace_root();
    let mut model = HubRepo::from_dir(&root.join(FIXTURE)).expect("fixture files");
    let config =
        serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHATML});
    model.files.insert(
        "tokenizer_config.json".into(),
        config.to_string().into_bytes(),
    );
    let parquet = std::fs::read(root.join("worker/tests/fixtures/chat/conversations.parquet"))
        .expect("conversations.parquet");
    let dataset = HubRepo {
        files: [
            ("README.md", CHAT_CARD.as_bytes().to_vec()),
            ("data/train-00000-of-00001.parquet", parquet.clone()),
            ("data/test-00000-of-00001.parquet", parquet),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect(),
        token: None,
    };
    let mut repos = HubRepos::new();
    repos.insert("headroom/tiny-chat".into(), model);
    repos.insert("datasets/headroom/chats".into(), dataset);
    let hub = LocalHub::start("0.0.0.0:0", repos);
    let endpoint = hub.endpoint_on(&hub_host(&ns).await);
    let job = format!(
        r#"apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata:
  name: chat-from-hub
spec:
  model:
    pretrained:
      huggingFace: {{repo: headroom/tiny-chat, endpoint: "{endpoint}", allowInsecureHttp: true}}
      sequenceLength: 32
  data:
    huggingFace: {{repo: headroom/chats, split: train, endpoint: "{endpoint}", allowInsecureHttp: true}}
    format: parquet
    trainOn: assistant
  training:
    globalBatch: 4
    steps: 4
    learningRate: 0.003
    checkpointEverySteps: 100
  resources:
    cpu: {{memoryLimit: 1Gi, cores: 500m, maxWorkers: 1}}
  worker: {{}}
"#
    );
    ns.apply_job(&job).await;
    let status = ns.wait_succeeded("chat-from-hub", RUN).await;
    let data = status.data.as_ref().expect("status.data");
    // The user turns and the template's headers are masked, the replies not.
    assert!(
        data.masked_per_mille > 0 && data.masked_per_mille < 1000,
        "{data:?}"
    );
    assert!(final_loss(&status).is_finite());
    let requests = hub.take_requests();
    let got = |file: &str| {
        requests
            .iter()
            .filter(|r| {
                r.method == "GET"
                    && r.path.starts_with("/datasets/headroom/chats/resolve/")
                    && r.path.ends_with(file)
            })
            .count()
    };
    assert_eq!(got("/README.md"), 1, "{requests:#?}");
    assert_eq!(
        got("/data/train-00000-of-00001.parquet"),
        1,
        "{requests:#?}"
    );
    assert_eq!(got("/data/test-00000-of-00001.parquet"), 0, "{requests:#?}");
    ns.cleanup().await;
}
