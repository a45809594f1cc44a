//! Calibration bench: the planner's predicted peak against the measured peak
//! of real worker processes on the CPU (flex) backend.
//!
//! For each configuration of a grid (model size, sequence length,
//! micro-batch, accumulation, checkpointing, optimizer, tied/untied head; GPT
//! rows and Llama-family rows: grouped-query vs multi-head attention, SwiGLU
//! widths),
//! this binary re-runs itself as a worker (`--worker`, the same code path as
//! `headroom-worker`: `headroom_worker::run::run`) for a few steps, with a
//! checkpoint at the end as in production, and reads the process's peak
//! resident bytes (VmHWM) from its termination message. It prints a table,
//! the median absolute error and the worst under-prediction, and exits 1 when
//! the targets are missed (median |error| ≤ 5 %, no under-prediction beyond
//! the default 10 % headroom).
//!
//! A Llama row is a fine-tuning worker as in production: the bench writes a
//! randomly initialised Hugging Face checkpoint of the row's shape (config.json,
//! model.safetensors, the tiny-llama fixture's tokenizer) and a generated text
//! file into a temporary directory and names them in the assignment's
//! `files`, so the worker loads the checkpoint, tokenizes and packs the text,
//! trains, checkpoints and writes the trained model back out.
//!
//! LoRA rows: the Lq model with rank-8 adapters on q,v or on all
//! seven block linears, over a dense base (LoRA) and an int8 or int4 base
//! (QLoRA, block 64; flex stores int4 one byte a value), checkpointing off
//! (b 4) and on (b 16, where training rather than the checkpoint load
//! peaks), planned with the adapters and base format as the operator plans
//! a LoRA job. 8-bit AdamW rows: full fine-tuning and LoRA. Set
//! `CALIBRATE_BREAKDOWN=1` to print each row's predicted components;
//! `CALIBRATE_GUARD=1` runs every row with the near-OOM guard on and prints
//! its checks' share of each row's time and the median.
//!
//! Pipeline and replica rows: a GPT model split over p = 2 and 3 stages and
//! run as d = 2 and 4 ZeRO-1 replicas and 2 × 2, a Llama model and the Lq
//! QLoRA int8 model over p = 2 and d = 2, each worker a process talking to
//! its neighbours over loopback TCP; every worker's peak is compared with
//! the planner's per-stage prediction (the first stage's in-flight
//! micro-batches and the largest optimizer shard included). Then tokens/s of p = 1, 2, 3 on
//! that model, with the bubble the 1F1B schedule implies.
//!
//! Then it measures the step-time cost of telemetry: the same training steps
//! with and without the sampling/reporting thread.
//!
//! `--backend cuda` (a CUDA build, on an NVIDIA GPU; `gpu.rs`, run by
//! `make gpu-check`) runs a GPU grid of bf16 Llama models instead and
//! compares with the CUDA profile. `--backend wgpu` (a wgpu build, on any
//! Vulkan device; `vulkan.rs`, run by `make wgpu-check`) runs gpu-check's
//! rows that need no CUDA: a smoke run and the ops check. `--step-breakdown`
//! (`step_breakdown.rs`) times a full, LoRA and QLoRA step's phases, on
//! flex or, with `--backend cuda`, on the GPU.
//!
//! Usage (release build; debug figures are meaningless):
//!   cargo run --release -p headroom-worker --bin calibrate -- [--backend flex|cuda|wgpu [--large]] [--steps N] [--only NAME] [--skip-pipeline | --pipeline-only] [--skip-overhead | --overhead-only]

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use burn::tensor::Device;
use headroom_api::{
    CHECKPOINT_DIR_ENV, DataFormat, MALLOC_ARENA_MAX_ENV, MALLOC_TUNABLES_ENV, PEER_KEY_ENV,
    PIPELINE_ADDRESSES_ENV, PLAN_JSON_ENV, POD_NAME_ENV, PayloadFiles, REPLICA_ADDRESSES_ENV,
    TerminationMessage, WORKER_MALLOC_ARENAS, WORKER_MALLOC_TUNABLES, WorkerAssignment,
};
use headroom_planner::backend::{BackendProfile, FLEX};
use headroom_planner::memory::{MemoryBreakdown, StagePlacement, estimate_stage};
use headroom_planner::search::plan_with;
use headroom_planner::{
    BaseFormat, Inventory, JobRequest, LlamaShape, LoraConfig, ModelShape, Optimizer, Precision,
    RetryRung, SearchOptions, Target, TargetModule, TransformerShape,
};
use headroom_worker::ValidAssignment;
use headroom_worker::memory_probe::MemoryProbe;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::lora::BLOCK_LINEARS;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm};
use headroom_worker::report::{MemorySink, Progress, Reporter, WorkerIdentity, WritePolicy};
use headroom_worker::run::TERMINATION_MESSAGE_PATH_ENV;
use headroom_worker::train::Trainer;

mod gpu;
mod step_breakdown;
#[cfg(feature = "wgpu")]
mod vulkan;

const MIB: f64 = 1024.0 * 1024.0;
/// The calibration targets: a 10 % under-prediction bound (the default
/// headroom) and a median error of 5 %.
const MEDIAN_TARGET: f64 = 0.05;
const UNDER_TARGET: f64 = 0.10;

#[derive(Clone, Debug)]
struct Case {
    name: &'static str,
    /// A GPT `transformer` (random weights from the seed) or a Llama-family
    /// model (fine-tuned from a random checkpoint the bench writes).
    model: ModelShape,
    micro_batch: u32,
    accumulation: u32,
    checkpointing: bool,
    optimizer: Optimizer,
    /// LoRA adapters on the frozen base (`None`: full fine-tuning).
    adapters: Option<LoraConfig>,
    /// How the frozen base is stored (QLoRA: int8/int4; dense otherwise).
    base_format: BaseFormat,
    /// Fp32 on flex (its only precision); bf16 in the CUDA grid.
    precision: Precision,
    /// Offloaded checkpoints (CUDA grid only: on flex the host is the
    /// device, and the planner never offloads there).
    offload_activations: bool,
    /// The frozen embedding in host memory (CUDA grid only, LoRA rows).
    offload_embedding: bool,
    /// Each block's gradients to a host accumulator as backward makes them,
    /// the step on the host (CUDA grid only, full fine-tunes; with
    /// checkpointing and the optimizer offload, as the rung sets them).
    offload_gradients: bool,
}

impl Case {
    /// Full fine-tuning (no adapters) of a dense model.
    fn full(
        name: &'static str,
        model: &ModelShape,
        (micro_batch, accumulation): (u32, u32),
        checkpointing: bool,
        optimizer: Optimizer,
        precision: Precision,
    ) -> Case {
        Case {
            name,
            model: model.clone(),
            micro_batch,
            accumulation,
            checkpointing,
            optimizer,
            adapters: None,
            base_format: BaseFormat::Dense,
            precision,
            offload_activations: false,
            offload_embedding: false,
            offload_gradients: false,
        }
    }

    fn layers(&self) -> u32 {
        self.model.splittable_layers()
    }
}

fn shape(layers: u32, hidden: u32, heads: u32, seq: u32, vocab: u32, tied: bool) -> ModelShape {
    ModelShape::Transformer(TransformerShape {
        layers,
        hidden,
        heads,
        sequence_length: seq,
        vocabulary: vocab,
        feed_forward: None,
        tied_embeddings: tied,
    })
}

/// The Hugging Face `config.json` of a Llama model, f32 weights.
fn llama_config(
    layers: u32,
    hidden: u32,
    (heads, kv_heads): (u32, u32),
    intermediate: u32,
    vocab: u32,
    tied: bool,
) -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden / heads,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "attention_bias": false,
        "mlp_bias": false,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "float32",
    })
}

/// A Llama model as the planner reads it from that config.
fn llama(
    layers: u32,
    hidden: u32,
    heads: (u32, u32),
    intermediate: u32,
    seq: u32,
    vocab: u32,
    tied: bool,
) -> ModelShape {
    let config = llama_config(layers, hidden, heads, intermediate, vocab, tied);
    ModelShape::Llama(
        LlamaShape::from_hf_config(&config.to_string(), seq).expect("a valid Llama config"),
    )
}

/// The CPU grid: the full fine-tuning rows, then the LoRA and QLoRA rows.
fn grid() -> Vec<Case> {
    let c = |name, model: &ModelShape, b, acc, ckpt, opt| {
        Case::full(name, model, (b, acc), ckpt, opt, Precision::Fp32)
    };
    // LoRA rows: Lq, 25M parameters (h 512, GQA 8/2, SwiGLU 1408 = 22 × 64,
    // so the default QLoRA block of 64 divides every block linear), untied;
    // rank 8, alpha 16 on q,v or on all seven block linears.
    let lq = llama(6, 512, (8, 2), 1408, 128, 8192, false);
    let lora = |name, b, ckpt, opt, targets: &[TargetModule], format| Case {
        adapters: Some(lora_config(targets)),
        base_format: format,
        ..c(name, &lq, b, 1, ckpt, opt)
    };
    // The same with PEFT's common lora_dropout of 0.1.
    let dropped = |name, b, ckpt, targets: &[TargetModule], format| Case {
        adapters: Some(LoraConfig {
            dropout: 0.1,
            ..lora_config(targets)
        }),
        base_format: format,
        ..c(name, &lq, b, 1, ckpt, Adamw)
    };
    let lq2k = llama(6, 512, (8, 2), 1408, 2048, 8192, false);
    let lora2k = |name, ckpt, targets: &[TargetModule], format| Case {
        adapters: Some(lora_config(targets)),
        base_format: format,
        ..c(name, &lq2k, 1, 1, ckpt, Adamw)
    };
    use BaseFormat::{Dense, Int4, Int8, Nf4};
    use Optimizer::{Adamw, Adamw8bit};
    let qv = &[TargetModule::QProj, TargetModule::VProj][..];
    let all7 = &BLOCK_LINEARS[..];
    let mut cases = full_grid();
    cases.extend([
        lora("Lq lora qv b4", 4, false, Adamw, qv, Dense),
        lora("Lq lora qv b16 ckpt", 16, true, Adamw, qv, Dense),
        lora("Lq lora all7 b4", 4, false, Adamw, all7, Dense),
        lora("Lq lora all7 b16 ckpt", 16, true, Adamw, all7, Dense),
        lora("Lq qlora8 qv b4", 4, false, Adamw, qv, Int8),
        lora("Lq qlora8 qv b16 ckpt", 16, true, Adamw, qv, Int8),
        lora("Lq qlora8 all7 b4", 4, false, Adamw, all7, Int8),
        lora("Lq qlora8 all7 b16 ckpt", 16, true, Adamw, all7, Int8),
        lora("Lq qlora4 qv b4", 4, false, Adamw, qv, Int4),
        lora("Lq qlora4 qv b16 ckpt", 16, true, Adamw, qv, Int4),
        lora("Lq qlora4 all7 b4", 4, false, Adamw, all7, Int4),
        lora("Lq qlora4 all7 b16 ckpt", 16, true, Adamw, all7, Int4),
        dropped("Lq lora qv b4 drop", 4, false, qv, Dense),
        dropped("Lq lora all7 b4 drop", 4, false, all7, Dense),
        dropped("Lq nf4 all7 b16 ckpt drop", 16, true, all7, Nf4),
        lora("Lq nf4 qv b4", 4, false, Adamw, qv, Nf4),
        lora("Lq nf4 all7 b4", 4, false, Adamw, all7, Nf4),
        lora("Lq nf4 all7 b16 ckpt", 16, true, Adamw, all7, Nf4),
        lora("Lq lora all7 b4 8bit", 4, false, Adamw8bit, all7, Dense),
        lora2k("Lq lora all7 s2048", false, all7, Dense),
        lora2k("Lq qlora8 all7 s2048", false, all7, Int8),
        lora2k("Lq qlora4 all7 s2048 ckpt", true, all7, Int4),
        lora2k("Lq nf4 all7 s2048", false, all7, Nf4),
        lora2k("Lq nf4 all7 s2048 ckpt", true, all7, Nf4),
        lora(
            "Lq qlora8 all7 b16 ckpt 8bit",
            16,
            true,
            Adamw8bit,
            all7,
            Int8,
        ),
    ]);
    cases
}

/// The full fine-tuning rows: GPT and Llama shapes, every optimizer.
fn full_grid() -> Vec<Case> {
    let s = shape(2, 128, 4, 128, 1024, true);
    let m = shape(4, 256, 4, 256, 4096, true);
    let l = shape(6, 384, 6, 256, 8192, true);
    let attn = shape(4, 256, 8, 512, 2048, true);
    let wide = shape(2, 768, 12, 128, 16384, false);
    // A job once OOM-killed at micro-batch 1 with 8-bit AdamW.
    let i36 = shape(6, 384, 6, 256, 4096, true);
    // The first-fit bench's (make bench-first-fit) jobs measured furthest
    // from their plans: few layers, large micro-batches or vocabularies.
    let ff20 = shape(2, 512, 8, 128, 4096, true);
    let ff11 = shape(2, 512, 8, 64, 4096, true);
    // Wide and shallow at a large micro-batch: where burn's batched matmul
    // made each trained weight's gradient once per sample in backward
    // (measured 1233 MiB against 903 predicted before the worker's linears
    // ran on rows; `worker/src/model/lean/linear.rs`).
    let ff24 = shape(2, 1024, 16, 64, 4096, true);
    let ff22 = shape(2, 768, 12, 128, 4096, true);
    let ff21 = shape(2, 192, 3, 64, 32000, true);
    let ff02 = shape(3, 512, 8, 64, 32000, true);
    let ff16 = shape(2, 768, 12, 64, 16384, true);
    let ff16u = shape(2, 768, 12, 64, 16384, false);
    let ff21u = shape(2, 192, 3, 64, 32000, false);
    // Llama rows (vocabularies ≥ 512: the tiny-llama tokenizer's ids).
    // Q: 8 query heads sharing 2 key/value heads, SwiGLU width 688 (≈ 8h/3,
    // Llama's ratio), tied; Qm: the same with multi-head attention (8/8);
    // Qw: the wide SwiGLU (6h); Qu: untied with a larger vocabulary; Qs:
    // s = 512; B: a 25M-parameter untied model.
    let q = llama(4, 256, (8, 2), 688, 256, 4096, true);
    let qm = llama(4, 256, (8, 8), 688, 256, 4096, true);
    let qw = llama(4, 256, (8, 2), 1536, 256, 4096, true);
    let qu = llama(4, 256, (8, 2), 688, 256, 8192, false);
    let qs = llama(4, 256, (8, 2), 688, 512, 2048, true);
    let big = llama(6, 512, (8, 2), 1376, 128, 8192, false);
    // Long sequences, where burn's softmax attention kept s² per head and
    // the loss whole logits: Q's shape at s = 1024, 2048, 4096.
    let q1k = llama(4, 256, (8, 2), 688, 1024, 4096, true);
    let q2k = llama(4, 256, (8, 2), 688, 2048, 4096, true);
    let q4k = llama(4, 256, (8, 2), 688, 4096, 4096, true);
    let a2k = shape(4, 256, 8, 2048, 2048, true);
    let c = |name, model: &ModelShape, b, acc, ckpt, opt| {
        Case::full(name, model, (b, acc), ckpt, opt, Precision::Fp32)
    };
    use Optimizer::{Adamw, Adamw8bit, Sgd, SgdMomentum};
    vec![
        c("S b4", &s, 4, 1, false, Adamw),
        c("S b16", &s, 16, 1, false, Adamw),
        c("S b16 ckpt", &s, 16, 1, true, Adamw),
        c("M b4", &m, 4, 1, false, Adamw),
        c("M b4 ckpt", &m, 4, 1, true, Adamw),
        c("M b16", &m, 16, 1, false, Adamw),
        c("M b16 ckpt", &m, 16, 1, true, Adamw),
        c("M b8 acc2", &m, 8, 2, false, Adamw),
        c("M b16 sgd", &m, 16, 1, false, Sgd),
        c("L b4", &l, 4, 1, false, Adamw),
        c("L b8", &l, 8, 1, false, Adamw),
        c("L b8 ckpt", &l, 8, 1, true, Adamw),
        c("A s512 b2", &attn, 2, 1, false, Adamw),
        c("A s512 b8", &attn, 8, 1, false, Adamw),
        c("A s512 b8 ckpt", &attn, 8, 1, true, Adamw),
        c("W untied b4 mom", &wide, 4, 1, false, SgdMomentum),
        c("Llama Q gqa b4", &q, 4, 1, false, Adamw),
        c("Llama Q gqa b16", &q, 16, 1, false, Adamw),
        c("Llama Q gqa b16 ckpt", &q, 16, 1, true, Adamw),
        c("Llama Qm mha b16", &qm, 16, 1, false, Adamw),
        c("Llama Qm mha b16 ckpt", &qm, 16, 1, true, Adamw),
        c("Llama Qw swiglu6h b8", &qw, 8, 1, false, Adamw),
        c("Llama Qu untied b8 acc2", &qu, 8, 2, false, Adamw),
        c("Llama Qs s512 b4", &qs, 4, 1, false, Adamw),
        c("Llama Qs s512 b8 ckpt", &qs, 8, 1, true, Adamw),
        c("Llama B untied b4", &big, 4, 1, false, Adamw),
        c("Llama B untied b8 ckpt mom", &big, 8, 1, true, SgdMomentum),
        c("Llama B untied b4 8bit", &big, 4, 1, false, Adamw8bit),
        c("Llama B untied b8 ckpt 8bit", &big, 8, 1, true, Adamw8bit),
        c("Llama Q gqa b16 8bit", &q, 16, 1, false, Adamw8bit),
        // 8-bit AdamW where its fixed parts weigh most: small
        // hidden sizes, whose tensors below 4096 elements stay f32 and
        // whose quantization buffers are a larger share of the state.
        c("S b4 8bit", &s, 4, 1, false, Adamw8bit),
        c("S b16 ckpt 8bit", &s, 16, 1, true, Adamw8bit),
        c("M b4 8bit", &m, 4, 1, false, Adamw8bit),
        c("M b16 8bit", &m, 16, 1, false, Adamw8bit),
        c("M b16 ckpt 8bit", &m, 16, 1, true, Adamw8bit),
        c("L b8 8bit", &l, 8, 1, false, Adamw8bit),
        c("I36 b1 8bit", &i36, 1, 1, false, Adamw8bit),
        c("I36 b1 ckpt 8bit", &i36, 1, 1, true, Adamw8bit),
        c("I36 b4 8bit", &i36, 4, 1, false, Adamw8bit),
        c("W untied b4 8bit", &wide, 4, 1, false, Adamw8bit),
        c("FF20 2x512 s128 b32", &ff20, 32, 1, false, Adamw),
        c("FF11 2x512 s64 b32", &ff11, 32, 1, false, Adamw),
        c("FF24 2x1024 s64 b32", &ff24, 32, 1, false, Adamw),
        c("FF24 2x1024 s64 b32 ckpt", &ff24, 32, 1, true, Adamw),
        c("FF22 2x768 s128 b4", &ff22, 4, 1, false, Adamw),
        c("FF21 2x192 v32000 b16", &ff21, 16, 1, false, Adamw),
        c("FF02 3x512 v32000 b16", &ff02, 16, 1, false, Adamw),
        c("FF16 2x768 v16384 b2 8bit", &ff16, 2, 1, false, Adamw8bit),
        c(
            "FF16u untied 2x768 v16384 b2 8bit",
            &ff16u,
            2,
            1,
            false,
            Adamw8bit,
        ),
        c("FF21u untied 2x192 v32000 b16", &ff21u, 16, 1, false, Adamw),
        c("FF16 2x768 v16384 b2", &ff16, 2, 1, false, Adamw),
        c("Llama Q s1024 b2", &q1k, 2, 1, false, Adamw),
        c("Llama Q s2048 b1", &q2k, 1, 1, false, Adamw),
        c("Llama Q s2048 b2 ckpt", &q2k, 2, 1, true, Adamw),
        c("Llama Q s4096 b1", &q4k, 1, 1, false, Adamw),
        c("Llama Q s4096 b1 ckpt", &q4k, 1, 1, true, Adamw),
        c("A s2048 b1", &a2k, 1, 1, false, Adamw),
    ]
}

/// Rank 8, alpha 16 (PEFT's common pairing), no dropout, QLoRA block 64
/// (the API's default).
fn lora_config(targets: &[TargetModule]) -> LoraConfig {
    LoraConfig {
        rank: 8,
        alpha: 16.0,
        dropout: 0.0,
        target_modules: targets.to_vec(),
        block_size: headroom_planner::adapters::default_block_size(),
    }
}

/// The job a case is: its settings pinned, on `target`.
fn job_request(case: &Case, target: Target) -> JobRequest {
    JobRequest {
        model: case.model.clone(),
        global_batch: case.micro_batch * case.accumulation,
        precision: case.precision,
        optimizer: case.optimizer,
        pinned_micro_batch: Some(case.micro_batch),
        pinned_checkpointing: Some(case.checkpointing),
        pinned_stages: None,
        pinned_replicas: None,
        objective: Default::default(),
        target,
        headroom_fraction: 0.1,
        allowed_rungs: RetryRung::ALL.to_vec(),
        adapters: case.adapters.clone(),
        base_format: case.base_format,
    }
}

/// A single worker's assignment for `plan`, checkpointing at the end.
fn worker_assignment(
    model: &ModelShape,
    plan: headroom_planner::Plan,
    steps: u64,
) -> WorkerAssignment {
    WorkerAssignment {
        job: "calibrate".into(),
        namespace: "default".into(),
        attempt: 1,
        stage: 0,
        replica: 0,
        model: model.clone(),
        plan,
        recipe: headroom_api::Recipe::constant(1e-3, steps),
        checkpoint_every_steps: u32::try_from(steps).unwrap_or(u32::MAX),
        seed: 1,
        files: None,
        memory_guard: None,
    }
}

fn assignment(case: &Case, steps: u64) -> WorkerAssignment {
    let req = job_request(
        case,
        Target::Cpu {
            memory_limit_bytes: 64 << 30,
            max_workers: 1,
        },
    );
    let plan = plan_with(&req, &Inventory::default(), &SearchOptions::default())
        .expect("a 64 GiB budget fits every grid case");
    worker_assignment(&case.model, plan, steps)
}

/// For a Llama case: a randomly initialised checkpoint of its shape, the
/// tiny-llama fixture's tokenizer and a generated text under `dir`, named in
/// the assignment as a fine-tuning job's files. Written by this process, so
/// the worker's peak does not include it; the worker's own load and
/// write-back do count.
fn fine_tuning_files(case: &Case, dir: &Path) -> Option<PayloadFiles> {
    fine_tuning_files_with(case, dir, dir, 3)
}

/// [`fine_tuning_files`] with the checkpoint under `models` (reused by every
/// case of the same shape: a 1B checkpoint takes a while to write) and text
/// for at least `steps` steps.
fn fine_tuning_files_with(
    case: &Case,
    dir: &Path,
    models: &Path,
    steps: u64,
) -> Option<PayloadFiles> {
    let ModelShape::Llama(l) = &case.model else {
        return None;
    };
    let model_dir = models.join(format!(
        "model-{}-{}-{}-{}-{}-{}-{}",
        l.layers,
        l.hidden,
        l.attention_heads,
        l.key_value_heads,
        l.intermediate,
        l.vocabulary,
        if l.tied_embeddings { "tied" } else { "untied" }
    ));
    let data = dir.join("text.txt");
    write_text(
        &data,
        u64::from(case.micro_batch * case.accumulation)
            * u64::from(l.sequence_length)
            * (steps + 1),
    );
    let files = PayloadFiles {
        model_dir: model_dir.display().to_string(),
        data_file: data.display().to_string(),
        data_format: DataFormat::Text,
        train_on: headroom_api::TrainOn::All,
        data_split: None,
        packing: headroom_api::Packing::Stream,
        output_dir: dir.join("output").display().to_string(),
        hub_model: None,
    };
    if model_dir.join("config.json").is_file() {
        return Some(files);
    }
    std::fs::create_dir_all(&model_dir).expect("model dir");
    let config = llama_config(
        l.layers,
        l.hidden,
        (l.attention_heads, l.key_value_heads),
        l.intermediate,
        l.vocabulary,
        l.tied_embeddings,
    );
    std::fs::write(model_dir.join("config.json"), config.to_string()).expect("config.json");
    // In the binary, not read from the source tree: `make gpu-bundle` carries
    // this binary alone to a GPU machine, where the build's path does not exist.
    const TOKENIZER: &[u8] =
        include_bytes!("../../../tests/fixtures/llama/tiny-llama/tokenizer.json");
    std::fs::write(model_dir.join("tokenizer.json"), TOKENIZER).expect("tokenizer.json");
    // `open` wants a weight file; `save_stage` replaces it with the real one.
    std::fs::write(model_dir.join("model.safetensors"), b"").expect("placeholder");
    let checkpoint = HfCheckpoint::open(&model_dir, l.sequence_length).expect("config");
    let shape = LmShape::Llama(l.clone());
    let layout = StageLayout::whole(&shape);
    let model = TransformerLm::new(&shape, &layout, 1, &Device::flex());
    checkpoint
        .save_stage(&model, &layout, 0, 1, &model_dir)
        .expect("write the random checkpoint");
    Some(files)
}

/// A generated text of at least 60,000 words and `tokens` words (each word
/// is at least one token of the tiny-llama tokenizer).
fn write_text(path: &Path, tokens: u64) {
    const WORDS: [&str; 16] = [
        "people",
        "government",
        "liberty",
        "powers",
        "right",
        "laws",
        "the",
        "of",
        "and",
        "to",
        "history",
        "repeated",
        "injuries",
        "consent",
        "safety",
        "happiness",
    ];
    let mut text = String::new();
    let mut x = 7u64;
    for i in 0..tokens.max(60_000) {
        x = headroom_worker::data::splitmix(x ^ i);
        text.push_str(WORDS[(x % 16) as usize]);
        text.push(if i % 17 == 16 { '.' } else { ' ' });
    }
    std::fs::write(path, text).expect("text");
}

struct Measured {
    /// The case, with " pN sK" for a pipeline stage.
    label: String,
    case: Case,
    predicted: u64,
    measured: u64,
    seconds: f64,
    /// Data-parallel replicas of the row's plan (1: none).
    replicas: u32,
    /// With `CALIBRATE_GUARD=1`: the memory guard's checks and their time,
    /// as the worker logs them at its end.
    guard: Option<GuardCost>,
}

/// What the near-OOM guard cost a worker: its checks, their own time and
/// the time of the training loop they ran in.
#[derive(Clone, Copy, Debug)]
struct GuardCost {
    checks: u64,
    seconds: f64,
    training_seconds: f64,
}

/// `CALIBRATE_GUARD=1`: the grid's workers run with the near-OOM guard on
/// (margin 3 %, no stepping down) under a soft limit of 64 GiB that no row
/// nears, so every check is made and none trips; each row's cost is read
/// from the worker's log (docs/benchmarks.md, "Memory guard overhead").
fn guard_on() -> bool {
    std::env::var_os("CALIBRATE_GUARD").is_some_and(|v| v == "1")
}

/// The guard's figures from a worker's log line `memory guard: N checks
/// took X ms in all, of a training loop of Y s (…)` (`run::report_guard_cost`).
fn guard_cost(log: &str) -> Option<GuardCost> {
    let line = log
        .lines()
        .find(|l| l.contains("memory guard: ") && l.contains(" checks took "))?;
    let after = &line[line.find("memory guard: ")? + "memory guard: ".len()..];
    let number = |after_text: &str| -> Option<f64> {
        after
            .split(after_text)
            .nth(1)?
            .split_whitespace()
            .next()?
            .parse()
            .ok()
    };
    Some(GuardCost {
        checks: after.split_whitespace().next()?.parse().ok()?,
        seconds: number(" checks took ")? / 1e3,
        training_seconds: number("training loop of ")?,
    })
}

impl Measured {
    /// (predicted − measured) / measured: negative is an under-prediction.
    fn error(&self) -> f64 {
        (self.predicted as f64 - self.measured as f64) / self.measured as f64
    }
}

fn measure(case: &Case, steps: u64) -> Measured {
    let a = assignment(case, steps);
    let settings = a.plan.settings;
    assert_eq!(
        (
            settings.micro_batch,
            settings.gradient_accumulation,
            settings.activation_checkpointing,
            settings.optimizer,
            settings.base_format,
        ),
        (
            case.micro_batch,
            case.accumulation,
            case.checkpointing,
            case.optimizer,
            case.base_format,
        ),
        "{}: the plan kept the pinned settings",
        case.name
    );
    assert_eq!(
        a.plan.adapters, case.adapters,
        "{}: the plan's adapters",
        case.name
    );
    let breakdown = estimate_stage(
        &case.model,
        a.plan.adapters.as_ref(),
        &settings,
        StagePlacement::single(case.layers()),
        &FLEX,
        1.0,
    );
    if std::env::var_os("CALIBRATE_BREAKDOWN").is_some() {
        eprintln!("  {}: {}", case.name, breakdown_mib(&breakdown));
    }
    let predicted = breakdown.total;
    let dir = std::env::temp_dir().join(format!("headroom-calibrate-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut a = a;
    a.files = fine_tuning_files(case, &dir);
    if guard_on() {
        a.memory_guard = Some(headroom_api::MemoryGuardSettings {
            margin_percent: 3,
            step_down_in_place: false,
        });
    }
    let (message, seconds, log) =
        try_run_worker(case.name, &a, &dir).unwrap_or_else(|e| panic!("{e}"));
    let _ = std::fs::remove_dir_all(&dir);
    let guard = guard_on().then(|| {
        guard_cost(&log).unwrap_or_else(|| {
            panic!(
                "{}: no `memory guard: N checks took` line in the worker's log:\n{log}",
                case.name
            )
        })
    });
    Measured {
        label: case.name.to_string(),
        case: case.clone(),
        predicted,
        measured: message
            .peak_bytes
            .expect("peak bytes in the termination message"),
        seconds,
        replicas: 1,
        guard,
    }
}

/// Runs `a` in a worker process (this binary with `--worker`, the
/// production code path) with its checkpoints and termination message under
/// `dir`: its message, its wall time and its log (stderr), or, when it
/// failed, an error that says why.
fn try_run_worker(
    name: &str,
    a: &WorkerAssignment,
    dir: &Path,
) -> Result<(TerminationMessage, f64, String), String> {
    let termination = dir.join("termination-log");
    let started = Instant::now();
    let mut command = Command::new(std::env::current_exe().expect("own path"));
    if a.memory_guard.is_some() {
        // A limit for the guard to check against outside a pod's cgroup,
        // and the log line with its cost.
        command
            .env(
                headroom_worker::env::DEVICE_MEMORY_LIMIT_ENV,
                (64u64 << 30).to_string(),
            )
            .env("RUST_LOG", "warn,headroom_worker::run=info");
    } else {
        command.env("RUST_LOG", "warn");
    }
    let out = command
        .arg("--worker")
        .env(PLAN_JSON_ENV, serde_json::to_string(a).expect("json"))
        .env(CHECKPOINT_DIR_ENV, dir.join("checkpoints"))
        .env(
            headroom_worker::env::GPU_CACHE_DIR_ENV,
            gpu::gpu_cache_dir(),
        )
        .env(TERMINATION_MESSAGE_PATH_ENV, &termination)
        .env(POD_NAME_ENV, "calibrate")
        .env(MALLOC_ARENA_MAX_ENV, WORKER_MALLOC_ARENAS)
        .env(MALLOC_TUNABLES_ENV, WORKER_MALLOC_TUNABLES)
        .env("KUBECONFIG", dir.join("none"))
        .env("HOME", dir)
        .env(
            headroom_worker::model::lean::NAIVE_OPS_ENV,
            if headroom_worker::model::lean::naive_ops() {
                "1"
            } else {
                "0"
            },
        )
        .output()
        .expect("run a worker");
    let seconds = started.elapsed().as_secs_f64();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let message: TerminationMessage = std::fs::read_to_string(&termination)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .ok_or_else(|| format!("{name}: no termination message; stderr:\n{stderr}"))?;
    if out.status.code() != Some(0) {
        return Err(format!(
            "{name}: worker failed ({}): {} {}\n{stderr}",
            out.status, message.outcome, message.reason
        ));
    }
    Ok((message, seconds, stderr.into_owned()))
}

/// `a` split over `p` balanced stages (the planner's split when it fits).
fn split_assignment(a: &WorkerAssignment, p: u32) -> WorkerAssignment {
    let layers = a.plan.stages[0].layer_end;
    let split = headroom_planner::search::balanced_split(layers, p).expect("p ≤ layers");
    let m = a.plan.settings.gradient_accumulation;
    let mut a = a.clone();
    let template = a.plan.stages[0].clone();
    let mut start = 0;
    a.plan.stages = split
        .iter()
        .enumerate()
        .map(|(k, n)| {
            let mut stage = template.clone();
            stage.index = k as u32;
            stage.layer_start = start;
            stage.layer_end = start + n;
            stage.in_flight_micro_batches = (p - k as u32).min(m).max(1);
            start += n;
            stage
        })
        .collect();
    a.plan.workers = p;
    a
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port()
}

/// `case` split over `p` stages and `d` data-parallel replicas (the global
/// batch kept: each replica runs 1/d of the micro-batches, its optimizer
/// state sharded ZeRO-1).
fn pipeline_assignment(case: &Case, p: u32, d: u32, steps: u64) -> WorkerAssignment {
    split_over(case, &assignment(case, steps), p, d)
}

/// `base`, a one-worker plan of `case`, split over `p` stages and `d`
/// replicas as [`pipeline_assignment`] does (the GPU rows split a CUDA plan).
fn split_over(case: &Case, base: &WorkerAssignment, p: u32, d: u32) -> WorkerAssignment {
    let mut a = split_assignment(base, p);
    let m = a.plan.settings.gradient_accumulation;
    assert!(
        m.is_multiple_of(d),
        "{}: {m} micro-batches over {d} replicas",
        case.name
    );
    a.plan.settings.gradient_accumulation = m / d;
    a.plan.replicas = d;
    a.plan.workers = p * d;
    for stage in &mut a.plan.stages {
        stage.in_flight_micro_batches = stage.in_flight_micro_batches.min(m / d).max(1);
    }
    a
}

/// The planner's FLEX figure for stage `k` of `a` (every replica of a stage
/// is budgeted alike).
fn stage_estimate(case: &Case, a: &WorkerAssignment, k: u32) -> MemoryBreakdown {
    stage_estimate_on(case, a, k, &FLEX)
}

/// The planner's figure on `profile` for stage `k` of `a`.
fn stage_estimate_on(
    case: &Case,
    a: &WorkerAssignment,
    k: u32,
    profile: &BackendProfile,
) -> MemoryBreakdown {
    let stage = &a.plan.stages[k as usize];
    let placement = StagePlacement {
        layers: stage.layer_end - stage.layer_start,
        first: k == 0,
        last: k as usize + 1 == a.plan.stages.len(),
        in_flight: stage.in_flight_micro_batches,
        replicas: a.plan.replicas,
    };
    estimate_stage(
        &case.model,
        a.plan.adapters.as_ref(),
        &a.plan.settings,
        placement,
        profile,
        1.0,
    )
}

/// The label of stage `k`, replica `r` of a `p` × `d` row.
fn stage_label(case: &Case, a: &WorkerAssignment, p: u32, d: u32, k: u32, r: u32) -> String {
    let stage = &a.plan.stages[k as usize];
    let replicas = if d > 1 {
        format!(" d{d} r{r}")
    } else {
        String::new()
    };
    format!(
        "{} p{p}{replicas} s{k} (L{}-{})",
        case.name,
        stage.layer_start,
        stage.layer_end - 1
    )
}

/// Every stage of `case` split over `p` stages and `d` replicas
/// ([`pipeline_assignment`]), run as `p · d` worker processes over loopback;
/// one row per worker.
fn measure_pipeline(case: &Case, p: u32, d: u32, steps: u64) -> Vec<Measured> {
    let a = pipeline_assignment(case, p, d, steps);
    run_split(case, a, (p, d), &FLEX, &SplitWorkers::Host, |dir| {
        fine_tuning_files(case, dir)
    })
    .unwrap_or_else(|e| panic!("{e}"))
}

/// Where the workers of a split row run.
enum SplitWorkers {
    /// On this machine's CPU (flex): the device is the host.
    Host,
    /// Worker (stage k, replica r) alone on GPU `k·d + r`
    /// (`CUDA_VISIBLE_DEVICES`), its peak less that GPU's NVML baseline.
    OneGpuEach {
        /// NVML's used bytes of each GPU before the row.
        baselines: Vec<u64>,
    },
}

/// Runs `a`, a plan split over `(p, d)` stages × replicas, as `p · d`
/// worker processes over loopback (`files`: the row's checkpoint and data
/// in the directory given), and compares each worker's peak with its
/// stage's figure on `profile`; one row per worker, or the first worker's
/// failure.
fn run_split(
    case: &Case,
    mut a: WorkerAssignment,
    (p, d): (u32, u32),
    profile: &BackendProfile,
    placement: &SplitWorkers,
    files: impl FnOnce(&Path) -> Option<PayloadFiles>,
) -> Result<Vec<Measured>, String> {
    let dir = std::env::temp_dir().join(format!(
        "headroom-calibrate-p{p}-d{d}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    a.files = files(&dir);
    // Worker (k, r) listens on the pipeline port of replica r's stage k and
    // on the ring port of stage k's replica r.
    let port = |_: u32| format!("127.0.0.1:{}", free_port());
    let addresses = SplitAddresses {
        pipeline: (0..d).map(|_| (0..p).map(port).collect()).collect(),
        ring: (0..p).map(|_| (0..d).map(port).collect()).collect(),
        // The workers prove this run's key to each other, as a job's do the
        // operator's (there is no worker API here to hand one out).
        key: headroom_worker::link_auth::LinkKey::random()
            .expect("peer key")
            .to_hex(),
    };
    let run = SplitRun {
        case,
        a: &a,
        p,
        d,
        dir: &dir,
        placement,
    };
    let workers: Vec<(u32, u32)> = (0..p).flat_map(|k| (0..d).map(move |r| (k, r))).collect();
    let started = Instant::now();
    let children: Vec<_> = workers
        .iter()
        .map(|&(k, r)| {
            run.command(k, r, &addresses)
                .spawn()
                .expect("start a worker")
        })
        .collect();
    let outputs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().expect("worker"))
        .collect();
    let seconds = started.elapsed().as_secs_f64();
    let rows = workers
        .iter()
        .zip(&outputs)
        .map(|(&(k, r), out)| run.measured(k, r, out, profile, seconds))
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    rows
}

/// Where the workers of a split run listen, and the key they prove.
struct SplitAddresses {
    /// Per replica, every stage's pipeline address.
    pipeline: Vec<Vec<String>>,
    /// Per stage, every replica's ring address.
    ring: Vec<Vec<String>>,
    key: String,
}

/// One case run as `p` stages × `d` replicas, one worker process each.
struct SplitRun<'a> {
    case: &'a Case,
    a: &'a WorkerAssignment,
    p: u32,
    d: u32,
    dir: &'a Path,
    placement: &'a SplitWorkers,
}

impl SplitRun<'_> {
    /// Worker (k, r)'s name, as the operator's hostnames go.
    fn name(&self, k: u32, r: u32) -> String {
        if self.d > 1 {
            format!("s{k}-r{r}")
        } else {
            format!("s{k}")
        }
    }

    /// The worker process of stage `k`, replica `r`.
    fn command(&self, k: u32, r: u32, addresses: &SplitAddresses) -> Command {
        let (dir, name) = (self.dir, self.name(k, r));
        let mut worker = self.a.clone();
        worker.stage = k;
        worker.replica = r;
        let mut cmd = Command::new(std::env::current_exe().expect("own path"));
        cmd.arg("--worker")
            .env(PLAN_JSON_ENV, serde_json::to_string(&worker).expect("json"))
            .env(
                PIPELINE_ADDRESSES_ENV,
                addresses.pipeline[r as usize].join(","),
            )
            .env(PEER_KEY_ENV, &addresses.key)
            .env(CHECKPOINT_DIR_ENV, dir.join("checkpoints"))
            // One per slot, as in a pod: a cache has one writer.
            .env(
                headroom_worker::env::GPU_CACHE_DIR_ENV,
                gpu::gpu_cache_dir().join(&name),
            )
            .env(
                TERMINATION_MESSAGE_PATH_ENV,
                dir.join(format!("termination-{name}")),
            )
            .env(POD_NAME_ENV, format!("calibrate-{name}"))
            .env(MALLOC_ARENA_MAX_ENV, WORKER_MALLOC_ARENAS)
            .env(MALLOC_TUNABLES_ENV, WORKER_MALLOC_TUNABLES)
            .env("KUBECONFIG", dir.join("none"))
            .env("HOME", dir)
            .env("RUST_LOG", "warn")
            .stderr(std::process::Stdio::piped());
        if self.d > 1 {
            cmd.env(REPLICA_ADDRESSES_ENV, addresses.ring[k as usize].join(","));
        }
        if let SplitWorkers::OneGpuEach { .. } = self.placement {
            // CUDA numbers GPUs as NVML does (the probe's and the
            // baselines' indices) only in PCI bus order.
            cmd.env("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
                .env("CUDA_VISIBLE_DEVICES", (k * self.d + r).to_string());
        }
        cmd
    }

    /// Worker (k, r)'s row: its termination message's peak (less its GPU's
    /// baseline) against its stage's prediction.
    fn measured(
        &self,
        k: u32,
        r: u32,
        out: &std::process::Output,
        profile: &BackendProfile,
        seconds: f64,
    ) -> Result<Measured, String> {
        let (case, a, p, d) = (self.case, self.a, self.p, self.d);
        let message: Option<TerminationMessage> =
            std::fs::read_to_string(self.dir.join(format!("termination-{}", self.name(k, r))))
                .ok()
                .and_then(|t| serde_json::from_str(&t).ok());
        let message = match message {
            Some(m) if out.status.code() == Some(0) => m,
            m => {
                return Err(format!(
                    "{} p{p} d{d} {}: worker failed ({}): {m:?}\n{}",
                    case.name,
                    self.name(k, r),
                    out.status,
                    String::from_utf8_lossy(&out.stderr)
                ));
            }
        };
        let breakdown = stage_estimate_on(case, a, k, profile);
        if std::env::var_os("CALIBRATE_BREAKDOWN").is_some() {
            eprintln!(
                "  {} p{p} d{d} {}: {}",
                case.name,
                self.name(k, r),
                breakdown_mib(&breakdown)
            );
        }
        // The stage's prediction is its largest shard's (the planner
        // budgets every replica for it).
        let predicted = breakdown.total;
        let peak = message.peak_bytes.expect("peak");
        let baseline = match self.placement {
            SplitWorkers::Host => 0,
            SplitWorkers::OneGpuEach { baselines } => {
                baselines.get((k * d + r) as usize).copied().unwrap_or(0)
            }
        };
        Ok(Measured {
            label: stage_label(case, a, p, d, k, r),
            case: case.clone(),
            predicted,
            measured: peak.saturating_sub(baseline),
            seconds,
            replicas: d,
            guard: None,
        })
    }
}

/// The model the pipeline rows and the throughput figures use.
fn pipeline_case() -> Case {
    let model = shape(6, 256, 4, 128, 4096, true);
    Case::full(
        "P",
        &model,
        (4, 4),
        false,
        Optimizer::Adamw,
        Precision::Fp32,
    )
}

/// The LoRA pipeline rows: the Lq model as QLoRA int8 on all seven block
/// linears, the same micro-batches as P.
fn qlora_pipeline_case() -> Case {
    Case {
        name: "Lq qlora8 all7 PL",
        model: llama(6, 512, (8, 2), 1408, 128, 8192, false),
        adapters: Some(lora_config(&BLOCK_LINEARS)),
        base_format: BaseFormat::Int8,
        ..pipeline_case()
    }
}

/// The Llama model of the pipeline rows: GQA 8/2, tied (the last stage keeps
/// its own copy of the embedding), the same micro-batches as P.
fn llama_pipeline_case() -> Case {
    Case {
        name: "Llama PQ",
        model: llama(6, 256, (8, 2), 688, 128, 4096, true),
        ..pipeline_case()
    }
}

/// Tokens/s of `p` stages training together in this process (one thread and
/// one loopback link per stage), median over steps after warm-up.
fn pipeline_throughput(case: &Case, p: u32, steps: u64) -> f64 {
    use headroom_worker::collective::Single;
    use headroom_worker::link_auth::LinkKey;
    use headroom_worker::pipeline::{Hello, Peers, establish};
    let a = split_assignment(&assignment(case, 1_000_000), p);
    let (listeners, peers) = Peers::loopback(p).expect("loopback sockets");
    let key = LinkKey::random().expect("peer key");
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(k, listener)| {
            let mut stage = a.clone();
            stage.stage = k as u32;
            let (peers, key) = (peers.clone(), key.clone());
            std::thread::spawn(move || {
                let config = ValidAssignment::new(stage)
                    .expect("valid assignment")
                    .into_config();
                let tokens = config.tokens_per_step() as f64;
                let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
                let me = Hello {
                    job: "throughput".into(),
                    namespace: "default".into(),
                    attempt: 1,
                    stage: k as u32,
                    stages: p,
                    resume_step: 0,
                };
                let wait = Duration::from_secs(60);
                let mut links =
                    establish(&me, &key, (k > 0).then_some(listener), &peers, wait, wait)
                        .expect("links");
                let times: Vec<f64> = (0..steps + 2)
                    .map(|_| {
                        let report = trainer.train_step_with(&mut links, &mut Single);
                        report.expect("step").elapsed.as_secs_f64()
                    })
                    .skip(2)
                    .collect();
                tokens / median(times)
            })
        })
        .collect();
    let rates: Vec<f64> = handles
        .into_iter()
        .map(|h| h.join().expect("stage"))
        .collect();
    // The stages advance in lock-step; the slowest one's rate is the pipeline's.
    rates.into_iter().fold(f64::INFINITY, f64::min)
}

/// The pipeline rows: each case with the (stages, replicas) it runs beside
/// its one-worker row.
fn pipeline_grid() -> [(Case, &'static [(u32, u32)]); 3] {
    [
        (
            pipeline_case(),
            &[(2, 1), (3, 1), (1, 2), (1, 4), (2, 2)][..],
        ),
        (llama_pipeline_case(), &[(2, 1), (1, 2)][..]),
        (qlora_pipeline_case(), &[(2, 1), (1, 2)][..]),
    ]
}

fn pipeline_report(steps: u64) -> Vec<Measured> {
    let mut rows = Vec::new();
    for (case, shapes) in pipeline_grid() {
        let mut whole = measure(&case, steps);
        whole.label = format!("{} p1", case.name);
        print_row(&whole);
        rows.push(whole);
        for &(p, d) in shapes {
            for m in measure_pipeline(&case, p, d, steps) {
                print_row(&m);
                rows.push(m);
            }
        }
    }
    rows
}

fn throughput_report() {
    let case = pipeline_case();
    let m = case.accumulation;
    println!(
        "\npipeline throughput, model {} ({:.1}M parameters), micro-batch {} × {} micro-batches per step, this machine's cores shared by all stages:",
        case.name,
        case.model.total_params() as f64 / 1e6,
        case.micro_batch,
        m
    );
    println!("| stages | tokens/s (median step) | 1F1B bubble (p−1)/(m+p−1) |");
    println!("|---|---|---|");
    for p in [1, 2, 3] {
        let rate = pipeline_throughput(&case, p, 6);
        println!(
            "| {p} | {rate:.0} | {:.0} % |",
            100.0 * f64::from(p - 1) / f64::from(m + p - 1)
        );
    }
}

/// The lean ops against the naive ones they replaced (`HEADROOM_NAIVE_OPS`,
/// see `headroom_worker::model::lean`), per grid case: each one's measured
/// peak (a worker process each, VmHWM) and tokens/s (median of `steps`
/// steps after one warm-up, in this process, one after the other).
fn ops_ab_report(steps: u64, only: Option<&str>) {
    use headroom_worker::model::lean::set_naive_ops;
    println!(
        "| case | s | micro | ckpt | adapters | predicted MiB | naive MiB | lean MiB | lean / naive | naive tokens/s | lean tokens/s | lean / naive |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    for case in grid()
        .into_iter()
        .filter(|c| only.is_none_or(|o| selected(c.name, o)))
    {
        // The worker processes take this process's choice (`try_run_worker`).
        let peak = |naive: bool| {
            set_naive_ops(naive);
            let m = measure(&case, steps);
            (m.predicted, m.measured)
        };
        let (_, naive_peak) = peak(true);
        let (predicted, lean_peak) = peak(false);
        let rate = |naive: bool| {
            set_naive_ops(naive);
            let dir = std::env::temp_dir().join(format!("headroom-ops-ab-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(&dir).expect("temp dir");
            let mut a = assignment(&case, steps + 1);
            a.files = fine_tuning_files(&case, &dir);
            let config = ValidAssignment::new(a).expect("valid").into_config();
            let tokens = config.tokens_per_step() as f64;
            let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
            trainer.train_step().expect("warm-up");
            let times: Vec<f64> = (0..steps)
                .map(|_| trainer.train_step().expect("step").elapsed.as_secs_f64())
                .collect();
            let _ = std::fs::remove_dir_all(&dir);
            tokens / median(times)
        };
        let (naive_rate, lean_rate) = (rate(true), rate(false));
        set_naive_ops(false);
        let (seq, adapters) = match &case.model {
            ModelShape::Llama(l) => (l.sequence_length, adapters_cell(&case)),
            ModelShape::Transformer(t) => (t.sequence_length, adapters_cell(&case)),
            ModelShape::Generic(_) => (0, String::new()),
        };
        let mib = |b: u64| b as f64 / MIB;
        println!(
            "| {} | {seq} | {} | {} | {adapters} | {:.0} | {:.0} | {:.0} | {:.2} | {:.0} | {:.0} | {:.2} |",
            case.name,
            case.micro_batch,
            if case.checkpointing { "on" } else { "off" },
            mib(predicted),
            mib(naive_peak),
            mib(lean_peak),
            lean_peak as f64 / naive_peak as f64,
            naive_rate,
            lean_rate,
            lean_rate / naive_rate,
        );
    }
}

/// `--only`: the cases whose name contains one of the `|`-separated parts
/// (a part ending in `$`: whose name ends with it, so `M b8$` is not
/// `M b8 ckpt`).
fn selected(name: &str, only: &str) -> bool {
    only.split('|').any(|part| match part.strip_suffix('$') {
        Some(end) => name.ends_with(end),
        None => name.contains(part),
    })
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

/// The model of the CPU telemetry-overhead figure.
fn overhead_case() -> Case {
    let model = shape(4, 256, 4, 256, 4096, true);
    Case::full(
        "overhead",
        &model,
        (8, 1),
        false,
        Optimizer::Adamw,
        Precision::Fp32,
    )
}

/// Step times (seconds) of one trainer of `a` on `device`, alternating
/// segments without and with the telemetry thread so both see the same
/// model, data and machine state; and the tokens one step trains.
fn step_times(
    a: WorkerAssignment,
    device: Device,
    rounds: u32,
    steps_per_segment: u32,
) -> (Vec<f64>, Vec<f64>, f64) {
    let layer_end = a.plan.stages[0].layer_end;
    let peak_on_device = a.plan.backend != headroom_planner::Backend::Flex;
    let config = ValidAssignment::new(a)
        .expect("valid assignment")
        .into_config();
    let tokens = config.tokens_per_step() as f64;
    let mut trainer = Trainer::new(config, device).expect("trainer");
    // Warm-up: optimizer state, allocator arenas.
    for _ in 0..2 {
        trainer.train_step().expect("single stage");
    }
    let (mut without, mut with) = (Vec::new(), Vec::new());
    for round in 0..rounds {
        for telemetry in [round % 2 == 0, round % 2 == 1] {
            let reporter = telemetry.then(|| {
                Reporter::start(
                    WorkerIdentity {
                        name: "overhead".into(),
                        job: "calibrate".into(),
                        namespace: "default".into(),
                        attempt: 1,
                        stage: 0,
                        layer_start: 0,
                        layer_end,
                    },
                    probe(&trainer.device, peak_on_device),
                    Some(Box::new(MemorySink::default())),
                    headroom_worker::report::DEFAULT_SAMPLE_EVERY,
                    // Every sample is written: the worst case of the rate limit.
                    WritePolicy::new(Duration::ZERO),
                )
            });
            for _ in 0..steps_per_segment {
                let r = trainer.train_step().expect("single stage");
                if let Some(rep) = &reporter {
                    rep.update(Progress {
                        step: r.step,
                        loss: r.loss,
                        eval_loss: None,
                        tokens_per_second: Some(r.tokens_per_second()),
                        download: None,
                        stepped_down: None,
                    });
                }
                if telemetry { &mut with } else { &mut without }.push(r.elapsed.as_secs_f64());
            }
        }
    }
    (without, with, tokens)
}

/// The worker's probe for `device` (with NVML in a CUDA build).
fn probe(device: &Device, peak_on_device: bool) -> MemoryProbe {
    let probe = MemoryProbe::for_this_process(Some(device.clone()));
    if peak_on_device {
        probe.device_peak()
    } else {
        probe
    }
}

fn telemetry_overhead() {
    let a = assignment(&overhead_case(), 1_000_000);
    telemetry_overhead_on(a, Device::flex().autodiff());
}

/// The cost of one memory sample on `device` (reading /proc, cgroup files,
/// the allocator and, in a CUDA build, NVML), then one trainer of `a` with
/// and without the reporter thread: median step, tokens/s, overhead.
fn telemetry_overhead_on(a: WorkerAssignment, device: Device) {
    let mut probe = probe(&device, a.plan.backend != headroom_planner::Backend::Flex);
    let n = 2000;
    let t = Instant::now();
    for _ in 0..n {
        std::hint::black_box(probe.sample());
    }
    let per_sample = t.elapsed().as_secs_f64() / f64::from(n);
    let every = headroom_worker::report::DEFAULT_SAMPLE_EVERY.as_secs_f64();
    println!(
        "\ntelemetry: one memory sample costs {:.1} µs; at one sample per {:.1} s that is {:.4} % of one core",
        per_sample * 1e6,
        every,
        100.0 * per_sample / every
    );
    // End to end: one trainer, alternating segments without and with the telemetry thread.
    let (without, with, tokens) = step_times(a, device, 8, 4);
    let n = with.len();
    let (a, b) = (median(without), median(with));
    println!(
        "telemetry: median step {:.1} ms without, {:.1} ms with the reporter ({n} steps each, sample every {:.1} s, every sample written): {:+.2} %; {:.0} tokens/s without",
        a * 1e3,
        b * 1e3,
        every,
        100.0 * (b - a) / a,
        tokens / a
    );
}

fn main() {
    // Its own steps (--step-breakdown) and the workers it runs follow it.
    headroom_ffi::configure_from_env().unwrap_or_else(|e| panic!("{e}"));
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `--autotune LEVEL` (cuda) applies to this process and its children.
    if let Some(at) = args.iter().position(|a| a == "--autotune") {
        let level = args.get(at + 1).cloned().expect("--autotune LEVEL");
        gpu::set_autotune(&level);
        args.drain(at..at + 2);
    }
    run_child_mode(&args);
    let options = Options::parse(&args);
    if options.overhead_only {
        telemetry_overhead();
        return;
    }
    if cfg!(debug_assertions) {
        eprintln!("warning: a debug build; calibrate with --release");
    }
    let (steps, only) = (options.steps, options.only.as_deref());
    if options.wgpu {
        #[cfg(feature = "wgpu")]
        std::process::exit(vulkan::run(options.quick));
        #[cfg(not(feature = "wgpu"))]
        {
            eprintln!(
                "this calibrate binary was built without the `wgpu` feature: build it with `make wgpu-check`"
            );
            std::process::exit(2);
        }
    }
    if options.step_breakdown {
        if only.is_none_or(|o| selected("linear-ops", o)) {
            step_breakdown::linear_ops(15);
        }
        if only.is_none_or(|o| selected("block-ops", o)) {
            step_breakdown::block_ops(15);
        }
        if !matches!(only, Some("linear-ops" | "block-ops")) {
            let backend = if options.cuda {
                headroom_planner::Backend::Cuda
            } else {
                headroom_planner::Backend::Flex
            };
            step_breakdown::run(if options.steps_given { steps } else { 6 }, only, backend);
        }
        return;
    }
    if options.cuda {
        std::process::exit(gpu::run(
            steps,
            only,
            options.overhead,
            options.large,
            options.quick,
            options.ops_check,
        ));
    }
    if options.ops_ab {
        ops_ab_report(steps, only);
        return;
    }
    if options.predict_only {
        predict_only_report(steps, only);
        return;
    }
    println!(
        "FLEX profile: fixed overhead {:.0} MiB, state slack {:.0} %, activation slack {:.0} % ({:.0} % for adapters without checkpointing), logit copies {}, checkpointed phase overlap {}, {:?} activation count; {steps} steps per case, peak = worker VmHWM\n",
        FLEX.fixed_overhead_bytes as f64 / MIB,
        FLEX.state_slack * 100.0,
        FLEX.activation_slack * 100.0,
        FLEX.adapter_activation_slack * 100.0,
        FLEX.logit_copies,
        FLEX.checkpoint_phase_overlap,
        FLEX.activation_count,
    );
    print_table_header();
    let mut rows = Vec::new();
    for case in grid()
        .into_iter()
        .filter(|c| only.is_none_or(|o| selected(c.name, o)))
    {
        let m = measure(&case, steps);
        print_row(&m);
        eprintln!("  ({} took {:.1} s)", m.case.name, m.seconds);
        rows.push(m);
    }
    let pipeline = options.pipeline && only.is_none_or(|o| o == "--pipeline-only");
    if pipeline {
        rows.extend(pipeline_report(steps));
    }
    summary(&rows, options.overhead, pipeline);
}

/// The modes this binary runs in as a child of the bench (a worker, or one
/// GPU check): each exits the process with its code.
fn run_child_mode(args: &[String]) {
    match args.first().map(String::as_str) {
        Some("--worker") => {
            // The worker's log on stderr as headroom-worker writes it, at
            // the bench's RUST_LOG (the guard's cost line is read from it).
            tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
                )
                .with_writer(std::io::stderr)
                .with_ansi(false)
                .init();
            let exit = headroom_worker::run::run(headroom_worker::WorkerEnv::from_env());
            std::process::exit(exit.code());
        }
        Some("--gpu-smoke") => std::process::exit(gpu::smoke()),
        Some("--gpu-load-check") => {
            let format = match args.get(1).map(String::as_str) {
                Some("dense") => BaseFormat::Dense,
                Some("nf4") => BaseFormat::Nf4,
                other => {
                    panic!("--gpu-load-check {other:?}: dense or nf4, then the model's directory")
                }
            };
            let dir = args.get(2).expect("--gpu-load-check FORMAT MODEL_DIR");
            std::process::exit(gpu::load_check(format, Path::new(dir)));
        }
        #[cfg(feature = "wgpu")]
        Some("--wgpu-ops-check") => {
            assert_eq!(
                args.get(1).map(String::as_str),
                Some("f16"),
                "--wgpu-ops-check f16"
            );
            let quick = args.get(2).is_some_and(|a| a == "--quick");
            std::process::exit(vulkan::ops_check_f16(quick));
        }
        Some("--gpu-ops-check") => {
            let precision = match args.get(1).map(String::as_str) {
                Some("fp32") => Precision::Fp32,
                Some("bf16") => Precision::Bf16,
                other => panic!("--gpu-ops-check {other:?}: fp32 or bf16"),
            };
            std::process::exit(gpu::ops_check(precision));
        }
        _ => {}
    }
}

/// The bench's command line.
struct Options {
    steps: u64,
    only: Option<String>,
    overhead: bool,
    pipeline: bool,
    cuda: bool,
    /// `--backend wgpu`: gpu-check's rows that need no CUDA, on a Vulkan device.
    wgpu: bool,
    large: bool,
    quick: bool,
    ops_check: bool,
    ops_ab: bool,
    /// `--step-breakdown`: a step's time by phase, full vs LoRA vs QLoRA.
    step_breakdown: bool,
    /// Whether `--steps` was given (each mode has its own default).
    steps_given: bool,
    predict_only: bool,
    /// `--overhead-only`: the arguments after it are not read.
    overhead_only: bool,
}

impl Options {
    fn parse(args: &[String]) -> Options {
        let mut o = Options {
            steps: 3,
            only: None,
            overhead: true,
            pipeline: true,
            cuda: false,
            wgpu: false,
            large: false,
            quick: false,
            ops_check: true,
            ops_ab: false,
            step_breakdown: false,
            steps_given: false,
            predict_only: false,
            overhead_only: false,
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--steps" => {
                    o.steps = it.next().and_then(|v| v.parse().ok()).expect("--steps N");
                    o.steps_given = true;
                }
                "--only" => o.only = it.next().cloned(),
                "--backend" => match it.next().map(String::as_str) {
                    Some("cuda") => o.cuda = true,
                    Some("wgpu") => o.wgpu = true,
                    Some("flex") => o.cuda = false,
                    other => {
                        panic!("--backend {other:?}: use flex (CPU, the default), cuda or wgpu")
                    }
                },
                "--large" => o.large = true,
                "--quick" => o.quick = true,
                "--skip-ops-check" => o.ops_check = false,
                "--ops-ab" => o.ops_ab = true,
                "--step-breakdown" => o.step_breakdown = true,
                "--predict-only" => o.predict_only = true,
                "--skip-overhead" => o.overhead = false,
                "--skip-pipeline" => o.pipeline = false,
                "--pipeline-only" => o.only = Some("--pipeline-only".into()),
                "--overhead-only" => {
                    o.overhead_only = true;
                    return o;
                }
                other => panic!(
                    "unknown argument {other}; use --backend flex|cuda|wgpu, --large (cuda: add 3B rows), --autotune minimal|balanced|extensive|full (cuda), --quick (cuda: the 110M-350M rows, no 1.1B speed rows; wgpu: the small ops shapes), --skip-ops-check (cuda), --steps N, --only NAME[|NAME…], --skip-pipeline, --pipeline-only, --skip-overhead, --overhead-only, --ops-ab, --step-breakdown, --predict-only"
                ),
            }
        }
        o
    }
}

/// The planner's figure for each case without running it (to refit a
/// profile against peaks measured before), in the rows' own labels.
fn predict_only_report(steps: u64, only: Option<&str>) {
    let row = |label: &str, b: &MemoryBreakdown| {
        let total = b.total as f64 / MIB;
        println!("| {label} | {total:.0} | {} |", breakdown_mib(b));
    };
    for case in grid()
        .into_iter()
        .filter(|c| only.is_none_or(|o| selected(c.name, o)))
    {
        row(
            case.name,
            &stage_estimate(&case, &assignment(&case, steps), 0),
        );
    }
    for (case, shapes) in pipeline_grid() {
        let whole = stage_estimate(&case, &assignment(&case, steps), 0);
        row(&format!("{} p1", case.name), &whole);
        for &(p, d) in shapes {
            let a = pipeline_assignment(&case, p, d, steps);
            for (k, r) in (0..p).flat_map(|k| (0..d).map(move |r| (k, r))) {
                row(
                    &stage_label(&case, &a, p, d, k, r),
                    &stage_estimate(&case, &a, k),
                );
            }
        }
    }
}

/// The header of the table [`print_row`] writes rows of.
fn print_table_header() {
    println!(
        "| case | L | h | heads | ffn | s | v | params | micro × acc | ckpt | optimizer | adapters | predicted MiB | measured MiB | error |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
}

fn print_row(m: &Measured) {
    // GPT: heads and the 4h feed-forward; Llama: query/key-value heads and the SwiGLU width.
    let (layers, hidden, heads, ffn, seq, vocab) = match &m.case.model {
        ModelShape::Transformer(t) => (
            t.layers,
            t.hidden,
            t.heads.to_string(),
            t.ffn(),
            t.sequence_length,
            t.vocabulary,
        ),
        ModelShape::Llama(l) => (
            l.layers,
            l.hidden,
            format!("{}/{}", l.attention_heads, l.key_value_heads),
            u64::from(l.intermediate),
            l.sequence_length,
            l.vocabulary,
        ),
        ModelShape::Generic(_) => unreachable!("the grid builds transformers"),
    };
    println!(
        "| {} | {layers} | {hidden} | {heads} | {ffn} | {seq} | {vocab} | {:.2}M | {} × {} | {} | {} | {} | {:.0} | {:.0} | {:+.1} % |",
        m.label,
        m.case.model.total_params() as f64 / 1e6,
        m.case.micro_batch,
        m.case.accumulation,
        if m.case.checkpointing { "on" } else { "off" },
        m.case.optimizer,
        adapters_cell(&m.case),
        m.predicted as f64 / MIB,
        m.measured as f64 / MIB,
        100.0 * m.error(),
    );
}

/// The predicted components in MiB (`CALIBRATE_BREAKDOWN=1`, on stderr).
fn breakdown_mib(b: &headroom_planner::MemoryBreakdown) -> String {
    let m = |x: u64| x as f64 / MIB;
    format!(
        "weights {:.1}, gradients {:.1}, optimizer {:.1}, activations {:.1}, logits {:.1}, composed {:.1}, step {:.1}, slack {:.1}, fixed {:.0}: training {:.1}; load peak {:.1}",
        m(b.weights),
        m(b.gradients),
        m(b.optimizer_state),
        m(b.activations),
        m(b.logits),
        m(b.composed_weights),
        m(b.optimizer_step),
        m(b.allocator_slack),
        m(b.fixed_overhead),
        m(b.training_total()),
        m(b.load_peak)
    )
}

/// "—" for full fine-tuning; else the rank, the targets (q,v or all 7 block
/// linears) and the base format (with its block for a quantized base).
fn adapters_cell(case: &Case) -> String {
    let Some(a) = &case.adapters else {
        return "—".into();
    };
    let targets = if a.target_modules.len() == 7 && a.target_modules.iter().all(|m| m.per_layer()) {
        "all 7".to_string()
    } else {
        a.target_modules
            .iter()
            .map(|m| m.hf_name().trim_end_matches("_proj"))
            .collect::<Vec<_>>()
            .join(",")
    };
    let base = match case.base_format {
        BaseFormat::Dense => "dense".to_string(),
        f => format!("{f}/{}", a.block_size),
    };
    format!("r{} {targets}, {base}", a.rank)
}

/// `CALIBRATE_GUARD=1`: each row's guard checks and their share of the
/// row's training loop (its steps and periodic checkpoints), and the median
/// over the grid against the < 1 % target.
fn guard_report(rows: &[Measured]) {
    let shares: Vec<f64> = rows
        .iter()
        .filter_map(|m| {
            let g = m.guard?;
            let share = g.seconds / g.training_seconds;
            println!(
                "guard {}: {} checks, {:.1} ms of a {:.2} s training loop ({:.3} %)",
                m.label,
                g.checks,
                g.seconds * 1e3,
                g.training_seconds,
                100.0 * share
            );
            Some(share)
        })
        .collect();
    if !shares.is_empty() {
        println!(
            "memory guard over {} rows: median {:.3} % of the training loop, max {:.3} % (target < 1 %)",
            shares.len(),
            100.0 * median(shares.clone()),
            100.0 * shares.iter().copied().fold(0.0, f64::max)
        );
    }
}

fn summary(rows: &[Measured], overhead: bool, pipeline: bool) {
    // Replica rows are held to the under-prediction target (an
    // under-prediction is an OOM kill) but not yet to the median: the ZeRO-1
    // model over-predicts them (docs/benchmarks.md) and is not calibrated.
    let (replicas, single): (Vec<&Measured>, Vec<&Measured>) =
        rows.iter().partition(|m| m.replicas > 1);
    let med = median(single.iter().map(|m| m.error().abs()).collect());
    let worst_under = rows.iter().map(|m| m.error()).fold(0.0f64, f64::min);
    println!(
        "\n{} cases without replicas: median |error| {:.1} % (target ≤ {:.0} %); all {} rows: worst under-prediction {:.1} % (target ≥ −{:.0} %)",
        single.len(),
        100.0 * med,
        100.0 * MEDIAN_TARGET,
        rows.len(),
        100.0 * worst_under,
        100.0 * UNDER_TARGET
    );
    if !replicas.is_empty() {
        let errors: Vec<f64> = replicas.iter().map(|m| m.error()).collect();
        println!(
            "{} replica rows: median error {:+.1} %, range {:+.1} … {:+.1} % (not in the median target)",
            replicas.len(),
            100.0 * median(errors.clone()),
            100.0 * errors.iter().copied().fold(f64::INFINITY, f64::min),
            100.0 * errors.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        );
    }
    guard_report(rows);
    if pipeline {
        throughput_report();
    }
    if overhead {
        telemetry_overhead();
    }
    if !(med <= MEDIAN_TARGET && worst_under >= -UNDER_TARGET) {
        std::process::exit(1);
    }
}
