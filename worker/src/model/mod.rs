//! The decoder-only language model the worker trains, one pipeline stage's
//! part of it at a time: a token embedding, a range of decoder blocks, and a
//! final norm with an output head (tied to the embedding or not).
//!
//! Two families share that outline ([`LmShape`]):
//! * [`gpt`] — the synthetic `transformer` (learned positions, LayerNorm,
//!   GELU), randomly initialised from the job's seed; kept for benchmarks and
//!   the control-loop tests;
//! * [`llama`] — Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and Gemma 3
//!   as Hugging Face builds them (RoPE, RMSNorm, grouped-query attention,
//!   SwiGLU or GeGLU), loaded
//!   from a checkpoint by [`hf`] and written back in the same format.
//!
//! The parameter count equals the planner's for either family; tests pin
//! that, so the memory model and the worker cannot drift.
//!
//! A stage may carry LoRA adapters on its frozen base ([`lora`]), read and
//! written in PEFT's format by [`peft`].
//!
//! Besides the plain [`TransformerLm::forward`], the model exposes its three
//! parts (embedding, one block, head + loss) so the trainer can run
//! block-level activation checkpointing: keep each block's input, recompute
//! one block at a time in backward.

pub mod gpt;
pub mod hf;
pub mod host_embedding;
pub mod lean;
pub mod llama;
pub mod lora;
pub mod nf4;
pub mod peft;
pub mod safetensors_reads;

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig,
    RmsNorm,
};
use burn::tensor::{Device, Int, Tensor, TensorData};
use headroom_planner::{LlamaShape, ModelShape, TransformerShape};
use lean::linear::AdapterDropout;
use serde::{Deserialize, Serialize};

pub use gpt::GptBlock;
pub use host_embedding::HostEmbedding;
pub use llama::LlamaBlock;

/// Standard deviation of the normal initialiser for embeddings (GPT-2's 0.02).
const EMBEDDING_INIT_STD: f64 = 0.02;

/// The shape of a model the worker can build.
///
/// Untagged so a checkpoint's `meta.json` written before Llama models existed
/// (a bare `TransformerShape`) still reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum LmShape {
    Gpt(TransformerShape),
    Llama(LlamaShape),
}

impl LmShape {
    /// The buildable part of a planner shape; `None` for a generic model.
    pub fn from_model(model: &ModelShape) -> Option<Self> {
        match model {
            ModelShape::Transformer(t) => Some(LmShape::Gpt(t.clone())),
            ModelShape::Llama(l) => Some(LmShape::Llama(l.clone())),
            ModelShape::Generic(_) => None,
        }
    }

    pub fn layers(&self) -> u32 {
        match self {
            LmShape::Gpt(t) => t.layers,
            LmShape::Llama(l) => l.layers,
        }
    }

    pub fn hidden(&self) -> u32 {
        match self {
            LmShape::Gpt(t) => t.hidden,
            LmShape::Llama(l) => l.hidden,
        }
    }

    pub fn vocabulary(&self) -> u32 {
        match self {
            LmShape::Gpt(t) => t.vocabulary,
            LmShape::Llama(l) => l.vocabulary,
        }
    }

    /// Tokens per training sample.
    pub fn sequence_length(&self) -> u32 {
        match self {
            LmShape::Gpt(t) => t.sequence_length,
            LmShape::Llama(l) => l.sequence_length,
        }
    }

    pub fn tied_embeddings(&self) -> bool {
        match self {
            LmShape::Gpt(t) => t.tied_embeddings,
            LmShape::Llama(l) => l.tied_embeddings,
        }
    }

    /// Learned position embeddings (GPT); Llama's RoPE has no weights.
    pub fn has_positions(&self) -> bool {
        matches!(self, LmShape::Gpt(_))
    }

    /// Parameters of the whole model, as the planner counts them.
    pub fn total_params(&self) -> u64 {
        match self {
            LmShape::Gpt(t) => t.total_params(),
            LmShape::Llama(l) => l.total_params(),
        }
    }
}

impl From<TransformerShape> for LmShape {
    fn from(shape: TransformerShape) -> Self {
        LmShape::Gpt(shape)
    }
}

impl From<LlamaShape> for LmShape {
    fn from(shape: LlamaShape) -> Self {
        LmShape::Llama(shape)
    }
}

/// One decoder block of either family.
// A model holds a few dozen blocks, built once: the size gap between the
// variants costs nothing worth a Box through burn's module derive.
#[allow(clippy::large_enum_variant)]
#[derive(Module, Debug)]
pub enum Block {
    Gpt(GptBlock),
    Llama(LlamaBlock),
}

impl Block {
    /// [batch, seq, hidden] → [batch, seq, hidden].
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_dropping(x, None, None)
    }

    /// [`Self::forward`] in training, with this block's adapter dropout
    /// (adapters are on Llama-family blocks only), over a batch packed by
    /// `documents` where given.
    pub fn forward_dropping(
        &self,
        x: Tensor<3>,
        dropout: Option<AdapterDropout>,
        documents: Option<&Documents>,
    ) -> Tensor<3> {
        match self {
            Block::Gpt(b) => b.forward_in(x, documents),
            Block::Llama(b) => b.forward_dropping(x, dropout, documents),
        }
    }
}

/// Where the documents of a batch packed by documents lie
/// ([`crate::text::Packing::Documents`]): per row and token, its document
/// (attention stays inside it) and its position in it (RoPE and learned
/// positions restart at 0 with each document). A stream-packed batch has
/// none: one sequence a row, positions 0..s.
#[derive(Clone, Debug, PartialEq)]
pub struct Documents {
    segments: lean::attention::Segments,
    /// `[b, s]` row-major.
    positions: std::sync::Arc<[usize]>,
}

impl Documents {
    /// From a document id per token, `ids` `[rows, seq]` row-major (a
    /// document is a run of equal ids).
    pub fn new(ids: &[u32], rows: usize, seq: usize) -> Self {
        let segments = lean::attention::Segments::new(ids, rows, seq);
        let positions = (0..rows * seq)
            .map(|i| i % seq - segments.start(i / seq, i % seq))
            .collect();
        Documents {
            segments,
            positions,
        }
    }

    pub fn segments(&self) -> &lean::attention::Segments {
        &self.segments
    }

    /// Each token's position in its document, `[b, s]` row-major.
    pub fn positions(&self) -> &[usize] {
        &self.positions
    }
}

/// The final norm of either family.
#[derive(Module, Debug)]
pub enum FinalNorm {
    Layer(LayerNorm),
    Rms(RmsNorm),
}

/// Final norm and, unless the head is tied to the token embedding, the
/// output projection: the last stage's part after its blocks.
#[derive(Module, Debug)]
pub struct Head {
    pub norm: FinalNorm,
    pub projection: Option<Linear>,
}

/// What one pipeline stage holds of the language model.
///
/// The first stage holds the embeddings, the last the final norm and head
/// (and computes the loss); a single stage holds all of it. A tied head on a
/// last stage that is not also the first needs the token embedding too: that
/// stage keeps its own copy, initialised identically, and the two copies are
/// kept equal by summing their gradients across the pipeline before each
/// update (see [`crate::pipeline`]).
///
/// A GPT part is initialised from its own seed ([`part_seed`]), so a stage's
/// weights do not depend on how the model is split: p = 1, 2, 3 stages start
/// from the same model. A Llama part is read from the checkpoint.
#[derive(Module, Debug)]
pub struct TransformerLm {
    /// On the first stage, and on a last stage with a tied head; `None`
    /// on a first stage whose embedding waits in host memory instead
    /// (`host_token`).
    pub token: Option<Embedding>,
    /// A LoRA job's frozen, untied token embedding in host memory (the
    /// plan's `offload_embedding`, [`Self::keep_embedding_on_host`]). Not a
    /// module of the stage: nothing trains it, and the stage's modules
    /// stay on one device.
    #[module(skip)]
    pub host_token: Option<HostEmbedding>,
    /// On the first stage of a GPT model only.
    pub position: Option<Embedding>,
    pub blocks: Vec<Block>,
    /// On the last stage only.
    pub head: Option<Head>,
    /// Holds the embeddings (kept as a flag: a Llama first stage has no position embedding).
    first: bool,
    /// Gemma's: the token embedding's output is multiplied by √hidden, the
    /// final norm is Gemma's, and the logits may be soft-capped. Derived
    /// from the shape, not part of the record.
    #[module(skip)]
    gemma: Option<GemmaOutput>,
}

/// What a Gemma model does around its blocks that a Llama one does not.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmaOutput {
    /// √hidden, by which the token embedding's output is multiplied
    /// (transformers rounds it to the weights' dtype first).
    pub embed_scale: f32,
    /// `final_logit_softcapping`: logits become cap · tanh(logits / cap).
    pub final_softcap: Option<f64>,
}

/// The parts a model is made of, each initialised and checkpointed on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Part {
    Token,
    Position,
    Block(u32),
    Head,
}

impl Part {
    /// File stem in a checkpoint.
    pub fn file_stem(self) -> String {
        match self {
            Part::Token => "token".into(),
            Part::Position => "position".into(),
            Part::Block(i) => format!("block-{i:04}"),
            Part::Head => "head".into(),
        }
    }

    fn seed_index(self) -> u64 {
        match self {
            Part::Token => 1,
            Part::Position => 2,
            Part::Head => 3,
            Part::Block(i) => 1_000 + u64::from(i),
        }
    }
}

/// The seed a part's weights are drawn from: the run's seed mixed with the part.
pub fn part_seed(seed: u64, part: Part) -> u64 {
    crate::data::splitmix(seed ^ crate::data::splitmix(part.seed_index()))
}

/// Which end(s) of the pipeline a stage is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StageLayout {
    /// Blocks this stage holds.
    pub layers: Range<u32>,
    pub first: bool,
    pub last: bool,
}

impl StageLayout {
    /// The whole model on one worker.
    pub fn whole(shape: &LmShape) -> Self {
        StageLayout {
            layers: 0..shape.layers(),
            first: true,
            last: true,
        }
    }

    /// The parts this stage holds and saves, in a fixed order. The tied
    /// head's copy of the token embedding is not a part of its own: it is
    /// restored from the first stage's [`Part::Token`].
    pub fn parts(&self, shape: &LmShape) -> Vec<Part> {
        let mut parts = Vec::new();
        if self.first {
            parts.push(Part::Token);
            if shape.has_positions() {
                parts.push(Part::Position);
            }
        }
        parts.extend(self.layers.clone().map(Part::Block));
        if self.last {
            parts.push(Part::Head);
        }
        parts
    }
}

fn embedding_init() -> Initializer {
    Initializer::Normal {
        mean: 0.0,
        std: EMBEDDING_INIT_STD,
    }
}

/// burn's generator is global to the process: whatever draws seeded weights
/// (models built concurrently in tests, stages in threads) takes this first,
/// so each gets the draws of its own seed.
pub(crate) static INIT_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Runs `draw` holding [`INIT_LOCK`], for code that seeds and draws from
/// burn's generator itself (adapter dropout masks; tests' random tensors and
/// lazily initialised Llama weights): unlocked, a `seed` or a draw in one
/// thread lands in the middle of another's seeded draw (CI saw
/// `weights_do_not_depend_on_the_split` fail that way). `draw` must not
/// call [`TransformerLm::new`] (it takes the lock).
pub(crate) fn with_generator<R>(draw: impl FnOnce() -> R) -> R {
    let _guard = INIT_LOCK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    draw()
}

/// Runs every parameter's (lazy) initialiser now. burn draws initial weights
/// on first use from a generator shared by the whole process.
fn materialize<M: Module>(module: &M) {
    struct Touch;
    impl ModuleVisitor for Touch {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let _ = param.val();
        }
    }
    module.visit(&mut Touch);
}

impl TransformerLm {
    /// Builds one stage. A GPT stage's parts are initialised now, each from
    /// its own seed; a Llama stage's parameters stay uninitialised (burn
    /// initialises lazily) until [`hf::load_stage`] fills them, so building
    /// it costs no memory for weights that are about to be replaced.
    ///
    /// burn's generator is global to the process: models built concurrently
    /// (tests, stages in threads) take turns, so each gets its seeded weights.
    pub fn new(shape: &LmShape, layout: &StageLayout, seed: u64, device: &Device) -> Self {
        let _guard = INIT_LOCK
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let seeded = |part: Part| {
            if shape.has_positions() {
                device.seed(part_seed(seed, part));
            }
        };
        let init = |module: &dyn Fn()| {
            if shape.has_positions() {
                module();
            }
        };
        let (v, h) = (shape.vocabulary() as usize, shape.hidden() as usize);
        let token = (layout.first || (layout.last && shape.tied_embeddings())).then(|| {
            seeded(Part::Token);
            let token = EmbeddingConfig::new(v, h)
                .with_initializer(embedding_init())
                .init(device);
            init(&|| materialize(&token));
            token
        });
        let position = match shape {
            LmShape::Gpt(t) if layout.first => {
                seeded(Part::Position);
                let position = EmbeddingConfig::new(t.sequence_length as usize, h)
                    .with_initializer(embedding_init())
                    .init(device);
                materialize(&position);
                Some(position)
            }
            _ => None,
        };
        let blocks = layout
            .layers
            .clone()
            .map(|i| {
                seeded(Part::Block(i));
                let block = match shape {
                    LmShape::Gpt(t) => Block::Gpt(GptBlock::new(t, device)),
                    LmShape::Llama(l) => Block::Llama(LlamaBlock::new(l, i, device)),
                };
                init(&|| materialize(&block));
                block
            })
            .collect();
        let head = layout.last.then(|| {
            seeded(Part::Head);
            let (norm, bias) = match shape {
                LmShape::Gpt(_) => (
                    FinalNorm::Layer(LayerNormConfig::new(h).init(device)),
                    false,
                ),
                LmShape::Llama(l) => (FinalNorm::Rms(llama::rms_norm(l, device)), false),
            };
            let head = Head {
                norm,
                projection: (!shape.tied_embeddings())
                    .then(|| LinearConfig::new(h, v).with_bias(bias).init(device)),
            };
            init(&|| materialize(&head));
            head
        });
        let gemma = match shape {
            LmShape::Llama(l) if l.architecture.gemma() => Some(GemmaOutput {
                embed_scale: (l.hidden as f32).sqrt(),
                final_softcap: l.gemma.as_ref().and_then(|g| g.final_logit_softcapping),
            }),
            _ => None,
        };
        TransformerLm {
            token,
            host_token: None,
            position,
            blocks,
            head,
            first: layout.first,
            gemma,
        }
    }

    /// Moves the first stage's token embedding to host memory, where
    /// lookups gather its rows ([`HostEmbedding`]), unless it is tied to
    /// the head (which needs it on the device). An unloaded table (a Llama
    /// stage before [`hf::HfCheckpoint`] fills it) is made empty on the
    /// host, so the checkpoint reads it there and the device never holds
    /// it. `dtype`: the stage's floats. Only for a frozen embedding (LoRA):
    /// the host table trains nothing. Returns whether it moved.
    pub fn keep_embedding_on_host(&mut self, shape: &LmShape, dtype: burn::tensor::DType) -> bool {
        if !self.first || shape.tied_embeddings() {
            return false;
        }
        let Some(token) = self.token.take() else {
            return false;
        };
        self.host_token = Some(if token.weight.is_initialized() {
            HostEmbedding::from_device(token, dtype)
        } else {
            HostEmbedding::empty(shape.vocabulary() as usize, shape.hidden() as usize, dtype)
        });
        true
    }

    /// This stage as its checkpoint files hold it: a host embedding is the
    /// stage's `token` again (a view sharing its tensors, for writing).
    pub fn with_embedding_as_token(&self) -> TransformerLm {
        let mut model = self.clone();
        if let Some(host) = model.host_token.take() {
            model.token = Some(host.table().clone());
        }
        model
    }

    /// Holds the embeddings (the first stage).
    pub fn is_first(&self) -> bool {
        self.first
    }

    /// Holds the head and computes the loss (the last stage).
    pub fn is_last(&self) -> bool {
        self.head.is_some()
    }

    /// Token (+ learned position) embeddings. `tokens`: [batch, seq] → [batch, seq, hidden].
    pub fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        self.embed_in(tokens, None)
    }

    /// [`Self::embed`] of a batch packed by `documents`, where given
    /// (learned positions restart with each document).
    pub fn embed_in(&self, tokens: Tensor<2, Int>, documents: Option<&Documents>) -> Tensor<3> {
        let [b, s] = tokens.dims();
        let device = tokens.device();
        let x = match (self.first, &self.token, &self.host_token) {
            (true, Some(token), _) => token.forward(tokens),
            (true, None, Some(host)) => host.lookup(tokens),
            _ => panic!("embed() on a stage without the embeddings"),
        };
        let x = match &self.gemma {
            // transformers casts √hidden to the weights' dtype before the product.
            Some(g) => {
                let scale = match x.dtype() {
                    burn::tensor::DType::BF16 => {
                        burn::tensor::bf16::from_f32(g.embed_scale).to_f32()
                    }
                    burn::tensor::DType::F16 => burn::tensor::f16::from_f32(g.embed_scale).to_f32(),
                    _ => g.embed_scale,
                };
                x.mul_scalar(scale)
            }
            None => x,
        };
        match &self.position {
            Some(position) => {
                let positions = match documents {
                    Some(d) => {
                        let at: Vec<i64> = d.positions().iter().map(|&p| p as i64).collect();
                        Tensor::<2, Int>::from_data(TensorData::new(at, [b, s]), &device)
                    }
                    None => Tensor::<1, Int>::arange(0..s as i64, &device)
                        .unsqueeze::<2>()
                        .expand([b, s]),
                };
                x + position.forward(positions)
            }
            None => x,
        }
    }

    /// This stage's blocks in order.
    pub fn blocks_forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.blocks_forward_dropping(x, None, 0, None)
    }

    /// [`Self::blocks_forward`] in training: `dropout` is the micro-batch's
    /// key, block `k` of the stage is model layer `first_layer + k`, and
    /// the batch is packed by `documents` where given.
    pub fn blocks_forward_dropping(
        &self,
        x: Tensor<3>,
        dropout: Option<AdapterDropout>,
        first_layer: u32,
        documents: Option<&Documents>,
    ) -> Tensor<3> {
        self.blocks
            .iter()
            .zip(first_layer..)
            .fold(x, |x, (block, layer)| {
                // The near-OOM guard looks before each block (a no-op without one).
                crate::memory_guard::check(
                    crate::memory_guard::Phase::Forward,
                    layer - first_layer,
                );
                block.forward_dropping(x, dropout.map(|d| d.part(u64::from(layer))), documents)
            })
    }

    /// The last stage's head: the final norm over `x` [batch, seq, hidden]
    /// as [batch·seq, hidden], and the projection's weight as [vocab, hidden]
    /// (the token embedding's own layout; a Linear's `[hidden, vocab]` seen
    /// transposed, no copy). Neither family's head has a bias ([`Self::new`]).
    fn head_parts(&self, x: Tensor<3>) -> (Tensor<2>, Tensor<2>) {
        let head = self.head.as_ref().expect("the head on a stage without it");
        let [b, s, h] = x.dims();
        let x = match &head.norm {
            FinalNorm::Layer(n) => n.forward(x),
            FinalNorm::Rms(n) => llama::norm(n, x, self.gemma.is_some()),
        }
        .reshape([b * s, h]);
        match (&head.projection, &self.token) {
            (Some(projection), _) => (x, projection.weight.val().transpose()),
            (None, Some(token)) => (x, token.weight.val()),
            (None, None) => panic!("a tied head without the token embedding"),
        }
    }

    /// Final norm and output head. [batch, seq, hidden] → logits [batch·seq, vocab].
    pub fn logits(&self, x: Tensor<3>) -> Tensor<2> {
        let (x, weight) = self.head_parts(x);
        let logits = x.matmul(weight.transpose());
        match self.final_softcap() {
            Some(cap) => logits.div_scalar(cap).tanh().mul_scalar(cap),
            None => logits,
        }
    }

    /// Gemma's `final_logit_softcapping`, where the model has it.
    fn final_softcap(&self) -> Option<f64> {
        self.gemma.and_then(|g| g.final_softcap)
    }

    /// Mean next-token cross-entropy of the head over `x`, against `targets`
    /// [batch, seq], without ever holding the whole logits
    /// ([`lean::fused_cross_entropy`], the planner's
    /// [`headroom_planner::LOSS_CHUNK_ELEMENTS`] logits at a time).
    ///
    /// Targets of [`crate::data::IGNORED_TARGET`] (masked: a prompt, a
    /// user turn) take no part: the mean is over the others, whose rows
    /// alone go through the head (their gradient reaches the rest by the
    /// selection's backward). With every target masked the loss is 0,
    /// with a zero gradient.
    pub fn head_loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        self.head_loss_scaled(x, targets, 1.0)
    }

    /// [`Self::head_loss`] for a backward from `loss · grad_scale` (the
    /// trainer's mean over micro-batches and fp16's loss scale): the loss's
    /// gradients are formed in its forward at that scale
    /// ([`lean::fused_cross_entropy_capped`]).
    pub fn head_loss_scaled(
        &self,
        x: Tensor<3>,
        targets: Tensor<2, Int>,
        grad_scale: f64,
    ) -> Tensor<1> {
        let [b, s] = targets.dims();
        let (x, weight) = self.head_parts(x);
        let chunk = headroom_planner::memory::loss_chunk_rows(weight.dims()[0] as u64) as usize;
        let targets = targets.reshape([b * s]);
        let (x, targets, scale) = match trained_rows(&targets) {
            None => (x, targets, None),
            Some(rows) if rows.is_empty() => {
                // Row 0 with a valid target, times zero: a loss with a graph.
                let first = Tensor::<1, Int>::zeros([1], &targets.device());
                (x.narrow(0, 0, 1), first, Some(0.0))
            }
            Some(rows) => {
                let n = rows.len();
                let rows =
                    Tensor::<1, Int>::from_data(TensorData::new(rows, [n]), &targets.device());
                (x.select(0, rows.clone()), targets.select(0, rows), None)
            }
        };
        let loss = lean::fused_cross_entropy_capped(
            x,
            weight,
            targets,
            chunk,
            self.final_softcap(),
            grad_scale,
        );
        match scale {
            Some(scale) => loss.mul_scalar(scale),
            None => loss,
        }
    }

    /// Full forward to logits [batch·seq, vocab] (a single-stage model).
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<2> {
        self.logits(self.blocks_forward(self.embed(tokens)))
    }

    /// Mean next-token cross-entropy over the whole model (a single-stage model).
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        self.loss_in(tokens, targets, None)
    }

    /// [`Self::loss`] of a batch packed by `documents`, where given.
    pub fn loss_in(
        &self,
        tokens: Tensor<2, Int>,
        targets: Tensor<2, Int>,
        documents: Option<&Documents>,
    ) -> Tensor<1> {
        let x = self.embed_in(tokens, documents);
        self.head_loss(self.blocks_forward_dropping(x, None, 0, documents), targets)
    }
}

/// The rows whose target is not masked; `None` when none is masked.
fn trained_rows(targets: &Tensor<1, Int>) -> Option<Vec<i64>> {
    let data = targets.to_data();
    let values: Vec<i64> = data.iter::<i64>().collect();
    if values.iter().all(|&t| t >= 0) {
        return None;
    }
    Some(
        values
            .iter()
            .enumerate()
            .filter(|&(_, &t)| t >= 0)
            .map(|(i, _)| i as i64)
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(tied: bool, ff: Option<u32>) -> TransformerShape {
        TransformerShape {
            layers: 3,
            hidden: 32,
            heads: 4,
            sequence_length: 16,
            vocabulary: 50,
            feed_forward: ff,
            tied_embeddings: tied,
        }
    }

    #[test]
    fn parameter_count_matches_the_planner() {
        let device = Device::flex();
        for (tied, ff) in [
            (true, None),
            (false, None),
            (true, Some(40)),
            (false, Some(72)),
        ] {
            let s = shape(tied, ff);
            let model = TransformerLm::new(
                &LmShape::Gpt(s.clone()),
                &StageLayout::whole(&LmShape::Gpt(s.clone())),
                1,
                &device,
            );
            assert_eq!(
                model.num_params() as u64,
                s.total_params(),
                "tied {tied}, feed-forward {ff:?}"
            );
        }
    }

    #[test]
    fn stage_parameter_counts_match_the_planner() {
        let device = Device::flex();
        for tied in [true, false] {
            let s = shape(tied, None);
            let layouts = [
                (0..1, true, false),
                (1..2, false, false),
                (2..3, false, true),
                (0..2, true, false),
            ];
            let mut sum = 0;
            for (layers, first, last) in layouts {
                let layout = StageLayout {
                    layers: layers.clone(),
                    first,
                    last,
                };
                let model = TransformerLm::new(&LmShape::Gpt(s.clone()), &layout, 1, &device);
                let mut expected = u64::from(layers.end - layers.start) * s.params_per_layer();
                if first {
                    expected += s.embedding_params();
                }
                if last {
                    expected += s.head_params();
                    if tied && !first {
                        expected += u64::from(s.vocabulary) * u64::from(s.hidden);
                    }
                }
                assert_eq!(
                    model.num_params() as u64,
                    expected,
                    "tied {tied}, {layout:?}"
                );
                if layers.end <= 3 && layers.len() == 1 {
                    sum += model.num_params() as u64;
                }
            }
            let copy = if tied {
                u64::from(s.vocabulary) * u64::from(s.hidden)
            } else {
                0
            };
            assert_eq!(sum, s.total_params() + copy);
        }
    }

    #[test]
    fn weights_do_not_depend_on_the_split() {
        let device = Device::flex();
        let s = shape(true, None);
        let whole = TransformerLm::new(
            &LmShape::Gpt(s.clone()),
            &StageLayout::whole(&LmShape::Gpt(s.clone())),
            9,
            &device,
        );
        let last = TransformerLm::new(
            &LmShape::Gpt(s.clone()),
            &StageLayout {
                layers: 2..3,
                first: false,
                last: true,
            },
            9,
            &device,
        );
        let values = |m: &Block| {
            let Block::Gpt(m) = m else {
                panic!("a GPT block")
            };
            m.ff_in
                .weight
                .val()
                .into_data()
                .iter::<f32>()
                .collect::<Vec<_>>()
        };
        assert_eq!(values(&whole.blocks[2]), values(&last.blocks[0]));
        let token = |m: &TransformerLm| {
            m.token
                .as_ref()
                .expect("token")
                .weight
                .val()
                .into_data()
                .iter::<f32>()
                .collect::<Vec<_>>()
        };
        assert_eq!(
            token(&whole),
            token(&last),
            "the tied head's copy starts equal"
        );
        assert_ne!(values(&whole.blocks[1]), values(&whole.blocks[2]));
    }

    #[test]
    fn attention_is_causal() {
        let device = Device::flex();
        let s = shape(true, None);
        let model = TransformerLm::new(
            &LmShape::Gpt(s.clone()),
            &StageLayout::whole(&LmShape::Gpt(s.clone())),
            3,
            &device,
        );
        let a: Vec<i64> = (0..16).map(|i| i % 7).collect();
        let mut b = a.clone();
        b[15] = 42; // only the last token differs
        let logits = |t: Vec<i64>| {
            model
                .forward(Tensor::<2, Int>::from_data(
                    burn::tensor::TensorData::new(t, [1, 16]),
                    &device,
                ))
                .into_data()
                .iter::<f32>()
                .collect::<Vec<_>>()
        };
        let (la, lb) = (logits(a), logits(b));
        let v = 50;
        // Positions 0..15 cannot see token 15.
        for i in 0..15 * v {
            assert!(
                (la[i] - lb[i]).abs() < 1e-5,
                "position {} saw the future",
                i / v
            );
        }
        assert!((15 * v..16 * v).any(|i| (la[i] - lb[i]).abs() > 1e-6));
    }

    /// A tiny Llama (RoPE, grouped-query attention) with random weights.
    fn llama(device: &Device) -> TransformerLm {
        let text = r#"{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": 50, "hidden_size": 32, "intermediate_size": 40,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "max_position_embeddings": 64}"#;
        let shape = LmShape::Llama(LlamaShape::from_hf_config(text, 16).expect("config"));
        TransformerLm::new(&shape, &StageLayout::whole(&shape), 5, device)
    }

    /// The loss of one sample packed by documents: documents `a` and `b`
    /// (token ids), then padding, against the token-weighted loss of each
    /// document run alone as its own sample. Returns their relative gap.
    fn packed_against_alone(model: &TransformerLm, a: &[i64], b: &[i64], s: usize) -> f64 {
        let device = Device::flex();
        let tensor = |v: Vec<i64>, n: usize| {
            Tensor::<2, Int>::from_data(TensorData::new(v, [1, n]), &device)
        };
        let loss = |tokens, targets, documents: Option<&Documents>| {
            f64::from(
                model
                    .loss_in(tokens, targets, documents)
                    .into_scalar::<f32>(),
            )
        };
        let alone = |doc: &[i64]| {
            let n = doc.len() - 1;
            (
                loss(
                    tensor(doc[..n].to_vec(), n),
                    tensor(doc[1..].to_vec(), n),
                    None,
                ),
                n as f64,
            )
        };
        // The sample's s + 1 tokens; a target is trained where it continues its document.
        let pad = 0;
        let mut tokens: Vec<i64> = a.iter().chain(b).copied().collect();
        let mut ids: Vec<u32> = [(0, a.len()), (1, b.len())]
            .iter()
            .flat_map(|&(d, n)| std::iter::repeat_n(d, n))
            .collect();
        tokens.resize(s + 1, pad);
        ids.resize(s + 1, 2);
        let targets: Vec<i64> = (0..s)
            .map(|j| {
                let trained = ids[j + 1] == ids[j] && ids[j + 1] < 2;
                if trained {
                    tokens[j + 1]
                } else {
                    crate::data::IGNORED_TARGET
                }
            })
            .collect();
        let documents = Documents::new(&ids[..s], 1, s);
        assert_eq!(
            documents.positions()[a.len()],
            0,
            "the second document starts at 0"
        );
        let packed = loss(
            tensor(tokens[..s].to_vec(), s),
            tensor(targets, s),
            Some(&documents),
        );
        let ((la, na), (lb, nb)) = (alone(a), alone(b));
        let weighted = (la * na + lb * nb) / (na + nb);
        (packed - weighted).abs() / weighted
    }

    #[test]
    fn a_sample_of_documents_trains_each_as_if_alone() {
        let device = Device::flex();
        let a: Vec<i64> = (0..6).map(|i| (i * 7 + 3) % 50).collect();
        let b: Vec<i64> = (0..7).map(|i| (i * 11 + 5) % 50).collect();
        // Learned positions (GPT) show a restart; RoPE (Llama) is relative,
        // so there the blocked attention is what is shown.
        let s = shape(false, None);
        let gpt = TransformerLm::new(
            &LmShape::Gpt(s.clone()),
            &StageLayout::whole(&LmShape::Gpt(s)),
            3,
            &device,
        );
        for (name, model) in [("gpt", gpt), ("llama", llama(&device))] {
            let gap = packed_against_alone(&model, &a, &b, 16);
            eprintln!("{name}: packed vs alone, relative gap {gap:e}");
            // f32 sums over other shapes: measured ≤ 1e-7 here.
            assert!(
                gap < 1e-5,
                "{name}: the packed loss is {gap:e} off the documents' own"
            );
            // Without the documents the second one sees the first, and
            // its positions do not restart: a loss of another sample.
            let tokens: Vec<i64> = a.iter().chain(&b).copied().collect();
            let n = tokens.len() - 1;
            let tensor =
                |v: Vec<i64>| Tensor::<2, Int>::from_data(TensorData::new(v, [1, n]), &device);
            let mut targets = tokens[1..].to_vec();
            targets[a.len() - 1] = crate::data::IGNORED_TARGET;
            let ids: Vec<u32> = (0..n).map(|t| u32::from(t >= a.len())).collect();
            let blocked = model.loss_in(
                tensor(tokens[..n].to_vec()),
                tensor(targets.clone()),
                Some(&Documents::new(&ids, 1, n)),
            );
            let streamed = model.loss(tensor(tokens[..n].to_vec()), tensor(targets));
            let (x, y) = (blocked.into_scalar::<f32>(), streamed.into_scalar::<f32>());
            assert!(
                (x - y).abs() > 1e-4,
                "{name}: documents changed nothing ({x} vs {y})"
            );
        }
    }
}
