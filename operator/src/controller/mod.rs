//! The MemoryAwareTrainingJob controller.

pub mod children;
pub mod classify;
pub mod decide;
