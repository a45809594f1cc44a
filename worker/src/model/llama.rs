//! One Llama-family decoder block as Hugging Face's `LlamaDecoderLayer`
//! computes it (Mistral's and Qwen2's are the same block; Qwen2 adds biases to
//! q, k and v): RMSNorm → self-attention with rotary positions and
//! grouped-query attention → residual, RMSNorm → SwiGLU MLP → residual.
//!
//! Field names follow Hugging Face's module names (`self_attn.q_proj`,
//! `mlp.gate_proj`, `input_layernorm`, …) so a checkpoint's tensors map onto
//! the module by a prefix alone (see [`super::hf`]).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::tensor::activation::silu;
use burn::tensor::{Device, Tensor, TensorData};
use headroom_planner::{LlamaShape, TargetModule};

use super::lean::linear::{self, AdapterDropout};
use super::lean::{ATTENTION_BLOCK, AttentionOptions, attend};
use super::nf4::Nf4Bases;

/// Rotary position embedding in Hugging Face's layout: the two halves of a
/// head's vector are rotated against each other (`rotate_half`), not
/// adjacent pairs. burn's `RotaryEncoding` rotates adjacent pairs (Meta's
/// original layout), which would need the q/k weights permuted on load and
/// back on save; applying HF's layout directly keeps the checkpoint's
/// tensors as they are.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    head_dim: usize,
    /// Inverse frequencies, one per rotated pair (head_dim / 2).
    inv_freq: Vec<f32>,
}

impl Rope {
    /// `theta`: the RoPE base (`rope_theta`); `scaling`: Llama 3's frequency
    /// scaling where the config asks for it.
    pub fn new(head_dim: usize, theta: f64, scaling: Option<&Llama3RopeScaling>) -> Self {
        // As transformers computes it: in f32, exponent 2i/d.
        let inv_freq = (0..head_dim / 2)
            .map(|i| 1.0 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .map(|f| scaling.map_or(f, |s| s.scale(f)))
            .collect();
        Rope { head_dim, inv_freq }
    }

    /// cos and sin for positions 0..seq, each [seq, head_dim] (halves repeated).
    fn tables(&self, seq: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let d = self.head_dim;
        let mut cos = Vec::with_capacity(seq * d);
        let mut sin = Vec::with_capacity(seq * d);
        for p in 0..seq {
            for _half in 0..2 {
                for f in &self.inv_freq {
                    let angle = p as f32 * f;
                    cos.push(angle.cos());
                    sin.push(angle.sin());
                }
            }
        }
        (
            Tensor::from_data(TensorData::new(cos, [seq, d]), device),
            Tensor::from_data(TensorData::new(sin, [seq, d]), device),
        )
    }

    /// Rotates `x` [batch, heads, seq, head_dim] by position.
    fn apply(&self, x: Tensor<4>, cos: &Tensor<2>, sin: &Tensor<2>) -> Tensor<4> {
        let [b, a, s, d] = x.dims();
        let half = d / 2;
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        let cos = cos.clone().unsqueeze::<4>().expand([b, a, s, d]);
        let sin = sin.clone().unsqueeze::<4>().expand([b, a, s, d]);
        x * cos + rotated * sin
    }
}

/// `rope_scaling` with `rope_type: llama3` (Llama 3.1/3.2): long wavelengths
/// are slowed by `factor`, short ones kept, the band between interpolated.
#[derive(Clone, Debug, PartialEq)]
pub struct Llama3RopeScaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: f32,
}

impl Llama3RopeScaling {
    fn scale(&self, inv_freq: f32) -> f32 {
        let low_wavelen = self.original_max_position_embeddings / self.low_freq_factor;
        let high_wavelen = self.original_max_position_embeddings / self.high_freq_factor;
        let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
        if wavelen > low_wavelen {
            inv_freq / self.factor
        } else if wavelen < high_wavelen {
            inv_freq
        } else {
            let smooth = (self.original_max_position_embeddings / wavelen - self.low_freq_factor)
                / (self.high_freq_factor - self.low_freq_factor);
            (1.0 - smooth) * inv_freq / self.factor + smooth * inv_freq
        }
    }
}

/// Causal self-attention with `heads` query heads sharing `kv_heads` key/value heads.
#[derive(Module, Debug)]
pub struct LlamaAttention {
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// SwiGLU: down(silu(gate(x)) · up(x)).
#[derive(Module, Debug)]
pub struct LlamaMlp {
    pub gate_proj: Linear,
    pub up_proj: Linear,
    pub down_proj: Linear,
}

/// One decoder block.
#[derive(Module, Debug)]
pub struct LlamaBlock {
    pub input_layernorm: RmsNorm,
    pub self_attn: LlamaAttention,
    pub post_attention_layernorm: RmsNorm,
    pub mlp: LlamaMlp,
    /// The seven linears' frozen weights under QLoRA with an NF4 base (the
    /// linears then hold empty placeholders); empty otherwise. Not part of
    /// the module's record: a run re-quantizes the pretrained checkpoint.
    #[module(skip)]
    pub nf4: Nf4Bases,
    rope_theta: f64,
    rope_scaling: Option<[f32; 4]>,
}

/// `LlamaShape`'s RMSNorm with the shape's epsilon.
pub fn rms_norm(shape: &LlamaShape, device: &Device) -> RmsNorm {
    RmsNormConfig::new(shape.hidden as usize)
        .with_epsilon(shape.rms_norm_eps)
        .init(device)
}

impl LlamaBlock {
    /// A block with burn's default initialisation; its weights are normally
    /// replaced by a checkpoint's (see [`super::hf`]).
    pub fn new(shape: &LlamaShape, device: &Device) -> Self {
        let h = shape.hidden as usize;
        let i = shape.intermediate as usize;
        let (q, kv) = (shape.q_dim() as usize, shape.kv_dim() as usize);
        let qkv_bias = shape.attention_bias;
        // Qwen2's o_proj has no bias; Llama's attention_bias puts one on all four.
        let o_bias = shape.attention_bias
            && shape.architecture != headroom_planner::LlamaArchitecture::Qwen2;
        let linear = |i, o, bias| LinearConfig::new(i, o).with_bias(bias).init(device);
        LlamaBlock {
            input_layernorm: rms_norm(shape, device),
            self_attn: LlamaAttention {
                q_proj: linear(h, q, qkv_bias),
                k_proj: linear(h, kv, qkv_bias),
                v_proj: linear(h, kv, qkv_bias),
                o_proj: linear(q, h, o_bias),
                heads: shape.attention_heads as usize,
                kv_heads: shape.key_value_heads as usize,
                head_dim: shape.head_dim as usize,
            },
            post_attention_layernorm: rms_norm(shape, device),
            mlp: LlamaMlp {
                gate_proj: linear(h, i, shape.mlp_bias),
                up_proj: linear(h, i, shape.mlp_bias),
                down_proj: linear(i, h, shape.mlp_bias),
            },
            nf4: Nf4Bases::default(),
            rope_theta: shape.rope_theta,
            rope_scaling: shape.rope_scaling.as_ref().map(|s| {
                [
                    s.factor,
                    s.low_freq_factor,
                    s.high_freq_factor,
                    s.original_max_position_embeddings,
                ]
            }),
        }
    }

    fn rope(&self) -> Rope {
        let scaling = self.rope_scaling.map(|[f, l, h, o]| Llama3RopeScaling {
            factor: f,
            low_freq_factor: l,
            high_freq_factor: h,
            original_max_position_embeddings: o,
        });
        Rope::new(self.self_attn.head_dim, self.rope_theta, scaling.as_ref())
    }

    /// [batch, seq, hidden] → [batch, seq, hidden].
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_dropping(x, None)
    }

    /// [`Self::forward`] with this block's adapter dropout (training).
    pub fn forward_dropping(&self, x: Tensor<3>, dropout: Option<AdapterDropout>) -> Tensor<3> {
        let projections = Projections {
            nf4: &self.nf4,
            dropout,
        };
        let attn = self.self_attn.forward(
            self.input_layernorm.forward(x.clone()),
            &self.rope(),
            &projections,
        );
        let x = x + attn;
        let mlp = self.mlp.forward(
            self.post_attention_layernorm.forward(x.clone()),
            &projections,
        );
        x + mlp
    }
}

/// What a block's linears share in one forward: the NF4 bases standing in
/// for their weights and the adapter dropout's key.
struct Projections<'a> {
    nf4: &'a Nf4Bases,
    dropout: Option<AdapterDropout>,
}

impl Projections<'_> {
    fn forward(&self, module: TargetModule, linear: &Linear, x: Tensor<3>) -> Tensor<3> {
        let dropout = self.dropout.map(|d| d.part(module as u64));
        linear::forward(linear, self.nf4.get(module), x, dropout)
    }
}

impl LlamaMlp {
    fn forward(&self, x: Tensor<3>, p: &Projections) -> Tensor<3> {
        use TargetModule::{DownProj, GateProj, UpProj};
        let gate = silu(p.forward(GateProj, &self.gate_proj, x.clone()));
        let up = p.forward(UpProj, &self.up_proj, x);
        p.forward(DownProj, &self.down_proj, gate * up)
    }
}

impl LlamaAttention {
    /// `x`: [batch, seq, hidden] (already normalised) → [batch, seq, hidden].
    fn forward(&self, x: Tensor<3>, rope: &Rope, p: &Projections) -> Tensor<3> {
        use TargetModule::{KProj, OProj, QProj, VProj};
        let [b, s, _] = x.dims();
        let (a, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        let device = x.device();
        let heads = |t: Tensor<3>, n: usize| t.reshape([b, s, n, d]).swap_dims(1, 2); // [b, n, s, d]
        let q = heads(p.forward(QProj, &self.q_proj, x.clone()), a);
        let k = heads(p.forward(KProj, &self.k_proj, x.clone()), kv);
        let v = heads(p.forward(VProj, &self.v_proj, x), kv);
        let (cos, sin) = rope.tables(s, &device);
        let q = rope.apply(q, &cos, &sin);
        let k = rope.apply(k, &cos, &sin);
        // Each key/value head serves a / kv consecutive query heads; the
        // blocked op reads them in place (see `lean::attention`).
        let options = AttentionOptions::causal(d, ATTENTION_BLOCK);
        let context = attend(q, k, v, options)
            .swap_dims(1, 2)
            .reshape([b, s, a * d]);
        p.forward(OProj, &self.o_proj, context)
    }
}
