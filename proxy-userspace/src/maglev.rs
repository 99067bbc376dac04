//! Maglev consistent hashing (Eisenbud et al., NSDI'16): the load-balancing
//! algorithms a frontend may use, the table size and seed every node must
//! share, and the table itself. Every node given the same backends, size
//! and seed builds the same table, whatever order it learnt the backends in
//! and whatever ids it gave them, so the datapath's
//! `flow_hash % size` picks the same backend everywhere (docs/maglev.md).

use std::{fmt, str::FromStr};

use proxy_common::maglev::permutation;

pub use proxy_common::maglev::{DEFAULT_HASH_SEED, DEFAULT_TABLE_SIZE, flow_hash};

/// The smallest table accepted: below it a table holds too few slots for
/// even a handful of backends to get near-equal shares.
pub const MIN_TABLE_SIZE: u32 = 251;
/// The largest table accepted: a slot index stays below
/// `MAX_BACKENDS_PER_SERVICE`, and each table is that many entries of
/// `BACKEND_SLOTS` (docs/maglev.md has the memory).
pub const MAX_TABLE_SIZE: u32 = 65_521;

/// How a frontend picks the backend of a new flow.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LbAlgorithm {
    /// Uniformly at random on the node that sees the flow first, as
    /// kube-proxy's probabilities.
    #[default]
    Random,
    /// By the flow's hash in the frontend's Maglev table: the same backend
    /// on every node, and after a restart.
    Maglev,
}

impl LbAlgorithm {
    pub fn as_str(self) -> &'static str {
        match self {
            LbAlgorithm::Random => "random",
            LbAlgorithm::Maglev => "maglev",
        }
    }
}

impl fmt::Display for LbAlgorithm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MaglevError {
    #[error("{0:?} is not a load-balancing algorithm (random, maglev)")]
    UnknownAlgorithm(String),
    #[error(
        "Maglev table size {0} is not a prime: a table of composite size leaves slots some backends never reach"
    )]
    NotPrime(u32),
    #[error("Maglev table size {0} is outside {MIN_TABLE_SIZE}..={MAX_TABLE_SIZE}")]
    OutOfRange(u32),
}

impl FromStr for LbAlgorithm {
    type Err = MaglevError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "random" => Ok(LbAlgorithm::Random),
            "maglev" => Ok(LbAlgorithm::Maglev),
            other => Err(MaglevError::UnknownAlgorithm(other.to_owned())),
        }
    }
}

/// `size` if it is a usable table size: a prime within bounds.
pub fn table_size(size: u32) -> Result<u32, MaglevError> {
    if !(MIN_TABLE_SIZE..=MAX_TABLE_SIZE).contains(&size) {
        return Err(MaglevError::OutOfRange(size));
    }
    if !is_prime(size) {
        return Err(MaglevError::NotPrime(size));
    }
    Ok(size)
}

fn is_prime(n: u32) -> bool {
    n >= 2 && (2..=n.isqrt()).all(|d| !n.is_multiple_of(d))
}

/// What the agent balances with: the algorithm of frontends whose Service
/// does not choose, and the table every node must build alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LbConfig {
    pub algorithm: LbAlgorithm,
    /// A prime from [`table_size`].
    pub table_size: u32,
    pub hash_seed: u32,
}

impl Default for LbConfig {
    fn default() -> Self {
        LbConfig {
            algorithm: LbAlgorithm::Random,
            table_size: DEFAULT_TABLE_SIZE,
            hash_seed: DEFAULT_HASH_SEED,
        }
    }
}

/// A backend as every node names it: address (IPv4-mapped words, network
/// order), port (network order) and protocol. Its order is the order
/// backends take their turns in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BackendName {
    pub addr_be: [u32; 4],
    pub port_be: u16,
    pub proto: u8,
}

impl BackendName {
    /// Bytes as on the wire, so the order is the addresses' and ports'
    /// numeric order on any host.
    fn sort_key(&self) -> ([u8; 16], u16, u8) {
        let mut addr = [0u8; 16];
        for (chunk, w) in addr.chunks_exact_mut(4).zip(self.addr_be) {
            chunk.copy_from_slice(&w.to_ne_bytes());
        }
        (addr, u16::from_be(self.port_be), self.proto)
    }
}

impl PartialOrd for BackendName {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for BackendName {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.sort_key().cmp(&other.sort_key())
    }
}

/// The Maglev table of `size` slots (a prime from [`table_size`]) over a
/// weighted backend set, given as a random-mode slot set is: one entry per
/// slot, a backend's weight being how many slots it has. Each slot holds
/// the `T` (a backend id) of the backend owning it; empty when there are no
/// backends.
///
/// A backend of weight w takes w turns in each round (IPVS `mh`'s way), so
/// its share of the table is its share of the weight. Backends take their
/// turns in the order of their names and find their slots by their names'
/// hashes, so the table depends on the set alone, never on the order given
/// or on the ids.
pub fn build<T: Clone>(slots: &[(BackendName, T)], size: u32, seed: u32) -> Vec<T> {
    if slots.is_empty() {
        return Vec::new();
    }
    // (name, weight, value), by name; a name given twice counts twice and
    // keeps the first value given for it (the sort is stable).
    let mut weighted: Vec<(BackendName, u32, T)> = Vec::new();
    let mut sorted: Vec<&(BackendName, T)> = slots.iter().collect();
    sorted.sort_by_key(|(name, _)| *name);
    for (name, value) in sorted {
        match weighted.last_mut() {
            Some((last, weight, _)) if last == name => *weight += 1,
            _ => weighted.push((*name, 1, value.clone())),
        }
    }

    let m = size as usize;
    // Each backend's next preferred slot and its step.
    let mut next: Vec<(u32, u32)> = weighted
        .iter()
        .map(|(name, _, _)| permutation(name.addr_be, name.port_be, name.proto, seed, size))
        .collect();
    let mut owner: Vec<u32> = vec![u32::MAX; m];
    let mut filled = 0;
    'rounds: loop {
        for (i, (_, weight, _)) in weighted.iter().enumerate() {
            for _ in 0..*weight {
                let (pos, skip) = &mut next[i];
                while owner[*pos as usize] != u32::MAX {
                    *pos = advance(*pos, *skip, size);
                }
                owner[*pos as usize] = i as u32;
                *pos = advance(*pos, *skip, size);
                filled += 1;
                if filled == m {
                    break 'rounds;
                }
            }
        }
    }
    owner
        .iter()
        .map(|&i| weighted[i as usize].2.clone())
        .collect()
}

#[inline]
fn advance(pos: u32, skip: u32, size: u32) -> u32 {
    let next = pos + skip;
    if next >= size { next - size } else { next }
}

#[cfg(test)]
mod tests;
