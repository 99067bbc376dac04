//! The reaper's removals (`proxy_common::ct_reap`): each key the agent read
//! as expired is looked up again and its entry removed only if it is still
//! expired. Between the agent's read and a removal, a packet may have
//! taken the expired entry's tuple for a new flow, overwriting it or
//! inserting over it; removing that key blindly removed the new flow's
//! entry, and the flow lost a direction of its translation until it
//! expired in turn. Checked here, in the kernel, that window shrinks from
//! the agent's read of a chunk of the map to the few instructions between
//! this lookup and its removal.

use aya_ebpf::{btf_maps::PerCpuArray, macros::btf_map, programs::XdpContext};
use proxy_common::{
    CtKeyOf, FlowAddr,
    ct_reap::{HEADER_LEN, Header, MAX_KEYS, map},
};

use crate::{
    family::{Family, V4, V6},
    maps::{Conntrack, expired},
};

/// The key `ct_reap_key` is to look at, copied out of the frame: an IPv6
/// key, or an IPv4 one in its first bytes. Only `ct_reap` writes it, and
/// one run at a time on a CPU.
#[btf_map]
static REAP_KEY: PerCpuArray<CtKeyOf<[u32; 4]>, 1> = PerCpuArray::new();

/// Removes what the frame's keys still hold expired at the header's time,
/// and writes how many it removed into the header.
#[inline(always)]
pub fn reap(ctx: &XdpContext) {
    let (data, end) = (ctx.data(), ctx.data_end());
    if data + HEADER_LEN > end {
        return;
    }
    let header = data as *mut Header;
    // SAFETY: within the frame, checked above.
    let (which, count, now) = unsafe { ((*header).map, (*header).keys, (*header).now_ns) };
    let keys = Keys {
        start: data + HEADER_LEN,
        end,
        count,
    };
    let removed = match which {
        map::CONNTRACK | map::CT_NEW => keys.each::<u32>(which, now),
        map::CONNTRACK6 | map::CT_NEW6 => keys.each::<[u32; 4]>(which, now),
        _ => 0,
    };
    // SAFETY: as above.
    unsafe { (*header).removed = removed };
}

/// The frame's keys: `count` of them from `start`, none past `end`.
struct Keys {
    start: usize,
    end: usize,
    count: u32,
}

impl Keys {
    /// Hands each key, of addresses `A`, to `ct_reap_key`; how many
    /// entries it removed. The loop's body is that copy and a call: the
    /// lookup's and the removal's branches, in a global function, are
    /// verified once rather than in each of the loop's turns.
    #[inline(always)]
    fn each<A: FlowAddr>(&self, which: u32, now: u64) -> u32 {
        let size = size_of::<CtKeyOf<A>>();
        let mut removed = 0;
        for i in 0..MAX_KEYS {
            let at = self.start + i as usize * size;
            if i >= self.count || at + size > self.end {
                break;
            }
            let Some(slot) = REAP_KEY.get_ptr_mut(0) else {
                break;
            };
            // SAFETY: within the frame, checked above; into this CPU's
            // slot, which holds an IPv6 key, so an IPv4 one too. Word by
            // word (a key is a whole number of them), read unaligned as the
            // frame promises no alignment: a copy of the whole key would be
            // a call to a byte loop.
            unsafe {
                let slot = slot.cast::<u32>();
                for w in 0..size / 4 {
                    let word = core::ptr::read_unaligned((at + 4 * w) as *const u32);
                    slot.add(w).write(word);
                }
            }
            removed += ct_reap_key(u64::from(which), now);
        }
        removed
    }
}

/// Removes the entry of `REAP_KEY`'s key from map `which` if it is expired
/// at `now`: 1 if it did, else 0. Global (`no_mangle`, scalar arguments
/// and result), as `conntrack::snat_try_port` is.
#[inline(never)]
#[unsafe(no_mangle)]
#[unsafe(link_section = ".text")]
pub extern "C" fn ct_reap_key(which: u64, now: u64) -> u32 {
    let Some(slot) = REAP_KEY.get_ptr(0) else {
        return 0;
    };
    match which as u32 {
        map::CONNTRACK => remove_if_expired::<V4>(V4::conntrack(), slot.cast(), now),
        map::CT_NEW => remove_if_expired::<V4>(V4::ct_new(), slot.cast(), now),
        map::CONNTRACK6 => remove_if_expired::<V6>(V6::conntrack(), slot, now),
        map::CT_NEW6 => remove_if_expired::<V6>(V6::ct_new(), slot, now),
        _ => 0,
    }
}

#[inline(always)]
fn remove_if_expired<F: Family>(
    map: &Conntrack<F::Addr>,
    key: *const CtKeyOf<F::Addr>,
    now: u64,
) -> u32 {
    // SAFETY: this CPU's `REAP_KEY` slot, valid for this program's run.
    let key = unsafe { &*key };
    let Some(entry) = map.get_ptr(key) else {
        return 0;
    };
    // SAFETY: a pointer the map lookup returned, valid for this program's
    // run.
    let still = expired(unsafe { &*entry }, key.proto, now);
    u32::from(still && map.remove(key).is_ok())
}
