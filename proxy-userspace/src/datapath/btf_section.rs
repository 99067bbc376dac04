//! The `.BTF` section of the eBPF object, read for the rewrites done in
//! place before the load (`btf_names`, `btf_wire`): where it lies in the
//! file, and where its type and string sections lie in it.

use std::ops::Range;

use object::{Object, ObjectSection};

pub const MAGIC: u16 = 0xeb9f;
pub const KIND_INT: u32 = 1;
pub const KIND_ARRAY: u32 = 3;
pub const KIND_STRUCT: u32 = 4;
pub const KIND_UNION: u32 = 5;
pub const KIND_ENUM: u32 = 6;
pub const KIND_FWD: u32 = 7;
pub const KIND_TYPEDEF: u32 = 8;
pub const KIND_FUNC_PROTO: u32 = 13;
pub const KIND_VAR: u32 = 14;
pub const KIND_DATASEC: u32 = 15;
pub const KIND_DECL_TAG: u32 = 17;
pub const KIND_ENUM64: u32 = 19;

/// Where the `.BTF` section lies in `object`; None where it has none.
pub fn range(object: &[u8]) -> Result<Option<Range<usize>>, object::Error> {
    let file = object::File::parse(object)?;
    Ok(file
        .section_by_name(".BTF")
        .and_then(|s| s.file_range())
        .map(|(start, size)| start as usize..(start + size) as usize))
}

/// The little-endian word at `at` of `b`, if `b` has it.
pub fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    b.get(at..at + 4)
        .map(|s| u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
}

/// Where a BTF blob's type and string sections lie in it.
pub struct Layout {
    pub types: Range<usize>,
    pub strings: Range<usize>,
}

/// The layout of `btf`, or what is wrong with its header.
pub fn layout(btf: &[u8]) -> Result<Layout, &'static str> {
    if btf.len() < 24 || u16::from_le_bytes([btf[0], btf[1]]) != MAGIC {
        return Err("no BTF header");
    }
    let word = |at| u32_at(btf, at).map(|w| w as usize).ok_or("no BTF header");
    let hdr_len = word(4)?;
    let (type_off, type_len) = (word(8)?, word(12)?);
    let (str_off, str_len) = (word(16)?, word(20)?);
    let types = hdr_len + type_off..hdr_len + type_off + type_len;
    let strings = hdr_len + str_off..hdr_len + str_off + str_len;
    if types.end > btf.len() || strings.end > btf.len() {
        return Err("sections past the end");
    }
    Ok(Layout { types, strings })
}

/// A BTF blob for tests: a header, then `types`, then `strings`.
#[cfg(test)]
pub fn blob(types: &[u32], strings: &[u8]) -> Vec<u8> {
    let type_len = (types.len() * 4) as u32;
    let mut b = Vec::new();
    b.extend_from_slice(&MAGIC.to_le_bytes());
    b.extend_from_slice(&[1, 0]);
    for v in [24u32, 0, type_len, type_len, strings.len() as u32] {
        b.extend_from_slice(&v.to_le_bytes());
    }
    for t in types {
        b.extend_from_slice(&t.to_le_bytes());
    }
    b.extend_from_slice(strings);
    b
}
