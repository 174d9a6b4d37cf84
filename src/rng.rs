//! Deterministic random streams.
//!
//! Every random number in populora comes from a ChaCha stream keyed by the
//! scenario seed and a path of labels, e.g. `(seed, member id, step, "sample")`.
//! Two streams with different keys are independent; the same key always gives
//! the same stream, whatever thread or process asks for it.

use rand_chacha::ChaCha12Rng;
use rand_core::SeedableRng;
use sha2::{Digest, Sha256};

/// A part of a stream key: a number (member id, step, row) or a label ("sample").
#[derive(Debug, Clone, Copy)]
pub enum KeyPart<'a> {
    Num(u64),
    Label(&'a str),
}

impl From<u64> for KeyPart<'_> {
    fn from(n: u64) -> Self {
        KeyPart::Num(n)
    }
}

impl From<usize> for KeyPart<'_> {
    fn from(n: usize) -> Self {
        KeyPart::Num(n as u64)
    }
}

impl<'a> From<&'a str> for KeyPart<'a> {
    fn from(s: &'a str) -> Self {
        KeyPart::Label(s)
    }
}

/// The ChaCha stream for `seed` and `key`. The key is hashed with SHA-256 so that
/// related keys (step 1 vs step 2) give unrelated streams.
pub fn stream(seed: u64, key: &[KeyPart<'_>]) -> ChaCha12Rng {
    let mut h = Sha256::new();
    h.update(b"populora-rng-v1");
    h.update(seed.to_le_bytes());
    for part in key {
        match part {
            KeyPart::Num(n) => {
                h.update([0u8]);
                h.update(n.to_le_bytes());
            }
            KeyPart::Label(s) => {
                h.update([1u8]);
                h.update((s.len() as u64).to_le_bytes());
                h.update(s.as_bytes());
            }
        }
    }
    ChaCha12Rng::from_seed(h.finalize().into())
}

/// `stream(seed, &[..])` with a literal key: `keyed_stream!(seed, member, step, "sample")`.
#[macro_export]
macro_rules! keyed_stream {
    ($seed:expr $(, $part:expr)* $(,)?) => {
        $crate::rng::stream($seed, &[$($crate::rng::KeyPart::from($part)),*])
    };
}

#[cfg(test)]
mod tests {
    use rand::Rng;

    #[test]
    fn same_key_same_stream_different_key_different_stream() {
        let a: u64 = keyed_stream!(7, 1u64, 2u64, "sample").random();
        let b: u64 = keyed_stream!(7, 1u64, 2u64, "sample").random();
        let c: u64 = keyed_stream!(7, 1u64, 3u64, "sample").random();
        let d: u64 = keyed_stream!(8, 1u64, 2u64, "sample").random();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
    }

    #[test]
    fn labels_and_numbers_do_not_collide() {
        let a: u64 = keyed_stream!(1, "1").random();
        let b: u64 = keyed_stream!(1, 1u64).random();
        assert_ne!(a, b);
    }
}
