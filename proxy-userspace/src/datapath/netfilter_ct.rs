//! Completes tc's questions to netfilter's conntrack before the object is
//! loaded (the sequence and why it exists: `proxy_common::netfilter_ct`):
//! the kfuncs' ids come from the running kernel's BTF. Where the kernel
//! lacks them (no `nf_conntrack`, or built as a module, whose BTF the
//! loader does not pass), every question is answered "no": flows kube-proxy
//! translated are then taken as new ones on their next packet, as before
//! the takeover existed, and the agent says so.

use proxy_common::netfilter_ct::{
    LEN, LOOKUP_KFUNC, LOOKUP_MAGIC, RELEASE_AT, RELEASE_KFUNC, RELEASE_MAGIC,
};

use super::{
    ip_summed::{INSN, SequenceError, call, complete_each, insn, op},
    kernel_btf::{self, Btf, BtfError},
};

/// How the questions are completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Through the kfuncs with these BTF ids.
    Kfuncs { lookup: u32, release: u32 },
    /// Never asked: every answer is "not netfilter's".
    Absent,
}

impl std::fmt::Display for Lookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lookup::Kfuncs { lookup, release } => write!(
                f,
                "through {LOOKUP_KFUNC} (BTF id {lookup}) and {RELEASE_KFUNC} ({release})"
            ),
            Lookup::Absent => f.write_str(
                "not asked: this kernel's BTF has no conntrack kfuncs, so flows kube-proxy \
                 translated are not told apart",
            ),
        }
    }
}

impl Lookup {
    /// What the running kernel offers.
    pub fn for_this_kernel() -> Result<Lookup, BtfError> {
        Self::from_btf(&Btf::vmlinux()?)
    }

    pub fn from_btf(btf: &Btf) -> Result<Lookup, BtfError> {
        Ok(Lookup::Kfuncs {
            lookup: btf.id_of(kernel_btf::kind::FUNC, LOOKUP_KFUNC)?,
            release: btf.id_of(kernel_btf::kind::FUNC, RELEASE_KFUNC)?,
        })
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PatchError {
    #[error(
        "a conntrack question in the object (the sequence proxy_common::netfilter_ct describes): {0}"
    )]
    Sequence(#[from] SequenceError),
    #[error("the eBPF object has no conntrack question: it was built from other sources")]
    NoLookup,
}

/// Completes every question in `object` (an ELF object's bytes) as `lookup`
/// says; returns how many there were.
pub fn complete(object: &mut [u8], lookup: Lookup) -> Result<usize, PatchError> {
    let found = complete_each(object, call(0, LOOKUP_MAGIC), LEN, is_template, |seq| {
        fill(seq, lookup);
    })?;
    if found == 0 {
        return Err(PatchError::NoLookup);
    }
    Ok(found)
}

/// `BPF_ALU64` | `BPF_MOV` | `BPF_X`
const MOV_REG: u8 = 0xbf;

/// The sequence as the compiler leaves it: the registers are fixed by the
/// asm block (r0, r1).
fn template() -> [[u8; INSN]; LEN] {
    [
        call(0, LOOKUP_MAGIC),
        insn(op::JEQ_IMM, 0, 3, 0),
        // dst r1, src r0.
        insn(MOV_REG, 0x01, 0, 0),
        call(0, RELEASE_MAGIC),
        insn(op::MOV_IMM, 0, 0, 1),
    ]
}

fn is_template(seq: &[u8]) -> bool {
    seq.chunks(INSN).zip(template()).all(|(a, b)| a == b)
}

fn fill(seq: &mut [u8], lookup: Lookup) {
    let mut put = |at: usize, i: [u8; INSN]| seq[at * INSN..][..INSN].copy_from_slice(&i);
    match lookup {
        Lookup::Kfuncs { lookup, release } => {
            put(0, call(op::PSEUDO_KFUNC_CALL, lookup as i32));
            put(RELEASE_AT, call(op::PSEUDO_KFUNC_CALL, release as i32));
        }
        // r0 = 0: the branch after it always skips the release, which the
        // verifier then never looks at; it is made harmless all the same.
        Lookup::Absent => {
            put(0, insn(op::MOV_IMM, 0, 0, 0));
            put(RELEASE_AT, insn(op::MOV_IMM, 0, 0, 0));
        }
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
    fn every_question_in_the_object_is_completed() {
        let template = template().concat();
        let before = positions(EBPF_OBJECT, &template);
        // tc_ingress and tc_ingress6 ask; XDP never does.
        assert!(
            before.len() >= 2,
            "the object has {} conntrack questions, expected one per tc program",
            before.len()
        );
        let mut out = EBPF_OBJECT.to_vec();
        let n = complete(
            &mut out,
            Lookup::Kfuncs {
                lookup: 111,
                release: 222,
            },
        )
        .expect("complete");
        assert_eq!(n, before.len(), "questions completed vs sequences");
        for at in before {
            assert_eq!(&out[at..at + INSN], &call(2, 111), "lookup call at {at}");
            assert_eq!(
                &out[at + RELEASE_AT * INSN..][..INSN],
                &call(2, 222),
                "release call at {at}"
            );
        }
        let changed = EBPF_OBJECT.iter().zip(&out).filter(|(a, b)| a != b).count();
        assert!(changed <= n * 2 * INSN, "{changed} bytes changed for {n}");

        let mut absent = EBPF_OBJECT.to_vec();
        complete(&mut absent, Lookup::Absent).expect("complete");
        assert!(positions(&absent, &call(0, LOOKUP_MAGIC)).is_empty());
        assert!(positions(&absent, &call(0, RELEASE_MAGIC)).is_empty());
    }

    #[test]
    fn a_sequence_the_compiler_changed_is_refused_by_name() {
        let mut bytes = EBPF_OBJECT.to_vec();
        let at = positions(&bytes, &template().concat())[0];
        // `r0 = 1` becomes `r0 = 2`.
        bytes[at + 4 * INSN + 4] = 2;
        let e = complete(&mut bytes, Lookup::Absent)
            .expect_err("refused")
            .to_string();
        assert!(e.contains("not the placeholder sequence"), "{e}");
    }

    #[test]
    fn this_kernel_offers_the_kfuncs() {
        let lookup = Lookup::for_this_kernel().expect("kernel BTF");
        assert!(matches!(lookup, Lookup::Kfuncs { .. }), "{lookup:?}");
    }
}
