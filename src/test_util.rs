//! Helpers shared by the unit tests.

use candle_core::{DType, Tensor};

/// The largest absolute elementwise difference of two tensors of one shape,
/// in f64 whatever their dtype.
pub fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}
