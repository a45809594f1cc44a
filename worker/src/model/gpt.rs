//! One GPT-style block of the synthetic `transformer` model (kept for the
//! benchmarks and the control-loop tests): pre-norm causal self-attention
//! with a fused QKV projection, then a GELU feed-forward, each with a
//! residual. No dropout: the planner's memory model assumes mask bytes of 0.

use burn::module::Module;
use burn::nn::{LayerNorm, LayerNormConfig, Linear, LinearConfig};
use burn::tensor::activation::gelu;
use burn::tensor::{Device, Tensor};
use headroom_planner::TransformerShape;

use super::Documents;
use super::lean::linear::on_rows;
use super::lean::{AttentionOptions, attend, attention_block};

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

    /// `x`: [batch, seq, hidden] → [batch, seq, hidden]; attention stays
    /// inside each of `documents` where given.
    fn forward(&self, x: Tensor<3>, documents: Option<&Documents>) -> Tensor<3> {
        let [b, s, h] = x.dims();
        let a = self.heads;
        let d = h / a;
        let qkv = on_rows(x, |x| self.qkv.forward(x)); // [b, s, 3h]
        let split = |i: usize| {
            qkv.clone()
                .narrow(2, i * h, h)
                .reshape([b, s, a, d])
                .swap_dims(1, 2) // [b, a, s, d]
        };
        let (q, k, v) = (split(0), split(1), split(2));
        let options = AttentionOptions {
            segments: documents.map(|d| d.segments().clone()),
            ..AttentionOptions::causal(d, attention_block(&q.device()))
        };
        let context = attend(q, k, v, options).swap_dims(1, 2).reshape([b, s, h]); // [b, s, h]
        on_rows(context, |x| self.out.forward(x))
    }
}

/// One pre-norm block: x + attn(ln1(x)), then + ff(ln2(·)).
#[derive(Module, Debug)]
pub struct GptBlock {
    ln1: LayerNorm,
    attention: Attention,
    ln2: LayerNorm,
    pub(crate) ff_in: Linear,
    ff_out: Linear,
}

impl GptBlock {
    pub fn new(shape: &TransformerShape, device: &Device) -> Self {
        let h = shape.hidden as usize;
        let f = shape.ffn() as usize;
        GptBlock {
            ln1: LayerNormConfig::new(h).init(device),
            attention: Attention::new(h, shape.heads as usize, device),
            ln2: LayerNormConfig::new(h).init(device),
            ff_in: LinearConfig::new(h, f).init(device),
            ff_out: LinearConfig::new(f, h).init(device),
        }
    }

    /// [batch, seq, hidden] → [batch, seq, hidden].
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_in(x, None)
    }

    /// [`Self::forward`] over a batch packed by `documents`, where given.
    pub fn forward_in(&self, x: Tensor<3>, documents: Option<&Documents>) -> Tensor<3> {
        let x = x.clone() + self.attention.forward(self.ln1.forward(x), documents);
        let inner = on_rows(self.ln2.forward(x.clone()), |x| self.ff_in.forward(x));
        let ff = on_rows(gelu(inner), |x| self.ff_out.forward(x));
        x + ff
    }
}
