//! `x·Wᵀ` for a handful of rows: a small decode step's projections and LM
//! head, and the per-row products of decode attention and LoRA.
//!
//! gemm's kernels are built for a tall left operand: they pack the weight into
//! panels and hand blocks to threads, and with 1–32 rows that packing and
//! hand-off cost more than the arithmetic. A decode step reads every weight
//! once for a few rows, so the weight stream is what matters. Here each block
//! of 4 weight rows is read straight from `W` once and dotted with up to 6
//! input rows at a time, in registers; the input rows stay in cache. On
//! SmolLM2's 210 block projections per decode step, 4 rows took 25–36 ms
//! against gemm's 91–94 (BENCHMARKS.md, broker, "few-row kernel"). Above
//! [`MAX_ROWS`] rows the horizontal sums and the re-reading of input rows
//! cost more than [`super::row_lanes`], which takes over up to 32 rows.
//!
//! Each output is one dot product summed in a fixed order (lane-wise over
//! vector-wide chunks, a fixed reduction, then the tail), whatever the rows
//! around it, so a row gets the same bits alone or inside a batch.

use rayon::prelude::*;

/// Most rows a projection sends here (default 8); 9–32 rows go to
/// [`super::row_lanes`], taller inputs to gemm. At 8 rows the two kernels
/// tie on SmolLM2's block projections (BENCHMARKS.md, session 10).
pub const MAX_ROWS: usize = 8;

/// Weight rows per block, and input rows per register tile.
const BLOCK: usize = 4;
const TILE: usize = 6;

/// Parallel tasks per product, so two threads stay busy on the smallest
/// projections (192 outputs) without one task per block.
const TASKS: usize = 16;

/// The instruction sets with a kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Isa {
    #[cfg(target_arch = "x86_64")]
    Avx512,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    Portable,
}

impl Isa {
    /// The widest this CPU runs.
    pub(crate) fn best() -> Isa {
        Isa::ALL
            .iter()
            .copied()
            .find(|isa| isa.runs_here())
            .unwrap_or(Isa::Portable)
    }

    /// Widest first.
    const ALL: &[Isa] = &[
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2,
        Isa::Portable,
    ];

    /// Whether this CPU has the features the kernels enable. F16C (every
    /// AVX2 CPU has it) converts the f16 scales of weights in blocks.
    pub(crate) fn runs_here(self) -> bool {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f") && Isa::Avx2.runs_here(),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            Isa::Portable => true,
        }
    }

    /// Values per vector: the `Lanes::WIDTH` of this instruction set's kernel.
    pub(crate) fn width(self) -> usize {
        match self {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86::Avx512::WIDTH,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::Avx2::WIDTH,
            Isa::Portable => Scalar::WIDTH,
        }
    }

    /// Every kernel this CPU can run (for tests).
    #[cfg(test)]
    pub(crate) fn available() -> Vec<Isa> {
        Isa::ALL
            .iter()
            .copied()
            .filter(|isa| isa.runs_here())
            .collect()
    }
}

/// `x·Wᵀ` for row-major `x` `[m, k]` and `w` `[n, k]`: row-major `[m, n]`,
/// spread over rayon's threads.
pub fn matmul_t(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Result<Vec<f32>, String> {
    matmul_t_with(Isa::best(), Threads::Rayon, x, w, m, k, n)
}

/// [`matmul_t`] on the calling thread, for callers that are already one of
/// many parallel tasks.
pub fn matmul_t_serial(
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
) -> Result<Vec<f32>, String> {
    matmul_t_with(Isa::best(), Threads::Caller, x, w, m, k, n)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Threads {
    Rayon,
    Caller,
}

pub(crate) fn matmul_t_with(
    isa: Isa,
    threads: Threads,
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
) -> Result<Vec<f32>, String> {
    check_product("few-row matmul", isa, x, w, m, k, n)?;
    if m == 0 || n == 0 || k == 0 {
        return Ok(vec![0.0; m * n]);
    }
    // Outputs transposed ([n, m]) so each task writes one contiguous run.
    let mut y_t = vec![0f32; n * m];
    match threads {
        Threads::Rayon => {
            let per_task = n.div_ceil(TASKS).next_multiple_of(BLOCK).max(BLOCK);
            y_t.par_chunks_mut(per_task * m)
                .zip(w.par_chunks(per_task * k))
                .for_each(|(y_t, w)| run(isa, x, w, m, k, y_t));
        }
        Threads::Caller => run(isa, x, w, m, k, &mut y_t),
    }
    let mut y = vec![0f32; m * n];
    for (j, column) in y_t.chunks_exact(m).enumerate() {
        for (r, &v) in column.iter().enumerate() {
            y[r * n + j] = v;
        }
    }
    Ok(y)
}

/// That `x` holds `[m, k]` and `w` `[n, k]` values, that `[m, n]` fits in
/// memory, and that this CPU runs `isa`; `kernel` names the caller.
pub(crate) fn check_product(
    kernel: &str,
    isa: Isa,
    x: &[f32],
    w: &[f32],
    m: usize,
    k: usize,
    n: usize,
) -> Result<(), String> {
    let fits = |len: usize, rows: usize| rows.checked_mul(k) == Some(len);
    if !fits(x.len(), m) || !fits(w.len(), n) || m.checked_mul(n).is_none() {
        return Err(format!(
            "{kernel}: x has {} values for [{m}, {k}], W {} for [{n}, {k}]",
            x.len(),
            w.len()
        ));
    }
    if !isa.runs_here() {
        return Err(format!("{kernel}: this CPU lacks {isa:?}"));
    }
    Ok(())
}

fn run(isa: Isa, x: &[f32], w: &[f32], m: usize, k: usize, y_t: &mut [f32]) {
    debug_assert!(x.len() == m * k && w.len().is_multiple_of(k) && y_t.len() == w.len() / k * m);
    // SAFETY: the slices have the lengths `tiles` reads and writes, k > 0
    // (both checked by `matmul_t_with`, and kept by its chunking), and
    // `matmul_t_with` checked that this CPU has the features `isa` enables.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => tiles_avx512(x, w, m, k, y_t),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => tiles_avx2(x, w, m, k, y_t),
            Isa::Portable => tiles::<Scalar>(x, w, m, k, y_t),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma")]
unsafe fn tiles_avx512(x: &[f32], w: &[f32], m: usize, k: usize, y_t: &mut [f32]) {
    tiles::<x86::Avx512>(x, w, m, k, y_t)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn tiles_avx2(x: &[f32], w: &[f32], m: usize, k: usize, y_t: &mut [f32]) {
    tiles::<x86::Avx2>(x, w, m, k, y_t)
}

/// Vector operations a kernel is written in.
pub(crate) trait Lanes {
    type V: Copy;
    const WIDTH: usize;
    unsafe fn zero() -> Self::V;
    unsafe fn load(p: *const f32) -> Self::V;
    unsafe fn store(p: *mut f32, v: Self::V);
    /// Every lane `*p`.
    unsafe fn splat(p: *const f32) -> Self::V;
    /// A hint to bring `p`'s cache line into L2 (default: nothing).
    #[inline(always)]
    unsafe fn prefetch(_p: *const f32) {}
    /// `a·b + c`.
    unsafe fn fma(a: Self::V, b: Self::V, c: Self::V) -> Self::V;
    unsafe fn sum(v: Self::V) -> f32;
}

/// One lane: the kernel on any CPU.
pub(crate) struct Scalar;

impl Lanes for Scalar {
    type V = f32;
    const WIDTH: usize = 1;
    unsafe fn zero() -> f32 {
        0.0
    }
    unsafe fn load(p: *const f32) -> f32 {
        *p
    }
    unsafe fn store(p: *mut f32, v: f32) {
        *p = v
    }
    unsafe fn splat(p: *const f32) -> f32 {
        *p
    }
    unsafe fn fma(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
    unsafe fn sum(v: f32) -> f32 {
        v
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    pub struct Avx512;
    pub struct Avx2;

    impl super::Lanes for Avx512 {
        type V = __m512;
        const WIDTH: usize = 16;
        #[inline(always)]
        unsafe fn zero() -> __m512 {
            _mm512_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m512 {
            _mm512_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m512) {
            _mm512_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m512 {
            _mm512_set1_ps(*p)
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const f32) {
            _mm_prefetch::<_MM_HINT_T1>(p as *const i8)
        }
        #[inline(always)]
        unsafe fn fma(a: __m512, b: __m512, c: __m512) -> __m512 {
            _mm512_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn sum(v: __m512) -> f32 {
            _mm512_reduce_add_ps(v)
        }
    }

    impl super::Lanes for Avx2 {
        type V = __m256;
        const WIDTH: usize = 8;
        #[inline(always)]
        unsafe fn zero() -> __m256 {
            _mm256_setzero_ps()
        }
        #[inline(always)]
        unsafe fn load(p: *const f32) -> __m256 {
            _mm256_loadu_ps(p)
        }
        #[inline(always)]
        unsafe fn store(p: *mut f32, v: __m256) {
            _mm256_storeu_ps(p, v)
        }
        #[inline(always)]
        unsafe fn splat(p: *const f32) -> __m256 {
            _mm256_broadcast_ss(&*p)
        }
        #[inline(always)]
        unsafe fn prefetch(p: *const f32) {
            _mm_prefetch::<_MM_HINT_T1>(p as *const i8)
        }
        #[inline(always)]
        unsafe fn fma(a: __m256, b: __m256, c: __m256) -> __m256 {
            _mm256_fmadd_ps(a, b, c)
        }
        #[inline(always)]
        unsafe fn sum(v: __m256) -> f32 {
            let half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
            let quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
            _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps(quarter, quarter, 1)))
        }
    }
}

/// All of `y_t` (`[w rows, m]`): blocks of [`BLOCK`] weight rows, each
/// against tiles of [`TILE`] input rows; leftover rows and columns one at a
/// time.
#[inline(always)]
unsafe fn tiles<S: Lanes>(x: &[f32], w: &[f32], m: usize, k: usize, y_t: &mut [f32]) {
    let n = w.len() / k;
    let (x, w, y_t) = (x.as_ptr(), w.as_ptr(), y_t.as_mut_ptr());
    let (full_n, full_m) = (n - n % BLOCK, m - m % TILE);
    let at = |j: usize, r: usize| (x.add(r * k), w.add(j * k), y_t.add(j * m + r));
    for j in (0..full_n).step_by(BLOCK) {
        for r in (0..full_m).step_by(TILE) {
            let (x, w, y) = at(j, r);
            dots::<S, BLOCK, TILE>(x, w, k, m, y);
        }
        for r in full_m..m {
            let (x, w, y) = at(j, r);
            dots::<S, BLOCK, 1>(x, w, k, m, y);
        }
    }
    for j in full_n..n {
        for r in 0..m {
            let (x, w, y) = at(j, r);
            dots::<S, 1, 1>(x, w, k, m, y);
        }
    }
}

/// The `B × R` dot products of weight rows `w[0..B]` with input rows
/// `x[0..R]` (each `k` long), written to `y[b·m + r]`.
#[inline(always)]
unsafe fn dots<S: Lanes, const B: usize, const R: usize>(
    x: *const f32,
    w: *const f32,
    k: usize,
    m: usize,
    y: *mut f32,
) {
    let mut acc = [[S::zero(); R]; B];
    let body = k - k % S::WIDTH;
    for o in (0..body).step_by(S::WIDTH) {
        let mut wv = [S::zero(); B];
        for (b, wv) in wv.iter_mut().enumerate() {
            *wv = S::load(w.add(b * k + o));
        }
        for r in 0..R {
            let xv = S::load(x.add(r * k + o));
            for (acc, &wv) in acc.iter_mut().zip(&wv) {
                acc[r] = S::fma(wv, xv, acc[r]);
            }
        }
    }
    for (b, acc) in acc.iter().enumerate() {
        for (r, &acc) in acc.iter().enumerate() {
            let mut sum = S::sum(acc);
            for i in body..k {
                sum += *w.add(b * k + i) * *x.add(r * k + i);
            }
            *y.add(b * m + r) = sum;
        }
    }
}

/// `n` values in [-1, 1] that depend on `seed`, for the kernels' tests.
#[cfg(test)]
pub(crate) fn test_values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| {
            ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) % 2001) as f32 / 1000.0 - 1.0
        })
        .collect()
}

/// That `y` is `x·wᵀ` (`x` `[m, k]`, `w` `[n, k]`) to within f32 rounding,
/// checked against sums in f64; `label` names the kernel in a failure.
#[cfg(test)]
pub(crate) fn assert_matches_reference(label: &str, x: &[f32], w: &[f32], y: &[f32], k: usize) {
    let (m, n) = (x.len() / k, w.len() / k);
    assert_eq!(y.len(), m * n, "{label}");
    for (r, x) in x.chunks_exact(k).enumerate() {
        for (j, w) in w.chunks_exact(k).enumerate() {
            let exact: f64 = x.iter().zip(w).map(|(&a, &b)| a as f64 * b as f64).sum();
            let err = (y[r * n + j] as f64 - exact).abs();
            assert!(
                err <= 1e-5 * k as f64,
                "{label} {m}x{k}x{n} [{r},{j}]: {err}"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::test_values as values;

    fn every_kernel() -> Vec<(Isa, Threads)> {
        let threads = [Threads::Rayon, Threads::Caller];
        let isas = Isa::available();
        isas.into_iter()
            .flat_map(|isa| threads.map(|t| (isa, t)))
            .collect()
    }

    /// Every kernel this CPU runs agrees with an f64 reference, over row
    /// counts that cover partial tiles and blocks and lengths with a tail.
    #[test]
    fn kernels_match_a_reference() {
        let cases = [
            (1, 16, 4),
            (5, 37, 7),
            (7, 64, 9),
            (32, 576, 24),
            (13, 3, 1),
        ];
        for (isa, threads) in every_kernel() {
            for &(m, k, n) in &cases {
                let (x, w) = (values(m * k, 1), values(n * k, 2));
                let y = matmul_t_with(isa, threads, &x, &w, m, k, n).unwrap();
                assert_matches_reference(&format!("{isa:?} {threads:?}"), &x, &w, &y, k);
            }
        }
    }

    /// A row's outputs are bitwise the same alone and inside a batch, and
    /// on one thread or many.
    #[test]
    fn a_row_gets_the_same_bits_in_any_batch() {
        let (k, n) = (100, 13);
        let w = values(n * k, 3);
        let batch = values(11 * k, 4);
        for (isa, threads) in every_kernel() {
            let together = matmul_t_with(isa, threads, &batch, &w, 11, k, n).unwrap();
            for r in 0..11 {
                let row = &batch[r * k..(r + 1) * k];
                let alone = matmul_t_with(isa, threads, row, &w, 1, k, n).unwrap();
                assert_eq!(alone, together[r * n..(r + 1) * n], "{isa:?} row {r}");
            }
            let serial = matmul_t_with(isa, Threads::Caller, &batch, &w, 11, k, n).unwrap();
            assert_eq!(serial, together, "{isa:?}");
        }
    }

    #[test]
    fn wrong_lengths_are_an_error_and_empty_products_zeros() {
        let err = matmul_t(&[0.0; 5], &[0.0; 8], 2, 3, 4).unwrap_err();
        assert!(err.contains("[2, 3]"), "{err}");
        let huge = usize::MAX / 2 + 1;
        assert!(matmul_t(&[0.0; 4], &[0.0; 4], huge, 2, 2).is_err());
        assert_eq!(matmul_t(&[], &[], 2, 0, 3).unwrap(), vec![0.0; 6]);
        assert!(matmul_t_serial(&[], &[0.0; 6], 0, 3, 2).unwrap().is_empty());
    }
}
