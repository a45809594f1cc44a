//! `make bench-first-fit`: does the planner's first plan fit, on real pods?
//!
//! A grid of small CPU training jobs of varied shapes (2–8 layers, hidden
//! 128–768, sequence 64–256, vocabularies 2k–32k, global batch 16/32) and
//! memory limits, each planned by Headroom with its own settings (no pinned
//! micro-batch or checkpointing) and run by the operator on the cluster
//! KUBECONFIG points to, until it succeeds or fails for good. Half of the
//! grid sits at the edge: its limit is the one (of 160Mi–1Gi in 8Mi steps)
//! at which the planner's plan fills the largest share of the budget, at
//! least 95 %; the rest take a round limit. Also a job that was once
//! OOM-killed and then given up on (6 × 384, s 256, v 4096, 256Mi).
//!
//! Prints one row per job (plan, prediction, measured peak, attempts) and
//! the summary docs/benchmarks.md quotes: first-attempt success, attempts to
//! success, measured peak / budget, permanent failures.
//!
//!     bench-first-fit [--jobs N] [--parallel P] [--steps S] [--dry-run]

use std::time::{Duration, Instant};

use headroom_api::{Attempt, AttemptOutcome, JobPhase, MemoryAwareTrainingJob};
use headroom_e2e::{E2E, TestNs};
use headroom_planner::{Inventory, Plan, Settings};

/// One job of the grid.
#[derive(Clone, Debug)]
struct Case {
    layers: u32,
    hidden: u32,
    sequence: u32,
    vocabulary: u32,
    global_batch: u32,
    limit_mib: u64,
    /// Chosen at the edge (plan ≥ 95 % of its budget) or a round limit.
    edge: bool,
}

impl Case {
    fn name(&self, i: usize) -> String {
        format!(
            "ff{i:02}-l{}h{}s{}v{}",
            self.layers, self.hidden, self.sequence, self.vocabulary
        )
    }

    fn manifest(&self, name: &str, steps: u32) -> String {
        format!(
            r#"apiVersion: headroom.dev/v1alpha1
kind: MemoryAwareTrainingJob
metadata:
  name: {name}
spec:
  model:
    transformer: {{layers: {l}, hidden: {h}, heads: {heads}, sequenceLength: {s}, vocabulary: {v}}}
  training:
    globalBatch: {gb}
    steps: {steps}
    optimizer: adamw
    precision: fp32
  resources:
    cpu: {{memoryLimit: {limit}Mi, cores: "1", maxWorkers: 1}}
  worker:
    image: localhost/headroom-worker:dev
"#,
            l = self.layers,
            h = self.hidden,
            heads = (self.hidden / 64).max(2),
            s = self.sequence,
            v = self.vocabulary,
            gb = self.global_batch,
            limit = self.limit_mib,
        )
    }

    fn job(&self, steps: u32) -> MemoryAwareTrainingJob {
        serde_yaml::from_str(&self.manifest("x", steps)).expect("the grid's manifest parses")
    }

    /// The plan the operator will make (a CPU job's budget is its limit
    /// less the headroom; the node's 24 GiB holds any of these).
    fn plan(&self) -> Option<Plan> {
        let request = self.job(4).spec.job_request().ok()?;
        headroom_planner::plan(&request, &Inventory::default()).ok()
    }

    /// Training FLOPs of one optimizer step (6 × parameters × tokens), to
    /// keep the grid's run time bounded on a 2-core node.
    fn step_flops(&self) -> f64 {
        let (l, h, v) = (
            self.layers as f64,
            self.hidden as f64,
            self.vocabulary as f64,
        );
        let params = 12.0 * l * h * h + 2.0 * v * h;
        6.0 * params * (self.global_batch as f64 * self.sequence as f64)
    }
}

/// A deterministic generator (SplitMix64): the same grid on every machine.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[(self.next() % from.len() as u64) as usize]
    }
}

fn fill(plan: &Plan) -> f64 {
    plan.predicted_peak_bytes as f64 / plan.budget_bytes as f64
}

/// The limit (160Mi–1Gi, 8Mi steps) at which `case`'s plan fills its budget
/// most, if that is at least 95 %.
fn edge_limit(case: &Case) -> Option<u64> {
    let mut best: Option<(f64, u64)> = None;
    for limit in (160..=1024).step_by(8) {
        let probe = Case {
            limit_mib: limit,
            ..case.clone()
        };
        if let Some(p) = probe.plan() {
            let f = fill(&p);
            if best.is_none_or(|(b, _)| f > b) {
                best = Some((f, limit));
            }
        }
    }
    best.filter(|(f, _)| *f >= 0.95).map(|(_, l)| l)
}

fn grid(jobs: usize) -> (Vec<Case>, Vec<Case>) {
    // A job once OOM-killed on attempt 1, then given NoFeasiblePlan.
    let mut planned = vec![Case {
        layers: 6,
        hidden: 384,
        sequence: 256,
        vocabulary: 4096,
        global_batch: 16,
        limit_mib: 256,
        edge: false,
    }];
    let mut refused = vec![];
    let mut rng = Rng(36);
    let mut tries = 0;
    while planned.len() < jobs && tries < 10_000 {
        tries += 1;
        let hidden = rng.pick(&[128, 192, 256, 384, 512, 768]);
        let mut case = Case {
            layers: rng.pick(&[2, 3, 4, 6, 8]),
            hidden,
            sequence: rng.pick(&[64, 128, 256]),
            vocabulary: rng.pick(&[2048, 4096, 8192, 16384, 32000]),
            global_batch: rng.pick(&[16, 32]),
            limit_mib: rng.pick(&[256, 384, 512, 768, 1024]),
            edge: planned.len() % 2 == 1,
        };
        // About 10 s a step or less on one core of a 2-core node; each
        // shape once.
        let same_shape = |c: &Case| {
            (c.layers, c.hidden, c.sequence, c.vocabulary)
                == (case.layers, case.hidden, case.sequence, case.vocabulary)
        };
        if case.step_flops() > 4.0e11 || planned.iter().any(same_shape) {
            continue;
        }
        if case.edge {
            match edge_limit(&case) {
                Some(limit) => case.limit_mib = limit,
                None => continue,
            }
        }
        if case.plan().is_some() {
            planned.push(case);
        } else if refused.len() < 4 {
            refused.push(case);
        }
    }
    (planned, refused)
}

/// What one job did.
#[derive(Debug)]
struct Outcome {
    succeeded: bool,
    attempts: Vec<(Attempt, AttemptOutcome, Option<u64>, Option<String>)>,
    message: String,
    seconds: f64,
}

async fn run_one(ns: &TestNs, name: &str, yaml: &str, timeout: Duration) -> Outcome {
    let started = Instant::now();
    ns.apply_job(yaml).await;
    let job = ns
        .wait_job(name, "Succeeded or Failed", timeout, |j| {
            matches!(
                j.status.as_ref().and_then(|s| s.phase),
                Some(JobPhase::Succeeded | JobPhase::Failed)
            )
        })
        .await;
    let status = job.status.unwrap_or_default();
    Outcome {
        succeeded: status.phase == Some(JobPhase::Succeeded),
        attempts: status
            .attempts
            .iter()
            .map(|a| {
                (
                    a.clone(),
                    a.outcome,
                    a.observed_peak_bytes,
                    a.reason.clone(),
                )
            })
            .collect(),
        message: status
            .conditions
            .iter()
            .map(|c| c.message.clone())
            .next_back()
            .unwrap_or_default(),
        seconds: started.elapsed().as_secs_f64(),
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1 << 20) as f64
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn settings(s: &Settings) -> String {
    format!(
        "{} × {}{}{}",
        s.micro_batch,
        s.gradient_accumulation,
        if s.activation_checkpointing {
            ", ckpt"
        } else {
            ""
        },
        match s.optimizer {
            headroom_planner::Optimizer::Adamw8bit => ", adamw8",
            _ => "",
        }
    )
}

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let (planned, refused) = grid(args.jobs);
    println!(
        "grid: {} planned jobs ({} at the edge), {} refused up front by the planner; {} steps each, {} at a time",
        planned.len(),
        planned.iter().filter(|c| c.edge).count(),
        refused.len(),
        args.steps,
        args.parallel
    );
    for c in &refused {
        println!(
            "refused: {} layers × {} hidden, s {}, v {}, gb {}, {}Mi",
            c.layers, c.hidden, c.sequence, c.vocabulary, c.global_batch, c.limit_mib
        );
    }
    if args.dry_run {
        print_plans(&planned);
        return;
    }
    let ns = std::sync::Arc::new(TestNs::new(E2E, "bench-first-fit").await);
    let results = run_all(&ns, &planned, args.steps, args.parallel).await;
    report(&planned, &results);
    match std::sync::Arc::try_unwrap(ns) {
        Ok(ns) => ns.cleanup().await,
        Err(_) => eprintln!("namespace kept: a task still holds it"),
    }
}

/// The command line.
struct Args {
    jobs: usize,
    parallel: usize,
    steps: u32,
    dry_run: bool,
}

impl Args {
    fn parse() -> Args {
        let mut parsed = Args {
            jobs: 24,
            parallel: 2,
            steps: 4,
            dry_run: false,
        };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            let mut value = || {
                args.next()
                    .and_then(|v| v.parse::<usize>().ok())
                    .unwrap_or_else(|| panic!("{a} takes a number"))
            };
            match a.as_str() {
                "--jobs" => parsed.jobs = value(),
                "--parallel" => parsed.parallel = value().max(1),
                "--steps" => parsed.steps = value() as u32,
                "--dry-run" => parsed.dry_run = true,
                other => {
                    panic!(
                        "unknown argument {other}; use --jobs N, --parallel P, --steps S, --dry-run"
                    )
                }
            }
        }
        parsed
    }
}

/// `--dry-run`: each planned job's first plan, without a cluster.
fn print_plans(planned: &[Case]) {
    for (i, c) in planned.iter().enumerate() {
        let p = c.plan().expect("planned");
        println!(
            "{} {}Mi{}: {} predicted {:.1} of {:.1} MiB ({:.0} %), {:.1e} FLOP/step",
            c.name(i),
            c.limit_mib,
            if c.edge { " (edge)" } else { "" },
            settings(&p.settings),
            mib(p.predicted_peak_bytes),
            mib(p.budget_bytes),
            100.0 * fill(&p),
            c.step_flops()
        );
    }
}

/// Runs every planned job, `parallel` at a time, to its end; the outcomes
/// in the grid's order.
async fn run_all(
    ns: &std::sync::Arc<TestNs>,
    planned: &[Case],
    steps: u32,
    parallel: usize,
) -> Vec<Outcome> {
    let timeout = Duration::from_secs(1800);
    let mut results: Vec<Option<Outcome>> = (0..planned.len()).map(|_| None).collect();
    let mut running = tokio::task::JoinSet::new();
    let mut next = 0;
    while next < planned.len() || !running.is_empty() {
        while next < planned.len() && running.len() < parallel {
            let name = planned[next].name(next);
            let yaml = planned[next].manifest(&name, steps);
            let ns = ns.clone();
            let i = next;
            running.spawn(async move { (i, run_one(&ns, &name, &yaml, timeout).await) });
            next += 1;
        }
        if let Some(done) = running.join_next().await {
            let (i, outcome) = done.expect("a job's task");
            let c = &planned[i];
            eprintln!(
                "{} done: {} after {} attempt(s), {:.0} s",
                c.name(i),
                if outcome.succeeded {
                    "Succeeded"
                } else {
                    "Failed"
                },
                outcome.attempts.len(),
                outcome.seconds
            );
            results[i] = Some(outcome);
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every job ran"))
        .collect()
}

/// One row per job, then the first-fit figures over all of them.
fn report(planned: &[Case], results: &[Outcome]) {
    println!(
        "\n| job | limit | attempt 1: micro-batch × accumulation | predicted / budget | measured peak / budget | error | attempts | outcome |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let (mut first, mut within_two, mut failed, mut killed_first) = (0, 0, 0, 0);
    let mut fills = vec![];
    let mut errors = vec![];
    for (i, (c, r)) in planned.iter().zip(results).enumerate() {
        let (plan, outcome, peak, _) = &r.attempts[0];
        let n = r.attempts.len();
        if r.succeeded && n == 1 {
            first += 1;
        }
        if r.succeeded && n <= 2 {
            within_two += 1;
        }
        if !r.succeeded {
            failed += 1;
        }
        if *outcome == AttemptOutcome::HostOutOfMemory {
            killed_first += 1;
        }
        let error = peak.map(|b| 100.0 * (plan.predicted_peak_bytes as f64 - b as f64) / b as f64);
        // The last successful attempt's measured peak is what the job needed.
        if let Some((p, _, Some(b), _)) = r
            .attempts
            .iter()
            .rev()
            .find(|a| a.1 == AttemptOutcome::Succeeded)
        {
            fills.push(*b as f64 / p.budget_bytes as f64);
        }
        if *outcome == AttemptOutcome::Succeeded
            && let Some(e) = error
        {
            errors.push(e.abs());
        }
        print_row(i, c, r, error);
    }
    let n = planned.len();
    println!(
        "\nplanned {n}: first-attempt success {first}/{n} ({:.0} %), succeeded within 2 attempts {within_two}/{n}, permanent failures {failed}, attempt-1 OOM kills {killed_first}; measured peak / budget of the successful attempts: median {:.0} %; |error| of first attempts that succeeded: median {:.1} %",
        100.0 * first as f64 / n as f64,
        100.0 * median(fills),
        median(errors)
    );
}

/// Job `i`'s row: its first plan against its first attempt's measured
/// peak (`error`: the prediction's, in per cent of the peak), and every
/// attempt.
fn print_row(i: usize, c: &Case, r: &Outcome, error: Option<f64>) {
    let (plan, _, peak, _) = &r.attempts[0];
    let measured = peak.map(|b| b as f64 / plan.budget_bytes as f64);
    println!(
        "| {}{} | {}Mi | {} | {:.1} / {:.1} MiB ({:.0} %) | {} | {} | {} | {} |",
        c.name(i),
        if c.edge { " (edge)" } else { "" },
        c.limit_mib,
        settings(&plan.settings),
        mib(plan.predicted_peak_bytes),
        mib(plan.budget_bytes),
        100.0 * plan.predicted_peak_bytes as f64 / plan.budget_bytes as f64,
        measured.map_or("none reported".into(), |m| format!(
            "{:.1} MiB ({:.0} %)",
            mib(peak.unwrap_or(0)),
            100.0 * m
        )),
        error.map_or("".into(), |e| format!("{e:+.1} %")),
        r.attempts
            .iter()
            .map(|(p, o, _, why)| format!(
                "{o:?}{} ({})",
                why.as_deref()
                    .filter(|w| *w != format!("{o:?}"))
                    .map(|w| format!(" {w}"))
                    .unwrap_or_default(),
                settings(&p.settings)
            ))
            .collect::<Vec<_>>()
            .join(" → "),
        if r.succeeded {
            "Succeeded".to_string()
        } else {
            format!("Failed: {}", r.message.lines().next().unwrap_or(""))
        },
    );
}
