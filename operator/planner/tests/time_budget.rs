//! A search with a deadline ([`SearchOptions::deadline`]) gives up once it
//! passes, with [`NoFeasiblePlan::out_of_time`], on a first plan and on
//! every kind of replan; without one, or within it, it plans as before.

mod common;
use std::time::Duration;

use common::*;
use headroom_planner::*;

fn within(budget: Duration) -> SearchOptions {
    SearchOptions {
        deadline: Some(Deadline::after(budget)),
        ..SearchOptions::default()
    }
}

/// The planner's benchmark job: 70B parameters over 1,000 nodes of six GPU
/// types, up to 64 GPUs.
fn large_job() -> (JobRequest, Inventory) {
    (
        gpu_job(model_70b(), 1024, 64),
        Inventory::from_nodes(&six_type_cluster(1000)),
    )
}

fn assert_out_of_time(answer: Result<Plan, NoFeasiblePlan>, budget: Duration) {
    let refused = answer.expect_err("past its deadline");
    assert_eq!(refused.out_of_time, Some(budget), "{refused:?}");
    assert!(
        refused.summary.contains("time budget") && refused.waits_for.is_none(),
        "{refused:?}"
    );
}

/// The clock is looked at only inside the search (before each candidate
/// and each shape): a deadline already passed when the search starts is
/// seen there, and the search answers out of time, not with a plan or a
/// refusal of the job's numbers.
#[test]
fn a_search_past_its_deadline_answers_out_of_time() {
    let (job, inventory) = large_job();
    assert_out_of_time(
        plan_with(&job, &inventory, &within(Duration::ZERO)),
        Duration::ZERO,
    );
}

#[test]
fn a_search_within_its_deadline_plans_as_without_one() {
    let (job, inventory) = large_job();
    let unbounded = plan(&job, &inventory).expect("a 70B plan");
    let bounded = plan_with(&job, &inventory, &within(Duration::from_secs(600))).expect("in time");
    assert_eq!(bounded, unbounded);
    // So does a budget too large to add to the clock.
    let endless = plan_with(&job, &inventory, &within(Duration::MAX)).expect("in time");
    assert_eq!(endless, unbounded);
}

/// Replans honour the deadline too: the ladder after an out-of-memory
/// failure and the search without an unschedulable device type.
#[test]
fn replans_past_their_deadline_answer_out_of_time() {
    let (job, inventory) = large_job();
    let ended = plan(&job, &inventory).expect("a 70B plan");
    let oom = FailureCause::OutOfMemory(MemoryFailure {
        kind: MemoryFailureKind::DeviceOom,
        observed_peak_bytes: None,
        trained: false,
    });
    let unschedulable = FailureCause::Unschedulable {
        excluded_devices: vec![ended.device.clone()],
    };
    for cause in [&oom, &unschedulable] {
        let deadline = Deadline::after(Duration::ZERO);
        assert_out_of_time(
            replan_within(&job, &inventory, &ended, cause, Some(deadline)),
            Duration::ZERO,
        );
        let in_time = Deadline::after(Duration::from_secs(600));
        assert_eq!(
            replan_within(&job, &inventory, &ended, cause, Some(in_time)),
            replan(&job, &inventory, &ended, cause),
            "{cause:?}"
        );
    }
}

/// The operator's default budget (5 s, `DEFAULT_PLANNING_BUDGET`) must
/// leave the largest searches room: 70B parameters over 1,000 nodes of six
/// GPU types up to 64 GPUs, and a LoRA job of the largest shape a
/// checkpoint may have on eight GPUs (the most the operator plans for).
/// Prints what they take in this build (`-- --nocapture`); they fail only
/// far past what they take (0.2–0.4 s and 7–11 ms in a debug build).
#[test]
fn the_largest_searches_end_well_within_the_operators_default_budget() {
    const DEFAULT_BUDGET: Duration = Duration::from_secs(5);
    let (job, inventory) = large_job();
    let started = std::time::Instant::now();
    let _ = plan(&job, &inventory);
    eprintln!(
        "70B over 1,000 nodes, up to 64 GPUs: {:?}",
        started.elapsed()
    );
    // The largest shape a checkpoint may have, LoRA on eight GPUs (the
    // most the operator plans for).
    let config = format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":{},"intermediate_size":{},
            "num_hidden_layers":{},"num_attention_heads":64,"num_key_value_heads":64,
            "vocab_size":{},"tie_word_embeddings":false}}"#,
        limits::HIDDEN.max,
        limits::FEED_FORWARD.max,
        limits::LAYERS.max,
        limits::VOCABULARY.max
    );
    let shape = LlamaShape::from_hf_config(&config, 131_072).expect("within the bounds");
    let mut lora = gpu_job(ModelShape::Llama(shape), 8, 8);
    lora.adapters = Some(LoraConfig {
        rank: 8,
        alpha: 16.0,
        dropout: 0.0,
        target_modules: TargetModule::BLOCK_LINEARS.to_vec(),
        block_size: 64,
    });
    lora.allowed_rungs = RetryRung::ALL.to_vec();
    let inventory =
        Inventory::from_nodes(&[gpu_node("node-0", "NVIDIA-H100-80GB-HBM3", 81_559, 8)])
            .on_one_node();
    let started = std::time::Instant::now();
    let _ = plan(&lora, &inventory);
    let took = started.elapsed();
    eprintln!("largest LoRA shape on 8 GPUs: {took:?}");
    assert!(took < DEFAULT_BUDGET, "took {took:?}");
}
