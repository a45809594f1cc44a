//! Data-parallel throughput bench: the same GPT model and the
//! same global batch trained as p × d = 1 × 1, 1 × 2, 1 × 4 and 2 × 2 on
//! the CPU (flex) backend, every (stage, replica) a thread of this process
//! (one loopback pipeline per replica, one loopback TCP ring per stage, as
//! `worker/tests/data_parallel.rs` runs them), with ZeRO-1 as production
//! runs it (the flex profile's 2 MiB buckets, ring chunks of an eighth of
//! one).
//!
//! Per configuration it prints the median step (the slowest worker's, after
//! `--warmup` steps), tokens/s (global batch × sequence length / step), the
//! exchange time per step from [`StepReport::collective`] (reduce-scatter +
//! all-gather + loss gather with their bucket copies, mean over workers)
//! and its loss-gather part (the wait for the slowest replica), the
//! measured scaling efficiency tokens/s ÷ (p·d × tokens/s of 1 × 1), and the
//! efficiency the planner's time model expects
//! (`headroom_planner::timing::estimate` with the FLEX profile, for the
//! same model, settings and the largest stage's trained elements):
//! T(1 × 1) ÷ (p·d × T(p × d)), which for one stage is compute ÷ (compute +
//! all-reduce). The model assumes one device per worker. The same ratio
//! with the CUDA profile (fp32, one GPU per worker) is printed beside it.
//! The configurations run `--rounds` times, interleaved, so that load from
//! other processes that comes and goes hits each of them; a figure is the
//! median over rounds (tokens/s also shows the rounds' range). The last
//! loss is the same in every configuration (the same training, within
//! float tolerance): a check that they trained the same thing. "Other
//! processes" is the CPU the rest of the machine used while a configuration
//! ran (/proc/stat's busy time less this process's, in cores): what to read
//! an outlier against.
//!
//! **Threads.** burn-flex runs a large matmul on the *current* rayon pool
//! (`gemm::Parallelism::Rayon(0)`: `rayon::current_num_threads()` threads,
//! burn-flex-0.22.1/src/ops/matmul.rs), and its reductions with
//! `into_par_iter` on the same pool; outside any pool that is rayon's
//! global pool, one thread per core, which all workers of a process would
//! share. So every worker here runs inside its own pool
//! (`ThreadPool::install`) of `--threads-per-worker` threads:
//!
//! * `shared` (default pass 1): max(1, cores ÷ workers) threads per worker,
//!   so 1 × 1 uses every core and the compute threads add up to the cores
//!   (more only when workers > cores). This is the fair "same machine"
//!   comparison; on it more replicas cannot add compute.
//! * `one` (default pass 2): one thread per worker, so 1 × 1 is one core and
//!   1 × 2 is one core per replica: what the time model describes (one
//!   device per worker) while workers ≤ cores.
//!
//! The ring's reader/writer threads are not in the pools; they share the
//! cores with everything else.
//!
//! Usage (release build; debug figures are meaningless):
//!   cargo run --release -p headroom-worker --bin dp_bench -- [--steps N] [--warmup N] [--rounds N] [--threads shared|one|N] [--configs 1x1,1x2,1x4,2x2]

use std::time::Duration;

use burn::tensor::Device;
use headroom_planner::backend::{CUDA, FLEX};
use headroom_planner::search::balanced_split;
use headroom_planner::sharding::ring_chunk_bytes;
use headroom_planner::timing::estimate;
use headroom_planner::{DeviceKind, ModelShape, Settings, TransformerShape};
use headroom_worker::collective::{Ring, RingTimeouts};
use headroom_worker::link_auth::LinkKey;
use headroom_worker::model::StageLayout;
use headroom_worker::pipeline::{Hello, Peers, establish};
use headroom_worker::train::{StepReport, TrainConfig, Trainer};

/// Samples per optimizer step, whatever p × d.
const GLOBAL_BATCH: u32 = 16;
/// Per micro-batch, the same in every configuration (so per-token compute
/// is comparable): accumulation = 16 ÷ (2 d).
const MICRO_BATCH: u32 = 2;

/// 4 layers, h 256, 4 heads, s 64, v 4096, tied head: 4.2M parameters.
fn shape() -> TransformerShape {
    TransformerShape {
        layers: 4,
        hidden: 256,
        heads: 4,
        sequence_length: 64,
        vocabulary: 4096,
        feed_forward: None,
        tied_embeddings: true,
    }
}

/// Per replica: micro-batch 2 × (16 ÷ 2 d) micro-batches, fp32 AdamW.
fn settings(d: u32) -> Settings {
    assert_eq!(GLOBAL_BATCH % (MICRO_BATCH * d), 0, "d divides the batch");
    Settings {
        micro_batch: MICRO_BATCH,
        gradient_accumulation: GLOBAL_BATCH / MICRO_BATCH / d,
        ..Settings::default()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Threads {
    /// max(1, cores ÷ workers) per worker.
    Shared,
    /// This many per worker.
    Fixed(usize),
}

impl Threads {
    fn per_worker(self, cores: usize, workers: u32) -> usize {
        match self {
            Threads::Shared => (cores / workers as usize).max(1),
            Threads::Fixed(n) => n.max(1),
        }
    }

    fn describe(self) -> String {
        match self {
            Threads::Shared => "shared: max(1, cores ÷ workers) rayon threads per worker".into(),
            Threads::Fixed(1) => "one: 1 rayon thread per worker".into(),
            Threads::Fixed(n) => format!("{n} rayon threads per worker"),
        }
    }
}

/// What one (stage, replica) measured.
struct Worker {
    stage: u32,
    reports: Vec<StepReport>,
    /// Elements of the tensors its stage trains.
    trained: u64,
}

/// Trains `warmup + steps` steps on p stages × d replicas, each worker a
/// thread running inside its own rayon pool of `threads` threads.
fn run(p: u32, d: u32, threads: usize, warmup: u64, steps: u64) -> Vec<Worker> {
    let base = TrainConfig::single_stage(shape(), settings(d), 0, 1e-3, 7);
    let split = balanced_split(base.shape.layers(), p).expect("split");
    let timeouts = RingTimeouts {
        rendezvous: Duration::from_secs(60),
        io: Duration::from_secs(300),
    };
    let chunk = ring_chunk_bytes(FLEX.collective_bucket_bytes);
    let mut rings: Vec<Vec<Option<Ring>>> = (0..p)
        .map(|_| {
            Ring::loopback(d, timeouts)
                .expect("ring")
                .into_iter()
                .map(|mut ring| {
                    // As run.rs does: chunks of an eighth of a bucket.
                    ring.set_chunk_bytes(usize::try_from(chunk).expect("chunk"));
                    Some(ring)
                })
                .collect()
        })
        .collect();
    let key = LinkKey::random().expect("peer key");
    let mut pipelines: Vec<(Vec<Option<std::net::TcpListener>>, Peers)> = (0..d)
        .map(|_| {
            let (listeners, peers) = Peers::loopback(p).expect("loopback sockets");
            (listeners.into_iter().map(Some).collect(), peers)
        })
        .collect();
    let mut handles = Vec::new();
    let mut start = 0;
    for k in 0..p {
        let layout = StageLayout {
            layers: start..start + split[k as usize],
            first: k == 0,
            last: k + 1 == p,
        };
        start += split[k as usize];
        for r in 0..d {
            let mut config = base.clone().with_replica(r, d);
            config.layout = layout.clone();
            config.stage = k;
            config.stages = p;
            config.recipe.total_steps = warmup + steps;
            let mut ring = rings[k as usize][r as usize].take().expect("ring");
            let listener = pipelines[r as usize].0[k as usize].take();
            let peers = pipelines[r as usize].1.clone();
            let key = key.clone();
            handles.push(std::thread::spawn(move || {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .thread_name(move |i| format!("s{k}r{r}-rayon{i}"))
                    .build()
                    .expect("rayon pool");
                pool.install(move || {
                    // What gemm's `Parallelism::Rayon(0)` and burn-flex's par_iter use.
                    assert_eq!(rayon::current_num_threads(), threads, "the worker's pool");
                    let mut trainer =
                        Trainer::new(config, Device::flex().autodiff()).expect("trainer");
                    let me = Hello {
                        job: "dp-bench".into(),
                        namespace: "local".into(),
                        attempt: 1,
                        stage: k,
                        stages: p,
                        resume_step: 0,
                    };
                    let wait = Duration::from_secs(300);
                    let mut links =
                        establish(&me, &key, listener.filter(|_| k > 0), &peers, wait, wait)
                            .expect("pipeline links");
                    let trained = trainer
                        .shards(d)
                        .tensors
                        .iter()
                        .map(|t| t.elements as u64)
                        .sum();
                    let mut reports = Vec::new();
                    while !trainer.finished() {
                        let report = trainer.train_step_with(&mut links, &mut ring);
                        reports.push(report.expect("step"));
                    }
                    Worker {
                        stage: k,
                        reports,
                        trained,
                    }
                })
            }));
        }
    }
    handles
        .into_iter()
        .map(|h| h.join().expect("worker thread"))
        .collect()
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn mean(xs: impl Iterator<Item = f64>) -> f64 {
    let (sum, n) = xs.fold((0.0, 0usize), |(s, n), x| (s + x, n + 1));
    if n == 0 { f64::NAN } else { sum / n as f64 }
}

/// One configuration's figures.
struct Row {
    p: u32,
    d: u32,
    threads: usize,
    step: f64,
    tokens_per_second: f64,
    /// Median over steps of the mean over workers, seconds.
    collective: f64,
    loss_gather: f64,
    /// Cores' worth of CPU other processes used meanwhile.
    others: f64,
    /// The planner's estimate for this configuration (FLEX profile), and
    /// with the CUDA profile (one GPU per worker, fp32).
    model: headroom_planner::StepTime,
    gpu: headroom_planner::StepTime,
    last_loss: Option<f64>,
}

/// Jiffies since boot: the machine's busy ones, all of them (busy + idle,
/// every core), and this process's (user + system).
fn cpu_jiffies() -> Option<(u64, u64, u64)> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let fields: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|v| v.parse().ok())
        .collect::<Option<_>>()?;
    // user nice system idle iowait irq softirq steal
    let all: u64 = fields.iter().sum();
    let busy = all - fields[3] - fields[4];
    let me = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_comm = &me[me.rfind(')')? + 2..];
    let f: Vec<&str> = after_comm.split_whitespace().collect();
    // Fields 14 and 15 of the file (utime, stime): 11 and 12 after the state.
    let ours = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some((busy, all, ours))
}

/// Cores' worth of CPU that other processes used between two readings.
fn others_cores(before: Option<(u64, u64, u64)>, cores: usize) -> f64 {
    match (before, cpu_jiffies()) {
        (Some((b0, a0, o0)), Some((b1, a1, o1))) if a1 > a0 => {
            let others = (b1 - b0).saturating_sub(o1 - o0);
            others as f64 / (a1 - a0) as f64 * cores as f64
        }
        _ => f64::NAN,
    }
}

fn measure(p: u32, d: u32, threads: usize, warmup: u64, steps: u64) -> Row {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let before = cpu_jiffies();
    let workers = run(p, d, threads, warmup, steps);
    let others = others_cores(before, cores);
    let skip = warmup as usize;
    let measured = |f: &dyn Fn(&Worker, usize) -> Option<f64>, combine: fn(Vec<f64>) -> f64| {
        median(
            (skip..skip + steps as usize)
                .map(|i| combine(workers.iter().filter_map(|w| f(w, i)).collect()))
                .collect(),
        )
    };
    let slowest = |xs: Vec<f64>| xs.into_iter().fold(0.0, f64::max);
    let average = |xs: Vec<f64>| mean(xs.into_iter());
    // Workers advance in lock-step: a step is the slowest worker's.
    let step = measured(&|w, i| Some(w.reports[i].elapsed.as_secs_f64()), slowest);
    let collective = measured(&|w, i| Some(w.reports[i].collective.as_secs_f64()), average);
    let last = p - 1;
    let loss_gather = measured(
        &|w, i| (w.stage == last).then(|| w.reports[i].loss_gather.as_secs_f64()),
        average,
    );
    let largest_stage = workers.iter().map(|w| w.trained).max().unwrap_or(0);
    let model_shape = ModelShape::Transformer(shape());
    let model = estimate(
        &model_shape,
        None,
        &settings(d),
        (p, d),
        DeviceKind::Cpu,
        &FLEX,
        largest_stage,
    );
    let gpu = estimate(
        &model_shape,
        None,
        &settings(d),
        (p, d),
        DeviceKind::Gpu,
        &CUDA,
        largest_stage,
    );
    let tokens = f64::from(GLOBAL_BATCH) * f64::from(shape().sequence_length);
    let last_loss = workers
        .iter()
        .find(|w| w.stage == last)
        .and_then(|w| w.reports.last())
        .and_then(|r| r.loss);
    Row {
        p,
        d,
        threads,
        step,
        tokens_per_second: tokens / step,
        collective,
        loss_gather,
        others,
        model,
        gpu,
        last_loss,
    }
}

/// Runs every configuration `rounds` times, interleaved (1 × 1, 1 × 2, …,
/// then again), so that a load that comes and goes hits all of them; each
/// figure is the median over rounds of the per-round medians.
fn pass(
    configs: &[(u32, u32)],
    threads: Threads,
    cores: usize,
    (rounds, warmup, steps): (u32, u64, u64),
) {
    let mut runs: Vec<Vec<Row>> = configs.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds {
        for (i, &(p, d)) in configs.iter().enumerate() {
            let row = measure(p, d, threads.per_worker(cores, p * d), warmup, steps);
            eprintln!(
                "  round {}/{rounds}: {p} × {d}: {:.3} s/step, {:.0} tokens/s, other processes {:.2} cores (load {})",
                round + 1,
                row.step,
                row.tokens_per_second,
                row.others,
                load_average()
            );
            runs[i].push(row);
        }
    }
    println!("\nthreads: {}", threads.describe());
    println!(
        "| p × d | workers | threads/worker | median step s | tokens/s (rounds' min-max) | speed-up | exchange ms/step | of which loss gather ms | efficiency measured | efficiency model | model step s (compute + all-reduce ms) | efficiency model, CUDA profile | other processes, cores | last loss |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let tokens = f64::from(GLOBAL_BATCH) * f64::from(shape().sequence_length);
    let mut base: Option<(f64, f64, f64)> = None;
    for rows in &runs {
        let row = &rows[0];
        let of = |f: fn(&Row) -> f64| median(rows.iter().map(f).collect());
        let step = of(|r| r.step);
        let rate = tokens / step;
        let (low, high) = rows.iter().fold((f64::INFINITY, 0.0f64), |(l, h), r| {
            (l.min(r.tokens_per_second), h.max(r.tokens_per_second))
        });
        let workers = row.p * row.d;
        let (base_rate, base_model, base_gpu) =
            *base.get_or_insert((rate, row.model.seconds, row.gpu.seconds));
        let n = f64::from(workers);
        println!(
            "| {} × {} | {workers} | {} | {step:.3} | {rate:.0} ({low:.0}-{high:.0}) | {:.2}× | {:.1} | {:.1} | {:.2} | {:.2} | {:.3} ({:.3} + {:.1}) | {:.2} | {:.2} | {} |",
            row.p,
            row.d,
            row.threads,
            rate / base_rate,
            of(|r| r.collective) * 1e3,
            of(|r| r.loss_gather) * 1e3,
            rate / (n * base_rate),
            base_model / (n * row.model.seconds),
            row.model.seconds,
            row.model.compute_seconds,
            row.model.all_reduce_seconds * 1e3,
            base_gpu / (n * row.gpu.seconds),
            of(|r| r.others),
            row.last_loss
                .map_or_else(|| "—".to_string(), |l| format!("{l:.5}")),
        );
    }
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "unknown".into())
}

fn main() {
    let mut steps: u64 = 6;
    let mut warmup: u64 = 2;
    let mut rounds: u32 = 3;
    let mut passes = vec![Threads::Shared, Threads::Fixed(1)];
    let mut configs = vec![(1, 1), (1, 2), (1, 4), (2, 2)];
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        let mut value = || it.next().cloned().unwrap_or_default();
        match arg.as_str() {
            "--steps" => steps = value().parse().expect("--steps N"),
            "--warmup" => warmup = value().parse().expect("--warmup N"),
            "--rounds" => rounds = value().parse().expect("--rounds N"),
            "--threads" => {
                passes = vec![match value().as_str() {
                    "shared" => Threads::Shared,
                    "one" => Threads::Fixed(1),
                    n => Threads::Fixed(n.parse().expect("--threads shared|one|N")),
                }];
            }
            "--configs" => {
                configs = value()
                    .split(',')
                    .map(|c| {
                        let (p, d) = c.split_once('x').expect("--configs PxD,...");
                        (p.trim().parse().expect("p"), d.trim().parse().expect("d"))
                    })
                    .collect();
            }
            other => panic!(
                "unknown argument {other}; use --steps N, --warmup N, --rounds N, --threads shared|one|N, --configs 1x1,1x2,1x4,2x2"
            ),
        }
    }
    if cfg!(debug_assertions) {
        eprintln!("warning: a debug build; run with --release");
    }
    assert!(steps > 0 && rounds > 0, "--steps, --rounds: at least 1");
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let model = ModelShape::Transformer(shape());
    let s = shape();
    println!(
        "data-parallel throughput on flex: {cores} cores available (std::thread::available_parallelism), load average {} at start",
        load_average()
    );
    println!(
        "model: GPT {} layers, h {}, {} heads, s {}, v {}, tied ({:.2}M parameters), fp32 AdamW; global batch {GLOBAL_BATCH} = micro-batch {MICRO_BATCH} × accumulation 16/(2d) × d ({} tokens per step); ZeRO-1, {} MiB buckets; per round the median of {steps} steps after {warmup} warm-up, {rounds} rounds",
        s.layers,
        s.hidden,
        s.heads,
        s.sequence_length,
        s.vocabulary,
        model.total_params() as f64 / 1e6,
        GLOBAL_BATCH * s.sequence_length,
        FLEX.collective_bucket_bytes >> 20,
    );
    println!(
        "model figures: headroom_planner::timing::estimate, FLEX profile ({:.0e} FLOP/s per device, {:.0e} B/s ring, {:.0e} s per message), one device per worker",
        FLEX.fp32_flops_per_second,
        FLEX.collective_bytes_per_second,
        FLEX.collective_latency_seconds,
    );
    for threads in passes {
        pass(&configs, threads, cores, (rounds, warmup, steps));
    }
    println!("\nload average {} at the end", load_average());
}
