//! Taking over a node from kube-proxy.

pub mod rules;
