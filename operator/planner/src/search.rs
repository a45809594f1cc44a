//! Plan search: the plan that fits every worker's budget, cheapest in devices,
//! then fastest; or an explanation, with numbers, of why nothing fits.
//!
//! Order of preference, from the issue and the field's practice: fewest
//! devices first (they are the scarce thing); among equals, the lowest
//! estimated step time; the user's precision and optimizer are kept unless
//! nothing fits and the policy allows changing them. Pipeline stages run a
//! 1F1B schedule, so stage k holds min(p − k, accumulation) micro-batches.

use crate::backend::BackendProfile;
use crate::inventory::{DeviceKind, DeviceType, Inventory};
use crate::memory::{StagePlacement, estimate_stage};
use crate::plan::{JobRequest, NoFeasiblePlan, Plan, SearchOptions, Stage, Target};
use crate::rung::RetryRung;
use crate::training::{Precision, Settings, divisors_desc};
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
        Err(e) => e,
    };
    let one_node = inventory.one_node;
    let busy = inventory
        .devices
        .iter()
        .any(|d| d.free < d.reachable(one_node));
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

fn search_with(
    req: &JobRequest,
    inventory: &Inventory,
    opts: &SearchOptions,
) -> Result<Plan, NoFeasiblePlan> {
    let profile = opts.profile.unwrap_or(req.backend().profile());
    if let Some(e) = adapter_errors(req, profile) {
        return Err(NoFeasiblePlan {
            waits_for: None,
            summary: e,
            details: vec![],
        });
    }
    if !profile.precisions.contains(&req.precision) {
        return Err(NoFeasiblePlan {
            waits_for: None,
            summary: format!(
                "precision {} is not supported by the {} backend (supported: {})",
                req.precision,
                profile.backend,
                list(profile.precisions)
            ),
            details: vec![],
        });
    }
    if !profile.optimizers.contains(&req.optimizer) {
        return Err(NoFeasiblePlan {
            waits_for: None,
            summary: format!(
                "optimizer {} is not supported by the {} backend (supported: {})",
                req.optimizer,
                profile.backend,
                list(profile.optimizers)
            ),
            details: vec![],
        });
    }
    // A CPU job plans against the operator's view of the nodes when it has
    // one (their allocatable memory and cores), else against its own budget.
    let own;
    let has_cpu = inventory.devices.iter().any(|d| d.kind == DeviceKind::Cpu);
    let inventory = match req.own_inventory() {
        Some(inv) if !has_cpu => {
            own = inv;
            &own
        }
        _ => inventory,
    };
    let devices: Vec<&DeviceType> = inventory
        .devices
        .iter()
        .filter(|d| req.accepts(d) && !opts.excluded_devices.contains(&d.name))
        .collect();
    let search = Search::new(req, opts, inventory.one_node);

    let micro_batches = match (opts.ignore_pins, req.pinned_micro_batch) {
        (false, Some(b)) => vec![b],
        _ => divisors_desc(req.global_batch),
    };
    let checkpointing = match (opts.ignore_pins, req.pinned_checkpointing) {
        (false, Some(c)) => vec![c],
        _ => vec![false, true],
    };

    let options = numerics_options(req, profile);
    let pinned = !opts.ignore_pins
        && (req.pinned_micro_batch.is_some()
            || req.pinned_checkpointing.is_some()
            || req.pinned_stages.is_some());
    // A first attempt with pins runs the user's numerics too (precision,
    // optimizer, base format): pins say "run this", and the retry ladder,
    // not the search, relaxes what was asked once memory proves it must.
    let tried = if pinned { &options[..1] } else { &options[..] };
    for (numerics, rungs) in tried {
        let found =
            search.cheapest_then_fastest(&devices, numerics, &micro_batches, &checkpointing);
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

    let pinned_p = search.stage_counts().next().unwrap_or(1);
    if pinned
        && let Some(largest) = devices
            .iter()
            .filter(|d| d.free >= pinned_p)
            .max_by_key(|d| d.memory_bytes)
    {
        // Pins are the user's call on a first attempt: run them, and say so.
        let settings = Settings {
            micro_batch: micro_batches[0],
            gradient_accumulation: req.global_batch / micro_batches[0],
            activation_checkpointing: checkpointing[0],
            ..options[0].0
        };
        let mut plan = search
            .build(largest, pinned_p, settings)
            .or_else(|| search.build_unchecked(largest, pinned_p, settings));
        if let Some(plan) = plan.as_mut() {
            plan.warnings.push(format!(
                "pinned settings are predicted over budget ({}); running them as asked — a retry will relax them",
                plan.fit
            ));
            return Ok(plan.clone());
        }
    }

    let mut infeasible = search.explain(
        &options,
        &devices,
        &micro_batches,
        &checkpointing,
        !inventory.left_out.is_empty(),
    );
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
    Err(infeasible)
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
    out
}

/// The numerics rungs, in the ladder's order.
const NUMERICS_RUNGS: [RetryRung; 4] = [
    RetryRung::LowerPrecision,
    RetryRung::CheaperOptimizer,
    RetryRung::QuantizeBase,
    RetryRung::OffloadOptimizer,
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
        gradient_accumulation: 1,
        activation_checkpointing: false,
        precision: req.precision,
        optimizer: req.optimizer,
        base_format: if lora {
            req.base_format
        } else {
            crate::adapters::BaseFormat::Dense
        },
        offload_optimizer: false,
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
                let mut applied = rungs.clone();
                applied.push(rung);
                grown.push((next, applied, taken, index + 1));
                at = next;
            }
        }
        all.extend(grown);
    }
    all.sort_by_key(|(_, _, steps, costliest)| (*costliest, *steps));
    all.into_iter().map(|(s, r, _, _)| (s, r)).collect()
}

/// One search's fixed inputs.
pub(crate) struct Search<'a> {
    req: &'a JobRequest,
    profile: &'static BackendProfile,
    correction: f64,
    /// The user's pinned stage count applies (a first attempt).
    pin_stages: bool,
    /// Every worker of the job shares one node ([`Inventory::on_one_node`]):
    /// their host memory requests add up on it.
    one_node: bool,
}

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
            pin_stages: !opts.ignore_pins,
            one_node,
        }
    }

    /// Stage counts to consider, fewest first: the pinned one on a first
    /// attempt (within what the model and the target allow), else 1..=max.
    pub(crate) fn stage_counts(&self) -> std::ops::RangeInclusive<u32> {
        let max = self.req.max_workers();
        match self.req.pinned_stages.filter(|_| self.pin_stages) {
            Some(n) => {
                let n = n.clamp(1, max);
                n..=n
            }
            None => 1..=max,
        }
    }

    /// Fewest devices first, then the fastest plan at that count.
    fn cheapest_then_fastest(
        &self,
        devices: &[&DeviceType],
        numerics: &Settings,
        micro_batches: &[u32],
        checkpointing: &[bool],
    ) -> Option<Plan> {
        for p in self.stage_counts() {
            let mut best: Option<Plan> = None;
            for device in devices.iter().filter(|d| d.free >= p) {
                if let Some(plan) = self.best_on(device, p, numerics, micro_batches, checkpointing)
                    && best
                        .as_ref()
                        .is_none_or(|b| plan.relative_step_time < b.relative_step_time)
                {
                    best = Some(plan);
                }
            }
            if best.is_some() {
                return best;
            }
        }
        None
    }

    /// The fastest fitting plan on `p` devices of one type, if any, with
    /// the numerics (precision, optimizer, base format, offload) of `numerics`.
    pub(crate) fn best_on(
        &self,
        device: &DeviceType,
        p: u32,
        numerics: &Settings,
        micro_batches: &[u32],
        checkpointing: &[bool],
    ) -> Option<Plan> {
        let g = self.req.global_batch;
        let settings = |b: u32, ckpt: bool| Settings {
            micro_batch: b,
            gradient_accumulation: g / b,
            activation_checkpointing: ckpt,
            ..*numerics
        };
        // Cheap prune: if the leanest option on this device count does not fit, none will.
        let leanest_b = *micro_batches.last()?;
        let leanest_ckpt = checkpointing.iter().any(|c| *c);
        self.build(device, p, settings(leanest_b, leanest_ckpt))?;

        let mut best: Option<Plan> = None;
        for &ckpt in checkpointing {
            // Largest micro-batch that fits (descending scan; the first fit wins).
            if let Some(plan) = micro_batches
                .iter()
                .find_map(|&b| self.build(device, p, settings(b, ckpt)))
                && best
                    .as_ref()
                    .is_none_or(|b| plan.relative_step_time < b.relative_step_time)
            {
                best = Some(plan);
            }
        }
        best
    }

    /// A fitting plan for these exact settings on `p` devices, if the layers can be split to fit.
    pub(crate) fn build(&self, device: &DeviceType, p: u32, settings: Settings) -> Option<Plan> {
        let budget = budget_bytes(device, self.profile, self.req.headroom_fraction);
        let layers = self.split(p, &settings, budget)?;
        let plan = self.assemble(device, &layers, settings, budget);
        (plan.fits() && self.host_shortfall(device, &plan).is_none()).then_some(plan)
    }

    /// Host memory `plan`'s worker pods request from one node: each stage's
    /// baseline plus its `hostBytes` (what the operator puts in the pod's
    /// request and limit), the largest stage's — or all stages' when they
    /// share a node.
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
            pods.sum()
        } else {
            pods.max().unwrap_or(0)
        }
    }

    /// Why nodes of `device` cannot hold `plan`'s pods' host memory, if they cannot.
    fn host_shortfall(&self, device: &DeviceType, plan: &Plan) -> Option<String> {
        let node = device.host_memory_bytes?;
        let need = self.host_request(plan);
        (need > node).then(|| {
            format!(
                "its worker pods need {} of host memory{} (optimizer state and load buffers kept there) and the smallest {} node allocates {}",
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

    /// A plan for these settings on `p` devices even when over budget (pinned first attempts, explanations).
    pub(crate) fn build_unchecked(
        &self,
        device: &DeviceType,
        p: u32,
        settings: Settings,
    ) -> Option<Plan> {
        let budget = budget_bytes(device, self.profile, self.req.headroom_fraction);
        let layers = balanced_split(self.req.model.splittable_layers(), p)?;
        Some(self.assemble(device, &layers, settings, budget))
    }

    fn placement(&self, layers: &[u32], k: usize, settings: &Settings) -> StagePlacement {
        let p = layers.len() as u32;
        StagePlacement {
            layers: layers[k],
            first: k == 0,
            last: k + 1 == layers.len(),
            in_flight: (p - k as u32).min(settings.gradient_accumulation).max(1),
        }
    }

    fn stage_total(&self, layers: &[u32], k: usize, settings: &Settings) -> u64 {
        let placement = self.placement(layers, k, settings);
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
    fn split(&self, p: u32, settings: &Settings, budget: u64) -> Option<Vec<u32>> {
        let total_layers = self.req.model.splittable_layers();
        let balanced = balanced_split(total_layers, p)?;
        if (0..balanced.len()).all(|k| self.stage_total(&balanced, k, settings) <= budget) {
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
            let one = self.stage_total(&probe, k, settings);
            if one > budget {
                return None;
            }
            probe[k] = 2;
            let per_layer = self
                .stage_total(&probe, k, settings)
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
        settings: Settings,
        budget: u64,
    ) -> Plan {
        let mut stages = Vec::with_capacity(layers.len());
        let mut start = 0;
        for k in 0..layers.len() {
            let placement = self.placement(layers, k, &settings);
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
        Plan {
            device: device.name.clone(),
            device_kind: device.kind,
            resource: device.resource.clone(),
            device_memory_bytes: device.memory_bytes,
            budget_bytes: budget,
            backend: self.profile.backend,
            workers: p,
            stages,
            settings,
            global_batch: settings.global_batch(),
            predicted_peak_bytes: peak,
            correction_factor: self.correction,
            relative_step_time: relative_step_time(&settings, p, device.kind),
            rungs_applied: vec![],
            warnings: vec![],
            fit: format!(
                "{} / {} ({:.0}%)",
                format_bytes(peak),
                format_bytes(budget),
                100.0 * peak as f64 / budget.max(1) as f64
            ),
            adapters: self.req.adapters.clone(),
        }
    }

    /// Why nothing fits: per device type, the leanest plan's peak against the budget.
    /// `placement_limited`: the inventory left out nodes the job's pods may
    /// not use (the summary then says so).
    fn explain(
        &self,
        options: &[(Settings, Vec<RetryRung>)],
        devices: &[&DeviceType],
        micro_batches: &[u32],
        checkpointing: &[bool],
        placement_limited: bool,
    ) -> NoFeasiblePlan {
        let req = self.req;
        let mut details = Vec::new();
        let leanest_b = micro_batches.last().copied().unwrap_or(1);
        let leanest_ckpt = checkpointing.iter().any(|c| *c);
        // The strictest numerics the search tried.
        let Some((numerics, _)) = options.last() else {
            return NoFeasiblePlan {
                summary: "no numerics to try".into(),
                details: vec![],
                waits_for: None,
            };
        };
        for device in devices {
            let usable_p = req.max_workers().min(device.free);
            if usable_p == 0 {
                details.push(format!(
                    "{}: no free devices ({} in the cluster)",
                    device.name, device.total
                ));
                continue;
            }
            let settings = Settings {
                micro_batch: leanest_b,
                gradient_accumulation: req.global_batch / leanest_b,
                activation_checkpointing: leanest_ckpt,
                ..*numerics
            };
            if let Some(plan) = self.build_unchecked(device, usable_p, settings) {
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

/// Unitless step-time estimate: recompute costs about a third more compute;
/// 16-bit math runs about twice as fast on GPUs; a 1F1B pipeline idles for
/// (p − 1)/m of a step; tiny micro-batches use a device poorly; a quantized
/// base is dequantized on every forward (a fifth more, unmeasured); an
/// offloaded optimizer moves gradients and weights over PCIe and steps on
/// the CPU once per step (half a step more at accumulation 1, amortised
/// over the micro-batches; unmeasured). The work is divided over p stages.
pub fn relative_step_time(settings: &Settings, p: u32, kind: DeviceKind) -> f64 {
    let recompute = if settings.activation_checkpointing {
        4.0 / 3.0
    } else {
        1.0
    };
    let math = match (kind, settings.precision) {
        (DeviceKind::Gpu, Precision::Bf16 | Precision::Fp16) => 0.5,
        _ => 1.0,
    };
    let m = f64::from(settings.gradient_accumulation.max(1));
    let bubble = 1.0 + (f64::from(p) - 1.0) / m;
    let small_batch = 1.0 + 0.5 / f64::from(settings.micro_batch.max(1));
    let dequantize = if settings.base_format.is_quantized() {
        1.2
    } else {
        1.0
    };
    let offload = if settings.offload_optimizer {
        1.0 + 0.5 / m
    } else {
        1.0
    };
    recompute * math * bubble * small_batch * dequantize * offload / f64::from(p.max(1))
}
