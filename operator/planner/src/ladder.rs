//! The retry ladder: after an out-of-memory failure, the next plan that is
//! stricter than the failed one, keeps the global batch, and fits once the
//! estimate is corrected by what the failure proved.
//!
//! An OOM proves the attempt needed at least the device's usable memory (or
//! the observed peak, when larger), so the correction factor becomes
//! max(previous factor, that figure / the uncorrected prediction). Rungs are
//! applied cumulatively in the policy's order until a plan fits.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::inventory::{DeviceType, Inventory};
use crate::search::{JobRequest, NoFeasiblePlan, Plan, Search, SearchOptions, budget_bytes};
use crate::training::{Settings, divisors_desc};
use crate::units::format_bytes;

/// One way to need less memory per worker, in the default order of the ladder.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "camelCase")]
pub enum RetryRung {
    /// Turn activation checkpointing on.
    ActivationCheckpointing,
    /// Halve the micro-batch and double gradient accumulation.
    HalveMicroBatch,
    /// Move to a lower precision the backend supports (fp32 → bf16).
    LowerPrecision,
    /// Keep optimizer state in 8 bits.
    CheaperOptimizer,
    /// Split the layers over more pipeline stages.
    MorePipelineStages,
    /// Move to a GPU type with more memory.
    LargerGpu,
}

impl RetryRung {
    /// The default order: cheapest in speed and devices first.
    pub const ALL: [RetryRung; 6] = [
        RetryRung::ActivationCheckpointing,
        RetryRung::HalveMicroBatch,
        RetryRung::LowerPrecision,
        RetryRung::CheaperOptimizer,
        RetryRung::MorePipelineStages,
        RetryRung::LargerGpu,
    ];
}

impl std::fmt::Display for RetryRung {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            RetryRung::ActivationCheckpointing => "activationCheckpointing",
            RetryRung::HalveMicroBatch => "halveMicroBatch",
            RetryRung::LowerPrecision => "lowerPrecision",
            RetryRung::CheaperOptimizer => "cheaperOptimizer",
            RetryRung::MorePipelineStages => "morePipelineStages",
            RetryRung::LargerGpu => "largerGpu",
        })
    }
}

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
    );

    let g = u32::try_from(failed.global_batch).unwrap_or(req.global_batch);
    let mut state: Settings = failed.settings;
    let mut p = failed.workers;
    let mut applied: Vec<RetryRung> = Vec::new();
    let mut notes: Vec<String> = Vec::new();
    let budget = budget_bytes(&device, profile, req.headroom_fraction);
    let peak_of = |dev: &DeviceType, p: u32, s: Settings| {
        search.build_unchecked(dev, p, s).map_or_else(
            || "no split".to_string(),
            |pl| format_bytes(pl.predicted_peak_bytes),
        )
    };
    let done = |mut plan: Plan, applied: &[RetryRung]| {
        plan.rungs_applied = applied.to_vec();
        plan.warnings.push(format!(
            "retry after {:?}: estimates corrected ×{:.2} from what the failure proved",
            failure.kind, correction
        ));
        plan
    };

    for rung in RetryRung::ALL
        .into_iter()
        .filter(|r| req.allowed_rungs.contains(r))
    {
        match rung {
            RetryRung::ActivationCheckpointing => {
                if state.activation_checkpointing {
                    notes.push(format!("{rung}: already on"));
                    continue;
                }
                state.activation_checkpointing = true;
                applied.push(rung);
                if let Some(plan) = search.build(&device, p, state) {
                    return Ok(done(plan, &applied));
                }
                notes.push(format!(
                    "{rung}: on → {} > budget {}",
                    peak_of(&device, p, state),
                    format_bytes(budget)
                ));
            }
            RetryRung::HalveMicroBatch => {
                let mut halved = false;
                while let Some(b) = divisors_desc(g)
                    .into_iter()
                    .find(|&d| d <= state.micro_batch / 2)
                {
                    state.micro_batch = b;
                    state.gradient_accumulation = g / b;
                    if !halved {
                        applied.push(rung);
                        halved = true;
                    }
                    if let Some(plan) = search.build(&device, p, state) {
                        return Ok(done(plan, &applied));
                    }
                }
                notes.push(format!(
                    "{rung}: down to micro-batch {} × accumulation {} → {} > budget {}",
                    state.micro_batch,
                    state.gradient_accumulation,
                    peak_of(&device, p, state),
                    format_bytes(budget)
                ));
            }
            RetryRung::LowerPrecision => {
                match state
                    .precision
                    .lower()
                    .filter(|l| profile.precisions.contains(l))
                {
                    Some(lower) => {
                        state.precision = lower;
                        applied.push(rung);
                        if let Some(plan) = search.build(&device, p, state) {
                            return Ok(done(plan, &applied));
                        }
                        notes.push(format!(
                            "{rung}: {lower} → {} > budget {}",
                            peak_of(&device, p, state),
                            format_bytes(budget)
                        ));
                    }
                    None => notes.push(format!(
                        "{rung}: {} backend offers nothing below {}",
                        profile.backend, state.precision
                    )),
                }
            }
            RetryRung::CheaperOptimizer => {
                match state
                    .optimizer
                    .cheaper()
                    .filter(|o| profile.optimizers.contains(o))
                {
                    Some(cheaper) => {
                        state.optimizer = cheaper;
                        applied.push(rung);
                        if let Some(plan) = search.build(&device, p, state) {
                            return Ok(done(plan, &applied));
                        }
                        notes.push(format!(
                            "{rung}: {cheaper} → {} > budget {}",
                            peak_of(&device, p, state),
                            format_bytes(budget)
                        ));
                    }
                    None => notes.push(format!(
                        "{rung}: no cheaper-state variant of {} on the {} backend",
                        state.optimizer, profile.backend
                    )),
                }
            }
            RetryRung::MorePipelineStages => {
                let max_p = req.max_workers().min(device.free.max(failed.workers));
                if p >= max_p {
                    notes.push(format!(
                        "{rung}: already at {p} stage(s), the most allowed/available"
                    ));
                    continue;
                }
                applied.push(rung);
                while p < max_p {
                    p += 1;
                    if let Some(plan) = search.build(&device, p, state) {
                        return Ok(done(plan, &applied));
                    }
                }
                notes.push(format!(
                    "{rung}: up to {p} stages → {} > budget {}",
                    peak_of(&device, p, state),
                    format_bytes(budget)
                ));
            }
            RetryRung::LargerGpu => {
                let mut larger: Vec<&DeviceType> = inventory
                    .devices
                    .iter()
                    .filter(|d| {
                        d.memory_bytes > device.memory_bytes && req.accepts(d) && d.free > 0
                    })
                    .collect();
                larger.sort_by_key(|d| d.memory_bytes);
                if larger.is_empty() {
                    notes.push(format!(
                        "{rung}: no free allowed GPU type larger than {}",
                        format_bytes(device.memory_bytes)
                    ));
                    continue;
                }
                applied.push(rung);
                for dev in &larger {
                    for stages in 1..=req.max_workers().min(dev.free) {
                        if let Some(plan) = search.build(dev, stages, state) {
                            return Ok(done(plan, &applied));
                        }
                    }
                }
                notes.push(format!(
                    "{rung}: tried {}; none fits",
                    larger
                        .iter()
                        .map(|d| format!("{} ({})", d.name, format_bytes(d.memory_bytes)))
                        .collect::<Vec<_>>()
                        .join(", ")
                ));
            }
        }
    }
    Err(NoFeasiblePlan {
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
