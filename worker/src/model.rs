//! The decoder-only transformer the worker trains, built from the job's
//! [`TransformerShape`]: token + learned position embeddings, pre-norm blocks
//! (causal self-attention, GELU feed-forward), a final layer norm and an
//! output head tied to the token embedding unless the shape says otherwise.
//!
//! No dropout (the planner's memory model assumes mask bytes of 0). The
//! parameter count equals the planner's `TransformerShape::total_params`;
//! a test pins that, so the memory model and the worker cannot drift.
//!
//! Besides the plain [`TransformerLm::forward`], the model exposes its three
//! parts (embedding, one block, head + loss) so the trainer can run
//! block-level activation checkpointing: keep each block's input, recompute
//! one block at a time in backward.

use std::ops::Range;

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{
    Embedding, EmbeddingConfig, Initializer, LayerNorm, LayerNormConfig, Linear, LinearConfig,
};
use burn::tensor::activation::{gelu, log_softmax, softmax};
use burn::tensor::{Bool, Device, Int, Tensor};
use headroom_planner::TransformerShape;

/// Standard deviation of the normal initialiser for embeddings (GPT-2's 0.02).
const EMBEDDING_INIT_STD: f64 = 0.02;

/// Causal multi-head self-attention: one fused QKV projection (3h² + 3h) and
/// an output projection (h² + h).
#[derive(Module, Debug)]
pub struct Attention {
    qkv: Linear,
    out: Linear,
    heads: usize,
}

impl Attention {
    fn new(hidden: usize, heads: usize, device: &Device) -> Self {
        Attention {
            qkv: LinearConfig::new(hidden, 3 * hidden).init(device),
            out: LinearConfig::new(hidden, hidden).init(device),
            heads,
        }
    }

    /// `x`: [batch, seq, hidden] → [batch, seq, hidden].
    fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let [b, s, h] = x.dims();
        let a = self.heads;
        let d = h / a;
        let qkv = self.qkv.forward(x); // [b, s, 3h]
        let split = |i: usize| {
            qkv.clone()
                .narrow(2, i * h, h)
                .reshape([b, s, a, d])
                .swap_dims(1, 2) // [b, a, s, d]
        };
        let (q, k, v) = (split(0), split(1), split(2));
        let scores = q.matmul(k.swap_dims(2, 3)).div_scalar((d as f64).sqrt()); // [b, a, s, s]
        // True above the diagonal: the future each position must not see.
        let future = Tensor::<2, Bool>::tril_mask([s, s], 0, &scores.device())
            .unsqueeze::<4>()
            .expand([b, a, s, s]);
        let weights = softmax(scores.mask_fill(future, -1.0e30), 3);
        let context = weights.matmul(v).swap_dims(1, 2).reshape([b, s, h]); // [b, s, h]
        self.out.forward(context)
    }
}

/// One pre-norm block: x + attn(ln1(x)), then + ff(ln2(·)).
#[derive(Module, Debug)]
pub struct Block {
    ln1: LayerNorm,
    attention: Attention,
    ln2: LayerNorm,
    ff_in: Linear,
    ff_out: Linear,
}

impl Block {
    fn new(shape: &TransformerShape, device: &Device) -> Self {
        let h = shape.hidden as usize;
        let f = shape.ffn() as usize;
        Block {
            ln1: LayerNormConfig::new(h).init(device),
            attention: Attention::new(h, shape.heads as usize, device),
            ln2: LayerNormConfig::new(h).init(device),
            ff_in: LinearConfig::new(h, f).init(device),
            ff_out: LinearConfig::new(f, h).init(device),
        }
    }

    /// [batch, seq, hidden] → [batch, seq, hidden].
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        let x = x.clone() + self.attention.forward(self.ln1.forward(x));
        let ff = self
            .ff_out
            .forward(gelu(self.ff_in.forward(self.ln2.forward(x.clone()))));
        x + ff
    }
}

/// Final layer norm and, unless the head is tied to the token embedding, the
/// output projection: the last stage's part after its blocks.
#[derive(Module, Debug)]
pub struct Head {
    ln_f: LayerNorm,
    projection: Option<Linear>,
}

/// What one pipeline stage holds of the language model.
///
/// The first stage holds the token and position embeddings, the last the
/// final norm and head (and computes the loss); a single stage holds all of
/// it. A tied head on a last stage that is not also the first needs the token
/// embedding too: that stage keeps its own copy, initialised identically, and
/// the two copies are kept equal by summing their gradients across the
/// pipeline before each update (see [`crate::pipeline`]).
///
/// Every part is initialised from its own seed ([`part_seed`]), so a stage's
/// weights do not depend on how the model is split: p = 1, 2, 3 stages start
/// from the same model.
#[derive(Module, Debug)]
pub struct TransformerLm {
    /// On the first stage, and on a last stage with a tied head.
    pub token: Option<Embedding>,
    /// On the first stage only.
    pub position: Option<Embedding>,
    pub blocks: Vec<Block>,
    /// On the last stage only.
    pub head: Option<Head>,
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
    pub fn whole(shape: &TransformerShape) -> Self {
        StageLayout {
            layers: 0..shape.layers,
            first: true,
            last: true,
        }
    }

    /// The parts this stage holds and saves, in a fixed order. The tied
    /// head's copy of the token embedding is not a part of its own: it is
    /// restored from the first stage's [`Part::Token`].
    pub fn parts(&self) -> Vec<Part> {
        let mut parts = Vec::new();
        if self.first {
            parts.extend([Part::Token, Part::Position]);
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

fn token_embedding(shape: &TransformerShape, device: &Device) -> Embedding {
    EmbeddingConfig::new(shape.vocabulary as usize, shape.hidden as usize)
        .with_initializer(embedding_init())
        .init(device)
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
    /// Builds and initialises the parts of one stage, each from its own seed.
    ///
    /// burn's generator is global to the process: models built concurrently
    /// (tests, stages in threads) take turns, so each gets its seeded weights.
    pub fn new(shape: &TransformerShape, layout: &StageLayout, seed: u64, device: &Device) -> Self {
        static INIT_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _guard = INIT_LOCK
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let h = shape.hidden as usize;
        let seeded = |part: Part| device.seed(part_seed(seed, part));
        let token = (layout.first || (layout.last && shape.tied_embeddings)).then(|| {
            seeded(Part::Token);
            let token = token_embedding(shape, device);
            materialize(&token);
            token
        });
        let position = layout.first.then(|| {
            seeded(Part::Position);
            let position = EmbeddingConfig::new(shape.sequence_length as usize, h)
                .with_initializer(embedding_init())
                .init(device);
            materialize(&position);
            position
        });
        let blocks = layout
            .layers
            .clone()
            .map(|i| {
                seeded(Part::Block(i));
                let block = Block::new(shape, device);
                materialize(&block);
                block
            })
            .collect();
        let head = layout.last.then(|| {
            seeded(Part::Head);
            let head = Head {
                ln_f: LayerNormConfig::new(h).init(device),
                projection: (!shape.tied_embeddings).then(|| {
                    LinearConfig::new(h, shape.vocabulary as usize)
                        .with_bias(false)
                        .init(device)
                }),
            };
            materialize(&head);
            head
        });
        TransformerLm {
            token,
            position,
            blocks,
            head,
        }
    }

    /// Holds the embeddings (the first stage).
    pub fn is_first(&self) -> bool {
        self.position.is_some()
    }

    /// Holds the head and computes the loss (the last stage).
    pub fn is_last(&self) -> bool {
        self.head.is_some()
    }

    /// Token + position embeddings. `tokens`: [batch, seq] → [batch, seq, hidden].
    pub fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let (Some(token), Some(position)) = (&self.token, &self.position) else {
            panic!("embed() on a stage without the embeddings");
        };
        let [b, s] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..s as i64, &device)
            .unsqueeze::<2>()
            .expand([b, s]);
        token.forward(tokens) + position.forward(positions)
    }

    /// This stage's blocks in order.
    pub fn blocks_forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.blocks.iter().fold(x, |x, block| block.forward(x))
    }

    /// Final norm and output head. [batch, seq, hidden] → logits [batch·seq, vocab].
    pub fn logits(&self, x: Tensor<3>) -> Tensor<2> {
        let head = self
            .head
            .as_ref()
            .expect("logits() on a stage without the head");
        let [b, s, h] = x.dims();
        let x = head.ln_f.forward(x).reshape([b * s, h]);
        match (&head.projection, &self.token) {
            (Some(projection), _) => projection.forward(x),
            (None, Some(token)) => x.matmul(token.weight.val().transpose()),
            (None, None) => panic!("a tied head without the token embedding"),
        }
    }

    /// Mean next-token cross-entropy of the head over `x`, against `targets` [batch, seq].
    pub fn head_loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        let [b, s] = targets.dims();
        let logp = log_softmax(self.logits(x), 1); // [b·s, v]
        logp.gather(1, targets.reshape([b * s, 1])).mean().neg()
    }

    /// Full forward to logits [batch·seq, vocab] (a single-stage model).
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<2> {
        self.logits(self.blocks_forward(self.embed(tokens)))
    }

    /// Mean next-token cross-entropy over the whole model (a single-stage model).
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        self.head_loss(self.blocks_forward(self.embed(tokens)), targets)
    }
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
            let model = TransformerLm::new(&s, &StageLayout::whole(&s), 1, &device);
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
                let model = TransformerLm::new(&s, &layout, 1, &device);
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
        let whole = TransformerLm::new(&s, &StageLayout::whole(&s), 9, &device);
        let last = TransformerLm::new(
            &s,
            &StageLayout {
                layers: 2..3,
                first: false,
                last: true,
            },
            9,
            &device,
        );
        let values = |m: &Block| {
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
        let model = TransformerLm::new(&s, &StageLayout::whole(&s), 3, &device);
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
}
