//! The retry ladder: after an out-of-memory failure, the next plan that is
//! stricter than the failed one, keeps the global batch, and fits once the
//! estimate is corrected by what the failure proved.
//!
//! An OOM proves the attempt needed at least the device's usable memory (or
//! the observed peak, when larger). The over-run — that figure less the
//! failed stage's uncorrected prediction — is the estimated terms' doing
//! ([`MemoryBreakdown::estimated`]: optimizer state, activations, logits,
//! composed weights, collective buffers; the weights and gradients are
//! counted exactly): the correction factor becomes max(previous factor,
//! 1 + over-run / those terms), in the phase that ran out, and multiplies
//! those terms alone, so a rung that removes or shrinks a term shrinks its
//! correction. The phase is the evidence's: training when the attempt's
//! telemetry reported an optimizer step past its start before the kill
//! (the load was survived); otherwise the phase the plan predicted higher
//! (training, or the checkpoint load).
//!
//! The headroom is spent once: it exists to absorb estimation error, and
//! after a failure the correction carries the error the failure measured.
//! What is left uncertain is how far past the observed peak the attempt
//! would have gone, which the last sample before the kill bounds: the next
//! plan is judged against the usable memory less a margin of (usable −
//! observed peak) / usable, at least [`MIN_RETRY_MARGIN`] and at most the
//! job's headroom — the full headroom when nothing was observed, or when
//! the observed peak is below what the failed plan predicted (it measured
//! nothing about the estimate).
//!
//! The rungs ([`crate::rung`]) the job's policy allows are applied
//! cumulatively, in the ladder's fixed order, until a plan fits that
//! budget. When none does but one fits within the usable memory itself by
//! its corrected estimate, the first such is tried (with a warning); a job
//! ends without a plan only when every allowed rung is over the limit.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::backend::BackendProfile;
use crate::inventory::{DeviceType, Inventory};
use crate::memory::MemoryBreakdown;
use crate::plan::{Deadline, JobRequest, NoFeasiblePlan, Plan, SearchOptions};
use crate::rung::{Candidate, RetryRung, RungLimits, Tightening};
use crate::search::{Search, budget_bytes};
use crate::units::format_bytes;

/// Where the memory ran out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum MemoryFailureKind {
    /// The kernel killed the container at its memory limit (`OOMKilled`, exit 137).
    HostOom,
    /// The worker caught an allocation failure on the device.
    DeviceOom,
    /// The worker's memory guard stopped a step that would have crossed
    /// the limit (what it would have reached is the observed peak).
    NearOom,
}

/// What a failed attempt tells the ladder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryFailure {
    pub kind: MemoryFailureKind,
    /// Highest per-worker peak observed (telemetry or termination message), bytes.
    pub observed_peak_bytes: Option<u64>,
    /// The attempt's telemetry reported an optimizer step past the one it
    /// started from before it ran out: its load was survived, and the
    /// over-run happened in training, whatever phase the plan expected to peak.
    pub trained: bool,
}

/// The least margin a retry keeps below the usable memory: the worker's
/// telemetry samples every 0.5 s, and a step's allocations move faster than
/// that; 2 % is the spread of repeated peaks of one case in the CPU
/// calibration (docs/benchmarks.md), the noise of a measurement itself.
pub const MIN_RETRY_MARGIN: f64 = 0.02;

/// The correction factor after `failed` ran out of memory: the factor on
/// the estimated terms of its peak stage that makes them explain what the
/// failure proved (see the module docs).
pub fn corrected_factor(failed: &Plan, failure: &MemoryFailure, usable_bytes: u64) -> f64 {
    let previous = failed.correction_factor.max(1.0);
    let proven = failure.observed_peak_bytes.unwrap_or(0).max(usable_bytes) as f64;
    let Some(stage) = failed.stages.iter().max_by_key(|s| s.memory.total) else {
        return previous;
    };
    let m: &MemoryBreakdown = &stage.memory;
    // Each phase as the plan predicted it without correction: its counted
    // part and its estimated part.
    let training_estimated = m.estimated() as f64;
    let training_counted = (m.training_total() - m.correction) as f64 - training_estimated;
    let load_counted = (m.fixed_overhead + m.weights) as f64;
    let load_estimated = m.load_peak.saturating_sub(m.fixed_overhead + m.weights) as f64 / previous;
    // The phase that ran out: training once a step was done (the load is
    // behind it); before that, the one the plan predicted higher.
    let (counted, estimated) = if m.load_peak > m.training_total() && !failure.trained {
        (load_counted, load_estimated)
    } else {
        (training_counted, training_estimated)
    };
    if estimated <= 0.0 {
        // Nothing estimated to blame: scale the whole figure, as a last resort.
        let whole = counted.max(1.0);
        return previous.max(proven / whole);
    }
    previous.max((proven - counted) / estimated)
}

/// The margin the next plan keeps below the usable memory after `failure`
/// of a plan that predicted `predicted` bytes (see the module docs): what
/// the measurement leaves uncertain. Only a failure that measured the
/// estimate wrong — an observed peak above the prediction — spends the
/// headroom; one that stopped below it (a pinned plan predicted over the
/// limit, killed there) measured nothing about the estimate, and the next
/// plan keeps the job's whole headroom.
pub fn retry_margin(
    failure: &MemoryFailure,
    predicted: u64,
    usable_bytes: u64,
    headroom: f64,
) -> f64 {
    let headroom = headroom.clamp(0.0, 0.99);
    match failure.observed_peak_bytes {
        Some(observed) if usable_bytes > 0 && observed > predicted => {
            let unseen = (usable_bytes as f64 - observed as f64) / usable_bytes as f64;
            unseen.clamp(MIN_RETRY_MARGIN.min(headroom), headroom)
        }
        _ => headroom,
    }
}

/// The next, stricter plan after `failed` ran out of memory; or why none exists.
///
/// One loop over the allowed rungs in the ladder's fixed order: each rung
/// offers its stricter candidates from where the previous ones left off;
/// the first that fits is the plan, and a rung none of whose candidates fit
/// leaves a note with the numbers.
pub fn next_stricter_plan(
    req: &JobRequest,
    inventory: &Inventory,
    failed: &Plan,
    failure: &MemoryFailure,
) -> Result<Plan, NoFeasiblePlan> {
    next_stricter_plan_within(req, inventory, failed, failure, None)
}

/// [`next_stricter_plan`] that gives up once `deadline` passes
/// ([`NoFeasiblePlan::out_of_time`]).
pub fn next_stricter_plan_within(
    req: &JobRequest,
    inventory: &Inventory,
    failed: &Plan,
    failure: &MemoryFailure,
    deadline: Option<Deadline>,
) -> Result<Plan, NoFeasiblePlan> {
    // As for the first attempt: a CPU job plans against the operator's
    // view when it has one (node sizes, a Kueue queue's quota), else its
    // own budget.
    let inventory = &*crate::search::planning_inventory(req, inventory);
    let profile = req.backend().profile();
    let usable = (failed.device_memory_bytes as f64 * profile.usable_fraction) as u64;
    let correction = corrected_factor(failed, failure, usable);
    let margin = retry_margin(
        failure,
        failed.predicted_peak_bytes,
        usable,
        req.headroom_fraction,
    );
    let req = &JobRequest {
        headroom_fraction: margin,
        ..req.clone()
    };
    let search = Search::new(
        req,
        &SearchOptions {
            correction,
            ignore_pins: true,
            deadline,
            ..SearchOptions::default()
        },
        inventory.one_node,
    );
    let retry = Retry {
        req,
        search: &search,
        profile,
        failure,
        correction,
        margin,
    };
    let limits = rung_limits(req, profile, failed, inventory);

    // Rungs are cumulative: each starts where the previous one stopped.
    let mut state = Candidate {
        device: failed_device(inventory, failed),
        stages: failed.stage_count(),
        replicas: failed.replicas.max(1),
        settings: failed.settings,
    };
    let mut applied: Vec<RetryRung> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    // The first candidate over the budget but within the usable memory.
    let mut within_limit: Option<Plan> = None;
    for rung in RetryRung::ALL.into_iter().filter(|r| req.allows(*r)) {
        let tried = match rung.tighten(&state, &limits) {
            Tightening::Skip(why) => {
                notes.push(format!("{rung}: {why}"));
                continue;
            }
            Tightening::Try(candidates) => candidates,
        };
        if !tried.is_empty() {
            applied.push(rung);
        }
        for c in &tried {
            if let Some(plan) = retry.fitting_plan(c, &applied) {
                search.in_time()?;
                return Ok(plan);
            }
            if within_limit.is_none() {
                within_limit = retry.plan_within_usable_memory(c, &applied);
            }
        }
        // More replicas that did not fit are not carried on: the stage and
        // GPU rungs after it would otherwise multiply them.
        if let Some(last) = tried.last()
            && rung != RetryRung::ShardOptimizerState
        {
            state = last.clone();
        }
        let note = rung.over_budget_note(&state, &tried, || retry.shortfall(&state));
        notes.push(format!("{rung}: {note}"));
        search.in_time()?;
    }
    if let Some(plan) = within_limit {
        return Ok(plan);
    }
    Err(NoFeasiblePlan {
        waits_for: None,
        summary: format!(
            "after {:?} at {} (predicted {}, estimated terms corrected ×{:.2}), every allowed rung is over the usable memory itself",
            failure.kind,
            failed.device,
            format_bytes(failed.predicted_peak_bytes),
            correction
        ),
        details: notes,
        out_of_time: None,
    })
}

/// The failed device as the inventory sees it now; as the plan saw it
/// when the inventory no longer lists it.
fn failed_device(inventory: &Inventory, failed: &Plan) -> DeviceType {
    inventory
        .devices
        .iter()
        .find(|d| d.name == failed.device)
        .cloned()
        .unwrap_or_else(|| DeviceType {
            name: failed.device.clone(),
            kind: failed.device_kind,
            resource: failed.resource.clone(),
            memory_bytes: failed.device_memory_bytes,
            free: failed.workers,
            free_on_one_node: failed.workers,
            total: failed.workers,
            total_on_one_node: failed.workers,
            host_memory_bytes: None,
        })
}

/// What the rungs may reach from `failed`: its global batch, the job's
/// worker and device limits, the device types the job accepts.
fn rung_limits(
    req: &JobRequest,
    profile: &'static BackendProfile,
    failed: &Plan,
    inventory: &Inventory,
) -> RungLimits {
    RungLimits {
        profile,
        global_batch: u32::try_from(failed.settings.global_batch()).unwrap_or(req.global_batch),
        lora: req.adapters.is_some(),
        max_workers: req.max_workers(),
        max_devices: req.max_devices(),
        devices: inventory
            .devices
            .iter()
            .filter(|d| req.accepts(d))
            .cloned()
            .collect(),
    }
}

/// One retry's search: the corrected estimate and the margin the next plan
/// keeps, and what it tells the user about each candidate.
struct Retry<'a> {
    /// The job with the retry's margin as its headroom.
    req: &'a JobRequest,
    search: &'a Search<'a>,
    profile: &'a BackendProfile,
    failure: &'a MemoryFailure,
    correction: f64,
    margin: f64,
}

impl Retry<'_> {
    /// `c`'s plan when it fits the budget, with the rungs `applied`.
    fn fitting_plan(&self, c: &Candidate, applied: &[RetryRung]) -> Option<Plan> {
        let mut plan = self.search.build(&c.device, c.shape(), c.settings)?;
        plan.rungs_applied = applied.to_vec();
        plan.warnings.push(format!(
            "retry after {:?}: estimated terms corrected ×{:.2} from what the failure proved; budget {:.0} % under the usable memory",
            self.failure.kind,
            self.correction,
            self.margin * 100.0
        ));
        Some(plan)
    }

    /// `c`'s plan when it is over the budget but within the usable memory
    /// itself: the plan to run when no candidate fits the budget.
    fn plan_within_usable_memory(&self, c: &Candidate, applied: &[RetryRung]) -> Option<Plan> {
        let mut plan = self
            .search
            .build_unchecked(&c.device, c.shape(), c.settings)?;
        let usable = (c.device.memory_bytes as f64 * self.profile.usable_fraction) as u64;
        if plan.predicted_peak_bytes > usable {
            return None;
        }
        plan.rungs_applied = applied.to_vec();
        plan.warnings.push(format!(
            "retry after {:?}: estimated terms corrected ×{:.2}; no allowed rung fits the budget ({:.0} % under the usable memory), and this one is the first within the usable memory itself ({} of {})",
            self.failure.kind,
            self.correction,
            self.margin * 100.0,
            format_bytes(plan.predicted_peak_bytes),
            format_bytes(usable)
        ));
        Some(plan)
    }

    /// `c`'s predicted peak against its budget: "peak > budget".
    fn shortfall(&self, c: &Candidate) -> String {
        let peak = self
            .search
            .build_unchecked(&c.device, c.shape(), c.settings)
            .map_or_else(
                || "no split".to_string(),
                |pl| format_bytes(pl.predicted_peak_bytes),
            );
        let budget = budget_bytes(&c.device, self.profile, self.req.headroom_fraction);
        format!("{peak} > budget {}", format_bytes(budget))
    }
}
