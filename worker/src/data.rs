//! What the worker trains on: [`Samples`], either real text packed by
//! [`crate::text`] ([`TextSamples`]) or the synthetic next-token task below.
//!
//! Both give sample `i` of the run as a pure function of the job (seed, data)
//! and `i`, and optimizer step `k` uses samples `k·G .. (k+1)·G` (G the global
//! batch), so a step sees the same data whatever the micro-batch,
//! accumulation or pipeline split of the attempt that runs it.
//!
//! ## The synthetic task
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

use crate::model::Documents;

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
        Samples::Progression(*self).batch(first, count, device)
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
        Samples::Progression(*self).micro_batch(step, global_batch, micro_batch, micro, device)
    }
}

/// Real text, packed into samples of `sequence_length + 1` tokens and
/// visited in an order that depends on the seed alone; after the last sample
/// of an epoch the next epoch visits them again in a fresh order.
#[derive(Clone, Debug)]
pub struct TextSamples {
    samples: Vec<Vec<u32>>,
    /// Per sample, whether each target is trained ([`crate::text::Packed::trained`]);
    /// `None` when every target is.
    trained: Option<Vec<Vec<bool>>>,
    /// Per sample, the document of each token ([`crate::text::Packed::segments`]);
    /// `None` for the stream.
    segments: Option<Vec<Vec<u32>>>,
    seed: u64,
}

/// A target the loss skips, as Hugging Face's labels write it
/// (`ignore_index` of PyTorch's cross-entropy).
pub const IGNORED_TARGET: i64 = -100;

impl TextSamples {
    /// `samples` as [`crate::text::pack`] made them (at least one).
    pub fn new(samples: Vec<Vec<u32>>, seed: u64) -> Self {
        TextSamples::with_masks(samples, None, seed)
    }

    /// `samples` with their targets' masks, as [`crate::text::pack_tokenized`] made them.
    pub fn with_masks(samples: Vec<Vec<u32>>, trained: Option<Vec<Vec<bool>>>, seed: u64) -> Self {
        assert!(!samples.is_empty(), "packing yields at least one sample");
        if let Some(t) = &trained {
            assert_eq!(t.len(), samples.len(), "a mask per sample");
        }
        TextSamples {
            samples,
            trained,
            segments: None,
            seed,
        }
    }

    /// The samples of `packed`, with their masks and documents.
    pub fn packed(packed: crate::text::Packed, seed: u64) -> Self {
        let segments = packed.segments;
        if let Some(s) = &segments {
            assert_eq!(s.len(), packed.samples.len(), "segments per sample");
        }
        TextSamples {
            segments,
            ..TextSamples::with_masks(packed.samples, packed.trained, seed)
        }
    }

    pub fn len(&self) -> usize {
        self.samples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Splits off `count` samples for evaluation (at most all but one),
    /// chosen by the seed alone: (what is trained on, what is held out).
    pub fn hold_out(self, count: usize) -> (TextSamples, TextSamples) {
        /// Mixed into the seed so the held-out draw is not an epoch's order.
        const HELD_OUT_SALT: u64 = 0x4865_6c64_4f75_7401;
        let count = count.min(self.samples.len() - 1);
        let order = crate::text::shuffled(self.samples.len(), splitmix(self.seed ^ HELD_OUT_SALT));
        let mut held = vec![false; self.samples.len()];
        for &i in &order[..count] {
            held[i] = true;
        }
        let (mut trained, mut evaluated) = (Vec::new(), Vec::new());
        let (mut trained_masks, mut evaluated_masks) = (Vec::new(), Vec::new());
        let masks = self
            .trained
            .map(|m| m.into_iter().map(Some).collect::<Vec<_>>());
        let masks = masks.unwrap_or_else(|| vec![None; self.samples.len()]);
        let (mut trained_segments, mut evaluated_segments) = (Vec::new(), Vec::new());
        let segments = self
            .segments
            .map(|m| m.into_iter().map(Some).collect::<Vec<_>>());
        let segments = segments.unwrap_or_else(|| vec![None; self.samples.len()]);
        for (((sample, mask), segment), held) in
            self.samples.into_iter().zip(masks).zip(segments).zip(held)
        {
            if held {
                evaluated.push(sample);
                evaluated_masks.extend(mask);
                evaluated_segments.extend(segment);
            } else {
                trained.push(sample);
                trained_masks.extend(mask);
                trained_segments.extend(segment);
            }
        }
        let some = |m: Vec<Vec<bool>>| (!m.is_empty()).then_some(m);
        let part = |samples, masks, segments: Vec<Vec<u32>>| TextSamples {
            segments: (!segments.is_empty()).then_some(segments),
            ..TextSamples::with_masks(samples, some(masks), self.seed)
        };
        (
            part(trained, trained_masks, trained_segments),
            part(evaluated, evaluated_masks, evaluated_segments),
        )
    }

    /// Which packed sample sample `index` of the run is.
    fn pick(&self, index: u64) -> usize {
        let n = self.samples.len() as u64;
        let (epoch, within) = (index / n, index % n);
        // One permutation per epoch; recomputing it per sample is O(n) but n
        // is the number of packed samples of one job, and a step asks for G.
        let order = crate::text::shuffled(n as usize, splitmix(self.seed ^ splitmix(epoch)));
        order[within as usize]
    }

    /// Sample `index` of the run.
    pub fn sample(&self, index: u64) -> Vec<i64> {
        self.samples[self.pick(index)]
            .iter()
            .map(|&t| i64::from(t))
            .collect()
    }

    /// Sample `index`'s tokens and, where some targets are masked, which are trained.
    fn sample_masked(&self, index: u64) -> (Vec<i64>, Option<&[bool]>) {
        let k = self.pick(index);
        let tokens = self.samples[k].iter().map(|&t| i64::from(t)).collect();
        (tokens, self.trained.as_ref().map(|m| m[k].as_slice()))
    }

    /// Whether some targets are masked.
    pub fn is_masked(&self) -> bool {
        self.trained.is_some()
    }
}

/// The training data of a run.
#[derive(Clone, Debug)]
pub enum Samples {
    Progression(ProgressionTask),
    Text(TextSamples),
}

impl Samples {
    fn sample(&self, index: u64) -> (Vec<i64>, Option<&[bool]>) {
        match self {
            Samples::Progression(t) => (t.sample(index), None),
            Samples::Text(t) => t.sample_masked(index),
        }
    }

    /// The trained targets of samples `first .. first + count`; `None`
    /// when no target of the data is masked (then every one is trained).
    pub fn trained_targets(&self, first: u64, count: u64) -> Option<u64> {
        let Samples::Text(t) = self else {
            return None;
        };
        let masks = t.trained.as_ref()?;
        Some(
            (first..first + count)
                .map(|i| masks[t.pick(i)].iter().filter(|&&m| m).count() as u64)
                .sum(),
        )
    }

    /// Where the documents of samples `first .. first + count` lie (their
    /// inputs' tokens), as [`Self::batch`] gives them; `None` unless the
    /// data is packed by documents. Every stage and replica that runs the
    /// blocks over a batch needs it, not only those holding its tokens.
    pub fn documents(&self, first: u64, count: u32) -> Option<Documents> {
        let Samples::Text(t) = self else {
            return None;
        };
        let segments = t.segments.as_ref()?;
        let mut ids = Vec::new();
        let mut s = 0;
        for i in first..first + u64::from(count) {
            let segment = &segments[t.pick(i)];
            s = segment.len() - 1;
            ids.extend_from_slice(&segment[..s]);
        }
        Some(Documents::new(&ids, count as usize, s))
    }

    /// [`Self::documents`] of the micro-batch [`Self::micro_batch`] gives.
    pub fn micro_documents(
        &self,
        step: u64,
        global_batch: u64,
        micro_batch: u32,
        micro: u32,
    ) -> Option<Documents> {
        let first = step * global_batch + u64::from(micro) * u64::from(micro_batch);
        self.documents(first, micro_batch)
    }

    /// Inputs and targets ([samples, seq] each) for samples `first .. first + count`.
    pub fn batch(
        &self,
        first: u64,
        count: u32,
        device: &Device,
    ) -> (Tensor<2, Int>, Tensor<2, Int>) {
        let n = count as usize;
        let mut inputs = Vec::new();
        let mut targets = Vec::new();
        let mut s = 0;
        for i in 0..u64::from(count) {
            let (sample, trained) = self.sample(first + i);
            s = sample.len() - 1;
            inputs.extend_from_slice(&sample[..s]);
            match trained {
                Some(trained) => targets.extend(
                    sample[1..]
                        .iter()
                        .zip(trained)
                        .map(|(&t, &on)| if on { t } else { IGNORED_TARGET }),
                ),
                None => targets.extend_from_slice(&sample[1..]),
            }
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
    fn held_out_samples_are_split_off_by_the_seed_alone() {
        let samples: Vec<Vec<u32>> = (0..20).map(|i| vec![i, i + 1]).collect();
        let (trained, held) = TextSamples::new(samples.clone(), 3).hold_out(4);
        assert_eq!((trained.len(), held.len()), (16, 4));
        let mut all: Vec<Vec<u32>> = trained
            .samples
            .iter()
            .chain(&held.samples)
            .cloned()
            .collect();
        all.sort();
        assert_eq!(all, samples, "every sample once, in one part or the other");
        let (_, again) = TextSamples::new(samples.clone(), 3).hold_out(4);
        assert_eq!(
            again.samples, held.samples,
            "the same seed holds out the same"
        );
        let (_, other) = TextSamples::new(samples.clone(), 4).hold_out(4);
        assert_ne!(other.samples, held.samples);
        let (left, _) = TextSamples::new(samples, 3).hold_out(50);
        assert_eq!(left.len(), 1, "at least one sample is left to train on");
    }

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

    #[test]
    fn text_epochs_visit_every_sample_once_in_a_seeded_order() {
        let packed: Vec<Vec<u32>> = (0..5).map(|i| vec![i, i + 10, i + 20]).collect();
        let text = TextSamples::new(packed.clone(), 3);
        let epoch = |e: u64| -> Vec<i64> { (0..5).map(|i| text.sample(e * 5 + i)[0]).collect() };
        for e in 0..3 {
            let mut firsts = epoch(e);
            firsts.sort();
            assert_eq!(firsts, vec![0, 1, 2, 3, 4], "epoch {e} is a permutation");
        }
        assert_ne!(epoch(0), epoch(1), "each epoch has its own order");
        assert_eq!(epoch(1), TextSamples::new(packed, 3).sample_firsts(5, 5));
        let (inputs, targets) = Samples::Text(text).batch(2, 2, &Device::flex());
        assert_eq!(inputs.dims(), [2, 2]);
        let (i, t): (Vec<i64>, Vec<i64>) = (
            inputs.into_data().iter().collect(),
            targets.into_data().iter().collect(),
        );
        assert_eq!(
            (i[1] - i[0], t[0] - i[0]),
            (10, 10),
            "targets are inputs shifted by one"
        );
    }

    impl TextSamples {
        fn sample_firsts(&self, first: u64, n: u64) -> Vec<i64> {
            (first..first + n).map(|i| self.sample(i)[0]).collect()
        }
    }
}
