//! The invalid-manifest corpus (`e2e/testdata/invalid`): manifests the API
//! server must reject, each with an `# expect:` line naming text the
//! rejection must contain. The API-server tests submit them by dry run, the
//! e2e suite with `kubectl apply`, `kubectl-headroom plan` offline.

use std::path::PathBuf;

use crate::fixtures::workspace_root;

/// The corpus directory, relative to the workspace root.
pub const INVALID_DIR: &str = "e2e/testdata/invalid";

/// The corpus must not quietly shrink.
const MIN_MANIFESTS: usize = 20;

/// One manifest of the corpus.
#[derive(Clone, Debug)]
pub struct InvalidManifest {
    /// File name, e.g. `01-missing-model.yaml`.
    pub name: String,
    pub path: PathBuf,
    pub text: String,
    /// What the rejection must contain (the `# expect:` line).
    pub expect: String,
}

/// Every `*.yaml` of the corpus, by file name.
pub fn invalid_manifests() -> Vec<InvalidManifest> {
    let dir = workspace_root().join(INVALID_DIR);
    let mut paths: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus {}: {e}", dir.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    paths.sort();
    assert!(
        paths.len() >= MIN_MANIFESTS,
        "the corpus needs at least {MIN_MANIFESTS} manifests, found {}",
        paths.len()
    );
    paths
        .into_iter()
        .map(|path| {
            let text = std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let expect = text
                .lines()
                .find_map(|l| l.strip_prefix("# expect: "))
                .unwrap_or_else(|| panic!("{} has no `# expect:` line", path.display()))
                .trim()
                .to_string();
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            InvalidManifest {
                name,
                path,
                text,
                expect,
            }
        })
        .collect()
}

/// Submits every manifest of the corpus through `submit` (`Ok`: accepted;
/// `Err(message)`: rejected) and fails, listing each offender, unless every
/// one was rejected with a message containing its `# expect:` text.
pub async fn assert_all_rejected(
    mut submit: impl AsyncFnMut(&InvalidManifest) -> Result<(), String>,
) {
    let manifests = invalid_manifests();
    let mut failures = Vec::new();
    for m in &manifests {
        match submit(m).await {
            Ok(()) => failures.push(format!(
                "{}: accepted, expected rejection with {:?}",
                m.name, m.expect
            )),
            Err(message) if !message.contains(&m.expect) => failures.push(format!(
                "{}: rejected, but without {:?}:\n    {message}",
                m.name, m.expect
            )),
            Err(_) => {}
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} manifests misbehaved:\n{}",
        failures.len(),
        manifests.len(),
        failures.join("\n")
    );
}
