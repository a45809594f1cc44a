//! Plan search: the plan that fits every worker's budget, fastest or
//! cheapest in devices as the job asks; or an explanation, with numbers, of
//! why nothing fits.
//!
//! A plan is p pipeline stages × d data-parallel replicas on p · d devices
//! of one type, with micro-batch × accumulation × d = the global batch.
//! Order of preference ([`Objective`]): `fastest` takes the lowest estimated
//! step time ([`crate::timing`]) within the device cap and the free devices,
//! preferring fewer devices when more would gain under 2 %; `fewestGpus`
//! takes the fewest devices that fit, then the fastest plan on that many.
//! The user's precision and optimizer are kept unless nothing fits and the
//! policy allows changing them. Pipeline stages run a 1F1B schedule, so
//! stage k holds min(p − k, accumulation) micro-batches; each replica of a
//! stage keeps the optimizer state of its share of the trained tensors
//! (ZeRO-1, [`crate::sharding`]).

use crate::backend::BackendProfile;
use crate::inventory::{DeviceKind, DeviceType, Inventory};
use crate::memory::{StagePlacement, estimate_stage, trained_elements};
use crate::plan::{
    Deadline, JobRequest, NoFeasiblePlan, Objective, Plan, SearchOptions, Stage, Target,
};
use crate::rung::RetryRung;
use crate::timing::{self, StepTime};
use crate::training::{Settings, divisors_desc};
use crate::units::format_bytes;

/// Usable bytes minus headroom for one device of this type.
pub fn budget_bytes(device: &DeviceType, profile: &BackendProfile, headroom_fraction: f64) -> u64 {
    let usable = device.memory_bytes as f64 * profile.usable_fraction;
    (usable * (1.0 - headroom_fraction.clamp(0.0, 0.99))).floor() as u64
}

/// Finds the best plan for a first attempt.
pub fn plan(req: &JobRequest, inventory: &Inventory) -> Result<Plan, NoFeasiblePlan> {
    plan_with(req, inventory, &SearchOptions::default())
}

/// [`plan`] with ladder/operator options. When nothing fits the free
/// devices, tells waiting from never: if the job fits the same cluster with
/// every device free, the error says what it waits for
/// ([`NoFeasiblePlan::waits_for`]).
pub fn plan_with(
    req: &JobRequest,
    inventory: &Inventory,
    opts: &SearchOptions,
) -> Result<Plan, NoFeasiblePlan> {
    let mut err = match search_with(req, inventory, opts) {
        Ok(plan) => return Ok(plan),
        Err(e) if e.out_of_time.is_some() => return Err(e),
        Err(e) => e,
    };
    let one_node = inventory.one_node;
    let busy = inventory
        .devices
        .iter()
        .any(|d| d.free < d.reachable(one_node));
    // A second search that runs out of time leaves the first's refusal
    // without what it waits for.
    if busy && let Ok(p) = search_with(req, &inventory.idle(), opts) {
        let free = inventory
            .devices
            .iter()
            .find(|d| d.name == p.device)
            .map_or(0, |d| d.free);
        let total = inventory
            .devices
            .iter()
            .find(|d| d.name == p.device)
            .map_or(0, |d| d.reachable(one_node));
        let place = if inventory.one_node {
            " on one node"
        } else {
            ""
        };
        err.waits_for = Some(format!(
            "{} × {} free{place} ({free} free of {total} now)",
            p.workers, p.device
        ));
    }
    Err(err)
}

/// What the search weighed beside the plan it chose: the fastest fitting
/// plan of every other shape (stages × replicas) with the chosen plan's
/// numerics, fastest first. What `kubectl headroom plan` lists as rejected.
pub fn alternatives(req: &JobRequest, inventory: &Inventory, chosen: &Plan) -> Vec<Plan> {
    let inventory = planning_inventory(req, inventory);
    let search = Search::new(req, &SearchOptions::default(), inventory.one_node);
    let devices = job_devices(req, &inventory, &[]);
    let mut found: Vec<Plan> = search
        .shapes()
        .into_iter()
        .filter(|&(p, d)| (p, d) != (chosen.stage_count(), chosen.replicas))
        .filter_map(|(p, d)| {
            devices
                .iter()
                .filter(|dev| dev.free >= p * d)
                .filter_map(|dev| search.best_on(dev, (p, d), &chosen.settings))
                .min_by(|a, b| a.step_time.seconds.total_cmp(&b.step_time.seconds))
        })
        .collect();
    found.sort_by(|a, b| a.step_time.seconds.total_cmp(&b.step_time.seconds));
    found
}

fn search_with(
    req: &JobRequest,
    inventory: &Inventory,
    opts: &SearchOptions,
) -> Result<Plan, NoFeasiblePlan> {
    let profile = opts.profile.unwrap_or(req.backend().profile());
    if let Some(summary) = unsupported_numerics(req, profile) {
        return Err(refusal(summary));
    }
    let inventory = planning_inventory(req, inventory);
    let inventory = &*inventory;
    let devices = job_devices(req, inventory, &opts.excluded_devices);
    let search = Search::new(req, opts, inventory.one_node);
    if let Some(d) = search.pinned_replicas()
        && d > 1
        && !search.profile.data_parallel
    {
        return Err(refusal(format!(
            "training.dataParallelReplicas {d}: the {} worker does not run data-parallel replicas yet; remove the field (or set 1)",
            search.profile.backend
        )));
    }

    let options = numerics_options(req, search.profile);
    let pinned = !opts.ignore_pins
        && (req.pinned_micro_batch.is_some()
            || req.pinned_checkpointing.is_some()
            || req.pinned_stages.is_some()
            || req.pinned_replicas.is_some());
    // A first attempt with pins runs the user's numerics too (precision,
    // optimizer, base format): pins say "run this", and the retry ladder,
    // not the search, relaxes what was asked once memory proves it must.
    let tried = if pinned { &options[..1] } else { &options[..] };
    for (numerics, rungs) in tried {
        let found = search.best(&devices, numerics);
        search.in_time()?;
        if let Some(mut plan) = found {
            plan.rungs_applied = rungs.clone();
            if !plan.rungs_applied.is_empty() {
                plan.warnings.push(format!(
                    "nothing fits at {}; planned with {}",
                    describe_numerics(&options[0].0),
                    describe_numerics(&plan.settings)
                ));
            }
            return Ok(plan);
        }
    }
    if pinned && let Some(plan) = pinned_over_budget(&search, &devices, &options[0].0) {
        search.in_time()?;
        return Ok(plan);
    }
    let why = infeasible(&search, inventory, &options, &devices);
    search.in_time()?;
    Err(why)
}

/// A plan-less answer with `summary` and no details.
fn refusal(summary: String) -> NoFeasiblePlan {
    NoFeasiblePlan {
        waits_for: None,
        summary,
        details: vec![],
        out_of_time: None,
    }
}

/// Why the backend `profile` cannot run the job's numerics as asked: its
/// adapters, precision or optimizer; `None` when it can.
fn unsupported_numerics(req: &JobRequest, profile: &BackendProfile) -> Option<String> {
    if let Some(e) = adapter_errors(req, profile) {
        return Some(e);
    }
    if !profile.precisions.contains(&req.precision) {
        return Some(format!(
            "precision {} is not supported by the {} backend (supported: {})",
            req.precision,
            profile.backend,
            list(profile.precisions)
        ));
    }
    if !profile.optimizers.contains(&req.optimizer) {
        return Some(format!(
            "optimizer {} is not supported by the {} backend (supported: {})",
            req.optimizer,
            profile.backend,
            list(profile.optimizers)
        ));
    }
    None
}

/// Pins are the user's call on a first attempt: when nothing fits, the
/// pinned settings (at the user's numerics, `asked`) on the largest free
/// device, run as asked with a warning; `None` when the pins cannot be
/// placed at all.
fn pinned_over_budget(search: &Search, devices: &[&DeviceType], asked: &Settings) -> Option<Plan> {
    let req = search.req;
    let pinned_p = search.stage_counts().next().unwrap_or(1);
    let pinned_d = search.pinned_replicas().unwrap_or(1);
    let per_replica = req.global_batch / pinned_d;
    if !req.global_batch.is_multiple_of(pinned_d) {
        return None;
    }
    let &micro_batch = search.micro_batches(pinned_d).first()?;
    let largest = devices
        .iter()
        .filter(|d| d.free >= pinned_p * pinned_d)
        .max_by_key(|d| d.memory_bytes)?;
    let settings = Settings {
        micro_batch,
        gradient_accumulation: per_replica / micro_batch,
        activation_checkpointing: search.checkpointing()[0],
        ..*asked
    };
    let shape = (pinned_p, pinned_d);
    let mut plan = search
        .build(largest, shape, settings)
        .or_else(|| search.build_unchecked(largest, shape, settings))?;
    plan.warnings.push(format!(
        "pinned settings are predicted over budget ({}); running them as asked — a retry will relax them",
        plan.fit
    ));
    Some(plan)
}

/// Why nothing fits, with the numbers ([`Search::explain`]), the nodes the
/// inventory left out, and a one-node limit where it may have been the cause.
fn infeasible(
    search: &Search,
    inventory: &Inventory,
    options: &[(Settings, Vec<RetryRung>)],
    devices: &[&DeviceType],
) -> NoFeasiblePlan {
    let req = search.req;
    let mut infeasible = search.explain(options, devices, !inventory.left_out.is_empty());
    if !inventory.left_out.is_empty() {
        const SHOWN: usize = 5;
        let mut nodes = inventory.left_out[..inventory.left_out.len().min(SHOWN)].join("; ");
        if inventory.left_out.len() > SHOWN {
            nodes.push_str(&format!("; and {} more", inventory.left_out.len() - SHOWN));
        }
        infeasible.details.push(format!(
            "nodes left out (spec.worker.nodeSelector, spec.worker.tolerations, or too small for one worker): {nodes}"
        ));
    }
    // Only when one node's count may have been the limit: below the job's
    // worker cap, with more such devices elsewhere in the cluster.
    if inventory.one_node
        && devices
            .iter()
            .any(|d| d.kind == DeviceKind::Gpu && d.free < req.max_workers() && d.free < d.total)
    {
        infeasible.details.push(
            "stages share one node (the checkpoint volume is ReadWriteOnce), so each count above is one node's free GPUs; a ReadWriteMany checkpoint volume (Helm checkpoints.accessMode) lets stages spread over nodes".into(),
        );
    }
    infeasible
}

/// What a job plans against: a CPU job the operator's view of the nodes
/// when it has one (their allocatable memory and cores), else its own
/// budget; a GPU job the cluster's inventory.
pub(crate) fn planning_inventory<'a>(
    req: &JobRequest,
    inventory: &'a Inventory,
) -> std::borrow::Cow<'a, Inventory> {
    let has_cpu = inventory.devices.iter().any(|d| d.kind == DeviceKind::Cpu);
    match req.own_inventory() {
        Some(own) if !has_cpu => std::borrow::Cow::Owned(own),
        _ => std::borrow::Cow::Borrowed(inventory),
    }
}

/// The device types of `inventory` the job may use, less `excluded`.
fn job_devices<'a>(
    req: &JobRequest,
    inventory: &'a Inventory,
    excluded: &[String],
) -> Vec<&'a DeviceType> {
    inventory
        .devices
        .iter()
        .filter(|d| req.accepts(d) && !excluded.contains(&d.name))
        .collect()
}

fn list<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why a LoRA request cannot be planned at all, if it cannot: adapters on
/// a model that is not Llama-family, a quantized base without adapters, or
/// a base format the backend does not store.
fn adapter_errors(req: &JobRequest, profile: &BackendProfile) -> Option<String> {
    if req.adapters.is_some() && !matches!(req.model, crate::model::ModelShape::Llama(_)) {
        return Some("LoRA adapters need a Llama-family model (model.llama)".into());
    }
    if req.adapters.is_none() && req.base_format.is_quantized() {
        return Some(format!(
            "base format {} needs LoRA adapters: full fine-tuning trains a dense base",
            req.base_format
        ));
    }
    if req.adapters.is_some() && !profile.base_formats.contains(&req.base_format) {
        return Some(format!(
            "base format {} is not supported by the {} backend (supported: {})",
            req.base_format,
            profile.backend,
            list(profile.base_formats)
        ));
    }
    None
}

/// `bf16 / adamw`, with the base format and offload when they are not the defaults.
fn describe_numerics(s: &Settings) -> String {
    let mut out = format!("{} / {}", s.precision, s.optimizer);
    if s.base_format.is_quantized() {
        out.push_str(&format!(" / {} base", s.base_format));
    }
    if s.offload_optimizer {
        out.push_str(" / optimizer offloaded");
    }
    if s.offload_activations {
        out.push_str(" / checkpoints offloaded");
    }
    if s.offload_embedding {
        out.push_str(" / embedding offloaded");
    }
    if s.offload_gradients {
        out.push_str(" / gradients offloaded");
    }
    if s.compact_host_state {
        out.push_str(" / host state compact");
    }
    out
}

/// The numerics rungs, in the ladder's order.
const NUMERICS_RUNGS: [RetryRung; 7] = [
    RetryRung::OffloadEmbedding,
    RetryRung::LowerPrecision,
    RetryRung::CheaperOptimizer,
    RetryRung::QuantizeBase,
    RetryRung::OffloadOptimizer,
    RetryRung::OffloadGradients,
    RetryRung::OffloadActivations,
];

/// Numerics to try, in order, with the rungs each implies: the user's own
/// first (precision, optimizer, the request's base format, state on the
/// device), then every combination the allowed numerics rungs offer from
/// there, ordered by the costliest rung they use (ladder order: lower
/// precision, cheaper optimizer, quantized base, offload) and then by how
/// many steps they take. Only the numerics fields of the settings matter;
/// the batch fields are placeholders the search replaces.
fn numerics_options(req: &JobRequest, profile: &BackendProfile) -> Vec<(Settings, Vec<RetryRung>)> {
    let g = req.global_batch;
    let lora = req.adapters.is_some();
    let asked = Settings {
        micro_batch: g,
        precision: req.precision,
        optimizer: req.optimizer,
        base_format: if lora {
            req.base_format
        } else {
            crate::adapters::BaseFormat::Dense
        },
        ..Settings::default()
    };
    // (settings, rungs applied, steps taken, index of the costliest rung + 1)
    let mut all: Vec<(Settings, Vec<RetryRung>, usize, usize)> = vec![(asked, vec![], 0, 0)];
    for (index, rung) in NUMERICS_RUNGS.into_iter().enumerate() {
        if !req.allows(rung) {
            continue;
        }
        let mut grown = Vec::new();
        for (from, rungs, steps, _) in &all {
            let mut at = *from;
            let mut taken = *steps;
            // Every step of the rung (quantizeBase: int8, then int4).
            while let Some(next) = rung.tighten_settings(&at, profile, g, lora) {
                taken += 1;
                at = next;
                // offloadGradients turns the optimizer offload on too: the
                // same numerics an earlier combination reached are not
                // searched twice.
                let seen = |(s, ..): &(Settings, Vec<RetryRung>, usize, usize)| *s == next;
                if all.iter().any(seen) || grown.iter().any(seen) {
                    continue;
                }
                let mut applied = rungs.clone();
                applied.push(rung);
                grown.push((next, applied, taken, index + 1));
            }
        }
        all.extend(grown);
    }
    all.sort_by_key(|(_, _, steps, costliest)| (*costliest, *steps));
    // Last of all, each offloaded half-precision option again with its host
    // state compact: it changes no device byte and costs some of the
    // update's precision, so it is only for a node whose host memory
    // cannot hold the full state of any option before it.
    let compact: Vec<_> = all
        .iter()
        .filter_map(|(s, r, ..)| {
            let c = Settings {
                compact_host_state: true,
                ..*s
            };
            crate::memory::compacts_host_state(&c, profile).then(|| (c, r.clone()))
        })
        .collect();
    all.into_iter()
        .map(|(s, r, _, _)| (s, r))
        .chain(compact)
        .collect()
}

/// One search's fixed inputs.
pub(crate) struct Search<'a> {
    req: &'a JobRequest,
    profile: &'static BackendProfile,
    correction: f64,
    /// The user's pins (stages, replicas, micro-batch, checkpointing) apply (a first attempt).
    pins: bool,
    /// Every worker of the job shares one node ([`Inventory::on_one_node`]):
    /// their host memory requests add up on it.
    one_node: bool,
    deadline: Option<Deadline>,
    /// The deadline was seen passed: every later candidate is refused
    /// without a look at the clock, and the search's answer is
    /// [`Deadline::ran_out`], whatever it found before.
    stopped: std::cell::Cell<bool>,
}

/// More devices must make a step at least this much faster under
/// [`Objective::Fastest`]: estimates this close are not worth the devices.
const FASTER_ENOUGH: f64 = 0.02;

impl<'a> Search<'a> {
    pub(crate) fn new(req: &'a JobRequest, opts: &SearchOptions, one_node: bool) -> Self {
        let correction = if opts.correction.is_finite() {
            opts.correction.max(1.0)
        } else {
            1.0
        };
        Search {
            req,
            profile: opts.profile.unwrap_or(req.backend().profile()),
            correction,
            pins: !opts.ignore_pins,
            one_node,
            deadline: opts.deadline,
            stopped: std::cell::Cell::new(false),
        }
    }

    /// Whether the deadline has passed: looked at before each candidate is
    /// built, the unit of the search's work (a few closed-form stage
    /// estimates), so a search stops within one candidate of its budget.
    pub(crate) fn out_of_time(&self) -> bool {
        if !self.stopped.get() && self.deadline.is_some_and(|d| d.passed()) {
            self.stopped.set(true);
        }
        self.stopped.get()
    }

    /// `Err(`[`Deadline::ran_out`]`)` once the search has stopped at its deadline.
    pub(crate) fn in_time(&self) -> Result<(), NoFeasiblePlan> {
        match self.deadline {
            Some(d) if self.stopped.get() => Err(d.ran_out()),
            _ => Ok(()),
        }
    }

    /// Stage counts to consider, fewest first: the pinned one on a first
    /// attempt (within what the model and the target allow), else 1..=max.
    pub(crate) fn stage_counts(&self) -> std::ops::RangeInclusive<u32> {
        let max = self.req.max_workers();
        match self.req.pinned_stages.filter(|_| self.pins) {
            Some(n) => {
                let n = n.clamp(1, max);
                n..=n
            }
            None => 1..=max,
        }
    }

    /// The user's replica count, when pins apply.
    fn pinned_replicas(&self) -> Option<u32> {
        self.req.pinned_replicas.filter(|_| self.pins)
    }

    /// Replica counts for `p` stages, fewest first: divisors of the global
    /// batch (each replica takes an equal share) within the device cap; the
    /// pinned one on a first attempt; 1 where the backend has no
    /// data-parallel worker.
    fn replica_counts(&self, p: u32) -> Vec<u32> {
        let g = self.req.global_batch;
        let cap = self.req.max_devices() / p.max(1);
        match self.pinned_replicas() {
            Some(d) => vec![d],
            None if !self.profile.data_parallel => vec![1],
            None => divisors_desc(g)
                .into_iter()
                .rev()
                .filter(|&d| d <= cap)
                .collect(),
        }
    }

    /// Every (stages, replicas) shape to consider.
    fn shapes(&self) -> Vec<(u32, u32)> {
        self.stage_counts()
            .flat_map(|p| self.replica_counts(p).into_iter().map(move |d| (p, d)))
            .collect()
    }

    /// Micro-batches to try with `d` replicas, largest first: the divisors
    /// of a replica's share of the global batch, or the pinned one when it
    /// divides that share (none otherwise).
    fn micro_batches(&self, d: u32) -> Vec<u32> {
        let g = self.req.global_batch;
        if d == 0 || !g.is_multiple_of(d) {
            return vec![];
        }
        let share = g / d;
        match self.req.pinned_micro_batch.filter(|_| self.pins) {
            Some(b) if share.is_multiple_of(b) => vec![b],
            Some(_) => vec![],
            None => divisors_desc(share),
        }
    }

    /// Activation checkpointing off, then on; or the pinned value.
    fn checkpointing(&self) -> Vec<bool> {
        match self.req.pinned_checkpointing.filter(|_| self.pins) {
            Some(c) => vec![c],
            None => vec![false, true],
        }
    }

    /// One device's time for the whole global batch in fp32 (the unit of
    /// [`Plan::relative_step_time`]), seconds.
    fn one_device_seconds(&self) -> f64 {
        timing::step_flops(
            &self.req.model,
            self.req.adapters.as_ref(),
            u64::from(self.req.global_batch),
        ) / self.profile.fp32_flops_per_second
    }

    /// The best fitting plan with these numerics by the job's objective.
    fn best(&self, devices: &[&DeviceType], numerics: &Settings) -> Option<Plan> {
        match self.req.objective {
            Objective::Fastest if self.profile.data_parallel => self.fastest(devices, numerics),
            // Without replicas, more devices could only deepen the pipeline:
            // its stage-to-stage transfers (through host memory and TCP in
            // the worker) are not in the time model, so it is not trusted
            // to say a deeper pipeline than memory needs is faster.
            Objective::Fastest | Objective::FewestGpus => {
                self.fewest_then_fastest(devices, numerics)
            }
        }
    }

    /// Fewest devices first, then the fastest plan at that count.
    fn fewest_then_fastest(&self, devices: &[&DeviceType], numerics: &Settings) -> Option<Plan> {
        let mut shapes = self.shapes();
        shapes.sort_by_key(|&(p, d)| (p * d, p));
        let mut best: Option<Plan> = None;
        for (p, d) in shapes {
            if best.as_ref().is_some_and(|b| b.workers < p * d) || self.out_of_time() {
                break;
            }
            for device in devices.iter().filter(|dev| dev.free >= p * d) {
                if let Some(plan) = self.best_on(device, (p, d), numerics)
                    && best
                        .as_ref()
                        .is_none_or(|b| plan.step_time.seconds < b.step_time.seconds)
                {
                    best = Some(plan);
                }
            }
        }
        best
    }

    /// The lowest estimated step time over every shape and device type, the
    /// fewest devices among plans within [`FASTER_ENOUGH`] of it. Shapes are
    /// visited by a lower bound of their step time (no bubble, the largest
    /// micro-batch, no checkpointing, the all-reduce of an even split), and
    /// the visit stops once the bound passes the fastest plan found.
    fn fastest(&self, devices: &[&DeviceType], numerics: &Settings) -> Option<Plan> {
        let one = self.one_device_seconds();
        let kind = devices.first().map_or(DeviceKind::Cpu, |d| d.kind);
        let all_trained = trained_elements(
            &self.req.model,
            self.req.adapters.as_ref(),
            StagePlacement::single(self.req.model.splittable_layers()),
        );
        let mut shapes: Vec<((u32, u32), f64)> = self
            .shapes()
            .into_iter()
            .map(|(p, d)| {
                let quickest = Settings {
                    micro_batch: self.req.global_batch / d,
                    gradient_accumulation: 1,
                    activation_checkpointing: false,
                    ..*numerics
                };
                let compute = timing::relative_compute(&quickest, 1, d, kind) / f64::from(p) * one;
                let ring = timing::all_reduce_seconds(
                    all_trained / u64::from(p),
                    numerics.precision.gradient_bytes(),
                    d,
                    self.profile,
                );
                ((p, d), compute + ring)
            })
            .collect();
        shapes.sort_by(|a, b| {
            a.1.total_cmp(&b.1)
                .then((a.0.0 * a.0.1).cmp(&(b.0.0 * b.0.1)))
        });
        let mut found: Vec<Plan> = Vec::new();
        let mut fastest = f64::INFINITY;
        for ((p, d), bound) in shapes {
            if bound > fastest * (1.0 + FASTER_ENOUGH) || self.out_of_time() {
                break;
            }
            for device in devices.iter().filter(|dev| dev.free >= p * d) {
                if let Some(plan) = self.best_on(device, (p, d), numerics) {
                    fastest = fastest.min(plan.step_time.seconds);
                    found.push(plan);
                }
            }
        }
        found
            .into_iter()
            .filter(|plan| plan.step_time.seconds <= fastest * (1.0 + FASTER_ENOUGH))
            .min_by(|a, b| {
                a.workers
                    .cmp(&b.workers)
                    .then(a.step_time.seconds.total_cmp(&b.step_time.seconds))
            })
    }

    /// The fastest fitting plan on `shape` (stages, replicas) devices of one
    /// type, if any, with the numerics (precision, optimizer, base format,
    /// offload) of `numerics`.
    pub(crate) fn best_on(
        &self,
        device: &DeviceType,
        shape: (u32, u32),
        numerics: &Settings,
    ) -> Option<Plan> {
        let (_, d) = shape;
        let share = self.req.global_batch / d.max(1);
        let micro_batches = self.micro_batches(d);
        let mut checkpointing = self.checkpointing();
        // Offloaded checkpoints are checkpointing's inputs, and offloaded
        // gradients leave block by block as its backward runs: never
        // without it.
        if numerics.offload_activations || numerics.offload_gradients {
            checkpointing.retain(|&c| c);
        }
        let settings = |b: u32, ckpt: bool| Settings {
            micro_batch: b,
            gradient_accumulation: share / b,
            activation_checkpointing: ckpt,
            ..*numerics
        };
        // Cheap prune: if the leanest option on this shape does not fit, none will.
        let leanest_b = *micro_batches.last()?;
        let leanest_ckpt = checkpointing.iter().any(|c| *c);
        self.build(device, shape, settings(leanest_b, leanest_ckpt))?;

        let mut best: Option<Plan> = None;
        for &ckpt in &checkpointing {
            // Largest micro-batch that fits (descending scan; the first fit wins).
            if let Some(plan) = micro_batches
                .iter()
                .find_map(|&b| self.build(device, shape, settings(b, ckpt)))
                && best
                    .as_ref()
                    .is_none_or(|b| plan.step_time.seconds < b.step_time.seconds)
            {
                best = Some(plan);
            }
        }
        best
    }

    /// A fitting plan for these exact settings on `(stages, replicas)`
    /// devices, if the layers can be split to fit.
    pub(crate) fn build(
        &self,
        device: &DeviceType,
        (p, d): (u32, u32),
        settings: Settings,
    ) -> Option<Plan> {
        if self.out_of_time() {
            return None;
        }
        let budget = budget_bytes(device, self.profile, self.req.headroom_fraction);
        let layers = self.split(p, d, &settings, budget)?;
        let plan = self.assemble(device, &layers, d, settings, budget);
        (plan.fits() && self.host_shortfall(device, &plan).is_none()).then_some(plan)
    }

    /// Host memory `plan`'s worker pods request from one node: each stage's
    /// baseline plus its `hostBytes` (what the operator puts in the pod's
    /// request and limit), the largest stage's — or all workers' (every
    /// stage's replicas) when they share a node.
    fn host_request(&self, plan: &Plan) -> u64 {
        let baseline = match &self.req.target {
            Target::Gpu {
                host_baseline_bytes,
                ..
            } => host_baseline_bytes.unwrap_or(0),
            Target::Cpu { .. } => return 0,
        };
        let pods = plan.stages.iter().map(|s| baseline + s.memory.host_bytes);
        if self.one_node {
            pods.sum::<u64>() * u64::from(plan.replicas.max(1))
        } else {
            pods.max().unwrap_or(0)
        }
    }

    /// Why nodes of `device` cannot hold `plan`'s pods' host memory, if they cannot.
    fn host_shortfall(&self, device: &DeviceType, plan: &Plan) -> Option<String> {
        let node = device.host_memory_bytes?;
        let need = self.host_request(plan);
        // What the plan keeps there, as far as it matters to the reader.
        let kept = if plan.settings.offload_gradients && plan.settings.compact_host_state {
            "optimizer state, 16-bit master remainders and gradient sums, and load buffers"
        } else if plan.settings.offload_gradients {
            "optimizer state, fp32 gradient accumulators and load buffers"
        } else {
            "optimizer state and load buffers"
        };
        (need > node).then(|| {
            format!(
                "its worker pods need {} of host memory{} ({kept} kept there) and the smallest {} node allocates {}",
                format_bytes(need),
                if self.one_node && plan.workers > 1 {
                    " on one node"
                } else {
                    " each"
                },
                device.name,
                format_bytes(node)
            )
        })
    }

    /// A plan for these settings on `(stages, replicas)` devices even when
    /// over budget (pinned first attempts, explanations).
    pub(crate) fn build_unchecked(
        &self,
        device: &DeviceType,
        (p, d): (u32, u32),
        settings: Settings,
    ) -> Option<Plan> {
        if self.out_of_time() {
            return None;
        }
        let budget = budget_bytes(device, self.profile, self.req.headroom_fraction);
        let layers = balanced_split(self.req.model.splittable_layers(), p)?;
        Some(self.assemble(device, &layers, d, settings, budget))
    }

    fn placement(&self, layers: &[u32], k: usize, d: u32, settings: &Settings) -> StagePlacement {
        let p = layers.len() as u32;
        StagePlacement {
            layers: layers[k],
            first: k == 0,
            last: k + 1 == layers.len(),
            in_flight: (p - k as u32).min(settings.gradient_accumulation).max(1),
            replicas: d,
        }
    }

    fn stage_total(&self, layers: &[u32], k: usize, d: u32, settings: &Settings) -> u64 {
        let placement = self.placement(layers, k, d, settings);
        estimate_stage(
            &self.req.model,
            self.req.adapters.as_ref(),
            settings,
            placement,
            self.profile,
            self.correction,
        )
        .total
    }

    /// Layers per stage: balanced when that fits, otherwise shifted away from
    /// the stages that hold more in-flight activations, embeddings or the head.
    fn split(&self, p: u32, d: u32, settings: &Settings, budget: u64) -> Option<Vec<u32>> {
        let total_layers = self.req.model.splittable_layers();
        let balanced = balanced_split(total_layers, p)?;
        if (0..balanced.len()).all(|k| self.stage_total(&balanced, k, d, settings) <= budget) {
            return Some(balanced);
        }
        if p == 1 {
            return None;
        }
        // Capacity of each stage: the estimate is affine in its layer count above one layer.
        let mut caps = Vec::with_capacity(p as usize);
        for k in 0..p as usize {
            let mut probe = balanced.clone();
            probe[k] = 1;
            let one = self.stage_total(&probe, k, d, settings);
            if one > budget {
                return None;
            }
            probe[k] = 2;
            let per_layer = self
                .stage_total(&probe, k, d, settings)
                .saturating_sub(one)
                .max(1);
            caps.push(1 + ((budget - one) / per_layer) as u32);
        }
        if caps.iter().map(|&c| u64::from(c)).sum::<u64>() < u64::from(total_layers) {
            return None;
        }
        let mut layers: Vec<u32> = balanced
            .iter()
            .zip(&caps)
            .map(|(b, c)| (*b).min(*c))
            .collect();
        let mut missing = total_layers - layers.iter().sum::<u32>();
        // Hand the remainder to the stages with room, last stages first (fewest in flight).
        for k in (0..layers.len()).rev() {
            let room = caps[k] - layers[k];
            let add = room.min(missing);
            layers[k] += add;
            missing -= add;
        }
        Some(layers)
    }

    fn assemble(
        &self,
        device: &DeviceType,
        layers: &[u32],
        d: u32,
        settings: Settings,
        budget: u64,
    ) -> Plan {
        let mut stages = Vec::with_capacity(layers.len());
        let mut start = 0;
        for k in 0..layers.len() {
            let placement = self.placement(layers, k, d, &settings);
            let memory = estimate_stage(
                &self.req.model,
                self.req.adapters.as_ref(),
                &settings,
                placement,
                self.profile,
                self.correction,
            );
            stages.push(Stage {
                index: k as u32,
                layer_start: start,
                layer_end: start + layers[k],
                in_flight_micro_batches: placement.in_flight,
                memory,
            });
            start += layers[k];
        }
        let peak = stages.iter().map(|s| s.memory.total).max().unwrap_or(0);
        let p = layers.len() as u32;
        let model = &self.req.model;
        let adapters = self.req.adapters.as_ref();
        let stage_trained = (0..layers.len())
            .map(|k| trained_elements(model, adapters, self.placement(layers, k, d, &settings)))
            .max()
            .unwrap_or(0);
        let step_time: StepTime = timing::estimate(
            model,
            adapters,
            &settings,
            (p, d),
            device.kind,
            self.profile,
            stage_trained,
        );
        Plan {
            device: device.name.clone(),
            device_kind: device.kind,
            resource: device.resource.clone(),
            device_memory_bytes: device.memory_bytes,
            budget_bytes: budget,
            backend: self.profile.backend,
            workers: p * d,
            replicas: d,
            stages,
            settings,
            global_batch: settings.global_batch() * u64::from(d),
            predicted_peak_bytes: peak,
            correction_factor: self.correction,
            relative_step_time: step_time.seconds / self.one_device_seconds(),
            step_time,
            rungs_applied: vec![],
            warnings: vec![],
            fit: format!(
                "{} / {} ({:.0}%)",
                format_bytes(peak),
                format_bytes(budget),
                100.0 * peak as f64 / budget.max(1) as f64
            ),
            adapters: self.req.adapters.clone(),
            gpu_runtime: self.profile.gpu_runtime,
            disk: None,
        }
    }

    /// How far `plan` on `device` stands over what bounds it, to be
    /// compared in order: its peak over the device's budget (1 once it
    /// fits: any candidate the device holds is closer than one it does
    /// not, since the device is what the plan is for), then its pods' host
    /// memory over a node's (1 once it fits, 0 where the node's size is
    /// unknown).
    fn over_budget(&self, device: &DeviceType, plan: &Plan) -> (f64, f64) {
        let device_ratio = plan.predicted_peak_bytes as f64 / plan.budget_bytes.max(1) as f64;
        let host_ratio = device.host_memory_bytes.map_or(0.0, |node| {
            self.host_request(plan) as f64 / node.max(1) as f64
        });
        // Within the node's memory a smaller request is no closer: the
        // earlier (less strict) numerics win the tie.
        (device_ratio.max(1.0), host_ratio.max(1.0))
    }

    /// Why nothing fits: per device type, the candidate that came closest —
    /// the leanest batch settings on the most stages, with whichever
    /// numerics the search tried left it least over budget
    /// ([`Self::over_budget`]) — against the budget. Not simply the
    /// strictest numerics: those may move more to the host than a node
    /// holds where a laxer set needs less. `placement_limited`: the inventory left out nodes the job's
    /// pods may not use (the summary then says so).
    fn explain(
        &self,
        options: &[(Settings, Vec<RetryRung>)],
        devices: &[&DeviceType],
        placement_limited: bool,
    ) -> NoFeasiblePlan {
        let req = self.req;
        let mut details = Vec::new();
        let leanest_b = self.micro_batches(1).last().copied().unwrap_or(1);
        let leanest_ckpt = self.checkpointing().iter().any(|c| *c);
        if options.is_empty() {
            return NoFeasiblePlan {
                summary: "no numerics to try".into(),
                details: vec![],
                waits_for: None,
                out_of_time: None,
            };
        }
        for device in devices {
            let usable_p = req.max_workers().min(device.free);
            if usable_p == 0 {
                details.push(format!(
                    "{}: no free devices ({} in the cluster)",
                    device.name, device.total
                ));
                continue;
            }
            let closest = options
                .iter()
                .filter_map(|(numerics, _)| {
                    let settings = Settings {
                        micro_batch: leanest_b,
                        gradient_accumulation: req.global_batch / leanest_b,
                        activation_checkpointing: leanest_ckpt,
                        ..*numerics
                    };
                    let plan = self.build_unchecked(device, (usable_p, 1), settings)?;
                    Some((self.over_budget(device, &plan), plan))
                })
                .min_by(|(a, _), (b, _)| a.0.total_cmp(&b.0).then(a.1.total_cmp(&b.1)));
            if let Some((_, plan)) = closest {
                let numerics = &plan.settings;
                if plan.fits()
                    && let Some(why) = self.host_shortfall(device, &plan)
                {
                    details.push(format!(
                        "{}: {} stage(s), micro-batch {}, {} fit its memory, but {why}",
                        device.name,
                        usable_p,
                        leanest_b,
                        describe_numerics(numerics),
                    ));
                    continue;
                }
                details.push(format!(
                    "{}: even {} stage(s), micro-batch {}, checkpointing {}, {} predict a peak of {} against a budget of {} ({} nominal, {:.0}% headroom)",
                    device.name,
                    usable_p,
                    leanest_b,
                    if leanest_ckpt { "on" } else { "off" },
                    describe_numerics(numerics),
                    format_bytes(plan.predicted_peak_bytes),
                    format_bytes(plan.budget_bytes),
                    format_bytes(device.memory_bytes),
                    req.headroom_fraction * 100.0
                ));
            }
        }
        let params = req.model.total_params();
        let no_room = !devices.is_empty()
            && devices
                .iter()
                .all(|d| d.kind == DeviceKind::Cpu && d.total == 0);
        let summary = if no_room {
            "no node this job's pods may use can hold one of its workers (resources.cpu.memoryLimit and cores, per worker)".to_string()
        } else if devices.is_empty() {
            let nodes = if placement_limited {
                "no node this job's pods may use"
            } else {
                "no node"
            };
            match &req.target {
                Target::Gpu { allowed_types, .. } if !allowed_types.is_empty() => {
                    format!(
                        "{nodes} offers the allowed GPU types [{}]",
                        allowed_types.join(", ")
                    )
                }
                _ => format!("{nodes} offers a GPU with GPU Feature Discovery memory labels"),
            }
        } else {
            format!(
                "{} parameters, global batch {}: no device type and split up to {} worker(s) stays within budget",
                crate::units::format_count(params),
                req.global_batch,
                req.max_workers()
            )
        };
        NoFeasiblePlan {
            summary,
            details,
            waits_for: None,
            out_of_time: None,
        }
    }
}

/// Even split with the remainder on the later stages (the first stage holds
/// the most in-flight activations under 1F1B). None when p exceeds the layers.
pub fn balanced_split(layers: u32, p: u32) -> Option<Vec<u32>> {
    if p == 0 || p > layers {
        return None;
    }
    let base = layers / p;
    let extra = layers % p;
    Some((0..p).map(|k| base + u32::from(k >= p - extra)).collect())
}
