//! One Llama-family decoder block as Hugging Face's `LlamaDecoderLayer`
//! computes it (Mistral's and Qwen2's are the same block; Qwen2 adds biases to
//! q, k and v; Qwen3 normalises each head of q and k before RoPE; Phi-3
//! computes q, k, v with one matrix and gate, up with another, rotates part
//! of each head, with LongRoPE): RMSNorm → self-attention with rotary
//! positions and grouped-query attention → residual, RMSNorm → SwiGLU MLP →
//! residual.
//!
//! Gemma 2 and 3 keep these weights and names with another function:
//! every norm is Gemma's RMSNorm (x / rms(x) · (1 + weight), in f32, see
//! [`norm`]), each sublayer's output is normalised again before the
//! residual (`post_attention_layernorm`, `post_feedforward_layernorm`; the
//! MLP's input by `pre_feedforward_layernorm`), the MLP is GeGLU, the
//! attention scale is `query_pre_attn_scalar`^-½, sliding layers see a
//! window of recent tokens and turn RoPE with their own base; Gemma 3 has
//! Qwen3's q/k norms, Gemma 2 soft-caps the attention scores.
//!
//! Field names follow Hugging Face's module names (`self_attn.q_proj`,
//! `mlp.gate_proj`, `input_layernorm`, …) so a checkpoint's tensors map onto
//! the module by a prefix alone (see [`super::hf`]).

use burn::module::Module;
use burn::nn::{Linear, LinearConfig, RmsNorm, RmsNormConfig};
use burn::tensor::{DType, Device, Tensor, TensorData};
use headroom_planner::{LayerAttention, LlamaShape, RopeScaling, TargetModule};

use super::Documents;
use super::lean::linear::{self, AdapterDropout};
use super::lean::{self, AttentionOptions, GateActivation, attend};
use super::nf4::Nf4Bases;

/// Rotary position embedding in Hugging Face's layout: the two halves of a
/// head's vector are rotated against each other (`rotate_half`), not
/// adjacent pairs. burn's `RotaryEncoding` rotates adjacent pairs (Meta's
/// original layout), which would need the q/k weights permuted on load and
/// back on save; applying HF's layout directly keeps the checkpoint's
/// tensors as they are.
///
/// Only the first `rotary_dim` values of a head turn (Phi-3's
/// `partial_rotary_factor`); the rest pass through unchanged.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// The values of a head RoPE rotates (its first ones).
    rotary_dim: usize,
    /// Inverse frequencies, one per rotated pair (rotary_dim / 2).
    inv_freq: Vec<f32>,
    /// LongRoPE's frequencies for sequences longer than the pretraining
    /// context, and that context (tokens): transformers switches to them
    /// when a forward pass's positions run past it.
    long: Option<(Vec<f32>, usize)>,
    /// cos and sin are multiplied by it (LongRoPE's attention factor; 1 otherwise).
    scale: f32,
}

impl Rope {
    /// Layer `layer`'s RoPE in `shape`: its base (`rope_theta`; a Gemma
    /// sliding layer's own), rotated part of a head, and Llama 3's,
    /// LongRoPE's or (Gemma 3's global layers) linear frequency scaling
    /// where the config asks for it.
    pub fn new(shape: &LlamaShape, layer: u32) -> Self {
        let rotary_dim = shape.rotary_dim() as usize;
        if let Some(g) = &shape.gemma {
            let sliding = g.layer_types.get(layer as usize) == Some(&LayerAttention::Sliding);
            let (theta, factor) = if sliding {
                (g.local_rope_theta, 1.0)
            } else {
                (shape.rope_theta, g.global_rope_factor.unwrap_or(1.0))
            };
            // transformers: base^(2i/d) in f32, the linear type divides inv_freq by factor.
            let theta = theta as f32;
            let inv_freq = (0..rotary_dim / 2)
                .map(|i| 1.0 / theta.powf((2 * i) as f32 / rotary_dim as f32) / factor as f32)
                .collect();
            return Rope {
                rotary_dim,
                inv_freq,
                long: None,
                scale: 1.0,
            };
        }
        let theta = shape.rope_theta as f32;
        // As transformers computes it: in f32, exponent 2i/d over the rotated part.
        let base = |i: usize| theta.powf((2 * i) as f32 / rotary_dim as f32);
        let pairs = 0..rotary_dim / 2;
        if let Some(l) = &shape.long_rope {
            // transformers: 1 / (factor · base^(2i/d)).
            let freqs = |factors: &[f32]| {
                pairs
                    .clone()
                    .map(|i| 1.0 / (factors[i] * base(i)))
                    .collect()
            };
            return Rope {
                rotary_dim,
                inv_freq: freqs(&l.short_factor),
                long: Some((
                    freqs(&l.long_factor),
                    l.original_max_position_embeddings as usize,
                )),
                scale: l.attention_factor as f32,
            };
        }
        let inv_freq = pairs
            .map(|i| 1.0 / base(i))
            .map(|f| {
                shape
                    .rope_scaling
                    .as_ref()
                    .map_or(f, |s| llama3_scaled(s, f))
            })
            .collect();
        Rope {
            rotary_dim,
            inv_freq,
            long: None,
            scale: 1.0,
        }
    }

    /// cos and sin for positions 0..seq, each [1, 1, seq, rotary_dim] (halves repeated).
    fn tables(&self, seq: usize, device: &Device) -> (Tensor<4>, Tensor<4>) {
        let (cos, sin) = self.rows(0..seq, seq, device);
        (cos.unsqueeze::<4>(), sin.unsqueeze::<4>())
    }

    /// cos and sin at each token's own position, `positions` [b, s]
    /// row-major (documents packed into a row restart at 0), each
    /// [b, 1, s, rotary_dim]: the rows of [`Self::tables`] those positions
    /// pick.
    fn tables_at(
        &self,
        positions: &[usize],
        [b, s]: [usize; 2],
        device: &Device,
    ) -> (Tensor<4>, Tensor<4>) {
        // transformers picks LongRoPE's frequencies by the largest position.
        let seq = positions.iter().max().map_or(0, |p| p + 1);
        let (cos, sin) = self.rows(positions.iter().copied(), seq, device);
        let d = self.rotary_dim;
        (cos.reshape([b, 1, s, d]), sin.reshape([b, 1, s, d]))
    }

    /// cos and sin of `positions` as rows [n, rotary_dim], with the
    /// frequencies for a forward pass of `seq` positions.
    fn rows(
        &self,
        positions: impl ExactSizeIterator<Item = usize>,
        seq: usize,
        device: &Device,
    ) -> (Tensor<2>, Tensor<2>) {
        let d = self.rotary_dim;
        let inv_freq = match &self.long {
            Some((long, original)) if seq > *original => long,
            _ => &self.inv_freq,
        };
        let n = positions.len();
        let mut cos = Vec::with_capacity(n * d);
        let mut sin = Vec::with_capacity(n * d);
        for p in positions {
            for _half in 0..2 {
                for f in inv_freq {
                    let angle = p as f32 * f;
                    cos.push(angle.cos() * self.scale);
                    sin.push(angle.sin() * self.scale);
                }
            }
        }
        (
            Tensor::from_data(TensorData::new(cos, [n, d]), device),
            Tensor::from_data(TensorData::new(sin, [n, d]), device),
        )
    }

    /// Rotates `x` [batch, heads, seq, head_dim] by position; `cos`, `sin`
    /// [1 or batch, 1, seq, rotary_dim] as [`Self::tables`] or
    /// [`Self::tables_at`] give them.
    fn apply(&self, x: Tensor<4>, cos: &Tensor<4>, sin: &Tensor<4>) -> Tensor<4> {
        let [b, a, s, d] = x.dims();
        let r = self.rotary_dim;
        if r < d {
            let rotated = self.apply(x.clone().narrow(3, 0, r), cos, sin);
            return Tensor::cat(vec![rotated, x.narrow(3, r, d - r)], 3);
        }
        let half = d / 2;
        let x1 = x.clone().narrow(3, 0, half);
        let x2 = x.clone().narrow(3, half, half);
        let rotated = Tensor::cat(vec![x2.neg(), x1], 3);
        let cos = cos.clone().expand([b, a, s, d]);
        let sin = sin.clone().expand([b, a, s, d]);
        x * cos + rotated * sin
    }
}

/// `rope_scaling` with `rope_type: llama3` (Llama 3.1/3.2): long wavelengths
/// are slowed by `factor`, short ones kept, the band between interpolated.
fn llama3_scaled(s: &RopeScaling, inv_freq: f32) -> f32 {
    let low_wavelen = s.original_max_position_embeddings / s.low_freq_factor;
    let high_wavelen = s.original_max_position_embeddings / s.high_freq_factor;
    let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
    if wavelen > low_wavelen {
        inv_freq / s.factor
    } else if wavelen < high_wavelen {
        inv_freq
    } else {
        let smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq
    }
}

/// Gemma's RMSNorm over the last dimension with `norm`'s weights and
/// epsilon: x / rms(x) · (1 + weight), computed in f32 and returned in x's
/// dtype (transformers' `Gemma3RMSNorm`; the weights are offsets from 1).
fn gemma_norm<const D: usize>(norm: &RmsNorm, x: Tensor<D>) -> Tensor<D> {
    let dtype = x.dtype();
    let x = x.cast(DType::F32);
    let rms = (x.clone().square().mean_dim(D - 1) + norm.epsilon).sqrt();
    let scale = norm.gamma.val().cast(DType::F32).add_scalar(1.0);
    (x / rms * scale.unsqueeze()).cast(dtype)
}

/// `norm` over `x`: Llama's RMSNorm, or Gemma's where `gemma`.
pub fn norm<const D: usize>(norm: &RmsNorm, x: Tensor<D>, gemma: bool) -> Tensor<D> {
    if gemma {
        gemma_norm(norm, x)
    } else {
        norm.forward(x)
    }
}

/// How one layer's attention turns scores into weights, beyond its weights:
/// the scale, Gemma 2's soft-capping and a sliding layer's window.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerScores {
    scale: f64,
    softcap: Option<f64>,
    window: Option<usize>,
}

impl LayerScores {
    fn new(shape: &LlamaShape, layer: u32) -> Self {
        match &shape.gemma {
            Some(g) => LayerScores {
                scale: 1.0 / g.query_pre_attn_scalar.sqrt(),
                softcap: g.attn_logit_softcapping,
                window: (g.layer_types.get(layer as usize) == Some(&LayerAttention::Sliding))
                    .then_some(g.sliding_window as usize),
            },
            None => LayerScores {
                scale: 1.0 / f64::from(shape.head_dim).sqrt(),
                softcap: None,
                window: None,
            },
        }
    }
}

/// Causal self-attention with `heads` query heads sharing `kv_heads`
/// key/value heads, each `head_dim` wide (which need not be hidden / heads).
/// q, k and v come from three linears, or from Phi-3's one `qkv_proj`
/// (their outputs side by side, in that order).
#[derive(Module, Debug)]
pub struct LlamaAttention {
    pub q_proj: Option<Linear>,
    pub k_proj: Option<Linear>,
    pub v_proj: Option<Linear>,
    pub qkv_proj: Option<Linear>,
    pub o_proj: Linear,
    /// Qwen3's and Gemma 3's RMSNorm over each query head ([head_dim] weights); `None` elsewhere.
    pub q_norm: Option<RmsNorm>,
    /// Qwen3's and Gemma 3's RMSNorm over each key head.
    pub k_norm: Option<RmsNorm>,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Derived from the shape and the layer, not part of the record.
    #[module(skip)]
    scores: LayerScores,
    /// Gemma's norms (q_norm, k_norm over 1 + weight).
    #[module(skip)]
    gemma: bool,
}

/// SwiGLU: down(silu(gate(x)) · up(x)); gate and up are two linears, or
/// Phi-3's one `gate_up_proj` (gate's outputs first). Gemma's GeGLU puts
/// `gelu_pytorch_tanh` where SiLU is. The gating is one lean op
/// ([`lean::gated`]), which keeps gate and up only.
#[derive(Module, Debug)]
pub struct LlamaMlp {
    pub gate_proj: Option<Linear>,
    pub up_proj: Option<Linear>,
    pub gate_up_proj: Option<Linear>,
    pub down_proj: Linear,
    /// GeGLU (Gemma's tanh-approximated GELU on the gate) instead of SwiGLU.
    #[module(skip)]
    geglu: bool,
}

/// One decoder block.
#[derive(Module, Debug)]
pub struct LlamaBlock {
    pub input_layernorm: RmsNorm,
    pub self_attn: LlamaAttention,
    pub post_attention_layernorm: RmsNorm,
    /// Gemma's norm of the MLP's input (`post_attention_layernorm` then
    /// normalises the attention's output); `None` elsewhere.
    pub pre_feedforward_layernorm: Option<RmsNorm>,
    /// Gemma's norm of the MLP's output, before the residual.
    pub post_feedforward_layernorm: Option<RmsNorm>,
    pub mlp: LlamaMlp,
    /// The linears' frozen weights under QLoRA with an NF4 base (the
    /// linears then hold empty placeholders); empty otherwise. Not part of
    /// the module's record: a run re-quantizes the pretrained checkpoint.
    #[module(skip)]
    pub nf4: Nf4Bases,
    /// Derived from the shape, so not part of the record either.
    #[module(skip)]
    rope: Rope,
    /// Gemma's norms and their placement.
    #[module(skip)]
    gemma: bool,
}

/// `LlamaShape`'s RMSNorm with the shape's epsilon.
pub fn rms_norm(shape: &LlamaShape, device: &Device) -> RmsNorm {
    RmsNormConfig::new(shape.hidden as usize)
        .with_epsilon(shape.rms_norm_eps)
        .init(device)
}

impl LlamaBlock {
    /// Layer `layer` of `shape` with burn's default initialisation; its
    /// weights are normally replaced by a checkpoint's (see [`super::hf`]).
    pub fn new(shape: &LlamaShape, layer: u32, device: &Device) -> Self {
        let h = shape.hidden as usize;
        let i = shape.intermediate as usize;
        let (q, kv) = (shape.q_dim() as usize, shape.kv_dim() as usize);
        let qkv_bias = shape.attention_bias;
        // Qwen2's o_proj has no bias; Llama's attention_bias puts one on all four.
        let o_bias = shape.attention_bias
            && shape.architecture != headroom_planner::LlamaArchitecture::Qwen2;
        let linear = |i, o, bias| LinearConfig::new(i, o).with_bias(bias).init(device);
        // Phi-3's fused matrices, or Llama's separate ones.
        let fused = shape.architecture.fused_projections();
        let separate = |i, o, bias| (!fused).then(|| linear(i, o, bias));
        let head_norm = || {
            shape.architecture.qk_norm().then(|| {
                RmsNormConfig::new(shape.head_dim as usize)
                    .with_epsilon(shape.rms_norm_eps)
                    .init(device)
            })
        };
        let gemma = shape.architecture.gemma();
        LlamaBlock {
            input_layernorm: rms_norm(shape, device),
            self_attn: LlamaAttention {
                q_proj: separate(h, q, qkv_bias),
                k_proj: separate(h, kv, qkv_bias),
                v_proj: separate(h, kv, qkv_bias),
                qkv_proj: fused.then(|| linear(h, q + 2 * kv, false)),
                o_proj: linear(q, h, o_bias),
                q_norm: head_norm(),
                k_norm: head_norm(),
                heads: shape.attention_heads as usize,
                kv_heads: shape.key_value_heads as usize,
                head_dim: shape.head_dim as usize,
                scores: LayerScores::new(shape, layer),
                gemma,
            },
            post_attention_layernorm: rms_norm(shape, device),
            pre_feedforward_layernorm: gemma.then(|| rms_norm(shape, device)),
            post_feedforward_layernorm: gemma.then(|| rms_norm(shape, device)),
            mlp: LlamaMlp {
                gate_proj: separate(h, i, shape.mlp_bias),
                up_proj: separate(h, i, shape.mlp_bias),
                gate_up_proj: fused.then(|| linear(h, 2 * i, false)),
                down_proj: linear(i, h, shape.mlp_bias),
                geglu: gemma,
            },
            nf4: Nf4Bases::default(),
            rope: Rope::new(shape, layer),
            gemma,
        }
    }

    /// [batch, seq, hidden] → [batch, seq, hidden].
    pub fn forward(&self, x: Tensor<3>) -> Tensor<3> {
        self.forward_dropping(x, None, None)
    }

    /// [`Self::forward`] with this block's adapter dropout (training), over
    /// a batch packed by `documents` where given (each token attends to its
    /// own document, at its position in it).
    pub fn forward_dropping(
        &self,
        x: Tensor<3>,
        dropout: Option<AdapterDropout>,
        documents: Option<&Documents>,
    ) -> Tensor<3> {
        let projections = Projections {
            nf4: &self.nf4,
            dropout,
        };
        let g = self.gemma;
        let attn = self.self_attn.forward(
            norm(&self.input_layernorm, x.clone(), g),
            &self.rope,
            &projections,
            documents,
        );
        if let (Some(pre), Some(post)) = (
            &self.pre_feedforward_layernorm,
            &self.post_feedforward_layernorm,
        ) {
            // Gemma: each sublayer's output is normalised before the residual.
            let x = x + norm(&self.post_attention_layernorm, attn, g);
            let mlp = self.mlp.forward(norm(pre, x.clone(), g), &projections);
            return x + norm(post, mlp, g);
        }
        let x = x + attn;
        let mlp = self.mlp.forward(
            norm(&self.post_attention_layernorm, x.clone(), g),
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
        use TargetModule::{DownProj, GateProj, GateUpProj, UpProj};
        let (gate, up) = match (&self.gate_up_proj, &self.gate_proj, &self.up_proj) {
            (Some(fused), _, _) => {
                let both = p.forward(GateUpProj, fused, x);
                let i = both.dims()[2] / 2;
                (both.clone().narrow(2, 0, i), both.narrow(2, i, i))
            }
            (None, Some(gate), Some(up)) => (
                p.forward(GateProj, gate, x.clone()),
                p.forward(UpProj, up, x),
            ),
            _ => unreachable!("a block has gate_up_proj or both gate_proj and up_proj"),
        };
        let activation = if self.geglu {
            GateActivation::GeluTanh
        } else {
            GateActivation::Silu
        };
        p.forward(DownProj, &self.down_proj, lean::gated(gate, up, activation))
    }
}

impl LlamaAttention {
    /// `x`: [batch, seq, hidden] (already normalised) → [batch, seq, hidden].
    fn forward(
        &self,
        x: Tensor<3>,
        rope: &Rope,
        p: &Projections,
        documents: Option<&Documents>,
    ) -> Tensor<3> {
        use TargetModule::{KProj, OProj, QProj, QkvProj, VProj};
        let [b, s, _] = x.dims();
        let (a, kv, d) = (self.heads, self.kv_heads, self.head_dim);
        let device = x.device();
        let heads = |t: Tensor<3>, n: usize| t.reshape([b, s, n, d]).swap_dims(1, 2); // [b, n, s, d]
        let (q, k, v) = match (&self.qkv_proj, &self.q_proj, &self.k_proj, &self.v_proj) {
            (Some(fused), ..) => {
                let qkv = p.forward(QkvProj, fused, x);
                (
                    qkv.clone().narrow(2, 0, a * d),
                    qkv.clone().narrow(2, a * d, kv * d),
                    qkv.narrow(2, (a + kv) * d, kv * d),
                )
            }
            (None, Some(q), Some(k), Some(v)) => (
                p.forward(QProj, q, x.clone()),
                p.forward(KProj, k, x.clone()),
                p.forward(VProj, v, x),
            ),
            _ => unreachable!("a block has qkv_proj or all of q_proj, k_proj and v_proj"),
        };
        let (q, k, v) = (heads(q, a), heads(k, kv), heads(v, kv));
        // Qwen3 normalises each head over its head_dim values, before RoPE.
        let per_head = |n: &Option<RmsNorm>, t: Tensor<4>| match n {
            Some(n) => norm(n, t, self.gemma),
            None => t,
        };
        let q = per_head(&self.q_norm, q);
        let k = per_head(&self.k_norm, k);
        let (cos, sin) = match documents {
            Some(documents) => rope.tables_at(documents.positions(), [b, s], &device),
            None => rope.tables(s, &device),
        };
        let q = rope.apply(q, &cos, &sin);
        let k = rope.apply(k, &cos, &sin);
        // Each key/value head serves a / kv consecutive query heads; the
        // blocked op reads them in place (see `lean::attention`).
        let LayerScores {
            scale,
            softcap,
            window,
        } = self.scores;
        let options = AttentionOptions {
            scale,
            block: lean::attention_block(&device),
            softcap,
            window,
            segments: documents.map(|d| d.segments().clone()),
        };
        let context = attend(q, k, v, options)
            .swap_dims(1, 2)
            .reshape([b, s, a * d]);
        p.forward(OProj, &self.o_proj, context)
    }
}
