//! Gradient offload (`offloadGradients`): each block's gradients summed in
//! host memory as the checkpointed backward produces them, and the update
//! stepped block by block from those sums, train as the device accumulator
//! does: on one stage, on 2 pipeline stages (a tied embedding split across
//! them, so its gradient exchange runs on host sums), on 2 data-parallel
//! replicas (the reduce-scatter runs on host sums), with clipping and
//! weight decay; a checkpoint resumes across the setting turned on or off.
//!
//! On this CPU machine the host is the training device (flex), so these
//! tests check the accumulation, the exchanges and the block-by-block
//! update, not a transfer over PCIe (the CUDA build compiles the same
//! code; its copies run only on a GPU worker).
//!
//! Bound: the sums are the device accumulator's addition for addition and
//! every parameter is stepped once, so the losses and weights are equal
//! bit for bit (measured 0 difference on every row, over repeated runs of
//! each); the assertions allow [`LOSS_BOUND`], a margin far below any real
//! difference (a gradient lost or counted twice moves the third step's
//! loss by 1e-3 or more).

mod common;

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Tensor};
use headroom_api::Recipe;
use headroom_planner::search::balanced_split;
use headroom_planner::{Settings, TransformerShape};
use headroom_worker::collective::{Ring, RingTimeouts};
use headroom_worker::model::StageLayout;
use headroom_worker::pipeline::Links;
use headroom_worker::train::{TrainConfig, Trainer};

/// Allowed loss difference (absolute) between offloaded and device
/// gradients: the measured difference is 0.
const LOSS_BOUND: f64 = 1e-6;
/// Allowed weight difference (absolute) at the end of a run; measured 0.
const WEIGHT_BOUND: f32 = 1e-6;

/// Model initialisation draws from burn's global RNG (a Trainer seeds it).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn shape() -> TransformerShape {
    TransformerShape {
        layers: 4,
        ..common::tiny_shape()
    }
}

/// Per replica: micro-batch 2 × `accumulation`, checkpointing and the
/// optimizer offloaded (what offloaded gradients need), gradients
/// offloaded when `offload`.
fn settings(accumulation: u32, offload: bool) -> Settings {
    Settings {
        micro_batch: 2,
        gradient_accumulation: accumulation,
        activation_checkpointing: true,
        offload_optimizer: true,
        offload_gradients: offload,
        ..Settings::default()
    }
}

/// Weight decay, and a clipping limit every step's norm exceeds (so the
/// clipping's factor, computed from the host sums, shapes every update).
fn recipe() -> Recipe {
    Recipe {
        weight_decay: 0.1,
        max_grad_norm: 0.5,
        ..Recipe::constant(1e-2, 1_000)
    }
}

#[derive(Debug)]
struct Outcome {
    losses: Vec<f64>,
    norms: Vec<f64>,
    /// Every parameter of the stage, module visit order.
    params: Vec<Vec<f32>>,
}

fn params(trainer: &Trainer) -> Vec<Vec<f32>> {
    struct All(Vec<Vec<f32>>);
    impl ModuleVisitor for All {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.push(param.val().into_data().iter::<f32>().collect());
        }
    }
    let mut all = All(Vec::new());
    trainer.model().visit(&mut all);
    all.0
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "headroom-gradient-offload-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// Trains `steps` steps on `p` stages × `d` replicas, each (stage, replica)
/// on its own thread: in-process links along each replica's pipeline, a
/// loopback ring among each stage's replicas. Resumes from `resume` and
/// saves into `save` when given. Returns the outcomes `[stage][replica]`.
fn run(
    p: u32,
    d: u32,
    settings: Settings,
    steps: u64,
    resume: Option<&Path>,
    save: Option<&Path>,
) -> Vec<Vec<Outcome>> {
    let shape = shape();
    let split = balanced_split(shape.layers, p).expect("split");
    let timeouts = RingTimeouts {
        rendezvous: Duration::from_secs(30),
        io: Duration::from_secs(60),
    };
    let mut rings: Vec<Vec<Option<Ring>>> = (0..p)
        .map(|_| {
            Ring::loopback(d, timeouts)
                .expect("ring")
                .into_iter()
                .map(Some)
                .collect()
        })
        .collect();
    let mut pipelines: Vec<Vec<Option<Links>>> = (0..d)
        .map(|_| {
            Links::in_process(p, Duration::from_secs(60))
                .into_iter()
                .map(Some)
                .collect()
        })
        .collect();
    let mut handles = Vec::new();
    let mut start = 0;
    for k in 0..p {
        let layout = StageLayout {
            layers: start..start + split[k as usize],
            first: k == 0,
            last: k + 1 == p,
        };
        start += split[k as usize];
        for r in 0..d {
            let mut config: TrainConfig =
                TrainConfig::single_stage(shape.clone(), settings, 0, 1e-2, 7).with_replica(r, d);
            config.recipe = recipe();
            config.layout = layout.clone();
            config.stage = k;
            config.stages = p;
            let mut ring = rings[k as usize][r as usize].take().expect("ring");
            let mut links = pipelines[r as usize][k as usize].take().expect("links");
            let (resume, save) = (resume.map(Path::to_path_buf), save.map(Path::to_path_buf));
            handles.push(std::thread::spawn(move || {
                let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
                if let Some(dir) = &resume {
                    trainer.resume(dir).expect("resume").expect("a checkpoint");
                }
                let end = trainer.step + steps;
                let (mut losses, mut norms) = (Vec::new(), Vec::new());
                while trainer.step < end {
                    let report = trainer
                        .train_step_with(&mut links, &mut ring)
                        .expect("step");
                    losses.extend(report.loss);
                    norms.extend(report.grad_norm);
                }
                if let Some(dir) = &save {
                    trainer
                        .save_checkpoint(dir, 1, losses.last().copied())
                        .expect("save");
                }
                Outcome {
                    losses,
                    norms,
                    params: params(&trainer),
                }
            }));
        }
    }
    let mut done: Vec<Outcome> = handles
        .into_iter()
        .map(|h| h.join().expect("worker thread"))
        .collect();
    let mut by_stage = Vec::new();
    for _ in 0..p {
        let rest = done.split_off(d as usize);
        by_stage.push(std::mem::replace(&mut done, rest));
    }
    by_stage
}

fn last_losses(run: &[Vec<Outcome>]) -> Vec<f64> {
    run.last().expect("stages")[0].losses.clone()
}

/// The largest loss difference, asserted within [`LOSS_BOUND`] and printed
/// (the measurement the bound comes from).
fn assert_losses(a: &[f64], b: &[f64], what: &str) -> f64 {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    let diff = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max);
    println!(
        "{what}: max loss difference {diff:e} over {} steps",
        a.len()
    );
    assert!(diff <= LOSS_BOUND, "{what}: {a:?} vs {b:?}");
    diff
}

fn assert_weights(a: &[Vec<Outcome>], b: &[Vec<Outcome>], what: &str) {
    for (stage_a, stage_b) in a.iter().zip(b) {
        for (x, y) in stage_a.iter().zip(stage_b) {
            let diff = x
                .params
                .iter()
                .flatten()
                .zip(y.params.iter().flatten())
                .map(|(u, v)| (u - v).abs())
                .fold(0.0, f32::max);
            println!("{what}: max weight difference {diff:e}");
            assert!(diff <= WEIGHT_BOUND, "{what}: weights part by {diff}");
            assert_eq!(x.norms.len(), y.norms.len());
            for (m, n) in x.norms.iter().zip(&y.norms) {
                assert!(
                    (m - n).abs() <= 1e-6 * m.max(1.0),
                    "{what}: norms {m} vs {n}"
                );
            }
        }
    }
}

/// One stage, accumulation 3: the same losses, norms and weights.
#[test]
fn one_stage_trains_alike_with_gradients_offloaded() {
    let _serial = serial();
    let steps = 4;
    let start = run(1, 1, settings(3, true), 0, None, None);
    let device = run(1, 1, settings(3, false), steps, None, None);
    let host = run(1, 1, settings(3, true), steps, None, None);
    let losses = last_losses(&device);
    // The updates were applied (equal because both did nothing would pass too).
    let moved = start[0][0]
        .params
        .iter()
        .flatten()
        .zip(host[0][0].params.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(
        moved > 1e-3,
        "the weights moved by {moved} only ({losses:?})"
    );
    assert!(
        device[0][0].norms.iter().all(|&n| n > 0.5),
        "every step is clipped: {:?}",
        device[0][0].norms
    );
    assert_losses(&losses, &last_losses(&host), "1 stage");
    assert_weights(&device, &host, "1 stage");
}

/// Two pipeline stages with the tied embedding split across them: its two
/// halves are exchanged and summed on the host.
#[test]
fn two_stages_train_alike_with_gradients_offloaded() {
    let _serial = serial();
    let steps = 3;
    let one = run(1, 1, settings(3, false), steps, None, None);
    let device = run(2, 1, settings(3, false), steps, None, None);
    let host = run(2, 1, settings(3, true), steps, None, None);
    assert_losses(&last_losses(&device), &last_losses(&host), "2 stages");
    assert_weights(&device, &host, "2 stages");
    // And the split trains as one stage does (within the pipeline tests' tolerance).
    for (x, y) in last_losses(&one).iter().zip(&last_losses(&host)) {
        assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "{x} vs {y}");
    }
}

/// Two data-parallel replicas (accumulation 2 each, the same global batch
/// as accumulation 4 on one): the reduce-scatter of the host sums and each
/// replica's share of the update.
#[test]
fn two_replicas_train_alike_with_gradients_offloaded() {
    let _serial = serial();
    let steps = 3;
    let device = run(1, 2, settings(2, false), steps, None, None);
    let host = run(1, 2, settings(2, true), steps, None, None);
    assert_losses(&last_losses(&device), &last_losses(&host), "2 replicas");
    assert_weights(&device, &host, "2 replicas");
    let single = run(1, 1, settings(4, true), steps, None, None);
    for (x, y) in last_losses(&single).iter().zip(&last_losses(&host)) {
        assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "{x} vs {y}");
    }
}

/// Turned on by a retry after 2 steps, and off again: the checkpoint holds
/// no gradients (a step ends with none), and the optimizer state carries
/// over, so the losses are the straight run's.
#[test]
fn a_checkpoint_resumes_across_gradient_offload_on_and_off() {
    let _serial = serial();
    let straight = last_losses(&run(1, 1, settings(3, false), 4, None, None));
    for (before, after) in [(false, true), (true, false)] {
        let dir = temp_dir(&format!("{before}-{after}"));
        let first = last_losses(&run(1, 1, settings(3, before), 2, None, Some(&dir)));
        let second = last_losses(&run(1, 1, settings(3, after), 2, Some(&dir), None));
        let resumed: Vec<f64> = first.into_iter().chain(second).collect();
        assert_losses(
            &straight,
            &resumed,
            &format!("offload {before} → {after} at step 2"),
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// Without checkpointing or without the offloaded optimizer the worker
/// refuses the setting, naming it and what it needs; so it does a compact
/// host state without the offloaded optimizer.
#[test]
fn offloaded_gradients_need_checkpointing_and_the_offloaded_optimizer() {
    let _serial = serial();
    for (checkpointing, optimizer) in [(false, true), (true, false), (false, false)] {
        let mut s = settings(3, true);
        s.activation_checkpointing = checkpointing;
        s.offload_optimizer = optimizer;
        let config = TrainConfig::single_stage(shape(), s, 1, 1e-2, 7);
        let err = Trainer::new(config, Device::flex().autodiff()).expect_err("refused");
        assert_eq!(err.field, "plan.settings.offloadGradients");
        assert!(
            err.problem.contains("activationCheckpointing")
                && err.problem.contains("offloadOptimizer"),
            "{err}"
        );
    }
    // A compact host state is the offloaded optimizer's.
    let s = Settings {
        compact_host_state: true,
        ..settings(3, false)
    };
    let s = Settings {
        offload_optimizer: false,
        ..s
    };
    let config = TrainConfig::single_stage(shape(), s, 1, 1e-2, 7);
    let err = Trainer::new(config, Device::flex().autodiff()).expect_err("refused");
    assert_eq!(err.field, "plan.settings.compactHostState");
    assert!(err.problem.contains("offloadOptimizer"), "{err}");
}
