//! What every benchmark takes from the harness with `mod common;`: its command line,
//! result files, rounds, reports and Ctrl-C handling ([`ebpf_proxy_tests::bench`]).
//! The servers and clients the end-to-end benches drive are the harness's
//! ([`ebpf_proxy_tests::servers::PooledBackend`], [`ebpf_proxy_tests::load`]).

pub use ebpf_proxy_tests::bench::*;
