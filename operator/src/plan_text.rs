//! The text `kubectl headroom plan` prints: a plan's summary and per-stage
//! memory table, the plans weighed beside it, and why no plan fits.

use std::fmt::Write;

use headroom_planner::units::{format_bytes, format_count};
use headroom_planner::{JobRequest, MemoryBreakdown, ModelShape, NoFeasiblePlan, Plan};

/// Parameters the optimizer trains: the adapters' of a LoRA job (PEFT's
/// "trainable params"), every parameter otherwise.
pub fn trainable_params(request: &JobRequest) -> u64 {
    match (&request.adapters, &request.model) {
        (Some(lora), ModelShape::Llama(shape)) => lora.trainable_params(shape),
        _ => request.model.total_params(),
    }
}

/// `4194304` as `4,194,304`, as PEFT prints trainable parameters.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Plan summary and per-stage memory breakdown as a text table.
pub fn plan_table(title: &str, request: &JobRequest, plan: &Plan) -> String {
    let mut out = summary_lines(title, request, plan);
    let _ = writeln!(out);
    out.push_str(&stage_table(plan));
    for warning in &plan.warnings {
        let _ = writeln!(out, "warning: {warning}");
    }
    out
}

/// The plan in a few labelled lines: the model, its adapters, the workers
/// and devices, the peak, the settings, the step time and what raised them.
fn summary_lines(title: &str, request: &JobRequest, plan: &Plan) -> String {
    let mut out = String::new();
    let params = request.model.total_params();
    let _ = writeln!(
        out,
        "{title}: {} parameters, global batch {}",
        format_count(params),
        plan.global_batch
    );
    if let Some(lora) = &plan.adapters {
        let targets: Vec<&str> = lora.target_modules.iter().map(|m| m.hf_name()).collect();
        let trainable = trainable_params(request);
        let _ = writeln!(
            out,
            "Adapters:  LoRA r {} alpha {} on {}: {} trainable ({:.3} % of all), base {}",
            lora.rank,
            lora.alpha,
            targets.join(", "),
            thousands(trainable),
            100.0 * trainable as f64 / (params + trainable).max(1) as f64,
            plan.settings.base_format
        );
    }
    let shape = if plan.replicas > 1 {
        format!(
            "{} stage(s) × {} data-parallel replicas (optimizer state sharded) = {}",
            plan.stage_count(),
            plan.replicas,
            plan.workers
        )
    } else {
        plan.workers.to_string()
    };
    let _ = writeln!(
        out,
        "Plan:      {shape} × {} ({} backend), {} of {} nominal per worker after headroom",
        plan.device,
        plan.backend,
        format_bytes(plan.budget_bytes),
        format_bytes(plan.device_memory_bytes)
    );
    let _ = writeln!(out, "Peak:      {}", plan.fit);
    let _ = writeln!(out, "Settings:  {}", plan.settings);
    if let Some(runtime) = &plan.gpu_runtime {
        let _ = writeln!(out, "Runtime:   {runtime}");
    }
    let _ = writeln!(out, "Step time: {}", step_time(plan));
    if let Some(disk) = &plan.disk {
        let _ = writeln!(out, "Disk:      {}", disk.summary());
    }
    if plan.correction_factor > 1.0 {
        let _ = writeln!(
            out,
            "Corrected: ×{:.2} on the estimated terms, from observed peaks",
            plan.correction_factor
        );
    }
    if !plan.rungs_applied.is_empty() {
        let rungs: Vec<String> = plan.rungs_applied.iter().map(ToString::to_string).collect();
        let _ = writeln!(out, "Rungs:     {}", rungs.join(", "));
    }
    out
}

/// `1.23 s (compute 0.9 s, all-reduce 0.3 s; estimated, relative 1.00)`:
/// the communication terms only where the plan has them.
fn step_time(plan: &Plan) -> String {
    let t = &plan.step_time;
    format!(
        "{} (compute {}{}; estimated, relative {:.2})",
        seconds(t.seconds),
        seconds(t.compute_seconds),
        [
            ("all-reduce", t.all_reduce_seconds),
            ("stage transfers", t.transfer_seconds),
            ("host copies", t.host_copy_seconds)
        ]
        .into_iter()
        .filter(|(_, s)| *s > 0.0)
        .map(|(what, s)| format!(", {what} {}", seconds(s)))
        .collect::<String>(),
        plan.relative_step_time
    )
}

/// A column of the stage table: its header and the figure it shows.
type MemoryColumn = (&'static str, fn(&MemoryBreakdown) -> u64);

/// The memory breakdown's columns, in the table's order.
const MEMORY_COLUMNS: [MemoryColumn; 14] = [
    ("WEIGHTS", |m| m.weights),
    ("GRADIENTS", |m| m.gradients),
    ("OPTIMIZER", |m| m.optimizer_state),
    ("ACTIVATIONS", |m| m.activations),
    ("LOGITS", |m| m.logits),
    ("COMPOSED", |m| m.composed_weights),
    ("STEP", |m| m.optimizer_step),
    ("OVERHEAD", |m| m.fixed_overhead),
    ("SLACK", |m| m.allocator_slack),
    ("CORRECTION", |m| m.correction),
    ("TRAINING", |m| m.training_total()),
    ("LOAD", |m| m.load_peak),
    ("TOTAL", |m| m.total),
    ("HOST", |m| m.host_bytes),
];

/// One row per stage: its layers, its micro-batches in flight and its
/// memory breakdown. Columns that are zero on every stage (no adapters, no
/// checkpoint to load, nothing in host memory) are left out.
fn stage_table(plan: &Plan) -> String {
    let optional = ["COMPOSED", "STEP", "LOAD", "HOST", "TRAINING"];
    let shown: Vec<&MemoryColumn> = MEMORY_COLUMNS
        .iter()
        .filter(|(name, get)| {
            !optional.contains(name)
                || plan.stages.iter().any(|s| {
                    // TRAINING only says something when the load peak is shown beside it.
                    let m = &s.memory;
                    if *name == "TRAINING" {
                        m.load_peak > 0
                    } else {
                        get(m) > 0
                    }
                })
        })
        .collect();
    let mut header = vec!["STAGE".to_string(), "LAYERS".into(), "IN-FLIGHT".into()];
    header.extend(shown.iter().map(|(name, _)| name.to_string()));
    let mut rows: Vec<Vec<String>> = vec![header];
    for stage in &plan.stages {
        let m: &MemoryBreakdown = &stage.memory;
        let mut row = vec![
            stage.index.to_string(),
            format!(
                "{}-{}",
                stage.layer_start,
                stage.layer_end.saturating_sub(1)
            ),
            stage.in_flight_micro_batches.to_string(),
        ];
        row.extend(shown.iter().map(|(_, get)| format_bytes(get(m))));
        rows.push(row);
    }
    columns(&rows)
}

/// The plans the search weighed and did not choose, one line each
/// (`alternatives` from [`headroom_planner::alternatives`], fastest first).
pub fn alternatives_table(chosen: &Plan, alternatives: &[Plan], objective: &str) -> String {
    if alternatives.is_empty() {
        return String::new();
    }
    let mut rows: Vec<Vec<String>> = vec![
        [
            "STAGES×REPLICAS",
            "DEVICE",
            "SETTINGS",
            "PEAK/BUDGET",
            "STEP",
            "ALL-REDUCE",
            "TRANSFERS",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for plan in std::iter::once(chosen).chain(alternatives) {
        let mark = if std::ptr::eq(plan, chosen) {
            " (chosen)"
        } else {
            ""
        };
        rows.push(vec![
            format!("{} × {}{mark}", plan.stage_count(), plan.replicas),
            plan.device.clone(),
            plan.settings.to_string(),
            plan.fit.clone(),
            seconds(plan.step_time.seconds),
            seconds(plan.step_time.all_reduce_seconds),
            seconds(plan.step_time.transfer_seconds),
        ]);
    }
    format!(
        "Weighed ({objective}; estimated step times, the fastest fitting plan of each shape):\n{}",
        columns(&rows)
    )
}

/// The planner's explanation, one reason per line.
pub fn infeasible_text(title: &str, err: &NoFeasiblePlan) -> String {
    let mut out = format!("{title}: no feasible plan\n{}\n", err.summary);
    for d in &err.details {
        let _ = writeln!(out, "  - {d}");
    }
    out
}

fn columns(rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..rows[0].len())
        .map(|c| {
            rows.iter()
                .map(|r| r.get(c).map_or(0, String::len))
                .max()
                .unwrap_or(0)
        })
        .collect();
    let mut out = String::new();
    for row in rows {
        let line: Vec<String> = row
            .iter()
            .zip(&widths)
            .map(|(cell, w)| format!("{cell:<w$}"))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    out
}

/// `1.23 s`, `45 ms`, `0.8 ms`.
fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else if s >= 0.01 {
        format!("{:.0} ms", s * 1e3)
    } else {
        format!("{:.1} ms", s * 1e3)
    }
}
