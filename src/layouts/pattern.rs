//! The byte pattern that makes every transferred byte checkable.
//!
//! Each K/V vector gets 64-bit words derived from (request seed, layer, global head,
//! absolute token, K or V, word index), so a decode rank can check that a byte holds
//! exactly the head, layer and token its own layout says it should — a wrong rank map,
//! offset or layout shows up as a mismatch, not only a lost byte.

use serde::Serialize;

use super::geometry::{BlockContent, VecCoord};

/// SplitMix64 finaliser: cheap, and every input bit affects every output bit.
#[inline]
pub(crate) fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Spreads consecutive word indices over all 64 bits (the golden ratio).
const STEP: u64 = 0x9e37_79b9_7f4a_7c15;

/// The key of one vector; word `w` of it is `key ^ (w * STEP)`. The key is fully mixed, so
/// vectors of different coordinates share nothing; inside a vector the words differ by
/// multiples of `STEP`, which is cheap enough to write and check at memory speed.
#[inline]
pub fn vector_key(seed: u64, layer: u32, global_head: u32, token: u32, kv: u32) -> u64 {
    let id =
        (u64::from(layer) << 44) ^ (u64::from(global_head) << 26) ^ (u64::from(token) << 1) ^ u64::from(kv);
    mix(seed ^ mix(id))
}

/// Word `w` of the run keyed `key`.
#[inline]
pub(crate) fn word_at(key: u64, w: u64) -> u64 {
    key ^ w.wrapping_mul(STEP)
}

/// Writes one vector.
#[inline]
pub fn fill_vector(buf: &mut [u8], key: u64) {
    fill_at(buf, key, 0);
}

/// Returns the index of the first byte that differs from the pattern, if any.
#[inline]
pub fn check_vector(buf: &[u8], key: u64) -> Option<usize> {
    check_at(buf, key, 0).err().map(|off| off as usize)
}

/// Writes the words of `key` into `buf` as they stand from byte `offset` on (a multiple of
/// 8): byte `i` of `buf` gets byte `offset + i` of the run. A vector is the run from 0; a
/// buffer `kvx xfer` reads is one run over its whole length, written piece by piece.
#[inline]
pub fn fill_at(buf: &mut [u8], key: u64, offset: u64) {
    debug_assert!(offset.is_multiple_of(8));
    let mut chunks = buf.chunks_exact_mut(8);
    let mut acc = (offset / 8).wrapping_mul(STEP);
    for c in &mut chunks {
        c.copy_from_slice(&(key ^ acc).to_le_bytes());
        acc = acc.wrapping_add(STEP);
    }
    let tail = chunks.into_remainder();
    if !tail.is_empty() {
        let bytes = (key ^ acc).to_le_bytes();
        tail.copy_from_slice(&bytes[..tail.len()]);
    }
}

/// Checks that `buf` holds the run of `key` from byte `offset` on (any offset, any length:
/// bytes up to the first multiple of 8, then whole words, then the bytes left); `Err` holds
/// the offset in the run of the first byte that differs.
#[inline]
pub fn check_at(buf: &[u8], key: u64, offset: u64) -> Result<(), u64> {
    let byte_at = |off: u64| word_at(key, off / 8).to_le_bytes()[(off % 8) as usize];
    let head = ((8 - offset % 8) % 8).min(buf.len() as u64) as usize;
    let body_off = offset + head as u64;
    let mut chunks = buf[head..].chunks_exact(8);
    let mut acc = (body_off / 8).wrapping_mul(STEP);
    let mut bad = false;
    for c in &mut chunks {
        let got = u64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]);
        bad |= got != key ^ acc;
        acc = acc.wrapping_add(STEP);
    }
    let tail = chunks.remainder();
    let tail_off = offset + (buf.len() - tail.len()) as u64;
    let edge_ok = |bytes: &[u8], first: u64| bytes.iter().zip(first..).all(|(&b, off)| b == byte_at(off));
    if !bad && edge_ok(&buf[..head], offset) && edge_ok(tail, tail_off) {
        return Ok(());
    }
    // Slow path only on a mismatch: find the first differing byte.
    match buf.iter().zip(offset..).find(|&(&b, off)| b != byte_at(off)) {
        Some((_, off)) => Err(off),
        None => Ok(()),
    }
}

/// Where a block's content sits in the request: global head of local head 0, and the
/// absolute token of the block's token 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockOrigin {
    pub seed: u64,
    pub first_global_head: u32,
    pub first_token: u32,
}

impl BlockOrigin {
    #[inline]
    fn key(&self, c: VecCoord) -> u64 {
        vector_key(self.seed, c.layer, self.first_global_head + c.head, self.first_token + c.token, c.kv)
    }
}

/// Fills one block of a region with the pattern.
pub fn fill_block(content: &BlockContent, origin: BlockOrigin, block: &mut [u8]) {
    let vb = content.vec_bytes() as usize;
    content.for_each_vector(|off, c| {
        let off = off as usize;
        if let Some(v) = block.get_mut(off..off + vb) {
            fill_vector(v, origin.key(c));
        }
    });
}

/// A byte that does not hold what it should.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, thiserror::Error)]
#[error(
    "byte {offset} of the block should hold layer {layer}, head {global_head}, token {token}, {kv} byte {byte} but differs"
)]
pub struct Mismatch {
    pub offset: u64,
    pub layer: u32,
    pub global_head: u32,
    pub token: u32,
    pub kv: &'static str,
    pub byte: u32,
}

/// Checks one block; every `sample`-th vector (1 = all). Returns the bytes checked.
pub fn verify_block(
    content: &BlockContent,
    origin: BlockOrigin,
    block: &[u8],
    sample: u32,
) -> Result<u64, Mismatch> {
    let vb = content.vec_bytes() as usize;
    let mut checked = 0u64;
    let mut first: Option<Mismatch> = None;
    let mut n = 0u32;
    let sample = sample.max(1);
    content.for_each_vector(|off, c| {
        n = n.wrapping_add(1);
        if first.is_some() || !n.is_multiple_of(sample) {
            return;
        }
        let start = off as usize;
        let Some(v) = block.get(start..start + vb) else {
            first = Some(Mismatch {
                offset: off,
                layer: c.layer,
                global_head: origin.first_global_head + c.head,
                token: origin.first_token + c.token,
                kv: "missing",
                byte: 0,
            });
            return;
        };
        match check_vector(v, origin.key(c)) {
            None => checked += vb as u64,
            Some(i) => {
                first = Some(Mismatch {
                    offset: off + i as u64,
                    layer: c.layer,
                    global_head: origin.first_global_head + c.head,
                    token: origin.first_token + c.token,
                    kv: if c.kv == 0 { "K" } else { "V" },
                    byte: i as u32,
                });
            }
        }
    });
    match first {
        Some(m) => Err(m),
        None => Ok(checked),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layouts::geometry::Axis;

    #[test]
    fn vectors_of_different_coordinates_differ() {
        let a = vector_key(1, 0, 0, 0, 0);
        assert_ne!(a, vector_key(1, 0, 1, 0, 0));
        assert_ne!(a, vector_key(1, 0, 0, 1, 0));
        assert_ne!(a, vector_key(1, 1, 0, 0, 0));
        assert_ne!(a, vector_key(1, 0, 0, 0, 1));
        assert_ne!(a, vector_key(2, 0, 0, 0, 0));
    }

    #[test]
    fn runs_check_at_any_offset_and_catch_shifted_and_damaged_bytes() {
        let mut buf = vec![0u8; 4096 + 13];
        fill_at(&mut buf, 7, 0);
        assert_eq!(check_at(&buf, 7, 0), Ok(()));
        assert_eq!(check_at(&buf[64..128], 7, 64), Ok(()));
        assert_eq!(check_at(&buf[3..1000], 7, 3), Ok(()));
        assert_eq!(check_at(&buf[64..128], 7, 72), Err(72));
        assert!(check_at(&buf[0..64], 8, 0).is_err());
        buf[100] ^= 1;
        assert_eq!(check_at(&buf[96..200], 7, 96), Err(100), "the byte, not its word");
        assert_eq!(check_at(&buf[97..200], 7, 97), Err(100));
        buf[100] ^= 1;
        // Every start and length around the word boundaries, and a wrong last byte.
        for start in 0..24 {
            for end in start..start + 40 {
                assert_eq!(check_at(&buf[start..end], 7, start as u64), Ok(()), "{start}..{end}");
                if end > start {
                    buf[end - 1] ^= 0x80;
                    assert_eq!(check_at(&buf[start..end], 7, start as u64), Err(end as u64 - 1));
                    buf[end - 1] ^= 0x80;
                }
            }
        }
        // Written piece by piece, a run is the run written at once; a vector is the run from 0.
        let mut pieces = vec![0u8; buf.len()];
        for (i, c) in pieces.chunks_mut(64).enumerate() {
            fill_at(c, 7, 64 * i as u64);
        }
        assert_eq!(pieces, buf);
        let mut v = vec![0u8; 21];
        fill_vector(&mut v, 7);
        assert_eq!(v, buf[..21]);
        assert_eq!(check_vector(&buf[..21], 7), None);
    }

    #[test]
    fn fill_then_verify_and_detect_a_flip() {
        let content = BlockContent {
            layer: Some(3),
            head: None,
            kv: None,
            axes: vec![(Axis::Head, 2), (Axis::Token, 4), (Axis::Kv, 2), (Axis::Bytes, 12)],
        };
        let origin = BlockOrigin { seed: 7, first_global_head: 4, first_token: 32 };
        let mut block = vec![0u8; content.len() as usize];
        fill_block(&content, origin, &mut block);
        assert_eq!(verify_block(&content, origin, &block, 1), Ok(content.len()));
        block[12 * 2 * 4 + 5] ^= 1; // head 1, token 0, K, byte 5
        let m = verify_block(&content, origin, &block, 1).expect_err("flip detected");
        assert_eq!((m.global_head, m.token, m.kv, m.byte), (5, 32, "K", 5));
        // Same bytes checked as a different token are wrong.
        let shifted = BlockOrigin { first_token: 33, ..origin };
        assert!(verify_block(&content, shifted, &block, 1).is_err());
    }
}

/// The NIXL peers' byte (`--fill peer`; `scripts/peers/nixl_pd_peer.py` and vLLM's
/// workers in `vllm-peer` write it): byte `offset` of block `block` in region `region` of a
/// prefill rank's pool.
#[inline]
pub fn peer_byte(region: u64, block: u64, offset: u64) -> u8 {
    ((region * 131 + block * 31 + offset) % 251) as u8
}

/// Writes the peer pattern into `bytes`, which start at byte `offset` of `block` in `region`.
pub fn fill_peer(bytes: &mut [u8], region: u64, block: u64, offset: u64) {
    let mut v = (region * 131 + block * 31 + offset) % 251;
    for b in bytes {
        *b = v as u8;
        v = if v == 250 { 0 } else { v + 1 };
    }
}

/// The first byte of `bytes` (which start at byte `offset` of `block` in `region`) that is not
/// the peer pattern, as an index into `bytes`.
pub fn check_peer(bytes: &[u8], region: u64, block: u64, offset: u64) -> Option<usize> {
    let mut v = (region * 131 + block * 31 + offset) % 251;
    for (i, &b) in bytes.iter().enumerate() {
        if u64::from(b) != v {
            return Some(i);
        }
        v = if v == 250 { 0 } else { v + 1 };
    }
    None
}

#[cfg(test)]
mod peer_tests {
    use super::*;

    #[test]
    fn the_peer_pattern_is_the_formula_byte_by_byte_and_a_changed_byte_is_found() {
        let mut b = vec![0u8; 1000];
        fill_peer(&mut b, 3, 7, 500);
        for (i, &x) in b.iter().enumerate() {
            assert_eq!(x, peer_byte(3, 7, 500 + i as u64));
        }
        assert_eq!(check_peer(&b, 3, 7, 500), None);
        b[321] ^= 1;
        assert_eq!(check_peer(&b, 3, 7, 500), Some(321));
        assert_eq!(check_peer(&b, 3, 8, 500), Some(0), "another block's bytes differ");
    }
}
