//! The frozen products with `W` kept in blocks ([`super::blocks`]): each
//! weight unpacked from its block in registers ([`super::unpack`]), f32
//! activations, f32 sums. Chosen by row count as for f32 weights
//! ([`super::ops`]):
//!
//! - up to [`few_rows::MAX_ROWS`] rows (a small decode step): each group of
//!   weight rows is unpacked once per tile of input rows and dotted with them
//!   in registers, the few-row kernel's scheme over a weight stream 5.4×
//!   (Q4_1) or 3.8× (Q8_0) smaller than f32's. Each output is one dot product
//!   summed lane-wise over the row's blocks, then reduced in a fixed order,
//!   whatever the rows around it: a row gets the same bits alone or in a batch.
//! - up to [`row_lanes::MAX_ROWS`] rows: [`row_lanes`]' kernel, each tile of
//!   weight rows unpacked into a buffer in cache first; its sums are those of
//!   f32 weights, bit for bit.
//! - taller inputs (prefill, the train step): [`panels_t`], panels of `W`
//!   unpacked into f32 tiles that stay in cache, each multiplied by gemm.
//!
//! The train step's backward through the frozen weights, `∂x = ∂y·W`, is
//! [`input_grad`]: column panels of `W` unpacked, then gemm.

use gemm::Parallelism;
use rayon::prelude::*;

use super::blocks::{BlockFormat, BlockMatrix, BLOCK};
use super::few_rows::{self, Isa, Lanes, Scalar};
use super::gemm::Out;
use super::row_lanes;
use super::unpack::{self, with_format, Unpack};

/// Parallel tasks per few-row product (as the f32 kernel's).
const TASKS: usize = 16;

/// Values in one unpacked panel at most (default 2¹⁷: 512 KB of f32, half
/// of Zen 4's L2), so a panel stays in cache while gemm reads it.
const PANEL_VALUES: usize = 1 << 17;

/// Panels per thread (default 4), so two threads finish together.
const PANELS_PER_THREAD: usize = 4;

/// `x·Wᵀ` for row-major f32 `x` `[m, w.cols()]`: row-major `[m, w.rows()]`,
/// spread over rayon's threads, by the kernel for `m` rows.
pub fn matmul_t(x: &[f32], w: &BlockMatrix, m: usize) -> Result<Vec<f32>, String> {
    matmul_t_with(Isa::best(), x, w, m)
}

pub(crate) fn matmul_t_with(
    isa: Isa,
    x: &[f32],
    w: &BlockMatrix,
    m: usize,
) -> Result<Vec<f32>, String> {
    let (n, k) = (w.rows(), w.cols());
    if m <= few_rows::MAX_ROWS {
        few_rows_t(isa, x, w, m)
    } else if m <= row_lanes::MAX_ROWS {
        row_lanes::matmul_t_with(isa, x, row_lanes::Weights::Blocks(w), m, k, n)
    } else {
        check(isa, x, w, m)?;
        let mut y = vec![0f32; m * n];
        panels_t(x, m, w, &mut y);
        Ok(y)
    }
}

/// That `x` holds `[m, w.cols()]` values, that `[m, w.rows()]` fits, and
/// that this CPU runs `isa`.
fn check(isa: Isa, x: &[f32], w: &BlockMatrix, m: usize) -> Result<(), String> {
    let (n, k) = (w.rows(), w.cols());
    if m.checked_mul(k) != Some(x.len()) || m.checked_mul(n).is_none() {
        return Err(format!(
            "native matmul: x has {} values for [{m}, {k}], W is [{n}, {k}]",
            x.len()
        ));
    }
    if !isa.runs_here() {
        return Err(format!("native matmul: this CPU lacks {isa:?}"));
    }
    Ok(())
}

// ------------------------------------------------------------ few rows

/// Few-row `x·Wᵀ`: tasks over blocks of weight rows, outputs transposed
/// (`[n, m]`) so each task writes one contiguous run.
fn few_rows_t(isa: Isa, x: &[f32], w: &BlockMatrix, m: usize) -> Result<Vec<f32>, String> {
    check(isa, x, w, m)?;
    let (n, k) = (w.rows(), w.cols());
    if m == 0 || n == 0 || k == 0 {
        return Ok(vec![0.0; m * n]);
    }
    let row_bytes = w.row_bytes();
    let mut y_t = vec![0f32; n * m];
    let per_task = n.div_ceil(TASKS).next_multiple_of(4);
    y_t.par_chunks_mut(per_task * m)
        .zip(w.bytes().par_chunks(per_task * row_bytes))
        .for_each(|(y_t, rows)| {
            // SAFETY: `rows` holds `y_t.len() / m` whole rows of `k` values
            // in `w.format()`, `x` is `[m, k]` with `k` a multiple of BLOCK
            // (checked above and by BlockMatrix), and this CPU runs `isa`.
            unsafe { few_rows_task(isa, w.format(), x, rows, row_bytes, m, k, y_t) }
        });
    let mut y = vec![0f32; m * n];
    for (j, column) in y_t.chunks_exact(m).enumerate() {
        for (r, &v) in column.iter().enumerate() {
            y[r * n + j] = v;
        }
    }
    Ok(y)
}

#[allow(clippy::too_many_arguments)]
unsafe fn few_rows_task(
    isa: Isa,
    format: BlockFormat,
    x: &[f32],
    rows: &[u8],
    row_bytes: usize,
    m: usize,
    k: usize,
    y_t: &mut [f32],
) {
    let n = rows.len() / row_bytes;
    let (x, w, y) = (x.as_ptr(), rows.as_ptr(), y_t.as_mut_ptr());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => few_rows_avx512(format, x, w, row_bytes, n, m, k, y),
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => few_rows_avx2(format, x, w, row_bytes, n, m, k, y),
        Isa::Portable => with_format!(format, F => {
            tiles::<Scalar, F, 4, 2>(x, w, row_bytes, n, m, k, y)
        }),
    }
}

// Tile shapes: input rows in tiles of up to `TILE_ROWS` (each weight is
// unpacked once per tile); `WIDE` weight rows at a time for one or two input rows,
// `NARROW` for more, so that the accumulators, the unpacked weights and one
// input vector fit the 32 (AVX-512) or 16 (AVX2) registers.

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn few_rows_avx512(
    format: BlockFormat,
    x: *const f32,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    m: usize,
    k: usize,
    y: *mut f32,
) {
    use super::few_rows::x86::Avx512;
    with_format!(format, F => tiles::<Avx512, F, 4, 2>(x, w, row_bytes, n, m, k, y))
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn few_rows_avx2(
    format: BlockFormat,
    x: *const f32,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    m: usize,
    k: usize,
    y: *mut f32,
) {
    use super::few_rows::x86::Avx2;
    with_format!(format, F => tiles::<Avx2, F, 2, 1>(x, w, row_bytes, n, m, k, y))
}

/// Most input rows in one tile (default 4: at 8 rows, two tiles of 4 took
/// 45 ms of one thread's time for SmolLM2's decode step against 57–61 for
/// one tile of 8).
const TILE_ROWS: usize = 4;
// `tiles` has an arm per tile height up to 4: a taller tile needs more arms.
const _: () = assert!(TILE_ROWS == 4);

/// All of `y` (`[n, m]`, transposed): tiles of up to [`TILE_ROWS`] input
/// rows (as even as they can be), each against every weight row.
///
/// # Safety
/// `w` holds `n` rows of `row_bytes` (whole blocks of `k` values in `F`'s
/// format), `x` `m` rows of `k`, `y` room for `n·m` values; the CPU runs `S`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tiles<S: Lanes, F: Unpack<S>, const WIDE: usize, const NARROW: usize>(
    x: *const f32,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    m: usize,
    k: usize,
    y: *mut f32,
) {
    let tiles = m.div_ceil(TILE_ROWS);
    let mut r = 0;
    for t in 0..tiles {
        let (x, y) = (x.add(r * k), y.add(r));
        let rows = (m - r).div_ceil(tiles - t);
        match rows {
            1 => weight_rows::<S, F, WIDE, 1>(x, w, row_bytes, n, m, k, y),
            2 => weight_rows::<S, F, WIDE, 2>(x, w, row_bytes, n, m, k, y),
            3 => weight_rows::<S, F, NARROW, 3>(x, w, row_bytes, n, m, k, y),
            _ => weight_rows::<S, F, NARROW, TILE_ROWS>(x, w, row_bytes, n, m, k, y),
        }
        r += rows;
    }
}

/// `R` input rows against every weight row, `B` weight rows at a time.
///
/// # Safety
/// As for [`tiles`], with `x` `R` rows of `k` and `y` their first column.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn weight_rows<S: Lanes, F: Unpack<S>, const B: usize, const R: usize>(
    x: *const f32,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    m: usize,
    k: usize,
    y: *mut f32,
) {
    let full_n = n - n % B;
    for j in (0..full_n).step_by(B) {
        dots::<S, F, B, R>(x, w.add(j * row_bytes), row_bytes, k, m, y.add(j * m));
    }
    for j in full_n..n {
        dots::<S, F, 1, R>(x, w.add(j * row_bytes), row_bytes, k, m, y.add(j * m));
    }
}

/// The `B × R` dot products of weight rows `w[0..B]` (blocks) with input
/// rows `x[0..R]`, written to `y[b·m + r]`.
#[inline(always)]
unsafe fn dots<S: Lanes, F: Unpack<S>, const B: usize, const R: usize>(
    x: *const f32,
    w: *const u8,
    row_bytes: usize,
    k: usize,
    m: usize,
    y: *mut f32,
) {
    let bytes = F::FORMAT.bytes();
    let mut acc = [[S::zero(); R]; B];
    for block in 0..k / BLOCK {
        // The same block of the weight rows two calls ahead (rows
        // `2B..3B` from here): of one, two and four calls ahead, two
        // decoded fastest at batch 1 (BENCHMARKS.md, "Native weights").
        for b in 0..B {
            S::prefetch(w.wrapping_add((2 * B + b) * row_bytes + block * bytes) as *const f32);
        }
        for c in 0..BLOCK / S::WIDTH {
            let mut wv = [S::zero(); B];
            for (b, wv) in wv.iter_mut().enumerate() {
                *wv = F::chunk(w.add(b * row_bytes + block * bytes), c);
            }
            let o = block * BLOCK + c * S::WIDTH;
            for r in 0..R {
                let xv = S::load(x.add(r * k + o));
                for (acc, &wv) in acc.iter_mut().zip(&wv) {
                    acc[r] = S::fma(wv, xv, acc[r]);
                }
            }
        }
    }
    for (b, acc) in acc.iter().enumerate() {
        for (r, &acc) in acc.iter().enumerate() {
            *y.add(b * m + r) = S::sum(acc);
        }
    }
}

// ------------------------------------------------------------ panels

/// The activation types of the panel products: f32, and f64 for the
/// gradient checks (weights unpacked to f32, then widened: exact).
pub trait PanelFloat: candle_core::WithDType {
    /// The values of the whole blocks `src` of `format`, into `out`, by
    /// the widest kernel this CPU runs.
    fn decode(format: BlockFormat, src: &[u8], out: &mut [Self]);
}

impl PanelFloat for f32 {
    fn decode(format: BlockFormat, src: &[u8], out: &mut [f32]) {
        unpack::decode(Isa::best(), format, src, out)
    }
}

impl PanelFloat for f64 {
    fn decode(format: BlockFormat, src: &[u8], out: &mut [f64]) {
        let mut narrow = vec![0f32; out.len()];
        unpack::decode(Isa::best(), format, src, &mut narrow);
        for (o, v) in out.iter_mut().zip(narrow) {
            *o = v as f64;
        }
    }
}

/// Rows or columns per panel: about [`PANELS_PER_THREAD`] panels per
/// thread, each at most [`PANEL_VALUES`] values of `line` each, a multiple of
/// `align`.
fn panel_size(count: usize, line: usize, align: usize) -> usize {
    let tasks = PANELS_PER_THREAD * rayon::current_num_threads();
    let cap = (PANEL_VALUES / line.max(1)) / align * align;
    count
        .div_ceil(tasks)
        .next_multiple_of(align)
        .min(cap.max(align))
}

/// `x·Wᵀ` into `y` (`[m, n]`, overwritten) for `x` `[m, k]`: panels of
/// weight rows in parallel, each unpacked then multiplied by gemm on its
/// thread. Callers check the sizes.
pub(crate) fn panels_t<T: PanelFloat>(x: &[T], m: usize, w: &BlockMatrix, y: &mut [T]) {
    let (n, k) = (w.rows(), w.cols());
    assert!(x.len() == m * k && y.len() == m * n, "panels_t: sizes");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        y.fill(T::zero());
        return;
    }
    let per = panel_size(n, k, 16);
    let out = Out(y.as_mut_ptr());
    let row_bytes = w.row_bytes();
    (0..n.div_ceil(per)).into_par_iter().for_each(|p| {
        let rows = p * per..((p + 1) * per).min(n);
        let mut panel = vec![T::zero(); rows.len() * k];
        T::decode(
            w.format(),
            &w.bytes()[rows.start * row_bytes..rows.end * row_bytes],
            &mut panel,
        );
        // SAFETY: `x` is `[m, k]` and `panel` `[rows, k]`, both row-major;
        // this task alone writes columns `rows` of `y` `[m, n]`.
        unsafe {
            gemm::gemm(
                m,
                rows.len(),
                k,
                out.at(rows.start),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                panel.as_ptr(),
                k as isize,
                1,
                T::one(),
                T::one(),
                false,
                false,
                false,
                Parallelism::None,
            )
        }
    });
}

/// `∂y·W` for `∂y` `[m, n]` (`n = w.rows()`), added into `dx` `[m, k]`
/// (`k = w.cols()`) when `add`, else written over it: column panels of `W`
/// (whole blocks) in parallel, each unpacked a chunk of rows at a time
/// and multiplied by gemm on its thread.
pub fn input_grad<T: PanelFloat>(
    dy: &[T],
    m: usize,
    w: &BlockMatrix,
    dx: &mut [T],
    add: bool,
) -> Result<(), String> {
    let (n, k) = (w.rows(), w.cols());
    if m.checked_mul(n) != Some(dy.len()) || m.checked_mul(k) != Some(dx.len()) {
        return Err(format!(
            "native input gradient: ∂y has {} values for [{m}, {n}], ∂x {} for [{m}, {k}]",
            dy.len(),
            dx.len()
        ));
    }
    if !add {
        dx.fill(T::zero());
    }
    if m == 0 || n == 0 || k == 0 {
        return Ok(());
    }
    let blocks = k / BLOCK;
    let per_blocks = panel_size(blocks, 1, 1).min(blocks);
    // Rows of `W` unpacked at a time: a panel stays within PANEL_VALUES.
    let chunk_rows = (PANEL_VALUES / (per_blocks * BLOCK)).clamp(1, n);
    let (format, bytes) = (w.format(), w.format().bytes());
    let out = Out(dx.as_mut_ptr());
    (0..blocks.div_ceil(per_blocks))
        .into_par_iter()
        .for_each(|p| {
            let span = p * per_blocks..((p + 1) * per_blocks).min(blocks);
            let width = span.len() * BLOCK;
            let mut panel = vec![T::zero(); chunk_rows * width];
            for first in (0..n).step_by(chunk_rows) {
                let rows = first..(first + chunk_rows).min(n);
                let panel = &mut panel[..rows.len() * width];
                for (r, out) in rows.clone().zip(panel.chunks_exact_mut(width)) {
                    let row = &w.row(r)[span.start * bytes..span.end * bytes];
                    T::decode(format, row, out);
                }
                // SAFETY: `dy` is `[m, n]` and `panel` `[rows, width]`, both
                // row-major; this task alone touches columns
                // `span·BLOCK` of `dx` `[m, k]`, which hold values.
                unsafe {
                    gemm::gemm(
                        m,
                        width,
                        rows.len(),
                        out.at(span.start * BLOCK),
                        1,
                        k as isize,
                        true,
                        dy.as_ptr().add(rows.start),
                        1,
                        n as isize,
                        panel.as_ptr(),
                        1,
                        width as isize,
                        T::one(),
                        T::one(),
                        false,
                        false,
                        false,
                        Parallelism::None,
                    )
                }
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::few_rows::test_values;
    use candle_core::{Device, Tensor};

    fn matrix(rows: usize, cols: usize, format: BlockFormat, seed: u32) -> BlockMatrix {
        let values = test_values(rows * cols, seed);
        let t = Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap();
        BlockMatrix::quantize(&t, format).unwrap()
    }

    /// `|y − x·Wᵀ|` against f64 sums over the dequantized values, within
    /// what summing `k` f32 products in another order can change:
    /// `k·ε·Σ|x·w|` (ε = 2⁻²⁴), the classic bound for recursive summation.
    fn assert_within_order_bound(label: &str, x: &[f32], w: &[f32], y: &[f32], k: usize) {
        let (m, n) = (x.len() / k, w.len() / k);
        for (r, x) in x.chunks_exact(k).enumerate() {
            for (j, w) in w.chunks_exact(k).enumerate() {
                let exact: f64 = x.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum();
                let magnitude: f64 = x
                    .iter()
                    .zip(w)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let bound = k as f64 * f32::EPSILON as f64 / 2.0 * magnitude + 1e-30;
                let err = (y[r * n + j] as f64 - exact).abs();
                assert!(
                    err <= bound,
                    "{label} {m}x{k}x{n} [{r},{j}]: {err} > {bound}"
                );
            }
        }
    }

    /// Every kernel and format this CPU runs, at every row count where the
    /// kernel changes, agrees with the dequantized f32 values within the
    /// summation-order bound; the row-lanes range gives the f32 kernel's
    /// bits exactly.
    #[test]
    fn native_products_match_the_dequantized_reference() {
        for format in BlockFormat::ALL {
            for &(n, k) in &[(13, 64), (37, 96)] {
                let w = matrix(n, k, format, 7);
                let dense = w.to_f32();
                for isa in Isa::available() {
                    for m in [1, 2, 3, 5, 8, 9, 17, 32, 33, 70] {
                        let x = test_values(m * k, m as u32);
                        let y = matmul_t_with(isa, &x, &w, m).unwrap();
                        assert_within_order_bound(
                            &format!("{format:?} {isa:?}"),
                            &x,
                            &dense,
                            &y,
                            k,
                        );
                        if (9..=32).contains(&m) {
                            let f32_kernel = row_lanes::matmul_t_with(
                                isa,
                                &x,
                                row_lanes::Weights::F32(&dense),
                                m,
                                k,
                                n,
                            )
                            .unwrap();
                            assert_eq!(y, f32_kernel, "{format:?} {isa:?} {m} rows");
                        }
                    }
                }
            }
        }
    }

    /// A row's outputs are bitwise the same alone and in any batch each
    /// kernel serves, with every instruction set.
    #[test]
    fn a_row_gets_the_same_bits_in_any_batch() {
        let (n, k) = (21, 128);
        for format in [BlockFormat::Q4_1, BlockFormat::Q8_0] {
            let w = matrix(n, k, format, 3);
            for isa in Isa::available() {
                for m in [2, 5, 8, 9, 20, 32] {
                    let x = test_values(m * k, 9);
                    let together = matmul_t_with(isa, &x, &w, m).unwrap();
                    for r in 0..m {
                        let alone_rows = if m <= few_rows::MAX_ROWS { 1 } else { 9 };
                        // A row alone, or with the 8 rows after it (row lanes' smallest batch).
                        let mut rows = x[r * k..(r + 1) * k].to_vec();
                        rows.extend(test_values((alone_rows - 1) * k, 99));
                        let alone = matmul_t_with(isa, &rows, &w, alone_rows).unwrap();
                        assert_eq!(
                            alone[..n],
                            together[r * n..(r + 1) * n],
                            "{format:?} {isa:?} {m} rows, row {r}"
                        );
                    }
                }
            }
        }
    }

    /// `∂y·W`, written and added, equals the dequantized product, in f32
    /// and f64, over panels of rows and columns.
    #[test]
    fn input_gradients_match_the_dequantized_product() {
        for &(m, n, k) in &[(3, 5, 32), (40, 300, 96), (7, 4100, 64)] {
            let w = matrix(n, k, BlockFormat::Q4_1, 11);
            let dense = Tensor::from_vec(w.to_f32(), (n, k), &Device::Cpu).unwrap();
            let dy = Tensor::from_vec(test_values(m * n, 2), (m, n), &Device::Cpu).unwrap();
            let expected = dy
                .to_dtype(candle_core::DType::F64)
                .unwrap()
                .matmul(&dense.to_dtype(candle_core::DType::F64).unwrap())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let dy32 = dy.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let dy64: Vec<f64> = dy32.iter().map(|&v| v as f64).collect();
            let mut dx = vec![1.0f64; m * k];
            input_grad(&dy64, m, &w, &mut dx, true).unwrap();
            for (got, want) in dx.iter().zip(&expected) {
                assert!((got - 1.0 - want).abs() < 1e-9, "{m}x{n}x{k}: {got} {want}");
            }
            let mut dx = vec![f32::NAN; m * k];
            input_grad(&dy32, m, &w, &mut dx, false).unwrap();
            for (got, want) in dx.iter().zip(&expected) {
                assert!(
                    (*got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "{m}x{n}x{k}"
                );
            }
            assert!(input_grad(&dy32[1..], m, &w, &mut dx, false).is_err());
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let w = matrix(4, 32, BlockFormat::Q8_0, 1);
        for m in [1, 9, 40] {
            let err = matmul_t(&vec![0.0; 32 * m + 1], &w, m).unwrap_err();
            assert!(err.contains(&format!("[{m}, 32]")), "{err}");
        }
        assert_eq!(matmul_t(&[], &w, 0).unwrap(), Vec::<f32>::new());
    }
}
