//! Conversations and prompt/completion rows against transformers and TRL.
//!
//! `tests/fixtures/chat/expected.json` holds, for the public Llama 3,
//! Qwen3, Gemma 3 and Phi-3 chat templates and for plain prompt/completion
//! rows, the token ids and labels TRL's `SFTTrainer` prepares (its
//! defaults, `assistant_only_loss`, `completion_only_loss: false`), and
//! `masked_loss.json` a loss transformers' Llama computes with masked
//! labels (`generate.py`, run once; versions in the README). The worker
//! must give the same ids and the same masks, and the same loss.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor, TensorData};
use headroom_api::TrainOn;
use headroom_worker::chat::Template;
use headroom_worker::data::IGNORED_TARGET;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm};
use headroom_worker::text::{Located, Tokenization, example_of, load_tokenizer};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/chat")
        .join(name)
}

fn json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(name)).expect("fixture");
    serde_json::from_str(&text).expect("JSON")
}

#[test]
fn token_ids_and_labels_equal_trl() {
    let tokenizer = load_tokenizer(&fixture("tokenizer.json")).expect("tokenizer");
    let cases = json("expected.json");
    let cases = cases.as_array().expect("a list of cases");
    let mut masked_kinds = 0;
    for (n, case) in cases.iter().enumerate() {
        let s = |k: &str| case[k].as_str().map(str::to_owned);
        let template = s("template").map(|name| {
            let source = std::fs::read_to_string(fixture(&format!("templates/{name}.jinja")))
                .expect("template");
            Template::new(
                source,
                s("bos").unwrap_or_default(),
                s("eos").unwrap_or_default(),
            )
            .expect("template parses")
        });
        let eos = tokenizer
            .token_to_id(&s("eos").expect("eos"))
            .expect("eos in the vocabulary");
        let train_on: TrainOn = serde_json::from_value(case["train_on"].clone()).expect("trainOn");
        // The row as a JSONL line (keys in the order Python wrote them).
        let row = s("row").expect("row");
        let located = Located {
            example: example_of(&row, "text").expect("a valid row"),
            path: Arc::from(Path::new("expected.json")),
            row: n + 1,
        };
        let how = Tokenization {
            tokenizer: &tokenizer,
            template: template.as_ref(),
            eos,
            train_on,
            model_dir: Path::new("fixture"),
        };
        let got = how
            .tokenize(&located)
            .unwrap_or_else(|e| panic!("case {n} ({:?} {train_on:?}): {e}", s("template")));
        let want_ids: Vec<u32> = serde_json::from_value(case["input_ids"].clone()).expect("ids");
        let want_labels: Vec<i64> = serde_json::from_value(case["labels"].clone()).expect("labels");
        let what = format!("case {n}: {:?} {train_on:?} {}", s("template"), case["row"]);
        assert_eq!(got.ids, want_ids, "{what}: token ids");
        let labels: Vec<i64> = got
            .ids
            .iter()
            .zip(&got.trained)
            .map(|(&id, &on)| if on { i64::from(id) } else { IGNORED_TARGET })
            .collect();
        assert_eq!(labels, want_labels, "{what}: labels");
        masked_kinds += usize::from(labels.contains(&IGNORED_TARGET));
    }
    // The fixture exercises masks, not only whole sequences.
    assert!(
        cases.len() >= 30 && masked_kinds >= 10,
        "{} cases, {masked_kinds} masked",
        cases.len()
    );
}

/// Largest difference from transformers' loss measured here: printed with
/// `--nocapture`; the bound leaves room for another CPU.
const LOSS_TOLERANCE: f64 = 1e-5;

#[test]
fn a_masked_loss_equals_transformers() {
    let expected = json("masked_loss.json");
    let ids: Vec<Vec<i64>> = serde_json::from_value(expected["input_ids"].clone()).expect("ids");
    let labels: Vec<Vec<i64>> = serde_json::from_value(expected["labels"].clone()).expect("labels");
    let want = expected["loss"].as_f64().expect("loss");
    let (batch, seq) = (ids.len(), ids[0].len() - 1);
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/tiny-llama");
    let checkpoint = HfCheckpoint::open(&dir, seq as u32).expect("checkpoint");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let layout = StageLayout::whole(&shape);
    let device = Device::flex();
    let mut model = TransformerLm::new(&shape, &layout, 0, &device);
    checkpoint.load_stage(&mut model, &layout).expect("weights");
    // transformers shifts the labels: position t predicts label t + 1.
    let tokens: Vec<i64> = ids.iter().flat_map(|r| r[..seq].to_vec()).collect();
    let targets: Vec<i64> = labels.iter().flat_map(|r| r[1..].to_vec()).collect();
    let unmasked: Vec<i64> = ids.iter().flat_map(|r| r[1..].to_vec()).collect();
    let tensor =
        |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [batch, seq]), &device);
    let loss = |targets: Vec<i64>| -> f64 {
        let l = model.loss(tensor(tokens.clone()), tensor(targets));
        f64::from(l.into_data().iter::<f32>().next().expect("a value"))
    };
    let got = loss(targets);
    eprintln!(
        "masked loss {got:.7} vs transformers {want:.7}: |diff| {:.2e}",
        (got - want).abs()
    );
    assert!(
        (got - want).abs() <= LOSS_TOLERANCE,
        "masked loss {got} vs transformers {want}"
    );
    let whole = loss(unmasked);
    assert!(
        (whole - want).abs() > 100.0 * LOSS_TOLERANCE,
        "the masks change the loss ({whole} unmasked)"
    );
}
