//! What the operator and the worker agree on besides the CRD.

use headroom_planner::{ModelShape, Plan};
use serde::{Deserialize, Serialize};

/// API group of Headroom's resources.
pub const GROUP: &str = "headroom.dev";
/// Field manager the operator uses for every server-side apply.
pub const OPERATOR_FIELD_MANAGER: &str = "headroom-operator";
/// Workers use `headroom-worker/<worker name>` so each owns only its own status entry.
pub const WORKER_FIELD_MANAGER_PREFIX: &str = "headroom-worker/";

/// Labels on everything the operator creates for a job.
pub const LABEL_JOB: &str = "headroom.dev/job";
pub const LABEL_ATTEMPT: &str = "headroom.dev/attempt";
pub const LABEL_STAGE: &str = "headroom.dev/stage";

/// Where the worker finds its [`WorkerAssignment`]: a JSON file, or the JSON itself.
pub const PLAN_FILE_ENV: &str = "HEADROOM_PLAN_FILE";
pub const PLAN_JSON_ENV: &str = "HEADROOM_PLAN";
/// Directory of the checkpoint volume (shared by all attempts of a job).
pub const CHECKPOINT_DIR_ENV: &str = "HEADROOM_CHECKPOINT_DIR";
pub const DEFAULT_CHECKPOINT_DIR: &str = "/var/lib/headroom/checkpoints";
/// The pod's own name (downward API): the key of its `status.workers` entry.
pub const POD_NAME_ENV: &str = "POD_NAME";
/// Seconds between telemetry writes to the job status (a markedly higher peak writes at once).
pub const TELEMETRY_INTERVAL_ENV: &str = "HEADROOM_TELEMETRY_INTERVAL_SECONDS";
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
/// Seconds a stage waits for its neighbours to come up, and then for any one
/// message from them, before it gives up with `PEER_LOST`.
pub const PIPELINE_TIMEOUT_ENV: &str = "HEADROOM_PIPELINE_TIMEOUT_SECONDS";

/// Worker exit codes. 137 (SIGKILL, e.g. the kernel OOM killer) is not ours.
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
    /// Any other failure.
    pub const FAILURE: i32 = 1;
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
    /// The model to build (the Headroom worker trains transformers only).
    pub model: ModelShape,
    pub plan: Plan,
    pub steps: u64,
    pub learning_rate: f64,
    pub checkpoint_every_steps: u32,
    pub seed: u64,
}

/// What happened inside the worker, written to the termination-message file on every exit.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TerminationMessage {
    /// `succeeded`, `deviceOutOfMemory`, `invalidPlan`, `peerLost`, `failed`.
    pub outcome: String,
    pub reason: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak_bytes: Option<u64>,
    /// Bytes the failing allocation asked for, when the backend says.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub requested_bytes: Option<u64>,
}
