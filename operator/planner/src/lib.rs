//! Headroom's planner: will this training job fit, and how?
//!
//! Pure functions only — no Kubernetes client, no burn, no I/O — so that the
//! operator, the `kubectl headroom` plugin, the worker and the tests all share
//! one answer. Every memory figure is in **bytes** unless a name says otherwise.
//!
//! * [`model`] — what is being trained (transformer shape or a generic parameter count)
//! * [`training`] — precision, optimizer and batch settings
//! * [`memory`] — the per-worker memory model with its breakdown
//! * [`inventory`] — devices the cluster offers (GPU Feature Discovery labels) or a CPU budget
//! * [`search`] — the cheapest-then-fastest plan that fits, or an explanation with numbers
//! * [`ladder`] — the next, stricter plan after an out-of-memory failure

pub mod inventory;
pub mod ladder;
pub mod memory;
pub mod model;
pub mod search;
pub mod training;
pub mod units;

pub use inventory::{DeviceKind, DeviceType, Inventory, NodeFacts};
pub use ladder::{MemoryFailure, MemoryFailureKind, RetryRung, next_stricter_plan};
pub use memory::{BackendProfile, MemoryBreakdown};
pub use model::{GenericModel, ModelShape, TransformerShape};
pub use search::{JobRequest, NoFeasiblePlan, Plan, Stage, Target, plan};
pub use training::{Optimizer, Precision, Settings};
