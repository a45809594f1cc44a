//! The worker's Llama-family models against Hugging Face transformers.
//!
//! `tests/fixtures/llama/<variant>/` holds a tiny random checkpoint written
//! by transformers' `save_pretrained` and the logits transformers computed
//! for fixed input ids (`generate.py`, run once; versions in its README).
//! Each variant is loaded here from its safetensors, whole and split into
//! two pipeline stages, and must give the same logits.

use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm};

/// Absolute tolerance on a logit: the largest difference measured is 5.3e-6
/// (docs/benchmarks.md); ten times that leaves room for another CPU.
const TOLERANCE: f32 = 5e-5;

const VARIANTS: [&str; 9] = [
    "llama-gqa-tied",
    "llama-mha-untied",
    "qwen2-gqa-bias",
    "mistral-gqa-bf16",
    // head_dim 16 on 4 heads of hidden 32, and per-head q/k norms.
    "qwen3-gqa-tied",
    // Fused qkv_proj and gate_up_proj, LongRoPE: 6 of 8 values rotated and
    // the long factors (12 positions > 8) ...
    "phi3-gqa-longrope-tied",
    // ... and whole heads with the short factors (12 ≤ 16).
    "phi3-mha-longrope-short",
    // GeGLU, Gemma's norms (four a block, q/k per head), √hidden-scaled
    // embeddings, query_pre_attn_scalar, a 4-token sliding layer with its
    // own RoPE base and a global one with linear scaling.
    "gemma3-gqa-tied",
    // Soft-capped attention scores and final logits, a 5-token window.
    "gemma2-softcap",
];

fn fixture(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama")
        .join(variant)
}

struct Expected {
    input_ids: Vec<i64>,
    batch: usize,
    seq: usize,
    logits: Vec<f32>,
}

fn expected(variant: &str) -> Expected {
    let text = std::fs::read_to_string(fixture(variant).join("expected.json")).expect("fixture");
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let ids: Vec<Vec<i64>> = serde_json::from_value(v["input_ids"].clone()).expect("input_ids");
    let logits: Vec<Vec<Vec<f32>>> = serde_json::from_value(v["logits"].clone()).expect("logits");
    Expected {
        batch: ids.len(),
        seq: ids[0].len(),
        input_ids: ids.concat(),
        logits: logits.concat().concat(),
    }
}

fn assert_close(variant: &str, what: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{variant} {what}: logit count");
    let (worst, at) = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .enumerate()
        .fold(
            (0.0f32, 0),
            |(m, i), (j, d)| if d > m { (d, j) } else { (m, i) },
        );
    // Printed for docs/benchmarks.md (`--nocapture`).
    eprintln!("{variant} {what}: max |logit - transformers| = {worst:.2e}");
    assert!(
        worst <= TOLERANCE,
        "{variant} {what}: logit {at} differs by {worst} (got {}, transformers {})",
        got[at],
        want[at]
    );
}

fn open(variant: &str, seq: usize) -> (HfCheckpoint, LmShape) {
    let checkpoint = HfCheckpoint::open(&fixture(variant), seq as u32).expect("checkpoint");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    (checkpoint, shape)
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

#[test]
fn logits_equal_transformers() {
    let device = Device::flex();
    for variant in VARIANTS {
        let e = expected(variant);
        let (checkpoint, shape) = open(variant, e.seq);
        let layout = StageLayout::whole(&shape);
        let mut model = TransformerLm::new(&shape, &layout, 0, &device);
        checkpoint
            .load_stage(&mut model, &layout)
            .unwrap_or_else(|err| panic!("{variant}: {err}"));
        assert_eq!(
            model.num_params() as u64,
            shape.total_params(),
            "{variant}: the planner's parameter count"
        );
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(e.input_ids.clone(), [e.batch, e.seq]),
            &device,
        );
        assert_close(variant, "whole", &values(model.forward(tokens)), &e.logits);
    }
}

#[test]
fn two_stages_loaded_separately_give_the_same_logits() {
    let device = Device::flex();
    for variant in VARIANTS {
        let e = expected(variant);
        let (checkpoint, shape) = open(variant, e.seq);
        let first = StageLayout {
            layers: 0..1,
            first: true,
            last: false,
        };
        let last = StageLayout {
            layers: 1..2,
            first: false,
            last: true,
        };
        let mut a = TransformerLm::new(&shape, &first, 0, &device);
        let mut b = TransformerLm::new(&shape, &last, 0, &device);
        checkpoint.load_stage(&mut a, &first).expect("first stage");
        checkpoint.load_stage(&mut b, &last).expect("last stage");
        // Each stage holds its own layers only (plus the tied head's embedding copy).
        let per_layer = match &shape {
            LmShape::Llama(l) => l.params_per_layer(),
            LmShape::Gpt(_) => unreachable!(),
        };
        let LmShape::Llama(l) = &shape else {
            unreachable!()
        };
        let tied_copy = if l.tied_embeddings {
            l.embedding_params()
        } else {
            0
        };
        assert_eq!(a.num_params() as u64, l.embedding_params() + per_layer);
        assert_eq!(
            b.num_params() as u64,
            per_layer + l.head_params() + tied_copy
        );
        let tokens = Tensor::<2, Int>::from_data(
            TensorData::new(e.input_ids.clone(), [e.batch, e.seq]),
            &device,
        );
        let hidden = a.blocks_forward(a.embed(tokens));
        let logits = b.logits(b.blocks_forward(hidden));
        assert_close(variant, "two stages", &values(logits), &e.logits);
    }
}

#[test]
fn a_checkpoint_of_another_shape_is_refused_naming_the_tensor() {
    let device = Device::flex();
    let (checkpoint, shape) = open("llama-gqa-tied", 12);
    // Claim MHA: k_proj would need 32 outputs, the file has 16.
    let LmShape::Llama(mut wrong) = shape else {
        unreachable!()
    };
    wrong.key_value_heads = wrong.attention_heads;
    let wrong = LmShape::Llama(wrong);
    let layout = StageLayout::whole(&wrong);
    let mut model = TransformerLm::new(&wrong, &layout, 0, &device);
    let err = checkpoint
        .load_stage(&mut model, &layout)
        .expect_err("shape mismatch")
        .to_string();
    assert!(err.contains("k_proj"), "{err}");
}
