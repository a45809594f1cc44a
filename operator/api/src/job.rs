//! The `MemoryAwareTrainingJob` resource: what the user asks for (spec) and
//! what Headroom knows and did (status).
//!
//! Invalid specs are rejected by the API server itself: bounds in the schema,
//! cross-field rules as CEL `x-kubernetes-validations` whose messages name the
//! field and say what would work. [`MemoryAwareTrainingJobSpec::job_request`]
//! repeats those checks for offline use (`kubectl headroom plan -f`).

use std::collections::BTreeMap;

use headroom_planner::{
    Backend, JobRequest, ModelShape, Optimizer, Plan, Precision, RetryRung, Settings, Target,
};
use k8s_openapi::api::core::v1::Toleration;
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::quantity::{parse_bytes, parse_cores};

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

/// Where a checkpoint to fine-tune is, and how long its training samples are.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.huggingFace) != has(self.volume)",
     "message": "model.pretrained: set exactly one of huggingFace (repo, revision) or volume (claimName, path)"},
    {"rule": "self == oldSelf",
     "message": "model.pretrained is immutable: the initializer has read this checkpoint and the job is planned from it; create a new job for another checkpoint"}
]))]
pub struct PretrainedModel {
    /// A Hugging Face repository, downloaded into the job's checkpoint volume
    /// (once: retries and later attempts reuse it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceSource>,
    /// A directory on a PersistentVolumeClaim holding config.json,
    /// `*.safetensors` (or shards and model.safetensors.index.json) and tokenizer.json.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumePath>,
    /// Tokens per training sample.
    #[schemars(range(min = 1, max = 131072))]
    pub sequence_length: u32,
}

/// A Hugging Face model repository.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.endpoint) || self.endpoint.startsWith('https://') || (has(self.allowInsecureHttp) && self.allowInsecureHttp)",
     "fieldPath": ".endpoint",
     "reason": "FieldValueForbidden",
     "message": "model.pretrained.huggingFace.endpoint: must start with https:// (the token of tokenSecret is sent there); for a plain-HTTP mirror on a network you trust, also set allowInsecureHttp: true"}
]))]
pub struct HuggingFaceSource {
    /// `owner/name`, e.g. `meta-llama/Llama-3.2-1B`.
    #[schemars(
        length(min = 3, max = 200),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
    )]
    pub repo: String,
    /// A branch, tag or commit.
    #[serde(default = "default_revision")]
    #[schemars(length(min = 1, max = 200))]
    pub revision: String,
    /// The hub or a mirror, as `HF_ENDPOINT` (default `https://huggingface.co`).
    /// Must be `https://`: the token of `tokenSecret` is sent here. A plain
    /// `http://` mirror needs `allowInsecureHttp: true` as well.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 500), regex(pattern = r"^https?://[^\s]+$"))]
    pub endpoint: Option<String>,
    /// Accept a plain `http://` `endpoint` (a mirror on a network you trust):
    /// the token of `tokenSecret`, if any, and the files then travel
    /// unencrypted and unauthenticated. Default false: `endpoint` must be
    /// `https://`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_insecure_http: Option<bool>,
    /// A key of a Secret in the job's namespace holding the Hugging Face
    /// token, for gated or private repositories.
    /// Only a user who may `get` that Secret may name it: the chart's
    /// admission policy (`secretAccessPolicy`) refuses a job whose creator
    /// may not read it. The token is mounted, read-only, as a file into the
    /// job's initializer pod alone (never into its workers, never as an
    /// environment variable) and sent only to `endpoint`, as an
    /// `Authorization: Bearer` header (a redirect keeps it only on the same
    /// host over https; a CDN's signed URL gets none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret: Option<SecretKey>,
}

/// What the CEL rule on a hub source's `endpoint` says (after the field's
/// name) when it is plain HTTP without the opt-in.
fn insecure_endpoint_problem() -> &'static str {
    "must start with https:// (the token of tokenSecret is sent there); for a plain-HTTP mirror on a network you trust, also set allowInsecureHttp: true"
}

/// The CEL rule on a hub source's `endpoint`, offline: `https://`, or
/// `http://` with `allowInsecureHttp: true` beside it.
fn check_endpoint(
    endpoint: Option<&str>,
    allow_insecure_http: Option<bool>,
    field: &'static str,
) -> Result<(), SpecError> {
    match endpoint {
        Some(e) if !e.starts_with("https://") && allow_insecure_http != Some(true) => {
            Err(spec_error(field, insecure_endpoint_problem()))
        }
        _ => Ok(()),
    }
}

impl HuggingFaceSource {
    /// Whether `endpoint` may be used: see [`check_endpoint`].
    pub fn check_endpoint(&self) -> Result<(), SpecError> {
        check_endpoint(
            self.endpoint.as_deref(),
            self.allow_insecure_http,
            "model.pretrained.huggingFace.endpoint",
        )
    }
}

impl HuggingFaceDataFile {
    /// Whether `endpoint` may be used: see [`check_endpoint`].
    pub fn check_endpoint(&self) -> Result<(), SpecError> {
        check_endpoint(
            self.endpoint.as_deref(),
            self.allow_insecure_http,
            "data.huggingFace.endpoint",
        )
    }
}

/// One key of a Secret in the job's namespace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SecretKey {
    /// The Secret's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// Default `token`.
    #[serde(default = "default_token_key")]
    #[schemars(length(min = 1, max = 253))]
    pub key: String,
}

/// A path on a PersistentVolumeClaim in the job's namespace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!self.path.startsWith('/') && !self.path.split('/').exists(p, p == '..')",
     "message": "path is relative to the claim's root and must not contain '..' (e.g. models/llama-3.2-1b)"}
]))]
pub struct VolumePath {
    /// A PersistentVolumeClaim in the job's namespace.
    #[schemars(length(min = 1, max = 253))]
    pub claim_name: String,
    /// Relative to the claim's root; empty for the root itself.
    #[serde(default)]
    #[schemars(length(max = 1000))]
    pub path: String,
}

impl VolumePath {
    /// The CEL rule above, offline: `field` names where this path is.
    fn check(&self, field: &'static str) -> Result<(), SpecError> {
        if self.path.starts_with('/') || self.path.split('/').any(|p| p == "..") {
            return Err(spec_error(
                field,
                "path is relative to the claim's root and must not contain '..' (e.g. models/llama-3.2-1b)",
            ));
        }
        Ok(())
    }
}

/// The training text.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "has(self.huggingFace) != has(self.volume)",
     "message": "data: set exactly one of huggingFace (repo, file) or volume (claimName, path)"},
    {"rule": "self == oldSelf",
     "message": "data is immutable: the initializer has read this text and the job's samples come from it; create a new job for other data"}
]))]
pub struct DataSpec {
    /// The data file on a claim.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub volume: Option<VolumePath>,
    /// One file of a Hugging Face dataset repository, downloaded into the
    /// job's checkpoint volume by the initializer (once).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hugging_face: Option<HuggingFaceDataFile>,
    /// `jsonl` (one JSON object a line, the text under `field`) or `text` (the file is one document).
    #[serde(default)]
    pub format: TextFormat,
    /// The JSONL field holding the document.
    #[serde(default = "default_text_field")]
    #[schemars(length(min = 1, max = 200))]
    pub field: String,
}

/// A file of a Hugging Face dataset repository.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!self.file.startsWith('/') && !self.file.split('/').exists(p, p == '..' || p == '.' || p == '')",
     "message": "data.huggingFace.file is a path inside the repository (e.g. data/train.jsonl), without a leading '/', '.' or '..'"},
    {"rule": "!self.file.endsWith('.parquet') && !self.file.endsWith('.arrow')",
     "message": "data.huggingFace.file must be JSONL (format: jsonl) or plain text (format: text); Headroom does not read Parquet or Arrow: pick or upload such a file"},
    {"rule": "!has(self.endpoint) || self.endpoint.startsWith('https://') || (has(self.allowInsecureHttp) && self.allowInsecureHttp)",
     "fieldPath": ".endpoint",
     "reason": "FieldValueForbidden",
     "message": "data.huggingFace.endpoint: must start with https:// (the token of tokenSecret is sent there); for a plain-HTTP mirror on a network you trust, also set allowInsecureHttp: true"}
]))]
pub struct HuggingFaceDataFile {
    /// `owner/name` of a dataset repository, e.g. `stanfordnlp/imdb`.
    #[schemars(
        length(min = 3, max = 200),
        regex(pattern = r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
    )]
    pub repo: String,
    /// A branch, tag or commit.
    #[serde(default = "default_revision")]
    #[schemars(length(min = 1, max = 200))]
    pub revision: String,
    /// The file's path in the repository, e.g. `data/train.jsonl`.
    #[schemars(length(min = 1, max = 1000))]
    pub file: String,
    /// The hub or a mirror, as `HF_ENDPOINT` (default `https://huggingface.co`).
    /// Must be `https://`: the token of `tokenSecret` is sent here. A plain
    /// `http://` mirror needs `allowInsecureHttp: true` as well.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 500), regex(pattern = r"^https?://[^\s]+$"))]
    pub endpoint: Option<String>,
    /// Accept a plain `http://` `endpoint` (a mirror on a network you trust):
    /// the token of `tokenSecret`, if any, and the files then travel
    /// unencrypted and unauthenticated. Default false: `endpoint` must be
    /// `https://`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allow_insecure_http: Option<bool>,
    /// A key of a Secret in the job's namespace holding the Hugging Face
    /// token, for a gated or private dataset.
    /// Only a user who may `get` that Secret may name it: the chart's
    /// admission policy (`secretAccessPolicy`) refuses a job whose creator
    /// may not read it. The token is mounted, read-only, as a file into the
    /// job's initializer pod alone (never into its workers, never as an
    /// environment variable) and sent only to `endpoint`, as an
    /// `Authorization: Bearer` header (a redirect keeps it only on the same
    /// host over https; a CDN's signed URL gets none).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token_secret: Option<SecretKey>,
}

/// How a data file holds its documents.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum TextFormat {
    #[default]
    Jsonl,
    Text,
}

/// Where the fine-tuned model goes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct OutputSpec {
    /// A directory on a claim (created if missing), written in the
    /// checkpoint's Hugging Face format on success.
    pub volume: VolumePath,
}

fn default_revision() -> String {
    "main".into()
}
fn default_token_key() -> String {
    "token".into()
}
fn default_text_field() -> String {
    "text".into()
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
    {"rule": "!has(self.lora) || self.method != 'full'",
     "message": "training.lora: adapters are for method lora or qlora; set training.method: lora (or qlora), or remove training.lora"},
    {"rule": "!has(self.lora) || !has(self.lora.baseFormat) || self.method == 'qlora'",
     "message": "training.lora.baseFormat: only a qlora job quantizes its base (lora keeps it dense); set training.method: qlora, or remove baseFormat"}
]))]
pub struct TrainingSpec {
    /// Samples per optimizer step; every attempt keeps it exactly (micro-batch × accumulation).
    #[schemars(range(min = 1, max = 1048576))]
    pub global_batch: u32,
    /// Optimizer steps to train.
    #[schemars(range(min = 1, max = 1000000000))]
    pub steps: u64,
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

fn default_lora_targets() -> Vec<headroom_planner::TargetModule> {
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
     "message": "resources.gpu.hostMemory must be a quantity of at least 64Mi, e.g. 32Gi"}
]))]
pub struct GpuResources {
    /// Allowed GPU products as GPU Feature Discovery labels them
    /// (`nvidia.com/gpu.product`, e.g. `NVIDIA-A100-SXM4-80GB`); empty allows any.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "set"))]
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
    /// offloadActivations, shardOptimizerState, morePipelineStages,
    /// largerGpu); all of them by default. A rung that does not apply to a
    /// job (the offload rungs on a CPU worker, offloadEmbedding or
    /// quantizeBase on a full fine-tune) is skipped; when no rung helps, the
    /// job's failure lists why each one did not.
    #[serde(default = "default_rungs")]
    #[schemars(length(max = 11), extend("x-kubernetes-list-type" = "set"))]
    pub allowed_rungs: Vec<RetryRung>,
    /// Attempts in total, the first included.
    #[serde(default = "default_max_attempts")]
    #[schemars(range(min = 1, max = 20))]
    pub max_attempts: u32,
    /// First backoff before retrying a non-memory failure; doubles each time.
    #[serde(default = "default_backoff")]
    #[schemars(range(min = 0, max = 3600))]
    pub backoff_seconds: u32,
}

impl Default for MemoryPolicy {
    fn default() -> Self {
        MemoryPolicy {
            allowed_rungs: default_rungs(),
            max_attempts: default_max_attempts(),
            backoff_seconds: default_backoff(),
        }
    }
}

/// The worker pods: their image, and where they may run on a shared cluster.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
#[schemars(extend("x-kubernetes-validations" = [
    {"rule": "!has(self.nodeSelector) || !('nvidia.com/gpu.product' in self.nodeSelector)",
     "message": "worker.nodeSelector: Headroom chooses nvidia.com/gpu.product itself; list the allowed products in resources.gpu.types"},
    {"rule": "!has(self.tolerations) || self.tolerations.all(t, !has(t.operator) || t.operator in ['Equal', 'Exists'])",
     "message": "worker.tolerations: operator must be Equal or Exists"},
    {"rule": "!has(self.tolerations) || self.tolerations.all(t, !has(t.effect) || t.effect in ['', 'NoSchedule', 'PreferNoSchedule', 'NoExecute'])",
     "message": "worker.tolerations: effect must be NoSchedule, PreferNoSchedule, NoExecute or empty (all effects)"},
    {"rule": "!has(self.tolerations) || self.tolerations.all(t, (has(t.operator) && t.operator == 'Exists') ? (!has(t.value) || t.value == '') : (has(t.key) && t.key != ''))",
     "message": "worker.tolerations: Exists takes no value, and Equal (the default) needs a key"}
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
    /// Names of Secrets in the job's namespace for pulling the image from a private registry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16), inner(length(min = 1, max = 253)))]
    pub image_pull_secrets: Vec<String>,
    /// Node labels every worker pod requires (a node pool, a zone). The
    /// planner counts only the GPUs of matching nodes. Not
    /// `nvidia.com/gpu.product`: that is chosen from `resources.gpu.types`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    #[schemars(extend("maxProperties" = 32))]
    pub node_selector: BTreeMap<String, String>,
    /// Tolerations for the worker pods (GPU jobs also get
    /// `nvidia.com/gpu:NoSchedule`). Nodes with a NoSchedule or NoExecute
    /// taint the workers do not tolerate are left out of the plan.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32))]
    pub tolerations: Vec<Toleration>,
    /// PriorityClass of the worker pods.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub priority_class_name: Option<String>,
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

/// Where a job is in its life. `Succeeded` and `Failed` are final.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum JobPhase {
    Pending,
    Running,
    Retrying,
    Succeeded,
    Failed,
}

/// How an attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum AttemptOutcome {
    Running,
    Succeeded,
    /// Killed by the kernel at the container memory limit (`OOMKilled` / 137).
    HostOutOfMemory,
    /// The worker caught a device allocation failure.
    DeviceOutOfMemory,
    /// Evicted, preempted or its node was lost.
    Disrupted,
    /// No node could take the pods (e.g. no free GPU of the planned type).
    Unschedulable,
    Failed,
}

impl AttemptOutcome {
    /// Out of memory, on the host or on the device: the retry is stricter.
    pub fn is_memory(self) -> bool {
        matches!(
            self,
            AttemptOutcome::HostOutOfMemory | AttemptOutcome::DeviceOutOfMemory
        )
    }
}

/// One attempt, kept forever in `status.attempts`: what it ran, what it was
/// predicted to need, what it used and how it ended.
///
/// The whole plan (stages, memory breakdown, step time) is stored once, in
/// `status.plan`, for the current attempt; an attempt keeps what a user
/// compares across attempts. Jobs stored before this shape carry each
/// attempt's whole plan in `plan`: it is read (to fill the fields below) and
/// the operator's next status write replaces it ([`Attempt::stored_with_plan`]).
// The fields' meanings (and the CRD's schema) are `StoredAttempt`'s, the
// tolerant reading every attempt is deserialized through.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase", try_from = "StoredAttempt")]
pub struct Attempt {
    pub number: u32,
    pub device: String,
    pub device_memory_bytes: u64,
    pub workers: u32,
    pub stages: u32,
    pub settings: Settings,
    pub predicted_peak_bytes: u64,
    pub budget_bytes: u64,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rungs_applied: Vec<RetryRung>,
    pub outcome: AttemptOutcome,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub started_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub finished_at: Option<Time>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_peak_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_step: Option<u64>,
    /// Read from an object stored with the attempt's whole plan (the shape
    /// before the plan was stored once): the operator's next status write
    /// rewrites the attempts in the lean shape. Never serialized.
    #[serde(skip)]
    pub stored_with_plan: bool,
}

impl Attempt {
    /// A new running attempt of `plan`.
    pub fn start(number: u32, plan: &Plan, started_at: Option<Time>) -> Attempt {
        Attempt {
            number,
            device: plan.device.clone(),
            device_memory_bytes: plan.device_memory_bytes,
            workers: plan.workers,
            stages: plan.stage_count(),
            settings: plan.settings,
            predicted_peak_bytes: plan.predicted_peak_bytes,
            budget_bytes: plan.budget_bytes,
            rungs_applied: plan.rungs_applied.clone(),
            outcome: AttemptOutcome::Running,
            reason: None,
            message: None,
            started_at,
            finished_at: None,
            observed_peak_bytes: None,
            last_step: None,
            stored_with_plan: false,
        }
    }

    /// Whether the plan was predicted within its budget.
    pub fn fits(&self) -> bool {
        self.predicted_peak_bytes <= self.budget_bytes
    }

    /// Data-parallel replicas (workers per stage).
    pub fn replicas(&self) -> u32 {
        self.workers / self.stages.max(1)
    }
}

/// An attempt as the API server stores it, the tolerant reading (and the
/// schema) of [`Attempt`]: what the attempt ran is either in the fields of
/// this shape or, for jobs stored before it, in `plan`.
#[derive(Clone, Debug, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
struct StoredAttempt {
    /// 1-based.
    number: u32,
    /// The device type the attempt's workers ran on (`cpu` for CPU jobs).
    #[serde(default)]
    device: Option<String>,
    /// Memory of that device (or the CPU worker's container limit), bytes.
    #[serde(default)]
    device_memory_bytes: Option<u64>,
    /// Worker pods (stages × data-parallel replicas).
    #[serde(default)]
    workers: Option<u32>,
    /// Pipeline stages.
    #[serde(default)]
    stages: Option<u32>,
    /// Micro-batch, accumulation, checkpointing, precision, optimizer.
    #[serde(default)]
    // Atomic: one writer always writes it whole, so the object's managed
    // fields name it once instead of listing each of its fields (issue 33).
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    settings: Option<Settings>,
    /// The plan's predicted peak of its largest worker, bytes.
    #[serde(default)]
    predicted_peak_bytes: Option<u64>,
    /// What a worker may use: device memory (or the CPU worker's limit)
    /// less the job's headroom, bytes.
    #[serde(default)]
    budget_bytes: Option<u64>,
    /// Retry rungs this attempt's plan applied on top of the first.
    #[serde(default)]
    rungs_applied: Vec<RetryRung>,
    outcome: AttemptOutcome,
    /// Short reason the attempt ended (`OOMKilled`, `Terminated`, `ExitCode1`, …).
    #[serde(default)]
    reason: Option<String>,
    /// What ended the attempt, in the worker's or Kubernetes' words.
    #[serde(default)]
    message: Option<String>,
    #[serde(default)]
    started_at: Option<Time>,
    #[serde(default)]
    finished_at: Option<Time>,
    /// Highest peak any worker of this attempt reported, bytes.
    #[serde(default)]
    observed_peak_bytes: Option<u64>,
    /// Last optimizer step reached.
    #[serde(default)]
    last_step: Option<u64>,
    /// Jobs stored before the plan was stored once: the attempt's whole
    /// plan. Read, never written (the operator's next status write
    /// replaces it with the fields above).
    #[serde(default)]
    #[schemars(schema_with = "preserved_object")]
    plan: Option<Box<Plan>>,
}

/// An object whose fields the API server keeps as they are (no schema below
/// it): old-shape data that is read, never written.
fn preserved_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "x-kubernetes-preserve-unknown-fields": true,
    })
}

impl TryFrom<StoredAttempt> for Attempt {
    type Error = String;

    fn try_from(s: StoredAttempt) -> Result<Attempt, String> {
        let n = s.number;
        let missing = |field: &str| {
            format!("status.attempts[number={n}]: no `{field}` and no `plan` to read it from")
        };
        let plan = s.plan.as_deref();
        let stored_with_plan = plan.is_some();
        Ok(Attempt {
            number: n,
            device: s
                .device
                .or_else(|| plan.map(|p| p.device.clone()))
                .ok_or_else(|| missing("device"))?,
            device_memory_bytes: s
                .device_memory_bytes
                .or(plan.map(|p| p.device_memory_bytes))
                .ok_or_else(|| missing("deviceMemoryBytes"))?,
            workers: s
                .workers
                .or(plan.map(|p| p.workers))
                .ok_or_else(|| missing("workers"))?,
            stages: s
                .stages
                .or(plan.map(Plan::stage_count))
                .ok_or_else(|| missing("stages"))?,
            settings: s
                .settings
                .or(plan.map(|p| p.settings))
                .ok_or_else(|| missing("settings"))?,
            predicted_peak_bytes: s
                .predicted_peak_bytes
                .or(plan.map(|p| p.predicted_peak_bytes))
                .ok_or_else(|| missing("predictedPeakBytes"))?,
            budget_bytes: s
                .budget_bytes
                .or(plan.map(|p| p.budget_bytes))
                .ok_or_else(|| missing("budgetBytes"))?,
            rungs_applied: match plan {
                Some(p) if s.rungs_applied.is_empty() => p.rungs_applied.clone(),
                _ => s.rungs_applied,
            },
            outcome: s.outcome,
            reason: s.reason,
            message: s.message,
            started_at: s.started_at,
            finished_at: s.finished_at,
            observed_peak_bytes: s.observed_peak_bytes,
            last_step: s.last_step,
            stored_with_plan,
        })
    }
}

/// Live memory of one worker, sampled by the worker itself.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemorySample {
    /// Memory the worker's cgroup uses now (memory.current / usage_in_bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_current_bytes: Option<u64>,
    /// Highest memory the worker's cgroup has used (memory.peak / max_usage_in_bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cgroup_peak_bytes: Option<u64>,
    /// Resident set size of the worker process.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_rss_bytes: Option<u64>,
    /// Bytes the backend allocator has handed out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_in_use_bytes: Option<u64>,
    /// Bytes the backend allocator holds (in use + cached); the gap is fragmentation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator_reserved_bytes: Option<u64>,
    /// Per-GPU memory as NVML reports it (GPU workers only; at most 16).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 16))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["index"]))]
    pub gpus: Vec<GpuMemory>,
    /// Highest memory this worker has used so far, bytes.
    pub peak_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct GpuMemory {
    /// NVML index of the GPU.
    pub index: u32,
    /// Bytes in use on the GPU (all processes).
    pub used_bytes: u64,
    /// The GPU's memory size.
    pub total_bytes: u64,
}

/// One worker's live report; each worker writes only its own entry.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct WorkerTelemetry {
    /// Pod name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
    /// The attempt this worker belongs to.
    pub attempt: u32,
    /// Pipeline stage this worker runs (0-based).
    pub stage: u32,
    /// First transformer block of the stage (inclusive).
    pub layer_start: u32,
    /// One past the last transformer block of the stage.
    pub layer_end: u32,
    /// Optimizer steps done so far.
    pub step: u64,
    /// Training loss of the last step (the last stage reports it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Training throughput over the last steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    // Atomic: one writer always writes it whole, so the object's managed
    // fields name it once instead of listing each of its fields (issue 33).
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub memory: MemorySample,
    /// The initializer's download while it runs (only on the initializer's
    /// entry: pod `<job>-init-<n>`, attempt 0, removed once attempt 1 starts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub download: Option<DownloadProgress>,
    pub updated_at: Time,
}

/// Where an initializer's download of a Hugging Face checkpoint stands.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DownloadProgress {
    /// The file being fetched (or the last one fetched); a longer name is
    /// cut to its last 1,000 bytes by the initializer.
    #[schemars(length(max = 1024))]
    pub file: String,
    /// Bytes of that file on the volume so far (a resumed file counts what an
    /// earlier run left).
    pub file_bytes: u64,
    /// That file's size, once the hub has said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file_total_bytes: Option<u64>,
    /// Files in place (downloaded, or already there with the right size).
    pub files_done: u32,
    /// Files to fetch as far as known (shards count once the index is read).
    pub files: u32,
    /// Bytes this run received.
    pub downloaded_bytes: u64,
}

impl DownloadProgress {
    /// The longest file name reported, bytes (the CRD allows 1,024).
    pub const MAX_FILE_BYTES: usize = 1000;

    /// Sets the file being fetched, keeping the end of a longer name (the
    /// part that tells shards apart) within [`Self::MAX_FILE_BYTES`].
    pub fn set_file(&mut self, name: &str) {
        let mut start = name.len().saturating_sub(Self::MAX_FILE_BYTES);
        while !name.is_char_boundary(start) {
            start += 1;
        }
        self.file = name[start..].to_string();
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct MemoryAwareTrainingJobStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub phase: Option<JobPhase>,
    /// The spec generation this status answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Planned`, `Running`, `Complete`, `Failed`, each with its reason (see the
    /// README's Job lifecycle).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    // Atomic: only the operator writes the conditions, always the whole
    // list (a JSON merge patch replaces a list whole anyway), so nothing
    // merges entries and the managed fields name the list once instead of
    // listing every condition's fields (issue 33).
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub conditions: Vec<Condition>,
    /// Current attempt number (1-based).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// The current attempt's whole plan: stages, memory breakdown term by
    /// term, step time (stored here only: each attempt keeps its summary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Atomic: one writer always writes it whole, so the object's managed
    // fields name it once instead of listing each of its fields (issue 33).
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub plan: Option<Plan>,
    /// Every attempt so far, oldest first, each with its settings, predicted
    /// and observed peak, and outcome; never pruned.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    // Atomic, as the conditions: one writer, the whole list (each attempt
    // would otherwise add its ~15 fields to the managed fields).
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub attempts: Vec<Attempt>,
    /// Live telemetry per worker of the current attempt (at most 1,024
    /// workers, `resources.gpu.maxGpus`'s bound, and the initializer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1025))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub workers: Vec<WorkerTelemetry>,
    /// One line on where the job stands (the current attempt and its plan, or
    /// why the job waits or failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The checkpoint a `model.pretrained` job fine-tunes, as the initializer
    /// read it (shape from config.json, checked against the weight files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Atomic: one writer always writes it whole, so the object's managed
    // fields name it once instead of listing each of its fields (issue 33).
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub model: Option<crate::ModelFacts>,
    /// The training text as the checkpoint's tokenizer sees it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Atomic: one writer always writes it whole, so the object's managed
    // fields name it once instead of listing each of its fields (issue 33).
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub data: Option<crate::DataFacts>,
    /// Where the fine-tuned model is written (`<claim>:<path>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// Initializer pods started (one unless a transient failure, e.g. a
    /// dropped download, made the operator start another).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initializations: Option<u32>,
}

/// A spec that cannot be planned, with the field at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("spec.{field}: {problem}")]
pub struct SpecError {
    /// The field's path under `spec`, list indices included (`memoryPolicy.allowedRungs[2]`).
    pub field: std::borrow::Cow<'static, str>,
    pub problem: String,
}

fn spec_error(
    field: impl Into<std::borrow::Cow<'static, str>>,
    problem: impl Into<String>,
) -> SpecError {
    SpecError {
        field: field.into(),
        problem: problem.into(),
    }
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

    /// The hub endpoints the job names (`model.pretrained.huggingFace`,
    /// `data.huggingFace`): each `https://`, or plain HTTP where the job says
    /// `allowInsecureHttp: true` beside it, since a token is sent there. The
    /// API server's CEL rules, offline; the operator also checks this before
    /// it starts an initializer (for a job stored before the rule existed).
    pub fn check_hub_endpoints(&self) -> Result<(), SpecError> {
        if let Some(hf) = self
            .model
            .pretrained
            .as_ref()
            .and_then(|p| p.hugging_face.as_ref())
        {
            hf.check_endpoint()?;
        }
        if let Some(hf) = self.data.as_ref().and_then(|d| d.hugging_face.as_ref()) {
            hf.check_endpoint()?;
        }
        Ok(())
    }

    /// The planner's view of this spec. Repeats the API server's CEL checks so
    /// offline callers (the kubectl plugin) get the same field-named errors.
    pub fn job_request(&self) -> Result<JobRequest, SpecError> {
        self.job_request_for(None)
    }

    /// [`Self::job_request`] for a `model.pretrained` job whose checkpoint
    /// has been read (`pretrained`: the shape from its config.json).
    pub fn job_request_for(
        &self,
        pretrained: Option<&headroom_planner::LlamaShape>,
    ) -> Result<JobRequest, SpecError> {
        if let Some(p) = &self.model.pretrained {
            if self.model.transformer.is_some() || self.model.generic.is_some() {
                return Err(spec_error(
                    "model",
                    "set exactly one of model.pretrained, model.transformer or model.generic",
                ));
            }
            if p.hugging_face.is_some() == p.volume.is_some() {
                return Err(spec_error(
                    "model.pretrained",
                    "set exactly one of huggingFace (repo, revision) or volume (claimName, path)",
                ));
            }
            let Some(data) = &self.data else {
                return Err(spec_error(
                    "data",
                    "a model.pretrained job needs its training text (data.volume.claimName, data.volume.path)",
                ));
            };
            // The CEL rules on the sources, for offline checks (the API
            // server holds them too).
            if let Some(v) = &p.volume {
                v.check("model.pretrained.volume.path")?;
            }
            if data.hugging_face.is_some() == data.volume.is_some() {
                return Err(spec_error(
                    "data",
                    "set exactly one of huggingFace (repo, file) or volume (claimName, path)",
                ));
            }
            if let Some(v) = &data.volume {
                v.check("data.volume.path")?;
            }
            if let Some(o) = &self.output {
                o.volume.check("output.volume.path")?;
            }
            self.check_hub_endpoints()?;
            if let Some(hf) = &data.hugging_face {
                let file = hf.file.as_str();
                if file.starts_with('/')
                    || file
                        .split('/')
                        .any(|p| p.is_empty() || p == "." || p == "..")
                {
                    return Err(spec_error(
                        "data.huggingFace.file",
                        "is a path inside the repository (e.g. data/train.jsonl), without a leading '/', '.' or '..'",
                    ));
                }
                if file.ends_with(".parquet") || file.ends_with(".arrow") {
                    return Err(spec_error(
                        "data.huggingFace.file",
                        "must be JSONL (format: jsonl) or plain text (format: text); Headroom does not read Parquet or Arrow: pick or upload such a file",
                    ));
                }
            }
            let Some(shape) = pretrained else {
                return Err(spec_error(
                    "model.pretrained",
                    "is planned from the checkpoint's config.json, which the initializer reads; offline, plan it with kubectl headroom plan --model-dir DIR",
                ));
            };
            let mut shape = shape.clone();
            shape.sequence_length = p.sequence_length;
            self.check_adapters_fit(&shape)?;
            return self.request_for_model(ModelShape::Llama(shape));
        }
        if self.training.method != TrainingMethod::Full {
            return Err(spec_error(
                "training.method",
                "lora and qlora adapt a pretrained checkpoint; set model.pretrained, or use method: full",
            ));
        }
        if self.data.is_some() || self.output.is_some() {
            return Err(spec_error(
                if self.data.is_some() {
                    "data"
                } else {
                    "output"
                },
                "only a model.pretrained job takes training text and writes a fine-tuned model",
            ));
        }
        let model = match (&self.model.transformer, &self.model.generic) {
            (Some(t), None) => {
                if t.heads == 0 || t.hidden % t.heads != 0 {
                    return Err(spec_error(
                        "model.transformer.hidden",
                        format!(
                            "hidden ({}) must be a multiple of heads ({})",
                            t.hidden, t.heads
                        ),
                    ));
                }
                ModelShape::Transformer(t.clone())
            }
            (None, Some(g)) => ModelShape::Generic(g.clone()),
            _ => {
                return Err(spec_error(
                    "model",
                    "set exactly one of model.pretrained, model.transformer or model.generic",
                ));
            }
        };
        self.request_for_model(model)
    }

    fn request_for_model(&self, model: ModelShape) -> Result<JobRequest, SpecError> {
        let t = &self.training;
        if t.global_batch == 0 {
            return Err(spec_error("training.globalBatch", "must be at least 1"));
        }
        if let Some(b) = t.micro_batch
            && (b == 0 || !t.global_batch.is_multiple_of(b))
        {
            return Err(spec_error(
                "training.microBatch",
                format!(
                    "microBatch ({b}) must divide globalBatch ({}) so the global batch is kept exactly",
                    t.global_batch
                ),
            ));
        }
        if !(0.0..=0.9).contains(&self.resources.headroom_fraction) {
            return Err(spec_error(
                "resources.headroomFraction",
                "must be between 0 and 0.9 (e.g. 0.1)",
            ));
        }
        let target = match (&self.resources.gpu, &self.resources.cpu) {
            (Some(g), None) => {
                let mut host_baseline_bytes = None;
                if let Some(host) = &g.host_memory {
                    let bytes = parse_bytes(&host.0)
                        .map_err(|e| spec_error("resources.gpu.hostMemory", e))?;
                    if bytes < 64 << 20 {
                        return Err(spec_error(
                            "resources.gpu.hostMemory",
                            "must be at least 64Mi, e.g. 32Gi",
                        ));
                    }
                    host_baseline_bytes = Some(bytes);
                }
                Target::Gpu {
                    allowed_types: g.types.clone(),
                    max_gpus: g.max_gpus.max(1),
                    host_baseline_bytes,
                }
            }
            (None, Some(c)) => {
                if let Some(cores) = &c.cores {
                    parse_cores(&cores.0).map_err(|e| spec_error("resources.cpu.cores", e))?;
                }
                let limit = parse_bytes(&c.memory_limit.0)
                    .map_err(|e| spec_error("resources.cpu.memoryLimit", e))?;
                if limit < 64 << 20 {
                    return Err(spec_error(
                        "resources.cpu.memoryLimit",
                        "must be at least 64Mi, e.g. 2Gi",
                    ));
                }
                if c.max_workers > 1 && self.model.generic.is_some() {
                    return Err(spec_error(
                        "resources.cpu.maxWorkers",
                        "a generic model cannot be split into pipeline stages; use 1",
                    ));
                }
                Target::Cpu {
                    memory_limit_bytes: limit,
                    max_workers: c.max_workers.max(1),
                }
            }
            _ => {
                return Err(spec_error(
                    "resources",
                    "set exactly one of resources.gpu or resources.cpu",
                ));
            }
        };
        if let Some(n) = t.pipeline_stages {
            let (max, field) = match &target {
                Target::Gpu { max_gpus, .. } => (*max_gpus, "resources.gpu.maxGpus"),
                Target::Cpu { max_workers, .. } => (*max_workers, "resources.cpu.maxWorkers"),
            };
            let layers = model.splittable_layers();
            if n > max || n > layers {
                return Err(spec_error(
                    "training.pipelineStages",
                    format!(
                        "{n} stages: at most {field} ({max}) and the model's layers ({layers}); raise {field} or pin fewer stages"
                    ),
                ));
            }
        }
        if let Some(d) = t.data_parallel_replicas {
            let (max, field) = match &target {
                Target::Gpu { max_gpus, .. } => (*max_gpus, "resources.gpu.maxGpus"),
                Target::Cpu { max_workers, .. } => (*max_workers, "resources.cpu.maxWorkers"),
            };
            let p = t.pipeline_stages.unwrap_or(1);
            if d == 0 || !t.global_batch.is_multiple_of(d) {
                return Err(spec_error(
                    "training.dataParallelReplicas",
                    format!(
                        "{d} replicas must divide training.globalBatch ({}) so every replica trains an equal share",
                        t.global_batch
                    ),
                ));
            }
            if let Some(b) = t.micro_batch
                && !(t.global_batch / d).is_multiple_of(b)
            {
                return Err(spec_error(
                    "training.microBatch",
                    format!(
                        "{b} must divide each replica's share of training.globalBatch ({} / {d} = {})",
                        t.global_batch,
                        t.global_batch / d
                    ),
                ));
            }
            if p * d > max {
                return Err(spec_error(
                    "training.dataParallelReplicas",
                    format!(
                        "{p} stage(s) × {d} replicas = {} workers: at most {field} ({max}); raise {field} or pin fewer",
                        p * d
                    ),
                ));
            }
        }
        let backend = self.backend();
        if (backend == Backend::Cuda) != self.resources.gpu.is_some() {
            return Err(spec_error(
                "worker.backend",
                "must be 'cuda' for a GPU job (resources.gpu) and 'flex' for a CPU job (resources.cpu)",
            ));
        }
        if backend == Backend::Flex && t.precision != Precision::Fp32 {
            return Err(spec_error(
                "training.precision",
                "the CPU backend (flex) trains in fp32 only; set precision: fp32",
            ));
        }
        for (i, t) in self.worker.tolerations.iter().enumerate() {
            let operator = t.operator.as_deref().unwrap_or("Equal");
            let problem = if !["Equal", "Exists"].contains(&operator) {
                Some("operator must be Equal or Exists")
            } else if !["", "NoSchedule", "PreferNoSchedule", "NoExecute"]
                .contains(&t.effect.as_deref().unwrap_or(""))
            {
                Some(
                    "effect must be NoSchedule, PreferNoSchedule, NoExecute or empty (all effects)",
                )
            } else if operator == "Exists" && !t.value.as_deref().unwrap_or("").is_empty() {
                Some("Exists takes no value")
            } else if operator == "Equal" && t.key.as_deref().unwrap_or("").is_empty() {
                Some("Equal (the default) needs a key")
            } else {
                None
            };
            if let Some(problem) = problem {
                return Err(spec_error(
                    "worker.tolerations",
                    format!("toleration {i}: {problem}"),
                ));
            }
        }
        // A list-type set: the API server refuses a rung listed twice
        // (`Duplicate value`); so does the offline check, in its words.
        let allowed_rungs = self.memory_policy.allowed_rungs.clone();
        for (i, rung) in allowed_rungs.iter().enumerate() {
            if allowed_rungs[..i].contains(rung) {
                return Err(spec_error(
                    format!("memoryPolicy.allowedRungs[{i}]"),
                    format!("Duplicate value: \"{rung}\""),
                ));
            }
        }
        if self
            .worker
            .node_selector
            .contains_key(headroom_planner::inventory::LABEL_GPU_PRODUCT)
        {
            return Err(spec_error(
                "worker.nodeSelector",
                "Headroom chooses nvidia.com/gpu.product itself; list the allowed products in resources.gpu.types",
            ));
        }
        let (adapters, base_format) = self.adapters(backend)?;
        Ok(JobRequest {
            model,
            global_batch: t.global_batch,
            precision: t.precision,
            optimizer: t.optimizer,
            pinned_micro_batch: t.micro_batch,
            pinned_checkpointing: t.activation_checkpointing,
            pinned_stages: t.pipeline_stages,
            pinned_replicas: t.data_parallel_replicas,
            // CPU workers of one job share their nodes' cores, so more of
            // them is not the speed-up it is on GPUs: a CPU job takes the
            // fewest workers that fit.
            objective: self
                .resources
                .gpu
                .as_ref()
                .map_or(headroom_planner::Objective::FewestGpus, |g| g.objective),
            target,
            headroom_fraction: self.resources.headroom_fraction,
            allowed_rungs,
            adapters,
            base_format,
        })
    }

    /// What only the checkpoint's shape decides about the adapters: the
    /// targets must be modules of its architecture (Phi-3 fuses q/k/v and
    /// gate/up), an adapter on a tied head would change the embedding too
    /// (PEFT allows it; Headroom's worker does not), and a quantized base
    /// needs a block size that divides every block linear's output size
    /// (burn quantizes whole blocks only).
    fn check_adapters_fit(&self, shape: &headroom_planner::LlamaShape) -> Result<(), SpecError> {
        use headroom_planner::TargetModule;
        let t = &self.training;
        if t.method == TrainingMethod::Full {
            return Ok(());
        }
        let lora = t.lora.clone().unwrap_or_default();
        if let Some(problem) = lora.config().foreign_targets(shape.architecture) {
            return Err(spec_error(
                "training.lora.targetModules",
                format!(
                    "{problem}{}",
                    if lora.target_modules == default_lora_targets() {
                        " (targetModules defaults to q_proj, v_proj: Llama's names)"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if shape.tied_embeddings && lora.target_modules.contains(&TargetModule::LmHead) {
            return Err(spec_error(
                "training.lora.targetModules",
                "lm_head is tied to the token embedding in this checkpoint (tie_word_embeddings), so an adapter there would change the embedding too; remove lm_head",
            ));
        }
        let nf4 = lora.base_format.unwrap_or(QuantizedFormat::Nf4) == QuantizedFormat::Nf4;
        let nf4_block = headroom_planner::memory::NF4_BLOCK;
        if t.method == TrainingMethod::Qlora && nf4 && u64::from(lora.block_size) != nf4_block {
            return Err(spec_error(
                "training.lora.blockSize",
                format!(
                    "nf4{} is stored as bitsandbytes stores QLoRA's base, in blocks of {nf4_block} values, not {}; remove blockSize (or set {nf4_block}), or set baseFormat: int4 or int8 to keep this block size",
                    if lora.base_format.is_none() {
                        " (the default qlora base)"
                    } else {
                        ""
                    },
                    lora.block_size
                ),
            ));
        }
        if t.method == TrainingMethod::Qlora && !nf4 {
            let block = u64::from(lora.block_size);
            let mut outputs: Vec<u64> = shape
                .architecture
                .block_linears()
                .iter()
                .map(|m| m.dims(shape).1)
                .collect();
            // k and v, gate and up have the same outputs: each said once.
            outputs.dedup();
            if block == 0 || block > 255 || outputs.iter().any(|o| o % block != 0) {
                // The largest block sizes that fit: divisors of the outputs' gcd.
                let gcd = outputs.iter().fold(0u64, |a, &b| {
                    let (mut x, mut y) = (a, b);
                    while y != 0 {
                        (x, y) = (y, x % y);
                    }
                    x
                });
                let fits: Vec<String> = (1..=gcd.min(255))
                    .rev()
                    .filter(|b| gcd % b == 0)
                    .take(3)
                    .map(|b| b.to_string())
                    .collect();
                return Err(spec_error(
                    "training.lora.blockSize",
                    format!(
                        "{block} must be at most 255 and divide the output size of every block linear ({}); e.g. {}",
                        outputs
                            .iter()
                            .map(|o| o.to_string())
                            .collect::<Vec<_>>()
                            .join(", "),
                        if fits.is_empty() {
                            "1".into()
                        } else {
                            fits.join(" or ")
                        }
                    ),
                ));
            }
        }
        Ok(())
    }

    /// The adapters and the first attempt's base format, checked as the
    /// API server's CEL rules check them, plus what only the backend knows.
    fn adapters(
        &self,
        backend: Backend,
    ) -> Result<
        (
            Option<headroom_planner::LoraConfig>,
            headroom_planner::BaseFormat,
        ),
        SpecError,
    > {
        use headroom_planner::BaseFormat;
        let t = &self.training;
        if t.method == TrainingMethod::Full {
            if t.lora.is_some() {
                return Err(spec_error(
                    "training.lora",
                    "adapters are for method lora or qlora; set training.method: lora (or qlora), or remove training.lora",
                ));
            }
            return Ok((None, BaseFormat::Dense));
        }
        let lora = t.lora.clone().unwrap_or_default();
        if !(0.0..1.0).contains(&lora.dropout) {
            return Err(spec_error(
                "training.lora.dropout",
                "must be below 1 (PEFT's lora_dropout: the probability of zeroing each value of an adapter's input); e.g. 0.05 or 0.1, or 0 for none",
            ));
        }
        if lora.rank == 0 || lora.target_modules.is_empty() {
            return Err(spec_error(
                "training.lora",
                "rank must be at least 1 and targetModules must name at least one module (e.g. [q_proj, v_proj])",
            ));
        }
        let format = match (t.method, lora.base_format) {
            (TrainingMethod::Qlora, f) => BaseFormat::from(f.unwrap_or(QuantizedFormat::Nf4)),
            (_, Some(_)) => {
                return Err(spec_error(
                    "training.lora.baseFormat",
                    "only a qlora job quantizes its base (lora keeps it dense); set training.method: qlora, or remove baseFormat",
                ));
            }
            (_, None) => BaseFormat::Dense,
        };
        let profile = backend.profile();
        if !profile.base_formats.contains(&format) {
            let runs: Vec<String> = profile.base_formats.iter().map(|f| f.to_string()).collect();
            return Err(spec_error(
                if t.method == TrainingMethod::Qlora {
                    "training.lora.baseFormat"
                } else {
                    "training.method"
                },
                format!(
                    "the {backend} worker does not run a {format} base yet; it runs: {}",
                    runs.join(", ")
                ),
            ));
        }
        Ok((Some(lora.config()), format))
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_long_download_name_keeps_its_end_within_the_bound() {
        let mut p = DownloadProgress::default();
        p.set_file("model-00001-of-00002.safetensors");
        assert_eq!(p.file, "model-00001-of-00002.safetensors");
        let long = format!("{}é-model-00002.safetensors", "d/".repeat(600));
        p.set_file(&long);
        assert!(
            p.file.len() <= DownloadProgress::MAX_FILE_BYTES,
            "{}",
            p.file.len()
        );
        assert!(p.file.ends_with("-model-00002.safetensors"));
    }
    use super::*;

    fn invalid_manifest(file: &str) -> MemoryAwareTrainingJob {
        let path = format!(
            "{}/../../e2e/testdata/invalid/{file}",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        serde_yaml::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    /// A plan as the planner makes it for the CPU sample that is OOM-killed first.
    fn sample_plan() -> Plan {
        let path = format!(
            "{}/../../samples/cpu-oom-first.yaml",
            env!("CARGO_MANIFEST_DIR")
        );
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let job: MemoryAwareTrainingJob = serde_yaml::from_str(&text).expect("sample");
        let request = job.spec.job_request().expect("request");
        headroom_planner::plan(&request, &headroom_planner::Inventory::default()).expect("plan")
    }

    /// Both shapes of `status.attempts[]` read into the same attempt: the
    /// lean one as written, the old one (each attempt with its whole plan)
    /// with the summary filled from the plan and marked for rewriting; a
    /// write never carries the plan again.
    #[test]
    fn attempts_of_both_shapes_read_the_same_and_are_written_lean() {
        let plan = sample_plan();
        let lean = Attempt::start(1, &plan, None);
        let written = serde_json::to_value(&lean).expect("serialize");
        assert!(written.get("plan").is_none(), "{written}");
        let back: Attempt = serde_json::from_value(written).expect("lean reads back");
        assert_eq!(back, lean);
        assert!(!back.stored_with_plan);

        let old = serde_json::json!({"number": 1, "plan": plan, "outcome": "Running"});
        let read: Attempt = serde_json::from_value(old).expect("old shape reads");
        assert!(read.stored_with_plan);
        assert_eq!(
            Attempt {
                stored_with_plan: false,
                ..read.clone()
            },
            lean
        );
        let rewritten = serde_json::to_value(&read).expect("serialize");
        assert!(rewritten.get("plan").is_none(), "{rewritten}");

        let neither = serde_json::json!({"number": 3, "outcome": "Failed"});
        let err = serde_json::from_value::<Attempt>(neither).expect_err("nothing to read");
        assert!(
            err.to_string()
                .contains("status.attempts[number=3]: no `device` and no `plan`"),
            "{err}"
        );
    }

    #[test]
    fn the_default_policy_offers_only_rungs_a_worker_can_run() {
        let policy = MemoryPolicy::default();
        assert_eq!(policy.allowed_rungs, RetryRung::DEFAULT.to_vec());
        assert!(policy.allowed_rungs.iter().all(|r| r.runnable()));
    }

    #[test]
    fn a_rung_listed_twice_is_rejected_offline_like_the_api_server_does() {
        let job = invalid_manifest("30-duplicate-rung.yaml");
        let err = job.spec.job_request().expect_err("a duplicate rung");
        assert_eq!(
            err.to_string(),
            "spec.memoryPolicy.allowedRungs[2]: Duplicate value: \"halveMicroBatch\""
        );
        let mut allowed = job.spec.clone();
        allowed.memory_policy.allowed_rungs = RetryRung::ALL.to_vec();
        allowed.job_request().expect("every rung is accepted once");
    }

    /// The replica rules of the corpus hold offline too, naming the field;
    /// and a pinned count over the worker cap is refused before planning.
    #[test]
    fn replica_pins_are_checked_offline() {
        for (file, field) in [
            (
                "50-replicas-not-dividing.yaml",
                "training.dataParallelReplicas",
            ),
            (
                "51-micro-batch-not-dividing-a-replicas-share.yaml",
                "training.microBatch",
            ),
        ] {
            let err = invalid_manifest(file).spec.job_request().expect_err(file);
            assert_eq!(err.field, field, "{file}: {err}");
        }
        let mut job = invalid_manifest("50-replicas-not-dividing.yaml").spec;
        job.training.data_parallel_replicas = Some(8);
        let err = job.job_request().expect_err("8 replicas over 4 workers");
        assert_eq!(err.field, "training.dataParallelReplicas");
        assert!(
            err.problem.contains("resources.cpu.maxWorkers (4)"),
            "{err}"
        );
        job.training.data_parallel_replicas = Some(4);
        let request = job.job_request().expect("4 replicas of 8 samples");
        assert_eq!(request.pinned_replicas, Some(4));
        // CPU jobs take the fewest workers; GPU jobs default to the fastest plan.
        assert_eq!(request.objective, headroom_planner::Objective::FewestGpus);
    }

    /// The tiny-llama fixture's shape, read from its config.json.
    fn tiny_llama() -> headroom_planner::LlamaShape {
        headroom_planner::LlamaShape::from_hf_config(
            &std::fs::read_to_string(format!(
                "{}/../../worker/tests/fixtures/llama/tiny-llama/config.json",
                env!("CARGO_MANIFEST_DIR")
            ))
            .expect("tiny-llama config"),
            64,
        )
        .expect("config")
    }

    /// The LoRA rules of the corpus, offline: the field and the words of
    /// each manifest's CEL message (`# expect:`), for a pretrained job whose
    /// config.json has been read.
    #[test]
    fn lora_rules_are_checked_offline_with_the_api_servers_words() {
        let shape = tiny_llama();
        for (file, field) in [
            ("44-lora-block-on-full-finetune.yaml", "training.lora"),
            ("45-lora-dropout.yaml", "training.lora.dropout"),
            (
                "46-lora-base-format-without-qlora.yaml",
                "training.lora.baseFormat",
            ),
            ("49-lora-on-a-model-from-scratch.yaml", "training.method"),
        ] {
            let path = format!(
                "{}/../../e2e/testdata/invalid/{file}",
                env!("CARGO_MANIFEST_DIR")
            );
            let text = std::fs::read_to_string(&path).expect("manifest");
            let expect = text
                .lines()
                .find_map(|l| l.strip_prefix("# expect: "))
                .expect("expect line");
            let err = invalid_manifest(file)
                .spec
                .job_request_for(Some(&shape))
                .expect_err(file);
            assert_eq!(err.field, field, "{file}");
            assert_eq!(format!("{field}: {}", err.problem), expect, "{file}");
        }
    }

    /// A hub endpoint is `https://`, or plain HTTP only with the opt-in
    /// beside it: offline with the API server's words (the corpus's
    /// `# expect:`), the CRD's CEL message the same, and the opt-in admits it.
    #[test]
    fn a_plain_http_hub_endpoint_needs_the_opt_in() {
        let shape = tiny_llama();
        let crd =
            serde_json::to_string(&<MemoryAwareTrainingJob as kube::CustomResourceExt>::crd())
                .expect("crd");
        for (file, field) in [
            (
                "54-hub-endpoint-plain-http.yaml",
                "model.pretrained.huggingFace.endpoint",
            ),
            (
                "55-data-hub-endpoint-plain-http.yaml",
                "data.huggingFace.endpoint",
            ),
        ] {
            let path = format!(
                "{}/../../e2e/testdata/invalid/{file}",
                env!("CARGO_MANIFEST_DIR")
            );
            let text = std::fs::read_to_string(&path).expect("manifest");
            let expect = text
                .lines()
                .find_map(|l| l.strip_prefix("# expect: "))
                .expect("expect line");
            let job = invalid_manifest(file);
            let err = job.spec.job_request_for(Some(&shape)).expect_err(file);
            assert_eq!(err.field, field, "{file}");
            assert_eq!(format!("{field}: {}", err.problem), expect, "{file}");
            assert!(crd.contains(expect), "{file}: the CRD's CEL message");
            assert_eq!(job.spec.check_hub_endpoints(), Err(err));

            // The opt-in beside the endpoint admits it; https needs none.
            let mut spec = job.spec.clone();
            let set = |spec: &mut MemoryAwareTrainingJobSpec, endpoint: &str, allow| {
                if let Some(hf) = spec
                    .model
                    .pretrained
                    .as_mut()
                    .and_then(|p| p.hugging_face.as_mut())
                {
                    hf.endpoint = Some(endpoint.into());
                    hf.allow_insecure_http = allow;
                }
                if let Some(hf) = spec.data.as_mut().and_then(|d| d.hugging_face.as_mut()) {
                    hf.endpoint = Some(endpoint.into());
                    hf.allow_insecure_http = allow;
                }
            };
            set(&mut spec, "http://hf-mirror.example", Some(true));
            spec.check_hub_endpoints().expect("opted in");
            spec.job_request_for(Some(&shape)).expect("opted in");
            set(&mut spec, "https://hf-mirror.example", None);
            spec.check_hub_endpoints().expect("https");
            set(&mut spec, "HTTP://hf-mirror.example", None);
            assert!(spec.check_hub_endpoints().is_err(), "{file}: HTTP://");
        }
    }

    #[test]
    fn a_lora_job_plans_with_peft_defaults_and_a_qlora_job_with_an_int4_base() {
        let shape = tiny_llama();
        let mut spec = invalid_manifest("45-lora-dropout.yaml").spec;
        spec.training.lora = None;
        let request = spec.job_request_for(Some(&shape)).expect("lora");
        let adapters = request.adapters.expect("adapters");
        assert_eq!((adapters.rank, adapters.alpha), (8, 16.0));
        assert_eq!(
            adapters.target_modules,
            vec![
                headroom_planner::TargetModule::QProj,
                headroom_planner::TargetModule::VProj
            ]
        );
        assert_eq!(request.base_format, headroom_planner::BaseFormat::Dense);

        // QLoRA starts from nf4 unless told otherwise.
        spec.training.method = TrainingMethod::Qlora;
        spec.training.lora = Some(LoraSpec::default());
        let r = spec.job_request_for(Some(&shape)).expect("qlora");
        assert_eq!(r.base_format, headroom_planner::BaseFormat::Nf4);
        spec.training.lora = Some(LoraSpec {
            block_size: 4,
            base_format: Some(QuantizedFormat::Int4),
            ..LoraSpec::default()
        });
        let r = spec.job_request_for(Some(&shape)).expect("qlora int4");
        assert_eq!(r.base_format, headroom_planner::BaseFormat::Int4);
    }

    /// Phi-3 names its fused modules qkv_proj and gate_up_proj: Llama's
    /// names (targetModules' default among them) are refused naming Phi-3's,
    /// and its own plan.
    #[test]
    fn phi3_adapters_take_phi3s_module_names() {
        use headroom_planner::TargetModule::{GateUpProj, OProj, QkvProj};
        let shape = headroom_planner::LlamaShape::from_hf_config(
            &std::fs::read_to_string(format!(
                "{}/../../worker/tests/fixtures/llama/phi3-mha-longrope-short/config.json",
                env!("CARGO_MANIFEST_DIR")
            ))
            .expect("phi3 config"),
            12,
        )
        .expect("config");
        let mut spec = invalid_manifest("45-lora-dropout.yaml").spec;
        spec.training.lora = Some(LoraSpec::default());
        let err = spec
            .job_request_for(Some(&shape))
            .expect_err("q_proj on Phi-3");
        assert_eq!(err.field, "training.lora.targetModules", "{err}");
        assert!(
            err.problem
                .contains("qkv_proj, o_proj, gate_up_proj, down_proj, lm_head")
                && err.problem.contains("default"),
            "{err}"
        );
        spec.training.lora = Some(LoraSpec {
            target_modules: vec![QkvProj, OProj, GateUpProj],
            ..LoraSpec::default()
        });
        let request = spec.job_request_for(Some(&shape)).expect("Phi-3's names");
        assert_eq!(
            request.adapters.expect("adapters").target_modules,
            vec![QkvProj, OProj, GateUpProj]
        );
    }

    #[test]
    fn adapters_the_checkpoint_cannot_take_are_refused_naming_the_field() {
        let shape = tiny_llama();
        assert!(shape.tied_embeddings, "tiny-llama ties its head");
        let mut spec = invalid_manifest("45-lora-dropout.yaml").spec;
        spec.training.lora = Some(LoraSpec {
            target_modules: vec![
                headroom_planner::TargetModule::QProj,
                headroom_planner::TargetModule::LmHead,
            ],
            ..LoraSpec::default()
        });
        let err = spec.job_request_for(Some(&shape)).expect_err("tied head");
        assert_eq!(err.field, "training.lora.targetModules", "{err}");

        // k/v project to 2 heads × 16 = 32 values and gate/up to 172: an
        // int4 block of 64 divides neither; 4 divides all.
        spec.training.method = TrainingMethod::Qlora;
        let int4 = |block_size| {
            Some(LoraSpec {
                block_size,
                base_format: Some(QuantizedFormat::Int4),
                ..LoraSpec::default()
            })
        };
        spec.training.lora = int4(64);
        let err = spec.job_request_for(Some(&shape)).expect_err("block 64");
        assert_eq!(err.field, "training.lora.blockSize", "{err}");
        assert!(err.problem.contains("e.g. 4 or 2 or 1"), "{err}");
        // nf4's blocks run over the whole tensor: no divisibility, but 64 only.
        spec.training.lora = Some(LoraSpec::default());
        spec.job_request_for(Some(&shape))
            .expect("nf4 fits any shape");
        spec.training.lora = Some(LoraSpec {
            block_size: 4,
            ..LoraSpec::default()
        });
        let err = spec.job_request_for(Some(&shape)).expect_err("nf4 block 4");
        assert_eq!(err.field, "training.lora.blockSize", "{err}");
        assert!(err.problem.contains("baseFormat: int4"), "{err}");
        spec.training.lora = int4(4);
        let result = spec.job_request_for(Some(&shape));
        assert!(
            result
                .as_ref()
                .map_or_else(|e| e.field != "training.lora.blockSize", |_| true),
            "{result:?}"
        );
    }
}
