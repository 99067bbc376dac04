//! The fixture shared by the integration tests and `cargo xtask run`'s demo: a routed
//! node with a client pod and backend pods that each run a TCP and a UDP server, a
//! manifest directory, and (once started) the agent.

use std::{net::Ipv4Addr, path::Path};

use anyhow::{Context, Result, anyhow};

use crate::{
    agent::Agent,
    manifest::ManifestDir,
    require_root,
    servers::{TcpServer, UdpServer},
    topology::{Pod, Topology, one_node},
};

/// Everything one test (or the demo) needs; dropped in a safe order: the agent while
/// its namespace exists, then the servers, the manifests and the namespaces.
#[derive(Debug)]
pub struct Sandbox {
    agent: Option<Agent>,
    tcp: Vec<TcpServer>,
    udp: Vec<UdpServer>,
    manifests: ManifestDir,
    topology: Topology,
}

impl Sandbox {
    /// A routed topology with `clients` and `backends` as pods; each backend answers
    /// on TCP `tcp_port` and UDP `udp_port` under its pod name.
    pub fn new(
        clients: &[(&str, Ipv4Addr)],
        backends: &[(&str, Ipv4Addr)],
        tcp_port: u16,
        udp_port: u16,
    ) -> Result<Sandbox> {
        if clients.is_empty() {
            return Err(anyhow!("a sandbox needs a client"));
        }
        let mut pods = clients.to_vec();
        pods.extend_from_slice(backends);
        let topology = Topology::routed(&pods).context("build the routed topology")?;
        let manifests = ManifestDir::create(topology.stem())?;
        let mut sandbox = Sandbox {
            agent: None,
            tcp: Vec::new(),
            udp: Vec::new(),
            manifests,
            topology,
        };
        for (name, _) in backends {
            let ns = &sandbox.topology.pod(name).ns;
            sandbox.tcp.push(TcpServer::start(ns, name, tcp_port)?);
            sandbox.udp.push(UdpServer::start(ns, name, udp_port)?);
        }
        Ok(sandbox)
    }

    /// The one-node world ([`one_node`]): `clients` and every backend as pods, `test/web`
    /// on all three backends behind [`one_node::CLUSTER_IP`], and the agent on it with
    /// `extra_args`, healthy.
    pub fn serving_web(clients: &[(&str, Ipv4Addr)], extra_args: &[&str]) -> Result<Sandbox> {
        require_root()?;
        let mut sandbox = Sandbox::new(
            clients,
            &one_node::BACKENDS,
            one_node::TCP_PORT,
            one_node::UDP_PORT,
        )?;
        sandbox.manifests.write(
            "web.yaml",
            &one_node::web_service(one_node::CLUSTER_IP).yaml(Some(&one_node::backend_ips())),
        )?;
        sandbox.start_agent_with(extra_args)?;
        Ok(sandbox)
    }

    /// Starts the agent in the node on `manifests` (a file or directory) and waits
    /// until it is healthy.
    pub fn start_agent(&mut self, manifests: &Path) -> Result<&mut Agent> {
        if self.agent.is_some() {
            return Err(anyhow!("the agent is already running"));
        }
        let agent = Agent::start(&self.topology.node, manifests)?;
        Ok(self.agent.insert(agent))
    }

    /// Starts the agent on this sandbox's own manifest directory.
    pub fn start_agent_on_manifests(&mut self) -> Result<&mut Agent> {
        self.start_agent_with(&[])
    }

    /// [`Sandbox::start_agent_on_manifests`] with extra arguments for
    /// `ebpf-proxy run`.
    pub fn start_agent_with(&mut self, extra_args: &[&str]) -> Result<&mut Agent> {
        if self.agent.is_some() {
            return Err(anyhow!("the agent is already running"));
        }
        let agent = Agent::start_with(&self.topology.node, self.manifests.path(), extra_args)?;
        Ok(self.agent.insert(agent))
    }

    /// Another agent on this sandbox's node, manifests and bpf root, with
    /// `extra_args` (a restart, an upgrade, a new flag), once it is healthy.
    /// Dropping it cleans the root up, as for the first one.
    pub fn agent_on_the_same_root(&self, extra_args: &[&str]) -> Result<Agent> {
        Agent::start_on_root(
            &self.topology.node,
            self.manifests.path(),
            extra_args,
            self.agent().bpf_root().to_owned(),
        )
    }

    /// The agent; panics if none was started (a bug in the caller).
    pub fn agent(&self) -> &Agent {
        self.agent.as_ref().expect("start_agent first")
    }

    /// The agent's datapath counter `name`; panics, saying why, if it cannot be read.
    pub fn counter(&self, name: &str) -> u64 {
        self.agent()
            .counter(name)
            .unwrap_or_else(|e| panic!("counter {name}: {e:#}"))
    }

    /// The agent, to stop it or clean up; panics if none was started.
    pub fn agent_mut(&mut self) -> &mut Agent {
        self.agent.as_mut().expect("start_agent first")
    }

    pub fn manifests(&self) -> &ManifestDir {
        &self.manifests
    }

    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The first client pod.
    pub fn client(&self) -> &Pod {
        &self.topology.pods()[0]
    }

    /// The pod called `name`; panics if there is none.
    pub fn pod(&self, name: &str) -> &Pod {
        self.topology.pod(name)
    }

    /// Adds a pod (without servers) to the running sandbox: an interface that appears
    /// after the agent started.
    pub fn add_pod(&mut self, name: &str, ip: Ipv4Addr) -> Result<&Pod> {
        self.topology.add_pod(name, ip)
    }
}
