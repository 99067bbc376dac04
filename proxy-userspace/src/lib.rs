//! ebpf-proxy's agent, as a library so that the integration tests and
//! benchmarks drive the same code the binary runs.
//!
//! Data flow (docs/architecture.md, "Data flow"): [`source`] -> [`state`] -> [`model`] ->
//! [`planner`] -> [`datapath`] maps, driven by [`agent`].

pub mod adopt;
pub mod agent;
pub mod cli;
mod cluster_cidr;
pub mod config;
pub mod datapath;
mod detect_local;
mod health_check_server;
pub mod healthz;
pub mod heap;
pub mod housekeeping;
mod http;
mod http_limits;
mod http_metrics;
pub mod kube_proxy_argv;
mod kube_proxy_flags;
pub mod logging;
pub mod maglev;
mod metrics;
pub mod model;
mod node_ip;
pub mod planner;
pub mod privileges;
mod retry;
pub mod settle;
pub mod source;
pub mod state;
pub mod status;
pub mod trace;
