//! Optimizers burn 0.22 does not ship: AdamW with 8-bit block-wise moments
//! (bitsandbytes' `AdamW8bit`), for plans whose `optimizer` is `adamw8bit`.

pub mod adamw8bit;
pub mod blockwise;

pub use adamw8bit::{AdamW8bit, AdamW8bitConfig, AdamW8bitState, Moments};
