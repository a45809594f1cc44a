//! The GPU code path without a GPU: burn's wgpu backend on a Vulkan device
//! (in CI, Mesa's lavapipe, which runs the kernels on the CPU), against the
//! flex backend. wgpu runs the same cubecl runtime as CUDA: kernel fusion,
//! autotune, the memory pools and the lean ops' `Cube` implementations are
//! the CUDA build's; what only CUDA has (its allocator, NVML, bf16 kernels,
//! NCCL) is not here (docs/gpu.md, "The GPU path on lavapipe").
//!
//! `make worker-wgpu-test` installs lavapipe and runs this binary (built
//! with `--features wgpu` in its own target directory). Without the
//! feature it is empty.
#![cfg(feature = "wgpu")]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::tensor::{Device, DeviceKind, Tensor, TensorData};
use headroom_planner::backend::{AutotuneLevel, CUDA};
use headroom_planner::memory::arena_page_bytes;
use headroom_planner::{
    Backend, BaseFormat, GpuRuntime, LoraConfig, Optimizer, Settings, TargetModule,
};
use headroom_worker::gpu_runtime::{RuntimeSettings, install};
use headroom_worker::memory_probe::MemoryProbe;
use headroom_worker::model::TransformerLm;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::lean::check::{Shapes, compare_on};
use headroom_worker::train::{TrainConfig, Trainer};

const SEQUENCE: u32 = 12;
const STEPS: u64 = 4;

/// The Vulkan device, opened once per process after the CUDA profile's
/// runtime settings (allocator, persistent memory; autotune at its minimal
/// level) were installed as the worker installs a plan's: the same code,
/// so the same pools and the same tuning. `DeviceKind::Cpu`: lavapipe, even on a machine
/// that also has a GPU, so every machine runs the same rows.
fn vulkan() -> Device {
    static DEVICE: OnceLock<Device> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            // Empty at the start of each process, so that what the runtime
            // cache test finds there was written by this one.
            let _ = std::fs::remove_dir_all(runtime_cache_dir().parent().expect("a parent"));
            let cache = runtime_cache_dir();
            // Autotune at its minimal level: lavapipe compiles each candidate
            // kernel with LLVM on the CPU, and at the profile's level the
            // matmul candidates alone took over 8 minutes of the first test
            // (debug build, 2 cores) without finishing it.
            let runtime = GpuRuntime {
                autotune: AutotuneLevel::Minimal,
                ..CUDA
                    .gpu_runtime
                    .expect("the CUDA profile has GPU runtime settings")
            };
            let settings =
                RuntimeSettings::for_plan(Backend::Cuda, Some(runtime), "lavapipe", Some(cache))
                    .expect("a CUDA plan's settings");
            install(&settings).expect("cubecl's configuration, set before the device opens");
            Device::wgpu(DeviceKind::Cpu)
        })
        .clone()
}

/// This process's cubecl environment directory, as a worker's is on the
/// job's checkpoint claim.
fn runtime_cache_dir() -> PathBuf {
    std::env::temp_dir()
        .join("headroom-wgpu-test-runtime")
        .join(std::process::id().to_string())
}

/// Bytes in the files under `dir`, recursively.
fn bytes_under(dir: &Path) -> u64 {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .map(|e| match e.metadata() {
                Ok(m) if m.is_dir() => bytes_under(&e.path()),
                Ok(m) => m.len(),
                Err(_) => 0,
            })
            .sum()
    })
}

fn base(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama")
        .join(variant)
}

/// The lean ops (blocked attention with soft-capping, windows and packed
/// documents; the chunked loss; the NF4 LoRA linear) against the naive ones
/// on the Vulkan device, values and gradients in f32, and both against the
/// naive ops in f32 on flex. Tolerance as `calibrate --backend cuda
/// --gpu-ops-check fp32` holds an H200 to.
#[test]
fn lean_ops_match_the_naive_ones_in_f32() {
    let started = Instant::now();
    let rows = compare_on(&vulkan().autodiff(), Shapes::small());
    let mut worse = Vec::new();
    for r in &rows {
        println!(
            "{} {}: lean vs naive {:.1e}, lean vs flex {:?}, naive vs flex {:?}",
            r.case, r.quantity, r.lean_vs_naive, r.lean_vs_reference, r.naive_vs_reference
        );
        if !r.holds(1e-3) {
            worse.push(format!("{} {}", r.case, r.quantity));
        }
    }
    println!(
        "{} comparisons in {:.1} s",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(rows.len() >= 16, "{} comparisons", rows.len());
    assert!(
        worse.is_empty(),
        "less accurate than the naive op: {worse:?}"
    );
}

fn lora(format: BaseFormat) -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: TargetModule::ALL.to_vec(),
        block_size: if format == BaseFormat::Nf4 { 64 } else { 8 },
    }
}

/// One row of the training comparison: a job's settings on a tiny
/// Llama-family checkpoint (2 layers, hidden 32, untied embedding).
#[derive(Clone, Copy, Debug)]
struct Row {
    name: &'static str,
    adapters: Option<BaseFormat>,
    checkpointing: bool,
    offload_activations: bool,
    offload_embedding: bool,
}

const ROWS: [Row; 5] = [
    Row {
        name: "full fine-tune",
        adapters: None,
        checkpointing: false,
        offload_activations: false,
        offload_embedding: false,
    },
    Row {
        name: "LoRA",
        adapters: Some(BaseFormat::Dense),
        checkpointing: false,
        offload_activations: false,
        offload_embedding: false,
    },
    Row {
        name: "QLoRA (nf4), checkpointing",
        adapters: Some(BaseFormat::Nf4),
        checkpointing: true,
        offload_activations: false,
        offload_embedding: false,
    },
    Row {
        name: "QLoRA (nf4), offloaded checkpoints",
        adapters: Some(BaseFormat::Nf4),
        checkpointing: true,
        offload_activations: true,
        offload_embedding: false,
    },
    Row {
        name: "LoRA, embedding in host memory",
        adapters: Some(BaseFormat::Dense),
        checkpointing: false,
        offload_activations: false,
        offload_embedding: true,
    },
];

fn trainer(row: Row, optimizer: Optimizer, device: Device) -> Trainer {
    let model = base("llama-mha-untied");
    let checkpoint = HfCheckpoint::open(&model, SEQUENCE).expect("fixture");
    let mut config = TrainConfig::single_stage(
        checkpoint.shape,
        Settings {
            micro_batch: 2,
            gradient_accumulation: 2,
            optimizer,
            activation_checkpointing: row.checkpointing,
            offload_activations: row.offload_activations,
            offload_embedding: row.offload_embedding,
            base_format: row.adapters.unwrap_or(BaseFormat::Dense),
            ..Settings::default()
        },
        STEPS,
        1e-2,
        3,
    )
    .with_pretrained(model);
    if let Some(format) = row.adapters {
        config = config.with_adapters(lora(format));
    }
    Trainer::new(config, device).expect("trainer")
}

fn losses(trainer: &mut Trainer) -> Vec<f64> {
    let mut losses = Vec::new();
    while !trainer.finished() {
        losses.extend(trainer.train_step().expect("step").loss);
    }
    assert_eq!(losses.len() as u64, STEPS);
    losses
}

/// Each step's |a − b| / |b|.
fn relative(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs() / y.abs())
        .collect()
}

fn sci(v: &[f64]) -> String {
    let v: Vec<String> = v.iter().map(|x| format!("{x:.1e}")).collect();
    format!("[{}]", v.join(", "))
}

/// The trained parameters' values of `from` (the LoRA factors) put into
/// `into`, by parameter id (the same in both: [`Trainer`] gives stable
/// ids). burn draws the adapters' `A` on the device they live on, from the
/// run's seed, and the wgpu backend's generator is not flex's: the same
/// seed gives other factors there, and since `B` starts at zero only the
/// first step's loss agrees (on lavapipe, LoRA's losses were up to 1.3e-2
/// off flex's under AdamW and 4.4e-3 under SGD; with flex's factors, 0 and
/// 1.2e-7).
fn with_trained_of(from: &TransformerLm, into: TransformerLm) -> TransformerLm {
    struct Collect(HashMap<ParamId, TensorData>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let value = param.base();
            if value.is_require_grad() {
                self.0.insert(param.id, value.into_data());
            }
        }
    }
    struct Replace(HashMap<ParamId, TensorData>);
    impl ModuleMapper for Replace {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            match self.0.remove(&param.id) {
                Some(data) => param.map(|t| {
                    let trained = t.is_require_grad();
                    Tensor::from_data(data, &t.device()).set_require_grad(trained)
                }),
                None => param,
            }
        }
    }
    let mut collect = Collect(HashMap::new());
    from.visit(&mut collect);
    assert!(!collect.0.is_empty(), "no trained parameters");
    let mut replace = Replace(collect.0);
    let into = into.map(&mut replace);
    assert!(
        replace.0.is_empty(),
        "{} trained parameters not found on the device",
        replace.0.len()
    );
    into
}

/// A few optimizer steps of `row` on the Vulkan device and on flex, from
/// the same checkpoint, adapters and data: the same losses up to f32
/// rounding in another order (fused kernels, other matmul tilings). The
/// step-4 loss depends on three updates, so a wrong gradient anywhere
/// shows.
fn matches_flex(row: Row, optimizer: Optimizer) {
    let started = Instant::now();
    let mut on_flex = trainer(row, optimizer, Device::flex().autodiff());
    let mut on_vulkan = trainer(row, optimizer, vulkan().autodiff());
    if row.adapters.is_some() {
        let model = on_vulkan.take_model();
        on_vulkan.set_model(with_trained_of(on_flex.model(), model));
    }
    if row.offload_embedding {
        assert!(on_vulkan.model().host_token.is_some(), "{row:?}");
    }
    let vulkan_losses = losses(&mut on_vulkan);
    let vulkan_s = started.elapsed().as_secs_f64();
    let flex_losses = losses(&mut on_flex);
    let err = relative(&vulkan_losses, &flex_losses);
    println!(
        "{} ({:?}): vulkan {vulkan_losses:?} ({vulkan_s:.1} s), flex {flex_losses:?}, relative {}",
        row.name,
        optimizer,
        sci(&err)
    );
    assert!(
        vulkan_losses.iter().all(|l| l.is_finite()),
        "{}: {vulkan_losses:?}",
        row.name
    );
    let worst = err.iter().copied().fold(0.0, f64::max);
    assert!(
        worst < 1e-4,
        "{}: vulkan {vulkan_losses:?} vs flex {flex_losses:?} ({worst:e})",
        row.name
    );
    assert!(
        flex_losses[0] - flex_losses[STEPS as usize - 1] > 0.0,
        "{}: it trains: {flex_losses:?}",
        row.name
    );
}

#[test]
fn training_full_fine_tune_matches_flex() {
    matches_flex(ROWS[0], Optimizer::Adamw);
}

#[test]
fn training_lora_matches_flex() {
    matches_flex(ROWS[1], Optimizer::Adamw);
}

/// LoRA stepped by SGD: an update proportional to the gradient, so the
/// device's gradients must match flex's to rounding at every step.
#[test]
fn training_lora_sgd_matches_flex() {
    matches_flex(ROWS[1], Optimizer::Sgd);
}

#[test]
fn training_qlora_checkpointing_matches_flex() {
    matches_flex(ROWS[2], Optimizer::Adamw);
}

#[test]
fn training_qlora_offloaded_checkpoints_matches_flex() {
    matches_flex(ROWS[3], Optimizer::Adamw);
}

#[test]
fn training_lora_host_embedding_matches_flex() {
    matches_flex(ROWS[4], Optimizer::Adamw);
}

/// What a worker's first steps compile and tune outlives the process:
/// cubecl writes it to the environment directory the worker gives it (on
/// the job's checkpoint claim), so a retry on the same card starts warm.
/// Without burn's `persistence` the directory stays empty.
#[test]
fn the_runtime_cache_is_written_where_the_worker_puts_it() {
    let mut on_vulkan = trainer(ROWS[0], Optimizer::Adamw, vulkan().autodiff());
    losses(&mut on_vulkan);
    let dir = runtime_cache_dir();
    let bytes = bytes_under(&dir);
    println!(
        "cubecl's environment after a full fine-tune: {bytes} bytes in {}",
        dir.display()
    );
    assert!(bytes > 0, "nothing written under {}", dir.display());
}

/// What the memory model counts of cubecl's pools, against what the
/// runtime reports on the Vulkan device: a request above the sliced pools'
/// sizes is carved out of the arena, whose page is the largest request so
/// far plus a granule, rounded ([`arena_page_bytes`] with the CUDA
/// profile's granule); the arena keeps its pages after the tensors are
/// dropped (reserved stays, in use falls); and the worker's memory probe
/// reads the same in-use and reserved bytes the runtime reports.
#[test]
fn the_arena_and_the_probe_match_the_memory_model() {
    let device = vulkan();
    // Warm the device (its first allocations) before the readings.
    let _ = Tensor::<1>::ones([16], &device).into_data();
    let before = device
        .memory_pool_usage()
        .expect("cubecl reports its pools");
    // 3 MiB and 5 MiB f32 tensors, the second larger than the first page;
    // uploaded, so they are buffers whatever fusion would make of them.
    let upload = |n: usize| Tensor::<1>::from_data(TensorData::new(vec![1.0f32; n], [n]), &device);
    let small = upload(3 << 18);
    let large = upload(5 << 18);
    let sum = small.clone().sum().into_scalar::<f32>() + large.clone().sum().into_scalar::<f32>();
    assert_eq!(sum, (8 << 18) as f32);
    let reports = device.memory_pool_report().expect("cubecl's pool report");
    for (i, p) in reports.iter().enumerate() {
        println!(
            "pool {i}: {} pages of {} B ({} at most), largest allocation {} B",
            p.pages, p.page_size, p.pages_peak, p.largest_alloc
        );
    }
    let largest = 5u64 << 20;
    let arena = reports
        .iter()
        .find(|p| p.largest_alloc >= largest)
        .expect("a pool served the 5 MiB tensor");
    assert!(
        arena.page_size <= arena_page_bytes(&CUDA, arena.largest_alloc),
        "arena page {} B above the model's {} B for a largest request of {} B",
        arena.page_size,
        arena_page_bytes(&CUDA, arena.largest_alloc),
        arena.largest_alloc
    );
    assert!(arena.page_size >= arena.largest_alloc, "{arena:?}");

    let mut probe = MemoryProbe::for_this_process(Some(device.clone()));
    let sample = probe.sample();
    let usage = device.memory_pool_usage().expect("usage");
    println!("probe {sample:?}; runtime {usage:?}; before {before:?}");
    assert_eq!(sample.allocator_in_use_bytes, Some(usage.bytes_in_use));
    assert_eq!(sample.allocator_reserved_bytes, Some(usage.bytes_reserved));
    // The two tensors are in use. Not measured against `before`: tensors an
    // earlier test of this process dropped can be freed between the two
    // readings (seen after the lean-ops check: 8 MiB + 128 B in use after
    // the uploads, more than 128 B before them), so the growth is checked
    // below, by the drop.
    assert!(usage.bytes_in_use >= 8 << 20, "{usage:?}");
    assert!(usage.bytes_reserved >= usage.bytes_in_use, "{usage:?}");

    drop((small, large));
    let after = device.memory_pool_usage().expect("usage");
    println!("after drop {after:?}");
    assert!(
        after.bytes_in_use + (8 << 20) <= usage.bytes_in_use,
        "{after:?}"
    );
    assert_eq!(
        after.bytes_reserved, usage.bytes_reserved,
        "pages are kept until a cleanup"
    );
}
