//! The prefilter's marks of flows (`proxy_common::prefilter::flows`),
//! mapped into the agent's memory. The datapath marks the key of each
//! flow's reply entry as it inserts the flow; the agent clears marks, one
//! half of the array at a time (`FlowMarks::refresh`, over what
//! `prefilter_rebuild::refresh_flows` reads of conntrack), and opens them
//! all where a flow may lack its mark: at load, as the programs of an
//! earlier agent on the same pins made their flows without, and after the
//! agent itself carried flows into conntrack.

use std::sync::{
    Mutex, PoisonError,
    atomic::{AtomicU32, Ordering},
};

use aya::maps::{Array, MapData};
use proxy_common::{
    map_names,
    prefilter::flows::{BOTH, SLOTS, WORDS, half_mask, word_and_shift},
};

use super::prefilter::{MappedWords, PrefilterError};

/// A refresh is due once this many slots are marked, and twice what the
/// last refresh found live: below it, what closed flows leave marked
/// costs few packets the full path.
const REFRESH_FLOOR: u32 = SLOTS / 64;

/// The mapped array.
#[derive(Debug)]
pub struct FlowMarks {
    words: MappedWords,
    /// The half the next refresh clears.
    next_half: AtomicU32,
    /// Refreshes owed before the marks say no more than conntrack holds:
    /// two after `open`, one per half.
    owed: AtomicU32,
    /// Slots the last refresh marked: the live flows' replies then.
    live: AtomicU32,
    /// Held by refreshes and opens, which must not interleave.
    lock: Mutex<()>,
}

/// What a refresh left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refreshed {
    /// The half cleared and marked again (0 or 1).
    pub half: u32,
    /// Slots that half holds marked now: the replies of the flows in
    /// conntrack, and of those the datapath made since the clear.
    pub live: u32,
    /// Slots marked in either half.
    pub marked: u32,
}

impl FlowMarks {
    /// Maps `array` (`map_names::PREFILTER_FLOWS`) into memory, read and
    /// write.
    pub fn map(array: Array<MapData, u64>) -> Result<Self, PrefilterError> {
        Ok(Self {
            words: MappedWords::map(array, map_names::PREFILTER_FLOWS, WORDS)?,
            next_half: AtomicU32::new(0),
            owed: AtomicU32::new(0),
            live: AtomicU32::new(0),
            lock: Mutex::new(()),
        })
    }

    /// Every slot marked in both halves: every packet from any address
    /// and port takes the full path until two refreshes have run.
    pub fn open(&self) {
        let _held = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        for word in self.words.words() {
            word.store(u64::MAX, Ordering::Relaxed);
        }
        self.owed.store(2, Ordering::Relaxed);
    }

    /// Whether `slot` is marked in either half.
    pub fn is_marked(&self, slot: u32) -> bool {
        let (word, shift) = word_and_shift(slot);
        (self.words.words()[word as usize].load(Ordering::Relaxed) >> shift) & u64::from(BOTH) != 0
    }

    /// Slots marked in either half, of `SLOTS`.
    pub fn marked(&self) -> u32 {
        self.words
            .words()
            .iter()
            .map(|w| {
                let w = w.load(Ordering::Relaxed);
                ((w | (w >> 1)) & half_mask(0)).count_ones()
            })
            .sum()
    }

    /// Whether a refresh is due: owed after `open`, or enough closed flows'
    /// marks gathered since the last (`REFRESH_FLOOR`).
    pub fn refresh_due(&self) -> bool {
        if self.owed.load(Ordering::Relaxed) > 0 {
            return true;
        }
        let marked = self.marked();
        marked > REFRESH_FLOOR && marked > 2 * self.live.load(Ordering::Relaxed)
    }

    /// Clears one half, then marks it for every slot `reply_slots` passes
    /// to its argument: the reply entries of what conntrack holds, read
    /// after the clear (see `proxy_common::prefilter::flows` for why
    /// nothing live goes unmarked). The other half answers meanwhile.
    /// Where the read fails, the half is marked whole again, as opened.
    pub fn refresh<E>(
        &self,
        reply_slots: impl FnOnce(&mut dyn FnMut(u32)) -> Result<(), E>,
    ) -> Result<Refreshed, E> {
        let _held = self.lock.lock().unwrap_or_else(PoisonError::into_inner);
        let half = self.next_half.load(Ordering::Relaxed) & 1;
        let mask = half_mask(half);
        let words = self.words.words();
        for word in words {
            word.fetch_and(!mask, Ordering::SeqCst);
        }
        let read = reply_slots(&mut |slot| {
            let (word, shift) = word_and_shift(slot);
            words[word as usize].fetch_or((mask & 0xff) << shift, Ordering::Relaxed);
        });
        if let Err(e) = read {
            for word in words {
                word.fetch_or(mask, Ordering::Relaxed);
            }
            return Err(e);
        }
        let live = words
            .iter()
            .map(|w| (w.load(Ordering::Relaxed) & mask).count_ones())
            .sum();
        self.next_half.store(half ^ 1, Ordering::Relaxed);
        self.live.store(live, Ordering::Relaxed);
        // A no-op where none was owed.
        let _ = self
            .owed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1));
        Ok(Refreshed {
            half,
            live,
            marked: self.marked(),
        })
    }

    /// Whether refreshes are owed since the last `open`.
    pub fn owed(&self) -> bool {
        self.owed.load(Ordering::Relaxed) > 0
    }
}
