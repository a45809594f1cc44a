//! The MemoryAwareTrainingJob CRD on a control plane that has no Helm chart
//! installed, and what the API server says about a manifest.

use std::time::Duration;

use headroom_api::MemoryAwareTrainingJob;
use headroom_api::admission::{self, SPEC_RULES_POLICY};
use k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::Client;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};

/// How long the CRD may take to be established and served, and its spec
/// rules' policy to be enforced.
const SERVED_TIMEOUT: Duration = Duration::from_secs(30);

/// Server-side applies what `make manifests` writes to crds/ (the CRD and
/// the policy with its spec rules, generated from the API types) and waits
/// until the CRD is established, its resource served and the policy
/// enforced, so a create right after meets neither a 404 nor a spec the
/// rules would refuse let through.
pub async fn install(client: &Client, field_manager: &str) -> Result<(), String> {
    let crd = admission::crd();
    let name = crd.metadata.name.clone().unwrap_or_default();
    apply(client, field_manager, &name, &crd).await?;
    let generation_before = Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .get_opt(SPEC_RULES_POLICY)
        .await
        .map_err(|e| format!("read ValidatingAdmissionPolicy {SPEC_RULES_POLICY}: {e}"))?
        .and_then(|p| p.metadata.generation);
    let policy = apply(
        client,
        field_manager,
        SPEC_RULES_POLICY,
        &admission::spec_rules_policy(),
    )
    .await?;
    apply(
        client,
        field_manager,
        SPEC_RULES_POLICY,
        &admission::spec_rules_binding(),
    )
    .await?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let deadline = tokio::time::Instant::now() + SERVED_TIMEOUT;
    let established = await_condition(crds, &name, conditions::is_crd_established());
    match tokio::time::timeout_at(deadline, established).await {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => return Err(format!("watch CRD {name}: {e}")),
        Err(_) => {
            return Err(format!(
                "CRD {name} not established within {SERVED_TIMEOUT:?}"
            ));
        }
    }
    // Established, yet the resource's handler can lag by a moment. (Metadata
    // only: a stored job the types cannot read must not fail this.)
    let jobs: Api<MemoryAwareTrainingJob> = Api::all(client.clone());
    loop {
        match jobs.list_metadata(&ListParams::default().limit(1)).await {
            Ok(_) => break,
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(format!("list {name}: {e}")),
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("{name} not served within {SERVED_TIMEOUT:?}"));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    // The API server loads a new policy from its informers, a moment after
    // the apply. A changed policy gets a moment more: the probe below cannot
    // tell its older version from the new one (and the status that would,
    // `observedGeneration`, is kube-controller-manager's, which a bare
    // control plane may not run). Then probe with a spec only the rules
    // refuse (a CPU job in bf16).
    if policy.metadata.generation != generation_before {
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let mut probe: serde_json::Value =
        serde_yaml::from_str(crate::fixtures::CPU_TINY).map_err(|e| format!("probe: {e}"))?;
    probe["spec"]["training"]["precision"] = "bf16".into();
    // A name no test uses: a stored job of the same name would answer
    // "already exists" while the policy is not loaded yet.
    probe["metadata"]["name"] = "headroom-spec-rules-probe".into();
    let probe = serde_yaml::to_string(&probe).map_err(|e| format!("probe: {e}"))?;
    loop {
        match dry_run_create(client, "default", &probe).await {
            Err(m) if m.contains(SPEC_RULES_POLICY) => return Ok(()),
            // Accepted: the policy is not loaded yet.
            Ok(()) => {}
            Err(m) => {
                return Err(format!(
                    "probe of {SPEC_RULES_POLICY}: refused otherwise: {m}"
                ));
            }
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!(
                "{SPEC_RULES_POLICY} not enforced within {SERVED_TIMEOUT:?}"
            ));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Server-side applies one cluster-scoped object, forcing conflicts (the
/// tests, the benches and chart-check apply the same objects as managers of
/// their own).
async fn apply<K>(client: &Client, field_manager: &str, name: &str, object: &K) -> Result<K, String>
where
    K: kube::Resource<Scope = k8s_openapi::ClusterResourceScope>
        + Clone
        + std::fmt::Debug
        + k8s_openapi::serde::Serialize
        + k8s_openapi::serde::de::DeserializeOwned,
    K::DynamicType: Default,
{
    Api::<K>::all(client.clone())
        .patch(
            name,
            &PatchParams::apply(field_manager).force(),
            &Patch::Apply(object),
        )
        .await
        .map_err(|e| format!("apply {} {name}: {e}", K::kind(&K::DynamicType::default())))
}

/// Creates `manifest` (YAML) in `namespace` as a server-side dry run:
/// `Ok` if the API server accepts it, else the server's message (schema,
/// CEL and admission errors name the field).
pub async fn dry_run_create(
    client: &Client,
    namespace: &str,
    manifest: &str,
) -> Result<(), String> {
    let api: Api<DynamicObject> = Api::namespaced_with(
        client.clone(),
        namespace,
        &ApiResource::erase::<MemoryAwareTrainingJob>(&()),
    );
    let obj: DynamicObject =
        serde_yaml::from_str(manifest).map_err(|e| format!("not a manifest: {e}"))?;
    let pp = PostParams {
        dry_run: true,
        ..PostParams::default()
    };
    match api.create(&pp, &obj).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) => Err(s.message),
        Err(e) => Err(e.to_string()),
    }
}
