//! Acceptance (issue 57): full fine-tunes where peers fit them, with each
//! block's gradients leaving the device as backward produces them
//! (`offloadGradients`), and loads that stream the checkpoint. The CUDA
//! profile as shipped; each test prints its plan
//! (`cargo test -p headroom-planner --test gradient_offload -- --nocapture`).

mod common;
use common::*;
use headroom_planner::units::{GIB, format_bytes};
use headroom_planner::*;

const LLAMA_3_8B: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,
    "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,
    "num_key_value_heads":8,"vocab_size":128256,"tie_word_embeddings":false,
    "rope_theta":500000.0,"torch_dtype":"bfloat16"}"#;
const LLAMA_2_13B: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":5120,
    "intermediate_size":13824,"num_hidden_layers":40,"num_attention_heads":40,
    "num_key_value_heads":40,"vocab_size":32000,"tie_word_embeddings":false,"torch_dtype":"float16"}"#;

fn llama(config: &str, seq: u32) -> ModelShape {
    ModelShape::Llama(LlamaShape::from_hf_config(config, seq).expect("valid config"))
}

/// The operator's default host memory per GPU worker pod (Helm `gpuHostMemory`).
const HOST_BASELINE: u64 = 16 * GIB;

/// A GPU job as the operator plans it: every rung allowed, the default
/// host memory per pod beside what the plan keeps there.
fn job(model: ModelShape, global_batch: u32, max_gpus: u32) -> JobRequest {
    JobRequest {
        target: Target::Gpu {
            allowed_types: vec![],
            max_gpus,
            host_baseline_bytes: Some(HOST_BASELINE),
        },
        ..gpu_job(model, global_batch, max_gpus)
    }
}

/// One node of `count` GPUs with `host_gib` GiB of allocatable memory.
fn node(product: &str, memory_mib: u64, count: u64, host_gib: u64) -> Inventory {
    let mut n = gpu_node("node-0", product, memory_mib, count);
    n.host_memory_bytes = Some(host_gib * GIB);
    Inventory::from_nodes([&n]).on_one_node()
}

/// `req` with every rung allowed but `rung`.
fn without(req: &JobRequest, rung: RetryRung) -> JobRequest {
    JobRequest {
        allowed_rungs: req
            .allowed_rungs
            .iter()
            .copied()
            .filter(|r| *r != rung)
            .collect(),
        ..req.clone()
    }
}

/// The host memory the plan's pods ask of their one node: each pod's
/// baseline and what its stage keeps on the host, every pod.
fn pods_host_bytes(plan: &Plan) -> u64 {
    plan.stages
        .iter()
        .map(|s| HOST_BASELINE + s.memory.host_bytes)
        .sum::<u64>()
        * u64::from(plan.replicas)
}

fn show(title: &str, plan: &Plan) {
    println!(
        "{title}: {} × {}, {}, rungs {:?}, fit {}, step {:.2} s (host copies {:.2} s)",
        plan.workers,
        plan.device,
        plan.settings,
        plan.rungs_applied,
        plan.fit,
        plan.step_time.seconds,
        plan.step_time.host_copy_seconds
    );
    for s in &plan.stages {
        let m = &s.memory;
        println!(
            "  stage {} layers {}..{}: weights {} grads {} optimizer {} activations {} logits {} fixed {} slack {} | training {} load {} host {} total {}",
            s.index,
            s.layer_start,
            s.layer_end,
            format_bytes(m.weights),
            format_bytes(m.gradients),
            format_bytes(m.optimizer_state),
            format_bytes(m.activations),
            format_bytes(m.logits),
            format_bytes(m.fixed_overhead),
            format_bytes(m.allocator_slack),
            format_bytes(m.training_total()),
            format_bytes(m.load_peak),
            format_bytes(m.host_bytes),
            format_bytes(m.total),
        );
    }
}

#[test]
fn llama_3_8b_full_fine_tune_on_one_rtx_4090() {
    let req = job(llama(LLAMA_3_8B, 2048), 8, 1);
    let inventory = node("NVIDIA-GeForce-RTX-4090", 24564, 1, 128);
    match plan(&without(&req, RetryRung::OffloadGradients), &inventory) {
        Ok(p) => show("without", &p),
        Err(e) => println!("without: {e}"),
    }
    let p = plan(&req, &inventory).expect("plans");
    show("Llama-3-8B full, 4090", &p);
}

#[test]
fn the_seeds_llama_2_13b_full_fine_tune_on_two_rtx_a5000() {
    let mut req = job(llama(LLAMA_2_13B, 2048), 32, 2);
    req.precision = Precision::Fp16;
    let inventory = node("NVIDIA-RTX-A5000", 24564, 2, 125);
    match plan(&without(&req, RetryRung::OffloadGradients), &inventory) {
        Ok(p) => show("without", &p),
        Err(e) => println!("without: {e}"),
    }
    match plan(&req, &inventory) {
        Ok(p) => show("Llama-2-13B full, 2 × A5000", &p),
        Err(e) => println!("with: {e}"),
    }
}
