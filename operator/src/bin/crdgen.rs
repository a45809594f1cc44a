//! Prints the MemoryAwareTrainingJob CRD as YAML (`make manifests` writes it to crds/).

fn main() -> anyhow::Result<()> {
    print!("{}", headroom_operator::crd::crd_yaml()?);
    Ok(())
}
