//! Fused CPU kernels of the train step's hand-written forward and backward
//! ([`super::tape`]), in f32 and f64 (the f64 path serves the finite-difference
//! gradient check). Each reads its inputs once and writes one new tensor (the
//! log-prob gradient overwrites its logits instead), in parallel over rows,
//! where candle would chain several single-pass ops and allocate a tensor for
//! each.

use std::mem::MaybeUninit;
use std::ops::Range;

use candle_core::{bail, Device, Error, Result, Shape, Storage, StorageRef, Tensor, WithDType};
use rayon::prelude::*;

use crate::base::few_rows;

/// The float types the kernels run in.
pub trait Real: WithDType {
    const ZERO: Self;
    const ONE: Self;
    /// In f32 [`exp_f32`]: +∞ above 88.3 (libm: above 88.72), 0 below -87.3.
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
}

impl Real for f32 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    fn exp(self) -> Self {
        exp_f32(self)
    }
    fn sqrt(self) -> Self {
        f32::sqrt(self)
    }
}

impl Real for f64 {
    const ZERO: Self = 0.0;
    const ONE: Self = 1.0;
    fn exp(self) -> Self {
        f64::exp(self)
    }
    fn sqrt(self) -> Self {
        f64::sqrt(self)
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
fn inverse_rms<T: Real>(x: &[T], eps: f64) -> T {
    let sum = x.iter().fold(T::ZERO, |s, &v| s + v * v);
    T::ONE / (sum / T::from_f64(x.len() as f64) + T::from_f64(eps)).sqrt()
}

/// RMSNorm over the last axis: `x · r · w`, `r = 1/√(mean(x²) + ε)`.
pub fn rms_norm<T: Real>(x: &Tensor, w: &Tensor, eps: f64) -> Result<Tensor> {
    let d = last_dim(x)?;
    let (xv, wv) = (View::of(x)?, View::of(w)?);
    let (xs, ws) = (xv.values::<T>()?, wv.values::<T>()?);
    check_len("RMSNorm weight", ws.len(), d)?;
    let out = filled(xs.len(), d, |i, y| {
        let x = &xs[i * d..][..d];
        let r = inverse_rms(x, eps);
        for ((y, &x), &w) in y.iter_mut().zip(x).zip(ws) {
            *y = x * r * w;
        }
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
    let n = T::from_f64(d as f64);
    let out = filled(xs.len(), d, |i, dx| {
        let (x, g) = (&xs[i * d..][..d], &gs[i * d..][..d]);
        if let Some(rs) = rs {
            dx.copy_from_slice(&rs[i * d..][..d]);
        }
        let r = inverse_rms(x, eps);
        let dot = x
            .iter()
            .zip(g)
            .zip(ws)
            .fold(T::ZERO, |s, ((&x, &g), &w)| s + g * w * x * r);
        let mean = dot / n;
        for (((dx, &x), &g), &w) in dx.iter_mut().zip(x).zip(g).zip(ws) {
            *dx += r * (g * w - x * r * mean);
        }
    })?;
    tensor(out, x.shape())
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
    // One chunk per (row, head): n·hd output values.
    let out = filled(xs.len(), s.n * hd, |rh, y| {
        let (r, h) = (rh / s.heads, rh % s.heads);
        for (i, y) in y.chunks_mut(hd).enumerate() {
            let src = ((r * s.n + i) * s.heads + h) * hd;
            let trig = (r * s.n + i) * half;
            for j in 0..half {
                let (x1, x2) = (xs[src + j], xs[src + half + j]);
                let (c, sn) = (cs[trig + j], ss[trig + j]);
                y[j] = x1 * c - x2 * sn;
                y[half + j] = x2 * c + x1 * sn;
            }
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
    // One chunk per token (row, i): heads·hd output values.
    let out = filled(gs.len(), s.heads * hd, |ri, y| {
        let (r, i) = (ri / s.n, ri % s.n);
        let trig = ri * half;
        for (h, y) in y.chunks_mut(hd).enumerate() {
            let src = ((r * s.heads + h) * s.n + i) * hd;
            for j in 0..half {
                let (g1, g2) = (gs[src + j], gs[src + half + j]);
                let (c, sn) = (cs[trig + j], ss[trig + j]);
                y[j] = g1 * c + g2 * sn;
                y[half + j] = g2 * c - g1 * sn;
            }
        }
    })?;
    tensor(out, (s.rows * s.n, s.heads * hd))
}

/// Attention probabilities `softmax(scale·s + mask)` over the last axis, for
/// scores `[rows, …, n, slots]` (any number of heads between) and the additive
/// mask `[rows, 1, n, slots]` shared by every head of a row.
pub fn masked_softmax<T: Real>(scores: &Tensor, mask: &Tensor, scale: f64) -> Result<Tensor> {
    let slots = last_dim(scores)?;
    let (rows, _, n, mask_slots) = mask.dims4()?;
    let per_row = scores.elem_count() / rows.max(1);
    if rows == 0 || n == 0 || mask_slots != slots || !per_row.is_multiple_of(n * slots) {
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
    let scale = T::from_f64(scale);
    let out = filled(ss.len(), slots, |q, p| {
        let (r, i) = (q * slots / per_row, q % n);
        let s = &ss[q * slots..][..slots];
        let m = &ms[(r * n + i) * slots..][..slots];
        let mut max = T::from_f64(f64::NEG_INFINITY);
        for ((p, &s), &m) in p.iter_mut().zip(s).zip(m) {
            *p = scale * s + m;
            max = if *p > max { *p } else { max };
        }
        // exp in a loop of its own, without the sum, so that it vectorises.
        p.iter_mut().for_each(|p| *p = (*p - max).exp());
        let sum = p.iter().fold(T::ZERO, |sum, &p| sum + p);
        p.iter_mut().for_each(|p| *p /= sum);
    })?;
    tensor(out, scores.shape())
}

/// The gradient of [`masked_softmax`] with respect to the unscaled scores:
/// `scale · p ⊙ (g − Σⱼ gⱼ·pⱼ)`.
pub fn masked_softmax_backward<T: Real>(p: &Tensor, g: &Tensor, scale: f64) -> Result<Tensor> {
    let slots = last_dim(p)?;
    let (pv, gv) = (View::of(p)?, View::of(g)?);
    let (ps, gs) = (pv.values::<T>()?, gv.values::<T>()?);
    check_len("softmax gradient", gs.len(), ps.len())?;
    let scale = T::from_f64(scale);
    let out = filled(ps.len(), slots, |i, d| {
        let (p, g) = (&ps[i * slots..][..slots], &gs[i * slots..][..slots]);
        let dot = p.iter().zip(g).fold(T::ZERO, |s, (&p, &g)| s + p * g);
        for ((d, &p), &g) in d.iter_mut().zip(p).zip(g) {
            *d = scale * p * (g - dot);
        }
    })?;
    tensor(out, p.shape())
}

/// For `logits`, the row-major values of `[n, vocab]` with one target token
/// per row: each row's `log softmax(logits)[target]`; the logits are
/// overwritten with the gradient of a loss whose derivative with respect to
/// row `i`'s log-prob is `dloss(i, logp)`:
/// `g·(onehot(target) − softmax(logits))`, `g = dloss(i, logp)`.
pub fn target_logprob_grad<T: Real>(
    logits: &mut [T],
    vocab: usize,
    targets: &[u32],
    dloss: impl Fn(usize, f64) -> f64 + Sync,
) -> Result<Vec<f64>> {
    if vocab == 0 || targets.len().checked_mul(vocab) != Some(logits.len()) {
        bail!(
            "{} targets for {} logits of a vocabulary of {vocab}",
            targets.len(),
            logits.len()
        )
    }
    if let Some(t) = targets.iter().find(|&&t| t as usize >= vocab) {
        bail!("target token {t} outside the vocabulary of {vocab}")
    }
    Ok(logits
        .par_chunks_mut(vocab)
        .enumerate()
        .map(|(i, z)| {
            let max = z
                .iter()
                .copied()
                .fold(z[0], |m, v| if v > m { v } else { m });
            let target = targets[i] as usize;
            let target_logit = z[target];
            z.iter_mut().for_each(|z| *z = (*z - max).exp());
            let sum = z.iter().fold(0f64, |sum, z| sum + z.to_f64());
            let logp = (target_logit - max).to_f64() - sum.ln();
            let g = dloss(i, logp);
            let scale = T::from_f64(-g / sum);
            z.iter_mut().for_each(|z| *z *= scale);
            z[target] += T::from_f64(g);
            logp
        })
        .collect())
}

/// The LoRA delta of single-token rows (a decode step) against a batch's
/// concatenated factors `a` `[n·r, in]` and `b_t` `[n·r, out]` (B
/// pre-scaled): row `i` uses rank block `slots[i]` (`None`: no adapter, zeros),
/// `Δᵢ = (xᵢ·a[block]ᵀ)·b_t[block]`. `x` is `[rows, in]`, f32. Rows sharing
/// an adapter shrink together in the few-row kernel, in pieces of up to
/// [`LORA_PIECE_ROWS`] so a batch on one adapter still spreads over threads.
pub fn row_lora(
    x: &Tensor,
    a: &Tensor,
    b_t: &Tensor,
    slots: &[Option<usize>],
    rank: usize,
) -> Result<Tensor> {
    let (rows, in_dim) = x.dims2()?;
    let (width, a_in) = a.dims2()?;
    let (b_width, out_dim) = b_t.dims2()?;
    let fits = |s: &Option<usize>| s.is_none_or(|s| (s + 1) * rank <= width);
    let empty = in_dim == 0 || out_dim == 0 || rank == 0;
    if empty || rows != slots.len() || a_in != in_dim || b_width != width || !slots.iter().all(fits)
    {
        bail!(
            "row_lora: x {:?}, A {:?}, B {:?}, {} slots of rank {rank}",
            x.shape(),
            a.shape(),
            b_t.shape(),
            slots.len()
        )
    }
    let (xv, av, bv) = (View::of(x)?, View::of(a)?, View::of(b_t)?);
    let (xs, a, b) = (
        xv.values::<f32>()?,
        av.values::<f32>()?,
        bv.values::<f32>()?,
    );
    let mut out = vec![0f32; rows * out_dim];
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
            for (y, u) in y.chunks_exact_mut(out_dim).zip(u.chunks_exact(rank)) {
                for (j, &u) in u.iter().enumerate() {
                    let b = &b[(slot * rank + j) * out_dim..][..out_dim];
                    y.iter_mut().zip(b).for_each(|(y, &b)| *y += u * b);
                }
            }
            Ok::<_, Error>(())
        })?;
    tensor(out, (rows, out_dim))
}

/// Rows per parallel task of [`row_lora`] (default 4).
const LORA_PIECE_ROWS: usize = 4;

/// Values per parallel task of the elementwise kernels below.
const CHUNK: usize = 4096;

fn sigmoid<T: Real>(x: T) -> T {
    T::ONE / (T::ONE + (T::ZERO - x).exp())
}

/// SwiGLU's product `silu(gate) ⊙ up`.
pub fn swiglu<T: Real>(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let (gv, uv) = (View::of(gate)?, View::of(up)?);
    let (gs, us) = (gv.values::<T>()?, uv.values::<T>()?);
    check_len("SwiGLU up", us.len(), gs.len())?;
    let out = filled(gs.len(), CHUNK, |i, y| {
        let at = i * CHUNK..i * CHUNK + y.len();
        let (g, u) = (&gs[at.clone()], &us[at]);
        for ((y, &g), &u) in y.iter_mut().zip(g).zip(u) {
            *y = g * sigmoid(g) * u;
        }
    })?;
    tensor(out, gate.shape())
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
    let (d_gate, d_up) = filled_pair(gs.len(), CHUNK, |i, dg, du| {
        let at = i * CHUNK..i * CHUNK + dg.len();
        let (g, u, d) = (&gs[at.clone()], &us[at.clone()], &ds[at]);
        let values = dg.iter_mut().zip(du).zip(g.iter().zip(u).zip(d));
        for ((dg, du), ((&g, &u), &d)) in values {
            let s = sigmoid(g);
            *dg = d * u * s * (T::ONE + g * (T::ONE - s));
            *du = d * g * s;
        }
    })?;
    Ok((tensor(d_gate, gate.shape())?, tensor(d_up, gate.shape())?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff;
    use candle_core::{DType, Var, D};

    fn randn(shape: &[usize]) -> Tensor {
        Tensor::randn(0f64, 1.0, shape, &Device::Cpu).unwrap()
    }

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
        let logps = target_logprob_grad::<f64>(&mut grad, 7, &targets, |i, _| weights[i]).unwrap();
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
            let result = target_logprob_grad::<f64>(&mut values(), vocab, bad_targets, |_, _| 1.0);
            assert!(result.is_err(), "{vocab} {bad_targets:?}");
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
