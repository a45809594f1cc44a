//! The retry policy in one place: the plan for the next attempt after one
//! ended, whatever ended it. Out of memory climbs the ladder
//! ([`crate::ladder`]); unschedulable plans again without the device types
//! that could not be placed; anything else runs the same settings again.

use crate::inventory::Inventory;
use crate::ladder::{MemoryFailure, next_stricter_plan_within};
use crate::plan::{Deadline, JobRequest, NoFeasiblePlan, Plan, SearchOptions};
use crate::search::plan_with;

/// Why the last attempt ended, as far as planning the next one is concerned.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailureCause {
    /// Host (kernel OOM kill) or device out-of-memory: climb the ladder.
    OutOfMemory(MemoryFailure),
    /// The attempt's pods could not be scheduled; `excluded_devices` are
    /// every device type that was unschedulable so far (the ended one included).
    Unschedulable { excluded_devices: Vec<String> },
    /// Anything else (crash, disruption): the same settings again.
    Other,
}

/// The plan for the attempt after `ended`, given why it ended; or why none exists.
///
/// Retries never honour the user's pins (they were tried on the first
/// attempt) and keep what earlier failures proved about the estimates
/// (`ended.correction_factor`, raised further by an out-of-memory failure).
pub fn replan(
    request: &JobRequest,
    inventory: &Inventory,
    ended: &Plan,
    cause: &FailureCause,
) -> Result<Plan, NoFeasiblePlan> {
    replan_within(request, inventory, ended, cause, None)
}

/// [`replan`] that gives up once `deadline` passes
/// ([`NoFeasiblePlan::out_of_time`]).
pub fn replan_within(
    request: &JobRequest,
    inventory: &Inventory,
    ended: &Plan,
    cause: &FailureCause,
    deadline: Option<Deadline>,
) -> Result<Plan, NoFeasiblePlan> {
    match cause {
        FailureCause::OutOfMemory(failure) => {
            next_stricter_plan_within(request, inventory, ended, failure, deadline)
        }
        FailureCause::Unschedulable { excluded_devices } => {
            let mut excluded = excluded_devices.clone();
            // Never back onto the device that just failed to schedule, even
            // if the caller's list missed it.
            if !excluded.contains(&ended.device) {
                excluded.push(ended.device.clone());
            }
            let opts = SearchOptions {
                correction: ended.correction_factor,
                excluded_devices: excluded,
                ignore_pins: true,
                profile: None,
                deadline,
            };
            plan_with(request, inventory, &opts).map_err(|mut e| {
                e.summary = format!("{} was unschedulable; {}", ended.device, e.summary);
                e
            })
        }
        FailureCause::Other => {
            // The plan as it ran: what produced it last time is history.
            let mut same = ended.clone();
            same.rungs_applied.clear();
            same.warnings.clear();
            Ok(same)
        }
    }
}
