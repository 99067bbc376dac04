use clap::CommandFactory;

use super::*;
use crate::{
    cli::{Cli, Command},
    detect_local::LocalMode,
};

/// `kubeadm config print init-defaults --component-configs
/// KubeProxyConfiguration`, the KubeProxyConfiguration document (kubeadm
/// 1.32): what the `kube-proxy` ConfigMap's `config.conf` holds on a
/// kubeadm cluster whose `ClusterConfiguration` sets nothing for the proxy.
const KUBEADM_DEFAULTS: &str = include_str!("testdata/kubeadm-init-defaults.yaml");

fn parsed(text: &str) -> FileConfig {
    parse(text, "test.yaml").unwrap_or_else(|e| panic!("{e}\nin:\n{text}"))
}

fn refused(text: &str) -> String {
    match parse(text, "test.yaml") {
        Ok(config) => panic!("accepted, as {config:?}:\n{text}"),
        Err(e) => e.to_string(),
    }
}

/// kubeadm's defaults with `edit` applied: each (field, value) replaces the
/// line of that field (top level or two-space indented), `+` lines are added.
fn kubeadm_with(edits: &[(&str, &str)]) -> String {
    // A newline first, so that every field's line starts with one.
    let mut text = format!("\n{KUBEADM_DEFAULTS}");
    for (field, value) in edits {
        if let Some(line) = field.strip_prefix('+') {
            text.push_str(line);
            text.push('\n');
            continue;
        }
        let (from, indent, name) = match field.split_once('.') {
            Some((block, name)) => {
                let block_start = text
                    .find(&format!("\n{block}:\n"))
                    .unwrap_or_else(|| panic!("no block {block}"));
                (block_start, "  ", name)
            }
            None => (0, "", *field),
        };
        let prefix = format!("\n{indent}{name}: ");
        let start = from
            + text[from..]
                .find(&prefix)
                .unwrap_or_else(|| panic!("no field {field} in kubeadm's defaults"));
        let end = start + 1 + text[start + 1..].find('\n').expect("line end");
        text.replace_range(start..end, &format!("{prefix}{value}"));
    }
    text
}

#[test]
fn kubeadms_default_configuration_asks_only_for_its_kubeconfig() {
    let config = parsed(KUBEADM_DEFAULTS);
    assert_eq!(
        config.settings,
        Settings {
            kubeconfig: Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf")),
            ..Settings::default()
        },
        "every other field is kube-proxy's default (0.0.0.0 binds nothing in particular)"
    );
    assert_eq!(
        config.ignored,
        Vec::<Ignored>::new(),
        "zero values ask for nothing, so nothing is warned about"
    );
}

#[test]
fn a_kubeadm_cluster_configmap_maps_onto_the_flags() {
    let text = kubeadm_with(&[
        ("clusterCIDR", "10.244.0.0/16,fd00:10:244::/56"),
        ("metricsBindAddress", "0.0.0.0:10249"),
        ("healthzBindAddress", "127.0.0.1"),
        ("bindAddress", "192.168.1.10"),
        ("hostnameOverride", " Worker-1 "),
        ("nodePortAddresses", "[10.0.0.0/8, localhost]"),
        ("conntrack.maxPerCore", "0"),
        ("conntrack.min", "200000"),
        ("conntrack.tcpEstablishedTimeout", "24h0m0s"),
        ("conntrack.tcpCloseWaitTimeout", "1h0m0s"),
        ("conntrack.udpTimeout", "30s"),
        ("iptables.syncPeriod", "1m30s"),
        ("iptables.minSyncPeriod", "1s"),
        ("iptables.localhostNodePorts", "false"),
        ("detectLocalMode", "ClusterCIDR"),
        ("bindAddressHardFail", "true"),
    ]);
    let config = parsed(&text);
    let cidrs = |list: &[&str]| {
        Some(
            list.iter()
                .map(|c| NodePortAddress::Cidr(Cidr::parse(c).unwrap()))
                .collect(),
        )
    };
    assert_eq!(
        config.settings,
        Settings {
            cluster_cidr: Some("10.244.0.0/16,fd00:10:244::/56".parse().unwrap()),
            nodeport_addresses: cidrs(&["10.0.0.0/8", "127.0.0.0/8", "::1/128"]),
            conntrack_max_per_core: Some(0),
            conntrack_min: Some(200_000),
            conntrack_tcp_timeout_established: Some(Duration::from_hours(24)),
            conntrack_tcp_timeout_close_wait: Some(Duration::from_hours(1)),
            conntrack_udp_timeout: Some(Duration::from_secs(30)),
            node_ip: Some(crate::node_ip::NodeIps {
                v4: Some(std::net::Ipv4Addr::new(192, 168, 1, 10)),
                v6: None,
            }),
            healthz_bind_address: Some("127.0.0.1:10256".parse().unwrap()),
            metrics_bind_address: Some(Some("0.0.0.0:10249".parse().unwrap())),
            kubeconfig: Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf")),
            node_name: Some("worker-1".into()),
            min_sync_period: Some(Duration::from_secs(1)),
            sync_period: Some(Duration::from_secs(90)),
            localhost_nodeports: Some(false),
            log_format: None,
            detect_local_mode: Some(LocalMode::ClusterCidr),
            ..Settings::default()
        },
        "maxPerCore 0 leaves the table size alone, as kube-proxy does"
    );
    assert_eq!(config.ignored, Vec::<Ignored>::new());
}

#[test]
fn conntrack_size_is_kube_proxys_per_core_rule() {
    let cpus = u32::try_from(crate::kube_proxy_flags::cpus()).unwrap();
    let sizing = |per_core: &str, min: &str| {
        let settings = parsed(&kubeadm_with(&[
            ("conntrack.maxPerCore", per_core),
            ("conntrack.min", min),
        ]))
        .settings;
        (settings.conntrack_max_per_core, settings.conntrack_min)
    };
    assert_eq!(
        sizing("null", "null"),
        (None, None),
        "unset: the flags' defaults"
    );
    assert_eq!(sizing("65536", "1024"), (Some(65_536), Some(1024)));
    let connections = |per_core: &str, min: &str| {
        let (mut run, _, _) = run_args(&[]);
        let settings = parsed(&kubeadm_with(&[
            ("conntrack.maxPerCore", per_core),
            ("conntrack.min", min),
        ]))
        .settings;
        settings.apply(&mut run, &|_| false);
        run.conntrack_connections()
    };
    assert_eq!(connections("65536", "1024"), 65_536 * cpus);
    assert_eq!(
        connections("1", "131072"),
        131_072,
        "min wins over a small per-core value"
    );
    assert_eq!(
        connections("null", "1024"),
        32_768 * cpus,
        "maxPerCore defaults to kube-proxy's 32768"
    );
    assert_eq!(
        connections("0", "9999999"),
        proxy_common::MAX_CONNTRACK / 2,
        "maxPerCore 0 leaves the size alone and min with it"
    );
    let error = refused(&kubeadm_with(&[("conntrack.maxPerCore", "-1")]));
    assert!(error.contains("conntrack.maxPerCore"), "{error}");
    let error = refused(&kubeadm_with(&[("conntrack.min", "2000000000")]));
    assert!(
        error.contains("conntrack.maxPerCore") && error.contains("1073741824"),
        "too large a table: {error}"
    );
}

#[test]
fn conntrack_timeouts_are_kube_proxys() {
    let (mut run, _, _) = run_args(&[]);
    parsed(KUBEADM_DEFAULTS)
        .settings
        .apply(&mut run, &|_| false);
    assert_eq!(
        (
            run.conntrack_tcp_timeout_established,
            run.conntrack_tcp_timeout_close_wait,
            run.conntrack_udp_timeout
        ),
        (
            Duration::from_hours(24),
            Duration::from_hours(1),
            Duration::from_mins(1)
        ),
        "kubeadm's nulls and 0s are kube-proxy's defaults (UDP: 60s here)"
    );
    let settings = parsed(&kubeadm_with(&[
        ("conntrack.tcpEstablishedTimeout", "0s"),
        ("conntrack.tcpCloseWaitTimeout", "0s"),
    ]))
    .settings;
    settings.apply(&mut run, &|_| false);
    let timeouts = run.ct_timeouts();
    assert_eq!(
        (timeouts.tcp_established_ns, timeouts.tcp_close_wait_ns),
        (432_000_000_000_000, 60_000_000_000),
        "an explicit 0s leaves the kernel's defaults, as with kube-proxy"
    );
}

#[test]
fn each_detect_local_mode_is_read_with_its_field() {
    for (edits, mode, bridge, prefix) in [
        (
            vec![("detectLocalMode", "ClusterCIDR")],
            LocalMode::ClusterCidr,
            None,
            None,
        ),
        (
            vec![("detectLocalMode", "NodeCIDR")],
            LocalMode::NodeCidr,
            None,
            None,
        ),
        (
            vec![
                ("detectLocalMode", "BridgeInterface"),
                ("detectLocal.bridgeInterface", "cbr0"),
            ],
            LocalMode::BridgeInterface,
            Some("cbr0"),
            None,
        ),
        (
            vec![
                ("detectLocalMode", "InterfaceNamePrefix"),
                ("detectLocal.interfaceNamePrefix", "veth"),
            ],
            LocalMode::InterfaceNamePrefix,
            None,
            Some("veth"),
        ),
    ] {
        let config = parsed(&kubeadm_with(&edits));
        assert_eq!(config.settings.detect_local_mode, Some(mode), "{edits:?}");
        assert_eq!(config.settings.pod_bridge_interface.as_deref(), bridge);
        assert_eq!(config.settings.pod_interface_name_prefix.as_deref(), prefix);
        assert_eq!(config.ignored, Vec::<Ignored>::new(), "{edits:?}");
    }
    for (edits, field) in [
        (
            vec![("detectLocalMode", "BridgeInterface")],
            "detectLocal.bridgeInterface",
        ),
        (
            vec![
                ("detectLocalMode", "InterfaceNamePrefix"),
                ("detectLocal.bridgeInterface", "cbr0"),
            ],
            "detectLocal.interfaceNamePrefix",
        ),
        (
            vec![("detectLocal.bridgeInterface", "\"a/b\"")],
            "detectLocal.bridgeInterface",
        ),
    ] {
        let error = refused(&kubeadm_with(&edits));
        assert!(
            error.starts_with(&format!("test.yaml: {field}: ")),
            "{error}"
        );
    }
}

#[test]
fn node_port_addresses_take_primary_alone() {
    let config = parsed(&kubeadm_with(&[("nodePortAddresses", "[primary]")]));
    assert_eq!(
        config.settings.nodeport_addresses,
        Some(vec![NodePortAddress::Primary])
    );
    let error = refused(&kubeadm_with(&[(
        "nodePortAddresses",
        "[primary, 10.0.0.0/8]",
    )]));
    assert!(
        error.starts_with("test.yaml: nodePortAddresses: "),
        "{error}"
    );
}

#[test]
fn masquerade_all_is_read_from_the_modes_block() {
    let all = |edits: &[(&str, &str)]| {
        let config = parsed(&kubeadm_with(edits));
        let ignored: Vec<String> = config.ignored.into_iter().map(|i| i.field).collect();
        (config.settings.masquerade_all, ignored)
    };
    assert_eq!(
        all(&[("iptables.masqueradeAll", "true")]),
        (Some(true), vec![])
    );
    assert_eq!(
        all(&[("mode", "nftables"), ("nftables.masqueradeAll", "true")]),
        (Some(true), vec!["mode".to_owned()])
    );
    assert_eq!(
        all(&[("mode", "nftables"), ("iptables.masqueradeAll", "true")]),
        (
            None,
            vec!["iptables.masqueradeAll".to_owned(), "mode".to_owned()]
        ),
        "another mode's block"
    );
    assert_eq!(all(&[]), (None, vec![]), "false asks for nothing");
}

#[test]
fn fields_that_do_not_apply_are_warned_about_once_each_when_set() {
    let text = kubeadm_with(&[
        ("mode", "ipvs"),
        ("ipvs.strictARP", "true"),
        ("ipvs.syncPeriod", "45s"),
        ("iptables.masqueradeAll", "true"),
        ("iptables.syncPeriod", "10s"),
        ("clientConnection.qps", "50"),
        ("oomScoreAdj", "-999"),
        ("conntrack.udpStreamTimeout", "300s"),
        ("+featureGates: {Foo: true, Bar: false}", ""),
    ]);
    let config = parsed(&text);
    let fields: Vec<&str> = config.ignored.iter().map(|i| i.field.as_str()).collect();
    assert_eq!(
        fields,
        [
            "clientConnection.qps",
            "conntrack.udpStreamTimeout",
            "iptables.syncPeriod",
            "ipvs.strictARP",
            "mode",
            "oomScoreAdj",
            "featureGates.Foo",
        ],
        "each set field that does not apply, once (ipvs.syncPeriod applies in ipvs mode)"
    );
    assert_eq!(config.settings.sync_period, Some(Duration::from_secs(45)));
    assert_eq!(
        config.settings.masquerade_all,
        Some(true),
        "kube-proxy reads iptables.masqueradeAll in ipvs mode"
    );
    let mode = &config.ignored[4];
    assert_eq!(mode.value, "ipvs");
    assert!(mode.why.contains("one datapath"), "{mode:?}");
}

#[test]
fn an_unknown_field_is_warned_about_and_skipped() {
    for (text, field, value) in [
        (kubeadm_with(&[("+fooBar: 1", "")]), "fooBar", "1"),
        (
            kubeadm_with(&[("+  maxPerCor: 1", "")]),
            "winkernel.maxPerCor",
            "1",
        ),
        (
            KUBEADM_DEFAULTS.replace("  maxPerCore: null", "  maxPerCor: 0"),
            "conntrack.maxPerCor",
            "0",
        ),
        (
            KUBEADM_DEFAULTS.replace("clusterCIDR: \"\"", "clusterCidr: 10.0.0.0/8"),
            "clusterCidr",
            "10.0.0.0/8",
        ),
        (
            kubeadm_with(&[("+newBlock: {a: {b: [1, 2]}}", "")]),
            "newBlock",
            "a: b: - 1 - 2",
        ),
    ] {
        let config = parsed(&text);
        assert_eq!(
            config.ignored,
            [Ignored {
                field: field.to_owned(),
                value: value.to_owned(),
                why: UNKNOWN_FIELD,
            }],
            "{text}"
        );
        assert!(UNKNOWN_FIELD.starts_with("unknown field"));
        assert_eq!(
            config.settings.cluster_cidr, None,
            "a misspelt field sets nothing"
        );
    }
    // Several, at several depths, with the known fields still read.
    let config = parsed(&kubeadm_with(&[
        ("clusterCIDR", "10.244.0.0/16"),
        ("+zeta: true", ""),
        ("+alpha: x", ""),
        ("conntrack.udpTimeout", "5s\n  udpFoo: 1s"),
    ]));
    let fields: Vec<&str> = config.ignored.iter().map(|i| i.field.as_str()).collect();
    assert_eq!(fields, ["conntrack.udpFoo", "zeta", "alpha"]);
    assert_eq!(
        config.settings.conntrack_udp_timeout,
        Some(Duration::from_secs(5))
    );
    assert!(config.settings.cluster_cidr.is_some());
    // A known field of the wrong type is still an error.
    let error = refused(&kubeadm_with(&[("conntrack.min", "lots")]));
    assert!(error.starts_with("test.yaml: conntrack.min: "), "{error}");
}

#[test]
fn an_invalid_value_is_an_error_naming_its_field() {
    for (edit, field) in [
        (("clusterCIDR", "10.0.0.0/33"), "clusterCIDR"),
        (
            ("clusterCIDR", "10.244.0.0/16,10.245.0.0/16"),
            "clusterCIDR",
        ),
        (
            ("nodePortAddresses", "[primary, localhost]"),
            "nodePortAddresses",
        ),
        (("nodePortAddresses", "[10.0.0.0]"), "nodePortAddresses"),
        (
            ("conntrack.tcpEstablishedTimeout", "1d"),
            "conntrack.tcpEstablishedTimeout",
        ),
        (("conntrack.udpTimeout", "-5s"), "conntrack.udpTimeout"),
        (("iptables.masqueradeBit", "lots"), "iptables.masqueradeBit"),
        (("ipvs.tcpTimeout", "5 minutes"), "ipvs.tcpTimeout"),
        (("bindAddress", "node-1"), "bindAddress"),
        (("bindAddress", "::1"), "bindAddress"),
        (
            ("healthzBindAddress", "localhost:10256"),
            "healthzBindAddress",
        ),
        (
            ("metricsBindAddress", "0.0.0.0:99999"),
            "metricsBindAddress",
        ),
        (("detectLocalMode", "nodecidr"), "detectLocalMode"),
        (("mode", "userspace"), "mode"),
        (
            ("apiVersion", "kubeproxy.config.k8s.io/v1beta1"),
            "apiVersion",
        ),
        (("kind", "KubeletConfiguration"), "kind"),
        (("enableProfiling", "maybe"), "enableProfiling"),
    ] {
        let error = refused(&kubeadm_with(&[edit]));
        assert!(
            error.starts_with(&format!("test.yaml: {field}: ")),
            "{edit:?}: {error}"
        );
    }
    for (text, what) in [
        ("", "empty"),
        ("- a list", "a list"),
        ("kind: [unclosed", "not YAML"),
    ] {
        let error = refused(text);
        assert!(error.contains(what), "{text:?}: {error}");
    }
}

#[test]
fn go_durations_parse_as_go_does() {
    for (text, want) in [
        ("0", Duration::ZERO),
        ("0s", Duration::ZERO),
        ("1h0m0s", Duration::from_hours(1)),
        ("24h0m0s", Duration::from_hours(24)),
        ("1m30s", Duration::from_secs(90)),
        ("250ms", Duration::from_millis(250)),
        ("1.5h", Duration::from_mins(90)),
        ("300us", Duration::from_micros(300)),
        ("300µs", Duration::from_micros(300)),
        ("10ns", Duration::from_nanos(10)),
        ("2h45m", Duration::from_mins(165)),
    ] {
        assert_eq!(
            crate::kube_proxy_flags::parse_go_duration(text),
            Ok(want),
            "{text:?}"
        );
    }
    for bad in [
        "",
        "5",
        "1d",
        "s",
        "1..5s",
        ".s",
        "-1s",
        "1h-5m",
        "9999999999h",
    ] {
        assert!(
            crate::kube_proxy_flags::parse_go_duration(bad).is_err(),
            "{bad:?} was accepted"
        );
    }
}

fn run_args(argv: &[&str]) -> (RunArgs, LogFormat, ArgMatches) {
    let matches = Cli::command()
        .try_get_matches_from(["ebpf-proxy", "run"].iter().chain(argv))
        .expect("arguments");
    let cli = Cli::from_arg_matches(&matches).expect("arguments");
    match cli.command {
        Command::Run(run) => (*run, cli.log_format, matches),
        other => panic!("not a run command: {other:?}"),
    }
}

use clap::FromArgMatches;

#[test]
fn flags_override_the_file_and_the_file_overrides_defaults() {
    let dir = std::env::temp_dir().join(format!("ebpf-proxy-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.conf");
    std::fs::write(
        &file,
        kubeadm_with(&[
            ("clusterCIDR", "10.244.0.0/16"),
            ("metricsBindAddress", "0.0.0.0:10249"),
            ("healthzBindAddress", "127.0.0.1:10266"),
            ("iptables.syncPeriod", "45s"),
            ("logging.flushFrequency", "0\n  format: json"),
        ]),
    )
    .unwrap();
    let path = file.to_str().unwrap();

    let (mut run, mut format, matches) = run_args(&[
        "--config",
        path,
        "--cluster-cidr",
        "10.1.0.0/16",
        "--sync-period=20s",
    ]);
    let merged = merge(&mut run, &mut format, &matches)
        .expect("merge")
        .expect("a file");
    let cidr = |c: &str| Cidr::parse(c).unwrap();
    assert_eq!(*run.cluster_cidr, [cidr("10.1.0.0/16")], "the flag wins");
    assert_eq!(run.sync_period, Duration::from_secs(20), "the flag wins");
    assert_eq!(
        run.metrics_bind_address,
        Some("0.0.0.0:10249".parse().unwrap()),
        "the file overrides the default 127.0.0.1:10249"
    );
    assert_eq!(run.healthz_bind_address, "127.0.0.1:10266".parse().unwrap());
    assert_eq!(format, LogFormat::Json, "logging.format sets --log-format");
    assert_eq!(merged.overridden, ["cluster_cidr", "sync_period"]);
    if std::env::var_os("KUBECONFIG").is_none() {
        assert_eq!(
            run.kubeconfig.as_deref(),
            Some(Path::new("/var/lib/kube-proxy/kubeconfig.conf"))
        );
    }

    let (mut run, mut format, matches) = run_args(&["--config", path, "--log-format", "text"]);
    merge(&mut run, &mut format, &matches).expect("merge");
    assert_eq!(*run.cluster_cidr, [cidr("10.244.0.0/16")], "from the file");
    assert_eq!(run.sync_period, Duration::from_secs(45), "from the file");
    assert_eq!(format, LogFormat::Text, "--log-format wins");

    let (mut run, mut format, matches) = run_args(&["--config", "/nonexistent/config.conf"]);
    let error = merge(&mut run, &mut format, &matches).expect_err("no such file");
    assert!(
        error.to_string().contains("/nonexistent/config.conf"),
        "{error}"
    );
    let (mut run, mut format, matches) = run_args(&[]);
    assert!(merge(&mut run, &mut format, &matches).unwrap().is_none());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn an_ipv6_bind_address_is_the_nodes_ipv6_address() {
    let config = parsed(&kubeadm_with(&[("bindAddress", "\"fd00::10\"")]));
    assert_eq!(
        config.settings.node_ip,
        Some(crate::node_ip::NodeIps {
            v4: None,
            v6: Some("fd00::10".parse().unwrap()),
        })
    );
    let config = parsed(&kubeadm_with(&[("bindAddress", "\"::\"")]));
    assert_eq!(
        config.settings.node_ip, None,
        "unspecified: no node address"
    );
}

#[test]
fn node_ip_takes_one_address_per_family() {
    let (run, _, _) = run_args(&["--node-ip", "10.0.0.5,fd00::5"]);
    assert_eq!(
        run.node_ip,
        Some(crate::node_ip::NodeIps {
            v4: Some(std::net::Ipv4Addr::new(10, 0, 0, 5)),
            v6: Some("fd00::5".parse().unwrap()),
        })
    );
    let err = Cli::command()
        .try_get_matches_from(["ebpf-proxy", "run", "--node-ip", "10.0.0.5,10.0.0.6"])
        .expect_err("two IPv4 addresses");
    let err = err.to_string();
    assert!(
        err.contains("--node-ip") && err.contains("at most one address per family"),
        "{err}"
    );
}

#[test]
fn cluster_cidr_and_nodeport_addresses_take_both_families() {
    let (mut run, _, _) = run_args(&[
        "--cluster-cidr",
        "10.244.0.0/16,fd00:10:244::/56",
        "--nodeport-addresses",
        "192.168.0.0/16,fd00:1::/64",
    ]);
    crate::settle::settle(&mut run, &|_| false).expect("settled");
    let cidr = |c: &str| Cidr::parse(c).unwrap();
    assert_eq!(
        *run.cluster_cidr,
        [cidr("10.244.0.0/16"), cidr("fd00:10:244::/56")]
    );
    assert_eq!(
        run.nodeport_addresses,
        [cidr("192.168.0.0/16"), cidr("fd00:1::/64")]
    );
}

#[test]
fn cluster_cidr_takes_at_most_one_cidr_per_family() {
    let (run, _, _) = run_args(&[]);
    assert!(run.cluster_cidr.is_empty(), "none by default");
    for (value, family) in [
        ("10.244.0.0/16,10.245.0.0/16", "IPv4"),
        ("fd00:1::/64,10.0.0.0/8,fd00:2::/64", "IPv6"),
    ] {
        let err = Cli::command()
            .try_get_matches_from(["ebpf-proxy", "run", "--cluster-cidr", value])
            .expect_err("two CIDRs of one family")
            .to_string();
        assert!(
            err.contains("--cluster-cidr")
                && err.contains(&format!(
                    "are both {family}: give at most one CIDR per family"
                )),
            "{value}: {err}"
        );
    }
    let err = Cli::command()
        .try_get_matches_from(["ebpf-proxy", "run", "--cluster-cidr", "10.0.0.0/8,pods"])
        .expect_err("not a CIDR")
        .to_string();
    assert!(
        err.contains("--cluster-cidr") && err.contains("\"pods\" is not a CIDR"),
        "{err}"
    );
}
