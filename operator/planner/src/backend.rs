//! The worker backends a plan can run on, and what each one costs and
//! supports: the facts the memory model, the search and the retry rungs read.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::adapters::BaseFormat;
use crate::training::{Optimizer, Precision};
use crate::units::MIB;

/// The worker backend a plan runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Backend {
    /// burn's CPU backend.
    Flex,
    /// burn's CUDA backend (NVIDIA GPUs).
    Cuda,
}

/// What a backend costs beyond tensors, and what it supports. Constants are
/// starting points; the worker calibration bench refines them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackendProfile {
    pub backend: Backend,
    /// Process/context baseline in bytes (binary, thread stacks; CUDA context and kernels).
    pub fixed_overhead_bytes: u64,
    /// Slack on the model states (weights, gradients, optimizer state) as a
    /// fraction of their bytes: the optimizer's transient copies while it
    /// updates, the serialised checkpoint, allocator caching.
    pub state_slack: f64,
    /// Slack on a checkpoint load's bytes (the device's and the host's),
    /// its own: the load's transients are not the training step's.
    pub load_slack: f64,
    /// Slack on activations and logits as a fraction of their bytes: the
    /// transient gradients backward makes beside what forward kept, and the
    /// allocator's free-but-unreturned memory they leave.
    pub activation_slack: f64,
    /// The activation slack of a stage that trains LoRA adapters on a frozen
    /// base without activation checkpointing: backward through a frozen
    /// projection makes the gradient of its input only, not of its weight,
    /// so fewer transients sit beside the kept tensors. (With checkpointing
    /// the recomputation's transients dominate as in full fine-tuning, and
    /// `activation_slack` applies.)
    pub adapter_activation_slack: f64,
    /// How a block's kept activations are counted.
    pub activation_count: ActivationCount,
    /// With activation checkpointing, the loss (logits and their gradient)
    /// and the recomputation of one block run one after the other, not
    /// together: the larger of the two is counted whole and the smaller at
    /// this fraction, what the allocator still holds of the earlier phase
    /// (1: the two are simply added).
    pub checkpoint_phase_overlap: f64,
    /// Fraction of nominal device memory that is actually allocatable.
    pub usable_fraction: f64,
    /// Dropout mask bytes per element (0: the Headroom worker trains without dropout).
    pub dropout_mask_bytes: u64,
    /// The optimizer step's temporaries, in f32 copies of the largest
    /// tensor a worker steps, beyond the states they replace (new moments,
    /// direction, decayed and updated weights). The step runs after
    /// backward has freed the activations, so it is a phase of its own
    /// ([`crate::memory::MemoryBreakdown::optimizer_step`]).
    pub optimizer_step_copies: f64,
    /// Copies of the loss op's chunk of f32 logits alive at once (logits,
    /// their exponentials and, in backward, the gradient), fitted: they do
    /// not all overlap for the whole of the loss.
    pub logit_copies: f64,
    /// Bytes a pipeline stage holds per link to a neighbouring stage
    /// (`worker/src/pipeline`: its reader thread and the frames in flight
    /// on it), beside the fixed overhead, where the budgeted memory is the
    /// host's (on a GPU they are host memory).
    pub stage_link_bytes: u64,
    /// Precisions the worker trains in on this backend; a plan never leaves them.
    pub precisions: &'static [Precision],
    /// Whether a bf16/fp16 plan trains the half-precision weights
    /// themselves: no fp32 master copy, and the optimizer's moments in the
    /// weights' dtype (burn's optimizers keep their state in the gradient's
    /// dtype). False: mixed precision as PyTorch's AMP keeps it (fp32
    /// master weights and moments), the conservative count.
    pub pure_half_precision: bool,
    /// Whether a fully trained Llama-family block's gated MLP is counted as
    /// burn's composed `silu(gate) · up` (which also keeps the sigmoid and
    /// SiLU's output: 2 intermediate-wide tensors a token more) instead of
    /// the worker's one gating op (gate and up kept, the sigmoid or tanh
    /// recomputed in backward). False for today's worker; true describes
    /// the worker before the op, as the H200 rows of 2026-11-27 measured it.
    pub composed_gated_mlp: bool,
    /// Optimizers the worker implements on this backend; a plan never leaves them.
    pub optimizers: &'static [Optimizer],
    /// Formats the worker stores a frozen LoRA base in on this backend
    /// (dense for LoRA; int8, int4 or nf4 for QLoRA); a plan never leaves them.
    pub base_formats: &'static [BaseFormat],
    /// Bytes one stored int4 value really occupies: 1.0 where the backend
    /// keeps a 4-bit value in a byte, 0.5 where it packs two per byte. The
    /// planner promises only the saving the backend gives.
    pub int4_value_bytes: f64,
    /// Whether the worker can keep optimizer state in host memory (GPU
    /// backends; on CPU the state is in host memory already).
    pub optimizer_offload: bool,
    /// Whether the worker can keep checkpointed block inputs in host memory
    /// (`Settings::offload_activations`; GPU backends only).
    pub activation_offload: bool,
    /// Whether the worker can keep a LoRA job's frozen token embedding in
    /// host memory (`Settings::offload_embedding`; GPU backends only).
    pub embedding_offload: bool,
    /// Whether the worker can move each block's gradients to a host fp32
    /// accumulator as its backward produces them (`Settings::offload_gradients`,
    /// with checkpointing and the optimizer offloaded; GPU backends only).
    pub gradient_offload: bool,
    /// Whether the budgeted device memory is the host's (CPU workers): then
    /// the checkpoint load's host-side transient counts against the budget;
    /// on a GPU it is the pod's host memory instead
    /// ([`MemoryBreakdown::host_bytes`](crate::MemoryBreakdown::host_bytes)).
    pub device_is_host: bool,
    /// Whether the worker runs data-parallel replicas on this backend
    /// (gradients averaged by an all-reduce, optimizer state sharded ZeRO-1
    /// style). A plan never has more than one replica where it does not.
    pub data_parallel: bool,
    /// Sustained fp32 arithmetic of one device, FLOP/s: with the model's
    /// FLOPs per step it turns the step-time model's relative compute into
    /// seconds, so that it can be weighed against the all-reduce.
    pub fp32_flops_per_second: f64,
    /// Bus bandwidth of the all-reduce between two devices of this backend,
    /// bytes/s (what a ring moves per link; see [`crate::timing`]).
    pub collective_bytes_per_second: f64,
    /// Fixed cost of one collective message (latency), seconds.
    pub collective_latency_seconds: f64,
    /// f32 bytes the worker reduces or gathers at once: what bounds the
    /// collective's buffers (memory) and sets the number of messages
    /// (latency, [`crate::timing`]).
    pub collective_bucket_bytes: u64,
    /// Bandwidth of the link between two pipeline stages, bytes/s: the
    /// worker's TCP connections (worker/src/pipeline), which carry each
    /// micro-batch's activations forward and their gradients back.
    pub stage_link_bytes_per_second: f64,
    /// Bandwidth between the device and host memory, bytes/s: what
    /// offloaded gradients and the weights they update cross
    /// ([`crate::timing::host_copy_seconds`]). Unused where the device is
    /// the host.
    pub host_link_bytes_per_second: f64,
    /// How the worker configures the GPU runtime (GPU backends only).
    pub gpu_runtime: Option<GpuRuntime>,
    /// cubecl's arena (CUDA): every allocation above 64 KiB is carved,
    /// first fit, out of pages of one size, the largest request so far plus
    /// this, rounded up to a multiple of it (`cubecl-server` 0.11.3,
    /// `memory_management/dynamic/arena.rs`: `PAGE_SLACK` = `PAGE_GRANULE`
    /// = 1 MiB, at least 2 MiB), and pages go back to the driver only on an
    /// explicit cleanup. So the arena holds whole pages: up to one page more
    /// than its live bytes, which the memory model counts
    /// ([`crate::memory::arena_page_bytes`]). 0: no such pages (flex: the
    /// system allocator, which the slacks cover).
    pub arena_page_slack_bytes: u64,
    /// Query and key rows per block of the worker's attention op
    /// (`worker/src/model/lean/attention.rs`), whose transient is one block
    /// pair's scores ([`crate::memory::attention_transient_bytes`]). A
    /// block pair on the diagonal computes its masked half too, so small
    /// blocks skip more of it, at more ops per call: on the CPU, where an
    /// op costs little, blocks of 64 run the bench's attention (4 × 256 and
    /// 1 × 2048 tokens) forward and backward in 0.61× and 0.82× of the time
    /// blocks of 256 take (`calibrate --step-breakdown --only block-ops`);
    /// on a GPU each pair is kernel launches, so blocks stay large.
    pub attention_block: u64,
}

/// How the memory model counts the activations one block keeps for backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActivationCount {
    /// The published counts: Korthikanti et al. 2022 for a GPT block, and a
    /// first-principles count of the tensors a Llama block needs (without the
    /// copies an implementation makes).
    Published,
    /// What burn's autodiff keeps for the Headroom worker's blocks, counted
    /// op by op from `worker/src/model/{gpt,llama}.rs` and burn 0.22's op
    /// implementations (see [`crate::memory`]).
    BurnAutodiff,
}

/// How a GPU worker configures cubecl, burn's GPU runtime, before it opens
/// the device: chosen with the backend's memory model and recorded in the
/// plan, so that what the planner counted is what the worker runs
/// (`worker/src/gpu_runtime.rs` applies it), as seed 003 sets
/// `PYTORCH_CUDA_ALLOC_CONF` from what it measured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GpuRuntime {
    /// Where cubecl's pools get device memory.
    pub allocator: GpuAllocator,
    /// Whether allocations the size of a persistent (weight-shaped) bucket
    /// are served from the persistent pool.
    pub persistent_memory: PersistentMemory,
    /// How hard cubecl benchmarks kernel candidates the first time it meets
    /// a shape (the results are kept on the job's checkpoint volume, so a
    /// retry does not tune again).
    pub autotune: AutotuneLevel,
}

/// cubecl's CUDA allocator (`[memory.cuda] allocator`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum GpuAllocator {
    /// `cuMemAlloc`/`cuMemFree` for each pool page: nothing reserved beyond
    /// the pages, which is what the memory model counts.
    Sync,
    /// CUDA's stream-ordered allocator, which may keep freed memory in a
    /// pool of its own (not modelled: a plan does not choose it).
    Async,
}

/// cubecl's persistent memory (`[memory] persistent_memory`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum PersistentMemory {
    /// Only allocations made as persistent (cubecl's default).
    Enabled,
    /// Also allocations whose size matches a persistent bucket: gradients
    /// and optimizer moments are weight-shaped.
    SizeMatch,
    /// No persistent pool.
    Disabled,
}

/// cubecl's autotune level (`[autotune] level`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum AutotuneLevel {
    Minimal,
    Balanced,
    Extensive,
    Full,
}

impl std::fmt::Display for GpuRuntime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The names cubecl.toml spells them with.
        let allocator = match self.allocator {
            GpuAllocator::Sync => "sync",
            GpuAllocator::Async => "async",
        };
        let persistent = match self.persistent_memory {
            PersistentMemory::Enabled => "enabled",
            PersistentMemory::SizeMatch => "size-match",
            PersistentMemory::Disabled => "disabled",
        };
        let autotune = match self.autotune {
            AutotuneLevel::Minimal => "minimal",
            AutotuneLevel::Balanced => "balanced",
            AutotuneLevel::Extensive => "extensive",
            AutotuneLevel::Full => "full",
        };
        write!(
            f,
            "cubecl allocator {allocator}, persistent memory {persistent}, autotune {autotune}"
        )
    }
}

impl Backend {
    pub fn profile(self) -> &'static BackendProfile {
        match self {
            Backend::Flex => &FLEX,
            Backend::Cuda => &CUDA,
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Flex => "flex",
            Backend::Cuda => "cuda",
        })
    }
}

/// burn `flex` on CPU: the container's memory limit is the device.
///
/// Calibrated against measured worker peaks (VmHWM of the worker process,
/// `calibrate --skip-overhead`: GPT and Llama-family models at s 64–4096,
/// LoRA/QLoRA, 8-bit AdamW, with and without checkpointing, pipeline
/// stages; refitted on 2026-11-28 to the worker's fixed mmap threshold,
/// and on 2026-11-29 to its linears on rows: 94 rows without replicas,
/// median |error| 4.5 % and 4.7 % in two runs, worst −7.5 % and −8.2 %,
/// `docs/benchmarks.md`). Activations are counted as burn's autodiff keeps
/// them, so the slack left is each component's own.
pub const FLEX: BackendProfile = BackendProfile {
    backend: Backend::Flex,
    // A worker's baseline resident set (binary, allocator arenas, rayon
    // threads, tokenizer): about 20 MiB; the smallest GPT row measured 44 MiB
    // in all.
    fixed_overhead_bytes: 20 * MIB,
    // The optimizer updates one parameter tensor at a time and the
    // checkpoint is written one part at a time, so the model states leave
    // little beside them: with the linears on rows
    // (`worker/src/model/lean/linear.rs`) backward makes each trained
    // weight's gradient once, not once per sample, and the grid fits best
    // with none; 1 % stays for the state-heavy rows with few activations
    // (`FF22` measured 394 and 404 MiB in two runs). Two runs, 94 rows
    // without replicas: median |error| 4.5 % and 4.7 %, worst −7.5 % and
    // −8.2 % (docs/benchmarks.md).
    state_slack: 0.01,
    // Fitted to the load's own figures (`make bench-load-peak`,
    // docs/benchmarks.md), which the linears on rows do not change.
    load_slack: 0.05,
    // None: the worker's attention and loss ops (`worker/src/model/lean/`)
    // make no s²-sized temporaries in backward, and a least-squares fit of
    // the 33 rows without checkpointing gives the counted activations a
    // coefficient of 0.92.
    activation_slack: 0.0,
    // Likewise for LoRA/QLoRA rows without checkpointing (fitted 0.92): the
    // adapters run beside the frozen matmul and compose no weight.
    adapter_activation_slack: 0.0,
    activation_count: ActivationCount::BurnAutodiff,
    // Fitted: with checkpointing the loss (one chunk of logits, three
    // copies) and the recomputation of one block mostly alternate; a
    // quarter of the smaller phase is still held when the larger peaks
    // (0.5 over-predicted the checkpointed rows by 10–40 %).
    checkpoint_phase_overlap: 0.25,
    usable_fraction: 1.0,
    dropout_mask_bytes: 0,
    // Measured where the step is the peak, activations small beside one
    // large tensor (calibration rows FF16, 2 × 768 with a 16k vocabulary,
    // from the first-fit bench's permanent failure; docs/benchmarks.md):
    // 2.5 copies of the embedding with f32 AdamW, 2.9 and 3.2 with 8-bit
    // AdamW (untied, tied).
    optimizer_step_copies: 3.25,
    // One chunk of the loss op's f32 logits, their exponentials and, in
    // backward, the gradient: three copies, which do not all live through
    // the loss. With the worker's fixed mmap threshold (a 32 MiB chunk is
    // mapped and unmapped, not kept in the heap) a least-squares fit of the
    // grid gives the logits 0.87 of three copies (docs/log/benchmarks-log.md,
    // 2026-11-28 evening).
    logit_copies: 2.6,
    // Measured, not derived: the middle stage of three (two links) sits
    // 11 MiB above its plan, stages with one link 0 to +10 %, with the
    // same terms otherwise (`calibrate --skip-overhead`, 2026-11-28).
    stage_link_bytes: 4 * MIB,
    precisions: &[Precision::Fp32],
    // fp32 only.
    pure_half_precision: false,
    composed_gated_mlp: false,
    optimizers: &[
        Optimizer::Adamw,
        Optimizer::Adam,
        Optimizer::SgdMomentum,
        Optimizer::Sgd,
        // bitsandbytes-style block-wise 8-bit moments (worker/src/optim/).
        Optimizer::Adamw8bit,
    ],
    // The worker quantizes a QLoRA base with burn's block-wise scheme
    // (worker/src/model/lora.rs); burn-flex keeps every quantized value,
    // int4 included, in one i8 (burn-flex-0.22.1/src/qtensor.rs), so int4
    // runs but stores what int8 does.
    base_formats: &[
        BaseFormat::Dense,
        BaseFormat::Int8,
        BaseFormat::Int4,
        BaseFormat::Nf4,
    ],
    int4_value_bytes: 1.0,
    optimizer_offload: false,
    activation_offload: false,
    embedding_offload: false,
    gradient_offload: false,
    device_is_host: true,
    // The worker's replicas over its TCP ring (worker/src/data_parallel.rs):
    // gradients reduce-scattered, ZeRO-1 shards stepped, weights all-gathered.
    data_parallel: true,
    // burn-flex's fp32 matmuls on the 2-core machine the calibration ran on
    // (docs/benchmarks.md, tokens/s of the calibration models): an order of
    // magnitude, not a calibration; only its ratio to the link matters.
    fp32_flops_per_second: 2.0e10,
    // The worker's TCP ring on loopback, 2 cores: bus bandwidth 0.6-1.3 GB/s
    // at d = 2 and 0.3-0.9 GB/s at d = 4 for 4-256 MiB (`cargo run --release
    // -p headroom-worker --bin allreduce_bench`, docs/benchmarks.md).
    collective_bytes_per_second: 1.0e9,
    collective_latency_seconds: 1.0e-4,
    // Small: on CPU the buffers come out of the same memory limit as the
    // model, and a small model must still gain from sharding its state.
    collective_bucket_bytes: 2 * MIB,
    // The same TCP as the ring, pod to pod.
    stage_link_bytes_per_second: 1.0e9,
    // No link: the device is the host.
    host_link_bytes_per_second: f64::INFINITY,
    gpu_runtime: None,
    arena_page_slack_bytes: 0,
    attention_block: 64,
};

/// burn CUDA: the context and kernels NVML counts beside cubecl's pool, and
/// drivers keep ~1 % back (an "80 GB" card offers about 79.2 GiB).
///
/// Calibrated on an H200 (2026-11-27, docs/gpu.md) against four bf16 full
/// fine-tunes with the lean ops (110M and 374M, s 1024 and 8192, with and
/// without checkpointing); its 1.1B, LoRA/QLoRA and 8-bit AdamW rows are
/// not measured yet, so those keep the same terms unverified.
pub const CUDA: BackendProfile = BackendProfile {
    backend: Backend::Cuda,
    // NVML's used bytes less cubecl's reserved pool in the smoke run (853 −
    // 214 MiB) is the context, ~640 MiB; the fit of the four rows gives
    // 650-730 MiB of fixed cost.
    fixed_overhead_bytes: 680 * MIB,
    // cubecl's pool rounds each allocation up to its page sizes.
    state_slack: 0.02,
    load_slack: 0.02,
    // Measured ÷ counted activations was 1.337 (110M) and 1.332 (374M)
    // without checkpointing, once the states are counted as the worker
    // keeps them. Not yet separated: f32 copies where a bf16 stage upcasts
    // (RmsNorm), the freed pages cubecl's pool keeps, and (measured on
    // those rows, removed since 2026-11-29) each trained weight's gradient
    // made once per sample by burn's batched matmul: the rows' peaks may be
    // lower now, so this may over-predict until a GPU measures them again.
    activation_slack: 0.33,
    // Not measured on a GPU for adapters: the full fine-tunes' figure.
    adapter_activation_slack: 0.33,
    activation_count: ActivationCount::BurnAutodiff,
    checkpoint_phase_overlap: 1.0,
    usable_fraction: 0.99,
    dropout_mask_bytes: 0,
    // Not measured on a GPU: nothing beyond the state slack until a GPU
    // run measures the step (the CPU's figure is glibc's, not the CUDA
    // caching allocator's).
    optimizer_step_copies: 0.0,
    // The loss op's chunk, as on flex.
    logit_copies: 3.0,
    // Host memory on a GPU worker.
    stage_link_bytes: 0,
    precisions: &[Precision::Fp32, Precision::Bf16, Precision::Fp16],
    // The worker's bf16/fp16 stage computes with half-precision weights and
    // gradients, and its optimizer keeps f32 master weights and f32 moments
    // on the device (worker/src/train.rs, `build_optimizer`), as PyTorch's
    // mixed precision does. The H200 rows of 2026-11-27 (docs/gpu.md) were
    // measured when the stage kept everything in bf16; they await a GPU
    // session's re-measurement under this count.
    pure_half_precision: false,
    composed_gated_mlp: false,
    optimizers: &[
        Optimizer::Adamw,
        Optimizer::Adam,
        Optimizer::SgdMomentum,
        Optimizer::Sgd,
        // bitsandbytes-style block-wise 8-bit moments (worker/src/optim/).
        Optimizer::Adamw8bit,
    ],
    // The same burn code as on flex; cubecl packs int4 values two per byte.
    // Unverified on a GPU (none here).
    base_formats: &[
        BaseFormat::Dense,
        BaseFormat::Int8,
        BaseFormat::Int4,
        BaseFormat::Nf4,
    ],
    int4_value_bytes: 0.5,
    // The worker wraps the optimizer to keep its state, and run its step,
    // on the host (worker/src/optim/offload.rs). Unverified on a GPU.
    optimizer_offload: true,
    // The checkpointed block inputs go to the host after each block's
    // forward and come back for its recomputation (worker/src/train.rs,
    // `KeptInput`). Unverified on a GPU.
    activation_offload: true,
    // The frozen embedding is looked up on the host and only the
    // micro-batch's rows go to the device (worker/src/model/host_embedding.rs).
    // Unverified on a GPU.
    embedding_offload: true,
    // After each checkpointed block's backward its gradients go to a host
    // fp32 accumulator and the step runs there, block by block
    // (the worker's gradient offload, `Settings::offload_gradients`).
    // Unverified on a GPU.
    gradient_offload: true,
    device_is_host: false,
    // Replicas all-reduce over NCCL (worker/src/collective/nccl.rs), or the
    // TCP ring when the image has no libnccl. Unverified on a GPU.
    data_parallel: true,
    // An A100/H100-class GPU at a typical 40-50 % of its TF32/bf16 peak in
    // training (bf16 counts twice this, `timing::relative_compute`).
    // Uncalibrated: no GPU has measured it.
    fp32_flops_per_second: 1.0e14,
    // The worker's NCCL collective is host-staged: a bucket of gradients
    // crosses PCIe four times (down out of burn, up into NCCL's buffer, the
    // reduced shard down, the updated weights up), each at ~12 GB/s for
    // pageable memory, which is a bucket every ~0.33 s per GB whatever d;
    // NCCL's own ring (20 GB/s bus bandwidth over PCIe 4.0, several times
    // that over NVLink) is small beside it. 3 GB/s charges that at d = 2
    // and overcharges larger d (the formula's 2(d-1)/d grows with d, the
    // staging does not): the conservative end. Uncalibrated.
    collective_bytes_per_second: 3.0e9,
    collective_latency_seconds: 5.0e-6,
    // PyTorch DDP's default bucket (25 MB): few enough messages that the
    // ring's latency stays small beside its bandwidth.
    collective_bucket_bytes: 32 * MIB,
    // Stages talk over the worker's TCP connections on GPUs too, each
    // tensor staged through host memory: the flex figure, not NVLink's.
    stage_link_bytes_per_second: 1.0e9,
    // PCIe 4.0 x16 from pageable host memory, ~12 GB/s (the figure the
    // collective's staging is charged above); pinned buffers reach ~25.
    // Uncalibrated.
    host_link_bytes_per_second: 12.0e9,
    // cubecl's defaults for the allocator and the persistent pool, which is
    // what the terms above were calibrated with (H200, 2026-11-27); the
    // autotune level is cubecl's default too, now that the worker keeps
    // its results (the 142 s first step of docs/gpu.md is paid once per
    // job and GPU type, not per process).
    gpu_runtime: Some(GpuRuntime {
        allocator: GpuAllocator::Sync,
        persistent_memory: PersistentMemory::Enabled,
        autotune: AutotuneLevel::Balanced,
    }),
    // Read from cubecl's source (see the field); the H200 rows above were
    // measured with it but the page was not a term of its own then: on
    // them it is 34-66 MiB of 1.6-24 GiB peaks. Unverified as a term.
    arena_page_slack_bytes: MIB,
    attention_block: 256,
};
