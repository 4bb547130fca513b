//! NIXL's agent metadata blob (`nixl_agent.get_agent_metadata()`), decoded without NIXL.
//!
//! vLLM advertises this blob in `NixlAgentMetadata.agent_metadata`; a peer hands it to
//! NIXL's `loadRemoteMD` to learn how to reach the agent and which memory it may read.
//! kvx decodes it to show what a peer offers (`kvx probe`) before any NIXL is loaded.
//!
//! # Format (NIXL 1.5.1, read from real blobs; `tests/fixtures/nixl/`)
//!
//! The blob is NIXL's serializer output: the intro `nixlSerDes|`, then fields. A field is
//! its tag (raw text, no length: the reader must know which tag comes next), the value's
//! length as 8 bytes little-endian, the value, and `|`. Integers inside values are
//! little-endian (the serializer copies host memory; every NIXL wheel is x86-64 or
//! aarch64, both little-endian).
//!
//! ```text
//! nixlSerDes|
//! Agent       <agent name>
//! Conns       u64: number of backends with connection info, then for each:
//!   t         <backend type, e.g. UCX>
//!   c         <connection info: for UCX the worker address>          (opaque)
//! ""          "MemSection"                                            (empty tag)
//! nixlSecElms u64: number of (memory type, backend) sections, then for each:
//!   bknd      <backend type>
//!   nixlDList "nixlSDList"
//!   t         u32: memory type (0 DRAM, 1 VRAM, 2 BLK, 3 OBJ, 4 FILE)
//!   n         u64: number of descriptors, then for each:
//!     ""      u64 address, u64 length, u64 device id, then the backend's
//!             remote key for the region (UCX: a packed rkey)          (opaque)
//! ```
//!
//! Decoded: the agent name, each backend's type and connection-info size, and every
//! registered region's backend, memory type, address, length, device id and remote-key
//! size. Kept opaque: connection info and remote keys (only their sizes are reported;
//! they are UCX's packed formats, which only UCX reads).
//!
//! Accepted from NIXL's source but not seen in a 1.5.1 blob: one-byte `u` (unified
//! addressing) and `s` (sorted) flags between a list's `t` and `n`, which other NIXL
//! versions write (skipped), and the `AgentName` / `AgentUUID` fields newer NIXL appends
//! after the memory sections (the UUID is kept). Anything after the last field kvx knows is
//! counted in [`AgentBlob::unparsed_tail`], not guessed at.
//!
//! Owns: the pure decoding of that blob. Must not load NIXL or interpret what the regions
//! hold (that is the caller's layout).
#![forbid(unsafe_code)]

use std::fmt;

use serde::{Serialize, Serializer};

/// What every NIXL serializer output starts with.
pub const INTRO: &[u8] = b"nixlSerDes|";

/// At most this many backends with connection info; NIXL ships about a dozen plugins.
pub const MAX_BACKENDS: u64 = 64;
/// At most this many (memory type, backend) sections: 5 memory types times the backends.
pub const MAX_SECTIONS: u64 = 5 * MAX_BACKENDS;
/// At most this many regions in one blob. vLLM registers one region per KV cache tensor
/// (a few hundred for the largest models); the cap keeps a hostile count from costing more
/// than a few megabytes.
pub const MAX_REGIONS: u64 = 1 << 16;

/// A decoded agent metadata blob.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AgentBlob {
    pub agent_name: String,
    /// Backends that published connection info, in blob order.
    pub backends: Vec<BackendConn>,
    /// Registered regions of every section, in blob order (NIXL sorts a section by device
    /// id, then address).
    pub regions: Vec<BlobRegion>,
    /// `AgentUUID`, which NIXL releases newer than 1.5.1 append.
    pub agent_uuid: Option<String>,
    /// Bytes after the last field kvx decodes (0 for a 1.5.1 blob).
    pub unparsed_tail: usize,
}

/// One backend's connection info (opaque: only its size is kept).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BackendConn {
    pub backend: String,
    pub conn_info_len_bytes: usize,
}

/// One registered region as the blob advertises it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BlobRegion {
    /// The backend that registered it (its section's `bknd`).
    pub backend: String,
    pub mem_type: MemType,
    pub addr: u64,
    pub len_bytes: u64,
    pub device_id: u64,
    /// Size of the backend's remote key for the region (opaque).
    pub rkey_len_bytes: usize,
}

/// NIXL's `nixl_mem_t`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemType {
    Dram,
    Vram,
    Block,
    Object,
    File,
    /// A value this kvx does not know (a newer NIXL), kept as written.
    Other(u32),
}

impl MemType {
    fn from_raw(v: u32) -> Self {
        match v {
            0 => MemType::Dram,
            1 => MemType::Vram,
            2 => MemType::Block,
            3 => MemType::Object,
            4 => MemType::File,
            v => MemType::Other(v),
        }
    }
}

impl fmt::Display for MemType {
    /// NIXL's own names (`nixl_agent.get_reg_descs(.., "DRAM")`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemType::Dram => f.write_str("DRAM"),
            MemType::Vram => f.write_str("VRAM"),
            MemType::Block => f.write_str("BLK"),
            MemType::Object => f.write_str("OBJ"),
            MemType::File => f.write_str("FILE"),
            MemType::Other(v) => write!(f, "mem type {v}"),
        }
    }
}

impl Serialize for MemType {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// Why a blob did not decode. Offsets count from the blob's first byte.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlobError {
    #[error("not a NIXL agent blob: it does not start with `nixlSerDes|`")]
    NoIntro,
    #[error("NIXL agent blob ends inside field `{tag}` (at byte {offset})")]
    Truncated { tag: &'static str, offset: usize },
    #[error("NIXL agent blob: expected field `{tag}` at byte {offset}")]
    UnexpectedTag { tag: &'static str, offset: usize },
    #[error("NIXL agent blob: field `{tag}` at byte {offset} claims {len} bytes, only {left} left")]
    LengthPastEnd { tag: &'static str, offset: usize, len: u64, left: usize },
    #[error("NIXL agent blob: field `{tag}` at byte {offset} is {len} bytes, expected {expected}")]
    BadLength { tag: &'static str, offset: usize, len: usize, expected: usize },
    #[error(
        "NIXL agent blob: the region at byte {offset} is {len} bytes, less than its address, length and device id (24)"
    )]
    ShortRegion { offset: usize, len: usize },
    #[error("NIXL agent blob: field `{tag}` at byte {offset} is not followed by `|`")]
    NoSeparator { tag: &'static str, offset: usize },
    #[error("NIXL agent blob: field `{tag}` at byte {offset} is not UTF-8")]
    NotUtf8 { tag: &'static str, offset: usize },
    #[error("NIXL agent blob: {count} {what} (kvx reads at most {max})")]
    TooMany { what: &'static str, count: u64, max: u64 },
    #[error("NIXL agent blob: field `{tag}` is {found:?}, expected {expected:?}")]
    BadMarker { tag: &'static str, found: String, expected: &'static str },
}

/// Decodes an agent metadata blob. Never panics; allocates at most in proportion to
/// `bytes` and the caps above.
pub fn decode(bytes: &[u8]) -> Result<AgentBlob, BlobError> {
    let rest = bytes.strip_prefix(INTRO).ok_or(BlobError::NoIntro)?;
    let mut c = Cursor { bytes, pos: bytes.len() - rest.len() };

    let agent_name = c.string("Agent")?;
    let n_conns = c.count("Conns", "backends", MAX_BACKENDS)?;
    let mut backends = Vec::new();
    for _ in 0..n_conns {
        let backend = c.string("t")?;
        let conn_info_len_bytes = c.field("c")?.len();
        backends.push(BackendConn { backend, conn_info_len_bytes });
    }

    c.marker("", "MemSection")?;
    let n_sections = c.count("nixlSecElms", "memory sections", MAX_SECTIONS)?;
    let mut regions = Vec::new();
    for _ in 0..n_sections {
        let backend = c.string("bknd")?;
        c.marker("nixlDList", "nixlSDList")?;
        let mem_type = MemType::from_raw(c.u32("t")?);
        for flag in ["u", "s"] {
            if c.at(flag) {
                c.fixed(flag, 1)?;
            }
        }
        let n = c.count("n", "regions", MAX_REGIONS - regions.len() as u64)?;
        for _ in 0..n {
            let at = c.pos;
            let d = c.field("")?;
            let (Some(addr), Some(len_bytes), Some(device_id)) = (le_u64(d, 0), le_u64(d, 8), le_u64(d, 16))
            else {
                return Err(BlobError::ShortRegion { offset: at, len: d.len() });
            };
            regions.push(BlobRegion {
                backend: backend.clone(),
                mem_type,
                addr,
                len_bytes,
                device_id,
                rkey_len_bytes: d.len() - 24,
            });
        }
    }

    let mut agent_uuid = None;
    if c.at("AgentName") {
        c.field("AgentName")?;
    }
    if c.at("AgentUUID") {
        agent_uuid = Some(c.string("AgentUUID")?);
    }
    Ok(AgentBlob { agent_name, backends, regions, agent_uuid, unparsed_tail: bytes.len() - c.pos })
}

fn le_u64(b: &[u8], at: usize) -> Option<u64> {
    let s: [u8; 8] = b.get(at..at + 8)?.try_into().ok()?;
    Some(u64::from_le_bytes(s))
}

/// Reads fields in order; every read checks what is left first.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn left(&self) -> &'a [u8] {
        self.bytes.get(self.pos..).unwrap_or_default()
    }

    /// Whether a well-formed field tagged `tag` comes next (for optional fields).
    fn at(&self, tag: &'static str) -> bool {
        let mut probe = Cursor { bytes: self.bytes, pos: self.pos };
        probe.field(tag).is_ok()
    }

    /// The next field's value, which must be tagged `tag`.
    fn field(&mut self, tag: &'static str) -> Result<&'a [u8], BlobError> {
        let offset = self.pos;
        let left = self.left();
        let Some(after_tag) = left.strip_prefix(tag.as_bytes()) else {
            return Err(if tag.as_bytes().starts_with(left) {
                BlobError::Truncated { tag, offset }
            } else {
                BlobError::UnexpectedTag { tag, offset }
            });
        };
        let len = le_u64(after_tag, 0).ok_or(BlobError::Truncated { tag, offset })?;
        let value_and_sep = &after_tag[8..];
        let left = value_and_sep.len();
        let end = match usize::try_from(len) {
            Ok(l) if l < left => l,
            // The value is all there but its `|` is not: the blob was cut.
            Ok(l) if l == left => return Err(BlobError::Truncated { tag, offset }),
            _ => return Err(BlobError::LengthPastEnd { tag, offset, len, left }),
        };
        if value_and_sep[end] != b'|' {
            return Err(BlobError::NoSeparator { tag, offset });
        }
        self.pos = offset + tag.len() + 8 + end + 1;
        Ok(&value_and_sep[..end])
    }

    fn fixed(&mut self, tag: &'static str, len: usize) -> Result<&'a [u8], BlobError> {
        let offset = self.pos;
        let v = self.field(tag)?;
        if v.len() != len {
            return Err(BlobError::BadLength { tag, offset, len: v.len(), expected: len });
        }
        Ok(v)
    }

    fn u32(&mut self, tag: &'static str) -> Result<u32, BlobError> {
        let v = self.fixed(tag, 4)?;
        Ok(u32::from_le_bytes([v[0], v[1], v[2], v[3]]))
    }

    /// A `size_t` count, refused above `max`.
    fn count(&mut self, tag: &'static str, what: &'static str, max: u64) -> Result<u64, BlobError> {
        let v = self.fixed(tag, 8)?;
        let count = le_u64(v, 0).unwrap_or(u64::MAX);
        if count > max {
            return Err(BlobError::TooMany { what, count, max });
        }
        Ok(count)
    }

    fn string(&mut self, tag: &'static str) -> Result<String, BlobError> {
        let offset = self.pos;
        let v = self.field(tag)?;
        std::str::from_utf8(v).map(str::to_owned).map_err(|_| BlobError::NotUtf8 { tag, offset })
    }

    fn marker(&mut self, tag: &'static str, expected: &'static str) -> Result<(), BlobError> {
        let v = self.field(tag)?;
        if v != expected.as_bytes() {
            let found = String::from_utf8_lossy(&v[..v.len().min(32)]).into_owned();
            return Err(BlobError::BadMarker { tag, found, expected });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A blob in `tests/fixtures/nixl/` and what was registered to make it.
    struct Fixture {
        name: &'static str,
        blob: &'static [u8],
        registered: &'static str,
    }

    macro_rules! fixture {
        ($name:literal) => {
            Fixture {
                name: $name,
                blob: include_bytes!(concat!("../../../tests/fixtures/nixl/", $name, ".bin")),
                registered: include_str!(concat!("../../../tests/fixtures/nixl/", $name, ".json")),
            }
        };
    }

    fn fixtures() -> [Fixture; 4] {
        [
            fixture!("agent-0-regions"),
            fixture!("agent-1-region"),
            fixture!("agent-3-regions"),
            fixture!("agent-2-devices"),
        ]
    }

    #[derive(serde::Deserialize)]
    struct Registered {
        agent_name: String,
        backends: Vec<String>,
        registered: Vec<Region>,
    }

    #[derive(serde::Deserialize, Debug, PartialEq, Eq, PartialOrd, Ord)]
    struct Region {
        dev_id: u64,
        addr: u64,
        len: u64,
        mem: String,
    }

    #[test]
    fn real_blobs_decode_to_what_was_registered() {
        for f in fixtures() {
            let want: Registered = serde_json::from_str(f.registered).expect("fixture JSON");
            let got = decode(f.blob).unwrap_or_else(|e| panic!("{}: {e}", f.name));
            assert_eq!(got.agent_name, want.agent_name, "{}", f.name);
            let backends: Vec<&str> = got.backends.iter().map(|b| b.backend.as_str()).collect();
            assert_eq!(backends, want.backends, "{}", f.name);
            assert!(got.backends.iter().all(|b| b.conn_info_len_bytes > 0), "{}", f.name);
            assert_eq!((got.agent_uuid.as_deref(), got.unparsed_tail), (None, 0), "{}", f.name);

            let mut decoded: Vec<Region> = got
                .regions
                .iter()
                .map(|r| Region {
                    dev_id: r.device_id,
                    addr: r.addr,
                    len: r.len_bytes,
                    mem: r.mem_type.to_string(),
                })
                .collect();
            // NIXL keeps a section sorted by device id, then address: that is the blob order.
            assert!(decoded.is_sorted(), "{}: {decoded:?}", f.name);
            let mut registered = want.registered;
            registered.sort();
            decoded.sort();
            assert_eq!(decoded, registered, "{}", f.name);
            assert!(got.regions.iter().all(|r| r.backend == "UCX" && r.rkey_len_bytes > 0), "{}", f.name);
        }
    }

    #[test]
    fn two_devices_come_in_device_order() {
        let got = decode(fixture!("agent-2-devices").blob).expect("decodes");
        let devs: Vec<(u64, u64, MemType)> =
            got.regions.iter().map(|r| (r.device_id, r.len_bytes, r.mem_type)).collect();
        assert_eq!(devs, [(0, 16384, MemType::Dram), (1, 8192, MemType::Dram)]);
    }

    #[test]
    fn every_truncation_is_an_error() {
        for f in fixtures() {
            for n in 0..f.blob.len() {
                assert!(decode(&f.blob[..n]).is_err(), "{} cut at {n} decoded", f.name);
            }
        }
        assert_eq!(decode(b"nixlSerDes"), Err(BlobError::NoIntro));
        assert_eq!(
            decode(&fixture!("agent-1-region").blob[..20]),
            Err(BlobError::Truncated { tag: "Agent", offset: 11 })
        );
    }

    /// Appends one field in NIXL's framing.
    fn push_field(out: &mut Vec<u8>, tag: &str, value: &[u8]) {
        out.extend_from_slice(tag.as_bytes());
        out.extend_from_slice(&(value.len() as u64).to_le_bytes());
        out.extend_from_slice(value);
        out.push(b'|');
    }

    #[test]
    fn newer_trailing_fields_are_read_and_unknown_ones_counted() {
        let base = fixture!("agent-1-region").blob;
        let uuid = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b";
        let mut newer = base.to_vec();
        push_field(&mut newer, "AgentName", b"kvx-agent-1-region");
        push_field(&mut newer, "AgentUUID", uuid.as_bytes());
        let got = decode(&newer).expect("decodes");
        assert_eq!((got.agent_uuid.as_deref(), got.unparsed_tail), (Some(uuid), 0));
        assert_eq!(got.regions, decode(base).expect("decodes").regions);

        let mut unknown = base.to_vec();
        push_field(&mut unknown, "Later", b"x");
        assert_eq!(decode(&unknown).expect("decodes").unparsed_tail, 5 + 8 + 1 + 1);
    }

    /// Where the value of the list field starting `sep_tag_len` (`|`, a one-letter tag, the
    /// length's low byte) lies, searched after the list marker so connection info cannot match.
    fn value_at(blob: &[u8], sep_tag_len: &[u8; 3]) -> usize {
        let list = blob.windows(10).position(|w| w == b"nixlSDList").expect("a region list");
        list + blob[list..].windows(3).position(|w| w == sep_tag_len).expect("the field") + 2 + 8
    }

    #[test]
    fn hostile_counts_and_lengths_are_refused() {
        let mut b = INTRO.to_vec();
        push_field(&mut b, "Agent", b"a");
        push_field(&mut b, "Conns", &u64::MAX.to_le_bytes());
        assert_eq!(
            decode(&b),
            Err(BlobError::TooMany { what: "backends", count: u64::MAX, max: MAX_BACKENDS })
        );

        let mut b = INTRO.to_vec();
        b.extend_from_slice(b"Agent");
        b.extend_from_slice(&u64::MAX.to_le_bytes());
        b.extend_from_slice(b"a|");
        assert!(matches!(decode(&b), Err(BlobError::LengthPastEnd { tag: "Agent", len: u64::MAX, .. })));

        // A region count past the cap, in an otherwise real blob.
        let real = fixture!("agent-1-region").blob;
        let n_at = value_at(real, b"|n\x08");
        let mut b = real.to_vec();
        b[n_at..n_at + 8].copy_from_slice(&(MAX_REGIONS + 1).to_le_bytes());
        assert!(matches!(decode(&b), Err(BlobError::TooMany { what: "regions", .. })));
    }

    #[test]
    fn unknown_memory_types_are_kept() {
        let real = fixture!("agent-1-region").blob;
        let t_at = value_at(real, b"|t\x04");
        let mut b = real.to_vec();
        b[t_at] = 9;
        let got = decode(&b).expect("decodes");
        assert_eq!(got.regions[0].mem_type, MemType::Other(9));
        assert_eq!(got.regions[0].mem_type.to_string(), "mem type 9");
        b[t_at] = 1;
        assert_eq!(decode(&b).expect("decodes").regions[0].mem_type, MemType::Vram);
    }

    #[test]
    fn serializes_mem_type_by_name() {
        let got = decode(fixture!("agent-1-region").blob).expect("decodes");
        let j = serde_json::to_value(&got).expect("serializes");
        assert_eq!(j["regions"][0]["mem_type"], "DRAM");
        assert_eq!(j["backends"][0]["backend"], "UCX");
    }

    /// One change to a real blob: overwrite, insert or remove a byte at a position.
    #[derive(Debug, Clone)]
    enum Mutation {
        Set(usize, u8),
        Insert(usize, u8),
        Remove(usize),
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Set(i, b)),
            (any::<usize>(), any::<u8>()).prop_map(|(i, b)| Mutation::Insert(i, b)),
            any::<usize>().prop_map(Mutation::Remove),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        #[test]
        fn random_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..1024)) {
            let _ = decode(&bytes);
            let mut with_intro = INTRO.to_vec();
            with_intro.extend_from_slice(&bytes);
            let _ = decode(&with_intro);
        }

        #[test]
        fn mutated_real_blobs_never_panic(seed in 0usize..4, muts in prop::collection::vec(mutation(), 1..6)) {
            let mut b = fixtures()[seed].blob.to_vec();
            for m in muts {
                match m {
                    Mutation::Set(i, v) => {
                        let i = i % b.len().max(1);
                        if let Some(x) = b.get_mut(i) {
                            *x = v;
                        }
                    }
                    Mutation::Insert(i, v) => b.insert(i % (b.len() + 1), v),
                    Mutation::Remove(i) => {
                        if !b.is_empty() {
                            b.remove(i % b.len());
                        }
                    }
                }
            }
            if let Ok(got) = decode(&b) {
                prop_assert!(got.regions.len() as u64 <= MAX_REGIONS);
                prop_assert!(got.unparsed_tail <= b.len());
            }
        }
    }
}
