//! The f32 values of a contiguous tensor on burn's flex (CPU) backend, as a
//! slice: what the hand-written CPU loops (the lean ops, the fused AdamW)
//! read and write in place of chains of tensor ops.

use burn::backend::Flex;
use burn::backend::tensor::FloatTensor;
use burn::tensor::{DType, Device, Tensor};

/// Whether `t` is f32 on the plain flex device (where the CPU loops run).
pub(crate) fn is_flex_f32<const D: usize>(t: &Tensor<D>) -> bool {
    t.dtype() == DType::F32 && t.device() == Device::flex()
}

/// The tensor as a contiguous flex primitive where it is f32 on the plain
/// flex device; `None` elsewhere.
pub(crate) fn flex_f32<const D: usize>(t: &Tensor<D>) -> Option<FloatTensor<Flex>> {
    is_flex_f32(t).then(|| into_flex(t.clone()))
}

/// A flex tensor's contiguous primitive (shared, not copied, where it is
/// contiguous already).
pub(crate) fn into_flex<const D: usize>(t: Tensor<D>) -> FloatTensor<Flex> {
    let t = t
        .try_into_primitive::<Flex>()
        .expect("a tensor on the flex device is a flex tensor");
    if t.layout().contiguous_offsets().is_some() {
        t
    } else {
        t.to_contiguous()
    }
}

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
