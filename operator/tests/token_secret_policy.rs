//! The chart's token Secret policy (charts/headroom/files/token-secret-policy.yaml)
//! on a real kube-apiserver: a job's initializer sends the token of the
//! Secret the job names to the job's hub endpoint, so creating a job must not
//! be a way to use a Secret one may not read. A user who may create jobs but
//! not `get` the Secret is refused, with a message naming the field; once
//! granted `get` on that Secret (and on that one only) the job is admitted.
//! The API server's authorizer answers for the requesting user; no webhook.
//!
//! The API-server test is ignored by plain `cargo test`; `make test-apiserver` runs it.

mod support;

use headroom_api::MemoryAwareTrainingJob;
use headroom_operator::crd::crd_yaml;
use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::{Value, json};
use support::*;

const POLICY: &str = "charts/headroom/files/token-secret-policy.yaml";
const TEMPLATE: &str = "charts/headroom/templates/token-secret-policy.yaml";

fn policy_documents() -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
    let text = std::fs::read_to_string(workspace_root().join(POLICY)).expect("policy file");
    let mut docs = text.split("\n---\n");
    let policy = serde_yaml::from_str(docs.next().expect("policy")).expect("policy parses");
    let binding = serde_yaml::from_str(docs.next().expect("binding")).expect("binding parses");
    (policy, binding)
}

/// Every place the CRD lets a job name a Secret (`tokenSecret`), as the
/// API server writes its path (`spec.model.pretrained.huggingFace.tokenSecret`).
fn token_secret_fields() -> Vec<String> {
    fn walk(schema: &Value, path: &str, out: &mut Vec<String>) {
        let Some(properties) = schema["properties"].as_object() else {
            return;
        };
        for (name, child) in properties {
            let here = format!("{path}.{name}");
            if name == "tokenSecret" {
                out.push(here.clone());
            }
            walk(child, &here, out);
        }
    }
    let crd: Value = serde_yaml::from_str(&crd_yaml().expect("crd")).expect("yaml");
    let spec = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"];
    let mut out = vec![];
    walk(spec, "spec", &mut out);
    out.sort();
    out
}

/// The chart renders the policy file as it is, and the policy checks every
/// Secret reference the CRD has, each with a message naming its field: a
/// new `tokenSecret` without a rule would let any job creator use any Secret.
#[test]
fn the_policy_checks_every_secret_a_job_can_name() {
    let template = std::fs::read_to_string(workspace_root().join(TEMPLATE)).expect("template");
    assert!(
        template.contains(r#".Files.Get "files/token-secret-policy.yaml""#),
        "{TEMPLATE} includes {POLICY}"
    );
    let fields = token_secret_fields();
    assert_eq!(
        fields,
        [
            "spec.data.huggingFace.tokenSecret",
            "spec.model.pretrained.huggingFace.tokenSecret"
        ]
    );
    let (policy, binding) = policy_documents();
    let spec = policy.spec.expect("spec");
    let validations = spec.validations.unwrap_or_default();
    for field in &fields {
        let rule = validations
            .iter()
            .find(|v| {
                v.message
                    .as_deref()
                    .is_some_and(|m| m.starts_with(&format!("{field}: ")))
            })
            .unwrap_or_else(|| panic!("{POLICY}: no rule for {field}"));
        assert!(
            rule.expression.contains("resource('secrets')")
                && rule.expression.contains("check('get').allowed()"),
            "{field}: {}",
            rule.expression
        );
        assert!(
            rule.message_expression
                .as_deref()
                .is_some_and(|m| m.contains(&format!("'{field}: '"))),
            "{field}: the message names the field"
        );
    }
    assert_eq!(spec.failure_policy.as_deref(), Some("Fail"));
    let binding = binding.spec.expect("binding spec");
    assert_eq!(
        binding.policy_name.as_deref(),
        policy.metadata.name.as_deref()
    );
    assert_eq!(binding.validation_actions, Some(vec!["Deny".to_string()]));
}

/// Applies the chart's policy (cluster-scoped, the chart's own names, server-side
/// apply: repeated runs, and the chart-check's apply, leave one copy).
async fn install_policy(client: &Client) {
    let (policy, binding) = policy_documents();
    let pp = PatchParams::apply("headroom-tests").force();
    Api::<ValidatingAdmissionPolicy>::all(client.clone())
        .patch(&policy.name_any(), &pp, &Patch::Apply(&policy))
        .await
        .expect("policy applied");
    Api::<ValidatingAdmissionPolicyBinding>::all(client.clone())
        .patch(&binding.name_any(), &pp, &Patch::Apply(&binding))
        .await
        .expect("binding applied");
}

/// A client that acts as `user` (impersonation by the test's admin).
async fn client_as(user: &str) -> Client {
    let mut config = kube::Config::infer().await.expect("kubeconfig");
    config.auth_info.impersonate = Some(user.to_string());
    Client::try_from(config).expect("impersonating client")
}

/// A Role in the test's namespace with `rules`, bound to `user`.
async fn grant(ns: &TestNs, name: &str, user: &str, rules: Value) {
    let pp = PostParams::default();
    let role: Role =
        serde_json::from_value(json!({"metadata": {"name": name}, "rules": rules})).expect("role");
    Api::<Role>::namespaced(ns.client.clone(), &ns.name)
        .create(&pp, &role)
        .await
        .expect("role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    }))
    .expect("binding");
    Api::<RoleBinding>::namespaced(ns.client.clone(), &ns.name)
        .create(&pp, &binding)
        .await
        .expect("role binding");
}

/// The fine-tuning sample, named `name`, with `model` and `data` sources.
fn job(name: &str, model: &str, data: &str) -> MemoryAwareTrainingJob {
    let sample = include_str!("../../samples/cpu-finetune-tiny-llama.yaml")
        .replace("name: finetune-tiny-llama", &format!("name: {name}"))
        .replace("volume: {claimName: models, path: tiny-llama}", model)
        .replace(
            "volume: {claimName: datasets, path: declaration-of-independence.jsonl}",
            data,
        );
    serde_yaml::from_str(&sample).expect("job")
}

const MODEL_ON_CLAIM: &str = "volume: {claimName: models, path: tiny-llama}";
const DATA_ON_CLAIM: &str =
    "volume: {claimName: datasets, path: declaration-of-independence.jsonl}";
const MODEL_WITH_TOKEN: &str =
    "huggingFace: {repo: headroom/tiny-llama, tokenSecret: {name: hf-token}}";
const DATA_WITH_TOKEN: &str = "huggingFace: {repo: headroom/declaration, file: data/train.jsonl, tokenSecret: {name: hf-data}}";

/// What the API server answered a create: `Ok`, or the status code and message.
async fn create(
    jobs: &Api<MemoryAwareTrainingJob>,
    job: &MemoryAwareTrainingJob,
) -> Result<(), (u16, String)> {
    match jobs.create(&PostParams::default(), job).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) => Err((e.code, e.message)),
        Err(e) => Err((0, e.to_string())),
    }
}

#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_job_may_name_only_a_secret_its_creator_may_get() {
    let ns = test_ns("hr-token-secret").await;
    install_policy(&ns.client).await;
    create_secrets(&ns, &["hf-token", "hf-data"]).await;
    let creator = a_job_creator_who_reads_no_secret(&ns).await;

    // A job that names no Secret is this user's to create (RBAC is in force).
    let plain = job("no-secret", MODEL_ON_CLAIM, DATA_ON_CLAIM);
    ns.wait_for("the user may create jobs", TIMEOUT, || async {
        create(&creator.jobs, &plain).await.ok()
    })
    .await;

    naming_a_secret_one_may_not_get_is_refused_naming_the_field(&ns, &creator).await;
    // An administrator, who may read every Secret, is admitted.
    let admin_job = job("admin-token", MODEL_WITH_TOKEN, DATA_WITH_TOKEN);
    create(&ns.jobs(), &admin_job)
        .await
        .expect("an administrator may name the Secret");
    get_on_one_secret_admits_that_secret_only(&ns, &creator).await;
    an_edit_that_keeps_the_secret_is_no_new_use(&ns).await;
    ns.cleanup().await;
}

/// Secrets of these names, each with a token.
async fn create_secrets(ns: &TestNs, names: &[&str]) {
    let secrets: Api<Secret> = Api::namespaced(ns.client.clone(), &ns.name);
    for name in names {
        let secret: Secret = serde_json::from_value(json!({
            "metadata": {"name": name}, "stringData": {"token": format!("hf_{name}")}
        }))
        .expect("secret");
        secrets
            .create(&PostParams::default(), &secret)
            .await
            .expect("secret");
    }
}

/// A user, and the jobs of the test's namespace as that user sees them.
struct Creator {
    user: String,
    jobs: Api<MemoryAwareTrainingJob>,
}

/// A user who may create, read and delete jobs here, and read no Secret.
async fn a_job_creator_who_reads_no_secret(ns: &TestNs) -> Creator {
    let user = format!("job-creator@{}", ns.name);
    grant(
        ns,
        "job-creator",
        &user,
        json!([{"apiGroups": ["headroom.dev"], "resources": ["memoryawaretrainingjobs"],
                "verbs": ["create", "get", "delete"]}]),
    )
    .await;
    let jobs = Api::namespaced(client_as(&user).await, &ns.name);
    Creator { user, jobs }
}

/// Naming the model's Secret is refused once the policy is in force
/// (policies take effect asynchronously: an early admission is undone), and
/// the dataset's Secret alike, each with its own field.
async fn naming_a_secret_one_may_not_get_is_refused_naming_the_field(
    ns: &TestNs,
    creator: &Creator,
) {
    let Creator { user, jobs } = creator;
    let model_job = job("model-token", MODEL_WITH_TOKEN, DATA_ON_CLAIM);
    let field = "spec.model.pretrained.huggingFace.tokenSecret: ";
    let (code, message) = ns
        .wait_for("the policy in force", TIMEOUT, || async {
            match create(jobs, &model_job).await {
                Err((code, message)) if message.contains(field) => Some((code, message)),
                Ok(()) => {
                    let _ = ns
                        .jobs()
                        .delete("model-token", &DeleteParams::default())
                        .await;
                    None
                }
                Err(_) => None,
            }
        })
        .await;
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(&format!(
            "{field}{user} may not get Secret hf-token in namespace {}",
            ns.name
        )) && message.contains("name a Secret you may read, or ask for get on this one"),
        "{message}"
    );
    let data_job = job("data-token", MODEL_ON_CLAIM, DATA_WITH_TOKEN);
    let (code, message) = create(jobs, &data_job).await.expect_err("refused");
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(&format!(
            "spec.data.huggingFace.tokenSecret: {user} may not get Secret hf-data"
        )),
        "{message}"
    );
}

/// Granted `get` on hf-token alone: the model's Secret is admitted, the
/// dataset's (another Secret) still refused.
async fn get_on_one_secret_admits_that_secret_only(ns: &TestNs, creator: &Creator) {
    grant(
        ns,
        "read-hf-token",
        &creator.user,
        json!([{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["hf-token"],
                "verbs": ["get"]}]),
    )
    .await;
    let model_job = job("model-token", MODEL_WITH_TOKEN, DATA_ON_CLAIM);
    ns.wait_for("the job admitted after get is granted", TIMEOUT, || async {
        create(&creator.jobs, &model_job).await.ok()
    })
    .await;
    let stored = ns.jobs().get("model-token").await.expect("stored");
    assert_eq!(
        stored
            .spec
            .model
            .pretrained
            .and_then(|p| p.hugging_face)
            .and_then(|hf| hf.token_secret)
            .map(|s| s.name),
        Some("hf-token".to_string())
    );
    let data_job = job("data-token", MODEL_ON_CLAIM, DATA_WITH_TOKEN);
    let (code, message) = create(&creator.jobs, &data_job)
        .await
        .expect_err("still refused");
    assert_eq!(code, 403, "{message}");
    assert!(message.contains("hf-data"), "{message}");
}

/// An edit that keeps the job's Secret is not a new use of it: a user who
/// may edit jobs but read no Secret changes the steps of the admin's job.
async fn an_edit_that_keeps_the_secret_is_no_new_use(ns: &TestNs) {
    let editor = format!("job-editor@{}", ns.name);
    grant(
        ns,
        "job-editor",
        &editor,
        json!([{"apiGroups": ["headroom.dev"], "resources": ["memoryawaretrainingjobs"],
                "verbs": ["get", "patch"]}]),
    )
    .await;
    let editor_jobs: Api<MemoryAwareTrainingJob> =
        Api::namespaced(client_as(&editor).await, &ns.name);
    let patch = Patch::Merge(json!({"spec": {"training": {"steps": 40}}}));
    let edited = ns
        .wait_for("the editor may patch jobs", TIMEOUT, || async {
            editor_jobs
                .patch("admin-token", &PatchParams::default(), &patch)
                .await
                .ok()
        })
        .await;
    assert_eq!(edited.spec.training.steps, 40);
}
