//! Makes the object's BTF type names acceptable to the kernel. The linker
//! spells Rust's generic struct names as identifiers (`Global_3C_u8_3E_`)
//! but leaves generic unions as Rust writes them (`MaybeUninit<u8>`, from
//! aya-log's level global), and the kernel refuses the whole BTF for one
//! such name. Each byte that is not an identifier's becomes `_`, in place:
//! no offset moves, and only names change.

use super::btf_section::{
    self, KIND_ENUM, KIND_ENUM64, KIND_FWD, KIND_STRUCT, KIND_TYPEDEF, KIND_UNION,
};

#[derive(Debug, thiserror::Error)]
pub enum BtfNamesError {
    #[error("reading the eBPF object: {0}")]
    Object(#[from] object::Error),
    #[error("the object's BTF is malformed: {0}")]
    Malformed(&'static str),
    #[error("the object's BTF is malformed: {0}")]
    Walk(#[from] btf_section::WalkError),
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
    // Name offsets of the identifiers to check, collected first: the type
    // section is only read, the string section only written.
    let types = &btf[layout.types];
    let mut names = Vec::new();
    for t in btf_section::walk(types)? {
        if matches!(
            t.kind,
            KIND_STRUCT | KIND_UNION | KIND_ENUM | KIND_ENUM64 | KIND_FWD | KIND_TYPEDEF
        ) {
            names.push(t.name_off);
        }
        if matches!(t.kind, KIND_STRUCT | KIND_UNION | KIND_ENUM | KIND_ENUM64) {
            for i in 0..t.records {
                names.push(u32_at(types, t.record_at(i))?);
            }
        }
    }
    let strings = &mut btf[layout.strings];
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
    use crate::datapath::btf_section::{KIND_INT, KIND_STRUCT, KIND_VAR, blob};

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
