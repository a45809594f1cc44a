//! The retry ladder: after an out-of-memory failure, the next plan that is
//! stricter than the failed one, keeps the global batch, and fits once the
//! estimate is corrected by what the failure proved.
//!
//! An OOM proves the attempt needed at least the device's usable memory (or
//! the observed peak, when larger), so the correction factor becomes
//! max(previous factor, that figure / the uncorrected prediction). The rungs
//! ([`crate::rung`]) the job's policy allows are applied cumulatively, in
//! the ladder's fixed order, until a plan fits.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::inventory::{DeviceType, Inventory};
use crate::plan::{JobRequest, NoFeasiblePlan, Plan, SearchOptions};
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
}

/// What a failed attempt tells the ladder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryFailure {
    pub kind: MemoryFailureKind,
    /// Highest per-worker peak observed (telemetry or termination message), bytes.
    pub observed_peak_bytes: Option<u64>,
}

/// The correction factor after `failed` ran out of memory.
pub fn corrected_factor(failed: &Plan, failure: &MemoryFailure, usable_bytes: u64) -> f64 {
    let previous = failed.correction_factor.max(1.0);
    let uncorrected = failed.predicted_peak_bytes as f64 / previous;
    let proven = failure.observed_peak_bytes.unwrap_or(0).max(usable_bytes) as f64;
    if uncorrected <= 0.0 {
        previous
    } else {
        previous.max(proven / uncorrected)
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
    let own;
    let inventory = match req.own_inventory() {
        Some(inv) => {
            own = inv;
            &own
        }
        None => inventory,
    };
    // The failed device as the inventory sees it now; as the plan saw it
    // when the inventory no longer lists it.
    let device = inventory
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
        });
    let profile = req.backend().profile();
    let usable = (failed.device_memory_bytes as f64 * profile.usable_fraction) as u64;
    let correction = corrected_factor(failed, failure, usable);
    let search = Search::new(
        req,
        &SearchOptions {
            correction,
            ignore_pins: true,
            ..SearchOptions::default()
        },
        inventory.one_node,
    );
    let limits = RungLimits {
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
    };
    let shortfall = |c: &Candidate| {
        let peak = search
            .build_unchecked(&c.device, c.shape(), c.settings)
            .map_or_else(
                || "no split".to_string(),
                |pl| format_bytes(pl.predicted_peak_bytes),
            );
        let budget = budget_bytes(&c.device, profile, req.headroom_fraction);
        format!("{peak} > budget {}", format_bytes(budget))
    };

    // Rungs are cumulative: each starts where the previous one stopped.
    let mut state = Candidate {
        device,
        stages: failed.stage_count(),
        replicas: failed.replicas.max(1),
        settings: failed.settings,
    };
    let mut applied: Vec<RetryRung> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
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
            if let Some(mut plan) = search.build(&c.device, c.shape(), c.settings) {
                plan.rungs_applied = applied;
                plan.warnings.push(format!(
                    "retry after {:?}: estimates corrected ×{:.2} from what the failure proved",
                    failure.kind, correction
                ));
                return Ok(plan);
            }
        }
        // More replicas that did not fit are not carried on: the stage and
        // GPU rungs after it would otherwise multiply them.
        if let Some(last) = tried.last()
            && rung != RetryRung::ShardOptimizerState
        {
            state = last.clone();
        }
        let note = rung.over_budget_note(&state, &tried, || shortfall(&state));
        notes.push(format!("{rung}: {note}"));
    }
    Err(NoFeasiblePlan {
        waits_for: None,
        summary: format!(
            "after {:?} at {} (predicted {}, corrected ×{:.2}), no allowed rung yields a plan within budget",
            failure.kind,
            failed.device,
            format_bytes(failed.predicted_peak_bytes),
            correction
        ),
        details: notes,
    })
}
