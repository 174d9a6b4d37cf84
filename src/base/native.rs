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
//! - taller inputs (prefill, the train step): [`unpacked_t`], slices of
//!   whole weight rows unpacked into a reused f32 buffer, each multiplied
//!   by one gemm call over all threads. A block projection is one slice,
//!   so its product is the f32 path's gemm call on the same values: the
//!   same bits, plus the unpacking. (Panels of `W` multiplied one per
//!   thread repacked the activations for every panel: 0.94× f32's train
//!   step, BENCHMARKS.md.)
//!
//! The train step's backward through the frozen weights, `∂x = ∂y·W`, is
//! [`add_input_grad`] and [`input_grad_values`]: the same slices, their
//! products added in order.

use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use gemm::Parallelism;
use rayon::prelude::*;

use super::blocks::{BlockFormat, BlockMatrix, BLOCK};
use super::few_rows::{self, Isa, Lanes, Scalar};
use super::gemm::overwrite_with;
use super::row_lanes;
use super::unpack::{self, with_format, Unpack};

/// Parallel tasks per few-row product (as the f32 kernel's).
const TASKS: usize = 16;

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
        Ok(unpacked_t_values(x, m, w))
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

// ------------------------------------------------------------ unpacked slices

/// The activation types of the tall products: f32, and f64 for the
/// gradient checks (weights unpacked to f32, then widened: exact).
pub trait PanelFloat: candle_core::WithDType {
    /// The values of the whole blocks `src` of `format`, into `out`, by
    /// the widest kernel this CPU runs.
    fn decode(format: BlockFormat, src: &[u8], out: &mut [Self]);

    /// Buffers of unpacked weights kept between products: a fresh one
    /// would be faulted in and zeroed for every projection.
    fn buffers() -> &'static Mutex<Vec<Vec<Self>>>;
}

impl PanelFloat for f32 {
    fn decode(format: BlockFormat, src: &[u8], out: &mut [f32]) {
        unpack::decode(Isa::best(), format, src, out)
    }

    fn buffers() -> &'static Mutex<Vec<Vec<f32>>> {
        static BUFFERS: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());
        &BUFFERS
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

    fn buffers() -> &'static Mutex<Vec<Vec<f64>>> {
        static BUFFERS: Mutex<Vec<Vec<f64>>> = Mutex::new(Vec::new());
        &BUFFERS
    }
}

/// Weight rows unpacked per slice at most, in values (default 2²⁰: 4 MB of
/// f32). Every block projection of SmolLM2 fits in one slice (the largest,
/// 1536 × 576, is 0.88 M values), so its product is one gemm call, the call
/// the f32 path makes, on the same values; the LM head (49,152 × 576) takes
/// 28 slices of 1,740–1,756 rows.
const SLICE_VALUES: usize = 1 << 20;

/// Weight rows each task unpacks at a time (default 64).
const UNPACK_ROWS: usize = 64;

/// `f(rows, values)` for consecutive slices of whole rows of `w`, each
/// unpacked into one reused buffer (row-major `[rows, w.cols()]`) by all of
/// rayon's threads.
fn for_each_slice<T: PanelFloat>(w: &BlockMatrix, mut f: impl FnMut(Range<usize>, &[T])) {
    let (n, k) = (w.rows(), w.cols());
    if n == 0 || k == 0 {
        return;
    }
    // Slices as even as they can be: a slice of a few rows would take
    // gemm's small-size branch, which splits the sum over `k` otherwise.
    let slices = n.div_ceil((SLICE_VALUES / k).max(1));
    let per = n.div_ceil(slices);
    let pool = T::buffers();
    let mut buffer = pool
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .pop()
        .unwrap_or_default();
    if buffer.len() < per * k {
        buffer.resize(per * k, T::zero());
    }
    let (format, row_bytes) = (w.format(), w.row_bytes());
    for start in (0..n).step_by(per) {
        let rows = start..(start + per).min(n);
        let values = &mut buffer[..rows.len() * k];
        let bytes = &w.bytes()[rows.start * row_bytes..rows.end * row_bytes];
        values
            .par_chunks_mut(UNPACK_ROWS * k)
            .zip(bytes.par_chunks(UNPACK_ROWS * row_bytes))
            .for_each(|(out, src)| T::decode(format, src, out));
        f(rows, values);
    }
    pool.lock()
        .unwrap_or_else(PoisonError::into_inner)
        .push(buffer);
}

/// gemm's threads for one tall product: all of rayon's, as the f32 path's.
fn threads() -> Parallelism {
    match rayon::current_num_threads() {
        1 => Parallelism::None,
        n => Parallelism::Rayon(n),
    }
}

/// `x·Wᵀ` into `y` (`[m, n]`, overwritten) for `x` `[m, k]`.
pub(crate) fn unpacked_t<T: PanelFloat>(x: &[T], m: usize, w: &BlockMatrix, y: &mut [T]) {
    assert!(
        x.len() == m * w.cols() && y.len() == m * w.rows(),
        "unpacked_t: sizes"
    );
    if w.cols() == 0 {
        y.fill(T::zero());
    } else if m > 0 {
        // SAFETY: `y` holds `[m, n]` values.
        unsafe { unpacked_t_into(x, m, w, y.as_mut_ptr()) }
    }
}

/// `x·Wᵀ` as fresh values `[m, n]` (no zero fill: gemm writes every one).
fn unpacked_t_values(x: &[f32], m: usize, w: &BlockMatrix) -> Vec<f32> {
    let len = m * w.rows();
    if w.cols() == 0 || m == 0 {
        return vec![0.0; len];
    }
    let mut y = Vec::new();
    // SAFETY: gemm writes every value of `[m, n]` and reads none.
    unsafe { overwrite_with(&mut y, len, |y| unpacked_t_into(x, m, w, y)) };
    y
}

/// `x·Wᵀ` written (not read) to `y`, slice by slice of weight rows: each
/// slice's columns of `y` by one gemm call.
///
/// # Safety
/// `x` holds `[m, k]` values with `k = w.cols() > 0` and `m > 0`; `y` is
/// valid for writes of `[m, w.rows()]` values, touched by no one else.
unsafe fn unpacked_t_into<T: PanelFloat>(x: &[T], m: usize, w: &BlockMatrix, y: *mut T) {
    let (n, k) = (w.rows(), w.cols());
    for_each_slice(w, |rows, values: &[T]| {
        // SAFETY: `x` is `[m, k]` and `values` `[rows, k]`, both row-major
        // (read as `Wᵀ`); columns `rows` of `y` `[m, n]` lie inside it.
        unsafe {
            gemm::gemm(
                m,
                rows.len(),
                k,
                y.add(rows.start),
                1,
                n as isize,
                false,
                x.as_ptr(),
                1,
                k as isize,
                values.as_ptr(),
                k as isize,
                1,
                T::one(),
                T::one(),
                false,
                false,
                false,
                threads(),
            )
        }
    });
}

/// `∂y·W` for `∂y` `[m, n]` (`n = w.rows()`), added into `dx` `[m, k]`
/// (`k = w.cols()`). A slice of weight rows is a slice of the sum over `n`:
/// the slices are added in order.
pub fn add_input_grad<T: PanelFloat>(
    dy: &[T],
    m: usize,
    w: &BlockMatrix,
    dx: &mut [T],
) -> Result<(), String> {
    check_input_grad(dy.len(), dx.len(), m, w)?;
    if w.rows() > 0 && m > 0 && w.cols() > 0 {
        // SAFETY: sizes checked above; `dx` holds values.
        unsafe { input_grad_into(dy, m, w, dx.as_mut_ptr(), true) }
    }
    Ok(())
}

/// `∂y·W` as fresh values `[m, k]` (no zero fill: gemm writes every one).
pub fn input_grad_values<T: PanelFloat>(
    dy: &[T],
    m: usize,
    w: &BlockMatrix,
) -> Result<Vec<T>, String> {
    let len = m * w.cols();
    check_input_grad(dy.len(), len, m, w)?;
    if w.rows() == 0 || m == 0 || w.cols() == 0 {
        return Ok(vec![T::zero(); len]);
    }
    let mut dx = Vec::new();
    // SAFETY: sizes checked above; the first slice's gemm writes every value
    // of `[m, k]` without reading it.
    unsafe { overwrite_with(&mut dx, len, |dx| input_grad_into(dy, m, w, dx, false)) };
    Ok(dx)
}

fn check_input_grad(dy: usize, dx: usize, m: usize, w: &BlockMatrix) -> Result<(), String> {
    let (n, k) = (w.rows(), w.cols());
    if m.checked_mul(n) != Some(dy) || m.checked_mul(k) != Some(dx) {
        return Err(format!(
            "native input gradient: ∂y has {dy} values for [{m}, {n}], ∂x {dx} for [{m}, {k}]"
        ));
    }
    Ok(())
}

/// # Safety
/// `dy` holds `[m, n]` values and `dx` is valid for `[m, k]`, initialised
/// when `add`, touched by no one else; `m`, `n`, `k` are not zero.
unsafe fn input_grad_into<T: PanelFloat>(
    dy: &[T],
    m: usize,
    w: &BlockMatrix,
    dx: *mut T,
    add: bool,
) {
    let (n, k) = (w.rows(), w.cols());
    for_each_slice(w, |rows, values: &[T]| {
        // SAFETY: `∂y`'s columns `rows` (row stride `n`) times `values`
        // `[rows, k]`, row-major, into `dx` `[m, k]`; every slice after the
        // first adds to what the ones before wrote.
        unsafe {
            gemm::gemm(
                m,
                k,
                rows.len(),
                dx,
                1,
                k as isize,
                add || rows.start > 0,
                dy.as_ptr().add(rows.start),
                1,
                n as isize,
                values.as_ptr(),
                1,
                k as isize,
                T::one(),
                T::one(),
                false,
                false,
                false,
                threads(),
            )
        }
    });
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

    /// `∂y·W`, written, added and fresh, equals the dequantized product, in
    /// f32 and f64, in one slice of weight rows and in several.
    #[test]
    fn input_gradients_match_the_dequantized_product() {
        let cases = [(3, 5, 32), (40, 300, 96), (7, 17_000, 64)];
        assert!(
            cases.iter().any(|&(_, n, k)| n * k > SLICE_VALUES),
            "a case of several slices"
        );
        for &(m, n, k) in &cases {
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
            add_input_grad(&dy64, m, &w, &mut dx).unwrap();
            for (got, want) in dx.iter().zip(&expected) {
                assert!((got - 1.0 - want).abs() < 1e-9, "{m}x{n}x{k}: {got} {want}");
            }
            let dx = input_grad_values(&dy32, m, &w).unwrap();
            for (got, want) in dx.iter().zip(&expected) {
                assert!(
                    (*got as f64 - want).abs() < 1e-4 * (1.0 + want.abs()),
                    "{m}x{n}x{k}"
                );
            }
            let mut zeros = vec![0f32; m * k];
            add_input_grad(&dy32, m, &w, &mut zeros).unwrap();
            assert_eq!(zeros, dx, "added to zeros, {m}x{n}x{k}");
            assert!(add_input_grad(&dy32[1..], m, &w, &mut zeros).is_err());
            assert!(input_grad_values(&dy32[1..], m, &w).is_err());
        }
    }

    /// Above [`row_lanes::MAX_ROWS`] rows, `x·Wᵀ` gives the bits of the f32
    /// path's gemm call on the dequantized values (within one slice of
    /// weight rows it is the same call; over several, each output's sum over
    /// `k` is split where f32's is, as long as no slice is small enough for
    /// gemm's small-size branch), and so does `∂y·W` within one slice; over
    /// several, a slice's sum over `n` ends where gemm's depth block need
    /// not. Written over stale values, `x·Wᵀ` reads none of them.
    #[test]
    fn tall_products_give_the_f32_paths_bits() {
        use crate::base::gemm::{matmul, product_values, Threads};
        let device = Device::Cpu;
        // SmolLM2's k, in two slices; and more slices at a small k.
        let shapes = [(37, 96), (1_900, 576), (17_000, 64)];
        assert!(
            shapes.iter().any(|&(n, k)| n * k > SLICE_VALUES),
            "a case of several slices"
        );
        for format in BlockFormat::ALL {
            for &(n, k) in &shapes {
                let w = matrix(n, k, format, 5);
                let dense = Tensor::from_vec(w.to_f32(), (n, k), &device).unwrap();
                // The LM head's last chunk can be a few rows: every value written.
                let x = test_values(5 * k, 8);
                let mut stale = vec![f32::NAN; 5 * n];
                unpacked_t(&x, 5, &w, &mut stale);
                let label = format!("{format:?} {n}x{k}, 5 rows");
                assert_within_order_bound(&label, &x, &w.to_f32(), &stale, k);
                for m in [33, 70] {
                    let x = test_values(m * k, 4);
                    let xt = Tensor::from_vec(x.clone(), (m, k), &device).unwrap();
                    let f32_path = matmul(&xt, &dense.t().unwrap()).unwrap();
                    let f32_path = f32_path.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                    let label = format!("{format:?} {n}x{k}, {m} rows");
                    assert!(matmul_t(&x, &w, m).unwrap() == f32_path, "{label}: x·Wᵀ");
                    let mut stale = vec![f32::NAN; m * n];
                    unpacked_t(&x, m, &w, &mut stale);
                    assert!(stale == f32_path, "{label}: x·Wᵀ over stale values");

                    let dy = test_values(m * n, 6);
                    let dyt = Tensor::from_vec(dy.clone(), (m, n), &device).unwrap();
                    let (f32_grad, _) = product_values::<f32>(&dyt, &dense, Threads::All).unwrap();
                    let grad = input_grad_values(&dy, m, &w).unwrap();
                    if n * k <= SLICE_VALUES {
                        assert!(grad == f32_grad, "{label}: ∂y·W");
                    } else {
                        // Another order of the sum over `n`: within its bound.
                        let dense_t = dense.t().unwrap().contiguous().unwrap();
                        let dense_t = dense_t.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                        assert_within_order_bound(&label, &dy, &dense_t, &grad, n);
                    }
                }
            }
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
