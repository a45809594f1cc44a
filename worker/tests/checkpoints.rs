//! Checkpoints: resume continues the step count and the run itself, even with
//! another micro-batch; a torn checkpoint never replaces the last good one.

mod common;

use std::path::PathBuf;

use burn::module::Module;
use burn::tensor::Device;
use headroom_worker::train::Trainer;

use common::tiny_config;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-ckpt-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn probe(trainer: &Trainer) -> Vec<f32> {
    let task = headroom_worker::data::ProgressionTask {
        seed: 5,
        vocabulary: trainer.config.shape.vocabulary(),
        sequence_length: trainer.config.shape.sequence_length(),
    };
    let (tokens, _) = task.batch(0, 2, &Device::flex());
    trainer
        .model()
        .valid()
        .forward(tokens)
        .into_data()
        .iter::<f32>()
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn resume_continues_step_count_model_and_optimizer() {
    let dir = temp_dir("resume");
    // Uninterrupted: 6 steps.
    let mut straight =
        Trainer::new(tiny_config(4, 1, false), Device::flex().autodiff()).expect("trainer");
    let straight_losses: Vec<f64> = (0..6)
        .map(|_| straight.train_step().expect("step").loss.expect("loss"))
        .collect();

    // Interrupted after 3 steps, resumed by a fresh process-like trainer.
    let mut first =
        Trainer::new(tiny_config(4, 1, false), Device::flex().autodiff()).expect("trainer");
    let mut last = 0.0;
    for _ in 0..3 {
        last = first.train_step().expect("step").loss.expect("loss");
    }
    first.save_checkpoint(&dir, 1, Some(last)).expect("save");
    drop(first);

    let mut second =
        Trainer::new(tiny_config(4, 1, false), Device::flex().autodiff()).expect("trainer");
    let found = second.resume(&dir).expect("resume").expect("a checkpoint");
    assert_eq!(found.meta.step, 3);
    assert_eq!(second.step, 3);
    assert!(found.skipped.is_empty(), "{:?}", found.skipped);
    let resumed_losses: Vec<f64> = (0..3)
        .map(|_| second.train_step().expect("step").loss.expect("loss"))
        .collect();
    assert_eq!(second.step, 6);
    for (a, b) in straight_losses[3..].iter().zip(&resumed_losses) {
        assert!(
            (a - b).abs() < 1e-5,
            "straight {straight_losses:?} vs resumed {resumed_losses:?}"
        );
    }
    // Optimizer state came back too: the models agree, not only the losses.
    let d = max_diff(&probe(&straight), &probe(&second));
    assert!(d < 1e-4, "models differ by {d}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_with_another_micro_batch_and_checkpointing() {
    let dir = temp_dir("resplit");
    let mut straight =
        Trainer::new(tiny_config(4, 1, false), Device::flex().autodiff()).expect("trainer");
    let straight_losses: Vec<f64> = (0..4)
        .map(|_| straight.train_step().expect("step").loss.expect("loss"))
        .collect();

    let mut first =
        Trainer::new(tiny_config(4, 1, false), Device::flex().autodiff()).expect("trainer");
    first.train_step().expect("step");
    first.train_step().expect("step");
    first.save_checkpoint(&dir, 1, None).expect("save");

    // The retry ladder's attempt: checkpointing on, micro-batch halved, accumulation doubled.
    let mut retry =
        Trainer::new(tiny_config(2, 2, true), Device::flex().autodiff()).expect("trainer");
    retry.resume(&dir).expect("resume").expect("a checkpoint");
    assert_eq!(retry.step, 2);
    let resumed: Vec<f64> = (0..2)
        .map(|_| retry.train_step().expect("step").loss.expect("loss"))
        .collect();
    for (a, b) in straight_losses[2..].iter().zip(&resumed) {
        assert!(
            (a - b).abs() < 1e-3,
            "straight {straight_losses:?} vs resumed {resumed:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_torn_checkpoint_falls_back_to_the_last_good_one() {
    let dir = temp_dir("torn");
    let mut trainer =
        Trainer::new(tiny_config(4, 1, false), Device::flex().autodiff()).expect("trainer");
    trainer.train_step().expect("step");
    trainer.save_checkpoint(&dir, 1, None).expect("save step 1");
    trainer.train_step().expect("step");
    let newest = trainer.save_checkpoint(&dir, 1, None).expect("save step 2");
    // Corrupt the newest (as a partial copy would) and leave a half-written temporary.
    assert_eq!(
        newest,
        dir.join("step-000000000002").join("stage-0000-0002")
    );
    let block = newest.join("block-0000.bpk");
    let bytes = std::fs::read(&block).expect("read");
    std::fs::write(&block, &bytes[..bytes.len() / 2]).expect("truncate");
    // One crashed writer's temporary, untouched for an hour, and one that a
    // stage may still be writing.
    let tmp = dir.join("step-000000000002").join(".tmp-stage-0000-0002-1");
    std::fs::create_dir_all(&tmp).expect("tmp");
    let an_hour_ago = std::time::SystemTime::now() - std::time::Duration::from_secs(3600);
    let part = tmp.join("block-0000.bpk");
    std::fs::write(&part, b"half").expect("part");
    for path in [&part, &tmp] {
        std::fs::File::open(path)
            .and_then(|f| f.set_modified(an_hour_ago))
            .expect("set mtime");
    }
    let live = dir
        .join("step-000000000002")
        .join(".tmp-stage-0000-0002-other-1");
    std::fs::create_dir_all(&live).expect("live tmp");

    let mut fresh =
        Trainer::new(tiny_config(4, 1, false), Device::flex().autodiff()).expect("trainer");
    let found = fresh
        .resume(&dir)
        .expect("resume")
        .expect("the older checkpoint");
    assert_eq!(found.meta.step, 1);
    assert!(
        found.skipped.iter().any(|s| s.contains("block-0000.bpk")),
        "{:?}",
        found.skipped
    );
    assert!(!tmp.exists(), "a stale temporary is removed");
    assert!(live.exists(), "a temporary written just now is kept");

    // Saving again keeps only the newest two complete checkpoints.
    for _ in 0..3 {
        fresh.train_step().expect("step");
        fresh.save_checkpoint(&dir, 2, None).expect("save");
    }
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .expect("list")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, vec!["step-000000000003", "step-000000000004"]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn no_checkpoint_is_a_fresh_start() {
    let dir = temp_dir("empty");
    let mut trainer =
        Trainer::new(tiny_config(4, 1, false), Device::flex().autodiff()).expect("trainer");
    assert!(
        trainer
            .resume(&dir.join("missing"))
            .expect("resume")
            .is_none()
    );
    assert_eq!(trainer.step, 0);
    let _ = std::fs::remove_dir_all(&dir);
}
