//! `kubectl headroom` — ask Headroom whether a job fits, and how, before any pod runs.
//!
//!     kubectl headroom plan -f job.yaml|- [--nodes nodes.yaml] [-o table|json|yaml]
//!         [--checkpoint-access-mode ReadWriteOnce|ReadWriteMany]
//!         [-n namespace] [--context name] [--kubeconfig file]
//!
//! A job in a Kueue queue is planned within the queue's quota, as the
//! operator plans it; a `model.pretrained.huggingFace` job without
//! `--model-dir` is planned from the config.json its hub holds (hub.rs).
//!
//! Exit codes: 0 a plan exists, 3 no feasible plan, 1 bad input or cluster error.

mod cluster;
mod hub;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Parser, Subcommand, ValueEnum};
use cluster::{ClusterFlags, Target};
use headroom_api::{MemoryAwareTrainingJob, NEEDS_CHECKPOINT_CONFIG};
use headroom_operator::controller::CheckpointAccess;
use headroom_operator::controller::pods::disk_inputs;
use headroom_operator::inventory::cpu_inventory;
use headroom_operator::kueue::{self, QueueOffer, UnreadOffer};
use headroom_operator::plan_text::{
    alternatives_table, infeasible_text, plan_table, trainable_params,
};
use headroom_planner::{Inventory, JobRequest, LlamaShape, ModelShape, Plan, plan};
use k8s_openapi::api::core::v1::{Node, Pod};
use serde::Deserialize;

#[derive(Parser, Debug)]
#[command(
    name = "kubectl-headroom",
    version,
    about = "Memory planning for MemoryAwareTrainingJobs"
)]
struct Cli {
    #[command(flatten)]
    cluster: ClusterFlags,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Plan a job: device type, pipeline split, micro-batch, checkpointing, precision; with the memory breakdown.
    Plan {
        /// Job manifest (YAML; every MemoryAwareTrainingJob document in it
        /// is planned); `-` reads it from standard input.
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// Nodes to plan against (a NodeList, a List or Node documents).
        /// Default: the cluster's, when you may list them.
        #[arg(long)]
        nodes: Option<PathBuf>,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Table)]
        output: Output,
        /// The operator's checkpoint access mode (Helm `checkpoints.accessMode`):
        /// with ReadWriteOnce a job's stages must fit on one node's free GPUs.
        #[arg(long, value_enum, default_value = "ReadWriteOnce")]
        checkpoint_access_mode: CheckpointAccess,
        /// The operator's host memory for GPU workers whose job does not set
        /// resources.gpu.hostMemory (Helm `gpuHostMemory`): the plan adds
        /// what it keeps on the host, and a node must hold the sum.
        #[arg(long, default_value = "16Gi")]
        gpu_host_memory: String,
        /// Plan the model a Hugging Face `config.json` describes (Llama,
        /// Mistral, Qwen2, Qwen3, Phi-3, Gemma 2, Gemma 3) instead of the
        /// manifest's `spec.model`.
        #[arg(long, conflicts_with = "model_dir")]
        model_config: Option<PathBuf>,
        /// A checkpoint directory: plans from its `config.json`. Without
        /// it (or --model-config), a `model.pretrained.huggingFace` job's
        /// config.json is fetched from its hub at its revision's commit,
        /// with the token in HF_TOKEN (sent only to huggingface.co or the
        /// endpoint HF_ENDPOINT names).
        #[arg(long)]
        model_dir: Option<PathBuf>,
        /// Tokens per training sample with --model-config/--model-dir
        /// (default: the manifest's model.transformer.sequenceLength).
        #[arg(long)]
        sequence_length: Option<u32>,
    },
}

/// The model of a Hugging Face config, for a job whose manifest gives
/// `sequence_length` (or none).
fn hf_model(path: &Path, sequence_length: Option<u32>) -> Result<ModelShape> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    hf_model_of(&text, &path.display().to_string(), sequence_length)
}

/// As [`hf_model`], of config.json text from `what` (a path or a repository).
fn hf_model_of(text: &str, what: &str, sequence_length: Option<u32>) -> Result<ModelShape> {
    let s = sequence_length.context(
        "--sequence-length is needed: the job's manifest has no model.transformer.sequenceLength to take it from",
    )?;
    let shape = LlamaShape::from_hf_config(text, s).with_context(|| what.to_string())?;
    Ok(ModelShape::Llama(shape))
}

#[derive(Clone, Copy, Debug, ValueEnum, PartialEq, Eq)]
enum Output {
    Table,
    Json,
    Yaml,
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> Result<ExitCode> {
    let Command::Plan {
        file,
        nodes,
        output,
        checkpoint_access_mode,
        gpu_host_memory,
        model_config,
        model_dir,
        sequence_length,
    } = cli.command;
    let target = Target::from_flags(&cli.cluster)?;
    let gpu_host_memory = headroom_api::quantity::parse_bytes(&gpu_host_memory)
        .map_err(|e| anyhow::anyhow!("--gpu-host-memory {gpu_host_memory:?}: {e} (e.g. 16Gi)"))?;
    let model = ModelOverride {
        config: model_config.or(model_dir.map(|d| d.join("config.json"))),
        sequence_length,
    };
    let source = Source::of(&file);
    let jobs = read_jobs(&source, &source.read()?)?;
    // Validate every spec before touching the cluster: bad input fails fast and offline.
    let mut requests = Vec::with_capacity(jobs.len());
    let mut namespaces = Vec::new();
    let mut queues = Vec::new();
    let hub_env = hub::UserHubEnv::from_env();
    for job in &jobs {
        let job_name = job.metadata.name.as_deref().unwrap_or("<unnamed>");
        let namespace = target
            .job_namespace(job.metadata.namespace.as_deref())
            .with_context(|| format!("{source}: {job_name}"))?;
        let name = format!("{namespace}/{job_name}");
        let mut request = job_request(job, &model, &hub_env, &format!("{source}: {name}"))?;
        request.default_host_baseline(gpu_host_memory);
        requests.push((name, request));
        queues.push(kueue::queue_name(job).map(|q| (namespace.clone(), q.to_string())));
        namespaces.push(namespace);
    }
    namespaces.sort();
    namespaces.dedup();
    let gpu = jobs.iter().any(|j| j.spec.resources.gpu.is_some());
    let cluster = match &nodes {
        Some(path) => ClusterInventory::from_file(read_nodes(path)?),
        None => ClusterInventory::read(&target, gpu, &namespaces)?,
    };
    for note in &cluster.unread {
        eprintln!("note: {note}");
    }
    let offers = QueueOffers::read(&target, &queues);
    let one_node = checkpoint_access_mode.stages_share_a_node();
    let mut all_fit = true;
    let mut machine = Vec::new();
    for (((name, request), job), queue) in requests.iter().zip(&jobs).zip(&queues) {
        let offer = queue.as_ref().map(|q| offers.of(q));
        if let Some(offer) = &offer {
            eprintln!("note: {name}: {}", offer.note());
        }
        let within = offer.as_ref().and_then(QueueRead::offer);
        let inventory = job_inventory_as_planned(job, name, &cluster, within, one_node);
        // What it keeps on its checkpoint claim, as the operator counts
        // it before the initializer has measured anything.
        let inputs = disk_inputs(job, &Default::default());
        let result = plan(request, &inventory).map(|mut p| {
            p.disk = Some(p.disk_needs(&request.model, &inputs));
            p
        });
        all_fit &= result.is_ok();
        match output {
            Output::Table => emit(&match &result {
                Ok(p) => plan_text(name, request, &inventory, p),
                Err(e) => format!("{}\n", infeasible_text(name, e)),
            })?,
            Output::Json | Output::Yaml => machine.push({
                let mut item = match &result {
                    Ok(p) => serde_json::json!({"job": name, "parameters": request.model.total_params(), "trainableParameters": trainable_params(request), "feasible": true, "plan": p}),
                    Err(e) => serde_json::json!({"job": name, "parameters": request.model.total_params(), "trainableParameters": trainable_params(request), "feasible": false, "summary": e.summary, "details": e.details, "waitsFor": e.waits_for}),
                };
                if let Some(offer) = &offer {
                    item["queue"] = offer.json();
                }
                item
            }),
        }
    }
    // One shape for one job or several, as `kubectl get -o json` prints.
    let doc = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": machine});
    match output {
        Output::Json => emit(&format!("{}\n", serde_json::to_string_pretty(&doc)?))?,
        Output::Yaml => emit(&serde_yaml::to_string(&doc)?)?,
        Output::Table => {}
    }
    Ok(if all_fit {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    })
}

/// The model the flags plan with instead of the manifest's: a Hugging Face
/// `config.json` (--model-config, or --model-dir's), at --sequence-length.
struct ModelOverride {
    config: Option<PathBuf>,
    sequence_length: Option<u32>,
}

/// What `job` asks the planner, with the model `model` names when it names
/// one. An invalid spec's error starts with `what` (the file and the job).
fn job_request(
    job: &MemoryAwareTrainingJob,
    model: &ModelOverride,
    hub_env: &hub::UserHubEnv,
    what: &str,
) -> Result<JobRequest> {
    // A model.pretrained job is planned from its checkpoint's config.json:
    // the flags', else its hub's, once the spec is valid without it (an
    // invalid spec is refused offline, without a download).
    if let Some(pretrained) = &job.spec.model.pretrained {
        let length = model.sequence_length.unwrap_or(pretrained.sequence_length);
        let shape = match (&model.config, &pretrained.hugging_face) {
            (Some(config), _) => hf_model(config, Some(length))?,
            (None, Some(source)) => {
                match job.spec.job_request() {
                    Err(e)
                        if e.field == "model.pretrained"
                            && e.problem == NEEDS_CHECKPOINT_CONFIG => {}
                    other => return other.context(what.to_string()),
                }
                let fetched = hub::fetch_config(source, hub_env).with_context(|| {
                    format!("{what}: model.pretrained.huggingFace (or pass --model-dir)")
                })?;
                eprintln!(
                    "note: {what}: planned from config.json of {}{}",
                    fetched.describe,
                    fetched
                        .commit
                        .as_deref()
                        .map(|c| format!(", commit {c}"))
                        .unwrap_or_default()
                );
                hf_model_of(&fetched.text, &fetched.describe, Some(length))?
            }
            // A volume: the spec's error says to pass --model-dir.
            (None, None) => return job.spec.job_request().context(what.to_string()),
        };
        let ModelShape::Llama(shape) = shape else {
            unreachable!("hf_model gives a Llama shape");
        };
        return job
            .spec
            .job_request_for(Some(&shape))
            .context(what.to_string());
    }
    let mut request = job.spec.job_request().context(what.to_string())?;
    if let Some(config) = &model.config {
        let from_manifest = job
            .spec
            .model
            .transformer
            .as_ref()
            .map(|t| t.sequence_length);
        request.model = hf_model(config, model.sequence_length.or(from_manifest))?;
    }
    Ok(request)
}

/// What the jobs are planned against: nodes from --nodes or the cluster,
/// and the pods that hold GPUs there.
struct ClusterInventory {
    /// `Err`: why there are none (no cluster, or the user may not list them).
    nodes: std::result::Result<Vec<Node>, String>,
    device_pods: Vec<Pod>,
    /// What the user's rights kept from the plan, beyond nodes.
    unread: Vec<String>,
}

impl ClusterInventory {
    fn from_file(nodes: Vec<Node>) -> Self {
        ClusterInventory {
            nodes: Ok(nodes),
            device_pods: vec![],
            unread: vec![],
        }
    }

    /// The cluster's nodes and (for `gpu` jobs) pods, as far as the user
    /// may read them. A CPU job plans without a cluster (its budget as
    /// given, said in a note); a GPU job needs nodes to plan on.
    fn read(target: &Target, gpu: bool, namespaces: &[String]) -> Result<Self> {
        const WAY_OUT: &str =
            "pass --nodes nodes.yaml (a NodeList: `kubectl get nodes -o yaml` by someone who may)";
        let state = match target.state(gpu, namespaces) {
            Ok(state) => state,
            Err(e) if gpu => {
                bail!(
                    "a GPU job needs an inventory: {WAY_OUT}, or point KUBECONFIG (or --kubeconfig) at a cluster ({e:#})"
                )
            }
            Err(e) => {
                return Ok(ClusterInventory {
                    nodes: Err(format!("no cluster to read them from ({e:#})")),
                    device_pods: vec![],
                    unread: vec![],
                });
            }
        };
        let (mut unread, nodes) = (state.unread, state.nodes);
        let nodes = match nodes {
            Some(nodes) => Ok(nodes),
            None if gpu => bail!(
                "a GPU job needs an inventory: {}; {WAY_OUT}",
                unread.join("; ")
            ),
            None => Err(unread.remove(0)),
        };
        Ok(ClusterInventory {
            nodes,
            device_pods: state.pods,
            unread,
        })
    }
}

/// The same inventory the operator plans `job` with: the nodes its workers
/// may be placed on, less held devices, one node's worth when the
/// checkpoint volume is ReadWriteOnce, within its Kueue queue's `offer`
/// (crate::kueue, shared with the operator).
fn job_inventory_as_planned(
    job: &MemoryAwareTrainingJob,
    name: &str,
    cluster: &ClusterInventory,
    offer: Option<&QueueOffer>,
    one_node: bool,
) -> Inventory {
    let nodes: Vec<&Node> = cluster
        .nodes
        .as_deref()
        .unwrap_or_default()
        .iter()
        .collect();
    if job.spec.resources.cpu.is_some() {
        let by_nodes = cpu_inventory(job, nodes.iter().copied(), one_node);
        if by_nodes.is_none() {
            // Without node sizes the budget is planned as given, and the
            // user is told that nothing checked it, and why.
            let why = match &cluster.nodes {
                Err(why) => why.as_str(),
                Ok(_) => "no node is known",
            };
            eprintln!(
                "note: {name}: node sizes not checked: {why} (pass --nodes to check that a node can hold the workers)"
            );
        }
        kueue::cpu_inventory_within(job, by_nodes, offer)
    } else {
        let pods: Vec<&Pod> = cluster.device_pods.iter().collect();
        kueue::gpu_inventory_within(job, &nodes, &pods, offer, one_node)
    }
}

/// A Kueue LocalQueue: its namespace and name.
type QueueKey = (String, String);
/// A queue's offer, or why it could not be read.
type ReadOffer = std::result::Result<QueueOffer, UnreadOffer>;

/// The queues the jobs name, as far as the user may read them.
struct QueueOffers {
    /// `Err`: no cluster to read any from.
    read: std::result::Result<Vec<(QueueKey, ReadOffer)>, String>,
}

/// One job's queue, as read.
enum QueueRead<'a> {
    Offer(&'a QueueOffer),
    Unread {
        local: &'a str,
        why: String,
        forbidden: bool,
    },
}

impl QueueOffers {
    /// Reads each queue `queues` names once; nothing when none does.
    fn read(target: &Target, queues: &[Option<QueueKey>]) -> Self {
        let mut wanted: Vec<QueueKey> = queues.iter().flatten().cloned().collect();
        wanted.sort();
        wanted.dedup();
        if wanted.is_empty() {
            return QueueOffers { read: Ok(vec![]) };
        }
        QueueOffers {
            read: target
                .queue_offers(&wanted)
                .map(|offers| wanted.into_iter().zip(offers).collect())
                .map_err(|e| format!("{e:#}")),
        }
    }

    fn of<'a>(&'a self, queue: &'a QueueKey) -> QueueRead<'a> {
        let local = queue.1.as_str();
        match &self.read {
            Err(e) => QueueRead::Unread {
                local,
                why: format!("no cluster to read it from ({e})"),
                forbidden: false,
            },
            Ok(read) => match read.iter().find(|(q, _)| q == queue).map(|(_, r)| r) {
                Some(Ok(offer)) => QueueRead::Offer(offer),
                Some(Err(e)) => QueueRead::Unread {
                    local,
                    why: e.message.clone(),
                    forbidden: e.forbidden,
                },
                None => unreachable!("every named queue is read"),
            },
        }
    }
}

impl QueueRead<'_> {
    fn offer(&self) -> Option<&QueueOffer> {
        match self {
            QueueRead::Offer(offer) => Some(offer),
            QueueRead::Unread { .. } => None,
        }
    }

    /// What the plan took from the queue, or what it assumed and why.
    fn note(&self) -> String {
        match self {
            QueueRead::Offer(offer) => format!(
                "planned within the quota of {} (Kueue admits it when that much is unused)",
                offer.describe()
            ),
            QueueRead::Unread {
                local,
                why,
                forbidden: true,
            } => format!(
                "queue quota not checked: you may not read it ({why}); planned as if LocalQueue {local} gave all the nodes have, and Kueue admits the job only within its quota"
            ),
            QueueRead::Unread { local, why, .. } => format!(
                "queue quota not checked: {why}; planned as if LocalQueue {local} gave all the nodes have"
            ),
        }
    }

    fn json(&self) -> serde_json::Value {
        match self {
            QueueRead::Offer(o) => serde_json::json!({
                "localQueue": o.local_queue, "clusterQueue": o.cluster_queue, "quotaChecked": true,
            }),
            QueueRead::Unread { local, why, .. } => serde_json::json!({
                "localQueue": local, "quotaChecked": false, "why": why,
            }),
        }
    }
}

/// The table output of a job that has plan `p`: the plan, and the others
/// the search weighed against it.
fn plan_text(name: &str, request: &JobRequest, inventory: &Inventory, p: &Plan) -> String {
    let weighed = headroom_planner::alternatives(request, inventory, p);
    let replicas = request.backend().profile().data_parallel;
    let objective = match request.objective {
        headroom_planner::Objective::Fastest if replicas => "objective fastest",
        headroom_planner::Objective::Fastest => {
            "objective fastest, as fewest devices: this backend's worker runs no replicas yet"
        }
        headroom_planner::Objective::FewestGpus => "objective fewest devices",
    };
    format!(
        "{}\n{}",
        plan_table(name, request, p),
        alternatives_table(p, &weighed, objective)
    )
}

/// Writes to stdout. A reader that stopped reading (`… | head`) is not an
/// error: the exit code still says whether every job has a plan (0/3), as
/// documented, instead of a panic (101).
fn emit(text: &str) -> Result<()> {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e.into()),
        _ => Ok(()),
    }
}

/// Where the manifest comes from: a file, or standard input (`-f -`).
enum Source<'a> {
    File(&'a Path),
    Stdin,
}

impl<'a> Source<'a> {
    fn of(path: &'a Path) -> Self {
        if path.as_os_str() == "-" {
            Source::Stdin
        } else {
            Source::File(path)
        }
    }

    fn read(&self) -> Result<String> {
        match self {
            Source::File(path) => std::fs::read_to_string(path)
                .with_context(|| format!("cannot read {}", path.display())),
            Source::Stdin => std::io::read_to_string(std::io::stdin()).context("cannot read stdin"),
        }
    }
}

impl std::fmt::Display for Source<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::File(path) => write!(f, "{}", path.display()),
            Source::Stdin => f.write_str("stdin"),
        }
    }
}

/// Every MemoryAwareTrainingJob in a (multi-document) YAML text from
/// `path`, with field paths in errors.
fn read_jobs(path: &Source, text: &str) -> Result<Vec<MemoryAwareTrainingJob>> {
    let mut jobs = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc)
            .with_context(|| format!("{path}: document {} is not valid YAML", i + 1))?;
        if value.is_null() {
            continue;
        }
        let kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("<no kind>");
        if kind != "MemoryAwareTrainingJob" {
            bail!(
                "{path}: document {} is a {kind}; expected kind: MemoryAwareTrainingJob (apiVersion: headroom.dev/v1alpha1)",
                i + 1
            );
        }
        // As strict as the API server, by the same schema: a mistyped field,
        // a value out of the schema's bounds or a missing required field is
        // an error naming the field, never planned.
        let job = headroom_operator::crd::read_manifest(serde_json::to_value(&value)?)
            .map_err(|e| anyhow!("{path}: document {}: {e}", i + 1))?;
        jobs.push(job);
    }
    if jobs.is_empty() {
        bail!("{path}: no MemoryAwareTrainingJob found");
    }
    Ok(jobs)
}

/// Nodes from a file: a NodeList/List (`items`) or Node documents.
fn read_nodes(path: &Path) -> Result<Vec<Node>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut nodes: Vec<Node> = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc)
            .with_context(|| format!("{}: document {} is not valid YAML", path.display(), i + 1))?;
        let items = match value.get("items") {
            Some(serde_yaml::Value::Sequence(items)) => items.clone(),
            _ if value.is_null() => vec![],
            _ => vec![value],
        };
        for item in items {
            let node: Node = serde_path_to_error::deserialize(item).map_err(|e| {
                anyhow!(
                    "{}: document {}: node field `{}`: {}",
                    path.display(),
                    i + 1,
                    e.path(),
                    e.inner()
                )
            })?;
            nodes.push(node);
        }
    }
    Ok(nodes)
}
