//! What the operator and the worker agree on besides the CRD.

use headroom_planner::{ModelShape, Plan};
use serde::{Deserialize, Serialize};

/// API group of Headroom's resources.
pub const GROUP: &str = "headroom.dev";
/// Field manager the operator uses for every server-side apply.
pub const OPERATOR_FIELD_MANAGER: &str = "headroom-operator";
/// Workers use `headroom-worker/<worker name>` so each owns only its own status entry.
/// The operator writes a worker's report under it only when it holds too
/// many to aggregate (`operator/src/worker_reports.rs`).
pub const WORKER_FIELD_MANAGER_PREFIX: &str = "headroom-worker/";
/// The operator's aggregated telemetry writes: this prefix and a random
/// suffix per operator process, so one process's apply never deletes the
/// entries another (a restarted or second replica) wrote.
pub const TELEMETRY_FIELD_MANAGER_PREFIX: &str = "headroom-telemetry/";
/// A peak this much above the last one written is reported at once by a
/// worker and written at once by the operator's aggregator.
pub const PEAK_GROWTH_FOR_IMMEDIATE_WRITE: f64 = 0.10;

/// Labels on everything the operator creates for a job.
pub const LABEL_JOB: &str = "headroom.dev/job";
pub const LABEL_ATTEMPT: &str = "headroom.dev/attempt";
pub const LABEL_STAGE: &str = "headroom.dev/stage";
/// On a worker pod of a plan with data-parallel replicas: its replica (rank) within its stage.
pub const LABEL_REPLICA: &str = "headroom.dev/replica";
/// On a checkpoint claim: the uid of the job whose checkpoints it holds (a
/// kept claim outlives its job; a new job of the same name must not resume
/// from it).
pub const ANNOTATION_JOB_UID: &str = "headroom.dev/job-uid";
/// On a checkpoint claim kept after its job: the job's name.
pub const LABEL_RETAINED_FROM: &str = "headroom.dev/retained-from";
/// On an initializer pod: [`ROLE_INITIALIZER`], which tells it from the
/// workers (worker pods carry no role label).
pub const LABEL_ROLE: &str = "headroom.dev/role";
pub const ROLE_INITIALIZER: &str = "initializer";
/// On a shared model cache claim (`headroom-model-<hash>`): the component
/// [`COMPONENT_MODEL_CACHE`] (label), and its state as annotations, which
/// are all the state there is (an operator restart rebuilds nothing).
pub const COMPONENT_MODEL_CACHE: &str = "model-cache";
/// `filling` (a job's initializer downloads into it) or `ready`.
pub const ANNOTATION_CACHE_STATE: &str = "headroom.dev/cache-state";
/// While filling: the uid of the job whose initializer downloads (absent
/// once that job ended without filling it: the next job takes over).
pub const ANNOTATION_CACHE_FILLER: &str = "headroom.dev/cache-filler";
/// While filling: that job's name, for the waiting jobs' message.
pub const ANNOTATION_CACHE_FILLER_JOB: &str = "headroom.dev/cache-filler-job";
/// The repository, revision and endpoint the claim holds (for `kubectl get`).
pub const ANNOTATION_CACHE_REPO: &str = "headroom.dev/cache-repo";
pub const ANNOTATION_CACHE_REVISION: &str = "headroom.dev/cache-revision";
pub const ANNOTATION_CACHE_ENDPOINT: &str = "headroom.dev/cache-endpoint";
/// Once ready: the commit the files came from, as the hub listed it.
pub const ANNOTATION_CACHE_COMMIT: &str = "headroom.dev/cache-commit";
/// When a job last used the claim (RFC 3339), refreshed while one does; the
/// claim is deleted once it is older than the idle time and no job uses it.
pub const ANNOTATION_CACHE_LAST_USED: &str = "headroom.dev/cache-last-used";
pub const CACHE_STATE_FILLING: &str = "filling";
pub const CACHE_STATE_READY: &str = "ready";
/// Kubernetes' recommended labels, on everything the operator creates for a
/// job: [`MANAGED_BY`], and the part of the job it is. The initializer pod
/// is [`COMPONENT_INITIALIZER`]; the worker pods, their headless Service and
/// the checkpoint claim are [`COMPONENT_WORKER`].
pub const LABEL_MANAGED_BY: &str = "app.kubernetes.io/managed-by";
pub const MANAGED_BY: &str = "headroom";
pub const LABEL_COMPONENT: &str = "app.kubernetes.io/component";
pub const COMPONENT_WORKER: &str = "worker";
pub const COMPONENT_INITIALIZER: &str = "initializer";

/// Where the worker finds its [`WorkerAssignment`]: a JSON file, or the JSON itself.
pub const PLAN_FILE_ENV: &str = "HEADROOM_PLAN_FILE";
pub const PLAN_JSON_ENV: &str = "HEADROOM_PLAN";
/// Directory of the checkpoint volume (shared by all attempts of a job).
pub const CHECKPOINT_DIR_ENV: &str = "HEADROOM_CHECKPOINT_DIR";
pub const DEFAULT_CHECKPOINT_DIR: &str = "/var/lib/headroom/checkpoints";
/// The pod's own name (downward API): the key of its `status.workers` entry.
pub const POD_NAME_ENV: &str = "POD_NAME";
/// glibc's malloc arenas, and the worker's count of them. glibc gives a
/// thread that allocates an arena of its own (up to eight per core), and an
/// arena keeps what its threads freed: a pipeline stage's link threads read
/// whole activation and gradient frames that the trainer frees, and on the
/// CPU calibration that held the middle of three stages 18 MiB (16.5 %)
/// above its plan. One arena measured 110 → 100–101 MiB there, the other
/// stages 1–10 MiB lower, single workers unchanged within their spread
/// (docs/benchmarks.md); the operator sets it in every worker pod, the
/// calibration harness in every worker it runs.
pub const MALLOC_ARENA_MAX_ENV: &str = "MALLOC_ARENA_MAX";
pub const WORKER_MALLOC_ARENAS: &str = "1";
/// glibc's malloc tunables, and the worker's: tensors of 8 MiB and more
/// are mmapped (a fixed threshold) on transparent huge pages. glibc's
/// default raises its mmap threshold to the largest block freed so far (up
/// to 32 MiB), so after the first step nearly every tensor lives on the
/// heap, and a heap whose holes do not fit the next tensor grows: the same
/// job's peak then varied by 15–50 MiB from run to run and sat up to 48 %
/// above the bytes really alive (a 2 × 192 model with a 32k vocabulary:
/// 299 and 351 MiB against 237 mmapped). A fixed threshold gives freed
/// large tensors back at once, so the peak is what is alive; huge pages
/// keep the page faults of fresh mappings cheap. 8 MiB rather than 4: a
/// mapping is zeroed by the kernel on first touch every time it is made,
/// and the 4–8 MiB tensors of a small model's step (a 135M model's MLP
/// activations at 6 MiB) are made and freed many times a step; from the
/// heap they cost no faults. That saved 3–10 % of a full and of a LoRA step
/// on the CPU, for peaks +1 MiB at the median over the calibration grid
/// (docs/benchmarks.md). Where the node disables transparent huge pages
/// only the threshold applies. The operator sets it in every worker pod,
/// the calibration harness in every worker it runs.
pub const MALLOC_TUNABLES_ENV: &str = "GLIBC_TUNABLES";
pub const WORKER_MALLOC_TUNABLES: &str =
    "glibc.malloc.hugetlb=1:glibc.malloc.mmap_threshold=8388608";
/// Seconds between a worker's telemetry reports, and between the operator's
/// writes of a job's reports into its status (a markedly higher peak goes at once).
pub const TELEMETRY_INTERVAL_ENV: &str = "HEADROOM_TELEMETRY_INTERVAL_SECONDS";
/// The operator's worker API: the base URL (`http://host:port`) through which
/// workers and the initializer report telemetry and look up their peers.
/// Workers hold no Kubernetes API rights of their own: the operator checks
/// each call's pod-bound token with a TokenReview and writes on its behalf.
/// Unset (local runs, tests): telemetry is logged, peers come from the
/// address overrides or DNS.
pub const WORKER_API_ENV: &str = "HEADROOM_WORKER_API";
/// The CA certificate (PEM) an `https` worker API's certificate is issued
/// from: the worker trusts only it for that API. Public, not a secret.
pub const WORKER_API_CA_ENV: &str = "HEADROOM_WORKER_API_CA";
/// Path of the token the worker presents to the worker API (a projected
/// service-account token bound to the pod, audience [`WORKER_API_AUDIENCE`];
/// the kubelet rotates it, so it is read again for every call).
pub const WORKER_API_TOKEN_ENV: &str = "HEADROOM_WORKER_API_TOKEN";
pub const WORKER_API_TOKEN_PATH: &str = "/var/run/secrets/headroom.dev/worker-api/token";
/// The audience of that token: the API server accepts it for nothing else.
pub const WORKER_API_AUDIENCE: &str = "headroom.dev/worker-api";
/// `POST` a [`crate::WorkerTelemetry`] as JSON: it becomes the caller's own
/// `status.workers` entry (204).
pub const WORKER_API_TELEMETRY_PATH: &str = "/v1/telemetry";
/// `GET /v1/peers/<pod>`: a [`PeerAddress`] for a pod of the caller's own job.
pub const WORKER_API_PEERS_PATH: &str = "/v1/peers/";

/// `GET`: the secret the caller's job's workers prove their membership with
/// on the pipeline and replica links ([`PeerKey`]). The operator derives it
/// from its own key and the job's uid, so it is stored nowhere and no other
/// job's pods can learn it.
pub const WORKER_API_PEER_KEY_PATH: &str = "/v1/peer-key";
/// Overrides the peer key (64 hex digits) where there is no worker API:
/// local runs and tests. In a cluster the worker asks the worker API.
pub const PEER_KEY_ENV: &str = "HEADROOM_PEER_KEY";

/// The worker API's answer to a peer-key request.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerKey {
    /// 32 bytes as 64 lowercase hex digits.
    pub key: String,
}

impl std::fmt::Debug for PeerKey {
    // A secret: never in a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PeerKey(..)")
    }
}

/// The worker API's answer to a peer lookup.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PeerAddress {
    /// The pod's IP; `None` while it has none (not yet scheduled or started).
    #[serde(default)]
    pub pod_ip: Option<String>,
}

/// Where Kubernetes reads the termination message from.
pub const TERMINATION_MESSAGE_PATH: &str = "/dev/termination-log";

/// Pipeline stages the Headroom worker runs together (one pod each). The
/// planner may split further; the operator never launches more stages.
pub const WORKER_MAX_STAGES: u32 = 8;

/// Pipeline stages: the port every stage listens on for its predecessor.
pub const PIPELINE_PORT: u16 = 29_500;
/// Comma-separated pod names of all stages of the attempt, stage order.
pub const PIPELINE_PODS_ENV: &str = "HEADROOM_PIPELINE_PODS";
/// The headless Service the stage pods are under (DNS `s<k>.<service>`).
pub const PIPELINE_SERVICE_ENV: &str = "HEADROOM_PIPELINE_SERVICE";
/// Overrides: comma-separated `host:port` of every stage (local runs, tests).
pub const PIPELINE_ADDRESSES_ENV: &str = "HEADROOM_PIPELINE_ADDRESSES";
/// Data-parallel replicas: the port every replica listens on for the
/// previous replica of its stage in the ring (gradient reduce-scatter,
/// weight all-gather).
pub const REPLICA_PORT: u16 = 29_501;
/// Comma-separated pod names of the replicas of this worker's stage, rank order.
pub const REPLICA_PODS_ENV: &str = "HEADROOM_REPLICA_PODS";
/// Overrides: comma-separated `host:port` of the replicas of this worker's stage (local runs, tests).
pub const REPLICA_ADDRESSES_ENV: &str = "HEADROOM_REPLICA_ADDRESSES";
/// Seconds a stage waits for its neighbours to come up, and then for any one
/// message from them, before it gives up with `PEER_LOST`.
pub const PIPELINE_TIMEOUT_ENV: &str = "HEADROOM_PIPELINE_TIMEOUT_SECONDS";

/// Worker exit codes. 137 (SIGKILL, e.g. the kernel OOM killer) is not ours.
/// Each has its [`WorkerOutcome`]; `WorkerOutcome::exit_code` is the one place they are paired.
pub mod exit_code {
    pub const SUCCESS: i32 = 0;
    /// The worker caught an out-of-memory error on its device.
    pub const DEVICE_OUT_OF_MEMORY: i32 = 88;
    /// The plan document is missing, unreadable or inconsistent (sysexits EX_CONFIG).
    pub const INVALID_PLAN: i32 = 78;
    /// A pipeline neighbour went away or never came up (sysexits EX_TEMPFAIL):
    /// a consequence, not a cause; the operator looks for the cause in the
    /// other stages' pods.
    pub const PEER_LOST: i32 = 75;
    /// Stopped by SIGTERM (a deleted or evicted pod, a drained node) after
    /// saving a checkpoint at the step it reached: a disruption, not a
    /// failure. 128 + 15, what a shell reports for a SIGTERM death.
    pub const TERMINATED: i32 = 143;
    /// A checkpoint or the output could not be written: the volume is full
    /// (ENOSPC; sysexits EX_IOERR). The operator grows an expandable claim
    /// and retries, or names the setting that sizes it.
    pub const DISK_FULL: i32 = 74;
    /// The memory guard stopped a step that would have crossed the memory
    /// limit, before the kernel's OOM killer (or the device's allocator)
    /// could: the last completed step is checkpointed, nothing is lost.
    pub const NEAR_OUT_OF_MEMORY: i32 = 89;
    /// Any other failure.
    pub const FAILURE: i32 = 1;
}

/// How a worker process ended, as it tells the operator: the exit code and
/// the `outcome` of its termination message both come from this.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum WorkerOutcome {
    Succeeded,
    /// An allocation failed on the device (the worker caught it).
    DeviceOutOfMemory,
    /// The assignment is unusable: retrying the same plan is pointless.
    InvalidPlan,
    /// A pipeline neighbour went away; the cause is in another stage's pod.
    PeerLost,
    /// Told to stop (SIGTERM); the work so far is checkpointed.
    Terminated,
    /// A write to the job's checkpoint volume found it full (ENOSPC).
    DiskFull,
    /// The memory guard stopped a step before it crossed the limit; the
    /// last completed step is checkpointed.
    NearOutOfMemory,
    Failed,
}

impl WorkerOutcome {
    pub const ALL: [WorkerOutcome; 8] = [
        WorkerOutcome::Succeeded,
        WorkerOutcome::DeviceOutOfMemory,
        WorkerOutcome::InvalidPlan,
        WorkerOutcome::PeerLost,
        WorkerOutcome::Terminated,
        WorkerOutcome::DiskFull,
        WorkerOutcome::NearOutOfMemory,
        WorkerOutcome::Failed,
    ];

    /// The process exit code for this outcome.
    pub const fn exit_code(self) -> i32 {
        match self {
            WorkerOutcome::Succeeded => exit_code::SUCCESS,
            WorkerOutcome::DeviceOutOfMemory => exit_code::DEVICE_OUT_OF_MEMORY,
            WorkerOutcome::InvalidPlan => exit_code::INVALID_PLAN,
            WorkerOutcome::PeerLost => exit_code::PEER_LOST,
            WorkerOutcome::Terminated => exit_code::TERMINATED,
            WorkerOutcome::DiskFull => exit_code::DISK_FULL,
            WorkerOutcome::NearOutOfMemory => exit_code::NEAR_OUT_OF_MEMORY,
            WorkerOutcome::Failed => exit_code::FAILURE,
        }
    }

    /// The outcome a worker exit code stands for; `None` for codes the worker
    /// never uses (signals such as 137, or a crash before `main`).
    pub fn from_exit_code(code: i32) -> Option<WorkerOutcome> {
        WorkerOutcome::ALL
            .into_iter()
            .find(|o| o.exit_code() == code)
    }
}

impl std::fmt::Display for WorkerOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            WorkerOutcome::Succeeded => "succeeded",
            WorkerOutcome::DeviceOutOfMemory => "deviceOutOfMemory",
            WorkerOutcome::InvalidPlan => "invalidPlan",
            WorkerOutcome::PeerLost => "peerLost",
            WorkerOutcome::Terminated => "terminated",
            WorkerOutcome::DiskFull => "diskFull",
            WorkerOutcome::NearOutOfMemory => "nearOutOfMemory",
            WorkerOutcome::Failed => "failed",
        })
    }
}

/// Everything one worker needs to run its part of an attempt.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkerAssignment {
    pub job: String,
    pub namespace: String,
    /// 1-based attempt number.
    pub attempt: u32,
    /// Index into `plan.stages`.
    pub stage: u32,
    /// Data-parallel rank within the stage, `0..plan.replicas`: which share
    /// of every global batch it trains and which tensors' optimizer state it
    /// keeps ([`headroom_planner::sharding`]).
    #[serde(default)]
    pub replica: u32,
    /// The model to build (the Headroom worker trains transformers only).
    pub model: ModelShape,
    pub plan: Plan,
    /// The run's optimizer recipe (`status.recipe`): total steps, learning
    /// rate schedule, AdamW's settings, weight decay, clipping.
    pub recipe: crate::Recipe,
    pub checkpoint_every_steps: u32,
    pub seed: u64,
    /// Where a Llama-family job's checkpoint, text and output are inside the
    /// pod; absent for the synthetic `transformer`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files: Option<PayloadFiles>,
    /// The near-OOM guard (`spec.memoryPolicy.guard`); `None`: off (the
    /// job turned it off, a GPU job left it unset, or an operator from
    /// before the guard wrote this).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_guard: Option<MemoryGuardSettings>,
}

/// How a worker's near-OOM guard runs: it checks the memory in use before
/// each part of a step that grows it (a block's forward, the loss, a
/// micro-batch's backward, the optimizer step) and stops the step when
/// what that part is known to add would leave less than the margin under
/// the limit.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MemoryGuardSettings {
    /// Kept free under the limit, percent of the limit.
    pub margin_percent: u32,
    /// Whether a trip may halve the micro-batch and double the
    /// accumulation inside the running worker (one stage, one replica, an
    /// even micro-batch): the global batch is unchanged, and no restart.
    pub step_down_in_place: bool,
}

/// The files a fine-tuning worker reads and writes, as paths in its pod.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PayloadFiles {
    /// A Hugging Face checkpoint directory: config.json, `*.safetensors`
    /// (or shards and their index), tokenizer.json.
    pub model_dir: String,
    /// The training text.
    pub data_file: String,
    /// How `data_file` holds documents.
    pub data_format: DataFormat,
    /// Which tokens the loss is computed on (`data.trainOn`).
    #[serde(default)]
    pub train_on: crate::TrainOn,
    /// A split of a hub dataset (`data.huggingFace.split`): `data_file` is
    /// then the directory the repository's files were downloaded into, and
    /// the split's files are found there as on the hub.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_split: Option<DataSplit>,
    /// How examples are packed into samples (`data.packing`).
    #[serde(default)]
    pub packing: crate::Packing,
    /// Where the fine-tuned model is written, in the checkpoint's format, on success.
    pub output_dir: String,
    /// The Hugging Face repo the model came from (`model.pretrained.huggingFace`):
    /// what an adapter's `adapter_config.json` names as its base
    /// (`base_model_name_or_path`, `revision`), so PEFT can fetch the base
    /// wherever the adapter goes. `None` for a model from a volume: the
    /// adapter then names `model_dir`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hub_model: Option<HubModel>,
}

/// A model on the Hugging Face hub: repo id and revision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct HubModel {
    pub repo: String,
    pub revision: String,
}

/// A split of a dataset repository, as `datasets.load_dataset(repo, subset,
/// split=split)` names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DataSplit {
    /// The config (`configs[].config_name` of the README); `None`: the default one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subset: Option<String>,
    pub split: String,
}

/// Which files of a dataset repository the job reads.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum HubDataFiles {
    /// A path in the repository, or a glob pattern naming several.
    File(String),
    /// The files of a split.
    Split(DataSplit),
}

/// How a data file holds its documents.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DataFormat {
    /// One JSON object a line: a conversation (`messages`), a
    /// prompt/completion pair (`prompt`, `completion`) or plain text under
    /// `field` (`text` by default).
    Jsonl { field: String },
    /// The whole file is one document.
    Text,
    /// Parquet files: each row as a JSONL line's object.
    Parquet { field: String },
}

/// `HEADROOM_INITIALIZE`: the initializer's assignment as JSON. Its presence
/// makes the worker binary an initializer (fetch, inspect, report, exit).
pub const INITIALIZE_JSON_ENV: &str = "HEADROOM_INITIALIZE";
/// The path of the file holding the Hugging Face token of
/// `spec.model.pretrained.huggingFace.tokenSecret` (the value is a path, never
/// the token). Only the initializer pod has it: the operator mounts that one
/// key of the job's Secret there, read-only ([`HF_TOKEN_PATH`]).
pub const HF_TOKEN_FILE_ENV: &str = "HEADROOM_HF_TOKEN_FILE";
/// Where the initializer pod has the model repository's token.
pub const HF_TOKEN_PATH: &str = "/var/run/secrets/headroom.dev/hf-token/token";
/// As [`HF_TOKEN_FILE_ENV`], for `spec.data.huggingFace.tokenSecret`.
pub const HF_DATASET_TOKEN_FILE_ENV: &str = "HEADROOM_HF_DATASET_TOKEN_FILE";
/// Where the initializer pod has the dataset's token.
pub const HF_DATASET_TOKEN_PATH: &str = "/var/run/secrets/headroom.dev/hf-dataset-token/token";
/// The Hugging Face hub, unless the job names a mirror.
pub const DEFAULT_HF_ENDPOINT: &str = "https://huggingface.co";

/// What the initializer pod does before a fine-tuning job is planned:
/// bring the checkpoint into `model_dir` (from the hub, resumably, skipping
/// files already there with the right size), check the checkpoint, the
/// tokenizer and the data against each other, and report what it found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InitializerAssignment {
    pub job: String,
    pub namespace: String,
    pub model: ModelSource,
    /// Where the checkpoint is (a volume path), or is downloaded into.
    pub model_dir: String,
    /// Where the training text is (a volume path), or is downloaded to.
    pub data_file: String,
    /// Where the training text comes from.
    #[serde(default)]
    pub data: DataSource,
    pub data_format: DataFormat,
    /// Which tokens the loss is computed on (`data.trainOn`).
    #[serde(default)]
    pub train_on: crate::TrainOn,
    /// As [`PayloadFiles::data_split`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data_split: Option<DataSplit>,
    /// How examples are packed into samples (`data.packing`).
    #[serde(default)]
    pub packing: crate::Packing,
    /// Tokens per training sample (the data must give at least one sample).
    pub sequence_length: u32,
    /// With `model` read from a shared model cache claim (`Volume`): the
    /// hub revision the claim was filled from (`HuggingFace`). Unless that
    /// revision is a commit, the initializer asks the hub which commit it
    /// names now and reports it (`InitializerReport::commit`), so the
    /// operator can tell a cache that a branch has moved past.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache_of: Option<ModelSource>,
}

/// Whether a hub revision is a commit (40 hex digits, the form a listing's
/// `sha` takes) rather than a branch or tag that may move.
pub fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Where a checkpoint comes from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum ModelSource {
    /// A Hugging Face repository, downloaded into `model_dir`; the token, if
    /// any, is in the file [`HF_TOKEN_FILE_ENV`] names.
    HuggingFace {
        repo: String,
        revision: String,
        /// The hub or a mirror (as `HF_ENDPOINT`), e.g. [`DEFAULT_HF_ENDPOINT`].
        endpoint: String,
    },
    /// Already in `model_dir` (a path on a volume).
    Volume,
}

/// Where the training text comes from.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum DataSource {
    /// Files of a Hugging Face dataset repository, downloaded under
    /// `data_dir` (keeping their paths in the repository): the assignment's
    /// `data_file` is `data_dir` joined with the file or glob, or `data_dir`
    /// itself for a split. The token, if any, is in the file
    /// [`HF_DATASET_TOKEN_FILE_ENV`] names.
    HuggingFace {
        repo: String,
        revision: String,
        endpoint: String,
        data_dir: String,
        files: HubDataFiles,
    },
    /// Already at `data_file` (a path on a volume).
    #[default]
    Volume,
}

/// What the initializer found, written as its termination message on
/// success (kept well under Kubernetes' 4 KiB).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InitializerReport {
    pub model: ModelFacts,
    pub data: DataFacts,
    /// Bytes this run downloaded (0 when every file was already there).
    pub downloaded_bytes: u64,
    /// The commit the hub's listing named for the model's revision (absent
    /// for a model on a volume, or a hub that did not say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub commit: Option<String>,
}

/// The checkpoint as its files describe it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ModelFacts {
    /// The shape read from config.json, checked against the safetensors headers.
    pub shape: headroom_planner::LlamaShape,
    /// Parameters in the safetensors files (equal to the shape's count).
    pub parameters: u64,
    /// Bytes of the weight files.
    pub bytes: u64,
    /// Stored dtype of the weights (e.g. `BF16`).
    pub dtype: String,
}

impl ModelFacts {
    /// What the operator checks before it plans from a report: the shape
    /// within the bounds a job's own `spec.model.transformer` has, and the
    /// parameter count the shape's. A report is the job's worker image's
    /// word (a job may name its own image), so nothing in it is trusted
    /// further than this.
    pub fn check(&self) -> Result<(), String> {
        self.shape.check_bounds().map_err(|e| e.to_string())?;
        let implied = self.shape.total_params();
        if self.parameters != implied {
            return Err(format!(
                "parameters: {} in the report, but config.json's shape has {implied}",
                self.parameters
            ));
        }
        Ok(())
    }
}

/// The training text as the checkpoint's tokenizer sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DataFacts {
    /// Examples (documents, conversations or prompt/completion pairs) in the data files.
    pub documents: u64,
    /// Tokens after tokenizing, end-of-sequence separators included.
    pub tokens: u64,
    /// Packed samples of `sequence_length + 1` tokens, as `data.packing`
    /// packs them (what `training.epochs` count).
    pub samples: u64,
    /// Of the packed samples' target tokens, those the loss skips
    /// (`data.trainOn`: prompts, user and system turns; with `documents`
    /// packing also the padding and each example's first token), in
    /// thousandths.
    #[serde(default)]
    #[schemars(range(max = 1000))]
    pub masked_per_mille: u32,
    /// Examples longer than one sample (`sequenceLength + 1` tokens):
    /// `stream` packing splits them over consecutive samples, so no sample
    /// holds one whole; `documents` packing keeps their first
    /// `sequenceLength + 1` tokens (as TRL's `bfd` truncates them).
    #[serde(default)]
    pub longer_than_sample: u64,
}

/// What happened inside the worker, written to the termination-message file on every exit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TerminationMessage {
    pub outcome: WorkerOutcome,
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    /// Bytes the failing allocation asked for, when the backend says; for
    /// `diskFull` from the initializer, the bytes more the volume needs for
    /// the download.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_bytes: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_and_exit_codes_pair_one_to_one() {
        for o in WorkerOutcome::ALL {
            assert_eq!(WorkerOutcome::from_exit_code(o.exit_code()), Some(o));
            // The wire name is the Display name (the operator parses it back).
            let json = serde_json::to_string(&o).expect("serialize");
            assert_eq!(json, format!("\"{o}\""));
        }
        assert_eq!(WorkerOutcome::from_exit_code(137), None);
    }

    #[test]
    fn termination_messages_of_earlier_workers_still_parse() {
        let m: TerminationMessage = serde_json::from_str(
            r#"{"outcome":"peerLost","reason":"pipeline stage 1: closed the connection"}"#,
        )
        .expect("parse");
        assert_eq!(m.outcome, WorkerOutcome::PeerLost);
    }
}
