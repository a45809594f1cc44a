//! A LoRA job's frozen token embedding kept in host memory (the plan's
//! `offload_embedding`, a GPU rung; what Unsloth calls `offload_embedding`).
//!
//! A lookup is a gather: it needs no device, and the frozen table needs no
//! gradient. So the table waits on the host (`Device::flex()`) at the
//! stage's float dtype, each micro-batch's token ids come down, their rows
//! are gathered there, and only those rows go up, as the first block's
//! input the device needs anyway. For Llama-3-8B that keeps a 128256 × 4096
//! bf16 table (1.05 GB) off the device for one upload of `b·s·h` values per
//! micro-batch. The rows are the table's values, copied: the losses are the
//! on-device embedding's bit for bit (`worker/tests/half_precision.rs`).
//!
//! The checkpoint reads the table straight into host memory, never through
//! the device; the planner counts it in the pod's host bytes
//! (`headroom_planner::memory`, "Offloaded embedding").

use burn::module::Module;
use burn::nn::{Embedding, EmbeddingConfig};
use burn::tensor::{DType, Device, Int, Tensor};

/// The token embedding of a first stage, in host memory.
#[derive(Clone, Debug)]
pub struct HostEmbedding {
    /// On `Device::flex()`, uninitialised until the checkpoint fills it.
    table: Embedding,
    /// The stage's float dtype: the table's once [`Self::settle`] ran, and
    /// the rows' on the device.
    dtype: DType,
}

impl HostEmbedding {
    /// An empty `vocabulary × hidden` table for the checkpoint to fill
    /// (burn initialises lazily: nothing is allocated before the load),
    /// for a stage whose floats are `dtype`.
    pub fn empty(vocabulary: usize, hidden: usize, dtype: DType) -> Self {
        HostEmbedding {
            table: EmbeddingConfig::new(vocabulary, hidden)
                .init(&Device::flex())
                .no_grad(),
            dtype,
        }
    }

    /// `token`'s values, moved to host memory (a table made on the device,
    /// e.g. a seeded synthetic model's), at the stage's `dtype`.
    pub fn from_device(token: Embedding, dtype: DType) -> Self {
        let host = Device::flex();
        let weight = token
            .weight
            .map(|w| Tensor::<2>::from_data(w.into_data(), &host).cast(dtype));
        HostEmbedding {
            table: Embedding { weight }.no_grad(),
            dtype,
        }
    }

    /// The table as a module, for the checkpoint loader to fill.
    pub fn table_mut(&mut self) -> &mut Embedding {
        &mut self.table
    }

    /// The table as a module (saving it, checkpoint records).
    pub fn table(&self) -> &Embedding {
        &self.table
    }

    /// Casts a freshly loaded table to the stage's dtype: the loader reads
    /// at the host device's default float dtype (f32), so for a bf16 stage
    /// the f32 read lives only until this.
    pub fn settle(&mut self) {
        let dtype = self.dtype;
        if self.table.weight.val().dtype() != dtype {
            self.table.weight = self.table.weight.clone().map(|w| w.cast(dtype));
        }
    }

    /// The rows of `tokens` [batch, seq] as [batch, seq, hidden] on the
    /// tokens' device (untracked: the table is frozen).
    pub fn lookup(&self, tokens: Tensor<2, Int>) -> Tensor<3> {
        let device = tokens.device();
        let ids = Tensor::<2, Int>::from_data(tokens.into_data(), &self.table.weight.device());
        let rows = self.table.forward(ids);
        Tensor::<3>::from_data(rows.into_data(), &device).cast(self.dtype)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    /// A bf16 stage (a GPU's) with an f32 table read from the checkpoint:
    /// the table keeps bf16 on the host, and a lookup gives the f32 rows
    /// rounded to bf16 once, on the stage's device, as the on-device
    /// embedding of a bf16 stage does.
    #[test]
    fn a_bf16_stage_gets_its_table_rows_rounded_once() {
        let host = Device::flex();
        let token = EmbeddingConfig::new(10, 4).init(&host);
        let rows = [3i64, 0, 9, 3];
        let ids = |device: &Device| {
            Tensor::<2, Int>::from_data(TensorData::new(rows.to_vec(), [2, 2]), device)
        };
        let want = token.forward(ids(&host)).cast(DType::BF16).into_data();

        let mut loaded = HostEmbedding::empty(10, 4, DType::BF16);
        *loaded.table_mut() = token.clone();
        loaded.settle();
        let moved = HostEmbedding::from_device(token, DType::BF16);
        let device = Device::flex().autodiff();
        for table in [loaded, moved] {
            assert_eq!(table.table().weight.val().dtype(), DType::BF16);
            let got = table.lookup(ids(&device));
            assert_eq!(got.device(), device);
            assert_eq!(got.into_data(), want);
        }
    }
}
