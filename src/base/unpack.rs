//! Blocks of frozen weights ([`super::blocks`]) unpacked into f32 vectors, per
//! instruction set: what every native kernel ([`super::native`], and
//! [`super::row_lanes`] on blocks) reads its weights through.
//!
//! Each unpacked value is exactly [`BlockFormat::value`]: Q4_1's `d·q + m` as
//! one fused multiply-add (its product is exact, so fusing rounds as the
//! reference does), Q8_0's `d·q` as one multiply, f16 and bf16 widened.

use super::blocks::{BlockFormat, BLOCK};
use super::few_rows::{Isa, Lanes, Scalar};

/// A block format `S` can unpack.
pub(crate) trait Unpack<S: Lanes> {
    const FORMAT: BlockFormat;
    /// Values `c·S::WIDTH..(c + 1)·S::WIDTH` of the block at `block`.
    ///
    /// # Safety
    /// `block` points at a whole block of `FORMAT`, `c < BLOCK / S::WIDTH`,
    /// and the CPU runs `S`.
    unsafe fn chunk(block: *const u8, c: usize) -> S::V;
}

pub(crate) struct Q4_1;
pub(crate) struct Q8_0;
pub(crate) struct F16;
pub(crate) struct Bf16;

/// Every format through [`BlockFormat::value`], one value at a time: the
/// kernels on any CPU.
macro_rules! scalar_unpack {
    ($($marker:ident => $format:expr),*) => {$(
        impl Unpack<Scalar> for $marker {
            const FORMAT: BlockFormat = $format;
            #[inline(always)]
            unsafe fn chunk(block: *const u8, c: usize) -> f32 {
                $format.value(std::slice::from_raw_parts(block, $format.bytes()), c)
            }
        }
    )*};
}

scalar_unpack!(
    Q4_1 => BlockFormat::Q4_1,
    Q8_0 => BlockFormat::Q8_0,
    F16 => BlockFormat::F16,
    Bf16 => BlockFormat::Bf16
);

/// `f(F)` with `F` the marker type of `format`.
macro_rules! with_format {
    ($format:expr, $F:ident => $body:expr) => {
        match $format {
            BlockFormat::Q4_1 => {
                type $F = $crate::base::unpack::Q4_1;
                $body
            }
            BlockFormat::Q8_0 => {
                type $F = $crate::base::unpack::Q8_0;
                $body
            }
            BlockFormat::F16 => {
                type $F = $crate::base::unpack::F16;
                $body
            }
            BlockFormat::Bf16 => {
                type $F = $crate::base::unpack::Bf16;
                $body
            }
        }
    };
}
pub(crate) use with_format;

/// The vector types that unpack every format.
pub(crate) trait Decode: Lanes {
    /// `blocks` blocks of `format` from `src` written to `out`, [`BLOCK`]
    /// values each.
    ///
    /// # Safety
    /// `src` holds `blocks` whole blocks, `out` has room for their values,
    /// and the CPU runs `Self`.
    unsafe fn decode_blocks(format: BlockFormat, src: *const u8, blocks: usize, out: *mut f32);
}

impl<S: Lanes> Decode for S
where
    Q4_1: Unpack<S>,
    Q8_0: Unpack<S>,
    F16: Unpack<S>,
    Bf16: Unpack<S>,
{
    #[inline(always)]
    unsafe fn decode_blocks(format: BlockFormat, src: *const u8, blocks: usize, out: *mut f32) {
        with_format!(format, F => decode_as::<S, F>(src, blocks, out))
    }
}

#[inline(always)]
unsafe fn decode_as<S: Lanes, F: Unpack<S>>(src: *const u8, blocks: usize, out: *mut f32) {
    let bytes = F::FORMAT.bytes();
    for b in 0..blocks {
        for c in 0..BLOCK / S::WIDTH {
            S::store(
                out.add(b * BLOCK + c * S::WIDTH),
                F::chunk(src.add(b * bytes), c),
            );
        }
    }
}

/// The values of the whole blocks `src` of `format`, written to `out`
/// (`BLOCK` per block), with `isa`'s kernel.
///
/// # Panics
/// If `src` is not whole blocks, `out` not their length, or `isa` does not
/// run here.
pub(crate) fn decode(isa: Isa, format: BlockFormat, src: &[u8], out: &mut [f32]) {
    let blocks = src.len() / format.bytes();
    assert!(
        src.len() == blocks * format.bytes() && out.len() == blocks * BLOCK && isa.runs_here(),
        "decode: {} bytes of {format:?} into {} values with {isa:?}",
        src.len(),
        out.len()
    );
    let (src, out) = (src.as_ptr(), out.as_mut_ptr());
    // SAFETY: lengths and CPU checked above.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => decode_avx512(format, src, blocks, out),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => decode_avx2(format, src, blocks, out),
            Isa::Portable => Scalar::decode_blocks(format, src, blocks, out),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,fma,f16c")]
unsafe fn decode_avx512(format: BlockFormat, src: *const u8, blocks: usize, out: *mut f32) {
    super::few_rows::x86::Avx512::decode_blocks(format, src, blocks, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn decode_avx2(format: BlockFormat, src: *const u8, blocks: usize, out: *mut f32) {
    super::few_rows::x86::Avx2::decode_blocks(format, src, blocks, out)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Bf16, BlockFormat, Unpack, F16, Q4_1, Q8_0};
    use crate::base::few_rows::x86::{Avx2, Avx512};

    /// The block's first two f16 (Q4_1's `d` and `m`; Q8_0's `d`) in lanes 0 and 1.
    #[inline(always)]
    unsafe fn scales(block: *const u8) -> __m128 {
        _mm_cvtph_ps(_mm_cvtsi32_si128(std::ptr::read_unaligned(
            block as *const i32,
        )))
    }

    impl Unpack<Avx512> for Q4_1 {
        const FORMAT: BlockFormat = BlockFormat::Q4_1;
        /// The block's 16 values `d·q + m` (q = 0..15) form a table; each
        /// nibble picks its value from it (`vpermps` reads an index's low
        /// four bits, so neither nibble needs masking).
        #[inline(always)]
        unsafe fn chunk(block: *const u8, c: usize) -> __m512 {
            let s = scales(block);
            let iota = _mm512_setr_ps(
                0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0,
                15.0,
            );
            let table = _mm512_fmadd_ps(
                iota,
                _mm512_broadcastss_ps(s),
                _mm512_broadcastss_ps(_mm_movehdup_ps(s)),
            );
            let bytes = _mm_loadu_si128(block.add(4) as *const __m128i);
            let nibbles = if c == 0 {
                bytes
            } else {
                _mm_srli_epi16::<4>(bytes)
            };
            _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(nibbles), table)
        }
    }

    impl Unpack<Avx512> for Q8_0 {
        const FORMAT: BlockFormat = BlockFormat::Q8_0;
        #[inline(always)]
        unsafe fn chunk(block: *const u8, c: usize) -> __m512 {
            let d = _mm512_broadcastss_ps(scales(block));
            let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(block.add(2 + 16 * c) as *const __m128i));
            _mm512_mul_ps(_mm512_cvtepi32_ps(q), d)
        }
    }

    impl Unpack<Avx512> for F16 {
        const FORMAT: BlockFormat = BlockFormat::F16;
        #[inline(always)]
        unsafe fn chunk(block: *const u8, c: usize) -> __m512 {
            _mm512_cvtph_ps(_mm256_loadu_si256(block.add(32 * c) as *const __m256i))
        }
    }

    impl Unpack<Avx512> for Bf16 {
        const FORMAT: BlockFormat = BlockFormat::Bf16;
        #[inline(always)]
        unsafe fn chunk(block: *const u8, c: usize) -> __m512 {
            let wide =
                _mm512_cvtepu16_epi32(_mm256_loadu_si256(block.add(32 * c) as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
        }
    }

    impl Unpack<Avx2> for Q4_1 {
        const FORMAT: BlockFormat = BlockFormat::Q4_1;
        #[inline(always)]
        unsafe fn chunk(block: *const u8, c: usize) -> __m256 {
            let s = scales(block);
            let (d, m) = (
                _mm256_broadcastss_ps(s),
                _mm256_broadcastss_ps(_mm_movehdup_ps(s)),
            );
            let bytes =
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(block.add(4 + 8 * (c % 2)) as *const __m128i));
            let q = if c < 2 {
                _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F))
            } else {
                _mm256_srli_epi32::<4>(bytes)
            };
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(q), d, m)
        }
    }

    impl Unpack<Avx2> for Q8_0 {
        const FORMAT: BlockFormat = BlockFormat::Q8_0;
        #[inline(always)]
        unsafe fn chunk(block: *const u8, c: usize) -> __m256 {
            let d = _mm256_broadcastss_ps(scales(block));
            let q = _mm256_cvtepi8_epi32(_mm_loadl_epi64(block.add(2 + 8 * c) as *const __m128i));
            _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
        }
    }

    impl Unpack<Avx2> for F16 {
        const FORMAT: BlockFormat = BlockFormat::F16;
        #[inline(always)]
        unsafe fn chunk(block: *const u8, c: usize) -> __m256 {
            _mm256_cvtph_ps(_mm_loadu_si128(block.add(16 * c) as *const __m128i))
        }
    }

    impl Unpack<Avx2> for Bf16 {
        const FORMAT: BlockFormat = BlockFormat::Bf16;
        #[inline(always)]
        unsafe fn chunk(block: *const u8, c: usize) -> __m256 {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(block.add(16 * c) as *const __m128i));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::blocks::BlockMatrix;
    use candle_core::{Device, Tensor};

    /// Random blocks of every format, with extreme scales among them
    /// (subnormal and large f16 `d`), unpack to the reference values bit for
    /// bit with every kernel this CPU runs.
    #[test]
    fn every_kernel_unpacks_the_reference_values() {
        let values = crate::base::few_rows::test_values(9 * 128, 5);
        let t = (Tensor::from_vec(values, (9, 128), &Device::Cpu).unwrap() * 7.0).unwrap();
        for format in BlockFormat::ALL {
            let mut blocks = BlockMatrix::quantize(&t, format).unwrap().bytes().to_vec();
            if matches!(format, BlockFormat::Q4_1 | BlockFormat::Q8_0) {
                // A subnormal d in block 0, a large d and negative m in block 1.
                blocks[..2].copy_from_slice(&half::f16::from_f32(3e-7).to_bits().to_le_bytes());
                let at = format.bytes();
                blocks[at..at + 2]
                    .copy_from_slice(&half::f16::from_f32(-6e4).to_bits().to_le_bytes());
            }
            let matrix = BlockMatrix::new(format, 9, 128, blocks.clone()).unwrap();
            let reference = matrix.to_f32();
            for isa in Isa::available() {
                let mut out = vec![f32::NAN; reference.len()];
                decode(isa, format, &blocks, &mut out);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&out), bits(&reference), "{format:?} {isa:?}");
            }
        }
    }
}
