//! Where the API server checks a job's spec.
//!
//! The spec's cross-field rules are declared beside the fields they check,
//! as CEL `x-kubernetes-validations` on the types (`job/`), and
//! [`MemoryAwareTrainingJobSpec::job_request`](crate::MemoryAwareTrainingJobSpec::job_request)
//! repeats them offline in the same words. Every one of them reads the
//! spec only. kube-apiserver (v1.33) evaluates a CRD's rules on every write
//! of an object, status writes included, which cannot change the spec: the
//! rules were 11–19 % of the API server's CPU for each status write, and a
//! running job's status is written far more often than its spec
//! (docs/benchmarks.md, "One job object on the API server").
//!
//! So the CRD Headroom ships ([`crd`]) is the types' schema without the
//! rules, and the rules run in a ValidatingAdmissionPolicy
//! ([`spec_rules_policy`], bound by [`spec_rules_binding`]) on creates and
//! updates of the resource, not of its status subresource, and only when the
//! spec is new or changed (as the CRD's ratcheting let an unchanged spec
//! through). A refusal names the field as the CRD's rule did:
//! `… denied request: spec.training.microBatch must divide training.globalBatch`.
//! `make manifests` writes both next to the CRD (`crds/`) and into the
//! chart, so `kubectl apply -f crds/` and `helm install` validate alike.

use k8s_openapi::api::admissionregistration::v1::{
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding,
};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;
use serde_json::{Value, json};

use crate::MemoryAwareTrainingJob;

/// Name of the policy and of its binding (cluster-scoped, like the CRD).
pub const SPEC_RULES_POLICY: &str = "headroom-spec-rules";

/// One of the spec's rules, where the types declare it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpecRule {
    /// The field the rule sits on: `["spec", "training"]`.
    pub path: Vec<String>,
    /// CEL on `self` (and `oldSelf` for a transition rule).
    pub rule: String,
    pub message: String,
}

impl SpecRule {
    /// A transition rule: it compares the field with its stored value.
    pub fn is_transition(&self) -> bool {
        contains_word(&self.rule, "oldSelf")
    }

    /// The refusal's words: the rule's message, which names its field
    /// relative to `spec` (`training.microBatch must divide …`), made a full
    /// path; a message that does not start with its field gets the field in
    /// front (`spec.data.volume: path is relative …`).
    pub fn refusal(&self) -> String {
        let relative = self.path[1..].join(".");
        let names_its_field = relative.is_empty()
            || self
                .message
                .strip_prefix(&relative)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with(['.', ':', ' ', '[']));
        if names_its_field {
            format!("spec.{}", self.message)
        } else {
            format!("{}: {}", self.path.join("."), self.message)
        }
    }

    /// The rule as a policy expression on `object` (and `oldObject`): each
    /// optional field on the way guarded by `has()`, since the CRD evaluated
    /// a rule only where its field is set; a transition rule only where both
    /// objects have the field (never on a create).
    pub fn expression(&self) -> String {
        let at = |root: &str, upto: usize| {
            std::iter::once(root)
                .chain(self.path[..upto].iter().map(String::as_str))
                .collect::<Vec<_>>()
                .join(".")
        };
        // `spec` itself is required; every field below it may be absent.
        let guards = |root: &str| -> Vec<String> {
            (2..=self.path.len())
                .map(|i| format!("!has({})", at(root, i)))
                .collect()
        };
        let depth = self.path.len();
        let body = replace_word(&self.rule, "oldSelf", &at("oldObject", depth));
        let body = replace_word(&body, "self", &at("object", depth));
        let mut alternatives = vec![];
        if self.is_transition() {
            alternatives.push("oldObject == null".to_string());
            alternatives.extend(guards("object"));
            alternatives.extend(guards("oldObject"));
        } else {
            alternatives.extend(guards("object"));
        }
        alternatives.push(format!("({body})"));
        alternatives.join(" || ")
    }
}

/// The CRD as the types declare it, rules included: the source of
/// [`spec_rules`] and of the offline validator's schema, not what is installed.
fn crd_with_rules() -> CustomResourceDefinition {
    MemoryAwareTrainingJob::crd()
}

/// The CRD Headroom installs: the types' schema without its CEL rules (they
/// run in [`spec_rules_policy`]).
pub fn crd() -> CustomResourceDefinition {
    fn strip(v: &mut Value) {
        match v {
            Value::Object(m) => {
                m.remove("x-kubernetes-validations");
                m.values_mut().for_each(strip);
            }
            Value::Array(a) => a.iter_mut().for_each(strip),
            _ => {}
        }
    }
    let mut v = serde_json::to_value(crd_with_rules()).expect("the CRD serialises");
    strip(&mut v);
    serde_json::from_value(v).expect("the CRD without rules deserialises")
}

/// Every rule the types declare under `spec`, depth first in field order.
pub fn spec_rules() -> Vec<SpecRule> {
    fn walk(schema: &Value, path: &[String], out: &mut Vec<SpecRule>) {
        for v in schema["x-kubernetes-validations"]
            .as_array()
            .into_iter()
            .flatten()
        {
            out.push(SpecRule {
                path: path.to_vec(),
                rule: v["rule"].as_str().unwrap_or_default().to_string(),
                message: v["message"].as_str().unwrap_or_default().to_string(),
            });
        }
        // Rules under a list's items or a map's values would need the
        // policy to iterate them (`all()`); none are declared there, and
        // `spec_rules_cover_every_rule_of_the_types` fails if one is.
        if let Some(props) = schema["properties"].as_object() {
            for (k, child) in props {
                let mut p = path.to_vec();
                p.push(k.clone());
                walk(child, &p, out);
            }
        }
    }
    let schema = serde_json::to_value(&crd_with_rules().spec.versions[0].schema)
        .expect("the schema serialises");
    let mut out = vec![];
    walk(
        &schema["openAPIV3Schema"]["properties"]["spec"],
        &["spec".to_string()],
        &mut out,
    );
    out
}

/// The spec's rules as one ValidatingAdmissionPolicy: creates and updates
/// of `memoryawaretrainingjobs` (a status write is a write of
/// `memoryawaretrainingjobs/status`, which it does not match), only when
/// the spec is new or changed. Each rule refuses with reason `Invalid`
/// (HTTP 422, as the CRD's rules did), naming its field; deeper fields'
/// rules first.
pub fn spec_rules_policy() -> ValidatingAdmissionPolicy {
    let crd = crd_with_rules();
    // The API server reports the first rule a spec breaks (the CRD reported
    // them all): the deepest field's rule first, so a spec with two models
    // hears `spec.model: set exactly one of …` before a rule at `spec`
    // about one of them.
    let mut rules = spec_rules();
    rules.sort_by_key(|r| std::cmp::Reverse(r.path.len()));
    let validations: Vec<Value> = rules
        .iter()
        .map(|r| {
            json!({
                "expression": r.expression(),
                "message": r.refusal(),
                "reason": "Invalid",
            })
        })
        .collect();
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": SPEC_RULES_POLICY},
        "spec": {
            // The rules are the spec's validation: an API server that cannot
            // evaluate them refuses the write rather than skip them.
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [{
                "apiGroups": [crd.spec.group],
                "apiVersions": ["*"],
                "operations": ["CREATE", "UPDATE"],
                "resources": [crd.spec.names.plural],
            }]},
            // A metadata-only update (labels, finalizers) of a job stored
            // before a rule existed is not refused for that rule.
            "matchConditions": [{
                "name": "spec-written",
                "expression": "oldObject == null || object.spec != oldObject.spec",
            }],
            "validations": validations,
        },
    }))
    .expect("a ValidatingAdmissionPolicy")
}

/// The policy's binding: every namespace, refusals denied.
pub fn spec_rules_binding() -> ValidatingAdmissionPolicyBinding {
    serde_json::from_value(json!({
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": SPEC_RULES_POLICY},
        "spec": {"policyName": SPEC_RULES_POLICY, "validationActions": ["Deny"]},
    }))
    .expect("a ValidatingAdmissionPolicyBinding")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Whether `text` has `word` as a whole word.
fn contains_word(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(i, _)| {
        !text[..i].chars().next_back().is_some_and(is_ident)
            && !text[i + word.len()..].chars().next().is_some_and(is_ident)
    })
}

/// `text` with every whole word `word` replaced by `by`.
fn replace_word(text: &str, word: &str, by: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find(word) {
        let before = rest[..i].chars().next_back();
        let after = rest[i + word.len()..].chars().next();
        let whole = !before.is_some_and(is_ident) && !after.is_some_and(is_ident);
        out.push_str(&rest[..i]);
        out.push_str(if whole { by } else { word });
        rest = &rest[i + word.len()..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count_rules(v: &Value) -> usize {
        match v {
            Value::Object(m) => {
                m.get("x-kubernetes-validations")
                    .and_then(Value::as_array)
                    .map_or(0, Vec::len)
                    + m.values().map(count_rules).sum::<usize>()
            }
            Value::Array(a) => a.iter().map(count_rules).sum(),
            _ => 0,
        }
    }

    #[test]
    fn only_whole_words_are_rewritten() {
        assert_eq!(
            replace_word("self.a + oldSelf.b == self_c + selfish(self)", "self", "X"),
            "X.a + oldSelf.b == self_c + selfish(X)"
        );
        assert_eq!(
            replace_word("self == oldSelf", "oldSelf", "old.y"),
            "self == old.y"
        );
        assert!(contains_word("self == oldSelf", "oldSelf"));
        assert!(!contains_word("self == oldSelfish", "oldSelf"));
    }

    /// Every rule of the types is in the policy (none sits where the walk
    /// does not go), and the installed CRD has none left.
    #[test]
    fn spec_rules_cover_every_rule_of_the_types() {
        let with = serde_json::to_value(crd_with_rules()).expect("json");
        let rules = count_rules(&with);
        assert!(rules >= 30, "{rules} rules");
        assert_eq!(spec_rules().len(), rules);
        let policy = serde_json::to_value(spec_rules_policy()).expect("json");
        assert_eq!(
            policy["spec"]["validations"].as_array().map(Vec::len),
            Some(rules)
        );
        assert_eq!(count_rules(&serde_json::to_value(crd()).expect("json")), 0);
        let binding = serde_json::to_value(spec_rules_binding()).expect("json");
        assert_eq!(binding["spec"]["policyName"], policy["metadata"]["name"]);
    }

    /// Each rule becomes one guarded expression on `object`; a transition
    /// rule only where both objects have its field.
    #[test]
    fn rules_become_guarded_expressions() {
        let rules = spec_rules();
        let expressions: Vec<String> = rules.iter().map(SpecRule::expression).collect();
        assert!(
            expressions
                .iter()
                .all(|e| !contains_word(e, "self") && !contains_word(e, "oldSelf")),
            "{expressions:#?}"
        );
        assert!(expressions.contains(
            &"!has(object.spec.model) || !has(object.spec.model.transformer) || (object.spec.model.transformer.hidden % object.spec.model.transformer.heads == 0)".to_string()
        ));
        assert!(expressions.contains(
            &"oldObject == null || !has(object.spec.data) || !has(oldObject.spec.data) || (object.spec.data == oldObject.spec.data)".to_string()
        ));
        // data and checkpoints.size are immutable.
        assert_eq!(rules.iter().filter(|r| r.is_transition()).count(), 3);
    }

    /// A refusal names its field from `spec` down, as the CRD's rule did.
    #[test]
    fn refusals_name_the_field_from_spec() {
        let refusals: Vec<String> = spec_rules().iter().map(SpecRule::refusal).collect();
        for expected in [
            "spec.training.microBatch must divide training.globalBatch",
            "spec.training.precision: the CPU backend (flex) trains in fp32 only",
            "spec.data.volume: path is relative to the claim's root",
            "spec.model: set exactly one of model.pretrained",
            "spec.data is immutable",
        ] {
            assert!(
                refusals.iter().any(|r| r.starts_with(expected)),
                "{expected:?} in {refusals:#?}"
            );
        }
        assert!(refusals.iter().all(|r| r.starts_with("spec")));
    }
}
