//! 8-bit AdamW against f32 AdamW on the tiny Llama fixture
//! (`worker/tests/fixtures/llama/tiny-llama`: hidden 64, 4 layers, vocabulary
//! 512, tied head) on the flex backend: optimizer state bytes and step times.
//!
//! State bytes, per optimizer: what its moments hold in memory (computed from
//! the parameter sizes: AdamW 8 bytes per element; AdamW8bit 2 bytes per
//! element padded to blocks of 256 plus 8 bytes per block, 8 bytes per
//! element below 4096 elements), and the size of its serialized optimizer
//! record (the checkpoint's `optimizer.bpk`), which carries the same tensors
//! in their stored dtypes.
//!
//! Times, medians of `--steps` (default 40) after 5 warm-up steps: the
//! optimizer update alone (`ModuleOptimizer::step` on gradients of a fixed
//! batch) and a whole training step (`Trainer::train_step`, micro-batch 2 ×
//! accumulation 2, sequence 32).
//!
//! Usage (release build; debug figures are meaningless):
//!   cargo run --release -p headroom-worker --bin adamw8bit -- [--steps N]

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::{Device, Tensor};
use headroom_planner::{Optimizer, Settings};
use headroom_worker::data::ProgressionTask;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::optim::blockwise::{BLOCK, Quantized};
use headroom_worker::train::{TrainConfig, Trainer};

const SEQUENCE: u32 = 32;
const MIN_8BIT_ELEMENTS: usize = 4096;

fn tiny_llama() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/tiny-llama")
}

fn trainer(optimizer: Optimizer) -> Trainer {
    let checkpoint = HfCheckpoint::open(&tiny_llama(), SEQUENCE).expect("tiny-llama fixture");
    let config = TrainConfig::single_stage(
        checkpoint.shape,
        Settings {
            micro_batch: 2,
            gradient_accumulation: 2,
            optimizer,
            ..Settings::default()
        },
        1_000_000,
        3e-3,
        5,
    )
    .with_pretrained(tiny_llama());
    Trainer::new(config, Device::flex().autodiff()).expect("trainer")
}

/// Element counts of every float parameter.
#[derive(Default)]
struct Sizes(Vec<usize>);

impl ModuleVisitor for Sizes {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        self.0.push(param.val().shape().num_elements());
    }
}

/// In-memory moment bytes: (AdamW, AdamW8bit).
fn state_bytes(sizes: &[usize]) -> (usize, usize) {
    let f32_bytes = sizes.iter().map(|n| 8 * n).sum();
    let eight_bytes = sizes
        .iter()
        .map(|&n| {
            if n < MIN_8BIT_ELEMENTS {
                8 * n
            } else {
                let blocks = Quantized::blocks(n);
                2 * (blocks * BLOCK + 4 * blocks)
            }
        })
        .sum();
    (f32_bytes, eight_bytes)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

struct Figures {
    record_bytes: usize,
    optimizer_step: Duration,
    train_step: Duration,
}

fn measure(optimizer: Optimizer, steps: usize) -> Figures {
    let mut t = trainer(optimizer);
    for _ in 0..5 {
        t.train_step().expect("warm-up step");
    }
    let record_bytes = t
        .optimizer
        .to_record()
        .into_bytes()
        .expect("optimizer record")
        .len();

    let task = ProgressionTask {
        seed: 3,
        vocabulary: t.config.shape.vocabulary(),
        sequence_length: SEQUENCE,
    };
    let (tokens, targets) = task.batch(0, 2, &t.device);
    let mut optimizer_times = Vec::with_capacity(steps);
    for _ in 0..steps {
        let model = t.take_model();
        let grads = model.loss(tokens.clone(), targets.clone()).backward();
        let grads = GradientsParams::from_grads(grads, &model);
        let started = Instant::now();
        let model = t.optimizer.step(1e-4, model, grads);
        optimizer_times.push(started.elapsed());
        t.set_model(model);
    }
    let train_times = (0..steps)
        .map(|_| t.train_step().expect("step").elapsed)
        .collect();
    Figures {
        record_bytes,
        optimizer_step: median(optimizer_times),
        train_step: median(train_times),
    }
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut steps = 40;
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--steps" => {
                steps = args
                    .next()
                    .and_then(|s| s.parse().ok())
                    .expect("--steps takes a number")
            }
            other => panic!("unknown argument {other}; usage: adamw8bit [--steps N]"),
        }
    }
    let model = trainer(Optimizer::Adamw).take_model();
    let mut sizes = Sizes::default();
    model.visit(&mut sizes);
    let parameters: usize = sizes.0.iter().sum();
    let quantized = sizes
        .0
        .iter()
        .filter(|n| **n >= MIN_8BIT_ELEMENTS)
        .sum::<usize>();
    let (f32_bytes, eight_bytes) = state_bytes(&sizes.0);

    let f32_run = measure(Optimizer::Adamw, steps);
    let eight_run = measure(Optimizer::Adamw8bit, steps);
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    println!(
        "tiny Llama: {parameters} parameters in {} tensors, {quantized} ({:.1} %) in tensors of ≥ {MIN_8BIT_ELEMENTS} elements",
        sizes.0.len(),
        100.0 * quantized as f64 / parameters as f64
    );
    println!(
        "moment bytes in memory: adamw {f32_bytes}, adamw8bit {eight_bytes} ({:.3}×, {:.2} bytes/parameter vs 8)",
        eight_bytes as f64 / f32_bytes as f64,
        eight_bytes as f64 / parameters as f64
    );
    println!(
        "optimizer record (optimizer.bpk) bytes: adamw {}, adamw8bit {} ({:.3}×)",
        f32_run.record_bytes,
        eight_run.record_bytes,
        eight_run.record_bytes as f64 / f32_run.record_bytes as f64
    );
    println!(
        "optimizer update, median of {steps}: adamw {:.3} ms, adamw8bit {:.3} ms ({:.2}×)",
        ms(f32_run.optimizer_step),
        ms(eight_run.optimizer_step),
        ms(eight_run.optimizer_step) / ms(f32_run.optimizer_step)
    );
    println!(
        "training step, median of {steps}: adamw {:.3} ms, adamw8bit {:.3} ms ({:.2}×)",
        ms(f32_run.train_step),
        ms(eight_run.train_step),
        ms(eight_run.train_step) / ms(f32_run.train_step)
    );
}
