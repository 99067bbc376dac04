//! Retypes, in the object's BTF alone, the fields `bpftool map dump`
//! would print as numbers of the machine's byte order: each struct field
//! named `*_be` becomes the bytes it holds, in network order, and each
//! `proto`, `dir` and `scope` (one byte) an enum of its values' names,
//! and each text field (`namespace`, `name`...) an array of `char`, which
//! bpftool prints as a string (`proxy_common::WireView`, whose own fields
//! give the types to retype to). A field keeps its size and offset, and
//! the code reads memory as declared: only what bpftool prints changes
//! (docs/maps.md, "Reading the maps").

use super::btf_section::{self, KIND_ARRAY, KIND_INT, KIND_STRUCT};

#[derive(Debug, thiserror::Error)]
pub enum BtfWireError {
    #[error("reading the eBPF object: {0}")]
    Object(#[from] object::Error),
    #[error("the object's BTF is malformed: {0}")]
    Malformed(&'static str),
    #[error("the object's BTF is malformed: {0}")]
    Walk(#[from] btf_section::WalkError),
    #[error("the object's BTF has no struct WireView with field {0}")]
    NoView(&'static str),
}

/// The struct whose fields name the types to retype to.
const VIEW: &str = "WireView";
/// The one-byte fields shown as an enum, each `WireView`'s field's.
const NAMED: [&str; 3] = ["proto", "dir", "scope"];
/// The byte arrays shown as strings: text, NUL padded.
const TEXT: [&str; 5] = ["namespace", "name", "port_name", "reason", "text"];
/// `WireView`'s arrays of `char`, by length.
const TEXT_VIEWS: [(u32, &str); 4] = [
    (16, "text16"),
    (32, "text32"),
    (64, "text64"),
    (256, "text256"),
];

/// What a type is, as far as retyping asks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Shape {
    /// An integer of this many bytes.
    Int(u32),
    /// An array of `n` elements of type `elem`.
    Array {
        elem: u32,
        n: u32,
    },
    Struct,
    Other,
}

/// One type of the section: where its record starts, and its shape.
struct Type {
    at: usize,
    name_off: u32,
    shape: Shape,
    /// Kind flag set: a struct with bitfields, whose member offsets are
    /// encoded otherwise; left alone.
    kind_flag: bool,
    members: usize,
}

/// Retypes `object`'s `.BTF` section in place. Returns how many fields
/// were retyped.
pub fn retype(object: &mut [u8]) -> Result<usize, BtfWireError> {
    let Some(range) = btf_section::range(object)? else {
        return Ok(0);
    };
    let btf = object
        .get_mut(range)
        .ok_or(BtfWireError::Malformed(".BTF lies outside the file"))?;
    retype_btf(btf)
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, BtfWireError> {
    btf_section::u32_at(b, at).ok_or(BtfWireError::Malformed("a type runs past the type section"))
}

fn name_at(strings: &[u8], off: u32) -> Result<&[u8], BtfWireError> {
    let name = strings
        .get(off as usize..)
        .ok_or(BtfWireError::Malformed("a name past the string section"))?;
    Ok(&name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())])
}

/// Every type of the section, by id (id 0, `void`, first).
fn types(section: &[u8]) -> Result<Vec<Type>, BtfWireError> {
    let void = Type {
        at: 0,
        name_off: 0,
        shape: Shape::Other,
        kind_flag: false,
        members: 0,
    };
    let mut out = vec![void];
    for t in btf_section::walk(section)? {
        let shape = match t.kind {
            KIND_INT => Shape::Int(t.size_or_type),
            KIND_ARRAY => Shape::Array {
                elem: u32_at(section, t.record_at(0))?,
                n: u32_at(section, t.record_at(0) + 8)?,
            },
            KIND_STRUCT => Shape::Struct,
            _ => Shape::Other,
        };
        out.push(Type {
            at: t.at,
            name_off: t.name_off,
            shape,
            kind_flag: t.kind_flag,
            members: if t.kind == KIND_STRUCT { t.vlen } else { 0 },
        });
    }
    Ok(out)
}

/// The type and string sections, read.
struct Section<'a> {
    strings: &'a [u8],
    types: &'a [u8],
    all: Vec<Type>,
}

impl<'a> Section<'a> {
    /// Member `i` of struct `t`: its name, its type, and where its type id
    /// is in the type section.
    fn member(&self, t: &Type, i: usize) -> Result<(&'a [u8], u32, usize), BtfWireError> {
        let at = t.at + 12 + i * 12;
        Ok((
            name_at(self.strings, u32_at(self.types, at)?)?,
            u32_at(self.types, at + 4)?,
            at + 4,
        ))
    }

    fn shape(&self, id: u32) -> Shape {
        self.all.get(id as usize).map_or(Shape::Other, |t| t.shape)
    }
}

/// What `WireView` gives to retype to.
struct Targets {
    /// Its index in `Section::all`.
    view: usize,
    bytes16: u32,
    bytes4: u32,
    bytes2: u32,
    /// One-byte fields shown by name: the view's field of the same name
    /// gives the enum.
    named: Vec<(&'static [u8], u32)>,
    /// Arrays of `char`, by length.
    texts: Vec<(u32, u32)>,
    /// The view's `char` field's name (the one string of the section that
    /// says `char`), and where its type's name offset is.
    char_name: u32,
    char_at: usize,
}

fn targets(sec: &Section<'_>) -> Result<Targets, BtfWireError> {
    let view = sec
        .all
        .iter()
        .position(|t| {
            t.shape == Shape::Struct
                && name_at(sec.strings, t.name_off).ok() == Some(VIEW.as_bytes())
        })
        .ok_or(BtfWireError::NoView("(any)"))?;
    let field = |field: &'static str| -> Result<(u32, usize), BtfWireError> {
        let t = &sec.all[view];
        (0..t.members)
            .map(|i| sec.member(t, i))
            .find(|m| {
                m.as_ref()
                    .is_ok_and(|(name, _, _)| *name == field.as_bytes())
            })
            .ok_or(BtfWireError::NoView(field))?
            .map(|(_, ty, at)| (ty, at))
    };
    let ty = |name| field(name).map(|(ty, _)| ty);
    let mut named = Vec::new();
    for name in NAMED {
        named.push((name.as_bytes(), ty(name)?));
    }
    let mut texts = Vec::new();
    for (n, name) in TEXT_VIEWS {
        texts.push((n, ty(name)?));
    }
    let (char_type, char_member_at) = field("char")?;
    let char_at = sec
        .all
        .get(char_type as usize)
        .filter(|t| t.shape == Shape::Int(1))
        .map(|t| t.at)
        .ok_or(BtfWireError::NoView("char, an integer of one byte"))?;
    Ok(Targets {
        view,
        bytes16: ty("bytes16")?,
        bytes4: ty("bytes4")?,
        bytes2: ty("bytes2")?,
        named,
        texts,
        char_name: u32_at(sec.types, char_member_at - 4)?,
        char_at,
    })
}

/// The type a member `name` of type `ty` is retyped to, if any.
fn target_of(sec: &Section<'_>, to: &Targets, name: &[u8], ty: u32) -> Option<u32> {
    if name.ends_with(b"_be") {
        match sec.shape(ty) {
            Shape::Int(4) => Some(to.bytes4),
            Shape::Int(2) => Some(to.bytes2),
            Shape::Array { elem, n: 4 } if sec.shape(elem) == Shape::Int(4) => Some(to.bytes16),
            _ => None,
        }
    } else if sec.shape(ty) == Shape::Int(1) {
        to.named.iter().find(|(n, _)| *n == name).map(|(_, t)| *t)
    } else if let Shape::Array { elem, n } = sec.shape(ty)
        && sec.shape(elem) == Shape::Int(1)
        && TEXT.iter().any(|t| t.as_bytes() == name)
    {
        to.texts.iter().find(|(len, _)| *len == n).map(|(_, t)| *t)
    } else {
        None
    }
}

/// `retype` on the `.BTF` section's bytes.
fn retype_btf(btf: &mut [u8]) -> Result<usize, BtfWireError> {
    let layout = btf_section::layout(btf).map_err(BtfWireError::Malformed)?;
    let types_at = layout.types.start;
    let section = &btf[layout.types.clone()];
    let sec = Section {
        strings: &btf[layout.strings],
        types: section,
        all: types(section)?,
    };
    let to = targets(&sec)?;

    // Where each retyped member's type id is, and its new one: gathered
    // first, so that a malformed section changes nothing.
    let mut patches = Vec::new();
    for (index, t) in sec.all.iter().enumerate() {
        if t.shape != Shape::Struct || t.kind_flag || index == to.view {
            continue;
        }
        for i in 0..t.members {
            let (name, ty, ty_at) = sec.member(t, i)?;
            if let Some(new) = target_of(&sec, &to, name, ty)
                && new != ty
            {
                patches.push((types_at + ty_at, new));
            }
        }
    }
    let retyped = patches.len();
    patches.push((types_at + to.char_at, to.char_name));
    for (at, value) in &patches {
        btf[*at..*at + 4].copy_from_slice(&value.to_le_bytes());
    }
    Ok(retyped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::btf_section::{KIND_ENUM, blob};

    /// The type id of member `i` of the struct whose record starts at word
    /// `word` of `types`.
    fn member_type(b: &[u8], word: usize, i: usize) -> u32 {
        let at = 24 + (word + 3 + i * 3 + 1) * 4;
        u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
    }

    #[test]
    fn be_fields_become_bytes_proto_its_enum_names_strings_and_nothing_else_moves() {
        let s = b"\0u32\0u16\0u8\0WireView\0bytes16\0bytes4\0bytes2\0proto\0dir\0scope\0char\0text16\0text32\0text64\0text256\0Key\0addr_be\0port_be\0seq\0IpProtocol\0TCP\0a4\0name\0i8\0";
        let off = |name: &[u8]| -> u32 {
            s.windows(name.len() + 2)
                .position(|w| w[0] == 0 && &w[1..=name.len()] == name && w[name.len() + 1] == 0)
                .map(|p| p as u32 + 1)
                .expect("a name of the table")
        };
        #[rustfmt::skip]
        let types = [
            // [1] u32, [2] u16, [3] u8.
            off(b"u32"), KIND_INT << 24, 4, 32,
            off(b"u16"), KIND_INT << 24, 2, 16,
            off(b"u8"), KIND_INT << 24, 1, 8,
            // [4] [u32; 4], [5] [u8; 16], [6] [u8; 4], [7] [u8; 2].
            0, KIND_ARRAY << 24, 0, 1, 1, 4,
            0, KIND_ARRAY << 24, 0, 3, 1, 16,
            0, KIND_ARRAY << 24, 0, 3, 1, 4,
            0, KIND_ARRAY << 24, 0, 3, 1, 2,
            // [8] enum IpProtocol, size 1: TCP = 6.
            off(b"IpProtocol"), (KIND_ENUM << 24) | 1, 1, off(b"TCP"), 6,
            // [9] struct WireView (word 41); dir and scope as the enum
            // too, which is all this test needs of them.
            off(b"WireView"), (KIND_STRUCT << 24) | 0xb, 400,
            off(b"bytes16"), 5, 0,
            off(b"bytes4"), 6, 128,
            off(b"bytes2"), 7, 160,
            off(b"proto"), 8, 176,
            off(b"dir"), 8, 184,
            off(b"scope"), 8, 192,
            off(b"char"), 11, 200,
            off(b"text16"), 12, 208,
            off(b"text32"), 13, 336,
            off(b"text64"), 14, 592,
            off(b"text256"), 15, 1104,
            // [10] struct Key (word 77): addr_be [u32; 4], port_be u16,
            // proto u8, seq u32, a4 (not _be) u32, name [u8; 16].
            off(b"Key"), (KIND_STRUCT << 24) | 6, 44,
            off(b"addr_be"), 4, 0,
            off(b"port_be"), 2, 128,
            off(b"proto"), 3, 144,
            off(b"seq"), 1, 160,
            off(b"a4"), 1, 192,
            off(b"name"), 5, 224,
            // [11] i8 (word 98), [12..15] [i8; 16, 32, 64, 256].
            off(b"i8"), KIND_INT << 24, 1, (1 << 24) | 8,
            0, KIND_ARRAY << 24, 0, 11, 1, 16,
            0, KIND_ARRAY << 24, 0, 11, 1, 32,
            0, KIND_ARRAY << 24, 0, 11, 1, 64,
            0, KIND_ARRAY << 24, 0, 11, 1, 256,
        ];
        let mut b = blob(&types, s);
        let before = b.clone();
        assert_eq!(retype_btf(&mut b).expect("valid BTF"), 4);
        assert_eq!(
            (0..6).map(|i| member_type(&b, 77, i)).collect::<Vec<_>>(),
            [5, 7, 8, 1, 1, 12],
            "addr_be as [u8; 16], port_be as [u8; 2], proto as the enum, name as [char; 16], \
             the rest as they were"
        );
        assert_eq!(
            (0..11).map(|i| member_type(&b, 41, i)).collect::<Vec<_>>(),
            [5, 6, 7, 8, 8, 8, 11, 12, 13, 14, 15],
            "WireView itself is left alone"
        );
        let name_at = 24 + 98 * 4;
        assert_eq!(
            u32::from_le_bytes(b[name_at..name_at + 4].try_into().expect("4 bytes")),
            off(b"char"),
            "i8 is named char"
        );
        let changed: Vec<usize> = (0..b.len()).filter(|&i| b[i] != before[i]).collect();
        assert!(
            changed
                .iter()
                .all(|&i| (24 + 77 * 4..24 + 98 * 4).contains(&i)
                    || (name_at..name_at + 4).contains(&i)),
            "bytes changed outside Key's members and i8's name: {changed:?}"
        );
        assert_eq!(retype_btf(&mut b).expect("valid BTF"), 0, "idempotent");
    }

    #[test]
    fn without_the_view_or_with_malformed_btf_nothing_changes() {
        let mut b = blob(&[1, KIND_INT << 24, 4, 32], b"\0u32\0");
        let before = b.clone();
        assert!(matches!(retype_btf(&mut b), Err(BtfWireError::NoView(_))));
        assert_eq!(b, before);
        assert!(retype_btf(&mut [0u8; 8]).is_err());
        let mut truncated = blob(&[1, KIND_STRUCT << 24 | 3, 4], b"\0x\0");
        assert!(retype_btf(&mut truncated).is_err());
    }
}
