//! The `headroom-worker` binary as an initializer (`HEADROOM_INITIALIZE`),
//! end to end against the test kit's local stand-in for the Hugging Face hub
//! (`headroom_e2e::hub`: listings, `resolve` URLs with the weights behind a
//! CDN redirect, `Range`, HEAD, tokens, 404s). It records every request, so
//! the tests can tell what was downloaded and how, and can cut a transfer
//! off halfway through.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use headroom_api::{
    DataFormat, DataSource, DataSplit, HF_TOKEN_FILE_ENV, HubDataFiles, INITIALIZE_JSON_ENV,
    InitializerAssignment, InitializerReport, ModelSource, TerminationMessage, WorkerOutcome,
    exit_code,
};
use headroom_e2e::hub::{HUB_COMMIT as COMMIT, HubRepo, HubRepos, HubRequest as Seen, LocalHub};
use headroom_worker::run::TERMINATION_MESSAGE_PATH_ENV;

const REPO: &str = "headroom/tiny-llama";
const PRIVATE_REPO: &str = "headroom/private-llama";
const BIN_ONLY_REPO: &str = "headroom/bin-only-llama";
const SHARDED_REPO: &str = "headroom/sharded-llama";
const SHARDS: [&str; 2] = [
    "model-00001-of-00002.safetensors",
    "model-00002-of-00002.safetensors",
];
const INDEX: &str = "model.safetensors.index.json";
const TOKEN: &str = "hf_test_token";
/// A dataset repository holding the sample text under a subdirectory.
const DATASET: &str = "headroom/declaration";
const DATASET_FILE: &str = "data/train.jsonl";
/// A dataset in the layout `push_to_hub` writes: a card whose `configs`
/// name each split's files, and the splits' shards under `data/`.
const SPLIT_DATASET: &str = "headroom/declaration-splits";
const CARD: &str = "---\nlicense: cc0-1.0\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n    path: data/train-*\n  - split: test\n    path: data/test-*\n---\n# The declaration, in splits\n";
const WEIGHTS: &str = "model.safetensors";
/// The fixture's files, all served by the hub stand-in.
const FILES: [&str; 5] = [
    "config.json",
    "generation_config.json",
    WEIGHTS,
    "tokenizer.json",
    "tokenizer_config.json",
];

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/tiny-llama")
}

fn data_file() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../samples/data/declaration-of-independence.jsonl")
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-init-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The hub stand-in with the repositories these tests use.
fn start_hub() -> LocalHub {
    let tiny = fixture_files();
    let public = |files: BTreeMap<String, Vec<u8>>| HubRepo { files, token: None };
    let mut repos = HubRepos::new();
    repos.insert(REPO.to_string(), public(tiny.clone()));
    repos.insert(
        PRIVATE_REPO.to_string(),
        HubRepo {
            files: tiny.clone(),
            token: Some(TOKEN.into()),
        },
    );
    repos.insert(SHARDED_REPO.to_string(), public(sharded(&tiny)));
    repos.insert(
        BIN_ONLY_REPO.to_string(),
        public(
            [
                ("config.json", &tiny["config.json"][..]),
                ("tokenizer.json", &tiny["tokenizer.json"][..]),
                ("pytorch_model.bin", b"not really"),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_vec()))
            .collect(),
        ),
    );
    repos.insert(
        format!("datasets/{DATASET}"),
        public(
            [(
                DATASET_FILE.to_string(),
                std::fs::read(data_file()).expect("sample text"),
            )]
            .into_iter()
            .collect(),
        ),
    );
    // The sample's eight lines: five and three in two train shards, the
    // first again as the test split.
    let text = std::fs::read_to_string(data_file()).expect("sample text");
    let lines: Vec<&str> = text.lines().collect();
    let joined = |l: &[&str]| format!("{}\n", l.join("\n")).into_bytes();
    repos.insert(
        format!("datasets/{SPLIT_DATASET}"),
        public(
            [
                ("README.md", CARD.as_bytes().to_vec()),
                ("data/train-00000-of-00002.jsonl", joined(&lines[..5])),
                ("data/train-00001-of-00002.jsonl", joined(&lines[5..])),
                ("data/test-00000-of-00001.jsonl", joined(&lines[..1])),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        ),
    );
    LocalHub::start("127.0.0.1:0", repos)
}

/// The tiny-llama fixture's files.
fn fixture_files() -> BTreeMap<String, Vec<u8>> {
    FILES
        .iter()
        .map(|f| {
            (
                f.to_string(),
                std::fs::read(fixture().join(f)).expect("fixture file"),
            )
        })
        .collect()
}

/// The fixture as a sharded checkpoint: the embedding and layers 0–1 in one
/// shard, the rest in another, and the index naming them.
fn sharded(tiny: &BTreeMap<String, Vec<u8>>) -> BTreeMap<String, Vec<u8>> {
    let tensors = safetensors::SafeTensors::deserialize(&tiny[WEIGHTS]).expect("fixture weights");
    let mut shards: [Vec<(String, safetensors::tensor::TensorView<'_>)>; 2] = [vec![], vec![]];
    for (name, view) in tensors.tensors() {
        let first = name.starts_with("model.embed_tokens")
            || name.starts_with("model.layers.0.")
            || name.starts_with("model.layers.1.");
        shards[usize::from(!first)].push((name, view));
    }
    let mut files: BTreeMap<String, Vec<u8>> = tiny
        .iter()
        .filter(|(name, _)| *name != WEIGHTS)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let mut weight_map = BTreeMap::new();
    for (k, shard) in shards.iter().enumerate() {
        let file = SHARDS[k].to_string();
        for (name, _) in shard {
            weight_map.insert(name.clone(), file.clone());
        }
        let bytes = safetensors::serialize(shard.iter().map(|(n, v)| (n.as_str(), v)), None)
            .expect("serialize a shard");
        files.insert(file, bytes);
    }
    let index = serde_json::json!({"metadata": {"total_size": 0}, "weight_map": weight_map});
    files.insert(INDEX.to_string(), index.to_string().into_bytes());
    files
}

/// What one run of the binary left.
#[derive(Debug)]
enum Ended {
    /// Boxed: a report is several times the size of a message.
    Report(Box<InitializerReport>),
    Message(i32, TerminationMessage),
}

impl Ended {
    fn report(self) -> InitializerReport {
        match self {
            Ended::Report(r) => *r,
            Ended::Message(code, m) => panic!("expected success, got exit {code}: {m:?}"),
        }
    }

    fn message(self) -> (i32, TerminationMessage) {
        match self {
            Ended::Message(code, m) => (code, m),
            Ended::Report(r) => panic!("expected a failure, got {r:?}"),
        }
    }
}

fn assignment(model: ModelSource, model_dir: &Path, data: &Path) -> InitializerAssignment {
    InitializerAssignment {
        job: "tiny".into(),
        namespace: "default".into(),
        model,
        model_dir: model_dir.display().to_string(),
        data_file: data.display().to_string(),
        data: DataSource::Volume,
        data_format: DataFormat::Jsonl {
            field: "text".into(),
        },
        train_on: headroom_api::TrainOn::Auto,
        data_split: None,
        packing: headroom_api::Packing::Stream,
        sequence_length: 32,
        cache_of: None,
    }
}

fn from_hub(hub: &LocalHub, repo: &str) -> ModelSource {
    ModelSource::HuggingFace {
        repo: repo.into(),
        revision: "main".into(),
        endpoint: hub.endpoint(),
    }
}

/// Runs the initializer; `token`, if any, in a file whose path is in
/// `HEADROOM_HF_TOKEN_FILE`, as the operator mounts it from the job's Secret.
fn initialize(dir: &Path, assignment: &InitializerAssignment, token: Option<&str>) -> Ended {
    let mut env = vec![];
    if let Some(token) = token {
        let file = dir.join("hf-token");
        std::fs::write(&file, format!("{token}\n")).expect("token file");
        env.push((HF_TOKEN_FILE_ENV, file.display().to_string()));
    }
    initialize_with_env(dir, assignment, &env)
}

/// Runs the initializer with `env` besides its assignment.
fn initialize_with_env(
    dir: &Path,
    assignment: &InitializerAssignment,
    env: &[(&str, String)],
) -> Ended {
    let termination = dir.join("termination-log");
    let _ = std::fs::remove_file(&termination);
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_headroom-worker"));
    cmd.env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .env("HOME", dir)
        .env(
            INITIALIZE_JSON_ENV,
            serde_json::to_string(assignment).expect("json"),
        )
        .env(TERMINATION_MESSAGE_PATH_ENV, &termination);
    cmd.envs(env.iter().map(|(k, v)| (*k, v)));
    let out = cmd.output().expect("run the initializer");
    let code = out.status.code().expect("exit code");
    // Shown for a failing test (or with --nocapture).
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    let text = std::fs::read_to_string(&termination).unwrap_or_else(|e| {
        panic!(
            "every exit writes a termination message ({e}); stderr:\n{}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    if code == exit_code::SUCCESS {
        Ended::Report(Box::new(serde_json::from_str(&text).expect("a report")))
    } else {
        let message: TerminationMessage = serde_json::from_str(&text).expect("a message");
        assert_eq!(
            message.outcome.exit_code(),
            code,
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ended::Message(code, message)
    }
}

fn fixture_bytes() -> u64 {
    FILES
        .iter()
        .map(|f| std::fs::metadata(fixture().join(f)).expect("fixture").len())
        .sum()
}

fn assert_same_files(dir: &Path) {
    for f in FILES {
        assert!(
            std::fs::read(dir.join(f)).expect("downloaded")
                == std::fs::read(fixture().join(f)).expect("fixture"),
            "{f} differs from the fixture"
        );
        assert!(
            !dir.join(format!("{f}.part")).exists(),
            "{f}.part left behind"
        );
    }
}

fn count(requests: &[Seen], method: &str, path_part: &str) -> usize {
    requests
        .iter()
        .filter(|r| r.method == method && r.path.contains(path_part))
        .count()
}

#[test]
fn fetches_checks_and_reports_then_downloads_nothing_the_second_time() {
    let hub = start_hub();
    let dir = temp_dir("fetch");
    let model_dir = dir.join("model");
    let a = assignment(from_hub(&hub, REPO), &model_dir, &data_file());

    let report = initialize(&dir, &a, None).report();
    assert_eq!(report.model.parameters, 214_592);
    assert_eq!(report.model.dtype, "F32");
    assert_eq!(report.model.shape.layers, 4);
    assert_eq!(report.model.shape.sequence_length, 32);
    assert_eq!(
        report.model.bytes,
        std::fs::metadata(fixture().join(WEIGHTS))
            .expect("fixture")
            .len()
    );
    assert_eq!(report.data.documents, 8);
    assert!(report.data.samples > 0, "{report:?}");
    assert!(report.data.tokens > 32 * report.data.samples, "{report:?}");
    assert_eq!(report.downloaded_bytes, fixture_bytes());
    // The commit the listing named: the shared model cache records it.
    assert_eq!(report.commit.as_deref(), Some(COMMIT));
    assert_same_files(&model_dir);
    let first = hub.take_requests();
    // Files came by the commit the listing named; the weights through the CDN redirect.
    assert_eq!(
        count(&first, "GET", &format!("/resolve/{COMMIT}/")),
        FILES.len(),
        "{first:#?}"
    );
    assert_eq!(count(&first, "GET", "/cdn/"), 1, "{first:#?}");
    for unwanted in ["README.md", ".gitattributes"] {
        assert_eq!(count(&first, "GET", unwanted), 0, "{first:#?}");
    }

    // Everything is in place: the second run only lists and compares sizes.
    let again = initialize(&dir, &a, None).report();
    assert_eq!(again.downloaded_bytes, 0);
    assert_eq!(again.model, report.model);
    assert_eq!(again.data, report.data);
    let second = hub.take_requests();
    assert_eq!(count(&second, "GET", "/api/models/"), 1, "{second:#?}");
    assert_eq!(count(&second, "GET", "/resolve/"), 0, "{second:#?}");
    assert_eq!(count(&second, "GET", "/cdn/"), 0, "{second:#?}");
    // The weights, which the listing gives no size for, are sized by HEAD
    // (without following the redirect to the CDN); the rest by the listing.
    assert_eq!(count(&second, "HEAD", "/resolve/"), 1, "{second:#?}");
    assert_eq!(count(&second, "HEAD", WEIGHTS), 1, "{second:#?}");
    assert_eq!(second.len(), 2, "{second:#?}");
    assert_same_files(&model_dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A job that reads a shared model cache claim checks the copy there and
/// asks the hub, with one listing request and no file, which commit the
/// claim's branch names now; a claim filled from a commit asks nothing.
#[test]
fn a_cache_reader_asks_which_commit_its_branch_names_and_downloads_nothing() {
    let hub = start_hub();
    let dir = temp_dir("cache-reader");
    let model_dir = dir.join("model");
    // The filler's download.
    initialize(
        &dir,
        &assignment(from_hub(&hub, REPO), &model_dir, &data_file()),
        None,
    )
    .report();
    hub.take_requests();

    let mut reader = assignment(ModelSource::Volume, &model_dir, &data_file());
    reader.cache_of = Some(from_hub(&hub, REPO));
    let report = initialize(&dir, &reader, None).report();
    assert_eq!(report.commit.as_deref(), Some(COMMIT));
    assert_eq!(report.downloaded_bytes, 0);
    assert_eq!(
        report.model.parameters, 214_592,
        "the copy on the claim is checked"
    );
    let seen = hub.take_requests();
    assert_eq!(
        count(&seen, "GET", &format!("/api/models/{REPO}/revision/main")),
        1,
        "{seen:#?}"
    );
    assert_eq!(seen.len(), 1, "one listing, no file: {seen:#?}");

    reader.cache_of = Some(ModelSource::HuggingFace {
        repo: REPO.into(),
        revision: COMMIT.into(),
        endpoint: hub.endpoint(),
    });
    let report = initialize(&dir, &reader, None).report();
    assert_eq!(report.commit.as_deref(), Some(COMMIT));
    let seen = hub.take_requests();
    assert!(seen.is_empty(), "a commit cannot move: {seen:#?}");

    // A hub that cannot be reached leaves the cache in use, unchecked.
    reader.cache_of = Some(ModelSource::HuggingFace {
        repo: REPO.into(),
        revision: "main".into(),
        endpoint: "http://127.0.0.1:9".into(),
    });
    let report = initialize(&dir, &reader, None).report();
    assert_eq!(report.commit, None);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_broken_download_is_resumed_with_a_range_request() {
    let hub = start_hub();
    hub.state().cut_next = 1;
    let dir = temp_dir("resume");
    let model_dir = dir.join("model");
    let a = assignment(from_hub(&hub, REPO), &model_dir, &data_file());
    // The run retries the broken transfer itself, from where it broke off.
    let report = initialize(&dir, &a, None).report();
    assert_eq!(report.model.parameters, 214_592);
    let cdn: Vec<Seen> = hub
        .take_requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.contains("/cdn/"))
        .collect();
    let half = std::fs::metadata(fixture().join(WEIGHTS))
        .expect("fixture")
        .len()
        / 2;
    assert_eq!(cdn.len(), 2, "{cdn:#?}");
    assert_eq!(cdn[0].range, None);
    assert_eq!(
        cdn[1].range.as_deref(),
        Some(format!("bytes={half}-").as_str())
    );
    // Half, then the other half: every byte once.
    assert_eq!(report.downloaded_bytes, fixture_bytes());
    assert_same_files(&model_dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_download_that_keeps_breaking_fails_and_the_next_run_resumes_it() {
    let hub = start_hub();
    hub.state().cut_always = true;
    let dir = temp_dir("keeps-breaking");
    let model_dir = dir.join("model");
    let a = assignment(from_hub(&hub, REPO), &model_dir, &data_file());
    let (code, message) = initialize(&dir, &a, None).message();
    assert_eq!(code, exit_code::FAILURE);
    assert_eq!(message.outcome, WorkerOutcome::Failed);
    assert!(
        message.reason.contains(&format!(
            "{}/{REPO}/resolve/{COMMIT}/{WEIGHTS}",
            hub.endpoint()
        )) && message.reason.contains("resumes"),
        "{}",
        message.reason
    );
    let part = model_dir.join(format!("{WEIGHTS}.part"));
    let kept = std::fs::metadata(&part)
        .expect("the partial download is kept")
        .len();
    let full = std::fs::metadata(fixture().join(WEIGHTS))
        .expect("fixture")
        .len();
    assert!(kept > full / 2 && kept < full, "{kept} of {full}");
    assert!(!model_dir.join(WEIGHTS).exists());
    // Each try asked for the rest of what the previous one got.
    let ranges: Vec<Option<String>> = hub
        .take_requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.contains("/cdn/"))
        .map(|r| r.range)
        .collect();
    assert_eq!(ranges.len(), 4, "{ranges:?}");
    assert_eq!(ranges[0], None);
    assert!(ranges[1..].iter().all(Option::is_some), "{ranges:?}");

    hub.state().cut_always = false;
    let report = initialize(&dir, &a, None).report();
    let cdn: Vec<Seen> = hub
        .take_requests()
        .into_iter()
        .filter(|r| r.method == "GET" && r.path.contains("/cdn/"))
        .collect();
    assert_eq!(cdn.len(), 1, "{cdn:#?}");
    assert_eq!(
        cdn[0].range.as_deref(),
        Some(format!("bytes={kept}-").as_str())
    );
    // Only the rest of the weights: the small files were already in place.
    assert_eq!(report.downloaded_bytes, full - kept);
    assert_same_files(&model_dir);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_complete_part_file_is_put_in_place_without_downloading_it_again() {
    // A run that died between the last byte and the rename.
    let hub = start_hub();
    let dir = temp_dir("complete-part");
    let model_dir = dir.join("model");
    std::fs::create_dir_all(&model_dir).expect("dir");
    for f in FILES {
        let to = if f == WEIGHTS {
            model_dir.join(format!("{f}.part"))
        } else {
            model_dir.join(f)
        };
        std::fs::copy(fixture().join(f), to).expect("copy");
    }
    let a = assignment(from_hub(&hub, REPO), &model_dir, &data_file());
    let report = initialize(&dir, &a, None).report();
    assert_eq!(report.downloaded_bytes, 0);
    assert_same_files(&model_dir);
    // The listing gives no size for the weights: the server's 416 to the
    // range after the last byte says the part is whole.
    let full = std::fs::metadata(fixture().join(WEIGHTS))
        .expect("fixture")
        .len();
    let cdn: Vec<Seen> = hub
        .take_requests()
        .into_iter()
        .filter(|r| r.path.contains("/cdn/"))
        .collect();
    assert_eq!(cdn.len(), 1, "{cdn:#?}");
    assert_eq!(
        cdn[0].range.as_deref(),
        Some(format!("bytes={full}-").as_str())
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_sharded_checkpoint_comes_with_its_index_and_every_shard() {
    let hub = start_hub();
    let dir = temp_dir("sharded");
    let model_dir = dir.join("model");
    let a = assignment(from_hub(&hub, SHARDED_REPO), &model_dir, &data_file());
    let report = initialize(&dir, &a, None).report();
    assert_eq!(report.model.parameters, 214_592);
    let served = sharded(&fixture_files());
    assert_eq!(
        report.model.bytes,
        SHARDS.iter().map(|s| served[*s].len() as u64).sum::<u64>()
    );
    assert_eq!(
        report.downloaded_bytes,
        served.values().map(|b| b.len() as u64).sum::<u64>()
    );
    for (name, bytes) in &served {
        assert!(
            std::fs::read(model_dir.join(name)).expect("downloaded") == *bytes,
            "{name} differs"
        );
    }
    assert!(!model_dir.join(WEIGHTS).exists());
    let requests = hub.take_requests();
    assert_eq!(count(&requests, "GET", "/cdn/"), 2, "{requests:#?}");

    let again = initialize(&dir, &a, None).report();
    assert_eq!(again.downloaded_bytes, 0);
    let requests = hub.take_requests();
    assert_eq!(count(&requests, "GET", "/resolve/"), 0, "{requests:#?}");
    assert_eq!(count(&requests, "HEAD", "/resolve/"), 2, "{requests:#?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_private_repository_needs_the_token() {
    let hub = start_hub();
    let dir = temp_dir("private");
    let model_dir = dir.join("model");
    let a = assignment(from_hub(&hub, PRIVATE_REPO), &model_dir, &data_file());

    let (code, message) = initialize(&dir, &a, None).message();
    assert_eq!(code, exit_code::INVALID_PLAN);
    assert!(
        message.reason.contains(PRIVATE_REPO)
            && message.reason.contains("needs a token")
            && message.reason.contains("tokenSecret"),
        "{}",
        message.reason
    );
    // A token in the environment is not the initializer's: the operator
    // mounts it as a file, and only a file is read.
    let (code, message) =
        initialize_with_env(&dir, &a, &[("HF_TOKEN", TOKEN.to_string())]).message();
    assert_eq!(code, exit_code::INVALID_PLAN);
    assert!(
        message.reason.contains("needs a token"),
        "{}",
        message.reason
    );
    // A token file named but not there: the field whose Secret it is.
    let (code, message) = initialize_with_env(
        &dir,
        &a,
        &[(
            HF_TOKEN_FILE_ENV,
            dir.join("no-such-file").display().to_string(),
        )],
    )
    .message();
    assert_eq!(code, exit_code::INVALID_PLAN);
    assert!(
        message
            .reason
            .contains("cannot read the token of model.pretrained.huggingFace.tokenSecret"),
        "{}",
        message.reason
    );
    let (code, message) = initialize(&dir, &a, Some("hf_wrong")).message();
    assert_eq!(code, exit_code::INVALID_PLAN);
    assert!(
        message.reason.contains("token was refused"),
        "{}",
        message.reason
    );
    assert!(!message.reason.contains("hf_wrong"), "{}", message.reason);
    hub.take_requests();

    let report = initialize(&dir, &a, Some(TOKEN)).report();
    assert_eq!(report.model.parameters, 214_592);
    assert_same_files(&model_dir);
    let requests = hub.take_requests();
    let bearer = format!("Bearer {TOKEN}");
    for r in requests.iter().filter(|r| !r.path.starts_with("/cdn/")) {
        assert_eq!(r.authorization.as_deref(), Some(bearer.as_str()), "{r:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_repository_is_not_found() {
    let hub = start_hub();
    let dir = temp_dir("unknown");
    let a = assignment(
        from_hub(&hub, "headroom/no-such-model"),
        &dir.join("model"),
        &data_file(),
    );
    let (code, message) = initialize(&dir, &a, None).message();
    assert_eq!(code, exit_code::INVALID_PLAN);
    assert!(
        message.reason.contains("headroom/no-such-model")
            && message.reason.contains("(revision main)")
            && message.reason.contains(&hub.endpoint())
            && message.reason.contains("not found"),
        "{}",
        message.reason
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_repository_with_only_pytorch_weights_is_refused_before_any_download() {
    let hub = start_hub();
    let dir = temp_dir("bin-only");
    let a = assignment(
        from_hub(&hub, BIN_ONLY_REPO),
        &dir.join("model"),
        &data_file(),
    );
    let (code, message) = initialize(&dir, &a, None).message();
    assert_eq!(code, exit_code::INVALID_PLAN);
    assert!(
        message.reason.contains(BIN_ONLY_REPO)
            && message.reason.contains(".bin")
            && message.reason.contains("safetensors"),
        "{}",
        message.reason
    );
    let requests = hub.take_requests();
    assert_eq!(count(&requests, "GET", "/resolve/"), 0, "{requests:#?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A copy of the fixture with config.json edited by `edit`.
fn volume_copy(dir: &Path, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let model = dir.join("volume-model");
    std::fs::create_dir_all(&model).expect("dir");
    for f in FILES {
        std::fs::copy(fixture().join(f), model.join(f)).expect("copy");
    }
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(model.join("config.json")).expect("config"))
            .expect("json");
    edit(&mut config);
    std::fs::write(model.join("config.json"), config.to_string()).expect("write");
    model
}

#[test]
fn a_checkpoint_on_a_volume_is_checked_against_its_config() {
    let dir = temp_dir("volume");
    let model = volume_copy(&dir, |_| {});
    let report = initialize(
        &dir,
        &assignment(ModelSource::Volume, &model, &data_file()),
        None,
    )
    .report();
    assert_eq!(report.model.parameters, 214_592);
    assert_eq!(report.downloaded_bytes, 0);

    let tampered = volume_copy(&dir, |c| c["num_key_value_heads"] = 4.into());
    let (code, message) = initialize(
        &dir,
        &assignment(ModelSource::Volume, &tampered, &data_file()),
        None,
    )
    .message();
    assert_eq!(code, exit_code::INVALID_PLAN);
    assert!(
        message
            .reason
            .contains("model.layers.0.self_attn.k_proj.weight is [32, 64]")
            && message.reason.contains("implies [64, 64]")
            && message.reason.contains("num_key_value_heads 4"),
        "{}",
        message.reason
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn data_without_the_field_names_the_file_and_the_field() {
    let dir = temp_dir("data");
    let data = dir.join("notes.jsonl");
    std::fs::write(
        &data,
        "{\"body\": \"We hold these truths to be self-evident.\"}\n",
    )
    .expect("write");
    let (code, message) = initialize(
        &dir,
        &assignment(ModelSource::Volume, &fixture(), &data),
        None,
    )
    .message();
    assert_eq!(code, exit_code::INVALID_PLAN);
    assert!(
        message.reason.contains(&format!("{}:1", data.display()))
            && message.reason.contains("no field `text`")
            && message.reason.contains("body"),
        "{}",
        message.reason
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_dataset_file_comes_from_the_hub_once() {
    let hub = start_hub();
    let dir = temp_dir("dataset");
    let target = dir.join("data").join(DATASET_FILE);
    let mut a = assignment(ModelSource::Volume, &fixture(), &target);
    a.data = DataSource::HuggingFace {
        repo: DATASET.into(),
        revision: "main".into(),
        endpoint: hub.endpoint(),
        data_dir: dir.join("data").display().to_string(),
        files: HubDataFiles::File(DATASET_FILE.into()),
    };
    let report = initialize(&dir, &a, None).report();
    let text = std::fs::read(data_file()).expect("sample");
    assert_eq!(std::fs::read(&target).expect("downloaded"), text);
    assert_eq!(report.downloaded_bytes, text.len() as u64);
    // The same documents as the text on a volume gives.
    assert_eq!(report.data.documents, 8);
    let requests = hub.take_requests();
    assert_eq!(
        count(
            &requests,
            "GET",
            &format!("/api/datasets/{DATASET}/revision/main")
        ),
        1,
        "{requests:#?}"
    );
    assert_eq!(
        count(
            &requests,
            "GET",
            &format!("/datasets/{DATASET}/resolve/{COMMIT}/{DATASET_FILE}")
        ),
        1,
        "{requests:#?}"
    );

    let again = initialize(&dir, &a, None).report();
    assert_eq!(again.downloaded_bytes, 0);
    assert_eq!(again.data, report.data);
    assert_eq!(count(&hub.take_requests(), "GET", "/resolve/"), 0);

    // A file the repository does not have: named, with what it does have.
    a.data = DataSource::HuggingFace {
        repo: DATASET.into(),
        revision: "main".into(),
        endpoint: hub.endpoint(),
        data_dir: dir.join("data").display().to_string(),
        files: HubDataFiles::File("data/test.jsonl".into()),
    };
    a.data_file = dir.join("data/data/test.jsonl").display().to_string();
    let (code, message) = initialize(&dir, &a, None).message();
    assert_eq!(code, exit_code::INVALID_PLAN);
    assert!(
        message
            .reason
            .contains(&format!("dataset repository {DATASET}"))
            && message.reason.contains("no file data/test.jsonl")
            && message.reason.contains(DATASET_FILE),
        "{}",
        message.reason
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A split of a dataset in the hub's layout is found as `datasets` finds it
/// (the card's `configs`), only its files are downloaded, and the workers'
/// reading of the download directory gives the same documents; a glob names
/// the same files; a missing split or subset names what the dataset has.
#[test]
fn a_split_of_a_hub_dataset_is_downloaded_and_read_as_datasets_reads_it() {
    let hub = start_hub();
    let dir = temp_dir("split");
    let data_dir = dir.join("data");
    let train = DataSplit {
        subset: None,
        split: "train".into(),
    };
    let by_split = |split: &DataSplit| {
        let mut a = assignment(ModelSource::Volume, &fixture(), &data_dir);
        a.data = DataSource::HuggingFace {
            repo: SPLIT_DATASET.into(),
            revision: "main".into(),
            endpoint: hub.endpoint(),
            data_dir: data_dir.display().to_string(),
            files: HubDataFiles::Split(split.clone()),
        };
        a.data_split = Some(split.clone());
        a
    };
    let report = initialize(&dir, &by_split(&train), None).report();
    // Both train shards, in order: the sample's eight documents.
    assert_eq!(report.data.documents, 8);
    let requests = hub.take_requests();
    let got = |file: &str| {
        count(
            &requests,
            "GET",
            &format!("/datasets/{SPLIT_DATASET}/resolve/{COMMIT}/{file}"),
        )
    };
    assert_eq!(got("README.md"), 1, "{requests:#?}");
    assert_eq!(got("data/train-00000-of-00002.jsonl"), 1, "{requests:#?}");
    assert_eq!(got("data/train-00001-of-00002.jsonl"), 1, "{requests:#?}");
    assert_eq!(got("data/test-00000-of-00001.jsonl"), 0, "{requests:#?}");
    // The workers read the same files from the download directory.
    let format = headroom_worker::text::Format::Jsonl {
        field: "text".into(),
    };
    let location =
        headroom_worker::text::DataLocation::new(&data_dir.display().to_string(), Some(&train));
    let read = headroom_worker::text::read_documents(location, &format).expect("split");
    let sample = headroom_worker::text::read_documents(&data_file(), &format).expect("sample");
    assert_eq!(read, sample);

    // A glob names the train shards too.
    let mut glob = by_split(&train);
    glob.data = DataSource::HuggingFace {
        repo: SPLIT_DATASET.into(),
        revision: "main".into(),
        endpoint: hub.endpoint(),
        data_dir: data_dir.display().to_string(),
        files: HubDataFiles::File("data/train-*.jsonl".into()),
    };
    glob.data_split = None;
    glob.data_file = data_dir.join("data/train-*.jsonl").display().to_string();
    let again = initialize(&dir, &glob, None).report();
    assert_eq!((again.data.documents, again.downloaded_bytes), (8, 0));

    // What the dataset has, when asked for what it has not.
    for (split, says) in [
        (
            DataSplit {
                subset: None,
                split: "validation".into(),
            },
            "config default has the splits train, test",
        ),
        (
            DataSplit {
                subset: Some("fr".into()),
                split: "train".into(),
            },
            "subset fr: the dataset's configs are default",
        ),
    ] {
        let (code, message) = initialize(&dir, &by_split(&split), None).message();
        assert_eq!(code, exit_code::INVALID_PLAN);
        assert!(
            message
                .reason
                .contains(&format!("dataset repository {SPLIT_DATASET}"))
                && message.reason.contains(says),
            "{}",
            message.reason
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
