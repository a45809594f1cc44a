//! What the recipe reference tests share: PyTorch's curves from
//! `tests/fixtures/recipe/`, the worker's configuration of the same job, and
//! the per-step comparison. Each test binary (fp32, bf16) includes it, as
//! flex's float dtype is set once per process.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use headroom_api::{AdamSpec, Recipe, ScheduleType};
use headroom_planner::{LoraConfig, Settings, TargetModule};
use headroom_worker::data::ProgressionTask;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::peft;
use headroom_worker::train::{TrainConfig, Trainer};
use serde_json::Value;

pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/recipe")
}

pub fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// PyTorch's side of `run` (`full` or `lora`).
pub fn reference(run: &str) -> Value {
    let path = fixtures().join(format!("{run}.json"));
    let text = std::fs::read_to_string(&path).expect("fixture");
    serde_json::from_str(&text).expect("fixture JSON")
}

pub fn number(v: &Value, key: &str) -> f64 {
    v[key]
        .as_f64()
        .unwrap_or_else(|| panic!("{key}: {}", v[key]))
}

pub fn integer(v: &Value, key: &str) -> u64 {
    v[key]
        .as_u64()
        .unwrap_or_else(|| panic!("{key}: {}", v[key]))
}

pub fn series(v: &Value, key: &str) -> Vec<f64> {
    v[key]
        .as_array()
        .unwrap_or_else(|| panic!("{key}: {}", v[key]))
        .iter()
        .map(|x| x.as_f64().expect("number"))
        .collect()
}

pub fn tokens(v: &Value) -> Vec<i64> {
    v.as_array()
        .expect("sample")
        .iter()
        .map(|t| t.as_i64().expect("token"))
        .collect()
}

/// The recipe of the Trainer's `TrainingArguments` recorded in `settings`
/// (anything else as [`Recipe::constant`] leaves it: no minimum learning
/// rate, steps rather than epochs).
pub fn recipe(settings: &Value) -> Recipe {
    assert_eq!(settings["schedule"], "cosine");
    Recipe {
        schedule: ScheduleType::Cosine,
        warmup_steps: integer(settings, "warmup_steps"),
        weight_decay: number(settings, "weight_decay"),
        adam: AdamSpec {
            beta1: number(settings, "adam_beta1"),
            beta2: number(settings, "adam_beta2"),
            epsilon: number(settings, "adam_epsilon"),
        },
        max_grad_norm: number(settings, "max_grad_norm"),
        ..Recipe::constant(
            number(settings, "learning_rate"),
            integer(settings, "steps"),
        )
    }
}

pub fn lora(settings: &Value) -> LoraConfig {
    let targets = settings["target_modules"]
        .as_array()
        .expect("target_modules")
        .iter()
        .map(|m| {
            let name = m.as_str().expect("name");
            TargetModule::from_hf_name(name).unwrap_or_else(|| panic!("module {name}"))
        })
        .collect();
    LoraConfig {
        rank: integer(settings, "r") as u32,
        alpha: number(settings, "lora_alpha"),
        dropout: number(settings, "lora_dropout"),
        target_modules: targets,
        block_size: 64, // a quantized base only
    }
}

/// The worker's configuration of the job PyTorch ran, split into
/// micro-batches of `micro_batch` (the same global batch).
pub fn config(reference: &Value, micro_batch: u32) -> TrainConfig {
    let s = &reference["settings"];
    let model = repo().join(s["model"].as_str().expect("model"));
    let sequence = integer(s, "sequence_length") as u32;
    let global = integer(s, "micro_batch") * integer(s, "gradient_accumulation");
    let checkpoint = HfCheckpoint::open(&model, sequence).expect("checkpoint");
    let mut config = TrainConfig::single_stage(
        checkpoint.shape,
        Settings {
            micro_batch,
            gradient_accumulation: (global / u64::from(micro_batch)) as u32,
            ..Settings::default()
        },
        0,
        0.0,
        integer(s, "seed"),
    )
    .with_pretrained(model);
    config.recipe = recipe(s);
    if !s["lora"].is_null() {
        config = config.with_adapters(lora(&s["lora"]));
    }
    config
}

/// What the worker logged per step.
#[derive(Debug, Default)]
pub struct Curve {
    pub loss: Vec<f64>,
    pub learning_rate: Vec<f64>,
    pub grad_norm: Vec<f64>,
}

/// Trains the job as `config` says on `device` (flex, in fp32 or bf16) on
/// `threads` rayon threads.
pub fn train(config: TrainConfig, device: &Device, threads: usize) -> Curve {
    let device = device.clone();
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("rayon pool");
    pool.install(move || {
        let adapters = config.adapters.clone();
        let layout = config.layout.clone();
        let mut trainer = Trainer::new(config, device.autodiff()).expect("trainer");
        if let Some(adapters) = adapters {
            // PEFT's initial adapter, not one drawn from the worker's seed.
            let model = trainer.take_model();
            let model = peft::load_stage(model, &layout, &adapters, &fixtures().join("lora-init"))
                .expect("PEFT's initial adapter");
            trainer.set_model(model);
        }
        let mut curve = Curve::default();
        while !trainer.finished() {
            let report = trainer.train_step().expect("step");
            curve
                .loss
                .push(report.loss.expect("one stage computes the loss"));
            curve.learning_rate.push(report.learning_rate);
            curve
                .grad_norm
                .push(report.grad_norm.expect("clipping is on"));
        }
        curve
    })
}

/// Largest absolute and relative per-step difference of `ours` from `theirs`.
pub fn difference(ours: &[f64], theirs: &[f64]) -> (f64, f64) {
    assert_eq!(ours.len(), theirs.len(), "steps");
    ours.iter().zip(theirs).fold((0.0, 0.0), |(a, r), (x, y)| {
        let d = (x - y).abs();
        (f64::max(a, d), f64::max(r, d / y.abs().max(1e-30)))
    })
}

/// The worker's data is the data PyTorch trained on: the first samples and
/// the last.
pub fn check_data(reference: &Value, config: &TrainConfig) {
    let task = ProgressionTask {
        seed: config.seed,
        vocabulary: config.shape.vocabulary(),
        sequence_length: config.shape.sequence_length(),
    };
    for (i, expected) in reference["first_samples"]
        .as_array()
        .expect("first_samples")
        .iter()
        .enumerate()
    {
        assert_eq!(task.sample(i as u64), tokens(expected), "sample {i}");
    }
    let last = config.recipe.total_steps * config.global_batch() - 1;
    assert_eq!(
        task.sample(last),
        tokens(&reference["last_sample"]),
        "sample {last}"
    );
}

/// How far the worker's curve lies from PyTorch's: the largest per-step
/// differences of the loss (absolute), the learning rate and the gradient
/// norm (relative), and the difference of the mean loss over all steps (a
/// drift that per-step noise does not hide: bf16's curves part step by step
/// in both directions).
#[derive(Debug)]
pub struct Gap {
    pub loss: f64,
    pub learning_rate: f64,
    pub grad_norm: f64,
    pub mean_loss: f64,
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len() as f64
}

/// Trains `run` (a fixture's name) as PyTorch did, on `device`, with
/// `change` made to the worker's configuration, and prints the curves side by
/// side.
pub fn measure(run: &str, device: &Device, change: impl FnOnce(&mut TrainConfig)) -> Gap {
    let reference = reference(run);
    let micro = integer(&reference["settings"], "micro_batch") as u32;
    let mut config = config(&reference, micro);
    check_data(&reference, &config);
    change(&mut config);
    let ours = train(config, device, 1);
    let (loss, lr, norm) = (
        series(&reference, "loss"),
        series(&reference, "learning_rate"),
        series(&reference, "grad_norm"),
    );
    let (loss_abs, loss_rel) = difference(&ours.loss, &loss);
    let (_, lr_rel) = difference(&ours.learning_rate, &lr);
    let (norm_abs, norm_rel) = difference(&ours.grad_norm, &norm);
    let mean_loss = (mean(&ours.loss) - mean(&loss)).abs();
    println!(
        "{run}: loss {:.4} -> {:.4} (PyTorch {:.4} -> {:.4}); max |diff| loss {loss_abs:.2e} (rel {loss_rel:.2e}), \
         grad norm {norm_abs:.2e} (rel {norm_rel:.2e}), learning rate rel {lr_rel:.2e}; mean loss {mean_loss:.2e}",
        ours.loss[0],
        ours.loss[ours.loss.len() - 1],
        loss[0],
        loss[loss.len() - 1],
    );
    for step in [0, 1, 5, 6, 10, 20, 30, 40, 50, 59]
        .into_iter()
        .filter(|&s| s < loss.len())
    {
        println!(
            "  step {:2}: loss {:.6} vs {:.6}, lr {:.6e} vs {:.6e}, grad norm {:.6} vs {:.6}",
            step + 1,
            ours.loss[step],
            loss[step],
            ours.learning_rate[step],
            lr[step],
            ours.grad_norm[step],
            norm[step]
        );
    }
    Gap {
        loss: loss_abs,
        learning_rate: lr_rel,
        grad_norm: norm_rel,
        mean_loss,
    }
}
