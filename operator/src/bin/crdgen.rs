//! Prints the MemoryAwareTrainingJob CRD as YAML (`make manifests` writes it
//! to crds/), or, with `spec-rules-policy`, the ValidatingAdmissionPolicy
//! and binding that check the spec's rules.

fn main() -> anyhow::Result<()> {
    match std::env::args().nth(1).as_deref() {
        None => print!("{}", headroom_operator::crd::crd_yaml()?),
        Some("spec-rules-policy") => {
            print!("{}", headroom_operator::crd::spec_rules_policy_yaml()?)
        }
        Some(other) => anyhow::bail!(
            "crdgen: unknown argument {other:?}; use none (the CRD) or spec-rules-policy"
        ),
    }
    Ok(())
}
