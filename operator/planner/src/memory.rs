//! The memory model: bytes one worker (one pipeline stage on one device) needs.
//!
//! training = (weights + gradients + optimizer state) × (1 + state slack)
//!            + (activations + logits + composed weights) × (1 + activation slack)
//!            + fixed backend overhead, × correction;
//! total    = max(training, load peak).
//!
//! The two slacks are the backend profile's: the model states and the
//! activations leave different transients beside them (the optimizer's
//! per-parameter temporaries and the serialised checkpoint vs. backward's
//! gradients of the kept tensors), so one fraction of all tensor bytes
//! over-predicts a model with few activations and under-predicts one with
//! many. `MemoryBreakdown::allocator_slack` is their sum. A stage training
//! LoRA adapters without checkpointing takes the profile's
//! `adapter_activation_slack` instead: backward through its frozen
//! projections makes no weight gradients.
//!
//! Activations are counted one of two ways ([`ActivationCount`]):
//!
//! * Published: Korthikanti et al. 2022 generalised to any element size `e`
//!   and dropout-mask size `m` (bytes): per GPT block, per micro-batch of
//!   `b`, `s·b·h·(16e + 2m) + a·s²·b·(2e + m)`, which is the published
//!   `s·b·h·(34 + 5·a·s/h)` at e = 2, m = 1; a Llama block by
//!   [`LlamaShape::block_activation_bytes`](crate::LlamaShape::block_activation_bytes).
//! * Burn autodiff: the tensors burn 0.22's autodiff keeps for the Headroom
//!   worker's blocks, op by op ([`gpt_burn_block_bytes`],
//!   [`LlamaShape::burn_block_activation_bytes`](crate::LlamaShape::burn_block_activation_bytes)),
//!   plus the final norm's three per-token vectors on the last stage and
//!   the stage-boundary tensors a pipeline stage holds per in-flight
//!   micro-batch. The worker's attention is one op that keeps q, k, v, its
//!   output and a logsumexp per row (no `s × s` map outlives it; its
//!   transient is one block pair's scores, [`attention_transient_bytes`]),
//!   and its loss one op that keeps a logsumexp per row and one chunk of
//!   logits at a time ([`loss_bytes`]), so `logits` is that, not `s·b·v`.
//!   The CUDA worker runs the same ops, so both profiles count this way.
//!
//! With full activation checkpointing a block keeps only its input
//! (`s·b·h·e`) and one block at a time is recomputed in backward, so
//! checkpointing never raises the figure.
//!
//! # Model states, tensor by tensor
//!
//! [`stage_tensors`] lists the tensors a stage holds (the Llama modules
//! exactly; a GPT block as the worker builds it). Weights and gradients are
//! bytes per element; optimizer state is counted per tensor
//! ([`Optimizer::tensor_state_bytes`](crate::Optimizer::tensor_state_bytes)),
//! which 8-bit AdamW needs: its block-wise absmax is per tensor, and tensors
//! under 4096 elements (norm weights, biases) keep 32-bit moments.
//!
//! # The optimizer step
//!
//! The worker steps one tensor at a time once backward has freed the
//! activations (8-bit AdamW a slice of 1024 blocks of a tensor at a time,
//! `worker/src/optim/adamw8bit.rs`). The step's temporaries — new moments,
//! the direction, the decayed and updated weights — are the profile's
//! `optimizer_step_copies` f32 copies of the largest tensor a worker steps
//! (with replicas, of its own shard). That is its own phase: the training
//! peak holds the larger of it and the activation phase, and
//! [`MemoryBreakdown::optimizer_step`] is what the step needs beyond the
//! activations. It decides the peak where one tensor is large beside a
//! micro-batch's activations: a 2 × 768 GPT with a 16k vocabulary at
//! micro-batch 2 measured 443 MiB against 329 MiB predicted without it.
//!
//! # LoRA and QLoRA (Llama-family models)
//!
//! The worker adapts a model with burn 0.22's `apply_lora` / `apply_qlora`
//! (paths under `~/.cargo/registry/src/*/`), and the planner counts what
//! burn keeps, which is not what PEFT keeps:
//!
//! * Every base parameter is frozen: no gradient, no optimizer state
//!   (burn-core 0.22.1, `module::lora`: `<Lora as Reparameterizer>::reparameterize`
//!   calls `set_require_grad(false)` on the base).
//!   The factors `A: d_in × r` and `B: r × d_out` of each targeted matrix
//!   are built at the training precision (the same function, `dtype`) and
//!   carry weights, gradients, optimizer state and, in mixed precision,
//!   fp32 master weights (not on a backend whose half-precision stages
//!   train the half-precision weights themselves:
//!   [`BackendProfile::pure_half_precision`], the CUDA worker's case).
//! * QLoRA quantizes the seven linear weights of each decoder block (q, k,
//!   v, o, gate, up, down); embeddings, norms, biases and `lm_head` stay
//!   dense. A quantized tensor of n values stores `n × v` bytes (int8:
//!   v = 1; int4: the profile's `int4_value_bytes`: burn-flex keeps every
//!   quantized value as one i8, burn-flex 0.22.1's `FlexQTensor`,
//!   so 1.0 there; 0.5 where the backend packs) plus one f32 scale per
//!   `block_size` values.
//! * The worker runs the adapter beside the frozen matmul, as PEFT does:
//!   `x·W + s·(x·A)·B` (`worker/src/model/lean/linear.rs`), never burn's
//!   composed `W_eff = base + s·A@B` (which `Param::val` builds and the
//!   block's matmul would keep for backward: one dense copy per adapted
//!   matrix per graph). A dense frozen `W` costs nothing
//!   kept (the matmul keeps the parameter itself); a quantized one goes
//!   through the worker's frozen matmul, dequantized for the forward's
//!   product and again for backward's, never kept dense. What stays in
//!   [`MemoryBreakdown::composed_weights`]: the dense copy of the largest
//!   quantized matrix while one product runs, and an adapted `lm_head`,
//!   which the loss reads composed (kept, with its weight-shaped gradient).
//! * An adapter keeps the `r`-wide `x·A` (its `x` is the projection's
//!   input, counted with the block), and the frozen blocks keep less than under full fine-tuning, by
//!   burn's rule that a matmul or product keeps one operand only for the
//!   other's gradient (burn-autodiff 0.22.1, the backward
//!   of `float_mul` and of `float_matmul`): a frozen projection does not keep its input, a frozen γ not
//!   the RMSNorm's normalised tensor, and the first stage's first block
//!   (its input is the frozen embedding's) keeps nothing before its first
//!   adapted projection. `AdaptedBlock` follows the tracked flags through
//!   the worker's block op by op; with checkpointing every recomputed block's
//!   input is tracked (the worker asks for its gradient). On the calibration
//!   grid this lowered the non-checkpointed LoRA rows' estimates by 13-14 %
//!   (q,v) and 4-5 % (all seven linears).
//!
//! # Optimizer offload
//!
//! With `offload_optimizer` on a GPU backend the optimizer state and the
//! fp32 master weights live in host memory: they leave the device's
//! breakdown and make up [`MemoryBreakdown::host_bytes`] (with the state
//! slack). The worker is expected to step one parameter tensor at a time
//! on the host.
//!
//! # Offloaded gradients
//!
//! With `offload_gradients` (and checkpointing, and the optimizer
//! offloaded) on a GPU backend ([`offloads_gradients`]) backward runs block
//! by block, as checkpointing's recomputation already does, and after each
//! block's backward its gradients go to host memory at the training
//! precision and are added to an fp32 accumulator there; the step runs on
//! the host (where the offloaded state and master weights are) and the
//! updated weights come back at the training precision. The device keeps
//! one unit's gradients instead of the stage's (twice with accumulation):
//! [`MemoryBreakdown::gradients`] is the largest unit the worker's backward
//! hands over at once — one block's trained tensors, or the head (with the
//! final norm) at the loss, or the embedding at the end — and the same
//! bytes cover the updated weights of one unit on their way back, which
//! come after its gradients have left. The host adds the fp32 accumulator
//! of every trained value of the stage and one unit's staging copy at the
//! training precision to [`MemoryBreakdown::host_bytes`] (with the state
//! slack). The copies cross PCIe every micro-batch
//! ([`crate::timing::relative_compute`]). For a full fine-tune of
//! Llama-3-8B in bf16 that leaves 1.05 GB of gradients (the head's) on the
//! device instead of 32 GB with accumulation.
//!
//! # Compact host state
//!
//! With `compact_host_state` ([`compacts_host_state`]: the optimizer
//! offloaded, a half-precision stage, a GPU) the host keeps 2 bytes where
//! it kept 4, twice: instead of an fp32 master copy, the part of the
//! master below the device's bf16/fp16 weights, in bf16 (the master is
//! the weights plus it), and the offloaded gradients' sums in the training
//! precision instead of fp32. With 8-bit AdamW a full fine-tune's host
//! state goes from 10 bytes a trained value to 6: the seeds' 13B job on
//! two 24 GB cards needs 108 GiB of its node instead of 157. The search
//! tries it only after every option with the full state
//! (`search::numerics_options`).
//!
//! # Offloaded checkpoints
//!
//! With `offload_activations` (and checkpointing) on a GPU backend each
//! block's checkpointed input goes to host memory once the block's forward
//! has run and comes back when backward recomputes the block, as Unsloth's
//! offloaded gradient checkpointing does. The device keeps one block's
//! input (the block that runs, counted in its recomputation phase); the
//! others, of every micro-batch in flight, are in
//! [`MemoryBreakdown::host_bytes`] (with the state slack), beside an
//! offloaded optimizer state. The bytes are the kept inputs the planner
//! counts anyway, moved; the transfers are synchronous in the worker, so
//! they cost step time ([`crate::timing::relative_compute`]).
//!
//! # Offloaded embedding
//!
//! With `offload_embedding` a LoRA job's first stage on a GPU keeps its
//! frozen token embedding in host memory ([`offloads_embedding`]): the
//! worker looks the micro-batch's tokens up there and uploads their rows,
//! which are the first block's input the activations count anyway. The
//! table leaves `weights` for [`MemoryBreakdown::host_bytes`] (with the
//! state slack), and the load never uploads it: the device's load term is
//! the largest tensor the device receives, and the host's holds the
//! table's f32 read beside its stage-dtype copy. For Llama-3-8B that is
//! 1.05 GB of a 6 GB QLoRA stage. A tied embedding is the head's weight
//! and stays.
//!
//! # Load peak (Llama checkpoints)
//!
//! Loading a stage's weights from a Hugging Face checkpoint is its own
//! peak, before training allocates anything (`docs/benchmarks.md`, "Loading
//! a checkpoint"): on top of the stage's weights, `F + k·C + 2k·B` bytes at
//! the checkpoint's stored element size — F the stage's tensors in the file
//! it reads most of (the planner does not know the shards, so all of the
//! stage: an upper bound), C the largest tensor the load converts, B the
//! largest linear of a block, k = 1 when the load casts 16-bit values to
//! f32 and 2 for an f32 checkpoint ([`load_transient`]). On a CPU worker
//! (`device_is_host`) that is the budgeted memory; on a GPU the device sees
//! only the stage's weights plus one tensor's f32 upload, and the host-side
//! transient is part of [`MemoryBreakdown::host_bytes`]. On a GPU the load
//! streams (worker/src/model/hf.rs): the checkpoint is read through a memory
//! map tensor by tensor and each tensor is uploaded before the next is
//! read, so the host holds the largest tensor's mapped pages and its
//! conversion copies, not the stage's file ([`streaming_load_bytes`]),
//! beside what the plan keeps there. A quantized base
//! is loaded part by part and quantized block by block as it loads, never
//! the whole stage dense first; on the host its peak is
//! [`quantized_load_bytes`] (one dense block beside the quantized ones, or
//! the dense embedding and head while they load, whichever is more).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::adapters::{BaseFormat, LoraConfig};
use crate::backend::{ActivationCount, BackendProfile};
use crate::llama::{LlamaArchitecture, LlamaShape};
use crate::model::{ModelShape, TransformerShape};
use crate::target_module::TargetModule;
use crate::training::{Optimizer, Precision, Settings};

/// Bytes by component for one worker. `total` is what is compared with the budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryBreakdown {
    /// Parameters on the device, bytes (a quantized LoRA base at its stored
    /// size, plus the adapters).
    pub weights: u64,
    /// Gradients (and the accumulation buffer when accumulating) of the
    /// trained parameters, bytes.
    pub gradients: u64,
    /// Optimizer state (e.g. AdamW's two moments) and mixed precision's
    /// fp32 master weights on the device, bytes (0 when offloaded).
    pub optimizer_state: u64,
    /// Activations kept for the backward pass of the micro-batches in flight, bytes.
    pub activations: u64,
    /// Logits and their gradient for one micro-batch, bytes.
    pub logits: u64,
    /// LoRA/QLoRA: the dense weights a stage still makes, bytes: the
    /// largest quantized matrix dequantized for one product, an adapted
    /// `lm_head` composed for the loss with its gradient (0 for full
    /// fine-tuning and for a dense base without an adapted head; see the
    /// module docs).
    #[serde(default)]
    pub composed_weights: u64,
    /// Data-parallel replicas: the buffers of the gradient reduce-scatter and
    /// the weight all-gather (a bucket and the ring's chunks in flight,
    /// [`crate::sharding::collective_buffer_bytes`]), bytes.
    #[serde(default)]
    pub collective_buffers: u64,
    /// The optimizer step beyond the activation phase, bytes. The step runs
    /// once backward has freed the activations; its temporaries (the
    /// profile's `optimizer_step_copies` f32 copies of the largest tensor
    /// the worker steps) outgrow them when one tensor is large beside a
    /// micro-batch's activations (a big embedding, a small micro-batch).
    /// What the step needs beyond the activation phase's terms
    /// (activations, logits, composed weights, collective buffers) and,
    /// with replicas, beyond the largest shard's state; 0 when the
    /// activation phase is the larger.
    #[serde(default)]
    pub optimizer_step: u64,
    /// The backend's fixed overhead (runtime, context, workspace), bytes.
    pub fixed_overhead: u64,
    /// Allocator fragmentation and caching on top of the above, and on a
    /// GPU the arena's last page ([`arena_page_bytes`]), bytes.
    pub allocator_slack: u64,
    /// Added by what earlier attempts' failures proved (0 on a first
    /// attempt): the correction factor applied to the estimated terms only
    /// ([`Self::estimated`]), never to the counted ones.
    pub correction: u64,
    /// The predicted peak while the stage loads its checkpoint (fixed
    /// overhead, the stage's weights and the load's transient, with the
    /// state slack and the correction), bytes; 0 for a model that loads no
    /// Hugging Face checkpoint.
    #[serde(default)]
    pub load_peak: u64,
    /// Host memory a GPU worker needs beyond its process baseline, bytes:
    /// the offloaded optimizer state and master weights, or the checkpoint
    /// load's host-side transient, whichever is larger (the load ends before
    /// the first step allocates state). The pod's memory request must hold
    /// it. 0 on CPU workers, whose host memory is the budget above.
    #[serde(default)]
    pub host_bytes: u64,
    /// The predicted peak, bytes: the larger of the training sum (every
    /// component above from `weights` to `correction`) and `load_peak`.
    pub total: u64,
}

impl MemoryBreakdown {
    /// The terms an out-of-memory failure can correct, bytes: the ones the
    /// planner estimates from a model of what the worker keeps — the
    /// optimizer state (8-bit blocks and their buffers, master weights),
    /// activations, logits, composed weights and collective buffers. The
    /// weights and gradients are counted exactly from the parameters, and
    /// the fixed overhead is measured; an over-run is not theirs. A retry's
    /// correction factor multiplies these terms only, so a rung that shrinks
    /// one (checkpointing the activations, halving the micro-batch) shrinks
    /// its correction with it.
    pub fn estimated(&self) -> u64 {
        self.optimizer_state
            + self.activations
            + self.logits
            + self.composed_weights
            + self.collective_buffers
            + self.optimizer_step
    }

    /// The training peak: the sum of the components, without the load peak.
    pub fn training_total(&self) -> u64 {
        self.weights
            + self.gradients
            + self.optimizer_state
            + self.activations
            + self.logits
            + self.composed_weights
            + self.collective_buffers
            + self.optimizer_step
            + self.fixed_overhead
            + self.allocator_slack
            + self.correction
    }
}

/// Where a stage sits in the pipeline and how much of the model it holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StagePlacement {
    /// Transformer blocks on this stage.
    pub layers: u32,
    /// Holds the embeddings.
    pub first: bool,
    /// Holds the final norm, output head and loss.
    pub last: bool,
    /// Micro-batches whose activations are alive at once (1F1B: p − k on stage k).
    pub in_flight: u32,
    /// Data-parallel replicas of this stage: each keeps the optimizer state
    /// of its share of the trained tensors ([`crate::sharding`]; 1: all).
    pub replicas: u32,
}

impl StagePlacement {
    /// The whole model on one worker.
    pub fn single(layers: u32) -> Self {
        StagePlacement {
            layers,
            first: true,
            last: true,
            in_flight: 1,
            replicas: 1,
        }
    }
}

/// What a tensor is, as far as memory is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TensorRole {
    /// A token (or position) embedding table.
    Embedding,
    /// A linear weight inside a decoder block; for Llama, which module.
    BlockLinear(Option<TargetModule>),
    /// The output head's weight: untied, or a tied head's own copy on a
    /// stage without the embedding.
    Head,
    /// Norm weights and biases, linear biases: vectors.
    Vector,
}

/// `count` tensors of `elements` each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StageTensor {
    pub role: TensorRole,
    pub elements: u64,
    pub count: u64,
}

impl StageTensor {
    fn new(role: TensorRole, elements: u64, count: u64) -> Self {
        StageTensor {
            role,
            elements,
            count,
        }
    }

    pub fn total_elements(&self) -> u64 {
        self.elements * self.count
    }
}

/// The parameter tensors one stage holds. Their elements add up to the
/// model's parameter counts ([`LlamaShape::params_per_layer`] and its
/// embedding/head counts; a GPT block as `TransformerShape` counts it); a
/// generic model is one tensor.
pub fn stage_tensors(model: &ModelShape, stage: StagePlacement) -> Vec<StageTensor> {
    use TensorRole::*;
    let layers = u64::from(stage.layers);
    let mut out = Vec::new();
    match model {
        ModelShape::Transformer(t) => {
            let (h, f, v) = (u64::from(t.hidden), t.ffn(), u64::from(t.vocabulary));
            if layers > 0 {
                // Fused QKV, output projection, the two feed-forward
                // projections, their biases and two LayerNorms (weight, bias).
                out.push(StageTensor::new(BlockLinear(None), 3 * h * h, layers));
                out.push(StageTensor::new(Vector, 3 * h, layers));
                out.push(StageTensor::new(BlockLinear(None), h * h, layers));
                out.push(StageTensor::new(BlockLinear(None), h * f, layers));
                out.push(StageTensor::new(Vector, f, layers));
                out.push(StageTensor::new(BlockLinear(None), f * h, layers));
                out.push(StageTensor::new(Vector, h, 6 * layers));
            }
            if stage.first {
                out.push(StageTensor::new(Embedding, v * h, 1));
                out.push(StageTensor::new(
                    Embedding,
                    u64::from(t.sequence_length) * h,
                    1,
                ));
            }
            if stage.last {
                out.push(StageTensor::new(Vector, h, 2));
                if !t.tied_embeddings || !stage.first {
                    out.push(StageTensor::new(Head, v * h, 1));
                }
            }
        }
        ModelShape::Llama(l) => {
            let h = u64::from(l.hidden);
            if layers > 0 {
                for &m in l.architecture.block_linears() {
                    let (d_in, d_out) = m.dims(l);
                    out.push(StageTensor::new(BlockLinear(Some(m)), d_in * d_out, layers));
                }
                // Two norms a block; Gemma's four.
                let norms = if l.architecture.gemma() { 4 } else { 2 };
                out.push(StageTensor::new(Vector, h, norms * layers));
                if l.attention_bias {
                    out.push(StageTensor::new(Vector, l.q_dim(), layers));
                    out.push(StageTensor::new(Vector, l.kv_dim(), 2 * layers));
                    if l.architecture != LlamaArchitecture::Qwen2 {
                        out.push(StageTensor::new(Vector, h, layers));
                    }
                }
                if l.architecture.qk_norm() {
                    out.push(StageTensor::new(Vector, u64::from(l.head_dim), 2 * layers));
                }
                if l.mlp_bias {
                    out.push(StageTensor::new(
                        Vector,
                        u64::from(l.intermediate),
                        2 * layers,
                    ));
                    out.push(StageTensor::new(Vector, h, layers));
                }
            }
            if stage.first {
                out.push(StageTensor::new(Embedding, l.embedding_params(), 1));
            }
            if stage.last {
                out.push(StageTensor::new(Vector, h, 1));
                if !l.tied_embeddings || !stage.first {
                    out.push(StageTensor::new(Head, l.embedding_params(), 1));
                }
            }
        }
        ModelShape::Generic(g) => out.push(StageTensor::new(BlockLinear(None), g.parameters, 1)),
    }
    out
}

/// Stored bytes of `elements` values in a quantized `format` with one f32
/// scale per `block` values; `elements × weight bytes` for dense. NF4 has
/// bitsandbytes' fixed blocks instead: half a byte a value, one byte per 64
/// values, one f32 per 256 blocks and one per tensor (the worker's
/// `Nf4Tensor::bytes_for`).
pub fn base_tensor_bytes(
    elements: u64,
    format: BaseFormat,
    block: u32,
    precision: Precision,
    profile: &BackendProfile,
) -> u64 {
    let value_bytes = match format {
        BaseFormat::Dense => return elements * precision.weight_bytes(),
        BaseFormat::Nf4 => {
            let blocks = elements.div_ceil(NF4_BLOCK);
            return elements.div_ceil(2) + blocks + 4 * blocks.div_ceil(NF4_NESTED_BLOCK) + 4;
        }
        BaseFormat::Int8 => 1.0,
        BaseFormat::Int4 => profile.int4_value_bytes,
    };
    (elements as f64 * value_bytes).ceil() as u64 + 4 * elements.div_ceil(u64::from(block.max(1)))
}

/// The trainable LoRA factors on a stage: A and B of every targeted block
/// matrix (`count` = the stage's layers) and of `lm_head` on the last stage.
fn adapter_tensors(l: &LlamaShape, lora: &LoraConfig, stage: StagePlacement) -> Vec<StageTensor> {
    let r = u64::from(lora.rank);
    let layers = u64::from(stage.layers);
    let mut out = Vec::new();
    for &m in &lora.target_modules {
        let count = if m.per_layer() {
            layers
        } else if stage.last {
            1
        } else {
            0
        };
        if count == 0 {
            continue;
        }
        let (d_in, d_out) = m.dims(l);
        let role = TensorRole::BlockLinear(Some(m));
        out.push(StageTensor::new(role, d_in * r, count));
        out.push(StageTensor::new(role, r * d_out, count));
    }
    out
}

/// Element size of the checkpoint's stored floats, from `torch_dtype`
/// (Hugging Face's default, absent, is float32).
fn stored_element_bytes(l: &LlamaShape) -> u64 {
    match l.torch_dtype.as_deref() {
        Some("bfloat16" | "float16" | "half" | "bf16" | "fp16") => 2,
        _ => 4,
    }
}

/// The load's transient beyond the stage's weights, in bytes:
/// `(host transient F + k·C + 2k·B at the stored element size, the largest
/// tensor's elements)` for the stage's `tensors` (see the module docs and
/// `docs/benchmarks.md`).
pub fn load_transient(tensors: &[StageTensor], stored_bytes: u64) -> (u64, u64) {
    let casts = stored_bytes < 4;
    let k = if casts { 1 } else { 2 };
    let f: u64 = tensors.iter().map(StageTensor::total_elements).sum::<u64>() * stored_bytes;
    let largest = |keep: &dyn Fn(TensorRole) -> bool| {
        tensors
            .iter()
            .filter(|t| keep(t.role))
            .map(|t| t.elements)
            .max()
            .unwrap_or(0)
    };
    let c = if casts {
        largest(&|_| true)
    } else {
        largest(&|r| matches!(r, TensorRole::BlockLinear(_) | TensorRole::Head))
    };
    let b = largest(&|r| matches!(r, TensorRole::BlockLinear(_)));
    (
        f + k * c * stored_bytes + 2 * k * b * stored_bytes,
        largest(&|_| true),
    )
}

/// The host side of a streaming load, bytes: the largest tensor's mapped
/// pages (`C` at the stored size) where [`load_transient`] has the whole
/// stage's file (`F`), beside the same conversion copies (`k·C + 2k·B`).
/// The term follows worker/src/model/hf.rs's streaming load: safetensors
/// read through a memory map tensor by tensor, each tensor converted and
/// handed over before the next is read, so no more than one tensor's pages
/// are resident for it.
pub fn streaming_load_bytes(tensors: &[StageTensor], stored_bytes: u64) -> u64 {
    let (transient, largest) = load_transient(tensors, stored_bytes);
    let file: u64 = tensors.iter().map(StageTensor::total_elements).sum::<u64>() * stored_bytes;
    transient - file + largest * stored_bytes
}

/// What a stage with a quantized base holds at the peak of its load on the
/// host, bytes, `weights` (the quantized base, the dense rest and the
/// adapters) included. The worker loads such a stage part by part
/// (worker/src/model/lora.rs, `load_quantized`): the embedding and the head
/// first, each from stores of its own, then each block, quantized before
/// the next is read. The peak is the larger of
/// * the dense parts' phase: the embedding and head at f32, plus one part's
///   mapped pages and conversion copies at the stored size (`F + k·C` with
///   the part's tensor as C; k = 1, or 2 for an f32 checkpoint's head,
///   which is copied and transposed);
/// * the blocks' phase: everything held, plus one block dense at f32 and
///   its mapped pages at the stored size, plus `2k·B` (the conversion
///   buffers the allocator keeps, as for a dense load).
///
/// Measured in `docs/benchmarks.md` ("Loading a checkpoint", QLoRA rows).
pub fn quantized_load_bytes(tensors: &[StageTensor], stored_bytes: u64, weights: u64) -> u64 {
    let dense_part = |role: TensorRole| -> Vec<StageTensor> {
        tensors.iter().filter(|t| t.role == role).copied().collect()
    };
    let (embedding, head) = (
        dense_part(TensorRole::Embedding),
        dense_part(TensorRole::Head),
    );
    let dense_f32: u64 = embedding
        .iter()
        .chain(&head)
        .map(StageTensor::total_elements)
        .sum::<u64>()
        * 4;
    let k = if stored_bytes < 4 { 1 } else { 2 };
    let part = |tensors: &[StageTensor], k: u64| -> u64 {
        let f: u64 = tensors.iter().map(StageTensor::total_elements).sum();
        let c = tensors.iter().map(|t| t.elements).max().unwrap_or(0);
        (f + k * c) * stored_bytes
    };
    let dense_phase = dense_f32 + part(&embedding, 1).max(part(&head, k));
    let linears: Vec<&StageTensor> = tensors
        .iter()
        .filter(|t| matches!(t.role, TensorRole::BlockLinear(_)))
        .collect();
    let block: u64 = linears.iter().map(|t| t.elements).sum();
    let largest = linears.iter().map(|t| t.elements).max().unwrap_or(0);
    let block_phase = weights + block * (4 + stored_bytes) + 2 * k * largest * stored_bytes;
    dense_phase.max(block_phase)
}

/// Values per NF4 block, and 8-bit block absmax values per nested f32
/// scale (bitsandbytes' QLoRA defaults; `worker/src/model/nf4.rs`).
pub const NF4_BLOCK: u64 = 64;
pub const NF4_NESTED_BLOCK: u64 = 256;

/// Values of an NF4 matrix the worker dequantizes at a time
/// (`worker/src/model/nf4.rs`, `Nf4Weight::chunk_rows`): a larger matrix's
/// matmul runs a slice of rows at a time, so its transient is bounded.
pub const NF4_DEQUANT_CHUNK_VALUES: u64 = 4 << 20;

/// Bytes per value of an NF4 slice being dequantized: the f32 code values
/// and their scaled copy (the i32 codes they are looked up with are freed
/// before the scaling), then the cast to the training precision.
const NF4_DEQUANT_BYTES_PER_VALUE: u64 = 8;

/// Logits the worker's loss op holds at a time (`worker/src/model/lean/
/// cross_entropy.rs`): rows per chunk = this / vocabulary, at least one.
pub const LOSS_CHUNK_ELEMENTS: u64 = 8 << 20;

/// Activation bytes one transformer block keeps for backward, for one micro-batch.
pub fn block_activation_bytes(
    s: u64,
    b: u64,
    h: u64,
    a: u64,
    element_bytes: u64,
    mask_bytes: u64,
    checkpointed: bool,
) -> u64 {
    if checkpointed {
        s * b * h * element_bytes
    } else {
        s * b * h * (16 * element_bytes + 2 * mask_bytes)
            + a * s * s * b * (2 * element_bytes + mask_bytes)
    }
}

/// Activation bytes burn's autodiff keeps for one Headroom GPT block
/// (`worker/src/model/gpt.rs`), one micro-batch, without checkpointing.
/// Per token: each LayerNorm keeps its centred input, the normalised tensor
/// and its output (3h, twice; burn's composite layer norm); the fused QKV
/// output (3h, which the attention op holds as views of q, k and v); the
/// op's output (h) and the merged heads' contiguous copy that the output
/// projection keeps (h); the feed-forward input's output that GELU keeps
/// (f) and GELU's output that the second projection keeps (f); per head, the
/// op's logsumexp (one value). No `s × s` map outlives the attention op.
pub fn gpt_burn_block_bytes(s: u64, b: u64, h: u64, a: u64, f: u64, e: u64) -> u64 {
    s * b * (11 * h + 2 * f + a) * e
}

/// The attention op's transient (`worker/src/model/lean/attention.rs`):
/// the score-sized tensors of one block pair alive at once (scores,
/// probabilities, and in backward their gradient and the product with v),
/// `b · heads · block²` each, with blocks of `block` rows
/// ([`BackendProfile::attention_block`]) or the whole sequence when shorter.
pub fn attention_transient_bytes(s: u64, b: u64, heads: u64, e: u64, block: u64) -> u64 {
    let block = s.min(block);
    4 * b * heads * block * block * e
}

/// The loss op's bytes (`worker/src/model/lean/cross_entropy.rs`): the
/// logsumexp it keeps per row (f32) and the f32 logits of one chunk of
/// rows, `copies` of them alive at once (logits, their exponentials, and
/// in backward the gradient), where a chunk is [`LOSS_CHUNK_ELEMENTS`] /
/// `vocab` rows, at most all `rows`.
pub fn loss_bytes(rows: u64, vocab: u64, copies: f64) -> u64 {
    let chunk = loss_chunk_bytes(rows.max(1), vocab, true);
    rows * 4 + (copies * chunk as f64).round() as u64
}

/// One page of `profile`'s arena when its largest request is `largest`
/// bytes: what the arena may hold beyond its live bytes, since it keeps
/// whole pages (`BackendProfile::arena_page_slack_bytes`); 0 without an
/// arena.
pub fn arena_page_bytes(profile: &BackendProfile, largest: u64) -> u64 {
    let granule = profile.arena_page_slack_bytes;
    if granule == 0 {
        return 0;
    }
    (largest + granule).div_ceil(granule).max(2) * granule
}

/// Whether a stage with `settings` keeps its checkpointed block inputs in
/// host memory: asked for, with checkpointing on, on a backend whose worker
/// does it and whose device is not the host.
pub fn offloads_activations(settings: &Settings, profile: &BackendProfile) -> bool {
    settings.offload_activations
        && settings.activation_checkpointing
        && profile.activation_offload
        && !profile.device_is_host
}

/// Whether a stage with `settings` moves its gradients to host memory block
/// by block ([`Settings::offload_gradients`]): asked for, with
/// checkpointing (backward runs block by block) and the optimizer offloaded
/// (the step that takes them is the host's), on a backend whose worker does
/// it and whose device is not the host.
pub fn offloads_gradients(settings: &Settings, profile: &BackendProfile) -> bool {
    settings.offload_gradients
        && settings.activation_checkpointing
        && settings.offload_optimizer
        && profile.gradient_offload
        && profile.optimizer_offload
        && !profile.device_is_host
}

/// Whether a stage with `settings` keeps its offloaded state compact
/// ([`Settings::compact_host_state`]): asked for, with the optimizer
/// offloaded, in a half precision (an fp32 stage has no master copy to
/// split and sums what it computes), where the device is not the host.
pub fn compacts_host_state(settings: &Settings, profile: &BackendProfile) -> bool {
    settings.compact_host_state
        && settings.offload_optimizer
        && settings.precision != Precision::Fp32
        && profile.optimizer_offload
        && !profile.device_is_host
}

/// Whether `stage` keeps its token embedding in host memory: asked for, on
/// a backend whose worker does it and whose device is not the host, for the
/// first stage of a LoRA job (`adapters`: the embedding is frozen) whose
/// embedding is not also its head's weight (tied, the head needs it on the
/// device).
pub fn offloads_embedding(
    model: &ModelShape,
    adapters: bool,
    settings: &Settings,
    stage: StagePlacement,
    profile: &BackendProfile,
) -> bool {
    settings.offload_embedding
        && profile.embedding_offload
        && !profile.device_is_host
        && adapters
        && stage.first
        && matches!(model, ModelShape::Llama(l) if !l.tied_embeddings)
}

/// Bytes of the loss op's chunk of f32 logits over `rows` rows, on the
/// stage that computes the loss (`last`); 0 elsewhere.
fn loss_chunk_bytes(rows: u64, vocab: u64, last: bool) -> u64 {
    if last {
        loss_chunk_rows(vocab).min(rows) * vocab * 4
    } else {
        0
    }
}

/// Rows of the loss op's chunk for a vocabulary of `vocab`: what the worker
/// asks the op for and what [`loss_bytes`] counts.
pub fn loss_chunk_rows(vocab: u64) -> u64 {
    (LOSS_CHUNK_ELEMENTS / vocab.max(1)).max(1)
}

/// Predicted memory of one stage (or of the whole model when `stage` is
/// [`StagePlacement::single`]). `adapters`: the job's LoRA adapters (only
/// Llama-family models have them; ignored for others), `None` for full
/// fine-tuning. `correction` ≥ 1 scales the estimated terms.
///
/// The module's formula, term by term: the model states (weights,
/// gradients, optimizer state) and the activation phase's transient
/// (activations, logits, composed weights, collective buffers, the
/// optimizer step beyond them), each with its slack, the fixed overhead
/// and the correction; the total is the larger of that and the load peak.
pub fn estimate_stage(
    model: &ModelShape,
    adapters: Option<&LoraConfig>,
    settings: &Settings,
    stage: StagePlacement,
    profile: &BackendProfile,
    correction: f64,
) -> MemoryBreakdown {
    let count = StageCount::new(model, adapters, settings, stage, profile);
    let phase = count.activation_phase();
    let host_embedding = count.host_embedding_bytes();
    let weights = count.weights(host_embedding);
    let gradients = count.gradients();
    // Under ZeRO-1 the largest replica's share of the state (and of the
    // master weights, which live with the state).
    let ranks = sharded_state_bytes(&count.trained, settings, profile, stage.replicas);
    let optimizer_total = ranks.iter().map(|r| r.0).max().unwrap_or(0);
    let optimizer_state = if count.offloads_optimizer() {
        0
    } else {
        optimizer_total
    };
    let composed_weights = count.composed_weights();
    let collective_buffers = count.collective_buffers();

    let states = weights + gradients + optimizer_state;
    let transient = phase.activations + phase.logits + composed_weights + collective_buffers;
    let optimizer_step = count.optimizer_step(&ranks, optimizer_state, transient);
    let transient = transient + optimizer_step;
    let allocator_slack = count.allocator_slack(states, transient, phase.widest);
    let fixed_overhead = fixed_overhead_bytes(profile, stage);
    // What earlier failures proved, on the estimated terms only
    // (`MemoryBreakdown::estimated`).
    let factor = correction.max(1.0);
    let correction = correction_bytes(factor, optimizer_state + transient);
    let training = states + transient + allocator_slack + fixed_overhead + correction;

    let load = count.load_phase(weights, host_embedding, fixed_overhead, factor);
    let host_bytes = count.host_bytes(
        optimizer_total + count.host_gradient_bytes(),
        phase.offloaded_inputs + host_embedding,
        load.host,
    );
    MemoryBreakdown {
        weights,
        gradients,
        optimizer_state,
        activations: phase.activations,
        logits: phase.logits,
        composed_weights,
        collective_buffers,
        optimizer_step,
        fixed_overhead,
        allocator_slack,
        correction,
        load_peak: load.peak,
        host_bytes,
        total: training.max(load.peak),
    }
}

/// The backend's fixed overhead on a stage: its runtime's, and a link
/// buffer for each neighbouring stage.
fn fixed_overhead_bytes(profile: &BackendProfile, stage: StagePlacement) -> u64 {
    let links = u64::from(!stage.first) + u64::from(!stage.last);
    profile.fixed_overhead_bytes + links * profile.stage_link_bytes
}

/// The correction for a `factor` (≥ 1) that earlier failures proved,
/// applied to the `estimated` terms only.
fn correction_bytes(factor: f64, estimated: u64) -> u64 {
    ((factor - 1.0) * estimated as f64).round() as u64
}

/// The activation phase's terms of one stage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ActivationPhase {
    /// What the device keeps for backward, with the phase's transients and
    /// the stage boundary's tensors ([`MemoryBreakdown::activations`]).
    activations: u64,
    /// The loss op's bytes ([`MemoryBreakdown::logits`]).
    logits: u64,
    /// The kept block inputs that wait in host memory instead of on the device.
    offloaded_inputs: u64,
    /// The largest activation-phase request cubecl's arena serves (an arena
    /// page's size): the widest per-token activation, or on the last stage
    /// the loss op's chunk of f32 logits.
    widest: u64,
}

/// The activation bytes of a stage's blocks for its micro-batches in flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct KeptBlocks {
    /// What the stage's blocks keep, all micro-batches in flight.
    kept: u64,
    /// One whole block's kept bytes, without checkpointing.
    one_block: u64,
    /// What recomputing one checkpointed block adds to its kept input (0
    /// without checkpointing).
    recomputed: u64,
}

/// The phase around one stage's blocks: what it adds beside their kept bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct PhaseTransients {
    /// The attention op's transient ([`attention_transient_bytes`]).
    attention: u64,
    /// One `[b, s, h]` tensor, bytes.
    token_vector: u64,
    /// Vectors the final norm keeps on the last stage ([`boundary_bytes`]).
    final_norm: u64,
}

/// One stage's inputs and the tensors they imply, from which each term of
/// the breakdown is counted.
struct StageCount<'a> {
    model: &'a ModelShape,
    /// The job's adapters as given (ignored for a model without any).
    adapters: Option<&'a LoraConfig>,
    /// The adapters of a Llama-family model: what the stage trains instead
    /// of its parameters.
    lora: Option<(&'a LlamaShape, &'a LoraConfig)>,
    settings: &'a Settings,
    stage: StagePlacement,
    profile: &'a BackendProfile,
    /// Every parameter tensor of the stage ([`stage_tensors`]).
    tensors: Vec<StageTensor>,
    /// What is trained: every tensor, or only the adapters.
    trained: Vec<StageTensor>,
    /// The frozen base's format; a quantized base only exists under
    /// adapters (full fine-tuning trains it dense).
    base_format: BaseFormat,
    /// Whether the token embedding waits in host memory ([`offloads_embedding`]).
    embedding_on_host: bool,
}

impl<'a> StageCount<'a> {
    fn new(
        model: &'a ModelShape,
        adapters: Option<&'a LoraConfig>,
        settings: &'a Settings,
        stage: StagePlacement,
        profile: &'a BackendProfile,
    ) -> Self {
        let tensors = stage_tensors(model, stage);
        let lora = match model {
            ModelShape::Llama(l) => adapters.map(|a| (l, a)),
            _ => None,
        };
        let base_format = if lora.is_some() {
            settings.base_format
        } else {
            BaseFormat::Dense
        };
        let trained = match lora {
            Some((l, a)) => adapter_tensors(l, a, stage),
            None => tensors.clone(),
        };
        let embedding_on_host = offloads_embedding(model, lora.is_some(), settings, stage, profile);
        StageCount {
            model,
            adapters,
            lora,
            settings,
            stage,
            profile,
            tensors,
            trained,
            base_format,
            embedding_on_host,
        }
    }

    fn precision(&self) -> Precision {
        self.settings.precision
    }

    fn trained_params(&self) -> u64 {
        self.trained.iter().map(StageTensor::total_elements).sum()
    }

    /// The optimizer state and its step live in host memory.
    fn offloads_optimizer(&self) -> bool {
        self.settings.offload_optimizer && !self.profile.device_is_host
    }

    /// The stage's parameters at their stored size: a quantized base's
    /// block linears in its format, everything else dense.
    fn base_bytes(&self) -> u64 {
        let block_size = self.adapters.map_or(64, |a| a.block_size);
        let quantized = |t: &StageTensor| {
            self.base_format.is_quantized() && matches!(t.role, TensorRole::BlockLinear(Some(_)))
        };
        self.tensors
            .iter()
            .map(|t| {
                let format = if quantized(t) {
                    self.base_format
                } else {
                    BaseFormat::Dense
                };
                t.count
                    * base_tensor_bytes(
                        t.elements,
                        format,
                        block_size,
                        self.precision(),
                        self.profile,
                    )
            })
            .sum()
    }

    /// An offloaded embedding (see the module docs): host memory, at the
    /// stage's element size, and never uploaded whole; 0 when on the device.
    fn host_embedding_bytes(&self) -> u64 {
        if !self.embedding_on_host {
            return 0;
        }
        self.tensors
            .iter()
            .filter(|t| t.role == TensorRole::Embedding)
            .map(|t| t.total_elements() * self.precision().weight_bytes())
            .sum()
    }

    /// [`MemoryBreakdown::weights`]: the base, and under adapters the
    /// factors beside it less an embedding kept on the host.
    fn weights(&self, host_embedding: u64) -> u64 {
        let base_bytes = self.base_bytes();
        if self.lora.is_some() {
            base_bytes - host_embedding + self.trained_params() * self.precision().weight_bytes()
        } else {
            base_bytes
        }
    }

    /// [`MemoryBreakdown::gradients`]: accumulating gradients keeps the
    /// running sum beside the current micro-batch's; offloaded, one unit's
    /// in flight ([`Self::gradient_unit_elements`]).
    fn gradients(&self) -> u64 {
        if offloads_gradients(self.settings, self.profile) {
            return self.gradient_unit_elements() * self.precision().gradient_bytes();
        }
        let copies = if self.settings.gradient_accumulation > 1 {
            2
        } else {
            1
        };
        self.trained_params() * self.precision().gradient_bytes() * copies
    }

    /// The most trained values whose gradients the worker's block-by-block
    /// backward hands to the host at once (see the module docs): one
    /// block's trained tensors, or a trained tensor outside the blocks
    /// (the embedding, the head, whose unit also takes the final norm's
    /// vector).
    fn gradient_unit_elements(&self) -> u64 {
        let layers = u64::from(self.stage.layers);
        let in_blocks = |t: &StageTensor| {
            layers > 0
                && t.count >= layers
                && t.count.is_multiple_of(layers)
                && matches!(t.role, TensorRole::BlockLinear(_) | TensorRole::Vector)
        };
        let block: u64 = self
            .trained
            .iter()
            .filter(|t| in_blocks(t))
            .map(|t| t.total_elements() / layers)
            .sum();
        let vectors: u64 = self
            .trained
            .iter()
            .filter(|t| !in_blocks(t) && t.role == TensorRole::Vector)
            .map(StageTensor::total_elements)
            .sum();
        let largest_outside = self
            .trained
            .iter()
            .filter(|t| !in_blocks(t) && t.role != TensorRole::Vector)
            .map(|t| t.elements)
            .max()
            .unwrap_or(0);
        block.max(largest_outside + vectors)
    }

    /// What offloaded gradients keep in host memory, bytes (0 when they are
    /// on the device): the accumulator of every trained value of the stage
    /// (fp32, or the training precision when the host state is compact),
    /// and one unit's staging copy at the training precision as it arrives.
    fn host_gradient_bytes(&self) -> u64 {
        if !offloads_gradients(self.settings, self.profile) {
            return 0;
        }
        let sum = if compacts_host_state(self.settings, self.profile) {
            self.precision().gradient_bytes()
        } else {
            4
        };
        self.trained_params() * sum
            + self.gradient_unit_elements() * self.precision().gradient_bytes()
    }

    /// [`MemoryBreakdown::composed_weights`] ([`composed_weight_bytes`]).
    fn composed_weights(&self) -> u64 {
        match self.lora {
            Some((l, a)) => composed_weight_bytes(
                l,
                a,
                self.base_format,
                self.stage,
                self.precision().activation_bytes(),
            ),
            None => 0,
        }
    }

    /// [`MemoryBreakdown::collective_buffers`]: a bucket is never larger
    /// than the stage's trained values (f32).
    fn collective_buffers(&self) -> u64 {
        crate::sharding::collective_buffer_bytes(
            self.profile
                .collective_bucket_bytes
                .min(4 * self.trained_params()),
            self.stage.replicas,
        )
    }

    /// [`MemoryBreakdown::optimizer_step`]: the step's phase, rank by rank
    /// (`ranks` from [`sharded_state_bytes`]): a replica steps its own
    /// shard, one tensor at a time, after backward freed the activation
    /// phase's `transient` (offloaded, the step runs on the host; plain SGD
    /// keeps no state to replace).
    fn optimizer_step(&self, ranks: &[(u64, u64)], optimizer_state: u64, transient: u64) -> u64 {
        if self.offloads_optimizer() || self.settings.optimizer == Optimizer::Sgd {
            return 0;
        }
        let copies = self.profile.optimizer_step_copies;
        let step = |largest: u64| (copies * 4.0 * largest as f64).round() as u64;
        let worst = ranks
            .iter()
            .map(|&(state, largest)| state + transient.max(step(largest)))
            .max()
            .unwrap_or(0);
        worst.saturating_sub(optimizer_state + transient)
    }

    /// [`MemoryBreakdown::allocator_slack`]: the profile's slacks on the
    /// model `states` and the `transient`, and the arena's last page, whose
    /// largest request is a trained tensor's gradient (weights live in
    /// cubecl's persistent pool, exact size) or the activation phase's `widest`.
    fn allocator_slack(&self, states: u64, transient: u64, widest: u64) -> u64 {
        let activation_slack = if self.lora.is_some() && !self.settings.activation_checkpointing {
            self.profile.adapter_activation_slack
        } else {
            self.profile.activation_slack
        };
        let largest_gradient = self.trained.iter().map(|t| t.elements).max().unwrap_or(0)
            * self.precision().gradient_bytes();
        let page = arena_page_bytes(self.profile, largest_gradient.max(widest));
        slack(states, self.profile.state_slack) + slack(transient, activation_slack) + page
    }

    /// [`MemoryBreakdown::host_bytes`] on a GPU: the training phase's (the
    /// offloaded state of `optimizer_total` bytes, offloaded gradients
    /// included, beside the `moved` activations and embedding) or the
    /// load's (`host_load`), whichever is larger, since the load ends
    /// before either; 0 on a CPU worker.
    fn host_bytes(&self, optimizer_total: u64, moved: u64, host_load: u64) -> u64 {
        let profile = self.profile;
        if profile.device_is_host {
            return 0;
        }
        let state = if self.offloads_optimizer() {
            optimizer_total + slack(optimizer_total, profile.state_slack)
        } else {
            0
        };
        let training = state + moved + slack(moved, profile.state_slack);
        training.max(host_load)
    }
}

impl StageCount<'_> {
    fn micro_batch(&self) -> u64 {
        u64::from(self.settings.micro_batch)
    }

    fn in_flight(&self) -> u64 {
        u64::from(self.stage.in_flight.max(1))
    }

    /// The activation phase of the stage's model ([`ActivationPhase`]).
    fn activation_phase(&self) -> ActivationPhase {
        match self.model {
            ModelShape::Transformer(t) => self.transformer_activations(t),
            ModelShape::Llama(l) => self.llama_activations(l),
            // Declared at 32-bit; scale to the element size. Checkpointing is
            // not modelled for an opaque model, so it never lowers the figure.
            ModelShape::Generic(g) => ActivationPhase {
                activations: g.activation_bytes_per_sample
                    * self.micro_batch()
                    * self.precision().activation_bytes()
                    / 4,
                ..ActivationPhase::default()
            },
        }
    }

    /// A GPT stage's activation phase: blocks counted as the profile's
    /// [`ActivationCount`] says, three final-norm vectors.
    fn transformer_activations(&self, t: &TransformerShape) -> ActivationPhase {
        let (b, e) = (self.micro_batch(), self.precision().activation_bytes());
        let (s, h, a) = (
            u64::from(t.sequence_length),
            u64::from(t.hidden),
            u64::from(t.heads),
        );
        let profile = self.profile;
        let m = profile.dropout_mask_bytes;
        let block = |checkpointed: bool| match (profile.activation_count, checkpointed) {
            (ActivationCount::BurnAutodiff, false) => gpt_burn_block_bytes(s, b, h, a, t.ffn(), e),
            _ => block_activation_bytes(s, b, h, a, e, m, checkpointed),
        };
        let logits = if self.stage.last {
            loss_bytes(s * b, u64::from(t.vocabulary), profile.logit_copies)
        } else {
            0
        };
        let kept = block(self.settings.activation_checkpointing);
        // Backward recomputes one block at a time; its kept input is part
        // of that block's full set.
        let blocks = KeptBlocks {
            kept: self.in_flight() * u64::from(self.stage.layers) * kept,
            one_block: block(false),
            recomputed: block(false) - kept,
        };
        let around = PhaseTransients {
            attention: attention_transient_bytes(s, b, a, e, profile.attention_block),
            token_vector: s * b * h * e,
            final_norm: 3,
        };
        let (activations, offloaded_inputs) = self.device_activations(blocks, around, logits);
        let widest = (s * b * t.ffn().max(h) * e).max(loss_chunk_bytes(
            s * b,
            u64::from(t.vocabulary),
            self.stage.last,
        ));
        ActivationPhase {
            activations,
            logits,
            offloaded_inputs,
            widest,
        }
    }

    /// A Llama-family stage's activation phase: blocks counted as the
    /// profile's [`ActivationCount`] says or, under adapters with burn's
    /// count, as [`AdaptedBlock`] follows them.
    fn llama_activations(&self, l: &LlamaShape) -> ActivationPhase {
        let (b, e) = (self.micro_batch(), self.precision().activation_bytes());
        let profile = self.profile;
        let tokens = u64::from(l.sequence_length) * b;
        let logits = if self.stage.last {
            loss_bytes(tokens, u64::from(l.vocabulary), profile.logit_copies)
        } else {
            0
        };
        let token_vector = tokens * u64::from(l.hidden) * e;
        // Under adapters burn keeps less (see `AdaptedBlock`).
        let burn_lora = match self.adapters {
            Some(a) if profile.activation_count == ActivationCount::BurnAutodiff => Some(a),
            _ => None,
        };
        let blocks = self.llama_kept_blocks(l, burn_lora, token_vector);
        let around = PhaseTransients {
            attention: attention_transient_bytes(
                u64::from(l.sequence_length),
                b,
                u64::from(l.attention_heads),
                e,
                profile.attention_block,
            ),
            token_vector,
            final_norm: final_norm_vectors(burn_lora),
        };
        let (activations, offloaded_inputs) = self.device_activations(blocks, around, logits);
        let width =
            u64::from(l.intermediate).max(u64::from(l.attention_heads) * u64::from(l.head_dim));
        let widest = (tokens * width * e).max(loss_chunk_bytes(
            tokens,
            u64::from(l.vocabulary),
            self.stage.last,
        ));
        ActivationPhase {
            activations,
            logits,
            offloaded_inputs,
            widest,
        }
    }

    /// A Llama-family stage's blocks ([`KeptBlocks`]), `token_vector` the
    /// bytes of one `[b, s, h]` tensor; `burn_lora`: the adapters when burn's
    /// count follows them.
    fn llama_kept_blocks(
        &self,
        l: &LlamaShape,
        burn_lora: Option<&LoraConfig>,
        token_vector: u64,
    ) -> KeptBlocks {
        let (b, e) = (self.micro_batch(), self.precision().activation_bytes());
        let ckpt = self.settings.activation_checkpointing;
        let layers = u64::from(self.stage.layers);
        let in_flight = self.in_flight();
        let block = |checkpointed: bool| match self.profile.activation_count {
            ActivationCount::BurnAutodiff => {
                // burn's composed `silu(gate) · up` keeps σ and SiLU's output too.
                let composed = if self.profile.composed_gated_mlp && !checkpointed {
                    2 * u64::from(l.sequence_length) * b * u64::from(l.intermediate) * e
                } else {
                    0
                };
                l.burn_block_activation_bytes(b, e, checkpointed) + composed
            }
            ActivationCount::Published => l.block_activation_bytes(b, e, checkpointed),
        };
        match burn_lora {
            Some(a) if ckpt => {
                let full = AdaptedBlock::new(l, a, true).bytes(l, b, e);
                KeptBlocks {
                    kept: in_flight * layers * token_vector,
                    one_block: full,
                    recomputed: full - token_vector,
                }
            }
            Some(a) => {
                let (first, later) = AdaptedBlock::stage(l, a, self.stage);
                let (first, later) = (first.bytes(l, b, e), later.bytes(l, b, e));
                let (sum, last) = match layers {
                    0 => (0, 0),
                    1 => (first, first),
                    n => (first + (n - 1) * later, later),
                };
                KeptBlocks {
                    kept: in_flight * sum,
                    one_block: last,
                    recomputed: 0,
                }
            }
            None => KeptBlocks {
                kept: in_flight * layers * block(ckpt),
                one_block: block(false),
                recomputed: block(false) - block(ckpt),
            },
        }
    }

    /// `(activations, offloaded inputs)` of a stage: its `blocks`' kept
    /// bytes less the checkpointed inputs that wait in host memory (one
    /// block's input stays on the device: the one that runs), the phase
    /// `around` one block ([`phase_bytes`]) and the stage boundary's tensors
    /// ([`boundary_bytes`]).
    fn device_activations(
        &self,
        blocks: KeptBlocks,
        around: PhaseTransients,
        logits: u64,
    ) -> (u64, u64) {
        let offloaded_inputs = if offloads_activations(self.settings, self.profile) {
            blocks
                .kept
                .saturating_sub(blocks.one_block - blocks.recomputed)
        } else {
            0
        };
        let mut activations = blocks.kept - offloaded_inputs;
        if self.stage.layers > 0 {
            activations += phase_bytes(
                self.profile,
                self.settings.activation_checkpointing,
                blocks.one_block,
                blocks.recomputed,
                around.attention,
                logits,
            );
        }
        activations += boundary_bytes(
            self.profile,
            self.stage,
            self.in_flight(),
            around.token_vector,
            around.final_norm,
        );
        (activations, offloaded_inputs)
    }
}

/// The vectors a Llama stage's final norm keeps (`burn_lora`: the adapters
/// when burn's count follows them): 3 when trained; with a frozen γ its
/// normalised tensor is not kept, nor its output unless the head is adapted.
fn final_norm_vectors(burn_lora: Option<&LoraConfig>) -> u64 {
    match burn_lora {
        Some(a) if a.targets(TargetModule::LmHead) => 2,
        Some(_) => 1,
        None => 3,
    }
}

/// The checkpoint load's peaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct LoadPhase {
    /// [`MemoryBreakdown::load_peak`].
    peak: u64,
    /// The host memory a GPU worker's load needs, bytes (0 on a CPU worker).
    host: u64,
}

impl StageCount<'_> {
    /// The checkpoint load: a Llama-family model starts from a Hugging Face
    /// checkpoint; other models load none. The stage's `weights`, an
    /// embedding of `host_embedding` bytes kept on the host, the stage's
    /// `fixed_overhead` and the correction `factor` (≥ 1) as in training.
    fn load_phase(
        &self,
        weights: u64,
        host_embedding: u64,
        fixed_overhead: u64,
        factor: f64,
    ) -> LoadPhase {
        let ModelShape::Llama(l) = self.model else {
            return LoadPhase::default();
        };
        let profile = self.profile;
        let stored = stored_element_bytes(l);
        let (host_transient, largest) = load_transient(&self.tensors, stored);
        let on_device = if profile.device_is_host {
            if self.base_format.is_quantized() {
                quantized_load_bytes(&self.tensors, stored, weights)
            } else {
                weights + host_transient
            }
        } else {
            self.gpu_load_bytes(stored, weights)
        };
        let load = on_device.saturating_sub(weights);
        let estimated = load + slack(on_device, profile.load_slack);
        let peak = fixed_overhead + weights + (estimated as f64 * factor).round() as u64;
        let host = if profile.device_is_host {
            0
        } else {
            // The load streams (`streaming_load_bytes`): the largest
            // tensor's pages and copies, its cast to the stage's dtype
            // (worker/src/model/hf.rs casts each tensor to the device's
            // float dtype, f32 only for an f32 stage), and what the plan
            // keeps on the host from the start, an offloaded embedding.
            let cast = largest * self.precision().weight_bytes();
            let host = streaming_load_bytes(&self.tensors, stored) + cast + host_embedding;
            host + slack(host, profile.load_slack)
        };
        LoadPhase { peak, host }
    }

    /// What a GPU holds while its stage loads, `weights` included. The
    /// checkpoint (values `stored` bytes each) is read and converted on the
    /// host (burn-store's adapters cast and transpose each tensor's data
    /// there) and the device receives each tensor once, at the training
    /// dtype, as the parameter it becomes; an offloaded embedding never
    /// reaches it. Beside the weights it keeps, the device holds at most the
    /// largest tensor's upload and, for a quantized base, one block dense
    /// before it is quantized. Measured on the CPU with a bf16 stage
    /// (`load_peak`'s bf16 table): the whole process, host and device
    /// together, holds no f32 copy of any tensor.
    fn gpu_load_bytes(&self, stored: u64, weights: u64) -> u64 {
        let device_tensors: Vec<StageTensor> = self
            .tensors
            .iter()
            .filter(|t| !(self.embedding_on_host && t.role == TensorRole::Embedding))
            .copied()
            .collect();
        let (_, largest) = load_transient(&device_tensors, stored);
        let block = if self.base_format.is_quantized() {
            self.tensors
                .iter()
                .filter(|t| matches!(t.role, TensorRole::BlockLinear(_)))
                .map(|t| t.elements)
                .sum::<u64>()
        } else {
            0
        };
        weights + (largest + block) * self.precision().weight_bytes()
    }
}

/// Per replica when `replicas` share the `trained` tensors ZeRO-1 style
/// (one entry, all of them, for one replica): the optimizer state and
/// master weights it keeps, bytes, and the elements of the largest tensor
/// it steps.
fn sharded_state_bytes(
    trained: &[StageTensor],
    settings: &Settings,
    profile: &BackendProfile,
    replicas: u32,
) -> Vec<(u64, u64)> {
    // Pure half precision: no master copy, and f32 moments become the
    // weights' dtype (8-bit AdamW's blocks are 8-bit either way). An
    // offloaded optimizer steps on the host in f32 against an f32 master
    // copy (worker/src/optim/offload.rs) whatever the device trains in.
    let pure = profile.pure_half_precision
        && settings.precision != Precision::Fp32
        && !settings.offload_optimizer;
    let master = if pure {
        0
    } else if compacts_host_state(settings, profile) {
        // The part of the master below the device's copy, in bf16.
        2
    } else {
        settings.precision.master_weight_bytes()
    };
    let moments = |elements: u64| {
        let bytes = settings.optimizer.tensor_state_bytes(elements);
        if pure && settings.optimizer != Optimizer::Adamw8bit {
            bytes * settings.precision.weight_bytes() / 4
        } else {
            bytes
        }
    };
    let state = |elements: u64| moments(elements) + elements * master;
    if replicas <= 1 {
        return vec![(
            trained.iter().map(|t| t.count * state(t.elements)).sum(),
            trained.iter().map(|t| t.elements).max().unwrap_or(0),
        )];
    }
    // The worker's owners (`shard_owners`), counted a size at a time: a
    // block's tensors repeat once a layer, and the greedy sees only sizes.
    let mut groups: Vec<(u64, u64)> = Vec::with_capacity(trained.len());
    for t in trained {
        groups.push((t.elements, t.count));
    }
    groups.sort_by_key(|g| std::cmp::Reverse(g.0));
    groups.dedup_by(|later, kept| {
        let same = later.0 == kept.0;
        if same {
            kept.1 += later.1;
        }
        same
    });
    let counts = crate::sharding::shard_counts(&groups, replicas);
    let mut per_rank = vec![(0u64, 0u64); replicas as usize];
    for (&(elements, _), row) in groups.iter().zip(&counts) {
        for (rank, &c) in per_rank.iter_mut().zip(row) {
            if c > 0 {
                rank.0 += c * state(elements);
                rank.1 = rank.1.max(elements);
            }
        }
    }
    per_rank
}

/// Elements of the tensors a stage trains (every parameter, or the adapters).
pub fn trained_elements(
    model: &ModelShape,
    adapters: Option<&LoraConfig>,
    stage: StagePlacement,
) -> u64 {
    match (model, adapters) {
        (ModelShape::Llama(l), Some(a)) => adapter_tensors(l, a, stage),
        _ => stage_tensors(model, stage),
    }
    .iter()
    .map(StageTensor::total_elements)
    .sum()
}

fn slack(bytes: u64, fraction: f64) -> u64 {
    (bytes as f64 * fraction).round() as u64
}

/// The dense weights a LoRA stage still makes: the worker's adapted
/// linears compute `x·W + s·(x·A)·B` and never compose `W + s·A·B`, and a
/// quantized frozen matrix is dequantized for its matmul and dropped
/// (`worker/src/model/lean/{linear,frozen}.rs`), so per block nothing dense
/// is kept. What remains: the transient dequantized copy of the largest
/// quantized matrix, and an adapted `lm_head` on the last stage, which the
/// loss reads composed (kept by the loss op) with its weight-shaped
/// gradient, at the training precision `e`.
fn composed_weight_bytes(
    l: &LlamaShape,
    lora: &LoraConfig,
    base_format: BaseFormat,
    stage: StagePlacement,
    e: u64,
) -> u64 {
    let matrix = |m: TargetModule| {
        let (d_in, d_out) = m.dims(l);
        d_in * d_out
    };
    let head = if stage.last && lora.targets(TargetModule::LmHead) {
        2 * matrix(TargetModule::LmHead)
    } else {
        0
    };
    let largest = l
        .architecture
        .block_linears()
        .iter()
        .copied()
        .map(matrix)
        .max()
        .unwrap_or(0);
    let quantized = match base_format {
        _ if stage.layers == 0 => 0,
        BaseFormat::Dense => 0,
        // burn's formats dequantize the whole matrix into the training dtype.
        BaseFormat::Int8 | BaseFormat::Int4 => largest * e,
        // The worker's NF4 matmul dequantizes a slice of rows at a time.
        BaseFormat::Nf4 => largest.min(NF4_DEQUANT_CHUNK_VALUES) * NF4_DEQUANT_BYTES_PER_VALUE,
    };
    head * e + quantized
}

/// What one Llama decoder block keeps for backward under LoRA, following
/// burn 0.22's autodiff rule for a binary op: a matmul or product keeps its
/// left operand only when the right one is tracked, and the right only
/// when the left is (burn-autodiff 0.22.1, the backward of `float_mul` and
/// of `float_matmul`). Every base parameter is frozen, so, compared with
/// full fine-tuning ([`LlamaShape::burn_block_activation_bytes`], the same
/// ops): the RMSNorms' normalised tensors are not kept (γ is frozen); a
/// norm's output, the merged heads and the gated MLP's product are kept only when
/// an adapted projection reads them (the adapter's `x·A` keeps `x`, and
/// `(x·A)·B` keeps the `r`-wide `x·A`); a frozen base matmul keeps nothing
/// new (a dense `W` is the parameter itself, a quantized one is
/// dequantized again in backward); and in a block whose input is not
/// tracked (the first block of the first stage: the frozen embedding) the
/// ops before the first adapted projection keep nothing. The attention op
/// keeps q, k, v, its output and a logsumexp per head and token once any
/// of q, k, v is tracked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct AdaptedBlock {
    /// Kept `[b, s, ·]` tensors: elements per token.
    token_elements: u64,
    /// Whether the RoPE rotations (tracked q or k) keep the cos/sin tables.
    rope_tables: bool,
    /// Whether the block's output is tracked.
    output_tracked: bool,
}

impl AdaptedBlock {
    fn new(l: &LlamaShape, lora: &LoraConfig, input_tracked: bool) -> Self {
        use TargetModule::*;
        let (h, q, kv, i, r) = (
            u64::from(l.hidden),
            l.q_dim(),
            l.kv_dim(),
            u64::from(l.intermediate),
            u64::from(lora.rank),
        );
        let mut tokens = 0;
        // Adapter dropout gives each adapted module an input of its own,
        // x·mask, kept by x·A beside its mask; x itself is then not kept
        // for the adapters (the shared-input terms below count it otherwise).
        let dropout = lora.dropout > 0.0;
        // x·W + s·(x·A)·B: tracked when x is or the adapter exists; the
        // adapter keeps its r-wide x·A (x itself is counted by the caller).
        let mut linear = |m: TargetModule, input_tracked: bool| {
            let adapted = lora.targets(m);
            if adapted {
                tokens += r;
                if dropout {
                    tokens += 2 * m.dims(l).0;
                }
            }
            input_tracked || adapted
        };
        // Whether an adapted module of `ms` keeps their shared input.
        let shared_input = |ms: &[TargetModule]| !dropout && ms.iter().any(|&m| lora.targets(m));
        let x = input_tracked;
        let mut kept = 0;
        // RMSNorm: its input (the square, the division) when tracked; its
        // output when an adapted projection reads it.
        kept += if x { h } else { 0 };
        kept += if shared_input(&[QProj, KProj, VProj, QkvProj]) {
            h
        } else {
            0
        };
        let (q_t, k_t, v_t) = (linear(QProj, x), linear(KProj, x), linear(VProj, x));
        // Phi-3's fused qkv_proj tracks q, k and v together.
        let qkv = linear(QkvProj, x);
        let (q_t, k_t, v_t) = (q_t || qkv, k_t || qkv, v_t || qkv);
        // Qwen3's q/k norms (γ frozen) keep their tracked input and one rms
        // per head and token; RoPE after them keeps only its tables.
        if l.architecture.qk_norm() {
            let heads = |n: u32| u64::from(n) * (1 + u64::from(l.head_dim));
            kept += if q_t { heads(l.attention_heads) } else { 0 };
            kept += if k_t { heads(l.key_value_heads) } else { 0 };
        }
        // RoPE's products keep only the cos/sin tables; the attention op,
        // once tracked, keeps q, k, v, its output and a logsumexp per head.
        let attention = q_t || k_t || v_t;
        kept += if attention {
            2 * q + 2 * kv + u64::from(l.attention_heads)
        } else {
            0
        };
        // Phi-3's v is a view of the fused q/k/v output: the op keeps it whole.
        if attention && l.architecture.fused_projections() {
            kept += q + kv;
        }
        // The merged heads' copy when o_proj is adapted.
        kept += if shared_input(&[OProj]) { q } else { 0 };
        // Gemma's norm of the attention's output keeps its input and the
        // normalised tensor once tracked (reasoned, not calibrated).
        let gemma = l.architecture.gemma();
        let attention_out = linear(OProj, attention);
        if gemma && attention_out {
            kept += 2 * h;
        }
        let x = attention_out || x;
        kept += if x { h } else { 0 };
        kept += if shared_input(&[GateProj, UpProj, GateUpProj]) {
            h
        } else {
            0
        };
        let (gate, up) = (linear(GateProj, x), linear(UpProj, x));
        let gate_up = linear(GateUpProj, x);
        let (gate, up) = (gate || gate_up, up || gate_up);
        // The gating op (SiLU or GeGLU, one op) keeps gate and up once
        // either is tracked; down keeps its input if adapted.
        kept += if gate || up { 2 * i } else { 0 };
        kept += if shared_input(&[DownProj]) { i } else { 0 };
        // Gemma: the pre-feed-forward norm's normalised tensor and the
        // post-feed-forward norm's input and normalised tensor (reasoned,
        // not calibrated).
        let mlp_out = linear(DownProj, gate || up);
        if gemma {
            kept += if x { h } else { 0 };
            kept += if mlp_out { 2 * h } else { 0 };
        }
        let output_tracked = mlp_out || x;
        AdaptedBlock {
            token_elements: tokens + kept,
            rope_tables: q_t || k_t,
            output_tracked,
        }
    }

    /// The stage's blocks without checkpointing, as `(first, later)`: the
    /// first stage's first block reads the frozen embedding (untracked); a
    /// later stage's input is tracked (its gradient goes back to the
    /// previous stage). A block's output is tracked whenever its input is,
    /// so every block after the first is `later`: the stage is counted
    /// without a value per layer, whatever its layer count.
    fn stage(l: &LlamaShape, lora: &LoraConfig, stage: StagePlacement) -> (Self, Self) {
        let first = AdaptedBlock::new(l, lora, !stage.first);
        (first, AdaptedBlock::new(l, lora, first.output_tracked))
    }

    /// Activation bytes for one micro-batch of `b` at `e` bytes an element.
    fn bytes(&self, l: &LlamaShape, b: u64, e: u64) -> u64 {
        let s = u64::from(l.sequence_length);
        let rope = if self.rope_tables {
            2 * s * u64::from(l.head_dim) * 4
        } else {
            0
        };
        s * b * self.token_elements * e + rope
    }
}

/// What a stage's backward adds beside the kept activations, given the
/// loss's `logits` (counted on their own). The attention op's transient
/// (`attention`, one block pair's scores) lives inside one block's forward
/// or backward: in forward, before that block and the loss have kept
/// theirs; in backward, after the block's later ops (the MLP, whose kept
/// tensors are larger) have freed theirs. So it only shows where it
/// exceeds what it replaces: the loss's chunks and one block's kept bytes
/// (`block`) without checkpointing; with it, the loss's chunks and the
/// recomputed block whole — its kept input (`block − recomputed`) and what
/// recomputing adds (`recomputed`, whose phase is weighed against the loss
/// by [`recomputation_bytes`]). So checkpointing never adds to a stage: the
/// same transient is weighed against the same whole block either way. On
/// the 53 CPU calibration rows, adding the transient outright gave it a
/// fitted coefficient of −0.02.
fn phase_bytes(
    profile: &BackendProfile,
    checkpointed: bool,
    block: u64,
    recomputed: u64,
    attention: u64,
    logits: u64,
) -> u64 {
    if checkpointed {
        let kept_input = block.saturating_sub(recomputed);
        recomputation_bytes(profile, recomputed, logits)
            .max(attention.saturating_sub(logits + kept_input))
    } else {
        attention.saturating_sub(logits + block)
    }
}

/// With checkpointing: what backward's recomputation of one block (`extra`
/// beyond its kept input) adds to the activations, given that the loss's
/// `logits` (counted on their own) come before it rather than with it. The
/// two phases together count as the larger one plus
/// `checkpoint_phase_overlap` of the smaller; the logits are already counted,
/// so this returns that minus them (never negative: overlap ≥ 0).
fn recomputation_bytes(profile: &BackendProfile, extra: u64, logits: u64) -> u64 {
    let k = profile.checkpoint_phase_overlap.clamp(0.0, 1.0);
    let (large, small) = (extra.max(logits), extra.min(logits));
    let both = large + (small as f64 * k).round() as u64;
    both.saturating_sub(logits)
}

/// Per-micro-batch activations a stage holds outside its blocks, with burn
/// autodiff counting (`token_vector`: one [b, s, h] tensor): the last
/// stage's final norm keeps `final_norm` vectors (3 when trained: its
/// input, normalised tensor and output; for the one micro-batch at the
/// loss); a stage after the first
/// keeps the input it received, and a stage before the last the output it
/// sent, for each in-flight micro-batch. Nothing with the published counts.
fn boundary_bytes(
    profile: &BackendProfile,
    stage: StagePlacement,
    in_flight: u64,
    token_vector: u64,
    final_norm: u64,
) -> u64 {
    if profile.activation_count != ActivationCount::BurnAutodiff {
        return 0;
    }
    let mut vectors = 0;
    if stage.last {
        vectors += final_norm;
    }
    if !stage.first {
        vectors += in_flight;
    }
    if !stage.last {
        vectors += in_flight;
    }
    vectors * token_vector
}

/// Model-state bytes per data-parallel rank for mixed-precision Adam (K = 12)
/// under ZeRO sharding stage 0–3 over `ranks` (Rajbhandari et al. 2019).
/// The search does not shard yet: the worker trains one rank per pipeline stage.
pub fn zero_model_state_bytes(params: u64, zero_stage: u8, ranks: u64) -> u64 {
    let d = ranks.max(1);
    match zero_stage {
        0 => 16 * params,
        1 => 4 * params + 12 * params / d,
        2 => 2 * params + 14 * params / d,
        _ => 16 * params / d,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::FLEX;
    use crate::model::TransformerShape;
    use crate::training::Precision;

    #[test]
    fn zero_paper_example() {
        // P = 7.5e9, d = 64: 120 / 31.4 / 16.6 / 1.9 GB (10^9 bytes).
        let gb = |x: u64| x as f64 / 1e9;
        let p = 7_500_000_000;
        assert!((gb(zero_model_state_bytes(p, 0, 64)) - 120.0).abs() < 0.05);
        assert!((gb(zero_model_state_bytes(p, 1, 64)) - 31.4).abs() < 0.05);
        assert!((gb(zero_model_state_bytes(p, 2, 64)) - 16.6).abs() < 0.05);
        assert!((gb(zero_model_state_bytes(p, 3, 64)) - 1.9).abs() < 0.05);
    }

    #[test]
    fn korthikanti_gpt3_layer() {
        // GPT-3 175B block: s = 2048, h = 12288, a = 96, b = 1, 16-bit, 1-byte masks.
        let (s, h, a) = (2048u64, 12288u64, 96u64);
        let published = s * h * (34 + 5 * a * s / h); // sbh(34 + 5as/h) = 2.87e9 bytes
        assert_eq!(block_activation_bytes(s, 1, h, a, 2, 1, false), published);
        assert_eq!(published, 2_868_903_936);
        // Full recomputation keeps 2·s·b·h.
        assert_eq!(block_activation_bytes(s, 1, h, a, 2, 1, true), 2 * s * h);
    }

    pub(super) fn small() -> ModelShape {
        ModelShape::Transformer(TransformerShape {
            layers: 4,
            hidden: 256,
            heads: 4,
            sequence_length: 128,
            vocabulary: 1000,
            feed_forward: None,
            tied_embeddings: true,
        })
    }

    fn settings(b: u32, ckpt: bool) -> Settings {
        Settings {
            micro_batch: b,
            activation_checkpointing: ckpt,
            ..Settings::default()
        }
    }

    #[test]
    fn breakdown_adds_up() {
        let m = estimate_stage(
            &small(),
            None,
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        let sum = m.weights
            + m.gradients
            + m.optimizer_state
            + m.activations
            + m.logits
            + m.composed_weights;
        assert_eq!(
            m.total,
            sum + m.allocator_slack + m.fixed_overhead + m.correction
        );
        assert_eq!(m.weights, small().total_params() * 4);
        assert_eq!(m.correction, 0);
    }

    #[test]
    fn correction_scales_the_estimated_terms_only() {
        let base = estimate_stage(
            &small(),
            None,
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        let corrected = estimate_stage(
            &small(),
            None,
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.5,
        );
        // Weights and gradients are counted, not estimated: untouched.
        assert_eq!(
            (corrected.weights, corrected.gradients),
            (base.weights, base.gradients)
        );
        let added = corrected.total - base.total;
        let want = 0.5 * base.estimated() as f64;
        assert!((added as f64 - want).abs() <= 1.0, "{added} vs {want}");
        assert_eq!(added, corrected.correction);
    }

    #[test]
    fn slack_is_per_component() {
        let m = estimate_stage(
            &small(),
            None,
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        let states = (m.weights + m.gradients + m.optimizer_state) as f64;
        let transient = (m.activations + m.logits) as f64;
        let expected = states * FLEX.state_slack + transient * FLEX.activation_slack;
        assert!((m.allocator_slack as f64 - expected).abs() <= 1.0);
    }

    #[test]
    fn cuda_counts_what_burn_keeps_in_bf16() {
        // The CUDA worker runs the same burn code and ops as flex, so the
        // same op-by-op count, with its own slacks (fitted on an H200); a
        // bf16 stage's optimizer keeps f32 moments and an f32 master copy
        // (12 bytes a parameter, six times its bf16 weight).
        use crate::backend::CUDA;
        let s = Settings {
            precision: Precision::Bf16,
            ..settings(8, false)
        };
        let m = estimate_stage(&small(), None, &s, StagePlacement::single(4), &CUDA, 1.0);
        assert_eq!(m.optimizer_state, 6 * m.weights);
        let states = (m.weights + m.gradients + m.optimizer_state) as f64;
        let transient = (m.activations + m.logits) as f64;
        // And one arena page of the largest request, here the loss op's
        // chunk of f32 logits (1024 rows × 1000 × 4 B; wider than the MLP's
        // 1024 × 1024 bf16 activation).
        let page = arena_page_bytes(&CUDA, 1024 * 1000 * 4);
        assert_eq!(page, 5 << 20);
        let expected = states * CUDA.state_slack + transient * CUDA.activation_slack + page as f64;
        assert!((m.allocator_slack as f64 - expected).abs() <= 1.0);
        let (sq, b, h, a, f) = (128u64, 8u64, 256u64, 4u64, 1024u64);
        assert_eq!(
            m.activations,
            4 * gpt_burn_block_bytes(sq, b, h, a, f, 2) + 3 * sq * b * h * 2
        );
    }

    #[test]
    fn burn_count_of_a_gpt_block() {
        // Per token 11h + 2f and one logsumexp per head, at 4 bytes: h 256,
        // f 1024, a 4, s 128, b 8; no s² term.
        let (s, b, h, a, f) = (128u64, 8u64, 256u64, 4u64, 1024u64);
        assert_eq!(
            gpt_burn_block_bytes(s, b, h, a, f, 4),
            s * b * (11 * 256 + 2 * 1024 + 4) * 4
        );
        let m = estimate_stage(
            &small(),
            None,
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        // Four blocks and the final norm's three vectors; the attention
        // op's transient (a block pair's scores) is smaller than the loss's
        // chunks plus one block, so it never shows at the peak.
        let attention = attention_transient_bytes(s, b, a, 4, FLEX.attention_block);
        assert!(attention < m.logits + gpt_burn_block_bytes(s, b, h, a, f, 4));
        assert_eq!(
            m.activations,
            4 * gpt_burn_block_bytes(s, b, h, a, f, 4) + 3 * s * b * h * 4
        );
    }

    #[test]
    fn checkpointed_loss_and_recomputation_overlap() {
        // The larger phase whole, a quarter of the smaller; never below the logits alone.
        assert_eq!(recomputation_bytes(&FLEX, 100, 60), 100 + 15 - 60);
        assert_eq!(recomputation_bytes(&FLEX, 40, 60), 10);
        assert_eq!(recomputation_bytes(&FLEX, 0, 60), 0);
        assert_eq!(recomputation_bytes(&crate::backend::CUDA, 40, 60), 40);
    }

    #[test]
    fn checkpointing_lowers_activations_for_deep_models() {
        let off = estimate_stage(
            &small(),
            None,
            &settings(8, false),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        let on = estimate_stage(
            &small(),
            None,
            &settings(8, true),
            StagePlacement::single(4),
            &FLEX,
            1.0,
        );
        assert!(on.activations < off.activations);
    }
}

#[cfg(test)]
mod lora_and_load_tests {
    use super::*;
    use crate::adapters::default_block_size;
    use crate::backend::{BackendProfile, CUDA, FLEX};
    use crate::training::Optimizer;
    use crate::units::MIB;

    /// The load-peak bench's model (`make bench-load-peak`): 155.7 M parameters.
    fn bench_llama(torch_dtype: &str) -> LlamaShape {
        LlamaShape::from_hf_config(
            &format!(
                r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":1024,"intermediate_size":2816,
                   "num_hidden_layers":8,"num_attention_heads":16,"num_key_value_heads":4,
                   "vocab_size":32000,"tie_word_embeddings":false,"torch_dtype":"{torch_dtype}"}}"#
            ),
            512,
        )
        .expect("valid test input")
    }

    fn llama_2_7b(seq: u32) -> LlamaShape {
        LlamaShape::from_hf_config(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":11008,
               "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":32,
               "vocab_size":32000,"tie_word_embeddings":false,"torch_dtype":"float16"}"#,
            seq,
        )
        .expect("valid test input")
    }

    /// cubecl's arena keeps whole pages of the largest request plus 1 MiB,
    /// rounded to 1 MiB and at least 2 MiB; flex has no such pages.
    #[test]
    fn the_cuda_arena_rounds_to_one_page_of_the_largest_request() {
        assert_eq!(arena_page_bytes(&FLEX, 1 << 30), 0);
        assert_eq!(arena_page_bytes(&CUDA, 4096), 2 * MIB);
        assert_eq!(arena_page_bytes(&CUDA, 49 * MIB), 50 * MIB);
        assert_eq!(arena_page_bytes(&CUDA, 49 * MIB + 1), 51 * MIB);
        // Llama-2-7B full fine-tune in bf16: the head's and the
        // embedding's gradients (32000 × 4096 × 2 B = 250 MiB) are the
        // largest request, larger than one micro-batch's MLP activation at
        // s 512 (512 × 11008 × 2 B) or the loss chunk.
        let model = ModelShape::Llama(llama_2_7b(512));
        let estimate = |profile: &BackendProfile| {
            let s = settings(Precision::Bf16, true);
            estimate_stage(&model, None, &s, StagePlacement::single(32), profile, 1.0)
        };
        let with_pages = estimate(&CUDA);
        let without = estimate(&BackendProfile {
            arena_page_slack_bytes: 0,
            ..CUDA
        });
        let gradient = 32000 * 4096 * 2;
        assert_eq!(
            with_pages.allocator_slack - without.allocator_slack,
            arena_page_bytes(&CUDA, gradient)
        );
        assert_eq!(
            with_pages.total - without.total,
            (gradient + MIB).div_ceil(MIB) * MIB
        );
    }

    fn settings(precision: Precision, ckpt: bool) -> Settings {
        Settings {
            activation_checkpointing: ckpt,
            precision,
            ..Settings::default()
        }
    }

    fn lora(rank: u32, targets: &[TargetModule]) -> LoraConfig {
        LoraConfig {
            rank,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: targets.to_vec(),
            block_size: default_block_size(),
        }
    }

    fn stages(p: u32) -> Vec<StagePlacement> {
        let layers = crate::search::balanced_split(8, p).expect("valid test input");
        (0..p as usize)
            .map(|k| StagePlacement {
                layers: layers[k],
                first: k == 0,
                last: k + 1 == p as usize,
                in_flight: p - k as u32,
                replicas: 1,
            })
            .collect()
    }

    #[test]
    fn stage_tensors_add_up_to_the_parameter_counts() {
        let l = llama_2_7b(512);
        let model = ModelShape::Llama(l.clone());
        let sum = |s| {
            stage_tensors(&model, s)
                .iter()
                .map(StageTensor::total_elements)
                .sum::<u64>()
        };
        assert_eq!(sum(StagePlacement::single(32)), 6_738_415_616);
        let mid = StagePlacement {
            layers: 3,
            first: false,
            last: false,
            in_flight: 1,
            replicas: 1,
        };
        assert_eq!(sum(mid), 3 * l.params_per_layer());
        let gpt = ModelShape::Transformer(crate::model::TransformerShape {
            layers: 4,
            hidden: 256,
            heads: 4,
            sequence_length: 128,
            vocabulary: 1000,
            feed_forward: None,
            tied_embeddings: true,
        });
        let total: u64 = stage_tensors(&gpt, StagePlacement::single(4))
            .iter()
            .map(StageTensor::total_elements)
            .sum();
        assert_eq!(total, gpt.total_params());
    }

    #[test]
    fn a_stage_holds_its_links_beside_the_fixed_overhead() {
        // The middle stage of three has two links, the ends one each, a
        // single worker none; on a GPU the links' frames are host memory.
        let model = ModelShape::Llama(llama_2_7b(512));
        let s = settings(Precision::Fp32, false);
        let fixed = |stage, profile: &BackendProfile| {
            estimate_stage(&model, None, &s, stage, profile, 1.0).fixed_overhead
        };
        let links: Vec<u64> = stages(3)
            .into_iter()
            .map(|stage| (fixed(stage, &FLEX) - FLEX.fixed_overhead_bytes) / FLEX.stage_link_bytes)
            .collect();
        assert_eq!(links, [1, 2, 1]);
        assert_eq!(
            fixed(StagePlacement::single(8), &FLEX),
            FLEX.fixed_overhead_bytes
        );
        assert_eq!(fixed(stages(3)[1], &CUDA), CUDA.fixed_overhead_bytes);
    }

    #[test]
    fn load_transient_equals_the_benchmark_bound() {
        // docs/benchmarks.md, "Loading a checkpoint": the bound column
        // F + k·C + 2k·B, 370.5 MiB for bf16 p = 1 and 505.0 MiB for the f32
        // last stage of p = 4 (measured 367.6 and 497.1).
        let mib = |b: u64| b as f64 / MIB as f64;
        let bf16 = ModelShape::Llama(bench_llama("bfloat16"));
        let (t, _) = load_transient(&stage_tensors(&bf16, StagePlacement::single(8)), 2);
        assert!((mib(t) - 370.5).abs() < 0.05, "{}", mib(t));
        let f32 = ModelShape::Llama(bench_llama("float32"));
        let last = stages(4)[3];
        let (t, _) = load_transient(&stage_tensors(&f32, last), 4);
        assert!((mib(t) - 505.0).abs() < 0.05, "{}", mib(t));
    }

    #[test]
    fn load_peak_changes_nothing_for_fp32_adamw_stages() {
        // The bench's rows: the load peak is 0.25–0.63 of the training peak
        // (measured); predicted, it stays below it on every stage, so the
        // total is the training sum as before.
        for dtype in ["bfloat16", "float32"] {
            let model = ModelShape::Llama(bench_llama(dtype));
            for p in [1, 2, 4] {
                for stage in stages(p) {
                    let m = estimate_stage(
                        &model,
                        None,
                        &settings(Precision::Fp32, true),
                        stage,
                        &FLEX,
                        1.0,
                    );
                    let ratio = m.load_peak as f64 / m.training_total() as f64;
                    assert!((0.2..0.9).contains(&ratio), "{dtype} p={p} {ratio:.2}");
                    assert_eq!(m.total, m.training_total());
                    assert_eq!(m.host_bytes, 0, "a CPU worker's host is its budget");
                }
            }
        }
    }

    #[test]
    fn a_quantized_base_loads_one_dense_block_at_a_time() {
        // Rank-8 q/v adapters on an int8 base, f32 checkpoint, on flex: the
        // worker quantizes each block as it reads it, so the load holds the
        // quantized stage and one dense block with its 4-byte pages, not the
        // whole stage's mapped pages and converted copies.
        let model = ModelShape::Llama(bench_llama("float32"));
        let a = lora(8, &[TargetModule::QProj, TargetModule::VProj]);
        let s = Settings {
            base_format: BaseFormat::Int8,
            ..settings(Precision::Fp32, true)
        };
        let m = estimate_stage(&model, Some(&a), &s, StagePlacement::single(8), &FLEX, 1.0);
        let dense = Settings {
            base_format: BaseFormat::Dense,
            ..s
        };
        let single = StagePlacement::single(8);
        let d = estimate_stage(&model, Some(&a), &dense, single, &FLEX, 1.0);
        println!("{m:#?}");
        assert!(m.load_peak > m.weights + m.fixed_overhead);
        let (q, d) = (m.load_peak, d.load_peak);
        assert!(q < d / 2, "{q} vs dense {d}");
    }

    #[test]
    fn an_adapted_block_keeps_what_burn_keeps() {
        let l = bench_llama("bfloat16");
        let (h, q, kv, i) = (1024, l.q_dim(), l.kv_dim(), u64::from(l.intermediate));
        let r = 8;
        let (b, e) = (2, 4);
        // All seven adapted and a tracked input: the full-fine-tuning count
        // less the two normalised tensors (γ frozen), plus each adapter's
        // r-wide x·A; no dense weight.
        let all = AdaptedBlock::new(&l, &lora(8, &TargetModule::BLOCK_LINEARS), true);
        let a = u64::from(l.attention_heads);
        assert_eq!(
            all.token_elements,
            4 * h + 3 * q + 2 * kv + a + 3 * i + 7 * r
        );
        let s = u64::from(l.sequence_length);
        assert_eq!(
            all.bytes(&l, b, e),
            l.burn_block_activation_bytes(b, e, false) - 2 * s * b * h * e + 7 * r * s * b * e
        );
        // q,v only: o_proj's and down_proj's inputs and the second norm's
        // output are not kept either, nor five adapters' x·A.
        let qv = [TargetModule::QProj, TargetModule::VProj];
        let later = AdaptedBlock::new(&l, &lora(8, &qv), true);
        assert_eq!(later.token_elements, all.token_elements - h - q - i - 5 * r);
        // The first block reads the frozen embedding: its first norm's input
        // keeps nothing.
        let first = AdaptedBlock::new(&l, &lora(8, &qv), false);
        assert_eq!(first.token_elements, later.token_elements - h);
        assert!(first.output_tracked);
        let stage = AdaptedBlock::stage(&l, &lora(8, &qv), StagePlacement::single(3));
        assert_eq!(stage, (first, later));
        // A block whose input is tracked tracks its output: the blocks
        // after the first are all alike.
        assert_eq!(
            AdaptedBlock::new(&l, &lora(8, &qv), later.output_tracked),
            later
        );
    }

    #[test]
    fn lora_trains_only_the_adapters() {
        // Llama-2-7B, r = 8 on q and v (PEFT: 4,194,304 trainable), bf16 AdamW on CUDA.
        let l = llama_2_7b(512);
        let a = lora(8, &[TargetModule::QProj, TargetModule::VProj]);
        let m = estimate_stage(
            &ModelShape::Llama(l),
            Some(&a),
            &settings(Precision::Bf16, true),
            StagePlacement::single(32),
            &CUDA,
            1.0,
        );
        let t = 4_194_304u64;
        assert_eq!(m.weights, 6_738_415_616 * 2 + t * 2);
        assert_eq!(m.gradients, t * 2);
        // f32 AdamW moments and an f32 master copy for the adapters, as
        // PEFT trains them over a bf16 base.
        assert_eq!(m.optimizer_state, t * 12);
        // q and v adapted as x·W + s·(x·A)·B: no dense weight composed.
        assert_eq!(m.composed_weights, 0);
    }

    #[test]
    fn qlora_stores_the_block_linears_quantized() {
        let l = llama_2_7b(512);
        let a = lora(16, &TargetModule::BLOCK_LINEARS);
        let linear: u64 = 32 * (4 * 4096 * 4096 + 3 * 4096 * 11008);
        assert_eq!(linear, 6_476_005_376);
        let dense_rest = 6_738_415_616 - linear;
        let adapters = a.trainable_params(&l);
        let weights = |format: BaseFormat, profile: &BackendProfile| {
            let s = Settings {
                base_format: format,
                ..settings(Precision::Bf16, true)
            };
            estimate_stage(
                &ModelShape::Llama(l.clone()),
                Some(&a),
                &s,
                StagePlacement::single(32),
                profile,
                1.0,
            )
            .weights
        };
        let scales = linear / 64 * 4;
        // Packed int4 (cuda): half a byte a value plus one f32 per 64.
        assert_eq!(
            weights(BaseFormat::Int4, &CUDA),
            linear / 2 + scales + dense_rest * 2 + adapters * 2
        );
        assert_eq!(
            weights(BaseFormat::Int8, &CUDA),
            linear + scales + dense_rest * 2 + adapters * 2
        );
        // burn-flex keeps each int4 value in an i8: no saving over int8.
        assert_eq!(
            weights(BaseFormat::Int4, &FLEX),
            weights(BaseFormat::Int8, &FLEX)
        );
    }

    #[test]
    fn no_dense_weight_is_composed_only_one_dequantized_at_a_time() {
        let l = llama_2_7b(512);
        let a = lora(8, &[TargetModule::QProj]);
        let largest = 4096 * 11008 * 2u64;
        let stage = StagePlacement {
            layers: 4,
            first: false,
            last: false,
            in_flight: 3,
            replicas: 1,
        };
        let composed = |ckpt: bool, format: BaseFormat| {
            let s = Settings {
                base_format: format,
                ..settings(Precision::Bf16, ckpt)
            };
            estimate_stage(
                &ModelShape::Llama(l.clone()),
                Some(&a),
                &s,
                stage,
                &CUDA,
                1.0,
            )
            .composed_weights
        };
        // A dense base is read where it lies: nothing composed, with or
        // without checkpointing, however many micro-batches are in flight.
        assert_eq!(composed(false, BaseFormat::Dense), 0);
        assert_eq!(composed(true, BaseFormat::Dense), 0);
        // A quantized base: one matrix dequantized at a time, the largest.
        assert_eq!(composed(true, BaseFormat::Int4), largest);
        assert_eq!(composed(false, BaseFormat::Int4), largest);
        // Full fine-tuning composes nothing.
        let full = estimate_stage(
            &ModelShape::Llama(l),
            None,
            &settings(Precision::Bf16, false),
            stage,
            &CUDA,
            1.0,
        );
        assert_eq!(full.composed_weights, 0);
    }

    #[test]
    fn eight_bit_adamw_is_counted_tensor_by_tensor() {
        // Bench model, full fine-tuning on one stage: every linear and the
        // embedding/head are ≥ 4096 elements (8-bit), the 17 norm vectors of
        // 1024 are not (32-bit).
        let l = bench_llama("bfloat16");
        let model = ModelShape::Llama(l.clone());
        let s = Settings {
            optimizer: Optimizer::Adamw8bit,
            ..settings(Precision::Fp32, true)
        };
        let m = estimate_stage(&model, None, &s, StagePlacement::single(8), &FLEX, 1.0);
        let big = |n: u64| 2 * n + 8 * n.div_ceil(256);
        let per_layer = 2 * big(1024 * 1024) + 2 * big(1024 * 256) + 3 * big(1024 * 2816);
        let expected = 8 * per_layer + 2 * big(32000 * 1024) + 17 * 8 * 1024;
        assert_eq!(m.optimizer_state, expected);
    }

    #[test]
    fn offloaded_state_leaves_the_gpu_for_host_memory() {
        let l = llama_2_7b(512);
        let on = Settings {
            offload_optimizer: true,
            ..settings(Precision::Bf16, true)
        };
        let model = ModelShape::Llama(l);
        let kept = estimate_stage(
            &model,
            None,
            &settings(Precision::Bf16, true),
            StagePlacement::single(32),
            &CUDA,
            1.0,
        );
        let off = estimate_stage(&model, None, &on, StagePlacement::single(32), &CUDA, 1.0);
        assert_eq!(kept.optimizer_state, 6_738_415_616 * 12);
        assert_eq!(off.optimizer_state, 0);
        assert!(off.host_bytes >= kept.optimizer_state);
        assert!(off.total < kept.total);
        // On flex the host is the device: nothing moves.
        let flex = estimate_stage(
            &model,
            None,
            &Settings {
                precision: Precision::Fp32,
                ..on
            },
            StagePlacement::single(32),
            &FLEX,
            1.0,
        );
        assert!(flex.optimizer_state > 0);
        assert_eq!(flex.host_bytes, 0);
    }

    /// Llama-2-7B, bf16, micro-batch 1 × 4, checkpointing, the optimizer
    /// offloaded: offloaded gradients leave one block's on the device (its
    /// 202,383,360 values, more than the 131,072,000 of the head) instead
    /// of every value twice, and put an fp32 accumulator of every value in
    /// host memory.
    #[test]
    fn offloaded_gradients_leave_one_block_on_the_gpu() {
        let model = ModelShape::Llama(llama_2_7b(2048));
        let params = 6_738_415_616u64;
        let block = 202_383_360u64;
        let kept = Settings {
            micro_batch: 1,
            gradient_accumulation: 4,
            offload_optimizer: true,
            ..settings(Precision::Bf16, true)
        };
        let off = Settings {
            offload_gradients: true,
            ..kept
        };
        let at = |s: &Settings, profile: &BackendProfile| {
            estimate_stage(&model, None, s, StagePlacement::single(32), profile, 1.0)
        };
        let (a, b) = (at(&kept, &CUDA), at(&off, &CUDA));
        assert_eq!(a.gradients, params * 2 * 2);
        assert_eq!(b.gradients, block * 2);
        assert!(b.total < a.total);
        assert_eq!(b.weights, a.weights);
        // The accumulator and one block's staging copy, with the state slack.
        let host = params * 4 + block * 2;
        // (The slack is rounded once on the sum: a byte either way.)
        let added = b.host_bytes - a.host_bytes;
        assert!(
            added.abs_diff(host + slack(host, CUDA.state_slack)) <= 1,
            "{added}"
        );
        // Only with checkpointing (backward block by block) and the
        // optimizer offloaded (the host's step takes them); never on flex.
        for (without, profile) in [
            (
                Settings {
                    activation_checkpointing: false,
                    ..off
                },
                &CUDA,
            ),
            (
                Settings {
                    offload_optimizer: false,
                    ..off
                },
                &CUDA,
            ),
            (
                Settings {
                    precision: Precision::Fp32,
                    ..off
                },
                &FLEX,
            ),
        ] {
            let plain = Settings {
                offload_gradients: false,
                ..without
            };
            assert_eq!(at(&without, profile), at(&plain, profile), "{without}");
        }
        // A stage's unit: a LoRA job's adapters of one block, or of the head.
        let adapters = qv_adapters();
        let lora = estimate_stage(
            &model,
            Some(&adapters),
            &off,
            StagePlacement::single(32),
            &CUDA,
            1.0,
        );
        assert_eq!(lora.gradients, 2 * 16 * (4096 + 4096) * 2);
    }

    /// A GPU stage's load streams: its host side is the largest tensor's,
    /// whatever the stage's share of the checkpoint.
    #[test]
    fn a_streaming_load_holds_the_largest_tensor_not_the_stage() {
        let model = ModelShape::Llama(llama_2_7b(512));
        let s = settings(Precision::Bf16, true);
        let host = |layers: u32| {
            estimate_stage(&model, None, &s, StagePlacement::single(layers), &CUDA, 1.0).host_bytes
        };
        assert_eq!(host(8), host(32));
        // 32000 × 4096 embedding: its pages and cast copy, the 4096 × 11008
        // linears' conversion buffers, with the load slack.
        let tensors = stage_tensors(&model, StagePlacement::single(32));
        let (largest, linear) = (32_000 * 4096u64, 4096 * 11008u64);
        assert_eq!(
            streaming_load_bytes(&tensors, 2),
            2 * largest + 2 * linear * 2 + largest * 2
        );
        let bytes = streaming_load_bytes(&tensors, 2) + largest * 2;
        assert_eq!(host(32), bytes + slack(bytes, CUDA.load_slack));
        let whole_file = load_transient(&tensors, 2).0;
        assert!(host(32) < whole_file / 4, "{} vs {whole_file}", host(32));
    }

    /// Rank-16 adapters on q and v, as the offload tests train.
    fn qv_adapters() -> crate::adapters::LoraConfig {
        crate::adapters::LoraConfig {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            target_modules: vec![TargetModule::QProj, TargetModule::VProj],
            block_size: 64,
        }
    }

    #[test]
    fn offloaded_checkpoints_leave_one_block_input_on_the_gpu() {
        // Llama-2-7B, s 2048, micro-batch 1, bf16, checkpointing: 32 block
        // inputs of 2048 × 4096 bf16 values; with a LoRA adapter too.
        let model = ModelShape::Llama(llama_2_7b(2048));
        let input = 2048 * 4096 * 2;
        let kept = Settings {
            micro_batch: 1,
            ..settings(Precision::Bf16, true)
        };
        let off = Settings {
            offload_activations: true,
            ..kept
        };
        let adapters = qv_adapters();
        for lora in [None, Some(&adapters)] {
            let at = |s: &Settings, profile: &BackendProfile, stage: StagePlacement| {
                estimate_stage(&model, lora, s, stage, profile, 1.0)
            };
            let whole = StagePlacement::single(32);
            let (a, b) = (at(&kept, &CUDA, whole), at(&off, &CUDA, whole));
            assert_eq!(a.activations - b.activations, 31 * input, "{lora:?}");
            // The pod's host memory holds them (beside, here, the larger
            // host side of the checkpoint load, which ends before).
            assert!(b.host_bytes >= 31 * input + slack(31 * input, CUDA.state_slack));
            assert!(b.total < a.total);
            // Without checkpointing there is nothing to offload, and on
            // flex the host is the device: nothing moves.
            let unckpt = |s: &Settings| Settings {
                activation_checkpointing: false,
                ..*s
            };
            assert_eq!(
                at(&unckpt(&off), &CUDA, whole),
                at(&unckpt(&kept), &CUDA, whole)
            );
            let fp32 = |s: &Settings| Settings {
                precision: Precision::Fp32,
                ..*s
            };
            assert_eq!(
                at(&fp32(&off), &FLEX, whole),
                at(&fp32(&kept), &FLEX, whole)
            );
        }
        assert!(!offloads_activations(&off, &FLEX));
        assert!(offloads_activations(&off, &CUDA));
    }

    /// An offloaded embedding moves Llama-2-7B's 32000 × 4096 table from
    /// the device's weights to the pod's host memory on the first stage of
    /// a LoRA job on a GPU, and nowhere else: a full fine-tune trains it, a
    /// tied one is the head's, a later stage has none, flex's device is
    /// the host.
    #[test]
    fn an_offloaded_embedding_leaves_the_device_only_where_it_is_frozen_and_untied() {
        let model = ModelShape::Llama(llama_2_7b(2048));
        let table = 32000 * 4096 * 2;
        let kept = Settings {
            micro_batch: 1,
            ..settings(Precision::Bf16, true)
        };
        let off = Settings {
            offload_embedding: true,
            ..kept
        };
        let adapters = qv_adapters();
        let at = |model: &ModelShape,
                  lora: Option<&crate::adapters::LoraConfig>,
                  s: &Settings,
                  profile: &BackendProfile,
                  stage: StagePlacement| {
            estimate_stage(model, lora, s, stage, profile, 1.0)
        };
        let whole = StagePlacement::single(32);
        let (a, b) = (
            at(&model, Some(&adapters), &kept, &CUDA, whole),
            at(&model, Some(&adapters), &off, &CUDA, whole),
        );
        assert_eq!(a.weights - b.weights, table);
        assert_eq!(a.activations, b.activations);
        assert!(b.load_peak < a.load_peak);
        assert!(b.host_bytes >= a.host_bytes.max(table + slack(table, CUDA.state_slack)));
        assert!(b.total < a.total);
        // Nowhere else does anything move.
        let full = (
            at(&model, None, &kept, &CUDA, whole),
            at(&model, None, &off, &CUDA, whole),
        );
        assert_eq!(full.0, full.1, "full fine-tuning trains the embedding");
        let later = StagePlacement {
            first: false,
            ..whole
        };
        assert_eq!(
            at(&model, Some(&adapters), &kept, &CUDA, later),
            at(&model, Some(&adapters), &off, &CUDA, later),
            "a later stage holds no embedding"
        );
        let mut tied_shape = llama_2_7b(2048);
        tied_shape.tied_embeddings = true;
        let tied = ModelShape::Llama(tied_shape);
        assert_eq!(
            at(&tied, Some(&adapters), &kept, &CUDA, whole),
            at(&tied, Some(&adapters), &off, &CUDA, whole),
            "a tied embedding is the head's weight"
        );
        let fp32 = |s: &Settings| Settings {
            precision: Precision::Fp32,
            ..*s
        };
        assert_eq!(
            at(&model, Some(&adapters), &fp32(&kept), &FLEX, whole),
            at(&model, Some(&adapters), &fp32(&off), &FLEX, whole),
        );
    }
}

/// The terms of [`estimate_stage`], each on its own.
#[cfg(test)]
mod term_tests {
    use super::*;
    use crate::backend::{CUDA, FLEX};
    use crate::model::GenericModel;
    use crate::units::MIB;

    // The small GPT the estimate's own tests use.
    use super::tests::small as gpt;

    fn untied_llama() -> ModelShape {
        ModelShape::Llama(
            LlamaShape::from_hf_config(
                r#"{"architectures":["LlamaForCausalLM"],"hidden_size":512,"intermediate_size":1408,
                   "num_hidden_layers":4,"num_attention_heads":8,"num_key_value_heads":4,
                   "vocab_size":8000,"tie_word_embeddings":false,"torch_dtype":"bfloat16"}"#,
                256,
            )
            .expect("valid test input"),
        )
    }

    fn llama_shape(model: &ModelShape) -> &LlamaShape {
        match model {
            ModelShape::Llama(l) => l,
            _ => unreachable!("a Llama model"),
        }
    }

    fn settings() -> Settings {
        Settings {
            micro_batch: 2,
            precision: Precision::Bf16,
            ..Settings::default()
        }
    }

    fn qv_lora() -> LoraConfig {
        LoraConfig {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: vec![TargetModule::QProj, TargetModule::VProj],
            block_size: 64,
        }
    }

    fn elements(tensors: &[StageTensor]) -> u64 {
        tensors.iter().map(StageTensor::total_elements).sum()
    }

    #[test]
    fn fixed_overhead_adds_a_link_per_neighbouring_stage() {
        let profile = BackendProfile {
            stage_link_bytes: MIB,
            ..FLEX
        };
        let single = StagePlacement::single(4);
        let middle = StagePlacement {
            first: false,
            last: false,
            ..single
        };
        assert_eq!(
            fixed_overhead_bytes(&profile, single),
            FLEX.fixed_overhead_bytes
        );
        assert_eq!(
            fixed_overhead_bytes(&profile, middle),
            FLEX.fixed_overhead_bytes + 2 * MIB
        );
    }

    #[test]
    fn the_correction_is_the_factor_beyond_one_of_the_estimated_terms() {
        assert_eq!(correction_bytes(1.0, 1000), 0);
        assert_eq!(correction_bytes(1.5, 1000), 500);
        assert_eq!(correction_bytes(1.25, 3), 1); // 0.75 rounds up
    }

    #[test]
    fn full_fine_tuning_trains_every_tensor_at_the_weight_size() {
        let model = untied_llama();
        let s = settings();
        let count = StageCount::new(&model, None, &s, StagePlacement::single(4), &CUDA);
        let params = elements(&stage_tensors(&model, StagePlacement::single(4)));
        assert_eq!(count.trained_params(), params);
        assert_eq!(count.weights(0), 2 * params);
        assert_eq!(count.gradients(), 2 * params);
        let accumulating = Settings {
            gradient_accumulation: 4,
            ..s
        };
        let count = StageCount::new(
            &model,
            None,
            &accumulating,
            StagePlacement::single(4),
            &CUDA,
        );
        assert_eq!(
            count.gradients(),
            2 * 2 * params,
            "the running sum beside the current"
        );
    }

    #[test]
    fn adapters_add_their_factors_beside_the_base_less_a_host_embedding() {
        let model = untied_llama();
        let l = llama_shape(&model);
        let lora = qv_lora();
        let s = Settings {
            offload_embedding: true,
            ..settings()
        };
        let stage = StagePlacement::single(4);
        let count = StageCount::new(&model, Some(&lora), &s, stage, &CUDA);
        let base = elements(&stage_tensors(&model, stage)) * 2;
        let factors = elements(&adapter_tensors(l, &lora, stage));
        assert_eq!(count.trained_params(), factors);
        let embedding = l.embedding_params() * 2;
        assert_eq!(count.host_embedding_bytes(), embedding);
        assert_eq!(count.weights(embedding), base - embedding + 2 * factors);
        assert_eq!(count.gradients(), 2 * factors);
        // Without adapters the embedding is trained, so it stays.
        let count = StageCount::new(&model, None, &s, stage, &CUDA);
        assert_eq!(count.host_embedding_bytes(), 0);
    }

    #[test]
    fn a_quantized_base_stores_only_the_block_linears_quantized() {
        let model = untied_llama();
        let lora = qv_lora();
        let stage = StagePlacement::single(4);
        let s = Settings {
            base_format: BaseFormat::Int8,
            ..settings()
        };
        let count = StageCount::new(&model, Some(&lora), &s, stage, &CUDA);
        let expected: u64 = stage_tensors(&model, stage)
            .iter()
            .map(|t| match t.role {
                TensorRole::BlockLinear(_) => t.count * (t.elements + 4 * t.elements.div_ceil(64)),
                _ => t.count * t.elements * 2,
            })
            .sum();
        assert_eq!(count.base_bytes(), expected);
        // Full fine-tuning trains the base, dense whatever the setting says.
        let count = StageCount::new(&model, None, &s, stage, &CUDA);
        assert_eq!(count.base_format, BaseFormat::Dense);
    }

    #[test]
    fn collective_buffers_need_replicas_and_fit_the_trained_values() {
        let model = gpt();
        let s = settings();
        let one = StagePlacement::single(4);
        let two = StagePlacement { replicas: 2, ..one };
        assert_eq!(
            StageCount::new(&model, None, &s, one, &CUDA).collective_buffers(),
            0
        );
        let count = StageCount::new(&model, None, &s, two, &CUDA);
        let bucket = CUDA.collective_bucket_bytes.min(4 * count.trained_params());
        assert_eq!(
            count.collective_buffers(),
            crate::sharding::collective_buffer_bytes(bucket, 2)
        );
    }

    #[test]
    fn the_optimizer_step_counts_only_what_outgrows_the_activation_phase() {
        let model = gpt();
        let profile = BackendProfile {
            optimizer_step_copies: 2.0,
            ..FLEX
        };
        let s = settings();
        let count = StageCount::new(&model, None, &s, StagePlacement::single(4), &profile);
        // One rank with 1000 bytes of state whose largest tensor has 100
        // elements: the step needs 2 × 4 × 100 = 800 bytes.
        let ranks = [(1000, 100)];
        assert_eq!(count.optimizer_step(&ranks, 1000, 300), 500);
        assert_eq!(count.optimizer_step(&ranks, 1000, 900), 0);
        // Replicas: the worst rank's state and step, beyond the largest state.
        assert_eq!(
            count.optimizer_step(&[(1000, 10), (900, 100)], 1000, 300),
            400
        );
        for quiet in [
            Settings {
                optimizer: Optimizer::Sgd,
                ..s
            },
            Settings {
                offload_optimizer: true,
                ..s
            },
        ] {
            let profile = BackendProfile {
                device_is_host: false,
                ..profile
            };
            let count = StageCount::new(&model, None, &quiet, StagePlacement::single(4), &profile);
            assert_eq!(count.optimizer_step(&ranks, 1000, 300), 0, "{quiet}");
        }
    }

    #[test]
    fn allocator_slack_is_each_phase_s_slack_and_one_arena_page() {
        let model = untied_llama();
        let lora = qv_lora();
        let s = settings();
        let stage = StagePlacement::single(4);
        let profile = BackendProfile {
            adapter_activation_slack: 0.5,
            ..CUDA
        };
        let count = StageCount::new(&model, None, &s, stage, &profile);
        let largest_gradient = llama_shape(&model).embedding_params() * 2;
        assert_eq!(
            count.allocator_slack(1000, 100, 0),
            20 + 33 + arena_page_bytes(&CUDA, largest_gradient)
        );
        // Adapters without checkpointing take the adapter slack; the widest
        // activation decides the page when it is larger than any gradient.
        let count = StageCount::new(&model, Some(&lora), &s, stage, &profile);
        assert_eq!(
            count.allocator_slack(1000, 100, 64 * MIB),
            20 + 50 + arena_page_bytes(&CUDA, 64 * MIB)
        );
    }

    #[test]
    fn host_bytes_hold_the_offloaded_terms_or_the_load_whichever_is_larger() {
        let model = gpt();
        let stage = StagePlacement::single(4);
        let s = settings();
        let on_device = StageCount::new(&model, None, &s, stage, &CUDA);
        assert_eq!(on_device.host_bytes(1000, 0, 7), 7);
        assert_eq!(on_device.host_bytes(1000, 500, 7), 510);
        let offloaded = Settings {
            offload_optimizer: true,
            ..s
        };
        let count = StageCount::new(&model, None, &offloaded, stage, &CUDA);
        assert_eq!(count.host_bytes(1000, 500, 7), 1020 + 510);
        assert_eq!(count.host_bytes(1000, 500, 5000), 5000);
        // A CPU worker's host memory is its budget, counted on the device.
        let count = StageCount::new(&model, None, &offloaded, stage, &FLEX);
        assert_eq!(count.host_bytes(1000, 500, 5000), 0);
    }

    #[test]
    fn a_generic_model_s_activations_scale_its_32_bit_figure() {
        let model = ModelShape::Generic(GenericModel {
            parameters: 1000,
            activation_bytes_per_sample: 400,
        });
        let s = settings();
        let count = StageCount::new(&model, None, &s, StagePlacement::single(1), &FLEX);
        let phase = count.activation_phase();
        assert_eq!(
            phase,
            ActivationPhase {
                activations: 400 * 2 * 2 / 4,
                ..ActivationPhase::default()
            }
        );
    }

    #[test]
    fn a_gpt_stage_s_activations_are_its_blocks_phase_and_boundary() {
        let model = gpt();
        let ModelShape::Transformer(t) = &model else {
            unreachable!()
        };
        let s = settings();
        let stage = StagePlacement::single(4);
        let count = StageCount::new(&model, None, &s, stage, &FLEX);
        let (sq, b, h, a, e) = (128, 2, 256, 4, 2);
        let block = gpt_burn_block_bytes(sq, b, h, a, t.ffn(), e);
        let logits = loss_bytes(sq * b, 1000, FLEX.logit_copies);
        let attention = attention_transient_bytes(sq, b, a, e, FLEX.attention_block);
        let phase = count.activation_phase();
        assert_eq!(phase.logits, logits);
        assert_eq!(
            phase.activations,
            4 * block + attention.saturating_sub(logits + block) + 3 * sq * b * h * e
        );
        assert_eq!(phase.offloaded_inputs, 0);
        assert_eq!(
            phase.widest,
            (sq * b * t.ffn() * e).max(loss_chunk_bytes(sq * b, 1000, true))
        );
    }

    #[test]
    fn offloaded_inputs_leave_one_block_s_input_on_the_device() {
        let model = gpt();
        let s = Settings {
            activation_checkpointing: true,
            offload_activations: true,
            ..settings()
        };
        let stage = StagePlacement {
            in_flight: 3,
            ..StagePlacement::single(4)
        };
        let count = StageCount::new(&model, None, &s, stage, &CUDA);
        let blocks = KeptBlocks {
            kept: 3 * 4 * 10,
            one_block: 50,
            recomputed: 40,
        };
        let around = PhaseTransients {
            attention: 0,
            token_vector: 10,
            final_norm: 3,
        };
        let (activations, offloaded) = count.device_activations(blocks, around, 0);
        assert_eq!(offloaded, 120 - 10);
        // The one input, the recomputed block, the final norm's vectors.
        assert_eq!(activations, 10 + recomputation_bytes(&CUDA, 40, 0) + 30);
    }

    /// A stage's blocks under adapters are counted in closed form: a stage
    /// of four billion layers costs what a stage of two does (a value per
    /// layer would need 64 GiB here).
    #[test]
    fn a_stage_under_adapters_is_counted_without_a_value_per_layer() {
        let model = untied_llama();
        let l = llama_shape(&model);
        let lora = qv_lora();
        let (b, e) = (2, 2);
        let token_vector = 256 * b * 512 * e;
        let n = u32::MAX;
        let plain = settings();
        for first in [true, false] {
            let stage = StagePlacement {
                first,
                ..StagePlacement::single(n)
            };
            let count = StageCount::new(&model, Some(&lora), &plain, stage, &FLEX);
            let head = AdaptedBlock::new(l, &lora, !first);
            let later = AdaptedBlock::new(l, &lora, true);
            let (head, later) = (head.bytes(l, b, e), later.bytes(l, b, e));
            assert_eq!(
                count.llama_kept_blocks(l, Some(&lora), token_vector),
                KeptBlocks {
                    kept: head + u64::from(n - 1) * later,
                    one_block: later,
                    recomputed: 0,
                }
            );
        }
    }

    #[test]
    fn llama_blocks_under_adapters_follow_what_burn_keeps() {
        let model = untied_llama();
        let l = llama_shape(&model);
        let lora = qv_lora();
        let (b, e) = (2, 2);
        let token_vector = 256 * b * 512 * e;
        let stage = StagePlacement {
            in_flight: 2,
            ..StagePlacement::single(4)
        };
        let plain = settings();
        let count = StageCount::new(&model, Some(&lora), &plain, stage, &FLEX);
        // The blocks in order, each from the one before it.
        let mut tracked = !stage.first;
        let blocks: Vec<u64> = (0..stage.layers)
            .map(|_| {
                let block = AdaptedBlock::new(l, &lora, tracked);
                tracked = block.output_tracked;
                block.bytes(l, b, e)
            })
            .collect();
        assert_eq!(
            count.llama_kept_blocks(l, Some(&lora), token_vector),
            KeptBlocks {
                kept: 2 * blocks.iter().sum::<u64>(),
                one_block: blocks[3],
                recomputed: 0,
            }
        );
        let ckpt = Settings {
            activation_checkpointing: true,
            ..plain
        };
        let count = StageCount::new(&model, Some(&lora), &ckpt, stage, &FLEX);
        let full = AdaptedBlock::new(l, &lora, true).bytes(l, b, e);
        assert_eq!(
            count.llama_kept_blocks(l, Some(&lora), token_vector),
            KeptBlocks {
                kept: 2 * 4 * token_vector,
                one_block: full,
                recomputed: full - token_vector,
            }
        );
        // Without adapters, the profile's count of a whole block.
        let count = StageCount::new(&model, None, &ckpt, stage, &FLEX);
        let block = |c| l.burn_block_activation_bytes(b, e, c);
        assert_eq!(
            count.llama_kept_blocks(l, None, token_vector),
            KeptBlocks {
                kept: 2 * 4 * block(true),
                one_block: block(false),
                recomputed: block(false) - block(true),
            }
        );
    }

    #[test]
    fn a_frozen_final_norm_keeps_fewer_vectors() {
        let mut lora = qv_lora();
        assert_eq!(final_norm_vectors(None), 3);
        assert_eq!(final_norm_vectors(Some(&lora)), 1);
        lora.target_modules.push(TargetModule::LmHead);
        assert_eq!(final_norm_vectors(Some(&lora)), 2);
    }

    #[test]
    fn only_a_llama_model_loads_a_checkpoint() {
        let model = gpt();
        let s = settings();
        let count = StageCount::new(&model, None, &s, StagePlacement::single(4), &FLEX);
        assert_eq!(count.load_phase(1000, 0, 10, 1.0), LoadPhase::default());
    }

    #[test]
    fn a_gpu_load_holds_the_weights_and_one_upload_and_the_host_one_tensor() {
        let model = untied_llama();
        let l = llama_shape(&model);
        let s = settings();
        let stage = StagePlacement::single(4);
        let count = StageCount::new(&model, None, &s, stage, &CUDA);
        let tensors = stage_tensors(&model, stage);
        let (_, largest) = load_transient(&tensors, 2);
        assert_eq!(largest, l.embedding_params());
        let weights = 1_000_000;
        assert_eq!(count.gpu_load_bytes(2, weights), weights + 2 * largest);
        let upload = 2 * largest;
        let expected_peak = 10 + weights + (upload + slack(weights + upload, CUDA.load_slack));
        // The streaming read of the largest tensor and its cast to the
        // stage's dtype (bf16 here), not the stage's file.
        let host = streaming_load_bytes(&tensors, 2) + 2 * largest;
        assert_eq!(
            count.load_phase(weights, 0, 10, 1.0),
            LoadPhase {
                peak: expected_peak,
                host: host + slack(host, CUDA.load_slack),
            }
        );
    }

    #[test]
    fn a_cpu_load_peaks_with_the_host_transient_beside_the_weights() {
        let model = untied_llama();
        let s = settings();
        let stage = StagePlacement::single(4);
        let count = StageCount::new(&model, None, &s, stage, &FLEX);
        let (host_transient, _) = load_transient(&stage_tensors(&model, stage), 2);
        let weights = 1_000_000;
        let on_device = weights + host_transient;
        let estimated = host_transient + slack(on_device, FLEX.load_slack);
        let phase = count.load_phase(weights, 0, 10, 2.0);
        assert_eq!(phase.host, 0);
        assert_eq!(phase.peak, 10 + weights + 2 * estimated);
    }
}
