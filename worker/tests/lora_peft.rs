//! The worker's LoRA adapters against Hugging Face PEFT.
//!
//! `tests/fixtures/peft/<case>/` holds an adapter PEFT saved for one of the
//! tiny transformers checkpoints in `tests/fixtures/llama/` (r 4, alpha 8,
//! random nonzero A and B) and the logits PEFT computed with it
//! (`generate.py`, run once; see its README). Each adapter is read into the
//! worker's burn model (adapters attached with burn's `apply_lora`), whole and
//! split into two pipeline stages, and must give PEFT's logits; the adapter
//! the worker writes back must have PEFT's tensor names, shapes and values.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use burn::tensor::{Device, Int, Tensor, TensorData};
use headroom_planner::BaseFormat;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm, lora, peft};

/// Absolute tolerance on a logit (the brief's; the llama fixtures agree to 5.3e-6).
const TOLERANCE: f32 = 1e-4;

const CASES: [(&str, &str); 8] = [
    ("llama-mha-untied-qv", "llama-mha-untied"),
    ("llama-mha-untied-all", "llama-mha-untied"),
    ("llama-gqa-tied-qv", "llama-gqa-tied"),
    ("qwen2-gqa-bias-qv", "qwen2-gqa-bias"),
    ("qwen3-gqa-tied-blocks", "qwen3-gqa-tied"),
    // Phi-3's fused qkv_proj and gate_up_proj, o_proj, down_proj, lm_head.
    ("phi3-mha-longrope-short-all", "phi3-mha-longrope-short"),
    // Gemma: Llama's names; PEFT's default q_proj, v_proj on Gemma 3, every
    // linear and lm_head on Gemma 2 (soft-capped logits).
    ("gemma3-gqa-tied-qv", "gemma3-gqa-tied"),
    ("gemma2-softcap-all", "gemma2-softcap"),
];

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

struct Expected {
    input_ids: Vec<i64>,
    batch: usize,
    seq: usize,
    logits: Vec<f32>,
}

fn expected(case: &str) -> Expected {
    let path = fixtures().join("peft").join(case).join("expected.json");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("JSON");
    let ids: Vec<Vec<i64>> = serde_json::from_value(v["input_ids"].clone()).expect("input_ids");
    let logits: Vec<Vec<Vec<f32>>> = serde_json::from_value(v["logits"].clone()).expect("logits");
    Expected {
        batch: ids.len(),
        seq: ids[0].len(),
        input_ids: ids.concat(),
        logits: logits.concat().concat(),
    }
}

fn max_diff(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs())
        .fold(0.0, f32::max)
}

/// The base of `variant` for `layout`, loaded, with the adapters of PEFT case `case` attached
/// (and, when `read`, PEFT's factors read in).
fn adapted(
    case: &str,
    variant: &str,
    seq: usize,
    layout: &StageLayout,
    adapter: Option<&Path>,
) -> TransformerLm {
    let device = Device::flex();
    let checkpoint =
        HfCheckpoint::open(&fixtures().join("llama").join(variant), seq as u32).expect("base");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let mut model = TransformerLm::new(&shape, layout, 0, &device);
    checkpoint.load_stage(&mut model, layout).expect("load");
    let config = peft::read_config(&fixtures().join("peft").join(case)).expect("config");
    let model =
        lora::attach(model, &config, BaseFormat::Dense, layout, 0, &device).expect("attach");
    match adapter {
        Some(dir) => peft::load_stage(model, layout, &config, dir).expect("read adapter"),
        None => model,
    }
}

fn tokens(e: &Expected) -> Tensor<2, Int> {
    Tensor::from_data(
        TensorData::new(e.input_ids.clone(), [e.batch, e.seq]),
        &Device::flex(),
    )
}

fn values(t: Tensor<2>) -> Vec<f32> {
    t.into_data().iter::<f32>().collect()
}

fn whole(variant: &str, seq: usize) -> StageLayout {
    let checkpoint =
        HfCheckpoint::open(&fixtures().join("llama").join(variant), seq as u32).expect("base");
    StageLayout::whole(&LmShape::Llama(checkpoint.shape))
}

/// name → (shape, f32 values) of a safetensors file.
fn tensors(file: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(file).expect("adapter file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    st.tensors()
        .into_iter()
        .map(|(name, view)| {
            assert_eq!(view.dtype(), safetensors::Dtype::F32, "{name}");
            let values = view
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            (name, (view.shape().to_vec(), values))
        })
        .collect()
}

fn tempdir(name: &str) -> PathBuf {
    let dir =
        std::env::temp_dir().join(format!("headroom-lora-peft-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn a_peft_adapter_read_into_the_worker_gives_pefts_logits() {
    for (case, variant) in CASES {
        let e = expected(case);
        let layout = whole(variant, e.seq);
        let dir = fixtures().join("peft").join(case);
        let model = adapted(case, variant, e.seq, &layout, Some(&dir));
        let worst = max_diff(&values(model.forward(tokens(&e))), &e.logits);
        // Printed for the fixture README (`--nocapture`).
        eprintln!("{case}: max |logit - PEFT| = {worst:.2e}");
        assert!(worst <= TOLERANCE, "{case}: {worst}");
        // Without the factors read in (B = 0) the logits are far from PEFT's.
        let fresh = adapted(case, variant, e.seq, &layout, None);
        assert!(max_diff(&values(fresh.forward(tokens(&e))), &e.logits) > 1.0);
    }
}

#[test]
fn two_stages_read_their_layers_of_a_peft_adapter() {
    for (case, variant) in CASES {
        let e = expected(case);
        let dir = fixtures().join("peft").join(case);
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
        let a = adapted(case, variant, e.seq, &first, Some(&dir));
        let b = adapted(case, variant, e.seq, &last, Some(&dir));
        let logits = b.logits(b.blocks_forward(a.blocks_forward(a.embed(tokens(&e)))));
        let worst = max_diff(&values(logits), &e.logits);
        assert!(worst <= TOLERANCE, "{case} in two stages: {worst}");
    }
}

#[test]
fn the_adapter_the_worker_writes_is_pefts() {
    for (case, variant) in CASES {
        let e = expected(case);
        let layout = whole(variant, e.seq);
        let dir = fixtures().join("peft").join(case);
        let config = peft::read_config(&dir).expect("config");
        let model = adapted(case, variant, e.seq, &layout, Some(&dir));
        let out = tempdir(case);
        // A model from the hub: the adapter names the repo and revision,
        // so PEFT fetches the same base wherever the adapter goes.
        let base = peft::BaseModel {
            name_or_path: "headroom-tests/tiny-llama".into(),
            revision: Some("v1".into()),
        };
        let file =
            peft::save_stage(&model, &layout, &config, 0, 1, &out, &base).expect("write adapter");
        assert_eq!(file, out.join(peft::ADAPTER_FILE));
        assert_eq!(
            tensors(&file),
            tensors(&dir.join(peft::ADAPTER_FILE)),
            "{case}: PEFT's names, shapes and values"
        );
        let written = peft::read_config(&out).expect("written config");
        assert_eq!(written, config, "{case}: adapter_config.json");
        let json: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(out.join(peft::CONFIG_FILE)).expect("config"),
        )
        .expect("JSON");
        for (key, value) in [
            ("peft_type", serde_json::json!("LORA")),
            ("task_type", serde_json::json!("CAUSAL_LM")),
            ("bias", serde_json::json!("none")),
            ("fan_in_fan_out", serde_json::json!(false)),
            (
                "base_model_name_or_path",
                serde_json::json!("headroom-tests/tiny-llama"),
            ),
            ("revision", serde_json::json!("v1")),
        ] {
            assert_eq!(json[key], value, "{case}: {key}");
        }
        // Read back: the same logits.
        let reread = adapted(case, variant, e.seq, &layout, Some(&out));
        assert_eq!(
            values(reread.forward(tokens(&e))),
            values(model.forward(tokens(&e))),
            "{case}: round trip"
        );
        let _ = std::fs::remove_dir_all(&out);
    }
}

#[test]
fn two_stages_write_one_adapter() {
    let (case, variant) = ("llama-mha-untied-all", "llama-mha-untied");
    let e = expected(case);
    let dir = fixtures().join("peft").join(case);
    let config = peft::read_config(&dir).expect("config");
    let out = tempdir("two-stages");
    let layouts = [
        StageLayout {
            layers: 0..1,
            first: true,
            last: false,
        },
        StageLayout {
            layers: 1..2,
            first: false,
            last: true,
        },
    ];
    // The last stage writes first: whichever finishes last completes the adapter.
    for k in [1u32, 0] {
        let layout = &layouts[k as usize];
        let model = adapted(case, variant, e.seq, layout, Some(&dir));
        let base = peft::BaseModel {
            name_or_path: "base".into(),
            revision: None,
        };
        peft::save_stage(&model, layout, &config, k, 2, &out, &base).expect("write part");
        assert_eq!(
            out.join(peft::ADAPTER_FILE).exists(),
            k == 0,
            "complete only once both stages wrote"
        );
    }
    assert_eq!(
        tensors(&out.join(peft::ADAPTER_FILE)),
        tensors(&dir.join(peft::ADAPTER_FILE))
    );
    let _ = std::fs::remove_dir_all(&out);
}
