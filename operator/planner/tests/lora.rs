//! Acceptance: LoRA and QLoRA plans for published model shapes on small
//! GPUs, with a CUDA profile that runs them (packed int4, 8-bit AdamW,
//! optimizer offload), so the tests hold once the real profile lists them.
//! Each prints its breakdown (`cargo test -p headroom-planner --test lora -- --nocapture`).

mod common;
use common::*;
use headroom_planner::backend::CUDA;
use headroom_planner::units::format_bytes;
use headroom_planner::*;

static CUDA_QLORA: BackendProfile = BackendProfile {
    base_formats: &[
        BaseFormat::Dense,
        BaseFormat::Int8,
        BaseFormat::Int4,
        BaseFormat::Nf4,
    ],
    optimizers: &[
        Optimizer::Adamw,
        Optimizer::Adam,
        Optimizer::SgdMomentum,
        Optimizer::Sgd,
        Optimizer::Adamw8bit,
    ],
    optimizer_offload: true,
    ..CUDA
};

fn opts() -> SearchOptions {
    SearchOptions {
        profile: Some(&CUDA_QLORA),
        ..SearchOptions::default()
    }
}

fn llama(config: &str, seq: u32) -> ModelShape {
    ModelShape::Llama(LlamaShape::from_hf_config(config, seq).expect("valid config"))
}

const LLAMA_2_7B: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,
    "intermediate_size":11008,"num_hidden_layers":32,"num_attention_heads":32,
    "num_key_value_heads":32,"vocab_size":32000,"tie_word_embeddings":false,"torch_dtype":"float16"}"#;
const LLAMA_3_8B: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,
    "intermediate_size":14336,"num_hidden_layers":32,"num_attention_heads":32,
    "num_key_value_heads":8,"vocab_size":128256,"tie_word_embeddings":false,
    "rope_theta":500000.0,"torch_dtype":"bfloat16"}"#;
const LLAMA_2_13B: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":5120,
    "intermediate_size":13824,"num_hidden_layers":40,"num_attention_heads":40,
    "num_key_value_heads":40,"vocab_size":32000,"tie_word_embeddings":false,"torch_dtype":"float16"}"#;
/// Phi-4-mini's config values as a Llama-family shape (3.8 B parameters).
const PHI_4_MINI: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":3072,
    "intermediate_size":8192,"num_hidden_layers":32,"num_attention_heads":24,
    "num_key_value_heads":8,"vocab_size":200064,"tie_word_embeddings":true,"torch_dtype":"bfloat16"}"#;

fn lora(rank: u32) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 2.0 * f64::from(rank),
        dropout: 0.0,
        target_modules: TargetModule::BLOCK_LINEARS.to_vec(),
        block_size: 64,
    }
}

fn job(model: ModelShape, global_batch: u32, max_gpus: u32) -> JobRequest {
    JobRequest {
        allowed_rungs: RetryRung::ALL.to_vec(),
        ..gpu_job(model, global_batch, max_gpus)
    }
}

fn one_node(product: &str, memory_mib: u64, count: u64) -> Inventory {
    Inventory::from_nodes(&[gpu_node("node-0", product, memory_mib, count)]).on_one_node()
}

fn show(title: &str, plan: &Plan) {
    println!(
        "{title}: {} × {}, {}, rungs {:?}, fit {}",
        plan.workers, plan.device, plan.settings, plan.rungs_applied, plan.fit
    );
    for s in &plan.stages {
        let m = &s.memory;
        println!(
            "  stage {} layers {}..{}: weights {} grads {} optimizer {} activations {} logits {} composed {} fixed {} slack {} | training {} load {} host {} total {}",
            s.index,
            s.layer_start,
            s.layer_end,
            format_bytes(m.weights),
            format_bytes(m.gradients),
            format_bytes(m.optimizer_state),
            format_bytes(m.activations),
            format_bytes(m.logits),
            format_bytes(m.composed_weights),
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
fn llama_2_13b_on_one_node_of_two_24_gb_gpus() {
    // LoRA r = 16 on all block linears, bf16, global batch 8, sequence 2048,
    // every rung allowed: the search picks the base format and stages.
    let mut req = job(llama(LLAMA_2_13B, 2048), 8, 2);
    req.adapters = Some(lora(16));
    let plan = plan_with(
        &req,
        &one_node("NVIDIA-GeForce-RTX-4090", 24564, 2),
        &opts(),
    )
    .expect("13B fits two 24 GB GPUs as (Q)LoRA");
    show("Llama-2-13B LoRA r16, 2 × 24 GB", &plan);
    assert!(plan.fits());
    assert!(plan.workers <= 2);
}

#[test]
fn phi_4_mini_qlora_on_one_6_gb_gpu() {
    // Seed 001: LoRA on a 4-bit base, micro-batch 1 × accumulation 8,
    // checkpointing, fp16, sequence 1024, "Total ~6-7GB" on a 6 GB GPU.
    let mut req = job(llama(PHI_4_MINI, 1024), 8, 1);
    req.adapters = Some(lora(16));
    req.base_format = BaseFormat::Nf4;
    req.precision = Precision::Fp16;
    req.pinned_micro_batch = Some(1);
    req.pinned_checkpointing = Some(true);
    req.allowed_rungs = vec![];
    let inventory = one_node("NVIDIA-GeForce-RTX-3060-Laptop", 6144, 1);
    let result = plan_with(&req, &inventory, &opts());
    match &result {
        Ok(plan) => show("Phi-4-mini QLoRA nf4, 6 GB", plan),
        Err(e) => println!("Phi-4-mini QLoRA nf4, 6 GB: {e}"),
    }
    let plan = result.expect("a pinned first attempt runs as asked");
    println!("warnings: {:?}", plan.warnings);
    // The seed's own job plans on its 6 GB card. Its
    // training peak is 4.8 GiB; the load's (the 200,064 × 3,072 embedding
    // uploaded once, at fp16, beside the weights) is the larger, 5.3 GiB.
    assert!(plan.fits(), "{:?}", plan.warnings);
}

#[test]
fn llama_2_7b_on_one_24_gb_gpu_full_fine_tuning_with_offloaded_gradients_qlora_without() {
    let inventory = one_node("NVIDIA-GeForce-RTX-4090", 24564, 1);
    let full = job(llama(LLAMA_2_7B, 2048), 8, 1);
    let refused = plan_with(
        &without_rung(&full, RetryRung::OffloadGradients),
        &inventory,
        &opts(),
    )
    .expect_err("7B full fine-tuning with its gradients on the device");
    println!("Llama-2-7B full fine-tuning, 1 × 24 GB: {refused}");
    // Its gradients leave the device block by block (tests/gradient_offload.rs).
    let offloaded = plan_with(&full, &inventory, &opts()).expect("gradients on the host");
    show(
        "Llama-2-7B full, gradients offloaded, 1 × 24 GB",
        &offloaded,
    );
    assert!(offloaded.settings.offload_gradients && offloaded.fits());

    let mut qlora = full.clone();
    qlora.adapters = Some(lora(16));
    qlora.base_format = BaseFormat::Int4;
    let plan = plan_with(&qlora, &inventory, &opts()).expect("7B QLoRA fits 24 GB");
    show("Llama-2-7B QLoRA int4 r16, 1 × 24 GB", &plan);
    assert_eq!(plan.settings.base_format, BaseFormat::Int4);
    assert!(plan.fits());
}

/// docs/benchmarks.md: Headroom's QLoRA (nf4, r = 16 on all block
/// linears, bf16, micro-batch 1, sequence 2048, checkpointing) and 16-bit
/// LoRA figures for one GPU, beside Unsloth's minimum-VRAM table.
#[test]
fn qlora_minimums_beside_unsloth() {
    use headroom_planner::memory::{StagePlacement, estimate_stage};
    let models = [
        ("7B (Llama-2-7B)", LLAMA_2_7B.to_string(), 5.0, 19.0),
        (
            "8B (Llama-3-8B)",
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":4096,"intermediate_size":14336,
               "num_hidden_layers":32,"num_attention_heads":32,"num_key_value_heads":8,
               "vocab_size":128256,"tie_word_embeddings":false,"torch_dtype":"bfloat16"}"#
                .to_string(),
            6.0,
            22.0,
        ),
        (
            "14B (Qwen2.5-14B)",
            r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":5120,"intermediate_size":13824,
               "num_hidden_layers":48,"num_attention_heads":40,"num_key_value_heads":8,
               "vocab_size":152064,"tie_word_embeddings":false,"torch_dtype":"bfloat16"}"#
                .to_string(),
            8.5,
            33.0,
        ),
        (
            "70B (Llama-2-70B)",
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":8192,"intermediate_size":28672,
               "num_hidden_layers":80,"num_attention_heads":64,"num_key_value_heads":8,
               "vocab_size":32000,"tie_word_embeddings":false,"torch_dtype":"float16"}"#
                .to_string(),
            41.0,
            164.0,
        ),
    ];
    let gb = |b: u64| b as f64 / 1e9;
    for (name, config, unsloth_q, unsloth_l) in models {
        let model = llama(&config, 2048);
        let layers = model.splittable_layers();
        let a = lora(16);
        let at = |format: BaseFormat| {
            let s = Settings {
                activation_checkpointing: true,
                precision: Precision::Bf16,
                base_format: format,
                ..Settings::default()
            };
            estimate_stage(
                &model,
                Some(&a),
                &s,
                StagePlacement::single(layers),
                &CUDA_QLORA,
                1.0,
            )
        };
        let (q, l) = (at(BaseFormat::Nf4), at(BaseFormat::Dense));
        println!(
            "| {name} | {:.1} | {:.1} (weights {:.1}, logits {:.1}, composed {:.1}, load {:.1}) | {unsloth_l:.0} | {:.1} (weights {:.1}) |",
            unsloth_q,
            gb(q.total),
            gb(q.weights),
            gb(q.logits),
            gb(q.composed_weights),
            gb(q.load_peak),
            gb(l.total),
            gb(l.weights),
        );
        assert!(gb(q.total) < gb(l.total));
    }
}

/// A LoRA job that pins its micro-batch and checkpointing runs its dense
/// base on the first attempt even when it is predicted over budget (pins
/// are the user's call; the ladder relaxes them after an OOM), while the
/// same job without pins is planned on an int8 base at once: quantizeBase
/// is one of the numerics rungs the search may use when nothing else fits.
#[test]
fn pins_keep_a_lora_job_on_its_dense_base_until_a_retry_quantizes_it() {
    let inventory = one_node("NVIDIA-GeForce-RTX-4090", 24564, 1);
    let mut unpinned = job(llama(LLAMA_2_13B, 2048), 8, 1);
    unpinned.adapters = Some(lora(16));
    unpinned.allowed_rungs = vec![RetryRung::QuantizeBase];
    let plan = plan_with(&unpinned, &inventory, &opts()).expect("13B LoRA on int8 fits 24 GB");
    assert_eq!(plan.settings.base_format, BaseFormat::Int8, "{plan:?}");
    assert_eq!(plan.rungs_applied, vec![RetryRung::QuantizeBase]);
    assert!(plan.fits());

    let pinned = JobRequest {
        pinned_micro_batch: Some(plan.settings.micro_batch),
        pinned_checkpointing: Some(plan.settings.activation_checkpointing),
        ..unpinned
    };
    let plan = plan_with(&pinned, &inventory, &opts()).expect("pins run as asked");
    assert_eq!(plan.settings.base_format, BaseFormat::Dense, "{plan:?}");
    assert!(
        !plan.fits(),
        "the dense 13B base does not fit 24 GB: {}",
        plan.fit
    );
    assert!(
        plan.warnings
            .iter()
            .any(|w| w.contains("running them as asked")),
        "{:?}",
        plan.warnings
    );
}

/// Meta-Llama-3-8B, QLoRA int4 r16 on the seven block linears, bf16, CUDA
/// profile, one stage: three plans (65.6, 40.9 and 49.5 GiB when burn
/// composed each adapted weight, docs/log/benchmarks-log.md) and the
/// targets' shapes. Prints the terms (today's figures: docs/benchmarks.md,
/// "Llama-3-8B QLoRA").
#[test]
fn llama_3_8b_qlora_terms_after_the_lean_ops() {
    use headroom_planner::memory::{StagePlacement, estimate_stage};
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let at_offloading = |seq: u32, micro: u32, acc: u32, ckpt: bool, offload: (bool, bool)| {
        let model = llama(LLAMA_3_8B, seq);
        let s = Settings {
            micro_batch: micro,
            gradient_accumulation: acc,
            activation_checkpointing: ckpt,
            precision: Precision::Bf16,
            base_format: BaseFormat::Nf4,
            offload_activations: offload.0,
            offload_embedding: offload.1,
            ..Settings::default()
        };
        estimate_stage(
            &model,
            Some(&lora(16)),
            &s,
            StagePlacement::single(32),
            &CUDA_QLORA,
            1.0,
        )
    };
    let at_offloaded = |seq: u32, micro: u32, acc: u32, ckpt: bool, offload: bool| {
        at_offloading(seq, micro, acc, ckpt, (offload, false))
    };
    let at =
        |seq: u32, micro: u32, acc: u32, ckpt: bool| at_offloaded(seq, micro, acc, ckpt, false);
    println!("| sequence | plan | peak GiB (training; load) | activations | logits | composed |");
    println!("|---|---|---|---|---|---|");
    for (seq, micro, acc, ckpt) in [
        (2048, 2, 4, false),
        (8192, 2, 4, true),
        (16384, 1, 8, true),
        (2048, 1, 1, true),
        (4096, 1, 1, true),
        (8192, 1, 1, true),
        (16384, 1, 1, true),
    ] {
        let m = at(seq, micro, acc, ckpt);
        println!(
            "| {seq} | mb {micro} × {acc}{} | {:.1} ({:.1}; {:.1}) | {:.2} | {:.2} | {:.2} |",
            if ckpt { ", checkpointing" } else { "" },
            gib(m.total),
            gib(m.training_total()),
            gib(m.load_peak),
            gib(m.activations),
            gib(m.logits),
            gib(m.composed_weights),
        );
    }
    // Offloaded checkpoints (GPU only): the block inputs wait in host memory.
    println!(
        "| sequence | plan, checkpoints offloaded | peak GiB (training; load) | activations | host GiB |"
    );
    println!("|---|---|---|---|---|");
    for seq in [2048, 4096, 8192, 16384] {
        let (kept, off) = (at(seq, 1, 1, true), at_offloaded(seq, 1, 1, true, true));
        println!(
            "| {seq} | mb 1 × 1 | {:.1} ({:.1}; {:.1}) | {:.2} | {:.1} |",
            gib(off.total),
            gib(off.training_total()),
            gib(off.load_peak),
            gib(off.activations),
            gib(off.host_bytes),
        );
        // 31 of the 32 block inputs (s × 4096 bf16 values each) leave the device.
        let input = u64::from(seq) * 4096 * 2;
        assert_eq!(kept.activations - off.activations, 31 * input);
    }
    // The frozen embedding in host memory too (GPU only): 128256 × 4096
    // bf16 values leave the device's weights and its load.
    println!(
        "| sequence | plan, embedding offloaded (and checkpoints) | peak GiB (training; load) | weights | host GiB |"
    );
    println!("|---|---|---|---|---|");
    let table = 128_256 * 4096 * 2;
    for seq in [2048, 4096, 8192, 16384] {
        for checkpoints in [false, true] {
            let before = at_offloaded(seq, 1, 1, true, checkpoints);
            let off = at_offloading(seq, 1, 1, true, (checkpoints, true));
            println!(
                "| {seq} | mb 1 × 1{} | {:.1} ({:.1}; {:.1}) | {:.2} | {:.1} |",
                if checkpoints { ", checkpoints too" } else { "" },
                gib(off.total),
                gib(off.training_total()),
                gib(off.load_peak),
                gib(off.weights),
                gib(off.host_bytes),
            );
            assert_eq!(before.weights - off.weights, table);
            assert_eq!(off.activations, before.activations);
            assert!(off.host_bytes >= before.host_bytes.max(table));
            assert!(off.load_peak < before.load_peak);
        }
    }
    // The first target: s 2048, mb 1, checkpointing, within 8 GB.
    let small = at_offloading(2048, 1, 1, true, (false, true));
    assert!(small.total <= 8_000_000_000, "{small:?}");
    // No s² term left: doubling s from 4096 to 8192 at most doubles
    // activations + logits.
    let (a, b) = (at(4096, 1, 1, true), at(8192, 1, 1, true));
    assert!(b.activations + b.logits <= 2 * (a.activations + a.logits));
    // s = 16384, mb 1, checkpointing: under 20 GiB.
    assert!(gib(at(16384, 1, 1, true).total) <= 20.0);
}

/// The 8 GB job: Meta-Llama-3-8B at sequence `seq`, QLoRA nf4 r16, bf16,
/// global batch 4, one GPU.
fn llama_3_8b_qlora(seq: u32) -> JobRequest {
    let mut req = job(llama(LLAMA_3_8B, seq), 4, 1);
    req.adapters = Some(lora(16));
    req.base_format = BaseFormat::Nf4;
    req.precision = Precision::Bf16;
    req
}

/// `req` with every rung allowed but `rung`.
fn without_rung(req: &JobRequest, rung: RetryRung) -> JobRequest {
    JobRequest {
        allowed_rungs: RetryRung::ALL.into_iter().filter(|r| *r != rung).collect(),
        ..req.clone()
    }
}

/// Long context on a small GPU: Llama-3-8B QLoRA at s 20480 needs about
/// 19 GiB with its block inputs on the device, more than a 16 GB card
/// offers; the search offloads the checkpoints (the rung the job allows)
/// and it fits, with their bytes in the pod's host memory.
#[test]
fn long_context_fits_a_small_gpu_with_offloaded_checkpoints() {
    const SEQ: u32 = 20480;
    let inventory = one_node("Tesla-V100-SXM2-16GB", 16384, 1);
    let req = llama_3_8b_qlora(SEQ);
    let without = without_rung(&req, RetryRung::OffloadActivations);
    assert!(plan_with(&without, &inventory, &opts()).is_err());
    let plan = plan_with(&req, &inventory, &opts()).expect("fits with offloaded checkpoints");
    assert!(plan.settings.offload_activations && plan.settings.activation_checkpointing);
    assert!(
        plan.rungs_applied.contains(&RetryRung::OffloadActivations),
        "{plan:?}"
    );
    assert!(plan.fits(), "{}", plan.fit);
    assert!(plan.stages[0].memory.host_bytes >= 31 * u64::from(SEQ) * 4096 * 2);
}

/// The 8 GB target as the search meets it: Llama-3-8B QLoRA nf4 at
/// s 2048 on an 8 GB card. With its 1.05 GB embedding on the device the
/// job does not fit; the search keeps the frozen embedding in host memory
/// (the rung the job allows) and it does, with the table in the pod's
/// host memory.
#[test]
fn llama_3_8b_qlora_fits_an_8_gb_gpu_with_its_embedding_on_the_host() {
    let inventory = one_node("NVIDIA-GeForce-RTX-3070", 8192, 1);
    let req = llama_3_8b_qlora(2048);
    let without = without_rung(&req, RetryRung::OffloadEmbedding);
    assert!(plan_with(&without, &inventory, &opts()).is_err());
    let plan = plan_with(&req, &inventory, &opts()).expect("fits with the embedding on the host");
    assert!(plan.settings.offload_embedding, "{plan:?}");
    assert!(
        plan.rungs_applied.contains(&RetryRung::OffloadEmbedding),
        "{plan:?}"
    );
    assert!(plan.fits(), "{}", plan.fit);
    let memory = &plan.stages[0].memory;
    assert!(memory.total <= 8_000_000_000, "{memory:?}");
    assert!(memory.host_bytes >= 128_256 * 4096 * 2);
    println!("{}: {:?}", plan.settings, memory);
}
