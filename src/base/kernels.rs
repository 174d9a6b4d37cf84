//! Fused CPU kernels of the train step's hand-written forward and backward
//! (`compute::tape`), in f32 and f64 (the f64 path serves the finite-difference
//! gradient check); the forwards are the ones the model's one forward runs on
//! the CPU ([`super::model`]). Each reads its inputs once and writes one new
//! tensor (the log-prob gradient overwrites its logits instead), in parallel
//! over rows, where candle would chain several single-pass ops and allocate a
//! tensor for each. Decode attention and generation's log-probs use their
//! row functions too. Their loops are built for each instruction set the
//! CPU may have (`per_isa!`).

use std::mem::MaybeUninit;
use std::ops::Range;

use candle_core::{bail, Device, Error, Result, Shape, Storage, StorageRef, Tensor, WithDType};
use rayon::prelude::*;

use super::few_rows::{self, Isa};

/// The float types the kernels run in.
pub trait Real: WithDType + super::native::PanelFloat {
    const ZERO: Self;
    const ONE: Self;
    /// In f32 [`exp_f32`]: +∞ above 88.3 (libm: above 88.72), 0 below -87.3.
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    /// The value in f64 (always inlined, unlike `WithDType::to_f64`, so sums of it vectorise).
    fn as_f64(self) -> f64;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline(always)]
    fn exp(self) -> Self {
        exp_f32(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn as_f64(self) -> f64 {
        self as f64
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    #[inline(always)]
    fn exp(self) -> Self {
        f64::exp(self)
    }
    #[inline(always)]
    fn sqrt(self) -> Self {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn as_f64(self) -> f64 {
        self
    }
}

/// `eˣ` in f32 without a libm call, so that a loop over a slice of values
/// vectorises: the libm call (`expf`) was ≈ 8 % of a train step's time, for the
/// attention softmax, the LM head and SwiGLU's sigmoid. Cephes' `expf`
/// (Moshier): `x = n·ln 2 + r` with `|r| ≤ ln 2 / 2`, `eʳ` by a degree-6
/// polynomial, `2ⁿ` written into the exponent bits. About 1 ulp: relative
/// error below 1e-7 sampled over `[-87.3, 88.3]` (unit test); below that range
/// the result is 0 (not a subnormal), above it +∞ (libm stays finite up to
/// 88.72), and NaN stays NaN.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOWEST: f32 = -87.3; // 2ⁿ with n ≥ -126 stays a normal float
    const HIGHEST: f32 = 88.3; // and with n ≤ 127 a finite one
    const ROUND: f32 = 12_582_912.0; // 1.5·2²³: adding it rounds to an integer
    const LN2_HI: f32 = 0.693_359_4; // ln 2 in two parts, so n·ln 2 is exact
    const LN2_LO: f32 = -2.121_944_4e-4;
    let xc = x.clamp(LOWEST, HIGHEST);
    let t = xc * std::f32::consts::LOG2_E + ROUND;
    let n = t - ROUND;
    let r = (xc - n * LN2_HI) - n * LN2_LO;
    // eʳ ≈ 1 + r + r²·P(r), P by Horner from the highest power.
    const P: [f32; 6] = [
        1.987_569_2e-4,
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        1.666_666_5e-1,
        0.5,
    ];
    let p = P.iter().fold(0.0, |p, &c| p * r + c);
    let e = (p * r * r + r) + 1.0;
    // n sits in the low bits of t's mantissa: t = 1.5·2²³ + n. Taking it from
    // there rather than with `n as i32` keeps the loop vectorised (the
    // saturating cast is done lane by lane).
    let two_n = f32::from_bits(t.to_bits().wrapping_sub(0x4B40_0000 - 127) << 23);
    if x > HIGHEST {
        f32::INFINITY
    } else if x < LOWEST {
        0.0
    } else {
        e * two_n
    }
}

/// Evaluates `$body` with the type `$t` bound to the [`Real`] of `$dtype`
/// (f32 or f64), or returns an error naming any other dtype.
macro_rules! with_real {
    ($dtype:expr, $t:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $t = f32;
                $body
            }
            candle_core::DType::F64 => {
                type $t = f64;
                $body
            }
            other => Err(candle_core::Error::Msg(format!(
                "the train step runs in f32 or f64, not {other:?}"
            ))
            .into()),
        }
    };
}
pub(crate) use with_real;

/// Defines `fn name<T: Real>(isa: Isa, args…)` from a body compiled once per
/// instruction set of [`Isa`], so its loops vectorise into AVX-512 or AVX2
/// registers: the crate builds for baseline x86-64, where they get SSE2's
/// four lanes. The body never asks for a fused multiply-add, and its sums
/// keep [`LANES`] accumulators whatever the register width, so every variant
/// gives the same bits (unit test). An `isa` this CPU does not run falls
/// back to the portable build.
macro_rules! per_isa {
    (
        $(#[$attr:meta])*
        $vis:vis fn $name:ident<T: Real>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$attr])*
        $vis fn $name<T: Real>(isa: Isa, $($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body<T: Real>($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx2,fma")]
            unsafe fn avx512<T: Real>($($arg: $ty),*) $(-> $ret)? {
                body::<T>($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn avx2<T: Real>($($arg: $ty),*) $(-> $ret)? {
                body::<T>($($arg),*)
            }
            match isa {
                // SAFETY: `runs_here` checked that this CPU has the features.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512 if isa.runs_here() => unsafe { avx512::<T>($($arg),*) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 if isa.runs_here() => unsafe { avx2::<T>($($arg),*) },
                _ => body::<T>($($arg),*),
            }
        }
    };
}

/// Independent accumulators of the kernels' sums and maxima. One running sum
/// is a chain of dependent adds that the compiler may not reorder, so it
/// runs one value at a time; sixteen partial results fill an AVX-512
/// register (or four SSE ones) and are combined in one fixed order.
const LANES: usize = 16;
const _: () = assert!(LANES.is_power_of_two(), "combine halves the lanes");

/// `Σᵢ term(aᵢ, bᵢ, cᵢ)` over three equally long slices, in [`LANES`]
/// partial sums (of type `S`, which may be wider than the values).
#[inline(always)]
fn lane_sum3<S: Real, A: Copy, B: Copy, C: Copy>(
    a: &[A],
    b: &[B],
    c: &[C],
    term: impl Fn(A, B, C) -> S,
) -> S {
    debug_assert!(a.len() == b.len() && b.len() == c.len());
    let mut partial = [S::ZERO; LANES];
    let mut add = |xs: &[A], ys: &[B], zs: &[C]| {
        let terms = xs.iter().zip(ys).zip(zs);
        for (sum, ((&x, &y), &z)) in partial.iter_mut().zip(terms) {
            *sum += term(x, y, z);
        }
    };
    let (xs, ys, zs) = (
        a.chunks_exact(LANES),
        b.chunks_exact(LANES),
        c.chunks_exact(LANES),
    );
    let tails = (xs.remainder(), ys.remainder(), zs.remainder());
    for ((x, y), z) in xs.zip(ys).zip(zs) {
        add(x, y, z);
    }
    add(tails.0, tails.1, tails.2);
    combine(partial, |x, y| x + y)
}

/// [`lane_sum3`] over two slices.
#[inline(always)]
fn lane_sum2<S: Real, A: Copy, B: Copy>(a: &[A], b: &[B], term: impl Fn(A, B) -> S) -> S {
    lane_sum3(a, b, b, |a, b, _| term(a, b))
}

/// [`lane_sum3`] over one slice.
#[inline(always)]
fn lane_sum<S: Real, A: Copy>(a: &[A], term: impl Fn(A) -> S) -> S {
    lane_sum3(a, a, a, |a, _, _| term(a))
}

/// The largest of `x` (`-∞` for none; NaN is passed over), in [`LANES`] partial maxima.
#[inline(always)]
fn lane_max<T: Real>(x: &[T]) -> T {
    let bigger = |m: T, v: T| if v > m { v } else { m };
    let mut acc = [T::from_f64(f64::NEG_INFINITY); LANES];
    let mut take = |x: &[T]| {
        for (acc, &v) in acc.iter_mut().zip(x) {
            *acc = bigger(*acc, v);
        }
    };
    let chunks = x.chunks_exact(LANES);
    let tail = chunks.remainder();
    chunks.for_each(&mut take);
    take(tail);
    combine(acc, bigger)
}

/// Folds [`LANES`] partial results pairwise, always in the same order.
#[inline(always)]
fn combine<T: Copy>(mut acc: [T; LANES], op: impl Fn(T, T) -> T) -> T {
    let mut width = LANES;
    while width > 1 {
        width /= 2;
        for i in 0..width {
            acc[i] = op(acc[i], acc[i + width]);
        }
    }
    acc[0]
}

/// A read lock on a contiguous CPU tensor's values.
struct View<'a> {
    storage: StorageRef<'a>,
    range: Range<usize>,
}

impl View<'_> {
    fn of(t: &Tensor) -> Result<View<'_>> {
        let (storage, layout) = t.storage_and_layout();
        let Some((start, end)) = layout.contiguous_offsets() else {
            bail!("kernel input {:?} is not contiguous", t.shape())
        };
        Ok(View {
            storage,
            range: start..end,
        })
    }

    fn values<T: Real>(&self) -> Result<&[T]> {
        match &*self.storage {
            Storage::Cpu(s) => Ok(&T::cpu_storage_as_slice(s)?[self.range.clone()]),
            _ => bail!("kernels run on the CPU only"),
        }
    }
}

fn tensor<T: Real>(values: Vec<T>, shape: impl Into<Shape>) -> Result<Tensor> {
    Tensor::from_vec(values, shape, &Device::Cpu)
}

/// A kernel's output of `len` values, computed piece by piece in parallel:
/// `fill(i, piece)` writes the `i`th `chunk` values. The allocation is not
/// zeroed as a whole first: `vec![0; len]` is a memset on one thread over
/// the whole output, since freed memory is reused rather than fresh from the
/// kernel (see the binary's `keep_freed_memory`). Each piece is zeroed by the
/// thread that then fills it, while it is in cache.
fn filled<T: Real>(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [T]) + Sync,
) -> Result<Vec<T>> {
    check_chunk(len, chunk)?;
    let mut out = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .enumerate()
        .for_each(|(i, piece)| fill(i, zeroed(piece)));
    // SAFETY: the pieces cover the first `len` values; `zeroed` initialised each.
    unsafe { out.set_len(len) };
    Ok(out)
}

/// [`filled`] for a kernel with two outputs of `len` values each.
fn filled_pair<T: Real>(
    len: usize,
    chunk: usize,
    fill: impl Fn(usize, &mut [T], &mut [T]) + Sync,
) -> Result<(Vec<T>, Vec<T>)> {
    check_chunk(len, chunk)?;
    let (mut a, mut b) = (Vec::with_capacity(len), Vec::with_capacity(len));
    a.spare_capacity_mut()[..len]
        .par_chunks_mut(chunk.max(1))
        .zip(b.spare_capacity_mut()[..len].par_chunks_mut(chunk.max(1)))
        .enumerate()
        .for_each(|(i, (pa, pb))| fill(i, zeroed(pa), zeroed(pb)));
    // SAFETY: as in `filled`, for each of the two.
    unsafe {
        a.set_len(len);
        b.set_len(len);
    }
    Ok((a, b))
}

/// An error for a piece size of 0 with values to fill: rayon would panic.
/// No kernel's checked shapes lead there.
fn check_chunk(len: usize, chunk: usize) -> Result<()> {
    if chunk == 0 && len > 0 {
        bail!("kernel output of {len} values in pieces of 0")
    }
    Ok(())
}

/// `piece` set to zeros, as values.
fn zeroed<T: Real>(piece: &mut [MaybeUninit<T>]) -> &mut [T] {
    piece.fill(MaybeUninit::new(T::ZERO));
    // SAFETY: every element was just initialised, and `MaybeUninit<T>` has
    // the layout of `T`.
    unsafe { &mut *(piece as *mut [MaybeUninit<T>] as *mut [T]) }
}

fn last_dim(t: &Tensor) -> Result<usize> {
    t.dims()
        .last()
        .copied()
        .filter(|&d| d > 0)
        .ok_or_else(|| candle_core::Error::Msg(format!("kernel input {:?} is empty", t.shape())))
}

/// An error unless `what` has `expected` values.
fn check_len(what: &str, actual: usize, expected: usize) -> Result<()> {
    if actual != expected {
        bail!("kernel input {what}: {actual} values, expected {expected}")
    }
    Ok(())
}

/// `1 / √(mean(x²) + ε)` of one row.
#[inline(always)]
fn inverse_rms<T: Real>(x: &[T], eps: f64) -> T {
    let sum = lane_sum(x, |v| v * v);
    T::ONE / (sum / T::from_f64(x.len() as f64) + T::from_f64(eps)).sqrt()
}

per_isa! {
    /// One row of [`rms_norm`].
    fn rms_norm_row<T: Real>(y: &mut [T], x: &[T], w: &[T], eps: f64) {
        let r = inverse_rms(x, eps);
        for ((y, &x), &w) in y.iter_mut().zip(x).zip(w) {
            *y = x * r * w;
        }
    }
}

/// RMSNorm over the last axis: `x · r · w`, `r = 1/√(mean(x²) + ε)`.
pub fn rms_norm<T: Real>(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let d = last_dim(x)?;
    let (xv, wv) = (View::of(x)?, View::of(w)?);
    let (xs, ws) = (xv.values::<T>()?, wv.values::<T>()?);
    check_len("RMSNorm weight", ws.len(), d)?;
    let isa = Isa::best();
    let out = filled(xs.len(), d, |i, y| {
        rms_norm_row(isa, y, &xs[i * d..][..d], ws, eps)
    })?;
    tensor(out, x.shape())
}

/// `residual + ∂/∂x` of RMSNorm given the output gradient `g`:
/// `r · (g⊙w − x̂ · mean(g⊙w⊙x̂))`, `x̂ = x·r`.
pub fn rms_norm_backward<T: Real>(
    x: &Tensor,
    w: &Tensor,
    eps: f64,
    g: &Tensor,
    residual: Option<&Tensor>,
) -> Result<Tensor> {
    let d = last_dim(x)?;
    let (xv, wv, gv) = (View::of(x)?, View::of(w)?, View::of(g)?);
    let (xs, ws, gs) = (xv.values::<T>()?, wv.values::<T>()?, gv.values::<T>()?);
    check_len("RMSNorm weight", ws.len(), d)?;
    check_len("RMSNorm gradient", gs.len(), xs.len())?;
    let rv = residual.map(View::of).transpose()?;
    let rs = rv.as_ref().map(|rv| rv.values::<T>()).transpose()?;
    if let Some(rs) = rs {
        check_len("RMSNorm residual", rs.len(), xs.len())?;
    }
    let isa = Isa::best();
    let out = filled(xs.len(), d, |i, dx| {
        if let Some(rs) = rs {
            dx.copy_from_slice(&rs[i * d..][..d]);
        }
        let (x, g) = (&xs[i * d..][..d], &gs[i * d..][..d]);
        rms_norm_backward_row(isa, dx, x, g, ws, eps)
    })?;
    tensor(out, x.shape())
}

per_isa! {
    /// One row of [`rms_norm_backward`], added to `dx`.
    fn rms_norm_backward_row<T: Real>(dx: &mut [T], x: &[T], g: &[T], w: &[T], eps: f64) {
        let r = inverse_rms(x, eps);
        let dot = lane_sum3(x, g, w, |x, g, w| g * w * x) * r;
        let mean = dot / T::from_f64(x.len() as f64);
        for (((dx, &x), &g), &w) in dx.iter_mut().zip(x).zip(g).zip(w) {
            *dx += r * (g * w - x * r * mean);
        }
    }
}

/// The shape of one RoPE'd projection: `rows` sequences of `n` tokens, `heads`
/// heads of `head_dim` values.
#[derive(Debug, Clone, Copy)]
pub struct Heads {
    pub rows: usize,
    pub n: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl Heads {
    /// An error unless `x` holds every head of every token and `cos`/`sin`
    /// one half head per token.
    fn check<T: Real>(&self, x: &[T], cos: &[T], sin: &[T]) -> Result<()> {
        let tokens = self.rows * self.n;
        if self.head_dim == 0 || self.head_dim % 2 == 1 || self.heads == 0 || tokens == 0 {
            bail!("RoPE: bad shape {self:?}")
        }
        check_len(
            "RoPE projection",
            x.len(),
            tokens * self.heads * self.head_dim,
        )?;
        check_len("RoPE cos", cos.len(), tokens * self.head_dim / 2)?;
        check_len("RoPE sin", sin.len(), tokens * self.head_dim / 2)
    }
}

/// HF ("rotate half") RoPE of a projection `[rows·n, heads·hd]`, written out
/// head-major as `[rows, heads, n, hd]` (the split-heads transpose in the same
/// pass). `cos`/`sin`: `[rows, 1, n, hd/2]`.
pub fn rope_heads<T: Real>(x: &Tensor, cos: &Tensor, sin: &Tensor, s: Heads) -> Result<Tensor> {
    let (hd, half) = (s.head_dim, s.head_dim / 2);
    let (xv, cv, sv) = (View::of(x)?, View::of(cos)?, View::of(sin)?);
    let (xs, cs, ss) = (xv.values::<T>()?, cv.values::<T>()?, sv.values::<T>()?);
    s.check(xs, cs, ss)?;
    let isa = Isa::best();
    // One chunk per (row, head): n·hd output values.
    let out = filled(xs.len(), s.n * hd, |rh, y| {
        let (r, h) = (rh / s.heads, rh % s.heads);
        for (i, y) in y.chunks_mut(hd).enumerate() {
            let src = ((r * s.n + i) * s.heads + h) * hd;
            let trig = (r * s.n + i) * half;
            let (cos, sin) = (&cs[trig..][..half], &ss[trig..][..half]);
            rotate(isa, y, &xs[src..][..hd], cos, sin, T::ONE);
        }
    })?;
    tensor(out, (s.rows, s.heads, s.n, hd))
}

/// The gradient of [`rope_heads`]: `[rows, heads, n, hd]` in, the projection's
/// `[rows·n, heads·hd]` out (the inverse rotation and the merge-heads transpose).
pub fn rope_heads_backward<T: Real>(
    g: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    s: Heads,
) -> Result<Tensor> {
    let (hd, half) = (s.head_dim, s.head_dim / 2);
    let (gv, cv, sv) = (View::of(g)?, View::of(cos)?, View::of(sin)?);
    let (gs, cs, ss) = (gv.values::<T>()?, cv.values::<T>()?, sv.values::<T>()?);
    s.check(gs, cs, ss)?;
    let isa = Isa::best();
    // One chunk per token (row, i): heads·hd output values.
    let out = filled(gs.len(), s.heads * hd, |ri, y| {
        let (r, i) = (ri / s.n, ri % s.n);
        let (cos, sin) = (&cs[ri * half..][..half], &ss[ri * half..][..half]);
        for (h, y) in y.chunks_mut(hd).enumerate() {
            let src = ((r * s.heads + h) * s.n + i) * hd;
            rotate(isa, y, &gs[src..][..hd], cos, sin, T::from_f64(-1.0));
        }
    })?;
    tensor(out, (s.rows * s.n, s.heads * hd))
}

per_isa! {
    /// One head of one token rotated "rotate half" style by `sign`·θ:
    /// `y = (x₁c − x₂s', x₂c + x₁s')`, `s' = sign·sin` (−1 undoes the rotation).
    fn rotate<T: Real>(y: &mut [T], x: &[T], cos: &[T], sin: &[T], sign: T) {
        let half = cos.len();
        let (x1, x2) = x.split_at(half);
        let (y1, y2) = y.split_at_mut(half);
        let values = y1.iter_mut().zip(y2).zip(x1.iter().zip(x2));
        for (((y1, y2), (&x1, &x2)), (&c, &s)) in values.zip(cos.iter().zip(sin)) {
            let s = sign * s;
            *y1 = x1 * c - x2 * s;
            *y2 = x2 * c + x1 * s;
        }
    }
}

/// Attention probabilities `softmax(scale·s + mask)` over the last axis, for
/// scores `[rows, …, n, slots]` (any number of heads between) and the additive
/// mask `[rows, 1, n, slots]` shared by every head of a row.
pub fn masked_softmax<T: Real>(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let slots = last_dim(scores)?;
    let (rows, _, n, mask_slots) = mask.dims4()?;
    let per_row = scores.elem_count() / rows.max(1);
    let same_rows = scores.dims().first() == Some(&rows);
    if rows == 0
        || n == 0
        || mask_slots != slots
        || !same_rows
        || !per_row.is_multiple_of(n * slots)
    {
        bail!(
            "masked softmax: scores {:?}, mask {:?}",
            scores.shape(),
            mask.shape()
        )
    }
    let (sv, mv) = (View::of(scores)?, View::of(mask)?);
    let (ss, ms) = (sv.values::<T>()?, mv.values::<T>()?);
    check_len("scores", ss.len(), rows * per_row)?;
    check_len("mask", ms.len(), rows * n * slots)?;
    let (scale, isa) = (T::from_f64(scale), Isa::best());
    let out = filled(ss.len(), slots, |q, p| {
        let (r, i) = (q * slots / per_row, q % n);
        let s = &ss[q * slots..][..slots];
        let m = &ms[(r * n + i) * slots..][..slots];
        softmax_row(isa, p, s, m, scale)
    })?;
    tensor(out, scores.shape())
}

per_isa! {
    /// One query row of [`masked_softmax`]: `p = softmax(scale·s + m)`.
    pub(crate) fn softmax_row<T: Real>(p: &mut [T], s: &[T], m: &[T], scale: T) {
        for ((p, &s), &m) in p.iter_mut().zip(s).zip(m) {
            *p = scale * s + m;
        }
        let max = lane_max(p);
        p.iter_mut().for_each(|p| *p = (*p - max).exp());
        let sum = lane_sum(p, |p| p);
        p.iter_mut().for_each(|p| *p /= sum);
    }
}

/// The gradient of [`masked_softmax`] with respect to the unscaled scores:
/// `scale · p ⊙ (g − Σⱼ gⱼ·pⱼ)`.
pub fn masked_softmax_backward<T: Real>(p: &Tensor, g: &Tensor, scale: f64) -> Result<Tensor> {
    let slots = last_dim(p)?;
    let (pv, gv) = (View::of(p)?, View::of(g)?);
    let (ps, gs) = (pv.values::<T>()?, gv.values::<T>()?);
    check_len("softmax gradient", gs.len(), ps.len())?;
    let (scale, isa) = (T::from_f64(scale), Isa::best());
    let out = filled(ps.len(), slots, |i, d| {
        let (p, g) = (&ps[i * slots..][..slots], &gs[i * slots..][..slots]);
        softmax_backward_row(isa, d, p, g, scale)
    })?;
    tensor(out, p.shape())
}

per_isa! {
    /// One row of [`masked_softmax_backward`].
    fn softmax_backward_row<T: Real>(d: &mut [T], p: &[T], g: &[T], scale: T) {
        let dot = lane_sum2(p, g, |p, g| p * g);
        for ((d, &p), &g) in d.iter_mut().zip(p).zip(g) {
            *d = scale * p * (g - dot);
        }
    }
}

/// Whether bit `t` of a token mask is set (bit `t % 32` of word `t / 32`).
pub fn bit_set(words: &[u32], t: u32) -> bool {
    words
        .get(t as usize / 32)
        .is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// `z[t] ← masked` for every `t` whose bit in the token mask `words` is
/// clear (and every `t` past its words).
pub fn mask_out<T: Copy>(z: &mut [T], words: &[u32], masked: T) {
    for (chunk, &word) in z.chunks_mut(32).zip(words) {
        if word == u32::MAX {
            continue;
        }
        for (bit, value) in chunk.iter_mut().enumerate() {
            if word >> bit & 1 == 0 {
                *value = masked;
            }
        }
    }
    z.iter_mut()
        .skip(words.len() * 32)
        .for_each(|v| *v = masked);
}

/// How a target's distribution comes from its logits: the softmax of
/// `logits · inv_temperature` over the tokens `mask` allows (every token when
/// `None`). It is the distribution its token was sampled from.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy<'a> {
    pub mask: Option<&'a [u32]>,
    pub inv_temperature: f64,
}

/// For `logits`, the row-major values of `[n, vocab]` with one target token
/// per row: each row's `log softmax(logits)[target]`; the logits are
/// overwritten with the gradient of a loss whose derivative with respect to
/// row `i`'s log-prob is `dloss(i, logp)`:
/// `g·(onehot(target) − softmax(logits))`, `g = dloss(i, logp)`; under row
/// `i`'s [`Policy`]: the softmax renormalised over the tokens its mask allows
/// (the others' logits set to −∞: no probability, no gradient), of the logits
/// divided by its temperature.
pub fn target_logprob_grad<T: Real>(
    logits: &mut [T],
    vocab: usize,
    targets: &[u32],
    policies: &[Policy],
    dloss: impl Fn(usize, f64) -> f64 + Sync,
) -> Result<Vec<f64>> {
    if vocab == 0 || targets.len().checked_mul(vocab) != Some(logits.len()) {
        bail!(
            "{} targets for {} logits of a vocabulary of {vocab}",
            targets.len(),
            logits.len()
        )
    }
    if policies.len() != targets.len() {
        bail!("{} targets but {} policies", targets.len(), policies.len())
    }
    if let Some(t) = targets.iter().find(|&&t| t as usize >= vocab) {
        bail!("target token {t} outside the vocabulary of {vocab}")
    }
    if let Some(i) = (0..targets.len()).find(|&i| {
        let p = &policies[i];
        p.mask
            .is_some_and(|m| m.len() != vocab.div_ceil(32) || !bit_set(m, targets[i]))
            || !(p.inv_temperature.is_finite() && p.inv_temperature > 0.0)
    }) {
        bail!("target {i} is outside its mask, its mask does not cover the vocabulary, or its temperature is not positive")
    }
    let isa = Isa::best();
    Ok(logits
        .par_chunks_mut(vocab)
        .enumerate()
        .map(|(i, z)| {
            let policy = &policies[i];
            if let Some(words) = policy.mask {
                mask_out(z, words, T::from_f64(f64::NEG_INFINITY));
            }
            // d/dz of a function of z/T is 1/T times its gradient there.
            let inv_t = policy.inv_temperature;
            if inv_t != 1.0 {
                scale_in_place(isa, z, T::from_f64(inv_t));
            }
            let target = targets[i] as usize;
            let target_logit = z[target];
            let (max, sum) = exp_shifted_in_place(isa, z);
            let logp = (target_logit - max).to_f64() - sum.ln();
            let g = dloss(i, logp) * inv_t;
            scale_in_place(isa, z, T::from_f64(-g / sum));
            z[target] += T::from_f64(g);
            logp
        })
        .collect())
}

per_isa! {
    /// `z ← exp(z − max z)`; returns `max z` and the new values' sum, in f64.
    fn exp_shifted_in_place<T: Real>(z: &mut [T]) -> (T, f64) {
        let max = lane_max(z);
        z.iter_mut().for_each(|z| *z = (*z - max).exp());
        (max, lane_sum(z, |z| z.as_f64()))
    }
}

per_isa! {
    /// `max z` and `Σ exp(z − max z)` (the sum in f64), without writing `z`.
    fn max_and_exp_sum<T: Real>(z: &[T]) -> (T, f64) {
        let max = lane_max(z);
        (max, lane_sum(z, |z| (z - max).exp().as_f64()))
    }
}

/// `log softmax(logits)[token]`, computed as [`target_logprob_grad`] does.
pub fn log_softmax_at(logits: &[f32], token: usize) -> f32 {
    let (max, sum) = max_and_exp_sum(Isa::best(), logits);
    ((logits[token] - max) as f64 - sum.ln()) as f32
}

/// The `k` largest entries of `log softmax(logits)`, best first (ties: the
/// lower token id first), each with the bits [`log_softmax_at`] gives it.
/// Tokens at −∞ (those a grammar's mask forbids) are left out.
pub fn top_log_softmax(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    if k == 0 {
        return Vec::new();
    }
    let (max, sum) = max_and_exp_sum(Isa::best(), logits);
    let best_first = |a: &u32, b: &u32| {
        let (la, lb) = (logits[*a as usize], logits[*b as usize]);
        lb.total_cmp(&la).then(a.cmp(b))
    };
    let mut tokens: Vec<u32> = (0..logits.len() as u32)
        .filter(|&t| logits[t as usize] > f32::NEG_INFINITY)
        .collect();
    if tokens.len() > k {
        tokens.select_nth_unstable_by(k, best_first);
        tokens.truncate(k);
    }
    tokens.sort_unstable_by(best_first);
    let ln_sum = sum.ln();
    tokens
        .into_iter()
        .map(|t| (t, ((logits[t as usize] - max) as f64 - ln_sum) as f32))
        .collect()
}

per_isa! {
    /// `z ← scale·z`.
    fn scale_in_place<T: Real>(z: &mut [T], scale: T) {
        z.iter_mut().for_each(|z| *z *= scale);
    }
}

/// `y` plus the LoRA delta of single-token rows (a decode step) against a
/// batch's concatenated factors `a` `[n·r, in]` and `b_t` `[n·r, out]` (B
/// pre-scaled): row `i` uses rank block `slots[i]` (`None`: no adapter, no
/// delta), `Δᵢ = (xᵢ·a[block]ᵀ)·b_t[block]`. `x` is `[rows, in]`, `y`
/// `[rows, out]`, f32. Rows sharing an adapter shrink together in the
/// few-row kernel, in pieces of up to [`LORA_PIECE_ROWS`] so a batch on one
/// adapter still spreads over threads.
pub fn row_lora(
    x: &Tensor,
    a: &Tensor,
    b_t: &Tensor,
    slots: &[Option<usize>],
    rank: usize,
    y: &Tensor,
) -> Result<Tensor> {
    let (rows, in_dim) = x.dims2()?;
    let (width, a_in) = a.dims2()?;
    let (b_width, out_dim) = b_t.dims2()?;
    let fits = |s: &Option<usize>| s.is_none_or(|s| (s + 1) * rank <= width);
    let empty = in_dim == 0 || out_dim == 0 || rank == 0;
    if empty
        || rows != slots.len()
        || a_in != in_dim
        || b_width != width
        || !slots.iter().all(fits)
        || y.dims() != [rows, out_dim]
    {
        bail!(
            "row_lora: x {:?}, A {:?}, B {:?}, y {:?}, {} slots of rank {rank}",
            x.shape(),
            a.shape(),
            b_t.shape(),
            y.shape(),
            slots.len()
        )
    }
    let (xv, av, bv, yv) = (View::of(x)?, View::of(a)?, View::of(b_t)?, View::of(y)?);
    let (xs, a, b) = (
        xv.values::<f32>()?,
        av.values::<f32>()?,
        bv.values::<f32>()?,
    );
    let isa = Isa::best();
    let mut out = yv.values::<f32>()?.to_vec();
    let mut pieces = Vec::new();
    let mut rest = out.as_mut_slice();
    let mut start = 0;
    for run in slots.chunk_by(|a, b| a == b) {
        for piece in run.chunks(LORA_PIECE_ROWS) {
            let (y, tail) = rest.split_at_mut(piece.len() * out_dim);
            pieces.push((start, piece.len(), piece[0], y));
            rest = tail;
            start += piece.len();
        }
    }
    pieces
        .into_par_iter()
        .try_for_each(|(start, len, slot, y)| {
            let Some(slot) = slot else { return Ok(()) };
            let x = &xs[start * in_dim..(start + len) * in_dim];
            let a = &a[slot * rank * in_dim..(slot + 1) * rank * in_dim];
            let u = few_rows::matmul_t_serial(x, a, len, in_dim, rank).map_err(Error::Msg)?;
            let b = &b[slot * rank * out_dim..][..rank * out_dim];
            for (y, u) in y.chunks_exact_mut(out_dim).zip(u.chunks_exact(rank)) {
                expand(isa, y, u, b);
            }
            Ok::<_, Error>(())
        })?;
    tensor(out, (rows, out_dim))
}

per_isa! {
    /// `y += Σⱼ uⱼ·b_t[j]`, `j` in order: one row's LoRA expand, or one
    /// query's weighted sum of values.
    pub(crate) fn expand<T: Real>(y: &mut [T], u: &[T], b_t: &[T]) {
        if y.is_empty() {
            return;
        }
        for (&u, b) in u.iter().zip(b_t.chunks_exact(y.len())) {
            y.iter_mut().zip(b).for_each(|(y, &b)| *y += u * b);
        }
    }
}

/// `a + b`, elementwise.
pub fn add<T: Real>(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    elementwise(a, b, "addend", add_piece::<T>)
}

/// `piece` over two tensors of one shape, in parallel pieces of [`CHUNK`]
/// values. `what` names `b` in errors.
fn elementwise<T: Real>(
    a: &Tensor,
    b: &Tensor,
    what: &str,
    piece: fn(Isa, &mut [T], &[T], &[T]),
) -> Result<Tensor> {
    if a.shape() != b.shape() {
        bail!("{what}: {:?}, expected {:?}", b.shape(), a.shape())
    }
    let (av, bv) = (View::of(a)?, View::of(b)?);
    let (left, right) = (av.values::<T>()?, bv.values::<T>()?);
    let isa = Isa::best();
    let out = filled(left.len(), CHUNK, |i, y| {
        let at = i * CHUNK..i * CHUNK + y.len();
        piece(isa, y, &left[at.clone()], &right[at])
    })?;
    tensor(out, a.shape())
}

per_isa! {
    /// A piece of [`add`].
    fn add_piece<T: Real>(y: &mut [T], a: &[T], b: &[T]) {
        for ((y, &a), &b) in y.iter_mut().zip(a).zip(b) {
            *y = a + b;
        }
    }
}

/// Rows per parallel task of [`row_lora`] (default 4).
const LORA_PIECE_ROWS: usize = 4;

/// Values per parallel task of the elementwise kernels ([`elementwise`],
/// SwiGLU's backward).
const CHUNK: usize = 4096;

#[inline(always)]
fn sigmoid<T: Real>(x: T) -> T {
    T::ONE / (T::ONE + (T::ZERO - x).exp())
}

/// SwiGLU's product `silu(gate) ⊙ up`.
pub fn swiglu<T: Real>(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    elementwise(gate, up, "SwiGLU up", swiglu_piece::<T>)
}

per_isa! {
    /// A piece of [`swiglu`].
    fn swiglu_piece<T: Real>(y: &mut [T], gate: &[T], up: &[T]) {
        for ((y, &g), &u) in y.iter_mut().zip(gate).zip(up) {
            *y = g * sigmoid(g) * u;
        }
    }
}

/// The gradients of [`swiglu`] given its output gradient `d`:
/// `(d ⊙ up ⊙ σ(g)(1 + g(1 − σ(g))), d ⊙ silu(g))`.
pub fn swiglu_backward<T: Real>(
    gate: &Tensor,
    up: &Tensor,
    d: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let (gv, uv, dv) = (View::of(gate)?, View::of(up)?, View::of(d)?);
    let (gs, us, ds) = (gv.values::<T>()?, uv.values::<T>()?, dv.values::<T>()?);
    check_len("SwiGLU up", us.len(), gs.len())?;
    check_len("SwiGLU gradient", ds.len(), gs.len())?;
    let isa = Isa::best();
    let (d_gate, d_up) = filled_pair(gs.len(), CHUNK, |i, dg, du| {
        let at = i * CHUNK..i * CHUNK + dg.len();
        let (g, u, d) = (&gs[at.clone()], &us[at.clone()], &ds[at]);
        swiglu_backward_piece(isa, dg, du, g, u, d)
    })?;
    Ok((tensor(d_gate, gate.shape())?, tensor(d_up, gate.shape())?))
}

per_isa! {
    /// A piece of [`swiglu_backward`].
    fn swiglu_backward_piece<T: Real>(
        d_gate: &mut [T],
        d_up: &mut [T],
        gate: &[T],
        up: &[T],
        d: &[T],
    ) {
        let values = d_gate.iter_mut().zip(d_up).zip(gate.iter().zip(up).zip(d));
        for ((dg, du), ((&g, &u), &d)) in values {
            let s = sigmoid(g);
            *dg = d * u * s * (T::ONE + g * (T::ONE - s));
            *du = d * g * s;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff;
    use candle_core::{DType, Var, D};

    fn randn(shape: &[usize]) -> Tensor {
        Tensor::randn(0f64, 1.0, shape, &Device::Cpu).unwrap()
    }

    /// The plain softmax at temperature 1.
    const FREE: Policy<'static> = Policy {
        mask: None,
        inv_temperature: 1.0,
    };

    /// `∂(Σ f(x)⊙w)/∂x` through candle's plain ops.
    fn plain_grad(x: &Tensor, w: &Tensor, f: impl Fn(&Tensor) -> Tensor) -> Tensor {
        let var = Var::from_tensor(x).unwrap();
        let y = f(var.as_tensor());
        let grads = (y * w).unwrap().sum_all().unwrap().backward().unwrap();
        grads.get(var.as_tensor()).unwrap().clone()
    }

    #[test]
    fn rms_norm_matches_plain_ops_in_value_and_gradient() {
        let (x, w, g, res) = (randn(&[5, 8]), randn(&[8]), randn(&[5, 8]), randn(&[5, 8]));
        let plain = |x: &Tensor| {
            let r = (x.sqr().unwrap().mean_keepdim(D::Minus1).unwrap() + 1e-5)
                .unwrap()
                .sqrt()
                .unwrap();
            x.broadcast_div(&r).unwrap().broadcast_mul(&w).unwrap()
        };
        assert!(max_abs_diff(&rms_norm::<f64>(&x, &w, 1e-5).unwrap(), &plain(&x)) < 1e-12);
        let ours = rms_norm_backward::<f64>(&x, &w, 1e-5, &g, Some(&res)).unwrap();
        let expected = (plain_grad(&x, &g, plain) + &res).unwrap();
        assert!(max_abs_diff(&ours, &expected) < 1e-12);
        let alone = rms_norm_backward::<f64>(&x, &w, 1e-5, &g, None).unwrap();
        assert!(max_abs_diff(&alone, &plain_grad(&x, &g, plain)) < 1e-12);
        let short = randn(&[4, 8]);
        assert!(rms_norm_backward::<f64>(&x, &w, 1e-5, &g, Some(&short)).is_err());
    }

    #[test]
    fn rope_heads_matches_plain_ops_in_value_and_gradient() {
        let s = Heads {
            rows: 2,
            n: 3,
            heads: 2,
            head_dim: 4,
        };
        let x = randn(&[s.rows * s.n, s.heads * s.head_dim]);
        let (cos, sin) = (randn(&[s.rows, 1, s.n, 2]), randn(&[s.rows, 1, s.n, 2]));
        let plain = |x: &Tensor| {
            let x = x
                .reshape((s.rows, s.n, s.heads, s.head_dim))
                .unwrap()
                .transpose(1, 2)
                .unwrap();
            let (x1, x2) = (x.narrow(3, 0, 2).unwrap(), x.narrow(3, 2, 2).unwrap());
            let mul = |a: &Tensor, b: &Tensor| a.broadcast_mul(b).unwrap();
            let r1 = (mul(&x1, &cos) - mul(&x2, &sin)).unwrap();
            let r2 = (mul(&x2, &cos) + mul(&x1, &sin)).unwrap();
            Tensor::cat(&[r1, r2], 3).unwrap()
        };
        let ours = rope_heads::<f64>(&x, &cos, &sin, s).unwrap();
        assert!(max_abs_diff(&ours, &plain(&x)) < 1e-12);
        let g = randn(ours.dims());
        let back = rope_heads_backward::<f64>(&g, &cos, &sin, s).unwrap();
        assert!(max_abs_diff(&back, &plain_grad(&x, &g, plain)) < 1e-12);
    }

    #[test]
    fn masked_softmax_matches_plain_ops_in_value_and_gradient() {
        let (rows, heads, n) = (2, 3, 4);
        let scores = randn(&[rows, heads, n, n]);
        let mask = Tensor::from_vec(
            (0..rows * n * n)
                .map(|i| if i % n > (i / n) % n { -1e9 } else { 0.0 })
                .collect::<Vec<f64>>(),
            (rows, 1, n, n),
            &Device::Cpu,
        )
        .unwrap();
        let plain = |s: &Tensor| {
            let z = ((s * 0.5).unwrap().broadcast_add(&mask)).unwrap();
            let e = z
                .broadcast_sub(&z.max_keepdim(D::Minus1).unwrap())
                .unwrap()
                .exp()
                .unwrap();
            e.broadcast_div(&e.sum_keepdim(D::Minus1).unwrap()).unwrap()
        };
        let p = masked_softmax::<f64>(&scores, &mask, 0.5).unwrap();
        assert!(max_abs_diff(&p, &plain(&scores)) < 1e-12);
        let g = randn(p.dims());
        let back = masked_softmax_backward::<f64>(&p, &g, 0.5).unwrap();
        assert!(max_abs_diff(&back, &plain_grad(&scores, &g, plain)) < 1e-12);
    }

    #[test]
    fn target_logprob_grad_matches_plain_ops() {
        let logits = randn(&[3, 7]);
        let targets = [4u32, 0, 6];
        let weights = [0.5, -2.0, 1.5];
        let values = || logits.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let mut grad = values();
        let free = [FREE; 3];
        let logps =
            target_logprob_grad::<f64>(&mut grad, 7, &targets, &free, |i, _| weights[i]).unwrap();
        let grad = Tensor::from_vec(grad, logits.shape(), &Device::Cpu).unwrap();
        let picked = |l: &Tensor| {
            candle_nn::ops::log_softmax(l, D::Minus1)
                .unwrap()
                .gather(
                    &Tensor::new(&targets, &Device::Cpu)
                        .unwrap()
                        .unsqueeze(1)
                        .unwrap(),
                    1,
                )
                .unwrap()
                .squeeze(1)
                .unwrap()
        };
        let expected = picked(&logits).to_vec1::<f64>().unwrap();
        for (a, b) in logps.iter().zip(&expected) {
            assert!((a - b).abs() < 1e-12);
        }
        let w = Tensor::new(&weights, &Device::Cpu).unwrap();
        assert!(max_abs_diff(&grad, &plain_grad(&logits, &w, picked)) < 1e-12);
        for (vocab, bad_targets) in [(7, &[4, 0, 7][..]), (7, &[4, 0]), (3, &[0; 6]), (0, &[])] {
            let free = vec![FREE; bad_targets.len()];
            let result =
                target_logprob_grad::<f64>(&mut values(), vocab, bad_targets, &free, |_, _| 1.0);
            assert!(result.is_err(), "{vocab} {bad_targets:?}");
        }
        // A target outside its mask, and a mask of the wrong size.
        let outside: [u32; 1] = [0b0110];
        let short: [u32; 0] = [];
        let masked = |mask| Policy {
            mask: Some(mask),
            inv_temperature: 1.0,
        };
        let frozen = Policy {
            mask: None,
            inv_temperature: 0.0,
        };
        for policies in [
            [masked(&outside[..]), FREE, FREE],
            [FREE, masked(&short[..]), FREE],
            [FREE, FREE, frozen],
        ] {
            let result =
                target_logprob_grad::<f64>(&mut values(), 7, &targets, &policies, |_, _| 1.0);
            assert!(result.is_err());
        }
    }

    #[test]
    fn target_logprob_grad_renormalises_over_the_mask_at_its_temperature() {
        let logits = randn(&[2, 7]);
        let targets = [4u32, 6];
        let weights = [0.7, -1.3];
        // Row 0 allows tokens 1, 4 and 5 at temperature 1; row 1 the whole
        // vocabulary at temperature 0.5.
        let allowed: [u32; 1] = [0b11_0010];
        let masks = [
            Policy {
                mask: Some(&allowed[..]),
                inv_temperature: 1.0,
            },
            Policy {
                mask: None,
                inv_temperature: 2.0,
            },
        ];
        let mut grad = logits.flatten_all().unwrap().to_vec1::<f64>().unwrap();
        let logps =
            target_logprob_grad::<f64>(&mut grad, 7, &targets, &masks, |i, _| weights[i]).unwrap();
        let grad = Tensor::from_vec(grad, logits.shape(), &Device::Cpu).unwrap();
        let neg = f64::NEG_INFINITY;
        let bias = Tensor::new(
            &[[neg, 0.0, neg, neg, 0.0, 0.0, neg], [0.0; 7]],
            &Device::Cpu,
        )
        .unwrap();
        let scale = Tensor::new(&[[1.0f64], [2.0]], &Device::Cpu).unwrap();
        let picked = |l: &Tensor| {
            let scaled = l.broadcast_mul(&scale).unwrap();
            candle_nn::ops::log_softmax(&(scaled + &bias).unwrap(), D::Minus1)
                .unwrap()
                .gather(&Tensor::new(&[[4u32], [6]], &Device::Cpu).unwrap(), 1)
                .unwrap()
                .squeeze(1)
                .unwrap()
        };
        let expected = picked(&logits).to_vec1::<f64>().unwrap();
        for (a, b) in logps.iter().zip(&expected) {
            assert!((a - b).abs() < 1e-12, "{a} {b}");
        }
        let w = Tensor::new(&weights, &Device::Cpu).unwrap();
        let plain = plain_grad(&logits, &w, picked);
        assert!(max_abs_diff(&grad, &plain) < 1e-12);
        let row0 = grad.get(0).unwrap().to_vec1::<f64>().unwrap();
        for t in [0, 2, 3, 6] {
            assert_eq!(row0[t], 0.0, "a masked-out token gets no gradient");
        }
    }

    #[test]
    fn swiglu_matches_plain_ops() {
        let (gate, up, d) = (randn(&[3, 5000]), randn(&[3, 5000]), randn(&[3, 5000]));
        let ours = swiglu::<f64>(&gate, &up).unwrap();
        let plain = (gate.silu().unwrap() * &up).unwrap();
        assert!(max_abs_diff(&ours, &plain) < 1e-12);
        let (dg, du) = swiglu_backward::<f64>(&gate, &up, &d).unwrap();
        let expect_dg = plain_grad(&gate, &d, |g| (g.silu().unwrap() * &up).unwrap());
        let expect_du = plain_grad(&up, &d, |u| (gate.silu().unwrap() * u).unwrap());
        assert!(max_abs_diff(&dg, &expect_dg) < 1e-12);
        assert!(max_abs_diff(&du, &expect_du) < 1e-12);

        // f32 goes through exp_f32.
        let (gate, up) = (
            gate.to_dtype(DType::F32).unwrap(),
            up.to_dtype(DType::F32).unwrap(),
        );
        let ours = swiglu::<f32>(&gate, &up).unwrap();
        let plain = (gate.silu().unwrap() * &up).unwrap();
        assert!(max_abs_diff(&ours, &plain) < 1e-5);
        assert_eq!(ours.dtype(), DType::F32);
    }

    /// Every instruction set's build of each row kernel gives the bits of
    /// the portable build, on lengths that leave a partial group of lanes.
    #[test]
    fn every_isa_gives_the_same_bits() {
        let run = |isa: Isa, n: usize| -> Vec<Vec<u32>> {
            let v = |seed| few_rows::test_values(n, seed);
            let (x, g, w) = (v(1), v(2), v(3));
            let mut outs = Vec::new();
            let mut out = vec![0f32; n];
            softmax_row(isa, &mut out, &x, &g, 0.37);
            outs.push(out.clone());
            softmax_backward_row(isa, &mut out, &x, &g, 0.37);
            outs.push(out.clone());
            rms_norm_row(isa, &mut out, &x, &w, 1e-5);
            outs.push(out.clone());
            out.copy_from_slice(&g);
            rms_norm_backward_row(isa, &mut out, &x, &g, &w, 1e-5);
            outs.push(out.clone());
            swiglu_piece(isa, &mut out, &x, &g);
            outs.push(out.clone());
            add_piece(isa, &mut out, &x, &g);
            outs.push(out.clone());
            let mut d_up = vec![0f32; n];
            swiglu_backward_piece(isa, &mut out, &mut d_up, &x, &g, &w);
            outs.extend([out.clone(), d_up]);
            let half = n / 2;
            let mut rotated = vec![0f32; 2 * half];
            rotate(
                isa,
                &mut rotated,
                &x[..2 * half],
                &g[..half],
                &w[..half],
                -1.0,
            );
            outs.push(rotated);
            let mut z = x.iter().map(|v| v * 30.0).collect::<Vec<f32>>();
            assert_eq!(max_and_exp_sum(isa, &z), max_and_exp_sum(Isa::Portable, &z));
            let (max, sum) = exp_shifted_in_place(isa, &mut z);
            assert_eq!(
                (max, sum),
                max_and_exp_sum(isa, &x.iter().map(|v| v * 30.0).collect::<Vec<f32>>())
            );
            scale_in_place(isa, &mut z, 0.3);
            outs.extend([
                z,
                vec![max],
                vec![sum as f32, (sum - sum as f32 as f64) as f32],
            ]);
            if n >= 3 {
                let mut y = w[..n / 3].to_vec();
                expand(isa, &mut y, &x[..3], &g[..n / 3 * 3]);
                outs.push(y);
            }
            outs.into_iter()
                .map(|o| o.iter().map(|v| v.to_bits()).collect())
                .collect()
        };
        for n in [1, 15, 16, 37, 581] {
            let portable = run(Isa::Portable, n);
            for isa in Isa::available() {
                assert_eq!(run(isa, n), portable, "{isa:?}, {n} values");
            }
        }
    }

    #[test]
    fn exp_f32_is_within_1e7_and_keeps_special_values() {
        let (mut x, mut worst) = (-87.3f32, 0f64);
        while x <= 88.3 {
            let (ours, exact) = (exp_f32(x) as f64, (x as f64).exp());
            worst = worst.max(((ours - exact) / exact).abs());
            x += 0.0137;
        }
        assert!(worst < 1e-7, "relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert_eq!(exp_f32(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_f32(-1e3), 0.0);
        assert_eq!(exp_f32(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_f32(1e3), f32::INFINITY);
        assert!(exp_f32(f32::NAN).is_nan());
    }
}
