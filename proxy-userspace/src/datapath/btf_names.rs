//! Makes the object's BTF type names acceptable to the kernel. The linker
//! spells Rust's generic struct names as identifiers (`Global_3C_u8_3E_`)
//! but leaves generic unions as Rust writes them (`MaybeUninit<u8>`, from
//! aya-log's level global), and the kernel refuses the whole BTF for one
//! such name. Each byte that is not an identifier's becomes `_`, in place:
//! no offset moves, and only names change.

use super::btf_section::{
    self, KIND_ARRAY, KIND_DATASEC, KIND_DECL_TAG, KIND_ENUM, KIND_ENUM64, KIND_FUNC_PROTO,
    KIND_FWD, KIND_INT, KIND_STRUCT, KIND_TYPEDEF, KIND_UNION, KIND_VAR,
};

#[derive(Debug, thiserror::Error)]
pub enum BtfNamesError {
    #[error("reading the eBPF object: {0}")]
    Object(#[from] object::Error),
    #[error("the object's BTF is malformed: {0}")]
    Malformed(&'static str),
}

/// Rewrites the invalid type and member names in `object`'s `.BTF`
/// section. Returns how many names were changed.
pub fn sanitize(object: &mut [u8]) -> Result<usize, BtfNamesError> {
    let Some(range) = btf_section::range(object)? else {
        return Ok(0);
    };
    let btf = object
        .get_mut(range)
        .ok_or(BtfNamesError::Malformed(".BTF lies outside the file"))?;
    sanitize_btf(btf)
}

fn u32_at(b: &[u8], at: usize) -> Result<u32, BtfNamesError> {
    btf_section::u32_at(b, at).ok_or(BtfNamesError::Malformed(
        "a type runs past the type section",
    ))
}

/// `sanitize` on the `.BTF` section's bytes.
fn sanitize_btf(btf: &mut [u8]) -> Result<usize, BtfNamesError> {
    let layout = btf_section::layout(btf).map_err(BtfNamesError::Malformed)?;
    let (types_at, type_len) = (layout.types.start, layout.types.len());
    let (strings_at, str_len) = (layout.strings.start, layout.strings.len());
    // Name offsets of the identifiers to check, collected first: the type
    // section is only read, the string section only written.
    let mut names = Vec::new();
    let types = &btf[types_at..types_at + type_len];
    let mut at = 0;
    while at < types.len() {
        let name_off = u32_at(types, at)?;
        let info = u32_at(types, at + 4)?;
        let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
        at += 12;
        #[expect(
            clippy::match_same_arms,
            reason = "one arm per BTF kind, as the kernel's documentation lists them"
        )]
        let (member_size, name_members) = match kind {
            KIND_INT | KIND_VAR | KIND_DECL_TAG => (4, false),
            KIND_ARRAY => (12, false),
            KIND_STRUCT | KIND_UNION => (12, true),
            KIND_ENUM => (8, true),
            KIND_ENUM64 => (12, true),
            KIND_FUNC_PROTO => (8, false),
            KIND_DATASEC => (12, false),
            _ => (0, false),
        };
        if matches!(
            kind,
            KIND_STRUCT | KIND_UNION | KIND_ENUM | KIND_ENUM64 | KIND_FWD | KIND_TYPEDEF
        ) {
            names.push(name_off);
        }
        // INT, VAR, ARRAY and DECL_TAG carry one record whatever vlen says.
        let records = match kind {
            KIND_INT | KIND_VAR | KIND_ARRAY | KIND_DECL_TAG => 1,
            _ => vlen,
        };
        for i in 0..records {
            if name_members {
                names.push(u32_at(types, at + i * member_size)?);
            }
        }
        at += records * member_size;
    }
    let strings = &mut btf[strings_at..strings_at + str_len];
    let mut changed = 0;
    for off in names {
        let Some(name) = strings.get_mut(off as usize..) else {
            return Err(BtfNamesError::Malformed("a name past the string section"));
        };
        let end = name.iter().position(|&b| b == 0).unwrap_or(name.len());
        let mut renamed = false;
        for b in &mut name[..end] {
            if !(b.is_ascii_alphanumeric() || *b == b'_') {
                *b = b'_';
                renamed = true;
            }
        }
        changed += usize::from(renamed);
    }
    Ok(changed)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::btf_section::{KIND_INT, KIND_STRUCT, blob};

    #[test]
    fn generic_union_names_become_identifiers_and_nothing_else_moves() {
        // "\0MaybeUninit<u8>\0value\0u8\0a<b\0"
        let strings = b"\0MaybeUninit<u8>\0value\0u8\0a<b\0";
        let types = [
            // [1] INT "u8" size 1, then its encoding word.
            23,
            KIND_INT << 24,
            1,
            8,
            // [2] UNION "MaybeUninit<u8>" size 1, one member "value" of [1].
            1,
            (KIND_UNION << 24) | 1,
            1,
            17,
            1,
            0,
            // [3] VAR "a<b" (not an identifier the kernel checks here).
            26,
            KIND_VAR << 24,
            1,
            1,
        ];
        let mut b = blob(&types, strings);
        let before = b.clone();
        assert_eq!(sanitize_btf(&mut b).expect("valid BTF"), 1);
        let tail = &b[24 + types.len() * 4..];
        assert_eq!(tail, b"\0MaybeUninit_u8_\0value\0u8\0a<b\0");
        assert_eq!(
            b[..24 + types.len() * 4],
            before[..24 + types.len() * 4],
            "only strings change"
        );
        assert_eq!(sanitize_btf(&mut b).expect("valid BTF"), 0, "idempotent");
    }

    #[test]
    fn malformed_btf_is_an_error_not_a_panic() {
        assert!(sanitize_btf(&mut [0u8; 8]).is_err());
        let mut truncated = blob(&[1, KIND_STRUCT << 24 | 3, 4], b"\0x\0");
        assert!(sanitize_btf(&mut truncated).is_err());
    }
}
