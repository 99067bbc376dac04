use anyhow::{Context, bail};
use clap::{CommandFactory, FromArgMatches};
use proxy_userspace::{
    adopt,
    agent::{self, AgentConfig, SourceConfig},
    cli::{Cli, Command, RunArgs, StatusOutput},
    config,
    datapath::{self, PinLayout},
    heap, kube_proxy_argv, logging,
    planner::node::SocketLb,
    privileges, settle, status, trace,
};

/// The command line, read as kube-proxy's too (the binary called as
/// kube-proxy, Go's flag spellings), with `run`'s configuration file merged
/// and its kube-proxy flags settled.
fn command_line() -> anyhow::Result<(Cli, Option<config::Merged>, Option<settle::Settled>)> {
    let command = Cli::command();
    let run_flags = kube_proxy_argv::run_flags(&command);
    let argv = kube_proxy_argv::rewrite(std::env::args_os().collect(), &|name| {
        run_flags.binary_search_by(|f| f.as_str().cmp(name)).is_ok()
    });
    let matches = command.get_matches_from(argv);
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let Command::Run(args) = &mut cli.command else {
        return Ok((cli, None, None));
    };
    let merged = config::merge(args, &mut cli.log_format, &matches)?;
    let settled = settle::settle(args, &|id| settle::given(&matches, id))?;
    Ok((cli, merged, Some(settled)))
}

/// One line for the kube-proxy flags that mean nothing here, one for those
/// taken that the datapath does not carry out yet.
fn warn_kube_proxy_flags(args: &RunArgs, settled: Option<settle::Settled>) {
    if !args.kube_proxy_ignored.0.is_empty() {
        tracing::warn!(
            flags = %args.kube_proxy_ignored.summary(),
            "kube-proxy flags without a meaning here, ignored (docs/operations.md, \"kube-proxy's flags\")"
        );
    }
    if let Some(settled) = settled.filter(|s| !s.not_yet.is_empty()) {
        tracing::warn!(
            settings = %settled.not_yet.join("; "),
            "taken, but not carried out by the datapath yet"
        );
    }
}

fn main() -> anyhow::Result<()> {
    heap::tune();
    let (cli, merged, settled) = command_line()?;
    logging::init(cli.log_format)?;
    if let Some(merged) = merged {
        merged.log();
    }
    if let Command::Run(args) = &cli.command {
        warn_kube_proxy_flags(args, settled);
    }
    match cli.command {
        Command::Run(args) => run(*args)?,
        Command::Cleanup(args) => {
            let bpf_root = &args.pins.bpf_root;
            let pins = PinLayout::new(bpf_root);
            if args.handoff {
                let done = adopt::handoff::hand_back(&pins)
                    .with_context(|| format!("handing back {}", bpf_root.display()))?;
                for (flow, why) in &done.failed {
                    eprintln!("not handed back: {flow}: {why}");
                }
                println!(
                    "handed {} flows to the kernel's conntrack ({} not handed back, {} TCP handshakes under way left to their retransmits); removed {} pins under {}",
                    done.flows,
                    done.failed.len(),
                    done.unanswered,
                    done.pins,
                    bpf_root.display()
                );
            } else {
                let removed = datapath::cleanup(&pins)
                    .with_context(|| format!("cleaning up {}", bpf_root.display()))?;
                println!(
                    "removed {} pins under {}",
                    removed.len(),
                    bpf_root.display()
                );
            }
        }
        Command::Status(args) => {
            let pins = PinLayout::new(&args.pins.bpf_root);
            let options = status::Options {
                json: args.output == StatusOutput::Json,
                flows: args.flows,
                service: args.service.clone(),
            };
            let text = status::render(&pins, &options).with_context(|| {
                format!(
                    "reading the maps pinned under {}",
                    args.pins.bpf_root.display()
                )
            })?;
            print!("{text}");
        }
        Command::DatapathLog(args) => {
            let pins = PinLayout::new(&args.pins.bpf_root);
            datapath::event_log::set_level(&pins, args.level).with_context(|| {
                format!(
                    "setting the datapath log level under {}",
                    args.pins.bpf_root.display()
                )
            })?;
            println!("datapath log level: {}", args.level.name());
        }
        Command::Trace(args) => {
            let pins = PinLayout::new(&args.pins.bpf_root);
            let filter = trace::Filter {
                service: args.service.clone(),
                client: args.client,
                node_port: args.node_port,
            };
            let json = args.output == StatusOutput::Json;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the async runtime")?;
            runtime
                .block_on(trace::run(&pins, &filter, json, &mut std::io::stdout()))
                .with_context(|| {
                    format!(
                        "tracing the datapath under {}",
                        args.pins.bpf_root.display()
                    )
                })?;
        }
    }
    Ok(())
}

/// `ebpf-proxy run`: the agent, until it is stopped.
fn run(args: RunArgs) -> anyhow::Result<()> {
    if let Some(file) = &args.write_config_to {
        bail!(
            "--write-config-to {}: ebpf-proxy writes no configuration of defaults; \
             kubeadm's `kube-proxy` ConfigMap is read as it is with --config",
            file.display()
        );
    }
    privileges::check()?;
    if args.init_only {
        tracing::info!("--init-only: nothing to prepare ahead of the agent; exiting");
        return Ok(());
    }
    for (flag, given) in args.raised_timeouts() {
        tracing::warn!(
            flag,
            given = ?given,
            raised_to = ?proxy_userspace::cli::MIN_IDLE_TIMEOUT,
            "idle timeout raised: the datapath refreshes a flow's entries once a second, so a \
             shorter timeout would expire flows still sending"
        );
    }
    let ct_timeouts = args.ct_timeouts();
    let conntrack_entries = args.conntrack_entries();
    let ct_source_share = args.ct_source_share();
    let model = args.model_config();
    let lb = args.lb_config();
    let config = AgentConfig {
        bpf_root: args.pins.bpf_root,
        source: match args.manifests {
            Some(path) => SourceConfig::Manifests(path),
            None => SourceConfig::Kube {
                kubeconfig: args.kubeconfig,
                master: args.master,
            },
        },
        interfaces: args.interfaces,
        healthz: args.healthz_bind_address,
        metrics: args.metrics_bind_address,
        node_name: args.node_name.unwrap_or_else(agent::default_node_name),
        min_sync_period: args.min_sync_period,
        sync_period: args.sync_period,
        ct_timeouts,
        conntrack_entries,
        service_counters: args.service_counters,
        lb,
        ct_source_share,
        model,
        localhost_nodeports: args.localhost_nodeports
            && agent::serves_loopback(&args.nodeport_addresses),
        nodeport_addresses: args.nodeport_addresses,
        cluster_cidrs: args.cluster_cidr.to_vec(),
        service_cidrs: args.service_cluster_ip_range.to_vec(),
        detect_local: args.detect_local.clone(),
        masquerade_all: args.masquerade_all,
        lb_mode: args.lb_mode,
        socket_lb: if args.socket_lb_pods {
            SocketLb::NodeAndPods
        } else {
            SocketLb::Node
        },
        host_routing: args.host_routing,
        xdp_mode: args.xdp_mode,
        xdp_interfaces: args.xdp_interfaces,
        node_ip: args.node_ip.unwrap_or_default(),
        cgroup_root: args
            .cgroup_root
            .or_else(datapath::host::default_cgroup_root),
        datapath_log: args.datapath_log,
        keep_kube_proxy_rules: args.keep_kube_proxy_rules,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    runtime
        .block_on(agent::run(config))
        .map_err(|e| match privileges::explain(&e) {
            Some(refused) => anyhow::Error::new(refused),
            None => e.into(),
        })?;
    Ok(())
}
