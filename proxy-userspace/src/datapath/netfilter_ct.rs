//! Completes the packet programs' questions to netfilter's conntrack (tc's
//! and XDP's) before the object is loaded (the sequence and why it exists:
//! `proxy_common::netfilter_ct`): the kfuncs' ids come from the running
//! kernel's BTF. Where the kernel lacks them (no `nf_conntrack`, or built
//! as a module, whose BTF the loader does not pass), every question is
//! answered "no": flows kube-proxy translated are then taken as new ones on
//! their next packet, as before the takeover existed, and the agent says
//! so.

use proxy_common::netfilter_ct::{
    LEN, LOOKUP_KFUNC, LOOKUP_MAGIC, RELEASE_AT, RELEASE_KFUNC, RELEASE_MAGIC, XDP_LOOKUP_KFUNC,
    XDP_LOOKUP_MAGIC,
};

use super::{
    ip_summed::{INSN, SequenceError, call, complete_each, insn, op},
    kernel_btf::{self, Btf, BtfError},
};

/// How the questions are completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// Through the kfuncs with these BTF ids (`xdp_lookup`: XDP's lookup).
    Kfuncs {
        lookup: u32,
        xdp_lookup: u32,
        release: u32,
    },
    /// Never asked: every answer is "not netfilter's".
    Absent,
}

impl std::fmt::Display for Lookup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Lookup::Kfuncs {
                lookup,
                xdp_lookup,
                release,
            } => write!(
                f,
                "through {LOOKUP_KFUNC} (BTF id {lookup}), {XDP_LOOKUP_KFUNC} ({xdp_lookup}) \
                 and {RELEASE_KFUNC} ({release})"
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
            xdp_lookup: btf.id_of(kernel_btf::kind::FUNC, XDP_LOOKUP_KFUNC)?,
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
    #[error("the eBPF object has no conntrack question at {0}: it was built from other sources")]
    NoLookup(&'static str),
}

/// Completes every question in `object` (an ELF object's bytes) as `lookup`
/// says; returns how many there were.
pub fn complete(object: &mut [u8], lookup: Lookup) -> Result<usize, PatchError> {
    let mut found = 0;
    for hook in [Hook::Tc, Hook::Xdp] {
        let asked = complete_each(
            object,
            call(0, hook.magic()),
            LEN,
            |seq| is_template(seq, hook),
            |seq| fill(seq, lookup, hook),
        )?;
        if asked == 0 {
            return Err(PatchError::NoLookup(hook.name()));
        }
        found += asked;
    }
    Ok(found)
}

/// The hook a question is asked at: which lookup kfunc it takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Hook {
    Tc,
    Xdp,
}

impl Hook {
    fn magic(self) -> i32 {
        match self {
            Hook::Tc => LOOKUP_MAGIC,
            Hook::Xdp => XDP_LOOKUP_MAGIC,
        }
    }

    fn name(self) -> &'static str {
        match self {
            Hook::Tc => "tc",
            Hook::Xdp => "XDP",
        }
    }
}

/// `BPF_ALU64` | `BPF_MOV` | `BPF_X`
const MOV_REG: u8 = 0xbf;

/// The sequence as the compiler leaves it: the registers are fixed by the
/// asm block (r0, r1).
fn template(hook: Hook) -> [[u8; INSN]; LEN] {
    [
        call(0, hook.magic()),
        insn(op::JEQ_IMM, 0, 3, 0),
        // dst r1, src r0.
        insn(MOV_REG, 0x01, 0, 0),
        call(0, RELEASE_MAGIC),
        insn(op::MOV_IMM, 0, 0, 1),
    ]
}

fn is_template(seq: &[u8], hook: Hook) -> bool {
    seq.chunks(INSN).zip(template(hook)).all(|(a, b)| a == b)
}

fn fill(seq: &mut [u8], lookup: Lookup, hook: Hook) {
    let mut put = |at: usize, i: [u8; INSN]| seq[at * INSN..][..INSN].copy_from_slice(&i);
    match lookup {
        Lookup::Kfuncs {
            lookup,
            xdp_lookup,
            release,
        } => {
            let lookup = match hook {
                Hook::Tc => lookup,
                Hook::Xdp => xdp_lookup,
            };
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
        // tc_ingress and tc_ingress6 ask at tc, xdp_ingress and
        // xdp_ingress6 at XDP, each with its hook's lookup.
        let sites = |bytes: &[u8], hook| positions(bytes, &template(hook).concat());
        let (tc, xdp) = (sites(EBPF_OBJECT, Hook::Tc), sites(EBPF_OBJECT, Hook::Xdp));
        assert!(
            tc.len() >= 2 && xdp.len() >= 2,
            "the object has {} conntrack questions at tc and {} at XDP, expected one per \
             program of each",
            tc.len(),
            xdp.len()
        );
        let mut out = EBPF_OBJECT.to_vec();
        let n = complete(
            &mut out,
            Lookup::Kfuncs {
                lookup: 111,
                xdp_lookup: 333,
                release: 222,
            },
        )
        .expect("complete");
        assert_eq!(n, tc.len() + xdp.len(), "questions completed vs sequences");
        for (sites, lookup) in [(tc, 111), (xdp, 333)] {
            for at in sites {
                assert_eq!(&out[at..at + INSN], &call(2, lookup), "lookup call at {at}");
                assert_eq!(
                    &out[at + RELEASE_AT * INSN..][..INSN],
                    &call(2, 222),
                    "release call at {at}"
                );
            }
        }
        let changed = EBPF_OBJECT.iter().zip(&out).filter(|(a, b)| a != b).count();
        assert!(changed <= n * 2 * INSN, "{changed} bytes changed for {n}");

        let mut absent = EBPF_OBJECT.to_vec();
        complete(&mut absent, Lookup::Absent).expect("complete");
        for magic in [LOOKUP_MAGIC, XDP_LOOKUP_MAGIC, RELEASE_MAGIC] {
            assert!(
                positions(&absent, &call(0, magic)).is_empty(),
                "{magic:#x} left"
            );
        }
    }

    #[test]
    fn a_sequence_the_compiler_changed_is_refused_by_name() {
        let mut bytes = EBPF_OBJECT.to_vec();
        let at = positions(&bytes, &template(Hook::Xdp).concat())[0];
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
