//! Loading a QLoRA stage block by block (`lora::load_quantized`, each block
//! quantized as soon as it is read) gives exactly the stage that loading it
//! whole and then attaching the adapters gives: the same parameters (ids,
//! dtypes, stored bytes, quantized values included; the adapter factors,
//! whose ids are fresh on every build, by value) and the same logits, on every fixture and pipeline split; and a
//! checkpoint that lacks a block's tensor is still refused naming it.

use std::path::{Path, PathBuf};

use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};
use headroom_planner::{BaseFormat, LoraConfig, TargetModule};
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm, lora};

const SEQUENCE: u32 = 12;

fn fixture(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama")
        .join(variant)
}

fn adapters(targets: &[TargetModule]) -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: targets.to_vec(),
        block_size: 8,
    }
}

/// Every float parameter: id, dtype and stored bytes.
fn parameters<M: Module>(module: &M) -> Vec<(ParamId, DType, Vec<u8>)> {
    struct All(Vec<(ParamId, DType, Vec<u8>)>);
    impl ModuleVisitor for All {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let t = param.base();
            let dtype = t.dtype();
            self.0
                .push((param.id, dtype, t.into_data().bytes().to_vec()));
        }
    }
    let mut all = All(Vec::new());
    module.visit(&mut all);
    all.0
}

fn logits(model: &TransformerLm, first: bool, device: &Device) -> Vec<f32> {
    let ids: Vec<i64> = (0..2 * SEQUENCE as i64).map(|i| (7 * i + 3) % 96).collect();
    let tokens = Tensor::<2, Int>::from_data(TensorData::new(ids, [2, SEQUENCE as usize]), device);
    let x = if first {
        model.embed(tokens)
    } else {
        // A later stage's input: any fixed hidden state.
        let h = match &model.blocks[0] {
            headroom_worker::model::Block::Llama(b) => b.input_layernorm.gamma.val().dims()[0],
            headroom_worker::model::Block::Gpt(_) => unreachable!(),
        };
        Tensor::<3>::from_data(
            TensorData::new(
                (0..2 * SEQUENCE as usize * h)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 100.0)
                    .collect::<Vec<f32>>(),
                [2, SEQUENCE as usize, h],
            ),
            device,
        )
    };
    let x = model.blocks_forward(x);
    let out = if model.is_last() {
        model.logits(x)
    } else {
        x.flatten::<2>(0, 1)
    };
    out.into_data().iter::<f32>().collect()
}

/// Builds the stage twice with the same seed: loaded whole then adapted,
/// and loaded block by block; both must be the same model.
fn both_ways(
    checkpoint: &HfCheckpoint,
    layout: &StageLayout,
    config: &LoraConfig,
    format: BaseFormat,
    device: &Device,
) -> (TransformerLm, TransformerLm) {
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let seed = 5;
    // ParamIds are drawn when the model is built: build one, clone it lazily
    // (nothing is initialised yet) so both start from the same ids.
    let built = TransformerLm::new(&shape, layout, seed, device);
    let mut whole = built.clone();
    checkpoint.load_stage(&mut whole, layout).expect("load");
    let whole = lora::attach(whole, config, format, layout, seed, device).expect("attach");
    let by_block = lora::load_quantized(checkpoint, built, config, format, layout, seed, device)
        .expect("load block by block");
    (whole, by_block)
}

#[test]
fn block_by_block_loading_gives_the_same_stage() {
    let device = Device::flex();
    for variant in [
        "llama-mha-untied",
        "llama-gqa-tied",
        "mistral-gqa-bf16",
        "qwen2-gqa-bias",
        "qwen3-gqa-tied",
        "phi3-gqa-longrope-tied",
        "gemma3-gqa-tied",
        "gemma2-softcap",
    ] {
        let checkpoint = HfCheckpoint::open(&fixture(variant), SEQUENCE).expect("fixture");
        let tied = checkpoint.shape.tied_embeddings;
        let targets: Vec<TargetModule> = checkpoint
            .shape
            .architecture
            .lora_targets()
            .into_iter()
            .filter(|m| !(tied && *m == TargetModule::LmHead))
            .collect();
        let config = adapters(&targets);
        let layers = checkpoint.shape.layers;
        let splits = [
            StageLayout {
                layers: 0..layers,
                first: true,
                last: true,
            },
            StageLayout {
                layers: 0..1,
                first: true,
                last: false,
            },
            StageLayout {
                layers: 1..layers,
                first: false,
                last: true,
            },
        ];
        for format in [BaseFormat::Int8, BaseFormat::Int4, BaseFormat::Dense] {
            for layout in &splits {
                let what = format!("{variant} {format} layers {:?}", layout.layers);
                let (whole, by_block) = both_ways(&checkpoint, layout, &config, format, &device);
                let (a, b) = (parameters(&whole), parameters(&by_block));
                assert_eq!(a.len(), b.len(), "{what}: parameter count");
                // The adapter factors get fresh ids; every base parameter keeps the built model's.
                let (fa, fb) = (lora::adapter_ids(&whole), lora::adapter_ids(&by_block));
                assert_eq!(fa.len(), fb.len(), "{what}: adapter factors");
                for (x, y) in a.iter().zip(&b) {
                    assert_eq!(
                        fa.contains(&x.0),
                        fb.contains(&y.0),
                        "{what}: parameter order"
                    );
                    if !fa.contains(&x.0) {
                        assert_eq!(x.0, y.0, "{what}: parameter ids in order");
                    }
                    assert_eq!(x.1, y.1, "{what}: dtype of {}", x.0);
                    assert_eq!(x.2, y.2, "{what}: stored bytes of {}", x.0);
                }
                let quantized = a.iter().filter(|p| matches!(p.1, DType::QFloat(_))).count();
                let want = if format.is_quantized() {
                    // Seven linears a block, four when fused (Phi-3).
                    checkpoint.shape.architecture.block_linears().len() * layout.layers.len()
                } else {
                    0
                };
                assert_eq!(quantized, want, "{what}: the block linears are quantized");
                assert_eq!(
                    logits(&whole, layout.first, &device),
                    logits(&by_block, layout.first, &device),
                    "{what}: outputs"
                );
            }
        }
    }
}

#[test]
fn refusals_come_before_the_load() {
    let device = Device::flex();
    let checkpoint = HfCheckpoint::open(&fixture("llama-gqa-tied"), SEQUENCE).expect("fixture");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let layout = StageLayout::whole(&shape);
    let build = || TransformerLm::new(&shape, &layout, 1, &device);
    let err = lora::load_quantized(
        &checkpoint,
        build(),
        &adapters(&[TargetModule::LmHead]),
        BaseFormat::Int8,
        &layout,
        1,
        &device,
    )
    .expect_err("tied lm_head")
    .to_string();
    assert!(err.starts_with("training.lora.targetModules: "), "{err}");
    let mut odd = adapters(&[TargetModule::QProj]);
    odd.block_size = 7;
    let err = lora::load_quantized(
        &checkpoint,
        build(),
        &odd,
        BaseFormat::Int4,
        &layout,
        1,
        &device,
    )
    .expect_err("block size")
    .to_string();
    assert!(err.starts_with("training.lora.blockSize: 7 "), "{err}");
}

#[test]
fn a_block_of_another_shape_is_refused_naming_the_tensor() {
    let device = Device::flex();
    let checkpoint = HfCheckpoint::open(&fixture("llama-gqa-tied"), SEQUENCE).expect("fixture");
    let LmShape::Llama(mut wrong) = LmShape::Llama(checkpoint.shape.clone()) else {
        unreachable!()
    };
    // Claim MHA: k_proj would need more outputs than the file has.
    wrong.key_value_heads = wrong.attention_heads;
    let wrong = LmShape::Llama(wrong);
    let layout = StageLayout::whole(&wrong);
    let err = lora::load_quantized(
        &checkpoint,
        TransformerLm::new(&wrong, &layout, 0, &device),
        &adapters(&[TargetModule::QProj]),
        BaseFormat::Int8,
        &layout,
        0,
        &device,
    )
    .expect_err("shape mismatch")
    .to_string();
    assert!(err.contains("k_proj"), "{err}");
}
