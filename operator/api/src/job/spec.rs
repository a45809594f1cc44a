//! The spec: what the user asks for.

use std::collections::BTreeMap;

use headroom_planner::{Backend, Optimizer, Precision, RetryRung};

use crate::recipe::{AdamSpec, EvaluationSpec, ScheduleSpec};
use k8s_openapi::api::core::v1::{Affinity, Toleration};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::sources::{DataSpec, OutputSpec, PretrainedModel};
use super::status::MemoryAwareTrainingJobStatus;

/// A training job that Headroom plans, places and retries so it fits in memory.
#[derive(CustomResource, Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "headroom.dev",
    version = "v1alpha1",
    kind = "MemoryAwareTrainingJob",
    plural = "memoryawaretrainingjobs",
    singular = "memoryawaretrainingjob",
    namespaced,
    status = "MemoryAwareTrainingJobStatus",
    shortname = "matj",
    category = "headroom",
    doc = "A training job that Headroom plans, places and retries so that it fits in memory",
    printcolumn(name = "Phase", type_ = "string", json_path = ".status.phase"),
    printcolumn(name = "Attempt", type_ = "integer", json_path = ".status.attempt"),
    printcolumn(
        name = "Step",
        type_ = "string",
        json_path = ".status.progress.stepOfTotal",
        description = "optimizer steps done of the run's total"
    ),
    printcolumn(
        name = "Loss",
        type_ = "number",
        json_path = ".status.progress.trainLoss",
        description = "training loss of the last step reported"
    ),
    printcolumn(
        name = "ETA",
        type_ = "string",
        json_path = ".status.progress.eta",
        description = "estimated time left at the measured pace"
    ),
    printcolumn(name = "Device", type_ = "string", json_path = ".status.plan.device"),
    printcolumn(
        name = "Workers",
        type_ = "integer",
        json_path = ".status.plan.workers"
    ),
    printcolumn(
        name = "Peak/Budget",
        type_ = "string",
        json_path = ".status.plan.fit",
        description = "predicted peak per worker against its budget"
    ),
    printcolumn(
        name = "Age",
        type_ = "date",
        json_path = ".metadata.creationTimestamp"
    )
)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.worker.backend) || (self.worker.backend == 'cuda') == has(self.resources.gpu)",
     "message": "worker.backend must be 'cuda' for a GPU job (resources.gpu) and 'flex' for a CPU job (resources.cpu)"},
    {"rule": "!has(self.resources.cpu) || self.training.precision == 'fp32'",
     "message": "training.precision: the CPU backend (flex) trains in fp32 only; set precision: fp32 or use resources.gpu"},
    {"rule": "!has(self.model.generic) || !has(self.resources.cpu) || self.resources.cpu.maxWorkers == 1",
     "message": "resources.cpu.maxWorkers: a generic model cannot be split into pipeline stages; use 1"},
    {"rule": "!has(self.model.generic)",
     "message": "model.generic is for planning only (kubectl headroom plan -f job.yaml); a job Headroom runs needs model.pretrained (a Hugging Face checkpoint) or model.transformer (layers, hidden, heads, sequenceLength, vocabulary)"},
    {"rule": "has(self.model.pretrained) == has(self.data)",
     "message": "data: a model.pretrained job needs its training text (data.volume.claimName, data.volume.path), and only such a job takes one"},
    {"rule": "!has(self.training.epochs) || has(self.data)",
     "message": "training.epochs: an epoch is a pass over spec.data, and this job has none (the synthetic task never ends); set training.steps instead"},
    {"rule": "!has(self.output) || has(self.model.pretrained)",
     "message": "output: only a model.pretrained job writes a fine-tuned model"},
    {"rule": "!has(self.training.method) || self.training.method == 'full' || has(self.model.pretrained)",
     "message": "training.method: lora and qlora adapt a pretrained checkpoint; set model.pretrained, or use method: full"},
    {"rule": "!has(self.training.pipelineStages) || !has(self.model.transformer) || self.training.pipelineStages <= self.model.transformer.layers",
     "message": "training.pipelineStages: at most model.transformer.layers (each stage holds at least one block); pin fewer stages"},
    {"rule": "(has(self.training.pipelineStages) ? self.training.pipelineStages : 1) * (has(self.training.dataParallelReplicas) ? self.training.dataParallelReplicas : 1) <= (has(self.resources.gpu) ? self.resources.gpu.maxGpus : (has(self.resources.cpu) ? self.resources.cpu.maxWorkers : 1048576))",
     "message": "training: pipelineStages × dataParallelReplicas workers, at most resources.gpu.maxGpus (GPU jobs) or resources.cpu.maxWorkers (CPU jobs); raise it or pin fewer"}
]))]
pub struct MemoryAwareTrainingJobSpec {
    /// The model to train: `transformer` (shape) or `generic` (parameter count).
    pub model: ModelSpec,
    /// How to train: global batch, steps, optimizer, precision, learning rate, seed
    /// and optional pins for the first attempt.
    pub training: TrainingSpec,
    /// Where to run: `gpu` (GPU types and count) or `cpu` (memory limit and workers),
    /// and the share of each device's memory to keep free.
    pub resources: ResourcesSpec,
    #[serde(default)]
    pub memory_policy: MemoryPolicy,
    /// The worker pods' image and pod settings; all optional.
    #[serde(default)]
    pub worker: WorkerSpec,
    /// The job's checkpoint volume (PVC `<job>-checkpoints`): what happens to it
    /// when the job is deleted.
    #[serde(default)]
    pub checkpoints: CheckpointsSpec,
    /// How long the job may wait for capacity on a busy cluster.
    #[serde(default)]
    pub scheduling: SchedulingSpec,
    /// The text to fine-tune on (with `model.pretrained`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<DataSpec>,
    /// Where the fine-tuned model is written (with `model.pretrained`);
    /// default: `output/` on the job's checkpoint claim, kept on success.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<OutputSpec>,
    /// No worker pods while true (as batch/v1 Job's `suspend`): a running
    /// attempt's workers are stopped (they checkpoint on SIGTERM) and the
    /// job says `Suspended=True`; set it false to go on from the last
    /// checkpoint, with no attempt used up. Default false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub suspend: bool,
    /// Seconds the job's attempts may run in all (from each attempt's
    /// start to its end, so not the backoffs, waits for capacity or
    /// suspensions between them) before the job fails
    /// (`DeadlineExceeded`), its workers stopped; unset: no limit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub active_deadline_seconds: Option<u64>,
    /// Seconds after the job Succeeded or Failed that the operator deletes
    /// the job object (as batch/v1 Job's); unset: kept until deleted. The
    /// checkpoint claim goes with it or stays as `checkpoints.retention`
    /// says (a kept claim was released when the job ended).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 31536000))]
    pub ttl_seconds_after_finished: Option<u32>,
}

impl MemoryAwareTrainingJobSpec {
    /// The backend this job's workers run on.
    pub fn backend(&self) -> Backend {
        self.worker
            .backend
            .unwrap_or(if self.resources.gpu.is_some() {
                Backend::Cuda
            } else {
                Backend::Flex
            })
    }
}

/// Waiting for capacity. A job that fits the cluster but not what is free now
/// (or whose pods the scheduler cannot place yet) waits, with the condition
/// `Waiting=True/WaitingForCapacity` saying for what; it never fails because
/// the cluster is busy, unless a deadline is set here.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SchedulingSpec {
    /// Seconds the job may wait for capacity at a time before it fails
    /// (`WaitedTooLong`); unset: it waits as long as it takes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_wait_seconds: Option<u64>,
}

/// Exactly one of `pretrained`, `transformer` or `generic`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "(has(self.transformer) ? 1 : 0) + (has(self.generic) ? 1 : 0) + (has(self.pretrained) ? 1 : 0) == 1",
     "message": "set exactly one of model.pretrained (a Hugging Face checkpoint to fine-tune), model.transformer (layers, hidden, heads, sequenceLength, vocabulary) or model.generic (parameters, activationBytesPerSample)"}
]))]
pub struct ModelSpec {
    /// A Llama-family checkpoint in Hugging Face format (Llama, Mistral,
    /// Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3 text) to fine-tune; an initializer
    /// pod reads its shape first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pretrained: Option<PretrainedModel>,
    /// A synthetic GPT-style model trained from random weights (benchmarks, tests).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transformer: Option<headroom_planner::TransformerShape>,
    /// Any model by parameter count: for planning only (`kubectl headroom plan`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generic: Option<headroom_planner::GenericModel>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.microBatch) || self.globalBatch % self.microBatch == 0",
     "message": "training.microBatch must divide training.globalBatch so the global batch is kept exactly (e.g. globalBatch 32 with microBatch 8)"},
    {"rule": "!has(self.dataParallelReplicas) || self.globalBatch % self.dataParallelReplicas == 0",
     "message": "training.dataParallelReplicas must divide training.globalBatch so every replica trains an equal share (e.g. globalBatch 32 with 4 replicas)"},
    {"rule": "!has(self.dataParallelReplicas) || !has(self.microBatch) || (self.globalBatch / self.dataParallelReplicas) % self.microBatch == 0",
     "message": "training.microBatch must divide each replica's share of training.globalBatch (globalBatch / dataParallelReplicas)"},
    {"rule": "has(self.steps) != has(self.epochs)",
     "message": "training: give the run's length as steps (optimizer steps) or as epochs (passes over spec.data), exactly one of them"},
    {"rule": "!has(self.epochs) || self.epochs > 0.0",
     "message": "training.epochs: must be above 0 (e.g. 3, or 0.5 for half the data)"},
    {"rule": "!has(self.schedule) || !has(self.schedule.minLearningRate) || self.schedule.minLearningRate <= self.learningRate",
     "message": "training.schedule.minLearningRate: above training.learningRate, the peak; the decay ends at the minimum, so set it below the peak (e.g. a tenth of it)"},
    {"rule": "!has(self.lora) || self.method != 'full'",
     "message": "training.lora: adapters are for method lora or qlora; set training.method: lora (or qlora), or remove training.lora"},
    {"rule": "!has(self.lora) || self.method != 'qlora' || (has(self.lora.baseFormat) && self.lora.baseFormat != 'nf4') || !has(self.lora.blockSize) || self.lora.blockSize == 64",
     "message": "training.lora.blockSize: nf4 (qlora's default base) is stored as bitsandbytes stores QLoRA's base, in blocks of 64 values; remove blockSize (or set 64), or set baseFormat: int4 or int8 to keep this block size"},
    {"rule": "!has(self.lora) || !has(self.lora.baseFormat) || self.method == 'qlora'",
     "message": "training.lora.baseFormat: only a qlora job quantizes its base (lora keeps it dense); set training.method: qlora, or remove baseFormat"}
]))]
pub struct TrainingSpec {
    /// Samples per optimizer step; every attempt keeps it exactly (micro-batch × accumulation).
    #[schemars(range(min = 1, max = 1048576))]
    pub global_batch: u32,
    /// Optimizer steps to train; or give `epochs`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000000000))]
    pub steps: Option<u64>,
    /// Passes over the data (`spec.data`'s packed samples), instead of
    /// `steps`: the run is `ceil(epochs × samples / globalBatch)` steps,
    /// fixed when the data is first inspected (`status.recipe.totalSteps`).
    /// Fractions are allowed (Hugging Face's `num_train_epochs`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1000000.0))]
    pub epochs: Option<f64>,
    #[serde(default = "default_optimizer")]
    pub optimizer: Optimizer,
    /// Preferred precision; a retry may lower it when the policy allows `lowerPrecision`.
    #[serde(default = "default_precision")]
    pub precision: Precision,
    /// Pin the micro-batch for the first attempt (must divide globalBatch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1048576))]
    pub micro_batch: Option<u32>,
    /// Pin activation checkpointing for the first attempt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_checkpointing: Option<bool>,
    /// Pin the number of pipeline stages (worker pods) for the first
    /// attempt; the morePipelineStages retry rung may add stages up to
    /// resources.cpu.maxWorkers / resources.gpu.maxGpus.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 64))]
    pub pipeline_stages: Option<u32>,
    /// Pin the number of data-parallel replicas of each stage for the first
    /// attempt (must divide globalBatch: each replica trains an equal share
    /// and gradients are averaged every step; each keeps the optimizer state
    /// of its share of the parameters). Stages × replicas workers in all, at
    /// most resources.cpu.maxWorkers / resources.gpu.maxGpus.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1024))]
    pub data_parallel_replicas: Option<u32>,
    /// Peak learning rate of the optimizer, e.g. 0.0003.
    #[serde(default = "default_learning_rate")]
    #[schemars(range(min = 0.0, max = 10.0))]
    pub learning_rate: f64,
    /// The learning rate over the run: warmup, then `linear` (default),
    /// `cosine` or `constant`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub schedule: Option<ScheduleSpec>,
    /// Decoupled weight decay (AdamW's) on every trained matrix, never on
    /// biases and norm weights, as the Hugging Face Trainer applies it;
    /// default 0.
    #[serde(default)]
    #[schemars(range(min = 0.0, max = 10.0))]
    pub weight_decay: f64,
    /// Adam's and AdamW's betas and epsilon (default 0.9, 0.999, 1e-8).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adam: Option<AdamSpec>,
    /// Clip the gradients' global norm (the whole model's, over every
    /// pipeline stage and replica) to this before each update; 0 turns
    /// clipping off. Default 1.0, as the Hugging Face Trainer.
    #[serde(default = "default_max_grad_norm")]
    #[schemars(range(min = 0.0, max = 1000000.0))]
    pub max_grad_norm: f64,
    /// Evaluate on a held-out share of the data every `everySteps` steps
    /// and at the end (none when omitted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub evaluation: Option<EvaluationSpec>,
    /// Save a checkpoint every this many optimizer steps.
    #[serde(default = "default_checkpoint_every")]
    #[schemars(range(min = 1, max = 1000000))]
    pub checkpoint_every_steps: u32,
    /// Seed of the model's initialisation and the data order; the same seed gives the
    /// same run.
    #[serde(default)]
    pub seed: u64,
    /// What is trained: `full` (every parameter), `lora` (adapters on a
    /// frozen base) or `qlora` (adapters on a quantized frozen base). A retry
    /// never switches between full fine-tuning and LoRA: the two give
    /// different things.
    #[serde(default)]
    pub method: TrainingMethod,
    /// The adapters of a `lora` or `qlora` job, as PEFT's LoraConfig names
    /// them; defaults when omitted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lora: Option<LoraSpec>,
}

/// What a job trains.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum TrainingMethod {
    /// Every parameter.
    #[default]
    Full,
    /// LoRA adapters on a dense frozen base.
    Lora,
    /// LoRA adapters on a frozen base quantized to `lora.baseFormat`.
    Qlora,
}

/// LoRA adapters (PEFT / Kubeflow Trainer `LoraConfig`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "self.dropout < 1.0",
     "message": "training.lora.dropout: must be below 1 (PEFT's lora_dropout: the probability of zeroing each value of an adapter's input); e.g. 0.05 or 0.1, or 0 for none"}
]))]
pub struct LoraSpec {
    /// Rank r of the low-rank update (PEFT `r`).
    #[serde(default = "default_lora_rank")]
    #[schemars(range(min = 1, max = 4096))]
    pub rank: u32,
    /// The update is scaled by alpha / rank (PEFT `lora_alpha`).
    #[serde(default = "default_lora_alpha")]
    #[schemars(range(min = 0.0, max = 1000000.0))]
    pub alpha: f64,
    /// Dropout on the adapter's input (PEFT `lora_dropout`): each value of
    /// the input of `(x·A)·B` is zeroed with this probability in training
    /// (the frozen base's input is not), at least 0 and below 1.
    #[serde(default)]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub dropout: f64,
    /// Modules that get adapters: q_proj, k_proj, v_proj, o_proj,
    /// gate_proj, up_proj, down_proj, lm_head (PEFT's default for Llama:
    /// q_proj and v_proj); for Phi-3 (fused projections): qkv_proj,
    /// o_proj, gate_up_proj, down_proj, lm_head.
    #[serde(default = "default_lora_targets")]
    #[schemars(length(min = 1, max = 8))]
    #[schemars(extend("x-kubernetes-list-type" = "set"))]
    pub target_modules: Vec<headroom_planner::TargetModule>,
    /// QLoRA only: how the frozen base is stored on the first attempt:
    /// `nf4` (the default: bitsandbytes' 4-bit NormalFloat with
    /// double-quantized scales, ≈ 4.13 bits a value, as PEFT's QLoRA
    /// stores it), `int4` or `int8` (one f32 scale per blockSize values).
    /// The quantizeBase rung may go further down (dense → int8 → nf4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_format: Option<QuantizedFormat>,
    /// QLoRA with int8/int4: values per quantization block (one scale
    /// each); at most 255, and it must divide the output size of every
    /// block linear. nf4 takes bitsandbytes' blocks of 64 only.
    #[serde(default = "headroom_planner::adapters::default_block_size")]
    #[schemars(range(min = 1, max = 255))]
    pub block_size: u32,
}

/// A quantized base format a QLoRA job may start from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum QuantizedFormat {
    Int8,
    Int4,
    Nf4,
}

impl From<QuantizedFormat> for headroom_planner::BaseFormat {
    fn from(f: QuantizedFormat) -> Self {
        match f {
            QuantizedFormat::Int8 => headroom_planner::BaseFormat::Int8,
            QuantizedFormat::Int4 => headroom_planner::BaseFormat::Int4,
            QuantizedFormat::Nf4 => headroom_planner::BaseFormat::Nf4,
        }
    }
}

fn default_lora_rank() -> u32 {
    8
}

fn default_lora_alpha() -> f64 {
    16.0
}

pub(super) fn default_lora_targets() -> Vec<headroom_planner::TargetModule> {
    vec![
        headroom_planner::TargetModule::QProj,
        headroom_planner::TargetModule::VProj,
    ]
}

impl Default for LoraSpec {
    fn default() -> Self {
        LoraSpec {
            rank: default_lora_rank(),
            alpha: default_lora_alpha(),
            dropout: 0.0,
            target_modules: default_lora_targets(),
            base_format: None,
            block_size: headroom_planner::adapters::default_block_size(),
        }
    }
}

impl LoraSpec {
    /// The planner's and the worker's view.
    pub fn config(&self) -> headroom_planner::LoraConfig {
        headroom_planner::LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            target_modules: self.target_modules.clone(),
            block_size: self.block_size,
        }
    }
}

/// Exactly one of `gpu` or `cpu`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.gpu) != has(self.cpu)",
     "message": "set exactly one of resources.gpu (types, maxGpus) for a GPU job or resources.cpu (memoryLimit, maxWorkers) for a CPU job"}
]))]
pub struct ResourcesSpec {
    /// A GPU job: which GPU products it may use and how many at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpu: Option<GpuResources>,
    /// A CPU job: the memory limit (the budget) and cores of each worker, and how
    /// many workers at most.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu: Option<CpuResources>,
    /// Fraction of each device's usable memory to keep free.
    #[serde(default = "default_headroom")]
    #[schemars(range(min = 0.0, max = 0.9))]
    pub headroom_fraction: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.hostMemory) || (isQuantity(string(self.hostMemory)) && quantity(string(self.hostMemory)).compareTo(quantity('64Mi')) >= 0)",
     "message": "resources.gpu.hostMemory must be a quantity of at least 64Mi, e.g. 32Gi"},
    {"rule": "!has(self.cores) || (isQuantity(string(self.cores)) && quantity(string(self.cores)).isGreaterThan(quantity('0')))",
     "message": "resources.gpu.cores must be a CPU quantity above zero, e.g. 1, 8 or 500m"}
]))]
pub struct GpuResources {
    /// Allowed GPU products as GPU Feature Discovery labels them
    /// (`nvidia.com/gpu.product`, e.g. `NVIDIA-A100-SXM4-80GB`); empty allows any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 32),
        inner(length(max = 63)),
        extend("x-kubernetes-list-type" = "set")
    )]
    pub types: Vec<String>,
    /// Most GPUs the job may use at once (pipeline stages × data-parallel replicas).
    #[serde(default = "default_one")]
    #[schemars(range(min = 1, max = 1024))]
    pub max_gpus: u32,
    /// What the planner ranks fitting plans by: `fastest` (the default: the
    /// lowest estimated time per optimizer step within maxGpus and the free
    /// GPUs, so idle GPUs become data-parallel replicas or stages when that
    /// is faster) or `fewestGpus` (the fewest GPUs that fit, then the fastest).
    #[serde(default)]
    pub objective: headroom_planner::Objective,
    /// Host memory limit per worker pod, a quantity of at least 64Mi such as
    /// 32Gi (defaults to the operator's setting).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_schema")]
    pub host_memory: Option<Quantity>,
    /// CPU request of each worker pod, a quantity above zero such as 8 or
    /// 500m (defaults to 1): what the worker's host side (data loading,
    /// tokenizing, checkpoint writes) gets for feeding its GPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_schema")]
    pub cores: Option<Quantity>,
}

/// A Kubernetes quantity: an integer or a string (`2`, `500m`, `4Gi`). Its
/// syntax and range are checked by the CEL rule of the struct that holds it,
/// with a message naming the field and an example. Bounded in length so
/// those rules stay within the API server's cost budget.
fn quantity_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "maxLength": 64,
        "x-kubernetes-int-or-string": true
    })
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "isQuantity(string(self.memoryLimit)) && quantity(string(self.memoryLimit)).compareTo(quantity('64Mi')) >= 0",
     "message": "resources.cpu.memoryLimit must be a quantity of at least 64Mi, e.g. 2Gi"},
    {"rule": "!has(self.cores) || (isQuantity(string(self.cores)) && quantity(string(self.cores)).isGreaterThan(quantity('0')))",
     "message": "resources.cpu.cores must be a CPU quantity above zero, e.g. 1, 2 or 500m"}
]))]
pub struct CpuResources {
    /// Memory limit of each worker container: the CPU job's device budget
    /// (a quantity of at least 64Mi, e.g. 2Gi).
    #[schemars(schema_with = "quantity_schema")]
    pub memory_limit: Quantity,
    /// CPU request per worker, a quantity above zero such as 2 or 500m
    /// (defaults to 1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_schema")]
    pub cores: Option<Quantity>,
    /// Most workers (pipeline stages) the job may use.
    #[serde(default = "default_one")]
    #[schemars(range(min = 1, max = 64))]
    pub max_workers: u32,
}

/// How Headroom may react when memory runs out.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryPolicy {
    /// Retry rungs allowed, applied in Headroom's fixed order
    /// (offloadEmbedding, activationCheckpointing, halveMicroBatch,
    /// lowerPrecision, cheaperOptimizer, quantizeBase, offloadOptimizer,
    /// offloadGradients, offloadActivations, shardOptimizerState,
    /// morePipelineStages, largerGpu); all of them by default. A rung that
    /// does not apply to a job (the offload rungs on a CPU worker,
    /// offloadEmbedding or quantizeBase on a full fine-tune) is skipped;
    /// when no rung helps, the job's failure lists why each one did not.
    #[serde(default = "default_rungs")]
    #[schemars(length(max = 12), extend("x-kubernetes-list-type" = "set"))]
    pub allowed_rungs: Vec<RetryRung>,
    /// Attempts in total, the first included.
    #[serde(default = "default_max_attempts")]
    #[schemars(range(min = 1, max = 20))]
    pub max_attempts: u32,
    /// First backoff before retrying a non-memory failure; doubles each time.
    #[serde(default = "default_backoff")]
    #[schemars(range(min = 0, max = 3600))]
    pub backoff_seconds: u32,
    /// The near-OOM guard in the workers: a step that would cross the
    /// memory limit is stopped before the kernel's OOM killer (or the
    /// device's allocator) stops the worker, the last completed step is
    /// kept, and the job steps down (in place, or through a stricter
    /// attempt). On by default for CPU workers; see `enabled`.
    #[serde(default)]
    pub guard: MemoryGuardPolicy,
}

/// The workers' near-OOM guard (`memoryPolicy.guard`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryGuardPolicy {
    /// Whether the guard runs. Unset: on for CPU workers (its cgroup meter
    /// is measured on real pods), off for GPU workers (its device meter has
    /// not yet run on a GPU: set `true` to use it there). Off: a worker
    /// that outgrows its limit is killed by the kernel (or fails an
    /// allocation on its device) and the next attempt resumes from the last
    /// periodic checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enabled: Option<bool>,
    /// Memory kept free under the worker's limit, percent of the limit:
    /// the guard stops a step when what its next part is known to add
    /// would leave less than this.
    #[serde(default = "default_guard_margin_percent")]
    #[schemars(range(min = 1, max = 50))]
    pub margin_percent: u32,
    /// Whether a trip may halve the micro-batch and double the gradient
    /// accumulation inside the running worker (the global batch is
    /// unchanged; one pipeline stage and one replica, an even micro-batch,
    /// and `halveMicroBatch` among the allowed rungs). Otherwise a trip
    /// ends the attempt and the next one is planned stricter.
    #[serde(default = "default_true")]
    pub step_down_in_place: bool,
}

impl Default for MemoryGuardPolicy {
    fn default() -> Self {
        MemoryGuardPolicy {
            enabled: None,
            margin_percent: default_guard_margin_percent(),
            step_down_in_place: true,
        }
    }
}

impl Default for MemoryPolicy {
    fn default() -> Self {
        MemoryPolicy {
            allowed_rungs: default_rungs(),
            max_attempts: default_max_attempts(),
            backoff_seconds: default_backoff(),
            guard: MemoryGuardPolicy::default(),
        }
    }
}

/// The worker pods: their image, and where they may run on a shared cluster.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.env) || self.env.all(e, has(e.value) != has(e.valueFrom))",
     "message": "worker.env: each variable has a value or a valueFrom, one of the two"},
    {"rule": "!has(self.env) || self.env.all(e, !e.name.startsWith('HEADROOM_') && !(e.name in ['POD_NAME', 'MALLOC_ARENA_MAX', 'GLIBC_TUNABLES']))",
     "message": "worker.env: HEADROOM_*, POD_NAME, MALLOC_ARENA_MAX and GLIBC_TUNABLES are set by the operator (the worker's assignment, identity and allocator); pick another name"},
    {"rule": "!has(self.podLabels) || self.podLabels.all(k, !k.startsWith('headroom.dev/'))",
     "message": "worker.podLabels: the headroom.dev/ prefix is the operator's (it finds a job's pods by these labels); pick another key"},
    {"rule": "!has(self.podAnnotations) || self.podAnnotations.all(k, !k.startsWith('headroom.dev/'))",
     "message": "worker.podAnnotations: the headroom.dev/ prefix is the operator's; pick another key"},
    {"rule": "!has(self.nodeSelector) || !('nvidia.com/gpu.product' in self.nodeSelector)",
     "message": "worker.nodeSelector: Headroom chooses nvidia.com/gpu.product itself; list the allowed products in resources.gpu.types"},
    {"rule": "!has(self.tolerations) || self.tolerations.all(t, !has(t.operator) || t.operator in ['Equal', 'Exists'])",
     "message": "worker.tolerations: operator must be Equal or Exists"},
    {"rule": "!has(self.tolerations) || self.tolerations.all(t, !has(t.effect) || t.effect in ['', 'NoSchedule', 'PreferNoSchedule', 'NoExecute'])",
     "message": "worker.tolerations: effect must be NoSchedule, PreferNoSchedule, NoExecute or empty (all effects)"},
    {"rule": "!has(self.tolerations) || self.tolerations.all(t, (has(t.operator) && t.operator == 'Exists') ? (!has(t.value) || t.value == '') : (has(t.key) && t.key != ''))",
     "message": "worker.tolerations: Exists takes no value, and Equal (the default) needs a key"},
    {"rule": "!has(self.envFrom) || self.envFrom.all(e, !has(e.secretRef))",
     "message": "worker.envFrom: secretRef is not offered: a job's tokens go through tokenSecret (model.pretrained.huggingFace, data.huggingFace), which the chart's policy checks against the job author's rights; use configMapRef for settings"},
    {"rule": "!has(self.envFrom) || self.envFrom.all(e, has(e.configMapRef))",
     "message": "worker.envFrom: each entry names a ConfigMap (configMapRef.name)"},
    {"rule": "!has(self.volumes) || self.volumes.all(v, !has(v.hostPath))",
     "message": "worker.volumes: hostPath is refused (a node's own files are no job's to read or write, and the pods run under the restricted Pod Security profile, which forbids it); use a persistentVolumeClaim, a configMap or an emptyDir"},
    {"rule": "!has(self.volumes) || self.volumes.all(v, (has(v.configMap) ? 1 : 0) + (has(v.persistentVolumeClaim) ? 1 : 0) + (has(v.emptyDir) ? 1 : 0) == 1)",
     "message": "worker.volumes: each volume has one source: configMap, persistentVolumeClaim or emptyDir"},
    {"rule": "!has(self.volumes) || self.volumes.all(v, !(v.name in ['checkpoints', 'tmp', 'worker-api-token']) && !v.name.startsWith('claim-') && !v.name.startsWith('headroom-'))",
     "message": "worker.volumes: checkpoints, tmp, worker-api-token, claim-* and headroom-* are the operator's volume names; pick another name"},
    {"rule": "!has(self.volumes) || self.volumes.all(v, self.volumes.exists_one(w, w.name == v.name))",
     "message": "worker.volumes: two volumes have one name; name each once"},
    {"rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && self.volumes.exists(v, v.name == m.name))",
     "message": "worker.volumeMounts: each mount names one of worker.volumes; add the volume there, or fix the mount's name"},
    {"rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, !m.mountPath.matches('/[.][.]?(/|$)'))",
     "message": "worker.volumeMounts: mountPath has a . or .. segment; give the plain absolute path, e.g. /mnt/ca"},
    {"rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, ['/var/lib/headroom', '/var/run/secrets/headroom.dev', '/tmp', '/dev'].all(p, m.mountPath != p && !m.mountPath.startsWith(p + '/') && !p.startsWith(m.mountPath + '/')))",
     "message": "worker.volumeMounts: mountPath is on, in or above one of the operator's mounts (/var/lib/headroom: checkpoints and claims; /var/run/secrets/headroom.dev: its token; /tmp: scratch; /dev); mount elsewhere, e.g. under /mnt"},
    {"rule": "!has(self.volumeMounts) || self.volumeMounts.all(m, self.volumeMounts.exists_one(n, n.mountPath == m.mountPath))",
     "message": "worker.volumeMounts: two mounts at one mountPath; give each its own"}
]))]
pub struct WorkerSpec {
    /// Worker container image. When unset, the operator's default image for
    /// the job's backend (`backend`, or the one derived from resources: GPU
    /// jobs `cuda`, CPU jobs `flex`), which the chart sets with
    /// `workerImages.cuda` and `workerImages.cpu`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 512))]
    pub image: Option<String>,
    /// `flex` (CPU) or `cuda`; derived from resources when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<Backend>,
    /// Pull policy of the worker image; the cluster's default when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image_pull_policy: Option<PullPolicy>,
    /// Secrets in the job's namespace for pulling the image from a private
    /// registry, as a PodSpec names them (`[{name: regcred}]`). A job stored
    /// before this shape, with bare names, is read as these.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "pull_secrets"
    )]
    #[schemars(length(max = 16))]
    pub image_pull_secrets: Vec<SecretName>,
    /// Node labels every worker pod requires (a node pool, a zone). The
    /// planner counts only the GPUs of matching nodes. Not
    /// `nvidia.com/gpu.product`: that is chosen from `resources.gpu.types`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend(
        "maxProperties" = 32,
        "additionalProperties" = {"type": "string", "maxLength": 63}
    ))]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations for the worker pods (GPU jobs also get
    /// `nvidia.com/gpu:NoSchedule`). Nodes with a NoSchedule or NoExecute
    /// taint the workers do not tolerate are left out of the plan.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), schema_with = "bounded_tolerations")]
    pub tolerations: Vec<Toleration>,
    /// Node affinity, pod affinity and anti-affinity of the pods, as a
    /// PodSpec has them (spread the workers of a team's jobs, prefer a
    /// zone). Headroom's own placement is ANDed with it, never replaced: a
    /// GPU's product labels and the stages kept on one node still hold.
    /// The planner does not read it (it counts the nodes `nodeSelector`
    /// and `tolerations` admit); a required node affinity that excludes
    /// those nodes leaves the job waiting for capacity.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "bounded::<Affinity>")]
    pub affinity: Option<Affinity>,
    /// PriorityClass of the worker pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub priority_class_name: Option<String>,
    /// Environment variables of the worker and initializer containers
    /// (a proxy, `HF_HUB_*`, `SSL_CERT_FILE`): a `value`, or a key of a
    /// ConfigMap in the job's namespace (`valueFrom.configMapKeyRef`).
    /// Secrets are not offered: a job's tokens go through `tokenSecret`,
    /// which the chart's policy checks against its creator's rights.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 64))]
    pub env: Vec<WorkerEnvVar>,
    /// Variables from every key of a ConfigMap in the job's namespace
    /// (`configMapRef`, with an optional `prefix`). `env` wins over them,
    /// and the operator's own variables over both. No `secretRef`: a job's
    /// tokens go through `tokenSecret`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub env_from: Vec<WorkerEnvFrom>,
    /// Volumes of the user's own for the pods' container (a CA bundle from
    /// a ConfigMap, a claim of shared data, a scratch `emptyDir`), mounted
    /// by `volumeMounts`: `configMap`, `persistentVolumeClaim` or
    /// `emptyDir`, one each; not `hostPath`. Names are not the operator's
    /// (`checkpoints`, `tmp`, `worker-api-token`, `claim-*`, `headroom-*`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub volumes: Vec<WorkerVolume>,
    /// Where the container mounts `volumes`: not on, in or above the
    /// operator's mounts (`/var/lib/headroom`, `/var/run/secrets/headroom.dev`,
    /// `/tmp`, `/dev`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    pub volume_mounts: Vec<WorkerVolumeMount>,
    /// Labels added to the job's pods (cost centre, team), besides the
    /// operator's own `headroom.dev/` ones.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend(
        "maxProperties" = 32,
        "additionalProperties" = {"type": "string", "maxLength": 63}
    ))]
    pub pod_labels: BTreeMap<String, String>,
    /// Annotations added to the job's pods (e.g. a service mesh's opt-out).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend(
        "maxProperties" = 32,
        "additionalProperties" = {"type": "string", "maxLength": 4096}
    ))]
    pub pod_annotations: BTreeMap<String, String>,
    /// RuntimeClass of the pods (e.g. `nvidia` where the GPU runtime is
    /// not the node's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub runtime_class_name: Option<String>,
    /// Seconds a worker has after SIGTERM (an eviction, a preemption) to
    /// write its checkpoint before it is killed. Default: derived from the
    /// plan, the time to write a worker's checkpoint at 100 MB/s plus
    /// 30 s, at least 30 s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400))]
    pub termination_grace_period_seconds: Option<u32>,
    /// The ServiceAccount in the job's namespace the pods run as (one a
    /// cloud identity is bound to: IRSA, GKE or Azure Workload Identity);
    /// default: the namespace's `default`. Its Kubernetes API token is
    /// never mounted: the workers and the initializer do not call the
    /// Kubernetes API (they reach the operator with a token of their own),
    /// and the identity webhooks project their own token.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 253),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
    )]
    pub service_account_name: Option<String>,
}

/// A Secret in the job's namespace, by name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]

pub struct SecretName {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

/// `imagePullSecrets` as PodSpec has it, or as bare names (the shape of
/// jobs stored before it): both read as [`SecretName`]s.
fn pull_secrets<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<SecretName>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Either {
        Named(SecretName),
        Bare(String),
    }
    Ok(Vec::<Either>::deserialize(d)?
        .into_iter()
        .map(|e| match e {
            Either::Named(n) => n,
            Either::Bare(name) => SecretName { name },
        })
        .collect())
}

/// One environment variable of the job's containers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerEnvVar {
    /// The variable's name (not the operator's: `HEADROOM_*`, `POD_NAME`,
    /// `MALLOC_ARENA_MAX`, `GLIBC_TUNABLES`).
    #[schemars(
        length(min = 1, max = 128),
        regex(pattern = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    )]
    pub name: String,
    /// Its value; or `valueFrom`, one of the two.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 8192))]
    pub value: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value_from: Option<EnvValueFrom>,
}

/// Where a variable's value comes from.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EnvValueFrom {
    pub config_map_key_ref: ConfigMapKey,
}

/// A key of a ConfigMap in the job's namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapKey {
    /// The ConfigMap's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The key whose value the variable takes.
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
    /// Start the pod even if the ConfigMap or key is missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
}

/// Variables from a ConfigMap's keys.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerEnvFrom {
    /// The ConfigMap in the job's namespace whose every key becomes a variable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map_ref: Option<ConfigMapName>,
    /// Not offered (refused): a job's tokens go through `tokenSecret`,
    /// which the chart's policy checks against the job author's rights.
    /// Declared so that the refusal can say so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretName>,
    /// Put before every key's name (`HUB_`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 128))]
    pub prefix: Option<String>,
}

/// A ConfigMap in the job's namespace, by name.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapName {
    /// The ConfigMap's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Start the pod even if the ConfigMap is missing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optional: Option<bool>,
}

/// One of the user's volumes: exactly one source.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerVolume {
    /// The volume's name, which `volumeMounts` use (a DNS label).
    #[schemars(
        length(min = 1, max = 63),
        regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    )]
    pub name: String,
    /// A ConfigMap's keys as files (a CA bundle).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ConfigMapName>,
    /// A claim in the job's namespace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub persistent_volume_claim: Option<ClaimSource>,
    /// A scratch directory that lives as long as the pod.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub empty_dir: Option<EmptyDirSource>,
    /// Refused: a node's own files are no job's to read or write, and the
    /// pods run under the restricted Pod Security profile. Declared so that
    /// the refusal can say so.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_path: Option<HostPathSource>,
}

/// A PersistentVolumeClaim as a volume.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ClaimSource {
    /// The claim's name.
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: String,
    /// Mount it read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
}

/// An emptyDir volume.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct EmptyDirSource {
    /// `Memory` for a tmpfs (counted in the container's memory, which the
    /// plan does not include), or empty for the node's disk.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^(Memory)?$"), length(max = 6))]
    pub medium: Option<String>,
    /// Most the volume may hold (`1Gi`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "quantity_schema")]
    pub size_limit: Option<Quantity>,
}

/// A hostPath volume, refused (see [`WorkerVolume::host_path`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct HostPathSource {
    /// The node's path.
    #[schemars(length(max = 4096))]
    pub path: String,
    /// Its type.
    #[serde(default, skip_serializing_if = "Option::is_none", rename = "type")]
    #[schemars(length(max = 32))]
    pub type_: Option<String>,
}

/// Where the container mounts one of the user's volumes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerVolumeMount {
    /// The volume's name in `volumes`.
    #[schemars(length(min = 1, max = 63))]
    pub name: String,
    /// An absolute path in the container (`/mnt/ca`).
    #[schemars(length(min = 2, max = 1024), regex(pattern = r"^(/[^/]+)+$"))]
    pub mount_path: String,
    /// Mount it read-only.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_only: Option<bool>,
}

/// The operator's own volume names and mount paths, which the user's
/// `volumes` and `volumeMounts` keep clear of (the CEL rules on
/// [`WorkerSpec`] list the same).
pub const RESERVED_VOLUME_NAMES: [&str; 3] = ["checkpoints", "tmp", "worker-api-token"];
/// Prefixes of the operator's volume names (its claims' `claim-<i>`, and
/// room for more).
pub const RESERVED_VOLUME_PREFIXES: [&str; 2] = ["claim-", "headroom-"];
/// The operator's mounts; a user's mount may be on, in or above none.
pub const RESERVED_MOUNT_PATHS: [&str; 4] = [
    "/var/lib/headroom",
    "/var/run/secrets/headroom.dev",
    "/tmp",
    "/dev",
];

/// Kubernetes' toleration schema with the lengths Kubernetes itself allows
/// (a taint's key is a qualified name, its value a label value), so that no
/// string of a job's spec is unbounded: the operator caches jobs, and a
/// bound here keeps one job from costing it more than a few kilobytes.
fn bounded_tolerations(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    let mut schema = generator.subschema_for::<Vec<Toleration>>();
    if let Some(properties) = schema
        .get_mut("items")
        .and_then(serde_json::Value::as_object_mut)
        .and_then(|items| items.get_mut("properties"))
        .and_then(serde_json::Value::as_object_mut)
    {
        for (field, max) in [("key", 317), ("operator", 8), ("value", 63), ("effect", 16)] {
            if let Some(property) = properties
                .get_mut(field)
                .and_then(serde_json::Value::as_object_mut)
            {
                property.insert("maxLength".into(), max.into());
            }
        }
    }
    schema
}

/// `T`'s schema (one of Kubernetes' own types, which bound nothing) with a
/// bound on every string, list and map that has none, for the reason
/// [`bounded_tolerations`] gives: strings to a qualified name's 317
/// characters, lists and maps to 32 entries.
fn bounded<T: JsonSchema>(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
    fn bound(node: &mut serde_json::Value) {
        let Some(object) = node.as_object_mut() else {
            return;
        };
        let (limit, value) = match object.get("type").and_then(serde_json::Value::as_str) {
            Some("string") if !object.contains_key("enum") => ("maxLength", 317),
            Some("array") => ("maxItems", 32),
            Some("object")
                if object
                    .get("additionalProperties")
                    .is_some_and(serde_json::Value::is_object) =>
            {
                ("maxProperties", 32)
            }
            _ => ("", 0),
        };
        if !limit.is_empty() && !object.contains_key(limit) {
            object.insert(limit.into(), value.into());
        }
        for key in ["items", "additionalProperties"] {
            if let Some(child) = object.get_mut(key) {
                bound(child);
            }
        }
        if let Some(properties) = object
            .get_mut("properties")
            .and_then(serde_json::Value::as_object_mut)
        {
            properties.values_mut().for_each(bound);
        }
    }
    let mut value = generator.subschema_for::<T>().to_value();
    bound(&mut value);
    schemars::Schema::try_from(value).unwrap_or_else(|_| generator.subschema_for::<T>())
}

/// The job's checkpoint volume: every attempt resumes from it, and a
/// finished job's last checkpoint there is its trained result.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct CheckpointsSpec {
    /// Whether the volume outlives the job: `RetainOnSuccess` (default) keeps
    /// it once the job has succeeded, `Retain` always, `Delete` never.
    #[serde(default)]
    pub retention: ClaimRetention,
    /// The size of the job's checkpoint claim (`40Gi`), which holds a hub
    /// model and dataset as downloaded, two checkpoints and the output;
    /// default: the chart's `checkpoints.size`. Fixed once the claim is made.
    /// The initializer refuses a download that would not fit, naming both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        length(min = 1, max = 32),
        regex(pattern = r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)?$"),
        extend("x-kubernetes-validations" = [
            {"rule": "self == oldSelf",
             "message": "checkpoints.size is fixed once the job's claim is made; create a new job for another size"}
        ])
    )]
    pub size: Option<String>,
}

/// Whether a job's checkpoint claim outlives the job. A kept claim is no
/// longer owned by the job (so deleting the job leaves it) and is labelled
/// `headroom.dev/retained-from=<job>`; delete it with kubectl when done.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum ClaimRetention {
    /// Kept once the job succeeds (its checkpoints are the trained result);
    /// deleted with a job that never succeeded.
    #[default]
    RetainOnSuccess,
    /// Always kept, whatever the job's end.
    Retain,
    /// Deleted with the job, always.
    Delete,
}

impl ClaimRetention {
    /// Whether a job that ended with `succeeded` keeps its claim.
    pub fn keeps(self, succeeded: bool) -> bool {
        match self {
            ClaimRetention::RetainOnSuccess => succeeded,
            ClaimRetention::Retain => true,
            ClaimRetention::Delete => false,
        }
    }
}

/// When the kubelet pulls the worker image.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum PullPolicy {
    /// On every pod start.
    Always,
    /// Only when the node does not have it.
    IfNotPresent,
    /// Never: the image must be on the node.
    Never,
}

impl PullPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            PullPolicy::Always => "Always",
            PullPolicy::IfNotPresent => "IfNotPresent",
            PullPolicy::Never => "Never",
        }
    }
}

fn default_optimizer() -> Optimizer {
    Optimizer::Adamw
}
fn default_precision() -> Precision {
    Precision::Fp32
}
fn default_learning_rate() -> f64 {
    3e-4
}
fn default_max_grad_norm() -> f64 {
    1.0
}
fn default_checkpoint_every() -> u32 {
    50
}
fn default_headroom() -> f64 {
    0.1
}
fn default_one() -> u32 {
    1
}
fn default_rungs() -> Vec<RetryRung> {
    RetryRung::DEFAULT.to_vec()
}
fn default_max_attempts() -> u32 {
    4
}
fn default_backoff() -> u32 {
    10
}
fn default_guard_margin_percent() -> u32 {
    3
}
fn default_true() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_policy_offers_only_rungs_a_worker_can_run() {
        let policy = MemoryPolicy::default();
        assert_eq!(policy.allowed_rungs, RetryRung::DEFAULT.to_vec());
        assert!(policy.allowed_rungs.iter().all(|r| r.runnable()));
    }
}
