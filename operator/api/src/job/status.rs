//! The status: what Headroom knows about a job and what it did.
//!
//! Atomic fields: a status object or list that one writer always writes
//! whole is marked atomic (`x-kubernetes-map-type` or
//! `x-kubernetes-list-type`), so the object's managed fields name it once
//! instead of listing each of its fields, or each entry's. Nothing merges a
//! list's entries anyway: a JSON merge patch replaces a list whole. The
//! fields marked so say `// Atomic: see the module doc.`

use headroom_planner::{Plan, RetryRung, Settings};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
    /// A checkpoint or the output did not fit on the job's checkpoint
    /// claim (the volume was full): the retry grows a claim whose
    /// StorageClass allows expansion.
    DiskFull,
    /// The worker's memory guard stopped a step before it crossed the
    /// memory limit, after checkpointing the last completed step: the retry
    /// is stricter, and no completed step is lost.
    NearOutOfMemory,
    Failed,
}

impl AttemptOutcome {
    /// Out of memory, on the host or on the device, or about to be (the
    /// guard): the retry is stricter.
    pub fn is_memory(self) -> bool {
        matches!(
            self,
            AttemptOutcome::HostOutOfMemory
                | AttemptOutcome::DeviceOutOfMemory
                | AttemptOutcome::NearOutOfMemory
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

impl MemorySample {
    /// The most GPUs one entry lists (the schema's `maxItems` of `gpus`).
    pub const MAX_GPUS: usize = 16;
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
    /// Loss on the held-out data at the last evaluation (the last stage
    /// reports it; a cross-entropy, so at least 0); absent until one ran.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub eval_loss: Option<f64>,
    /// Training throughput over the last steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_second: Option<f64>,
    // Atomic: see the module doc.
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub memory: MemorySample,
    /// The initializer's download while it runs (only on the initializer's
    /// entry: pod `<job>-init-<n>`, attempt 0, removed once attempt 1 starts).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub download: Option<DownloadProgress>,
    /// The micro-batch and accumulation the worker's memory guard stepped
    /// down to in place (the same global batch); absent: the attempt's own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stepped_down: Option<SteppedDown>,
    pub updated_at: Time,
}

/// Settings a worker's memory guard stepped down to without a restart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct SteppedDown {
    /// Samples per micro-batch now.
    #[schemars(range(min = 1))]
    pub micro_batch: u32,
    /// Micro-batches accumulated per optimizer step now.
    #[schemars(range(min = 1))]
    pub gradient_accumulation: u32,
}

impl WorkerTelemetry {
    /// The schema's bounds on one entry, checked where a worker's report
    /// comes in: the operator writes every worker's entry of a job in one
    /// status write, so an entry the API server would refuse must be
    /// refused to its worker, or the job's whole write fails every interval.
    /// The error names the field and what it allows.
    pub fn check_bounds(&self) -> Result<(), String> {
        let gpus = &self.memory.gpus;
        if gpus.len() > MemorySample::MAX_GPUS {
            return Err(format!(
                "memory.gpus: {} entries, at most {} (one per GPU the worker sees)",
                gpus.len(),
                MemorySample::MAX_GPUS
            ));
        }
        // A list keyed by `index`: the API server refuses a key twice.
        let mut indexes: Vec<u32> = gpus.iter().map(|g| g.index).collect();
        indexes.sort_unstable();
        if let Some(twice) = indexes.windows(2).find(|w| w[0] == w[1]) {
            return Err(format!(
                "memory.gpus: index {} appears twice; list each GPU once",
                twice[0]
            ));
        }
        if let Some(loss) = self.eval_loss.filter(|l| *l < 0.0) {
            return Err(format!(
                "evalLoss: {loss}, at least 0 (a cross-entropy); leave it out when no evaluation ran"
            ));
        }
        if let Some(download) = &self.download {
            // The API server counts characters, not bytes.
            let chars = download.file.chars().count();
            if chars > DownloadProgress::MAX_FILE_CHARS {
                return Err(format!(
                    "download.file: {chars} characters, at most {} (keep the name's end: DownloadProgress::set_file)",
                    DownloadProgress::MAX_FILE_CHARS
                ));
            }
        }
        Ok(())
    }
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
    /// The longest file name the schema allows (`maxLength`, characters).
    pub const MAX_FILE_CHARS: usize = 1024;

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
    // Atomic: see the module doc; only the operator writes the conditions.
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub conditions: Vec<Condition>,
    /// Current attempt number (1-based).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempt: Option<u32>,
    /// The current attempt's whole plan: stages, memory breakdown term by
    /// term, step time (stored here only: each attempt keeps its summary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Atomic: see the module doc.
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub plan: Option<Plan>,
    /// Every attempt so far, oldest first, each with its settings, predicted
    /// and observed peak, and outcome; never pruned.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    // Atomic: see the module doc; each attempt would otherwise add its ~15
    // fields to the managed fields.
    #[schemars(extend("x-kubernetes-list-type" = "atomic"))]
    pub attempts: Vec<Attempt>,
    /// Live telemetry per worker of the current attempt (at most 1,024
    /// workers, `resources.gpu.maxGpus`'s bound, and the initializer).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 1025))]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["name"]))]
    pub workers: Vec<WorkerTelemetry>,
    /// Where training stands: the step of the run's total, the last train
    /// and eval loss, tokens per second and the time left, from the
    /// workers' reports (absent until a worker of an attempt reports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Atomic: see the module doc; the telemetry writes replace it whole.
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub progress: Option<crate::JobProgress>,
    /// One line on where the job stands (the current attempt and its plan, or
    /// why the job waits or failed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub message: Option<String>,
    /// The checkpoint a `model.pretrained` job fine-tunes, as the initializer
    /// read it (shape from config.json, checked against the weight files).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Atomic: see the module doc.
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub model: Option<crate::ModelFacts>,
    /// The training text as the checkpoint's tokenizer sees it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Atomic: see the module doc.
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub data: Option<crate::DataFacts>,
    /// Where the fine-tuned model is written (`<claim>:<path>`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<String>,
    /// The shared model cache claim (`headroom-model-<hash>`) the job reads
    /// its checkpoint from, read-only, under `model/`
    /// (`model.pretrained.huggingFace.cache: Shared`); set when its first
    /// initializer starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_cache: Option<String>,
    /// Initializer pods started (one unless a transient failure, e.g. a
    /// dropped download, made the operator start another).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub initializations: Option<u32>,
    /// The image the first initializer run ran. Every later run (a retry, or
    /// a deleted pod made again) runs it too or none: the initializer holds
    /// the hub token, and the job's image may have changed since.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(max = 512))]
    pub initializer_image: Option<String>,
    /// The optimizer recipe the run follows (schedule, warmup in steps,
    /// AdamW's settings, weight decay, clipping, total steps), resolved from
    /// `spec.training` before the first attempt: every attempt follows this
    /// one, so a retry or a resume continues the same schedule at the step
    /// it reached even if the spec is edited meanwhile.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    // Atomic: see the module doc.
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub recipe: Option<crate::Recipe>,
}

// Reading an attempt back.
//
// How an attempt is read back from the API server: in the lean shape the
// operator writes, or in the older shape that stored each attempt's whole
// plan; either becomes an [`Attempt`], and the schema of
// `status.attempts[]` is this reading's.

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
    // Atomic: see the doc of the `status` module.
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

#[cfg(test)]
mod stored_attempt_tests {
    use super::*;
    use crate::job::MemoryAwareTrainingJob;

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
}

#[cfg(test)]
mod tests {
    use super::*;

    fn telemetry(gpus: Vec<GpuMemory>, file: Option<String>) -> WorkerTelemetry {
        WorkerTelemetry {
            name: "job-0".into(),
            attempt: 1,
            stage: 0,
            layer_start: 0,
            layer_end: 2,
            step: 3,
            loss: None,
            eval_loss: None,
            tokens_per_second: None,
            memory: MemorySample {
                gpus,
                peak_bytes: 1,
                ..MemorySample::default()
            },
            download: file.map(|file| DownloadProgress {
                file,
                ..DownloadProgress::default()
            }),
            stepped_down: None,
            updated_at: Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH),
        }
    }

    fn gpu(index: u32) -> GpuMemory {
        GpuMemory {
            index,
            used_bytes: 1,
            total_bytes: 2,
        }
    }

    #[test]
    fn an_entry_within_the_schemas_bounds_passes_and_one_beyond_names_its_field() {
        let most: Vec<GpuMemory> = (0..16).map(gpu).collect();
        let longest = "é".repeat(DownloadProgress::MAX_FILE_CHARS);
        assert_eq!(
            telemetry(most.clone(), Some(longest)).check_bounds(),
            Ok(())
        );

        let too_many: Vec<GpuMemory> = (0..17).map(gpu).collect();
        let e = telemetry(too_many, None)
            .check_bounds()
            .expect_err("beyond the bounds");
        assert!(e.starts_with("memory.gpus: 17 entries, at most 16"), "{e}");
        let e = telemetry(vec![gpu(0), gpu(3), gpu(3)], None)
            .check_bounds()
            .expect_err("beyond the bounds");
        assert!(e.contains("index 3 appears twice"), "{e}");
        let too_long = "a".repeat(DownloadProgress::MAX_FILE_CHARS + 1);
        let e = telemetry(most, Some(too_long))
            .check_bounds()
            .expect_err("beyond the bounds");
        assert!(
            e.starts_with("download.file: 1025 characters, at most 1024"),
            "{e}"
        );
        let mut evaluated = telemetry(vec![], None);
        evaluated.eval_loss = Some(0.0);
        assert_eq!(evaluated.check_bounds(), Ok(()));
        evaluated.eval_loss = Some(-0.5);
        let e = evaluated.check_bounds().expect_err("beyond the bounds");
        assert!(e.starts_with("evalLoss: -0.5, at least 0"), "{e}");
    }

    /// The bounds checked at ingest are the schema's own.
    #[test]
    fn the_ingest_bounds_are_the_schemas() {
        let crd = serde_json::to_value(
            <super::super::MemoryAwareTrainingJob as kube::CustomResourceExt>::crd(),
        )
        .expect("crd");
        let entry = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
            ["properties"]["workers"]["items"]["properties"];
        assert_eq!(
            entry["memory"]["properties"]["gpus"]["maxItems"],
            serde_json::json!(MemorySample::MAX_GPUS)
        );
        assert_eq!(
            entry["download"]["properties"]["file"]["maxLength"],
            serde_json::json!(DownloadProgress::MAX_FILE_CHARS)
        );
        assert_eq!(entry["evalLoss"]["minimum"], serde_json::json!(0.0));
    }

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
}
