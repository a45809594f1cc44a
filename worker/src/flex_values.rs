//! The f32 values of a contiguous tensor on burn's flex (CPU) backend, as a
//! slice: what the hand-written CPU loops (the lean ops, the fused AdamW)
//! read and write in place of chains of tensor ops.

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;

/// The values of a contiguous flex f32 tensor.
pub(crate) fn values(t: &FloatTensor<Flex>) -> &[f32] {
    let (start, end) = t
        .layout()
        .contiguous_offsets()
        .expect("a contiguous tensor has one run of values");
    &t.storage::<f32>()[start..end]
}

/// The values of a contiguous flex f32 tensor, for writing (copied first
/// when the buffer is shared).
pub(crate) fn values_mut(t: &mut FloatTensor<Flex>) -> &mut [f32] {
    let (start, end) = t
        .layout()
        .contiguous_offsets()
        .expect("a contiguous tensor has one run of values");
    &mut t.storage_mut::<f32>()[start..end]
}
