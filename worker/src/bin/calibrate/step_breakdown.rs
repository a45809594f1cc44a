//! `calibrate --step-breakdown`: where a training step's time goes, for a
//! full fine-tune and the LoRA and QLoRA steps of the same model, on the job
//! `worker/bench/pytorch_step.py` runs in PyTorch + PEFT (the A/B of
//! docs/benchmarks.md: a SmolLM2-135M-shaped Llama, fp32, AdamW at 1e-3 clipped at 1.0,
//! micro-batch 4 × 256 tokens, LoRA r16 on the seven block linears).
//!
//! Each case trains in this process on the worker's own `Trainer` (the
//! code path the worker pod runs, without the pod), from a random
//! checkpoint of the shape written once under the models directory.
//! Printed per case: the median step and its phases (forward with the
//! loss, backward, optimizer), tokens/s, and the LoRA and QLoRA steps as
//! fractions of the full one. With `--backend cuda` (a CUDA build) the
//! same cases train on GPU 0, cubecl configured as a worker's, and each
//! phase waits for the device before its time is read. The top ops inside the phases come from
//! `perf` around this mode (`make bench-lora-step`); `--only linear-ops`
//! and `--only block-ops` time a block's linears and its other ops alone.

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::Device;
use headroom_planner::{Backend, BaseFormat, LoraConfig, Optimizer, Precision};
use headroom_worker::ValidAssignment;
use headroom_worker::gpu_runtime::{self, RuntimeSettings};
use headroom_worker::model::lora::BLOCK_LINEARS;
use headroom_worker::train::{StepPhases, Trainer};

use super::{Case, assignment, fine_tuning_files_with, llama, median, selected};

/// SmolLM2-135M's shape (30 × 576, 9 query / 3 key-value heads, SwiGLU
/// 1536, vocabulary 49152, tied) at 256 tokens.
fn smol_135m() -> headroom_planner::ModelShape {
    llama(30, 576, (9, 3), 1536, 256, 49152, true)
}

/// PEFT's `LoraConfig(r=16, lora_alpha=32, lora_dropout=0)` on the seven
/// block linears; NF4 blocks of 64 as bitsandbytes'.
fn adapters() -> LoraConfig {
    LoraConfig {
        rank: 16,
        alpha: 32.0,
        dropout: 0.0,
        target_modules: BLOCK_LINEARS.to_vec(),
        block_size: headroom_planner::adapters::default_block_size(),
    }
}

fn cases() -> Vec<Case> {
    let full = Case::full(
        "full",
        &smol_135m(),
        (4, 1),
        false,
        Optimizer::Adamw,
        Precision::Fp32,
    );
    let lora = Case {
        name: "lora",
        adapters: Some(adapters()),
        ..full.clone()
    };
    let qlora = Case {
        name: "qlora-nf4",
        base_format: BaseFormat::Nf4,
        ..lora.clone()
    };
    vec![full, lora, qlora]
}

/// The measured steps of one case.
struct Timed {
    name: &'static str,
    tokens: f64,
    steps: Vec<(f64, StepPhases)>,
    /// Minor page faults of each timed step (fresh memory touched).
    faults: Vec<f64>,
}

impl Timed {
    fn median_step(&self) -> f64 {
        median(self.steps.iter().map(|(s, _)| *s).collect())
    }

    fn median_phase(&self, phase: impl Fn(&StepPhases) -> std::time::Duration) -> f64 {
        median(
            self.steps
                .iter()
                .map(|(_, p)| phase(p).as_secs_f64())
                .collect(),
        )
    }
}

/// Trains `case` on `backend` for `warmup` + `steps` steps; the last
/// `steps` are timed.
fn time_case(case: &Case, backend: Backend, models: &Path, warmup: u32, steps: u32) -> Timed {
    let total = u64::from(warmup + steps);
    let dir = std::env::temp_dir().join(format!(
        "headroom-step-breakdown-{}-{}",
        std::process::id(),
        case.name
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut a = assignment(case, total);
    // Transformers' Trainer clips at 1.0 by default; so does the PyTorch side.
    a.recipe.max_grad_norm = 1.0;
    a.files = fine_tuning_files_with(case, &dir, models, total);
    // The CPU's plan (the same micro-batch, no checkpointing), run on the
    // backend asked for.
    a.plan.backend = backend;
    let config = ValidAssignment::new(a)
        .expect("valid assignment")
        .into_config();
    let tokens = config.tokens_per_step() as f64;
    let loading = Instant::now();
    let device = match backend {
        Backend::Flex => Device::flex().autodiff(),
        _ => headroom_worker::train::training_device(backend, case.precision)
            .unwrap_or_else(|e| panic!("{e}")),
    };
    let mut trainer = Trainer::new(config, device).expect("trainer");
    // On a queued backend a phase's kernels finish after its calls return.
    trainer.sync_phases = backend != Backend::Flex;
    eprintln!(
        "  {}: loaded in {:.1} s",
        case.name,
        loading.elapsed().as_secs_f64()
    );
    let mut timed = Timed {
        name: case.name,
        tokens,
        steps: Vec::new(),
        faults: Vec::new(),
    };
    for i in 0..warmup + steps {
        let faults = minor_faults();
        let r = trainer.train_step().expect("one stage");
        let faults = minor_faults().saturating_sub(faults);
        eprintln!(
            "  {} step {}: {:.0} ms (forward {:.0}, backward {:.0}, optimizer {:.0}), {faults} page faults, loss {:.4}",
            case.name,
            r.step,
            r.elapsed.as_secs_f64() * 1e3,
            r.phases.forward.as_secs_f64() * 1e3,
            r.phases.backward.as_secs_f64() * 1e3,
            r.phases.optimizer.as_secs_f64() * 1e3,
            r.loss.unwrap_or(f64::NAN)
        );
        if i >= warmup {
            timed.steps.push((r.elapsed.as_secs_f64(), r.phases));
            timed.faults.push(faults as f64);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    timed
}

/// This process's minor page faults so far (`/proc/self/stat`, field 10).
fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|stat| {
            let after_name = stat.rsplit_once(')')?.1;
            after_name.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

/// Where the random checkpoints are kept between runs (one 540 MB file).
fn models_dir() -> PathBuf {
    let base = std::env::var_os("HEADROOM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join("bench").join("lora-step");
    std::fs::create_dir_all(&dir).expect("models dir");
    dir
}

/// The mode's entry point: `--only` picks cases by name (`full`, `lora`,
/// `qlora-nf4`), `--steps` the timed steps (default 6, after 2 warm-up),
/// `backend` the device (`--backend cuda`: GPU 0, cubecl configured as a
/// worker's, its compiled kernels kept in gpu-check's cache directory;
/// each phase waits for the device before its time is read).
pub fn run(steps: u64, only: Option<&str>, backend: Backend) {
    if cfg!(debug_assertions) {
        eprintln!("warning: a debug build; time with --release");
    }
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "all".into());
    let tunables = std::env::var(headroom_api::MALLOC_TUNABLES_ENV).unwrap_or_default();
    if tunables != headroom_api::WORKER_MALLOC_TUNABLES {
        eprintln!(
            "note: the worker pods run with {}={} (and {}={}); this process does not",
            headroom_api::MALLOC_TUNABLES_ENV,
            headroom_api::WORKER_MALLOC_TUNABLES,
            headroom_api::MALLOC_ARENA_MAX_ENV,
            headroom_api::WORKER_MALLOC_ARENAS
        );
    }
    println!(
        "step breakdown: SmolLM2-135M shape (30 × 576, GQA 9/3, SwiGLU 1536, vocab 49152, tied), fp32, AdamW, micro-batch 4 × 256 tokens, {steps} timed steps after 2 warm-up; threads: {threads}; GLIBC_TUNABLES={tunables:?}"
    );
    println!("backend: {backend:?}");
    if backend != Backend::Flex {
        // As gpu-check's workers: the CUDA profile's runtime with
        // `--autotune`'s level, the kernels kept in its cache directory.
        let settings = RuntimeSettings::for_plan(
            backend,
            Some(super::gpu::gpu_runtime()),
            "step-breakdown",
            Some(super::gpu::gpu_cache_dir()),
        );
        if let Some(settings) = settings {
            match gpu_runtime::install(&settings) {
                Ok(()) => println!("GPU runtime: {}", settings.runtime),
                Err(e) => eprintln!("GPU runtime not configured as a worker's: {e}"),
            }
        }
    }
    let models = models_dir();
    let steps = u32::try_from(steps).expect("steps");
    let rows: Vec<Timed> = cases()
        .iter()
        .filter(|c| only.is_none_or(|o| selected(c.name, o)))
        .map(|c| time_case(c, backend, &models, 2, steps))
        .collect();
    println!(
        "\n| case | median step ms | forward (with loss) ms | backward ms | optimizer ms | tokens/s | step / full step | page faults per step |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    let full = rows
        .iter()
        .find(|r| r.name == "full")
        .map(Timed::median_step);
    for r in &rows {
        let step = r.median_step();
        println!(
            "| {} | {:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {} | {:.0} |",
            r.name,
            step * 1e3,
            r.median_phase(|p| p.forward) * 1e3,
            r.median_phase(|p| p.backward) * 1e3,
            r.median_phase(|p| p.optimizer) * 1e3,
            r.tokens / step,
            full.map_or("—".into(), |f| format!("{:.2}", step / f)),
            median(r.faults.clone()),
        );
    }
}

/// One linear of the 135M model's blocks on a micro-batch's 4 × 256 tokens,
/// forward and backward timed apart, each way the trainer can run it: the
/// ops a step's linears spend their time in, measured one by one.
pub fn linear_ops(reps: usize) {
    use burn::module::{Lora, Module};
    use burn::nn::{Linear, LinearConfig};
    use burn::tensor::{Distribution, Tensor};
    use headroom_worker::model::lean::linear;

    let device = Device::flex().autodiff();
    let tokens = [4, 256];
    type Variant = (&'static str, fn(&Linear, Tensor<3>) -> Tensor<3>);
    let variants: [Variant; 6] = [
        ("trained W: burn Linear::forward", |l, x| {
            linear::on_rows(x, |x| l.forward(x))
        }),
        ("frozen W: burn Linear::forward", |l, x| {
            linear::on_rows(x, |x| l.forward(x))
        }),
        ("frozen W: x.matmul(W)", |l, x| {
            linear::on_rows(x, |x| x.matmul(l.weight.base()))
        }),
        ("LoRA r16: lean linear (one op)", |l, x| {
            linear::forward(l, None, x, None)
        }),
        ("LoRA r16: composed, x·W + (x·A·s)·B", |l, x| {
            let adapter = l.weight.adapter().expect("adapter");
            linear::on_rows(x, |x| {
                x.clone().matmul(l.weight.base())
                    + x.matmul(adapter.a.val())
                        .mul_scalar(adapter.scale)
                        .matmul(adapter.b.val())
            })
        }),
        ("adapter alone: (x·A·s)·B", |l, x| {
            let adapter = l.weight.adapter().expect("adapter");
            linear::on_rows(x, |x| {
                x.matmul(adapter.a.val())
                    .mul_scalar(adapter.scale)
                    .matmul(adapter.b.val())
            })
        }),
    ];
    println!(
        "\nlinear ops, x [4, 256, d_in] (requires grad), median of {reps} interleaved runs\n\n| d_in → d_out | op | forward ms | backward ms |\n|---|---|---|---|"
    );
    for (d_in, d_out) in [(576, 576), (576, 1536), (1536, 576)] {
        let trained = LinearConfig::new(d_in, d_out)
            .with_bias(false)
            .init(&device);
        // burn initialises lazily: draw the weight before the clones share it.
        let _ = trained.weight.val();
        let frozen = trained.clone().no_grad();
        let lora = trained.clone().apply_lora(Lora::new(16, 32.0));
        let x = Tensor::<3>::random(
            [tokens[0], tokens[1], d_in],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let upstream = Tensor::<3>::random(
            [tokens[0], tokens[1], d_out],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let mut times = vec![(Vec::new(), Vec::new()); variants.len()];
        for _ in 0..reps + 1 {
            for (k, (_, run)) in variants.iter().enumerate() {
                let layer = match k {
                    0 => &trained,
                    1 | 2 => &frozen,
                    _ => &lora,
                };
                let x = x.clone().detach().require_grad();
                let t = Instant::now();
                let y = run(layer, x.clone());
                let forward = t.elapsed().as_secs_f64();
                let t = Instant::now();
                let grads = (y * upstream.clone()).sum().backward();
                let backward = t.elapsed().as_secs_f64();
                assert!(x.grad(&grads).is_some(), "{}: dx", variants[k].0);
                if k == 0 {
                    let w = trained.weight.val();
                    assert!(w.grad(&grads).is_some(), "the trained W has a gradient");
                }
                times[k].0.push(forward);
                times[k].1.push(backward);
            }
        }
        // The three products of a linear's step, alone on the plain backend.
        let (xs, w, dy) = (
            x.clone().inner().reshape([tokens[0] * tokens[1], d_in]),
            trained.weight.val().inner(),
            upstream
                .clone()
                .inner()
                .reshape([tokens[0] * tokens[1], d_out]),
        );
        let adapter = lora.weight.adapter().expect("adapter");
        let (a, b) = (adapter.a.val().inner(), adapter.b.val().inner());
        let u = xs.clone().matmul(a.clone());
        let ops = (xs, w, dy, a, b, u);
        type Operands = (
            Tensor<2>,
            Tensor<2>,
            Tensor<2>,
            Tensor<2>,
            Tensor<2>,
            Tensor<2>,
        );
        type Product = (&'static str, fn(&Operands) -> Tensor<2>);
        let products: [Product; 13] = [
            ("gemm y = x·W", |(x, w, ..)| x.clone().matmul(w.clone())),
            ("gemm dx = dy·Wᵀ", |(_, w, dy, ..)| {
                dy.clone().matmul(w.clone().transpose())
            }),
            ("gemm dW = xᵀ·dy", |(x, _, dy, ..)| {
                x.clone().transpose().matmul(dy.clone())
            }),
            ("gemm u = x·A", |(x, _, _, a, ..)| {
                x.clone().matmul(a.clone())
            }),
            ("gemm u·B", |(.., b, u)| u.clone().matmul(b.clone())),
            ("gemm dy·Bᵀ", |(_, _, dy, _, b, _)| {
                dy.clone().matmul(b.clone().transpose())
            }),
            ("gemm dA = xᵀ·du", |(x, .., u)| {
                x.clone().transpose().matmul(u.clone())
            }),
            ("mul_scalar [N, d_out]", |(_, _, dy, ..)| {
                dy.clone().mul_scalar(2.0)
            }),
            ("add [N, d_out]", |(_, _, dy, ..)| dy.clone() + dy.clone()),
            ("y = x·W + u·B: 2 gemms, add", |(x, w, _, _, b, u)| {
                x.clone().matmul(w.clone()) + u.clone().matmul(b.clone())
            }),
            ("y = [x|u]·[W;B]: cats, 1 gemm", |(x, w, _, _, b, u)| {
                Tensor::cat(vec![x.clone(), u.clone()], 1)
                    .matmul(Tensor::cat(vec![w.clone(), b.clone()], 0))
            }),
            (
                "dx = dy·Wᵀ + du·Aᵀ: 2 gemms, add",
                |(_, w, dy, a, _, u)| {
                    dy.clone().matmul(w.clone().transpose())
                        + u.clone().matmul(a.clone().transpose())
                },
            ),
            (
                "dx = [dy|du]·[W|A]ᵀ: cats, 1 gemm",
                |(_, w, dy, a, _, u)| {
                    Tensor::cat(vec![dy.clone(), u.clone()], 1)
                        .matmul(Tensor::cat(vec![w.clone(), a.clone()], 1).transpose())
                },
            ),
        ];
        let mut product_times = vec![Vec::new(); products.len()];
        for _ in 0..reps + 1 {
            for (k, (_, run)) in products.iter().enumerate() {
                let t = Instant::now();
                std::hint::black_box(run(&ops));
                product_times[k].push(t.elapsed().as_secs_f64());
            }
        }
        for ((name, _), times) in products.iter().zip(product_times) {
            println!(
                "| {d_in} → {d_out} | {name} | {:.2} | |",
                median(times[1..].to_vec()) * 1e3
            );
        }
        for ((name, _), (forward, backward)) in variants.iter().zip(times) {
            // The first round warms the allocator up: not counted.
            let f = median(forward[1..].to_vec());
            let b = median(backward[1..].to_vec());
            println!(
                "| {d_in} → {d_out} | {name} | {:.2} | {:.2} |",
                f * 1e3,
                b * 1e3
            );
        }
    }
}

/// `--step-breakdown --only block-ops`: the ops of a decoder block other
/// than its linears, on the bench job's shapes (micro-batch 4 × 256, 9 / 3
/// heads of 64, SwiGLU 1536, vocabulary 49152), forward and backward timed
/// apart, median of `reps` interleaved runs after one warm-up. The
/// attention in blocks of 256 (the GPU's), 128 and 64 (the CPU's):
/// a block pair on the diagonal computes its masked half too, so smaller
/// blocks skip more of it, at more ops per call. Also the
/// `exp` these ops call, burn's (libm per value) against the lean ops'
/// vectorized one, on a causal scores block (half of it masked).
pub fn block_ops(reps: usize) {
    use burn::module::Module;
    use burn::tensor::activation::silu;
    use burn::tensor::{Distribution, Int, Tensor, TensorData};
    use headroom_worker::model::lean::{self, AttentionOptions};

    let device = Device::flex().autodiff();
    let (b, s, heads, kv, d) = (4, 256, 9, 3, 64);
    let normal =
        |shape: [usize; 4]| Tensor::<4>::random(shape, Distribution::Normal(0.0, 1.0), &device);
    let (q, k, v) = (
        normal([b, heads, s, d]),
        normal([b, kv, s, d]),
        normal([b, kv, s, d]),
    );
    let dout = normal([b, heads, s, d]);
    // A long sequence (one of 2048 tokens): there the diagonal pairs are a
    // small share of all pairs, so smaller blocks save little and pay more
    // ops per call.
    let long = 2048;
    let (q_long, k_long, v_long, dout_long) = (
        normal([1, heads, long, d]),
        normal([1, kv, long, d]),
        normal([1, kv, long, d]),
        normal([1, heads, long, d]),
    );
    let gate = Tensor::<3>::random([b, s, 1536], Distribution::Normal(0.0, 1.0), &device);
    let up = Tensor::<3>::random([b, s, 1536], Distribution::Normal(0.0, 1.0), &device);
    let dgate = Tensor::<3>::random([b, s, 1536], Distribution::Normal(0.0, 1.0), &device);
    let hidden = Tensor::<2>::random([b * s, 576], Distribution::Normal(0.0, 1.0), &device);
    let head = Tensor::<2>::random([49152, 576], Distribution::Normal(0.0, 0.02), &device);
    let targets = Tensor::<1, Int>::from_data(
        TensorData::new(
            (0..(b * s) as i64).map(|i| i * 7919 % 49152).collect(),
            [b * s],
        ),
        &device,
    );
    let norm = burn::nn::RmsNormConfig::new(576).init(&device).no_grad();
    let residual = Tensor::<3>::random([b, s, 576], Distribution::Normal(0.0, 1.0), &device);
    let chunk = headroom_planner::memory::loss_chunk_rows(49152) as usize;
    // A scores block as the attention's forward exponentiates it: rows of
    // 3 · 256 queries against 256 keys, the causal half at the mask value.
    let plain = Device::flex();
    let scores: Vec<f32> = (0..b * kv * 3 * s * s)
        .map(|i| {
            let (key, query) = (i % s, (i / s) % s);
            if key > query {
                -1.0e30
            } else {
                -((i % 13) as f32) * 0.9
            }
        })
        .collect();
    let scores = Tensor::<4>::from_data(TensorData::new(scores, [b, kv, 3 * s, s]), &plain);

    type Op<'a> = (&'static str, Box<dyn Fn() -> (f64, f64) + 'a>);
    let timed = |forward: &dyn Fn() -> Tensor<1>| {
        let t = Instant::now();
        let y = forward();
        let f = t.elapsed().as_secs_f64();
        let t = Instant::now();
        let _ = y.backward();
        (f, t.elapsed().as_secs_f64())
    };
    let short = (q.clone(), k.clone(), v.clone(), dout.clone());
    let long = (q_long, k_long, v_long, dout_long);
    type Qkv = (Tensor<4>, Tensor<4>, Tensor<4>, Tensor<4>);
    let attention_of = |qkv: &Qkv, block: usize| -> Box<dyn Fn() -> (f64, f64)> {
        let (q, k, v, dout) = qkv.clone();
        Box::new(move || {
            let (q, k, v) = (
                q.clone().detach().require_grad(),
                k.clone().detach().require_grad(),
                v.clone().detach().require_grad(),
            );
            let options = AttentionOptions::causal(d, block);
            timed(&|| {
                (lean::attend(q.clone(), k.clone(), v.clone(), options.clone()) * dout.clone())
                    .sum()
            })
        })
    };
    let attention = |block: usize| attention_of(&short, block);
    let ops: Vec<Op> = vec![
        (
            "attention [4, 9, 256, 64], GQA 3 (lean, blocks of 256)",
            attention(256),
        ),
        (
            "attention, blocks of 128 (the diagonal pair's masked half in 1 of 3 pairs)",
            attention(128),
        ),
        ("attention, blocks of 64", attention(64)),
        (
            "attention [1, 9, 2048, 64], blocks of 256",
            attention_of(&long, 256),
        ),
        (
            "attention [1, 9, 2048, 64], blocks of 128",
            attention_of(&long, 128),
        ),
        (
            "attention [1, 9, 2048, 64], blocks of 64",
            attention_of(&long, 64),
        ),
        (
            "SwiGLU silu(gate) · up [4, 256, 1536] (burn's ops, as the model had it)",
            Box::new(|| {
                let (g, u) = (
                    gate.clone().detach().require_grad(),
                    up.clone().detach().require_grad(),
                );
                timed(&|| (silu(g.clone()) * u.clone() * dgate.clone()).sum())
            }),
        ),
        (
            "SwiGLU [4, 256, 1536] (lean, one gating op)",
            Box::new(|| {
                let (g, u) = (
                    gate.clone().detach().require_grad(),
                    up.clone().detach().require_grad(),
                );
                timed(&|| {
                    (lean::gated(g.clone(), u.clone(), lean::GateActivation::Silu) * dgate.clone())
                        .sum()
                })
            }),
        ),
        (
            "RMSNorm [4, 256, 576] (burn, frozen weight)",
            Box::new(|| {
                let x = hidden.clone().reshape([b, s, 576]).detach().require_grad();
                timed(&|| (norm.forward(x.clone()) * residual.clone()).sum())
            }),
        ),
        (
            "one elementwise product [4, 256, 1536] (gate · up)",
            Box::new(|| {
                let x = gate.clone().detach().require_grad();
                timed(&|| (x.clone() * dgate.clone()).sum())
            }),
        ),
        (
            "cross-entropy 1024 × 49152 (lean, in the model's chunks; with the head's matmuls)",
            Box::new(|| {
                let h = hidden.clone().detach().require_grad();
                let w = head.clone().detach().require_grad();
                timed(&|| lean::fused_cross_entropy(h.clone(), w.clone(), targets.clone(), chunk))
            }),
        ),
        (
            "exp, scores [4, 3, 768, 256]: burn's",
            Box::new(|| {
                let t = Instant::now();
                std::hint::black_box(scores.clone().exp());
                (t.elapsed().as_secs_f64(), 0.0)
            }),
        ),
        (
            "exp, scores [4, 3, 768, 256]: the lean ops'",
            Box::new(|| {
                let t = Instant::now();
                std::hint::black_box(lean::exp::exp(scores.clone()));
                (t.elapsed().as_secs_f64(), 0.0)
            }),
        ),
    ];
    let mut times = vec![(Vec::new(), Vec::new()); ops.len()];
    for _ in 0..reps + 1 {
        for (i, (_, run)) in ops.iter().enumerate() {
            let (f, b) = run();
            times[i].0.push(f);
            times[i].1.push(b);
        }
    }
    println!(
        "\nblock ops (besides the linears), median of {reps} interleaved runs\n\n| op | forward ms | backward ms |\n|---|---|---|"
    );
    for ((name, _), (f, b)) in ops.iter().zip(times) {
        println!(
            "| {name} | {:.2} | {:.2} |",
            median(f[1..].to_vec()) * 1e3,
            median(b[1..].to_vec()) * 1e3
        );
    }
}
