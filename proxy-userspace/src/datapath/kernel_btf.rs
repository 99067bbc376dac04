//! The few facts the datapath needs from the running kernel's BTF
//! (`/sys/kernel/btf/vmlinux`): a kfunc's type id and where a struct field
//! sits. aya's BTF parser keeps types and struct members private to aya, so
//! this reads the format (the kernel's Documentation/bpf/btf.rst) itself, no
//! further than these two questions need.

use std::borrow::Cow;

use super::btf_section::{self, KIND_STRUCT, KIND_UNION, MAGIC};

pub const VMLINUX: &str = "/sys/kernel/btf/vmlinux";

const HEADER_LEN: usize = 24;
const TYPE_LEN: usize = 12;

/// BTF kinds (`BTF_KIND_*`) this module asks for or walks through.
pub mod kind {
    pub const INT: u8 = 1;
    pub const STRUCT: u8 = 4;
    pub const UNION: u8 = 5;
    pub const TYPEDEF: u8 = 8;
    pub const VOLATILE: u8 = 9;
    pub const CONST: u8 = 10;
    pub const RESTRICT: u8 = 11;
    pub const FUNC: u8 = 12;
    pub const TYPE_TAG: u8 = 18;
}

#[derive(Debug, thiserror::Error)]
pub enum BtfError {
    #[error("reading {path}: {source}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("malformed BTF: {0}")]
    Malformed(Cow<'static, str>),
    #[error("the kernel's BTF has no {what} named {name}")]
    NotFound { what: &'static str, name: String },
}

/// A parsed BTF blob: its type records, found by id, and its strings.
pub struct Btf {
    data: Vec<u8>,
    /// Byte offset in `data` of each type's record; type ids start at 1.
    types: Vec<usize>,
    strings: std::ops::Range<usize>,
}

/// A struct or union member, its place counted in bits from the start of
/// the outermost struct.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    pub bit_offset: u32,
    /// Width of a bitfield; 0 for a whole-type member.
    pub bits: u32,
}

fn malformed(what: impl Into<Cow<'static, str>>) -> BtfError {
    BtfError::Malformed(what.into())
}

impl Btf {
    /// The running kernel's BTF.
    pub fn vmlinux() -> Result<Self, BtfError> {
        let data = std::fs::read(VMLINUX).map_err(|source| BtfError::Read {
            path: VMLINUX.into(),
            source,
        })?;
        Self::parse(data)
    }

    /// Parses a raw, little-endian BTF blob.
    pub fn parse(data: Vec<u8>) -> Result<Self, BtfError> {
        let u16_at = |off: usize| {
            data.get(off..off + 2)
                .map(|b| u16::from_le_bytes([b[0], b[1]]))
        };
        if u16_at(0) != Some(MAGIC) {
            return Err(malformed("no BTF magic (or not little-endian)"));
        }
        if data[2] != 1 {
            return Err(malformed(format!("version {}, not 1", data[2])));
        }
        let header =
            |i: usize| read_u32(&data, 4 + 4 * i).ok_or_else(|| malformed("header cut short"));
        let hdr_len = header(0)? as usize;
        let (type_off, type_len) = (header(1)? as usize, header(2)? as usize);
        let (str_off, str_len) = (header(3)? as usize, header(4)? as usize);
        if hdr_len < HEADER_LEN {
            return Err(malformed(format!("header length {hdr_len}")));
        }
        let section = |off: usize, len: usize, what: &'static str| {
            let start = hdr_len.checked_add(off);
            let end = start.and_then(|s| s.checked_add(len));
            match (start, end) {
                (Some(start), Some(end)) if end <= data.len() => Ok(start..end),
                _ => Err(malformed(format!("{what} section runs past the end"))),
            }
        };
        let type_range = section(type_off, type_len, "type")?;
        let strings = section(str_off, str_len, "string")?;
        let mut types = vec![0]; // id 0 is void
        let walked =
            btf_section::walk(&data[type_range.clone()]).map_err(|e| malformed(e.to_string()))?;
        for t in walked {
            let at = type_range.start + t.at;
            // Names are checked once here, so lookups can trust them.
            let members = if matches!(t.kind, KIND_STRUCT | KIND_UNION) {
                t.records
            } else {
                0
            };
            let names = std::iter::once(t.at).chain((0..members).map(|i| t.record_at(i)));
            for name_at in names {
                match read_u32(&data, type_range.start + name_at) {
                    Some(off) if (off as usize) < strings.len() => {}
                    _ => {
                        return Err(malformed(format!(
                            "type {} names past the strings",
                            types.len()
                        )));
                    }
                }
            }
            types.push(at);
        }
        Ok(Self {
            data,
            types,
            strings,
        })
    }

    fn u32_at(&self, off: usize) -> u32 {
        // Records were bounds-checked in `parse`.
        read_u32(&self.data, off).expect("inside a checked record")
    }

    /// The string at `name_off` of the strings section, without its NUL
    /// (empty past the section's end): a type's name, or a line info
    /// record's file or source line.
    pub fn string(&self, name_off: u32) -> &[u8] {
        let strings = &self.data[self.strings.clone()];
        let rest = strings.get(name_off as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|b| *b == 0).unwrap_or(rest.len())]
    }

    fn kind(&self, id: u32) -> Option<(u8, usize)> {
        let at = *self.types.get(id as usize).filter(|_| id != 0)?;
        Some((((self.u32_at(at + 4) >> 24) & 0x1f) as u8, at))
    }

    /// The id of the type of kind `kind` named `name`.
    pub fn id_of(&self, kind: u8, name: &str) -> Result<u32, BtfError> {
        (1..self.types.len() as u32)
            .find(|&id| {
                let at = self.types[id as usize];
                self.kind(id).map(|(k, _)| k) == Some(kind)
                    && self.string(self.u32_at(at)) == name.as_bytes()
            })
            .ok_or_else(|| BtfError::NotFound {
                what: match kind {
                    kind::FUNC => "function",
                    kind::STRUCT => "struct",
                    _ => "type",
                },
                name: name.into(),
            })
    }

    /// Where `member` sits in `struct name`, looking into anonymous struct and
    /// union members (the kernel groups `sk_buff`'s fields in those).
    pub fn field(&self, name: &str, member: &str) -> Result<Field, BtfError> {
        let id = self.id_of(kind::STRUCT, name)?;
        self.find_member(id, member.as_bytes(), 0, 0)
            .ok_or_else(|| BtfError::NotFound {
                what: "member",
                name: format!("{name}.{member}"),
            })
    }

    /// `id` with typedefs and qualifiers skipped, as the kernel's own walk
    /// does (`btf_type_skip_modifiers`).
    fn skip_modifiers(&self, mut id: u32) -> u32 {
        for _ in 0..16 {
            match self.kind(id) {
                Some((
                    kind::TYPEDEF | kind::VOLATILE | kind::CONST | kind::RESTRICT | kind::TYPE_TAG,
                    at,
                )) => id = self.u32_at(at + 8),
                _ => break,
            }
        }
        id
    }

    fn find_member(&self, id: u32, member: &[u8], base: u32, depth: u8) -> Option<Field> {
        let (k, at) = self.kind(self.skip_modifiers(id))?;
        if !(k == kind::STRUCT || k == kind::UNION) || depth > 8 {
            return None;
        }
        let info = self.u32_at(at + 4);
        let bitfields = info >> 31 == 1;
        for i in 0..(info & 0xffff) as usize {
            let m = at + TYPE_LEN + 12 * i;
            let (name_off, ty, offset) = (self.u32_at(m), self.u32_at(m + 4), self.u32_at(m + 8));
            // With kind_flag set, the top byte is the bitfield's width.
            let (bit_offset, bits) = if bitfields {
                (offset & 0xff_ffff, offset >> 24)
            } else {
                (offset, 0)
            };
            let name = self.string(name_off);
            if name == member {
                return Some(Field {
                    bit_offset: base + bit_offset,
                    bits,
                });
            }
            if name.is_empty()
                && let Some(found) = self.find_member(ty, member, base + bit_offset, depth + 1)
            {
                return Some(found);
            }
        }
        None
    }
}

fn read_u32(data: &[u8], off: usize) -> Option<u32> {
    data.get(off..off + 4)
        .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob built by hand: `int`, `struct inner { u8 :5; u8 flag:2 }`
    /// reached through an anonymous union inside `struct outer` at byte 8,
    /// and a function `f`.
    fn sample() -> Vec<u8> {
        let strings = b"\0int\0outer\0inner\0flag\0other\0f\0";
        let s = |name: &str| {
            let needle = [name.as_bytes(), b"\0"].concat();
            strings
                .windows(needle.len())
                .position(|w| w == needle.as_slice() && !name.is_empty())
                .unwrap() as u32
        };
        let info = |kind: u32, vlen: u32, flag: bool| u32::from(flag) << 31 | kind << 24 | vlen;
        let mut types: Vec<u32> = Vec::new();
        // 1: int, 1 byte
        types.extend([s("int"), info(1, 0, false), 1, 8]);
        // 2: struct inner (bitfields): other at bit 0 width 5, flag at bit 5 width 2
        types.extend([s("inner"), info(4, 2, true), 1]);
        types.extend([s("other"), 1, 5 << 24]);
        types.extend([s("flag"), 1, 2 << 24 | 5]);
        // 3: anonymous union { struct inner; }
        types.extend([0, info(5, 1, false), 1, 0, 2, 0]);
        // 4: struct outer { int other; <anonymous const union> at bit 64 }
        types.extend([s("outer"), info(4, 2, false), 16]);
        types.extend([s("other"), 1, 0, 0, 6, 64]);
        // 5: func f
        types.extend([s("f"), info(12, 0, false), 0]);
        // 6: const <3>, which the walk looks through
        types.extend([0, info(10, 0, false), 3]);
        let type_bytes: Vec<u8> = types.iter().flat_map(|w| w.to_le_bytes()).collect();
        let mut blob = Vec::new();
        blob.extend(MAGIC.to_le_bytes());
        blob.extend([1u8, 0]);
        for w in [
            HEADER_LEN as u32,
            0,
            type_bytes.len() as u32,
            type_bytes.len() as u32,
            strings.len() as u32,
        ] {
            blob.extend(w.to_le_bytes());
        }
        blob.extend(type_bytes);
        blob.extend(strings);
        blob
    }

    #[test]
    fn finds_a_bitfield_inside_anonymous_members_and_a_function() {
        let btf = Btf::parse(sample()).expect("parse");
        assert_eq!(btf.id_of(kind::FUNC, "f").expect("f"), 5);
        assert_eq!(
            btf.field("outer", "flag").expect("flag"),
            Field {
                bit_offset: 64 + 5,
                bits: 2
            }
        );
        // The outer struct's own member comes first.
        assert_eq!(
            btf.field("outer", "other").expect("other"),
            Field {
                bit_offset: 0,
                bits: 0
            }
        );
    }

    #[test]
    fn missing_names_and_damaged_blobs_are_named() {
        let btf = Btf::parse(sample()).expect("parse");
        let e = btf.field("outer", "nope").unwrap_err().to_string();
        assert!(e.contains("member named outer.nope"), "{e}");
        let e = btf.id_of(kind::FUNC, "g").unwrap_err().to_string();
        assert!(e.contains("function named g"), "{e}");
        let mut cut = sample();
        cut.truncate(cut.len() - 40);
        let e = Btf::parse(cut)
            .err()
            .expect("a cut blob must not parse")
            .to_string();
        assert!(e.contains("runs past the end"), "{e}");
        let e = Btf::parse(vec![0; 8]).err().expect("no magic").to_string();
        assert!(e.contains("no BTF magic"), "{e}");
    }

    /// The running kernel's `sk_buff.ip_summed`: two bits inside one byte,
    /// and the kfunc the datapath calls, at the id `bpftool` reports.
    #[test]
    fn reads_the_running_kernels_btf() {
        let btf = Btf::vmlinux().expect("this machine's kernel has BTF");
        let f = btf
            .field("sk_buff", "ip_summed")
            .expect("sk_buff.ip_summed");
        assert_eq!(f.bits, 2, "{f:?}");
        assert_eq!(
            f.bit_offset / 8,
            (f.bit_offset + 1) / 8,
            "{f:?} spans two bytes"
        );
        let id = btf
            .id_of(kind::FUNC, "bpf_cast_to_kern_ctx")
            .expect("kfunc");
        let dump = std::process::Command::new("bpftool")
            .args(["btf", "dump", "file", VMLINUX])
            .output()
            .expect("bpftool");
        let dump = String::from_utf8_lossy(&dump.stdout);
        let line = dump
            .lines()
            .find(|l| l.contains("FUNC 'bpf_cast_to_kern_ctx'"))
            .expect("bpftool lists the kfunc");
        assert!(
            line.starts_with(&format!("[{id}] ")),
            "ours {id}, bpftool: {line}"
        );
    }
}
