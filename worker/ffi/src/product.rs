//! An f32 matrix product added into an existing matrix, `dst += lhs·rhs`:
//! gemm's accumulating mode (the crate burn's CPU backend multiplies
//! with), which burn's `matmul` does not offer: it writes every product to
//! a fresh tensor. A sum of products over chunks (the loss's head-weight
//! gradient, a chunk of rows at a time) would otherwise take a fresh
//! matrix of the sum's size, and a pass to add it, per chunk.

/// A read-only matrix: `rows × cols` values at `row_stride · i +
/// col_stride · j` in `values` (a transposed view swaps the strides).
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a> {
    pub values: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub row_stride: usize,
    pub col_stride: usize,
}

impl Strided<'_> {
    /// Whether every index the matrix names lies in `values`.
    fn in_bounds(&self) -> bool {
        if self.rows == 0 || self.cols == 0 {
            return true;
        }
        (self.rows - 1)
            .checked_mul(self.row_stride)
            .and_then(|r| {
                (self.cols - 1)
                    .checked_mul(self.col_stride)
                    .and_then(|c| r.checked_add(c))
            })
            .is_some_and(|last| last < self.values.len())
    }
}

/// Products at least this large (multiply-adds) use the rayon pool, as
/// burn's CPU matmul decides.
const PARALLEL_MULTIPLY_ADDS: usize = 192 * 192 * 192;

/// `dst += lhs · rhs`, where `dst` is `lhs.rows × rhs.cols`, row-major and
/// contiguous. Panics when the shapes do not agree or a stride reaches
/// past its slice.
pub fn add_product_f32(dst: &mut [f32], lhs: Strided<'_>, rhs: Strided<'_>) {
    let (m, k, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert_eq!(rhs.rows, k, "lhs is {m} × {k}, rhs {} × {n}", rhs.rows);
    assert_eq!(
        Some(dst.len()),
        m.checked_mul(n),
        "dst has {} values for a {m} × {n} product",
        dst.len()
    );
    assert!(lhs.in_bounds(), "lhs reaches past its values: {lhs:?}");
    assert!(rhs.in_bounds(), "rhs reaches past its values: {rhs:?}");
    let isize_of = |v: usize| isize::try_from(v).expect("a stride or size fits isize");
    for v in [
        m,
        n,
        k,
        lhs.row_stride,
        lhs.col_stride,
        rhs.row_stride,
        rhs.col_stride,
    ] {
        isize_of(v);
    }
    if m == 0 || n == 0 || k == 0 {
        return;
    }
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_MULTIPLY_ADDS {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // SAFETY: gemm reads lhs at `i·lhs_rs + l·lhs_cs` for i < m, l < k and
    // rhs at `l·rhs_rs + j·rhs_cs` for l < k, j < n: `in_bounds` checked
    // that the largest of each lies inside its slice (the strides are
    // non-negative, so the largest is the last). It reads and writes dst
    // at `i·n + j` for i < m, j < n, inside its `m·n` values; with the rayon
    // pool it splits dst into disjoint blocks. `dst` is borrowed mutably
    // and the operands shared, so no operand aliases it, and all three
    // outlive the call (gemm returns after its workers finish). Every size
    // and stride fits isize (checked above). read_dst with alpha 1 and
    // beta 1 is `dst = 1·dst + 1·lhs·rhs`; f32 has no conjugation.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            isize_of(n),
            true,
            lhs.values.as_ptr(),
            isize_of(lhs.col_stride),
            isize_of(lhs.row_stride),
            rhs.values.as_ptr(),
            isize_of(rhs.col_stride),
            isize_of(rhs.row_stride),
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn naive(lhs: Strided<'_>, rhs: Strided<'_>) -> Vec<f64> {
        let mut out = vec![0.0; lhs.rows * rhs.cols];
        for i in 0..lhs.rows {
            for j in 0..rhs.cols {
                for l in 0..lhs.cols {
                    out[i * rhs.cols + j] +=
                        f64::from(lhs.values[i * lhs.row_stride + l * lhs.col_stride])
                            * f64::from(rhs.values[l * rhs.row_stride + j * rhs.col_stride]);
                }
            }
        }
        out
    }

    fn filled(len: usize, seed: u32) -> Vec<f32> {
        (0..len)
            .map(|i| {
                ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 1000) as f32 / 500.0 - 1.0
            })
            .collect()
    }

    #[test]
    fn adds_a_transposed_product_into_what_is_there() {
        // dst [m, n] += gᵀ · h, with g [k, m] and h [k, n] row-major: the
        // loss's head-weight gradient, one chunk of k rows. The last is
        // large enough for the rayon pool.
        for (m, n, k) in [(7, 5, 3), (70, 33, 17), (300, 64, 200), (600, 96, 160)] {
            let (g, h) = (filled(k * m, 1), filled(k * n, 2));
            let lhs = Strided {
                values: &g,
                rows: m,
                cols: k,
                row_stride: 1,
                col_stride: m,
            };
            let rhs = Strided {
                values: &h,
                rows: k,
                cols: n,
                row_stride: n,
                col_stride: 1,
            };
            let before = filled(m * n, 3);
            let mut dst = before.clone();
            add_product_f32(&mut dst, lhs, rhs);
            add_product_f32(&mut dst, lhs, rhs);
            for ((got, was), p) in dst.iter().zip(&before).zip(naive(lhs, rhs)) {
                let want = f64::from(*was) + 2.0 * p;
                assert!(
                    (f64::from(*got) - want).abs()
                        <= 1e-5 * (k as f64).sqrt() * want.abs().max(1.0),
                    "{m}×{n}×{k}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    #[should_panic(expected = "reaches past its values")]
    fn a_stride_past_the_slice_is_refused() {
        let v = vec![0.0f32; 6];
        let mut dst = vec![0.0f32; 4];
        let lhs = Strided {
            values: &v,
            rows: 2,
            cols: 3,
            row_stride: 4,
            col_stride: 1,
        };
        let rhs = Strided {
            values: &v,
            rows: 3,
            cols: 2,
            row_stride: 2,
            col_stride: 1,
        };
        add_product_f32(&mut dst, lhs, rhs);
    }
}
