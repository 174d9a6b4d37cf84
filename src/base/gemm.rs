//! Matrix products on the CPU through the `gemm` crate (candle's own GEMM),
//! for tensors that carry no gradient: the model's forward (every pass) and
//! the train step's hand-written backward (`compute::tape`).
//!
//! What differs from `Tensor::matmul`, each measured on the train step
//! (`populora bench broker`, BENCHMARKS.md):
//! - The output is not zero-filled before gemm overwrites it. candle's
//!   `vec![0; m·n]` is a full extra pass over every product's output.
//! - [`add_product`] adds a product into values the caller already holds
//!   (a LoRA delta into its projection's output, the input gradients of
//!   several projections into one sum), instead of a product and an add.
//! - [`write_product`] overwrites a buffer the caller keeps (the LM head's
//!   logits, chunk after chunk), instead of mapping and zeroing fresh memory.
//! - A batch of at least as many small products as threads (attention: one
//!   per row and KV head, e.g. `[768, 64]·[64, 256]`) runs its products side
//!   by side, one per thread, instead of one after another with every thread
//!   on each; and
//!   [`Threads::One`] lets a caller do the same with products of its own
//!   (each adapter segment's LoRA). Each such product is too small to keep two
//!   threads busy, and the hand-off costs more than it saves.
//!
//! [`matmul`] sends anything else (another device or dtype, a tensor that
//! records a gradient) to `Tensor::matmul`, so callers need no second path.

use candle_core::{
    CpuStorage, CustomOp2, DType, Device, Layout, Result, Shape, Storage, Tensor, WithDType,
};
use gemm::Parallelism;
use rayon::prelude::*;

/// `dst` made the `len` values that `write` writes through the pointer it is
/// given, with room for them: no zero fill first.
///
/// # Safety
/// `write` writes every one of the `len` values and reads none.
pub(crate) unsafe fn overwrite_with<T: Copy>(
    dst: &mut Vec<T>,
    len: usize,
    write: impl FnOnce(*mut T),
) {
    dst.clear();
    dst.reserve_exact(len);
    write(dst.as_mut_ptr());
    // SAFETY: the caller's promise: `write` initialised all `len` values.
    unsafe { dst.set_len(len) };
}

/// How many threads one call may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Threads {
    /// rayon's whole pool.
    All,
    /// The calling thread only: for callers that run independent products
    /// side by side themselves. (A tensor that records a gradient still goes
    /// to `Tensor::matmul`, on every thread.)
    One,
}

/// `a·b` for `a` `[..., m, k]` and `b` `[..., k, n]` with equal batch
/// dimensions; any strides (a transposed view costs no copy).
pub fn matmul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    product(a, b, Threads::All)
}

/// [`matmul`] on the calling thread only.
pub fn matmul_serial(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    product(a, b, Threads::One)
}

fn product(a: &Tensor, b: &Tensor, threads: Threads) -> Result<Tensor> {
    let plain = a.device().is_cpu()
        && a.dtype() == b.dtype()
        && matches!(a.dtype(), DType::F32 | DType::F64)
        && !a.track_op()
        && !b.track_op();
    if plain {
        // Through candle's op machinery, which takes the storage locks
        // re-entrantly: `a` and `b` may share storage (`x·xᵀ`).
        a.apply_op2_no_bwd(b, &Product(threads))
    } else {
        a.matmul(b)
    }
}

struct Product(Threads);

impl CustomOp2 for Product {
    fn name(&self) -> &'static str {
        "gemm-product"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        a_layout: &Layout,
        b: &CpuStorage,
        b_layout: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        storage_product(a, a_layout, b, b_layout, self.0)
    }
}

/// `a·b` on the storages and layouts candle hands a `CustomOp` (f32 or f64).
pub(crate) fn storage_product(
    a: &CpuStorage,
    a_layout: &Layout,
    b: &CpuStorage,
    b_layout: &Layout,
    threads: Threads,
) -> Result<(CpuStorage, Shape)> {
    match (a, b) {
        (CpuStorage::F32(x), CpuStorage::F32(y)) => {
            let (values, shape) = Plan::new(x, a_layout, y, b_layout)?.values(threads);
            Ok((CpuStorage::F32(values), shape))
        }
        (CpuStorage::F64(x), CpuStorage::F64(y)) => {
            let (values, shape) = Plan::new(x, a_layout, y, b_layout)?.values(threads);
            Ok((CpuStorage::F64(values), shape))
        }
        _ => candle_core::bail!("gemm: operands must both be f32 or both f64"),
    }
}

/// A CPU tensor of row-major values.
pub fn tensor<T: WithDType>((values, shape): (Vec<T>, Shape)) -> Result<Tensor> {
    Tensor::from_vec(values, shape, &Device::Cpu)
}

/// `a·b` as row-major values of type `T` (the tensors' dtype), with its shape.
/// No gradient is recorded. The operands' storages are read-locked one after
/// the other (candle's `storage_and_layout`, not re-entrant), so `a` and `b`
/// must not share storage that another thread may be writing (`Var::set`).
pub fn product_values<T: WithDType>(
    a: &Tensor,
    b: &Tensor,
    threads: Threads,
) -> Result<(Vec<T>, Shape)> {
    with_plan(a, b, |plan| Ok(plan.values(threads)))
}

/// `dst += a·b`, for `dst` the row-major values of a product of `a`'s and
/// `b`'s shape. Locks as [`product_values`] does.
pub fn add_product<T: WithDType>(
    dst: &mut [T],
    a: &Tensor,
    b: &Tensor,
    threads: Threads,
) -> Result<()> {
    with_plan(a, b, |plan| {
        if dst.len() != plan.shape.elem_count() {
            candle_core::bail!(
                "gemm: {} values to add a product of shape {:?} into",
                dst.len(),
                plan.shape
            );
        }
        if plan.k > 0 && !dst.is_empty() {
            // SAFETY: `dst` holds exactly the product's values, initialised.
            unsafe { plan.run(dst.as_mut_ptr(), true, threads) };
        }
        Ok(())
    })
}

/// `a·b` written over `dst`, whose allocation is kept (it is resized to the
/// product's length); returns the product's shape. For a caller that forms
/// same-sized products over and over (the LM head's logits, 100 MB a chunk):
/// a fresh allocation that large is mapped anew each time, and the kernel
/// faults in and zeroes every page of it. Locks as [`product_values`] does.
pub fn write_product<T: WithDType>(
    dst: &mut Vec<T>,
    a: &Tensor,
    b: &Tensor,
    threads: Threads,
) -> Result<Shape> {
    with_plan(a, b, |plan| Ok(plan.write_into(dst, threads)))
}

/// [`product_values`] for a left operand given as a slice: row-major values
/// of shape `[m, k]`.
pub fn slice_product<T: WithDType>(
    a: &[T],
    (m, k): (usize, usize),
    b: &Tensor,
    threads: Threads,
) -> Result<(Vec<T>, Shape)> {
    if m.checked_mul(k) != Some(a.len()) {
        candle_core::bail!("gemm: {} values for a [{m}, {k}] operand", a.len());
    }
    let a_layout = Layout::contiguous((m, k));
    let (b_storage, b_layout) = b.storage_and_layout();
    let y = cpu_values::<T>(&b_storage)?;
    Ok(Plan::new(a, &a_layout, y, b_layout)?.values(threads))
}

/// `f` on the checked product of two CPU tensors of type `T`, their storages
/// read-locked meanwhile.
fn with_plan<T: WithDType, R>(
    a: &Tensor,
    b: &Tensor,
    f: impl FnOnce(Plan<T>) -> Result<R>,
) -> Result<R> {
    let (a_storage, a_layout) = a.storage_and_layout();
    let (b_storage, b_layout) = b.storage_and_layout();
    let (x, y) = (cpu_values::<T>(&a_storage)?, cpu_values::<T>(&b_storage)?);
    f(Plan::new(x, a_layout, y, b_layout)?)
}

/// The values of a CPU storage of type `T`.
fn cpu_values<T: WithDType>(storage: &Storage) -> Result<&[T]> {
    match storage {
        Storage::Cpu(values) => T::cpu_storage_as_slice(values),
        _ => candle_core::bail!("gemm: operands must be on the CPU"),
    }
}

/// One operand: its values and layout.
struct Operand<'a, T> {
    values: &'a [T],
    layout: &'a Layout,
}

impl<T> Operand<'_, T> {
    fn matrix_strides(&self) -> (isize, isize) {
        let s = self.layout.stride();
        (s[s.len() - 2] as isize, s[s.len() - 1] as isize)
    }

    /// Offset of each matrix of the batch, in row-major batch order.
    fn batch_offsets(&self) -> Vec<usize> {
        let dims = self.layout.dims();
        let strides = self.layout.stride();
        let mut offsets = vec![self.layout.start_offset()];
        for axis in 0..dims.len() - 2 {
            offsets = offsets
                .iter()
                .flat_map(|&o| (0..dims[axis]).map(move |i| o + i * strides[axis]))
                .collect();
        }
        offsets
    }

    /// Whether every element the layout reaches lies inside `values`: the
    /// bound gemm's raw-pointer reads rest on.
    fn in_bounds(&self) -> bool {
        let dims = self.layout.dims();
        if dims.contains(&0) {
            return true;
        }
        let last = dims
            .iter()
            .zip(self.layout.stride())
            .try_fold(self.layout.start_offset(), |acc, (&d, &s)| {
                (d - 1).checked_mul(s).and_then(|x| acc.checked_add(x))
            });
        matches!(last, Some(l) if l < self.values.len())
    }
}

/// A checked product: operands, sizes and the output's shape.
struct Plan<'a, T> {
    a: Operand<'a, T>,
    b: Operand<'a, T>,
    m: usize,
    k: usize,
    n: usize,
    shape: Shape,
}

/// A raw output pointer that parallel tasks write disjoint parts through
/// (here: matrices, see Plan::run; in `row_lanes`: columns).
#[derive(Clone, Copy)]
pub(crate) struct Out<T>(pub(crate) *mut T);

impl<T> Out<T> {
    /// # Safety
    /// As for `pointer::add`.
    pub(crate) unsafe fn at(self, offset: usize) -> *mut T {
        unsafe { self.0.add(offset) }
    }
}
// SAFETY: every user makes its tasks write disjoint elements of the output
// (Plan::run: one matrix each; row_lanes::matmul_t_with: one column range each).
unsafe impl<T: Send> Send for Out<T> {}
unsafe impl<T: Send> Sync for Out<T> {}

impl<'a, T: WithDType> Plan<'a, T> {
    fn new(a: &'a [T], a_layout: &'a Layout, b: &'a [T], b_layout: &'a Layout) -> Result<Self> {
        let (a_dims, b_dims) = (a_layout.dims(), b_layout.dims());
        let rank = a_dims.len();
        let fits = rank >= 2
            && b_dims.len() == rank
            && a_dims[..rank - 2] == b_dims[..rank - 2]
            && a_dims[rank - 1] == b_dims[rank - 2];
        if !fits {
            candle_core::bail!("gemm: cannot multiply {a_dims:?} by {b_dims:?}");
        }
        let (a, b) = (
            Operand {
                values: a,
                layout: a_layout,
            },
            Operand {
                values: b,
                layout: b_layout,
            },
        );
        if !a.in_bounds() || !b.in_bounds() {
            candle_core::bail!("gemm: a layout reaches past its storage");
        }
        let (m, k, n) = (a_dims[rank - 2], a_dims[rank - 1], b_dims[rank - 1]);
        let mut out_dims = a_dims[..rank - 2].to_vec();
        out_dims.extend([m, n]);
        Ok(Plan {
            a,
            b,
            m,
            k,
            n,
            shape: Shape::from(out_dims),
        })
    }

    /// The product as fresh row-major values, with its shape.
    fn values(self, threads: Threads) -> (Vec<T>, Shape) {
        let mut out = Vec::new();
        let shape = self.write_into(&mut out, threads);
        (out, shape)
    }

    /// Replaces `dst`'s values with the product's, row-major; returns its shape.
    fn write_into(self, dst: &mut Vec<T>, threads: Threads) -> Shape {
        let len = self.shape.elem_count();
        if self.k == 0 || len == 0 {
            dst.clear();
            dst.resize(len, T::from_f64(0.0));
            return self.shape;
        }
        // SAFETY: `run` writes every value of the product (`read_dst` false).
        unsafe { overwrite_with(dst, len, |dst| self.run(dst, false, threads)) };
        self.shape
    }

    /// Writes (or with `read_dst` adds) the product into `dst`.
    ///
    /// # Safety
    /// `dst` must be valid for writes of the product's `shape.elem_count()`
    /// values, initialised when `read_dst`, and touched by no one else
    /// meanwhile. `k` and the output must not be empty.
    unsafe fn run(&self, dst: *mut T, read_dst: bool, threads: Threads) {
        let (m, k, n) = (self.m, self.k, self.n);
        let (a_offsets, b_offsets) = (self.a.batch_offsets(), self.b.batch_offsets());
        let (a_rs, a_cs) = self.a.matrix_strides();
        let (b_rs, b_cs) = self.b.matrix_strides();
        let dst = Out(dst);
        let one = |i: usize, parallelism: Parallelism| {
            // SAFETY: `Plan::new` checked that every element each operand's
            // offsets and strides reach lies inside it; matrix `i` of the
            // output is the `m·n` values from `i·m·n` on, inside `dst` by
            // the caller's guarantee, and no other task touches them.
            unsafe {
                gemm::gemm(
                    m,
                    n,
                    k,
                    dst.at(i * m * n),
                    1,
                    n as isize,
                    read_dst,
                    self.a.values.as_ptr().add(a_offsets[i]),
                    a_cs,
                    a_rs,
                    self.b.values.as_ptr().add(b_offsets[i]),
                    b_cs,
                    b_rs,
                    T::from_f64(1.0),
                    T::from_f64(1.0),
                    false,
                    false,
                    false,
                    parallelism,
                )
            }
        };
        let batch = a_offsets.len();
        let pool = match threads {
            Threads::All => rayon::current_num_threads(),
            Threads::One => 1,
        };
        if pool == 1 {
            (0..batch).for_each(|i| one(i, Parallelism::None));
        } else if batch >= pool {
            (0..batch)
                .into_par_iter()
                .for_each(|i| one(i, Parallelism::None));
        } else {
            (0..batch).for_each(|i| one(i, Parallelism::Rayon(pool)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::max_abs_diff;

    fn close(a: &Tensor, b: &Tensor, tol: f64) {
        let diff = max_abs_diff(a, b);
        assert!(diff <= tol, "max difference {diff}");
    }

    #[test]
    fn equals_candle_matmul_for_views_and_batches() {
        let dev = Device::Cpu;
        for dtype in [DType::F32, DType::F64] {
            let x = Tensor::randn(0f32, 1.0, (3, 4, 37, 19), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let y = Tensor::randn(0f32, 1.0, (3, 4, 23, 19), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let cases = [
                // batched, transposed right operand (a strided view)
                (x.clone(), y.t().unwrap()),
                // a transposed left operand
                (x.t().unwrap(), x.clone()),
                // 2-D, a narrowed view with an offset
                (
                    x.get(1).unwrap().get(2).unwrap().narrow(0, 5, 20).unwrap(),
                    y.get(0).unwrap().get(3).unwrap().t().unwrap(),
                ),
                // batch dimensions taken through a transpose
                (
                    x.transpose(0, 1).unwrap(),
                    y.transpose(0, 1).unwrap().t().unwrap(),
                ),
            ];
            for (a, b) in cases {
                // candle refuses some of these strides: compare on copies.
                let theirs = a
                    .contiguous()
                    .unwrap()
                    .matmul(&b.contiguous().unwrap())
                    .unwrap();
                for ours in [matmul(&a, &b).unwrap(), matmul_serial(&a, &b).unwrap()] {
                    assert_eq!(ours.dims(), theirs.dims());
                    close(&ours, &theirs, 1e-5);
                }
            }
        }
    }

    #[test]
    fn batch_items_in_parallel_equal_one_at_a_time() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (16, 33, 8), &dev).unwrap();
        let y = Tensor::randn(0f32, 1.0, (16, 8, 29), &dev).unwrap();
        let together = matmul(&x, &y).unwrap();
        for i in 0..16 {
            let alone = matmul(&x.get(i).unwrap(), &y.get(i).unwrap()).unwrap();
            // Bitwise: only the split over threads differs, never a sum's order.
            assert_eq!(
                together.get(i).unwrap().to_vec2::<f32>().unwrap(),
                alone.to_vec2::<f32>().unwrap()
            );
        }
    }

    #[test]
    fn add_product_adds_into_the_values_it_is_given() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (6, 5), &dev).unwrap();
        let y = Tensor::randn(0f32, 1.0, (7, 5), &dev).unwrap();
        let base = Tensor::randn(0f32, 1.0, (6, 7), &dev).unwrap();
        for threads in [Threads::All, Threads::One] {
            let mut values = base.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            add_product(&mut values, &x, &y.t().unwrap(), threads).unwrap();
            let ours = Tensor::from_vec(values, (6, 7), &dev).unwrap();
            let expected = (&base + x.matmul(&y.t().unwrap()).unwrap()).unwrap();
            close(&ours, &expected, 1e-5);
        }
        let mut short = vec![0f32; 41];
        assert!(add_product(&mut short, &x, &y.t().unwrap(), Threads::All).is_err());
        let mut wrong_type = vec![0f64; 42];
        assert!(add_product(&mut wrong_type, &x, &y.t().unwrap(), Threads::All).is_err());
    }

    #[test]
    fn write_product_reuses_its_buffer_and_slice_product_reads_a_slice() {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (6, 5), &dev).unwrap();
        let y = Tensor::randn(0f32, 1.0, (7, 5), &dev).unwrap();
        let expected = x.matmul(&y.t().unwrap()).unwrap();
        // Longer than the product, with stale values in it.
        let mut buffer = vec![f32::NAN; 100];
        let address = buffer.as_ptr();
        let shape = write_product(&mut buffer, &x, &y.t().unwrap(), Threads::All).unwrap();
        assert_eq!(shape.dims(), &[6, 7]);
        assert_eq!(buffer.as_ptr(), address, "the allocation is reused");
        let mismatched = Tensor::randn(0f32, 1.0, (4, 7), &dev).unwrap();
        assert!(write_product(&mut buffer, &x, &mismatched, Threads::All).is_err());
        assert_eq!(
            buffer.len(),
            42,
            "a failed product leaves the buffer as it was"
        );
        let ours = Tensor::from_vec(buffer.clone(), (6, 7), &dev).unwrap();
        close(&ours, &expected, 1e-5);

        let (values, shape) = slice_product(&buffer, (6, 7), &y, Threads::One).unwrap();
        let again = expected.matmul(&y).unwrap();
        close(&gemm_tensor(values, shape), &again, 1e-4);
        assert!(slice_product(&buffer[..41], (6, 7), &y, Threads::All).is_err());
        assert!(slice_product(&[0f32; 43], (6, 7), &y, Threads::All).is_err());
        assert!(slice_product(&buffer, (7, 6), &y, Threads::All).is_err());
    }

    fn gemm_tensor(values: Vec<f32>, shape: Shape) -> Tensor {
        tensor((values, shape)).unwrap()
    }

    #[test]
    fn empty_and_mismatched_shapes() {
        let dev = Device::Cpu;
        let x = Tensor::zeros((4, 0), DType::F32, &dev).unwrap();
        let y = Tensor::zeros((0, 3), DType::F32, &dev).unwrap();
        let z = matmul(&x, &y).unwrap();
        assert_eq!(z.dims(), &[4, 3]);
        assert_eq!(z.sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
        let w = Tensor::zeros((5, 3), DType::F32, &dev).unwrap();
        assert!(matmul(&x, &w).is_err());
    }

    #[test]
    fn tensors_with_gradients_keep_autograd() {
        let dev = Device::Cpu;
        let x = candle_core::Var::new(&[[1f32, 2.0], [3.0, 4.0]], &dev).unwrap();
        let w = Tensor::new(&[[1f32, 0.5], [0.25, 2.0]], &dev).unwrap();
        let y = matmul(x.as_tensor(), &w).unwrap();
        let grads = y.sum_all().unwrap().backward().unwrap();
        let g = grads.get(x.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(g, vec![vec![1.5, 2.25], vec![1.5, 2.25]]);
    }
}
