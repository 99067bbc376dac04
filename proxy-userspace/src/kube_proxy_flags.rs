//! kube-proxy's own flags on `ebpf-proxy run`, so that a kube-proxy
//! command line (kubeadm's, kOps', k3s') starts this agent unchanged:
//! the flags with a meaning here are fields of `RunArgs` (and are settled
//! by `settle` once the configuration file is merged); the others are
//! [`IGNORED`], taken with kube-proxy's value syntax and named in one
//! warning at start.

use std::time::Duration;

use clap::{Arg, ArgAction, ArgMatches, parser::ValueSource};

use crate::model::Cidr;

/// How a flag's value is written, as kube-proxy's flag types take it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `--flag`, `--flag=true`, `--flag=false` (Go's `strconv.ParseBool`).
    Bool,
    /// A Go `int32` within these bounds.
    Int(i64, i64),
    /// A Go `uint64`.
    Uint,
    /// A finite Go `float32`.
    Float,
    /// A Go duration (`1m30s`).
    Duration,
    /// Any string.
    Text,
    /// Comma-separated CIDRs.
    Cidrs,
    /// Comma-separated `Name=bool` pairs (`--feature-gates`).
    Gates,
    /// klog's severity: a name or its number.
    Severity,
}

/// A kube-proxy flag without a meaning here.
#[derive(Clone, Copy, Debug)]
pub struct Ignored {
    pub name: &'static str,
    pub kind: Kind,
    /// Why it does not apply, for the flag's help and docs/operations.md.
    pub why: &'static str,
}

const fn ignored(name: &'static str, kind: Kind, why: &'static str) -> Ignored {
    Ignored { name, kind, why }
}

const LOGS: &str = "the log goes to standard error; its level is set with RUST_LOG";
const KLOG: &str = "klog's output options: the log goes to standard error";
const GO_RUNNER: &str = "go-runner's, which kOps puts among kube-proxy's flags";
const OTHER_MODE: &str = "a setting of another kube-proxy mode";
const API_CLIENT: &str = "the API client's rate limits and content types are its own";

/// Every flag of kube-proxy 1.34 on Linux (cmd/kube-proxy/app/options.go,
/// with the logging flags component-base and klog register) that means
/// nothing here, in kube-proxy's order. `-` and `_` are one character in
/// these names, as kube-proxy normalizes them (`--log_file` is
/// `--log-file`).
pub const IGNORED: &[Ignored] = &[
    ignored(
        "feature-gates",
        Kind::Gates,
        "kube-proxy's feature gates do not apply",
    ),
    ignored("kube-api-content-type", Kind::Text, API_CLIENT),
    ignored("kube-api-burst", Kind::Int(0, i32::MAX as i64), API_CLIENT),
    ignored("kube-api-qps", Kind::Float, API_CLIENT),
    ignored(
        "bind-address-hard-fail",
        Kind::Bool,
        "the agent always stops when it cannot listen",
    ),
    ignored("profiling", Kind::Bool, "no profiling endpoint is served"),
    ignored(
        "show-hidden-metrics-for-version",
        Kind::Text,
        "no metric is hidden",
    ),
    ignored("iptables-masquerade-bit", Kind::Int(0, 31), OTHER_MODE),
    ignored("ipvs-scheduler", Kind::Text, OTHER_MODE),
    ignored("ipvs-exclude-cidrs", Kind::Cidrs, OTHER_MODE),
    ignored("ipvs-strict-arp", Kind::Bool, OTHER_MODE),
    ignored("ipvs-tcp-timeout", Kind::Duration, OTHER_MODE),
    ignored("ipvs-tcpfin-timeout", Kind::Duration, OTHER_MODE),
    ignored("ipvs-udp-timeout", Kind::Duration, OTHER_MODE),
    ignored(
        "oom-score-adj",
        Kind::Int(-1000, 1000),
        "the agent leaves its OOM score to the pod's QoS class",
    ),
    ignored(
        "conntrack-tcp-be-liberal",
        Kind::Bool,
        "the datapath's conntrack follows no TCP windows",
    ),
    ignored(
        "conntrack-udp-timeout-stream",
        Kind::Duration,
        "the datapath has one UDP idle timeout, --conntrack-udp-timeout",
    ),
    ignored(
        "config-sync-period",
        Kind::Duration,
        "the API watches are not resynced periodically",
    ),
    ignored(
        "healthz-port",
        Kind::Int(0, 65535),
        "deprecated by kube-proxy: use --healthz-bind-address",
    ),
    ignored(
        "metrics-port",
        Kind::Int(0, 65535),
        "deprecated by kube-proxy: use --metrics-bind-address",
    ),
    ignored("v", Kind::Int(0, i32::MAX as i64), LOGS),
    ignored("vmodule", Kind::Text, LOGS),
    ignored("log-flush-frequency", Kind::Duration, LOGS),
    ignored("log-text-split-stream", Kind::Bool, LOGS),
    ignored("log-text-info-buffer-size", Kind::Text, LOGS),
    ignored("log-json-split-stream", Kind::Bool, LOGS),
    ignored("log-json-info-buffer-size", Kind::Text, LOGS),
    ignored("add-dir-header", Kind::Bool, KLOG),
    ignored("alsologtostderr", Kind::Bool, KLOG),
    ignored("log-backtrace-at", Kind::Text, KLOG),
    ignored("log-dir", Kind::Text, KLOG),
    ignored("log-file", Kind::Text, KLOG),
    ignored("log-file-max-size", Kind::Uint, KLOG),
    ignored("logtostderr", Kind::Bool, KLOG),
    ignored("one-output", Kind::Bool, KLOG),
    ignored("skip-headers", Kind::Bool, KLOG),
    ignored("skip-log-headers", Kind::Bool, KLOG),
    ignored("stderrthreshold", Kind::Severity, KLOG),
    ignored("also-stdout", Kind::Bool, GO_RUNNER),
    ignored("redirect-stderr", Kind::Bool, GO_RUNNER),
];

impl Ignored {
    /// The flag's definition on `ebpf-proxy run`.
    fn arg(self) -> Arg {
        let kind = self.kind;
        let arg = Arg::new(self.name)
            .long(self.name)
            .help(format!("kube-proxy's flag, ignored: {}.", self.why))
            .hide(true)
            .action(ArgAction::Set)
            .value_parser(move |text: &str| check(kind, text));
        match kind {
            Kind::Bool => arg.num_args(0..=1).default_missing_value("true"),
            Kind::Int(min, _) if min < 0 => arg.allow_negative_numbers(true),
            _ => arg,
        }
    }
}

/// `text` as a value of `kind`, or why it is not one.
fn check(kind: Kind, text: &str) -> Result<String, String> {
    match kind {
        Kind::Bool => parse_go_bool(text).map(|b| b.to_string()),
        Kind::Int(min, max) => match text.trim().parse::<i64>() {
            Ok(n) if (min..=max).contains(&n) => Ok(n.to_string()),
            _ => Err(format!("{text:?} is not an integer from {min} to {max}")),
        },
        Kind::Uint => text
            .trim()
            .parse::<u64>()
            .map(|n| n.to_string())
            .map_err(|_| format!("{text:?} is not a non-negative integer")),
        Kind::Float => match text.trim().parse::<f32>() {
            Ok(x) if x.is_finite() => Ok(text.trim().to_owned()),
            _ => Err(format!("{text:?} is not a number")),
        },
        Kind::Duration => parse_go_duration(text).map(|_| text.to_owned()),
        Kind::Text => Ok(text.to_owned()),
        Kind::Cidrs => {
            for entry in text.split(',').filter(|e| !e.trim().is_empty()) {
                parse_cidr(entry)?;
            }
            Ok(text.to_owned())
        }
        Kind::Gates => {
            for pair in text.split(',').filter(|p| !p.trim().is_empty()) {
                let (name, value) = pair
                    .split_once('=')
                    .filter(|(name, _)| !name.trim().is_empty())
                    .ok_or_else(|| format!("{pair:?} is not Name=true or Name=false"))?;
                parse_go_bool(value.trim())
                    .map_err(|e| format!("feature gate {}: {e}", name.trim()))?;
            }
            Ok(text.to_owned())
        }
        Kind::Severity => match text.trim() {
            "INFO" | "WARNING" | "ERROR" | "FATAL" | "0" | "1" | "2" | "3" => Ok(text.to_owned()),
            other => Err(format!(
                "{other:?} is not a severity (INFO, WARNING, ERROR, FATAL or 0 to 3)"
            )),
        },
    }
}

/// Go's `strconv.ParseBool`, which Go's boolean flags take.
pub fn parse_go_bool(text: &str) -> Result<bool, String> {
    match text {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Ok(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Ok(false),
        other => Err(format!("{other:?} is not a boolean (true or false)")),
    }
}

/// The ignored flags given, with their values, in [`IGNORED`]'s order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IgnoredFlags(pub Vec<(&'static str, String)>);

impl IgnoredFlags {
    /// The flags' names, for the warning at start: `--v=2, --oom-score-adj=-998`.
    pub fn summary(&self) -> String {
        self.0
            .iter()
            .map(|(name, value)| format!("--{name}={value}"))
            .collect::<Vec<_>>()
            .join(", ")
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|(name, _)| *name).collect()
    }
}

impl clap::FromArgMatches for IgnoredFlags {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut flags = Self::default();
        flags.update_from_arg_matches(matches)?;
        Ok(flags)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        for flag in IGNORED {
            if matches.value_source(flag.name) != Some(ValueSource::CommandLine) {
                continue;
            }
            let value = matches
                .get_one::<String>(flag.name)
                .cloned()
                .unwrap_or_default();
            self.0.retain(|(name, _)| *name != flag.name);
            self.0.push((flag.name, value));
        }
        Ok(())
    }
}

impl clap::Args for IgnoredFlags {
    fn augment_args(cmd: clap::Command) -> clap::Command {
        IGNORED.iter().fold(cmd, |cmd, flag| cmd.arg(flag.arg()))
    }

    fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
        Self::augment_args(cmd)
    }
}

/// A `--nodeport-addresses` entry: a CIDR, or kube-proxy's `primary`, the
/// node's primary address of each family.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodePortAddress {
    Cidr(Cidr),
    Primary,
}

impl NodePortAddress {
    pub fn parse(text: &str) -> Result<Self, String> {
        match text.trim() {
            "primary" => Ok(Self::Primary),
            other => parse_cidr(other).map(Self::Cidr),
        }
    }
}

/// "10.0.0.0/8" and the like.
pub fn parse_cidr(s: &str) -> Result<Cidr, String> {
    Cidr::parse(s).ok_or_else(|| format!("{s:?} is not a CIDR (like 192.168.0.0/16)"))
}

/// kube-proxy's rule: `primary` alone, or CIDRs.
pub fn check_nodeport_addresses(entries: &[NodePortAddress]) -> Result<(), String> {
    if entries.len() > 1 && entries.contains(&NodePortAddress::Primary) {
        return Err("\"primary\" cannot be combined with CIDRs: give it alone".to_owned());
    }
    Ok(())
}

/// kube-proxy's proxy modes on Linux; empty is its default, iptables.
pub fn parse_proxy_mode(text: &str) -> Result<String, String> {
    match text {
        "" | "iptables" | "ipvs" | "nftables" => Ok(text.to_owned()),
        other => Err(format!(
            "{other:?} is not a proxy mode (iptables, ipvs or nftables)"
        )),
    }
}

/// A Go duration, for every duration flag.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    parse_go_duration(text)
}

/// `--hostname-override` / `--node-name`: trimmed and lowercased as
/// kube-proxy takes it, never empty.
pub fn parse_node_name(text: &str) -> Result<String, String> {
    let name = text.trim();
    if name.is_empty() {
        return Err("an empty node name is invalid".to_owned());
    }
    Ok(name.to_lowercase())
}

/// kube-proxy's table size: `per_core` connections per CPU, at least `min`;
/// None when `per_core` is 0, which leaves the size as it is.
pub fn conntrack_size(per_core: u32, min: u32, cpus: u64) -> Result<Option<u32>, String> {
    if per_core == 0 {
        return Ok(None);
    }
    let max = (u64::from(per_core) * cpus).max(u64::from(min));
    let range = 1024..=u64::from(MAX_CONNECTIONS);
    if !range.contains(&max) {
        return Err(format!(
            "{per_core} per CPU x {cpus} CPUs (at least {min}) is {max} connections; \
             the table holds {} to {}",
            range.start(),
            range.end()
        ));
    }
    Ok(Some(u32::try_from(max).unwrap_or(MAX_CONNECTIONS)))
}

/// The most connections the conntrack map may be sized for.
pub const MAX_CONNECTIONS: u32 = 1 << 30;

/// The CPUs kube-proxy multiplies `--conntrack-max-per-core` by.
pub fn cpus() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}

/// Go's `time.ParseDuration`, for the durations a configuration may hold
/// (not negative).
pub fn parse_go_duration(text: &str) -> Result<Duration, String> {
    let bad = || format!("{text:?} is not a duration (like 30s, 1m30s, 250ms, 1h0m0s)");
    if text == "0" {
        return Ok(Duration::ZERO);
    }
    if text.starts_with('-') {
        return Err(format!("{text:?} is negative"));
    }
    let mut rest = text.strip_prefix('+').unwrap_or(text);
    if rest.is_empty() {
        return Err(bad());
    }
    let mut nanos: f64 = 0.0;
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .ok_or_else(bad)?;
        let (number, tail) = rest.split_at(number_end);
        if number.is_empty() || number == "." || number.matches('.').count() > 1 {
            return Err(bad());
        }
        let value: f64 = number.parse().map_err(|_| bad())?;
        let unit_end = tail
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(tail.len());
        let (unit, tail) = tail.split_at(unit_end);
        let scale = match unit {
            "ns" => 1.0,
            "us" | "µs" | "μs" => 1e3,
            "ms" => 1e6,
            "s" => 1e9,
            "m" => 60e9,
            "h" => 3600e9,
            _ => return Err(bad()),
        };
        nanos += value * scale;
        rest = tail;
    }
    // Go's durations are int64 nanoseconds.
    if nanos > i64::MAX as f64 {
        return Err(format!("{text:?} is longer than Go's longest duration"));
    }
    Ok(Duration::from_nanos(nanos.round() as u64))
}

#[cfg(test)]
mod tests;
