//! Random Llama checkpoints of any size, in Hugging Face's layout: the
//! e2e scenarios that need weights to dominate a worker's memory (a LoRA
//! job whose dense base does not fit and whose int8 base does) cannot use
//! the 0.8 MiB tiny-llama. The tokenizer and the rest of the config are the
//! tiny-llama's (vocabulary 512), so the sample text tokenizes the same.

use std::io::Write;
use std::path::Path;

use crate::fixtures::workspace_root;

/// The shape of a random checkpoint (LlamaForCausalLM, tied head, bf16 on disk).
#[derive(Clone, Copy, Debug)]
pub struct RandomLlama {
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
}

impl RandomLlama {
    pub const VOCABULARY: usize = 512;

    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }

    /// Hugging Face names and shapes ([out, in] for linears), checkpoint order.
    pub fn tensors(&self) -> Vec<(String, Vec<usize>)> {
        let (h, f) = (self.hidden, self.intermediate);
        let (q, kv) = (
            self.heads * self.head_dim(),
            self.kv_heads * self.head_dim(),
        );
        let mut out = vec![(
            "model.embed_tokens.weight".to_string(),
            vec![Self::VOCABULARY, h],
        )];
        for layer in 0..self.layers {
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
                out.push((format!("model.layers.{layer}.{name}"), shape));
            }
        }
        out.push(("model.norm.weight".to_string(), vec![h]));
        out
    }

    /// Parameters of the model (the head is tied to the embedding).
    pub fn parameters(&self) -> u64 {
        self.tensors()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }

    /// Writes config.json, model.safetensors (bf16: linears and the
    /// embedding uniform in ±0.02, norms ones; the same seed, the same bytes)
    /// and the tiny-llama's tokenizer files into `dir`.
    pub fn write(&self, dir: &Path, seed: u64) -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let tiny = workspace_root().join(crate::payload::TINY_LLAMA);
        let mut config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(tiny.join("config.json"))?)?;
        for (key, value) in [
            ("hidden_size", self.hidden),
            ("intermediate_size", self.intermediate),
            ("num_hidden_layers", self.layers),
            ("num_attention_heads", self.heads),
            ("num_key_value_heads", self.kv_heads),
            ("head_dim", self.head_dim()),
            ("vocab_size", Self::VOCABULARY),
        ] {
            config[key] = value.into();
        }
        config["dtype"] = "bfloat16".into();
        config["tie_word_embeddings"] = true.into();
        std::fs::write(dir.join("config.json"), serde_json::to_vec_pretty(&config)?)?;
        for file in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(tiny.join(file), dir.join(file))?;
        }

        // safetensors: an 8-byte little-endian header length, the JSON
        // header (padded with spaces to 8 bytes), then the tensors' bytes.
        let tensors = self.tensors();
        let mut header = serde_json::Map::new();
        header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
        let mut offset = 0usize;
        for (name, shape) in &tensors {
            let bytes = shape.iter().product::<usize>() * 2;
            header.insert(
                name.clone(),
                serde_json::json!({"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + bytes]}),
            );
            offset += bytes;
        }
        let mut json = serde_json::to_vec(&header)?;
        while json.len() % 8 != 0 {
            json.push(b' ');
        }
        let mut out =
            std::io::BufWriter::new(std::fs::File::create(dir.join("model.safetensors"))?);
        out.write_all(&(json.len() as u64).to_le_bytes())?;
        out.write_all(&json)?;
        let mut state = seed;
        for (name, shape) in &tensors {
            let ones = name.ends_with("norm.weight");
            for _ in 0..shape.iter().product::<usize>() {
                let x = if ones {
                    1.0f32
                } else {
                    state = splitmix(state);
                    ((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.04
                };
                out.write_all(&((x.to_bits() >> 16) as u16).to_le_bytes())?;
            }
        }
        out.flush()
    }
}

/// SplitMix64: a small, well-mixed generator (the checkpoint's bytes only
/// need to be deterministic, not cryptographic).
fn splitmix(state: u64) -> u64 {
    let mut z = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_written_header_names_every_tensor_at_its_offsets() {
        let shape = RandomLlama {
            hidden: 32,
            intermediate: 64,
            layers: 2,
            heads: 2,
            kv_heads: 1,
        };
        let dir =
            std::env::temp_dir().join(format!("headroom-random-llama-{}", std::process::id()));
        shape.write(&dir, 7).expect("written");
        let bytes = std::fs::read(dir.join("model.safetensors")).expect("read");
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes")) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).expect("json");
        let data = bytes.len() - 8 - n;
        assert_eq!(data as u64, shape.parameters() * 2);
        assert_eq!(
            header["model.layers.1.self_attn.k_proj.weight"]["shape"],
            serde_json::json!([16, 32])
        );
        let config: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join("config.json")).expect("config"))
                .expect("json");
        assert_eq!(config["num_key_value_heads"], 1);
        // The planner reads the same model from the config.
        let planned = headroom_planner::LlamaShape::from_hf_config(&config.to_string(), 64)
            .expect("plannable config");
        assert_eq!(planned.total_params(), shape.parameters());
        assert!(dir.join("tokenizer.json").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
