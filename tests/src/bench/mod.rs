//! What the benchmarks under tests/benches/ share: the command line and where results
//! go ([`cli`]), Ctrl-C ([`interrupt`]), interleaved rounds and paired ratios
//! ([`rounds`]), the end-to-end benchmarks' reports ([`report`]) and the machine's
//! description ([`machine`]). The servers and clients they drive are the harness's own
//! ([`crate::servers::PooledBackend`], [`crate::load`]).

pub mod cli;
pub mod interrupt;
pub mod machine;
pub mod report;
pub mod rounds;

pub use cli::*;
pub use interrupt::*;
pub use machine::*;
pub use report::*;
pub use rounds::*;
