//! Pipeline stages train the same model as one worker: p = 1, 2, 3 give the
//! same losses over the same steps and data, with and without activation
//! checkpointing and with a tied or untied head; and a checkpoint written
//! under one split resumes under another (the "more stages" rung).

mod common;

use std::path::Path;
use std::time::Duration;

use burn::tensor::Device;
use headroom_planner::search::balanced_split;
use headroom_planner::{Optimizer, Settings, TransformerShape};
use headroom_worker::model::StageLayout;
use headroom_worker::pipeline::{Hello, Peers, establish};
use headroom_worker::train::{TrainConfig, Trainer};

fn shape(tied: bool) -> TransformerShape {
    TransformerShape {
        layers: 3,
        hidden: 32,
        heads: 4,
        sequence_length: 16,
        vocabulary: 24,
        feed_forward: None,
        tied_embeddings: tied,
    }
}

fn settings(checkpointing: bool) -> Settings {
    Settings {
        micro_batch: 2,
        gradient_accumulation: 3,
        activation_checkpointing: checkpointing,
        precision: headroom_planner::Precision::Fp32,
        optimizer: Optimizer::Adamw,
        base_format: headroom_planner::BaseFormat::Dense,
        offload_optimizer: false,
    }
}

/// Trains `steps` optimizer steps (continuing from `dir`'s checkpoints when
/// there are some) on `p` stages, one thread and one loopback link per
/// stage, saving a checkpoint after the last step. Returns the last stage's
/// losses.
fn run(
    p: u32,
    shape: &TransformerShape,
    settings: Settings,
    steps: u64,
    dir: Option<&Path>,
) -> Vec<f64> {
    let split = balanced_split(shape.layers, p).expect("split");
    let (listeners, peers) = Peers::loopback(p).expect("loopback sockets");
    let mut start = 0;
    let handles: Vec<_> = listeners
        .into_iter()
        .enumerate()
        .map(|(k, listener)| {
            let k = k as u32;
            let layout = StageLayout {
                layers: start..start + split[k as usize],
                first: k == 0,
                last: k + 1 == p,
            };
            start += split[k as usize];
            let mut config = TrainConfig::single_stage(shape.clone(), settings, 0, 5e-3, 7);
            config.layout = layout;
            config.stage = k;
            config.stages = p;
            let peers = peers.clone();
            let dir = dir.map(Path::to_path_buf);
            std::thread::spawn(move || {
                let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
                if let Some(dir) = &dir {
                    trainer.resume(dir).expect("resume");
                }
                trainer.config.steps = trainer.step + steps;
                let me = Hello {
                    job: "j".into(),
                    namespace: "ns".into(),
                    attempt: 1,
                    stage: k,
                    stages: p,
                    resume_step: trainer.step,
                };
                let links = establish(
                    &me,
                    (k > 0).then_some(listener),
                    &peers,
                    Duration::from_secs(30),
                    Duration::from_secs(60),
                )
                .expect("links");
                trainer.connect(links);
                let mut losses = Vec::new();
                while !trainer.finished() {
                    let report = trainer.train_step().expect("step");
                    assert_eq!(
                        report.loss.is_some(),
                        k + 1 == p,
                        "only the last stage has the loss"
                    );
                    losses.extend(report.loss);
                }
                if let Some(dir) = &dir {
                    trainer
                        .save_checkpoint(dir, 1, losses.last().copied())
                        .expect("save");
                }
                losses
            })
        })
        .collect();
    // Join every stage, not just the last: a stage still saving its
    // checkpoint when the next run resumes would race that run's cleanup of
    // half-written directories.
    let mut all: Vec<Vec<f64>> = handles
        .into_iter()
        .map(|h| h.join().expect("stage thread"))
        .collect();
    all.pop().expect("a last stage")
}

fn assert_close(a: &[f64], b: &[f64], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: {a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!(
            (x - y).abs() <= 1e-4 * x.abs().max(1.0),
            "{what}: {a:?} vs {b:?}"
        );
    }
}

#[test]
fn two_and_three_stages_give_the_losses_of_one() {
    for tied in [true, false] {
        for checkpointing in [false, true] {
            let shape = shape(tied);
            let s = settings(checkpointing);
            let one = run(1, &shape, s, 4, None);
            assert!(one[3] < one[0], "it trains: {one:?}");
            for p in [2, 3] {
                let many = run(p, &shape, s, 4, None);
                assert_close(
                    &one,
                    &many,
                    &format!("p = {p}, tied {tied}, checkpointing {checkpointing}"),
                );
            }
        }
    }
}

#[test]
fn a_checkpoint_resumes_under_another_split() {
    let shape = shape(true);
    let s = settings(false);
    let straight = run(1, &shape, s, 6, None);
    let dir = std::env::temp_dir().join(format!("headroom-pipeline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // 1 stage, then 3 (more stages: the retry rung), then 2.
    let mut losses = run(1, &shape, s, 2, Some(&dir));
    losses.extend(run(3, &shape, s, 2, Some(&dir)));
    losses.extend(run(2, &shape, s, 2, Some(&dir)));
    assert_close(&straight, &losses, "1 → 3 → 2 stages across checkpoints");
    // Saves prune steps older than the newest two complete ones. Stages
    // prune concurrently, so the stage that saves step 6 first may still see
    // it incomplete and keep step 2 until the next save.
    let mut steps: Vec<String> = std::fs::read_dir(&dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    steps.sort();
    assert!(
        steps.ends_with(&["step-000000000004".into(), "step-000000000006".into()])
            && steps.len() <= 3,
        "{steps:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
