//! The `MemoryAwareTrainingJob` resource: what the user asks for (spec) and
//! what Headroom knows and did (status).
//!
//! Invalid specs are rejected by the API server itself: bounds in the schema,
//! cross-field rules as CEL `x-kubernetes-validations` whose messages name the
//! field and say what would work. [`MemoryAwareTrainingJobSpec::job_request`]
//! repeats those checks for offline use (`kubectl headroom plan -f`).

mod sources;
mod spec;
mod status;
mod stored_attempt;
mod validate;

pub use sources::*;
pub use spec::*;
pub use status::*;
pub use validate::*;
