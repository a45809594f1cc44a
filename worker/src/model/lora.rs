//! LoRA and QLoRA on a loaded stage, through burn's own reparameterisation
//! (`Module::apply_lora` / `apply_qlora`): a targeted weight `W` [d_in, d_out]
//! becomes `W + (alpha / r) · A @ B` with trainable `A` [d_in, r] and `B`
//! [r, d_out] (B starts at 0, so the adapted model starts as the base).
//!
//! What [`attach`] does to a stage, after its base was loaded:
//! * every base parameter is frozen (no gradient, so no optimizer state);
//! * the targeted linears of the stage's blocks, and `lm_head` on the last
//!   stage when targeted, get adapters; each block's factors are drawn from
//!   the run's seed and the block (not the split), so p = 1 and p = 2 start alike;
//! * with a quantized base format (QLoRA) the seven linear weights of each
//!   decoder block are quantized: to NF4 as bitsandbytes does
//!   ([`super::nf4`], kept in the block's `nf4` beside an empty placeholder
//!   weight), or by burn's quantizer to int8/int4 (one f32 scale per
//!   `block_size` values along a weight's output dimension); embeddings,
//!   norms, biases and `lm_head` stay dense, as bitsandbytes leaves them in
//!   PEFT's QLoRA.
//!
//! A quantized base is not loaded whole first: [`load_quantized`] reads the
//! stage part by part and quantizes each block as soon as it is read, so
//! the load holds one dense block beside the quantized ones (bitsandbytes
//! likewise quantizes each weight as it moves to the device). The result
//! equals [`attach`] on the stage loaded whole (`tests/qlora_load.rs`).
//!
//! burn's `Linear::forward` would compose the adapted weight densely for
//! each forward pass and keep it; the model's blocks call
//! [`super::lean::linear::forward`] instead, which computes
//! `x·W + s·(x·A)·B` with the factors burn attached here, and dequantizes a
//! quantized base per matmul without keeping it, and drops the adapter's
//! input (PEFT's `lora_dropout`) with a mask keyed by step, micro-batch,
//! layer and module, so a checkpointed block's recomputation draws it again
//! identically.

use burn::module::{Lora, LoraAdapter, Module, ParamGroup, ParamId, QLora, Quantizer};
use burn::nn::Linear;
use burn::tensor::Device;
use burn::tensor::quantization::{Calibration, QuantScheme, QuantValue, ScaleDtype};
use headroom_planner::{BaseFormat, LoraConfig, TargetModule};

use super::hf::{HfCheckpoint, HfError};
use super::nf4::{self, Nf4Bases};
use super::{Block, INIT_LOCK, LlamaBlock, Part, StageLayout, TransformerLm, part_seed};

/// Mixed into a part's seed so its adapter draws are not its weights' draws.
const ADAPTER_SEED_SALT: u64 = 0x4c6f_5241_2d41_0001;

/// The seven linear modules of a Llama decoder block (Phi-3 fuses them
/// into four: [`headroom_planner::LlamaArchitecture::block_linears`]).
pub const BLOCK_LINEARS: [TargetModule; 7] = TargetModule::BLOCK_LINEARS;

/// A stage this module cannot adapt, with what would work.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct AdapterError(pub String);

/// The block's linear a per-layer target names (`None` for `lm_head`, and
/// for a module the block's architecture does not have: Phi-3's fused
/// `qkv_proj` in a Llama block, Llama's `q_proj` in a Phi-3 one).
pub fn block_linear(block: &LlamaBlock, module: TargetModule) -> Option<&Linear> {
    match module {
        TargetModule::QProj => block.self_attn.q_proj.as_ref(),
        TargetModule::KProj => block.self_attn.k_proj.as_ref(),
        TargetModule::VProj => block.self_attn.v_proj.as_ref(),
        TargetModule::QkvProj => block.self_attn.qkv_proj.as_ref(),
        TargetModule::OProj => Some(&block.self_attn.o_proj),
        TargetModule::GateProj => block.mlp.gate_proj.as_ref(),
        TargetModule::UpProj => block.mlp.up_proj.as_ref(),
        TargetModule::GateUpProj => block.mlp.gate_up_proj.as_ref(),
        TargetModule::DownProj => Some(&block.mlp.down_proj),
        TargetModule::LmHead => None,
    }
}

/// The linears `block` has, with the module each is, in the block's order.
pub fn block_linears(block: &LlamaBlock) -> impl Iterator<Item = (TargetModule, &Linear)> {
    use TargetModule::*;
    [
        QProj, KProj, VProj, QkvProj, OProj, GateProj, UpProj, GateUpProj, DownProj,
    ]
    .into_iter()
    .filter_map(|m| block_linear(block, m).map(|linear| (m, linear)))
}

/// The module's Hugging Face path in layer `layer` (`model.layers.3.self_attn.q_proj`), or `lm_head`.
pub fn hf_module(module: TargetModule, layer: u32) -> String {
    match module {
        TargetModule::LmHead => "lm_head".to_string(),
        m if m.in_attention() => format!("model.layers.{layer}.self_attn.{}", m.hf_name()),
        m => format!("model.layers.{layer}.mlp.{}", m.hf_name()),
    }
}

/// burn's block-wise scheme of a quantized base format: symmetric 8- or
/// 4-bit values, one f32 scale per `block_size` consecutive values of a row.
/// `None` for a dense base, and for NF4, which is stored by
/// [`super::nf4`] in bitsandbytes' blocks of 64 (any other block size is
/// refused).
pub fn quant_scheme(
    format: BaseFormat,
    block_size: u32,
) -> Result<Option<QuantScheme>, AdapterError> {
    let value = match format {
        BaseFormat::Dense => return Ok(None),
        BaseFormat::Nf4 if block_size as usize == nf4::BLOCK => return Ok(None),
        BaseFormat::Nf4 => {
            return Err(AdapterError(format!(
                "training.lora.blockSize: nf4 is stored as bitsandbytes stores QLoRA's base, in blocks of {} values, not {block_size}; set {} (or int4/int8 for another block size)",
                nf4::BLOCK,
                nf4::BLOCK
            )));
        }
        BaseFormat::Int8 => QuantValue::Q8S,
        BaseFormat::Int4 => QuantValue::Q4S,
    };
    let block = u8::try_from(block_size)
        .ok()
        .filter(|b| *b >= 1)
        .ok_or_else(|| {
            AdapterError(format!(
                "training.lora.blockSize: burn quantizes in blocks of 1 to 255 values, not {block_size}; use 64"
            ))
        })?;
    Ok(Some(
        QuantScheme::default()
            .with_value(value)
            .per_block([block], ScaleDtype::F32),
    ))
}

/// The first block linear whose output dimension `block_size` does not
/// divide (burn quantizes a `[d_in, d_out]` weight in blocks of `[1,
/// block_size]` and needs whole blocks), as the error a user sees.
pub fn check_block_size(
    shape: &headroom_planner::LlamaShape,
    block_size: u32,
) -> Result<(), AdapterError> {
    let linears = shape.architecture.block_linears();
    for &module in linears {
        let (d_in, d_out) = module.dims(shape);
        if block_size == 0 || d_out % u64::from(block_size) != 0 {
            let fits: Vec<String> = [128u64, 64, 32, 16, 8]
                .into_iter()
                .filter(|b| linears.iter().all(|m| m.dims(shape).1 % b == 0))
                .map(|b| b.to_string())
                .collect();
            return Err(AdapterError(format!(
                "training.lora.blockSize: {block_size} does not divide the {d_out} outputs of {module} ({d_in} × {d_out}), and the quantized base is stored in whole blocks of a row; use {}",
                if fits.is_empty() {
                    "a divisor of every block linear's output size".to_string()
                } else {
                    fits.join(" or ")
                }
            )));
        }
    }
    Ok(())
}

/// What [`attach`] does to a stage's parts, set up once: each decoder block
/// is frozen, its seven linears quantized for a quantized base format, and
/// its targeted linears adapted; the head gets its adapter and the
/// embeddings are frozen. Split from [`attach`] so that a quantized base can
/// be adapted block by block as it loads ([`load_quantized`]): a block is
/// quantized before the next one is read, and the stage never holds its
/// whole base dense.
#[derive(Debug)]
pub struct StageAdapter {
    config: LoraConfig,
    /// burn's quantization of the base (int8, int4).
    scheme: Option<QuantScheme>,
    /// Whether the base is stored as NF4 instead ([`store_nf4`]).
    nf4: bool,
    seed: u64,
}

impl StageAdapter {
    /// Fails on a block size burn cannot quantize with.
    pub fn new(config: &LoraConfig, format: BaseFormat, seed: u64) -> Result<Self, AdapterError> {
        Ok(StageAdapter {
            scheme: quant_scheme(format, config.block_size)?,
            nf4: format == BaseFormat::Nf4,
            config: config.clone(),
            seed,
        })
    }

    fn lora(&self) -> Lora {
        Lora::new(self.config.rank as usize, self.config.alpha)
    }

    /// Adapts decoder block `layer` (and, for a quantized base, quantizes
    /// its linears). Its adapter factors are drawn from the run's seed
    /// and the block, whatever the order blocks are adapted in.
    pub fn block(&self, block: LlamaBlock, layer: u32, device: &Device) -> LlamaBlock {
        let targets: Vec<ParamId> = self
            .config
            .target_modules
            .iter()
            .filter_map(|&m| block_linear(&block, m).map(|l| l.weight.id))
            .collect();
        let lora = self.lora().set_param_group(ParamGroup::from_ids(targets));
        let quantizer = self.scheme.map(|scheme| {
            let mut quantizer = Quantizer::new(Calibration::MinMax, scheme);
            let all: Vec<ParamId> = block_linears(&block).map(|(_, l)| l.weight.id).collect();
            quantizer.set_param_group(ParamGroup::from_ids(all));
            quantizer
        });
        let _guard = INIT_LOCK
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        device.seed(part_seed(self.seed ^ ADAPTER_SEED_SALT, Part::Block(layer)));
        let block = match quantizer {
            None => block.apply_lora(lora),
            Some(quantizer) => block.apply_qlora(QLora::new(lora, quantizer)),
        };
        if self.nf4 {
            store_nf4(block, device)
        } else {
            block
        }
    }

    /// Adapts the head (`lm_head` when targeted) and freezes the embeddings;
    /// the blocks are left as they are.
    pub fn rest(&self, model: TransformerLm, device: &Device) -> TransformerLm {
        let TransformerLm {
            token,
            host_token,
            position,
            blocks,
            head,
            first,
            gemma,
        } = model;
        let head = head.map(|head| {
            let targets = match (&head.projection, self.config.targets(TargetModule::LmHead)) {
                (Some(projection), true) => vec![projection.weight.id],
                _ => vec![],
            };
            let lora = self.lora().set_param_group(ParamGroup::from_ids(targets));
            let _guard = INIT_LOCK
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            device.seed(part_seed(self.seed ^ ADAPTER_SEED_SALT, Part::Head));
            head.apply_lora(lora)
        });
        TransformerLm {
            token: token.map(Module::no_grad),
            host_token,
            position: position.map(Module::no_grad),
            blocks,
            head,
            first,
            gemma,
        }
    }
}

/// Stores the seven linears' base weights of an adapted `block` as NF4
/// ([`Nf4Bases`]), each quantized as bitsandbytes quantizes the
/// checkpoint's `[d_out, d_in]` weight, and leaves an empty placeholder in
/// each linear's weight, its adapter kept: the dense base is freed.
fn store_nf4(block: LlamaBlock, device: &Device) -> LlamaBlock {
    use burn::module::{ModuleMapper, Param};
    use burn::tensor::{Shape, Tensor};

    let mut bases = Nf4Bases::default();
    let mut ids = Vec::new();
    for (module, linear) in block_linears(&block) {
        let weight = &linear.weight;
        let [d_in, d_out] = weight.base().dims();
        let values: Vec<f32> = weight
            .base()
            .transpose()
            .into_data()
            .iter::<f32>()
            .collect();
        let quantized = nf4::Nf4Tensor::quantize(&values, [d_out, d_in]);
        bases.insert(module, nf4::Nf4Weight::upload(&quantized, device));
        ids.push(weight.id);
    }

    struct Placeholder(Vec<ParamId>);
    impl ModuleMapper for Placeholder {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            if !self.0.contains(&param.id) {
                return param;
            }
            param.map(|t| Tensor::empty(Shape::new([0; D]), (&t.device(), t.dtype())))
        }
    }
    let mut block = block.map(&mut Placeholder(ids));
    block.nf4 = bases;
    block
}

/// The refusal of an adapter on a head tied to the token embedding.
fn tied_head_error() -> AdapterError {
    AdapterError(
        "training.lora.targetModules: lm_head is tied to the token embedding in this checkpoint (tie_word_embeddings), and an adapter on it would change the embedding too; remove lm_head".into(),
    )
}

/// Freezes the stage's base, quantizes its block linears for a quantized
/// `format`, and attaches adapters to the targeted modules it holds. The
/// stage must be a Llama-family stage whose base is loaded.
pub fn attach(
    model: TransformerLm,
    config: &LoraConfig,
    format: BaseFormat,
    layout: &StageLayout,
    seed: u64,
    device: &Device,
) -> Result<TransformerLm, AdapterError> {
    let adapter = StageAdapter::new(config, format, seed)?;
    let tied_head = model.head.as_ref().is_some_and(|h| h.projection.is_none());
    if tied_head && config.targets(TargetModule::LmHead) {
        return Err(tied_head_error());
    }
    let mut model = model;
    let blocks = std::mem::take(&mut model.blocks);
    let mut adapted = Vec::with_capacity(blocks.len());
    for (block, layer) in blocks.into_iter().zip(layout.layers.clone()) {
        let Block::Llama(block) = block else {
            return Err(AdapterError(format!(
                "training.lora: adapters are for Llama-family checkpoints ({}), not the synthetic transformer",
                headroom_planner::LlamaArchitecture::ALL
                    .map(headroom_planner::LlamaArchitecture::hf_name)
                    .join(", ")
            )));
        };
        if let Some(&missing) = config
            .target_modules
            .iter()
            .find(|&&m| m.per_layer() && block_linear(&block, m).is_none())
        {
            let modules: Vec<&str> = block_linears(&block)
                .map(|(m, _)| m.hf_name())
                .chain(["lm_head"])
                .collect();
            return Err(AdapterError(format!(
                "training.lora.targetModules: this checkpoint's blocks have no {missing}; its modules are {}",
                modules.join(", ")
            )));
        }
        if adapter.scheme.is_some() {
            for (module, linear) in block_linears(&block) {
                let [d_in, d_out] = linear.weight.base().dims();
                if d_out % config.block_size as usize != 0 {
                    return Err(AdapterError(format!(
                        "training.lora.blockSize: {} does not divide the {d_out} outputs of {module} ({d_in} × {d_out}), and the quantized base is stored in whole blocks of a row",
                        config.block_size
                    )));
                }
            }
        }
        adapted.push(Block::Llama(adapter.block(block, layer, device)));
    }
    model.blocks = adapted;
    Ok(adapter.rest(model, device))
}

/// A QLoRA stage that could not be loaded: the checkpoint, or the adapters.
#[derive(Debug, thiserror::Error)]
pub enum QuantizedLoadError {
    #[error(transparent)]
    Checkpoint(#[from] HfError),
    #[error(transparent)]
    Adapter(#[from] AdapterError),
}

/// Loads a stage built by [`TransformerLm::new`] from `checkpoint` and
/// attaches `config`'s adapters, as [`HfCheckpoint::load_stage`] followed by
/// [`attach`] would, with the same weights, factors and quantized values;
/// but part by part ([`HfCheckpoint::load_stage_by_part`]), each block
/// quantized (for a quantized `format`) as soon as it is read. The load's
/// peak is then the quantized base, the dense embedding and head, and one
/// dense block with its conversion copies — not the whole stage dense, as
/// it would be if every block were loaded before the first is quantized.
/// The block size and a tied `lm_head` are checked before anything is read.
pub fn load_quantized(
    checkpoint: &HfCheckpoint,
    model: TransformerLm,
    config: &LoraConfig,
    format: BaseFormat,
    layout: &StageLayout,
    seed: u64,
    device: &Device,
) -> Result<TransformerLm, QuantizedLoadError> {
    let adapter = StageAdapter::new(config, format, seed)?;
    let shape = &checkpoint.shape;
    if layout.last && shape.tied_embeddings && config.targets(TargetModule::LmHead) {
        return Err(tied_head_error().into());
    }
    if let Some(problem) = config.foreign_targets(shape.architecture) {
        return Err(AdapterError(format!("training.lora.targetModules: {problem}")).into());
    }
    if adapter.scheme.is_some() {
        check_block_size(shape, config.block_size)?;
    }
    let mut model = model;
    checkpoint.load_stage_by_part(&mut model, layout, |block, layer| {
        adapter.block(block, layer, device)
    })?;
    Ok(adapter.rest(model, device))
}

/// One adapted module of a stage: its Hugging Face path and its factors.
#[derive(Debug)]
pub struct Adapted<'a> {
    pub module: TargetModule,
    /// `model.layers.<n>.self_attn.q_proj`, …, or `lm_head`.
    pub hf_path: String,
    pub adapter: &'a LoraAdapter,
}

/// The stage's adapters in a fixed order (blocks in order, modules in
/// [`TargetModule::ALL`]'s order, then `lm_head`).
pub fn stage_adapters<'a>(model: &'a TransformerLm, layout: &StageLayout) -> Vec<Adapted<'a>> {
    let mut found = Vec::new();
    for (block, layer) in model.blocks.iter().zip(layout.layers.clone()) {
        let Block::Llama(block) = block else { continue };
        for (module, linear) in block_linears(block) {
            if let Some(adapter) = linear.weight.adapter() {
                found.push(Adapted {
                    module,
                    hf_path: hf_module(module, layer),
                    adapter,
                });
            }
        }
    }
    if let Some(adapter) = model
        .head
        .as_ref()
        .and_then(|h| h.projection.as_ref())
        .and_then(|p| p.weight.adapter())
    {
        found.push(Adapted {
            module: TargetModule::LmHead,
            hf_path: hf_module(TargetModule::LmHead, 0),
            adapter,
        });
    }
    found
}

/// The ParamIds of the adapter factors a module (a block, the head, …) holds.
pub fn adapter_ids<M: Module>(module: &M) -> Vec<ParamId> {
    use burn::module::{ModuleVisitor, Param};
    use burn::tensor::Tensor;
    // burn visits an adapted weight's base first, then its factors inside a
    // "Reparameterization" container.
    struct Factors {
        ids: Vec<ParamId>,
        inside: usize,
    }
    impl ModuleVisitor for Factors {
        fn enter_module(&mut self, _name: &str, container_type: &str) {
            if container_type == "Reparameterization" {
                self.inside += 1;
            }
        }
        fn exit_module(&mut self, _name: &str, container_type: &str) {
            if container_type == "Reparameterization" {
                self.inside -= 1;
            }
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if self.inside > 0 {
                self.ids.push(param.id);
            }
        }
    }
    let mut factors = Factors {
        ids: Vec::new(),
        inside: 0,
    };
    module.visit(&mut factors);
    factors.ids
}

/// Whether any parameter of the stage carries an adapter.
pub fn is_adapted(model: &TransformerLm) -> bool {
    !adapter_ids(model).is_empty()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::module::{ModuleVisitor, Param};
    use burn::optim::{AdamWConfig, GradientsParams};
    use burn::tensor::{Int, Tensor, TensorData};
    use headroom_planner::{LlamaArchitecture, LlamaShape};

    use crate::model::LmShape;

    fn shape() -> LlamaShape {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "max_position_embeddings": 64}"#;
        let s = LlamaShape::from_hf_config(text, 8).expect("config");
        assert_eq!(s.architecture, LlamaArchitecture::Llama);
        s
    }

    /// A stage with random (not checkpoint) weights, materialised.
    fn base(device: &Device) -> (TransformerLm, StageLayout) {
        let shape = LmShape::Llama(shape());
        let layout = StageLayout::whole(&shape);
        let model = TransformerLm::new(&shape, &layout, 7, device);
        super::super::with_generator(|| {
            device.seed(7);
            super::super::materialize(&model);
        });
        (model, layout)
    }

    /// [`config`] with the block size `format` takes (NF4's is fixed at 64).
    fn config_for(format: BaseFormat, targets: &[TargetModule]) -> LoraConfig {
        LoraConfig {
            block_size: if format == BaseFormat::Nf4 { 64 } else { 8 },
            ..config(targets)
        }
    }

    fn config(targets: &[TargetModule]) -> LoraConfig {
        LoraConfig {
            rank: 2,
            alpha: 4.0,
            dropout: 0.0,
            target_modules: targets.to_vec(),
            block_size: 8,
        }
    }

    fn tokens(device: &Device) -> Tensor<2, Int> {
        let ids: Vec<i64> = (0..16).map(|i| (i * 7 + 3) % 40).collect();
        Tensor::from_data(TensorData::new(ids, [2, 8]), device)
    }

    fn values(t: Tensor<2>) -> Vec<f32> {
        t.into_data().iter::<f32>().collect()
    }

    /// Every float parameter's id and values.
    fn snapshot<M: Module>(module: &M) -> Vec<(ParamId, Vec<f32>)> {
        struct All(Vec<(ParamId, Vec<f32>)>);
        impl ModuleVisitor for All {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let v = param
                    .base()
                    .dequantize()
                    .into_data()
                    .iter::<f32>()
                    .collect();
                self.0.push((param.id, v));
            }
        }
        let mut all = All(Vec::new());
        module.visit(&mut all);
        all.0
    }

    #[test]
    fn with_b_zero_the_adapted_model_is_the_base() {
        let device = Device::flex();
        let (model, layout) = base(&device);
        let want = values(model.forward(tokens(&device)));
        let all = config(&TargetModule::ALL);
        let adapted = attach(model, &all, BaseFormat::Dense, &layout, 1, &device).expect("attach");
        assert_eq!(stage_adapters(&adapted, &layout).len(), 2 * 7 + 1);
        assert_eq!(
            adapter_ids(&adapted).len() as u64 / 2,
            2 * 7 + 1,
            "two factors per adapted module"
        );
        let got = values(adapted.forward(tokens(&device)));
        assert_eq!(
            got, want,
            "B = 0: the adapted model computes the base's logits"
        );
    }

    #[test]
    fn trainable_parameters_equal_the_planners_count() {
        let device = Device::flex();
        for targets in [
            vec![TargetModule::QProj, TargetModule::VProj],
            TargetModule::ALL.to_vec(),
        ] {
            let (model, layout) = base(&device);
            let c = config(&targets);
            let adapted =
                attach(model, &c, BaseFormat::Dense, &layout, 1, &device).expect("attach");
            let trainable: usize = stage_adapters(&adapted, &layout)
                .iter()
                .map(|a| {
                    a.adapter.a.val().dims().iter().product::<usize>()
                        + a.adapter.b.val().dims().iter().product::<usize>()
                })
                .sum();
            assert_eq!(
                trainable as u64,
                c.trainable_params(&shape()),
                "{targets:?}"
            );
        }
    }

    #[test]
    fn only_the_adapter_factors_get_gradients_and_change() {
        let device = Device::flex().autodiff();
        for format in [
            BaseFormat::Dense,
            BaseFormat::Int8,
            BaseFormat::Int4,
            BaseFormat::Nf4,
        ] {
            let (model, layout) = base(&device);
            let c = config_for(
                format,
                &[
                    TargetModule::QProj,
                    TargetModule::VProj,
                    TargetModule::LmHead,
                ],
            );
            let model = attach(model, &c, format, &layout, 1, &device).expect("attach");
            let factors = adapter_ids(&model);
            let before = snapshot(&model);
            let targets = tokens(&device);
            let loss = model.loss(tokens(&device), targets);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            let with_grad: Vec<ParamId> = before
                .iter()
                .map(|(id, _)| *id)
                .filter(|id| grads.get::<2>(*id).is_some() || grads.get::<1>(*id).is_some())
                .collect();
            let mut sorted = factors.clone();
            sorted.sort();
            let mut got = with_grad.clone();
            got.sort();
            assert_eq!(got, sorted, "{format}: gradients exactly for the factors");
            let mut optim = AdamWConfig::new().init();
            let model = optim.step(1e-2, model, grads);
            let after = snapshot(&model);
            for ((id, b), (id2, a)) in before.iter().zip(&after) {
                assert_eq!(id, id2);
                let changed = b != a;
                assert_eq!(
                    changed,
                    factors.contains(id),
                    "{format}: parameter {id} changed: {changed}"
                );
            }
        }
    }

    #[test]
    fn a_quantized_base_stores_the_block_linears_only_and_stays_close() {
        let device = Device::flex();
        for (format, tolerance) in [(BaseFormat::Int8, 0.05f32), (BaseFormat::Int4, 0.6)] {
            let (model, layout) = base(&device);
            let want = values(model.forward(tokens(&device)));
            let c = config(&[TargetModule::QProj]);
            let model = attach(model, &c, format, &layout, 1, &device).expect("attach");
            let Block::Llama(block) = &model.blocks[0] else {
                panic!("llama")
            };
            for m in BLOCK_LINEARS {
                let w = block_linear(block, m).expect("linear").weight.base();
                assert!(
                    matches!(w.dtype(), burn::tensor::DType::QFloat(_)),
                    "{format}: {m} is stored quantized"
                );
            }
            let dense = |t: burn::tensor::DType| !matches!(t, burn::tensor::DType::QFloat(_));
            assert!(dense(block.input_layernorm.gamma.base().dtype()));
            assert!(dense(
                model.token.as_ref().expect("token").weight.base().dtype()
            ));
            let head = model.head.as_ref().expect("head");
            assert!(dense(
                head.projection
                    .as_ref()
                    .expect("lm_head")
                    .weight
                    .base()
                    .dtype()
            ));
            let got = values(model.forward(tokens(&device)));
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (g - w).abs())
                .fold(0.0f32, f32::max);
            eprintln!("{format}: max |logit - dense| = {worst:.4}");
            assert!(worst < tolerance, "{format}: {worst}");
        }
    }

    /// NF4 (block 64) takes every linear of a block, adapted or not: their
    /// weights become empty placeholders and the block holds bitsandbytes'
    /// quantization of the checkpoint-layout weight; the model stays close
    /// to the dense one.
    #[test]
    fn an_nf4_base_replaces_the_dense_weights_with_bitsandbytes_values() {
        use super::super::nf4::Nf4Tensor;
        let device = Device::flex();
        let (model, layout) = base(&device);
        let want = values(model.forward(tokens(&device)));
        let Block::Llama(dense_block) = &model.blocks[0] else {
            panic!("llama")
        };
        let originals: Vec<Vec<f32>> = BLOCK_LINEARS
            .iter()
            .map(|m| {
                let w = block_linear(dense_block, *m).expect("linear").weight.base();
                w.transpose().into_data().iter::<f32>().collect()
            })
            .collect();
        let c = config_for(BaseFormat::Nf4, &[TargetModule::QProj]);
        let model = attach(model, &c, BaseFormat::Nf4, &layout, 1, &device).expect("attach");
        let Block::Llama(block) = &model.blocks[0] else {
            panic!("llama")
        };
        for (m, original) in BLOCK_LINEARS.iter().zip(&originals) {
            let linear = block_linear(block, *m).expect("linear");
            assert_eq!(
                linear.weight.base().dims(),
                [0, 0],
                "{m}: dense weight freed"
            );
            let stored = block.nf4.get(*m).expect("nf4 weight");
            let (d_in, d_out) = m.dims(&shape());
            assert_eq!(stored.shape(), [d_out as usize, d_in as usize]);
            let got: Vec<f32> = stored
                .dense(burn::tensor::DType::F32)
                .into_data()
                .iter::<f32>()
                .collect();
            let host = Nf4Tensor::quantize(original, stored.shape()).dequantize();
            assert_eq!(got, host, "{m}: bitsandbytes' values");
        }
        let q = block_linear(block, TargetModule::QProj).expect("q");
        assert!(q.weight.adapter().is_some(), "q_proj keeps its adapter");
        let got = values(model.forward(tokens(&device)));
        let worst = got
            .iter()
            .zip(&want)
            .map(|(g, w)| (g - w).abs())
            .fold(0.0f32, f32::max);
        let scale = want.iter().fold(0.0f32, |m, w| m.max(w.abs()));
        eprintln!("nf4: max |logit - dense| = {worst:.4} of max |logit| {scale:.4}");
        // A sanity bound (the values are checked bit for bit above): 16-wide
        // rows of uniform weights in 64-blocks, measured 0.59 of 1.60.
        assert!(worst < 0.5 * scale, "{worst} of {scale}");
        // Any other block size is refused, naming the field.
        let (model, layout) = base(&device);
        let err = attach(
            model,
            &config(&[TargetModule::QProj]),
            BaseFormat::Nf4,
            &layout,
            1,
            &device,
        )
        .expect_err("block 8");
        assert!(err.0.starts_with("training.lora.blockSize: "), "{err}");
    }

    #[test]
    fn a_tied_lm_head_is_refused() {
        let device = Device::flex();
        let text = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": 40, "hidden_size": 16, "intermediate_size": 24,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "tie_word_embeddings": true}"#;
        let shape = LmShape::Llama(LlamaShape::from_hf_config(text, 8).expect("config"));
        let layout = StageLayout::whole(&shape);
        let model = TransformerLm::new(&shape, &layout, 7, &device);
        super::super::with_generator(|| super::super::materialize(&model));
        let err = attach(
            model,
            &config(&[TargetModule::LmHead]),
            BaseFormat::Dense,
            &layout,
            1,
            &device,
        )
        .expect_err("tied");
        assert!(err.0.starts_with("training.lora.targetModules: "), "{err}");
    }
}
