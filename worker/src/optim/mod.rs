//! Optimizers burn 0.22 does not ship: AdamW with 8-bit block-wise moments
//! (bitsandbytes' `AdamW8bit`), for plans whose `optimizer` is `adamw8bit`;
//! and any optimizer with its state and step in host memory (`Offloaded`),
//! for plans that offload the optimizer from a GPU; and the host-side sums
//! of the gradients (`HostGradients`) for plans that offload those too.

pub mod adamw8bit;
pub mod blockwise;
pub mod fused_adamw;
pub mod host_gradients;
pub mod offload;
pub mod recipe;

pub use adamw8bit::{AdamW8bit, AdamW8bitConfig, AdamW8bitState, Moments};
pub use fused_adamw::FusedAdamW;
pub use host_gradients::HostGradients;
pub use offload::{Offloaded, OffloadedState};
