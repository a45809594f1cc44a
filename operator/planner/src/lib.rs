//! Headroom's planner: will this training job fit, and how?
//!
//! Pure functions only — no Kubernetes client, no burn, no I/O — so that the
//! operator, the `kubectl headroom` plugin, the worker and the tests all share
//! one answer. Every memory figure is in **bytes** unless a name says otherwise.
//!
//! Modules, each importing only those above it:
//!
//! * [`units`] — byte and count formatting
//! * [`limits`] — the sizes a transformer may have (the CRD's bounds, and a checkpoint's)
//! * [`target_module`] — the Llama-family modules LoRA may adapt, by their Hugging Face names
//! * [`llama`] — Llama-family models (Llama, Mistral, Qwen2, Qwen3, Phi-3) from a Hugging Face `config.json`
//! * [`adapters`] — LoRA adapters and the frozen base's storage format (QLoRA)
//! * [`model`] — what is being trained (transformer shape, Llama family, or a generic parameter count)
//! * [`training`] — precision, optimizer and batch settings
//! * [`disk`] — the bytes a plan keeps on the job's checkpoint claim, and the claim that holds them
//! * [`sharding`] — which data-parallel replica keeps each tensor's optimizer state (ZeRO-1)
//! * [`backend`] — the worker backends (flex, cuda): overheads and what each supports
//! * [`memory`] — the per-worker memory model with its breakdown
//! * [`inventory`] — devices the cluster offers (GPU Feature Discovery labels) or a CPU budget
//! * [`timing`] — the estimated time of an optimizer step (compute, all-reduce)
//! * [`rung`] — the retry rungs and how each tightens settings or placement
//! * [`plan`](mod@plan) — the request, the options, and the plan (or why none fits)
//! * [`search`] — the cheapest-then-fastest plan that fits, or an explanation with numbers
//! * [`ladder`] — the next, stricter plan after an out-of-memory failure
//! * [`retry`] — [`replan`]: the next attempt's plan after any failure

pub mod adapters;
pub mod backend;
pub mod disk;
pub mod inventory;
pub mod ladder;
pub mod limits;
pub mod llama;
pub mod memory;
pub mod model;
pub mod plan;
pub mod retry;
pub mod rung;
pub mod search;
pub mod sharding;
pub mod target_module;
pub mod timing;
pub mod training;
pub mod units;

pub use adapters::{BaseFormat, LoraConfig};
pub use backend::{Backend, BackendProfile, GpuRuntime};
pub use disk::{DataOnClaim, DiskBreakdown, DiskInputs};
pub use inventory::{DeviceKind, DeviceType, Inventory, NodeFacts};
pub use ladder::{MemoryFailure, MemoryFailureKind, next_stricter_plan};
pub use llama::{
    ConfigError, GemmaAttention, LayerAttention, LlamaArchitecture, LlamaShape, RopeScaling,
};
pub use memory::{LOSS_CHUNK_ELEMENTS, MemoryBreakdown, NF4_DEQUANT_CHUNK_VALUES};
pub use model::{GenericModel, ModelShape, TransformerShape};
pub use plan::{
    Deadline, JobRequest, NoFeasiblePlan, Objective, Plan, SearchOptions, Stage, Target,
};
pub use retry::{FailureCause, replan, replan_within};
pub use rung::{RetryRung, Tightening};
pub use search::{alternatives, plan, plan_with};
pub use target_module::TargetModule;
pub use timing::StepTime;
pub use training::{Optimizer, Precision, Settings};
