//! A bounded structural check of msgpack bytes, run before any decoder allocates.
//!
//! Every frame from the side channel is untrusted. A few bytes can claim an array of four
//! billion elements or a string of 4 GiB; this pass walks the encoding without building
//! anything and rejects a frame whose declared lengths exceed what the bytes can hold or
//! kvx's limits, or that nests too deep. After it passes, decoding allocates at most in
//! proportion to the frame, which is itself capped.
//!
//! Owns: msgpack structure limits. Must not interpret values.

use rmp::Marker;

/// Structural limits applied to one msgpack value.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Largest encoded value accepted, in bytes.
    pub max_bytes: usize,
    /// Deepest nesting of arrays and maps.
    pub max_depth: usize,
    /// Most elements of one array or entries of one map.
    pub max_collection_len: usize,
}

/// Why a msgpack value was rejected before decoding.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ScanError {
    #[error("{len} bytes exceed the {max}-byte limit")]
    TooLarge { len: usize, max: usize },
    #[error("truncated at byte {offset}: needs {needed} more bytes")]
    Truncated { offset: usize, needed: usize },
    #[error("nesting deeper than {max} levels at byte {offset}")]
    TooDeep { offset: usize, max: usize },
    #[error("collection of {len} items at byte {offset} exceeds the limit of {max}")]
    CollectionTooLarge { offset: usize, len: usize, max: usize },
    #[error("reserved msgpack marker 0xc1 at byte {offset}")]
    Reserved { offset: usize },
    #[error("{count} trailing bytes after the value")]
    Trailing { count: usize },
}

/// Checks that `bytes` hold exactly one msgpack value within `limits`.
pub fn check(bytes: &[u8], limits: &Limits) -> Result<(), ScanError> {
    if bytes.len() > limits.max_bytes {
        return Err(ScanError::TooLarge { len: bytes.len(), max: limits.max_bytes });
    }
    let mut pos = 0usize;
    // Values still to read at each open nesting level; the bottom entry is the root.
    let mut pending: Vec<usize> = vec![1];
    while let Some(top) = pending.last_mut() {
        if *top == 0 {
            pending.pop();
            continue;
        }
        *top -= 1;
        let offset = pos;
        let byte = *bytes.get(pos).ok_or(ScanError::Truncated { offset, needed: 1 })?;
        pos += 1;
        let (skip, children) = match Marker::from_u8(byte) {
            Marker::Reserved => return Err(ScanError::Reserved { offset }),
            Marker::FixPos(_) | Marker::FixNeg(_) | Marker::Null | Marker::True | Marker::False => (0, 0),
            Marker::U8 | Marker::I8 => (1, 0),
            Marker::U16 | Marker::I16 => (2, 0),
            Marker::U32 | Marker::I32 | Marker::F32 => (4, 0),
            Marker::U64 | Marker::I64 | Marker::F64 => (8, 0),
            Marker::FixStr(n) => (usize::from(n), 0),
            Marker::Str8 | Marker::Bin8 => (read_len(bytes, &mut pos, 1)?, 0),
            Marker::Str16 | Marker::Bin16 => (read_len(bytes, &mut pos, 2)?, 0),
            Marker::Str32 | Marker::Bin32 => (read_len(bytes, &mut pos, 4)?, 0),
            Marker::FixExt1 => (2, 0),
            Marker::FixExt2 => (3, 0),
            Marker::FixExt4 => (5, 0),
            Marker::FixExt8 => (9, 0),
            Marker::FixExt16 => (17, 0),
            Marker::Ext8 => (read_len(bytes, &mut pos, 1)? + 1, 0),
            Marker::Ext16 => (read_len(bytes, &mut pos, 2)? + 1, 0),
            Marker::Ext32 => (read_len(bytes, &mut pos, 4)? + 1, 0),
            Marker::FixArray(n) => (0, usize::from(n)),
            Marker::Array16 => (0, read_len(bytes, &mut pos, 2)?),
            Marker::Array32 => (0, read_len(bytes, &mut pos, 4)?),
            Marker::FixMap(n) => (0, map_children(usize::from(n), offset, limits)?),
            Marker::Map16 => (0, map_children(read_len(bytes, &mut pos, 2)?, offset, limits)?),
            Marker::Map32 => (0, map_children(read_len(bytes, &mut pos, 4)?, offset, limits)?),
        };
        let remaining = bytes.len() - pos;
        if skip > remaining {
            return Err(ScanError::Truncated { offset, needed: skip - remaining });
        }
        pos += skip;
        let is_collection = matches!(
            Marker::from_u8(byte),
            Marker::FixArray(_)
                | Marker::Array16
                | Marker::Array32
                | Marker::FixMap(_)
                | Marker::Map16
                | Marker::Map32
        );
        if is_collection {
            let items = if matches!(Marker::from_u8(byte), Marker::FixMap(_) | Marker::Map16 | Marker::Map32)
            {
                children / 2
            } else {
                children
            };
            if items > limits.max_collection_len {
                return Err(ScanError::CollectionTooLarge {
                    offset,
                    len: items,
                    max: limits.max_collection_len,
                });
            }
            // Each element takes at least one byte, so a longer claim cannot be honest.
            if children > remaining {
                return Err(ScanError::Truncated { offset, needed: children - remaining });
            }
            if pending.len() > limits.max_depth {
                return Err(ScanError::TooDeep { offset, max: limits.max_depth });
            }
            pending.push(children);
        }
    }
    if pos != bytes.len() {
        return Err(ScanError::Trailing { count: bytes.len() - pos });
    }
    Ok(())
}

fn map_children(entries: usize, offset: usize, limits: &Limits) -> Result<usize, ScanError> {
    if entries > limits.max_collection_len {
        return Err(ScanError::CollectionTooLarge { offset, len: entries, max: limits.max_collection_len });
    }
    Ok(entries * 2)
}

fn read_len(bytes: &[u8], pos: &mut usize, width: usize) -> Result<usize, ScanError> {
    let raw = bytes.get(*pos..*pos + width).ok_or_else(|| ScanError::Truncated {
        offset: *pos,
        needed: (*pos + width).saturating_sub(bytes.len()),
    })?;
    *pos += width;
    Ok(raw.iter().fold(0usize, |acc, b| (acc << 8) | usize::from(*b)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const L: Limits = Limits { max_bytes: 1 << 20, max_depth: 8, max_collection_len: 1000 };

    fn enc(v: &rmpv::Value) -> Vec<u8> {
        let mut out = Vec::new();
        rmpv::encode::write_value(&mut out, v).expect("encode to vec");
        out
    }

    #[test]
    fn accepts_well_formed_values() {
        use rmpv::Value as V;
        let v = V::Map(vec![
            (V::from("a"), V::Array(vec![V::from(1), V::from(-3), V::from(1.5), V::Nil])),
            (V::from("b"), V::Binary(vec![0; 300])),
            (V::from("c"), V::Ext(3, vec![1, 2, 3])),
            (V::from("d"), V::from("x".repeat(70000))),
        ]);
        check(&enc(&v), &L).expect("well formed");
    }

    #[test]
    fn rejects_lying_lengths_without_allocating() {
        // array32 claiming 4 billion elements, 5 bytes long
        assert!(matches!(
            check(&[0xdd, 0xff, 0xff, 0xff, 0xff], &L),
            Err(ScanError::CollectionTooLarge { .. })
        ));
        // bin32 claiming 4 GiB
        assert!(matches!(check(&[0xc6, 0xff, 0xff, 0xff, 0xff, 0], &L), Err(ScanError::Truncated { .. })));
        // array of 3 with only 2 elements present
        assert!(matches!(check(&[0x93, 0x01, 0x02], &L), Err(ScanError::Truncated { .. })));
        assert!(matches!(check(&[0xc1], &L), Err(ScanError::Reserved { .. })));
        assert!(matches!(check(&[0x01, 0x02], &L), Err(ScanError::Trailing { count: 1 })));
        assert!(matches!(check(&[], &L), Err(ScanError::Truncated { .. })));
        assert!(matches!(check(&[0xcd, 0x01], &L), Err(ScanError::Truncated { .. })));
    }

    #[test]
    fn rejects_deep_nesting_and_oversized_input() {
        let deep = vec![0x91; 20].into_iter().chain([0x00]).collect::<Vec<u8>>();
        assert!(matches!(check(&deep, &L), Err(ScanError::TooDeep { .. })));
        let small = Limits { max_bytes: 4, ..L };
        assert!(matches!(check(&[0x94, 1, 2, 3, 4], &small), Err(ScanError::TooLarge { len: 5, max: 4 })));
    }
}
