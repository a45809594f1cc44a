//! The planner's view of a spec ([`MemoryAwareTrainingJobSpec::job_request`]),
//! checked offline as the API server checks it: the same fields named, in
//! the CEL rules' words, so `kubectl headroom plan -f` refuses what the API
//! server would. Some checks need what only the planner's side knows (the
//! checkpoint's shape, the backend's base formats).

use headroom_planner::{Backend, JobRequest, LlamaShape, ModelShape, Precision, RetryRung, Target};
use k8s_openapi::api::core::v1::Toleration;

use super::sources::{
    DataSpec, HuggingFaceDataFile, HuggingFaceSource, PretrainedModel, TextFormat, TrainOn,
    VolumePath,
};
use super::spec::{
    CpuResources, GpuResources, LoraSpec, MemoryAwareTrainingJobSpec, QuantizedFormat,
    TrainingMethod, default_lora_targets,
};
use crate::quantity::{parse_bytes, parse_cores};

/// The problem of a valid `model.pretrained` spec planned without its
/// checkpoint's config.json ([`SpecError::problem`], field
/// `model.pretrained`): the checks that need no checkpoint passed, so a
/// caller that can read the config (the plugin, from the hub) plans it
/// with `job_request_for`.
pub const NEEDS_CHECKPOINT_CONFIG: &str = "is planned from the checkpoint's config.json, which the initializer reads; offline, plan it with kubectl headroom plan --model-dir DIR";

/// A spec that cannot be planned, with the field at fault.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("spec.{field}: {problem}")]
pub struct SpecError {
    /// The field's path under `spec`, list indices included (`memoryPolicy.allowedRungs[2]`).
    pub field: std::borrow::Cow<'static, str>,
    pub problem: String,
}

impl SpecError {
    pub fn new(
        field: impl Into<std::borrow::Cow<'static, str>>,
        problem: impl Into<String>,
    ) -> Self {
        spec_error(field, problem)
    }
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
    /// Whether `endpoint` may be used: `https://`, or `http://` with
    /// `allowInsecureHttp: true` beside it.
    pub fn check_endpoint(&self) -> Result<(), SpecError> {
        check_endpoint(
            self.endpoint.as_deref(),
            self.allow_insecure_http,
            "model.pretrained.huggingFace.endpoint",
        )
    }
}

/// The CEL message of a hub data source naming both files and a split.
const FILE_OR_SPLIT: &str = "file names the files itself; split and subset pick them by the dataset's layout (its README's configs, data/<split>-*): set file, or split (and subset)";

impl HuggingFaceDataFile {
    /// Whether `endpoint` may be used: `https://`, or `http://` with
    /// `allowInsecureHttp: true` beside it.
    pub fn check_endpoint(&self) -> Result<(), SpecError> {
        check_endpoint(
            self.endpoint.as_deref(),
            self.allow_insecure_http,
            "data.huggingFace.endpoint",
        )
    }

    /// The CEL rules on `file`, offline: a path (or glob) inside the
    /// repository, a format Headroom reads, and not beside `split`/`subset`.
    fn check_file(&self) -> Result<(), SpecError> {
        let Some(file) = self.file.as_deref() else {
            return Ok(());
        };
        if self.split.is_some() || self.subset.is_some() {
            return Err(spec_error("data.huggingFace", FILE_OR_SPLIT));
        }
        if file.starts_with('/')
            || file
                .split('/')
                .any(|p| p.is_empty() || p == "." || p == "..")
        {
            return Err(spec_error(
                "data.huggingFace.file",
                "is a path or glob pattern inside the repository (e.g. data/train.jsonl, data/train-*.parquet), without a leading '/', '.' or '..'",
            ));
        }
        if file.ends_with(".arrow") {
            return Err(spec_error(
                "data.huggingFace.file",
                "must be JSONL (format: jsonl), Parquet (format: parquet) or plain text (format: text); Headroom does not read Arrow files: pick the dataset's Parquet shard",
            ));
        }
        Ok(())
    }
}

impl DataSpec {
    /// The CEL rule on `trainOn`, offline: a text file has no prompts or
    /// turns to leave out.
    fn check_train_on(&self) -> Result<(), SpecError> {
        if self.format == TextFormat::Text
            && matches!(self.train_on, TrainOn::Assistant | TrainOn::Completion)
        {
            return Err(spec_error("data.trainOn", TRAIN_ON_TEXT));
        }
        Ok(())
    }
}

/// Why `trainOn: assistant` or `completion` cannot go with `format: text`.
const TRAIN_ON_TEXT: &str = "assistant and completion need JSONL or Parquet rows (conversations, prompt/completion pairs); a text file is plain text: use trainOn auto or all";

impl VolumePath {
    /// The CEL rule on [`VolumePath`], offline: `field` names where this
    /// path is.
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

impl MemoryAwareTrainingJobSpec {
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
        pretrained: Option<&LlamaShape>,
    ) -> Result<JobRequest, SpecError> {
        self.check_training_rules()?;
        let model = match &self.model.pretrained {
            Some(p) => self.pretrained_model(p, pretrained)?,
            None => self.model_from_scratch()?,
        };
        self.request_for_model(model)
    }

    /// The CEL rules on `training` that need no checkpoint (the recipe, an
    /// nf4 base's block size), offline.
    fn check_training_rules(&self) -> Result<(), SpecError> {
        let t = &self.training;
        if let Some(lora) = t
            .lora
            .as_ref()
            .filter(|_| t.method == TrainingMethod::Qlora)
        {
            check_nf4_block_size(lora)?;
        }
        if t.steps.is_some() == t.epochs.is_some() {
            return Err(spec_error(
                "training",
                "give the run's length as steps (optimizer steps) or as epochs (passes over spec.data), exactly one of them",
            ));
        }
        if t.epochs.is_some_and(|e| e <= 0.0) {
            return Err(spec_error(
                "training.epochs",
                "must be above 0 (e.g. 3, or 0.5 for half the data)",
            ));
        }
        if let Some(s) = &t.schedule {
            if s.warmup_steps.is_some() && s.warmup_ratio.is_some() {
                return Err(spec_error(
                    "training.schedule",
                    "warmupSteps and warmupRatio both set; give the warmup in steps or as a share of the run (e.g. warmupRatio: 0.03), not both",
                ));
            }
            if s.min_learning_rate.is_some_and(|m| m > t.learning_rate) {
                return Err(spec_error(
                    "training.schedule.minLearningRate",
                    "above training.learningRate, the peak; the decay ends at the minimum, so set it below the peak (e.g. a tenth of it)",
                ));
            }
        }
        if t.epochs.is_some() && self.data.is_none() {
            return Err(spec_error(
                "training.epochs",
                "an epoch is a pass over spec.data, and this job has none (the synthetic task never ends); set training.steps instead",
            ));
        }
        Ok(())
    }

    /// The shape of a `model.pretrained` job's checkpoint (`read`: from its
    /// config.json), at the spec's sequence length, once the job's sources
    /// and adapters are checked.
    fn pretrained_model(
        &self,
        p: &PretrainedModel,
        read: Option<&LlamaShape>,
    ) -> Result<ModelShape, SpecError> {
        if self.model.transformer.is_some() || self.model.generic.is_some() {
            return Err(spec_error(
                "model",
                "set exactly one of model.pretrained, model.transformer or model.generic",
            ));
        }
        self.check_pretrained_sources(p)?;
        let Some(shape) = read else {
            return Err(spec_error("model.pretrained", NEEDS_CHECKPOINT_CONFIG));
        };
        let mut shape = shape.clone();
        shape.sequence_length = p.sequence_length;
        // The initializer's report was checked when it came; a status
        // written before that check is held to the same bounds here.
        shape
            .check_bounds()
            .map_err(|e| spec_error("model.pretrained", format!("the checkpoint's {e}")))?;
        self.check_adapters_fit(&shape)?;
        Ok(ModelShape::Llama(shape))
    }

    /// Where a `model.pretrained` job's checkpoint, text and output are: the
    /// CEL rules on the sources, for offline checks (the API server holds
    /// them too).
    fn check_pretrained_sources(&self, p: &PretrainedModel) -> Result<(), SpecError> {
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
            hf.check_file()?;
        }
        data.check_train_on()?;
        Ok(())
    }

    /// The model of a job that does not start from a checkpoint:
    /// `model.transformer` (trained from random weights) or `model.generic`
    /// (planned only), with full training and none of a pretrained job's
    /// fields.
    fn model_from_scratch(&self) -> Result<ModelShape, SpecError> {
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
        match (&self.model.transformer, &self.model.generic) {
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
                Ok(ModelShape::Transformer(t.clone()))
            }
            (None, Some(g)) => Ok(ModelShape::Generic(g.clone())),
            _ => Err(spec_error(
                "model",
                "set exactly one of model.pretrained, model.transformer or model.generic",
            )),
        }
    }

    /// The planner's request for `model`: every check that does not depend
    /// on the model's kind, in the order the offline errors come.
    fn request_for_model(&self, model: ModelShape) -> Result<JobRequest, SpecError> {
        self.check_batch()?;
        let target = self.target()?;
        self.check_pinned_stages(&target, &model)?;
        self.check_pinned_replicas(&target)?;
        let backend = self.backend();
        self.check_backend(backend)?;
        self.check_tolerations()?;
        let allowed_rungs = self.allowed_rungs()?;
        self.check_node_selector()?;
        self.check_pod_settings()?;
        let (adapters, base_format) = self.adapters(backend)?;
        let t = &self.training;
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

    /// The global batch, the micro-batch that must divide it, and the
    /// headroom fraction's range.
    fn check_batch(&self) -> Result<(), SpecError> {
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
        Ok(())
    }

    /// Where the job runs, as the planner takes it: `resources.gpu` or
    /// `resources.cpu`, its quantities parsed and bounded.
    fn target(&self) -> Result<Target, SpecError> {
        match (&self.resources.gpu, &self.resources.cpu) {
            (Some(g), None) => gpu_target(g),
            (None, Some(c)) => self.cpu_target(c),
            _ => Err(spec_error(
                "resources",
                "set exactly one of resources.gpu or resources.cpu",
            )),
        }
    }

    /// A CPU job's target; a generic model runs on one worker only.
    fn cpu_target(&self, c: &CpuResources) -> Result<Target, SpecError> {
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
        Ok(Target::Cpu {
            memory_limit_bytes: limit,
            max_workers: c.max_workers.max(1),
        })
    }

    /// A pinned stage count: within the worker cap and the model's layers.
    fn check_pinned_stages(&self, target: &Target, model: &ModelShape) -> Result<(), SpecError> {
        let Some(n) = self.training.pipeline_stages else {
            return Ok(());
        };
        let (max, field) = worker_cap(target);
        let layers = model.splittable_layers();
        if n > max || n > layers {
            return Err(spec_error(
                "training.pipelineStages",
                format!(
                    "{n} stages: at most {field} ({max}) and the model's layers ({layers}); raise {field} or pin fewer stages"
                ),
            ));
        }
        Ok(())
    }

    /// A pinned replica count: it divides the global batch, its share is
    /// divided by the micro-batch, and stages × replicas fit the worker cap.
    fn check_pinned_replicas(&self, target: &Target) -> Result<(), SpecError> {
        let t = &self.training;
        let Some(d) = t.data_parallel_replicas else {
            return Ok(());
        };
        let (max, field) = worker_cap(target);
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
        Ok(())
    }

    /// The backend matches the resources (cuda for a GPU job, flex for a
    /// CPU job), and the CPU backend trains in fp32.
    fn check_backend(&self, backend: Backend) -> Result<(), SpecError> {
        if (backend == Backend::Cuda) != self.resources.gpu.is_some() {
            return Err(spec_error(
                "worker.backend",
                "must be 'cuda' for a GPU job (resources.gpu) and 'flex' for a CPU job (resources.cpu)",
            ));
        }
        if backend == Backend::Flex && self.training.precision != Precision::Fp32 {
            return Err(spec_error(
                "training.precision",
                "the CPU backend (flex) trains in fp32 only; set precision: fp32",
            ));
        }
        Ok(())
    }

    /// The worker pods' tolerations, as the CEL rules on them check them.
    fn check_tolerations(&self) -> Result<(), SpecError> {
        for (i, t) in self.worker.tolerations.iter().enumerate() {
            if let Some(problem) = toleration_problem(t) {
                return Err(spec_error(
                    "worker.tolerations",
                    format!("toleration {i}: {problem}"),
                ));
            }
        }
        Ok(())
    }

    /// The allowed rungs, each listed once: a list-type set, so the API
    /// server refuses a rung listed twice (`Duplicate value`); so does the
    /// offline check, in its words.
    fn allowed_rungs(&self) -> Result<Vec<RetryRung>, SpecError> {
        let allowed_rungs = self.memory_policy.allowed_rungs.clone();
        for (i, rung) in allowed_rungs.iter().enumerate() {
            if allowed_rungs[..i].contains(rung) {
                return Err(spec_error(
                    format!("memoryPolicy.allowedRungs[{i}]"),
                    format!("Duplicate value: \"{rung}\""),
                ));
            }
        }
        Ok(allowed_rungs)
    }

    /// The CEL rules on the pod settings, offline: the operator's own
    /// variables, labels and annotations stay its own, and a variable has
    /// one source.
    fn check_pod_settings(&self) -> Result<(), SpecError> {
        let worker = &self.worker;
        if worker.env.iter().any(|e| {
            e.name.starts_with("HEADROOM_")
                || ["POD_NAME", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES"].contains(&e.name.as_str())
        }) {
            return Err(spec_error(
                "worker.env",
                "HEADROOM_*, POD_NAME, MALLOC_ARENA_MAX and GLIBC_TUNABLES are set by the operator (the worker's assignment, identity and allocator); pick another name",
            ));
        }
        if worker
            .env
            .iter()
            .any(|e| e.value.is_some() == e.value_from.is_some())
        {
            return Err(spec_error(
                "worker.env",
                "each variable has a value or a valueFrom, one of the two",
            ));
        }
        self.check_env_from_and_volumes()?;
        for (field, keys, problem) in [
            (
                "worker.podLabels",
                &worker.pod_labels,
                "the headroom.dev/ prefix is the operator's (it finds a job's pods by these labels); pick another key",
            ),
            (
                "worker.podAnnotations",
                &worker.pod_annotations,
                "the headroom.dev/ prefix is the operator's; pick another key",
            ),
        ] {
            if keys.keys().any(|k| k.starts_with("headroom.dev/")) {
                return Err(spec_error(field, problem));
            }
        }
        Ok(())
    }

    /// The CEL rules on `envFrom`, `volumes` and `volumeMounts`, offline,
    /// in their order: ConfigMaps only, no hostPath, one source a volume,
    /// the operator's names and mounts left alone, each name and path once.
    fn check_env_from_and_volumes(&self) -> Result<(), SpecError> {
        use super::spec::{RESERVED_MOUNT_PATHS, RESERVED_VOLUME_NAMES, RESERVED_VOLUME_PREFIXES};
        let worker = &self.worker;
        let refuse = |field: &'static str, problem: &str| Err(spec_error(field, problem));
        if worker.env_from.iter().any(|e| e.secret_ref.is_some()) {
            return refuse(
                "worker.envFrom",
                "secretRef is not offered: a job's tokens go through tokenSecret (model.pretrained.huggingFace, data.huggingFace), which the chart's policy checks against the job author's rights; use configMapRef for settings",
            );
        }
        if worker.env_from.iter().any(|e| e.config_map_ref.is_none()) {
            return refuse(
                "worker.envFrom",
                "each entry names a ConfigMap (configMapRef.name)",
            );
        }
        let volumes = &worker.volumes;
        if volumes.iter().any(|v| v.host_path.is_some()) {
            return refuse(
                "worker.volumes",
                "hostPath is refused (a node's own files are no job's to read or write, and the pods run under the restricted Pod Security profile, which forbids it); use a persistentVolumeClaim, a configMap or an emptyDir",
            );
        }
        if volumes.iter().any(|v| {
            usize::from(v.config_map.is_some())
                + usize::from(v.persistent_volume_claim.is_some())
                + usize::from(v.empty_dir.is_some())
                != 1
        }) {
            return refuse(
                "worker.volumes",
                "each volume has one source: configMap, persistentVolumeClaim or emptyDir",
            );
        }
        if volumes.iter().any(|v| {
            RESERVED_VOLUME_NAMES.contains(&v.name.as_str())
                || RESERVED_VOLUME_PREFIXES
                    .iter()
                    .any(|p| v.name.starts_with(p))
        }) {
            return refuse(
                "worker.volumes",
                "checkpoints, tmp, worker-api-token, claim-* and headroom-* are the operator's volume names; pick another name",
            );
        }
        if volumes
            .iter()
            .any(|v| volumes.iter().filter(|w| w.name == v.name).count() != 1)
        {
            return refuse(
                "worker.volumes",
                "two volumes have one name; name each once",
            );
        }
        let mounts = &worker.volume_mounts;
        if mounts
            .iter()
            .any(|m| !volumes.iter().any(|v| v.name == m.name))
        {
            return refuse(
                "worker.volumeMounts",
                "each mount names one of worker.volumes; add the volume there, or fix the mount's name",
            );
        }
        if mounts
            .iter()
            .any(|m| m.mount_path.split('/').any(|s| s == "." || s == ".."))
        {
            return refuse(
                "worker.volumeMounts",
                "mountPath has a . or .. segment; give the plain absolute path, e.g. /mnt/ca",
            );
        }
        let collides = |path: &str, reserved: &str| {
            path == reserved
                || path.starts_with(&format!("{reserved}/"))
                || reserved.starts_with(&format!("{path}/"))
        };
        if mounts.iter().any(|m| {
            RESERVED_MOUNT_PATHS
                .iter()
                .any(|r| collides(&m.mount_path, r))
        }) {
            return refuse(
                "worker.volumeMounts",
                "mountPath is on, in or above one of the operator's mounts (/var/lib/headroom: checkpoints and claims; /var/run/secrets/headroom.dev: its token; /tmp: scratch; /dev); mount elsewhere, e.g. under /mnt",
            );
        }
        if mounts.iter().any(|m| {
            mounts
                .iter()
                .filter(|n| n.mount_path == m.mount_path)
                .count()
                != 1
        }) {
            return refuse(
                "worker.volumeMounts",
                "two mounts at one mountPath; give each its own",
            );
        }
        Ok(())
    }

    /// The node selector leaves the GPU product to Headroom.
    fn check_node_selector(&self) -> Result<(), SpecError> {
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
        Ok(())
    }

    /// What only the checkpoint's shape decides about the adapters: the
    /// targets must be modules of its architecture (Phi-3 fuses q/k/v and
    /// gate/up), an adapter on a tied head would change the embedding too
    /// (PEFT allows it; Headroom's worker does not), and a quantized base
    /// needs a block size that divides every block linear's output size
    /// (burn quantizes whole blocks only).
    fn check_adapters_fit(&self, shape: &LlamaShape) -> Result<(), SpecError> {
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
        if t.method == TrainingMethod::Qlora {
            check_qlora_block_size(&lora, shape)?;
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

/// An nf4 base's block size is bitsandbytes', whatever the checkpoint (the
/// API server's CEL rule on `training`).
fn check_nf4_block_size(lora: &LoraSpec) -> Result<(), SpecError> {
    let nf4 = lora.base_format.unwrap_or(QuantizedFormat::Nf4) == QuantizedFormat::Nf4;
    let nf4_block = headroom_planner::memory::NF4_BLOCK;
    if nf4 && u64::from(lora.block_size) != nf4_block {
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
    Ok(())
}

/// A QLoRA base's block size: nf4 takes bitsandbytes' blocks only; int8 and
/// int4 need one of at most 255 that divides every block linear's output
/// size (burn quantizes whole blocks only).
fn check_qlora_block_size(lora: &LoraSpec, shape: &LlamaShape) -> Result<(), SpecError> {
    check_nf4_block_size(lora)?;
    if lora.base_format.unwrap_or(QuantizedFormat::Nf4) == QuantizedFormat::Nf4 {
        return Ok(());
    }
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
        let common = outputs.iter().fold(0u64, |a, &b| gcd(a, b));
        let fits: Vec<String> = (1..=common.min(255))
            .rev()
            .filter(|b| common % b == 0)
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
    Ok(())
}

/// The greatest common divisor of `a` and `b` (`b` when `a` is 0).
fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// A GPU job's target, its host memory parsed and at least 64Mi, its
/// workers' cores a CPU quantity above zero.
fn gpu_target(g: &GpuResources) -> Result<Target, SpecError> {
    if let Some(cores) = &g.cores {
        parse_cores(&cores.0).map_err(|e| spec_error("resources.gpu.cores", e))?;
    }
    let mut host_baseline_bytes = None;
    if let Some(host) = &g.host_memory {
        let bytes = parse_bytes(&host.0).map_err(|e| spec_error("resources.gpu.hostMemory", e))?;
        if bytes < 64 << 20 {
            return Err(spec_error(
                "resources.gpu.hostMemory",
                "must be at least 64Mi, e.g. 32Gi",
            ));
        }
        host_baseline_bytes = Some(bytes);
    }
    Ok(Target::Gpu {
        allowed_types: g.types.clone(),
        max_gpus: g.max_gpus.max(1),
        host_baseline_bytes,
    })
}

/// The most workers `target` allows, and the field that says so.
fn worker_cap(target: &Target) -> (u32, &'static str) {
    match target {
        Target::Gpu { max_gpus, .. } => (*max_gpus, "resources.gpu.maxGpus"),
        Target::Cpu { max_workers, .. } => (*max_workers, "resources.cpu.maxWorkers"),
    }
}

/// What is wrong with a toleration, in the words of the CEL rules on
/// `worker.tolerations`; `None` when nothing is.
fn toleration_problem(t: &Toleration) -> Option<&'static str> {
    let operator = t.operator.as_deref().unwrap_or("Equal");
    if !["Equal", "Exists"].contains(&operator) {
        Some("operator must be Equal or Exists")
    } else if !["", "NoSchedule", "PreferNoSchedule", "NoExecute"]
        .contains(&t.effect.as_deref().unwrap_or(""))
    {
        Some("effect must be NoSchedule, PreferNoSchedule, NoExecute or empty (all effects)")
    } else if operator == "Exists" && !t.value.as_deref().unwrap_or("").is_empty() {
        Some("Exists takes no value")
    } else if operator == "Equal" && t.key.as_deref().unwrap_or("").is_empty() {
        Some("Equal (the default) needs a key")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::MemoryAwareTrainingJob;

    /// A manifest of the invalid-manifest corpus, as text.
    fn corpus_text(file: &str) -> String {
        let path = format!(
            "{}/../../e2e/testdata/invalid/{file}",
            env!("CARGO_MANIFEST_DIR")
        );
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"))
    }

    fn invalid_manifest(file: &str) -> MemoryAwareTrainingJob {
        serde_yaml::from_str(&corpus_text(file)).unwrap_or_else(|e| panic!("{file}: {e}"))
    }

    /// What the API server's refusal of a corpus manifest says (its
    /// `# expect:` line).
    fn corpus_expect(file: &str) -> String {
        corpus_text(file)
            .lines()
            .find_map(|l| l.strip_prefix("# expect: "))
            .expect("expect line")
            .to_string()
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
            let expect = corpus_expect(file);
            let err = invalid_manifest(file)
                .spec
                .job_request_for(Some(&shape))
                .expect_err(file);
            assert_eq!(err.field, field, "{file}");
            assert_eq!(format!("{field}: {}", err.problem), expect, "{file}");
        }
    }

    /// An Arrow file from the hub, and assistant- or completion-only loss
    /// on a text file, are refused offline with the API server's words and
    /// the CRD's CEL message; a Parquet file and trainOn on rows pass.
    #[test]
    fn data_the_worker_cannot_read_as_asked_is_refused_offline() {
        let shape = tiny_llama();
        let crd =
            serde_json::to_string(&<MemoryAwareTrainingJob as kube::CustomResourceExt>::crd())
                .expect("crd");
        for (file, field) in [
            ("42-data-arrow.yaml", "data.huggingFace.file"),
            ("56-data-train-on-text.yaml", "data.trainOn"),
            ("60-data-file-and-split.yaml", "data.huggingFace"),
        ] {
            let expect = corpus_expect(file);
            let job = invalid_manifest(file);
            let err = job.spec.job_request_for(Some(&shape)).expect_err(file);
            assert_eq!(err.field, field, "{file}");
            assert_eq!(format!("{field}: {}", err.problem), expect, "{file}");
            assert!(crd.contains(&expect), "{file}: the CRD's CEL message");
        }
        let mut spec = invalid_manifest("42-data-arrow.yaml").spec;
        if let Some(hf) = spec.data.as_mut().and_then(|d| d.hugging_face.as_mut()) {
            hf.file = Some("data/train-00000-of-00001.parquet".into());
        }
        spec.job_request_for(Some(&shape))
            .expect("a Parquet file is read");
        let mut spec = invalid_manifest("60-data-file-and-split.yaml").spec;
        if let Some(hf) = spec.data.as_mut().and_then(|d| d.hugging_face.as_mut()) {
            hf.file = None;
        }
        spec.job_request_for(Some(&shape))
            .expect("a split alone picks the files");
        let mut spec = invalid_manifest("56-data-train-on-text.yaml").spec;
        if let Some(data) = spec.data.as_mut() {
            data.format = TextFormat::Jsonl;
        }
        spec.job_request_for(Some(&shape))
            .expect("assistant turns of JSONL rows");
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
            let expect = corpus_expect(file);
            let job = invalid_manifest(file);
            let err = job.spec.job_request_for(Some(&shape)).expect_err(file);
            assert_eq!(err.field, field, "{file}");
            assert_eq!(format!("{field}: {}", err.problem), expect, "{file}");
            assert!(crd.contains(&expect), "{file}: the CRD's CEL message");
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

    /// A stored checkpoint shape beyond spec.model.transformer's bounds (a
    /// status written before reports were checked) is refused, not planned.
    #[test]
    fn a_checkpoint_shape_beyond_the_bounds_is_not_planned() {
        let mut shape = tiny_llama();
        shape.layers = 40_000_000;
        let mut spec = invalid_manifest("45-lora-dropout.yaml").spec;
        spec.training.lora = None;
        let e = spec.job_request_for(Some(&shape)).expect_err("refused");
        assert_eq!(e.field, "model.pretrained");
        assert!(
            e.problem
                .contains("num_hidden_layers: 40000000 exceeds 1024"),
            "{e}"
        );
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
    /// The user's volumes and ConfigMap variables: what the API server
    /// refuses (a hostPath, a Secret's keys, a mount over the operator's)
    /// is refused offline in the CEL rules' words.
    #[test]
    fn volumes_and_env_from_are_refused_offline_with_the_api_servers_words() {
        let crd =
            serde_json::to_string(&<MemoryAwareTrainingJob as kube::CustomResourceExt>::crd())
                .expect("crd");
        for (file, field) in [
            ("61-worker-volume-host-path.yaml", "worker.volumes"),
            ("62-worker-env-from-secret.yaml", "worker.envFrom"),
            (
                "63-worker-mount-over-checkpoints.yaml",
                "worker.volumeMounts",
            ),
        ] {
            let expect = corpus_expect(file);
            let err = invalid_manifest(file).spec.job_request().expect_err(file);
            assert_eq!(err.field, field, "{file}");
            assert_eq!(format!("{field}: {}", err.problem), expect, "{file}");
            assert!(crd.contains(&expect), "{file}: the CRD's CEL message");
        }
    }
}
