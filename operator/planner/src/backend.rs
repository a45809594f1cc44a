//! The worker backends a plan can run on, and what each one costs and
//! supports: the facts the memory model, the search and the retry rungs read.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::training::{Optimizer, Precision};
use crate::units::MIB;

/// The worker backend a plan runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub enum Backend {
    /// burn's CPU backend.
    Flex,
    /// burn's CUDA backend (NVIDIA GPUs).
    Cuda,
}

/// What a backend costs beyond tensors, and what it supports. Constants are
/// starting points; the worker calibration bench refines them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct BackendProfile {
    pub backend: Backend,
    /// Process/context baseline in bytes (binary, thread stacks; CUDA context and kernels).
    pub fixed_overhead_bytes: u64,
    /// Allocator slack and fragmentation as a fraction of tensor bytes.
    pub allocator_slack: f64,
    /// Fraction of nominal device memory that is actually allocatable.
    pub usable_fraction: f64,
    /// Dropout mask bytes per element (0: the Headroom worker trains without dropout).
    pub dropout_mask_bytes: u64,
    /// Copies of the fp32 logits alive at the loss (logits and their gradient).
    pub logit_copies: u64,
    /// Precisions the worker trains in on this backend; a plan never leaves them.
    pub precisions: &'static [Precision],
    /// Optimizers the worker implements on this backend; a plan never leaves them.
    pub optimizers: &'static [Optimizer],
}

impl Backend {
    pub fn profile(self) -> &'static BackendProfile {
        match self {
            Backend::Flex => &FLEX,
            Backend::Cuda => &CUDA,
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Backend::Flex => "flex",
            Backend::Cuda => "cuda",
        })
    }
}

/// burn `flex` on CPU: the container's memory limit is the device.
///
/// Calibrated against measured worker peaks (VmHWM of the `headroom-worker`
/// process, 16 configurations; `docs/benchmarks.md`): the process baseline
/// is about 20 MiB, and the slack of 32 % covers the glibc allocator plus the
/// intermediates burn's autodiff keeps beyond the Korthikanti count (the
/// attention mask and score copies, the transient gradient of each op).
pub const FLEX: BackendProfile = BackendProfile {
    backend: Backend::Flex,
    fixed_overhead_bytes: 20 * MIB,
    allocator_slack: 0.32,
    usable_fraction: 1.0,
    dropout_mask_bytes: 0,
    logit_copies: 2,
    precisions: &[Precision::Fp32],
    optimizers: &[
        Optimizer::Adamw,
        Optimizer::Adam,
        Optimizer::SgdMomentum,
        Optimizer::Sgd,
    ],
};

/// burn CUDA: context and kernels cost most of a GiB; drivers keep ~1 % back
/// (an "80 GB" card offers about 79.2 GiB).
pub const CUDA: BackendProfile = BackendProfile {
    backend: Backend::Cuda,
    fixed_overhead_bytes: 900 * MIB,
    allocator_slack: 0.08,
    usable_fraction: 0.99,
    dropout_mask_bytes: 0,
    logit_copies: 2,
    precisions: &[Precision::Fp32, Precision::Bf16, Precision::Fp16],
    optimizers: &[
        Optimizer::Adamw,
        Optimizer::Adam,
        Optimizer::SgdMomentum,
        Optimizer::Sgd,
    ],
};
