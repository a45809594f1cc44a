//! `calibrate --backend wgpu`: the rows of `make gpu-check` that need no
//! CUDA, on any Vulkan device (a GPU's, or Mesa's lavapipe on the CPU;
//! `make wgpu-check`). burn's wgpu backend runs the same cubecl runtime as
//! CUDA (fusion, autotune, the memory pools, the lean ops' `Cube` code), so
//! these rows check that runtime; what only CUDA has (its allocator, NVML,
//! bf16 kernels, NCCL) stays with `gpu-check` (docs/gpu.md).
//!
//! What it runs: a smoke run (a few f32 training steps of a small Llama
//! with the CUDA profile's runtime settings installed as the worker
//! installs a plan's, the worker's memory probe and cubecl's pools printed),
//! then the ops check (the lean ops against the naive ones, and both against
//! f32 on flex) in f32 and, in a child process (a device's float dtype is
//! set once per process), in f16 where the device offers it. `--quick`:
//! the unit tests' small shapes instead of the GPU ones (lavapipe runs the
//! GPU shapes in minutes). Exit 0 when every row holds, 1 when one does not,
//! 2 when no Vulkan device opens.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::time::Instant;

use burn::tensor::{DType, Device, DeviceKind, FloatDType, Tensor};
use headroom_planner::backend::CUDA;
use headroom_planner::memory::arena_page_bytes;
use headroom_planner::{Backend, Settings, TransformerShape};
use headroom_worker::gpu_runtime::{RuntimeSettings, install};
use headroom_worker::model::lean::check::{Shapes, compare_on};
use headroom_worker::train::{TrainConfig, Trainer};

use super::{MIB, probe};

/// The Vulkan device `HEADROOM_WGPU_DEVICE` names (`cpu`: lavapipe, or
/// `default`: the adapter wgpu prefers, a GPU where there is one); the
/// CUDA profile's runtime settings installed first. `Err` when no adapter
/// opens (burn panics on the first tensor then).
fn open(dtype: Option<FloatDType>) -> Result<Device, String> {
    let kind = match std::env::var("HEADROOM_WGPU_DEVICE").as_deref() {
        Ok("default") => DeviceKind::DefaultDevice,
        Ok("cpu") | Err(_) => DeviceKind::Cpu,
        Ok(other) => return Err(format!("HEADROOM_WGPU_DEVICE={other}: use cpu or default")),
    };
    let settings = RuntimeSettings::for_plan(
        Backend::Cuda,
        Some(super::gpu::gpu_runtime()),
        "wgpu",
        Some(super::gpu::gpu_cache_dir()),
    )
    .expect("the CUDA profile has GPU runtime settings");
    if let Err(e) = install(&settings) {
        eprintln!("wgpu-check: GPU runtime not configured as planned: {e}");
    }
    let mut device = Device::wgpu(kind.clone());
    // The first tensor opens the adapter; without one burn panics.
    let opened = catch_unwind(AssertUnwindSafe(|| {
        Tensor::<1>::ones([4], &device).into_data();
    }));
    if let Err(panic) = opened {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        return Err(format!(
            "no Vulkan device opened ({kind:?}): {message}. Install Mesa's lavapipe (bash worker/wgpu/install-lavapipe.sh) or a GPU's Vulkan driver"
        ));
    }
    if let Some(dtype) = dtype {
        if !device.supports_dtype(DType::from(dtype)) {
            return Err(format!("this Vulkan device offers no {dtype:?}"));
        }
        device
            .configure(dtype)
            .map_err(|e| format!("{dtype:?}: {e:?}"))?;
    }
    Ok(device)
}

/// `--backend wgpu`.
pub fn run(quick: bool) -> i32 {
    let device = match open(None) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("wgpu-check: {e}");
            return 2;
        }
    };
    let mut failed = smoke(&device);
    failed |= ops_check(&device, "f32", 1e-3, quick);
    // f16 in a child: this process's float dtype is f32.
    let exe = std::env::current_exe().expect("this binary");
    let mut child = std::process::Command::new(exe);
    child.args(["--wgpu-ops-check", "f16"]);
    if quick {
        child.arg("--quick");
    }
    match child.status() {
        Ok(s) if s.success() => {}
        Ok(s) if s.code() == Some(2) => eprintln!("wgpu-check: no f16 rows on this device"),
        Ok(s) => {
            eprintln!("wgpu-check: the f16 ops check failed ({s})");
            failed = true;
        }
        Err(e) => {
            eprintln!("wgpu-check: the f16 ops check did not start: {e}");
            failed = true;
        }
    }
    i32::from(failed)
}

/// `--wgpu-ops-check f16 [--quick]` (the child): 2 when the device has no f16.
pub fn ops_check_f16(quick: bool) -> i32 {
    match open(Some(FloatDType::F16)) {
        // f16 keeps 11 bits of mantissa; held to gpu-check's bf16 bound.
        Ok(device) => i32::from(ops_check(&device, "f16", 2e-2, quick)),
        Err(e) => {
            eprintln!("wgpu-check: {e}");
            2
        }
    }
}

/// The lean ops against the naive ones; true when one is worse.
fn ops_check(device: &Device, dtype: &str, tolerance: f32, quick: bool) -> bool {
    let started = Instant::now();
    let shapes = if quick {
        Shapes::small()
    } else {
        Shapes::gpu()
    };
    let rows = compare_on(&device.clone().autodiff(), shapes);
    let opt = |e: Option<f32>| e.map_or("—".to_string(), |e| format!("{e:.1e}"));
    let mut failed = false;
    for r in &rows {
        let ok = r.holds(tolerance);
        failed |= !ok;
        println!(
            "| wgpu {dtype} | {} | {} | {:.1e} | {} | {} | {} |",
            r.case,
            r.quantity,
            r.lean_vs_naive,
            opt(r.lean_vs_reference),
            opt(r.naive_vs_reference),
            if ok { "ok" } else { "WORSE" }
        );
    }
    eprintln!(
        "  (ops check {dtype}: {} comparisons in {:.1} s)",
        rows.len(),
        started.elapsed().as_secs_f64()
    );
    failed
}

/// Five f32 steps of a small Llama (4 layers, hidden 256, GQA, checkpointed)
/// and what the worker's probe and cubecl's pools read; true when a loss is
/// not finite or the probe reads no allocator.
fn smoke(device: &Device) -> bool {
    let shape = TransformerShape {
        layers: 4,
        hidden: 256,
        heads: 8,
        sequence_length: 128,
        vocabulary: 2048,
        feed_forward: None,
        tied_embeddings: false,
    };
    let config = TrainConfig::single_stage(
        shape,
        Settings {
            micro_batch: 4,
            activation_checkpointing: true,
            ..Settings::default()
        },
        5,
        1e-3,
        7,
    );
    let mut trainer = Trainer::new(config, device.clone().autodiff()).expect("trainer");
    let mut losses = Vec::new();
    while !trainer.finished() {
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
    let s = probe(device, true).sample();
    let mib = |b: Option<u64>| b.map_or("—".into(), |b| format!("{:.1} MiB", b as f64 / MIB));
    println!(
        "smoke: allocator {} in use, {} reserved; process RSS {}",
        mib(s.allocator_in_use_bytes),
        mib(s.allocator_reserved_bytes),
        mib(s.process_rss_bytes)
    );
    let mut failed = losses.len() != 5 || losses.iter().any(|l| !l.is_finite());
    if failed {
        eprintln!("wgpu-check: losses {losses:?}: not 5 finite values");
    }
    if s.allocator_reserved_bytes.is_none() {
        eprintln!("wgpu-check: the worker's probe read no allocator bytes");
        failed = true;
    }
    // The pools behind "reserved", beside the memory model's arena page
    // for each pool's largest request (`arena_page_bytes`; the unit test
    // tests/wgpu.rs holds the arena to it).
    for (i, pool) in device
        .memory_pool_report()
        .unwrap_or_default()
        .iter()
        .enumerate()
    {
        println!(
            "smoke: pool {i}: {} of {} held ({} at most), largest allocation {}; the model's arena page {}",
            pool.pages,
            mib(Some(pool.page_size)),
            pool.pages_peak,
            mib(Some(pool.largest_alloc)),
            mib(Some(arena_page_bytes(&CUDA, pool.largest_alloc)))
        );
    }
    failed
}
