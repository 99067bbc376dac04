//! Each Service port's traffic, from the datapath's Service counters
//! (`datapath::service_counters`), labelled by the port `SERVICE_NAMES`
//! names for its service id. Only ids with a name are read: a Service
//! port that goes away takes its series with it.

use aya::maps::{HashMap, MapData, PerCpuArray};
use prometheus_client::{
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{MetricType, counter::ConstCounter},
};
use proxy_common::{ServiceCounters, ServiceName, ct_dir, service_drop};

use crate::{
    datapath::service_counters::{self, Totals},
    planner::encode,
};

/// The `direction` label of each `ct_dir`.
const DIRECTIONS: [(usize, &str); 2] = [
    (ct_dir::FORWARD as usize, "to_backend"),
    (ct_dir::REPLY as usize, "to_client"),
];

/// One Service port's labels and totals.
struct Series {
    namespace: String,
    service: String,
    port: String,
    protocol: String,
    totals: Totals,
}

impl Series {
    fn labels(&self) -> [(&'static str, &str); 4] {
        [
            ("namespace", &self.namespace),
            ("service", &self.service),
            ("port", &self.port),
            ("protocol", &self.protocol),
        ]
    }
}

/// The named ports' totals, sorted by their labels. A port whose counters
/// cannot be read is left out, said once at debug level.
fn ports(
    names: &HashMap<MapData, u32, ServiceName>,
    counters: &PerCpuArray<MapData, ServiceCounters>,
) -> Vec<Series> {
    let mut out = Vec::new();
    for item in names {
        let Ok((id, name)) = item else {
            // Removed while being walked: the next scrape has it right.
            continue;
        };
        let totals = match service_counters::total(counters, id) {
            Ok(Some(totals)) => totals,
            // Past the counters' size (--service-counters): not counted.
            Ok(None) => continue,
            Err(e) => {
                tracing::debug!(error = %e, "a Service port's counters left out of this scrape");
                continue;
            }
        };
        out.push(Series {
            namespace: encode::name_text(&name.namespace),
            service: encode::name_text(&name.name),
            port: name.port.to_string(),
            protocol: encode::protocol_from_number(name.proto)
                .map_or_else(|| name.proto.to_string(), |p| p.to_string()),
            totals,
        });
    }
    out.sort_by(|a, b| a.labels().cmp(&b.labels()));
    out
}

/// Encodes the `ebpf_proxy_service_*` families.
pub fn encode(
    encoder: &mut DescriptorEncoder,
    names: &HashMap<MapData, u32, ServiceName>,
    counters: &PerCpuArray<MapData, ServiceCounters>,
) -> Result<(), std::fmt::Error> {
    let ports = ports(names, counters);
    let mut family = encoder.encode_descriptor(
        "ebpf_proxy_service_flows",
        "Flows the datapath started to each Service port: new connections and datagram flows at tc and XDP, connect()s of the node's sockets",
        None,
        MetricType::Counter,
    )?;
    for p in &ports {
        ConstCounter::new(p.totals.flows).encode(family.encode_family(&p.labels())?)?;
    }
    for (name, help, of) in [
        (
            "ebpf_proxy_service_packets",
            "Packets of each Service port's flows the datapath translated, by direction",
            (|t: &Totals, dir: usize| t.packets[dir]) as fn(&Totals, usize) -> u64,
        ),
        (
            "ebpf_proxy_service_bytes",
            "Bytes (whole IP packets) of each Service port's flows the datapath translated, by direction",
            |t: &Totals, dir: usize| t.bytes[dir],
        ),
    ] {
        let mut family = encoder.encode_descriptor(name, help, None, MetricType::Counter)?;
        for p in &ports {
            for (dir, direction) in DIRECTIONS {
                let [a, b, c, d] = p.labels();
                let labels = [a, b, c, d, ("direction", direction)];
                ConstCounter::new(of(&p.totals, dir)).encode(family.encode_family(&labels)?)?;
            }
        }
    }
    let mut family = encoder.encode_descriptor(
        "ebpf_proxy_service_rejected",
        "New flows to each Service port refused for want of endpoints (a reset, an ICMP error, ECONNREFUSED)",
        None,
        MetricType::Counter,
    )?;
    for p in &ports {
        ConstCounter::new(p.totals.rejected).encode(family.encode_family(&p.labels())?)?;
    }
    let mut family = encoder.encode_descriptor(
        "ebpf_proxy_service_dropped",
        "New flows to each Service port dropped, by reason: source_range, no_endpoint, snat_exhausted",
        None,
        MetricType::Counter,
    )?;
    for p in &ports {
        for (i, reason) in service_drop::NAMES.iter().enumerate() {
            let [a, b, c, d] = p.labels();
            let labels = [a, b, c, d, ("reason", *reason)];
            ConstCounter::new(p.totals.dropped[i]).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}
