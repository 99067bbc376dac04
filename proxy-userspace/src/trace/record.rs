//! A `TraceRecord` read from the ring buffer, named and decoded into
//! addresses, and its two printed forms: a line of text, or of JSON.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};

use proxy_common::{
    PROTO_SCTP, PROTO_TCP, PROTO_UDP, ServiceName, TraceRecord,
    trace::{family, hook, reason, verdict},
};
use serde_json::json;

use crate::planner::encode::{name_text, words_ipv6};

/// The Service port a record's service id stood for when it was read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    pub namespace: String,
    pub name: String,
    /// `spec.ports[].name`; empty for an unnamed only port.
    pub port_name: String,
}

/// One record, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Event {
    /// None for a packet to no Service (an unallocated service CIDR
    /// address) or an id `SERVICE_NAMES` no longer holds.
    pub service: Option<ServicePort>,
    pub protocol: &'static str,
    pub client: SocketAddr,
    pub frontend: SocketAddr,
    /// Where a translated flow went.
    pub backend: Option<SocketAddr>,
    pub verdict: &'static str,
    /// Why it was dropped.
    pub reason: Option<&'static str>,
    /// `tc` or `xdp`.
    pub hook: &'static str,
}

impl Event {
    pub fn of(rec: &TraceRecord, name: Option<ServiceName>) -> Self {
        let addr = |words: &[u32; 4], port_be: u16| -> SocketAddr {
            let port = u16::from_be(port_be);
            let ip = if rec.family == family::V6 {
                IpAddr::V6(words_ipv6(words))
            } else {
                IpAddr::V4(Ipv4Addr::from(words[0].to_ne_bytes()))
            };
            SocketAddr::new(ip, port)
        };
        let verdict_name = match rec.verdict {
            verdict::TRANSLATED => "translated",
            verdict::REJECTED => "rejected",
            verdict::DROPPED => "dropped",
            _ => "unknown",
        };
        Event {
            service: name.map(|n| ServicePort {
                namespace: name_text(&n.namespace),
                name: name_text(&n.name),
                port_name: name_text(&n.port_name),
            }),
            protocol: match rec.proto {
                PROTO_TCP => "tcp",
                PROTO_UDP => "udp",
                PROTO_SCTP => "sctp",
                _ => "ip",
            },
            client: addr(&rec.client_be, rec.client_port_be),
            frontend: addr(&rec.frontend_be, rec.frontend_port_be),
            backend: (rec.verdict == verdict::TRANSLATED)
                .then(|| addr(&rec.backend_be, rec.backend_port_be)),
            verdict: verdict_name,
            reason: (rec.verdict == verdict::DROPPED).then(|| {
                reason::NAMES
                    .get(usize::from(rec.reason))
                    .copied()
                    .unwrap_or("unknown")
            }),
            hook: if rec.hook == hook::XDP { "xdp" } else { "tc" },
        }
    }

    /// `namespace/name`, as `--service` names it.
    fn service_text(&self) -> Option<String> {
        self.service
            .as_ref()
            .map(|s| format!("{}/{}", s.namespace, s.name))
    }

    /// `translated tcp 10.0.0.2:40000 -> 10.96.0.10:80 => 10.1.0.5:8080 default/web:http (tc)`:
    /// the verdict (and a drop's reason), the flow, the backend of a
    /// translated one, the Service port (`-` for none) and the hook.
    pub fn text(&self) -> String {
        let mut line = String::from(self.verdict);
        if let Some(reason) = self.reason {
            line.push_str(&format!(" ({reason})"));
        }
        line.push_str(&format!(
            " {} {} -> {}",
            self.protocol, self.client, self.frontend
        ));
        if let Some(backend) = self.backend {
            line.push_str(&format!(" => {backend}"));
        }
        match &self.service {
            Some(s) if s.port_name.is_empty() => {
                line.push_str(&format!(" {}/{}", s.namespace, s.name));
            }
            Some(s) => line.push_str(&format!(" {}/{}:{}", s.namespace, s.name, s.port_name)),
            None => line.push_str(" -"),
        }
        line.push_str(&format!(" ({})", self.hook));
        line
    }

    /// One JSON object: `service` ("ns/name"), `port` (its port's name),
    /// `protocol`, `client`, `frontend`, `backend` ("ip:port", IPv6 as
    /// "[addr]:port", null where none), `verdict`, `reason` (drops only)
    /// and `hook`.
    pub fn json(&self) -> String {
        let mut object = json!({
            "service": self.service_text(),
            "port": self.service.as_ref().map(|s| s.port_name.clone()),
            "protocol": self.protocol,
            "client": self.client.to_string(),
            "frontend": self.frontend.to_string(),
            "backend": self.backend.map(|b| b.to_string()),
            "verdict": self.verdict,
            "hook": self.hook,
        });
        if let Some(reason) = self.reason {
            object["reason"] = json!(reason);
        }
        object.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(ns: &str, name: &str, port: &str) -> ServiceName {
        let mut n = ServiceName::default();
        n.namespace[..ns.len()].copy_from_slice(ns.as_bytes());
        n.name[..name.len()].copy_from_slice(name.as_bytes());
        n.port_name[..port.len()].copy_from_slice(port.as_bytes());
        n
    }

    fn v4(a: [u8; 4]) -> [u32; 4] {
        [u32::from_ne_bytes(a), 0, 0, 0]
    }

    #[test]
    fn a_translated_ipv4_flow_reads_as_it_went_on_the_wire() {
        let rec = TraceRecord {
            service_id: 7,
            verdict: verdict::TRANSLATED,
            proto: PROTO_TCP,
            family: family::V4,
            client_port_be: 40000u16.to_be(),
            frontend_port_be: 80u16.to_be(),
            backend_port_be: 8080u16.to_be(),
            client_be: v4([10, 200, 0, 2]),
            frontend_be: v4([10, 96, 0, 10]),
            backend_be: v4([10, 1, 0, 5]),
            ..TraceRecord::default()
        };
        let event = Event::of(&rec, Some(name("default", "web", "http")));
        assert_eq!(
            event.text(),
            "translated tcp 10.200.0.2:40000 -> 10.96.0.10:80 => 10.1.0.5:8080 default/web:http (tc)"
        );
        let json: serde_json::Value = serde_json::from_str(&event.json()).expect("JSON");
        assert_eq!(
            json,
            json!({
                "service": "default/web", "port": "http", "protocol": "tcp",
                "client": "10.200.0.2:40000", "frontend": "10.96.0.10:80",
                "backend": "10.1.0.5:8080", "verdict": "translated", "hook": "tc",
            })
        );
    }

    #[test]
    fn an_ipv6_drop_has_brackets_a_reason_and_no_backend() {
        let addr = |last: u8| {
            let mut bytes = [0u8; 16];
            bytes[0] = 0xfd;
            bytes[15] = last;
            let mut words = [0u32; 4];
            for (w, chunk) in words.iter_mut().zip(bytes.chunks_exact(4)) {
                *w = u32::from_ne_bytes(chunk.try_into().expect("4 bytes"));
            }
            words
        };
        let rec = TraceRecord {
            verdict: verdict::DROPPED,
            reason: reason::UNALLOCATED,
            proto: PROTO_UDP,
            family: family::V6,
            hook: hook::XDP,
            client_port_be: 5353u16.to_be(),
            frontend_port_be: 53u16.to_be(),
            client_be: addr(2),
            frontend_be: addr(9),
            ..TraceRecord::default()
        };
        let event = Event::of(&rec, None);
        assert_eq!(
            event.text(),
            "dropped (unallocated) udp [fd00::2]:5353 -> [fd00::9]:53 - (xdp)"
        );
        let json: serde_json::Value = serde_json::from_str(&event.json()).expect("JSON");
        assert_eq!(json["backend"], serde_json::Value::Null);
        assert_eq!(json["service"], serde_json::Value::Null);
        assert_eq!(json["reason"], "unallocated");
        assert_eq!(json["client"], "[fd00::2]:5353");
    }
}
