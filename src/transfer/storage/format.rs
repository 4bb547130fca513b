//! The on-disk format of one published (engine, request, prefill rank) file.
//!
//! ```text
//! header (padded with zeros to a multiple of ALIGN bytes)
//!   0  magic            8 bytes  "KVXKVSTR"
//!   8  format version   u32
//!  12  header length    u32      bytes, multiple of ALIGN; the payload starts here
//!  16  prefill rank     u32
//!  20  region count     u32
//!  24  request blocks   u32      positions in the request's block list
//!  28  engine id bytes  u32
//!  32  request id bytes u32
//!  36  reserved         u32      zero
//!  40  payload length   u64      bytes
//!  48  regions          count x (base_off, block_len, block_stride, num_blocks), u64 each
//!      block ids        blocks x u32, request order
//!      engine id, request id (UTF-8)
//!      SHA-256 of every header byte before it
//! payload (padded with zeros to a multiple of ALIGN bytes)
//!   region-major: region 0's block at request position 0, 1, ..., then region 1, ...
//! ```
//!
//! All integers are little-endian. Region-major payload order is the decode side's posting
//! order, so a decode rank's reads of one file are ascending file offsets, and whole-block
//! reads of a region are one contiguous range. Padding both parts to `ALIGN` lets the
//! same file be read and written with `O_DIRECT`.
//!
//! Pure encoding and decoding; no I/O.

use sha2::{Digest, Sha256};

/// First bytes of every kvx storage file.
pub const MAGIC: [u8; 8] = *b"KVXKVSTR";
/// Version this kvx writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// Alignment of the header length, the payload start and the file length (the largest
/// logical block size `O_DIRECT` asks for on common filesystems).
pub const ALIGN: u64 = 4096;
/// Bytes of the fixed part of the header.
pub const FIXED_LEN: usize = 48;
/// Largest header kvx will read: bounds the allocation a corrupt length field can cause
/// (a million regions or blocks is far beyond any model).
pub const MAX_HEADER_LEN: u64 = 64 << 20;

const DIGEST_LEN: usize = 32;
const REGION_LEN: usize = 32;

/// The geometry of one region as the file records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionGeom {
    pub base_off: u64,
    pub block_len: u64,
    pub block_stride: u64,
    pub num_blocks: u64,
}

/// Everything the header says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    pub p_rank: u32,
    pub engine_id: String,
    pub request_id: String,
    pub regions: Vec<RegionGeom>,
    /// The request's prefill block ids, in request order.
    pub blocks: Vec<u32>,
}

/// Why a header could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FormatError {
    BadMagic,
    Version(u32),
    Corrupt(String),
}

/// Rounds `n` up to a multiple of `ALIGN`.
pub fn align_up(n: u64) -> u64 {
    n.div_ceil(ALIGN) * ALIGN
}

impl Header {
    /// Bytes of the payload (all regions, all request blocks).
    pub fn payload_len(&self) -> u64 {
        self.regions.iter().map(|r| r.block_len).sum::<u64>() * self.blocks.len() as u64
    }

    fn body_len(&self) -> usize {
        FIXED_LEN
            + self.regions.len() * REGION_LEN
            + self.blocks.len() * 4
            + self.engine_id.len()
            + self.request_id.len()
            + DIGEST_LEN
    }

    /// Bytes of the header including padding; the payload starts here.
    pub fn header_len(&self) -> u64 {
        align_up(self.body_len() as u64)
    }

    /// Exact length of a complete file.
    pub fn file_len(&self) -> u64 {
        self.header_len() + align_up(self.payload_len())
    }

    /// File offset of the first byte of each region's run of blocks.
    pub fn region_file_offsets(&self) -> Vec<u64> {
        let n = self.blocks.len() as u64;
        let mut at = self.header_len();
        self.regions
            .iter()
            .map(|r| {
                let off = at;
                at += r.block_len * n;
                off
            })
            .collect()
    }

    /// The header bytes, `header_len()` long.
    pub fn encode(&self) -> Vec<u8> {
        let header_len = self.header_len();
        let mut b = Vec::with_capacity(header_len as usize);
        b.extend_from_slice(&MAGIC);
        b.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
        // The header is bounded by MAX_HEADER_LEN at publish time, so it fits u32.
        b.extend_from_slice(&(header_len as u32).to_le_bytes());
        b.extend_from_slice(&self.p_rank.to_le_bytes());
        b.extend_from_slice(&(self.regions.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.blocks.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.engine_id.len() as u32).to_le_bytes());
        b.extend_from_slice(&(self.request_id.len() as u32).to_le_bytes());
        b.extend_from_slice(&0u32.to_le_bytes());
        b.extend_from_slice(&self.payload_len().to_le_bytes());
        for r in &self.regions {
            for v in [r.base_off, r.block_len, r.block_stride, r.num_blocks] {
                b.extend_from_slice(&v.to_le_bytes());
            }
        }
        for id in &self.blocks {
            b.extend_from_slice(&id.to_le_bytes());
        }
        b.extend_from_slice(self.engine_id.as_bytes());
        b.extend_from_slice(self.request_id.as_bytes());
        let digest = Sha256::digest(&b);
        b.extend_from_slice(digest.as_slice());
        b.resize(header_len as usize, 0);
        b
    }

    /// Reads the header length from the fixed part (the first `FIXED_LEN` bytes), after
    /// checking magic and version, so the caller knows how much to read.
    pub fn decode_len(fixed: &[u8]) -> Result<u64, FormatError> {
        let mut c = Cursor { b: fixed, at: 0 };
        if c.take(8)? != MAGIC {
            return Err(FormatError::BadMagic);
        }
        let version = c.u32()?;
        if version != FORMAT_VERSION {
            return Err(FormatError::Version(version));
        }
        let len = u64::from(c.u32()?);
        if len < FIXED_LEN as u64 || !len.is_multiple_of(ALIGN) || len > MAX_HEADER_LEN {
            return Err(FormatError::Corrupt(format!(
                "header length {len} is not a multiple of {ALIGN} between {ALIGN} and {MAX_HEADER_LEN}"
            )));
        }
        Ok(len)
    }

    /// Decodes and checks a whole header (`bytes` holds at least the header).
    pub fn decode(bytes: &[u8]) -> Result<Header, FormatError> {
        let header_len = Self::decode_len(bytes)?;
        let mut c = Cursor { b: bytes, at: 16 };
        let p_rank = c.u32()?;
        let n_regions = c.u32()? as usize;
        let n_blocks = c.u32()? as usize;
        let engine_len = c.u32()? as usize;
        let request_len = c.u32()? as usize;
        let _reserved = c.u32()?;
        let payload_len = c.u64()?;
        let body = FIXED_LEN as u64
            + n_regions as u64 * REGION_LEN as u64
            + n_blocks as u64 * 4
            + engine_len as u64
            + request_len as u64
            + DIGEST_LEN as u64;
        if body > header_len || header_len > bytes.len() as u64 {
            return Err(FormatError::Corrupt(format!(
                "the header's counts ({n_regions} regions, {n_blocks} blocks, ids of {engine_len} and {request_len} \
                 bytes) need {body} bytes but the header is {header_len} bytes"
            )));
        }
        let mut regions = Vec::with_capacity(n_regions);
        for _ in 0..n_regions {
            regions.push(RegionGeom {
                base_off: c.u64()?,
                block_len: c.u64()?,
                block_stride: c.u64()?,
                num_blocks: c.u64()?,
            });
        }
        let mut blocks = Vec::with_capacity(n_blocks);
        for _ in 0..n_blocks {
            blocks.push(c.u32()?);
        }
        let engine_id = c.string(engine_len)?;
        let request_id = c.string(request_len)?;
        let signed = c.at;
        let digest = c.take(DIGEST_LEN)?;
        if Sha256::digest(&bytes[..signed]).as_slice() != digest {
            return Err(FormatError::Corrupt("the header checksum does not match its contents".into()));
        }
        let h = Header { p_rank, engine_id, request_id, regions, blocks };
        // Only a checksum collision gets here with an inconsistent length; check anyway, since
        // the reader sizes its reads from it.
        if h.payload_len() != payload_len {
            return Err(FormatError::Corrupt(format!(
                "payload length {payload_len} does not match the geometry ({} bytes)",
                h.payload_len()
            )));
        }
        Ok(h)
    }
}

struct Cursor<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], FormatError> {
        let s = self
            .b
            .get(self.at..self.at.saturating_add(n))
            .ok_or_else(|| FormatError::Corrupt(format!("the header ends early at byte {}", self.b.len())))?;
        self.at += n;
        Ok(s)
    }

    fn u32(&mut self) -> Result<u32, FormatError> {
        let mut a = [0u8; 4];
        a.copy_from_slice(self.take(4)?);
        Ok(u32::from_le_bytes(a))
    }

    fn u64(&mut self) -> Result<u64, FormatError> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }

    fn string(&mut self, n: usize) -> Result<String, FormatError> {
        String::from_utf8(self.take(n)?.to_vec())
            .map_err(|_| FormatError::Corrupt("an id in the header is not UTF-8".into()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Header {
        Header {
            p_rank: 3,
            engine_id: "engine-a".into(),
            request_id: "cmpl-1".into(),
            regions: vec![
                RegionGeom { base_off: 0, block_len: 64, block_stride: 64, num_blocks: 8 },
                RegionGeom { base_off: 512, block_len: 64, block_stride: 64, num_blocks: 8 },
            ],
            blocks: vec![5, 1, 7],
        }
    }

    #[test]
    fn round_trips_and_lays_out_region_major() {
        let h = sample();
        let bytes = h.encode();
        assert_eq!(bytes.len() as u64, ALIGN);
        assert_eq!(Header::decode(&bytes), Ok(h.clone()));
        assert_eq!(h.payload_len(), 2 * 3 * 64);
        assert_eq!(h.region_file_offsets(), vec![ALIGN, ALIGN + 192]);
        assert_eq!(h.file_len(), 2 * ALIGN);
    }

    #[test]
    fn any_flipped_byte_is_caught() {
        let h = sample();
        let good = h.encode();
        let body = h.body_len();
        for i in 0..body {
            let mut bad = good.clone();
            bad[i] ^= 0x40;
            assert!(Header::decode(&bad).is_err(), "flip at byte {i} went unnoticed");
        }
    }

    #[test]
    fn truncated_header_is_an_error_not_a_panic() {
        let bytes = sample().encode();
        for n in [0, 7, 8, 15, 47, 48, 100, 4095] {
            assert!(Header::decode(&bytes[..n]).is_err(), "{n} bytes");
        }
    }

    #[test]
    fn other_versions_are_named() {
        let mut bytes = sample().encode();
        bytes[8] = 9;
        assert_eq!(Header::decode(&bytes), Err(FormatError::Version(9)));
    }
}
