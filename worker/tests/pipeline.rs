//! Pipeline stages train the same model as one worker: p = 1, 2, 3 give the
//! same losses over the same steps and data, with and without activation
//! checkpointing and with a tied or untied head, over TCP as the worker
//! connects them and over in-process links; and a checkpoint written under
//! one split resumes under another (the "more stages" rung).

mod common;

use std::net::TcpListener;
use std::path::Path;
use std::time::Duration;

use burn::tensor::Device;
use headroom_api::{Recipe, ScheduleType};
use headroom_planner::search::balanced_split;
use headroom_planner::{Settings, TransformerShape};
use headroom_worker::collective::Single;
use headroom_worker::data::TextSamples;
use headroom_worker::link_auth::LinkKey;
use headroom_worker::model::StageLayout;
use headroom_worker::pipeline::{Hello, Links, Peers, establish};
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
        ..Settings::default()
    }
}

/// How the stages of a run reach each other.
#[derive(Clone, Copy)]
enum Transport {
    /// Loopback sockets, connected by `establish` as the worker connects them.
    Tcp,
    /// `Links::in_process`: channels between the threads, no sockets.
    InProcess,
}

/// What a stage's thread connects with.
enum Connect {
    Tcp(TcpListener, Peers),
    InProcess(Links),
}

impl Transport {
    fn stages(self, p: u32) -> Vec<Connect> {
        match self {
            Transport::Tcp => {
                let (listeners, peers) = Peers::loopback(p).expect("loopback sockets");
                listeners
                    .into_iter()
                    .map(|l| Connect::Tcp(l, peers.clone()))
                    .collect()
            }
            Transport::InProcess => Links::in_process(p, Duration::from_secs(60))
                .into_iter()
                .map(Connect::InProcess)
                .collect(),
        }
    }
}

/// Trains `steps` optimizer steps (continuing from `dir`'s checkpoints when
/// there are some) on `p` stages, one thread per stage, linked `over`,
/// saving a checkpoint after the last step. Returns the last stage's losses.
fn run(
    over: Transport,
    p: u32,
    shape: &TransformerShape,
    settings: Settings,
    steps: u64,
    dir: Option<&Path>,
) -> Vec<f64> {
    let recipe = Recipe::constant(5e-3, 1_000);
    run_recipe(over, p, shape, settings, &recipe, steps, dir)
}

/// [`run`] following `recipe` (its schedule over its `total_steps`, of which
/// this run trains the next `steps`).
fn run_recipe(
    over: Transport,
    p: u32,
    shape: &TransformerShape,
    settings: Settings,
    recipe: &Recipe,
    steps: u64,
    dir: Option<&Path>,
) -> Vec<f64> {
    run_on(over, p, shape, settings, recipe, steps, dir, None)
}

/// [`run_recipe`] on the samples `text` makes for a stage's configuration
/// (the progression task when `None`).
#[allow(clippy::too_many_arguments)]
fn run_on(
    over: Transport,
    p: u32,
    shape: &TransformerShape,
    settings: Settings,
    recipe: &Recipe,
    steps: u64,
    dir: Option<&Path>,
    text: Option<fn(&TrainConfig) -> TextSamples>,
) -> Vec<f64> {
    let split = balanced_split(shape.layers, p).expect("split");
    let mut start = 0;
    let handles: Vec<_> = over
        .stages(p)
        .into_iter()
        .enumerate()
        .map(|(k, connect)| {
            let k = k as u32;
            let layout = StageLayout {
                layers: start..start + split[k as usize],
                first: k == 0,
                last: k + 1 == p,
            };
            start += split[k as usize];
            let mut config = TrainConfig::single_stage(shape.clone(), settings, 0, 5e-3, 7);
            config.recipe = recipe.clone();
            config.layout = layout;
            config.stage = k;
            config.stages = p;
            let dir = dir.map(Path::to_path_buf);
            std::thread::spawn(move || {
                let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
                if let Some(text) = text {
                    let samples = text(&trainer.config);
                    trainer.use_text(samples);
                }
                if let Some(dir) = &dir {
                    trainer.resume(dir).expect("resume");
                }
                let end = trainer.step + steps;
                let mut links = match connect {
                    Connect::Tcp(listener, peers) => {
                        let me = Hello {
                            job: "j".into(),
                            namespace: "ns".into(),
                            attempt: 1,
                            stage: k,
                            stages: p,
                            resume_step: trainer.step,
                        };
                        establish(
                            &me,
                            &LinkKey::from_bytes([7; 32]),
                            (k > 0).then_some(listener),
                            &peers,
                            Duration::from_secs(30),
                            Duration::from_secs(60),
                        )
                        .expect("links")
                    }
                    Connect::InProcess(links) => links,
                };
                let mut losses = Vec::new();
                while trainer.step < end {
                    let report = trainer
                        .train_step_with(&mut links, &mut Single)
                        .expect("step");
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
            let one = run(Transport::Tcp, 1, &shape, s, 4, None);
            assert!(one[3] < one[0], "it trains: {one:?}");
            for p in [2, 3] {
                let many = run(Transport::Tcp, p, &shape, s, 4, None);
                assert_close(
                    &one,
                    &many,
                    &format!("p = {p}, tied {tied}, checkpointing {checkpointing}"),
                );
            }
        }
    }
}

/// Masked targets (a chat's prompts) are normalised over the global
/// batch by the last stage alone: two and three stages train as one.
#[test]
fn masked_targets_give_the_losses_of_one_stage_across_stages() {
    let shape = shape(true);
    let recipe = Recipe::constant(5e-3, 1_000);
    for checkpointing in [false, true] {
        let s = settings(checkpointing);
        let one = run_on(
            Transport::InProcess,
            1,
            &shape,
            s,
            &recipe,
            3,
            None,
            Some(common::masked_text),
        );
        for p in [2, 3] {
            let many = run_on(
                Transport::InProcess,
                p,
                &shape,
                s,
                &recipe,
                3,
                None,
                Some(common::masked_text),
            );
            assert_close(
                &one,
                &many,
                &format!("masked, p = {p}, checkpointing {checkpointing}"),
            );
        }
    }
}

/// Samples packed by documents: every stage runs its blocks with the
/// micro-batch's documents (the middle and last stages hold no tokens of
/// it), so two and three stages train as one.
#[test]
fn documents_packing_gives_the_losses_of_one_stage_across_stages() {
    let shape = shape(false);
    let recipe = Recipe::constant(5e-3, 1_000);
    for checkpointing in [false, true] {
        let s = settings(checkpointing);
        let run = |p| {
            run_on(
                Transport::InProcess,
                p,
                &shape,
                s,
                &recipe,
                3,
                None,
                Some(common::documents_text),
            )
        };
        let one = run(1);
        for p in [2, 3] {
            assert_close(
                &one,
                &run(p),
                &format!("documents, p = {p}, checkpointing {checkpointing}"),
            );
        }
    }
}

/// The step's links are the caller's: two stages in two threads over
/// channels, no sockets, train what one stage does, and bitwise what two
/// stages over TCP do (the same f32 frames cross either link).
#[test]
fn two_stages_over_in_process_links_give_the_losses_of_one() {
    for tied in [true, false] {
        for checkpointing in [false, true] {
            let what = format!("tied {tied}, checkpointing {checkpointing}");
            let shape = shape(tied);
            let s = settings(checkpointing);
            let one = run(Transport::InProcess, 1, &shape, s, 4, None);
            let two = run(Transport::InProcess, 2, &shape, s, 4, None);
            assert_eq!(two, run(Transport::Tcp, 2, &shape, s, 4, None), "{what}");
            if !tied {
                // Each stage computes what the one stage computes of it.
                assert_eq!(one, two, "{what}");
                continue;
            }
            // A tied embedding's gradient is summed per micro-batch
            // (embedding + head) on one stage, and per stage on two (all
            // the embedding's micro-batches, then the head's): float
            // addition does not associate, so from the second step the
            // losses differ in the last bits. Measured 2.5e-8 relative
            // (flex, 4 steps); the bound leaves 40 times that.
            for (a, b) in one.iter().zip(&two) {
                assert!(
                    (a - b).abs() <= 1e-6 * a.abs(),
                    "{what}: {one:?} vs {two:?}"
                );
            }
            assert_eq!(
                one[0], two[0],
                "the first step is before any update: {what}"
            );
        }
    }
}

#[test]
fn a_checkpoint_resumes_under_another_split() {
    let shape = shape(true);
    let s = settings(false);
    let straight = run(Transport::Tcp, 1, &shape, s, 6, None);
    let dir = std::env::temp_dir().join(format!("headroom-pipeline-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // 1 stage, then 3 (more stages: the retry rung), then 2.
    let mut losses = run(Transport::Tcp, 1, &shape, s, 2, Some(&dir));
    losses.extend(run(Transport::Tcp, 3, &shape, s, 2, Some(&dir)));
    losses.extend(run(Transport::Tcp, 2, &shape, s, 2, Some(&dir)));
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

/// A resumed attempt continues the recipe where it stopped: warmup, then a
/// cosine over the whole run, weight decay and clipping, across checkpoints
/// and splits (1 stage, then 3, then 2), give the losses of the run straight
/// through: the rate of each step depends on the step the checkpoint
/// restored, not on the attempt that runs it.
#[test]
fn the_recipe_continues_across_a_resume_under_another_split() {
    let shape = shape(true);
    let s = settings(false);
    let recipe = Recipe {
        schedule: ScheduleType::Cosine,
        warmup_steps: 2,
        weight_decay: 0.1,
        max_grad_norm: 0.5,
        ..Recipe::constant(5e-3, 6)
    };
    let straight = run_recipe(Transport::Tcp, 1, &shape, s, &recipe, 6, None);
    let dir = std::env::temp_dir().join(format!("headroom-recipe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut losses = run_recipe(Transport::Tcp, 1, &shape, s, &recipe, 2, Some(&dir));
    losses.extend(run_recipe(
        Transport::Tcp,
        3,
        &shape,
        s,
        &recipe,
        2,
        Some(&dir),
    ));
    losses.extend(run_recipe(
        Transport::Tcp,
        2,
        &shape,
        s,
        &recipe,
        2,
        Some(&dir),
    ));
    assert_close(&straight, &losses, "1 → 3 → 2 stages across checkpoints");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Offloaded checkpoints on pipeline stages: under 1F1B a stage keeps the
/// block inputs of several micro-batches at once (up to p − k), every one
/// in host memory now, and a later stage's first block input is what it
/// received. Three stages train bit for bit as with the inputs kept.
#[test]
fn offloaded_checkpoints_train_three_stages_bit_for_bit() {
    let shape = shape(false);
    let kept = settings(true);
    let offloaded = Settings {
        offload_activations: true,
        ..kept
    };
    let on_device = run(Transport::InProcess, 3, &shape, kept, 4, None);
    assert_eq!(
        on_device,
        run(Transport::InProcess, 3, &shape, offloaded, 4, None)
    );
}
