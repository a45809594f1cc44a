//! `kubectl headroom` — ask Headroom whether a job fits, and how, before any pod runs.
//!
//!     kubectl headroom plan -f job.yaml [--nodes nodes.yaml] [-o table|json|yaml]
//!         [--checkpoint-access-mode ReadWriteOnce|ReadWriteMany]
//!
//! Exit codes: 0 a plan exists, 3 no feasible plan, 1 bad input or cluster error.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Parser, Subcommand, ValueEnum};
use headroom_api::MemoryAwareTrainingJob;
use headroom_operator::controller::CheckpointAccess;
use headroom_operator::inventory::{cpu_inventory, job_inventory};
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
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Plan a job: device type, pipeline split, micro-batch, checkpointing, precision; with the memory breakdown.
    Plan {
        /// Job manifest (YAML; every MemoryAwareTrainingJob document in it is planned).
        #[arg(short = 'f', long = "filename")]
        file: PathBuf,
        /// Nodes to plan against (a NodeList, a List or Node documents). Default: the current cluster.
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
        /// A checkpoint directory: plans from its `config.json`.
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
    let s = sequence_length.context(
        "--sequence-length is needed: the job's manifest has no model.transformer.sequenceLength to take it from",
    )?;
    let shape =
        LlamaShape::from_hf_config(&text, s).with_context(|| format!("{}", path.display()))?;
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
    let gpu_host_memory = headroom_api::quantity::parse_bytes(&gpu_host_memory)
        .map_err(|e| anyhow::anyhow!("--gpu-host-memory {gpu_host_memory:?}: {e} (e.g. 16Gi)"))?;
    let model = ModelOverride {
        config: model_config.or(model_dir.map(|d| d.join("config.json"))),
        sequence_length,
    };
    let jobs = read_jobs(&file)?;
    // Validate every spec before touching the cluster: bad input fails fast and offline.
    let mut requests = Vec::with_capacity(jobs.len());
    for job in &jobs {
        let name = format!(
            "{}/{}",
            job.metadata.namespace.as_deref().unwrap_or("default"),
            job.metadata.name.as_deref().unwrap_or("<unnamed>")
        );
        let mut request = job_request(job, &model, &format!("{}: {name}", file.display()))?;
        request.default_host_baseline(gpu_host_memory);
        requests.push((name, request));
    }
    let needs_cluster = jobs.iter().any(|j| j.spec.resources.gpu.is_some());
    let (cluster_nodes, device_pods) = match (&nodes, needs_cluster) {
        (Some(path), _) => (read_nodes(path)?, vec![]),
        (None, true) => cluster_state()?,
        (None, false) => (vec![], vec![]),
    };
    let one_node = checkpoint_access_mode.stages_share_a_node();
    let mut all_fit = true;
    let mut machine = Vec::new();
    for ((name, request), job) in requests.iter().zip(&jobs) {
        let inventory = job_inventory_as_planned(job, name, &cluster_nodes, &device_pods, one_node);
        let result = plan(request, &inventory);
        all_fit &= result.is_ok();
        match output {
            Output::Table => emit(&match &result {
                Ok(p) => plan_text(name, request, &inventory, p),
                Err(e) => format!("{}\n", infeasible_text(name, e)),
            })?,
            Output::Json | Output::Yaml => machine.push(match &result {
                Ok(p) => serde_json::json!({"job": name, "parameters": request.model.total_params(), "trainableParameters": trainable_params(request), "feasible": true, "plan": p}),
                Err(e) => serde_json::json!({"job": name, "parameters": request.model.total_params(), "trainableParameters": trainable_params(request), "feasible": false, "summary": e.summary, "details": e.details, "waitsFor": e.waits_for}),
            }),
        }
    }
    let doc = if machine.len() == 1 {
        machine.remove(0)
    } else {
        serde_json::Value::Array(machine)
    };
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
    what: &str,
) -> Result<JobRequest> {
    // A model.pretrained job is planned from its checkpoint's config.json.
    if let (Some(pretrained), Some(config)) = (&job.spec.model.pretrained, &model.config) {
        let length = model.sequence_length.unwrap_or(pretrained.sequence_length);
        let ModelShape::Llama(shape) = hf_model(config, Some(length))? else {
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

/// The same inventory the operator plans `job` with: the nodes its workers
/// may be placed on, less held devices, one node's worth when the
/// checkpoint volume is ReadWriteOnce.
fn job_inventory_as_planned(
    job: &MemoryAwareTrainingJob,
    name: &str,
    nodes: &[Node],
    device_pods: &[Pod],
    one_node: bool,
) -> Inventory {
    if job.spec.resources.cpu.is_some() {
        // Node sizes from --nodes; without them the budget is planned
        // as given, and the user is told that nothing checked it.
        cpu_inventory(job, nodes, one_node).unwrap_or_else(|| {
            eprintln!(
                "note: {name}: node sizes not checked (pass --nodes to check that a node can hold the workers)"
            );
            Default::default()
        })
    } else {
        job_inventory(job, nodes, device_pods.iter(), one_node)
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

/// Every MemoryAwareTrainingJob in a (multi-document) YAML file, with field paths in errors.
fn read_jobs(path: &Path) -> Result<Vec<MemoryAwareTrainingJob>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut jobs = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let value = serde_yaml::Value::deserialize(doc)
            .with_context(|| format!("{}: document {} is not valid YAML", path.display(), i + 1))?;
        if value.is_null() {
            continue;
        }
        let kind = value
            .get("kind")
            .and_then(|k| k.as_str())
            .unwrap_or("<no kind>");
        if kind != "MemoryAwareTrainingJob" {
            bail!(
                "{}: document {} is a {kind}; expected kind: MemoryAwareTrainingJob (apiVersion: headroom.dev/v1alpha1)",
                path.display(),
                i + 1
            );
        }
        // As strict as the API server, by the same schema: a mistyped field,
        // a value out of the schema's bounds or a missing required field is
        // an error naming the field, never planned.
        let job = headroom_operator::crd::read_manifest(serde_json::to_value(&value)?)
            .map_err(|e| anyhow!("{}: document {}: {e}", path.display(), i + 1))?;
        jobs.push(job);
    }
    if jobs.is_empty() {
        bail!("{}: no MemoryAwareTrainingJob found", path.display());
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

/// Nodes and non-terminal pods from the current kubeconfig context.
fn cluster_state() -> Result<(Vec<Node>, Vec<Pod>)> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let client = kube::Client::try_default()
            .await
            .map_err(|_| anyhow!("a GPU job needs an inventory: pass --nodes nodes.yaml, or point KUBECONFIG at a cluster"))?;
        let lp = kube::api::ListParams::default();
        let nodes = kube::Api::<Node>::all(client.clone()).list(&lp).await.context("listing nodes")?;
        let pods = kube::Api::<Pod>::all(client)
            .list(&kube::api::ListParams::default().fields("status.phase!=Succeeded,status.phase!=Failed"))
            .await
            .context("listing pods")?;
        Ok((nodes.items, pods.items))
    })
}
