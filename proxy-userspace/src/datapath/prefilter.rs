//! The prefilter's bit array (`proxy_common::prefilter`), mapped into the
//! agent's memory: a write that needs a bit sets it with one atomic OR, no
//! system call, however many Services a sync writes.
//!
//! Bits are set before the frontend or backend that needs them lands
//! ([`Prefilter::landing`]), and cleared only by a rebuild (`prefilter_rebuild`), which writes
//! the whole array again from what the maps hold: frontends and the
//! destination of every flow in conntrack, so that a flow outlives its
//! Service as it does in kube-proxy's conntrack, and backends' source bits
//! until this agent's programs are attached (`Prefilter::keeps_sources`).
//! Landings and rebuilds hold one lock, so a rebuild never reads the maps
//! between a bit's setting and its entry's landing.

use std::{
    os::fd::{AsFd, AsRawFd},
    ptr::NonNull,
    sync::{
        Mutex, MutexGuard, PoisonError,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use aya::maps::{Array, IterableMap, MapData};
use proxy_common::{
    Backend, NodeAddr, NodeAddrKey, ServiceKey, map_names, node_addr_flags,
    prefilter::{
        BLOCK_PREFIX, MAX_BLOCKS, WIDE_BIT, WORDS, bit, block_bit, nodeports_bit, port_bit, side,
        to_bits, word_and_mask,
    },
    v4_mapped,
};

use crate::planner::{MapOp, encode::ClusterCidrEntry};

/// Why an array could not be mapped.
#[derive(Debug, thiserror::Error)]
pub enum PrefilterError {
    #[error("map {name}: {source}")]
    Info {
        name: &'static str,
        #[source]
        source: aya::maps::MapError,
    },
    #[error(
        "map {name} holds {entries} entries of {value_size} bytes, where this agent's holds {words} of 8: refused"
    )]
    Layout {
        name: &'static str,
        entries: u32,
        value_size: u32,
        words: u32,
    },
    #[error("mapping {name} into memory: {source}")]
    Mmap {
        name: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// An array of 64-bit words created with `BPF_F_MMAPABLE`, mapped into
/// this process read and write: the prefilter's arrays. It keeps the map's
/// descriptor open: programs loaded later (the benchmarks' reference
/// programs) are relocated against it.
pub struct MappedWords {
    words: NonNull<AtomicU64>,
    len: usize,
    _array: Array<MapData, u64>,
}

// SAFETY: the mapping is shared memory the kernel's programs read too;
// every access from here is atomic.
unsafe impl Send for MappedWords {}
// SAFETY: as for `Send`.
unsafe impl Sync for MappedWords {}

impl std::fmt::Debug for MappedWords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MappedWords")
            .field("words", &self.len)
            .finish_non_exhaustive()
    }
}

impl MappedWords {
    /// Maps `array` (named `name`), which must hold `words` words.
    pub fn map(
        array: Array<MapData, u64>,
        name: &'static str,
        words: u32,
    ) -> Result<Self, PrefilterError> {
        let map = array.map();
        let info = map
            .info()
            .map_err(|source| PrefilterError::Info { name, source })?;
        if info.max_entries() != words || info.value_size() != 8 {
            return Err(PrefilterError::Layout {
                name,
                entries: info.max_entries(),
                value_size: info.value_size(),
                words,
            });
        }
        let len = words as usize;
        // SAFETY: a shared mapping of the map's whole value area, which
        // the kernel allows for an array created with BPF_F_MMAPABLE; it is
        // unmapped on drop and only ever accessed as atomics.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len * size_of::<u64>(),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                map.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if addr == libc::MAP_FAILED {
            return Err(PrefilterError::Mmap {
                name,
                source: std::io::Error::last_os_error(),
            });
        }
        let words = NonNull::new(addr.cast::<AtomicU64>()).ok_or_else(|| PrefilterError::Mmap {
            name,
            source: std::io::Error::other("mmap returned null"),
        })?;
        Ok(Self {
            words,
            len,
            _array: array,
        })
    }

    /// The words, for as long as the mapping lives.
    pub fn words(&self) -> &[AtomicU64] {
        // SAFETY: `len` words, mapped for as long as `self` lives.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr(), self.len) }
    }
}

impl Drop for MappedWords {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, unused past this point.
        unsafe { libc::munmap(self.words.as_ptr().cast(), self.len * size_of::<u64>()) };
    }
}

/// Removals after which the bits are rebuilt at the next reap, however
/// soon: each leaves bits that send packets for nothing the full way.
const REBUILD_AFTER_REMOVALS: usize = 1024;
/// A rebuild at most this often for fewer removals.
const REBUILD_PERIOD: Duration = Duration::from_mins(1);

/// The mapped array.
#[derive(Debug)]
pub struct Prefilter {
    words: MappedWords,
    /// Held by each landing of entries that need bits, and by rebuilds.
    lock: Mutex<()>,
    /// Frontends and backends removed since the last rebuild.
    removed: AtomicUsize,
    last_rebuild: Mutex<Instant>,
    /// Whether backends' source bits (`backend_bit`) are kept: from the
    /// load until this agent's programs have replaced an earlier agent's,
    /// the only readers of those bits (`retire_sources`). At 100,000
    /// Services x 10 endpoints they are nine set bits in ten, each a chance
    /// that a packet for no Service takes the full path.
    sources: AtomicBool,
}

impl Prefilter {
    /// Maps `array` (`map_names::PREFILTER`) into memory, read and write.
    pub fn map(array: Array<MapData, u64>) -> Result<Self, PrefilterError> {
        Ok(Self {
            words: MappedWords::map(array, map_names::PREFILTER, WORDS)?,
            lock: Mutex::new(()),
            removed: AtomicUsize::new(0),
            last_rebuild: Mutex::new(Instant::now()),
            sources: AtomicBool::new(true),
        })
    }

    /// Whether backends' source bits are still kept (see `retire_sources`).
    pub fn keeps_sources(&self) -> bool {
        self.sources.load(Ordering::Relaxed)
    }

    /// Stops keeping backends' source bits, under the lock of the rebuild
    /// that clears those set (`prefilter_rebuild::retire_sources`), so
    /// that every landing after it leaves them out.
    pub fn retire_sources(&self, _held: &MutexGuard<'_, ()>) {
        self.sources.store(false, Ordering::Relaxed);
    }

    fn words(&self) -> &[AtomicU64] {
        self.words.words()
    }

    /// The lock landings and rebuilds hold.
    pub fn hold(&self) -> MutexGuard<'_, ()> {
        self.lock.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Sets the bit `op`'s entry needs, or notes a removal.
    fn admit(&self, op: &MapOp) {
        match op {
            MapOp::PutService { key, .. } => service_bits(key, |bit| self.set(bit)),
            MapOp::PutBackend { backend, .. } if self.keeps_sources() => {
                self.set(backend_bit(backend));
            }
            MapOp::PutServiceCidr { entry, .. } => service_cidr_bits(entry, |bit| self.set(bit)),
            MapOp::PutNodeAddr { key, value } => {
                if let Some(bit) = node_addr_bit(key, value) {
                    self.set(bit);
                }
            }
            MapOp::DeleteService { .. }
            | MapOp::DeleteBackend { .. }
            | MapOp::DeleteServiceCidr { .. }
            | MapOp::DeleteNodeAddr { .. } => {
                self.removed.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }

    fn set(&self, bit: u32) {
        let (word, mask) = word_and_mask(bit);
        self.words()[word as usize].fetch_or(mask, Ordering::Relaxed);
    }

    /// Word `word` of the array, as the datapath reads it.
    pub fn word(&self, word: u32) -> Option<u64> {
        self.words()
            .get(word as usize)
            .map(|w| w.load(Ordering::Relaxed))
    }

    /// Whether `bit` is set.
    pub fn holds(&self, bit: u32) -> bool {
        let (word, mask) = word_and_mask(bit);
        self.words()[word as usize].load(Ordering::Relaxed) & mask != 0
    }

    /// Bits set, of `proxy_common::prefilter::BITS`.
    pub fn ones(&self) -> u32 {
        self.words()
            .iter()
            .map(|w| w.load(Ordering::Relaxed).count_ones())
            .sum()
    }

    /// Whether enough went since the last rebuild for another
    /// (`REBUILD_AFTER_REMOVALS`, `REBUILD_PERIOD`).
    pub fn rebuild_due(&self) -> bool {
        let removed = self.removed.load(Ordering::Relaxed);
        let last = *self
            .last_rebuild
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        removed >= REBUILD_AFTER_REMOVALS || (removed > 0 && last.elapsed() >= REBUILD_PERIOD)
    }

    /// Makes the array hold `bits` alone; the lock is held by the caller.
    pub fn replace(&self, bits: &Bits, _held: &MutexGuard<'_, ()>) -> usize {
        let mut changed = 0;
        for (word, new) in self.words().iter().zip(&bits.0) {
            if word.swap(*new, Ordering::Relaxed) != *new {
                changed += 1;
            }
        }
        self.removed.store(0, Ordering::Relaxed);
        *self
            .last_rebuild
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Instant::now();
        changed
    }

    /// Every bit set: each packet takes the full path, as without a
    /// prefilter. Where the maps could not be read at load.
    pub fn open_all(&self) {
        let _held = self.hold();
        for word in self.words() {
            word.store(u64::MAX, Ordering::Relaxed);
        }
    }
}

/// Lands `write`, entries that `ops` describe, with their bits set first:
/// under the lock, so no rebuild reads the maps in between. Without a
/// prefilter (the pins of an older agent), `write` alone.
pub fn landing<T>(prefilter: Option<&Prefilter>, ops: &[MapOp], write: impl FnOnce() -> T) -> T {
    let Some(prefilter) = prefilter else {
        return write();
    };
    let _landing = prefilter.hold();
    for op in ops {
        prefilter.admit(op);
    }
    write()
}

/// The bit of a frontend the datapath asks for: its destination key, or
/// for a NodePort (on the unspecified address of its family) its port's.
pub fn service_bit(key: &ServiceKey) -> u32 {
    if is_node_port(key) {
        port_bit(key.port_be)
    } else {
        bit(&key.addr_be, key.port_be, key.proto, side::TO)
    }
}

/// Calls `set` with the bits a frontend needs: a NodePort its port's, any
/// other its destination key's and its block's `frontends_bit`
/// (`to_bits`), without which the datapath would not read the key's.
pub fn service_bits(key: &ServiceKey, mut set: impl FnMut(u32)) {
    if is_node_port(key) {
        set(port_bit(key.port_be));
    } else {
        to_bits(&key.addr_be, key.port_be, key.proto)
            .into_iter()
            .for_each(set);
    }
}

/// The bit of a `NODE_ADDRS` entry: for an address that serves NodePorts,
/// its block's `nodeports_bit`, without which the datapath never reads a
/// NodePort's port bit for packets to it.
pub fn node_addr_bit(key: &NodeAddrKey, value: &NodeAddr) -> Option<u32> {
    (value.flags & node_addr_flags::NODEPORT != 0).then(|| nodeports_bit(&key.addr_be))
}

fn is_node_port(key: &ServiceKey) -> bool {
    key.addr_be == [0; 4] || key.addr_be == v4_mapped(0)
}

/// The bit of a backend: the source key of its replies, which only the
/// programs of earlier agents read (`proxy_common::prefilter`).
pub fn backend_bit(backend: &Backend) -> u32 {
    bit(&backend.addr_be, backend.port_be, backend.proto, side::FROM)
}

/// Calls `set` with the bits of a `SERVICE_CIDRS` entry: the block bit of
/// each block of 256 addresses it covers, or `WIDE_BIT` where it covers
/// more than `MAX_BLOCKS` of them. IPv4's programs never read `WIDE_BIT`:
/// the blocks of an entry's IPv4 addresses (`::ffff:0:0/96`) are set
/// however many they are, 2^24 at most (a range that wide is a
/// misconfiguration, whose cost is this one loop rather than a read on
/// every packet). `WIDE_BIT` is set for them too, for the programs of an
/// earlier agent during an upgrade.
pub fn service_cidr_bits((prefix_len, key): &ClusterCidrEntry, mut set: impl FnMut(u32)) {
    let prefix = (*prefix_len).min(128);
    if prefix >= u32::from(BLOCK_PREFIX) {
        set(block_bit(&key.addr_be));
        return;
    }
    // The words hold their bytes in network order: as bytes, one big-endian
    // number, which the blocks count up from.
    let base = u128::from_be_bytes(bytemuck::cast(key.addr_be));
    let blocks = 1u64 << (u32::from(BLOCK_PREFIX) - prefix).min(63);
    if blocks <= MAX_BLOCKS {
        set_blocks(base, blocks, &mut set);
        return;
    }
    set(WIDE_BIT);
    if let Some((base, blocks)) = ipv4_part(base, prefix, blocks) {
        set_blocks(base, blocks, &mut set);
    }
}

/// IPv4-mapped addresses, `::ffff:0:0/96`, as one big-endian number.
const V4_MAPPED: u128 = 0xffff << 32;

/// The first block and the number of blocks of the IPv4 addresses
/// (`V4_MAPPED`) in the range `base`/`prefix` (128-bit) of `blocks`
/// blocks, if it has any: all of the range where it lies inside the /96,
/// all of IPv4 where it holds the /96. Both hold when the two agree on
/// the bits the narrower of them fixes.
fn ipv4_part(base: u128, prefix: u32, blocks: u64) -> Option<(u128, u64)> {
    let fixed = |addr: u128| addr.checked_shr(128 - prefix.min(96)).unwrap_or(0);
    if fixed(base) != fixed(V4_MAPPED) {
        return None;
    }
    Some(if prefix >= 96 {
        (base, blocks)
    } else {
        (V4_MAPPED, 1 << 24)
    })
}

/// Sets the block bit of `blocks` blocks of 256 from `base` on.
fn set_blocks(base: u128, blocks: u64, set: &mut impl FnMut(u32)) {
    for block in 0..blocks {
        let addr: [u32; 4] = bytemuck::cast((base + (u128::from(block) << 8)).to_be_bytes());
        set(block_bit(&addr));
    }
}

/// A rebuild's array, built in memory first (`prefilter_rebuild`).
pub struct Bits(Vec<u64>);

impl Bits {
    /// No bit set.
    pub fn new() -> Self {
        Self(vec![0; WORDS as usize])
    }

    pub fn set(&mut self, bit: u32) {
        let (word, mask) = word_and_mask(bit);
        self.0[word as usize] |= mask;
    }

    /// Bits set, of `BITS`.
    pub fn ones(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}

impl Default for Bits {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use proxy_common::{ServiceKey, prefilter::PORTS, scope, v4_mapped};

    use super::*;

    fn key(addr_be: [u32; 4], port: u16) -> ServiceKey {
        ServiceKey {
            addr_be,
            port_be: port.to_be(),
            proto: 6,
            scope: scope::ANY,
        }
    }

    /// A NodePort is asked for by its port alone (the datapath's third
    /// probe), on either family's unspecified address; any other frontend
    /// by its hashed key.
    #[test]
    fn node_ports_take_their_ports_bit_and_other_frontends_a_hashed_one() {
        for unspecified in [[0; 4], v4_mapped(0)] {
            assert_eq!(
                service_bit(&key(unspecified, 30080)),
                port_bit(30080u16.to_be()),
                "NodePort on {unspecified:?}"
            );
        }
        let cluster_ip = key(v4_mapped(u32::from_ne_bytes([10, 96, 0, 10])), 80);
        assert!(
            service_bit(&cluster_ip) >= PORTS,
            "a ClusterIP took a port's bit"
        );
        let backend = Backend {
            addr_be: v4_mapped(u32::from_ne_bytes([10, 244, 1, 5])),
            port_be: 8080u16.to_be(),
            proto: 6,
            flags: 0,
        };
        assert_eq!(
            backend_bit(&backend),
            bit(&backend.addr_be, backend.port_be, 6, side::FROM),
            "a backend's bit is its replies' source key"
        );
    }

    /// What a frontend sets is what the datapath asks for: a packet to any
    /// frontend, NodePorts on either family included, passes the prefilter
    /// once its entries' bits are set as a landing sets them (`admit`); a
    /// packet to another address of a ClusterIP's block is turned away with
    /// the block's service CIDR bit as the agent set it. A frontend's own
    /// bit without its block's is a packet passed untranslated.
    #[test]
    fn every_frontend_passes_the_datapaths_question() {
        use proxy_common::prefilter::{Block, for_no_frontend, frontends_bit, turned_away};
        let v4 = |a: u8, b: u8, c: u8, d: u8| v4_mapped(u32::from_ne_bytes([a, b, c, d]));
        let v6 = |last: u32| {
            [
                u32::from_be(0xfd00_0010),
                0,
                u32::from_be(0x96),
                last.to_be(),
            ]
        };
        let frontends = [
            key(v4(10, 96, 0, 10), 80),
            key(v4(192, 168, 1, 240), 443),
            key(v4(0, 0, 0, 0), 30080),
            key(v6(0x12cd), 80),
            key([0; 4], 30443),
        ];
        let mut bits = Bits::new();
        for key in &frontends {
            service_bits(key, |b| bits.set(b));
        }
        bits.set(block_bit(&frontends[0].addr_be));
        // The node's addresses, as their `NODE_ADDRS` entries land: the
        // first serves NodePorts, the second not.
        let (node, other) = (v4(192, 0, 2, 1), v4(198, 51, 100, 1));
        for (addr, flags) in [(node, node_addr_flags::NODEPORT), (other, 0)] {
            if let Some(b) = node_addr_bit(&NodeAddrKey { addr_be: addr }, &NodeAddr { flags }) {
                bits.set(b);
            }
        }
        fn read(bits: &Bits) -> impl Fn(u32) -> Option<u64> + '_ {
            |w| bits.0.get(w as usize).copied()
        }
        let client = v4(10, 244, 2, 7);
        assert_eq!(
            turned_away(
                read(&bits),
                |_| false,
                &other,
                30080u16.to_be(),
                &client,
                40_000,
                6
            ),
            Some(Block::NoCidr),
            "a NodePort's port was asked at an address that serves none"
        );
        for key in &frontends {
            let dst = if is_node_port(key) { node } else { key.addr_be };
            assert_eq!(
                turned_away(
                    read(&bits),
                    |_| false,
                    &dst,
                    key.port_be,
                    &client,
                    40_000,
                    6
                ),
                None,
                "a packet to {key:?} was turned away"
            );
            assert_eq!(
                for_no_frontend(read(&bits), &dst, key.port_be, 6),
                None,
                "a packet to {key:?} would skip the frontend lookups"
            );
        }
        assert_eq!(
            turned_away(
                read(&bits),
                |_| false,
                &v4(10, 96, 0, 99),
                80u16.to_be(),
                &client,
                40_000,
                6
            ),
            Some(Block::Cidr),
            "to an unheld address of the ClusterIP's block"
        );
        let (w, m) = word_and_mask(frontends_bit(&frontends[0].addr_be));
        bits.0[w as usize] &= !m;
        assert_eq!(
            turned_away(
                read(&bits),
                |_| false,
                &frontends[0].addr_be,
                frontends[0].port_be,
                &client,
                40_000,
                6
            ),
            Some(Block::Cidr),
            "the ClusterIP's key was asked for without its block's frontends bit"
        );
    }

    /// A reply from a backend, either family, passes the prefilter once its
    /// flow marked its tuple, and not for its backend's bit, which a landing
    /// sets for the programs of earlier agents until this agent's are
    /// attached; unknown to conntrack,
    /// it is for no frontend, so it skips the frontend lookups.
    #[test]
    fn a_backends_reply_passes_for_its_flows_mark_alone() {
        use proxy_common::prefilter::{Block, flows, for_no_frontend, turned_away};
        let client = v4_mapped(u32::from_ne_bytes([10, 244, 2, 7]));
        let backends = [
            v4_mapped(u32::from_ne_bytes([10, 244, 1, 5])),
            [
                u32::from_be(0xfd00_0010),
                0,
                u32::from_be(0x96),
                0x1_0005u32.to_be(),
            ],
        ]
        .map(|addr_be| Backend {
            addr_be,
            port_be: 8080u16.to_be(),
            proto: 6,
            flags: 0,
        });
        let mut bits = Bits::new();
        for backend in &backends {
            bits.set(backend_bit(backend));
        }
        let read = |w: u32| bits.0.get(w as usize).copied();
        for backend in &backends {
            let reply = flows::slot(&backend.addr_be, backend.port_be, &client, 40_000, 6);
            let ask = |marked: &dyn Fn(u32) -> bool| {
                turned_away(
                    read,
                    marked,
                    &client,
                    40_000,
                    &backend.addr_be,
                    backend.port_be,
                    6,
                )
            };
            assert_eq!(
                ask(&|slot| slot == reply),
                None,
                "a marked reply from {backend:?} was turned away"
            );
            assert_eq!(
                ask(&|_| false),
                Some(Block::NoCidr),
                "an unmarked packet from {backend:?} passed for its backend's bit"
            );
            assert_eq!(
                for_no_frontend(read, &client, 40_000, 6),
                Some(Block::NoCidr),
                "a reply from {backend:?} unknown to conntrack would be looked up as a frontend's"
            );
        }
    }

    /// Every address of a service CIDR finds its block's bit set, a /12 as
    /// a /28; an address outside it finds none of the CIDR's bits (here,
    /// where they are few, by their count); a CIDR of more than
    /// `MAX_BLOCKS` blocks sets `WIDE_BIT`, alone over IPv6.
    #[test]
    fn a_service_cidr_sets_the_block_bit_of_each_of_its_addresses() {
        use crate::{model::Cidr, planner::encode::cluster_cidr};
        let bits_of = |cidr: &str| {
            let mut bits = std::collections::BTreeSet::new();
            service_cidr_bits(&cluster_cidr(&Cidr::parse(cidr).unwrap()), |b| {
                bits.insert(b);
            });
            bits
        };
        let addr = |ip: &str| match ip.parse::<std::net::IpAddr>().unwrap() {
            std::net::IpAddr::V4(v4) => v4_mapped(u32::from_ne_bytes(v4.octets())),
            std::net::IpAddr::V6(v6) => {
                let o = v6.octets();
                std::array::from_fn(|i| {
                    u32::from_ne_bytes([o[4 * i], o[4 * i + 1], o[4 * i + 2], o[4 * i + 3]])
                })
            }
        };
        let wide = bits_of("10.96.0.0/12");
        assert_eq!(wide.len(), 4096, "a /12 has 4,096 blocks of 256");
        for ip in ["10.96.0.1", "10.100.7.200", "10.111.255.255"] {
            assert!(wide.contains(&block_bit(&addr(ip))), "{ip} in 10.96.0.0/12");
        }
        let narrow = bits_of("10.0.0.16/28");
        assert_eq!(narrow, [block_bit(&addr("10.0.0.1"))].into());
        let v6 = bits_of("fd00:10:96::/112");
        assert_eq!(v6.len(), 256);
        assert!(v6.contains(&block_bit(&addr("fd00:10:96::12cd"))));
        assert!(!v6.contains(&WIDE_BIT));
        assert_eq!(bits_of("fd00:10:96::/64"), [WIDE_BIT].into());
        assert_eq!(bits_of("10.0.0.0/8").len(), 65_536);
        // IPv4's programs do not read WIDE_BIT: a wider IPv4 range sets
        // each of its blocks' bits as well.
        let v4_wide = bits_of("10.0.0.0/7");
        assert!(v4_wide.contains(&WIDE_BIT), "10.0.0.0/7: no WIDE_BIT");
        for ip in ["10.0.0.1", "10.200.3.4", "11.255.255.255"] {
            assert!(
                v4_wide.contains(&block_bit(&addr(ip))),
                "{ip} in 10.0.0.0/7"
            );
        }
        assert!(!v4_wide.contains(&block_bit(&addr("12.0.0.1"))));
        // An IPv6 range holding all of IPv4's mapped addresses holds all of
        // IPv4's 2^24 blocks (set as the /7's are, here only counted); one
        // holding none, none.
        assert_eq!(
            ipv4_part(0, 80, 1 << 40),
            Some((V4_MAPPED, 1 << 24)),
            "::/80"
        );
        assert_eq!(ipv4_part(0, 0, 1 << 63), Some((V4_MAPPED, 1 << 24)), "::/0");
        assert_eq!(ipv4_part(0, 81, 1 << 39), None, "::/81");
        assert_eq!(bits_of("::/81"), [WIDE_BIT].into());
        assert_eq!(bits_of("fd00::/8"), [WIDE_BIT].into());
    }
}
