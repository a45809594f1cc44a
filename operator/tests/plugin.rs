//! `kubectl-headroom plan` end to end on the repository's samples, offline.

use std::process::{Command, Output};

use headroom_e2e::corpus::INVALID_DIR;
use headroom_e2e::fixtures::workspace_root as root;

fn plugin(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kubectl-headroom"))
        .args(args)
        .current_dir(root())
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        // Nor the cluster a CI pod runs in (the in-cluster fallback).
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("plugin runs")
}

/// The one job's document of `-o json` output: a `List` of one item.
fn one_job(out: &Output) -> serde_json::Value {
    let list: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", text(out)));
    assert_eq!(
        (&list["apiVersion"], &list["kind"]),
        (&"v1".into(), &"List".into()),
        "{list}"
    );
    let [item] = list["items"].as_array().expect("items").as_slice() else {
        panic!("one item: {list}");
    };
    item.clone()
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn plans_the_cpu_sample_with_a_breakdown() {
    let out = plugin(&["plan", "-f", "samples/cpu-tiny.yaml"]);
    let t = text(&out);
    assert!(out.status.success(), "{t}");
    for needle in [
        "default/tiny-cpu",
        "1 × cpu",
        "micro-batch",
        "WEIGHTS",
        "ACTIVATIONS",
        "TOTAL",
        "GiB",
    ] {
        assert!(t.contains(needle), "missing {needle:?} in\n{t}");
    }
}

#[test]
fn plans_the_gpu_sample_against_a_nodes_file_as_json() {
    let out = plugin(&[
        "plan",
        "-f",
        "samples/gpu-gpt2-medium.yaml",
        "--nodes",
        "samples/nodes-gfd.yaml",
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let doc = one_job(&out);
    assert_eq!(doc["feasible"], true);
    let plan = &doc["plan"];
    assert_eq!(plan["backend"], "cuda");
    assert!(plan["predictedPeakBytes"].as_u64() <= plan["budgetBytes"].as_u64());
    assert_eq!(plan["globalBatch"], 256);
    let device = plan["device"].as_str().expect("device");
    assert!(
        ["Tesla-T4", "NVIDIA-L4", "NVIDIA-A100-SXM4-80GB"].contains(&device),
        "{device} is not an allowed type"
    );
}

#[test]
fn yaml_output_parses() {
    let out = plugin(&["plan", "-f", "samples/cpu-oom-first.yaml", "-o", "yaml"]);
    assert!(out.status.success(), "{}", text(&out));
    let list: serde_yaml::Value = serde_yaml::from_slice(&out.stdout).expect("yaml output");
    assert_eq!(list["kind"], serde_yaml::Value::from("List"), "{list:?}");
    let doc = &list["items"][0];
    assert_eq!(
        doc["plan"]["settings"]["microBatch"],
        serde_yaml::Value::from(32)
    );
    assert!(
        doc["plan"]["warnings"][0]
            .as_str()
            .is_some_and(|w| w.contains("pinned"))
    );
}

#[test]
fn gpu_job_without_nodes_or_cluster_says_what_to_do() {
    let out = plugin(&["plan", "-f", "samples/gpu-gpt2-medium.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("--nodes"), "{}", text(&out));
}

#[test]
fn infeasible_job_exits_3_with_numbers() {
    let dir = std::env::temp_dir().join(format!("headroom-plugin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let job = std::fs::read_to_string(root().join("samples/gpu-gpt2-medium.yaml")).expect("sample");
    let huge = job.replace(
        "layers: 24, hidden: 1024, heads: 16",
        "layers: 96, hidden: 12288, heads: 96",
    );
    let path = dir.join("huge.yaml");
    std::fs::write(&path, huge).expect("write");
    let out = plugin(&[
        "plan",
        "-f",
        path.to_str().expect("utf8"),
        "--nodes",
        "samples/nodes-gfd.yaml",
    ]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("no feasible plan") && t.contains("budget of"),
        "{t}"
    );
}

#[test]
fn bad_files_get_clear_errors() {
    let out = plugin(&["plan", "-f", "does-not-exist.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("cannot read does-not-exist.yaml"),
        "{}",
        text(&out)
    );

    let out = plugin(&["plan", "-f", "samples/nodes-gfd.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("is a NodeList; expected kind: MemoryAwareTrainingJob"),
        "{}",
        text(&out)
    );

    let dir = std::env::temp_dir().join(format!("headroom-plugin-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let job = std::fs::read_to_string(root().join("samples/cpu-tiny.yaml")).expect("sample");
    let path = dir.join("typo.yaml");
    std::fs::write(&path, job.replace("globalBatch: 32", "globalBatch: many")).expect("write");
    let out = plugin(&["plan", "-f", path.to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("spec.training.globalBatch"),
        "{}",
        text(&out)
    );
}

/// `spec.worker.image` is optional (the operator picks its default image for
/// the job's backend): a job without one plans offline.
#[test]
fn a_job_without_a_worker_image_plans() {
    let dir = std::env::temp_dir().join(format!("headroom-plugin-noimage-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let job = std::fs::read_to_string(root().join("samples/cpu-tiny.yaml")).expect("sample");
    let without = job.replace(
        "  worker:\n    image: localhost/headroom-worker:dev\n",
        "  worker: {}\n",
    );
    assert_ne!(without, job, "the premise: the sample names an image");
    let path = dir.join("no-image.yaml");
    std::fs::write(&path, without).expect("write");
    let out = plugin(&["plan", "-f", path.to_str().expect("utf8"), "-o", "json"]);
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}", text(&out));
    let doc = one_job(&out);
    assert_eq!(doc["feasible"], true, "{doc}");
    assert_eq!(doc["plan"]["backend"], "flex", "{doc}");
}

/// A generic model is refused by the API server for running (the worker
/// trains transformers), but `kubectl headroom plan` plans it: that is what
/// it is for.
#[test]
fn a_generic_model_is_plan_only() {
    let out = plugin(&[
        "plan",
        "-f",
        &format!("{INVALID_DIR}/36-generic-model-not-runnable.yaml"),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("1.0 billion parameters"),
        "{}",
        text(&out)
    );
}

/// `--model-dir` plans the model a Hugging Face config describes; the JSON
/// output carries its parameter count, which equals the published one.
#[test]
fn plans_a_llama_family_model_from_its_hugging_face_config() {
    for (dir, params) in [
        ("samples/models/llama-3.2-1b", 1_235_814_400u64),
        ("samples/models/llama-2-7b", 6_738_415_616),
        ("samples/models/qwen3-8b", 8_190_735_360),
        ("samples/models/phi-4-mini-instruct", 3_836_021_760),
        ("samples/models/gemma-3-1b", 999_885_952),
    ] {
        let out = plugin(&[
            "plan",
            "-f",
            "samples/gpu-gpt2-medium.yaml",
            "--nodes",
            "samples/nodes-gfd.yaml",
            "--model-dir",
            dir,
            "--sequence-length",
            "2048",
            "-o",
            "json",
        ]);
        assert_eq!(out.status.code(), Some(0), "{dir}: {}", text(&out));
        let doc = one_job(&out);
        assert_eq!(doc["parameters"], params, "{dir}");
        assert!(doc["plan"]["workers"].as_u64().is_some_and(|w| w >= 1));
    }
    // Without a sequence length (the GPU sample's model is a transformer: it
    // gives one); a config that is not Llama-family names the key.
    let dir = std::env::temp_dir().join(format!("headroom-plugin-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    std::fs::write(
        dir.join("config.json"),
        r#"{"architectures": ["GPT2LMHeadModel"]}"#,
    )
    .expect("write");
    let out = plugin(&[
        "plan",
        "-f",
        "samples/gpu-gpt2-medium.yaml",
        "--nodes",
        "samples/nodes-gfd.yaml",
        "--model-dir",
        dir.to_str().expect("utf8"),
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("architectures"), "{}", text(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A config.json beyond the bounds a job's own `spec.model.transformer`
/// has is refused before it is planned, naming the key: forty million
/// layers under LoRA once took the plugin gigabytes of memory.
#[test]
fn a_checkpoint_config_beyond_the_crd_bounds_is_refused_naming_the_key() {
    let config = std::fs::read_to_string(root().join("samples/models/llama-2-7b/config.json"))
        .expect("sample config");
    let dir = std::env::temp_dir().join(format!("headroom-plugin-huge-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let job =
        std::fs::read_to_string(root().join("samples/gpu-lora-llama-2-7b.yaml")).expect("sample");
    let job_path = dir.join("lora.yaml");
    std::fs::write(&job_path, job.replace("maxGpus: 2", "maxGpus: 8")).expect("write");
    for (key, to) in [
        ("num_hidden_layers", 40_000_000u64),
        ("hidden_size", 4_000_000),
        ("vocab_size", 400_000_000),
        ("intermediate_size", 4_000_000_000),
    ] {
        let mut huge: serde_json::Value = serde_json::from_str(&config).expect("JSON");
        huge[key] = to.into();
        std::fs::write(dir.join("config.json"), huge.to_string()).expect("write");
        let started = std::time::Instant::now();
        let out = plugin(&[
            "plan",
            "-f",
            job_path.to_str().expect("utf8"),
            "--nodes",
            "samples/nodes-gfd.yaml",
            "--model-dir",
            dir.to_str().expect("utf8"),
        ]);
        let t = text(&out);
        assert_eq!(out.status.code(), Some(1), "{key}: {t}");
        assert!(
            t.contains(&format!("config.json: {key}: {to} exceeds")),
            "{key}: {t}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(5),
            "{key}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `model.pretrained` job is planned from its checkpoint's config.json
/// (`--model-dir`), at the manifest's sequence length; without one the
/// plugin says how to plan it.
#[test]
fn a_pretrained_job_is_planned_from_its_checkpoint_config() {
    let out = plugin(&[
        "plan",
        "-f",
        "samples/cpu-finetune-tiny-llama.yaml",
        "--model-dir",
        "worker/tests/fixtures/llama/tiny-llama",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let doc = one_job(&out);
    assert_eq!(doc["parameters"], 214_592);
    let out = plugin(&[
        "plan",
        "-f",
        "samples/gpu-finetune-llama-3.2-1b.yaml",
        "--nodes",
        "samples/nodes-gfd.yaml",
        "--model-dir",
        "samples/models/llama-3.2-1b",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let doc = one_job(&out);
    assert_eq!(doc["parameters"], 1_235_814_400u64);
    // The 7B-like sample: more than one 80 GB GPU's worth, so stages.
    let out = plugin(&[
        "plan",
        "-f",
        "samples/gpu-finetune-llama-2-7b.yaml",
        "--nodes",
        "samples/nodes-gfd.yaml",
        "--model-dir",
        "samples/models/llama-2-7b",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let doc = one_job(&out);
    assert_eq!(doc["parameters"], 6_738_415_616u64);
    let workers = doc["plan"]["workers"]
        .as_u64()
        .unwrap_or_else(|| panic!("{doc:#}"));
    assert!(workers >= 2, "7B with AdamW needs stages: {doc:#}");
    // LoRA on the 7B: PEFT's trainable count for r 8 on q_proj and v_proj.
    let out = plugin(&[
        "plan",
        "-f",
        "samples/gpu-lora-llama-2-7b.yaml",
        "--nodes",
        "samples/nodes-gfd.yaml",
        "--model-dir",
        "samples/models/llama-2-7b",
        "-o",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let doc = one_job(&out);
    assert_eq!(doc["trainableParameters"], 4_194_304u64, "{doc:#}");
    assert_eq!(doc["plan"]["adapters"]["rank"], 8, "{doc:#}");
    let out = plugin(&[
        "plan",
        "-f",
        "samples/gpu-lora-llama-2-7b.yaml",
        "--nodes",
        "samples/nodes-gfd.yaml",
        "--model-dir",
        "samples/models/llama-2-7b",
    ]);
    assert!(
        text(&out).contains("on q_proj, v_proj: 4,194,304 trainable"),
        "{}",
        text(&out)
    );
    let out = plugin(&["plan", "-f", "samples/cpu-finetune-tiny-llama.yaml"]);
    assert_eq!(out.status.code(), Some(1));
    let said = text(&out);
    assert!(
        said.contains("spec.model.pretrained") && said.contains("--model-dir"),
        "{said}"
    );
}

/// The QLoRA samples of the models people fine-tune now plan from their
/// published configs: seed 001's Phi-4-mini job on its 6 GB card, with
/// PEFT's trainable count for Phi-3's fused modules, and Qwen3-8B on one
/// 24 GB L4.
#[test]
fn the_adapter_samples_plan_phi_4_mini_on_6_gb_qwen3_8b_on_24_gb_and_gemma_3_on_16_gb() {
    for (sample, dir, params, trainable, device) in [
        (
            "samples/gpu-qlora-phi-4-mini.yaml",
            "samples/models/phi-4-mini-instruct",
            3_836_021_760u64,
            23_068_672u64,
            "NVIDIA-GeForce-RTX-2060",
        ),
        (
            "samples/gpu-qlora-qwen3-8b.yaml",
            "samples/models/qwen3-8b",
            8_190_735_360,
            43_646_976,
            "NVIDIA-L4",
        ),
        // PEFT's count: r · (in + out) per adapted matrix, q_proj 1152 →
        // 4 · 256 and v_proj 1152 → 256, on 26 layers.
        (
            "samples/gpu-lora-gemma-3-1b.yaml",
            "samples/models/gemma-3-1b",
            999_885_952,
            26 * 16 * ((1152 + 1024) + (1152 + 256)),
            "Tesla-T4",
        ),
    ] {
        let out = plugin(&[
            "plan",
            "-f",
            sample,
            "--nodes",
            "samples/nodes-gfd.yaml",
            "--model-dir",
            dir,
            "-o",
            "json",
        ]);
        assert_eq!(out.status.code(), Some(0), "{sample}: {}", text(&out));
        let doc = one_job(&out);
        assert_eq!(doc["parameters"], params, "{sample}");
        assert_eq!(doc["trainableParameters"], trainable, "{sample}");
        let plan = &doc["plan"];
        assert_eq!(plan["device"], device, "{doc:#}");
        assert_eq!(plan["workers"], 1, "{doc:#}");
        let base = if sample.contains("qlora") {
            "nf4"
        } else {
            "dense"
        };
        assert_eq!(plan["settings"]["baseFormat"], base, "{doc:#}");
        assert!(plan["predictedPeakBytes"].as_u64() <= plan["budgetBytes"].as_u64());
    }
    // The seed's own settings, as pinned: micro-batch 1 × 8, checkpointing.
    let out = plugin(&[
        "plan",
        "-f",
        "samples/gpu-qlora-phi-4-mini.yaml",
        "--nodes",
        "samples/nodes-gfd.yaml",
        "--model-dir",
        "samples/models/phi-4-mini-instruct",
    ]);
    let t = text(&out);
    assert!(
        t.contains("on qkv_proj, o_proj, gate_up_proj, down_proj: 23,068,672 trainable")
            && t.contains("micro-batch 1 × 8, checkpointing on, fp16"),
        "{t}"
    );
}

/// A mistyped field is an error offline, as on the API server, not ignored.
#[test]
fn unknown_fields_are_refused_with_their_path() {
    let dir = std::env::temp_dir().join(format!("headroom-plugin-typo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let job = std::fs::read_to_string(root().join("samples/cpu-tiny.yaml")).expect("sample");
    assert!(job.contains("    globalBatch: 32\n"), "the sample changed");
    let path = dir.join("unknown.yaml");
    std::fs::write(
        &path,
        job.replace(
            "    globalBatch: 32\n",
            "    globalBatch: 32\n    lerningRate: 0.1\n",
        ),
    )
    .expect("write");
    let out = plugin(&["plan", "-f", path.to_str().expect("utf8")]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let said = text(&out);
    assert!(said.contains("spec.training.lerningRate"), "{said}");
    assert!(
        said.contains("learningRate"),
        "names what would work: {said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kubectl headroom plan … | head`: the reader goes away; the exit code
/// still says whether a plan exists (0), never a panic (101).
#[test]
fn a_closed_stdout_is_not_a_crash() {
    for args in [
        &["plan", "-f", "samples/cpu-tiny.yaml"][..],
        &[
            "plan",
            "-f",
            "samples/gpu-gpt2-medium.yaml",
            "--nodes",
            "samples/nodes-gfd.yaml",
            "-o",
            "yaml",
        ][..],
    ] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader); // every write now fails with EPIPE
        let status = Command::new(env!("CARGO_BIN_EXE_kubectl-headroom"))
            .args(args)
            .current_dir(root())
            .env("KUBECONFIG", "/nonexistent/kubeconfig")
            // Nor the cluster a CI pod runs in (the in-cluster fallback).
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdout(writer)
            .stderr(std::process::Stdio::null())
            .status()
            .expect("plugin runs");
        assert_eq!(status.code(), Some(0), "{args:?}");
    }
}

#[test]
fn invalid_corpus_cross_field_rules_are_caught_offline_too() {
    // The API server is the authority (see api_server.rs); offline, the plugin
    // repeats the cross-field rules with the same field names.
    for (file, needle) in [
        ("02-both-model-kinds.yaml", "spec.model"),
        (
            "05-hidden-not-multiple-of-heads.yaml",
            "must be a multiple of heads",
        ),
        (
            "09-micro-batch-not-dividing.yaml",
            "must divide globalBatch",
        ),
        ("13-gpu-and-cpu.yaml", "spec.resources"),
        (
            "16-memory-limit-not-quantity.yaml",
            "spec.resources.cpu.memoryLimit",
        ),
        ("17-memory-limit-too-small.yaml", "at least 64Mi"),
        ("20-cuda-backend-on-cpu.yaml", "spec.worker.backend"),
        ("21-bf16-on-cpu.yaml", "fp32 only"),
        ("26-generic-model-split.yaml", "cannot be split"),
        (
            "28-node-selector-on-gpu-product.yaml",
            "spec.worker.nodeSelector",
        ),
        (
            "29-toleration-exists-with-value.yaml",
            "toleration 0: Exists takes no value",
        ),
        (
            "30-duplicate-rung.yaml",
            "spec.memoryPolicy.allowedRungs[2]: Duplicate value",
        ),
        ("31-cores-not-quantity.yaml", "spec.resources.cpu.cores"),
        ("32-negative-cores.yaml", "spec.resources.cpu.cores"),
        ("33-zero-cores.yaml", "must be above zero"),
        (
            "34-host-memory-not-quantity.yaml",
            "spec.resources.gpu.hostMemory",
        ),
        ("35-host-memory-too-small.yaml", "at least 64Mi"),
        (
            "57-steps-and-epochs.yaml",
            "spec.training: give the run's length",
        ),
        (
            "58-min-learning-rate-above-the-peak.yaml",
            "spec.training.schedule.minLearningRate: above",
        ),
        (
            "59-epochs-without-data.yaml",
            "spec.training.epochs: an epoch",
        ),
        // The CRD's schema, checked offline by a JSON Schema validator.
        (
            "04-zero-layers.yaml",
            "spec.model.transformer.layers: 0 is less than the minimum of 1",
        ),
        (
            "11-unknown-optimizer.yaml",
            "spec.training.optimizer: \"lion\"",
        ),
        ("22-empty-image.yaml", "spec.worker.image"),
        (
            "23-worker-env-reserved-name.yaml",
            "worker.env: HEADROOM_*, POD_NAME",
        ),
        (
            "27-duplicate-gpu-types.yaml",
            "spec.resources.gpu.types[1]: Duplicate value",
        ),
    ] {
        let path = format!("{INVALID_DIR}/{file}");
        let out = plugin(&["plan", "-f", &path]);
        assert_eq!(out.status.code(), Some(1), "{file}: {}", text(&out));
        assert!(
            text(&out).contains(needle),
            "{file}: {needle:?} not in {}",
            text(&out)
        );
    }
}

/// Offline refuses every manifest of the corpus the API server refuses (exit
/// 1), a fine-tuning job's with its checkpoint's config.json at hand. The
/// one exception is by design: `model.generic` is what the plugin plans
/// (the server refuses to run it).
#[test]
fn every_manifest_the_api_server_refuses_is_refused_offline() {
    let mut checked = 0;
    for m in headroom_e2e::corpus::invalid_manifests() {
        let file = m.name.as_str();
        if file == "36-generic-model-not-runnable.yaml" {
            continue;
        }
        let path = m.path.display().to_string();
        let mut args = vec!["plan", "-f", &path];
        if m.text.contains("pretrained:") {
            args.extend(["--model-dir", "samples/models/llama-3.2-1b"]);
        }
        let out = plugin(&args);
        assert_eq!(out.status.code(), Some(1), "{file}: {}", text(&out));
        checked += 1;
    }
    assert!(checked >= 50, "{checked} manifests");
}

/// The team-pool sample is planned on its pool's H100s, which it selects and
/// whose taint it tolerates; without the toleration those GPUs are not its
/// to plan, and nothing else matches its node selector.
#[test]
fn a_job_is_planned_only_on_nodes_its_workers_may_use() {
    let out = plugin(&[
        "plan",
        "-f",
        "samples/gpu-team-pool.yaml",
        "--nodes",
        "samples/nodes-gfd.yaml",
        "-o",
        "json",
    ]);
    assert!(out.status.success(), "{}", text(&out));
    let doc = one_job(&out);
    assert_eq!(doc["plan"]["device"], "NVIDIA-H100-80GB-HBM3", "{doc}");

    let sample =
        std::fs::read_to_string(root().join("samples/gpu-team-pool.yaml")).expect("sample");
    let untolerated: String = sample
        .lines()
        .filter(|l| !l.trim_start().starts_with("tolerations:"))
        .map(|l| format!("{l}\n"))
        .collect();
    let path =
        std::env::temp_dir().join(format!("headroom-untolerated-{}.yaml", std::process::id()));
    std::fs::write(&path, untolerated).expect("write");
    let out = plugin(&[
        "plan",
        "-f",
        path.to_str().expect("utf-8"),
        "--nodes",
        "samples/nodes-gfd.yaml",
    ]);
    let _ = std::fs::remove_file(&path);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    let t = text(&out);
    assert!(
        t.contains("no node this job's pods may use offers the allowed GPU types")
            && t.contains("h100-research-1 (taint dedicated=research:NoSchedule not tolerated)")
            && t.contains("a100-pool-1 (no label headroom.dev/pool=research)"),
        "the explanation names the nodes left out and why: {t}"
    );
}

/// A 7.4B-parameter bf16 job allowed up to 8 T4s.
const WIDE_T4_JOB: &str = "apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata: {name: wide}
spec:
  model:
    transformer: {layers: 64, hidden: 3072, heads: 24, sequenceLength: 1024, vocabulary: 50257}
  training: {globalBatch: 64, steps: 100, precision: bf16}
  resources:
    gpu: {types: [Tesla-T4], maxGpus: 8}
  worker: {image: localhost/headroom-worker:dev, backend: cuda}
";

/// `kubectl-headroom plan -f job --nodes nodes -o json [extra]`, parsed.
fn plan_json(job: &std::path::Path, nodes: &std::path::Path, extra: &[&str]) -> serde_json::Value {
    let mut args = vec![
        "plan",
        "-f",
        job.to_str().expect("utf-8"),
        "--nodes",
        nodes.to_str().expect("utf-8"),
        "-o",
        "json",
    ];
    args.extend_from_slice(extra);
    let out = plugin(&args);
    one_job(&out)
}

/// With a ReadWriteOnce checkpoint volume (the default) a job's stages share
/// a node, so two 4-GPU nodes offer 4 stages, not 8; ReadWriteMany lets the
/// same job spread over both.
#[test]
fn read_write_once_checkpoints_cap_stages_at_one_nodes_gpus() {
    let dir = std::env::temp_dir().join(format!("headroom-plugin-rwo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let nodes = dir.join("nodes.yaml");
    let node = |name: &str| {
        format!(
            "- metadata:\n    name: {name}\n    labels: {{nvidia.com/gpu.product: Tesla-T4, nvidia.com/gpu.memory: \"15360\", nvidia.com/gpu.count: \"4\"}}\n  status:\n    allocatable: {{nvidia.com/gpu: \"4\"}}\n"
        )
    };
    std::fs::write(
        &nodes,
        format!(
            "apiVersion: v1\nkind: NodeList\nitems:\n{}{}",
            node("t4-a"),
            node("t4-b")
        ),
    )
    .expect("nodes file");
    let job = dir.join("job.yaml");
    // Offloading the optimizer state would fit 3 T4s (see the test below).
    let policy = "  memoryPolicy:\n    allowedRungs: [activationCheckpointing, halveMicroBatch, lowerPrecision, cheaperOptimizer, morePipelineStages, largerGpu]\n";
    std::fs::write(&job, format!("{WIDE_T4_JOB}{policy}")).expect("job file");
    let plan = |mode: &str| plan_json(&job, &nodes, &["--checkpoint-access-mode", mode]);
    let spread = plan("ReadWriteMany");
    let workers = spread["plan"]["workers"]
        .as_u64()
        .expect("a plan over both nodes");
    assert!(
        workers > 4,
        "the premise: the job needs more than one node's GPUs: {spread}"
    );
    let one_node = plan("ReadWriteOnce");
    assert_eq!(one_node["feasible"], false, "{one_node}");
    let details = one_node["details"].to_string();
    assert!(
        details.contains("Tesla-T4") && details.contains("ReadWriteMany"),
        "the explanation names the device and the way out: {one_node}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Offloading the optimizer puts its state in the worker pods' host memory:
/// the same 7.4B bf16 job fits the T4s of one node that can hold the pods'
/// state (plus the default 16Gi each), takes 8-bit state where a node holds
/// less, and is refused, with the figures, where a node cannot hold even that.
#[test]
fn offloaded_state_needs_nodes_with_the_host_memory_for_it() {
    let dir = std::env::temp_dir().join(format!("headroom-plugin-host-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let job = dir.join("job.yaml");
    std::fs::write(&job, WIDE_T4_JOB).expect("job file");
    let plan = |host_memory: &str| {
        let nodes = dir.join(format!("nodes-{host_memory}.yaml"));
        std::fs::write(
            &nodes,
            format!(
                "apiVersion: v1\nkind: NodeList\nitems:\n- metadata:\n    name: t4\n    labels: {{nvidia.com/gpu.product: Tesla-T4, nvidia.com/gpu.memory: \"15360\", nvidia.com/gpu.count: \"4\"}}\n  status:\n    allocatable: {{nvidia.com/gpu: \"4\", memory: {host_memory}, cpu: \"48\"}}\n"
            ),
        )
        .expect("nodes file");
        plan_json(&job, &nodes, &[])
    };
    let big = plan("256Gi");
    assert_eq!(big["feasible"], true, "{big}");
    assert_eq!(big["plan"]["settings"]["offloadOptimizer"], true, "{big}");
    let host: u64 = big["plan"]["stages"]
        .as_array()
        .expect("stages")
        .iter()
        .map(|s| s["memory"]["hostBytes"].as_u64().expect("hostBytes"))
        .sum();
    let pods = big["plan"]["workers"].as_u64().expect("workers");
    let need = host + pods * (16 << 30);
    assert!(need <= 256 << 30 && need > 80 << 30, "{need}");

    // Less host memory: 8-bit moments make the offloaded state fit. (The
    // job has 7.4B parameters, not 3.8B, since a bf16 CUDA stage that keeps
    // its state on the GPU keeps bf16 moments and no fp32 master copy: it
    // takes this size to need more than one node's T4s. Offloaded, the
    // state is f32 on the host, with the master copy.)
    let mid = plan("112Gi");
    assert_eq!(mid["feasible"], true, "{mid}");
    assert_eq!(mid["plan"]["settings"]["optimizer"], "adamw8bit", "{mid}");
    assert_eq!(mid["plan"]["settings"]["offloadOptimizer"], true, "{mid}");

    let small = plan("48Gi");
    assert_eq!(small["feasible"], false, "{small}");
    let details = small["details"].to_string();
    assert!(
        details.contains("of host memory on one node") && details.contains("allocates 48.0 GiB"),
        "the refusal gives the figures: {small}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `kubectl-headroom` with `stdin` on its standard input.
fn plugin_with_stdin(args: &[&str], stdin: &str) -> Output {
    use std::io::Write;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kubectl-headroom"))
        .args(args)
        .current_dir(root())
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        // Nor the cluster a CI pod runs in (the in-cluster fallback).
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("plugin runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("plugin ends")
}

fn sample(name: &str) -> String {
    std::fs::read_to_string(root().join("samples").join(name)).expect("sample")
}

/// `-f -` reads the manifest from standard input, `-n` names the namespace
/// of a job whose manifest names none, and `-o json` is a `List` whether
/// it holds one job or several.
#[test]
fn stdin_and_dash_n_plan_every_job_as_one_list() {
    let out = plugin_with_stdin(
        &["plan", "-f", "-", "-n", "ml", "-o", "json"],
        &sample("cpu-tiny.yaml"),
    );
    assert_eq!(one_job(&out)["job"], "ml/tiny-cpu", "{}", text(&out));

    let both = format!(
        "{}\n---\n{}",
        sample("cpu-tiny.yaml"),
        sample("cpu-oom-first.yaml")
    );
    let out = plugin_with_stdin(&["-n", "ml", "plan", "-f", "-", "-o", "json"], &both);
    assert!(out.status.success(), "{}", text(&out));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(list["kind"], "List", "{list}");
    let jobs: Vec<&str> = list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|i| i["job"].as_str().expect("job"))
        .collect();
    assert_eq!(jobs.len(), 2, "{list}");
    assert!(jobs.iter().all(|j| j.starts_with("ml/")), "{jobs:?}");

    // A manifest naming another namespace than -n is refused, as kubectl does.
    let elsewhere =
        sample("cpu-tiny.yaml").replace("name: tiny-cpu", "name: tiny-cpu\n  namespace: team");
    assert_ne!(
        elsewhere,
        sample("cpu-tiny.yaml"),
        "the premise: the sample has that line"
    );
    let out = plugin_with_stdin(&["plan", "-f", "-", "-n", "ml"], &elsewhere);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("stdin: tiny-cpu") && text(&out).contains("--namespace=team"),
        "{}",
        text(&out)
    );
    let out = plugin_with_stdin(&["plan", "-f", "-", "-o", "json"], &elsewhere);
    assert_eq!(one_job(&out)["job"], "team/tiny-cpu");
}

/// Without `-n`, the kubeconfig context's namespace (`--kubeconfig`,
/// `--context`), not `default`; a cluster that cannot be reached leaves a
/// CPU job planned on its own budget, with a note that says why.
#[test]
fn the_kubeconfig_contexts_namespace_names_the_job() {
    let dir = std::env::temp_dir().join(format!("headroom-plugin-ctx-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("tmp");
    let kubeconfig = dir.join("kubeconfig");
    // Port 1 on loopback: nothing listens, the connection is refused at once.
    std::fs::write(
        &kubeconfig,
        "apiVersion: v1\nkind: Config\ncurrent-context: tenant\nclusters:\n- name: c\n  cluster: {server: 'https://127.0.0.1:1'}\nusers:\n- name: u\n  user: {token: t}\ncontexts:\n- name: tenant\n  context: {cluster: c, user: u, namespace: tenant}\n- name: other\n  context: {cluster: c, user: u, namespace: other}\n",
    )
    .expect("kubeconfig");
    let k = kubeconfig.to_str().expect("utf-8");
    let out = plugin(&[
        "plan",
        "-f",
        "samples/cpu-tiny.yaml",
        "--kubeconfig",
        k,
        "-o",
        "json",
    ]);
    assert_eq!(one_job(&out)["job"], "tenant/tiny-cpu", "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("tenant/tiny-cpu: node sizes not checked: no cluster"),
        "{said}"
    );
    let out = plugin(&[
        "plan",
        "-f",
        "samples/cpu-tiny.yaml",
        "--kubeconfig",
        k,
        "--context",
        "other",
        "-o",
        "json",
    ]);
    assert_eq!(one_job(&out)["job"], "other/tiny-cpu", "{}", text(&out));
    let out = plugin(&[
        "plan",
        "-f",
        "samples/cpu-tiny.yaml",
        "--kubeconfig",
        k,
        "--context",
        "prod",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out).contains("\"prod\": the kubeconfig has no such context (it has: tenant, other)"),
        "{}",
        text(&out)
    );
    // KUBECONFIG is read as kubectl reads it.
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-headroom"))
        .args(["plan", "-f", "samples/cpu-tiny.yaml", "-o", "json"])
        .current_dir(root())
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .output()
        .expect("plugin runs");
    assert_eq!(one_job(&out)["job"], "tenant/tiny-cpu", "{}", text(&out));
    // A GPU job needs nodes: the error says where to get them.
    let out = plugin(&[
        "plan",
        "-f",
        "samples/gpu-gpt2-medium.yaml",
        "--kubeconfig",
        k,
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out).contains("--nodes nodes.yaml"), "{}", text(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

/// The plugin's output for the CPU sample, whole, against the copy in
/// `tests/fixtures/plugin/` (`HEADROOM_UPDATE_GOLDEN=1` rewrites them after
/// a change meant to change them: review the diff).
#[test]
fn golden_outputs_of_the_cpu_samples() {
    let both = format!(
        "{}\n---\n{}",
        sample("cpu-tiny.yaml"),
        sample("cpu-oom-first.yaml")
    );
    for (golden, args) in [
        ("cpu-tiny.txt", &["plan", "-f", "-", "-n", "tenant"][..]),
        (
            "cpu-tiny-and-oom-first.yaml",
            &["plan", "-f", "-", "-n", "tenant", "-o", "yaml"][..],
        ),
    ] {
        let out = plugin_with_stdin(args, &both);
        assert!(out.status.success(), "{}", text(&out));
        let got = String::from_utf8(out.stdout).expect("utf-8");
        let path = root().join("operator/tests/fixtures/plugin").join(golden);
        if std::env::var_os("HEADROOM_UPDATE_GOLDEN").is_some() {
            std::fs::create_dir_all(path.parent().expect("dir")).expect("dir");
            std::fs::write(&path, &got).expect("write golden");
        }
        let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e} (HEADROOM_UPDATE_GOLDEN=1 writes it)",
                path.display()
            )
        });
        assert!(
            got == want,
            "{golden} differs from {} (HEADROOM_UPDATE_GOLDEN=1 rewrites it):\n{got}",
            path.display()
        );
    }
}

/// A user whose Role is namespaced, as a platform gives a team: context
/// namespace `tenant-…`, the jobs and pods there, no nodes, no other
/// namespace. On the real API server the plugin names the job after the
/// context's namespace and plans a CPU job without node sizes, saying
/// why; a GPU job's refusal says what to pass. Once the user may list nodes
/// they are planned on, and GPUs held outside the namespace, which the user
/// may not see, are said to be counted as free.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_namespaced_user_plans_in_the_contexts_namespace_on_the_api_server() {
    use headroom_e2e::fixtures::{GpuNodes, gpu_job};
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding, Role, RoleBinding};
    use kube::api::{Api, DeleteParams, PostParams};
    use serde_json::json;

    let ns = headroom_e2e::TestNs::new(headroom_e2e::API_SERVER, "tenant").await;
    let user = format!("{}-user", ns.name);
    let subject = json!([{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]);
    let pp = PostParams::default();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "team"},
        "rules": [
            {"apiGroups": ["headroom.dev"], "resources": ["memoryawaretrainingjobs"], "verbs": ["get", "list", "watch", "create", "delete"]},
            {"apiGroups": [""], "resources": ["pods", "pods/log"], "verbs": ["get", "list", "watch"]}
        ]
    }))
    .expect("role");
    Api::<Role>::namespaced(ns.client.clone(), &ns.name)
        .create(&pp, &role)
        .await
        .expect("role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "team"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "team"},
        "subjects": subject
    }))
    .expect("binding");
    Api::<RoleBinding>::namespaced(ns.client.clone(), &ns.name)
        .create(&pp, &binding)
        .await
        .expect("role binding");

    // The admin's kubeconfig, acting as the user, in a context whose namespace is the user's.
    let mut kubeconfig = kube::config::Kubeconfig::read().expect("KUBECONFIG");
    let current = kubeconfig
        .current_context
        .clone()
        .expect("a current context");
    for named in &mut kubeconfig.contexts {
        if named.name == current {
            named.context.as_mut().expect("context").namespace = Some(ns.name.clone());
        }
    }
    for named in &mut kubeconfig.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.impersonate = Some(user.clone());
        }
    }
    let dir = std::env::temp_dir().join(format!("headroom-plugin-tenant-{}", ns.name));
    std::fs::create_dir_all(&dir).expect("tmp");
    let path = dir.join("kubeconfig");
    std::fs::write(&path, serde_yaml::to_string(&kubeconfig).expect("yaml")).expect("kubeconfig");
    let k = path.to_str().expect("utf-8");

    let out = plugin_with_stdin(
        &["plan", "-f", "-", "--kubeconfig", k, "-o", "json"],
        &sample("cpu-tiny.yaml"),
    );
    let job = one_job(&out);
    assert_eq!(
        job["job"],
        format!("{}/tiny-cpu", ns.name),
        "{}",
        text(&out)
    );
    assert_eq!(job["feasible"], true, "{job}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!(
            "{}/tiny-cpu: node sizes not checked: you may not list nodes",
            ns.name
        )) && said.contains("forbidden"),
        "{said}"
    );

    let mut nodes = GpuNodes::new(&ns);
    let product = nodes.product("H100");
    nodes.add("gpu", &product, 81_920).await;
    let gpu = dir.join("gpu.yaml");
    std::fs::write(&gpu, gpu_job("gpu", &[&product], 1, "")).expect("job");
    let g = gpu.to_str().expect("utf-8");
    let out = plugin(&["plan", "-f", g, "--kubeconfig", k]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("a GPU job needs an inventory: you may not list nodes")
            && text(&out).contains("pass --nodes nodes.yaml"),
        "{}",
        text(&out)
    );

    // Nodes listed, pods only in the namespace.
    let name = format!("{}-nodes", ns.name);
    let cluster_role: ClusterRole = serde_json::from_value(json!({
        "metadata": {"name": name},
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list"]}]
    }))
    .expect("cluster role");
    let cluster_binding: ClusterRoleBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": subject
    }))
    .expect("cluster role binding");
    let roles = Api::<ClusterRole>::all(ns.client.clone());
    let bindings = Api::<ClusterRoleBinding>::all(ns.client.clone());
    roles
        .create(&pp, &cluster_role)
        .await
        .expect("cluster role");
    bindings
        .create(&pp, &cluster_binding)
        .await
        .expect("cluster role binding");
    let out = plugin(&["plan", "-f", g, "--kubeconfig", k, "-o", "json"]);
    let _ = bindings.delete(&name, &DeleteParams::default()).await;
    let _ = roles.delete(&name, &DeleteParams::default()).await;
    nodes.remove().await;
    let job = one_job(&out);
    assert_eq!(job["job"], format!("{}/gpu", ns.name), "{job}");
    assert_eq!(job["plan"]["device"], product.as_str(), "{job}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("you may not list pods in every namespace")
            && said.contains(&format!(
                "GPUs held by pods outside {} are counted as free",
                ns.name
            )),
        "{said}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    ns.cleanup().await;
}

/// `kubectl-headroom` with `stdin` and the Hugging Face variables `hf`
/// (and none of the developer's own).
fn plugin_with_hf(args: &[&str], stdin: &str, hf: &[(&str, &str)]) -> Output {
    use std::io::Write;
    let mut command = Command::new(env!("CARGO_BIN_EXE_kubectl-headroom"));
    command
        .args(args)
        .current_dir(root())
        .env("KUBECONFIG", "/nonexistent/kubeconfig")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("HF_TOKEN")
        .env_remove("HF_ENDPOINT")
        .env_remove("HF_TOKEN_PATH")
        // Nor the developer's `huggingface-cli login` token.
        .env("HF_HOME", "/nonexistent/hf-home")
        .envs(hf.iter().copied())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = command.spawn().expect("plugin runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    child.wait_with_output().expect("plugin ends")
}

/// `got` against the golden file `name` in `tests/fixtures/plugin/`
/// (`HEADROOM_UPDATE_GOLDEN=1` rewrites it).
fn assert_golden(name: &str, got: &str) {
    let path = root().join("operator/tests/fixtures/plugin").join(name);
    if std::env::var_os("HEADROOM_UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, got).expect("write golden");
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (HEADROOM_UPDATE_GOLDEN=1 writes it)",
            path.display()
        )
    });
    assert!(
        got == want,
        "{name} differs from {} (HEADROOM_UPDATE_GOLDEN=1 rewrites it):\n{got}",
        path.display()
    );
}

/// stdout, then stderr under a `--- stderr` line.
fn both_streams(out: &Output) -> String {
    format!(
        "{}--- stderr\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Without `--model-dir`, a `model.pretrained.huggingFace` job is planned
/// from the config.json its hub holds at its revision's commit, fetched as
/// the initializer fetches it (listing, then `resolve/{commit}`), from a
/// stand-in that answers as the hub does. The plan is the one
/// `--model-dir` gives from the same file. The user's HF_TOKEN is sent only
/// to the endpoint HF_ENDPOINT names (or huggingface.co), never to one a
/// manifest names, and each refusal says what to set.
#[test]
fn a_hub_models_config_is_fetched_at_its_revisions_commit() {
    use headroom_e2e::hub::{HUB_COMMIT, HubRepo, LocalHub};
    let config = std::fs::read(root().join("samples/models/llama-3.2-1b/config.json"))
        .expect("the sample's config");
    let repo = HubRepo {
        files: [("config.json".to_string(), config)].into_iter().collect(),
        token: Some("hf_plugin_user".into()),
    };
    let hub = LocalHub::start(
        "127.0.0.1:0",
        [("meta-llama/Llama-3.2-1B".to_string(), repo)]
            .into_iter()
            .collect(),
    );
    let endpoint = hub.endpoint();
    let job = sample("gpu-finetune-llama-3.2-1b.yaml");
    let on_hub = job.replace(
        "        tokenSecret: {name: hf-token}\n",
        &format!(
            "        tokenSecret: {{name: hf-token}}\n        endpoint: {endpoint}\n        allowInsecureHttp: true\n"
        ),
    );
    assert_ne!(on_hub, job, "the premise: the sample names a token Secret");
    let args = [
        "plan",
        "-f",
        "-",
        "-n",
        "tenant",
        "--nodes",
        "samples/nodes-gfd.yaml",
    ];

    // No token: the hub's 401, and what to set.
    let out = plugin_with_hf(&args, &on_hub, &[]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("needs a token: set HF_TOKEN") && text(&out).contains("--model-dir"),
        "{}",
        text(&out)
    );
    // A token, but the manifest's endpoint is not the user's: not sent.
    hub.take_requests();
    let out = plugin_with_hf(&args, &on_hub, &[("HF_TOKEN", "hf_plugin_user")]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains(&format!("set HF_ENDPOINT={endpoint} to send it there")),
        "{}",
        text(&out)
    );
    let seen = hub.take_requests();
    assert!(
        !seen.is_empty() && seen.iter().all(|r| r.authorization.is_none()),
        "{seen:?}"
    );

    // The user's own endpoint: the listing, then config.json at its commit.
    let hf = [
        ("HF_TOKEN", "hf_plugin_user"),
        ("HF_ENDPOINT", endpoint.as_str()),
    ];
    let out = plugin_with_hf(&args, &on_hub, &hf);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    let paths: Vec<(String, String, Option<String>)> = hub
        .take_requests()
        .into_iter()
        .map(|r| (r.method, r.path, r.authorization))
        .collect();
    let bearer = Some("Bearer hf_plugin_user".to_string());
    assert_eq!(
        paths,
        [
            (
                "GET".into(),
                "/api/models/meta-llama/Llama-3.2-1B/revision/main".into(),
                bearer.clone()
            ),
            (
                "GET".into(),
                format!("/meta-llama/Llama-3.2-1B/resolve/{HUB_COMMIT}/config.json"),
                bearer
            ),
        ]
    );
    let from_dir = plugin_with_hf(
        &[&args[..], &["--model-dir", "samples/models/llama-3.2-1b"]].concat(),
        &on_hub,
        &[],
    );
    assert_eq!(from_dir.status.code(), Some(0), "{}", text(&from_dir));
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&from_dir.stdout),
        "the hub's config.json plans as the same file on disk"
    );
    assert_golden(
        "hub-llama-3.2-1b.txt",
        &both_streams(&out).replace(&endpoint, "http://127.0.0.1:PORT"),
    );

    // The token file `huggingface-cli login` writes serves as HF_TOKEN does.
    let token_file = std::env::temp_dir().join(format!("headroom-hf-token-{}", std::process::id()));
    std::fs::write(&token_file, "hf_plugin_user\n").expect("token file");
    let out = plugin_with_hf(
        &args,
        &on_hub,
        &[
            ("HF_TOKEN_PATH", token_file.to_str().expect("utf-8")),
            ("HF_ENDPOINT", endpoint.as_str()),
        ],
    );
    let _ = std::fs::remove_file(&token_file);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        hub.take_requests()
            .iter()
            .all(|r| r.authorization.as_deref() == Some("Bearer hf_plugin_user")),
        "the file's token is sent"
    );

    // A revision the hub does not have is named.
    let out = plugin_with_hf(
        &args,
        &on_hub.replace("revision: main", "revision: v9"),
        &hf,
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("revision not found"), "{}", text(&out));
}

/// A job that names a Kueue queue, planned where no cluster can be reached:
/// planned without the queue's quota, and the note says so.
#[test]
fn golden_output_of_a_queued_job_without_a_cluster() {
    let job = headroom_e2e::kueue::queued(&sample("cpu-tiny.yaml"), "team-a", None);
    let out = plugin_with_stdin(&["plan", "-f", "-", "-n", "tenant"], &job);
    assert!(out.status.success(), "{}", text(&out));
    assert_golden("cpu-tiny-queued-offline.txt", &both_streams(&out));
    let out = plugin_with_stdin(&["plan", "-f", "-", "-n", "tenant", "-o", "json"], &job);
    let item = one_job(&out);
    assert_eq!(item["queue"]["localQueue"], "team-a", "{item}");
    assert_eq!(item["queue"]["quotaChecked"], false, "{item}");
}

/// On the real API server (Kueue's CRDs, no Kueue controller): a job that
/// names a LocalQueue is planned within its ClusterQueue's quota, as the
/// operator plans it (a worker the quota cannot hold is refused with both
/// figures); a user whose Role is namespaced may read the LocalQueue but
/// not the ClusterQueue, and is told that the quota was not checked.
#[tokio::test]
#[ignore = "needs the control plane: make test-apiserver"]
async fn a_queued_job_is_planned_within_its_quota_or_says_it_could_not_read_it() {
    use headroom_e2e::kueue::{QueueSpec, queued};
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    use kube::api::{Api, PostParams};
    use serde_json::json;

    let ns = headroom_e2e::TestNs::new(headroom_e2e::API_SERVER, "hr-plugin-queue").await;
    // Room for one 1 GiB worker of cpu-tiny, not for a 4 GiB one.
    let queue = ns
        .kueue_queue(&QueueSpec::one(&[("cpu", "2"), ("memory", "1536Mi")]))
        .await;
    let small = queued(&sample("cpu-tiny.yaml"), &queue.local, None);
    assert!(small.contains("memoryLimit: 1Gi"), "the sample changed");
    let big = small.replace("memoryLimit: 1Gi", "memoryLimit: 4Gi");

    // The admin's kubeconfig, in a context whose namespace is the test's.
    let mut kubeconfig = kube::config::Kubeconfig::read().expect("KUBECONFIG");
    let current = kubeconfig
        .current_context
        .clone()
        .expect("a current context");
    for named in &mut kubeconfig.contexts {
        if named.name == current {
            named.context.as_mut().expect("context").namespace = Some(ns.name.clone());
        }
    }
    let dir = std::env::temp_dir().join(format!("headroom-plugin-queue-{}", ns.name));
    std::fs::create_dir_all(&dir).expect("tmp");
    let admin = dir.join("admin");
    std::fs::write(&admin, serde_yaml::to_string(&kubeconfig).expect("yaml")).expect("write");
    let admin = admin.to_str().expect("utf-8");
    let described = format!(
        "LocalQueue {} (ClusterQueue {})",
        queue.local, queue.cluster
    );

    let out = plugin_with_stdin(
        &["plan", "-f", "-", "--kubeconfig", admin, "-o", "json"],
        &small,
    );
    let item = one_job(&out);
    assert_eq!(item["feasible"], true, "{}", text(&out));
    assert_eq!(item["queue"]["quotaChecked"], true, "{item}");
    assert_eq!(
        item["queue"]["clusterQueue"],
        queue.cluster.as_str(),
        "{item}"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr)
            .contains(&format!("planned within the quota of {described}")),
        "{}",
        text(&out)
    );
    let out = plugin_with_stdin(&["plan", "-f", "-", "--kubeconfig", admin], &big);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out));
    assert!(
        text(&out).contains(&format!(
            "of {described} has memory quota 1.5 GiB, one worker needs 4.0 GiB"
        )),
        "{}",
        text(&out)
    );

    // A user who may read the namespace's LocalQueues, not the ClusterQueue.
    let user = format!("{}-user", ns.name);
    let pp = PostParams::default();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "team"},
        "rules": [
            {"apiGroups": ["kueue.x-k8s.io"], "resources": ["localqueues"], "verbs": ["get", "list", "watch"]},
            {"apiGroups": ["headroom.dev"], "resources": ["memoryawaretrainingjobs"], "verbs": ["get", "list", "watch", "create"]}
        ]
    }))
    .expect("role");
    Api::<Role>::namespaced(ns.client.clone(), &ns.name)
        .create(&pp, &role)
        .await
        .expect("role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "team"},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "team"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]
    }))
    .expect("binding");
    Api::<RoleBinding>::namespaced(ns.client.clone(), &ns.name)
        .create(&pp, &binding)
        .await
        .expect("role binding");
    for named in &mut kubeconfig.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.impersonate = Some(user.clone());
        }
    }
    let tenant = dir.join("tenant");
    std::fs::write(&tenant, serde_yaml::to_string(&kubeconfig).expect("yaml")).expect("write");
    let tenant = tenant.to_str().expect("utf-8");
    let out = plugin_with_stdin(
        &["plan", "-f", "-", "--kubeconfig", tenant, "-o", "json"],
        &big,
    );
    let item = one_job(&out);
    assert_eq!(item["feasible"], true, "planned as given: {}", text(&out));
    assert_eq!(item["queue"]["quotaChecked"], false, "{item}");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains(&format!(
            "{}/tiny-cpu: queue quota not checked: you may not read it (ClusterQueue {}:",
            ns.name, queue.cluster
        )) && said.contains("forbidden")
            && said.contains(&format!(
                "planned as if LocalQueue {} gave all the nodes have",
                queue.local
            )),
        "{said}"
    );
    ns.delete_kueue_objects(&queue, &[]).await;
    let _ = std::fs::remove_dir_all(&dir);
    ns.cleanup().await;
}
