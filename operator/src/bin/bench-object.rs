//! What one job object costs kube-apiserver: CPU per
//! create, per whole-status write and per telemetry write (as a merge patch,
//! and as the operator's flusher sends it: a server-side apply), and the object's
//! stored size, for the MemoryAwareTrainingJob in the shape Headroom stored
//! before the plan was stored once (each attempt with its whole plan, under
//! the CRD of then: operator/tests/fixtures/crd-attempts-with-plan.yaml),
//! in the lean shape with the spec's CEL rules in the CRD (as shipped until
//! they moved), the lean shape as shipped (the CRD without rules, the rules
//! in their ValidatingAdmissionPolicy, `headroom_api::admission`), and,
//! given its CRD, a PyTorchJob as Kubeflow's training-operator writes it.
//!
//!   KUBECONFIG=~/.cache/headroom/state/controlplane/kubeconfig \
//!     bench-object --objects 300 --rounds 3 [--pytorchjob-crd <kubeflow.org_pytorchjobs.yaml>]
//!
//! (`make bench-object` does both.) kube-apiserver's CPU is read from
//! /proc around each phase, less its idle rate measured just before; the
//! requests go 4 at a time over one client. Rounds interleave the variants;
//! the figures are medians over rounds (range). The job is the CPU sample
//! that is OOM-killed first, with the status the operator keeps after its
//! retry: two attempts, four conditions, one worker's telemetry.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use futures::{StreamExt, TryStreamExt, stream};
use headroom_api::admission;
use headroom_api::{
    Attempt, AttemptOutcome, JobPhase, MemoryAwareTrainingJob, MemoryAwareTrainingJobStatus,
    MemorySample, WorkerTelemetry,
};
use headroom_planner::{Inventory, Plan, RetryRung};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, ListParams, Patch,
    PatchParams, PostParams,
};
use kube::{Client, CustomResourceExt};
use serde_json::{Value, json};

const OLD_CRD: &str = include_str!("../../tests/fixtures/crd-attempts-with-plan.yaml");
const SAMPLE: &str = include_str!("../../../samples/cpu-oom-first.yaml");
const FIELD_MANAGER: &str = "headroom-bench-object";
const TELEMETRY_FIELD_MANAGER: &str = "headroom-telemetry/bench-object";
const IN_FLIGHT: usize = 4;

#[derive(Parser)]
#[command(about = "kube-apiserver CPU per create and status write of one job object, by shape")]
struct Args {
    /// Objects per variant and round.
    #[arg(long, default_value_t = 300)]
    objects: usize,
    /// Rounds (the variants interleaved in each).
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Kubeflow's PyTorchJob CRD (training-operator's
    /// manifests/base/crds/kubeflow.org_pytorchjobs.yaml): adds it as a variant.
    #[arg(long)]
    pytorchjob_crd: Option<PathBuf>,
    /// kube-apiserver's pid file (default: the loopback control plane's).
    #[arg(long)]
    apiserver_pid_file: Option<PathBuf>,
    /// Also write, per variant, a CPU profile of kube-apiserver taken over
    /// `--profile-seconds` of whole-status writes (round 1) into this
    /// directory (`go tool pprof -top <file>`).
    #[arg(long)]
    profile_dir: Option<PathBuf>,
    #[arg(long, default_value_t = 15)]
    profile_seconds: u32,
}

/// CPU seconds a process has used (user + system), from /proc.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

/// A kind of object under test: its CRD (or none for a built-in), how to
/// make one, its status, and a telemetry-sized status patch.
struct Variant {
    name: &'static str,
    crd: Option<CustomResourceDefinition>,
    /// A ValidatingAdmissionPolicy (and its binding) in force while it runs.
    policy: Option<(Value, Value)>,
    resource: ApiResource,
    object: Value,
    status: Value,
    telemetry_patch: Value,
}

/// The sample job's status after its OOM retry, as the operator keeps it.
fn job_status(plan1: &Plan, plan2: &Plan) -> MemoryAwareTrainingJobStatus {
    let t = Time(jiff::Timestamp::from_second(1_795_000_000).expect("time"));
    let mut first = Attempt::start(1, plan1, Some(t.clone()));
    first.outcome = AttemptOutcome::HostOutOfMemory;
    first.reason = Some("OOMKilled".into());
    first.message = Some("container worker was OOM-killed at its memory limit".into());
    first.finished_at = Some(t.clone());
    first.observed_peak_bytes = Some(plan1.device_memory_bytes);
    first.last_step = Some(3);
    let second = Attempt::start(2, plan2, Some(t.clone()));
    let condition = |type_: &str, status: &str, reason: &str, message: &str| Condition {
        type_: type_.into(),
        status: status.into(),
        reason: reason.into(),
        message: message.into(),
        last_transition_time: t.clone(),
        observed_generation: Some(1),
    };
    MemoryAwareTrainingJobStatus {
        phase: Some(JobPhase::Running),
        observed_generation: Some(1),
        conditions: vec![
            condition("Planned", "True", "Replanned", &plan2.fit),
            condition("Running", "True", "WorkersRunning", "attempt 2"),
            condition("Waiting", "False", "Admitted", "capacity found"),
            condition("Complete", "False", "Running", "attempt 2 running"),
        ],
        attempt: Some(2),
        plan: Some(plan2.clone()),
        attempts: vec![first, second],
        workers: vec![worker(2, 10)],
        message: Some("attempt 2: 1 worker(s) running".into()),
        ..Default::default()
    }
}

fn worker(attempt: u32, step: u64) -> WorkerTelemetry {
    WorkerTelemetry {
        name: format!("oom-then-fit-a{attempt}-s0"),
        attempt,
        stage: 0,
        layer_start: 0,
        layer_end: 4,
        step,
        loss: Some(4.2),
        eval_loss: None,
        tokens_per_second: Some(1234.5),
        memory: MemorySample {
            cgroup_current_bytes: Some(180 << 20),
            cgroup_peak_bytes: Some(190 << 20),
            process_rss_bytes: Some(170 << 20),
            allocator_in_use_bytes: Some(150 << 20),
            allocator_reserved_bytes: Some(160 << 20),
            gpus: vec![],
            peak_bytes: 190 << 20,
        },
        download: None,
        stepped_down: None,
        updated_at: Time(jiff::Timestamp::from_second(1_795_000_100).expect("time")),
    }
}

/// The same status in the shape stored before: each attempt with its whole plan.
fn old_shape(status: &MemoryAwareTrainingJobStatus, plans: &[&Plan]) -> Result<Value> {
    let mut v = serde_json::to_value(status)?;
    for (a, plan) in v["attempts"]
        .as_array_mut()
        .context("attempts")?
        .iter_mut()
        .zip(plans)
    {
        let obj = a.as_object_mut().context("attempt")?;
        for key in [
            "device",
            "deviceMemoryBytes",
            "workers",
            "stages",
            "settings",
            "predictedPeakBytes",
            "budgetBytes",
            "rungsApplied",
        ] {
            obj.remove(key);
        }
        obj.insert("plan".into(), serde_json::to_value(plan)?);
    }
    Ok(v)
}

/// The shipped policy's name: the bench takes it out for the variants
/// without it and puts the shipped one back when it is done.
const SPEC_POLICY: &str = admission::SPEC_RULES_POLICY;

/// The shipped ValidatingAdmissionPolicy with the spec's rules, and its binding.
fn shipped_policy() -> Result<(Value, Value)> {
    Ok((
        serde_json::to_value(admission::spec_rules_policy())?,
        serde_json::to_value(admission::spec_rules_binding())?,
    ))
}

fn variants(args: &Args) -> Result<Vec<Variant>> {
    let sample: MemoryAwareTrainingJob = serde_yaml::from_str(SAMPLE)?;
    let request = sample
        .spec
        .job_request()
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let inventory = Inventory::default();
    let plan1 = headroom_planner::plan(&request, &inventory).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut plan2 = plan1.clone();
    plan2.settings.activation_checkpointing = true;
    plan2.rungs_applied = vec![RetryRung::ActivationCheckpointing];
    let status = job_status(&plan1, &plan2);
    let job = json!({
        "apiVersion": "headroom.dev/v1alpha1",
        "kind": "MemoryAwareTrainingJob",
        "metadata": {},
        "spec": serde_json::to_value(&sample.spec)?,
    });
    let telemetry = json!({"status": {"workers": [serde_json::to_value(worker(2, 20))?]}});
    let matj = ApiResource::erase::<MemoryAwareTrainingJob>(&());
    let mut out = vec![
        Variant {
            name: "headroom, attempts with their plan (before)",
            crd: Some(serde_yaml::from_str(OLD_CRD)?),
            policy: None,
            resource: matj.clone(),
            object: job.clone(),
            status: old_shape(&status, &[&plan1, &plan2])?,
            telemetry_patch: telemetry.clone(),
        },
        Variant {
            name: "headroom, lean, the rules in the CRD (as shipped before e50bb95)",
            crd: Some(MemoryAwareTrainingJob::crd()),
            policy: None,
            resource: matj.clone(),
            object: job.clone(),
            status: serde_json::to_value(&status)?,
            telemetry_patch: telemetry.clone(),
        },
        Variant {
            name: "headroom, lean, the rules in their policy (shipped)",
            crd: Some(admission::crd()),
            policy: Some(shipped_policy()?),
            resource: matj,
            object: job,
            status: serde_json::to_value(&status)?,
            telemetry_patch: telemetry,
        },
    ];
    if let Some(path) = &args.pytorchjob_crd {
        let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
        let crd: CustomResourceDefinition = serde_yaml::from_str(&text)?;
        out.push(Variant {
            name: "PyTorchJob (Kubeflow's status)",
            crd: Some(crd),
            policy: None,
            resource: ApiResource::from_gvk(&GroupVersionKind::gvk(
                "kubeflow.org",
                "v1",
                "PyTorchJob",
            )),
            object: json!({
                "apiVersion": "kubeflow.org/v1",
                "kind": "PyTorchJob",
                "metadata": {},
                "spec": {"pytorchReplicaSpecs": {"Master": {
                    "replicas": 1,
                    "restartPolicy": "OnFailure",
                    "template": {"spec": {"containers": [{
                        "name": "pytorch",
                        "image": "localhost/headroom-worker:dev",
                        "resources": {"limits": {"memory": "320Mi", "cpu": "1"}},
                    }]}},
                }}},
            }),
            // What training-operator v1.9 writes once the master runs.
            status: json!({
                "conditions": [
                    {"type": "Created", "status": "True", "reason": "PyTorchJobCreated",
                     "message": "PyTorchJob bench/x is created.",
                     "lastUpdateTime": "2026-11-18T00:00:00Z", "lastTransitionTime": "2026-11-18T00:00:00Z"},
                    {"type": "Running", "status": "True", "reason": "PyTorchJobRunning",
                     "message": "PyTorchJob bench/x is running.",
                     "lastUpdateTime": "2026-11-18T00:00:00Z", "lastTransitionTime": "2026-11-18T00:00:00Z"},
                ],
                "replicaStatuses": {"Master": {"active": 1, "selector": "training.kubeflow.org/job-name=x,training.kubeflow.org/operator-name=pytorchjob-controller,training.kubeflow.org/replica-type=master"}},
                "startTime": "2026-11-18T00:00:00Z",
                "lastReconcileTime": "2026-11-18T00:00:00Z",
            }),
            telemetry_patch: json!({"status": {"lastReconcileTime": "2026-11-18T00:00:10Z"}}),
        });
    }
    Ok(out)
}

async fn apply_crd(
    client: &Client,
    crd: &CustomResourceDefinition,
    resource: &ApiResource,
) -> Result<()> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.metadata.name.clone().context("CRD name")?;
    let mut crd = crd.clone();
    crd.metadata.managed_fields = None;
    crd.metadata.resource_version = None;
    crds.patch(
        &name,
        &PatchParams::apply(FIELD_MANAGER).force(),
        &Patch::Apply(&crd),
    )
    .await
    .with_context(|| format!("apply CRD {name}"))?;
    // Established and served with this schema: a create of a probe object
    // right after must not meet a 404 (the handler is swapped in a moment).
    let api: Api<DynamicObject> = Api::all_with(client.clone(), resource);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if api
            .list_metadata(&ListParams::default().limit(1))
            .await
            .is_ok()
        {
            break;
        }
        if Instant::now() > deadline {
            bail!("{name} not served after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    Ok(())
}

/// One variant's figures in one round.
#[derive(Clone, Copy, Default)]
struct Figures {
    create_ms: f64,
    status_ms: f64,
    telemetry_ms: f64,
    telemetry_apply_ms: f64,
    stored_bytes: usize,
}

/// Runs `n` requests, `IN_FLIGHT` at a time; returns kube-apiserver's CPU
/// per request above its idle rate, ms.
async fn measured<F, Fut>(pid: u32, idle_cores: f64, n: usize, request: F) -> Result<f64>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = Result<()>>,
{
    let (c0, t0) = (cpu_seconds(pid), Instant::now());
    stream::iter((0..n).map(&request))
        .buffer_unordered(IN_FLIGHT)
        .try_collect::<Vec<()>>()
        .await?;
    let (cpu, secs) = (cpu_seconds(pid) - c0, t0.elapsed().as_secs_f64());
    Ok(1000.0 * (cpu - idle_cores * secs).max(0.0) / n as f64)
}

async fn idle_cores(pid: u32) -> f64 {
    let (c0, t0) = (cpu_seconds(pid), Instant::now());
    tokio::time::sleep(Duration::from_secs(3)).await;
    (cpu_seconds(pid) - c0) / t0.elapsed().as_secs_f64()
}

/// kube-apiserver's CPU profile over `seconds` of whole-status writes to
/// the `n` objects (cycled), written to `out`.
async fn profile_status_writes(
    client: &Client,
    api: &Api<DynamicObject>,
    v: &Variant,
    n: usize,
    seconds: u32,
    out: &std::path::Path,
) -> Result<()> {
    let request =
        hyper::Request::get(format!("/debug/pprof/profile?seconds={seconds}")).body(Vec::new())?;
    let profile = tokio::spawn({
        let client = client.clone();
        async move { client.request_stream(request).await }
    });
    let patch = json!({"status": v.status});
    let mut i = 0;
    while !profile.is_finished() {
        let writes = (0..IN_FLIGHT).map(|k| {
            let name = format!("obj-{}", (i + k) % n);
            let patch = &patch;
            async move {
                api.patch_status(&name, &PatchParams::default(), &Patch::Merge(patch))
                    .await
            }
        });
        futures::future::try_join_all(writes).await?;
        i += IN_FLIGHT;
    }
    let mut body = Box::pin(profile.await??);
    let mut bytes = Vec::new();
    futures::AsyncReadExt::read_to_end(&mut body, &mut bytes).await?;
    std::fs::write(out, bytes)?;
    Ok(())
}

/// Puts `policy` (and its binding) in force, or removes the bench's policy
/// when None. In force means: a create that breaks a rule (heads that do
/// not divide hidden) is refused by it.
async fn set_policy(
    client: &Client,
    policy: Option<&(Value, Value)>,
    jobs: &Api<DynamicObject>,
    object: &Value,
) -> Result<()> {
    let gvk = |kind: &str| {
        ApiResource::from_gvk(&GroupVersionKind::gvk(
            "admissionregistration.k8s.io",
            "v1",
            kind,
        ))
    };
    let policies: Api<DynamicObject> =
        Api::all_with(client.clone(), &gvk("ValidatingAdmissionPolicy"));
    let bindings: Api<DynamicObject> =
        Api::all_with(client.clone(), &gvk("ValidatingAdmissionPolicyBinding"));
    let Some((policy, binding)) = policy else {
        for api in [&bindings, &policies] {
            match api.delete(SPEC_POLICY, &DeleteParams::default()).await {
                Ok(_) => {}
                Err(kube::Error::Api(e)) if e.code == 404 => {}
                Err(e) => return Err(e.into()),
            }
        }
        return Ok(());
    };
    for (api, body) in [(&policies, policy), (&bindings, binding)] {
        api.patch(
            SPEC_POLICY,
            &PatchParams::apply(FIELD_MANAGER).force(),
            &Patch::Apply(body),
        )
        .await
        .context("apply the spec policy")?;
    }
    let mut probe = object.clone();
    probe["metadata"]["name"] = json!("probe-breaks-a-rule");
    probe["spec"]["model"]["transformer"]["hidden"] = json!(250);
    let probe: DynamicObject = serde_json::from_value(probe)?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match jobs.create(&PostParams::default(), &probe).await {
            Err(kube::Error::Api(e)) if e.message.contains("multiple of") => return Ok(()),
            Ok(_) => {
                jobs.delete("probe-breaks-a-rule", &DeleteParams::default())
                    .await?;
            }
            Err(e) => bail!("the policy's probe: {e}"),
        }
        if Instant::now() > deadline {
            bail!("the spec policy not in force after 30 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

async fn run_variant(
    client: &Client,
    pid: u32,
    ns: &str,
    v: &Variant,
    n: usize,
    profile: Option<(PathBuf, u32)>,
) -> Result<Figures> {
    if let Some(crd) = &v.crd {
        apply_crd(client, crd, &v.resource).await?;
    }
    let api: Api<DynamicObject> = Api::namespaced_with(client.clone(), ns, &v.resource);
    set_policy(client, v.policy.as_ref(), &api, &v.object).await?;
    let name = |i: usize| format!("obj-{i}");
    let idle = idle_cores(pid).await;
    let create_ms = measured(pid, idle, n, |i| {
        let (api, mut obj) = (api.clone(), v.object.clone());
        obj["metadata"]["name"] = json!(name(i));
        async move {
            let obj: DynamicObject = serde_json::from_value(obj)?;
            api.create(&PostParams::default(), &obj).await?;
            Ok(())
        }
    })
    .await?;
    let status_ms = measured(pid, idle, n, |i| {
        let api = api.clone();
        let patch = json!({"status": v.status});
        async move {
            api.patch_status(&name(i), &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            Ok(())
        }
    })
    .await?;
    let telemetry_ms = measured(pid, idle, n, |i| {
        let api = api.clone();
        let patch = v.telemetry_patch.clone();
        async move {
            api.patch_status(&name(i), &PatchParams::default(), &Patch::Merge(&patch))
                .await?;
            Ok(())
        }
    })
    .await?;
    // The same entry as the operator's telemetry flusher sends it: a forced
    // server-side apply under its own field manager.
    let telemetry_apply_ms = measured(pid, idle, n, |i| {
        let api = api.clone();
        let mut body = v.telemetry_patch.clone();
        body["apiVersion"] = v.object["apiVersion"].clone();
        body["kind"] = v.object["kind"].clone();
        body["metadata"] = json!({"name": name(i)});
        async move {
            api.patch_status(
                &name(i),
                &PatchParams::apply(TELEMETRY_FIELD_MANAGER).force(),
                &Patch::Apply(&body),
            )
            .await?;
            Ok(())
        }
    })
    .await?;
    if let Some((dir, seconds)) = profile {
        let slug: String = v
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let out = dir.join(format!("{slug}.pprof"));
        profile_status_writes(client, &api, v, n, seconds, &out).await?;
        eprintln!("{}: profile in {}", v.name, out.display());
    }
    // As stored: the object with its managed fields, as JSON.
    let object = serde_json::to_value(api.get(&name(0)).await?)?;
    let stored = serde_json::to_vec(&object)?;
    let size = |v: &Value| serde_json::to_vec(v).map_or(0, |b| b.len());
    let mut parts = vec![
        ("managedFields", size(&object["metadata"]["managedFields"])),
        ("spec", size(&object["spec"])),
    ];
    if let Some(status) = object["status"].as_object() {
        parts.extend(status.iter().map(|(k, v)| (k.as_str(), size(v))));
    }
    parts.sort_by_key(|p| std::cmp::Reverse(p.1));
    eprintln!(
        "{}: {} B stored; {}",
        v.name,
        stored.len(),
        parts
            .iter()
            .map(|(k, b)| format!("{k} {b}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    api.delete_collection(&DeleteParams::default(), &ListParams::default())
        .await?;
    // Gone before the next variant (no finalizers: at once).
    let deadline = Instant::now() + Duration::from_secs(60);
    while !api
        .list_metadata(&ListParams::default().limit(1))
        .await?
        .items
        .is_empty()
    {
        if Instant::now() > deadline {
            bail!("{}: objects still there after 60 s", v.name);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    Ok(Figures {
        create_ms,
        status_ms,
        telemetry_ms,
        telemetry_apply_ms,
        stored_bytes: stored.len(),
    })
}

fn median_range(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    let median = if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    };
    (median, v[0], v[n - 1])
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let client = Client::try_default()
        .await
        .context("KUBECONFIG must point at the test control plane (make controlplane-up)")?;
    let pid_file = args.apiserver_pid_file.clone().unwrap_or_else(|| {
        let cache = std::env::var("HEADROOM_CACHE").unwrap_or_else(|_| {
            format!(
                "{}/.cache/headroom",
                std::env::var("HOME").unwrap_or_default()
            )
        });
        PathBuf::from(cache).join("state/controlplane/run/kube-apiserver.pid")
    });
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .with_context(|| pid_file.display().to_string())?
        .trim()
        .parse()
        .context("kube-apiserver pid")?;
    let variants = variants(&args)?;
    let ns = format!("bench-object-{}", std::process::id());
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    namespaces
        .create(
            &PostParams::default(),
            &serde_json::from_value(json!({"metadata": {"name": ns}}))?,
        )
        .await?;
    let mut figures: BTreeMap<usize, Vec<Figures>> = BTreeMap::new();
    let mut result = Ok(());
    'rounds: for round in 1..=args.rounds {
        for (i, v) in variants.iter().enumerate() {
            let profile = args
                .profile_dir
                .clone()
                .filter(|_| round == 1)
                .map(|d| (d, args.profile_seconds));
            match run_variant(&client, pid, &ns, v, args.objects, profile).await {
                Ok(f) => {
                    eprintln!(
                        "round {round}, {}: create {:.2} ms, status {:.2} ms, telemetry {:.2} ms, telemetry apply {:.2} ms, stored {} B",
                        v.name,
                        f.create_ms,
                        f.status_ms,
                        f.telemetry_ms,
                        f.telemetry_apply_ms,
                        f.stored_bytes
                    );
                    figures.entry(i).or_default().push(f);
                }
                Err(e) => {
                    result = Err(e);
                    break 'rounds;
                }
            }
        }
    }
    // Leave the shipped CRD and policy in place, whatever ran last.
    let jobs = Api::namespaced_with(
        client.clone(),
        &ns,
        &ApiResource::erase::<MemoryAwareTrainingJob>(&()),
    );
    let restore = async {
        apply_crd(
            &client,
            &admission::crd(),
            &ApiResource::erase::<MemoryAwareTrainingJob>(&()),
        )
        .await?;
        let shipped = variants
            .iter()
            .find(|v| v.policy.is_some())
            .context("the shipped variant")?;
        set_policy(&client, shipped.policy.as_ref(), &jobs, &shipped.object).await
    }
    .await;
    let _ = namespaces.delete(&ns, &DeleteParams::default()).await;
    result?;
    restore?;

    println!(
        "\nkube-apiserver CPU per request above idle, median of {} rounds (range), {} objects, {IN_FLIGHT} in flight:\n",
        args.rounds, args.objects
    );
    println!(
        "| object | create | whole status write | telemetry write (merge patch) | telemetry write (server-side apply) | stored (JSON, managed fields) |"
    );
    println!("|---|---|---|---|---|---|");
    for (i, v) in variants.iter().enumerate() {
        let f = &figures[&i];
        let cell = |g: fn(&Figures) -> f64| {
            let (m, lo, hi) = median_range(f.iter().map(g).collect());
            format!("{m:.2} ms ({lo:.2}–{hi:.2})")
        };
        println!(
            "| {} | {} | {} | {} | {} | {:.1} KB |",
            v.name,
            cell(|f| f.create_ms),
            cell(|f| f.status_ms),
            cell(|f| f.telemetry_ms),
            cell(|f| f.telemetry_apply_ms),
            f[0].stored_bytes as f64 / 1000.0
        );
    }
    Ok(())
}
