//! Kueue: a job that names a LocalQueue (`kueue.x-k8s.io/queue-name` on the
//! job, as Kueue's own integrations read it) is admitted by Kueue and sized
//! by Headroom.
//!
//! The route (README "Kueue"): each attempt's worker pods are a Kueue **pod
//! group** (Kueue's plain-pod integration). Headroom plans within what the
//! queue offers ([`QueueOffer`]: the ClusterQueue's flavors, matched to nodes
//! by their labels, and its quota), creates the attempt's pods with the
//! group's label and total count, and Kueue's webhook gates them until the
//! group's Workload — built by Kueue from those pods, so it requests exactly
//! what the plan sized, per stage — is admitted. Kueue preempting an attempt
//! deletes its pods with a `TerminationTarget` condition: Headroom counts that
//! as a disruption, and the next attempt (a new group) resumes from the
//! checkpoint once Kueue admits it again. No Go code runs in Headroom, and
//! without the label nothing here is used.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use headroom_api::MemoryAwareTrainingJob;
use headroom_api::quantity::{parse_bytes, parse_cores};
use headroom_planner::units::format_bytes;
use headroom_planner::{DeviceKind, Inventory};
use k8s_openapi::api::core::v1::{Node, Pod};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind};
use kube::{Client, ResourceExt};
use serde::Deserialize;

/// The job's (and its pods') LocalQueue, as every Kueue integration names it.
pub const LABEL_QUEUE_NAME: &str = "kueue.x-k8s.io/queue-name";
/// The WorkloadPriorityClass of the job's workloads (preemption order).
pub const LABEL_PRIORITY_CLASS: &str = "kueue.x-k8s.io/priority-class";
/// The pod group an attempt's pods form; Kueue's Workload has this name.
pub const LABEL_POD_GROUP: &str = "kueue.x-k8s.io/pod-group-name";
/// How many pods the group has: Kueue waits for all before admitting.
pub const ANNOTATION_POD_GROUP_TOTAL: &str = "kueue.x-k8s.io/pod-group-total-count";
/// `"false"`: a failed pod ends the group's Workload (its quota is released)
/// instead of Kueue waiting for a replacement: Headroom's next attempt is a
/// new group, never a replacement pod.
pub const ANNOTATION_RETRIABLE_IN_GROUP: &str = "kueue.x-k8s.io/retriable-in-group";
/// The scheduling gate Kueue's webhook puts on a queued pod until admission.
pub const ADMISSION_GATE: &str = "kueue.x-k8s.io/admission";
/// The pod condition Kueue sets on a pod it stops (preemption, eviction).
pub const CONDITION_TERMINATION_TARGET: &str = "TerminationTarget";

const GROUP: &str = "kueue.x-k8s.io";
const VERSION: &str = "v1beta2";

/// The LocalQueue the job names, if it opts in.
pub fn queue_name(job: &MemoryAwareTrainingJob) -> Option<&str> {
    job.metadata
        .labels
        .as_ref()?
        .get(LABEL_QUEUE_NAME)
        .map(String::as_str)
        .filter(|q| !q.is_empty())
}

/// Makes `pod` one of the `workers` pods of attempt `attempt`'s group in the
/// job's queue (no-op for a job without a queue).
pub fn join_pod_group(pod: &mut Pod, job: &MemoryAwareTrainingJob, group: &str, workers: u32) {
    let Some(queue) = queue_name(job) else {
        return;
    };
    let labels = pod.metadata.labels.get_or_insert_default();
    labels.insert(LABEL_QUEUE_NAME.into(), queue.into());
    labels.insert(LABEL_POD_GROUP.into(), group.into());
    if let Some(priority) = job.labels().get(LABEL_PRIORITY_CLASS) {
        labels.insert(LABEL_PRIORITY_CLASS.into(), priority.clone());
    }
    let annotations = pod.metadata.annotations.get_or_insert_default();
    annotations.insert(ANNOTATION_POD_GROUP_TOTAL.into(), workers.to_string());
    annotations.insert(ANNOTATION_RETRIABLE_IN_GROUP.into(), "false".into());
}

/// Whether Kueue still holds `pod` back (its Workload is not admitted).
pub fn is_gated(pod: &Pod) -> bool {
    pod.spec
        .as_ref()
        .and_then(|s| s.scheduling_gates.as_ref())
        .is_some_and(|g| g.iter().any(|g| g.name == ADMISSION_GATE))
}

/// Kueue stopped `pod` (its Workload was preempted or evicted): the
/// condition's reason and message.
pub fn stopped_by_kueue(pod: &Pod) -> Option<(String, String)> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    let c = conditions
        .iter()
        .find(|c| c.type_ == CONDITION_TERMINATION_TARGET && c.status == "True")?;
    Some((
        c.reason.clone().unwrap_or_else(|| "StoppedByKueue".into()),
        c.message.clone().unwrap_or_default(),
    ))
}

// ---- What the queue offers ----------------------------------------------------

/// How much of a resource a flavor gives the queue. `None`: no bound Headroom
/// can know (the ClusterQueue borrows from its cohort without a limit).
pub type Quota = Option<f64>;

/// One ResourceFlavor of the job's ClusterQueue: the nodes it stands for
/// (its `nodeLabels`) and the queue's quota in it, by resource.
#[derive(Clone, Debug, PartialEq)]
pub struct FlavorOffer {
    pub name: String,
    pub node_labels: BTreeMap<String, String>,
    /// Resource name → nominal quota plus the borrowing limit (GPU counts,
    /// memory in bytes, CPU in cores).
    pub quota: BTreeMap<String, Quota>,
}

/// What the job's LocalQueue can ever give it.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueOffer {
    pub local_queue: String,
    pub cluster_queue: String,
    pub flavors: Vec<FlavorOffer>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct LocalQueueSpec {
    cluster_queue: String,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ClusterQueueSpec {
    #[serde(default)]
    cohort_name: Option<String>,
    #[serde(default)]
    resource_groups: Vec<ResourceGroup>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ResourceGroup {
    #[serde(default)]
    flavors: Vec<FlavorQuotas>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct FlavorQuotas {
    name: String,
    #[serde(default)]
    resources: Vec<ResourceQuota>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct ResourceQuota {
    name: String,
    nominal_quota: serde_json::Value,
    #[serde(default)]
    borrowing_limit: Option<serde_json::Value>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ResourceFlavorSpec {
    #[serde(default)]
    node_labels: BTreeMap<String, String>,
}

/// A quantity in the resource's unit: cores for `cpu`, a plain number
/// (bytes, devices) for the rest.
fn amount(resource: &str, q: &serde_json::Value) -> Result<f64, String> {
    let text = match q {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if resource == "cpu" {
        parse_cores(&text)
    } else {
        parse_bytes(&text).map(|b| b as f64)
    }
}

fn api(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, kind), plural)
}

fn spec<T: for<'de> Deserialize<'de>>(obj: &DynamicObject, what: &str) -> Result<T, String> {
    serde_json::from_value(obj.data.get("spec").cloned().unwrap_or_default())
        .map_err(|e| format!("{what}: cannot read its spec: {e}"))
}

/// Why a queue's offer could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct UnreadOffer {
    /// Names the object that is missing or unreadable, and why.
    pub message: String,
    /// The reader's rights kept it (a user whose Role is namespaced may
    /// read the LocalQueue, not the cluster-scoped ClusterQueue).
    pub forbidden: bool,
}

impl UnreadOffer {
    fn api(object: String, e: &kube::Error) -> Self {
        UnreadOffer {
            message: format!("{object}: {}", short(e)),
            forbidden: matches!(e, kube::Error::Api(s) if s.is_forbidden()),
        }
    }
}

impl From<String> for UnreadOffer {
    fn from(message: String) -> Self {
        UnreadOffer {
            message,
            forbidden: false,
        }
    }
}

impl QueueOffer {
    /// The offer from the ClusterQueue behind LocalQueue `local` and its
    /// ResourceFlavors, as they are now. The message of an error names the
    /// object that is missing or unreadable.
    pub async fn read(client: &Client, namespace: &str, local: &str) -> Result<Self, String> {
        Self::read_as_allowed(client, namespace, local)
            .await
            .map_err(|e| e.message)
    }

    /// As [`QueueOffer::read`], saying whether a refusal of the client's
    /// rights is why it could not be read (`kubectl headroom plan` then
    /// says what it assumed).
    pub async fn read_as_allowed(
        client: &Client,
        namespace: &str,
        local: &str,
    ) -> Result<Self, UnreadOffer> {
        let lq_api: Api<DynamicObject> =
            Api::namespaced_with(client.clone(), namespace, &api("LocalQueue", "localqueues"));
        let lq = lq_api
            .get(local)
            .await
            .map_err(|e| UnreadOffer::api(format!("LocalQueue {namespace}/{local}"), &e))?;
        let lq: LocalQueueSpec = spec(&lq, &format!("LocalQueue {namespace}/{local}"))?;
        let cq_api: Api<DynamicObject> =
            Api::all_with(client.clone(), &api("ClusterQueue", "clusterqueues"));
        let cq = cq_api
            .get(&lq.cluster_queue)
            .await
            .map_err(|e| UnreadOffer::api(format!("ClusterQueue {}", lq.cluster_queue), &e))?;
        let cq: ClusterQueueSpec = spec(&cq, &format!("ClusterQueue {}", lq.cluster_queue))?;
        let rf_api: Api<DynamicObject> =
            Api::all_with(client.clone(), &api("ResourceFlavor", "resourceflavors"));
        let mut labels = BTreeMap::new();
        for f in cq.resource_groups.iter().flat_map(|g| &g.flavors) {
            if labels.contains_key(&f.name) {
                continue;
            }
            let rf = rf_api
                .get(&f.name)
                .await
                .map_err(|e| UnreadOffer::api(format!("ResourceFlavor {}", f.name), &e))?;
            let rf: ResourceFlavorSpec = spec(&rf, &format!("ResourceFlavor {}", f.name))?;
            labels.insert(f.name.clone(), rf.node_labels);
        }
        Ok(Self::from_specs(local, &lq.cluster_queue, cq, &labels)?)
    }

    fn from_specs(
        local: &str,
        cluster_queue: &str,
        cq: ClusterQueueSpec,
        node_labels: &BTreeMap<String, BTreeMap<String, String>>,
    ) -> Result<Self, String> {
        let in_cohort = cq.cohort_name.as_deref().is_some_and(|c| !c.is_empty());
        let mut flavors: Vec<FlavorOffer> = Vec::new();
        for f in cq.resource_groups.into_iter().flat_map(|g| g.flavors) {
            let mut quota = BTreeMap::new();
            for r in f.resources {
                let what = |field: &str| {
                    format!(
                        "ClusterQueue {cluster_queue}: flavor {} resource {} {field}",
                        f.name, r.name
                    )
                };
                let nominal = amount(&r.name, &r.nominal_quota)
                    .map_err(|e| format!("{}: {e}", what("nominalQuota")))?;
                let limit = match (&r.borrowing_limit, in_cohort) {
                    (Some(b), true) => Some(
                        nominal
                            + amount(&r.name, b)
                                .map_err(|e| format!("{}: {e}", what("borrowingLimit")))?,
                    ),
                    // May borrow all its cohort lends: no bound known here.
                    (None, true) => None,
                    (_, false) => Some(nominal),
                };
                quota.insert(r.name, limit);
            }
            // A flavor named in two resource groups covers both groups' resources.
            match flavors.iter_mut().find(|o| o.name == f.name) {
                Some(o) => o.quota.extend(quota),
                None => flavors.push(FlavorOffer {
                    node_labels: node_labels.get(&f.name).cloned().unwrap_or_default(),
                    name: f.name,
                    quota,
                }),
            }
        }
        Ok(QueueOffer {
            local_queue: local.into(),
            cluster_queue: cluster_queue.into(),
            flavors,
        })
    }

    /// The nodes flavor `f` stands for.
    fn in_flavor(f: &FlavorOffer, node: &Node) -> bool {
        let labels = node.metadata.labels.as_ref();
        f.node_labels
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v))
    }

    /// The GPU inventory the job may plan with in this queue: for each
    /// flavor that has quota for a device resource, the devices of the nodes
    /// it stands for (`build` makes an inventory from nodes, e.g.
    /// [`crate::inventory::job_inventory`]), their count capped at the
    /// flavor's quota. Every capped device counts as free: Kueue, not
    /// Headroom, decides when the job's turn comes. Devices of nodes no
    /// flavor stands for, or of a resource no flavor has quota for, are left
    /// out with why.
    pub fn gpu_inventory<'a>(
        &self,
        nodes: &[&'a Node],
        build: impl Fn(&[&'a Node]) -> Inventory,
    ) -> Inventory {
        let mut out = Inventory {
            one_node: false,
            ..Inventory::default()
        };
        let queue = self.describe();
        for f in &self.flavors {
            let members: Vec<&Node> = nodes
                .iter()
                .copied()
                .filter(|n| Self::in_flavor(f, n))
                .collect();
            let inv = build(&members);
            out.one_node = inv.one_node;
            for mut d in inv.devices {
                let Some(quota) = f.quota.get(&d.resource) else {
                    out.left_out.push(format!(
                        "{} {} (flavor {} of {queue} has no quota for {})",
                        d.total, d.name, f.name, d.resource
                    ));
                    continue;
                };
                let cap = |n: u32| quota.map_or(n, |q| n.min(q.max(0.0).floor() as u32));
                if cap(d.total) < d.total {
                    out.left_out.push(format!(
                        "{} of {} {} (flavor {} of {queue} has quota for {})",
                        d.total - cap(d.total),
                        d.total,
                        d.name,
                        f.name,
                        cap(d.total)
                    ));
                }
                d.total = cap(d.total);
                d.total_on_one_node = cap(d.total_on_one_node);
                d.free = d.reachable(inv.one_node);
                d.free_on_one_node = d.total_on_one_node;
                match out
                    .devices
                    .iter_mut()
                    .find(|o| o.resource == d.resource && o.name == d.name)
                {
                    Some(o) if o.total >= d.total => {}
                    Some(o) => *o = d,
                    None => out.devices.push(d),
                }
            }
            out.left_out.extend(inv.left_out);
        }
        for n in nodes {
            if !self.flavors.iter().any(|f| Self::in_flavor(f, n)) {
                let gpus = n
                    .status
                    .as_ref()
                    .and_then(|s| s.allocatable.as_ref())
                    .is_some_and(|a| a.keys().any(|k| k.starts_with("nvidia.com/")));
                if gpus {
                    out.left_out.push(format!(
                        "{} (no flavor of {queue} matches its labels)",
                        n.name_any()
                    ));
                }
            }
        }
        out.devices.sort_by(|a, b| {
            a.memory_bytes
                .cmp(&b.memory_bytes)
                .then_with(|| a.name.cmp(&b.name))
        });
        out
    }

    /// Caps a CPU job's inventory at how many of its workers (each
    /// `memory_limit` bytes and `cores` CPU) the queue's quota holds in the
    /// flavor that holds most, and counts them all free (Kueue decides
    /// when). A queue that holds none leaves the job unplannable, with the
    /// figures in `left_out`.
    pub fn cap_cpu(&self, inventory: &mut Inventory, memory_limit: u64, cores: f64) {
        let queue = self.describe();
        let mut best = 0u32;
        let mut short_of = Vec::new();
        for f in &self.flavors {
            let mut fit = u32::MAX;
            for (resource, need) in [("memory", memory_limit as f64), ("cpu", cores)] {
                match f.quota.get(resource) {
                    // A resource the queue does not cover is not limited by it.
                    None | Some(None) => {}
                    Some(Some(q)) => {
                        let n = (q / need.max(1e-9) + 1e-9).floor().max(0.0);
                        let n = if n >= f64::from(u32::MAX) {
                            u32::MAX
                        } else {
                            n as u32
                        };
                        if n == 0 {
                            let (have, want) = if resource == "memory" {
                                (format_bytes(*q as u64), format_bytes(memory_limit))
                            } else {
                                (format!("{q} cpu"), format!("{cores} cpu"))
                            };
                            short_of.push(format!(
                                "flavor {} of {queue} has {resource} quota {have}, one worker needs {want}",
                                f.name
                            ));
                        }
                        fit = fit.min(n);
                    }
                }
            }
            best = best.max(fit);
        }
        if self.flavors.is_empty() {
            short_of.push(format!("{queue} has no flavors"));
        }
        for d in inventory
            .devices
            .iter_mut()
            .filter(|d| d.kind == DeviceKind::Cpu)
        {
            d.total = d.total.min(best);
            d.total_on_one_node = d.total_on_one_node.min(best);
            d.free = d.reachable(inventory.one_node);
            d.free_on_one_node = d.total_on_one_node;
        }
        if best == 0 {
            inventory.left_out.extend(short_of);
        }
    }

    /// `LocalQueue a (ClusterQueue b)`.
    pub fn describe(&self) -> String {
        format!(
            "LocalQueue {} (ClusterQueue {})",
            self.local_queue, self.cluster_queue
        )
    }
}

/// A GPU job's devices: the nodes' less those `device_pods` hold, or, in a
/// queue (`offer`), those of the nodes its flavors stand for, capped by
/// their quota. The operator and `kubectl headroom plan` both plan with it.
pub fn gpu_inventory_within<'a>(
    job: &MemoryAwareTrainingJob,
    nodes: &[&'a Node],
    device_pods: &[&'a Pod],
    offer: Option<&QueueOffer>,
    one_node: bool,
) -> Inventory {
    let build = |nodes: &[&'a Node]| {
        crate::inventory::job_inventory(
            job,
            nodes.iter().copied(),
            device_pods.iter().copied(),
            one_node,
        )
    };
    match offer {
        Some(o) => o.gpu_inventory(nodes, build),
        None => build(nodes),
    }
}

/// A CPU job: `by_nodes`, what the nodes its pods may use can hold
/// ([`crate::inventory::cpu_inventory`]; `None` when no node is known),
/// capped by the queue's `offer`. Without nodes and without a queue the
/// job's own budget is all there is (the empty inventory); without nodes in
/// a queue (a control plane alone), the job's own worker cap, capped by the
/// queue.
pub fn cpu_inventory_within(
    job: &MemoryAwareTrainingJob,
    by_nodes: Option<Inventory>,
    offer: Option<&QueueOffer>,
) -> Inventory {
    match (offer, crate::inventory::cpu_worker_size(job)) {
        (Some(o), Some((limit, cores))) => {
            let mut inventory = by_nodes.unwrap_or_else(|| {
                let cap = job.spec.resources.cpu.as_ref().map_or(1, |c| c.max_workers);
                Inventory::cpu(limit, cap.max(1))
            });
            o.cap_cpu(&mut inventory, limit, cores);
            inventory
        }
        _ => by_nodes.unwrap_or_default(),
    }
}

/// Queue offers read within the last [`OfferCache::TTL`], by namespace and
/// LocalQueue: every reconcile of a queued job needs its queue's offer, and
/// a queue's flavors and quota change rarely, so a queue of many jobs costs
/// the API server a few reads per TTL rather than three per reconcile. A
/// quota changed by an admin is planned with within the TTL.
#[derive(Debug, Default)]
pub struct OfferCache {
    entries: Mutex<HashMap<QueueKey, ReadOffer>>,
}

/// Namespace and LocalQueue.
type QueueKey = (String, String);
/// When an offer was read, and what the read gave.
type ReadOffer = (Instant, Result<QueueOffer, String>);

impl OfferCache {
    pub const TTL: Duration = Duration::from_secs(30);

    /// The offer of LocalQueue `local` in `namespace`, read again when older than the TTL.
    pub async fn get(
        &self,
        client: &Client,
        namespace: &str,
        local: &str,
    ) -> Result<QueueOffer, String> {
        let key = (namespace.to_string(), local.to_string());
        if let Some((at, offer)) = self.lock().get(&key)
            && at.elapsed() < Self::TTL
        {
            return offer.clone();
        }
        let offer = QueueOffer::read(client, namespace, local).await;
        let mut entries = self.lock();
        entries.retain(|_, (at, _)| at.elapsed() < Self::TTL);
        entries.insert(key, (Instant::now(), offer.clone()));
        offer
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<QueueKey, ReadOffer>> {
        self.entries
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// What Kueue says of the Workload of pod group `group`: why it is not
/// admitted yet (its `QuotaReserved` or `Admitted` condition's message),
/// `None` when it is admitted or does not exist yet.
pub async fn workload_wait(client: &Client, namespace: &str, group: &str) -> Option<String> {
    let wl_api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &api("Workload", "workloads"));
    let wl = wl_api.get_opt(group).await.ok()??;
    waiting_message(&wl.data)
}

fn waiting_message(workload: &serde_json::Value) -> Option<String> {
    let conditions = workload.get("status")?.get("conditions")?.as_array()?;
    let find = |t: &str| {
        conditions
            .iter()
            .find(|c| c.get("type").and_then(|v| v.as_str()) == Some(t))
    };
    let is_true = |c: Option<&serde_json::Value>| {
        c.and_then(|c| c.get("status"))
            .and_then(|s| s.as_str())
            .is_some_and(|s| s == "True")
    };
    if is_true(find("Admitted")) {
        return None;
    }
    ["QuotaReserved", "Admitted"]
        .iter()
        .filter_map(|t| find(t))
        .filter(|c| !is_true(Some(c)))
        .find_map(|c| c.get("message").and_then(|m| m.as_str()))
        .map(str::to_string)
}

/// An API error without the noise: the server's message, or the error.
fn short(e: &kube::Error) -> String {
    match e {
        kube::Error::Api(s) if s.code == 404 => "not found".into(),
        kube::Error::Api(s) => s.message.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::node_facts;

    fn cq(yaml: &str) -> ClusterQueueSpec {
        serde_yaml::from_str(yaml).expect("ClusterQueue spec")
    }

    fn node(name: &str, product: &str, gpus: u32) -> Node {
        serde_yaml::from_str(&format!(
            r#"
metadata:
  name: {name}
  labels:
    nvidia.com/gpu.product: {product}
    nvidia.com/gpu.memory: "81559"
    nvidia.com/gpu.count: "{gpus}"
status:
  allocatable: {{nvidia.com/gpu: "{gpus}", memory: 1Ti, cpu: "64"}}
"#
        ))
        .expect("node")
    }

    fn flavors(pairs: &[(&str, &str)]) -> BTreeMap<String, BTreeMap<String, String>> {
        pairs
            .iter()
            .map(|(f, product)| {
                (
                    (*f).to_string(),
                    [("nvidia.com/gpu.product".to_string(), (*product).to_string())]
                        .into_iter()
                        .collect(),
                )
            })
            .collect()
    }

    fn build(nodes: &[&Node]) -> Inventory {
        let facts: Vec<_> = nodes.iter().map(|n| node_facts(n, [])).collect();
        Inventory::from_nodes(&facts)
    }

    /// The queue offers H100s only, 4 of the cluster's 16: the A100 nodes
    /// are left out (no flavor matches them) and the H100 count is the quota.
    #[test]
    fn only_the_queues_flavors_and_quota_are_planned_with() {
        let spec = cq(r#"
resourceGroups:
- coveredResources: [nvidia.com/gpu, cpu, memory]
  flavors:
  - name: h100
    resources:
    - {name: nvidia.com/gpu, nominalQuota: 4}
    - {name: cpu, nominalQuota: 64}
    - {name: memory, nominalQuota: 512Gi}
"#);
        let offer = QueueOffer::from_specs(
            "team-a",
            "gpus",
            spec,
            &flavors(&[("h100", "NVIDIA-H100-80GB-HBM3")]),
        )
        .expect("offer");
        let (h1, h2, a1) = (
            node("h1", "NVIDIA-H100-80GB-HBM3", 8),
            node("h2", "NVIDIA-H100-80GB-HBM3", 8),
            node("a1", "NVIDIA-A100-SXM4-80GB", 8),
        );
        let inv = offer.gpu_inventory(&[&h1, &h2, &a1], build);
        let got: Vec<_> = inv
            .devices
            .iter()
            .map(|d| (d.name.as_str(), d.total, d.free))
            .collect();
        assert_eq!(got, [("NVIDIA-H100-80GB-HBM3", 4, 4)], "{inv:?}");
        let why = inv.left_out.join("; ");
        assert!(
            why.contains(
                "a1 (no flavor of LocalQueue team-a (ClusterQueue gpus) matches its labels)"
            ),
            "{why}"
        );
        assert!(
            why.contains("12 of 16 NVIDIA-H100-80GB-HBM3 (flavor h100"),
            "{why}"
        );
    }

    /// Borrowing: a limit adds to the nominal quota; in a cohort with no
    /// limit there is no bound Headroom could know; outside a cohort the
    /// nominal quota is all.
    #[test]
    fn borrowing_limits_add_to_the_nominal_quota() {
        let with_limit = QueueOffer::from_specs(
            "q",
            "c",
            cq(r#"
cohortName: all
resourceGroups:
- flavors:
  - name: f
    resources:
    - {name: nvidia.com/gpu, nominalQuota: 2, borrowingLimit: 2}
    - {name: memory, nominalQuota: 1Gi}
    - {name: cpu, nominalQuota: 500m}
"#),
            &BTreeMap::new(),
        )
        .expect("offer");
        let q = &with_limit.flavors[0].quota;
        assert_eq!(q["nvidia.com/gpu"], Some(4.0));
        assert_eq!(q["memory"], None, "cohort, no borrowing limit");
        assert_eq!(q["cpu"], None);
        let alone = QueueOffer::from_specs(
            "q",
            "c",
            cq("resourceGroups: [{flavors: [{name: f, resources: [{name: cpu, nominalQuota: 500m}]}]}]"),
            &BTreeMap::new(),
        )
        .expect("offer");
        assert_eq!(alone.flavors[0].quota["cpu"], Some(0.5));
    }

    /// A CPU job whose worker needs 3 GiB in a queue of 2 GiB is unplannable,
    /// and says so with both figures; a queue of 7 GiB holds two workers.
    #[test]
    fn a_cpu_queue_caps_the_workers_and_names_its_quota_when_it_holds_none() {
        let offer = |memory: &str| {
            QueueOffer::from_specs(
                "small",
                "cpu-queue",
                cq(&format!(
                    "resourceGroups: [{{flavors: [{{name: default, resources: [{{name: cpu, nominalQuota: 4}}, {{name: memory, nominalQuota: {memory}}}]}}]}}]"
                )),
                &BTreeMap::new(),
            )
            .expect("offer")
        };
        let gib = 1u64 << 30;
        let mut inv = Inventory::cpu(3 * gib, 4);
        offer("2Gi").cap_cpu(&mut inv, 3 * gib, 1.0);
        assert_eq!(inv.devices[0].total, 0);
        let why = inv.left_out.join("; ");
        assert!(
            why.contains("flavor default of LocalQueue small (ClusterQueue cpu-queue) has memory quota 2.0 GiB, one worker needs 3.0 GiB"),
            "{why}"
        );
        let mut inv = Inventory::cpu(3 * gib, 4);
        offer("7Gi").cap_cpu(&mut inv, 3 * gib, 1.0);
        assert_eq!((inv.devices[0].total, inv.devices[0].free), (2, 2));
        assert!(inv.left_out.is_empty());
    }

    /// Kueue's own words on a Workload that waits, and silence once admitted.
    #[test]
    fn the_workloads_waiting_message_is_kueues() {
        let waiting = serde_json::json!({"status": {"conditions": [
            {"type": "QuotaReserved", "status": "False", "reason": "Pending",
             "message": "couldn't assign flavors to pod set 0a8c3e: insufficient unused quota for memory in flavor default, 64Mi more needed"}
        ]}});
        assert_eq!(
            waiting_message(&waiting).as_deref(),
            Some(
                "couldn't assign flavors to pod set 0a8c3e: insufficient unused quota for memory in flavor default, 64Mi more needed"
            )
        );
        let admitted = serde_json::json!({"status": {"conditions": [
            {"type": "QuotaReserved", "status": "True", "message": "Quota reserved"},
            {"type": "Admitted", "status": "True", "message": "The workload is admitted"}
        ]}});
        assert_eq!(waiting_message(&admitted), None);
    }

    #[test]
    fn a_pod_joins_its_attempts_group_only_when_the_job_names_a_queue() {
        let mut job: MemoryAwareTrainingJob = serde_yaml::from_str(
            r#"
apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata: {name: j, namespace: n, labels: {kueue.x-k8s.io/queue-name: team-a, kueue.x-k8s.io/priority-class: high}}
spec:
  model:
    transformer: {layers: 2, hidden: 64, heads: 2, sequenceLength: 32, vocabulary: 256}
  training: {globalBatch: 4, steps: 1}
  resources:
    cpu: {memoryLimit: 256Mi}
  worker: {image: localhost/headroom-worker:dev}
"#,
        )
        .expect("job");
        let mut pod = Pod::default();
        join_pod_group(&mut pod, &job, "j-a1", 3);
        let labels = pod.metadata.labels.clone().unwrap_or_default();
        assert_eq!(labels[LABEL_QUEUE_NAME], "team-a");
        assert_eq!(labels[LABEL_POD_GROUP], "j-a1");
        assert_eq!(labels[LABEL_PRIORITY_CLASS], "high");
        let annotations = pod.metadata.annotations.clone().unwrap_or_default();
        assert_eq!(annotations[ANNOTATION_POD_GROUP_TOTAL], "3");
        assert_eq!(annotations[ANNOTATION_RETRIABLE_IN_GROUP], "false");

        job.metadata.labels = None;
        let mut pod = Pod::default();
        join_pod_group(&mut pod, &job, "j-a1", 3);
        assert_eq!(pod, Pod::default());
    }
}
