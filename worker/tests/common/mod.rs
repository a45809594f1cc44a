//! Shared fixtures: tiny configurations that train in seconds in debug builds.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use burn::tensor::{Device, FloatDType};

use headroom_planner::{Settings, TransformerShape};
use headroom_worker::data::TextSamples;
use headroom_worker::text::{
    Format, Tokenized, load_tokenizer, pack, pack_documents, read_documents,
};
use headroom_worker::train::TrainConfig;

pub fn tiny_shape() -> TransformerShape {
    TransformerShape {
        layers: 2,
        hidden: 32,
        heads: 4,
        sequence_length: 16,
        vocabulary: 24,
        feed_forward: None,
        tied_embeddings: true,
    }
}

pub fn tiny_config(micro_batch: u32, accumulation: u32, checkpointing: bool) -> TrainConfig {
    let shape = tiny_shape();
    let mut config = TrainConfig::single_stage(
        shape,
        Settings {
            micro_batch,
            gradient_accumulation: accumulation,
            activation_checkpointing: checkpointing,
            ..Settings::default()
        },
        40,
        1e-2,
        11,
    );
    config.checkpoint_every_steps = 10;
    config
}

/// The tiny Llama checkpoint transformers wrote (`tests/fixtures/llama/tiny-llama`).
pub fn tiny_llama() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/tiny-llama")
}

/// The sample text, tokenized with tiny-llama's tokenizer and packed into
/// `sequence`-token samples, shuffled by `seed`.
pub fn tiny_llama_text(sequence: u32, seed: u64) -> TextSamples {
    let tokenizer = load_tokenizer(&tiny_llama().join("tokenizer.json")).expect("tokenizer");
    let eos = tokenizer.token_to_id("</s>").expect("</s>");
    let docs = read_documents(
        &Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../samples/data/declaration-of-independence.jsonl"),
        &Format::Jsonl {
            field: "text".into(),
        },
    )
    .expect("documents");
    let packed = pack(&tokenizer, &docs, eos, sequence as usize).expect("packed");
    TextSamples::new(packed.samples, seed)
}

/// Progression samples whose targets are masked as a chat's prompts are:
/// sample i trains on its targets from the (i mod 5)/4-th on, so the
/// micro-batches of a step hold different numbers of trained targets and
/// one sample in five none at all.
pub fn masked_text(config: &TrainConfig) -> TextSamples {
    let task = headroom_worker::data::ProgressionTask {
        seed: 5,
        vocabulary: config.shape.vocabulary(),
        sequence_length: config.shape.sequence_length(),
    };
    let s = config.shape.sequence_length() as usize;
    let samples = (0..16)
        .map(|i| task.sample(i).iter().map(|&t| t as u32).collect())
        .collect();
    let masks = (0..16)
        .map(|i| (0..s).map(|j| j >= (i % 5) * s / 4).collect())
        .collect();
    TextSamples::with_masks(samples, Some(masks), config.seed)
}

/// Progression examples of 2 to `sequence_length + 3` tokens (a few
/// longer than a sample, so truncated), a fifth with an untrained prompt,
/// packed by documents: samples of one to several documents and padding.
pub fn documents_text(config: &TrainConfig) -> TextSamples {
    let task = headroom_worker::data::ProgressionTask {
        seed: 9,
        vocabulary: config.shape.vocabulary(),
        sequence_length: config.shape.sequence_length() + 2,
    };
    let s = config.shape.sequence_length() as usize;
    let examples: Vec<Tokenized> = (0..40u64)
        .map(|i| {
            let n = 2 + (i as usize * 7) % (s + 2);
            let ids: Vec<u32> = task.sample(i)[..n].iter().map(|&t| t as u32).collect();
            let prompt = if i % 5 == 0 { n / 2 } else { 0 };
            Tokenized {
                trained: (0..n).map(|j| j >= prompt).collect(),
                ids,
            }
        })
        .collect();
    let packed = pack_documents(&examples, 0, s).expect("packed");
    assert!(packed.longer_than_sample > 0 && packed.samples.len() >= 8);
    TextSamples::packed(packed, config.seed)
}

/// Flex with bf16 as its default float dtype, configured once per process:
/// a test binary that calls it trains in bf16 throughout (burn sets the
/// default dtype once, before the first tensor).
pub fn bf16() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            let mut device = Device::flex();
            device
                .configure(FloatDType::BF16)
                .expect("bf16 set before any tensor of this process");
            device
        })
        .clone()
}
