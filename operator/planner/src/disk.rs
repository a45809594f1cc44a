//! The bytes a job keeps on its checkpoint claim: the pretrained model and
//! the data when they are downloaded onto it, the checkpoints the worker
//! keeps, and the trained model written at the end; and the claim size that
//! holds them ([`DiskBreakdown::claim_bytes`]).
//!
//! Counted from what the planner knows of the model (its parameters and the
//! checkpoint's stored dtype) and the plan's settings (precision, optimizer,
//! adapters), so a plan that changes them (a retry rung) changes the count.
//! The checkpoint count follows the worker's writer: [`CHECKPOINTS_KEPT`]
//! complete steps are kept, and a new step is written in full before the
//! oldest is pruned, so one more is on the claim while it is written.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::adapters::LoraConfig;
use crate::model::ModelShape;
use crate::training::Settings;
use crate::units::{GIB, KIB, MIB, format_bytes};

/// Complete checkpoint steps the worker keeps on the claim (it prunes older
/// ones after each write). Shared with the worker's checkpoint writer, so
/// the count here cannot drift from what it keeps.
pub const CHECKPOINTS_KEPT: u32 = 2;

/// Hub data whose size is not known yet (before the initializer has read
/// it): what the plan allows for it, bytes.
pub const DATA_ALLOWANCE_BYTES: u64 = GIB;

/// Downloaded data known by its tokens (the initializer reports those, not
/// its files' bytes): bytes a token, for text at some 4 bytes a token with
/// JSON or Parquet framing around it.
pub const DATA_BYTES_PER_TOKEN: u64 = 8;

/// The files beside a pretrained checkpoint's weights (config.json, the
/// tokenizer, generation config), which the planner does not size: an
/// allowance, bytes (a large tokenizer.json is some 30 MiB).
pub const MODEL_FILES_ALLOWANCE_BYTES: u64 = 64 * MIB;

/// Each checkpoint stage directory's `meta.json` (names, sizes, CRC-32s) and
/// the file system's blocks: an allowance per worker, bytes.
const CHECKPOINT_META_BYTES: u64 = 64 * KIB;

/// Added to a fifth more than the plan's bytes when sizing its claim, bytes.
pub const CLAIM_SLACK_BYTES: u64 = 256 * MIB;

/// LoRA adapter factors are trained and written in f32, bytes per element.
const ADAPTER_BYTES: u64 = 4;

/// What the planner cannot see from the request: where the job's files are.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DiskInputs {
    /// The pretrained checkpoint is downloaded onto the claim (a Hugging
    /// Face model; a model read from another claim is not).
    pub model_on_claim: bool,
    /// The pretrained checkpoint's weight files, bytes, when measured (the
    /// initializer's report); `None`: parameters × the stored dtype's bytes.
    pub model_file_bytes: Option<u64>,
    /// The data downloaded onto the claim (Hugging Face data).
    pub data: DataOnClaim,
    /// The trained model is written to the claim at the end (a pretrained
    /// model's job without `spec.output`, which names another claim).
    pub output_on_claim: bool,
}

/// The data a job keeps on its claim.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DataOnClaim {
    /// Read from another claim, or generated: nothing on this one.
    #[default]
    None,
    /// Downloaded, this many bytes.
    Bytes(u64),
    /// Downloaded, this many tokens: [`DATA_BYTES_PER_TOKEN`] each.
    Tokens(u64),
    /// Downloaded, size not known yet: [`DATA_ALLOWANCE_BYTES`].
    Unknown,
}

/// The bytes one job keeps on its checkpoint claim, by what they are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct DiskBreakdown {
    /// The pretrained checkpoint downloaded onto the claim (weights and an
    /// allowance for its other files), bytes; 0 when it is read from
    /// another claim or there is none.
    pub model_bytes: u64,
    /// The data downloaded onto the claim, bytes; 0 when it is read from
    /// another claim.
    pub data_bytes: u64,
    /// Set when `dataBytes` is estimated (from the data's tokens, or an
    /// allowance before the initializer has read it), not measured.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub data_estimated: bool,
    /// One checkpoint step, all stages and replicas, bytes: the trained
    /// weights (with LoRA, only the adapter factors) and the optimizer state
    /// with its f32 master copy.
    pub checkpoint_bytes: u64,
    /// Checkpoint steps on the claim at once: the ones the worker keeps and
    /// the one being written before the oldest is pruned.
    pub checkpoints: u32,
    /// The trained model written at the end (the whole model, or a LoRA
    /// adapter with the merged model over a dense base), bytes; 0 when it
    /// goes to another claim.
    pub output_bytes: u64,
    /// The sum, bytes.
    pub total_bytes: u64,
    /// The claim size this plan asks for: the sum with a fifth more and
    /// 256 MiB (the file system's own, what the estimate missed), rounded
    /// up to whole GiB ([`claim_for`]).
    pub claim_bytes: u64,
}

impl DiskBreakdown {
    /// `model 13.5 GiB + data 1.0 GiB (estimated) + 3 × checkpoint 160 MiB + output 13.6 GiB = 28.5 GiB; claim 35Gi`.
    pub fn summary(&self) -> String {
        let mut terms = Vec::new();
        if self.model_bytes > 0 {
            terms.push(format!("model {}", format_bytes(self.model_bytes)));
        }
        if self.data_bytes > 0 {
            let estimated = if self.data_estimated {
                " (estimated)"
            } else {
                ""
            };
            terms.push(format!("data {}{estimated}", format_bytes(self.data_bytes)));
        }
        terms.push(format!(
            "{} × checkpoint {}",
            self.checkpoints,
            format_bytes(self.checkpoint_bytes)
        ));
        if self.output_bytes > 0 {
            terms.push(format!("output {}", format_bytes(self.output_bytes)));
        }
        format!(
            "{} = {}; claim {}",
            terms.join(" + "),
            format_bytes(self.total_bytes),
            quantity(self.claim_bytes)
        )
    }
}

/// Bytes of one element as the pretrained checkpoint stores it
/// (`torch_dtype`): 4 for `float32`, 2 for the 16-bit types and when unknown.
fn stored_dtype_bytes(model: &ModelShape) -> u64 {
    match model {
        ModelShape::Llama(l) => match l.torch_dtype.as_deref() {
            Some("float32") => 4,
            _ => 2,
        },
        _ => 2,
    }
}

/// The bytes a plan keeps on its claim, given where the job's files are:
/// `model` trained with `adapters` (the plan's) and `s` (its settings) on
/// `workers` workers. [`crate::Plan::disk_needs`] calls it with the plan's.
pub fn needs(
    model: &ModelShape,
    adapters: Option<&LoraConfig>,
    s: &Settings,
    workers: u32,
    inputs: &DiskInputs,
) -> DiskBreakdown {
    let params = model.total_params();
    let stored = params.saturating_mul(stored_dtype_bytes(model));
    let weights = inputs.model_file_bytes.unwrap_or(stored);
    let model_bytes = if inputs.model_on_claim {
        weights + MODEL_FILES_ALLOWANCE_BYTES
    } else {
        0
    };
    let (data_bytes, data_estimated) = match inputs.data {
        DataOnClaim::None => (0, false),
        DataOnClaim::Bytes(b) => (b, false),
        DataOnClaim::Tokens(t) => (t.saturating_mul(DATA_BYTES_PER_TOKEN), true),
        DataOnClaim::Unknown => (DATA_ALLOWANCE_BYTES, true),
    };

    let adapter_params = match (adapters, model) {
        (Some(lora), ModelShape::Llama(shape)) => Some(lora.trainable_params(shape)),
        _ => None,
    };
    // The part files: every weight at the training precision, or the
    // adapter factors alone (the frozen base is the downloaded checkpoint).
    let (trained, parts) = match adapter_params {
        Some(a) => (a, a * ADAPTER_BYTES),
        None => (params, params.saturating_mul(s.precision.weight_bytes())),
    };
    // The optimizer file: its state in f32 (8-bit AdamW: its bytes) and,
    // training in a half precision, the f32 master copy. Counted whether
    // or not the backend keeps a master copy: a disk estimate may be high.
    let state = s
        .optimizer
        .tensor_state_bytes(trained)
        .saturating_add(trained.saturating_mul(s.precision.master_weight_bytes()));
    let checkpoint_bytes = parts
        .saturating_add(state)
        .saturating_add(CHECKPOINT_META_BYTES * u64::from(workers.max(1)));
    let checkpoints = CHECKPOINTS_KEPT + 1;

    let output_bytes = if inputs.output_on_claim {
        match adapter_params {
            // The adapter, and the merged model over a dense base (a
            // quantized base gets no merged weights).
            Some(a) => {
                let merged = if s.base_format.is_quantized() {
                    0
                } else {
                    weights + MODEL_FILES_ALLOWANCE_BYTES
                };
                a * ADAPTER_BYTES + MODEL_FILES_ALLOWANCE_BYTES + merged
            }
            // Cast back to the stored dtype, beside the copied tokenizer.
            None => weights + MODEL_FILES_ALLOWANCE_BYTES,
        }
    } else {
        0
    };
    let total_bytes = model_bytes
        .saturating_add(data_bytes)
        .saturating_add(checkpoint_bytes.saturating_mul(u64::from(checkpoints)))
        .saturating_add(output_bytes);
    DiskBreakdown {
        model_bytes,
        data_bytes,
        data_estimated,
        checkpoint_bytes,
        checkpoints,
        output_bytes,
        total_bytes,
        claim_bytes: claim_for(total_bytes),
    }
}

/// The claim that holds `total` bytes: a fifth more and 256 MiB (the file
/// system's own, what the estimate missed), in whole GiB.
pub fn claim_for(total: u64) -> u64 {
    let padded = total
        .saturating_add(total / 5)
        .saturating_add(CLAIM_SLACK_BYTES);
    padded.div_ceil(GIB).saturating_mul(GIB)
}

/// `bytes` as a Kubernetes quantity: whole GiB as `40Gi`, else whole MiB
/// (`1536Mi`), else bytes.
pub fn quantity(bytes: u64) -> String {
    if bytes.is_multiple_of(GIB) {
        format!("{}Gi", bytes / GIB)
    } else if bytes.is_multiple_of(MIB) {
        format!("{}Mi", bytes / MIB)
    } else {
        bytes.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::adapters::{BaseFormat, LoraConfig};
    use crate::inventory::{Inventory, NodeFacts};
    use crate::llama::LlamaShape;
    use crate::plan::{JobRequest, Objective, Target};
    use crate::target_module::TargetModule;
    use crate::training::{Optimizer, Precision};

    const LLAMA_2_7B: &str = r#"{"architectures":["LlamaForCausalLM"],"model_type":"llama",
        "hidden_size":4096,"intermediate_size":11008,"num_attention_heads":32,
        "num_hidden_layers":32,"num_key_value_heads":32,"vocab_size":32000,
        "max_position_embeddings":4096,"rms_norm_eps":1e-05,"rope_theta":10000.0,
        "tie_word_embeddings":false,"torch_dtype":"float16"}"#;

    fn llama_job(adapters: Option<LoraConfig>) -> JobRequest {
        JobRequest {
            model: ModelShape::Llama(LlamaShape::from_hf_config(LLAMA_2_7B, 512).expect("config")),
            adapters,
            base_format: BaseFormat::Dense,
            global_batch: 8,
            precision: Precision::Bf16,
            optimizer: Optimizer::Adamw,
            pinned_micro_batch: None,
            pinned_checkpointing: None,
            pinned_stages: None,
            pinned_replicas: None,
            objective: Objective::FewestGpus,
            target: Target::Gpu {
                allowed_types: vec![],
                max_gpus: 8,
                host_baseline_bytes: None,
            },
            headroom_fraction: 0.1,
            allowed_rungs: vec![],
        }
    }

    fn h100s() -> Inventory {
        use crate::inventory::{
            LABEL_GPU_COUNT, LABEL_GPU_MEMORY_MIB, LABEL_GPU_PRODUCT, RESOURCE_GPU,
        };
        let labels = [
            (LABEL_GPU_PRODUCT, "NVIDIA-H100-80GB-HBM3"),
            (LABEL_GPU_MEMORY_MIB, "81559"),
            (LABEL_GPU_COUNT, "8"),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        Inventory::from_nodes(&[NodeFacts {
            name: "node-0".into(),
            labels,
            allocatable: [(RESOURCE_GPU.to_string(), 8)].into_iter().collect(),
            in_use: Default::default(),
            schedulable: true,
            allocatable_reported: true,
            host_memory_bytes: None,
        }])
    }

    fn hub() -> DiskInputs {
        DiskInputs {
            model_on_claim: true,
            model_file_bytes: None,
            data: DataOnClaim::Unknown,
            output_on_claim: true,
        }
    }

    /// Llama 2 7B from the hub, fully fine-tuned in bf16 with AdamW: the
    /// download is its fp16 safetensors (~13.5 GB), each checkpoint holds
    /// bf16 weights, two f32 moments and the f32 master copy (14 bytes a
    /// parameter), three are on the claim while one is written, and the
    /// output is the model again: far beyond the 1Gi default.
    #[test]
    fn a_full_fine_tune_of_a_7b_model_needs_hundreds_of_gib() {
        let job = llama_job(None);
        let plan = crate::plan(&job, &h100s()).expect("plan");
        let params = job.model.total_params();
        let d = plan.disk_needs(&job.model, &hub());
        assert_eq!(d.model_bytes, 2 * params + MODEL_FILES_ALLOWANCE_BYTES);
        assert!((13_000_000_000..14_000_000_000).contains(&(2 * params)));
        assert!(d.data_estimated && d.data_bytes == DATA_ALLOWANCE_BYTES);
        assert_eq!(d.checkpoints, CHECKPOINTS_KEPT + 1);
        let per_param = d.checkpoint_bytes as f64 / params as f64;
        assert!((14.0..14.1).contains(&per_param), "{per_param}");
        assert_eq!(d.output_bytes, d.model_bytes);
        assert_eq!(
            d.total_bytes,
            d.model_bytes + d.data_bytes + 3 * d.checkpoint_bytes + d.output_bytes
        );
        assert!(
            d.claim_bytes >= d.total_bytes + d.total_bytes / 5 && d.claim_bytes.is_multiple_of(GIB)
        );
        assert!(d.claim_bytes > 250 * GIB, "{}", d.summary());
        assert!(d.summary().contains("3 × checkpoint"), "{}", d.summary());
    }

    /// The same model with LoRA: the checkpoints hold only the adapter
    /// factors and their state (megabytes), the download and the merged
    /// output are what fills the claim; a quantized base writes no merged
    /// model, and an output on another claim costs this one nothing.
    #[test]
    fn lora_checkpoints_are_small_and_the_output_depends_on_the_base() {
        let lora = LoraConfig {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            target_modules: vec![TargetModule::QProj, TargetModule::VProj],
            block_size: 64,
        };
        let job = llama_job(Some(lora.clone()));
        let mut plan = crate::plan(&job, &h100s()).expect("plan");
        let ModelShape::Llama(shape) = &job.model else {
            unreachable!()
        };
        let a = lora.trainable_params(shape);
        let d = plan.disk_needs(&job.model, &hub());
        assert!(d.checkpoint_bytes < 20 * a + MIB, "{}", d.checkpoint_bytes);
        assert!(d.checkpoint_bytes < GIB, "{}", d.checkpoint_bytes);
        let merged = d.output_bytes;
        assert!(merged > d.model_bytes, "adapter and merged model: {d:?}");
        plan.settings.base_format = BaseFormat::Int4;
        let quantized = plan.disk_needs(&job.model, &hub());
        assert!(quantized.output_bytes < 100 * MIB, "{quantized:?}");
        let elsewhere = plan.disk_needs(
            &job.model,
            &DiskInputs {
                output_on_claim: false,
                ..hub()
            },
        );
        assert_eq!(elsewhere.output_bytes, 0);
        assert_eq!(
            elsewhere.total_bytes,
            quantized.total_bytes - quantized.output_bytes
        );
    }

    /// A measured download replaces the estimate, and a model read from
    /// another claim costs this one nothing.
    #[test]
    fn measured_sizes_replace_the_estimates() {
        let job = llama_job(None);
        let plan = crate::plan(&job, &h100s()).expect("plan");
        let measured = plan.disk_needs(
            &job.model,
            &DiskInputs {
                model_file_bytes: Some(5 * GIB),
                data: DataOnClaim::Bytes(3 * MIB),
                ..hub()
            },
        );
        assert_eq!(measured.model_bytes, 5 * GIB + MODEL_FILES_ALLOWANCE_BYTES);
        assert_eq!(
            (measured.data_bytes, measured.data_estimated),
            (3 * MIB, false)
        );
        let tokens = plan.disk_needs(
            &job.model,
            &DiskInputs {
                data: DataOnClaim::Tokens(1000),
                ..hub()
            },
        );
        assert_eq!((tokens.data_bytes, tokens.data_estimated), (8000, true));
        let on_another_claim = plan.disk_needs(&job.model, &DiskInputs::default());
        assert_eq!(on_another_claim.model_bytes, 0);
        assert_eq!(on_another_claim.data_bytes, 0);
        assert_eq!(on_another_claim.output_bytes, 0);
        assert_eq!(
            on_another_claim.total_bytes,
            3 * on_another_claim.checkpoint_bytes
        );
    }

    #[test]
    fn claims_are_padded_and_whole_gib() {
        assert_eq!(claim_for(0), GIB);
        assert_eq!(claim_for(600 * MIB), GIB, "a tiny job keeps the 1Gi of old");
        assert_eq!(claim_for(10 * GIB), 13 * GIB);
        // 10 GiB + 2 GiB + 256 MiB rounds up; 12.5 GiB + 256 MiB is 13 GiB on the dot.
        assert_eq!(claim_for(10 * GIB + 640 * MIB), 13 * GIB);
        assert_eq!(claim_for(10 * GIB + 640 * MIB + 5), 14 * GIB);
        assert_eq!(quantity(13 * GIB), "13Gi");
        assert_eq!(quantity(1536 * MIB), "1536Mi");
        assert_eq!(quantity(1000), "1000");
    }
}
