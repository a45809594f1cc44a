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

/// The language model of one pipeline stage (today: always the whole model).
#[derive(Module, Debug)]
pub struct TransformerLm {
    token: Embedding,
    position: Embedding,
    pub blocks: Vec<Block>,
    ln_f: LayerNorm,
    /// `None` when the head is tied to the token embedding.
    head: Option<Linear>,
}

impl TransformerLm {
    /// Builds the blocks in `layers` (a stage's range) with fresh weights.
    /// The embeddings and the head are built too: a single-stage worker holds
    /// both ends. Seed the device first for reproducible weights.
    pub fn new(shape: &TransformerShape, layers: Range<u32>, device: &Device) -> Self {
        let h = shape.hidden as usize;
        let init = Initializer::Normal {
            mean: 0.0,
            std: EMBEDDING_INIT_STD,
        };
        TransformerLm {
            token: EmbeddingConfig::new(shape.vocabulary as usize, h)
                .with_initializer(init.clone())
                .init(device),
            position: EmbeddingConfig::new(shape.sequence_length as usize, h)
                .with_initializer(init)
                .init(device),
            blocks: layers.map(|_| Block::new(shape, device)).collect(),
            ln_f: LayerNormConfig::new(h).init(device),
            head: (!shape.tied_embeddings).then(|| {
                LinearConfig::new(h, shape.vocabulary as usize)
                    .with_bias(false)
                    .init(device)
            }),
        }
    }

    /// Runs every parameter's (lazy) initialiser now. burn draws initial
    /// weights on first use from a generator shared by the whole process, so
    /// a caller that wants reproducible weights seeds and then materialises
    /// while holding that generator.
    pub fn materialize_params(&self) {
        struct Touch;
        impl ModuleVisitor for Touch {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
                let _ = param.val();
            }
        }
        self.visit(&mut Touch);
    }

    /// Token + position embeddings. `tokens`: [batch, seq] → [batch, seq, hidden].
    pub fn embed(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let [b, s] = tokens.dims();
        let device = tokens.device();
        let positions = Tensor::<1, Int>::arange(0..s as i64, &device)
            .unsqueeze::<2>()
            .expand([b, s]);
        self.token.forward(tokens) + self.position.forward(positions)
    }

    /// Final norm and output head. [batch, seq, hidden] → logits [batch·seq, vocab].
    pub fn logits(&self, x: Tensor<3>) -> Tensor<2> {
        let [b, s, h] = x.dims();
        let x = self.ln_f.forward(x).reshape([b * s, h]);
        match &self.head {
            Some(head) => head.forward(x),
            None => x.matmul(self.token.weight.val().transpose()),
        }
    }

    /// Mean next-token cross-entropy of the head over `x`, against `targets` [batch, seq].
    pub fn head_loss(&self, x: Tensor<3>, targets: Tensor<2, Int>) -> Tensor<1> {
        let [b, s] = targets.dims();
        let logp = log_softmax(self.logits(x), 1); // [b·s, v]
        logp.gather(1, targets.reshape([b * s, 1])).mean().neg()
    }

    /// Full forward to logits [batch·seq, vocab].
    pub fn forward(&self, tokens: Tensor<2, Int>) -> Tensor<2> {
        let x = self
            .blocks
            .iter()
            .fold(self.embed(tokens), |x, block| block.forward(x));
        self.logits(x)
    }

    /// Mean next-token cross-entropy over the whole model.
    pub fn loss(&self, tokens: Tensor<2, Int>, targets: Tensor<2, Int>) -> Tensor<1> {
        let x = self
            .blocks
            .iter()
            .fold(self.embed(tokens), |x, block| block.forward(x));
        self.head_loss(x, targets)
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
            let model = TransformerLm::new(&s, 0..s.layers, &device);
            assert_eq!(
                model.num_params() as u64,
                s.total_params(),
                "tied {tied}, feed-forward {ff:?}"
            );
        }
    }

    #[test]
    fn attention_is_causal() {
        let device = Device::flex();
        device.seed(3);
        let s = shape(true, None);
        let model = TransformerLm::new(&s, 0..s.layers, &device);
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
