//! Loading streams: a stage reads its checkpoint tensor by tensor, so the
//! process's memory during the load is what the model keeps plus the
//! tensor in flight, not its share of the file on top.
//!
//! The test writes an f32 Llama checkpoint of 12 decoder layers (58 MiB,
//! largest tensor 4 MiB) and loads it in a fresh process (this test binary
//! again, `load_in_a_child`), which resets its peak resident size
//! (`/proc/self/clear_refs` ← 5) after building the (lazily allocated)
//! stage and reads VmHWM after loading it, with the allocator settings of a
//! worker pod. The load's transient (the peak over what the process holds
//! after it) must stay below 2 × the largest tensor (its read buffer and
//! its transposed copy) + [`TRANSIENT_SLACK`], and the peak's rise below
//! the model's bytes + 2 × the largest tensor + [`KEPT_SLACK`].
//!
//! Measured (debug build, 2026-12-02): rise 75.0 MiB, 67.0 MiB kept after,
//! transient 8.0 MiB. The memory-mapped load this replaced (burn-store's
//! `SafetensorsStore`, which kept every page it had read resident until the
//! file was done) rose 132.5 MiB with 68.5 MiB kept after: a transient of
//! 64 MiB, the file's 56 MiB on top of the tensor in flight; it fails both
//! bounds.

use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::process::Command;

use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm};
use serde_json::json;

const MIB: f64 = 1024.0 * 1024.0;
const HIDDEN: usize = 256;
const INTERMEDIATE: usize = 1024;
const LAYERS: usize = 12;
const HEADS: usize = 4;
const VOCABULARY: usize = 4096;
/// What the process keeps after the load beyond the model's bytes (the
/// allocator's and burn's; 11–12.5 MiB measured, the same with either
/// loader) with room to spare.
const KEPT_SLACK: u64 = 16 << 20;
/// Allowed transient (peak − resident after the load) beyond twice the
/// largest tensor: measured 0 (transient 8.0 MiB = 2 × 4 MiB).
const TRANSIENT_SLACK: u64 = 4 << 20;
/// Where the child finds the checkpoint (unset: the child test does nothing).
const CHILD_DIR: &str = "HEADROOM_STREAMING_LOAD_DIR";

/// One f32 tensor of the generated checkpoint, drawn when written.
struct Generated {
    shape: Vec<usize>,
    seed: u64,
}

impl safetensors::View for Generated {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        let mut state = self.seed;
        let out: Vec<u8> = (0..self.shape.iter().product::<usize>())
            .flat_map(|_| {
                state = headroom_worker::data::splitmix(state);
                (((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04).to_le_bytes()
            })
            .collect();
        Cow::Owned(out)
    }
    fn data_len(&self) -> usize {
        self.shape.iter().product::<usize>() * 4
    }
}

/// Hugging Face names and shapes of the whole model.
fn tensors() -> Vec<(String, Vec<usize>)> {
    let (h, f, v) = (HIDDEN, INTERMEDIATE, VOCABULARY);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for layer in 0..LAYERS {
        for (name, shape) in [
            ("self_attn.q_proj.weight", vec![h, h]),
            ("self_attn.k_proj.weight", vec![h, h]),
            ("self_attn.v_proj.weight", vec![h, h]),
            ("self_attn.o_proj.weight", vec![h, h]),
            ("mlp.gate_proj.weight", vec![f, h]),
            ("mlp.up_proj.weight", vec![f, h]),
            ("mlp.down_proj.weight", vec![h, f]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
        ] {
            out.push((format!("model.layers.{layer}.{name}"), shape));
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    out.push(("lm_head.weight".to_string(), vec![v, h]));
    out
}

fn write_checkpoint(dir: &Path) {
    std::fs::create_dir_all(dir).expect("dir");
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": HEADS,
        "vocab_size": VOCABULARY,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
    });
    std::fs::write(dir.join("config.json"), config.to_string()).expect("config.json");
    let generated: Vec<(String, Generated)> = tensors()
        .into_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let seed = i as u64 + 1;
            (name, Generated { shape, seed })
        })
        .collect();
    safetensors::serialize_to_file(generated, None, &dir.join("model.safetensors"))
        .expect("model.safetensors");
}

/// VmRSS and VmHWM, bytes.
fn status() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or_else(|| panic!("no {key} in /proc/self/status"))
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// The child: builds the whole model as one stage, resets the peak, loads
/// the checkpoint, prints `rise model_bytes largest_bytes`.
#[test]
fn load_in_a_child() {
    let Some(dir) = std::env::var_os(CHILD_DIR).map(PathBuf::from) else {
        return;
    };
    let checkpoint = HfCheckpoint::open(&dir, 64).expect("checkpoint");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let layout = StageLayout::whole(&shape);
    let device = burn::tensor::Device::flex().autodiff();
    let mut model = TransformerLm::new(&shape, &layout, 7, &device);
    std::fs::write("/proc/self/clear_refs", "5").expect("reset the peak resident size");
    let (before, _) = status();
    checkpoint
        .load_stage(&mut model, &layout)
        .expect("load the stage");
    let (after, peak) = status();
    let elements: usize = tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum();
    let largest = tensors()
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .max()
        .expect("tensors");
    println!(
        "LOAD {} {} {} {}",
        peak - before,
        after.saturating_sub(before),
        elements * 4,
        largest * 4
    );
    drop(model);
}

#[test]
fn a_load_holds_the_model_and_one_tensor_not_the_file() {
    let dir: PathBuf =
        std::env::temp_dir().join(format!("headroom-streaming-load-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    write_checkpoint(&dir);
    let file_bytes = std::fs::metadata(dir.join("model.safetensors"))
        .expect("written")
        .len();
    let out = Command::new(std::env::current_exe().expect("this test binary"))
        .args([
            "--exact",
            "load_in_a_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, &dir)
        // The allocator as the operator sets it in every worker pod.
        .env(
            headroom_api::contract::MALLOC_ARENA_MAX_ENV,
            headroom_api::contract::WORKER_MALLOC_ARENAS,
        )
        .env(
            headroom_api::contract::MALLOC_TUNABLES_ENV,
            headroom_api::contract::WORKER_MALLOC_TUNABLES,
        )
        .output()
        .expect("run the child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "child failed: {stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let figures: Vec<u64> = stdout
        .lines()
        // libtest may print the test's name on the same line first.
        .find_map(|l| l.split_once("LOAD ").map(|(_, figures)| figures))
        .expect("the child's figures")
        .split_whitespace()
        .map(|n| n.parse().expect("a number"))
        .collect();
    let [rise, kept, model, largest] = figures[..] else {
        panic!("four figures: {figures:?}");
    };
    let bound = model + 2 * largest + KEPT_SLACK;
    let transient = rise.saturating_sub(kept);
    let transient_bound = 2 * largest + TRANSIENT_SLACK;
    println!(
        "load: peak rise {:.1} MiB (bound {:.1}), kept after {:.1} MiB, transient {:.1} MiB (bound {:.1}); model {:.1} MiB, largest tensor {:.1} MiB, file {:.1} MiB",
        rise as f64 / MIB,
        bound as f64 / MIB,
        kept as f64 / MIB,
        transient as f64 / MIB,
        transient_bound as f64 / MIB,
        model as f64 / MIB,
        largest as f64 / MIB,
        file_bytes as f64 / MIB,
    );
    // The bounds discriminate: the file held besides the model breaks both.
    assert!(model + file_bytes > bound + (16 << 20));
    assert!(file_bytes > transient_bound + (16 << 20));
    assert!(
        transient <= transient_bound,
        "the load's peak was {:.1} MiB over what it left, more than twice its largest tensor and {:.0} MiB ({:.1} MiB)",
        transient as f64 / MIB,
        TRANSIENT_SLACK as f64 / MIB,
        transient_bound as f64 / MIB
    );
    assert!(
        rise <= bound,
        "the load's peak rose {:.1} MiB, over the model, twice its largest tensor and {:.0} MiB ({:.1} MiB)",
        rise as f64 / MIB,
        KEPT_SLACK as f64 / MIB,
        bound as f64 / MIB
    );
    let _ = std::fs::remove_dir_all(&dir);
}
