//! The chart's token Secret policy (charts/headroom/files/token-secret-policy.yaml)
//! on a real kube-apiserver: a job's initializer sends the token of the
//! Secret the job names to the job's hub endpoint, so creating a job must not
//! be a way to use a Secret one may not read. A user who may create jobs but
//! not `get` the Secret is refused, with a message naming the field; once
//! granted `get` on that Secret (and on that one only) the job is admitted.
//! The API server's authorizer answers for the requesting user; no webhook.
//! An update that changes the job's pods (image, placement, priority) needs
//! `get` on every Secret the job names; image pull Secrets are checked like
//! the token; the hub sources stay immutable even without the spec-rules
//! policy.
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

/// `spec.worker`'s fields that choose what the job's pods run, or where and
/// before whom: changing one re-checks every Secret the job names. Labels
/// count: a NetworkPolicy or another pod's affinity may select by them.
const WORKER_FIELDS_THAT_MOVE_PODS: [&str; 13] = [
    "image",
    "nodeSelector",
    "tolerations",
    "priorityClassName",
    "runtimeClassName",
    "env",
    "podAnnotations",
    "podLabels",
    // The identity the pods (the initializer with the token among them)
    // run as: a cloud identity reaches what the token's owner may not.
    "serviceAccountName",
    "affinity",
    // What the container reads: its variables and files.
    "envFrom",
    "volumes",
    "volumeMounts",
];
/// The others: the backend picks the operator's own image when none is
/// named, the pull policy and the grace period change nothing that runs,
/// and the pull Secrets have their own rule.
const WORKER_FIELDS_THAT_DO_NOT: [&str; 4] = [
    "backend",
    "imagePullPolicy",
    "imagePullSecrets",
    "terminationGracePeriodSeconds",
];

/// Every field of `spec.worker` is sorted into one of the two lists (a new
/// placement field cannot slip past the update check unnoticed); the policy
/// compares the first on every update, checks the pull Secrets through the
/// authorizer, and keeps both hub sources immutable.
#[test]
fn the_policy_rechecks_secrets_when_the_pods_change() {
    let crd: Value = serde_yaml::from_str(&crd_yaml().expect("crd")).expect("yaml");
    let worker = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]
        ["worker"]["properties"];
    let mut fields: Vec<&str> = worker
        .as_object()
        .expect("spec.worker's fields")
        .keys()
        .map(String::as_str)
        .collect();
    fields.sort_unstable();
    let mut sorted: Vec<&str> = WORKER_FIELDS_THAT_MOVE_PODS
        .iter()
        .chain(&WORKER_FIELDS_THAT_DO_NOT)
        .copied()
        .collect();
    sorted.sort_unstable();
    assert_eq!(fields, sorted, "sort each field of spec.worker into a list");

    let (policy, _) = policy_documents();
    let spec = policy.spec.expect("spec");
    let variables = spec.variables.unwrap_or_default();
    let variable = |name: &str| {
        variables
            .iter()
            .find(|v| v.name == name)
            .unwrap_or_else(|| panic!("{POLICY}: variable {name}"))
            .expression
            .clone()
    };
    let pods_changed = variable("podsChanged");
    for field in WORKER_FIELDS_THAT_MOVE_PODS {
        assert!(
            pods_changed.contains(&format!("object.?spec.?worker.?{field}.")),
            "podsChanged compares spec.worker.{field}: {pods_changed}"
        );
    }
    assert!(variable("unreadablePullSecrets").contains("check('get').allowed()"));
    let validations = spec.validations.unwrap_or_default();
    for (field, old) in [
        ("spec.worker.imagePullSecrets: ", None),
        (
            "spec.model.pretrained.huggingFace is immutable",
            Some("oldObject.?spec.?model.?pretrained.?huggingFace"),
        ),
        (
            "spec.data.huggingFace is immutable",
            Some("oldObject.?spec.?data.?huggingFace"),
        ),
    ] {
        let rule = validations
            .iter()
            .find(|v| v.message.as_deref().is_some_and(|m| m.starts_with(field)))
            .unwrap_or_else(|| panic!("{POLICY}: no rule for {field}"));
        if let Some(old) = old {
            assert!(rule.expression.contains(old), "{}", rule.expression);
        }
    }
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
struct Requester {
    user: String,
    jobs: Api<MemoryAwareTrainingJob>,
}

/// A user who may create, read and delete jobs here, and read no Secret.
async fn a_job_creator_who_reads_no_secret(ns: &TestNs) -> Requester {
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
    Requester { user, jobs }
}

/// Naming the model's Secret is refused once the policy is in force
/// (policies take effect asynchronously: an early admission is undone), and
/// the dataset's Secret and an image pull Secret alike, each with its own
/// field.
async fn naming_a_secret_one_may_not_get_is_refused_naming_the_field(
    ns: &TestNs,
    creator: &Requester,
) {
    let Requester { user, jobs } = creator;
    let model_job = job("model-token", MODEL_WITH_TOKEN, DATA_ON_CLAIM);
    let field = "spec.model.pretrained.huggingFace.tokenSecret: ";
    let (code, message) = refused_once_in_force(ns, jobs, &model_job, field).await;
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
    // Waited for too: an older version of the policy, still in force for a
    // moment after this one is applied, checks no pull Secret.
    let mut pulled = job("pull-secret", MODEL_ON_CLAIM, DATA_ON_CLAIM);
    pulled.spec.worker.image_pull_secrets = vec![headroom_api::SecretName {
        name: "registry".into(),
    }];
    let (code, message) =
        refused_once_in_force(ns, jobs, &pulled, "spec.worker.imagePullSecrets: ").await;
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(&format!(
            "spec.worker.imagePullSecrets: {user} may not get every one of Secrets registry"
        )),
        "{message}"
    );
}

/// The refusal of `job`'s create naming `field`, once the policy is in force
/// (policies take effect asynchronously: an early admission is undone).
async fn refused_once_in_force(
    ns: &TestNs,
    jobs: &Api<MemoryAwareTrainingJob>,
    job: &MemoryAwareTrainingJob,
    field: &str,
) -> (u16, String) {
    let name = job.name_any();
    ns.wait_for("the policy in force", TIMEOUT, || async {
        match create(jobs, job).await {
            Err((code, message)) if message.contains(field) => Some((code, message)),
            Ok(()) => {
                let _ = ns.jobs().delete(&name, &DeleteParams::default()).await;
                None
            }
            Err(_) => None,
        }
    })
    .await
}

/// Granted `get` on hf-token alone: the model's Secret is admitted, the
/// dataset's (another Secret) still refused.
async fn get_on_one_secret_admits_that_secret_only(ns: &TestNs, creator: &Requester) {
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
    let editor = a_job_editor_who_reads_no_secret(ns).await;
    let patch = Patch::Merge(json!({"spec": {"training": {"steps": 40}}}));
    let edited = ns
        .wait_for("the editor may patch jobs", TIMEOUT, || async {
            editor
                .jobs
                .patch("admin-token", &PatchParams::default(), &patch)
                .await
                .ok()
        })
        .await;
    assert_eq!(edited.spec.training.steps, Some(40));
}

/// What the API server answered a merge patch of job `name`.
async fn patch(
    jobs: &Api<MemoryAwareTrainingJob>,
    name: &str,
    patch: &Value,
) -> Result<(), (u16, String)> {
    match jobs
        .patch(name, &PatchParams::default(), &Patch::Merge(patch))
        .await
    {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(e)) => Err((e.code, e.message)),
        Err(e) => Err((0, e.to_string())),
    }
}

/// A user who may read and patch jobs here, and read no Secret.
async fn a_job_editor_who_reads_no_secret(ns: &TestNs) -> Requester {
    let user = format!("job-editor@{}", ns.name);
    grant(
        ns,
        "job-editor",
        &user,
        json!([{"apiGroups": ["headroom.dev"], "resources": ["memoryawaretrainingjobs"],
                "verbs": ["get", "patch"]}]),
    )
    .await;
    let jobs = Api::namespaced(client_as(&user).await, &ns.name);
    Requester { user, jobs }
}

/// One change of each field that moves a job's pods, `n` making it new.
fn pod_changes(n: u32) -> [Value; 9] {
    [
        json!({"spec": {"worker": {"image": format!("registry.example/other:{n}")}}}),
        json!({"spec": {"worker": {"nodeSelector": {"pool": format!("pool-{n}")}}}}),
        json!({"spec": {"worker": {"tolerations": [
            {"key": "dedicated", "operator": "Equal", "value": format!("team-{n}"), "effect": "NoSchedule"}
        ]}}}),
        json!({"spec": {"worker": {"priorityClassName": format!("priority-{n}")}}}),
        json!({"spec": {"worker": {"runtimeClassName": format!("runtime-{n}")}}}),
        json!({"spec": {"worker": {"env": [{"name": "LD_PRELOAD", "value": format!("/claims/x/{n}.so")}]}}}),
        json!({"spec": {"worker": {"serviceAccountName": format!("identity-{n}")}}}),
        json!({"spec": {"worker": {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "pool", "operator": "In", "values": [format!("pool-{n}")]}]}]
        }}}}}}),
        json!({"spec": {"worker": {"envFrom": [{"configMapRef": {"name": format!("settings-{n}")}}]}}}),
    ]
}

/// The image, placement or priority of a job that names a token Secret is
/// changed only by a user who may get that Secret (a retried initializer
/// runs the job's current image with the token); a pull Secret the user may
/// not get is refused like a token.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn changing_the_pods_of_a_job_that_names_a_secret_needs_get_on_it() {
    let ns = test_ns("hr-secret-update").await;
    install_policy(&ns.client).await;
    create_secrets(&ns, &["hf-token", "registry"]).await;
    create(
        &ns.jobs(),
        &job("token-job", MODEL_WITH_TOKEN, DATA_ON_CLAIM),
    )
    .await
    .expect("an administrator may name the Secret");
    let editor = an_editor_is_refused_each_change_of_the_pods(&ns).await;

    let pull = json!({"spec": {"worker": {"imagePullSecrets": [{"name": "registry"}]}}});
    let (code, message) = patch(&editor.jobs, "token-job", &pull)
        .await
        .expect_err("a pull Secret the editor may not get");
    assert_eq!(code, 403, "{message}");
    assert!(
        message.contains(&format!(
            "spec.worker.imagePullSecrets: {} may not get every one of Secrets registry in namespace {}",
            editor.user, ns.name
        )),
        "{message}"
    );

    grant(
        &ns,
        "read-hf-token",
        &editor.user,
        json!([{"apiGroups": [""], "resources": ["secrets"], "resourceNames": ["hf-token"],
                "verbs": ["get"]}]),
    )
    .await;
    let [first, rest @ ..] = pod_changes(1000);
    ns.wait_for(
        "the change admitted once get is granted",
        TIMEOUT,
        || async { patch(&editor.jobs, "token-job", &first).await.ok() },
    )
    .await;
    for change in rest {
        patch(&editor.jobs, "token-job", &change)
            .await
            .unwrap_or_else(|e| panic!("{change}: {e:?}"));
    }
    let (code, message) = patch(&editor.jobs, "token-job", &pull)
        .await
        .expect_err("get on the token is not get on the pull Secret");
    assert_eq!(code, 403, "{message}");
    ns.cleanup().await;
}

/// An editor who may not get the job's token Secret: each change of the
/// pods is refused once the policy is in force (a change admitted before
/// is followed by another, new one), naming the Secret and the fields.
async fn an_editor_is_refused_each_change_of_the_pods(ns: &TestNs) -> Requester {
    let editor = a_job_editor_who_reads_no_secret(ns).await;
    let expected = format!(
        "spec.model.pretrained.huggingFace.tokenSecret: {} may not get Secret hf-token in namespace {}, \
         so may not change spec.worker.image, nodeSelector, tolerations, priorityClassName, runtimeClassName, env, podAnnotations, podLabels, serviceAccountName, affinity, envFrom, volumes or volumeMounts",
        editor.user, ns.name
    );
    let tries = std::sync::atomic::AtomicU32::new(0);
    ns.wait_for("an image change refused", TIMEOUT, || async {
        let n = tries.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let [image, ..] = pod_changes(n);
        match patch(&editor.jobs, "token-job", &image).await {
            Err((_, message)) if message.contains(&expected) => Some(()),
            _ => None,
        }
    })
    .await;
    for change in pod_changes(999) {
        let (code, message) = patch(&editor.jobs, "token-job", &change)
            .await
            .expect_err("refused");
        assert_eq!(code, 403, "{change}: {message}");
        assert!(message.contains(&expected), "{change}: {message}");
    }
    editor
}

/// The hub sources are immutable in the token policy itself: with the
/// spec-rules policy (which says so too) unbound, changing the endpoint a
/// job's token goes to is still refused, for the model's hub and the
/// data's. The spec-rules policy is bound again before the verdict.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn the_hub_endpoint_stays_immutable_without_the_spec_rules_policy() {
    use headroom_api::admission::SPEC_RULES_POLICY;
    let ns = test_ns("hr-hub-immutable").await;
    install_policy(&ns.client).await;
    create_secrets(&ns, &["hf-token", "hf-data"]).await;
    create(
        &ns.jobs(),
        &job("hub-job", MODEL_WITH_TOKEN, DATA_WITH_TOKEN),
    )
    .await
    .expect("an administrator may name the Secrets");

    Api::<ValidatingAdmissionPolicyBinding>::all(ns.client.clone())
        .delete(SPEC_RULES_POLICY, &DeleteParams::default())
        .await
        .map(|_| ())
        .or_else(|e| match e {
            kube::Error::Api(e) if e.code == 404 => Ok(()),
            e => Err(e),
        })
        .expect("unbind the spec rules");
    let model_refusal = endpoint_change_refusal(&ns, "model", "pretrained").await;
    let data_refusal = endpoint_change_refusal(&ns, "data", "").await;
    headroom_e2e::crd::install(&ns.client, "headroom-tests")
        .await
        .expect("spec rules bound again");

    for (refusal, field) in [
        (
            model_refusal,
            "spec.model.pretrained.huggingFace is immutable",
        ),
        (data_refusal, "spec.data.huggingFace is immutable"),
    ] {
        let (code, message) = refusal.unwrap_or_else(|| {
            panic!("{field}: the endpoint changed with the spec-rules policy unbound")
        });
        assert_eq!(code, 422, "{message}");
        assert!(
            message.contains("headroom-token-secret-access") && message.contains(field),
            "{message}"
        );
    }
    ns.cleanup().await;
}

/// Changes `spec.<source>[.<nested>].huggingFace.endpoint` of hub-job, as an
/// administrator, until the token policy refuses it (a refusal by the
/// spec-rules policy, still unbinding, or an admission before the policy's
/// new version is in force, is tried again with another endpoint): the
/// refusal, or None after 30 s.
async fn endpoint_change_refusal(ns: &TestNs, source: &str, nested: &str) -> Option<(u16, String)> {
    for n in 0..120 {
        let hub = json!({"huggingFace": {"endpoint": format!("https://elsewhere-{n}.example")}});
        let at = if nested.is_empty() {
            json!({ source: hub })
        } else {
            json!({ source: { nested: hub } })
        };
        match patch(&ns.jobs(), "hub-job", &json!({ "spec": at })).await {
            Err((code, message)) if message.contains("headroom-token-secret-access") => {
                return Some((code, message));
            }
            _ => tokio::time::sleep(std::time::Duration::from_millis(250)).await,
        }
    }
    None
}
