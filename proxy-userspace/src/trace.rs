//! `ebpf-proxy trace`: new flows, rejects and drops, as the datapath
//! decides them, one a line (proxy-ebpf's `trace`, `proxy_common::trace`).
//!
//! It runs beside the agent on the pinned maps: it keeps `TRACE_ON`'s
//! deadline a few seconds ahead while it runs, reads `TRACE_EVENTS`, names
//! each record's Service port from `SERVICE_NAMES`, keeps those its filters
//! ask for and prints them. On SIGINT or SIGTERM it sets the deadline to 0,
//! unless another trace moved it meanwhile; killed outright, it stops the
//! datapath's records when its deadline passes.

mod record;

use std::{
    collections::HashMap,
    io::Write,
    net::{IpAddr, Ipv4Addr, Ipv6Addr},
    time::Duration,
};

use aya::maps::{Array, HashMap as BpfHashMap, Map, MapData, MapError, RingBuf};
use nix::time::{ClockId, clock_gettime};
use proxy_common::{
    ServiceKey, ServiceName, ServiceValue, TraceRecord, map_names, scope, trace::DEADLINE_AHEAD_NS,
};
use tokio::signal::unix::{SignalKind, signal};

use crate::{datapath::pins::PinLayout, planner::encode};
pub use record::Event;

/// Which records to print; every one when all are `None`.
#[derive(Clone, Debug, Default)]
pub struct Filter {
    /// `--service NAMESPACE/NAME`.
    pub service: Option<(String, String)>,
    /// `--client ADDR`.
    pub client: Option<IpAddr>,
    /// `--node-port PORT`: flows to this NodePort (a frontend of the port
    /// on a node address, which no Service's own frontend answers).
    pub node_port: Option<u16>,
}

impl Filter {
    /// Whether `event` is one the filter keeps.
    pub fn keeps(&self, event: &Event) -> bool {
        self.service.as_ref().is_none_or(|(ns, name)| {
            event
                .service
                .as_ref()
                .is_some_and(|s| s.namespace == *ns && s.name == *name)
        }) && self.client.is_none_or(|c| event.client.ip() == c)
            && self.node_port.is_none_or(|p| event.frontend.port() == p)
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error(
        "no map {name} pinned at {path}: the agent on this --bpf-root predates `ebpf-proxy trace`, or none has run"
    )]
    NotPinned { name: &'static str, path: String },
    #[error("map {name} at {path}: {source}")]
    Map {
        name: &'static str,
        path: String,
        #[source]
        source: MapError,
    },
    #[error("reading the clock: {0}")]
    Clock(#[source] nix::Error),
    #[error("installing the signal handlers: {0}")]
    Signals(#[source] std::io::Error),
    #[error("writing the trace: {0}")]
    Write(#[source] std::io::Error),
}

/// The pinned map `name` under `pins`, or `NotPinned`.
fn open(pins: &PinLayout, name: &'static str) -> Result<Map, TraceError> {
    let path = pins.map(name);
    if !path.exists() {
        return Err(TraceError::NotPinned {
            name,
            path: path.display().to_string(),
        });
    }
    let map_err = |source| TraceError::Map {
        name,
        path: path.display().to_string(),
        source,
    };
    let data = MapData::from_pin(&path).map_err(map_err)?;
    Map::from_map_data(data).map_err(map_err)
}

fn map_error(pins: &PinLayout, name: &'static str) -> impl Fn(MapError) -> TraceError + use<> {
    let path = pins.map(name).display().to_string();
    move |source| TraceError::Map {
        name,
        path: path.clone(),
        source,
    }
}

/// `CLOCK_MONOTONIC` in nanoseconds: the base of the datapath's coarse
/// clock (`bpf_ktime_get_coarse_ns`).
fn now_ns() -> Result<u64, TraceError> {
    let t = clock_gettime(ClockId::CLOCK_MONOTONIC).map_err(TraceError::Clock)?;
    Ok(t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
}

/// `TRACE_ON`, whose deadline this trace keeps ahead.
struct Switch {
    map: Array<MapData, u64>,
    /// The deadline this trace last wrote, 0 before the first.
    written: u64,
    err: Box<dyn Fn(MapError) -> TraceError + Send>,
}

impl Switch {
    fn open(pins: &PinLayout) -> Result<Self, TraceError> {
        let err = map_error(pins, map_names::TRACE_ON);
        let map = open(pins, map_names::TRACE_ON)?.try_into().map_err(&err)?;
        Ok(Switch {
            map,
            written: 0,
            err: Box::new(err),
        })
    }

    /// Moves the deadline to `DEADLINE_AHEAD_NS` from now, never nearer
    /// than another trace put it.
    fn extend(&mut self) -> Result<(), TraceError> {
        let current = self.map.get(&0, 0).map_err(&self.err)?;
        let deadline = now_ns()? + DEADLINE_AHEAD_NS;
        if deadline > current {
            self.map.set(0, deadline, 0).map_err(&self.err)?;
            self.written = deadline;
        }
        Ok(())
    }

    /// Ends the records, unless another trace moved the deadline past
    /// this one's (it then keeps them on until its own ends).
    fn off(&mut self) -> Result<(), TraceError> {
        let current = self.map.get(&0, 0).map_err(&self.err)?;
        if current == self.written {
            self.map.set(0, 0, 0).map_err(&self.err)?;
        }
        Ok(())
    }
}

/// `SERVICE_NAMES`, an id looked up when a record first names it in a
/// read of the ring buffer: the agent gives a freed id to the next new
/// port, so a name is kept for one read only, and the map, as large as
/// the node's Service ports, is never read whole.
struct Names {
    map: BpfHashMap<MapData, u32, ServiceName>,
    /// This read's names; None for an id the map lacks.
    names: HashMap<u32, Option<ServiceName>>,
}

impl Names {
    fn open(pins: &PinLayout) -> Result<Self, TraceError> {
        let err = map_error(pins, map_names::SERVICE_NAMES);
        let map = open(pins, map_names::SERVICE_NAMES)?
            .try_into()
            .map_err(err)?;
        Ok(Names {
            map,
            names: HashMap::new(),
        })
    }

    /// Forgets the names of the last read.
    fn forget(&mut self) {
        self.names.clear();
    }

    fn of(&mut self, id: u32) -> Option<ServiceName> {
        if id == 0 {
            return None;
        }
        let map = &self.map;
        *self.names.entry(id).or_insert_with(|| map.get(&id, 0).ok())
    }
}

/// `SERVICES`, asked whether a record's frontend was a NodePort: the
/// datapath keys a NodePort by the unspecified address, and tries the
/// packet's own destination first.
struct Frontends {
    map: BpfHashMap<MapData, ServiceKey, ServiceValue>,
}

impl Frontends {
    fn open(pins: &PinLayout) -> Result<Self, TraceError> {
        let err = map_error(pins, map_names::SERVICES);
        let map = open(pins, map_names::SERVICES)?.try_into().map_err(err)?;
        Ok(Frontends { map })
    }

    /// Whether `event`'s frontend, of protocol `proto`, was a NodePort:
    /// one its own address does not answer, and the unspecified address
    /// does.
    fn is_node_port(&self, event: &Event, proto: u8) -> bool {
        let held = |ip: IpAddr| {
            [scope::ANY, scope::INTERNAL].iter().any(|&scope| {
                let key = ServiceKey {
                    addr_be: encode::addr_words(ip),
                    port_be: event.frontend.port().to_be(),
                    proto,
                    scope,
                };
                self.map.get(&key, 0).is_ok()
            })
        };
        let unspecified = match event.frontend.ip() {
            IpAddr::V4(_) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            IpAddr::V6(_) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        !held(event.frontend.ip()) && held(unspecified)
    }
}

/// How often the ring buffer is read. The datapath writes its records
/// without waking the reader (see proxy-ebpf's `trace`), so a record waits
/// up to this long; the ring buffer holds 4096, enough for 40,000 new flows a
/// second.
const READ_EVERY: Duration = Duration::from_millis(100);

/// Prints every record waiting in `ring` that the filter keeps onto `out`.
fn print(
    ring: &mut RingBuf<MapData>,
    names: &mut Names,
    frontends: Option<&Frontends>,
    filter: &Filter,
    json: bool,
    out: &mut impl Write,
) -> std::io::Result<()> {
    names.forget();
    while let Some(item) = ring.next() {
        let Ok(rec) = bytemuck::try_from_bytes::<TraceRecord>(&item).copied() else {
            continue;
        };
        let event = Event::of(&rec, names.of(rec.service_id));
        if filter.keeps(&event) && frontends.is_none_or(|f| f.is_node_port(&event, rec.proto)) {
            let line = if json { event.json() } else { event.text() };
            writeln!(out, "{line}")?;
        }
    }
    out.flush()
}

/// Prints the records the filter keeps onto `out`, as text or JSON lines,
/// until SIGINT or SIGTERM.
pub async fn run(
    pins: &PinLayout,
    filter: &Filter,
    json: bool,
    out: &mut impl Write,
) -> Result<(), TraceError> {
    let mut switch = Switch::open(pins)?;
    let mut names = Names::open(pins)?;
    // Only `--node-port` asks what kind a frontend was.
    let frontends = filter
        .node_port
        .map(|_| Frontends::open(pins))
        .transpose()?;
    let err = map_error(pins, map_names::TRACE_EVENTS);
    let mut ring: RingBuf<MapData> = open(pins, map_names::TRACE_EVENTS)?
        .try_into()
        .map_err(err)?;
    let mut interrupt = signal(SignalKind::interrupt()).map_err(TraceError::Signals)?;
    let mut terminate = signal(SignalKind::terminate()).map_err(TraceError::Signals)?;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut read = tokio::time::interval(READ_EVERY);
    let result = loop {
        tokio::select! {
            _ = tick.tick() => {
                if let Err(e) = switch.extend() {
                    break Err(e);
                }
            }
            _ = interrupt.recv() => break Ok(()),
            _ = terminate.recv() => break Ok(()),
            _ = read.tick() => {
                if let Err(e) = print(&mut ring, &mut names, frontends.as_ref(), filter, json, out) {
                    break Err(TraceError::Write(e));
                }
            }
        }
    };
    let off = switch.off();
    result.and(off)
}
