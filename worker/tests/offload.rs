//! Optimizer offload (`offloadOptimizer`): the state and the step in host
//! memory give the same training as the plain optimizer, and a checkpoint
//! resumes across offload turned on or off (a retry turns it on mid-job).
//!
//! On this CPU machine the host device is the training device (flex), so
//! these tests check the wrapper's arithmetic and record, not a transfer
//! over PCIe; the device-to-host path runs only on a GPU worker.

mod common;

use std::path::PathBuf;

use burn::tensor::Device;
use headroom_planner::Optimizer;
use headroom_worker::train::{TrainConfig, Trainer};

/// Model initialisation draws from burn's global RNG (a Trainer seeds it).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn device() -> Device {
    Device::flex().autodiff()
}

fn config(optimizer: Optimizer, offload: bool) -> TrainConfig {
    let mut config = common::tiny_config(4, 2, false);
    config.settings.optimizer = optimizer;
    config.settings.offload_optimizer = offload;
    config
}

fn losses(trainer: &mut Trainer, steps: usize) -> Vec<f64> {
    (0..steps)
        .map(|_| trainer.train_step().expect("step").loss.expect("loss"))
        .collect()
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("headroom-offload-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

#[test]
fn offloaded_training_equals_plain_training() {
    let _serial = serial();
    for optimizer in [
        Optimizer::Adamw,
        Optimizer::Adamw8bit,
        Optimizer::SgdMomentum,
    ] {
        let plain = losses(
            &mut Trainer::new(config(optimizer, false), device()).expect("trainer"),
            4,
        );
        let offloaded = losses(
            &mut Trainer::new(config(optimizer, true), device()).expect("trainer"),
            4,
        );
        assert_eq!(plain, offloaded, "{optimizer}: identical losses");
        assert!(plain[3] < plain[0], "{optimizer}: it trains ({plain:?})");
    }
}

/// Turned on by a retry after 3 steps, and off again: the moments carry
/// over both ways, so the losses are the straight run's.
#[test]
fn a_checkpoint_resumes_across_offload_on_and_off() {
    let _serial = serial();
    let straight = losses(
        &mut Trainer::new(config(Optimizer::Adamw, false), device()).expect("trainer"),
        6,
    );
    for (before, after) in [(false, true), (true, false)] {
        let dir = temp_dir(&format!("{before}-{after}"));
        let mut first = Trainer::new(config(Optimizer::Adamw, before), device()).expect("trainer");
        assert_eq!(losses(&mut first, 3), straight[..3]);
        first.save_checkpoint(&dir, 1, None).expect("save");
        drop(first);
        let mut second = Trainer::new(config(Optimizer::Adamw, after), device()).expect("trainer");
        second.resume(&dir).expect("resume").expect("a checkpoint");
        assert_eq!(
            losses(&mut second, 3),
            straight[3..],
            "offload {before} → {after}: the state was restored, not restarted"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
