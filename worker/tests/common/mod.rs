//! Shared fixtures: tiny configurations that train in seconds in debug builds.
#![allow(dead_code)]

use headroom_planner::{Optimizer, Precision, Settings, TransformerShape};
use headroom_worker::train::TrainConfig;

pub fn tiny_shape() -> TransformerShape {
    TransformerShape {
        layers: 2,
        hidden: 32,
        heads: 4,
        sequence_length: 16,
        vocabulary: 24,
        feed_forward: None,
        tied_embeddings: true,
    }
}

pub fn tiny_config(micro_batch: u32, accumulation: u32, checkpointing: bool) -> TrainConfig {
    let shape = tiny_shape();
    let mut config = TrainConfig::single_stage(
        shape,
        Settings {
            micro_batch,
            gradient_accumulation: accumulation,
            activation_checkpointing: checkpointing,
            precision: Precision::Fp32,
            optimizer: Optimizer::Adamw,
            base_format: headroom_planner::BaseFormat::Dense,
            offload_optimizer: false,
        },
        40,
        1e-2,
        11,
    );
    config.checkpoint_every_steps = 10;
    config
}
