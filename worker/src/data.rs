//! The synthetic next-token task the worker trains on.
//!
//! Each sample is an arithmetic progression modulo the vocabulary: a random
//! start and a stride drawn from {1, 2, 3}. Predicting the next token needs
//! the stride, which only attention to the previous token reveals, so the
//! loss falls in two stages: from ln(v) to about ln(3) once the model learns
//! "next = current + small stride", then towards 0 once attention reads the
//! stride. A tiny model gets through the first stage within a few dozen steps.
//!
//! Sample `i` of the run depends only on `(seed, i)`, and optimizer step `k`
//! uses samples `k·G .. (k+1)·G` (G the global batch). The data a step sees
//! is therefore the same whatever the micro-batch and accumulation, which is
//! what lets a resumed attempt with other settings continue the same run.

use burn::tensor::{Device, Int, Tensor, TensorData};

/// Largest stride of the progression.
pub const MAX_STRIDE: u64 = 3;

/// SplitMix64: a small, well-mixed, dependency-free generator.
pub fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// Deterministic samples of the progression task.
#[derive(Clone, Copy, Debug)]
pub struct ProgressionTask {
    pub seed: u64,
    pub vocabulary: u32,
    pub sequence_length: u32,
}

impl ProgressionTask {
    /// Sample `index`: `sequence_length + 1` tokens (inputs, then shifted targets).
    pub fn sample(&self, index: u64) -> Vec<i64> {
        let v = u64::from(self.vocabulary);
        let r = splitmix(self.seed ^ splitmix(index));
        let start = r % v;
        let stride = 1 + (r >> 32) % MAX_STRIDE;
        (0..=u64::from(self.sequence_length))
            .map(|t| ((start + t * stride) % v) as i64)
            .collect()
    }

    /// Inputs and targets ([samples, seq] each) for samples `first .. first + count`.
    pub fn batch(
        &self,
        first: u64,
        count: u32,
        device: &Device,
    ) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let s = self.sequence_length as usize;
        let n = count as usize;
        let mut inputs = Vec::with_capacity(n * s);
        let mut targets = Vec::with_capacity(n * s);
        for i in 0..u64::from(count) {
            let sample = self.sample(first + i);
            inputs.extend_from_slice(&sample[..s]);
            targets.extend_from_slice(&sample[1..]);
        }
        (
            Tensor::from_data(TensorData::new(inputs, [n, s]), device),
            Tensor::from_data(TensorData::new(targets, [n, s]), device),
        )
    }

    /// The micro-batch `micro` (0-based) of optimizer step `step` (0-based).
    pub fn micro_batch(
        &self,
        step: u64,
        global_batch: u64,
        micro_batch: u32,
        micro: u32,
        device: &Device,
    ) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let first = step * global_batch + u64::from(micro) * u64::from(micro_batch);
        self.batch(first, micro_batch, device)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn samples_are_deterministic_progressions() {
        let task = ProgressionTask {
            seed: 7,
            vocabulary: 11,
            sequence_length: 8,
        };
        let a = task.sample(5);
        assert_eq!(a, task.sample(5));
        assert_eq!(a.len(), 9);
        let stride = (a[1] - a[0]).rem_euclid(11);
        assert!((1..=MAX_STRIDE as i64).contains(&stride));
        for w in a.windows(2) {
            assert_eq!((w[1] - w[0]).rem_euclid(11), stride);
        }
        assert_ne!(task.sample(5), task.sample(6));
    }

    #[test]
    fn a_step_sees_the_same_samples_whatever_the_micro_batch() {
        let task = ProgressionTask {
            seed: 1,
            vocabulary: 50,
            sequence_length: 4,
        };
        let device = Device::flex();
        let whole = task.micro_batch(3, 4, 4, 0, &device).0.into_data();
        let halves: Vec<i64> = (0..2)
            .flat_map(|m| {
                task.micro_batch(3, 4, 2, m, &device)
                    .0
                    .into_data()
                    .iter::<i64>()
                    .collect::<Vec<_>>()
            })
            .collect();
        assert_eq!(whole.iter::<i64>().collect::<Vec<_>>(), halves);
    }
}
