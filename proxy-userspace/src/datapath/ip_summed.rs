//! Completes the programs' reads of `skb->ip_summed` before the object is
//! loaded (the sequence and why it exists: `proxy_common::ip_summed`): the
//! kfunc's id and the field's place come from the running kernel's BTF.
//! Where the kernel lacks either, the reads are turned into "unknown" and tc
//! keeps updating L4 checksums through the kernel's helper: correct, and
//! some 20-40 ns a translated packet slower.

use object::{Object, ObjectSection, SectionKind};
use proxy_common::ip_summed::{CALL_MAGIC, LEN, LOAD_AT, SHIFT_AT, UNKNOWN};

use super::kernel_btf::{self, Btf, BtfError, Field};

const KFUNC: &str = "bpf_cast_to_kern_ctx";
pub(super) const INSN: usize = 8;

/// The opcodes of the sequence (include/uapi/linux/bpf.h: class | op | source).
pub(super) mod op {
    /// `BPF_JMP` | `BPF_CALL`
    pub const CALL: u8 = 0x85;
    /// `BPF_JMP` | `BPF_JEQ` | `BPF_K`
    pub const JEQ_IMM: u8 = 0x15;
    /// `BPF_LDX` | `BPF_MEM` | `BPF_B`
    pub const LOAD_BYTE: u8 = 0x71;
    /// `BPF_ALU64` | `BPF_RSH` | `BPF_K`
    pub const RSH_IMM: u8 = 0x77;
    /// `BPF_ALU64` | `BPF_AND` | `BPF_K`
    pub const AND_IMM: u8 = 0x57;
    /// `BPF_JMP` | `BPF_JA`
    pub const JA: u8 = 0x05;
    /// `BPF_ALU64` | `BPF_MOV` | `BPF_K`
    pub const MOV_IMM: u8 = 0xb7;
    /// `src_reg` of a call whose immediate is a kfunc's BTF id.
    pub const PSEUDO_KFUNC_CALL: u8 = 2;
}

/// How the reads are completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    /// Through the kfunc with BTF id `kfunc`: bits `shift..shift+2` of
    /// byte `byte` of `struct sk_buff`.
    Kfunc { kfunc: u32, byte: i16, shift: i32 },
    /// Not read: every read yields `UNKNOWN`.
    Unknown,
}

impl std::fmt::Display for Read {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Read::Kfunc { kfunc, byte, shift } => write!(
                f,
                "read through {KFUNC} (BTF id {kfunc}): sk_buff byte {byte}, bits {shift}-{}",
                shift + 1
            ),
            Read::Unknown => f.write_str("not read: every L4 checksum goes through the helper"),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error(transparent)]
    Btf(#[from] BtfError),
    #[error("sk_buff.ip_summed is {0:?} in this kernel, not two bits inside one byte")]
    Layout(Field),
}

#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error("the eBPF object is not a readable ELF file: {0}")]
    Elf(#[from] object::Error),
    #[error("section {section} lies outside the eBPF object")]
    Section { section: String },
    #[error(
        "section {section}, instruction {index}: an ip_summed read is not the sequence proxy_common::ip_summed describes"
    )]
    Sequence { section: String, index: usize },
    #[error("the eBPF object has no ip_summed read: it was built from other sources")]
    NoRead,
}

impl Read {
    /// What the running kernel allows, or why it allows nothing (the
    /// kfunc is Linux 6.2's).
    pub fn for_this_kernel() -> Result<Read, ReadError> {
        Self::from_btf(&Btf::vmlinux()?)
    }

    pub fn from_btf(btf: &Btf) -> Result<Read, ReadError> {
        let kfunc = btf.id_of(kernel_btf::kind::FUNC, KFUNC)?;
        let field = btf.field("sk_buff", "ip_summed")?;
        let (byte, shift) = (field.bit_offset / 8, field.bit_offset % 8);
        if field.bits != 2 || shift + field.bits > 8 || byte > i16::MAX as u32 {
            return Err(ReadError::Layout(field));
        }
        Ok(Read::Kfunc {
            kfunc,
            byte: byte as i16,
            shift: shift as i32,
        })
    }
}

/// `object` with every `ip_summed` read completed as `read` says, and how many
/// there were. The copy is 8-byte aligned, as the ELF parser wants.
pub fn complete(object: &[u8], read: Read) -> Result<(AlignedObject, usize), PatchError> {
    let mut out = AlignedObject::copy_of(object);
    let found = complete_each(
        out.bytes_mut(),
        call(0, CALL_MAGIC),
        LEN,
        is_template,
        |seq| fill(seq, read),
    )
    .map_err(|e| match e {
        SequenceError::Sections(SectionsError::Elf(e)) => PatchError::Elf(e),
        SequenceError::Sections(SectionsError::Outside(section)) => PatchError::Section { section },
        SequenceError::Sequence { section, index } => PatchError::Sequence { section, index },
    })?;
    if found == 0 {
        return Err(PatchError::NoRead);
    }
    Ok((out, found))
}

/// A placeholder sequence that could not be completed.
#[derive(Debug, thiserror::Error)]
pub enum SequenceError {
    #[error(transparent)]
    Sections(#[from] SectionsError),
    #[error("section {section}, instruction {index}: not the placeholder sequence")]
    Sequence { section: String, index: usize },
}

/// Completes, in every code section of `object`, each `len`-instruction
/// sequence that starts with the instruction `first`: `is_template` must
/// recognise it (a sequence the compiler changed is an error, never a
/// guess) and `fill` rewrites it. Returns how many there were.
pub(super) fn complete_each(
    object: &mut [u8],
    first: [u8; INSN],
    len: usize,
    is_template: impl Fn(&[u8]) -> bool,
    mut fill: impl FnMut(&mut [u8]),
) -> Result<usize, SequenceError> {
    let mut found = 0;
    for (section, start, size) in code_sections(object)? {
        let code = &mut object[start..start + size];
        for index in 0..code.len() / INSN {
            if code[index * INSN..][..INSN] != first {
                continue;
            }
            let seq = code
                .get_mut(index * INSN..(index + len) * INSN)
                .filter(|seq| is_template(seq))
                .ok_or_else(|| SequenceError::Sequence {
                    section: section.clone(),
                    index,
                })?;
            fill(seq);
            found += 1;
        }
    }
    Ok(found)
}

/// The code sections of an ELF object: name, file offset and size, each
/// checked to lie inside the object.
pub(super) fn code_sections(object: &[u8]) -> Result<Vec<(String, usize, usize)>, SectionsError> {
    let mut sections = Vec::new();
    for section in object::File::parse(object)?.sections() {
        if section.kind() != SectionKind::Text {
            continue;
        }
        if let Some((start, size)) = section.file_range() {
            let name = section.name().unwrap_or("?").to_owned();
            let (start, size) = (start as usize, size as usize);
            if start.checked_add(size).is_none_or(|end| end > object.len()) {
                return Err(SectionsError::Outside(name));
            }
            sections.push((name, start, size));
        }
    }
    Ok(sections)
}

#[derive(Debug, thiserror::Error)]
pub enum SectionsError {
    #[error("the eBPF object is not a readable ELF file: {0}")]
    Elf(#[from] object::Error),
    #[error("section {0} lies outside the eBPF object")]
    Outside(String),
}

pub(super) fn insn(code: u8, regs: u8, off: i16, imm: i32) -> [u8; INSN] {
    let mut i = [0u8; INSN];
    i[0] = code;
    i[1] = regs;
    i[2..4].copy_from_slice(&off.to_le_bytes());
    i[4..8].copy_from_slice(&imm.to_le_bytes());
    i
}

pub(super) fn call(src: u8, imm: i32) -> [u8; INSN] {
    insn(op::CALL, src << 4, 0, imm)
}

/// The sequence as the compiler leaves it (see `proxy_common::ip_summed`;
/// every register is r0, so the register bytes are 0).
fn template() -> [[u8; INSN]; LEN] {
    [
        call(0, CALL_MAGIC),
        insn(op::JEQ_IMM, 0, 4, 0),
        insn(op::LOAD_BYTE, 0, 0, 0),
        insn(op::RSH_IMM, 0, 0, 0),
        insn(op::AND_IMM, 0, 0, 3),
        insn(op::JA, 0, 1, 0),
        insn(op::MOV_IMM, 0, 0, UNKNOWN as i32),
    ]
}

fn is_template(seq: &[u8]) -> bool {
    seq.chunks(INSN).zip(template()).all(|(a, b)| a == b)
}

fn fill(seq: &mut [u8], read: Read) {
    let mut put = |at: usize, i: [u8; INSN]| seq[at * INSN..][..INSN].copy_from_slice(&i);
    match read {
        Read::Kfunc { kfunc, byte, shift } => {
            put(0, call(op::PSEUDO_KFUNC_CALL, kfunc as i32));
            put(LOAD_AT, insn(op::LOAD_BYTE, 0, byte, 0));
            put(SHIFT_AT, insn(op::RSH_IMM, 0, 0, shift));
        }
        // r0 = 0: the branch after it then always yields UNKNOWN, and the
        // verifier never looks at the load it skips.
        Read::Unknown => put(0, insn(op::MOV_IMM, 0, 0, 0)),
    }
}

/// An object's bytes in 8-byte aligned memory.
pub struct AlignedObject {
    words: Vec<u64>,
    len: usize,
}

impl AlignedObject {
    fn copy_of(bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes.len()].copy_from_slice(bytes);
        Self {
            words,
            len: bytes.len(),
        }
    }

    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice::<u64, u8>(&self.words)[..self.len]
    }

    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut::<u64, u8>(&mut self.words)[..self.len]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::datapath::EBPF_OBJECT;

    fn positions(bytes: &[u8], needle: &[u8]) -> Vec<usize> {
        (0..bytes.len().saturating_sub(needle.len()))
            .filter(|&i| i % INSN == 0 && &bytes[i..i + needle.len()] == needle)
            .collect()
    }

    #[test]
    fn every_read_in_the_object_is_completed() {
        let read = Read::Kfunc {
            kfunc: 12345,
            byte: 0x81,
            shift: 5,
        };
        let template = template().concat();
        let before = positions(EBPF_OBJECT, &template);
        assert!(!before.is_empty(), "the object has no ip_summed read");
        let (out, n) = complete(EBPF_OBJECT, read).expect("complete");
        assert_eq!(
            n,
            before.len(),
            "reads completed vs sequences in the object"
        );
        let out = out.bytes();
        assert!(
            positions(out, &call(0, CALL_MAGIC)).is_empty(),
            "a placeholder is left"
        );
        for at in before {
            assert_eq!(&out[at..at + INSN], &call(2, 12345), "call at {at}");
            assert_eq!(
                &out[at + 2 * INSN..][..INSN],
                &insn(op::LOAD_BYTE, 0, 0x81, 0)
            );
            assert_eq!(&out[at + 3 * INSN..][..INSN], &insn(op::RSH_IMM, 0, 0, 5));
        }
        // Nothing else changed.
        let changed = EBPF_OBJECT.iter().zip(out).filter(|(a, b)| a != b).count();
        assert!(changed <= n * 7, "{changed} bytes changed for {n} reads");

        let (unknown, _) = complete(EBPF_OBJECT, Read::Unknown).expect("complete");
        assert!(positions(unknown.bytes(), &call(0, CALL_MAGIC)).is_empty());
    }

    #[test]
    fn a_sequence_the_compiler_changed_is_refused_by_name() {
        let mut bytes = EBPF_OBJECT.to_vec();
        let at = positions(&bytes, &template().concat())[0];
        // `r0 &= 3` becomes `r0 &= 7`.
        bytes[at + 4 * INSN + 4] = 7;
        let e = complete(&bytes, Read::Unknown)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains("not the sequence"), "{e}");
    }

    #[test]
    fn this_kernel_offers_the_kfunc() {
        let read = Read::for_this_kernel().expect("kernel BTF");
        assert!(matches!(read, Read::Kfunc { .. }), "{read:?}");
    }
}
