//! The multi-adapter LoRA delta as one candle op with its backward: each token
//! row is shrunk and expanded by its own adapter's block of the batch's
//! concatenated factors, `Δ[t] = (x[t]·A_kᵀ)·(s·B_k)ᵀ` with `k = slot[t]`.
//!
//! On CUDA this runs our kernels (`kernels/lora.cu`: shrink, expand and the
//! per-adapter outer product of the backward), compiled once per process with
//! NVRTC. On the CPU it runs plain loops in the same order: the reference the
//! CUDA kernels are tested against (the CPU broker itself uses
//! [`super::RowAdapters`]' GEMMs, which are faster there).
//!
//! ```text
//! forward   s = shrink(x, A)      Δ = expand(s, Bᵀ)
//! backward  ∂s = shrink(∂Δ, Bᵀ)   ∂x = expand(∂s, A)
//!           ∂A = outer(∂s, x)     ∂Bᵀ = outer(s, ∂Δ)
//! ```
//! Every element is summed by one thread (or one warp) in a fixed order: the
//! same inputs give the same bits on every run on the same GPU.

use std::sync::Arc;

use candle_core::backend::BackendStorage;
use candle_core::{
    bail, CpuStorage, CustomOp2, CustomOp3, Device, Layout, Result, Shape, Tensor, WithDType,
};

/// The slot of a token row that uses no adapter.
pub const NO_SLOT: u32 = u32::MAX;

/// Which adapter block each token row of a batch uses, on the host (for the
/// CPU path and the backward's per-slot token ranges) and on the device.
#[derive(Debug, Clone)]
pub struct TokenSlots {
    host: Arc<Vec<u32>>,
    /// `[T]` u32 on the batch's device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    device: Tensor,
    /// Number of adapter blocks in the concatenation.
    blocks: usize,
}

impl TokenSlots {
    /// `slots[t]` < `blocks`, or [`NO_SLOT`].
    pub fn new(slots: Vec<u32>, blocks: usize, device: &Device) -> Result<TokenSlots> {
        if let Some(bad) = slots
            .iter()
            .find(|&&k| k != NO_SLOT && k as usize >= blocks)
        {
            bail!("token slot {bad} is outside the batch's {blocks} adapter blocks")
        }
        let tensor = Tensor::new(slots.as_slice(), device)?;
        Ok(TokenSlots {
            host: Arc::new(slots),
            device: tensor,
            blocks,
        })
    }

    pub fn len(&self) -> usize {
        self.host.len()
    }

    pub fn is_empty(&self) -> bool {
        self.host.is_empty()
    }

    /// For each block, the first token and one past the last that use it
    /// (`[2·blocks]`; empty blocks get `0..0`).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn ranges(&self) -> Vec<u32> {
        let mut ranges = vec![0u32; 2 * self.blocks];
        let mut seen = vec![false; self.blocks];
        for (t, &k) in self.host.iter().enumerate() {
            if k == NO_SLOT {
                continue;
            }
            let k = k as usize;
            if !seen[k] {
                seen[k] = true;
                ranges[2 * k] = t as u32;
            }
            ranges[2 * k + 1] = t as u32 + 1;
        }
        ranges
    }
}

/// `Δ [T, out]` for `x [T, in]`, `a [n·r, in]` (the adapters' A side by side)
/// and `b [n·r, out]` (their scaled Bᵀ), each token row against block
/// `slots[t]`. Gradients flow to all three when they are tracked (no pass
/// tracks them: the train step's backward off the CPU, `compute::generic_tape`,
/// calls [`shrink`], [`expand`] and [`outer`] itself).
pub fn lora_delta(
    x: &Tensor,
    a: &Tensor,
    b: &Tensor,
    slots: &TokenSlots,
    rank: usize,
) -> Result<Tensor> {
    let (rows, in_dim) = x.dims2()?;
    let (blocks_r, a_in) = a.dims2()?;
    let (b_rows, _) = b.dims2()?;
    if rows != slots.len()
        || a_in != in_dim
        || b_rows != blocks_r
        || blocks_r != slots.blocks * rank
    {
        bail!(
            "lora_delta: x {:?}, A {:?}, Bᵀ {:?} do not fit {} token slots over {} blocks of rank {rank}",
            x.dims(),
            a.dims(),
            b.dims(),
            slots.len(),
            slots.blocks
        )
    }
    let op = Delta(Shapes::new(slots, rank));
    x.contiguous()?
        .apply_op3(&a.contiguous()?, &b.contiguous()?, op)
}

/// `s [T, r]`: each token row of `x [T, width]` against its own block of
/// `a [n·r, width]` (zeros for a row without an adapter): the shrink half of
/// [`lora_delta`], and with `Bᵀ` for `a` the shrink of its backward.
pub fn shrink(x: &Tensor, a: &Tensor, slots: &TokenSlots, rank: usize) -> Result<Tensor> {
    let (rows, width) = x.dims2()?;
    let (blocks_r, a_width) = a.dims2()?;
    if rows != slots.len() || a_width != width || blocks_r != slots.blocks * rank {
        bail!(
            "lora shrink: x {:?} and factors {:?} do not fit {} token slots over {} blocks of rank {rank}",
            x.dims(),
            a.dims(),
            slots.len(),
            slots.blocks
        )
    }
    x.contiguous()?
        .apply_op2_no_bwd(&a.contiguous()?, &Shrink(Shapes::new(slots, rank)))
}

/// `y [T, out]`: each token row of `s [T, r]` expanded by its own block of
/// `b [n·r, out]` (zeros for a row without an adapter).
pub fn expand(s: &Tensor, b: &Tensor, slots: &TokenSlots, rank: usize) -> Result<Tensor> {
    let (rows, r) = s.dims2()?;
    let (blocks_r, _) = b.dims2()?;
    if rows != slots.len() || r != rank || blocks_r != slots.blocks * rank {
        bail!(
            "lora expand: s {:?} and factors {:?} do not fit {} token slots over {} blocks of rank {rank}",
            s.dims(),
            b.dims(),
            slots.len(),
            slots.blocks
        )
    }
    s.contiguous()?
        .apply_op2_no_bwd(&b.contiguous()?, &Expand(Shapes::new(slots, rank)))
}

/// `g [n·r, width]`: for each adapter block, the sum over its token rows of
/// `u[t]ᵀ·v[t]` (`u [T, r]`, `v [T, width]`): the factor gradients of the
/// backward, `∂A = outer(∂s, x)` and `∂(s·B)ᵀ = outer(s, ∂Δ)`.
pub fn outer(u: &Tensor, v: &Tensor, slots: &TokenSlots, rank: usize) -> Result<Tensor> {
    let (rows, r) = u.dims2()?;
    let (v_rows, _) = v.dims2()?;
    if rows != slots.len() || v_rows != rows || r != rank {
        bail!(
            "lora outer: u {:?} and v {:?} do not fit {} token slots of rank {rank}",
            u.dims(),
            v.dims(),
            slots.len()
        )
    }
    u.contiguous()?
        .apply_op2_no_bwd(&v.contiguous()?, &Outer(Shapes::new(slots, rank)))
}

#[derive(Debug, Clone)]
struct Shapes {
    slots: TokenSlots,
    rank: usize,
}

/// The whole delta, `expand(shrink(x, A), Bᵀ)`, with its backward.
struct Delta(Shapes);
/// `s [T, r]`: each row against its block of `a [n·r, width]`.
struct Shrink(Shapes);
/// `y [T, out]` from `s [T, r]` and `b [n·r, out]`.
struct Expand(Shapes);
/// `g [n·r, width]` = Σ over each block's rows of `u[t]ᵀ·v[t]`, `u [T, r]`, `v [T, width]`.
struct Outer(Shapes);

fn contiguous<'a, T>(values: &'a [T], layout: &Layout, op: &str) -> Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&values[start..end]),
        None => bail!("{op}: inputs must be contiguous"),
    }
}

/// The CPU reference, in the kernels' summation order.
mod reference {
    use super::{WithDType, NO_SLOT};

    pub fn shrink<T: WithDType>(x: &[T], a: &[T], slot: &[u32], width: usize, r: usize) -> Vec<T> {
        let mut s = vec![T::zero(); slot.len() * r];
        for (t, &k) in slot.iter().enumerate() {
            if k == NO_SLOT {
                continue;
            }
            let xrow = &x[t * width..(t + 1) * width];
            for j in 0..r {
                let arow = &a[(k as usize * r + j) * width..][..width];
                s[t * r + j] = xrow
                    .iter()
                    .zip(arow)
                    .fold(T::zero(), |acc, (&x, &a)| acc + x * a);
            }
        }
        s
    }

    pub fn expand<T: WithDType>(s: &[T], b: &[T], slot: &[u32], out: usize, r: usize) -> Vec<T> {
        let mut y = vec![T::zero(); slot.len() * out];
        for (t, &k) in slot.iter().enumerate() {
            if k == NO_SLOT {
                continue;
            }
            for o in 0..out {
                y[t * out + o] = (0..r).fold(T::zero(), |acc, j| {
                    acc + s[t * r + j] * b[(k as usize * r + j) * out + o]
                });
            }
        }
        y
    }

    pub fn outer<T: WithDType>(
        u: &[T],
        v: &[T],
        slot: &[u32],
        blocks: usize,
        width: usize,
        r: usize,
    ) -> Vec<T> {
        let mut g = vec![T::zero(); blocks * r * width];
        for (t, &k) in slot.iter().enumerate() {
            if k == NO_SLOT {
                continue;
            }
            for j in 0..r {
                let grow = &mut g[(k as usize * r + j) * width..][..width];
                for (g, &v) in grow.iter_mut().zip(&v[t * width..(t + 1) * width]) {
                    *g += u[t * r + j] * v;
                }
            }
        }
        g
    }
}

fn cpu_apply(
    name: &str,
    p: &CpuStorage,
    pl: &Layout,
    q: &CpuStorage,
    ql: &Layout,
    f: impl Fn(Floats) -> Result<(Floats, Shape)>,
) -> Result<(CpuStorage, Shape)> {
    let (out, shape) = match (p, q) {
        (CpuStorage::F32(p), CpuStorage::F32(q)) => f(Floats::F32(
            contiguous(p, pl, name)?.to_vec(),
            contiguous(q, ql, name)?.to_vec(),
        ))?,
        (CpuStorage::F64(p), CpuStorage::F64(q)) => f(Floats::F64(
            contiguous(p, pl, name)?.to_vec(),
            contiguous(q, ql, name)?.to_vec(),
        ))?,
        _ => bail!(
            "{name}: f32 or f64 inputs of one dtype, got {:?} and {:?}",
            p.dtype(),
            q.dtype()
        ),
    };
    Ok((out.into_storage(), shape))
}

/// Two inputs, or one output (the second vector empty), in f32 or f64.
enum Floats {
    F32(Vec<f32>, Vec<f32>),
    F64(Vec<f64>, Vec<f64>),
}

impl Floats {
    fn into_storage(self) -> CpuStorage {
        match self {
            Floats::F32(v, _) => CpuStorage::F32(v),
            Floats::F64(v, _) => CpuStorage::F64(v),
        }
    }
}

macro_rules! on_floats {
    ($floats:expr, |$p:ident, $q:ident| $body:expr) => {
        match $floats {
            Floats::F32($p, $q) => Floats::F32($body, Vec::new()),
            Floats::F64($p, $q) => Floats::F64($body, Vec::new()),
        }
    };
}

impl Shapes {
    fn new(slots: &TokenSlots, rank: usize) -> Shapes {
        Shapes {
            slots: slots.clone(),
            rank,
        }
    }

    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    fn rows(&self) -> usize {
        self.slots.len()
    }

    fn cpu_shrink(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        a: &CpuStorage,
        al: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (slot, r, width) = (self.slots.host.as_slice(), self.rank, xl.dims()[1]);
        cpu_apply("lora shrink", x, xl, a, al, |f| {
            let out = on_floats!(f, |x, a| reference::shrink(&x, &a, slot, width, r));
            Ok((out, Shape::from((slot.len(), r))))
        })
    }

    fn cpu_expand(
        &self,
        s: &CpuStorage,
        sl: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (slot, r, out_dim) = (self.slots.host.as_slice(), self.rank, bl.dims()[1]);
        cpu_apply("lora expand", s, sl, b, bl, |f| {
            let out = on_floats!(f, |s, b| reference::expand(&s, &b, slot, out_dim, r));
            Ok((out, Shape::from((slot.len(), out_dim))))
        })
    }

    fn cpu_outer(
        &self,
        u: &CpuStorage,
        ul: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (slot, r, width, blocks) = (
            self.slots.host.as_slice(),
            self.rank,
            vl.dims()[1],
            self.slots.blocks,
        );
        cpu_apply("lora outer", u, ul, v, vl, |f| {
            let out = on_floats!(f, |u, v| reference::outer(&u, &v, slot, blocks, width, r));
            Ok((out, Shape::from((blocks * r, width))))
        })
    }
}

/// A two-input op: its CPU reference and, with `cuda`, its kernel.
macro_rules! two_input_op {
    ($op:ident, $name:literal, $cpu:ident, $cuda:ident) => {
        impl CustomOp2 for $op {
            fn name(&self) -> &'static str {
                $name
            }
            fn cpu_fwd(
                &self,
                p: &CpuStorage,
                pl: &Layout,
                q: &CpuStorage,
                ql: &Layout,
            ) -> Result<(CpuStorage, Shape)> {
                self.0.$cpu(p, pl, q, ql)
            }
            #[cfg(feature = "cuda")]
            fn cuda_fwd(
                &self,
                p: &candle_core::CudaStorage,
                pl: &Layout,
                q: &candle_core::CudaStorage,
                ql: &Layout,
            ) -> Result<(candle_core::CudaStorage, Shape)> {
                cuda::$cuda(&self.0, p, pl, q, ql)
            }
        }
    };
}

two_input_op!(Shrink, "lora-shrink", cpu_shrink, shrink);
two_input_op!(Expand, "lora-expand", cpu_expand, expand);
two_input_op!(Outer, "lora-outer", cpu_outer, outer);

impl CustomOp3 for Delta {
    fn name(&self) -> &'static str {
        "lora-delta"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        xl: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (s, s_shape) = self.0.cpu_shrink(x, xl, a, al)?;
        self.0.cpu_expand(&s, &Layout::contiguous(s_shape), b, bl)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        xl: &Layout,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (s, s_shape) = cuda::shrink(&self.0, x, xl, a, al)?;
        cuda::expand(&self.0, &s, &Layout::contiguous(s_shape), b, bl)
    }

    fn bwd(
        &self,
        x: &Tensor,
        a: &Tensor,
        b: &Tensor,
        _delta: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let Shapes { slots, rank } = &self.0;
        let s = shrink(x, a, slots, *rank)?;
        let ds = shrink(grad, b, slots, *rank)?;
        Ok((
            Some(expand(&ds, a, slots, *rank)?),
            Some(outer(&ds, x, slots, *rank)?),
            Some(outer(&s, grad, slots, *rank)?),
        ))
    }
}

/// The CUDA side: NVRTC-compiled `kernels/lora.cu`, launched on candle's stream.
#[cfg(feature = "cuda")]
mod cuda {
    use std::sync::OnceLock;

    use candle_core::backend::BackendStorage;
    use candle_core::cuda_backend::cudarc::driver::{
        CudaSlice, DeviceRepr, LaunchConfig, PushKernelArg,
    };
    use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
    use candle_core::{bail, CudaDevice, CudaStorage, Layout, Result, Shape, Storage, Tensor};

    use super::Shapes;

    const SOURCE: &str = include_str!("../../kernels/lora.cu");
    const MODULE: &str = "populora_lora";
    /// Threads per block: 8 warps (one per rank coordinate at rank 8).
    const BLOCK: u32 = 256;

    /// The PTX of `kernels/lora.cu`, compiled on first use.
    fn ptx() -> Result<&'static str> {
        static PTX: OnceLock<std::result::Result<String, String>> = OnceLock::new();
        let compiled = PTX.get_or_init(|| {
            candle_core::cuda_backend::cudarc::nvrtc::compile_ptx(SOURCE)
                .map(|p| p.to_src())
                .map_err(|e| format!("{e:?}"))
        });
        match compiled {
            Ok(ptx) => Ok(ptx),
            Err(e) => bail!("NVRTC could not compile kernels/lora.cu: {e}"),
        }
    }

    fn suffix(storage: &CudaStorage) -> Result<&'static str> {
        match storage.dtype() {
            candle_core::DType::F32 => Ok("f32"),
            candle_core::DType::F64 => Ok("f64"),
            other => bail!("the LoRA kernels run in f32 or f64, not {other:?}"),
        }
    }

    /// Runs `kernel` with the inputs' slices (offset to their layouts) and an
    /// output of `len` elements; `args` pushes the trailing integer arguments.
    #[allow(clippy::too_many_arguments)]
    fn launch<T: DeviceRepr + candle_core::cuda_backend::CudaDType>(
        dev: &CudaDevice,
        kernel: &str,
        inputs: [(&CudaStorage, &Layout); 2],
        slots: &Tensor,
        extra: Option<&CudaSlice<u32>>,
        len: usize,
        ints: [i32; 2],
        config: LaunchConfig,
    ) -> Result<CudaStorage> {
        let func = dev.get_or_load_custom_func(kernel, MODULE, ptx()?)?;
        let (slot_storage, slot_layout) = slots.storage_and_layout();
        let Storage::Cuda(slot_storage) = &*slot_storage else {
            bail!("the token slots are not on the GPU")
        };
        let slots = slot_storage
            .as_cuda_slice::<u32>()?
            .slice(slot_layout.start_offset()..);
        let p = inputs[0]
            .0
            .as_cuda_slice::<T>()?
            .slice(inputs[0].1.start_offset()..);
        let q = inputs[1]
            .0
            .as_cuda_slice::<T>()?
            .slice(inputs[1].1.start_offset()..);
        // SAFETY: every element is written by the kernel.
        let out = unsafe { dev.alloc::<T>(len)? };
        let mut builder = func.builder();
        builder.arg(&p);
        builder.arg(&q);
        builder.arg(&slots);
        let extra = extra.map(|e| e.slice(..));
        if let Some(extra) = &extra {
            builder.arg(extra);
        }
        builder.arg(&out);
        builder.arg(&ints[0]);
        builder.arg(&ints[1]);
        if len > 0 {
            // SAFETY: the arguments match the kernel's signature in lora.cu.
            unsafe { builder.launch(config) }.w()?;
        }
        Ok(CudaStorage::wrap_cuda_slice(out, dev.clone()))
    }

    fn check(layouts: [&Layout; 2], op: &str) -> Result<()> {
        if layouts.iter().any(|l| !l.is_contiguous()) {
            bail!("{op}: inputs must be contiguous")
        }
        Ok(())
    }

    fn blocks(n: usize) -> u32 {
        n.div_ceil(BLOCK as usize) as u32
    }

    macro_rules! typed {
        ($storage:expr, |$t:ident| $body:expr) => {
            match &$storage.slice {
                CudaStorageSlice::F32(_) => {
                    type $t = f32;
                    $body
                }
                CudaStorageSlice::F64(_) => {
                    type $t = f64;
                    $body
                }
                _ => bail!(
                    "the LoRA kernels run in f32 or f64, not {:?}",
                    $storage.dtype()
                ),
            }
        };
    }

    pub fn shrink(
        shapes: &Shapes,
        x: &CudaStorage,
        xl: &Layout,
        a: &CudaStorage,
        al: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        check([xl, al], "lora shrink")?;
        let (rows, r, width) = (shapes.rows(), shapes.rank, xl.dims()[1]);
        let kernel = format!("lora_shrink_{}", suffix(x)?);
        let config = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let slots = &shapes.slots.device;
        let ints = [width as i32, r as i32];
        let out = typed!(x, |T| launch::<T>(
            x.device(),
            &kernel,
            [(x, xl), (a, al)],
            slots,
            None,
            rows * r,
            ints,
            config
        )?);
        Ok((out, Shape::from((rows, r))))
    }

    pub fn expand(
        shapes: &Shapes,
        s: &CudaStorage,
        sl: &Layout,
        b: &CudaStorage,
        bl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        check([sl, bl], "lora expand")?;
        let (rows, r, out_dim) = (shapes.rows(), shapes.rank, bl.dims()[1]);
        let kernel = format!("lora_expand_{}", suffix(s)?);
        let config = LaunchConfig {
            grid_dim: (rows as u32, blocks(out_dim), 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let slots = &shapes.slots.device;
        let ints = [out_dim as i32, r as i32];
        let out = typed!(s, |T| launch::<T>(
            s.device(),
            &kernel,
            [(s, sl), (b, bl)],
            slots,
            None,
            rows * out_dim,
            ints,
            config
        )?);
        Ok((out, Shape::from((rows, out_dim))))
    }

    pub fn outer(
        shapes: &Shapes,
        u: &CudaStorage,
        ul: &Layout,
        v: &CudaStorage,
        vl: &Layout,
    ) -> Result<(CudaStorage, Shape)> {
        check([ul, vl], "lora outer")?;
        let (r, width, blocks_n) = (shapes.rank, vl.dims()[1], shapes.slots.blocks);
        let kernel = format!("lora_outer_{}", suffix(u)?);
        let config = LaunchConfig {
            grid_dim: (blocks(width), (blocks_n * r) as u32, 1),
            block_dim: (BLOCK, 1, 1),
            shared_mem_bytes: 0,
        };
        let slots = &shapes.slots.device;
        let ranges = u.device().clone_htod(&shapes.slots.ranges())?;
        let ints = [width as i32, r as i32];
        let out = typed!(u, |T| launch::<T>(
            u.device(),
            &kernel,
            [(u, ul), (v, vl)],
            slots,
            Some(&ranges),
            blocks_n * r * width,
            ints,
            config
        )?);
        Ok((out, Shape::from((blocks_n * r, width))))
    }

    /// NVRTC alone, no GPU needed: every kernel of lora.cu compiles.
    #[cfg(test)]
    #[test]
    fn cuda_nvrtc_compiles_the_kernels() {
        let ptx = ptx().unwrap();
        for kernel in ["shrink", "expand", "outer"] {
            for dtype in ["f32", "f64"] {
                let entry = format!(".entry lora_{kernel}_{dtype}(");
                assert!(ptx.contains(&entry), "no {entry} in the PTX");
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use candle_core::{DType, Var};

    /// 3 adapters of rank 2 over 7 token rows, one without an adapter, blocks
    /// out of order.
    fn case(device: &Device, dtype: DType) -> (Tensor, Tensor, Tensor, TokenSlots) {
        let slots = vec![2, 2, 0, NO_SLOT, 1, 1, 1];
        let slots = TokenSlots::new(slots, 3, device).unwrap();
        let x = Tensor::randn(0f64, 1.0, (7, 5), &Device::Cpu).unwrap();
        let a = Tensor::randn(0f64, 1.0, (6, 5), &Device::Cpu).unwrap();
        let b = Tensor::randn(0f64, 1.0, (6, 4), &Device::Cpu).unwrap();
        let on = |t: Tensor| t.to_dtype(dtype).unwrap().to_device(device).unwrap();
        (on(x), on(a), on(b), slots)
    }

    /// Each row of `lora_delta` equals its own adapter's two matmuls.
    #[test]
    fn rows_use_their_own_block() {
        let (x, a, b, slots) = case(&Device::Cpu, DType::F64);
        let delta = lora_delta(&x, &a, &b, &slots, 2).unwrap();
        for (t, &k) in slots.host.iter().enumerate() {
            let row = delta.get(t).unwrap();
            let expected = if k == NO_SLOT {
                row.zeros_like().unwrap()
            } else {
                let a_k = a.narrow(0, 2 * k as usize, 2).unwrap();
                let b_k = b.narrow(0, 2 * k as usize, 2).unwrap();
                x.narrow(0, t, 1)
                    .unwrap()
                    .matmul(&a_k.t().unwrap())
                    .unwrap()
                    .matmul(&b_k)
                    .unwrap()
                    .squeeze(0)
                    .unwrap()
            };
            let diff = (row - expected).unwrap().abs().unwrap().max_all().unwrap();
            assert!(diff.to_scalar::<f64>().unwrap() < 1e-12, "row {t}");
        }
    }

    /// Central finite differences of `Σ w ⊙ Δ` against the op's backward, in f64.
    pub(crate) fn check_gradients(device: &Device) {
        let (x, a, b, slots) = case(device, DType::F64);
        let (x, a, b) = (
            Var::from_tensor(&x).unwrap(),
            Var::from_tensor(&a).unwrap(),
            Var::from_tensor(&b).unwrap(),
        );
        let w = Tensor::randn(0f64, 1.0, (7, 4), &Device::Cpu)
            .unwrap()
            .to_device(device)
            .unwrap();
        let loss = |x: &Tensor, a: &Tensor, b: &Tensor| -> f64 {
            let d = lora_delta(x, a, b, &slots, 2).unwrap();
            (d * &w)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f64>()
                .unwrap()
        };
        let d = lora_delta(x.as_tensor(), a.as_tensor(), b.as_tensor(), &slots, 2).unwrap();
        let grads = (d * &w).unwrap().sum_all().unwrap().backward().unwrap();
        let eps = 1e-6;
        for (which, var) in [x.clone(), a.clone(), b.clone()].iter().enumerate() {
            let analytic = grads
                .get(var.as_tensor())
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            let values = var
                .as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap();
            for i in 0..values.len() {
                let nudged = |by: f64| {
                    let mut v = values.clone();
                    v[i] += by;
                    let t = Tensor::from_vec(v, var.dims(), device).unwrap();
                    let mut inputs = [
                        x.as_tensor().clone(),
                        a.as_tensor().clone(),
                        b.as_tensor().clone(),
                    ];
                    inputs[which] = t;
                    loss(&inputs[0], &inputs[1], &inputs[2])
                };
                let numeric = (nudged(eps) - nudged(-eps)) / (2.0 * eps);
                assert!(
                    (numeric - analytic[i]).abs() < 1e-7 * (1.0 + numeric.abs()),
                    "input {which} element {i}: finite difference {numeric}, backward {}",
                    analytic[i]
                );
            }
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        check_gradients(&Device::Cpu);
    }

    #[test]
    fn bad_slots_and_shapes_are_errors() {
        let err = TokenSlots::new(vec![0, 3], 3, &Device::Cpu).unwrap_err();
        assert!(err.to_string().contains("token slot 3"), "{err}");
        let (x, a, b, slots) = case(&Device::Cpu, DType::F32);
        let err = lora_delta(&x, &a, &b, &slots, 3).unwrap_err();
        assert!(err.to_string().contains("do not fit"), "{err}");
        let err = lora_delta(&x.to_dtype(DType::F64).unwrap(), &a, &b, &slots, 2).unwrap_err();
        assert!(err.to_string().contains("dtype"), "{err}");
    }
}
