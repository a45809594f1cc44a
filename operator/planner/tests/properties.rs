//! Properties the memory model and the ladder must keep for every input.

mod common;
use common::*;
use headroom_planner::backend::{CUDA, FLEX};
use headroom_planner::memory::{StagePlacement, estimate_stage};
use headroom_planner::search::balanced_split;
use headroom_planner::training::divisors_desc;
use headroom_planner::*;
use proptest::prelude::*;

fn arb_model() -> impl Strategy<Value = ModelShape> {
    (
        1u32..=48,
        1u32..=32,
        1u32..=16,
        1u32..=2048,
        16u32..=64000,
        any::<bool>(),
    )
        .prop_map(|(layers, head_dim8, heads, seq, vocab, tied)| {
            ModelShape::Transformer(TransformerShape {
                layers,
                hidden: head_dim8 * 8 * heads,
                heads,
                sequence_length: seq,
                vocabulary: vocab,
                feed_forward: None,
                tied_embeddings: tied,
            })
        })
}

fn arb_settings() -> impl Strategy<Value = Settings> {
    (
        0u32..=8,
        1u32..=64,
        any::<bool>(),
        prop_oneof![Just(Precision::Fp32), Just(Precision::Bf16)],
        prop_oneof![
            Just(Optimizer::Adamw),
            Just(Optimizer::SgdMomentum),
            Just(Optimizer::Sgd)
        ],
    )
        .prop_map(
            |(log_b, accumulation, ckpt, precision, optimizer)| Settings {
                micro_batch: 1 << log_b,
                gradient_accumulation: accumulation,
                activation_checkpointing: ckpt,
                precision,
                optimizer,
                ..Settings::default()
            },
        )
}

fn arb_placement(layers: u32) -> impl Strategy<Value = StagePlacement> {
    (1u32..=layers.max(1), any::<bool>(), any::<bool>(), 1u32..=8).prop_map(
        |(layers, first, last, in_flight)| StagePlacement {
            layers,
            first,
            last,
            in_flight,
            replicas: 1,
        },
    )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn checkpointing_never_raises_the_estimate(model in arb_model(), s in arb_settings(), placement in arb_placement(48)) {
        let layers = placement.layers.min(model.splittable_layers());
        let placement = StagePlacement { layers, ..placement };
        let off = estimate_stage(&model, None, &Settings { activation_checkpointing: false, ..s }, placement, &CUDA, 1.0);
        let on = estimate_stage(&model, None, &Settings { activation_checkpointing: true, ..s }, placement, &CUDA, 1.0);
        prop_assert!(on.total <= off.total, "on {} > off {}", on.total, off.total);
    }

    /// Halving the micro-batch (and doubling accumulation) never raises the
    /// estimate once accumulation is in use. The first halving of a job with
    /// no accumulation may add the accumulation buffer (one gradient copy),
    /// and never more than that.
    #[test]
    fn halving_micro_batch_never_raises_the_estimate(model in arb_model(), s in arb_settings(), placement in arb_placement(48)) {
        prop_assume!(s.micro_batch >= 2);
        let layers = placement.layers.min(model.splittable_layers());
        let placement = StagePlacement { layers, in_flight: 1, ..placement };
        let before = estimate_stage(&model, None, &s, placement, &FLEX, 1.0);
        let halved = Settings { micro_batch: s.micro_batch / 2, gradient_accumulation: s.gradient_accumulation * 2, ..s };
        let after = estimate_stage(&model, None, &halved, placement, &FLEX, 1.0);
        if s.gradient_accumulation > 1 {
            prop_assert!(after.total <= before.total, "after {} > before {}", after.total, before.total);
        } else {
            let extra_grad = before.gradients + (before.gradients as f64 * FLEX.state_slack).ceil() as u64;
            prop_assert!(after.total <= before.total + extra_grad);
        }
        prop_assert_eq!(halved.global_batch(), s.global_batch());
    }

    #[test]
    fn a_returned_plan_never_exceeds_its_budget(
        model in arb_model(),
        log_g in 0u32..=8,
        limit_mib in 64u64..=16384,
        workers in 1u32..=4,
    ) {
        let job = cpu_job(model, 1 << log_g, limit_mib << 20, workers);
        if let Ok(plan) = plan(&job, &Inventory::default()) {
            prop_assert!(plan.predicted_peak_bytes <= plan.budget_bytes);
            for stage in &plan.stages {
                prop_assert!(stage.memory.total <= plan.budget_bytes);
            }
            prop_assert_eq!(plan.global_batch, 1u64 << log_g);
            prop_assert!(plan.workers <= workers);
        }
    }

    #[test]
    fn every_rung_preserves_the_global_batch(
        model in arb_model(),
        log_g in 0u32..=8,
        limit_mib in 256u64..=8192,
        workers in 1u32..=4,
        observed_ratio in 1.0f64..4.0,
    ) {
        let job = cpu_job(model, 1 << log_g, limit_mib << 20, workers);
        let Ok(first) = plan(&job, &Inventory::default()) else { return Ok(()) };
        let failure = MemoryFailure {
            kind: MemoryFailureKind::HostOom,
            observed_peak_bytes: Some((first.predicted_peak_bytes as f64 * observed_ratio) as u64),
            trained: false,
        };
        let mut failed = first;
        // Climb until the ladder gives up; every plan it returns must be valid.
        for _ in 0..8 {
            match next_stricter_plan(&job, &Inventory::default(), &failed, &failure) {
                Ok(next) => {
                    prop_assert_eq!(next.global_batch, 1u64 << log_g);
                    // Settings are per replica.
                    prop_assert_eq!(
                        next.settings.global_batch() * u64::from(next.replicas),
                        1u64 << log_g
                    );
                    // Within the budget, or — when no rung is — within
                    // the usable memory itself, saying so.
                    let usable = (next.device_memory_bytes as f64 * FLEX.usable_fraction) as u64;
                    prop_assert!(
                        next.fits()
                            || (next.predicted_peak_bytes <= usable
                                && next.warnings.iter().any(|w| w.contains("within the usable memory")))
                    );
                    prop_assert!(!next.rungs_applied.is_empty());
                    prop_assert!(next.correction_factor >= failed.correction_factor);
                    failed = next;
                }
                Err(e) => {
                    prop_assert!(!e.details.is_empty() || !e.summary.is_empty());
                    break;
                }
            }
        }
    }

    #[test]
    fn balanced_split_covers_every_layer_once(layers in 1u32..=512, p in 1u32..=64) {
        match balanced_split(layers, p) {
            Some(split) => {
                prop_assert_eq!(split.iter().sum::<u32>(), layers);
                prop_assert!(split.iter().all(|&n| n >= 1));
                let (min, max) = (split.iter().min().copied().unwrap_or(0), split.iter().max().copied().unwrap_or(0));
                prop_assert!(max - min <= 1);
            }
            None => prop_assert!(p > layers),
        }
    }

    #[test]
    fn divisors_divide(n in 1u32..=100_000) {
        let d = divisors_desc(n);
        prop_assert!(d.iter().all(|x| n % x == 0));
        prop_assert_eq!(d.first().copied(), Some(n));
        prop_assert_eq!(d.last().copied(), Some(1));
    }
}
