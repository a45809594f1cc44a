//! The MemoryAwareTrainingJob CRD on a control plane that has no Helm chart
//! installed, and what the API server says about a manifest.

use std::time::Duration;

use headroom_api::MemoryAwareTrainingJob;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, ListParams, Patch, PatchParams, PostParams};
use kube::runtime::wait::{await_condition, conditions};
use kube::{Client, CustomResourceExt};

/// How long the CRD may take to be established and served.
const SERVED_TIMEOUT: Duration = Duration::from_secs(30);

/// Server-side applies the CRD generated from the API types (the one
/// `make manifests` writes to crds/) and waits until it is established and
/// its resource is served, so a create right after cannot meet a 404.
pub async fn install(client: &Client, field_manager: &str) -> Result<(), String> {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let crd = MemoryAwareTrainingJob::crd();
    let name = crd.metadata.name.clone().unwrap_or_default();
    crds.patch(
        &name,
        &PatchParams::apply(field_manager).force(),
        &Patch::Apply(&crd),
    )
    .await
    .map_err(|e| format!("apply CRD {name}: {e}"))?;
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
            Ok(_) => return Ok(()),
            Err(kube::Error::Api(s)) if s.code == 404 => {}
            Err(e) => return Err(format!("list {name}: {e}")),
        }
        if tokio::time::Instant::now() > deadline {
            return Err(format!("{name} not served within {SERVED_TIMEOUT:?}"));
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
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
