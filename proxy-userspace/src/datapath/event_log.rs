//! The datapath's log of rare events (proxy-ebpf's `event_log`): its level,
//! written into the pinned `DATAPATH_LOG` map (by the agent at start, by
//! `ebpf-proxy datapath-log` at any time), and its records, read from
//! aya-log's pinned ring buffer and written into the agent's own log under
//! the target `datapath`.
//!
//! Both maps are pinned: a level set while the agent runs stays in force
//! until the next start writes `--datapath-log`, and records the programs
//! write while no agent runs wait in the ring buffer for the next one.

use std::{panic::AssertUnwindSafe, time::Duration};

use aya::maps::{Array, Map, MapData, MapError};
use aya_log::EbpfLogger;
use clap::ValueEnum;
use proxy_common::{datapath_log, map_names};
use tokio::io::{Interest, unix::AsyncFd};

use super::pins::PinLayout;

/// The tracing target the records are written under.
pub const TARGET: &str = "datapath";

/// `--datapath-log` and `ebpf-proxy datapath-log`: the least severe event
/// the datapath logs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Level {
    /// Nothing.
    #[default]
    Off,
    /// A packet rewrite the datapath could not finish.
    Error,
    /// Full maps (conntrack, SNAT ports), rejects that could not be built,
    /// packets without a route.
    Warn,
    /// Rejects sent, drops by loadBalancerSourceRanges or for want of
    /// endpoints.
    Info,
    /// Untracked fragments and spent TTLs.
    Debug,
}

impl Level {
    /// The value the datapath reads.
    pub fn as_map_value(self) -> u32 {
        match self {
            Level::Off => datapath_log::OFF,
            Level::Error => datapath_log::ERROR,
            Level::Warn => datapath_log::WARN,
            Level::Info => datapath_log::INFO,
            Level::Debug => datapath_log::DEBUG,
        }
    }

    /// The flag's spelling, for messages.
    pub fn name(self) -> &'static str {
        match self {
            Level::Off => "off",
            Level::Error => "error",
            Level::Warn => "warn",
            Level::Info => "info",
            Level::Debug => "debug",
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EventLogError {
    #[error(
        "no datapath log level map pinned at {path}: no agent of this release has run with this --bpf-root"
    )]
    NotPinned { path: String },
    #[error("datapath log level map at {path}: {source}")]
    Map {
        path: String,
        #[source]
        source: MapError,
    },
    #[error("reading the datapath's log records: {0}")]
    Logger(#[from] aya_log::Error),
    #[error("waiting on the datapath's log ring buffer: {0}")]
    Poll(#[source] std::io::Error),
}

/// Writes `level` into the pinned level map under `pins`: the datapath
/// logs at that level from its next packet on.
pub fn set_level(pins: &PinLayout, level: Level) -> Result<(), EventLogError> {
    let path = pins.map(map_names::DATAPATH_LOG);
    if !path.exists() {
        return Err(EventLogError::NotPinned {
            path: path.display().to_string(),
        });
    }
    let map_err = |source| EventLogError::Map {
        path: path.display().to_string(),
        source,
    };
    let data = MapData::from_pin(&path).map_err(map_err)?;
    let map = Map::from_map_data(data).map_err(map_err)?;
    let mut array: Array<MapData, u32> = map.try_into().map_err(map_err)?;
    array.set(0, level.as_map_value(), 0).map_err(map_err)
}

/// The level in force under `pins`.
pub fn level(pins: &PinLayout) -> Result<u32, EventLogError> {
    let path = pins.map(map_names::DATAPATH_LOG);
    let map_err = |source| EventLogError::Map {
        path: path.display().to_string(),
        source,
    };
    let data = MapData::from_pin(&path).map_err(map_err)?;
    let map = Map::from_map_data(data).map_err(map_err)?;
    let array: Array<MapData, u32> = map.try_into().map_err(map_err)?;
    array.get(&0, 0).map_err(map_err)
}

/// Writes aya-log's records into tracing, at their own level, under
/// `TARGET`. What the datapath sends is already filtered by its level map.
pub struct ToTracing;

impl log::Log for ToTracing {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }

    fn log(&self, record: &log::Record<'_>) {
        let message = record.args();
        match record.level() {
            log::Level::Error => tracing::error!(target: TARGET, "{message}"),
            log::Level::Warn => tracing::warn!(target: TARGET, "{message}"),
            log::Level::Info => tracing::info!(target: TARGET, "{message}"),
            log::Level::Debug => tracing::debug!(target: TARGET, "{message}"),
            log::Level::Trace => tracing::trace!(target: TARGET, "{message}"),
        }
    }

    fn flush(&self) {}
}

/// How long a failed level write waits before the next try.
const RETRY: Duration = Duration::from_secs(5);

/// Writes `level` under `pins` (retrying until it lands) and forwards the
/// records of `logger` into tracing for as long as the agent runs.
pub async fn run(
    pins: PinLayout,
    level: Level,
    logger: EbpfLogger<ToTracing>,
) -> Result<(), EventLogError> {
    write_level_until_it_lands(&pins, level).await;
    // SAFETY: the descriptor is the ring buffer map's, owned by `logger`,
    // which the AsyncFd owns for as long as it lives.
    let mut ready = unsafe { AsyncFd::register_with_interest(logger, Interest::READABLE) }
        .map_err(|e| EventLogError::Poll(e.into_parts().1))?;
    loop {
        let mut guard = ready.readable_mut().await.map_err(EventLogError::Poll)?;
        // aya-log panics on a record it cannot decode; that record is
        // consumed all the same, and the next ones must still be read.
        let logger = guard.get_inner_mut();
        if std::panic::catch_unwind(AssertUnwindSafe(|| logger.flush())).is_err() {
            tracing::warn!("a datapath log record could not be decoded and was skipped");
        }
        guard.clear_ready();
    }
}

async fn write_level_until_it_lands(pins: &PinLayout, level: Level) {
    loop {
        match set_level(pins, level) {
            Ok(()) => {
                tracing::info!(level = level.name(), "datapath log level set");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, retry_in = ?RETRY, "setting the datapath log level");
            }
        }
        tokio::time::sleep(RETRY).await;
    }
}
