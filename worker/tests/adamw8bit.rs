//! 8-bit AdamW (`optimizer: adamw8bit`): small parameters step exactly like
//! burn's AdamW, large ones keep one-byte moments, the state survives a
//! record round trip and a checkpoint, and training tracks f32 AdamW.

mod common;

use std::path::PathBuf;

use burn::module::Module;
use burn::nn::{Linear, LinearConfig};
use burn::optim::grad_clipping::GradientClippingConfig;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer, Optimizer as _};
use burn::tensor::{DType, Device, Distribution, Tensor, TensorData};
use headroom_planner::Optimizer;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::optim::{AdamW8bitConfig, Moments};
use headroom_worker::train::{TrainConfig, Trainer};

use common::{tiny_llama, tiny_llama_text};

/// Model initialisation draws from burn's global RNG (a Trainer seeds it):
/// tests that run in parallel would interleave their draws, so each takes this.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

#[derive(Module, Debug)]
struct TwoLayers {
    wide: Linear,
    narrow: Linear,
}

impl TwoLayers {
    /// `wide`: 64 × 96 = 6144 weights (8-bit moments) and 96 biases (f32);
    /// `narrow`: 96 × 8 = 768 weights (f32).
    fn new(device: &Device) -> Self {
        TwoLayers {
            wide: LinearConfig::new(64, 96).init(device),
            narrow: LinearConfig::new(96, 8).init(device),
        }
    }

    fn loss(&self, x: Tensor<2>) -> Tensor<1> {
        let h = burn::tensor::activation::relu(self.wide.forward(x));
        let y = self.narrow.forward(h);
        (y.clone() * y).mean()
    }
}

fn device() -> Device {
    Device::flex().autodiff()
}

fn input(step: u64) -> Tensor<2> {
    // Deterministic per step: the same data for every optimizer.
    let values: Vec<f32> = (0..4 * 64)
        .map(|i| (((i as u64 * 2654435761 + step * 97) % 1000) as f32 / 500.0) - 1.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [4, 64]), &device())
}

fn step(optimizer: &mut ModuleOptimizer, model: TwoLayers, step: u64) -> TwoLayers {
    let grads = GradientsParams::from_grads(model.loss(input(step)).backward(), &model);
    optimizer.step(1e-2, model, grads)
}

fn weights(model: &TwoLayers) -> Vec<f32> {
    let mut all: Vec<f32> = Vec::new();
    for t in [
        model.wide.weight.val().into_data(),
        model.wide.bias.as_ref().expect("bias").val().into_data(),
        model.narrow.weight.val().into_data(),
    ] {
        all.extend(t.iter::<f32>());
    }
    all
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn parameters_under_the_threshold_step_exactly_like_burns_adamw() {
    let _serial = serial();
    let start = TwoLayers::new(&device());
    let mut adamw = AdamWConfig::new().init();
    // Every parameter keeps f32 moments when the threshold is above them all.
    let mut eight = AdamW8bitConfig::new()
        .with_min_8bit_elements(1 << 20)
        .init();
    let (mut a, mut b) = (start.clone(), start);
    for s in 0..20 {
        a = step(&mut adamw, a, s);
        b = step(&mut eight, b, s);
    }
    assert_eq!(weights(&a), weights(&b), "the same update, bit for bit");
}

#[test]
fn the_first_step_equals_adamw_and_later_ones_stay_close() {
    let _serial = serial();
    // The first update uses the f32 moments before they are quantized.
    let start = TwoLayers::new(&device());
    let mut adamw = AdamWConfig::new().init();
    let mut eight = AdamW8bitConfig::new().init();
    let (mut a, mut b) = (
        step(&mut adamw, start.clone(), 0),
        step(&mut eight, start.clone(), 0),
    );
    assert_eq!(weights(&a), weights(&b));
    for s in 1..30 {
        a = step(&mut adamw, a, s);
        b = step(&mut eight, b, s);
    }
    let (w0, wa, wb) = (weights(&start), weights(&a), weights(&b));
    let mean_abs = |x: &[f32], y: &[f32]| {
        x.iter().zip(y).map(|(p, q)| (p - q).abs()).sum::<f32>() / x.len() as f32
    };
    let moved = mean_abs(&w0, &wa);
    let apart = mean_abs(&wa, &wb);
    eprintln!(
        "30 steps: AdamW moved weights by {moved:.5} on average (max {:.5}); 8-bit is {apart:.5} away on average (max {:.5})",
        max_diff(&w0, &wa),
        max_diff(&wa, &wb)
    );
    assert!(apart > 0.0, "the 8-bit moments are really quantized");
    // Measured: 6.1 % (0.00169 of 0.02778) on this problem.
    assert!(
        apart <= 0.10 * moved,
        "8-bit drifted {apart} from AdamW's {moved}"
    );
}

#[test]
fn large_parameters_keep_one_byte_per_element_and_small_ones_f32() {
    let _serial = serial();
    let optimizer = AdamW8bitConfig::new().build();
    let device = Device::flex();
    // 65 × 70 = 4550 elements: 18 blocks, the last one padded.
    let weight = Tensor::<2>::random([65, 70], Distribution::Normal(0.0, 1.0), &device);
    let grad = Tensor::<2>::random([65, 70], Distribution::Normal(0.0, 1.0), &device);
    let (_, state) = optimizer.step(1e-3, weight.clone(), grad.clone(), None);
    let (_, state) = optimizer.step(1e-3, weight, grad, state);
    let state = state.expect("state");
    assert_eq!(state.time, 2);
    match &state.moments {
        Moments::Blockwise { first, second } => {
            for q in [first, second] {
                assert_eq!(q.codes.dtype(), DType::U8);
                assert_eq!(q.codes.dims(), [18 * 256]);
                assert_eq!(q.absmax.dims(), [18]);
            }
        }
        Moments::Full { .. } => panic!("4550 elements get 8-bit moments"),
    }
    assert_eq!(state.bytes(), 2 * (18 * 256 + 18 * 4));

    let bias = Tensor::<1>::ones([4095], &device);
    let (_, state) = optimizer.step(1e-3, bias.clone(), bias, None);
    let state = state.expect("state");
    assert!(matches!(state.moments, Moments::Full { .. }));
    assert_eq!(state.bytes(), 2 * 4095 * 4);
}

/// A large parameter is stepped a slice of blocks at a time (bounded
/// temporaries): the weights and both moments' codes and scales are the
/// whole-tensor step's, bit for bit, whatever the slice (3 blocks, 7, the
/// default, all at once) and with a padded last block.
#[test]
fn stepping_a_slice_of_blocks_at_a_time_changes_nothing() {
    let _serial = serial();
    let device = Device::flex();
    // 65 × 70 = 4550 elements: 18 blocks, the last one padded.
    let weight = Tensor::<2>::random([65, 70], Distribution::Normal(0.0, 1.0), &device);
    let grads: Vec<Tensor<2>> = (0..4)
        .map(|_| Tensor::<2>::random([65, 70], Distribution::Normal(0.0, 1.0), &device))
        .collect();
    let run = |chunk: usize| {
        let optimizer = AdamW8bitConfig::new().with_step_chunk_blocks(chunk).build();
        let (mut w, mut state) = (weight.clone(), None);
        for g in &grads {
            (w, state) = optimizer.step(1e-2, w, g.clone(), state);
        }
        let state = state.expect("state");
        let Moments::Blockwise { first, second } = state.moments else {
            panic!("8-bit moments");
        };
        let bits = |t: Tensor<1>| {
            t.into_data()
                .iter::<f32>()
                .map(f32::to_bits)
                .collect::<Vec<_>>()
        };
        let codes =
            |t: Tensor<1, burn::tensor::Int>| t.into_data().iter::<u8>().collect::<Vec<u8>>();
        (
            w.into_data()
                .iter::<f32>()
                .map(f32::to_bits)
                .collect::<Vec<_>>(),
            codes(first.codes),
            bits(first.absmax),
            codes(second.codes),
            bits(second.absmax),
        )
    };
    let whole = run(usize::MAX / 256);
    for chunk in [3, 7, AdamW8bitConfig::new().step_chunk_blocks] {
        assert!(
            run(chunk) == whole,
            "a slice of {chunk} blocks stepped differently"
        );
    }
}

#[test]
fn a_record_round_trip_gives_identical_next_steps() {
    let _serial = serial();
    let make = || {
        AdamW8bitConfig::new()
            .with_grad_clipping(Some(GradientClippingConfig::Norm(1.0)))
            .init()
    };
    let mut model = TwoLayers::new(&device());
    let mut original = make();
    for s in 0..5 {
        model = step(&mut original, model, s);
    }
    let bytes = original.to_record().into_bytes().expect("record bytes");
    let mut restored = make().from_bytes(bytes).expect("record loads");
    let (mut a, mut b) = (model.clone(), model);
    for s in 5..10 {
        a = step(&mut original, a, s);
        b = step(&mut restored, b, s);
    }
    assert_eq!(weights(&a), weights(&b), "resumed steps are identical");

    // Without the state the next steps differ: the record carried it.
    let mut fresh = make();
    let c = step(&mut fresh, b.clone(), 10);
    let b = step(&mut restored, b, 10);
    assert!(max_diff(&weights(&b), &weights(&c)) > 1e-4);
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-8bit-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn eight_bit_tiny(accumulation: u32) -> TrainConfig {
    let mut config = common::tiny_config(4, accumulation, false);
    config.settings.optimizer = Optimizer::Adamw8bit;
    config
}

#[test]
fn a_checkpoint_resumes_the_8bit_state_exactly() {
    let _serial = serial();
    let dir = temp_dir("resume");
    let mut straight = Trainer::new(eight_bit_tiny(2), device()).expect("trainer");
    let straight_losses: Vec<f64> = (0..6)
        .map(|_| straight.train_step().expect("step").loss.expect("loss"))
        .collect();

    let mut first = Trainer::new(eight_bit_tiny(2), device()).expect("trainer");
    let first_losses: Vec<f64> = (0..3)
        .map(|_| first.train_step().expect("step").loss.expect("loss"))
        .collect();
    assert_eq!(
        straight_losses[..3],
        first_losses[..],
        "a run repeats exactly"
    );
    first.save_checkpoint(&dir, 1, None).expect("save");
    drop(first);

    let mut second = Trainer::new(eight_bit_tiny(2), device()).expect("trainer");
    second.resume(&dir).expect("resume").expect("a checkpoint");
    assert_eq!(second.step, 3);
    let resumed_losses: Vec<f64> = (0..3)
        .map(|_| second.train_step().expect("step").loss.expect("loss"))
        .collect();
    assert_eq!(straight_losses[3..], resumed_losses[..], "identical losses");
    let a: Vec<f32> = straight
        .model()
        .valid()
        .forward(probe_tokens())
        .into_data()
        .iter()
        .collect();
    let b: Vec<f32> = second
        .model()
        .valid()
        .forward(probe_tokens())
        .into_data()
        .iter()
        .collect();
    assert_eq!(a, b, "identical weights after the resumed steps");
    let _ = std::fs::remove_dir_all(&dir);
}

fn probe_tokens() -> Tensor<2, burn::tensor::Int> {
    let task = headroom_worker::data::ProgressionTask {
        seed: 5,
        vocabulary: common::tiny_shape().vocabulary,
        sequence_length: common::tiny_shape().sequence_length,
    };
    task.batch(0, 2, &Device::flex()).0
}

// Tiny Llama (tests/fixtures/llama/tiny-llama) on the sample text.

const SEQUENCE: u32 = 32;

fn llama_losses(optimizer: Optimizer, steps: u64, seed: u64) -> Vec<f64> {
    let checkpoint = HfCheckpoint::open(&tiny_llama(), SEQUENCE).expect("tiny-llama");
    let mut config = TrainConfig::single_stage(
        checkpoint.shape,
        headroom_planner::Settings {
            micro_batch: 2,
            gradient_accumulation: 2,
            optimizer,
            ..headroom_planner::Settings::default()
        },
        steps,
        3e-3,
        seed,
    )
    .with_pretrained(tiny_llama());
    config.checkpoint_every_steps = 1000;
    let mut trainer = Trainer::new(config, device()).expect("trainer");
    trainer.use_text(tiny_llama_text(SEQUENCE, seed));
    let mut losses = Vec::new();
    while !trainer.finished() {
        losses.extend(trainer.train_step().expect("step").loss);
    }
    losses
}

/// Same seed, data and schedule. What 8-bit AdamW guarantees is that it takes
/// the same steps as f32 AdamW up to the moments' quantization error. On this
/// over-fitting task that error is amplified from step to step, so:
/// - while the two runs are in their deterministic phase (the first
///   `AGREE_STEPS` steps) every step's loss agrees within `AGREE`;
/// - later the runs differ by step noise whose size depends on the seed and
///   on the CPU's float kernels (one final step compared with a tight bound
///   failed on one CPU and passed on another), so the late losses are
///   compared as a mean, within `TAIL`.
///
/// The bounds, from the spread measured across seeds 1–8 (AMD EPYC, no
/// AVX-512; `HEADROOM_TEST_SEED=N cargo test --release -p headroom-worker
/// --test adamw8bit -- --nocapture training_loss`, 2026-11-27):
/// - steps 0–19: at most 0.025 % apart (every seed); `AGREE` 0.5 %. Beyond
///   them one seed's runs are 26 % apart at one step by step 24 (a loss
///   spike in one run and not the other), the others first pass 1 % between
///   steps 44 and 77: no per-step bound holds there.
/// - mean of steps 40–59, 8-bit vs f32: −1.43 % to +0.26 % (sd 0.64 %; at
///   100 steps the spread was −2.54 % to +2.39 %); `TAIL` 3 %, twice the
///   largest. f32 AdamW's own mean over those steps varies by 2.2 % (sd)
///   from seed to seed, so 8-bit is as close to f32 as f32 is to itself.
#[test]
fn training_loss_tracks_f32_adamw_on_tiny_llama() {
    let _serial = serial();
    const STEPS: u64 = 60;
    const AGREE_STEPS: usize = 20;
    const AGREE: f64 = 0.005;
    const TAIL_STEPS: usize = 20;
    const TAIL: f64 = 0.03;
    // Seed 5 in CI; HEADROOM_TEST_SEED=N measures the spread across seeds.
    let seed = std::env::var("HEADROOM_TEST_SEED").map_or(5, |s| s.parse().expect("a seed"));
    let f32_losses = llama_losses(Optimizer::Adamw, STEPS, seed);
    let eight_losses = llama_losses(Optimizer::Adamw8bit, STEPS, seed);
    eprintln!("seed {seed}\nf32 {f32_losses:?}\n8-bit {eight_losses:?}");
    let tail = |l: &[f64]| l[l.len() - TAIL_STEPS..].iter().sum::<f64>() / TAIL_STEPS as f64;
    let (a, b) = (tail(&f32_losses), tail(&eight_losses));
    eprintln!(
        "first {:.4} / {:.4}, last {TAIL_STEPS} {a:.4} (f32) vs {b:.4} (8-bit), {:+.2} %",
        f32_losses[0],
        eight_losses[0],
        100.0 * (b - a) / a
    );
    assert!(a < f32_losses[0] - 0.5, "f32 AdamW learns: {f32_losses:?}");
    assert!(
        b < eight_losses[0] - 0.5,
        "8-bit AdamW learns: {eight_losses:?}"
    );
    for (s, (x, y)) in f32_losses
        .iter()
        .zip(&eight_losses)
        .take(AGREE_STEPS)
        .enumerate()
    {
        assert!(
            (x - y).abs() <= AGREE * x,
            "step {s}: {y} (8-bit) vs {x} (f32)\n8-bit {eight_losses:?}\nf32 {f32_losses:?}"
        );
    }
    assert!(
        (b - a).abs() <= TAIL * a,
        "mean of the last {TAIL_STEPS} losses {b} (8-bit) vs {a} (f32)\n8-bit {eight_losses:?}\nf32 {f32_losses:?}"
    );
}
