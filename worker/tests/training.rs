//! The training loop honours the plan: loss falls, accumulation equals one
//! big batch, block checkpointing gives the same gradients.

mod common;

use burn::module::Module;
use burn::tensor::Device;
use headroom_worker::data::Samples;
use headroom_worker::train::Trainer;

use common::{documents_text, masked_text, tiny_config};

#[test]
fn loss_falls_over_a_short_run() {
    let config = tiny_config(8, 1, false);
    let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
    let loss =
        |r: headroom_worker::train::StepReport| r.loss.expect("a single stage computes the loss");
    let first = loss(trainer.train_step().expect("step"));
    let mut last = first;
    let t = std::time::Instant::now();
    while trainer.step < 40 {
        last = loss(trainer.train_step().expect("step"));
    }
    eprintln!("first {:.3} last {:.3} in {:?}", first, last, t.elapsed());
    assert!(last < 0.6 * first, "loss {first} → {last}");
}

/// Logits of the trainer's current model on a fixed probe batch.
fn probe(trainer: &Trainer) -> Vec<f32> {
    let task = headroom_worker::data::ProgressionTask {
        seed: 99,
        vocabulary: trainer.config.shape.vocabulary(),
        sequence_length: trainer.config.shape.sequence_length(),
    };
    let device = Device::flex();
    let (tokens, _) = task.batch(0, 2, &device);
    trainer
        .model()
        .valid()
        .forward(tokens)
        .into_data()
        .iter::<f32>()
        .collect()
}

fn after_two_sgd_steps(micro: u32, accumulation: u32, checkpointing: bool) -> (Vec<f32>, Vec<f64>) {
    let mut config = tiny_config(micro, accumulation, checkpointing);
    config.settings.optimizer = headroom_planner::Optimizer::Sgd;
    config.recipe.learning_rate = 0.5;
    let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
    let losses = (0..2)
        .map(|_| trainer.train_step().expect("step").loss.expect("loss"))
        .collect();
    (probe(&trainer), losses)
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len());
    let worst = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / (1.0 + x.abs()))
        .fold(0.0f32, f32::max);
    assert!(worst < 1e-4, "{what}: worst relative difference {worst}");
}

#[test]
fn accumulation_gives_the_same_update_as_one_big_batch() {
    let (one_batch, l1) = after_two_sgd_steps(4, 1, false);
    let (accumulated, l2) = after_two_sgd_steps(2, 2, false);
    assert_close(
        &one_batch,
        &accumulated,
        "micro 2 × accumulation 2 vs batch 4",
    );
    for (a, b) in l1.iter().zip(&l2) {
        assert!((a - b).abs() < 1e-5, "losses {l1:?} vs {l2:?}");
    }
}

#[test]
fn block_checkpointing_gives_the_same_update() {
    let (plain, l1) = after_two_sgd_steps(4, 1, false);
    let (checkpointed, l2) = after_two_sgd_steps(4, 1, true);
    assert_close(&plain, &checkpointed, "checkpointing on vs off");
    let (both, _) = after_two_sgd_steps(2, 2, true);
    assert_close(&plain, &both, "checkpointing with accumulation");
    for (a, b) in l1.iter().zip(&l2) {
        assert!((a - b).abs() < 1e-5, "losses {l1:?} vs {l2:?}");
    }
}

/// fp16's dynamic loss scale, on f32 tensors so that only the scaler
/// differs from a plain run: a scale of 2^16 (GradScaler's first) trains
/// the curve of no scale, since multiplying the loss by a power of two and
/// the gradients by its inverse is exact; a scale past f32's range
/// overflows the gradients, and that step's update is skipped (the weights
/// stay, the step counts) and the scale halves; at a scale that fits, the
/// next update is applied.
#[test]
fn fp16s_loss_scale_trains_the_plain_curve_and_an_overflow_skips_the_update() {
    let plain = tiny_config(4, 2, false);
    let mut fp16 = plain.clone();
    fp16.settings.precision = headroom_planner::Precision::Fp16;
    let mut reference = Trainer::new(plain, Device::flex().autodiff()).expect("trainer");
    let mut scaled = Trainer::new(fp16, Device::flex().autodiff()).expect("trainer");
    assert_eq!(scaled.loss_scale.map(|l| l.scale), Some(65536.0));
    for _ in 0..3 {
        let a = reference.train_step().expect("step").loss.expect("loss");
        let b = scaled.train_step().expect("step").loss.expect("loss");
        assert!((a - b).abs() <= 1e-6 * a, "{a} vs {b}");
    }
    let before = probe(&scaled);
    let overflowing = headroom_worker::optim::recipe::LossScale {
        scale: 1e39,
        good_steps: 0,
    };
    scaled.loss_scale = Some(overflowing);
    let report = scaled.train_step().expect("a skipped step is no error");
    assert_eq!(report.step, 4, "the skipped step counts");
    assert!(report.grad_norm.is_some_and(|n| !n.is_finite()));
    assert_eq!(probe(&scaled), before, "no update");
    assert_eq!(scaled.loss_scale.map(|l| l.scale), Some(5e38));
    // At a scale that fits, the next step applies its update (halving one
    // step at a time from 5e38 back to 2^17 is the LossScale unit test's).
    scaled.loss_scale = Some(headroom_worker::optim::recipe::LossScale {
        scale: 131072.0,
        good_steps: 0,
    });
    let next = scaled.train_step().expect("step");
    assert!(next.grad_norm.is_some_and(f64::is_finite), "{next:?}");
    assert_eq!(scaled.loss_scale.map(|l| l.good_steps), Some(1));
    assert_ne!(probe(&scaled), before, "the update is applied");
}

fn after_two_masked_steps(
    micro: u32,
    accumulation: u32,
    checkpointing: bool,
) -> (Vec<f32>, Vec<f64>, f64) {
    let mut config = tiny_config(micro, accumulation, checkpointing);
    config.settings.optimizer = headroom_planner::Optimizer::Sgd;
    config.recipe.learning_rate = 0.5;
    let text = masked_text(&config);
    let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
    // The masked mean over the whole first global batch, before any update.
    let (tokens, targets) = Samples::Text(text.clone()).batch(0, 4, &Device::flex());
    let direct = trainer.model().valid().loss(tokens, targets);
    let direct = f64::from(direct.into_data().iter::<f32>().next().expect("loss"));
    trainer.use_text(text);
    let losses = (0..2)
        .map(|_| trainer.train_step().expect("step").loss.expect("loss"))
        .collect();
    (probe(&trainer), losses, direct)
}

#[test]
fn masked_targets_are_normalised_over_the_global_batch_whatever_the_accumulation() {
    let (one_batch, l1, direct) = after_two_masked_steps(4, 1, false);
    assert!(
        (l1[0] - direct).abs() < 1e-5,
        "the step's loss is the masked mean of its batch: {} vs {direct}",
        l1[0]
    );
    for (micro, accumulation, checkpointing) in [(2, 2, false), (1, 4, false), (1, 4, true)] {
        let (got, l2, _) = after_two_masked_steps(micro, accumulation, checkpointing);
        let what = format!(
            "micro {micro} × accumulation {accumulation} (checkpointing {checkpointing}) vs batch 4"
        );
        assert_close(&one_batch, &got, &what);
        for (a, b) in l1.iter().zip(&l2) {
            assert!((a - b).abs() < 1e-5, "{what}: losses {l1:?} vs {l2:?}");
        }
    }
    // A mean of the micro-batches' means would weigh a target of a
    // sparsely trained micro-batch more: the fixture's micro-batches differ.
    let (tokens, targets) = {
        let config = tiny_config(1, 4, false);
        Samples::Text(masked_text(&config)).batch(0, 4, &Device::flex())
    };
    let trained: Vec<usize> = targets
        .into_data()
        .iter::<i64>()
        .collect::<Vec<_>>()
        .chunks(tokens.dims()[1])
        .map(|row| row.iter().filter(|&&t| t >= 0).count())
        .collect();
    assert!(
        trained.iter().min() != trained.iter().max(),
        "micro-batches with different trained counts: {trained:?}"
    );
}

fn after_three_document_steps(
    micro: u32,
    accumulation: u32,
    checkpointing: bool,
) -> (Vec<f32>, Vec<f64>, f64, f64) {
    let mut config = tiny_config(micro, accumulation, checkpointing);
    config.settings.optimizer = headroom_planner::Optimizer::Sgd;
    config.recipe.learning_rate = 0.5;
    let text = documents_text(&config);
    let mut trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
    // The first global batch's loss, its documents apart and as one stream.
    let samples = Samples::Text(text.clone());
    let (tokens, targets) = samples.batch(0, 4, &Device::flex());
    let documents = samples.documents(0, 4);
    assert!(documents.is_some(), "packed by documents");
    let model = trainer.model().valid();
    let scalar = |t: burn::tensor::Tensor<1>| f64::from(t.into_scalar::<f32>());
    let apart = scalar(model.loss_in(tokens.clone(), targets.clone(), documents.as_ref()));
    let streamed = scalar(model.loss(tokens, targets));
    trainer.use_text(text);
    let losses = (0..3)
        .map(|_| trainer.train_step().expect("step").loss.expect("loss"))
        .collect();
    (probe(&trainer), losses, apart, streamed)
}

/// Samples packed by documents train with each document apart (its
/// attention and positions its own) in every forward the trainer runs:
/// the step's loss is the batch's loss with its documents, and
/// accumulation and block checkpointing (which recomputes blocks) train
/// as one batch does.
#[test]
fn documents_packing_trains_documents_apart_whatever_the_accumulation() {
    let (one_batch, l1, apart, streamed) = after_three_document_steps(4, 1, false);
    assert!(
        (l1[0] - apart).abs() < 1e-5,
        "the step's loss is its batch's with the documents apart: {} vs {apart}",
        l1[0]
    );
    assert!(
        (apart - streamed).abs() > 1e-4,
        "documents apart differ from one stream: {apart} vs {streamed}"
    );
    for (micro, accumulation, checkpointing) in [(2, 2, false), (1, 4, true)] {
        let (got, l2, _, _) = after_three_document_steps(micro, accumulation, checkpointing);
        let what = format!(
            "documents, micro {micro} × accumulation {accumulation} (checkpointing {checkpointing}) vs batch 4"
        );
        assert_close(&one_batch, &got, &what);
        for (a, b) in l1.iter().zip(&l2) {
            assert!((a - b).abs() < 1e-5, "{what}: losses {l1:?} vs {l2:?}");
        }
    }
}
