use anyhow::Context;
use clap::{CommandFactory, FromArgMatches};
use proxy_userspace::{
    agent::{self, AgentConfig, SourceConfig},
    cli::{Cli, Command},
    config,
    datapath::{self, PinLayout},
    logging,
    model::ModelConfig,
    privileges, status,
};

fn main() -> anyhow::Result<()> {
    // One malloc arena: the agent is a handful of threads doing little
    // allocation after the initial listing, and per-thread arenas would keep
    // that listing's freed memory resident several times over.
    // SAFETY: called before any thread exists.
    unsafe { libc::mallopt(libc::M_ARENA_MAX, 1) };
    let matches = Cli::command().get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let merged = match &mut cli.command {
        Command::Run(args) => config::merge(args, &mut cli.log_format, &matches)?,
        _ => None,
    };
    logging::init(cli.log_format)?;
    if let Some(merged) = merged {
        merged.log();
    }
    match cli.command {
        Command::Run(args) => {
            privileges::check()?;
            let ct_timeouts = args.ct_timeouts();
            let conntrack_entries = args.conntrack_entries();
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
                model: ModelConfig::default(),
                localhost_nodeports: args.localhost_nodeports
                    && agent::serves_loopback(&args.nodeport_addresses),
                nodeport_addresses: args.nodeport_addresses,
                cluster_cidrs: args.cluster_cidr.to_vec(),
                xdp_mode: args.xdp_mode,
                node_ip: args.node_ip.unwrap_or_default(),
                cgroup_root: args
                    .cgroup_root
                    .or_else(datapath::host::default_cgroup_root),
                datapath_log: args.datapath_log,
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
        }
        Command::Cleanup(args) => {
            let bpf_root = &args.pins.bpf_root;
            let pins = PinLayout::new(bpf_root);
            let removed = datapath::cleanup(&pins)
                .with_context(|| format!("cleaning up {}", bpf_root.display()))?;
            println!(
                "removed {} pins under {}",
                removed.len(),
                bpf_root.display()
            );
        }
        Command::Status(args) => {
            let pins = PinLayout::new(&args.pins.bpf_root);
            let render = if args.flows {
                status::render_with_flows
            } else {
                status::render
            };
            let text = render(&pins).with_context(|| {
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
    }
    Ok(())
}
