//! Frozen weights kept as a GGUF file holds them: each row of a `[rows, cols]`
//! matrix is a run of blocks of [`BLOCK`] values, byte for byte as in the file.
//!
//! | format | bytes per 32 values | value of `q` in its block |
//! |---|---|---|
//! | Q4_1 | 20: f16 `d`, f16 `m`, 16 bytes of 4-bit `q` (low nibbles are values 0–15, high nibbles 16–31) | `d·q + m` |
//! | Q8_0 | 34: f16 `d`, 32 × i8 `q` | `d·q` |
//! | F16, BF16 | 64: the values | the value |
//!
//! A value is exactly the f32 the dequantized path holds (candle's
//! `to_float`, llama.cpp's `dequantize_row_*`): `d·q` is exact in f32 (an
//! 11-bit significand times at most 8 bits), so `d·q + m` rounds once
//! whether or not it is fused. The kernels ([`super::native`]) form these
//! values in registers; only the order of their sums differs from the f32
//! path. SmolLM2's linear weights are Q4_1 (66 MB against 382 MB in f32),
//! its embedding and tied LM head Q8_0 (30 MB against 113 MB).

use candle_core::quantized::GgmlDType;
use half::{bf16, f16};
use rayon::prelude::*;

/// Values per block, every format.
pub const BLOCK: usize = 32;

/// How a block of [`BLOCK`] values is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockFormat {
    Q4_1,
    Q8_0,
    F16,
    Bf16,
}

impl BlockFormat {
    /// Every format, for tests.
    pub const ALL: [BlockFormat; 4] = [
        BlockFormat::Q4_1,
        BlockFormat::Q8_0,
        BlockFormat::F16,
        BlockFormat::Bf16,
    ];

    /// Bytes per block.
    pub const fn bytes(self) -> usize {
        match self {
            BlockFormat::Q4_1 => 20,
            BlockFormat::Q8_0 => 34,
            BlockFormat::F16 | BlockFormat::Bf16 => 2 * BLOCK,
        }
    }

    /// Bytes per value (0.625 in Q4_1, 1.0625 in Q8_0, 2 in F16 and BF16).
    pub fn bytes_per_value(self) -> f64 {
        self.bytes() as f64 / BLOCK as f64
    }

    /// The format of a GGUF tensor type, if kept natively.
    pub fn of_ggml(dtype: GgmlDType) -> Option<BlockFormat> {
        match dtype {
            GgmlDType::Q4_1 => Some(BlockFormat::Q4_1),
            GgmlDType::Q8_0 => Some(BlockFormat::Q8_0),
            GgmlDType::F16 => Some(BlockFormat::F16),
            GgmlDType::BF16 => Some(BlockFormat::Bf16),
            _ => None,
        }
    }

    pub fn ggml(self) -> GgmlDType {
        match self {
            BlockFormat::Q4_1 => GgmlDType::Q4_1,
            BlockFormat::Q8_0 => GgmlDType::Q8_0,
            BlockFormat::F16 => GgmlDType::F16,
            BlockFormat::Bf16 => GgmlDType::BF16,
        }
    }

    /// Value `i` (`< BLOCK`) of `block`, in f32: the reference every kernel
    /// is held to.
    #[inline(always)]
    pub fn value(self, block: &[u8], i: usize) -> f32 {
        let half_at = |at: usize| u16::from_le_bytes([block[at], block[at + 1]]);
        match self {
            BlockFormat::Q4_1 => {
                let (d, m) = (f16::from_bits(half_at(0)), f16::from_bits(half_at(2)));
                let byte = block[4 + i % (BLOCK / 2)];
                let q = if i < BLOCK / 2 {
                    byte & 0x0F
                } else {
                    byte >> 4
                };
                // Not fused, as candle's `to_float` (the product is exact anyway).
                (q as f32) * d.to_f32() + m.to_f32()
            }
            BlockFormat::Q8_0 => (block[2 + i] as i8 as f32) * f16::from_bits(half_at(0)).to_f32(),
            BlockFormat::F16 => f16::from_bits(half_at(2 * i)).to_f32(),
            BlockFormat::Bf16 => bf16::from_bits(half_at(2 * i)).to_f32(),
        }
    }
}

/// A `[rows, cols]` matrix in blocks, `cols` a multiple of [`BLOCK`].
#[derive(Clone, PartialEq, Eq)]
pub struct BlockMatrix {
    format: BlockFormat,
    rows: usize,
    cols: usize,
    bytes: Vec<u8>,
}

impl std::fmt::Debug for BlockMatrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BlockMatrix({:?}, [{}, {}])",
            self.format, self.rows, self.cols
        )
    }
}

impl BlockMatrix {
    /// `bytes` as `[rows, cols]` in `format`; an error unless `cols` is a
    /// multiple of [`BLOCK`] and the bytes are exactly the blocks.
    pub fn new(
        format: BlockFormat,
        rows: usize,
        cols: usize,
        bytes: Vec<u8>,
    ) -> Result<BlockMatrix, String> {
        let expected = (cols / BLOCK)
            .checked_mul(format.bytes())
            .and_then(|row| row.checked_mul(rows));
        if !cols.is_multiple_of(BLOCK) || expected != Some(bytes.len()) {
            return Err(format!(
                "{} bytes of {format:?} for [{rows}, {cols}] (rows must be whole blocks of {BLOCK} values, {} bytes each)",
                bytes.len(),
                format.bytes()
            ));
        }
        Ok(BlockMatrix {
            format,
            rows,
            cols,
            bytes,
        })
    }

    /// `values` (`[rows, cols]`, row-major) quantized by candle to `format`
    /// (tests and benchmarks: a model built in f32 kept in blocks).
    pub fn quantize(
        values: &candle_core::Tensor,
        format: BlockFormat,
    ) -> candle_core::Result<BlockMatrix> {
        let (rows, cols) = values.dims2()?;
        let q = candle_core::quantized::QTensor::quantize(&values.contiguous()?, format.ggml())?;
        BlockMatrix::new(format, rows, cols, q.data()?.into_owned())
            .map_err(candle_core::Error::Msg)
    }

    pub fn format(&self) -> BlockFormat {
        self.format
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The blocks, every row after the other.
    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn row_bytes(&self) -> usize {
        self.cols / BLOCK * self.format.bytes()
    }

    /// Row `r`'s blocks.
    pub fn row(&self, r: usize) -> &[u8] {
        let n = self.row_bytes();
        &self.bytes[r * n..(r + 1) * n]
    }

    /// Row `r`'s values written to `out` (`cols` long).
    pub fn decode_row(&self, r: usize, out: &mut [f32]) {
        let format = self.format;
        for (block, out) in self
            .row(r)
            .chunks_exact(format.bytes())
            .zip(out.chunks_exact_mut(BLOCK))
        {
            for (i, v) in out.iter_mut().enumerate() {
                *v = format.value(block, i);
            }
        }
    }

    /// Every value, row-major: what the dequantized path holds.
    pub fn to_f32(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.rows * self.cols];
        if self.cols > 0 {
            out.par_chunks_mut(self.cols)
                .enumerate()
                .for_each(|(r, out)| self.decode_row(r, out));
        }
        out
    }

    /// The rows `ids` name, decoded: `[ids.len(), cols]` row-major (an
    /// embedding lookup). An error names an id past the last row.
    pub fn gather(&self, ids: &[u32]) -> Result<Vec<f32>, String> {
        if let Some(bad) = ids.iter().find(|&&id| id as usize >= self.rows) {
            return Err(format!("row {bad} of a matrix of {} rows", self.rows));
        }
        let mut out = vec![0f32; ids.len() * self.cols];
        for (&id, out) in ids.iter().zip(out.chunks_exact_mut(self.cols.max(1))) {
            self.decode_row(id as usize, out);
        }
        Ok(out)
    }

    /// The matrix whose row `r` is this one's row `source(r)`: whole rows of
    /// blocks move, so the values stay exact.
    pub fn permute_rows(&self, source: impl Fn(usize) -> usize) -> BlockMatrix {
        let bytes = (0..self.rows)
            .flat_map(|r| self.row(source(r)).iter().copied())
            .collect();
        BlockMatrix { bytes, ..*self }
    }

    /// Bytes held.
    pub fn resident_bytes(&self) -> usize {
        self.bytes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};

    fn random(rows: usize, cols: usize, seed: u32) -> Tensor {
        let values = crate::base::few_rows::test_values(rows * cols, seed);
        Tensor::from_vec(values, (rows, cols), &Device::Cpu).unwrap()
    }

    /// Decoding equals candle's dequantization bit for bit, in every format.
    #[test]
    fn values_are_candles_dequantized_values() {
        let t = (random(7, 96, 1) * 3.0).unwrap();
        for format in BlockFormat::ALL {
            let blocks = BlockMatrix::quantize(&t, format).unwrap();
            let q = QTensor::quantize(&t, format.ggml()).unwrap();
            let theirs = q
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap();
            let ours = blocks.to_f32();
            assert_eq!(
                ours.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                theirs.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "{format:?}"
            );
            assert_eq!(blocks.resident_bytes(), 7 * 3 * format.bytes());
            let rows = blocks.gather(&[6, 0, 6]).unwrap();
            assert_eq!(rows[..96], ours[6 * 96..]);
            assert_eq!(rows[96..192], ours[..96]);
            assert!(blocks.gather(&[7]).unwrap_err().contains("row 7"));
        }
    }

    #[test]
    fn permuted_rows_carry_their_values() {
        let blocks = BlockMatrix::quantize(&random(5, 64, 2), BlockFormat::Q4_1).unwrap();
        let moved = blocks.permute_rows(|r| 4 - r);
        let (a, b) = (blocks.to_f32(), moved.to_f32());
        for r in 0..5 {
            assert_eq!(b[r * 64..(r + 1) * 64], a[(4 - r) * 64..(5 - r) * 64]);
        }
    }

    #[test]
    fn sizes_that_are_not_whole_blocks_are_errors() {
        assert!(BlockMatrix::new(BlockFormat::Q8_0, 2, 40, vec![0; 68]).is_err());
        assert!(BlockMatrix::new(BlockFormat::Q8_0, 2, 32, vec![0; 67]).is_err());
        assert!(BlockMatrix::new(BlockFormat::Q8_0, usize::MAX, 32, vec![]).is_err());
        assert!(BlockMatrix::new(BlockFormat::Q8_0, 2, 32, vec![0; 68]).is_ok());
    }
}
