//! Low-rank algebra on stacked LoRA factors, in f64, without ever forming ΔW.
//!
//! One module (one layer, one target) of one or more parents is held as a
//! [`Stack`]: `b.x` (out×K) holds the parents' B columns side by side and `a.x`
//! (in×K) their A rows as columns, K = parents × r. Parent i's update is
//! `b.x · E_i · a.xᵀ` (E_i: identity on block i), and any update in the span of
//! the parents is `b.x · M · a.xᵀ` for a small K×K *core* M.
//!
//! The only work proportional to the layer widths is one Gram product `XᵀX`
//! (K×K) per side when the stack is built and one product `X·T` (T: K×r) per side
//! when the child's factors are written. Everything in between (eigenvectors of
//! the Grams, the SVD of the core, truncation to rank r, noise in the singular
//! basis) works on K×K matrices. Why Grams rather than Householder QR: the same
//! orthonormal bases `Q = X·V·Λ^-½` come out of the Gram's eigenvectors at half
//! the flops, and rank deficiency (identical parents, zero factors) shows up as
//! eigenvalues we simply drop. The price is precision: directions whose singular
//! value is below ≈ √[`GRAM_RELATIVE_CUTOFF`] of the largest in a stack are lost,
//! i.e. a relative change of ΔW around 1e-6 at worst, far below f32 storage noise
//! in practice.

use faer::{Mat, MatRef, Side as Triangle};
use rand::Rng;

use super::Error;

/// Gram eigenvalues below this fraction of the largest one are treated as zero
/// (default 1e-13; eigenvalues are squared singular values, so this drops
/// directions under ≈3e-7 of the largest singular value of the stack).
pub const GRAM_RELATIVE_CUTOFF: f64 = 1e-13;

/// Singular values of a child below this fraction of its largest one are
/// treated as zero and their slot is re-initialised (default 1e-10).
pub const SINGULAR_RELATIVE_CUTOFF: f64 = 1e-10;

/// The norm of every row of a child's A: that of a Kaiming-uniform row at
/// initialisation in expectation (entries U(−1/√in, 1/√in) have variance
/// 1/(3·in), so ‖row‖² = 1/3 whatever `in`). Under Adam, ΔW moves at a speed
/// set by the factors' scale (dΔW ≈ dB·A while B is small), so a child whose
/// A keeps this scale learns as fast as a fresh adapter or a young parent;
/// the balanced split U·S^½, S^½·Vᵀ shrank A with √σ and slowed young
/// offspring several times over.
pub const A_ROW_NORM: f64 = 0.577_350_269_189_625_8;

/// One side (B or Aᵀ) of a stack: the tall factor and an orthonormal basis of
/// its column space expressed through it (`x · basis` has orthonormal columns
/// and `x = (x · basis) · root`).
pub struct Side {
    /// `n × K` stacked factor columns.
    pub x: Mat<f64>,
    /// `K × K`: `xᵀx`.
    gram: Mat<f64>,
    /// `K × k`: `V·Λ^-½` over the kept eigenpairs of `xᵀx`.
    basis: Mat<f64>,
    /// `k × K`: `Λ^½·Vᵀ`.
    root: Mat<f64>,
    /// `1ᵀ·x`: fixes the sign of singular vectors without touching `x` again.
    column_sums: Vec<f64>,
}

impl Side {
    fn new(x: Mat<f64>, what: &str) -> Result<Side, Error> {
        let gram = x.transpose() * &x;
        let column_sums = (0..x.ncols())
            .map(|j| x.col(j).iter().sum::<f64>())
            .collect();
        let (basis, root) = gram_basis(gram.as_ref(), what)?;
        Ok(Side {
            x,
            gram,
            basis,
            root,
            column_sums,
        })
    }

    /// Rank of the kept column space.
    fn dim(&self) -> usize {
        self.basis.ncols()
    }

    /// `x · t` as an `n × t.ncols()` matrix: the one wide product per side.
    pub fn apply(&self, t: MatRef<'_, f64>) -> Mat<f64> {
        &self.x * t
    }

    fn key(&self, coefficients: MatRef<'_, f64>, j: usize) -> f64 {
        (0..coefficients.nrows())
            .map(|i| self.column_sums[i] * coefficients[(i, j)])
            .sum()
    }
}

/// Eigen-decomposition of a Gram matrix, reduced to the directions above the
/// cutoff: returns (`V·Λ^-½`, `Λ^½·Vᵀ`), largest eigenvalue first.
fn gram_basis(gram: MatRef<'_, f64>, what: &str) -> Result<(Mat<f64>, Mat<f64>), Error> {
    let k = gram.nrows();
    if k == 0 {
        return Ok((Mat::zeros(0, 0), Mat::zeros(0, 0)));
    }
    let eigen = gram
        .self_adjoint_eigen(Triangle::Lower)
        .map_err(|e| Error::Numerical(format!("eigendecomposition of the {what} Gram: {e:?}")))?;
    let values: Vec<f64> = eigen.S().column_vector().iter().copied().collect();
    let vectors = eigen.U();
    let largest = values.iter().copied().fold(0.0_f64, f64::max);
    // faer sorts eigenvalues in increasing order; keep the large ones, largest first.
    let kept: Vec<usize> = (0..k)
        .rev()
        .filter(|&i| largest > 0.0 && values[i] > GRAM_RELATIVE_CUTOFF * largest)
        .collect();
    let basis = Mat::from_fn(k, kept.len(), |r, c| {
        vectors[(r, kept[c])] / values[kept[c]].sqrt()
    });
    let root = Mat::from_fn(kept.len(), k, |r, c| {
        vectors[(c, kept[r])] * values[kept[r]].sqrt()
    });
    Ok((basis, root))
}

/// A module's update in stack coordinates, as an SVD:
/// `ΔW = (b.x·p) · diag(s) · (a.x·q)ᵀ` where `b.x·p` and `a.x·q` have orthonormal
/// columns (or zero columns where `s` is zero). Columns are sorted by `s`,
/// largest first, and signed so that the result depends on ΔW only.
#[derive(Debug, Clone)]
pub struct StackSvd {
    pub p: Mat<f64>,
    pub s: Vec<f64>,
    pub q: Mat<f64>,
}

impl StackSvd {
    pub fn rank(&self) -> usize {
        self.s.len()
    }

    /// Whether direction j carries a (numerically) non-zero singular value.
    pub fn is_live(&self, j: usize) -> bool {
        let largest = self.s.iter().copied().fold(0.0_f64, f64::max);
        largest > 0.0 && self.s[j] > SINGULAR_RELATIVE_CUTOFF * largest
    }

    /// Number of live directions.
    pub fn effective_rank(&self) -> usize {
        (0..self.s.len()).filter(|&j| self.is_live(j)).count()
    }

    /// The core `p · diag(s) · qᵀ` (K×K) of the directions `range`.
    pub fn core(&self, range: std::ops::Range<usize>) -> Mat<f64> {
        let k = self.p.nrows();
        let mut core = Mat::zeros(k, k);
        for j in range {
            for c in 0..k {
                let right = self.s[j] * self.q[(c, j)];
                if right != 0.0 {
                    for r in 0..k {
                        core[(r, c)] += self.p[(r, j)] * right;
                    }
                }
            }
        }
        core
    }
}

/// One module of one or more parents, ready for operators.
pub struct Stack {
    pub b: Side,
    pub a: Side,
    /// Rank r of each parent (and of the child).
    pub rank: usize,
    pub parents: usize,
}

impl Stack {
    /// `b`: the parents' B side by side (`out × parents·r`); `at`: their Aᵀ
    /// (`in × parents·r`), parent i in columns `i·r..(i+1)·r` of both.
    pub fn new(b: Mat<f64>, at: Mat<f64>, rank: usize, parents: usize) -> Result<Stack, Error> {
        Ok(Stack {
            b: Side::new(b, "B")?,
            a: Side::new(at, "A")?,
            rank,
            parents,
        })
    }

    /// Width K of the stack.
    pub fn width(&self) -> usize {
        self.parents * self.rank
    }

    /// The core that selects parent i with weight w: `w·E_i`.
    pub fn parent_core(&self, parent: usize, weight: f64) -> Mat<f64> {
        let k = self.width();
        let start = parent * self.rank;
        Mat::from_fn(k, k, |r, c| {
            if r == c && (start..start + self.rank).contains(&r) {
                weight
            } else {
                0.0
            }
        })
    }

    /// `Σ wᵢ·E_i`: the weighted sum of the parents.
    pub fn weighted_core(&self, weights: &[f64]) -> Mat<f64> {
        let k = self.width();
        Mat::from_fn(
            k,
            k,
            |r, c| if r == c { weights[r / self.rank] } else { 0.0 },
        )
    }

    /// Best rank-r approximation (Frobenius) of `b.x · core · a.xᵀ`, as an SVD in
    /// stack coordinates. Exact when the update has rank ≤ r.
    pub fn svd_of_core(&self, core: MatRef<'_, f64>) -> Result<StackSvd, Error> {
        let small = &self.b.root * core * self.a.root.transpose();
        let k = self.width();
        let mut p = Mat::zeros(k, self.rank);
        let mut q = Mat::zeros(k, self.rank);
        let mut s = vec![0.0; self.rank];
        if self.b.dim() > 0 && self.a.dim() > 0 {
            let svd = small
                .thin_svd()
                .map_err(|e| Error::Numerical(format!("SVD of the core: {e:?}")))?;
            let values: Vec<f64> = svd.S().column_vector().iter().copied().collect();
            let left = &self.b.basis * svd.U();
            let right = &self.a.basis * svd.V();
            let largest = values.first().copied().unwrap_or(0.0);
            let kept = values
                .iter()
                .take(self.rank)
                .take_while(|&&v| largest > 0.0 && v > SINGULAR_RELATIVE_CUTOFF * largest)
                .count();
            for j in 0..kept {
                let key = self.b.key(left.as_ref(), j) + self.a.key(right.as_ref(), j);
                let sign = if key < 0.0 { -1.0 } else { 1.0 };
                s[j] = values[j];
                for r in 0..k {
                    p[(r, j)] = sign * left[(r, j)];
                    q[(r, j)] = sign * right[(r, j)];
                }
            }
        }
        Ok(StackSvd { p, s, q })
    }

    /// Parent i's own SVD, in stack coordinates.
    pub fn parent_svd(&self, parent: usize) -> Result<StackSvd, Error> {
        self.svd_of_core(self.parent_core(parent, 1.0).as_ref())
    }

    /// Coordinates of the parents' updates in one shared orthonormal basis of
    /// their balanced factors (U·S^½, V·S^½), plus the map back to a core. The basis depends
    /// on the parents' ΔW only (not on how each was factored), so elementwise
    /// operators (DARE, TIES) behave the same for `(B·M, M⁻¹·A)` as for `(B, A)`.
    pub fn joint_coordinates(&self) -> Result<JointCoordinates, Error> {
        let svds = (0..self.parents)
            .map(|i| self.parent_svd(i))
            .collect::<Result<Vec<_>, _>>()?;
        let k = self.width();
        // Balanced stack: parent i's block becomes U_i·S_i^½ (and V_i·S_i^½).
        let mut to_balanced_b = Mat::zeros(k, k);
        let mut to_balanced_a = Mat::zeros(k, k);
        for (i, svd) in svds.iter().enumerate() {
            for j in 0..self.rank {
                let root = svd.s[j].sqrt();
                for r in 0..k {
                    to_balanced_b[(r, i * self.rank + j)] = svd.p[(r, j)] * root;
                    to_balanced_a[(r, i * self.rank + j)] = svd.q[(r, j)] * root;
                }
            }
        }
        let gram_b = to_balanced_b.transpose() * &self.b.gram * &to_balanced_b;
        let gram_a = to_balanced_a.transpose() * &self.a.gram * &to_balanced_a;
        let (basis_b, root_b) = gram_basis(gram_b.as_ref(), "balanced B")?;
        let (basis_a, root_a) = gram_basis(gram_a.as_ref(), "balanced A")?;
        let coordinates = (0..self.parents)
            .map(|i| {
                let block = self.parent_core(i, 1.0);
                &root_b * &block * root_a.transpose()
            })
            .collect();
        Ok(JointCoordinates {
            coordinates,
            to_core_left: &to_balanced_b * basis_b,
            to_core_right: &to_balanced_a * basis_a,
        })
    }

    /// The child's factors: B (out×r) and Aᵀ (in×r) for the SVD `svd`, with
    /// column j of B scaled by `b_scale[j]` and of Aᵀ by `a_scale[j]`
    /// (`s/A_ROW_NORM` and `A_ROW_NORM` for the child split, both √s for the
    /// balanced one). Slots with a zero singular value get B = 0 and a fresh
    /// Kaiming-uniform A row from `rng`, so that they can still learn.
    pub fn factors(
        &self,
        svd: &StackSvd,
        b_scale: &[f64],
        a_scale: &[f64],
        rng: &mut impl Rng,
    ) -> (Mat<f64>, Mat<f64>) {
        let k = self.width();
        let live: Vec<bool> = (0..self.rank).map(|j| svd.is_live(j)).collect();
        let tb = Mat::from_fn(k, self.rank, |r, j| {
            if live[j] {
                svd.p[(r, j)] * b_scale[j]
            } else {
                0.0
            }
        });
        let ta = Mat::from_fn(k, self.rank, |r, j| {
            if live[j] {
                svd.q[(r, j)] * a_scale[j]
            } else {
                0.0
            }
        });
        let b = self.b.apply(tb.as_ref());
        let mut at = self.a.apply(ta.as_ref());
        let fan_in = at.nrows();
        let bound = 1.0 / (fan_in.max(1) as f64).sqrt();
        for j in (0..self.rank).filter(|&j| !live[j]) {
            for r in 0..fan_in {
                at[(r, j)] = rng.random_range(-bound..bound);
            }
        }
        (b, at)
    }

    /// The split every child is written in: B = U·S/c, Aᵀ = V·c with
    /// c = [`A_ROW_NORM`], so A's rows are orthogonal at their initial scale
    /// whatever ΔW's size (any split B·A = ΔW is the same adapter).
    pub fn child_factors(&self, svd: &StackSvd, rng: &mut impl Rng) -> (Mat<f64>, Mat<f64>) {
        let b_scale: Vec<f64> = svd.s.iter().map(|s| s / A_ROW_NORM).collect();
        self.factors(svd, &b_scale, &vec![A_ROW_NORM; svd.rank()], rng)
    }

    /// The balanced split: B = U·S^½, Aᵀ = V·S^½. Only the frame in which the
    /// elementwise mutations define their noise; children are not written in it.
    pub fn balanced_factors(&self, svd: &StackSvd, rng: &mut impl Rng) -> (Mat<f64>, Mat<f64>) {
        let roots: Vec<f64> = svd.s.iter().map(|s| s.sqrt()).collect();
        self.factors(svd, &roots, &roots, rng)
    }
}

/// See [`Stack::joint_coordinates`]. Child core for merged coordinates C:
/// `to_core_left · C · to_core_rightᵀ`.
pub struct JointCoordinates {
    pub coordinates: Vec<Mat<f64>>,
    pub to_core_left: Mat<f64>,
    pub to_core_right: Mat<f64>,
}

impl JointCoordinates {
    pub fn core(&self, merged: MatRef<'_, f64>) -> Mat<f64> {
        &self.to_core_left * merged * self.to_core_right.transpose()
    }
}
