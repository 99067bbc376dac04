use std::{ffi::OsString, path::PathBuf};

use clap::{CommandFactory, FromArgMatches};

use super::*;
use crate::cli::{Cli, Command};
use crate::{
    cli::RunArgs,
    detect_local::DetectLocal,
    settle::{Settled, given, settle},
};

/// `argv` as main takes it: rewritten, parsed, the file merged, settled.
fn started(argv: &[&str]) -> Result<(RunArgs, Settled), String> {
    let command = Cli::command();
    let flags = crate::kube_proxy_argv::run_flags(&command);
    let argv = crate::kube_proxy_argv::rewrite(argv.iter().map(OsString::from).collect(), &|n| {
        flags.iter().any(|f| f == n)
    });
    let matches = command
        .try_get_matches_from(argv)
        .map_err(|e| e.to_string())?;
    let mut cli = Cli::from_arg_matches(&matches).map_err(|e| e.to_string())?;
    let Command::Run(mut run) = cli.command else {
        return Err(format!("not a run command: {:?}", cli.command));
    };
    crate::config::merge(&mut run, &mut cli.log_format, &matches).map_err(|e| e.to_string())?;
    let settled = settle(&mut run, &|id| given(&matches, id)).map_err(|e| e.to_string())?;
    Ok((*run, settled))
}

fn cidr(text: &str) -> Cidr {
    Cidr::parse(text).unwrap()
}

fn cpus32() -> u32 {
    u32::try_from(cpus()).unwrap()
}

#[test]
fn kubeadms_command_line_reads_its_configmap() {
    let dir = std::env::temp_dir().join(format!("ebpf-proxy-kubeadm-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("config.conf");
    std::fs::write(
        &file,
        include_str!("../config/testdata/kubeadm-init-defaults.yaml")
            .replace("clusterCIDR: \"\"", "clusterCIDR: 10.244.0.0/16"),
    )
    .unwrap();
    let config = format!("--config={}", file.display());
    let (run, settled) = started(&[
        "/usr/local/bin/kube-proxy",
        &config,
        "--hostname-override=Node-A ",
    ])
    .expect("kubeadm's command line");
    assert_eq!(
        run.node_name.as_deref(),
        Some("node-a"),
        "trimmed, lowercased"
    );
    assert_eq!(*run.cluster_cidr, [cidr("10.244.0.0/16")]);
    if std::env::var_os("KUBECONFIG").is_none() {
        assert_eq!(
            run.kubeconfig,
            Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig.conf"))
        );
    }
    assert_eq!(
        run.conntrack_connections(),
        (32_768 * cpus32()).max(131_072)
    );
    assert_eq!(run.sync_period, Duration::from_secs(30));
    assert_eq!(run.kube_proxy_ignored, IgnoredFlags::default());
    assert_eq!(settled, Settled::default());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn kops_command_line_sizes_conntrack_and_lists_what_it_ignores() {
    let (run, settled) = started(&[
        "kube-proxy",
        "--v=2",
        "--oom-score-adj=-998",
        "--conntrack-max-per-core=131072",
        "--conntrack-min=131072",
        "--proxy-mode=iptables",
        "--cluster-cidr=100.96.0.0/11",
        "--master=https://api.internal",
        "--kubeconfig=/var/lib/kube-proxy/kubeconfig",
        "--hostname-override=ip-172-20-1-1.EC2.internal",
        "--log-file=/var/log/kube-proxy.log",
        "--also-stdout",
        "--logtostderr=false",
    ])
    .expect("kOps' command line");
    assert_eq!(run.node_name.as_deref(), Some("ip-172-20-1-1.ec2.internal"));
    assert_eq!(*run.cluster_cidr, [cidr("100.96.0.0/11")]);
    assert_eq!(run.master.as_deref(), Some("https://api.internal"));
    assert_eq!(
        run.kubeconfig,
        Some(PathBuf::from("/var/lib/kube-proxy/kubeconfig"))
    );
    assert_eq!(run.conntrack_connections(), 131_072 * cpus32());
    assert_eq!(run.conntrack_entries(), 2 * 131_072 * cpus32());
    assert_eq!(run.proxy_mode.as_deref(), Some("iptables"));
    assert_eq!(
        run.kube_proxy_ignored.0,
        [
            ("oom-score-adj", "-998".to_owned()),
            ("v", "2".to_owned()),
            ("log-file", "/var/log/kube-proxy.log".to_owned()),
            ("logtostderr", "false".to_owned()),
            ("also-stdout", "true".to_owned()),
        ]
    );
    assert_eq!(
        run.kube_proxy_ignored.summary(),
        "--oom-score-adj=-998, --v=2, --log-file=/var/log/kube-proxy.log, --logtostderr=false, --also-stdout=true"
    );
    assert_eq!(settled, Settled::default());
}

#[test]
fn k3s_command_line_leaves_conntrack_alone() {
    let (run, settled) = started(&[
        "kube-proxy",
        "--proxy-mode=iptables",
        "--healthz-bind-address=127.0.0.1",
        "--conntrack-max-per-core=0",
        "--conntrack-tcp-timeout-established=0s",
        "--conntrack-tcp-timeout-close-wait=0s",
        "--cluster-cidr=10.42.0.0/16",
        "--kubeconfig=/var/lib/rancher/k3s/agent/kubeproxy.kubeconfig",
        "--hostname-override=k3s-agent-1",
    ])
    .expect("k3s' command line");
    assert_eq!(run.node_name.as_deref(), Some("k3s-agent-1"));
    assert_eq!(run.healthz_bind_address, "127.0.0.1:10256".parse().unwrap());
    assert_eq!(*run.cluster_cidr, [cidr("10.42.0.0/16")]);
    assert_eq!(
        run.conntrack_connections(),
        proxy_common::MAX_CONNTRACK / 2,
        "per core 0: the size is left as it is"
    );
    let timeouts = run.ct_timeouts();
    assert_eq!(
        (timeouts.tcp_established_ns, timeouts.tcp_close_wait_ns),
        (
            Duration::from_hours(120).as_nanos() as u64,
            Duration::from_mins(1).as_nanos() as u64
        ),
        "0s leaves the kernel's timeouts"
    );
    assert!(run.kube_proxy_ignored.0.is_empty());
    assert_eq!(settled, Settled::default());
}

#[test]
fn kube_proxys_defaults_are_the_flags_defaults() {
    let (run, _) = started(&["ebpf-proxy", "run"]).unwrap();
    assert_eq!(
        run.conntrack_tcp_timeout_established,
        Duration::from_hours(24)
    );
    assert_eq!(
        run.conntrack_tcp_timeout_close_wait,
        Duration::from_hours(1)
    );
    assert_eq!(run.conntrack_udp_timeout, Duration::from_mins(1));
    assert_eq!(
        (run.conntrack_max_per_core, run.conntrack_min),
        (32_768, 131_072)
    );
    assert_eq!(
        run.conntrack_connections(),
        (32_768 * cpus32()).max(131_072)
    );
    assert_eq!(run.detect_local, DetectLocal::ClusterCidr);
    assert!(!run.masquerade_all && !run.nodeport_primary && run.localhost_nodeports);
    let (run, _) = started(&[
        "ebpf-proxy",
        "run",
        "--conntrack-max=2048",
        "--conntrack-min=9",
    ])
    .unwrap();
    assert_eq!(
        run.conntrack_connections(),
        2048,
        "--conntrack-max overrides the sizing"
    );
    let error = started(&[
        "ebpf-proxy",
        "run",
        "--conntrack-max-per-core=1",
        "--conntrack-min=2",
    ])
    .unwrap_err();
    assert!(error.contains("--conntrack-max-per-core"), "{error}");
}

#[test]
fn go_flag_syntax_is_taken() {
    let (run, _) = started(&[
        "kube-proxy",
        "-v=4",
        "--masquerade-all",
        "--iptables-localhost-nodeports=false",
        "--alsologtostderr=true",
        "--log_dir",
        "/var/log",
        "-skip_headers",
        "--feature-gates=A=true,B=false",
        "--min-sync-period=1m30s",
    ])
    .unwrap();
    assert!(run.masquerade_all);
    assert!(!run.localhost_nodeports);
    assert_eq!(run.min_sync_period, Duration::from_secs(90));
    let (again, _) = started(&[
        "kube-proxy",
        "--v=2",
        "-v=4",
        "--cluster-cidr=10.0.0.0/8",
        "--cluster-cidr=10.1.0.0/16",
        "--nodeport-addresses=10.0.0.0/8",
        "--nodeport-addresses=fd00::/64",
    ])
    .expect("a flag given again");
    assert_eq!(
        again.kube_proxy_ignored.0,
        [("v", "4".to_owned())],
        "the last wins"
    );
    assert_eq!(*again.cluster_cidr, [cidr("10.1.0.0/16")]);
    assert_eq!(
        again.nodeport_addresses,
        [cidr("10.0.0.0/8"), cidr("fd00::/64")],
        "a list flag appends, as pflag's string slices"
    );
    assert_eq!(
        run.kube_proxy_ignored.names(),
        [
            "feature-gates",
            "v",
            "alsologtostderr",
            "log-dir",
            "skip-headers"
        ]
    );
    for (flag, refused) in [
        ("--oom-score-adj=-1001", "--oom-score-adj"),
        ("--masquerade-all=yes", "--masquerade-all"),
        ("--feature-gates=A=maybe", "--feature-gates"),
        ("--iptables-masquerade-bit=32", "--iptables-masquerade-bit"),
        ("--config-sync-period=15", "--config-sync-period"),
        ("--proxy-mode=userspace", "--proxy-mode"),
        ("--stderrthreshold=LOUD", "--stderrthreshold"),
        ("--hostname-override= ", "--node-name"),
    ] {
        let error = started(&["kube-proxy", flag]).expect_err(flag);
        assert!(error.contains(refused), "{flag}: {error}");
    }
}

#[test]
fn mode_picks_the_sync_periods() {
    let (run, _) = started(&[
        "kube-proxy",
        "--iptables-sync-period=1m0s",
        "--iptables-min-sync-period=250ms",
        "--ipvs-sync-period=2m",
    ])
    .unwrap();
    assert_eq!(
        (run.sync_period, run.min_sync_period),
        (Duration::from_mins(1), Duration::from_millis(250)),
        "iptables, kube-proxy's default mode"
    );
    let (run, _) = started(&[
        "kube-proxy",
        "--proxy-mode=ipvs",
        "--iptables-sync-period=1m0s",
        "--ipvs-sync-period=2m",
    ])
    .unwrap();
    assert_eq!(run.sync_period, Duration::from_mins(2));
    let (run, _) = started(&[
        "kube-proxy",
        "--iptables-sync-period=1m",
        "--sync-period=5s",
    ])
    .unwrap();
    assert_eq!(run.sync_period, Duration::from_secs(5), "ours, given, wins");
}

#[test]
fn bind_address_is_the_nodes_address() {
    let (run, _) = started(&["kube-proxy", "--bind-address=10.0.0.7"]).unwrap();
    assert_eq!(run.node_ip.unwrap().v4, Some("10.0.0.7".parse().unwrap()));
    let (run, _) = started(&["kube-proxy", "--bind-address=0.0.0.0"]).unwrap();
    assert_eq!(run.node_ip, None, "unspecified: nothing");
    let (run, _) = started(&[
        "kube-proxy",
        "--bind-address=10.0.0.7",
        "--node-ip=10.0.0.8",
    ])
    .unwrap();
    assert_eq!(
        run.node_ip.unwrap().v4,
        Some("10.0.0.8".parse().unwrap()),
        "--node-ip wins"
    );
}

#[test]
fn nodeport_addresses_take_primary_alone() {
    let (run, settled) = started(&[
        "kube-proxy",
        "--nodeport-addresses=primary",
        "--node-ip=10.0.0.5,fd00::5",
    ])
    .unwrap();
    assert!(run.nodeport_primary);
    assert_eq!(
        run.nodeport_addresses,
        [cidr("10.0.0.5/32"), cidr("fd00::5/128")]
    );
    assert_eq!(settled, Settled::default());
    let (run, settled) = started(&["kube-proxy", "--nodeport-addresses", "primary"]).unwrap();
    assert!(run.nodeport_primary && run.nodeport_addresses.is_empty());
    assert_eq!(settled.not_yet.len(), 1, "{settled:?}");
    let (run, _) = started(&["kube-proxy", "--nodeport-addresses=10.0.0.0/8,fd00::/64"]).unwrap();
    assert!(!run.nodeport_primary);
    assert_eq!(
        run.nodeport_addresses,
        [cidr("10.0.0.0/8"), cidr("fd00::/64")]
    );
    let error = started(&["kube-proxy", "--nodeport-addresses=primary,10.0.0.0/8"]).unwrap_err();
    assert!(error.contains("--nodeport-addresses"), "{error}");
}

#[test]
fn each_detect_local_mode_is_taken_and_warned_about_until_the_datapath_has_it() {
    for (argv, want) in [
        (vec![], DetectLocal::ClusterCidr),
        (
            vec!["--detect-local-mode=ClusterCIDR"],
            DetectLocal::ClusterCidr,
        ),
        (vec!["--detect-local-mode=NodeCIDR"], DetectLocal::NodeCidr),
        (
            vec![
                "--detect-local-mode=BridgeInterface",
                "--pod-bridge-interface=cbr0",
            ],
            DetectLocal::BridgeInterface("cbr0".into()),
        ),
        (
            vec![
                "--detect-local-mode=InterfaceNamePrefix",
                "--pod-interface-name-prefix=veth",
            ],
            DetectLocal::InterfaceNamePrefix("veth".into()),
        ),
    ] {
        let mut full = vec!["kube-proxy"];
        full.extend(&argv);
        let (run, settled) = started(&full).unwrap();
        assert_eq!(run.detect_local, want, "{argv:?}");
        assert_eq!(settled.not_yet.len(), 0, "{argv:?}: {settled:?}");
    }
    let error = started(&["kube-proxy", "--detect-local-mode=BridgeInterface"]).unwrap_err();
    assert!(error.contains("--pod-bridge-interface"), "{error}");
    let error = started(&["kube-proxy", "--detect-local-mode=Bridge"]).unwrap_err();
    assert!(error.contains("--detect-local-mode"), "{error}");
}

#[test]
fn masquerade_all_is_taken_and_carried_out() {
    let (run, settled) = started(&["kube-proxy", "--masquerade-all=true"]).unwrap();
    assert!(run.masquerade_all);
    assert!(
        settled.not_yet.is_empty(),
        "the datapath SNATs every flow with it: {settled:?}"
    );
}

#[test]
fn every_ignored_flag_is_taken_with_a_value_of_its_kind() {
    for flag in IGNORED {
        let value = match flag.kind {
            Kind::Bool => "true",
            Kind::Int(min, _) => &min.to_string(),
            Kind::Uint => "1800",
            Kind::Float => "5.5",
            Kind::Duration => "1m30s",
            Kind::Text => "x",
            Kind::Cidrs => "10.0.0.0/8,fd00::/64",
            Kind::Gates => "A=true",
            Kind::Severity => "ERROR",
        };
        let arg = format!("--{}={value}", flag.name);
        let (run, _) = started(&["kube-proxy", &arg]).unwrap_or_else(|e| panic!("{arg}: {e}"));
        assert_eq!(run.kube_proxy_ignored.names(), [flag.name], "{arg}");
    }
}
