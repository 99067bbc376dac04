//! ebpf-proxy's agent, as a library so that the integration tests and
//! benchmarks drive the same code the binary runs.
//!
//! Data flow (docs/architecture.md, "Data flow"): [`source`] -> [`state`] -> [`model`] ->
//! [`planner`] -> [`datapath`] maps, driven by [`agent`].

pub mod adopt;
pub mod agent;
pub mod cli;
pub mod cluster_cidr;
pub mod config;
pub mod datapath;
pub mod detect_local;
pub mod health_check_server;
pub mod healthz;
pub mod housekeeping;
pub mod http;
pub mod kube_proxy_argv;
pub mod kube_proxy_flags;
pub mod logging;
pub mod metrics;
pub mod model;
pub mod node_ip;
pub mod planner;
pub mod privileges;
pub mod retry;
pub mod settle;
pub mod source;
pub mod state;
pub mod status;
