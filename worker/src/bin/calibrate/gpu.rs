//! `calibrate --backend cuda`: the planner's CUDA profile against real
//! workers on an NVIDIA GPU (`make gpu-check` runs it).
//!
//! The same method as the CPU grid: each case is planned by the real
//! planner (one GPU of the type NVML reports, the job's settings pinned),
//! run by a worker process of this binary (`--worker`, the production code
//! path) for a few steps with a checkpoint at the end, and its peak read
//! from the termination message. On a GPU the peak is the device's
//! (`MemoryProbe::device_peak`: the highest of NVML's used bytes and
//! cubecl's reserved bytes, sampled every 500 ms), less what NVML counted
//! as used before the worker started. Models are bf16 Llama-family
//! fine-tunes from random checkpoints this process writes (f32, reused by
//! every case of a shape), sized so GPU memory matters: 110M to 1.1B
//! parameters, 3B with `--large`; a case the planner says does not fit
//! this GPU is listed as skipped.
//!
//! Before the grid a child process (`--gpu-smoke`) trains a few bf16 steps
//! and prints NVML and the allocator's in-use/reserved bytes, so a broken
//! CUDA setup fails in seconds with its own error; then two more
//! (`--gpu-load-check`) load a dense and an nf4 stage and report the
//! device's bytes beyond the weights during the load ([`load_rows`]). After it: the cost of
//! one memory sample with NVML, and tokens/s with and without the
//! reporter thread.
//!
//! On a machine with two GPUs or more the grid ends with 2-GPU rows
//! ([`two_gpu_grid`]): the same planning, split over two replicas or two
//! stages, one worker process per GPU (`CUDA_VISIBLE_DEVICES`), the CPU
//! grid's pipeline runner ([`run_split`]) with each GPU's NVML baseline.

use super::*;
use headroom_planner::backend::CUDA;
use headroom_planner::{Backend, NodeFacts};
use headroom_worker::env::GPU_CACHE_DIR_ENV;
use headroom_worker::gpu_runtime::{RuntimeSettings, install};
use headroom_worker::train::{Unsupported, training_device};
use std::path::PathBuf;
use std::sync::OnceLock;

use headroom_planner::GpuRuntime;
use headroom_planner::backend::AutotuneLevel;

/// The GPU the grid runs on (NVML's index 0).
pub struct Gpu {
    pub name: String,
    pub memory_bytes: u64,
    pub driver: String,
    /// The newest CUDA the driver supports, e.g. "12.8".
    pub cuda: String,
    /// GPUs NVML sees (the 2-GPU rows need two).
    pub count: u32,
}

#[cfg(feature = "cuda")]
fn nvml() -> Result<nvml_wrapper::Nvml, String> {
    nvml_wrapper::Nvml::init().map_err(|e| {
        format!(
            "NVML did not start ({e}): no NVIDIA driver here. gpu-check needs a machine with an NVIDIA GPU and its driver (libnvidia-ml.so.1, /dev/nvidia*)"
        )
    })
}

#[cfg(feature = "cuda")]
pub fn detect() -> Result<Gpu, String> {
    let nvml = nvml()?;
    let count = nvml.device_count().map_err(|e| format!("NVML: {e}"))?;
    if count == 0 {
        return Err("NVML runs but sees no GPU".into());
    }
    let device = nvml
        .device_by_index(0)
        .map_err(|e| format!("NVML GPU 0: {e}"))?;
    let cuda = nvml.sys_cuda_driver_version().unwrap_or(0);
    Ok(Gpu {
        name: device.name().map_err(|e| format!("NVML GPU 0 name: {e}"))?,
        memory_bytes: device
            .memory_info()
            .map_err(|e| format!("NVML GPU 0 memory: {e}"))?
            .total,
        driver: nvml.sys_driver_version().unwrap_or_default(),
        cuda: format!("{}.{}", cuda / 1000, (cuda % 1000) / 10),
        count,
    })
}

#[cfg(not(feature = "cuda"))]
pub fn detect() -> Result<Gpu, String> {
    Err("this calibrate binary was built without the `cuda` feature: build it with `make worker-cuda`".into())
}

/// Bytes NVML counts as used on GPU 0 now (all processes).
fn used_bytes() -> u64 {
    used_bytes_of(0)
}

/// Bytes NVML counts as used on GPU `index` now (all processes).
#[cfg(feature = "cuda")]
fn used_bytes_of(index: u32) -> u64 {
    nvml()
        .ok()
        .and_then(|n| n.device_by_index(index).ok()?.memory_info().ok())
        .map_or(0, |m| m.used)
}

#[cfg(not(feature = "cuda"))]
fn used_bytes_of(_: u32) -> u64 {
    0
}

/// Where every process of a gpu-check keeps cubecl's autotune results and
/// compiled kernels (`HEADROOM_GPU_CACHE_DIR`, else one directory in the
/// temporary directory): the grid's worker processes pass it on, so a shape
/// is tuned once per machine, not once per case.
pub fn gpu_cache_dir() -> PathBuf {
    std::env::var_os(GPU_CACHE_DIR_ENV)
        .filter(|v| !v.is_empty())
        .map_or_else(
            || std::env::temp_dir().join("headroom-gpu-runtime"),
            PathBuf::from,
        )
}

/// `--autotune LEVEL`: the autotune level every process of this gpu-check
/// runs with instead of the CUDA profile's (an A/B of tuning time against
/// tokens/s); the grid's plans carry it to their workers.
static AUTOTUNE: OnceLock<AutotuneLevel> = OnceLock::new();

/// Parses `--autotune`'s value and keeps it for this process.
pub fn set_autotune(level: &str) {
    let parsed: AutotuneLevel = serde_json::from_value(serde_json::Value::String(level.into()))
        .unwrap_or_else(|_| panic!("--autotune {level}: minimal, balanced, extensive or full"));
    AUTOTUNE.set(parsed).expect("--autotune given once");
}

/// The arguments that pass this process's `--autotune` on to a child.
fn autotune_args() -> Vec<String> {
    AUTOTUNE.get().map_or_else(Vec::new, |level| {
        let name = serde_json::to_value(level).expect("an enum");
        vec![
            "--autotune".into(),
            name.as_str().unwrap_or_default().into(),
        ]
    })
}

/// The GPU runtime a worker of this gpu-check runs with: the CUDA
/// profile's, with `--autotune`'s level.
pub fn gpu_runtime() -> GpuRuntime {
    let mut runtime = CUDA
        .gpu_runtime
        .expect("the CUDA profile has GPU runtime settings");
    if let Some(&level) = AUTOTUNE.get() {
        runtime.autotune = level;
    }
    runtime
}

/// cubecl configured in this process as a CUDA plan's worker configures it
/// (before the device opens), its cache in [`gpu_cache_dir`].
fn configure_runtime(gpu: &Gpu) {
    let settings = RuntimeSettings::for_plan(
        Backend::Cuda,
        Some(gpu_runtime()),
        &gpu.name.replace(' ', "-"),
        Some(gpu_cache_dir()),
    )
    .expect("a CUDA plan has GPU runtime settings");
    match install(&settings) {
        Ok(()) => eprintln!("  (GPU runtime: {})", settings.runtime),
        Err(e) => eprintln!("gpu-check: GPU runtime not configured as planned: {e}"),
    }
}

/// One node with this GPU, labelled as GPU feature discovery labels it
/// (the product with spaces as dashes; memory in MiB as NVML reports it).
fn inventory(gpu: &Gpu) -> Inventory {
    let labels = [
        (
            headroom_planner::inventory::LABEL_GPU_PRODUCT,
            gpu.name.replace(' ', "-"),
        ),
        (
            headroom_planner::inventory::LABEL_GPU_MEMORY_MIB,
            (gpu.memory_bytes >> 20).to_string(),
        ),
        (headroom_planner::inventory::LABEL_GPU_COUNT, "1".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    let node = NodeFacts {
        name: "gpu-check".into(),
        labels,
        allocatable: [("nvidia.com/gpu".to_string(), 1)].into_iter().collect(),
        in_use: Default::default(),
        schedulable: true,
        allocatable_reported: true,
        host_memory_bytes: None,
    };
    Inventory::from_nodes([&node])
}

/// The CUDA profile's breakdown for a case's planned settings on one
/// stage: a grid row's prediction.
fn cuda_prediction(case: &Case, a: &WorkerAssignment) -> headroom_planner::MemoryBreakdown {
    estimate_stage(
        &case.model,
        a.plan.adapters.as_ref(),
        &a.plan.settings,
        StagePlacement::single(case.layers()),
        &CUDA,
        1.0,
    )
}

/// The case planned on one GPU, or why it does not fit.
fn assignment(case: &Case, steps: u64, gpu: &Gpu) -> Result<WorkerAssignment, String> {
    let req = job_request(
        case,
        Target::Gpu {
            allowed_types: vec![],
            max_gpus: 1,
            host_baseline_bytes: None,
        },
    );
    let mut plan =
        plan_with(&req, &inventory(gpu), &SearchOptions::default()).map_err(|e| e.to_string())?;
    // An offloaded row measures the same case with its checkpoints in host
    // memory, which the search only chooses where the case would not fit:
    // set it, and predict it ([`cuda_prediction`] reads the settings).
    if case.offload_activations || case.offload_embedding || case.offload_gradients {
        plan.settings.offload_activations |= case.offload_activations;
        plan.settings.offload_embedding |= case.offload_embedding;
        if case.offload_gradients {
            plan.settings.offload_gradients = true;
            plan.settings.offload_optimizer = true;
            plan.settings.activation_checkpointing = true;
        }
        let peak = estimate_stage(
            &case.model,
            plan.adapters.as_ref(),
            &plan.settings,
            StagePlacement::single(case.layers()),
            &CUDA,
            1.0,
        )
        .total;
        plan.predicted_peak_bytes = peak;
    }
    // Pinned settings are planned even over budget (a first attempt runs
    // them as asked); the grid keeps to what fits this GPU.
    if plan.predicted_peak_bytes > plan.budget_bytes {
        return Err(format!("predicted {}", plan.fit));
    }
    // The row measures the case's settings: a plan that only fits by
    // changing them (8-bit state, offload, a quantized base, more GPUs) is
    // not this case.
    let s = &plan.settings;
    let kept = (
        s.micro_batch,
        s.gradient_accumulation,
        s.activation_checkpointing,
        s.optimizer,
        s.base_format,
        s.offload_optimizer,
        s.offload_embedding,
        plan.stages.len(),
    ) == (
        case.micro_batch,
        case.accumulation,
        case.checkpointing,
        case.optimizer,
        case.base_format,
        case.offload_gradients,
        case.offload_embedding,
        1,
    );
    if !kept {
        return Err(format!(
            "fits only as {} × {}, checkpointing {}, {}, base {}, offload {}, {} stage(s)",
            s.micro_batch,
            s.gradient_accumulation,
            s.activation_checkpointing,
            s.optimizer,
            s.base_format,
            s.offload_optimizer,
            plan.stages.len()
        ));
    }
    let mut a = worker_assignment(&case.model, plan, steps);
    a.plan.gpu_runtime = Some(gpu_runtime());
    Ok(a)
}

/// bf16 Llama shapes with the Llama-2 vocabulary: T (110M, 12 × 768, MHA,
/// tied; s 1024, and 4096 and 8192 in the long-sequence rows), M (350M,
/// 24 × 1024, untied), B (TinyLlama-1.1B: 22 × 2048, GQA 32/4, SwiGLU
/// 5632, untied) and, with `large`, X (OpenLLaMA-3B: 26 × 3200, SwiGLU
/// 8640).
pub fn grid(large: bool) -> Vec<Case> {
    let t = llama(12, 768, (12, 12), 2048, 1024, 32000, true);
    let m = llama(24, 1024, (16, 16), 2816, 1024, 32000, false);
    let b = llama(22, 2048, (32, 4), 5632, 2048, 32000, false);
    let x = llama(26, 3200, (32, 32), 8640, 2048, 32000, false);
    let t4k = llama(12, 768, (12, 12), 2048, 4096, 32000, true);
    let t8k = llama(12, 768, (12, 12), 2048, 8192, 32000, true);
    let c = |name, model: &ModelShape, mb, acc, ckpt, opt| {
        Case::full(name, model, (mb, acc), ckpt, opt, Precision::Bf16)
    };
    let lora = |name, model: &ModelShape, mb, ckpt, targets: &[TargetModule], format| Case {
        adapters: Some(lora_config(targets)),
        base_format: format,
        ..c(name, model, mb, 1, ckpt, Optimizer::Adamw)
    };
    let offloaded = |case: Case| Case {
        offload_activations: true,
        ..case
    };
    let embedding_offloaded = |case: Case| Case {
        offload_embedding: true,
        ..case
    };
    let gradients_offloaded = |case: Case| Case {
        offload_gradients: true,
        ..case
    };
    use BaseFormat::{Dense, Int4, Int8, Nf4};
    use Optimizer::{Adamw, Adamw8bit};
    let qv = &[TargetModule::QProj, TargetModule::VProj][..];
    let all7 = &BLOCK_LINEARS[..];
    let mut cases = vec![
        c("T b8", &t, 8, 1, false, Adamw),
        c("T b16", &t, 16, 1, false, Adamw),
        c("T b16 ckpt", &t, 16, 1, true, Adamw),
        c("T b8 acc2", &t, 8, 2, false, Adamw),
        // Long sequences: the attention and loss ops keep memory linear in s.
        c("T s4096 b2", &t4k, 2, 1, false, Adamw),
        c("T s4096 b2 ckpt", &t4k, 2, 1, true, Adamw),
        c("T s8192 b1", &t8k, 1, 1, false, Adamw),
        c("T s8192 b1 ckpt", &t8k, 1, 1, true, Adamw),
        // The same with the checkpointed block inputs in host memory.
        offloaded(c("T s8192 b1 ckpt offload", &t8k, 1, 1, true, Adamw)),
        c("M b8", &m, 8, 1, false, Adamw),
        c("M b8 ckpt", &m, 8, 1, true, Adamw),
        c("M b8 8bit", &m, 8, 1, false, Adamw8bit),
        c("B b4", &b, 4, 1, false, Adamw),
        c("B b8 ckpt", &b, 8, 1, true, Adamw),
        c("B b8 ckpt 8bit", &b, 8, 1, true, Adamw8bit),
        // Each block's gradients to a host accumulator, the step on the
        // host: the device keeps one unit's gradients instead of all.
        c("B b1 acc4 ckpt", &b, 1, 4, true, Adamw),
        gradients_offloaded(c("B b1 acc4 ckpt grads", &b, 1, 4, true, Adamw)),
        lora("B lora qv b4", &b, 4, false, qv, Dense),
        lora("B lora all7 b8 ckpt", &b, 8, true, all7, Dense),
        lora("B qlora8 all7 b8 ckpt", &b, 8, true, all7, Int8),
        lora("B qlora4 all7 b8 ckpt", &b, 8, true, all7, Int4),
        lora("B nf4 all7 b8 ckpt", &b, 8, true, all7, Nf4),
        offloaded(lora("B nf4 all7 b8 ckpt offload", &b, 8, true, all7, Nf4)),
        // The frozen 32000 × 2048 embedding in host memory (125 MiB).
        embedding_offloaded(lora("B nf4 all7 b8 ckpt embed", &b, 8, true, all7, Nf4)),
    ];
    if large {
        cases.extend([
            c("X b2 ckpt", &x, 2, 1, true, Adamw),
            lora("X lora all7 b4 ckpt", &x, 4, true, all7, Dense),
            lora("X qlora4 all7 b8 ckpt", &x, 8, true, all7, Int4),
            lora("X nf4 all7 b8 ckpt", &x, 8, true, all7, Nf4),
        ]);
    }
    cases
}

/// Trains a few bf16 steps on the GPU in this process and prints what the
/// worker's probe reads (the `--gpu-smoke` child). 0 when the losses are
/// finite.
pub fn smoke() -> i32 {
    let gpu = match detect() {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("gpu-check: {e}");
            return 2;
        }
    };
    // The CPU overhead model, in bf16.
    let case = Case {
        name: "smoke",
        precision: Precision::Bf16,
        ..overhead_case()
    };
    let a = match assignment(&case, 5, &gpu) {
        Ok(a) => a,
        Err(e) => {
            eprintln!(
                "gpu-check: the smoke model does not plan on {}: {e}",
                gpu.name
            );
            return 1;
        }
    };
    configure_runtime(&gpu);
    let device = match training_device(Backend::Cuda, Precision::Bf16) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu-check: no CUDA device: {e}");
            return 1;
        }
    };
    let config = ValidAssignment::new(a).expect("valid").into_config();
    let mut trainer = Trainer::new(config, device.clone()).expect("trainer");
    let mut losses = Vec::new();
    for _ in 0..5 {
        let r = trainer.train_step().expect("single stage");
        println!(
            "smoke: step {} loss {:.4} in {:.1} ms ({:.0} tokens/s)",
            r.step,
            r.loss.unwrap_or(f64::NAN),
            r.elapsed.as_secs_f64() * 1e3,
            r.tokens_per_second()
        );
        losses.extend(r.loss);
    }
    let s = probe(&device, true).sample();
    let mib = |b: Option<u64>| b.map_or("—".into(), |b| format!("{:.0} MiB", b as f64 / MIB));
    for g in &s.gpus {
        println!(
            "smoke: NVML GPU {}: {} used of {}",
            g.index,
            mib(Some(g.used_bytes)),
            mib(Some(g.total_bytes))
        );
    }
    println!(
        "smoke: allocator {} in use, {} reserved; process RSS {}; device peak {}",
        mib(s.allocator_in_use_bytes),
        mib(s.allocator_reserved_bytes),
        mib(s.process_rss_bytes),
        mib(Some(s.peak_bytes))
    );
    // The pools behind "reserved": the arena's page size against the
    // largest request (the memory model counts one page of the largest
    // request plus 1 MiB, `arena_page_bytes`), and how many pages it kept.
    for (i, pool) in device
        .memory_pool_report()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        println!(
            "smoke: pool {i}: {} of {} pages held ({} at most), largest allocation {}",
            pool.pages,
            mib(Some(pool.page_size)),
            pool.pages_peak,
            mib(Some(pool.largest_alloc))
        );
    }
    if s.gpus.is_empty() {
        eprintln!("gpu-check: the worker's probe read no GPU through NVML");
        return 1;
    }
    if losses.len() != 5 || losses.iter().any(|l| !l.is_finite()) {
        eprintln!("gpu-check: losses {losses:?}: not 5 finite values");
        return 1;
    }
    0
}

/// `--gpu-ops-check fp32|bf16` (a child process: a device's float dtype
/// is set once per process): the lean ops against the naive ones on GPU 0
/// in that dtype, and both against the f32 reference on the CPU
/// (`headroom_worker::model::lean::check`). 0 when every lean op is as
/// accurate as the op it replaces.
pub fn ops_check(precision: Precision) -> i32 {
    use headroom_worker::model::lean::check::{Shapes, compare_on};
    match detect() {
        Ok(gpu) => configure_runtime(&gpu),
        Err(e) => {
            eprintln!("gpu-check: {e}");
            return 2;
        }
    }
    let device = match training_device(Backend::Cuda, precision) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu-check: no CUDA device: {e}");
            return 1;
        }
    };
    // The dtype's rounding: bf16 keeps 8 bits of mantissa; cubecl's f32
    // matmuls on an H200 put the naive ops 2.9e-4 to 3.4e-3 from the CPU's
    // (first run, docs/gpu.md), so an f32 row without a reference (the NF4
    // linear's dB: 3.3e-4 lean against naive) is held to 1e-3.
    let tolerance = match precision {
        Precision::Fp32 => 1e-3,
        _ => 2e-2,
    };
    let started = Instant::now();
    let rows = compare_on(&device, Shapes::gpu());
    let opt = |e: Option<f32>| e.map_or("—".to_string(), |e| format!("{e:.1e}"));
    let mut failed = 0;
    for r in &rows {
        let ok = r.holds(tolerance);
        failed += usize::from(!ok);
        println!(
            "| {precision} | {} | {} | {:.1e} | {} | {} | {} |",
            r.case,
            r.quantity,
            r.lean_vs_naive,
            opt(r.lean_vs_reference),
            opt(r.naive_vs_reference),
            if ok { "ok" } else { "WORSE" }
        );
    }
    eprintln!(
        "  (ops check {precision}: {} comparisons in {:.1} s)",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    i32::from(failed > 0)
}

/// The load check's model: Llama-3's vocabulary (128,256) at hidden 1024,
/// 4 layers, untied, so the largest tensor (the embedding, and the head:
/// 250.5 MiB each in bf16) dwarfs a block's linears (21.5 MiB) and the
/// planner's term for the largest tensor's upload shows on its own.
fn load_model() -> ModelShape {
    llama(4, 1024, (16, 4), 2816, 512, 128256, false)
}

/// What a stage's checkpoint load holds on its device, bytes beyond what the
/// device held before: the weights it keeps (live bytes after the load),
/// the highest live bytes seen while it loaded (sampled every millisecond
/// on a thread, and the live bytes after), and what the allocator reserved
/// (its pools keep the pages a load's transients took).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoadProbe {
    pub weights: u64,
    pub peak_live: u64,
    pub reserved: u64,
}

/// Loads the checkpoint in `model_dir` into a whole stage on `device` as the
/// worker does (dense: [`HfCheckpoint::load_stage`]; a quantized base:
/// `lora::load_quantized`, block by block) and reads the device's pools
/// around it. `None` where the device has no pools to read (flex, where it
/// still loads: the CPU's test of this code).
pub fn load_probe(device: &Device, format: BaseFormat, model_dir: &Path) -> Option<LoadProbe> {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let before = device.memory_pool_usage();
    let checkpoint = HfCheckpoint::open(model_dir, 512).expect("the load check's checkpoint");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let layout = StageLayout::whole(&shape);
    // Lazily initialised parameters: nothing on the device until loaded.
    let mut model = TransformerLm::new(&shape, &layout, 0, device);
    let stop = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(
        before.as_ref().map_or(0, |b| b.bytes_in_use),
    ));
    let sampler = {
        let (stop, peak, device) = (stop.clone(), peak.clone(), device.clone());
        std::thread::spawn(move || {
            while !stop.load(Ordering::Relaxed) {
                if let Some(u) = device.memory_pool_usage() {
                    peak.fetch_max(u.bytes_in_use, Ordering::Relaxed);
                }
                std::thread::sleep(Duration::from_millis(1));
            }
        })
    };
    if format.is_quantized() {
        let config = lora_config(&BLOCK_LINEARS);
        model = headroom_worker::model::lora::load_quantized(
            &checkpoint,
            model,
            &config,
            format,
            &layout,
            0,
            device,
        )
        .expect("load_quantized");
    } else {
        checkpoint
            .load_stage(&mut model, &layout)
            .expect("load_stage");
    }
    device.sync().expect("the device finishes the load");
    stop.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler");
    let (before, after) = (before?, device.memory_pool_usage()?);
    drop(model);
    let peak = peak.load(Ordering::Relaxed).max(after.bytes_in_use);
    Some(LoadProbe {
        weights: after.bytes_in_use.saturating_sub(before.bytes_in_use),
        peak_live: peak.saturating_sub(before.bytes_in_use),
        reserved: after.bytes_reserved.saturating_sub(before.bytes_reserved),
    })
}

/// `--gpu-load-check dense|nf4 MODEL_DIR` (a child process: a fresh device,
/// nothing loaded before): [`load_probe`] on GPU 0 in bf16, one JSON line.
pub fn load_check(format: BaseFormat, model_dir: &Path) -> i32 {
    match detect() {
        Ok(gpu) => configure_runtime(&gpu),
        Err(e) => {
            eprintln!("gpu-check: {e}");
            return 2;
        }
    }
    let device = match training_device(Backend::Cuda, Precision::Bf16) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gpu-check: no CUDA device: {e}");
            return 1;
        }
    };
    let Some(p) = load_probe(&device, format, model_dir) else {
        eprintln!("gpu-check: the CUDA device reports no memory pools");
        return 1;
    };
    println!(
        "{}",
        serde_json::json!({"weights": p.weights, "peak_live": p.peak_live, "reserved": p.reserved})
    );
    0
}

/// The planner's CUDA load of [`load_model`] on one stage, bytes: its
/// weights and what it counts beside them on the device (the load peak less
/// the fixed overhead and the weights: the largest tensor's upload, for a
/// quantized base one dense block, and the state slack on both).
fn planned_load(format: BaseFormat) -> (u64, u64) {
    let model = load_model();
    let adapters = format.is_quantized().then(|| lora_config(&BLOCK_LINEARS));
    let settings = headroom_planner::Settings {
        activation_checkpointing: true,
        precision: Precision::Bf16,
        base_format: format,
        ..headroom_planner::Settings::default()
    };
    let m = estimate_stage(
        &model,
        adapters.as_ref(),
        &settings,
        StagePlacement::single(model.splittable_layers()),
        &CUDA,
        1.0,
    );
    // The adapters are made after the load; the base is what it holds.
    let adapter_bytes = adapters.as_ref().map_or(0, |a| match &model {
        ModelShape::Llama(l) => a.trainable_params(l) * 2,
        _ => 0,
    });
    let base = m.weights - adapter_bytes;
    (base, m.load_peak - m.fixed_overhead - m.weights)
}

/// The device's share of a checkpoint load (the plan's load figure; on the
/// CPU host and device are one memory, so only a GPU can say): for a dense
/// and an nf4 base of [`load_model`], each loaded in a child process, the
/// live bytes beyond the weights against what the planner counts. Returns
/// the number of rows that failed.
fn load_rows(models: &Path) -> usize {
    let case = Case::full(
        "load",
        &load_model(),
        (1, 1),
        true,
        Optimizer::Adamw,
        Precision::Bf16,
    );
    let dir = std::env::temp_dir().join(format!("headroom-gpu-load-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let files = fine_tuning_files_with(&case, &dir, models, 1).expect("a Llama checkpoint");
    let _ = std::fs::remove_dir_all(&dir);
    println!(
        "\ncheckpoint load on the device (bf16 stage of a 4 × 1024 Llama with a 128,256 vocabulary, untied; live bytes from cubecl's pools, sampled every ms):\n"
    );
    println!(
        "| base | weights MiB (planned) | peak live beyond weights MiB | reserved beyond weights MiB | planned beyond weights MiB |"
    );
    println!("|---|---|---|---|---|");
    let mut failed = 0;
    for (format, name) in [(BaseFormat::Dense, "dense"), (BaseFormat::Nf4, "nf4")] {
        std::io::Write::flush(&mut std::io::stdout()).ok();
        let out = Command::new(std::env::current_exe().expect("own path"))
            .args(["--gpu-load-check", name, &files.model_dir])
            .args(autotune_args())
            .output()
            .expect("run the load-check child");
        let probe: Option<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| serde_json::from_str(l).ok());
        let (Some(p), true) = (probe, out.status.success()) else {
            println!("| {name} | failed ({}) |", out.status);
            eprintln!("{}", String::from_utf8_lossy(&out.stderr));
            failed += 1;
            continue;
        };
        let mib = |key: &str| p[key].as_u64().unwrap_or(0) as f64 / MIB;
        let (weights, beyond) = planned_load(format);
        println!(
            "| {name} | {:.1} ({:.1}) | {:.1} | {:.1} | {:.1} |",
            mib("weights"),
            weights as f64 / MIB,
            mib("peak_live") - mib("weights"),
            mib("reserved") - mib("weights"),
            beyond as f64 / MIB,
        );
    }
    failed
}

/// The card's dense bf16 tensor-core peak in FLOP/s, from NVIDIA's
/// datasheets (without sparsity), by the name NVML reports.
pub fn bf16_peak_flops(name: &str) -> Option<f64> {
    let name = name.to_ascii_uppercase();
    [
        ("H200", 989.4e12),
        ("H100 PCIE", 756.0e12),
        ("H100", 989.4e12),
        ("A100", 312.0e12),
        ("L40S", 362.05e12),
        ("L4", 121.0e12),
        ("A10", 125.0e12),
    ]
    .into_iter()
    .find(|(key, _)| name.contains(key))
    .map(|(_, flops)| flops)
}

/// Training FLOPs per token: 6 per parameter (forward and backward) plus
/// attention's scores and weighted sum, 12 · layers · hidden · sequence
/// (PaLM, appendix B; causal masking not discounted, as there).
pub fn flops_per_token(model: &ModelShape) -> f64 {
    let (layers, hidden, seq) = match model {
        ModelShape::Llama(l) => (l.layers, l.attention_heads * l.head_dim, l.sequence_length),
        ModelShape::Transformer(t) => (t.layers, t.hidden, t.sequence_length),
        ModelShape::Generic(_) => (0, 0, 0),
    };
    6.0 * model.total_params() as f64
        + 12.0 * f64::from(layers) * f64::from(hidden) * f64::from(seq)
}

/// Full fine-tunes timed in this process (random checkpoints from
/// `models`): the median of `steps` steps after two warm-up steps (kernel
/// compilation, autotune), tokens/s and model FLOPs utilisation.
fn speed_rows(gpu: &Gpu, device: &Device, models: &Path, steps: u64) {
    let b = llama(22, 2048, (32, 4), 5632, 2048, 32000, false);
    let cases = [
        Case::full("B b8", &b, (8, 1), false, Optimizer::Adamw, Precision::Bf16),
        Case::full(
            "B b8 ckpt",
            &b,
            (8, 1),
            true,
            Optimizer::Adamw,
            Precision::Bf16,
        ),
    ];
    let peak = bf16_peak_flops(&gpu.name);
    println!(
        "\nspeed (bf16 full fine-tunes, median of {steps} steps after 2 warm-up steps; MFU against {}):\n",
        peak.map_or("no known peak for this card".into(), |p| format!(
            "{:.0} TFLOP/s",
            p / 1e12
        ))
    );
    println!("| case | params | s | micro | ckpt | step ms | first step s | tokens/s | MFU |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for case in cases {
        let mut a = match assignment(&case, steps + 2, gpu) {
            Ok(a) => a,
            Err(e) => {
                println!("| {} | skipped: {e} |", case.name);
                continue;
            }
        };
        let dir = std::env::temp_dir().join(format!("headroom-gpu-speed-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        a.files = fine_tuning_files_with(&case, &dir, models, steps + 2);
        let config = ValidAssignment::new(a).expect("valid").into_config();
        let tokens = config.tokens_per_step() as f64;
        let timed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut trainer = Trainer::new(config, device.clone()).expect("trainer");
            // The first step compiles every kernel and tunes every shape
            // not in the cache yet (gpu_cache_dir).
            let first = trainer.train_step().expect("warm-up").elapsed.as_secs_f64();
            trainer.train_step().expect("warm-up");
            let times = (0..steps)
                .map(|_| trainer.train_step().expect("step").elapsed.as_secs_f64())
                .collect::<Vec<_>>();
            (first, times)
        }));
        let _ = std::fs::remove_dir_all(&dir);
        let Ok((first, times)) = timed else {
            println!("| {} | failed (see stderr) |", case.name);
            continue;
        };
        let step = median(times);
        let rate = tokens / step;
        let mfu = peak.map_or("—".into(), |p| {
            format!("{:.1} %", 100.0 * rate * flops_per_token(&case.model) / p)
        });
        let seq = match &case.model {
            ModelShape::Llama(l) => l.sequence_length,
            _ => 0,
        };
        println!(
            "| {} | {:.0}M | {seq} | {} | {} | {:.1} | {first:.1} | {rate:.0} | {mfu} |",
            case.name,
            case.model.total_params() as f64 / 1e6,
            case.micro_batch,
            if case.checkpointing { "on" } else { "off" },
            step * 1e3,
        );
    }
}

/// `--quick`: one row per kind of term on the small models (under 4
/// minutes with the smoke, the ops check and the telemetry run on an H200).
pub const QUICK_CASES: &str = "T b8$|T b16 ckpt|T s8192|M b8$";

/// The GPU grid, the summary and (with `overhead`) telemetry cost and
/// tokens/s. The exit code: 0 when the targets are met, 1 when missed, 2
/// when there is no GPU or CUDA build to run on.
pub fn run(
    steps: u64,
    only: Option<&str>,
    overhead: bool,
    large: bool,
    quick: bool,
    ops_check: bool,
) -> i32 {
    let only = only.or(quick.then_some(QUICK_CASES));
    let gpu = match detect() {
        Ok(gpu) => gpu,
        Err(e) => {
            eprintln!("gpu-check: {e}");
            return 2;
        }
    };
    println!(
        "GPU: {} ({:.1} GiB), driver {}, CUDA {} (driver API)\n",
        gpu.name,
        gpu.memory_bytes as f64 / (1u64 << 30) as f64,
        gpu.driver,
        gpu.cuda
    );
    let status = Command::new(std::env::current_exe().expect("own path"))
        .arg("--gpu-smoke")
        .args(autotune_args())
        .status()
        .expect("run the smoke child");
    if !status.success() {
        eprintln!("gpu-check: the bf16 smoke run failed ({status}); no grid");
        return 1;
    }
    let models = std::env::temp_dir().join(format!("headroom-gpu-models-{}", std::process::id()));
    let load_failed = load_rows(&models);
    let ops_failed = if ops_check { ops_checks() } else { 0 };
    print_profile(steps);
    print_table_header();
    let mut rows = Vec::new();
    let mut failed = 0;
    for case in grid(large)
        .into_iter()
        .filter(|c| only.is_none_or(|o| selected(c.name, o)))
    {
        match one_gpu_row(case, steps, &gpu, &models) {
            Row::Measured(m) => rows.push(*m),
            Row::Skipped => {}
            Row::Failed => failed += 1,
        }
    }
    if gpu.count >= 2 {
        let (two_rows, two_failed) = two_gpu_rows(&gpu, only, &models, steps);
        rows.extend(two_rows);
        failed += two_failed;
    }
    // One device for the in-process runs: its dtype is set once per process.
    if overhead {
        configure_runtime(&gpu);
    }
    let device = overhead.then(|| training_device(Backend::Cuda, Precision::Bf16));
    if let Some(Ok(device)) = &device
        && !quick
    {
        speed_rows(&gpu, device, &models, 5);
    }
    let _ = std::fs::remove_dir_all(&models);
    if let Some(device) = device {
        overhead_row(&gpu, device);
    }
    if rows.is_empty() {
        eprintln!("gpu-check: no case ran");
        return 1;
    }
    let missed = summarize(&rows);
    if ops_failed > 0 {
        eprintln!("gpu-check: a lean op was less accurate than the op it replaces on this GPU");
        return 1;
    }
    if failed + load_failed > 0 {
        eprintln!("gpu-check: {failed} case(s) and {load_failed} load check(s) failed");
        return 1;
    }
    missed
}

/// The lean ops against the naive ones on this GPU, in fp32 and bf16 (one
/// child process each); returns how many failed.
fn ops_checks() -> usize {
    println!(
        "\nlean ops on this GPU against the naive ones (max |difference| / max |value|; reference: the naive op in f32 on the CPU):\n"
    );
    println!(
        "| dtype | op | quantity | lean vs naive | lean vs reference | naive vs reference | |"
    );
    println!("|---|---|---|---|---|---|---|");
    let mut ops_failed = 0;
    for dtype in ["fp32", "bf16"] {
        // Flushed before the child writes to the same stdout.
        std::io::Write::flush(&mut std::io::stdout()).ok();
        let status = Command::new(std::env::current_exe().expect("own path"))
            .args(["--gpu-ops-check", dtype])
            .args(autotune_args())
            .status()
            .expect("run the ops-check child");
        if !status.success() {
            eprintln!("gpu-check: the {dtype} ops check failed ({status})");
            ops_failed += 1;
        }
    }
    ops_failed
}

/// The CUDA profile the grid's predictions come from.
fn print_profile(steps: u64) {
    println!(
        "\nCUDA profile: fixed overhead {:.0} MiB, state slack {:.0} %, activation slack {:.0} % ({:.0} % for adapters without checkpointing), logit copies {}, checkpointed phase overlap {}, {:?} activation count, usable {:.0} %; bf16, {steps} steps per case, peak = worker device peak (NVML used, allocator reserved) less the NVML baseline\n",
        CUDA.fixed_overhead_bytes as f64 / MIB,
        CUDA.state_slack * 100.0,
        CUDA.activation_slack * 100.0,
        CUDA.adapter_activation_slack * 100.0,
        CUDA.logit_copies,
        CUDA.checkpoint_phase_overlap,
        CUDA.activation_count,
        CUDA.usable_fraction * 100.0,
    );
}

/// How one case of the grid went.
enum Row {
    Measured(Box<Measured>),
    /// The plan does not fit this GPU.
    Skipped,
    /// The worker failed: a finding, the other rows still run.
    Failed,
}

/// Plans `case` for this GPU, runs it as a worker process and prints its
/// row (or why there is none).
fn one_gpu_row(case: Case, steps: u64, gpu: &Gpu, models: &Path) -> Row {
    let a = match assignment(&case, steps, gpu) {
        Ok(a) => a,
        Err(e) => {
            let first = e.lines().next().unwrap_or_default().to_string();
            println!(
                "| {} | skipped: does not fit this GPU ({first}) |",
                case.name
            );
            return Row::Skipped;
        }
    };
    let breakdown = cuda_prediction(&case, &a);
    if std::env::var_os("CALIBRATE_BREAKDOWN").is_some() {
        eprintln!("  {}: {}", case.name, breakdown_mib(&breakdown));
    }
    let dir = std::env::temp_dir().join(format!("headroom-gpu-case-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    let mut a = a;
    a.files = fine_tuning_files_with(&case, &dir, models, steps);
    let baseline = used_bytes();
    let run = try_run_worker(case.name, &a, &dir);
    let _ = std::fs::remove_dir_all(&dir);
    // One case failing (a CUDA out-of-memory, a kernel that does not
    // compile) is a finding; the other rows still run.
    let (message, seconds) = match run {
        Ok((message, seconds, _log)) => (message, seconds),
        Err(e) => {
            let first = e.lines().next().unwrap_or_default().to_string();
            println!("| {} | failed: {first} |", case.name);
            eprintln!("{e}");
            return Row::Failed;
        }
    };
    let peak = message
        .peak_bytes
        .expect("peak bytes in the termination message");
    let m = Measured {
        label: case.name.to_string(),
        case,
        predicted: breakdown.total,
        measured: peak.saturating_sub(baseline),
        seconds,
        replicas: 1,
        guard: None,
    };
    print_row(&m);
    eprintln!(
        "  ({} took {:.1} s; NVML baseline {:.0} MiB)",
        m.case.name,
        m.seconds,
        baseline as f64 / MIB
    );
    Row::Measured(Box::new(m))
}

/// A GPT-2-small shape trained from random weights (no checkpoint to
/// write): tokens/s and the reporter's cost on this GPU.
fn overhead_row(gpu: &Gpu, device: Result<Device, Unsupported>) {
    let case = Case::full(
        "GPT 12 × 768 s1024",
        &shape(12, 768, 12, 1024, 32000, true),
        (8, 1),
        false,
        Optimizer::Adamw,
        Precision::Bf16,
    );
    match assignment(&case, 1_000_000, gpu) {
        Ok(a) => match device {
            Ok(device) => {
                println!(
                    "\ntokens/s and telemetry, model {} bf16, micro-batch {}{}:",
                    case.name,
                    case.micro_batch,
                    bf16_peak_flops(&gpu.name).map_or(String::new(), |p| format!(
                        "; {:.1} GFLOP per token, so MFU = tokens/s × {:.3e}",
                        flops_per_token(&case.model) / 1e9,
                        flops_per_token(&case.model) / p
                    ))
                );
                telemetry_overhead_on(a, device);
            }
            Err(e) => eprintln!("gpu-check: no CUDA device for the overhead run: {e}"),
        },
        Err(e) => eprintln!("gpu-check: the overhead model does not fit: {e}"),
    }
}

/// The grid's 2-GPU rows, `(case, stages, replicas)`: TinyLlama full
/// fine-tuning as two ZeRO-1 replicas (NCCL between them where the image
/// has libnccl, else the TCP ring) and its nf4 QLoRA as two pipeline
/// stages (activations over TCP through the host). Each keeps four
/// micro-batches of 4 per step.
pub fn two_gpu_grid() -> Vec<(Case, u32, u32)> {
    let b = llama(22, 2048, (32, 4), 5632, 2048, 32000, false);
    let full = Case::full(
        "B b4 acc2 ckpt d2",
        &b,
        (4, 2),
        true,
        Optimizer::Adamw,
        Precision::Bf16,
    );
    let qlora = Case {
        name: "B nf4 all7 b4 acc2 ckpt p2",
        adapters: Some(lora_config(&BLOCK_LINEARS)),
        base_format: BaseFormat::Nf4,
        ..full.clone()
    };
    vec![(full, 1, 2), (qlora, 2, 1)]
}

/// Runs [`two_gpu_grid`]: each case planned for one GPU of this type,
/// split as the row says, one worker process per GPU (GPU k·d + r for
/// stage k, replica r), each worker's peak against its stage's CUDA
/// figure. Returns the rows and how many cases failed.
fn two_gpu_rows(
    gpu: &Gpu,
    only: Option<&str>,
    models: &Path,
    steps: u64,
) -> (Vec<Measured>, usize) {
    println!(
        "\n2-GPU rows ({} GPUs here; one worker per GPU; NCCL between replicas, TCP between stages):\n",
        gpu.count
    );
    print_table_header();
    let (mut rows, mut failed) = (Vec::new(), 0);
    for (case, p, d) in two_gpu_grid()
        .into_iter()
        .filter(|(c, _, _)| only.is_none_or(|o| selected(c.name, o)))
    {
        let a = match assignment(&case, steps, gpu) {
            Ok(a) => split_over(&case, &a, p, d),
            Err(e) => {
                let first = e.lines().next().unwrap_or_default().to_string();
                println!(
                    "| {} | skipped: does not fit one GPU ({first}) |",
                    case.name
                );
                continue;
            }
        };
        let baselines = (0..p * d).map(used_bytes_of).collect();
        let run = run_split(
            &case,
            a,
            (p, d),
            &CUDA,
            &SplitWorkers::OneGpuEach { baselines },
            |dir| fine_tuning_files_with(&case, dir, models, steps),
        );
        match run {
            Ok(measured) => {
                for m in measured {
                    print_row(&m);
                    rows.push(m);
                }
            }
            Err(e) => {
                let first = e.lines().next().unwrap_or_default().to_string();
                println!("| {} | failed: {first} |", case.name);
                eprintln!("{e}");
                failed += 1;
            }
        }
    }
    (rows, failed)
}

/// The median |error| and worst under-prediction against the targets.
fn summarize(rows: &[Measured]) -> i32 {
    let med = median(rows.iter().map(|m| m.error().abs()).collect());
    let worst_under = rows.iter().map(Measured::error).fold(0.0f64, f64::min);
    println!(
        "\n{} cases: median |error| {:.1} % (target ≤ {:.0} %), worst under-prediction {:.1} % (target ≥ −{:.0} %)",
        rows.len(),
        100.0 * med,
        100.0 * MEDIAN_TARGET,
        100.0 * worst_under,
        100.0 * UNDER_TARGET
    );
    i32::from(!(med <= MEDIAN_TARGET && worst_under >= -UNDER_TARGET))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(name: &str, mib: u64) -> Gpu {
        Gpu {
            name: name.into(),
            memory_bytes: mib << 20,
            driver: "test".into(),
            cuda: "12.8".into(),
            count: 1,
        }
    }

    /// The load check compares the device's live bytes beyond the weights
    /// with the planner's load term for the same stage: the largest
    /// tensor's upload (the 128,256 × 1024 embedding, 250.5 MiB in bf16),
    /// and for nf4 one dense block (21.5 MiB) more, on a smaller base.
    #[test]
    fn the_load_check_compares_the_planners_load_term() {
        let mib = |b: u64| b as f64 / MIB;
        let (dense_weights, dense_beyond) = planned_load(BaseFormat::Dense);
        let (nf4_weights, nf4_beyond) = planned_load(BaseFormat::Nf4);
        assert!(mib(dense_beyond) >= 250.5, "{}", mib(dense_beyond));
        assert!(mib(nf4_beyond) >= mib(dense_beyond) - 20.0 + 21.5);
        assert!(nf4_weights < dense_weights);
    }

    /// On flex (no pools to read) the probe still loads both bases as the
    /// worker does, and says it has nothing to report.
    #[test]
    fn the_load_probe_loads_both_bases_on_the_cpu() {
        let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/llama/tiny-llama");
        let device = Device::flex();
        assert_eq!(load_probe(&device, BaseFormat::Dense, &tiny), None);
        assert_eq!(load_probe(&device, BaseFormat::Nf4, &tiny), None);
    }

    #[test]
    fn cards_are_told_apart_by_the_names_nvml_reports() {
        let tflops = |name: &str| bf16_peak_flops(name).map(|f| f / 1e12);
        assert_eq!(tflops("NVIDIA H200"), Some(989.4));
        assert_eq!(tflops("NVIDIA H100 80GB HBM3"), Some(989.4));
        assert_eq!(tflops("NVIDIA H100 PCIe"), Some(756.0));
        assert_eq!(tflops("NVIDIA A100-SXM4-80GB"), Some(312.0));
        assert_eq!(tflops("NVIDIA A10"), Some(125.0));
        assert_eq!(tflops("NVIDIA L40S"), Some(362.05));
        assert_eq!(tflops("NVIDIA L4"), Some(121.0));
        assert_eq!(tflops("Tesla T4"), None, "no bf16 tensor cores");
    }

    #[test]
    fn model_flops_count_parameters_and_attention() {
        // GPT-2 small's shape with the Llama-2 vocabulary, s 1024.
        let model = shape(12, 768, 12, 1024, 32000, true);
        let params = model.total_params() as f64;
        assert!((100e6..130e6).contains(&params), "{params}");
        let attention = 12.0 * 12.0 * 768.0 * 1024.0;
        assert_eq!(flops_per_token(&model), 6.0 * params + attention);
    }

    #[test]
    fn only_takes_alternatives_and_exact_endings() {
        assert!(selected("M b8 ckpt", "M b8"));
        assert!(!selected("M b8 ckpt", "M b8$"));
        assert!(selected("M b8", "T b8$|M b8$"));
        assert!(!selected("B b4", "T|M"));
    }

    /// The peaks an H200 measured on 2026-11-27 (docs/gpu.md, run 2: bf16,
    /// the lean ops, 3 steps, the worker's device peak less the NVML
    /// baseline, MiB) against what the CUDA profile predicts for the same
    /// cases: the targets, median |error| ≤ 5 %, none under −10 %. The
    /// worker then kept its bf16 stages in bf16 alone (no f32 master copy,
    /// bf16 moments) and ran burn's composed `silu(gate) · up`, so the
    /// profile is held to those rows as that worker was: its slacks with
    /// `pure_half_precision` and `composed_gated_mlp`. Today's worker keeps
    /// the master copy and runs the gating op, which the shipped profile
    /// counts; its rows await a GPU.
    #[test]
    fn the_cuda_profile_predicts_what_an_h200_measured() {
        let as_measured = headroom_planner::BackendProfile {
            pure_half_precision: true,
            composed_gated_mlp: true,
            ..CUDA
        };
        let h200 = gpu("NVIDIA H200", 143771);
        let measured = [
            ("T b8", 6317.0),
            ("T s8192 b1", 6317.0),
            ("T s8192 b1 ckpt", 2279.0),
            ("M b8", 16331.0),
        ];
        let mut errors = Vec::new();
        for (name, mib) in measured {
            let case = grid(false)
                .into_iter()
                .find(|c| c.name == name)
                .expect("a grid case");
            let a = assignment(&case, 3, &h200).expect("plans on an H200");
            let predicted = estimate_stage(
                &case.model,
                a.plan.adapters.as_ref(),
                &a.plan.settings,
                StagePlacement::single(case.layers()),
                &as_measured,
                1.0,
            )
            .total as f64
                / MIB;
            let error = (predicted - mib) / mib;
            eprintln!(
                "{name}: predicted {predicted:.0} MiB, measured {mib:.0}: {:+.1} %",
                100.0 * error
            );
            errors.push(error);
        }
        let median = median(errors.iter().map(|e| e.abs()).collect());
        assert!(median <= MEDIAN_TARGET, "median |error| {median}");
        assert!(errors.iter().all(|&e| e >= -UNDER_TARGET), "{errors:?}");
    }

    /// What the grid does before any GPU runs it: every case plans on one
    /// H100 (NVML: 81559 MiB) with its own settings, so its row measures
    /// what its name says; on a T4 (15360 MiB) the 1.1B full fine-tunes do
    /// not fit and are skipped while the LoRA rows still plan.
    #[test]
    fn the_grid_plans_on_an_h100_and_a_t4_skips_what_does_not_fit() {
        let h100 = gpu("NVIDIA H100 80GB HBM3", 81559);
        for case in grid(true) {
            let a = assignment(&case, 3, &h100)
                .unwrap_or_else(|e| panic!("{} on an H100: {e}", case.name));
            assert_eq!(a.plan.backend, Backend::Cuda);
            assert_eq!(a.plan.settings.precision, Precision::Bf16);
            assert_eq!(a.plan.device, "NVIDIA-H100-80GB-HBM3");
            assert!(
                a.plan.predicted_peak_bytes < h100.memory_bytes,
                "{}",
                case.name
            );
        }
        let t4 = gpu("Tesla T4", 15360);
        let fits = |name: &str| {
            let case = grid(false)
                .into_iter()
                .find(|c| c.name == name)
                .expect("a grid case");
            assignment(&case, 3, &t4).is_ok()
        };
        assert!(fits("T b8"));
        assert!(fits("B qlora4 all7 b8 ckpt"));
        assert!(
            !fits("B b4"),
            "1.1B full fine-tuning in bf16 with AdamW on 15 GiB"
        );
    }
}
