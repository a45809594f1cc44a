//! The lean ops against the naive ones in f16 on the Vulkan device (its own
//! binary: a device's default float dtype is set once per process), where
//! the device offers f16 (Vulkan's `shaderFloat16`; lavapipe does). bf16,
//! the dtype CUDA runs train in, has no wgpu kernels: f16 is the half
//! precision this path can check (docs/gpu.md).
#![cfg(feature = "wgpu")]

use burn::tensor::{DType, Device, DeviceKind, FloatDType};
use headroom_planner::backend::{AutotuneLevel, CUDA};
use headroom_planner::{Backend, GpuRuntime};
use headroom_worker::gpu_runtime::{RuntimeSettings, install};
use headroom_worker::model::lean::check::{Shapes, compare_on};

#[test]
fn lean_ops_match_the_naive_ones_in_f16() {
    // As tests/wgpu.rs: the CUDA profile's runtime, autotune at its minimal
    // level (at the profile's level this binary was still tuning after 8 min).
    let runtime = GpuRuntime {
        autotune: AutotuneLevel::Minimal,
        ..CUDA
            .gpu_runtime
            .expect("the CUDA profile has GPU runtime settings")
    };
    let cache = std::env::temp_dir().join("headroom-wgpu-test-runtime");
    let settings = RuntimeSettings::for_plan(Backend::Cuda, Some(runtime), "lavapipe", Some(cache))
        .expect("a CUDA plan's settings");
    install(&settings).expect("cubecl's configuration, set before the device opens");
    let mut device = Device::wgpu(DeviceKind::Cpu);
    if !device.supports_dtype(DType::F16) {
        // Not a failure: the f32 rows (tests/wgpu.rs) still ran.
        println!("this Vulkan device offers no f16: the f16 rows are skipped");
        return;
    }
    device
        .configure(FloatDType::F16)
        .expect("f16 set before any tensor of this process");
    let rows = compare_on(&device.autodiff(), Shapes::small());
    let mut worse = Vec::new();
    for r in &rows {
        println!(
            "{} {}: lean vs naive {:.1e}, lean vs flex f32 {:?}, naive vs flex f32 {:?}",
            r.case, r.quantity, r.lean_vs_naive, r.lean_vs_reference, r.naive_vs_reference
        );
        // f16 keeps 11 bits of mantissa (rounding 4.9e-4); the tolerance is
        // `calibrate --gpu-ops-check bf16`'s, for a dtype 8× finer.
        if !r.holds(2e-2) {
            worse.push(format!("{} {}", r.case, r.quantity));
        }
    }
    assert!(rows.len() >= 16, "{} comparisons", rows.len());
    assert!(
        worse.is_empty(),
        "less accurate than the naive op in f16: {worse:?}"
    );
}
