//! How long an optimizer step takes: the model the `fastest` objective ranks
//! plans by, and what `kubectl headroom plan` shows beside each alternative.
//!
//! **Compute.** The step's model FLOPs at one device's sustained fp32 rate
//! ([`BackendProfile::fp32_flops_per_second`]), times the factors that make
//! one plan slower than another on the same devices, divided over the p · d
//! devices ([`relative_compute`]). FLOPs per token: 6 per trained parameter
//! (forward 2, backward 4: the gradients of input and weight); a frozen
//! LoRA base 4 (forward, and backward for its input gradient only).
//!
//! **All-reduce.** The d replicas of a stage average their gradients each
//! step. Ring reduce-scatter + all-gather moves 2 (d − 1) / d of the
//! stage's gradient bytes over every link (the bandwidth-optimal all-reduce
//! NCCL and the worker's TCP ring both run), at the backend's bus bandwidth
//! ([`BackendProfile::collective_bytes_per_second`]), plus one latency per
//! message: 2 (d − 1) per bucket of
//! [`BackendProfile::collective_bucket_bytes`].
//! ZeRO-1 adds nothing: its reduce-scatter of gradients and all-gather of
//! updated weights move the same bytes. Stages reduce at the same time, so
//! the stage with the most trained bytes counts. The worker reduces after a
//! step's last micro-batch rather than overlapping it with backward, so the
//! two times add.
//!
//! **Stage transfers.** A pipeline's stages pass each micro-batch's
//! activations forward and their gradients back: b · s · h f32 values each
//! way over each link ([`BackendProfile::stage_link_bytes_per_second`]). In
//! a 1F1B schedule of m micro-batches over p stages the step has m + p − 1
//! slots, and the worker sends in the slot it computes rather than beside
//! it, so each slot pays one transfer each way ([`stage_transfer_seconds`]).
//! Without this term a deeper pipeline looked free and `fastest` chose the
//! most stages there were devices for.
//!
//! **Host copies.** Offloaded gradients (`Settings::offload_gradients`)
//! cross PCIe every micro-batch: each trained value's gradient goes to the
//! host at the training precision, and once a step the updated weights come
//! back at the training precision ([`host_copy_seconds`], at
//! [`BackendProfile::host_link_bytes_per_second`]). The worker copies a
//! block's gradients once its backward is done and waits for them, so the
//! time adds to the compute; stages and replicas copy at the same time, so
//! the stage with the most trained values counts.
//!
//! Constants are orders of magnitude until calibrated (the flex figures
//! from this machine, the CUDA ones from published rates); only the ratio
//! of compute to link speed decides between plans.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::adapters::LoraConfig;
use crate::backend::BackendProfile;
use crate::inventory::DeviceKind;
use crate::model::ModelShape;
use crate::training::{Precision, Settings};

/// The estimated time of one optimizer step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StepTime {
    /// Forward, backward and update on each device, seconds.
    pub compute_seconds: f64,
    /// The gradient all-reduce between data-parallel replicas, seconds (0 for one replica).
    pub all_reduce_seconds: f64,
    /// Activations and their gradients between pipeline stages, seconds (0 for one stage).
    #[serde(default)]
    pub transfer_seconds: f64,
    /// Offloaded gradients to the host and the updated weights back over
    /// PCIe, seconds (0 when the gradients stay on the device).
    #[serde(default)]
    pub host_copy_seconds: f64,
    /// Their sum: the estimated time per optimizer step, seconds.
    pub seconds: f64,
}

/// Unitless compute time: 1 is one device running the whole global batch at
/// once, in fp32, without checkpointing. Recompute costs about a third more
/// compute; 16-bit math runs about twice as fast on GPUs; a 1F1B pipeline
/// idles for (p − 1)/m of a step; tiny micro-batches use a device poorly; a
/// quantized base is dequantized on every forward (a fifth more,
/// unmeasured); an offloaded optimizer moves gradients and weights over
/// PCIe and steps on the CPU once per step (half a step more at
/// accumulation 1, amortised over the micro-batches; unmeasured), and
/// offloaded checkpoints cross it twice per block and micro-batch (a tenth
/// more; unmeasured), an offloaded embedding once (a hundredth); offloaded
/// gradients' copies are timed on their own ([`host_copy_seconds`]), their
/// step is the optimizer offload's. The work is divided over p stages × d
/// replicas.
pub fn relative_compute(settings: &Settings, stages: u32, replicas: u32, kind: DeviceKind) -> f64 {
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
    let bubble = 1.0 + (f64::from(stages) - 1.0) / m;
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
    // Each checkpointed block input to the host and back, synchronously,
    // every micro-batch: a tenth more (unmeasured).
    let offload = if settings.offload_activations && settings.activation_checkpointing {
        offload * 1.1
    } else {
        offload
    };
    // A host-side gather and one upload of the first block's input per
    // micro-batch: a hundredth more (unmeasured).
    let offload = if settings.offload_embedding {
        offload * 1.01
    } else {
        offload
    };
    let devices = f64::from(stages.max(1)) * f64::from(replicas.max(1));
    recompute * math * bubble * small_batch * dequantize * offload / devices
}

/// Model FLOPs of one optimizer step over `global_batch` samples.
pub fn step_flops(model: &ModelShape, adapters: Option<&LoraConfig>, global_batch: u64) -> f64 {
    let (tokens_per_sample, params) = match model {
        ModelShape::Transformer(t) => (u64::from(t.sequence_length), t.total_params()),
        ModelShape::Llama(l) => (u64::from(l.sequence_length), l.total_params()),
        // An opaque model: a sample is its unit of work.
        ModelShape::Generic(g) => (1, g.parameters),
    };
    let per_token = match (model, adapters) {
        (ModelShape::Llama(l), Some(a)) => 4.0 * params as f64 + 6.0 * a.trainable_params(l) as f64,
        _ => 6.0 * params as f64,
    };
    per_token * (tokens_per_sample * global_batch) as f64
}

/// One ring all-reduce of `elements` values of `element_bytes` each over
/// `replicas`, seconds (0 for one replica).
pub fn all_reduce_seconds(
    elements: u64,
    element_bytes: u64,
    replicas: u32,
    profile: &BackendProfile,
) -> f64 {
    if replicas <= 1 {
        return 0.0;
    }
    let d = f64::from(replicas);
    let bytes = (elements * element_bytes) as f64;
    let buckets = (elements * 4)
        .div_ceil(profile.collective_bucket_bytes.max(1))
        .max(1) as f64;
    2.0 * (d - 1.0) / d * bytes / profile.collective_bytes_per_second
        + 2.0 * (d - 1.0) * buckets * profile.collective_latency_seconds
}

/// The stage-to-stage transfers of one step, seconds (0 for one stage):
/// m + p − 1 slots, each moving one micro-batch's b · s · h f32 values
/// forward and as many back. An opaque model has no known activation width.
pub fn stage_transfer_seconds(
    model: &ModelShape,
    settings: &Settings,
    stages: u32,
    profile: &BackendProfile,
) -> f64 {
    if stages <= 1 {
        return 0.0;
    }
    let width = match model {
        ModelShape::Transformer(t) => u64::from(t.sequence_length) * u64::from(t.hidden),
        ModelShape::Llama(l) => u64::from(l.sequence_length) * u64::from(l.hidden),
        ModelShape::Generic(_) => 0,
    };
    let bytes = (u64::from(settings.micro_batch) * width * 4) as f64;
    let slots = f64::from(settings.gradient_accumulation.max(1) + stages - 1);
    slots * 2.0 * bytes / profile.stage_link_bytes_per_second
}

/// The PCIe copies of offloaded gradients in one step, seconds (0 when the
/// gradients stay on the device): a stage's `trained_elements` gradients
/// down once per micro-batch and its weights up once per step, both at the
/// training precision.
pub fn host_copy_seconds(
    settings: &Settings,
    trained_elements: u64,
    profile: &BackendProfile,
) -> f64 {
    if !crate::memory::offloads_gradients(settings, profile) {
        return 0.0;
    }
    let m = u64::from(settings.gradient_accumulation.max(1));
    let down = trained_elements * settings.precision.gradient_bytes() * m;
    let up = trained_elements * settings.precision.weight_bytes();
    (down + up) as f64 / profile.host_link_bytes_per_second
}

/// The step time of a plan: `settings` on `stages` × `replicas` devices of
/// `kind`, whose largest stage trains `stage_trained_elements` values.
pub fn estimate(
    model: &ModelShape,
    adapters: Option<&LoraConfig>,
    settings: &Settings,
    (stages, replicas): (u32, u32),
    kind: DeviceKind,
    profile: &BackendProfile,
    stage_trained_elements: u64,
) -> StepTime {
    let global_batch = settings.global_batch() * u64::from(replicas.max(1));
    let one_device = step_flops(model, adapters, global_batch) / profile.fp32_flops_per_second;
    let compute_seconds = relative_compute(settings, stages, replicas, kind) * one_device;
    let all_reduce_seconds = all_reduce_seconds(
        stage_trained_elements,
        settings.precision.gradient_bytes(),
        replicas,
        profile,
    );
    let transfer_seconds = stage_transfer_seconds(model, settings, stages, profile);
    let host_copy_seconds = host_copy_seconds(settings, stage_trained_elements, profile);
    StepTime {
        compute_seconds,
        all_reduce_seconds,
        transfer_seconds,
        host_copy_seconds,
        seconds: compute_seconds + all_reduce_seconds + transfer_seconds + host_copy_seconds,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{CUDA, FLEX};

    fn settings(b: u32, m: u32) -> Settings {
        Settings {
            micro_batch: b,
            gradient_accumulation: m,
            precision: Precision::Bf16,
            ..Settings::default()
        }
    }

    #[test]
    fn the_ring_moves_two_d_minus_one_over_d_of_the_bytes() {
        let bytes = 1_000_000_000u64;
        let no_latency = BackendProfile {
            collective_latency_seconds: 0.0,
            ..FLEX
        };
        assert_eq!(all_reduce_seconds(bytes / 4, 4, 1, &no_latency), 0.0);
        let two = all_reduce_seconds(bytes / 4, 4, 2, &no_latency);
        let eight = all_reduce_seconds(bytes / 4, 4, 8, &no_latency);
        assert!((two - 1.0).abs() < 1e-9, "{two}"); // 2·1/2 · 1 GB at 1 GB/s
        assert!((eight - 1.75).abs() < 1e-9, "{eight}");
    }

    #[test]
    fn replicas_divide_compute_and_pay_the_all_reduce() {
        // A 6.6B-parameter GPT, 32 samples of 2048 tokens: 6·P·T ≈ 2.6 PFLOP.
        let shape = crate::model::TransformerShape {
            layers: 32,
            hidden: 4096,
            heads: 32,
            sequence_length: 2048,
            vocabulary: 32000,
            feed_forward: None,
            tied_embeddings: true,
        };
        let params = shape.total_params();
        let model = ModelShape::Transformer(shape);
        let one = estimate(
            &model,
            None,
            &settings(4, 8),
            (1, 1),
            DeviceKind::Gpu,
            &CUDA,
            params,
        );
        let eight = estimate(
            &model,
            None,
            &settings(4, 1),
            (1, 8),
            DeviceKind::Gpu,
            &CUDA,
            params,
        );
        assert_eq!(one.all_reduce_seconds, 0.0);
        // bf16 gradients: 2·7/8 of 2·P bytes at the profile's bus
        // bandwidth, plus latencies.
        let ring = 2.0 * 7.0 / 8.0 * (2 * params) as f64 / CUDA.collective_bytes_per_second;
        assert!(
            (eight.all_reduce_seconds / ring - 1.0).abs() < 0.05,
            "{eight:?} vs {ring}"
        );
        // Compute divides by 8 (the micro-batch is the same), the ring adds.
        assert!((eight.compute_seconds * 8.0 / one.compute_seconds - 1.0).abs() < 1e-9);
        assert!(
            (eight.seconds - eight.compute_seconds - eight.all_reduce_seconds).abs() < 1e-9
                && eight.transfer_seconds == 0.0
                && eight.seconds < one.seconds,
            "{one:?} vs {eight:?}"
        );
    }

    /// Offloaded gradients: 1 B values' bf16 gradients down each of 4
    /// micro-batches and their bf16 weights up once, at the profile's PCIe
    /// rate, added to the step; nothing where they stay on the device or
    /// the device is the host.
    #[test]
    fn offloaded_gradients_pay_their_pcie_copies() {
        let off = Settings {
            activation_checkpointing: true,
            offload_optimizer: true,
            offload_gradients: true,
            ..settings(1, 4)
        };
        let values = 1_000_000_000u64;
        let expected = (values * 2 * 4 + values * 2) as f64 / CUDA.host_link_bytes_per_second;
        assert!((host_copy_seconds(&off, values, &CUDA) - expected).abs() < 1e-9);
        let kept = Settings {
            offload_gradients: false,
            ..off
        };
        assert_eq!(host_copy_seconds(&kept, values, &CUDA), 0.0);
        assert_eq!(host_copy_seconds(&off, values, &FLEX), 0.0);
        let model = ModelShape::Generic(crate::model::GenericModel {
            parameters: values,
            activation_bytes_per_sample: 0,
        });
        let t = estimate(&model, None, &off, (1, 1), DeviceKind::Gpu, &CUDA, values);
        assert!((t.host_copy_seconds - expected).abs() < 1e-9);
        assert!((t.seconds - t.compute_seconds - t.host_copy_seconds).abs() < 1e-9);
    }

    #[test]
    fn stages_pay_a_transfer_each_way_per_slot() {
        let shape = crate::model::TransformerShape {
            layers: 8,
            hidden: 1024,
            heads: 8,
            sequence_length: 512,
            vocabulary: 1000,
            feed_forward: None,
            tied_embeddings: true,
        };
        let model = ModelShape::Transformer(shape);
        let s = settings(2, 4);
        assert_eq!(stage_transfer_seconds(&model, &s, 1, &FLEX), 0.0);
        // 4 + 2 − 1 slots, 2 · 512 · 1024 f32 values each way per slot.
        let bytes = 2.0 * 512.0 * 1024.0 * 4.0;
        let three = stage_transfer_seconds(&model, &s, 3, &FLEX);
        assert!((three - 6.0 * 2.0 * bytes / FLEX.stage_link_bytes_per_second).abs() < 1e-12);
        let t = estimate(&model, None, &s, (3, 1), DeviceKind::Cpu, &FLEX, 1000);
        assert_eq!(t.transfer_seconds, three);
        assert!((t.seconds - t.compute_seconds - t.transfer_seconds).abs() < 1e-12);
    }

    #[test]
    fn a_pipeline_pays_its_bubble() {
        let s = settings(1, 4);
        let p1 = relative_compute(&s, 1, 1, DeviceKind::Cpu);
        let p2 = relative_compute(&s, 2, 1, DeviceKind::Cpu);
        let d2 = relative_compute(&s, 1, 2, DeviceKind::Cpu);
        assert!((p2 / p1 - 1.25 / 2.0).abs() < 1e-12);
        assert!((d2 / p1 - 0.5).abs() < 1e-12);
    }
}
