//! Headroom's bf16 loss curve (f32 master weights) against PyTorch's on the
//! same job: `full-bf16.json` and `lora-bf16.json` in `tests/fixtures/recipe/`
//! (the Hugging Face Trainer with `bf16=True`, `generate.py`).
//!
//! This binary sets flex's default float dtype to bf16 for the whole process
//! (burn allows it once, before the first tensor), so the worker loads the
//! checkpoint onto a bf16 device and trains as on a bf16 GPU stage: every
//! op, activation and gradient in bf16, AdamW stepping an f32 master copy
//! with f32 moments. PyTorch's side is autocast (matmuls in bf16; embedding,
//! norms, residual stream, loss and gradients in fp32; fp32 master weights),
//! started from the same bf16-rounded weights (`generate.py` says what
//! differs).
//!
//! ## The figures
//!
//! Largest per-step difference (loss absolute, gradient norm relative) and
//! the difference of the mean loss over the 60 steps; debug build, one
//! x86-64 CPU, 2026-11-29 (`spread` and `fp32_gap` in the fixtures;
//! `headroom_bf16_spread` and this binary's tests with `--nocapture`):
//!
//! | | full: loss | full: grad norm | full: mean | LoRA: loss | LoRA: grad norm | LoRA: mean |
//! | --- | --- | --- | --- | --- | --- | --- |
//! | PyTorch bf16 vs itself (unfused AdamW, eager attention, 4 × 1) | 1.3e-3 | 1.1e-2 | 7.1e-5 | 3.0e-2 | 1.5e-1 | 1.5e-3 |
//! | PyTorch bf16 from the unrounded start | 3.0e-3 | 3.3e-2 | 6.0e-4 | 6.0e-2 | 2.5e-1 | 3.3e-3 |
//! | PyTorch bf16 vs PyTorch fp32 | 2.6e-3 | 2.0e-2 | 7.3e-4 | 5.0e-2 | 3.9e-1 | 2.9e-4 |
//! | Headroom bf16 vs itself (4 × 1) | 2.4e-3 | 1.7e-2 | 7.1e-4 | 2.7e-2 | 2.4e-1 | 2.6e-4 |
//! | **Headroom bf16 vs PyTorch bf16** | **3.7e-3** | **1.5e-2** | **9.2e-4** | **8.9e-2** | **2.2e-1** | **9.2e-3** |
//! | Headroom bf16 vs PyTorch fp32 | 5.5e-3 | 1.9e-2 | 1.6e-3 | 8.2e-2 | 4.0e-1 | 8.9e-3 |
//! | Headroom bf16 without master weights vs PyTorch bf16 | 5.0e-2 | 5.9e-2 | 1.5e-2 | 7.5e-2 | 2.0e-1 | |
//! | bound | 1e-2 | 5e-2 | 4e-3 | 1.5e-1 | 5e-1 | 2e-2 |
//!
//! In bf16 every step rounds the weights the matmuls see, and the
//! rounding's differences grow: a harmless change moves a curve 1000× more
//! than in fp32, and rounding the start alone moves PyTorch's curve further
//! than bf16 moves it from fp32. Two implementations that differ in every
//! kernel (and here also in what they compute in bf16) cannot come under
//! the bf16-vs-fp32 gap step by step, and they do not: Headroom's full run
//! lies 3.7e-3 from PyTorch's bf16 curve against PyTorch's own 2.6e-3 from
//! fp32, within Headroom's own spread (2.4e-3) and PyTorch's from the
//! rounded start (3.0e-3), and nearer PyTorch's bf16 curve than its fp32
//! one in all three measures. The check that matters, the f32 master copy,
//! is plain: without it the full run's updates below half a bf16 ulp are
//! lost and it leaves the bounds by 5× (loss) and 3.6× (mean loss),
//! `bf16_without_master_weights_leaves_the_bound`.
//!
//! The LoRA run is not a sharp check. Its per-step curves part by 3e-2
//! under PyTorch's own harmless changes (`llama-gqa-tied`'s N(0, 0.3)
//! weights make large activations, where a bf16 ulp is large); without
//! master weights the run lies no further from PyTorch (7.5e-2: at a peak
//! learning rate of 1e-2 the adapters' updates are mostly above a bf16
//! ulp); and Headroom's mean loss lies 9.2e-3 from PyTorch's bf16 and fp32
//! curves alike, 30× its own spread of the mean and PyTorch's bf16-vs-fp32
//! difference, 2.8× PyTorch's largest change (the unrounded start). Step 1
//! points to computing everything in bf16 rather than autocast as the
//! source: before any update the losses agree to 4e-6, but Headroom's
//! gradient norm is 1.0 % below autocast's, and PyTorch with every parameter
//! and op in bf16 gives Headroom's (1.7520; Headroom 1.7508, autocast
//! 1.7679, fp32 1.7675; `first_grad_norm` in the fixture). Neither the
//! norm's per-tensor sum in bf16 nor the fused cross-entropy is the cause
//! (both tried: summed in f32, 1.7510; the naive ops, 1.7525). The Trainer
//! has no pure-bf16 mode with fp32 master weights, so no PyTorch curve
//! computes as Headroom does. The LoRA bounds catch gross errors only; the
//! recipe itself is checked sharply in fp32 (`recipe_reference.rs`), and
//! the learning rate here to 4 ulps.

mod common;
mod recipe_common;

use common::bf16;
use headroom_planner::Precision;
use recipe_common::{Gap, config, difference, integer, measure, reference, train};

/// Largest per-step relative difference of the learning rate: 4 ulps (both
/// sides compute it in f64, as in fp32).
const LR_TOLERANCE: f64 = 4.0 * f64::EPSILON;

/// Largest differences from PyTorch's bf16 curve allowed (table above).
struct Bound {
    /// Per step, absolute.
    loss: f64,
    /// Of the mean over all steps, absolute.
    mean_loss: f64,
    /// Per step, relative.
    grad_norm: f64,
}

/// 2.7×, 4.4× and 3.3× the measured gap; the run without master weights
/// leaves the first two by 5× and 3.6×.
const FULL: Bound = Bound {
    loss: 1e-2,
    mean_loss: 4e-3,
    grad_norm: 5e-2,
};

/// 1.7×, 2.2× and 2.3× the measured gap: wider than PyTorch's bf16-vs-fp32
/// gap and not able to tell the missing master copy (see above).
const LORA: Bound = Bound {
    loss: 1.5e-1,
    mean_loss: 2e-2,
    grad_norm: 5e-1,
};

/// Trains the fixture `run` on the bf16 device with `precision` in the
/// plan's settings: `Bf16` steps an f32 master copy with f32 moments;
/// `Fp32` on this device steps the bf16 weights themselves.
fn measure_bf16(run: &str, precision: Precision) -> Gap {
    measure(run, &bf16(), |c| c.settings.precision = precision)
}

/// The worker's bf16 curve of `run` is PyTorch's within `bound`.
fn compare(run: &str, bound: &Bound) {
    let gap = measure_bf16(run, Precision::Bf16);
    assert!(
        gap.learning_rate <= LR_TOLERANCE,
        "{run}: learning rates differ by {:.2e} (relative)",
        gap.learning_rate
    );
    assert!(
        gap.loss <= bound.loss,
        "{run}: the loss leaves PyTorch's by {:.2e} (bound {:.0e})",
        gap.loss,
        bound.loss
    );
    assert!(
        gap.mean_loss <= bound.mean_loss,
        "{run}: the mean loss leaves PyTorch's by {:.2e} (bound {:.0e})",
        gap.mean_loss,
        bound.mean_loss
    );
    assert!(
        gap.grad_norm <= bound.grad_norm,
        "{run}: the gradient norm leaves PyTorch's by {:.2e} relative (bound {:.0e})",
        gap.grad_norm,
        bound.grad_norm
    );
}

#[test]
fn a_bf16_full_fine_tune_follows_pytorchs_bf16_loss_curve() {
    compare("full-bf16", &FULL);
}

#[test]
fn bf16_lora_follows_pytorch_and_peft_bf16_loss_curve() {
    compare("lora-bf16", &LORA);
}

/// Without the f32 master copy (the plan's precision fp32 on a bf16 device:
/// AdamW steps the bf16 weights, and updates below half a bf16 ulp are
/// lost) the full run leaves the bounds.
#[test]
fn bf16_without_master_weights_leaves_the_bound() {
    let gap = measure_bf16("full-bf16", Precision::Fp32);
    assert!(
        gap.loss > FULL.loss && gap.mean_loss > FULL.mean_loss,
        "bf16 without master weights stays within the bounds: {gap:?}"
    );
}

/// Headroom's bf16 run against PyTorch's fp32 curve of the same job, and
/// against itself split into one micro-batch of 4 (`--ignored --nocapture`).
#[test]
#[ignore = "a measurement: prints Headroom's bf16 spread and its distance from fp32"]
fn headroom_bf16_spread() {
    for run in ["full", "lora"] {
        println!(
            "{run}-bf16 vs {run}.json (fp32): {:?}",
            measure(run, &bf16(), |c| c.settings.precision = Precision::Bf16)
        );
        let reference = reference(&format!("{run}-bf16"));
        let micro = integer(&reference["settings"], "micro_batch") as u32;
        let bf16_config = |micro| {
            let mut c = config(&reference, micro);
            c.settings.precision = Precision::Bf16;
            c
        };
        let base = train(bf16_config(micro), &bf16(), 1);
        let other = train(bf16_config(4), &bf16(), 1);
        let (la, _) = difference(&other.loss, &base.loss);
        let (_, gr) = difference(&other.grad_norm, &base.grad_norm);
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
        let dm = (mean(&other.loss) - mean(&base.loss)).abs();
        println!("{run}-bf16 4 x 1: loss {la:.2e}, grad norm rel {gr:.2e}, mean loss {dm:.2e}");
    }
}
