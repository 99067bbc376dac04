//! BTF as this crate reads it: the `.BTF` section of the eBPF object, for
//! the rewrites done in place before the load (`btf_names`, `btf_wire`):
//! where it lies in the file and where its type and string sections lie in
//! it; and the walk of a type section's records, which the kernel's BTF
//! (`kernel_btf`) is read by too.

use std::ops::Range;

use object::{Object, ObjectSection};

pub const MAGIC: u16 = 0xeb9f;
pub const KIND_INT: u32 = 1;
pub const KIND_PTR: u32 = 2;
pub const KIND_ARRAY: u32 = 3;
pub const KIND_STRUCT: u32 = 4;
pub const KIND_UNION: u32 = 5;
pub const KIND_ENUM: u32 = 6;
pub const KIND_FWD: u32 = 7;
pub const KIND_TYPEDEF: u32 = 8;
pub const KIND_VOLATILE: u32 = 9;
pub const KIND_CONST: u32 = 10;
pub const KIND_RESTRICT: u32 = 11;
pub const KIND_FUNC: u32 = 12;
pub const KIND_FUNC_PROTO: u32 = 13;
pub const KIND_VAR: u32 = 14;
pub const KIND_DATASEC: u32 = 15;
pub const KIND_FLOAT: u32 = 16;
pub const KIND_DECL_TAG: u32 = 17;
pub const KIND_TYPE_TAG: u32 = 18;
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

/// One type of a type section, as its common header says.
pub struct RawType {
    /// Where its record starts in the type section.
    pub at: usize,
    pub name_off: u32,
    pub kind: u32,
    /// Kind flag set: for a struct, members with bitfields, whose offsets
    /// are encoded otherwise.
    pub kind_flag: bool,
    pub vlen: usize,
    pub size_or_type: u32,
    /// The size of each record that follows the header, and their number.
    pub record_size: usize,
    pub records: usize,
}

impl RawType {
    /// Where its `i`th record (member, enumerator...) starts.
    pub fn record_at(&self, i: usize) -> usize {
        self.at + 12 + i * self.record_size
    }
}

/// Why a type section could not be walked.
#[derive(Debug, thiserror::Error)]
pub enum WalkError {
    #[error("type {id} runs past the type section")]
    Past { id: usize },
    #[error("unknown kind {kind} at type {id}")]
    UnknownKind { kind: u32, id: usize },
}

/// Every type of the section `types`, in id order from 1; an error where
/// one runs past its end or is of a kind the walk cannot size.
pub fn walk(types: &[u8]) -> Result<Vec<RawType>, WalkError> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < types.len() {
        let id = out.len() + 1;
        let word = |off| u32_at(types, at + off).ok_or(WalkError::Past { id });
        let (name_off, info, size_or_type) = (word(0)?, word(4)?, word(8)?);
        let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
        #[expect(
            clippy::match_same_arms,
            reason = "one arm per BTF kind, as the kernel's documentation lists them"
        )]
        // INT, VAR, ARRAY and DECL_TAG carry one record whatever vlen says.
        let (record_size, records) = match kind {
            KIND_INT | KIND_VAR | KIND_DECL_TAG => (4, 1),
            KIND_ARRAY => (12, 1),
            KIND_STRUCT | KIND_UNION => (12, vlen),
            KIND_ENUM => (8, vlen),
            KIND_ENUM64 => (12, vlen),
            KIND_FUNC_PROTO => (8, vlen),
            KIND_DATASEC => (12, vlen),
            KIND_PTR | KIND_FWD | KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT
            | KIND_FUNC | KIND_FLOAT | KIND_TYPE_TAG => (0, 0),
            kind => return Err(WalkError::UnknownKind { kind, id }),
        };
        out.push(RawType {
            at,
            name_off,
            kind,
            kind_flag: info >> 31 == 1,
            vlen,
            size_or_type,
            record_size,
            records,
        });
        at += 12 + record_size * records;
    }
    if at != types.len() {
        return Err(WalkError::Past { id: out.len() });
    }
    Ok(out)
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
