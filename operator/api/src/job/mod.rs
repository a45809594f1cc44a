//! The `MemoryAwareTrainingJob` resource: what the user asks for (spec) and
//! what Headroom knows and did (status).
//!
//! Invalid specs are rejected by the API server itself: bounds in the schema,
//! cross-field rules as CEL `x-kubernetes-validations` whose messages name the
//! field and say what would work. [`MemoryAwareTrainingJobSpec::job_request`]
//! repeats those checks for offline use (`kubectl headroom plan -f`).
//!
//! - `spec`: the spec: the model, training, resources, memory policy, worker
//!   pods, checkpoint volume and scheduling;
//! - `progress`: where a job's training stands (`status.progress`), and
//!   the run's total steps;
//! - `sources`: where a fine-tuning job's checkpoint and text come from and
//!   where its fine-tuned model goes;
//! - `status`: what Headroom knows about a job and what it did, and how an
//!   attempt is read back from the API server (the old stored shape too);
//! - `validate`: the planner's view of a spec, checked offline.

mod progress;
mod sources;
mod spec;
mod status;
mod validate;

pub use progress::*;
pub use sources::*;
pub use spec::*;
pub use status::*;
pub use validate::*;
