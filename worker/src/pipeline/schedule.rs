//! The 1F1B schedule of one stage for one optimizer step.

/// One pass over one micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    Forward(u32),
    Backward(u32),
}

/// Stage `stage` of `stages` with `micro_batches` per step: `min(p − k − 1, m)`
/// warm-up forwards, then one forward and one backward in turn, then the
/// remaining backwards. Backwards run in micro-batch order, the order the next
/// stage sends their gradients in.
pub fn one_f_one_b(stage: u32, stages: u32, micro_batches: u32) -> Vec<Op> {
    let m = micro_batches;
    let warmup = (stages - stage - 1).min(m);
    let mut ops = Vec::with_capacity(2 * m as usize);
    ops.extend((0..warmup).map(Op::Forward));
    for i in 0..m - warmup {
        ops.push(Op::Forward(warmup + i));
        ops.push(Op::Backward(i));
    }
    ops.extend((m - warmup..m).map(Op::Backward));
    ops
}

/// Micro-batches whose activations are alive at once under [`one_f_one_b`].
pub fn peak_in_flight(ops: &[Op]) -> u32 {
    let (mut live, mut peak) = (0u32, 0u32);
    for op in ops {
        match op {
            Op::Forward(_) => {
                live += 1;
                peak = peak.max(live);
            }
            Op::Backward(_) => live -= 1,
        }
    }
    peak
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_micro_batch_runs_forward_then_backward_once() {
        for p in 1..=4 {
            for m in 1..=6 {
                for k in 0..p {
                    let ops = one_f_one_b(k, p, m);
                    assert_eq!(ops.len(), 2 * m as usize);
                    for i in 0..m {
                        let f = ops
                            .iter()
                            .position(|o| *o == Op::Forward(i))
                            .expect("forward");
                        let b = ops
                            .iter()
                            .position(|o| *o == Op::Backward(i))
                            .expect("backward");
                        assert!(f < b, "stage {k}/{p}, m {m}: micro-batch {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn in_flight_matches_the_planner() {
        // The planner budgets min(p − k, m) micro-batches on stage k (StagePlacement::in_flight).
        for p in 1..=4u32 {
            for m in 1..=6u32 {
                for k in 0..p {
                    assert_eq!(peak_in_flight(&one_f_one_b(k, p, m)), (p - k).min(m));
                }
            }
        }
    }

    #[test]
    fn the_last_stage_alternates_and_single_stage_is_plain_accumulation() {
        use Op::*;
        assert_eq!(
            one_f_one_b(0, 1, 3),
            vec![
                Forward(0),
                Backward(0),
                Forward(1),
                Backward(1),
                Forward(2),
                Backward(2)
            ]
        );
        assert_eq!(
            one_f_one_b(0, 3, 3),
            vec![
                Forward(0),
                Forward(1),
                Forward(2),
                Backward(0),
                Backward(1),
                Backward(2)
            ]
        );
        assert_eq!(
            one_f_one_b(1, 3, 4)[..4],
            [Forward(0), Forward(1), Backward(0), Forward(2)]
        );
    }
}
