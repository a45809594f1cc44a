//! A checkpoint's shape is held to the bounds of `spec.model.transformer`
//! before it is planned, and planning any shape within them stays small
//! and quick whatever its layer count.

mod common;
use std::time::{Duration, Instant};

use common::*;
use headroom_planner::limits;
use headroom_planner::*;
use proptest::prelude::*;

/// A small Llama config.json with `key` set to `value`.
fn config_with(key: &str, value: u64) -> String {
    let mut v: serde_json::Value = serde_json::from_str(
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":128,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
            "vocab_size":256,"tie_word_embeddings":false}"#,
    )
    .expect("JSON");
    v[key] = value.into();
    v.to_string()
}

#[test]
fn config_json_beyond_the_crd_bounds_is_refused_naming_the_key() {
    let cases = [
        ("num_hidden_layers", 40_000_000, "exceeds 1024"),
        ("hidden_size", 1 << 20, "exceeds 65536"),
        ("vocab_size", 100_000_000, "exceeds 4194304"),
        ("num_attention_heads", 4096, "exceeds 1024"),
        ("num_key_value_heads", 4096, "exceeds 1024"),
        ("intermediate_size", 4_000_000_000, "exceeds 1048576"),
        ("head_dim", 1 << 20, "exceeds 65536"),
        ("hidden_size", 4, "is below 8"),
    ];
    for (key, value, says) in cases {
        let e = LlamaShape::from_hf_config(&config_with(key, value), 64)
            .expect_err(&format!("{key} {value} is refused"));
        assert_eq!(e.key, key, "{e}");
        let text = e.to_string();
        assert!(
            text.starts_with(&format!("config.json: {key}: {value} {says}"))
                && text.contains("spec.model.transformer"),
            "{text}"
        );
    }
    let e = LlamaShape::from_hf_config(&config_with("num_hidden_layers", 2), 2_000_000)
        .expect_err("a sequence beyond the bound");
    assert_eq!(e.key, "(sequence length)");
    // At the bounds, read.
    let at = LlamaShape::from_hf_config(&config_with("num_hidden_layers", 1024), 64)
        .expect("1024 layers");
    assert_eq!(at.layers, limits::LAYERS.max);
    assert_eq!(at.check_bounds(), Ok(()));
}

#[test]
fn a_reported_shape_beyond_the_bounds_is_refused_naming_the_key() {
    let ok = LlamaShape::from_hf_config(&config_with("num_hidden_layers", 2), 64).expect("shape");
    type Change = fn(&mut LlamaShape);
    let cases: [(&str, Change); 7] = [
        ("num_hidden_layers", |s| s.layers = 40_000_000),
        ("hidden_size", |s| s.hidden = u32::MAX),
        ("intermediate_size", |s| s.intermediate = u32::MAX),
        ("num_attention_heads", |s| s.attention_heads = 0),
        ("head_dim", |s| s.head_dim = 1 << 20),
        ("vocab_size", |s| s.vocabulary = u32::MAX),
        ("num_key_value_heads", |s| s.key_value_heads = 3),
    ];
    for (key, change) in cases {
        let mut shape = ok.clone();
        change(&mut shape);
        let e = shape.check_bounds().expect_err(key);
        assert_eq!(e.key, key, "{e}");
    }
}

/// A LoRA job of a Llama shape anywhere within the bounds.
fn arb_extreme_llama() -> impl Strategy<Value = LlamaShape> {
    (
        prop_oneof![Just(limits::LAYERS.max), 1u32..=limits::LAYERS.max],
        prop_oneof![
            Just(limits::HIDDEN.max),
            limits::HIDDEN.min..=limits::HIDDEN.max
        ],
        prop_oneof![Just(limits::HEADS.max), 1u32..=64],
        prop_oneof![
            Just(limits::VOCABULARY.max),
            limits::VOCABULARY.min..=limits::VOCABULARY.max
        ],
        prop_oneof![
            Just(limits::FEED_FORWARD.max),
            1u32..=limits::FEED_FORWARD.max
        ],
        prop_oneof![Just(131_072u32), 1u32..=131_072],
    )
        .prop_map(|(layers, hidden, heads, vocab, intermediate, seq)| {
            let heads = heads.min(hidden);
            let hidden = hidden / heads * heads;
            let mut v: serde_json::Value =
                serde_json::from_str(&config_with("num_hidden_layers", u64::from(layers)))
                    .expect("JSON");
            v["hidden_size"] = hidden.into();
            v["num_attention_heads"] = heads.into();
            v["num_key_value_heads"] = heads.into();
            v["vocab_size"] = vocab.into();
            v["intermediate_size"] = intermediate.into();
            LlamaShape::from_hf_config(&v.to_string(), seq).expect("within the bounds")
        })
}

fn lora_job(shape: LlamaShape) -> JobRequest {
    JobRequest {
        adapters: Some(LoraConfig {
            rank: 8,
            alpha: 16.0,
            dropout: 0.0,
            target_modules: TargetModule::BLOCK_LINEARS.to_vec(),
            block_size: 64,
        }),
        allowed_rungs: RetryRung::ALL.to_vec(),
        ..gpu_job(ModelShape::Llama(shape), 8, 8)
    }
}

fn eight_gpus() -> Inventory {
    Inventory::from_nodes(&[gpu_node("node-0", "NVIDIA-H100-80GB-HBM3", 81_559, 8)]).on_one_node()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(16))]

    /// Planning a LoRA job of any shape within the bounds on eight GPUs
    /// (the most the operator plans for) ends, with a plan or a refusal
    /// and no overflow: the largest shapes took about a second in a debug
    /// build, and the bound leaves room for a loaded machine.
    #[test]
    fn any_shape_within_the_bounds_is_planned_in_bounded_time(shape in arb_extreme_llama()) {
        let started = Instant::now();
        let _ = plan(&lora_job(shape), &eight_gpus());
        let took = started.elapsed();
        prop_assert!(took < Duration::from_secs(20), "planning took {took:?}");
    }
}
