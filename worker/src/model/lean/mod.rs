//! Training ops that keep for backward only what their backward needs.
//! Five are autodiff ops with a backward of their own (burn's
//! backend-extension route: one trait, implemented on the plain backends and
//! on `Autodiff`); the sixth is composed from them and the tensor API:
//!
//! * [`adapted`] — a LoRA linear over a dense frozen base, `x·W +
//!   (s·x·A)·B`, its adapter's products added into the base's output and
//!   `dx` instead of written to fresh tensors and summed;
//! * [`attention`] — blocked causal attention (FlashAttention-2): saves q,
//!   k, v, the output and a logsumexp per row instead of burn's three
//!   `[b, heads, s, s]` tensors per layer;
//! * [`frozen`] — `x · W` for a frozen quantized `W`: dequantized for the
//!   matmul and again in backward, never kept dense;
//! * [`cross_entropy`] — the loss from hidden states and head weight, a
//!   chunk of rows at a time: saves a logsumexp per row instead of the f32
//!   logits and their gradient;
//! * [`gated`] — a gated MLP's `act(gate) · up` (SwiGLU, GeGLU): saves
//!   gate and up instead of burn's four tensors, recomputes the activation
//!   in backward;
//! * [`linear`] (composed) — a LoRA/QLoRA linear as `x·W + s·(x·A)·B`,
//!   never the dense `W + s·A·B`: a dense base through [`adapted`], a
//!   quantized one through [`frozen`].
//!
//! Their bodies call [`exp::exp`], vectorized on flex where burn's calls
//! libm once per value.
//!
//! The algorithms are written once over burn's tensor API on the inner
//! backend, so flex and the cubecl runtimes (CUDA, wgpu) run the same code; a fused kernel could replace
//! a body for `Cube` behind the same op.
//!
//! The autodiff ops are "compute bound" in burn's sense: they save
//! their state and are never recomputed by burn's own checkpointing (the
//! worker checkpoints whole blocks itself, see [`crate::train`]).

pub mod adapted;
pub mod attention;
pub mod check;
pub mod cross_entropy;
pub mod exp;
pub mod frozen;
pub mod gated;
pub mod linear;

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{
    Autodiff, Backend, DispatchKindConversion, DispatchTensor, Flex, backend_extension,
};
use burn::tensor::{Int, Tensor};

pub use attention::AttentionOptions;
pub use gated::GateActivation;

/// Query and key rows per attention block for tensors on `device`: the
/// backend profile's (small on the CPU, large on a GPU), whose block pair
/// the planner counts as the op's transient.
pub fn attention_block(device: &burn::tensor::Device) -> usize {
    let backend = if *device == burn::tensor::Device::flex() {
        headroom_planner::Backend::Flex
    } else {
        headroom_planner::Backend::Cuda
    };
    backend.profile().attention_block as usize
}

/// The environment variable that switches a worker back to the ops these
/// replace (burn's softmax attention, `log_softmax` over the whole logits,
/// the composed LoRA weight): for A/B benchmarks of memory and speed only
/// (`make bench-lean`), never set by the operator.
pub const NAIVE_OPS_ENV: &str = "HEADROOM_NAIVE_OPS";

static NAIVE: std::sync::OnceLock<std::sync::atomic::AtomicBool> = std::sync::OnceLock::new();

fn naive_flag() -> &'static std::sync::atomic::AtomicBool {
    NAIVE.get_or_init(|| {
        std::sync::atomic::AtomicBool::new(std::env::var(NAIVE_OPS_ENV).is_ok_and(|v| v == "1"))
    })
}

/// Whether this process runs the naive ops ([`NAIVE_OPS_ENV`] = 1 at start,
/// or [`set_naive_ops`]).
pub fn naive_ops() -> bool {
    naive_flag().load(std::sync::atomic::Ordering::Relaxed)
}

/// Switches the process to the naive ops or back (a benchmark's A/B).
pub fn set_naive_ops(naive: bool) {
    naive_flag().store(naive, std::sync::atomic::Ordering::Relaxed);
}
pub use frozen::FrozenWeight;

/// The extension trait behind [`attend`] and [`fused_cross_entropy`].
#[backend_extension(Flex, Cube: cfg(any(feature = "cuda", feature = "wgpu")), Autodiff)]
pub trait LeanBackend: Backend {
    /// `q` [b, a, s, d], `k`, `v` [b, kv, s, d] → [b, a, s, d].
    fn lean_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self>;

    /// `hidden` [n, h], `weight` [vocab, h], `targets` [n] → mean loss [1],
    /// its backward expecting the loss's gradient `grad_scale`.
    fn lean_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk: usize,
        softcap: Option<f64>,
        grad_scale: f64,
    ) -> FloatTensor<Self>;

    /// `x` [b, s, d_in] · the frozen `weight` [d_in, d_out] → [b, s, d_out].
    fn lean_frozen_matmul(x: FloatTensor<Self>, weight: FrozenWeight) -> FloatTensor<Self>;

    /// `activation(gate) · up`, both [b, s, i] → [b, s, i].
    fn lean_gated(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        activation: GateActivation,
    ) -> FloatTensor<Self>;

    /// `x` [n, d_in] · `w` [d_in, d_out] + (`scale` · `x` · `a` [d_in, r])
    /// · `b` [r, d_out] → [n, d_out].
    fn lean_adapted(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self>;
}

/// A plain backend's primitive as a tensor of the high-level API.
fn float<B: Backend, const D: usize>(primitive: FloatTensor<B>) -> Tensor<D>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    Tensor::from_primitive::<B>(primitive)
}

fn primitive<B: Backend, const D: usize>(tensor: Tensor<D>) -> FloatTensor<B>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    tensor
        .try_into_primitive::<B>()
        .expect("a lean op's result lives on its inputs' backend")
}

fn int<B: Backend, const D: usize>(primitive: IntTensor<B>) -> Tensor<D, Int>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    Tensor::from_primitive::<B>(primitive)
}

/// The forward alone, on a backend without autodiff (a frozen stage, a
/// checkpointed block's first pass).
macro_rules! plain_backend {
    ($backend:ty) => {
        impl LeanBackend for $backend {
            fn lean_attention(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                options: AttentionOptions,
            ) -> FloatTensor<Self> {
                let (output, _) = attention::forward(
                    float::<Self, 4>(q),
                    float::<Self, 4>(k),
                    float::<Self, 4>(v),
                    &options,
                );
                primitive::<Self, 4>(output)
            }

            fn lean_cross_entropy(
                hidden: FloatTensor<Self>,
                weight: FloatTensor<Self>,
                targets: IntTensor<Self>,
                chunk: usize,
                softcap: Option<f64>,
                _grad_scale: f64,
            ) -> FloatTensor<Self> {
                let loss = cross_entropy::forward(
                    float::<Self, 2>(hidden),
                    float::<Self, 2>(weight),
                    int::<Self, 1>(targets),
                    chunk,
                    softcap,
                    cross_entropy::Wanted::NONE,
                )
                .loss;
                primitive::<Self, 1>(loss)
            }

            fn lean_frozen_matmul(x: FloatTensor<Self>, weight: FrozenWeight) -> FloatTensor<Self> {
                primitive::<Self, 3>(frozen::forward(float::<Self, 3>(x), &weight))
            }

            fn lean_gated(
                gate: FloatTensor<Self>,
                up: FloatTensor<Self>,
                activation: GateActivation,
            ) -> FloatTensor<Self> {
                primitive::<Self, 3>(gated::forward(
                    float::<Self, 3>(gate),
                    float::<Self, 3>(up),
                    activation,
                ))
            }

            fn lean_adapted(
                x: FloatTensor<Self>,
                w: FloatTensor<Self>,
                a: FloatTensor<Self>,
                b: FloatTensor<Self>,
                scale: f64,
            ) -> FloatTensor<Self> {
                let (y, _) = adapted::forward(
                    float::<Self, 2>(x),
                    float::<Self, 2>(w),
                    float::<Self, 2>(a),
                    float::<Self, 2>(b),
                    scale,
                );
                primitive::<Self, 2>(y)
            }
        }
    };
}

plain_backend!(Flex);
#[cfg(any(feature = "cuda", feature = "wgpu"))]
plain_backend!(burn::backend::Cube);

/// What attention keeps between forward and backward.
#[derive(Clone, Debug)]
struct AttentionState<B: Backend> {
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    output: FloatTensor<B>,
    logsumexp: Vec<FloatTensor<B>>,
    options: AttentionOptions,
}

#[derive(Debug)]
struct AttentionBackward;

impl<B: Backend> Backward<B, 3> for AttentionBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = AttentionState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dout = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let (dq, dk, dv) = attention::backward(
            float::<B, 4>(s.q),
            float::<B, 4>(s.k),
            float::<B, 4>(s.v),
            float::<B, 4>(s.output),
            &s.logsumexp
                .into_iter()
                .map(float::<B, 4>)
                .collect::<Vec<_>>(),
            float::<B, 4>(dout),
            &s.options,
        );
        for (parent, grad) in ops.parents.into_iter().zip([dq, dk, dv]) {
            if let Some(parent) = parent {
                grads.register::<B>(parent.id, primitive::<B, 4>(grad));
            }
        }
    }
}

/// What the loss keeps between forward and backward: the gradients its
/// forward formed at `grad_scale` (see [`cross_entropy`]).
#[derive(Clone, Debug)]
struct CrossEntropyState<B: Backend> {
    dhidden: Option<FloatTensor<B>>,
    dweight: Option<FloatTensor<B>>,
    grad_scale: f64,
}

#[derive(Debug)]
struct CrossEntropyBackward;

impl<B: Backend> Backward<B, 2> for CrossEntropyBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = CrossEntropyState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dloss = float::<B, 1>(grads.consume::<B>(&ops.node));
        let s = ops.state;
        let [hidden_parent, weight_parent] = ops.parents;
        for (parent, gradient) in [(hidden_parent, s.dhidden), (weight_parent, s.dweight)] {
            if let (Some(parent), Some(gradient)) = (parent, gradient) {
                let gradient =
                    cross_entropy::backward(float::<B, 2>(gradient), &dloss, s.grad_scale);
                grads.register::<B>(parent.id, primitive::<B, 2>(gradient));
            }
        }
    }
}

#[derive(Debug)]
struct FrozenMatmulBackward;

impl<B: Backend> Backward<B, 1> for FrozenMatmulBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    /// The stored (quantized) weight, not its dense copy.
    type State = FrozenWeight;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let [parent] = ops.parents;
        if let Some(parent) = parent {
            let dx = frozen::backward(float::<B, 3>(dy), &ops.state);
            grads.register::<B>(parent.id, primitive::<B, 3>(dx));
        }
    }
}

/// What the gated activation keeps between forward and backward: its inputs.
#[derive(Clone, Debug)]
struct GatedState<B: Backend> {
    gate: FloatTensor<B>,
    up: FloatTensor<B>,
    activation: GateActivation,
}

#[derive(Debug)]
struct GatedBackward;

impl<B: Backend> Backward<B, 2> for GatedBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = GatedState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let dy = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let [gate_parent, up_parent] = ops.parents;
        let (dgate, dup) = gated::backward(
            float::<B, 3>(s.gate),
            float::<B, 3>(s.up),
            float::<B, 3>(dy),
            s.activation,
            (gate_parent.is_some(), up_parent.is_some()),
        );
        for (parent, grad) in [(gate_parent, dgate), (up_parent, dup)] {
            if let (Some(parent), Some(grad)) = (parent, grad) {
                grads.register::<B>(parent.id, primitive::<B, 3>(grad));
            }
        }
    }
}

/// What the adapted linear keeps between forward and backward.
#[derive(Clone, Debug)]
struct AdaptedState<B: Backend> {
    x: FloatTensor<B>,
    xa: FloatTensor<B>,
    w: FloatTensor<B>,
    a: FloatTensor<B>,
    b: FloatTensor<B>,
    scale: f64,
}

#[derive(Debug)]
struct AdaptedBackward;

impl<B: Backend> Backward<B, 4> for AdaptedBackward
where
    DispatchTensor: DispatchKindConversion<B>,
{
    type State = AdaptedState<B>;

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, _: &mut Checkpointer) {
        let g = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let kept = adapted::Kept {
            x: float::<B, 2>(s.x),
            xa: float::<B, 2>(s.xa),
            w: float::<B, 2>(s.w),
            a: float::<B, 2>(s.a),
            b: float::<B, 2>(s.b),
            scale: s.scale,
        };
        let need = ops.parents.each_ref().map(Option::is_some);
        let gradients = adapted::backward(kept, float::<B, 2>(g), need);
        for (parent, grad) in ops.parents.into_iter().zip(gradients) {
            if let (Some(parent), Some(grad)) = (parent, grad) {
                grads.register::<B>(parent.id, primitive::<B, 2>(grad));
            }
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> LeanBackend for Autodiff<B, C>
where
    DispatchTensor: DispatchKindConversion<B>,
{
    fn lean_attention(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        options: AttentionOptions,
    ) -> FloatTensor<Self> {
        let (q, q_node) = q.into_parts();
        let (k, k_node) = k.into_parts();
        let (v, v_node) = v.into_parts();
        let run = || {
            attention::forward(
                float::<B, 4>(q.clone()),
                float::<B, 4>(k.clone()),
                float::<B, 4>(v.clone()),
                &options,
            )
        };
        match AttentionBackward
            .prepare::<C>([q_node, k_node, v_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let (output, logsumexp) = run();
                let output = primitive::<B, 4>(output);
                let state = AttentionState {
                    q,
                    k,
                    v,
                    output: output.clone(),
                    logsumexp: logsumexp.into_iter().map(primitive::<B, 4>).collect(),
                    options,
                };
                prep.finish(state, output)
            }
            OpsKind::UnTracked(prep) => prep.finish(primitive::<B, 4>(run().0)),
        }
    }

    fn lean_cross_entropy(
        hidden: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        targets: IntTensor<Self>,
        chunk: usize,
        softcap: Option<f64>,
        grad_scale: f64,
    ) -> FloatTensor<Self> {
        let wanted = cross_entropy::Wanted {
            hidden: hidden.is_tracked(),
            weight: weight.is_tracked(),
            grad_scale,
        };
        let (hidden, hidden_node) = hidden.into_parts();
        let (weight, weight_node) = weight.into_parts();
        let run = |wanted| {
            cross_entropy::forward(
                float::<B, 2>(hidden),
                float::<B, 2>(weight),
                int::<B, 1>(targets),
                chunk,
                softcap,
                wanted,
            )
        };
        match CrossEntropyBackward
            .prepare::<C>([hidden_node, weight_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let out = run(wanted);
                let state = CrossEntropyState {
                    dhidden: out.dhidden.map(primitive::<B, 2>),
                    dweight: out.dweight.map(primitive::<B, 2>),
                    grad_scale,
                };
                prep.finish(state, primitive::<B, 1>(out.loss))
            }
            OpsKind::UnTracked(prep) => {
                prep.finish(primitive::<B, 1>(run(cross_entropy::Wanted::NONE).loss))
            }
        }
    }

    fn lean_frozen_matmul(x: FloatTensor<Self>, weight: FrozenWeight) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let y = primitive::<B, 3>(frozen::forward(float::<B, 3>(x), &weight));
        match FrozenMatmulBackward
            .prepare::<C>([x_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(weight, y),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn lean_gated(
        gate: FloatTensor<Self>,
        up: FloatTensor<Self>,
        activation: GateActivation,
    ) -> FloatTensor<Self> {
        let (gate, gate_node) = gate.into_parts();
        let (up, up_node) = up.into_parts();
        let y = primitive::<B, 3>(gated::forward(
            float::<B, 3>(gate.clone()),
            float::<B, 3>(up.clone()),
            activation,
        ));
        match GatedBackward
            .prepare::<C>([gate_node, up_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                GatedState {
                    gate,
                    up,
                    activation,
                },
                y,
            ),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }

    fn lean_adapted(
        x: FloatTensor<Self>,
        w: FloatTensor<Self>,
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        scale: f64,
    ) -> FloatTensor<Self> {
        let (x, x_node) = x.into_parts();
        let (w, w_node) = w.into_parts();
        let (a, a_node) = a.into_parts();
        let (b, b_node) = b.into_parts();
        let (y, xa) = adapted::forward(
            float::<B, 2>(x.clone()),
            float::<B, 2>(w.clone()),
            float::<B, 2>(a.clone()),
            float::<B, 2>(b.clone()),
            scale,
        );
        let y = primitive::<B, 2>(y);
        match AdaptedBackward
            .prepare::<C>([x_node, w_node, a_node, b_node])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(
                AdaptedState {
                    x,
                    xa: primitive::<B, 2>(xa),
                    w,
                    a,
                    b,
                    scale,
                },
                y,
            ),
            OpsKind::UnTracked(prep) => prep.finish(y),
        }
    }
}

/// Blocked causal attention: `q` [b, a, s, d], `k`, `v` [b, kv, s, d] (kv
/// divides a) → [b, a, s, d], differentiable.
pub fn attend(q: Tensor<4>, k: Tensor<4>, v: Tensor<4>, options: AttentionOptions) -> Tensor<4> {
    if naive_ops() {
        return attention::naive(q, k, v, &options);
    }
    Tensor::from_dispatch(<burn::backend::Dispatch as LeanBackend>::lean_attention(
        q.into_dispatch(),
        k.into_dispatch(),
        v.into_dispatch(),
        options,
    ))
}

/// `x` [b, s, d_in] · a frozen `weight` [d_in, d_out], keeping only the
/// stored weight for backward (differentiable in `x`).
pub fn frozen_matmul(x: Tensor<3>, weight: FrozenWeight) -> Tensor<3> {
    Tensor::from_dispatch(
        <burn::backend::Dispatch as LeanBackend>::lean_frozen_matmul(x.into_dispatch(), weight),
    )
}

/// A gated MLP's `activation(gate) · up`, both [b, s, i], keeping only
/// `gate` and `up` for backward (differentiable in both).
pub fn gated(gate: Tensor<3>, up: Tensor<3>, activation: GateActivation) -> Tensor<3> {
    if naive_ops() {
        return gated::naive(gate, up, activation);
    }
    Tensor::from_dispatch(<burn::backend::Dispatch as LeanBackend>::lean_gated(
        gate.into_dispatch(),
        up.into_dispatch(),
        activation,
    ))
}

/// A LoRA linear over a dense base: `x` [n, d_in] · `w` [d_in, d_out] +
/// (`scale` · `x` · `a`) · `b`, differentiable in all four (the base's
/// gradient only where `w` is tracked). See [`adapted`].
pub fn adapted_matmul(
    x: Tensor<2>,
    w: Tensor<2>,
    a: Tensor<2>,
    b: Tensor<2>,
    scale: f64,
) -> Tensor<2> {
    Tensor::from_dispatch(<burn::backend::Dispatch as LeanBackend>::lean_adapted(
        x.into_dispatch(),
        w.into_dispatch(),
        a.into_dispatch(),
        b.into_dispatch(),
        scale,
    ))
}

/// Mean next-token cross-entropy of `hidden` [n, h] under `weight` [vocab, h]
/// against `targets` [n], computed `chunk` rows at a time, differentiable in
/// both `hidden` and `weight`.
pub fn fused_cross_entropy(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    targets: Tensor<1, Int>,
    chunk: usize,
) -> Tensor<1> {
    fused_cross_entropy_capped(hidden, weight, targets, chunk, None, 1.0)
}

/// [`fused_cross_entropy`] with the logits soft-capped at `softcap` where
/// given (Gemma's `final_logit_softcapping`: cap · tanh(logits / cap)),
/// for a backward that will pass the loss's gradient `grad_scale` (the
/// scale the loss is multiplied by before `backward`; any other gradient
/// is still right, at the cost of one more pass over the gradients).
pub fn fused_cross_entropy_capped(
    hidden: Tensor<2>,
    weight: Tensor<2>,
    targets: Tensor<1, Int>,
    chunk: usize,
    softcap: Option<f64>,
    grad_scale: f64,
) -> Tensor<1> {
    if naive_ops() {
        return cross_entropy::naive_capped(hidden, weight, targets, softcap);
    }
    Tensor::from_dispatch(
        <burn::backend::Dispatch as LeanBackend>::lean_cross_entropy(
            hidden.into_dispatch(),
            weight.into_dispatch(),
            targets.into_dispatch(),
            chunk,
            softcap,
            grad_scale,
        ),
    )
}

#[cfg(test)]
mod tests;
