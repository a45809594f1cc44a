//! Fine-tuning a real (tiny) Hugging Face checkpoint on real text.
//!
//! `tests/fixtures/llama/tiny-llama` was made by transformers (`make_tiny.py`:
//! a LlamaForCausalLM with GQA and a tied head, and a byte-level BPE
//! tokenizer trained on the sample text). The worker loads it, tokenizes the
//! public-domain sample text with its tokenizer, trains, and writes the
//! result back in Hugging Face format; reading that output back gives the
//! trained model's logits, under the original tensor names and dtype — on one
//! worker, and from two pipeline stages that each write a shard.

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use headroom_planner::Settings;
use headroom_worker::collective::Single;
use headroom_worker::link_auth::LinkKey;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm};
use headroom_worker::pipeline::{Hello, Peers, establish};
use headroom_worker::train::{TrainConfig, Trainer};

use common::{tiny_llama, tiny_llama_text};

const SEQUENCE: u32 = 32;

fn config(steps: u64) -> TrainConfig {
    let checkpoint = HfCheckpoint::open(&tiny_llama(), SEQUENCE).expect("tiny-llama");
    TrainConfig::single_stage(
        checkpoint.shape,
        Settings {
            micro_batch: 2,
            gradient_accumulation: 2,
            ..Settings::default()
        },
        steps,
        3e-3,
        5,
    )
    .with_pretrained(tiny_llama())
}

fn probe_logits(model: &TransformerLm) -> Vec<f32> {
    let ids: Vec<i64> = (0..SEQUENCE as i64).map(|i| (i * 37 + 5) % 500).collect();
    let tokens = Tensor::<2, Int>::from_data(
        TensorData::new(ids, [1, SEQUENCE as usize]),
        &Device::flex(),
    );
    model.forward(tokens).into_data().iter::<f32>().collect()
}

fn reload(out: &Path) -> TransformerLm {
    let checkpoint = HfCheckpoint::open(out, SEQUENCE).expect("the output is a checkpoint");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let layout = StageLayout::whole(&shape);
    let mut model = TransformerLm::new(&shape, &layout, 0, &Device::flex());
    checkpoint.load_stage(&mut model, &layout).expect("reload");
    model
}

fn tensor_names(file: &Path) -> Vec<(String, String)> {
    let bytes = std::fs::read(file).expect("weights");
    let tensors = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut names: Vec<_> = tensors
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, format!("{:?}", v.dtype())))
        .collect();
    names.sort();
    names
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn fine_tunes_on_real_text_and_writes_a_model_that_reloads() {
    let out = tempdir("single");
    let mut trainer = Trainer::new(config(12), Device::flex().autodiff()).expect("trainer");
    trainer.use_text(tiny_llama_text(SEQUENCE, 5));
    let before = probe_logits(&trainer.model().valid());
    let mut losses = Vec::new();
    while !trainer.finished() {
        losses.extend(trainer.train_step().expect("step").loss);
    }
    let first = losses[..3].iter().sum::<f64>() / 3.0;
    let last = losses[losses.len() - 3..].iter().sum::<f64>() / 3.0;
    assert!(
        last < first - 0.3,
        "the loss falls on the sample text: {losses:?}"
    );

    let file = trainer.save_pretrained(&out).expect("save");
    assert_eq!(file, out.join("model.safetensors"));
    assert_eq!(
        tensor_names(&file),
        tensor_names(&tiny_llama().join("model.safetensors")),
        "the original tensor names and dtypes"
    );
    for copied in [
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        assert!(out.join(copied).exists(), "{copied} copied");
    }
    let trained = probe_logits(&trainer.model().valid());
    let reloaded = probe_logits(&reload(&out));
    assert!(max_diff(&trained, &reloaded) < 1e-5, "reloads as trained");
    assert!(
        max_diff(&before, &trained) > 1e-2,
        "training changed the weights"
    );
}

#[test]
fn two_stages_write_shards_and_an_index_that_reload_as_one_model() {
    let out = tempdir("pipeline");
    let single = {
        let mut trainer = Trainer::new(config(3), Device::flex().autodiff()).expect("trainer");
        trainer.use_text(tiny_llama_text(SEQUENCE, 5));
        while !trainer.finished() {
            trainer.train_step().expect("step");
        }
        probe_logits(&trainer.model().valid())
    };
    let (listeners, peers) = Peers::loopback(2).expect("loopback sockets");
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(k, listener)| {
            let k = k as u32;
            let mut config = config(3);
            config.layout = StageLayout {
                layers: if k == 0 { 0..2 } else { 2..4 },
                first: k == 0,
                last: k == 1,
            };
            config.stage = k;
            config.stages = 2;
            let (peers, out) = (peers.clone(), out.clone());
            std::thread::spawn(move || {
                let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
                trainer.use_text(tiny_llama_text(SEQUENCE, 5));
                let me = Hello {
                    job: "j".into(),
                    namespace: "ns".into(),
                    attempt: 1,
                    stage: k,
                    stages: 2,
                    resume_step: 0,
                };
                let mut links = establish(
                    &me,
                    &LinkKey::from_bytes([7; 32]),
                    (k > 0).then_some(listener),
                    &peers,
                    Duration::from_secs(30),
                    Duration::from_secs(60),
                )
                .expect("links");
                while !trainer.finished() {
                    trainer
                        .train_step_with(&mut links, &mut Single)
                        .expect("step");
                }
                trainer.save_pretrained(&out).expect("save shard")
            })
        })
        .collect();
    let shards: Vec<PathBuf> = handles
        .into_iter()
        .map(|h| h.join().expect("stage"))
        .collect();
    assert_eq!(
        shards,
        vec![
            out.join("model-00001-of-00002.safetensors"),
            out.join("model-00002-of-00002.safetensors")
        ]
    );
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(out.join("model.safetensors.index.json")).expect("index"),
    )
    .expect("JSON");
    let map = index["weight_map"].as_object().expect("weight_map");
    assert_eq!(
        map["model.embed_tokens.weight"],
        "model-00001-of-00002.safetensors"
    );
    assert_eq!(
        map["model.layers.3.mlp.down_proj.weight"],
        "model-00002-of-00002.safetensors"
    );
    assert_eq!(map["model.norm.weight"], "model-00002-of-00002.safetensors");
    let mut all: Vec<_> = shards.iter().flat_map(|s| tensor_names(s)).collect();
    all.sort();
    assert_eq!(
        all,
        tensor_names(&tiny_llama().join("model.safetensors")),
        "every tensor once (the tied head's copy is not written twice)"
    );
    // Pipeline training equals one worker's, so the reloaded model does too.
    assert!(max_diff(&probe_logits(&reload(&out)), &single) < 1e-3);
}

/// The architectures beyond Llama's blocks, fine-tuned whole for a few
/// steps (the synthetic task: these fixtures have no tokenizer) and written
/// out: the output has the source's tensor names and dtypes and reloads
/// with the trained logits. With `HEADROOM_HF_PYTHON` naming a Python that
/// has transformers (`fixtures/llama/generate.py` says how to make one), the
/// output is also loaded by transformers (`reload.py`) and must give the
/// worker's logits; CI has no torch, so there it is skipped.
#[test]
fn other_families_fine_tune_and_reload_in_transformers() {
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama");
    for variant in [
        "qwen3-gqa-tied",
        "phi3-gqa-longrope-tied",
        "gemma3-gqa-tied",
        // Its final logits are soft-capped: the chunked loss caps and
        // differentiates the cap.
        "gemma2-softcap",
    ] {
        let source = fixtures.join(variant);
        let expected: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(source.join("expected.json")).expect("expected.json"),
        )
        .expect("JSON");
        let ids: Vec<Vec<i64>> =
            serde_json::from_value(expected["input_ids"].clone()).expect("input_ids");
        let (batch, seq) = (ids.len(), ids[0].len());
        let logits_of = |model: &TransformerLm| -> Vec<f32> {
            let tokens = Tensor::<2, Int>::from_data(
                TensorData::new(ids.concat(), [batch, seq]),
                &Device::flex(),
            );
            model.forward(tokens).into_data().iter::<f32>().collect()
        };
        let checkpoint = HfCheckpoint::open(&source, seq as u32).expect("fixture");
        let config = TrainConfig::single_stage(
            checkpoint.shape,
            Settings {
                micro_batch: 2,
                ..Settings::default()
            },
            3,
            1e-2,
            3,
        )
        .with_pretrained(&source);
        let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
        let before = logits_of(&trainer.model().valid());
        while !trainer.finished() {
            trainer.train_step().expect("step");
        }
        let trained = logits_of(&trainer.model().valid());
        assert!(max_diff(&before, &trained) > 1e-2, "{variant}: trained");

        let out = tempdir(variant);
        let file = trainer.save_pretrained(&out).expect("save");
        assert_eq!(
            tensor_names(&file),
            tensor_names(&source.join("model.safetensors")),
            "{variant}: the source's tensor names and dtypes"
        );
        let written = HfCheckpoint::open(&out, seq as u32).expect("the output is a checkpoint");
        let shape = LmShape::Llama(written.shape.clone());
        let layout = StageLayout::whole(&shape);
        let mut reloaded = TransformerLm::new(&shape, &layout, 0, &Device::flex());
        written.load_stage(&mut reloaded, &layout).expect("reload");
        assert!(
            max_diff(&logits_of(&reloaded), &trained) < 1e-5,
            "{variant}: reloads as trained"
        );

        if let Ok(python) = std::env::var("HEADROOM_HF_PYTHON") {
            let run = std::process::Command::new(python)
                .arg(fixtures.join("reload.py"))
                .arg(&out)
                .arg(source.join("expected.json"))
                .output()
                .expect("run reload.py");
            assert!(
                run.status.success(),
                "{variant}: reload.py: {}",
                String::from_utf8_lossy(&run.stderr)
            );
            let theirs: serde_json::Value =
                serde_json::from_slice(&run.stdout).expect("reload.py prints JSON");
            let theirs: Vec<Vec<Vec<f32>>> =
                serde_json::from_value(theirs["logits"].clone()).expect("logits");
            let worst = max_diff(&theirs.concat().concat(), &trained);
            // Printed for the fixture README (`--nocapture`).
            eprintln!("{variant}: transformers on the output: max |logit - worker| = {worst:.2e}");
            assert!(worst < 1e-4, "{variant}: transformers gives {worst} away");
        }
        let _ = std::fs::remove_dir_all(&out);
    }
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "headroom-llama-training-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}
