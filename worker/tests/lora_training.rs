//! Training LoRA adapters on a frozen (dense or quantized) base: what moves,
//! what a checkpoint holds, resuming after the retry ladder changed the base
//! format, pipeline stages, and the output (a PEFT adapter + merged weights).
//!
//! The bases are the tiny transformers checkpoints of `tests/fixtures/llama`;
//! the data is the synthetic task (the fixtures have no tokenizer).

use std::path::{Path, PathBuf};
use std::time::Duration;

use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use headroom_planner::{BaseFormat, LoraConfig, Settings, TargetModule};
use headroom_worker::collective::Single;
use headroom_worker::link_auth::LinkKey;
use headroom_worker::model::hf::HfCheckpoint;
use headroom_worker::model::{LmShape, StageLayout, TransformerLm, lora, peft};
use headroom_worker::pipeline::{Hello, Peers, establish};
use headroom_worker::train::{MERGED_DIR, TrainConfig, Trainer};

const SEQUENCE: u32 = 12;

fn base(variant: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/llama")
        .join(variant)
}

fn adapters(targets: &[TargetModule]) -> LoraConfig {
    LoraConfig {
        rank: 4,
        alpha: 8.0,
        dropout: 0.0,
        target_modules: targets.to_vec(),
        block_size: 8,
    }
}

fn config(
    variant: &str,
    lora: LoraConfig,
    format: BaseFormat,
    checkpointing: bool,
    steps: u64,
) -> TrainConfig {
    let checkpoint = HfCheckpoint::open(&base(variant), SEQUENCE).expect("fixture");
    TrainConfig::single_stage(
        checkpoint.shape,
        Settings {
            micro_batch: 2,
            gradient_accumulation: 2,
            activation_checkpointing: checkpointing,
            base_format: format,
            ..Settings::default()
        },
        steps,
        1e-2,
        3,
    )
    .with_pretrained(base(variant))
    .with_adapters(lora)
}

/// The two input rows of the PEFT fixtures.
fn input_ids() -> Vec<Vec<i64>> {
    vec![
        (0..12i64).map(|i| (7 * i + 3) % 96).collect(),
        (0..12i64).map(|i| (95 - 11 * i).rem_euclid(96)).collect(),
    ]
}

fn logits(model: &TransformerLm) -> Vec<f32> {
    let tokens = Tensor::<2, Int>::from_data(
        TensorData::new(input_ids().concat(), [2, 12]),
        &Device::flex(),
    );
    model.forward(tokens).into_data().iter::<f32>().collect()
}

fn factors(trainer: &Trainer) -> Vec<Vec<f32>> {
    lora::stage_adapters(trainer.model(), &trainer.config.layout)
        .iter()
        .flat_map(|a| [a.adapter.a.val(), a.adapter.b.val()])
        .map(|t| t.into_data().iter::<f32>().collect())
        .collect()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "headroom-lora-training-{name}-{}",
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn dense_base(variant: &str) -> TransformerLm {
    let checkpoint = HfCheckpoint::open(&base(variant), SEQUENCE).expect("fixture");
    let shape = LmShape::Llama(checkpoint.shape.clone());
    let layout = StageLayout::whole(&shape);
    let mut model = TransformerLm::new(&shape, &layout, 0, &Device::flex());
    checkpoint.load_stage(&mut model, &layout).expect("load");
    model
}

#[test]
fn checkpoints_hold_the_adapters_and_resume_at_a_stricter_base_format() {
    let root = tempdir("resume");
    let all = adapters(&TargetModule::ALL);
    let mut trainer = Trainer::new(
        config("llama-mha-untied", all.clone(), BaseFormat::Dense, false, 6),
        Device::flex().autodiff(),
    )
    .expect("trainer");
    let untouched = logits(&dense_base("llama-mha-untied"));
    assert_eq!(
        logits(&trainer.model().valid()),
        untouched,
        "B = 0: training starts from the base's logits"
    );
    for _ in 0..2 {
        let loss = trainer.train_step().expect("step").loss.expect("loss");
        assert!(loss.is_finite());
    }
    let dir = trainer.save_checkpoint(&root, 1, None).expect("save");
    let trained = factors(&trainer);
    let trained_logits = logits(&trainer.model().valid());
    assert!(
        max_diff(&trained_logits, &untouched) > 1e-3,
        "the adapters moved"
    );

    // The checkpoint holds factors and their optimizer state, not the base.
    let size = |name: &str| std::fs::metadata(dir.join(name)).expect(name).len();
    let base_bytes = std::fs::metadata(base("llama-mha-untied").join("model.safetensors"))
        .expect("base")
        .len();
    let factor_bytes = 4 * all.trainable_params(
        &HfCheckpoint::open(&base("llama-mha-untied"), SEQUENCE)
            .expect("fixture")
            .shape,
    );
    let total: u64 = ["token.bpk", "block-0000.bpk", "block-0001.bpk", "head.bpk"]
        .iter()
        .map(|f| size(f))
        .sum();
    eprintln!(
        "part files {total} B, optimizer {} B, factors {factor_bytes} B, base {base_bytes} B",
        size("optimizer.bpk")
    );
    assert!(
        total < factor_bytes + 16 * 1024,
        "parts hold the factors only: {total} B"
    );
    assert!(size("token.bpk") < 1024, "no adapter on the embedding");
    assert!(size("optimizer.bpk") < 2 * factor_bytes + 16 * 1024);

    // The retry ladder's order: dense → int8 → nf4 (and a user's int4). Each
    // attempt reloads the base from the original files at its format and
    // continues the same factors; nf4 takes its own block size (64).
    for format in [
        BaseFormat::Dense,
        BaseFormat::Int8,
        BaseFormat::Int4,
        BaseFormat::Nf4,
    ] {
        let lora = LoraConfig {
            block_size: if format == BaseFormat::Nf4 { 64 } else { 8 },
            ..all.clone()
        };
        let mut resumed = Trainer::new(
            config("llama-mha-untied", lora, format, false, 6),
            Device::flex().autodiff(),
        )
        .expect("trainer");
        let found = resumed
            .resume(&root)
            .expect("resume")
            .expect("a checkpoint");
        assert_eq!((found.meta.step, resumed.step), (2, 2), "{format}");
        assert_eq!(factors(&resumed), trained, "{format}: the saved factors");
        let got = logits(&resumed.model().valid());
        let worst = max_diff(&got, &trained_logits);
        eprintln!("{format}: max |logit - dense-base logit| after resume = {worst:.2e}");
        match format {
            BaseFormat::Dense => assert_eq!(got, trained_logits, "dense: exactly the run's model"),
            // Logits of these random fixtures reach ±14; the int4 error is
            // about 127/7 times int8's (0.22 and 3.7 measured), as the levels are.
            BaseFormat::Int8 => assert!(worst < 0.5, "int8: close to the dense run ({worst})"),
            BaseFormat::Int4 => assert!(worst < 5.0, "int4: close to the dense run ({worst})"),
            BaseFormat::Nf4 => assert!(worst < 5.0, "nf4: close to the dense run ({worst})"),
        }
        let loss = resumed.train_step().expect("step").loss.expect("loss");
        assert!(loss.is_finite(), "{format}: trains on");
        assert_eq!(resumed.step, 3);
    }

    // Other adapters are another run: the checkpoint is skipped.
    let mut other = Trainer::new(
        config(
            "llama-mha-untied",
            adapters(&[TargetModule::QProj, TargetModule::VProj]),
            BaseFormat::Dense,
            false,
            6,
        ),
        Device::flex().autodiff(),
    )
    .expect("trainer");
    assert!(other.resume(&root).expect("resume").is_none());
    let _ = std::fs::remove_dir_all(&root);
}

#[test]
fn the_output_is_a_peft_adapter_and_merged_weights() {
    let out = tempdir("output");
    let targets = [
        TargetModule::QProj,
        TargetModule::VProj,
        TargetModule::LmHead,
    ];
    let mut trainer = Trainer::new(
        config(
            "llama-mha-untied",
            adapters(&targets),
            BaseFormat::Dense,
            true,
            3,
        ),
        Device::flex().autodiff(),
    )
    .expect("trainer");
    while !trainer.finished() {
        trainer.train_step().expect("step");
    }
    let file = trainer.save_pretrained(&out).expect("output");
    assert_eq!(file, out.join(peft::ADAPTER_FILE));
    let trained = logits(&trainer.model().valid());

    // The adapter reads back into a fresh adapted base with the same logits.
    let config = peft::read_config(&out).expect("adapter_config.json");
    assert_eq!(config.target_modules, targets.to_vec());
    let layout = trainer.config.layout.clone();
    let fresh = lora::attach(
        dense_base("llama-mha-untied"),
        &config,
        BaseFormat::Dense,
        &layout,
        99,
        &Device::flex(),
    )
    .expect("attach");
    let reread = peft::load_stage(fresh, &layout, &config, &out).expect("read");
    assert_eq!(logits(&reread), trained, "the adapter is the trained one");

    // merged/ is a Hugging Face checkpoint of base + scale·A@B.
    let merged = HfCheckpoint::open(&out.join(MERGED_DIR), SEQUENCE).expect("merged");
    let shape = LmShape::Llama(merged.shape.clone());
    let mut model = TransformerLm::new(&shape, &layout, 0, &Device::flex());
    merged.load_stage(&mut model, &layout).expect("load merged");
    let worst = max_diff(&logits(&model), &trained);
    eprintln!("merged: max |logit - adapted| = {worst:.2e}");
    assert!(worst < 1e-4);

    // For the recorded PEFT check (fixtures/peft/README.md): keep the adapter
    // and the worker's logits where the caller asks.
    if let Ok(keep) = std::env::var("HEADROOM_KEEP_LORA_OUTPUT") {
        let keep = PathBuf::from(keep);
        std::fs::create_dir_all(&keep).expect("keep dir");
        for name in [peft::ADAPTER_FILE, peft::CONFIG_FILE] {
            std::fs::copy(out.join(name), keep.join(name)).expect("copy");
        }
        let logits: Vec<Vec<Vec<f32>>> = trained
            .chunks(12 * 96)
            .map(|row| row.chunks(96).map(<[f32]>::to_vec).collect())
            .collect();
        let expected = serde_json::json!({"input_ids": input_ids(), "logits": logits});
        std::fs::write(keep.join("expected.json"), expected.to_string()).expect("write");
    }
    let _ = std::fs::remove_dir_all(&out);
}

#[test]
fn a_quantized_base_writes_the_adapter_without_merged_weights() {
    let out = tempdir("qlora-output");
    let mut trainer = Trainer::new(
        config(
            "qwen2-gqa-bias",
            adapters(&[TargetModule::QProj, TargetModule::VProj]),
            BaseFormat::Int8,
            false,
            2,
        ),
        Device::flex().autodiff(),
    )
    .expect("trainer");
    while !trainer.finished() {
        trainer.train_step().expect("step");
    }
    trainer.save_pretrained(&out).expect("output");
    assert!(out.join(peft::ADAPTER_FILE).exists());
    assert!(!out.join(MERGED_DIR).exists(), "no merge of a rounded base");
    let _ = std::fs::remove_dir_all(&out);
}

/// Two pipeline stages train the same adapters as one worker (each stage
/// adapts its own layers; the tied embedding is frozen, so no exchange);
/// with an untied model the first stage keeps its embedding in host
/// memory (`offload_embedding`) and the factors are still the same.
#[test]
fn two_stages_train_the_adapters_one_worker_trains() {
    for (variant, checkpointing) in [
        ("llama-gqa-tied", false),
        ("llama-gqa-tied", true),
        ("llama-mha-untied", true),
    ] {
        let offload = variant == "llama-mha-untied";
        let lora = adapters(&[
            TargetModule::QProj,
            TargetModule::VProj,
            TargetModule::DownProj,
        ]);
        let single = {
            let mut trainer = Trainer::new(
                config(variant, lora.clone(), BaseFormat::Dense, checkpointing, 3),
                Device::flex().autodiff(),
            )
            .expect("trainer");
            while !trainer.finished() {
                trainer.train_step().expect("step");
            }
            factors(&trainer)
        };
        let out = tempdir(&format!("pipeline-{variant}-{checkpointing}"));
        let (listeners, peers) = Peers::loopback(2).expect("loopback sockets");
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(k, listener)| {
                let k = k as u32;
                let mut config = config(variant, lora.clone(), BaseFormat::Dense, checkpointing, 3);
                config.layout = StageLayout {
                    layers: k..k + 1,
                    first: k == 0,
                    last: k == 1,
                };
                config.stage = k;
                config.stages = 2;
                config.settings.offload_embedding = offload;
                let (peers, out) = (peers.clone(), out.clone());
                std::thread::spawn(move || {
                    let mut trainer =
                        Trainer::new(config, Device::flex().autodiff()).expect("trainer");
                    assert_eq!(trainer.model().host_token.is_some(), offload && k == 0);
                    let me = Hello {
                        job: "j".into(),
                        namespace: "ns".into(),
                        attempt: 1,
                        stage: k,
                        stages: 2,
                        resume_step: 0,
                    };
                    let mut links = establish(
                        &me,
                        &LinkKey::from_bytes([7; 32]),
                        (k > 0).then_some(listener),
                        &peers,
                        Duration::from_secs(30),
                        Duration::from_secs(60),
                    )
                    .expect("links");
                    while !trainer.finished() {
                        trainer
                            .train_step_with(&mut links, &mut Single)
                            .expect("step");
                    }
                    trainer.save_pretrained(&out).expect("save");
                    factors(&trainer)
                })
            })
            .collect();
        let staged: Vec<Vec<f32>> = handles
            .into_iter()
            .flat_map(|h| h.join().expect("stage"))
            .collect();
        assert_eq!(staged.len(), single.len());
        let worst = staged
            .iter()
            .zip(&single)
            .map(|(a, b)| max_diff(a, b))
            .fold(0.0, f32::max);
        assert!(
            worst < 1e-4,
            "{variant}, checkpointing {checkpointing}: factors differ by {worst}"
        );
        let names = |file: &Path| {
            let bytes = std::fs::read(file).expect("adapter");
            let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
            let mut n: Vec<String> = st.names().into_iter().map(String::from).collect();
            n.sort();
            n
        };
        let got = names(&out.join(peft::ADAPTER_FILE));
        assert_eq!(got.len(), 2 * 2 * 3, "both stages' factors in one adapter");
        assert!(
            got.contains(
                &"base_model.model.model.layers.1.mlp.down_proj.lora_B.weight".to_string()
            )
        );
        let _ = std::fs::remove_dir_all(&out);
    }
}

/// Adapter dropout (PEFT's `lora_dropout`) trains, and a checkpointed block
/// recomputed in backward draws exactly the masks its forward drew: the
/// same run with and without checkpointing ends with the same factors and
/// losses (up to float summation order), while dropout 0.3 ends elsewhere
/// than no dropout.
#[test]
fn adapter_dropout_is_the_same_when_a_checkpointed_block_is_recomputed() {
    let run = |dropout: f64, checkpointing: bool| {
        let lora = LoraConfig {
            dropout,
            ..adapters(&TargetModule::ALL)
        };
        let mut trainer = Trainer::new(
            config(
                "llama-mha-untied",
                lora,
                BaseFormat::Dense,
                checkpointing,
                3,
            ),
            Device::flex().autodiff(),
        )
        .expect("trainer");
        let mut losses = Vec::new();
        while !trainer.finished() {
            losses.push(trainer.train_step().expect("step").loss.expect("loss") as f32);
        }
        (losses, factors(&trainer).concat())
    };
    let (graph_losses, graph) = run(0.3, false);
    let (ckpt_losses, ckpt) = run(0.3, true);
    let (_, plain) = run(0.0, false);
    let recompute = max_diff(&ckpt, &graph);
    let loss_gap = max_diff(&ckpt_losses, &graph_losses);
    let from_plain = max_diff(&graph, &plain);
    eprintln!(
        "dropout 0.3: |factors ckpt - graph| {recompute:.2e}, |losses| {loss_gap:.2e}; |factors - no dropout| {from_plain:.2e}"
    );
    assert!(
        recompute < 1e-5 && loss_gap < 1e-5,
        "{recompute} {loss_gap}"
    );
    assert!(from_plain > 1e-3, "dropout changes training: {from_plain}");
}

/// Every file under `dir`, relative path and bytes, in order.
fn files_under(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(at) = stack.pop() {
        for entry in std::fs::read_dir(&at).expect("read_dir") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                stack.push(path);
            } else {
                let bytes = std::fs::read(&path).expect("read");
                out.push((path.strip_prefix(dir).expect("under").to_path_buf(), bytes));
            }
        }
    }
    out.sort();
    out
}

/// An offloaded embedding (the plan's `offload_embedding`, a GPU rung)
/// waits in host memory and is looked up there: the stage has no token
/// module, and the losses, the adapter, the merged weights and the
/// checkpoint are those of the embedding on the device, bit for bit, over
/// a dense base and over an NF4 one with checkpointing. Either run's
/// checkpoint resumes the other (a retry may add the rung). A tied
/// embedding is the head's weight and stays on the device.
#[test]
fn an_embedding_in_host_memory_trains_and_saves_as_on_the_device() {
    for (format, checkpointing) in [(BaseFormat::Dense, false), (BaseFormat::Nf4, true)] {
        let lora = LoraConfig {
            block_size: if format == BaseFormat::Nf4 { 64 } else { 8 },
            ..adapters(&TargetModule::ALL)
        };
        let make = |offload: bool, steps: u64| {
            let mut config = config(
                "llama-mha-untied",
                lora.clone(),
                format,
                checkpointing,
                steps,
            );
            config.settings.offload_embedding = offload;
            let trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
            let model = trainer.model();
            assert_eq!(model.token.is_none(), offload, "{format}");
            assert_eq!(model.host_token.is_some(), offload, "{format}");
            trainer
        };
        let run = |offload: bool| {
            let out = tempdir(&format!("host-embedding-{format}-{offload}"));
            let mut trainer = make(offload, 3);
            let mut losses = Vec::new();
            while !trainer.finished() {
                losses.extend(trainer.train_step().expect("step").loss);
            }
            trainer
                .save_pretrained(&out.join("output"))
                .expect("output");
            trainer
                .save_checkpoint(&out.join("checkpoints"), 1, None)
                .expect("checkpoint");
            let logits = logits(&trainer.model().valid());
            (losses, logits, out)
        };
        let (device_losses, device_logits, device_out) = run(false);
        let (host_losses, host_logits, host_out) = run(true);
        assert_eq!(device_losses, host_losses, "{format}");
        assert_eq!(device_logits, host_logits, "{format}");
        let (device_files, host_files) = (
            files_under(&device_out.join("output")),
            files_under(&host_out.join("output")),
        );
        assert!(
            device_files.len() >= 2,
            "{format}: adapter and config at least: {:?}",
            device_files.iter().map(|f| &f.0).collect::<Vec<_>>()
        );
        assert!(device_files == host_files, "{format}: the outputs differ");
        // The merged weights (dense base) hold the embedding the host kept.
        if format == BaseFormat::Dense {
            assert!(
                host_files.iter().any(|(p, _)| p.starts_with(MERGED_DIR)),
                "merged weights written"
            );
        }
        // Each run's checkpoint resumes the other's way of keeping it.
        for (root, offload) in [(&device_out, true), (&host_out, false)] {
            let mut resumed = make(offload, 6);
            let found = resumed
                .resume(&root.join("checkpoints"))
                .expect("resume")
                .expect("a checkpoint");
            assert_eq!(found.meta.step, 3);
            assert_eq!(logits(&resumed.model().valid()), device_logits, "{format}");
        }
        let _ = std::fs::remove_dir_all(&device_out);
        let _ = std::fs::remove_dir_all(&host_out);
    }
    // Tied: the head reads the embedding on the device, so it stays.
    let mut config = config(
        "llama-gqa-tied",
        adapters(&[TargetModule::QProj]),
        BaseFormat::Dense,
        false,
        1,
    );
    config.settings.offload_embedding = true;
    let trainer = Trainer::new(config, Device::flex().autodiff()).expect("trainer");
    assert!(trainer.model().token.is_some() && trainer.model().host_token.is_none());
}
