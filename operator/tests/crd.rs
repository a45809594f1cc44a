//! The committed CRD matches the code, and its schema is structural.

use headroom_e2e::fixtures::workspace_root;
use headroom_operator::crd::{
    CHART_SPEC_RULES_POLICY_PATH, CRD_PATH, SPEC_RULES_POLICY_PATH, crd_yaml,
    spec_rules_policy_yaml,
};
use serde_json::Value;

#[test]
fn committed_crd_matches_the_types() {
    let committed =
        std::fs::read_to_string(workspace_root().join(CRD_PATH)).expect("crds/ file exists");
    let generated = crd_yaml().expect("CRD serialises");
    assert!(
        committed == generated,
        "{CRD_PATH} is stale: run `make manifests` and commit the result"
    );
}

#[test]
fn chart_ships_the_same_crd() {
    let chart = std::fs::read_to_string(
        workspace_root().join("charts/headroom/crds/memoryawaretrainingjobs.headroom.dev.yaml"),
    )
    .expect("chart CRD exists");
    assert!(
        chart == crd_yaml().expect("CRD serialises"),
        "chart CRD is stale: run `make manifests`"
    );
}

/// The policy with the spec's rules is committed beside the CRD and in the
/// chart, current, and the chart installs it by default: without it the
/// API server would take any spec the schema takes.
#[test]
fn committed_spec_rules_policy_matches_the_types() {
    let generated = spec_rules_policy_yaml().expect("policy serialises");
    for path in [SPEC_RULES_POLICY_PATH, CHART_SPEC_RULES_POLICY_PATH] {
        let committed = std::fs::read_to_string(workspace_root().join(path))
            .unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(
            committed == generated,
            "{path} is stale: run `make manifests` and commit the result"
        );
    }
    let template = std::fs::read_to_string(
        workspace_root().join("charts/headroom/templates/spec-rules-policy.yaml"),
    )
    .expect("template");
    assert!(template.contains(r#"(.Files.Get "files/spec-rules-policy.yaml")"#));
    let values = std::fs::read_to_string(workspace_root().join("charts/headroom/values.yaml"))
        .expect("values");
    assert!(
        values.contains("specRulesPolicy:\n  enabled: true"),
        "the spec rules are installed by default"
    );
}

/// Walks a schema node and records every violation of the structural-schema
/// rules the API server enforces (every node typed, no `$ref`, no
/// `additionalProperties` beside `properties`, junctors without types).
fn check_structural(node: &Value, path: &str, problems: &mut Vec<String>) {
    let Some(obj) = node.as_object() else { return };
    let typed = obj.contains_key("type")
        || obj.get("x-kubernetes-int-or-string") == Some(&Value::Bool(true))
        || obj.get("x-kubernetes-preserve-unknown-fields") == Some(&Value::Bool(true));
    if !typed {
        problems.push(format!("{path}: no type"));
    }
    if obj.contains_key("$ref") {
        problems.push(format!("{path}: $ref"));
    }
    if obj.contains_key("properties") && obj.contains_key("additionalProperties") {
        problems.push(format!("{path}: properties with additionalProperties"));
    }
    for junctor in ["oneOf", "anyOf", "allOf", "not"] {
        if let Some(Value::Array(branches)) = obj.get(junctor) {
            for b in branches {
                if b.get("type").is_some()
                    || b.get("properties").is_some()
                    || b.get("description").is_some()
                {
                    problems.push(format!(
                        "{path}.{junctor}: branch declares type/properties/description"
                    ));
                }
            }
        }
    }
    if let Some(Value::Object(props)) = obj.get("properties") {
        for (name, child) in props {
            check_structural(child, &format!("{path}.{name}"), problems);
        }
    }
    if let Some(items) = obj.get("items") {
        check_structural(items, &format!("{path}[]"), problems);
    }
    if let Some(extra @ Value::Object(_)) = obj.get("additionalProperties") {
        check_structural(extra, &format!("{path}{{}}"), problems);
    }
}

fn schema() -> Value {
    let crd = serde_json::to_value(
        <headroom_api::MemoryAwareTrainingJob as kube::CustomResourceExt>::crd(),
    )
    .expect("json");
    crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"].clone()
}

#[test]
fn schema_is_structural() {
    let mut problems = Vec::new();
    check_structural(&schema(), "", &mut problems);
    assert!(
        problems.is_empty(),
        "non-structural schema:\n{}",
        problems.join("\n")
    );
}

/// `status.workers` is merged entry by entry (each worker's and the
/// telemetry flusher's server-side applies); the lists only the operator
/// writes whole are atomic, so the managed fields name them once.
#[test]
fn lists_are_list_maps_or_sets_where_merging_matters() {
    let s = schema();
    let status = &s["properties"]["status"]["properties"];
    assert_eq!(status["workers"]["x-kubernetes-list-type"], "map");
    assert_eq!(status["workers"]["x-kubernetes-list-map-keys"][0], "name");
    for field in ["conditions", "attempts"] {
        assert_eq!(status[field]["x-kubernetes-list-type"], "atomic", "{field}");
    }
    assert_eq!(
        s["properties"]["spec"]["properties"]["memoryPolicy"]["properties"]["allowedRungs"]["x-kubernetes-list-type"],
        "set"
    );
}

fn collect_rules<'a>(node: &'a Value, out: &mut Vec<&'a Value>) {
    match node {
        Value::Object(obj) => {
            if let Some(Value::Array(rules)) = obj.get("x-kubernetes-validations") {
                out.extend(rules);
            }
            obj.values().for_each(|v| collect_rules(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_rules(v, out)),
        _ => {}
    }
}

#[test]
fn every_cel_rule_says_what_would_work() {
    let s = schema();
    let mut rules = Vec::new();
    collect_rules(&s, &mut rules);
    assert!(
        rules.len() >= 8,
        "expected the CEL rules in the schema, found {}",
        rules.len()
    );
    for rule in rules {
        let message = rule
            .get("message")
            .or_else(|| rule.get("messageExpression"))
            .and_then(Value::as_str)
            .unwrap_or("");
        assert!(
            message.len() > 20,
            "rule {rule} needs a message that names the field and the fix"
        );
    }
}

#[test]
fn status_and_printer_columns_are_declared() {
    let crd = serde_json::to_value(
        <headroom_api::MemoryAwareTrainingJob as kube::CustomResourceExt>::crd(),
    )
    .expect("json");
    let version = &crd["spec"]["versions"][0];
    assert!(version["subresources"]["status"].is_object());
    let columns: Vec<&str> = version["additionalPrinterColumns"]
        .as_array()
        .expect("columns")
        .iter()
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(
        columns,
        [
            "Phase",
            "Attempt",
            "Step",
            "Loss",
            "ETA",
            "Device",
            "Workers",
            "Peak/Budget",
            "Age"
        ]
    );
    assert_eq!(crd["spec"]["names"]["shortNames"][0], "matj");
    assert_eq!(crd["spec"]["scope"], "Namespaced");
}

/// Every field of spec and status says what it is: `kubectl explain` shows
/// these descriptions, and an empty one leaves a user guessing.
#[test]
fn every_spec_and_status_field_has_a_description() {
    fn walk(node: &Value, path: &str, missing: &mut Vec<String>) {
        let Some(props) = node.get("properties").and_then(Value::as_object) else {
            if let Some(items) = node.get("items") {
                walk(items, &format!("{path}[]"), missing);
            }
            return;
        };
        for (name, child) in props {
            let here = format!("{path}.{name}");
            let described = child
                .get("description")
                .and_then(Value::as_str)
                .is_some_and(|d| !d.trim().is_empty());
            if !described {
                missing.push(here.clone());
            }
            walk(child, &here, missing);
        }
    }
    let crd: Value = serde_yaml::from_str(&crd_yaml().expect("crd")).expect("yaml");
    let root = &crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"];
    let mut missing = vec![];
    walk(&root["spec"], "spec", &mut missing);
    walk(&root["status"], "status", &mut missing);
    assert!(
        missing.is_empty(),
        "fields without a description: {missing:#?}"
    );
}

/// Every value the chart takes says what it is in `values.schema.json`
/// (editors and `helm show values` readers see it), not only in the
/// comments of values.yaml.
#[test]
fn every_chart_value_is_described_in_its_schema() {
    fn walk(node: &Value, path: &str, missing: &mut Vec<String>) {
        let Some(properties) = node.get("properties").and_then(Value::as_object) else {
            return;
        };
        for (name, property) in properties {
            let path = if path.is_empty() {
                name.clone()
            } else {
                format!("{path}.{name}")
            };
            if property
                .get("description")
                .and_then(Value::as_str)
                .is_none_or(str::is_empty)
            {
                missing.push(path.clone());
            }
            walk(property, &path, missing);
        }
    }
    let text = std::fs::read_to_string(workspace_root().join("charts/headroom/values.schema.json"))
        .expect("values.schema.json");
    let schema: Value = serde_json::from_str(&text).expect("JSON");
    let mut missing = Vec::new();
    walk(&schema, "", &mut missing);
    assert!(
        missing.is_empty(),
        "values.schema.json: no description for {missing:?}"
    );
}
