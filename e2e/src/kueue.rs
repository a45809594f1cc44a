//! Kueue objects for a test: a ResourceFlavor, a ClusterQueue with a quota
//! and a LocalQueue in the test's namespace (named after the namespace, so
//! tests never share a queue), WorkloadPriorityClasses, and the namespace
//! label that opts it into Kueue's pod webhook where `e2e/kueue/kueue.sh`
//! installed Kueue.

use std::collections::BTreeMap;

use kube::ResourceExt;
use kube::api::{
    Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams,
};
use serde_json::json;

use crate::TestNs;

/// The namespace label `e2e/kueue/kueue.sh install` gives Kueue's
/// `managedJobsNamespaceSelector`: only namespaces that carry it are Kueue's.
pub const MANAGED_NAMESPACE_LABEL: (&str, &str) = ("e2e.headroom.dev/kueue", "managed");

/// A test's queue: its LocalQueue (in the test's namespace), ClusterQueue
/// and ResourceFlavors.
#[derive(Clone, Debug)]
pub struct TestQueue {
    pub local: String,
    pub cluster: String,
    pub flavors: Vec<String>,
}

/// One ResourceFlavor of a test's ClusterQueue.
#[derive(Clone, Debug, Default)]
pub struct FlavorSpec<'a> {
    /// Its name is the namespace's plus `-<suffix>`.
    pub suffix: &'a str,
    /// Its nodeLabels (empty: every node).
    pub node_labels: BTreeMap<String, String>,
    /// Resource → nominal quota, e.g. `("memory", "700Mi")`; every flavor
    /// of one queue names the same resources.
    pub quota: &'a [(&'a str, &'a str)],
}

/// What a test's ClusterQueue offers.
#[derive(Clone, Debug, Default)]
pub struct QueueSpec<'a> {
    pub flavors: Vec<FlavorSpec<'a>>,
    /// Preempt lower-priority workloads of the same ClusterQueue.
    pub preempt_lower_priority: bool,
}

impl<'a> QueueSpec<'a> {
    /// One flavor for every node, with `quota`.
    pub fn one(quota: &'a [(&'a str, &'a str)]) -> Self {
        QueueSpec {
            flavors: vec![FlavorSpec {
                suffix: "all",
                quota,
                ..FlavorSpec::default()
            }],
            preempt_lower_priority: false,
        }
    }
}

fn resource(kind: &str, plural: &str) -> ApiResource {
    ApiResource::from_gvk_with_plural(
        &GroupVersionKind::gvk("kueue.x-k8s.io", "v1beta2", kind),
        plural,
    )
}

fn object(kind: &str, name: &str, body: serde_json::Value) -> DynamicObject {
    let mut value = json!({
        "apiVersion": "kueue.x-k8s.io/v1beta2",
        "kind": kind,
        "metadata": {"name": name},
    });
    if let (Some(v), Some(b)) = (value.as_object_mut(), body.as_object()) {
        v.extend(b.clone());
    }
    serde_json::from_value(value).expect("Kueue object")
}

impl TestNs {
    async fn apply_kueue(&self, api: &Api<DynamicObject>, obj: DynamicObject) {
        let name = obj.name_any();
        api.patch(
            &name,
            &PatchParams::apply(self.suite.field_manager).force(),
            &Patch::Apply(&obj),
        )
        .await
        .unwrap_or_else(|e| panic!("Kueue {name} applies (are Kueue's CRDs installed?): {e}"));
    }

    /// Makes this namespace one Kueue's pod webhook manages.
    pub async fn opt_into_kueue(&self) {
        let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(self.client.clone());
        let (k, v) = MANAGED_NAMESPACE_LABEL;
        namespaces
            .patch(
                &self.name,
                &PatchParams::default(),
                &Patch::Merge(json!({"metadata": {"labels": {k: v}}})),
            )
            .await
            .expect("namespace label");
    }

    /// The ResourceFlavors, a ClusterQueue covering the quota's resources in
    /// them, and a LocalQueue here pointing at it; all named after the namespace.
    pub async fn kueue_queue(&self, spec: &QueueSpec<'_>) -> TestQueue {
        let name = self.name.clone();
        let flavor_api = Api::all_with(
            self.client.clone(),
            &resource("ResourceFlavor", "resourceflavors"),
        );
        let mut flavors = Vec::new();
        let mut flavor_quotas = Vec::new();
        for f in &spec.flavors {
            let flavor = format!("{name}-{}", f.suffix);
            let mut flavor_spec = json!({});
            if !f.node_labels.is_empty() {
                flavor_spec = json!({"nodeLabels": f.node_labels});
            }
            self.apply_kueue(
                &flavor_api,
                object("ResourceFlavor", &flavor, json!({"spec": flavor_spec})),
            )
            .await;
            let resources: Vec<serde_json::Value> = f
                .quota
                .iter()
                .map(|(r, q)| json!({"name": r, "nominalQuota": q}))
                .collect();
            flavor_quotas.push(json!({"name": flavor, "resources": resources}));
            flavors.push(flavor);
        }
        let covered: Vec<&str> = spec
            .flavors
            .first()
            .map(|f| f.quota.iter().map(|(r, _)| *r).collect())
            .unwrap_or_default();
        let mut cq_spec = json!({
            "namespaceSelector": {},
            "queueingStrategy": "StrictFIFO",
            "resourceGroups": [{"coveredResources": covered, "flavors": flavor_quotas}],
        });
        if spec.preempt_lower_priority {
            cq_spec["preemption"] = json!({"withinClusterQueue": "LowerPriority"});
        }
        let cqs = Api::all_with(
            self.client.clone(),
            &resource("ClusterQueue", "clusterqueues"),
        );
        self.apply_kueue(
            &cqs,
            object("ClusterQueue", &name, json!({"spec": cq_spec})),
        )
        .await;
        let lqs = Api::namespaced_with(
            self.client.clone(),
            &self.name,
            &resource("LocalQueue", "localqueues"),
        );
        let mut lq = object("LocalQueue", &name, json!({"spec": {"clusterQueue": name}}));
        lq.metadata.namespace = Some(self.name.clone());
        self.apply_kueue(&lqs, lq).await;
        TestQueue {
            local: name.clone(),
            cluster: name,
            flavors,
        }
    }

    /// A WorkloadPriorityClass (cluster-scoped) named after the namespace
    /// and `suffix`, with `value`.
    pub async fn kueue_priority(&self, suffix: &str, value: i32) -> String {
        let name = format!("{}-{suffix}", self.name);
        let api = Api::all_with(
            self.client.clone(),
            &resource("WorkloadPriorityClass", "workloadpriorityclasses"),
        );
        self.apply_kueue(
            &api,
            object("WorkloadPriorityClass", &name, json!({"value": value})),
        )
        .await;
        name
    }

    /// The Workloads Kueue made in this namespace (their JSON).
    pub async fn kueue_workloads(&self) -> Vec<DynamicObject> {
        let api: Api<DynamicObject> = Api::namespaced_with(
            self.client.clone(),
            &self.name,
            &resource("Workload", "workloads"),
        );
        api.list(&Default::default())
            .await
            .map(|l| l.items)
            .unwrap_or_default()
    }

    /// Deletes the cluster-scoped objects of [`TestNs::kueue_queue`] and
    /// [`TestNs::kueue_priority`] (the namespace's deletion takes the rest).
    pub async fn delete_kueue_objects(&self, queue: &TestQueue, priorities: &[String]) {
        let dp = DeleteParams::default();
        let cqs: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &resource("ClusterQueue", "clusterqueues"),
        );
        let _ = cqs.delete(&queue.cluster, &dp).await;
        let rfs: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &resource("ResourceFlavor", "resourceflavors"),
        );
        for f in &queue.flavors {
            let _ = rfs.delete(f, &dp).await;
        }
        let pcs: Api<DynamicObject> = Api::all_with(
            self.client.clone(),
            &resource("WorkloadPriorityClass", "workloadpriorityclasses"),
        );
        for p in priorities {
            let _ = pcs.delete(p, &dp).await;
        }
    }
}

/// A job manifest with the Kueue labels a user adds: its LocalQueue, and a
/// WorkloadPriorityClass when given.
pub fn queued(yaml: &str, queue: &str, priority: Option<&str>) -> String {
    let mut job: serde_yaml::Value = serde_yaml::from_str(yaml).expect("job manifest");
    let labels = job["metadata"]
        .as_mapping_mut()
        .expect("metadata")
        .entry("labels".into())
        .or_insert_with(|| serde_yaml::Value::Mapping(Default::default()));
    let labels = labels.as_mapping_mut().expect("labels");
    labels.insert("kueue.x-k8s.io/queue-name".into(), queue.into());
    if let Some(p) = priority {
        labels.insert("kueue.x-k8s.io/priority-class".into(), p.into());
    }
    serde_yaml::to_string(&job).expect("job manifest")
}
