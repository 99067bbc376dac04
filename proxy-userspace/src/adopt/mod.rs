//! Taking flows over from kube-proxy and handing them back: the kernel's
//! connection tracking table holds the NAT decisions kube-proxy's rules made
//! for flows already open, so adopting a node means reading those decisions
//! out (and, on the way back, writing them in again) instead of letting the
//! flows break when the rules change hands.

pub mod conntrack;
