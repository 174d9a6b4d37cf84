//! A minimal PNG encoder for opaque 8-bit RGB images: adaptive per-row
//! filtering and zlib compression (miniz_oxide, which the engine already
//! builds for `zip`). Smaller to build than the `png` crate, and all the report
//! needs.

/// PNG files start with these eight bytes.
pub(crate) const SIGNATURE: [u8; 8] = *b"\x89PNG\r\n\x1a\n";
/// zlib level: 6 is the usual balance of size and speed.
const LEVEL: u8 = 6;

/// Encodes `rgba` (row-major, 4 bytes per pixel, alpha ignored) as an RGB PNG.
/// Returns `None` when the buffer does not match the dimensions.
pub(crate) fn encode_rgb(width: u32, height: u32, rgba: &[u8]) -> Option<Vec<u8>> {
    let (w, h) = (width as usize, height as usize);
    if w == 0 || h == 0 || rgba.len() != w.checked_mul(h)?.checked_mul(4)? {
        return None;
    }
    let filtered = filter_rows(w, rgba);
    let compressed = miniz_oxide::deflate::compress_to_vec_zlib(&filtered, LEVEL);
    let mut out = Vec::with_capacity(compressed.len() + 64);
    out.extend_from_slice(&SIGNATURE);
    let mut header = Vec::with_capacity(13);
    header.extend_from_slice(&width.to_be_bytes());
    header.extend_from_slice(&height.to_be_bytes());
    // Bit depth 8, colour type 2 (RGB), deflate, adaptive filtering, no interlace.
    header.extend_from_slice(&[8, 2, 0, 0, 0]);
    chunk(&mut out, b"IHDR", &header);
    chunk(&mut out, b"IDAT", &compressed);
    chunk(&mut out, b"IEND", &[]);
    Some(out)
}

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    // Chunks are far below 4 GiB: a report image is a few megabytes raw.
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let start = out.len();
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    let crc = crc32fast::hash(&out[start..]);
    out.extend_from_slice(&crc.to_be_bytes());
}

/// Each RGB row prefixed by the filter (None, Sub or Up) with the smallest sum
/// of absolute residuals, the usual heuristic.
fn filter_rows(w: usize, rgba: &[u8]) -> Vec<u8> {
    let stride = w * 3;
    let mut out = Vec::with_capacity(rgba.len() / 4 * 3 + rgba.len() / (w * 4));
    let mut above = vec![0u8; stride];
    let mut row = vec![0u8; stride];
    let (mut sub, mut up) = (vec![0u8; stride], vec![0u8; stride]);
    for pixels in rgba.chunks_exact(w * 4) {
        for (rgb, px) in row.chunks_exact_mut(3).zip(pixels.chunks_exact(4)) {
            rgb.copy_from_slice(&px[..3]);
        }
        for x in 0..stride {
            sub[x] = row[x].wrapping_sub(if x >= 3 { row[x - 3] } else { 0 });
            up[x] = row[x].wrapping_sub(above[x]);
        }
        let cost = |r: &[u8]| {
            r.iter()
                .map(|&b| u64::from((b as i8).unsigned_abs()))
                .sum::<u64>()
        };
        let (kind, best) = [(0u8, &row), (1, &sub), (2, &up)]
            .into_iter()
            .min_by_key(|(_, r)| cost(r))
            .unwrap_or((0, &row));
        out.push(kind);
        out.extend_from_slice(best);
        std::mem::swap(&mut above, &mut row);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn encodes_a_valid_stream() {
        let (w, h) = (5u32, 3u32);
        let rgba: Vec<u8> = (0..w * h * 4).map(|i| (i * 7) as u8).collect();
        let png = encode_rgb(w, h, &rgba).expect("encode");
        assert_eq!(&png[..8], &SIGNATURE);
        assert_eq!(&png[12..16], b"IHDR");
        assert_eq!(u32::from_be_bytes([png[16], png[17], png[18], png[19]]), w);
        // Decompress IDAT and undo the filters: the pixels come back.
        let idat = png.windows(4).position(|c| c == b"IDAT").expect("IDAT");
        let len = u32::from_be_bytes([png[idat - 4], png[idat - 3], png[idat - 2], png[idat - 1]])
            as usize;
        let raw = miniz_oxide::inflate::decompress_to_vec_zlib(&png[idat + 4..idat + 4 + len])
            .expect("zlib");
        let stride = w as usize * 3;
        let mut prev = vec![0u8; stride];
        for (y, line) in raw.chunks_exact(stride + 1).enumerate() {
            let mut row = line[1..].to_vec();
            for x in 0..stride {
                let left = if x >= 3 { row[x - 3] } else { 0 };
                row[x] = match line[0] {
                    0 => row[x],
                    1 => row[x].wrapping_add(left),
                    2 => row[x].wrapping_add(prev[x]),
                    f => panic!("filter {f}"),
                };
            }
            let want: Vec<u8> = rgba[y * w as usize * 4..(y + 1) * w as usize * 4]
                .chunks_exact(4)
                .flat_map(|p| [p[0], p[1], p[2]])
                .collect();
            assert_eq!(row, want, "row {y}");
            prev = row;
        }
    }

    #[test]
    fn rejects_mismatched_buffers() {
        assert!(encode_rgb(2, 2, &[0; 15]).is_none());
        assert!(encode_rgb(0, 2, &[]).is_none());
    }
}
