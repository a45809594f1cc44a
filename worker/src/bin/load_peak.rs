//! Load-peak bench: how much memory a pipeline stage takes while
//! it reads its part of a Hugging Face checkpoint, against what it holds
//! afterwards and against the planner's predicted training peak.
//!
//! The bench writes a random Llama-family checkpoint (hidden 1024,
//! intermediate 2816, 8 layers, 16 heads / 4 key-value heads, vocabulary
//! 32,000, untied head: 155.7 M parameters) into a temporary directory in
//! three forms: bf16 in one model.safetensors, f32 in one file, and bf16 in
//! shards of at most 80 MiB with the index (Hugging Face's tensor names and
//! a config.json). Then, for p = 1, 2 and 4 stages (the
//! planner's balanced split), it re-runs itself once per stage (`--child`),
//! so each measurement starts from a fresh process: the child builds the
//! stage on the flex device the worker trains on (Llama parameters stay
//! lazily uninitialised until loaded), resets the kernel's peak-RSS counter
//! (`/proc/self/clear_refs` ← 5), loads the stage with the worker's own
//! [`HfCheckpoint::load_stage`] while a thread samples `RssAnon` and
//! `RssFile` every 0.5 ms, and prints VmRSS/VmHWM before and after as JSON.
//!
//! The parent prints, per stage (medians of `--runs` runs, default 3): the
//! stage's weights in f32 and in the stored dtype, its largest tensor, the
//! RSS before and after the load, the load peak (VmHWM), the transient
//! (peak − RSS after), split into the file-backed pages of the memory-mapped
//! checkpoint and the anonymous rest, the bound the planner should count
//! (docs/benchmarks.md, "Loading a checkpoint"), and the planner's predicted
//! training peak of that stage (flex profile, micro-batch 1, sequence 512,
//! checkpointing on, fp32, AdamW; 1F1B in-flight micro-batches).
//!
//! Usage (release build; debug figures are meaningless):
//!   cargo run --release -p headroom-worker --bin load_peak -- [--runs N] [--only bf16|f32|bf16-sharded] [--dense-only] [--fp32-only]
//!
//! The bf16 checkpoint is also loaded into stages that train in bf16
//! (flex's float dtype set to bf16, as the CUDA worker sets its device's
//! for a bf16 plan), dense and on the nf4 base, beside the CUDA profile's
//! load figure (`--fp32-only` skips that table).

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use headroom_planner::backend::FLEX;
use headroom_planner::memory::{StagePlacement, estimate_stage};
use headroom_planner::search::balanced_split;
use headroom_planner::{
    Backend, BaseFormat, LlamaShape, LoraConfig, ModelShape, Precision, Settings, TargetModule,
};
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm, lora};
use headroom_worker::train::training_device;
use serde_json::{Value, json};

const MIB: f64 = 1024.0 * 1024.0;
const SEQUENCE: u32 = 512;
const HIDDEN: usize = 1024;
const INTERMEDIATE: usize = 2816;
const LAYERS: usize = 8;
const HEADS: usize = 16;
const KV_HEADS: usize = 4;
const VOCABULARY: usize = 32_000;
const STAGE_COUNTS: [u32; 3] = [1, 2, 4];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stored {
    Bf16,
    F32,
}

impl Stored {
    fn torch_dtype(self) -> &'static str {
        match self {
            Stored::Bf16 => "bfloat16",
            Stored::F32 => "float32",
        }
    }

    fn bytes(self) -> u64 {
        match self {
            Stored::Bf16 => 2,
            Stored::F32 => 4,
        }
    }
}

/// A tensor of the generated checkpoint; its bytes are drawn when the writer
/// asks for them, so the parent never holds more than one tensor.
#[derive(Debug)]
struct RandomTensor {
    shape: Vec<usize>,
    stored: Stored,
    /// Norm weights are ones; everything else uniform in ±0.02.
    ones: bool,
    seed: u64,
}

impl RandomTensor {
    fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

impl safetensors::View for RandomTensor {
    fn dtype(&self) -> safetensors::Dtype {
        match self.stored {
            Stored::Bf16 => safetensors::Dtype::BF16,
            Stored::F32 => safetensors::Dtype::F32,
        }
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        let n = self.elements();
        let mut out = Vec::with_capacity(n * self.stored.bytes() as usize);
        let mut state = self.seed;
        for _ in 0..n {
            let x = if self.ones {
                1.0f32
            } else {
                state = headroom_worker::data::splitmix(state);
                ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04
            };
            match self.stored {
                Stored::Bf16 => out.extend_from_slice(&((x.to_bits() >> 16) as u16).to_le_bytes()),
                Stored::F32 => out.extend_from_slice(&x.to_le_bytes()),
            }
        }
        Cow::Owned(out)
    }

    fn data_len(&self) -> usize {
        self.elements() * self.stored.bytes() as usize
    }
}

/// Hugging Face names and shapes ([out, in] for linears) of the whole model.
fn checkpoint_tensors() -> Vec<(String, Vec<usize>)> {
    let (h, f, v) = (HIDDEN, INTERMEDIATE, VOCABULARY);
    let head_dim = HIDDEN / HEADS;
    let (q, kv) = (HEADS * head_dim, KV_HEADS * head_dim);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for layer in 0..LAYERS {
        let p = format!("model.layers.{layer}");
        for (name, shape) in [
            ("self_attn.q_proj.weight", vec![q, h]),
            ("self_attn.k_proj.weight", vec![kv, h]),
            ("self_attn.v_proj.weight", vec![kv, h]),
            ("self_attn.o_proj.weight", vec![h, q]),
            ("mlp.gate_proj.weight", vec![f, h]),
            ("mlp.up_proj.weight", vec![f, h]),
            ("mlp.down_proj.weight", vec![h, f]),
            ("input_layernorm.weight", vec![h]),
            ("post_attention_layernorm.weight", vec![h]),
        ] {
            out.push((format!("{p}.{name}"), shape));
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    out.push(("lm_head.weight".to_string(), vec![v, h]));
    out
}

/// Writes config.json and model.safetensors into `dir` or, with `shard_bytes`,
/// shards of at most that size (a tensor never split, as transformers'
/// `max_shard_size` does) and the index. Returns the bytes on disk and each
/// tensor's file.
fn write_checkpoint(
    dir: &Path,
    stored: Stored,
    shard_bytes: Option<u64>,
) -> (u64, BTreeMap<String, String>) {
    std::fs::create_dir_all(dir).expect("checkpoint dir");
    let config = json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "vocab_size": VOCABULARY,
        "tie_word_embeddings": false,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "torch_dtype": stored.torch_dtype(),
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).expect("JSON"),
    )
    .expect("config.json");
    // Tensors in checkpoint order, grouped into files.
    let mut groups: Vec<Vec<(String, Vec<usize>)>> = vec![Vec::new()];
    let mut in_group = 0u64;
    for (name, shape) in checkpoint_tensors() {
        let bytes = shape.iter().product::<usize>() as u64 * stored.bytes();
        if let Some(max) = shard_bytes
            && in_group > 0
            && in_group + bytes > max
        {
            groups.push(Vec::new());
            in_group = 0;
        }
        in_group += bytes;
        groups.last_mut().expect("a group").push((name, shape));
    }
    let n = groups.len();
    let mut files = BTreeMap::new();
    let mut total = 0;
    let mut seed = 0u64;
    for (i, group) in groups.into_iter().enumerate() {
        let file = if shard_bytes.is_some() {
            format!("model-{:05}-of-{n:05}.safetensors", i + 1)
        } else {
            "model.safetensors".to_string()
        };
        let tensors: Vec<(String, RandomTensor)> = group
            .into_iter()
            .map(|(name, shape)| {
                seed += 1;
                files.insert(name.clone(), file.clone());
                let ones = name.ends_with("norm.weight");
                (
                    name,
                    RandomTensor {
                        shape,
                        stored,
                        ones,
                        seed,
                    },
                )
            })
            .collect();
        let path = dir.join(&file);
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(tensors, Some(metadata), &path).expect("safetensors file");
        total += std::fs::metadata(&path).expect("written").len();
    }
    if shard_bytes.is_some() {
        let index = json!({"metadata": {"total_size": total}, "weight_map": files});
        std::fs::write(
            dir.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&index).expect("JSON"),
        )
        .expect("index");
    }
    (total, files)
}

/// The planner's balanced split: stage `k` of `p`.
fn layout(layers: u32, p: u32, k: u32) -> StageLayout {
    let split = balanced_split(layers, p).expect("p ≤ layers");
    let start: u32 = split[..k as usize].iter().sum();
    StageLayout {
        layers: start..start + split[k as usize],
        first: k == 0,
        last: k + 1 == p,
    }
}

/// Where stage `layout` runs, for the planner: one replica, `in_flight`
/// micro-batches held at once.
fn placement(layout: &StageLayout, in_flight: u32) -> StagePlacement {
    StagePlacement {
        layers: layout.layers.end - layout.layers.start,
        first: layout.first,
        last: layout.last,
        in_flight,
        replicas: 1,
    }
}

/// Memory fields of /proc/self/status, bytes.
#[derive(Clone, Copy, Debug, Default)]
struct Status {
    rss: u64,
    hwm: u64,
    anon: u64,
    file: u64,
}

impl Status {
    fn read() -> Status {
        let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let field = |key: &str| {
            text.lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|kb| kb.parse::<u64>().ok())
                .map_or(0, |kb| kb * 1024)
        };
        Status {
            rss: field("VmRSS:"),
            hwm: field("VmHWM:"),
            anon: field("RssAnon:"),
            file: field("RssFile:"),
        }
    }
}

/// The highest RssAnon, RssFile and their sum seen by a sampling thread.
fn sample_until(stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(u64, u64, u64)> {
    std::thread::spawn(move || {
        let (mut anon, mut file, mut both) = (0, 0, 0);
        loop {
            let s = Status::read();
            anon = anon.max(s.anon);
            file = file.max(s.file);
            both = both.max(s.anon + s.file);
            if stop.load(Ordering::Relaxed) {
                return (anon, file, both);
            }
            std::thread::sleep(Duration::from_micros(500));
        }
    })
}

/// One stage's load in this process; prints one JSON line. `half`: the
/// stage trains in bf16 (flex's default float dtype set to bf16, as the
/// CUDA worker configures its device for a bf16 plan).
fn child(dir: &Path, p: u32, k: u32, format: BaseFormat, half: bool) {
    let checkpoint = HfCheckpoint::open(dir, SEQUENCE).expect("checkpoint");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let layout = layout(shape.layers(), p, k);
    let device = if half {
        let mut device = burn::tensor::Device::flex();
        device
            .configure(burn::tensor::FloatDType::BF16)
            .expect("bf16 before any tensor of this process");
        device.autodiff()
    } else {
        training_device(Backend::Flex, Precision::Fp32).expect("flex device")
    };
    let mut model = TransformerLm::new(&shape, &layout, 0, &device);
    let before = Status::read();
    // Peak RSS from here on only (building the process is not the load).
    let reset = std::fs::write("/proc/self/clear_refs", "5").is_ok();
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = sample_until(stop.clone());
    let start = Instant::now();
    if format.is_quantized() {
        // As the worker loads a QLoRA stage (worker/src/train.rs).
        model = lora::load_quantized(&checkpoint, model, &qlora(), format, &layout, 0, &device)
            .expect("load_quantized");
    } else {
        checkpoint
            .load_stage(&mut model, &layout)
            .expect("load_stage");
    }
    let seconds = start.elapsed().as_secs_f64();
    let after = Status::read();
    stop.store(true, Ordering::Relaxed);
    let (anon_max, file_max, sum_max) = sampler.join().expect("sampler");
    use burn::module::Module;
    let params = model.num_params() as u64;
    println!(
        "{}",
        json!({
            "p": p, "stage": k, "params": params, "seconds": seconds, "hwm_reset": reset,
            "rss_before": before.rss, "hwm_before": before.hwm,
            "anon_before": before.anon, "file_before": before.file,
            "rss_after": after.rss, "hwm_after": after.hwm,
            "anon_after": after.anon, "file_after": after.file,
            "anon_max": anon_max, "file_max": file_max, "sum_max": sum_max,
        })
    );
}

/// Parameters of a stage as the planner counts them.
fn stage_params(shape: &LlamaShape, layout: &StageLayout) -> u64 {
    let mut params = u64::from(layout.layers.end - layout.layers.start) * shape.params_per_layer();
    if layout.first {
        params += shape.embedding_params();
    }
    if layout.last {
        params += shape.head_params();
        if shape.tied_embeddings && !layout.first {
            params += shape.embedding_params();
        }
    }
    params
}

/// What a stage reads of the checkpoint, from the tensors the bench wrote.
#[derive(Debug)]
struct StageTensors {
    /// Elements of all the stage's tensors.
    elements: u64,
    /// The most elements the stage reads from any one file (its mapped pages
    /// stay resident until that file's store is dropped).
    per_file_max: u64,
    /// Elements of the stage's largest tensor, and of its largest linear
    /// weight (the ones transposed on load).
    largest: u64,
    largest_linear: u64,
    /// Elements of the largest linear weight inside a decoder block.
    block_linear: u64,
}

fn stage_tensors(
    checkpoint: &HfCheckpoint,
    layout: &StageLayout,
    files: &BTreeMap<String, String>,
) -> StageTensors {
    let shapes: BTreeMap<String, Vec<usize>> = checkpoint_tensors().into_iter().collect();
    let mut per_file: BTreeMap<&str, u64> = BTreeMap::new();
    let mut t = StageTensors {
        elements: 0,
        per_file_max: 0,
        largest: 0,
        largest_linear: 0,
        block_linear: 0,
    };
    for name in checkpoint.stage_tensor_names(layout) {
        let shape = &shapes[&name];
        let n = shape.iter().product::<usize>() as u64;
        t.elements += n;
        *per_file.entry(files[&name].as_str()).or_default() += n;
        t.largest = t.largest.max(n);
        if shape.len() == 2 && name != "model.embed_tokens.weight" {
            t.largest_linear = t.largest_linear.max(n);
            if name.starts_with("model.layers.") {
                t.block_linear = t.block_linear.max(n);
            }
        }
    }
    t.per_file_max = per_file.values().copied().max().unwrap_or(0);
    t
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    let n = xs.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        xs[n / 2]
    } else {
        (xs[n / 2 - 1] + xs[n / 2]) / 2.0
    }
}

fn run_child(exe: &Path, dir: &Path, p: u32, k: u32, format: BaseFormat) -> Value {
    run_child_at(exe, dir, p, k, format, false)
}

fn run_child_at(exe: &Path, dir: &Path, p: u32, k: u32, format: BaseFormat, half: bool) -> Value {
    let out = Command::new(exe)
        .arg("--child")
        .arg(dir)
        .arg(p.to_string())
        .arg(k.to_string())
        .arg(format.to_string())
        .arg(if half { "bf16" } else { "fp32" })
        .output()
        .expect("child");
    assert!(
        out.status.success(),
        "child p={p} k={k} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout.lines().last().expect("child output");
    serde_json::from_str(line).expect("child JSON")
}

/// Removes the temporary checkpoints however the bench ends.
#[derive(Debug)]
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A checkpoint the bench writes and loads.
#[derive(Clone, Copy, Debug)]
struct Variant {
    name: &'static str,
    stored: Stored,
    /// Shard size, as transformers' `max_shard_size`; `None`: one file.
    shard_bytes: Option<u64>,
}

const VARIANTS: [Variant; 3] = [
    Variant {
        name: "bf16",
        stored: Stored::Bf16,
        shard_bytes: None,
    },
    Variant {
        name: "f32",
        stored: Stored::F32,
        shard_bytes: None,
    },
    Variant {
        name: "bf16-sharded",
        stored: Stored::Bf16,
        shard_bytes: Some(80 << 20),
    },
];

fn bench(
    variant: Variant,
    runs: usize,
    formats: &[BaseFormat],
    half: bool,
    root: &Path,
    exe: &Path,
) {
    let stored = variant.stored;
    let dir = root.join(variant.name);
    let start = Instant::now();
    let (size, files) = write_checkpoint(&dir, stored, variant.shard_bytes);
    let n_files = files
        .values()
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    println!(
        "\n{} checkpoint: {:.1} MiB on disk in {n_files} file(s), written in {:.1} s ({})",
        variant.name,
        size as f64 / MIB,
        start.elapsed().as_secs_f64(),
        dir.display()
    );
    let checkpoint = HfCheckpoint::open(&dir, SEQUENCE).expect("checkpoint");
    let shape = checkpoint.shape.clone();
    let model = ModelShape::Llama(shape.clone());
    let settings = Settings {
        activation_checkpointing: true,
        ..Settings::default()
    };
    let mut dense_peaks = BTreeMap::new();
    print_dense_header();
    let table = DenseTable {
        checkpoint: &checkpoint,
        files: &files,
        stored,
        model: &model,
        settings: &settings,
        runs,
        dir: &dir,
        exe,
    };
    for p in STAGE_COUNTS {
        for k in 0..p {
            dense_peaks.insert((p, k), table.stage_row(p, k));
        }
    }
    for &format in formats {
        qlora_table(format, runs, &dir, exe, &model, &settings, &dense_peaks);
    }
    if half && stored == Stored::Bf16 {
        half_table(runs, &dir, exe, &model, &tensor_sizes(&shape));
    }
}

/// The dense table's two header lines.
fn print_dense_header() {
    let header = [
        [
            "p",
            "stage",
            "layers",
            "W f32",
            "W stored",
            "largest",
            "before",
            "after",
            "peak",
            "transient",
            "file pg",
            "anon",
            "bound",
            "pk−before",
            "train",
            "peak/",
            "load",
        ],
        [
            "",
            "",
            "",
            "MiB",
            "MiB",
            "st/f32",
            "RSS",
            "RSS",
            "VmHWM",
            "pk−after",
            "max",
            "rest",
            "F+kC+2kB",
            "−W",
            "pred",
            "train",
            "s",
        ],
    ];
    for row in header {
        println!(
            "{:>3} {:>5} {:>6} {:>7} {:>8} {:>9} {:>7} {:>7} {:>7} {:>9} {:>7} {:>6} {:>8} {:>9} {:>7} {:>6} {:>5}",
            row[0],
            row[1],
            row[2],
            row[3],
            row[4],
            row[5],
            row[6],
            row[7],
            row[8],
            row[9],
            row[10],
            row[11],
            row[12],
            row[13],
            row[14],
            row[15],
            row[16],
        );
    }
}

/// What the rows of one checkpoint's dense table share.
struct DenseTable<'a> {
    checkpoint: &'a HfCheckpoint,
    /// Each tensor's file.
    files: &'a BTreeMap<String, String>,
    stored: Stored,
    model: &'a ModelShape,
    settings: &'a Settings,
    runs: usize,
    dir: &'a Path,
    exe: &'a Path,
}

impl DenseTable<'_> {
    /// Loads stage `k` of `p` in `runs` child processes, prints its row
    /// and returns its median peak (VmHWM).
    fn stage_row(&self, p: u32, k: u32) -> f64 {
        let shape = &self.checkpoint.shape;
        let layout = layout(shape.layers, p, k);
        let params = stage_params(shape, &layout);
        let tensors = stage_tensors(self.checkpoint, &layout, self.files);
        assert_eq!(
            tensors.elements, params,
            "stage parameters, planner vs checkpoint"
        );
        let w_f32 = params * 4;
        let w_stored = params * self.stored.bytes();
        let predicted = estimate_stage(
            self.model,
            None,
            self.settings,
            placement(&layout, p - k),
            &FLEX,
            1.0,
        )
        .total as f64;
        let results: Vec<Value> = (0..self.runs)
            .map(|_| run_child(self.exe, self.dir, p, k, BaseFormat::Dense))
            .collect();
        let get = |key: &str| values(&results, key);
        let diff = |a: &str, b: &str| differences(&results, a, b);
        let loaded = results[0]["params"].as_u64().expect("params");
        assert_eq!(loaded, params, "the stage's parameters, planner vs loaded");
        if !results
            .iter()
            .all(|r| r["hwm_reset"].as_bool() == Some(true))
        {
            println!("  (VmHWM could not be reset: the peak includes the process's start)");
        }
        let before = median(get("rss_before"));
        let after = median(get("rss_after"));
        let peak = median(get("hwm_after"));
        let transient = median(diff("hwm_after", "rss_after"));
        let file = median(diff("file_max", "file_before"));
        let over_weights = median(diff("hwm_after", "rss_before")) - w_f32 as f64;
        // The bound on what the load takes beyond the f32 weights, in
        // stored bytes: F, the stage's bytes in the file it reads most
        // from (mapped pages, released when that file's store is
        // dropped), + k × its largest converted tensor (the copies made
        // while converting it: a cast from bf16, or the transpose of a
        // linear) + 2k × its largest block linear (freed conversion
        // buffers the allocator keeps); k = 1 when the load casts, 2 for
        // an f32 checkpoint (which is only transposed).
        let (k_copies, converted) = match self.stored {
            Stored::F32 => (2, tensors.largest_linear),
            Stored::Bf16 => (1, tensors.largest),
        };
        let formula =
            ((tensors.per_file_max + k_copies * converted + 2 * k_copies * tensors.block_linear)
                * self.stored.bytes()) as f64;
        println!(
            "{:>3} {:>5} {:>6} {:>7.1} {:>8.1} {:>4.0}/{:<4.0} {:>7.1} {:>7.1} {:>7.1} {:>9.1} {:>7.1} {:>6.1} {:>8.1} {:>9.1} {:>7.1} {:>6.2} {:>5.2}",
            p,
            k,
            format!("{}-{}", layout.layers.start, layout.layers.end - 1),
            w_f32 as f64 / MIB,
            w_stored as f64 / MIB,
            (tensors.largest * self.stored.bytes()) as f64 / MIB,
            (tensors.largest * 4) as f64 / MIB,
            before / MIB,
            after / MIB,
            peak / MIB,
            transient / MIB,
            file / MIB,
            (transient - file) / MIB,
            formula / MIB,
            over_weights / MIB,
            predicted / MIB,
            peak / predicted,
            median(get("seconds")),
        );
        peak
    }
}

/// The largest checkpoint tensor and the largest decoder block, in values.
fn tensor_sizes(shape: &LlamaShape) -> (u64, u64) {
    let (h, i, v) = (
        u64::from(shape.hidden),
        u64::from(shape.intermediate),
        u64::from(shape.vocabulary),
    );
    let (q, kv) = (shape.q_dim(), shape.kv_dim());
    (v * h, 2 * h * q + 2 * h * kv + 3 * h * i)
}

/// A bf16 checkpoint loaded into stages that train in bf16, as the CUDA
/// worker loads a bf16 plan: dense and on the nf4 base. What the load adds
/// beyond the weights it keeps, in anonymous memory (the checkpoint's
/// mapped pages are file-backed and, on a GPU, host memory), against one
/// bf16 and one f32 copy of the largest tensor, and what the CUDA profile
/// says the device holds beside its weights at the load's peak (`CUDA
/// +load`): on the CPU host and device are one memory, so the anonymous
/// transient bounds the device's share from above.
fn half_table(runs: usize, dir: &Path, exe: &Path, model: &ModelShape, sizes: &(u64, u64)) {
    use headroom_planner::backend::CUDA;
    let ModelShape::Llama(shape) = model else {
        unreachable!("a Llama checkpoint")
    };
    let (largest, block) = *sizes;
    println!(
        "\n  bf16 stages (flex's float dtype bf16, as a CUDA bf16 plan): largest tensor {:.1} MiB in bf16 ({:.1} in f32), one dense block {:.1} MiB in bf16",
        (largest * 2) as f64 / MIB,
        (largest * 4) as f64 / MIB,
        (block * 2) as f64 / MIB
    );
    println!(
        "{:>6} {:>3} {:>5} {:>8} {:>8} {:>9} {:>8} {:>8} {:>10} {:>10}",
        "base",
        "p",
        "stage",
        "held MiB",
        "peak MiB",
        "transient",
        "file pg",
        "anon",
        "CUDA W",
        "CUDA +load"
    );
    for format in [BaseFormat::Dense, BaseFormat::Nf4] {
        let settings = Settings {
            activation_checkpointing: true,
            precision: Precision::Bf16,
            base_format: format,
            ..Settings::default()
        };
        let adapters = format.is_quantized().then(qlora);
        for p in [1, 2] {
            for k in 0..p {
                let layout = layout(shape.layers, p, k);
                let predicted = estimate_stage(
                    model,
                    adapters.as_ref(),
                    &settings,
                    placement(&layout, p - k),
                    &CUDA,
                    1.0,
                );
                let results: Vec<Value> = (0..runs)
                    .map(|_| run_child_at(exe, dir, p, k, format, true))
                    .collect();
                let diff = |a: &str, b: &str| differences(&results, a, b);
                let transient = median(diff("hwm_after", "rss_after"));
                let file = median(diff("file_max", "file_before"));
                // The CUDA figure without its context and slack, less the
                // weights: what it says the device holds beside them at the
                // load's peak.
                let device_load = (predicted.load_peak - CUDA.fixed_overhead_bytes) as f64
                    / (1.0 + CUDA.state_slack)
                    - predicted.weights as f64;
                println!(
                    "{:>6} {:>3} {:>5} {:>8.1} {:>8.1} {:>9.1} {:>8.1} {:>8.1} {:>10.1} {:>10.1}",
                    format.to_string(),
                    p,
                    k,
                    median(diff("rss_after", "rss_before")) / MIB,
                    median(diff("hwm_after", "rss_before")) / MIB,
                    transient / MIB,
                    file / MIB,
                    (transient - file) / MIB,
                    predicted.weights as f64 / MIB,
                    device_load / MIB,
                );
            }
        }
    }
}

/// One figure of every run's JSON line.
fn values(results: &[Value], key: &str) -> Vec<f64> {
    results
        .iter()
        .map(|r| r[key].as_f64().expect("number"))
        .collect()
}

/// `a − b` of every run's JSON line.
fn differences(results: &[Value], a: &str, b: &str) -> Vec<f64> {
    values(results, a)
        .into_iter()
        .zip(values(results, b))
        .map(|(x, y)| x - y)
        .collect()
}

/// The adapters of the QLoRA rows: Unsloth's defaults (rank 16, alpha 32,
/// every block linear), quantized in blocks of 64.
fn qlora() -> LoraConfig {
    LoraConfig {
        rank: 16,
        alpha: 32.0,
        dropout: 0.0,
        target_modules: TargetModule::ALL
            .into_iter()
            .filter(|m| m.per_layer())
            .collect(),
        block_size: 64,
    }
}

/// The same stages loaded as the worker loads a QLoRA stage (`format`
/// int8 or int4): measured peak beside the dense load's and the planner's
/// `load_peak`.
fn qlora_table(
    format: BaseFormat,
    runs: usize,
    dir: &Path,
    exe: &Path,
    model: &ModelShape,
    settings: &Settings,
    dense_peaks: &BTreeMap<(u32, u32), f64>,
) {
    let ModelShape::Llama(shape) = model else {
        unreachable!("a Llama checkpoint")
    };
    let settings = Settings {
        base_format: format,
        ..*settings
    };
    let adapters = qlora();
    println!(
        "  QLoRA {format} (rank {}, all 7 block linears, block {}): the same stages, loaded with lora::load_quantized",
        adapters.rank, adapters.block_size
    );
    println!(
        "{:>3} {:>5} {:>6} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>9} {:>7} {:>6} {:>8} {:>6} {:>7} {:>5}",
        "p",
        "stage",
        "layers",
        "W f32",
        "W held",
        "before",
        "after",
        "dense",
        "peak",
        "transient",
        "file pg",
        "anon",
        "load",
        "peak/",
        "train",
        "load"
    );
    println!(
        "{:>3} {:>5} {:>6} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>9} {:>7} {:>6} {:>8} {:>6} {:>7} {:>5}",
        "",
        "",
        "",
        "MiB",
        "pred",
        "RSS",
        "RSS",
        "peak",
        "VmHWM",
        "pk−after",
        "max",
        "rest",
        "pred",
        "load",
        "pred",
        "s"
    );
    for p in STAGE_COUNTS {
        for k in 0..p {
            let layout = layout(shape.layers, p, k);
            let w_f32 = stage_params(shape, &layout) * 4;
            let predicted = estimate_stage(
                model,
                Some(&adapters),
                &settings,
                placement(&layout, p - k),
                &FLEX,
                1.0,
            );
            let results: Vec<Value> = (0..runs)
                .map(|_| run_child(exe, dir, p, k, format))
                .collect();
            let get = |key: &str| values(&results, key);
            let diff = |a: &str, b: &str| differences(&results, a, b);
            let peak = median(get("hwm_after"));
            let transient = median(diff("hwm_after", "rss_after"));
            let file = median(diff("file_max", "file_before"));
            let load = predicted.load_peak as f64;
            println!(
                "{:>3} {:>5} {:>6} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>7.1} {:>9.1} {:>7.1} {:>6.1} {:>8.1} {:>6.2} {:>7.1} {:>5.2}",
                p,
                k,
                format!("{}-{}", layout.layers.start, layout.layers.end - 1),
                w_f32 as f64 / MIB,
                predicted.weights as f64 / MIB,
                median(get("rss_before")) / MIB,
                median(get("rss_after")) / MIB,
                dense_peaks.get(&(p, k)).copied().unwrap_or(f64::NAN) / MIB,
                peak / MIB,
                transient / MIB,
                file / MIB,
                (transient - file) / MIB,
                load / MIB,
                peak / load,
                predicted.training_total() as f64 / MIB,
                median(get("seconds")),
            );
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("--child") {
        let dir = PathBuf::from(&args[1]);
        let p = args[2].parse().expect("p");
        let k = args[3].parse().expect("stage");
        let format = match args.get(4).map(String::as_str) {
            Some("int8") => BaseFormat::Int8,
            Some("int4") => BaseFormat::Int4,
            Some("nf4") => BaseFormat::Nf4,
            _ => BaseFormat::Dense,
        };
        child(
            &dir,
            p,
            k,
            format,
            args.get(5).map(String::as_str) == Some("bf16"),
        );
        return;
    }
    let mut runs = 3;
    let mut variants = VARIANTS.to_vec();
    let mut formats = vec![BaseFormat::Int8, BaseFormat::Int4, BaseFormat::Nf4];
    let mut half = true;
    let mut it = args.iter();
    while let Some(arg) = it.next() {
        match arg.as_str() {
            "--runs" => runs = it.next().and_then(|v| v.parse().ok()).expect("--runs N"),
            "--only" => {
                let name = it.next().expect("--only NAME");
                variants.retain(|v| v.name == name.as_str());
                assert!(!variants.is_empty(), "--only bf16|f32|bf16-sharded");
            }
            "--dense-only" => formats.clear(),
            "--fp32-only" => half = false,
            other => panic!(
                "unknown argument {other}; use --runs N, --only bf16|f32|bf16-sharded, --dense-only, --fp32-only"
            ),
        }
    }
    if cfg!(debug_assertions) {
        eprintln!("warning: a debug build; measure with --release");
    }
    let exe = std::env::current_exe().expect("own path");
    let root =
        TempDir(std::env::temp_dir().join(format!("headroom-load-peak-{}", std::process::id())));
    println!(
        "Load peak per stage: Llama hidden {HIDDEN}, intermediate {INTERMEDIATE}, {LAYERS} layers, \
         {HEADS}/{KV_HEADS} heads, vocabulary {VOCABULARY}, untied head; flex; medians of {runs} runs.\n\
         before/after: VmRSS around load_stage; peak: VmHWM after it (reset just before);\n\
         transient = peak − after = file pg (the mapped checkpoint's pages, sampled max) + anon rest;\n\
         bound = F + k·C + 2k·B, stored bytes: F the stage's bytes in the file it reads most of, C its largest\n\
         converted tensor, B its largest block linear; k = 1 (bf16, cast) or 2 (f32, transposed only);\n\
         pk−before−W: what the load takes beyond the stage's f32 weights;\n\
         train pred: estimate_stage (flex profile, micro-batch 1, seq {SEQUENCE}, checkpointing, fp32, AdamW, 1F1B)"
    );
    for variant in variants {
        bench(variant, runs, &formats, half, &root.0, &exe);
        let _ = std::fs::remove_dir_all(root.0.join(variant.name));
    }
}
