//! `x·Wᵀ` for 9–32 rows with the vector lanes over the rows: a batched decode
//! step's projections and LM head.
//!
//! Past a few rows, [`super::few_rows`]' horizontal sums and its re-reading
//! of input rows cost more than the weight stream. Here the input is
//! transposed once (`[k][rows]`, it stays in cache) and the weights are read
//! once, in tiles of consecutive rows: each weight is broadcast to every lane
//! and multiplied into one or two vectors of rows at a time (up to 32 rows
//! with AVX-512, 16 with AVX2), with no horizontal sum. The next tile is prefetched while one
//! is being multiplied. On SmolLM2's 210 block projections, 32 rows took
//! 61–72 ms against the few-row kernel's 96, 16 rows 41–45 against 60–62, and
//! the LM head at 32 rows 10–14 ms against 29–32 (BENCHMARKS.md, session 10).
//!
//! Every output is one multiply-add chain over `k` in order, whatever the
//! rows around it, so a row gets the same bits in any batch this kernel
//! serves. That order differs from the few-row kernel's, so a row's last bits
//! can change when its batch crosses [`super::few_rows::MAX_ROWS`].
//!
//! Weights kept in blocks ([`super::blocks`]) are unpacked one tile of rows at
//! a time into a buffer that stays in cache ([`Weights::Blocks`]); the sums
//! are then those of the same values in f32, bit for bit.

use std::ops::Range;

use rayon::prelude::*;

use super::blocks::{BlockMatrix, BLOCK};
use super::few_rows::{check_product, Isa, Scalar};
use super::gemm::Out;
use super::unpack::Decode;

/// Most rows served here (default 32); taller inputs go to gemm.
pub const MAX_ROWS: usize = 32;

/// Vectors of rows multiplied together (2: 32 rows with AVX-512, 16 with
/// AVX2). Taller inputs are done in groups of this many vectors, each tile of
/// weights going through every group while it is in cache. `run` has a
/// kernel for 1 and 2 vectors.
const GROUP_VECTORS: usize = 2;
const _: () = assert!(GROUP_VECTORS == 2);

/// Parallel tasks per product at most (default 16; 8 on the smallest
/// projections, 192 outputs), so two threads stay busy.
const TASKS: usize = 16;

/// Task boundaries fall on multiples of this many weight rows (default 24;
/// every tile height in `run` divides it), so tasks run whole tiles.
const TILE_ALIGN: usize = 24;

/// `x·Wᵀ` for row-major `x` `[m, k]` and `w` `[n, k]`: row-major `[m, n]`,
/// spread over rayon's threads.
pub fn matmul_t(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Result<Vec<f32>, String> {
    matmul_t_with(Isa::best(), x, Weights::F32(w), m, k, n)
}

/// The weight rows `[n, k]` a product reads.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Weights<'a> {
    F32(&'a [f32]),
    Blocks(&'a BlockMatrix),
}

pub(crate) fn matmul_t_with(
    isa: Isa,
    x: &[f32],
    w: Weights,
    m: usize,
    k: usize,
    n: usize,
) -> Result<Vec<f32>, String> {
    match w {
        Weights::F32(w) => check_product("row-lanes matmul", isa, x, w, m, k, n)?,
        Weights::Blocks(b) => {
            if (b.rows(), b.cols()) != (n, k) {
                return Err(format!(
                    "row-lanes matmul: W is [{}, {}], not [{n}, {k}]",
                    b.rows(),
                    b.cols()
                ));
            }
            check_product("row-lanes matmul", isa, x, &[], m, k, 0)?;
        }
    }
    let mut y = vec![0f32; m * n];
    if m == 0 || n == 0 || k == 0 {
        return Ok(y);
    }
    let rows = RowGroups::new(isa, x, m, k);
    let out = Out(y.as_mut_ptr());
    let per_task = n.div_ceil(TASKS).next_multiple_of(TILE_ALIGN);
    (0..n.div_ceil(per_task)).into_par_iter().for_each(|task| {
        let cols = task * per_task..((task + 1) * per_task).min(n);
        // SAFETY: `rows` was built for `isa`, which runs here, from `x`
        // `[m, k]`; `w` holds `n` rows of `k > 0` (both checked above);
        // `cols` lies inside `0..n` and no two tasks share a column of `y`.
        UNPACKED.with_borrow_mut(|buffer| unsafe { run(isa, &rows, w, k, n, cols, out, buffer) })
    });
    Ok(y)
}

thread_local! {
    /// The tile of weight rows unpacked from blocks, per thread. (Taken out
    /// before the kernels: a closure inside a `target_feature` function does
    /// not inherit its features, and the kernels would not inline.)
    static UNPACKED: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Weight rows `j..j + count` as `[count, k]` f32 values: in place for f32
/// weights, else unpacked into `buffer`.
///
/// # Safety
/// The rows lie inside `w`, whose rows are `k` long; the CPU runs `S`.
#[inline(always)]
unsafe fn weight_rows<S: Decode>(
    w: Weights,
    j: usize,
    count: usize,
    k: usize,
    buffer: &mut Vec<f32>,
) -> *const f32 {
    match w {
        Weights::F32(w) => w.as_ptr().add(j * k),
        Weights::Blocks(b) => {
            buffer.resize(count * k, 0.0);
            S::decode_blocks(
                b.format(),
                b.row(j).as_ptr(),
                count * k / BLOCK,
                buffer.as_mut_ptr(),
            );
            buffer.as_ptr()
        }
    }
}

/// The rows of `x`, transposed in groups: group `g` is `[k][stride]` and
/// holds rows `g·stride..` in its lanes, the lanes past `m` zero.
struct RowGroups {
    xt: Vec<f32>,
    /// Vectors per group: 1 when every row fits in one, else `GROUP_VECTORS`.
    vectors: usize,
    stride: usize,
    k: usize,
    m: usize,
}

impl RowGroups {
    fn new(isa: Isa, x: &[f32], m: usize, k: usize) -> RowGroups {
        let vectors = m.div_ceil(isa.width()).min(GROUP_VECTORS);
        let stride = vectors * isa.width();
        let mut xt = vec![0f32; m.div_ceil(stride) * k * stride];
        for (r, row) in x.chunks_exact(k).enumerate() {
            let group = &mut xt[r / stride * k * stride..][..k * stride];
            for (i, &v) in row.iter().enumerate() {
                group[i * stride + r % stride] = v;
            }
        }
        RowGroups {
            xt,
            vectors,
            stride,
            k,
            m,
        }
    }

    fn count(&self) -> usize {
        self.m.div_ceil(self.stride)
    }

    /// Group `g`'s transposed values, first row and number of rows.
    fn group(&self, g: usize) -> (&[f32], usize, usize) {
        let size = self.k * self.stride;
        let first = g * self.stride;
        (
            &self.xt[g * size..][..size],
            first,
            self.stride.min(self.m - first),
        )
    }
}

/// Columns `cols` of `y` (`[m, n]`).
///
/// # Safety
/// `rows` was built by `RowGroups::new(isa, ..)` from rows of `k > 0`;
/// otherwise as for [`tiles`], with `isa` running here.
#[allow(clippy::too_many_arguments)]
unsafe fn run(
    isa: Isa,
    rows: &RowGroups,
    w: Weights,
    k: usize,
    n: usize,
    cols: Range<usize>,
    y: Out<f32>,
    buffer: &mut Vec<f32>,
) {
    // Tile heights: `vectors × height` accumulators take most of the 32
    // (AVX-512) or 16 (AVX2) vector registers.
    match (isa, rows.vectors) {
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, 1) => avx512::<1, 24>(rows, w, k, n, cols, y, buffer),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx512, _) => avx512::<2, 12>(rows, w, k, n, cols, y, buffer),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, 1) => avx2::<1, 12>(rows, w, k, n, cols, y, buffer),
        #[cfg(target_arch = "x86_64")]
        (Isa::Avx2, _) => avx2::<2, 6>(rows, w, k, n, cols, y, buffer),
        (Isa::Portable, 1) => tiles::<Scalar, 1, 8>(rows, w, k, n, cols, y, buffer),
        (Isa::Portable, _) => tiles::<Scalar, 2, 8>(rows, w, k, n, cols, y, buffer),
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma,f16c")]
unsafe fn avx512<const G: usize, const NR: usize>(
    rows: &RowGroups,
    w: Weights,
    k: usize,
    n: usize,
    cols: Range<usize>,
    y: Out<f32>,
    buffer: &mut Vec<f32>,
) {
    tiles::<super::few_rows::x86::Avx512, G, NR>(rows, w, k, n, cols, y, buffer)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2<const G: usize, const NR: usize>(
    rows: &RowGroups,
    w: Weights,
    k: usize,
    n: usize,
    cols: Range<usize>,
    y: Out<f32>,
    buffer: &mut Vec<f32>,
) {
    tiles::<super::few_rows::x86::Avx2, G, NR>(rows, w, k, n, cols, y, buffer)
}

/// Columns `cols` of `y`: tiles of `NR` weight rows, then what is left in
/// tiles of 8, 4, 2 and 1, each tile through every row group.
///
/// # Safety
/// `rows` has `G` vectors of `S::WIDTH` per group and was built from rows of
/// `k > 0`; `w` holds `n` rows of `k`; `cols` lies inside `0..n`; `y` is
/// `[rows.m, n]` and nobody else touches its columns `cols`; the CPU runs `S`.
#[inline(always)]
unsafe fn tiles<S: Decode, const G: usize, const NR: usize>(
    rows: &RowGroups,
    w: Weights,
    k: usize,
    n: usize,
    cols: Range<usize>,
    y: Out<f32>,
    buffer: &mut Vec<f32>,
) {
    // The row groups' layout is what keeps `tile`'s reads in bounds: checked
    // once per task, not only in debug builds.
    let w_rows = match w {
        Weights::F32(w) => w.len() / k.max(1),
        Weights::Blocks(b) => b.rows(),
    };
    assert!(rows.stride == G * S::WIDTH && rows.k == k && w_rows == n && cols.end <= n);
    let end = cols.end;
    let mut j = cols.start;
    while j < end {
        // No closure here: it would not inherit the caller's target features.
        j += match end - j {
            left if left >= NR => {
                every_group::<S, G, NR>(rows, weight_rows::<S>(w, j, NR, k, buffer), n, j, y)
            }
            8.. => every_group::<S, G, 8>(rows, weight_rows::<S>(w, j, 8, k, buffer), n, j, y),
            4.. => every_group::<S, G, 4>(rows, weight_rows::<S>(w, j, 4, k, buffer), n, j, y),
            2.. => every_group::<S, G, 2>(rows, weight_rows::<S>(w, j, 2, k, buffer), n, j, y),
            _ => every_group::<S, G, 1>(rows, weight_rows::<S>(w, j, 1, k, buffer), n, j, y),
        };
    }
}

/// Columns `j..j + NR` (weight rows `w[0..NR]`) of every row group. Returns `NR`.
///
/// # Safety
/// As for [`tiles`]; `w` points at weight row `j` of `[n, k]`, and
/// `j + NR` lies inside `tiles`' `cols`.
#[inline(always)]
unsafe fn every_group<S: Decode, const G: usize, const NR: usize>(
    rows: &RowGroups,
    w: *const f32,
    n: usize,
    j: usize,
    y: Out<f32>,
) -> usize {
    for g in 0..rows.count() {
        let (xt, first, count) = rows.group(g);
        tile::<S, G, NR>(xt.as_ptr(), w, rows.k, n, count, y.at(first * n + j));
    }
    NR
}

/// The outputs of weight rows `w[0..NR]` for `G` vectors of rows, written to
/// `y[r·n + j]` for the first `rows` rows.
///
/// # Safety
/// `xt` is `[k][G · S::WIDTH]`, `w` holds `NR` rows of `k`,
/// `rows ≤ G · S::WIDTH`, `y` has `rows` rows of stride `n` whose first `NR`
/// columns only this call writes, and the CPU runs `S`.
#[inline(always)]
unsafe fn tile<S: Decode, const G: usize, const NR: usize>(
    xt: *const f32,
    w: *const f32,
    k: usize,
    n: usize,
    rows: usize,
    y: *mut f32,
) {
    const { assert!(G * S::WIDTH <= 64) };
    let stride = G * S::WIDTH;
    // The next tile is one contiguous block: one or two cache lines a step
    // bring it in while this one is being multiplied.
    let next_tile = w.wrapping_add(NR * k);
    let mut acc = [[S::zero(); G]; NR];
    for i in 0..k {
        S::prefetch(next_tile.wrapping_add(NR * i));
        if NR > 16 {
            S::prefetch(next_tile.wrapping_add(NR * i + 16));
        }
        let mut xv = [S::zero(); G];
        for (g, xv) in xv.iter_mut().enumerate() {
            *xv = S::load(xt.add(i * stride + g * S::WIDTH));
        }
        for (j, acc) in acc.iter_mut().enumerate() {
            let wv = S::splat(w.add(j * k + i));
            for (acc, &xv) in acc.iter_mut().zip(&xv) {
                *acc = S::fma(wv, xv, *acc);
            }
        }
    }
    let mut lanes = [0f32; 64];
    for (j, acc) in acc.iter().enumerate() {
        for (g, &acc) in acc.iter().enumerate() {
            S::store(lanes.as_mut_ptr().add(g * S::WIDTH), acc);
        }
        for (r, &v) in lanes[..rows].iter().enumerate() {
            *y.add(r * n + j) = v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::base::few_rows::{assert_matches_reference, test_values as values};

    /// Every kernel this CPU runs agrees with an f64 reference, over row
    /// counts that cover partial vectors and several row groups, and tile
    /// heights with leftovers; each row gets the same bits alone.
    #[test]
    fn kernels_match_a_reference_and_rows_get_the_same_bits_alone() {
        let cases = [
            (1, 16, 4),
            (5, 37, 7),
            (5, 37, 20),
            (9, 64, 30),
            (17, 100, 61),
            (20, 37, 20),
            (32, 576, 100),
            (40, 3, 1),
            (40, 37, 61),
        ];
        for isa in Isa::available() {
            for &(m, k, n) in &cases {
                let (x, w) = (values(m * k, 1), values(n * k, 2));
                let y = matmul_t_with(isa, &x, Weights::F32(&w), m, k, n).unwrap();
                assert_matches_reference(&format!("{isa:?}"), &x, &w, &y, k);
                for r in 0..m {
                    let row = &x[r * k..(r + 1) * k];
                    let alone = matmul_t_with(isa, row, Weights::F32(&w), 1, k, n).unwrap();
                    assert_eq!(alone, y[r * n..(r + 1) * n], "{isa:?} {m}x{k}x{n} row {r}");
                }
            }
        }
    }

    #[test]
    fn wrong_lengths_are_an_error_and_empty_products_zeros() {
        let err = matmul_t(&[0.0; 5], &[0.0; 8], 2, 3, 4).unwrap_err();
        assert!(err.contains("[2, 3]"), "{err}");
        let huge = usize::MAX / 2 + 1;
        assert!(matmul_t(&[0.0; 4], &[0.0; 4], huge, 2, 2).is_err());
        assert_eq!(matmul_t(&[], &[], 2, 0, 3).unwrap(), vec![0.0; 6]);
        assert!(matmul_t(&[], &[0.0; 6], 0, 3, 2).unwrap().is_empty());
    }
}
