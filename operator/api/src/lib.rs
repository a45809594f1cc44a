//! The `MemoryAwareTrainingJob` custom resource and the contracts between the
//! operator and its workers (labels, field managers, exit codes, the plan
//! document, the termination message).
//!
//! Value types that the planner reasons about (model shape, precision,
//! optimizer, plan, memory breakdown, retry rungs) are defined once in
//! `headroom-planner` and used here directly, so the CRD schema, the planner,
//! the worker and the tests cannot drift apart.

// Repeated `printcolumn(type_ = ...)` keys inside #[kube(...)] look like duplicate attributes to clippy.
#![allow(clippy::duplicated_attributes)]

pub mod admission;
pub mod contract;
pub mod hub;
pub mod job;
pub mod quantity;
pub mod recipe;

pub use contract::*;
pub use job::*;
pub use recipe::{AdamSpec, EvaluationSpec, Recipe, ScheduleSpec, ScheduleType};
