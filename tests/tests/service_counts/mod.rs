//! A Service port's counters as the loaded datapath holds them, for the
//! frame tests of both families (`datapath.rs`, `datapath6.rs`).

use std::net::{IpAddr, SocketAddr};

use proxy_userspace::{
    datapath::{
        maps::Maps,
        service_counters::{self, Totals},
    },
    model::{FrontendKey, Protocol, Scope},
    planner::encode,
};

/// The service id of the TCP frontend `vip:port` (a NodePort on its
/// family's unspecified address).
pub fn service_id_of(maps: &Maps, vip: impl Into<IpAddr>, port: u16) -> u32 {
    let frontend = SocketAddr::new(vip.into(), port);
    let key = encode::service_key(&FrontendKey {
        ip: frontend.ip(),
        port,
        protocol: Protocol::Tcp,
        scope: Scope::Any,
    });
    maps.services
        .get(&key, 0)
        .unwrap_or_else(|e| panic!("no frontend {frontend} in SERVICES: {e}"))
        .service_id
}

/// The counters of service id `id`, summed over CPUs.
pub fn service_totals(maps: &Maps, id: u32) -> Totals {
    let map = maps
        .service_counters
        .as_ref()
        .expect("the loaded object's SERVICE_COUNTERS");
    service_counters::total(map, id)
        .unwrap_or_else(|e| panic!("reading the counters of service id {id}: {e}"))
        .unwrap_or_else(|| panic!("service id {id} is past the counters' size"))
}
