//! Completes the programs' reads of `skb->ip_summed` before the object is
//! loaded (the sequence and why it exists: `proxy_common::ip_summed`): the
//! kfunc's id and the field's place come from the running kernel's BTF.
//! Where the kernel lacks either, the reads are turned into "unknown" and tc
//! keeps updating L4 checksums through the kernel's helper: correct, and
//! some 20-40 ns a translated packet slower.

use object::{Object, ObjectSection, SectionKind};
use proxy_common::ip_summed::{CALL_MAGIC, LEN, LOAD_AT, SHIFT_AT, UNKNOWN};

use super::kernel_btf::{self, Btf, BtfError};

const KFUNC: &str = "bpf_cast_to_kern_ctx";
const INSN: usize = 8;
/// `src_reg` of a call whose immediate is a kfunc's BTF id.
const BPF_PSEUDO_KFUNC_CALL: u8 = 2;

/// How the reads are completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Read {
    /// Through the kfunc with BTF id `kfunc`: bits `shift..shift+2` of
    /// byte `byte` of `struct sk_buff`.
    Kfunc { kfunc: u32, byte: i16, shift: i32 },
    /// Not read: every read yields `UNKNOWN`.
    Unknown,
}

#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error("the eBPF object is not a readable ELF file: {0}")]
    Elf(#[from] object::Error),
    #[error(
        "section {section}, instruction {index}: an ip_summed read is not the sequence proxy_common::ip_summed describes"
    )]
    Sequence { section: String, index: usize },
    #[error("the eBPF object has no ip_summed read: it was built from other sources")]
    NoRead,
}

impl Read {
    /// What the running kernel allows, or why it allows nothing.
    pub fn for_this_kernel() -> Result<Read, BtfError> {
        Self::from_btf(&Btf::vmlinux()?)
    }

    pub fn from_btf(btf: &Btf) -> Result<Read, BtfError> {
        let kfunc = btf.id_of(kernel_btf::kind::FUNC, KFUNC)?;
        let field = btf.field("sk_buff", "ip_summed")?;
        let byte = field.bit_offset / 8;
        let shift = field.bit_offset % 8;
        if field.bits != 2 || shift + 2 > 8 || byte > i16::MAX as u32 {
            return Err(BtfError::Malformed(
                format!("sk_buff.ip_summed is {field:?}, not two bits inside one byte").into(),
            ));
        }
        Ok(Read::Kfunc {
            kfunc,
            byte: byte as i16,
            shift: shift as i32,
        })
    }
}

/// `object` with every ip_summed read completed as `read` says, and how many
/// there were. The copy is 8-byte aligned, as the ELF parser wants.
pub fn complete(object: &[u8], read: Read) -> Result<(AlignedObject, usize), PatchError> {
    let mut out = AlignedObject::copy_of(object);
    let file = object::File::parse(object)?;
    let mut found = 0;
    for section in file.sections() {
        if section.kind() != SectionKind::Text {
            continue;
        }
        let Some((start, size)) = section.file_range() else {
            continue;
        };
        let (start, size) = (start as usize, size as usize);
        let code = out
            .bytes_mut()
            .get_mut(start..start + size)
            .ok_or(PatchError::Sequence {
                section: section.name().unwrap_or("?").into(),
                index: 0,
            })?;
        let count = code.len() / INSN;
        for index in 0..count {
            if code[index * INSN..][..INSN] != call(0, CALL_MAGIC) {
                continue;
            }
            let seq = code
                .get_mut(index * INSN..(index + LEN) * INSN)
                .filter(|seq| is_template(seq))
                .ok_or_else(|| PatchError::Sequence {
                    section: section.name().unwrap_or("?").into(),
                    index,
                })?;
            fill(seq, read);
            found += 1;
        }
    }
    if found == 0 {
        return Err(PatchError::NoRead);
    }
    Ok((out, found))
}

fn insn(code: u8, regs: u8, off: i16, imm: i32) -> [u8; INSN] {
    let mut i = [0u8; INSN];
    i[0] = code;
    i[1] = regs;
    i[2..4].copy_from_slice(&off.to_le_bytes());
    i[4..8].copy_from_slice(&imm.to_le_bytes());
    i
}

fn call(src: u8, imm: i32) -> [u8; INSN] {
    insn(0x85, src << 4, 0, imm)
}

/// The sequence as the compiler leaves it (see `proxy_common::ip_summed`).
fn template() -> [[u8; INSN]; LEN] {
    [
        call(0, CALL_MAGIC),
        insn(0x15, 0, 4, 0),              // if r0 == 0 goto +4
        insn(0x71, 0, 0, 0),              // r0 = *(u8 *)(r0 + 0)
        insn(0x77, 0, 0, 0),              // r0 >>= 0
        insn(0x57, 0, 0, 3),              // r0 &= 3
        insn(0x05, 0, 1, 0),              // goto +1
        insn(0xb7, 0, 0, UNKNOWN as i32), // r0 = UNKNOWN
    ]
}

fn is_template(seq: &[u8]) -> bool {
    seq.chunks(INSN).zip(template()).all(|(a, b)| a == b)
}

fn fill(seq: &mut [u8], read: Read) {
    let mut put = |at: usize, i: [u8; INSN]| seq[at * INSN..][..INSN].copy_from_slice(&i);
    match read {
        Read::Kfunc { kfunc, byte, shift } => {
            put(0, call(BPF_PSEUDO_KFUNC_CALL, kfunc as i32));
            put(LOAD_AT, insn(0x71, 0, byte, 0));
            put(SHIFT_AT, insn(0x77, 0, 0, shift));
        }
        // r0 = 0: the branch after it then always yields UNKNOWN, and the
        // verifier never looks at the load it skips.
        Read::Unknown => put(0, insn(0xb7, 0, 0, 0)),
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

    fn bytes_mut(&mut self) -> &mut [u8] {
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
            assert_eq!(&out[at + 2 * INSN..][..INSN], &insn(0x71, 0, 0x81, 0));
            assert_eq!(&out[at + 3 * INSN..][..INSN], &insn(0x77, 0, 0, 5));
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
