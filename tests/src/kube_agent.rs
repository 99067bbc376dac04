//! The agent on the Kubernetes API source: `ebpf-proxy run --master URL` in a
//! node namespace, against the loopback API server the test runs there
//! (tests/apiserver/), with its own bpffs root; stopped, cleaned up and its log
//! printed (when the test failed) on drop. ([`crate::agent::Agent`] always
//! passes `--manifests`.)

use std::{
    fs::{self, File},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::Duration,
};

use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::{
    NotYet,
    agent::{self, HEALTHZ},
    netns::{NetNs, command_in, run_in, unique_stem},
    run_cmd,
};

/// How long the agent may take from start to a healthy /healthz.
const READY_TIMEOUT: Duration = Duration::from_mins(1);
/// How long the agent may take to exit after SIGTERM before it is killed.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// `ebpf-proxy run --master URL` in a namespace, stopped and cleaned up on drop.
pub struct KubeAgent {
    child: Option<Child>,
    bin: PathBuf,
    netns_path: PathBuf,
    node_name: String,
    master: String,
    extra_args: Vec<String>,
    bpf_root: PathBuf,
    log_path: PathBuf,
}

impl KubeAgent {
    /// The agent on `master`, in `node`'s namespace and named after it; returns
    /// once it is healthy (panics if it is not within a minute).
    pub fn start(node: &NetNs, master: &str) -> KubeAgent {
        Self::start_with(node, master, &[])
    }

    /// [`KubeAgent::start`] with `extra_args` on its command line.
    pub fn start_with(node: &NetNs, master: &str, extra_args: &[&str]) -> KubeAgent {
        let stem = unique_stem();
        let mut agent = KubeAgent {
            child: None,
            bin: agent::binary().expect("the agent binary"),
            netns_path: node.path(),
            node_name: node.name().to_owned(),
            master: master.to_owned(),
            extra_args: extra_args.iter().map(ToString::to_string).collect(),
            // The harness's prefix, so its stale-state sweep knows these.
            bpf_root: PathBuf::from(format!("/sys/fs/bpf/ebpf-proxy-test-{stem}")),
            log_path: std::env::temp_dir().join(format!("{stem}-kube-agent.log")),
        };
        agent.spawn();
        agent.wait_healthy(READY_TIMEOUT);
        agent
    }

    /// Starts the agent process, its log written afresh (at `RUST_LOG=info`
    /// unless the environment says otherwise).
    fn spawn(&mut self) {
        let log = File::create(&self.log_path).expect("agent log file");
        let mut cmd = command_in(&self.netns_path, &self.bin);
        cmd.arg("run")
            .arg("--master")
            .arg(&self.master)
            .arg("--bpf-root")
            .arg(&self.bpf_root)
            .arg("--healthz-bind-address")
            .arg(HEALTHZ.to_string())
            .arg("--node-name")
            .arg(&self.node_name)
            .args(&self.extra_args)
            .env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env("NO_COLOR", "1")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .process_group(0);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        self.child = Some(cmd.spawn().expect("start the agent"));
    }

    /// Kills the agent as a crash would (SIGKILL: nothing tidied up) and
    /// starts another on the same pins; returns once it is healthy.
    pub fn restart(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            child.wait().expect("wait for the killed agent");
        }
        self.spawn();
        self.wait_healthy(READY_TIMEOUT);
    }

    /// Waits until /healthz answers 200; panics with the agent's log if it
    /// does not within `timeout`, or at once if the agent exits.
    #[track_caller]
    pub fn wait_healthy(&mut self, timeout: Duration) {
        let child = self.child.as_mut().expect("a running agent");
        match agent::wait_healthy(child, &self.netns_path, timeout) {
            Ok(_) => {}
            Err(NotYet::Never(why)) => panic!("{why}:\n{}", self.log()),
            Err(NotYet::Again(last)) => panic!(
                "the agent was not healthy after {timeout:?} (last /healthz: {last}):\n{}",
                self.log()
            ),
        }
    }

    /// What `GET /healthz` answers now: `HTTP 200`, or the error.
    pub fn healthz(&self) -> String {
        match run_in(&self.netns_path, || agent::http_status(HEALTHZ, "/healthz")) {
            Ok(Ok(code)) => format!("HTTP {code}"),
            Ok(Err(e)) | Err(e) => format!("{e:#}"),
        }
    }

    /// Everything the agent printed so far (since its last start).
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_path)
            .unwrap_or_else(|e| format!("(cannot read {}: {e})", self.log_path.display()))
    }

    /// The agent's process id.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("a running agent").id()
    }

    /// The agent's bpffs root.
    pub fn bpf_root(&self) -> &Path {
        &self.bpf_root
    }

    /// The network namespace the agent runs in (its node's).
    pub fn netns_path(&self) -> &Path {
        &self.netns_path
    }

    /// `ebpf-proxy status ARGS` on this agent's pins, run in its node's
    /// namespace as an operator runs it on the node.
    pub fn status(&self, args: &[&str]) -> anyhow::Result<String> {
        run_cmd(
            command_in(&self.netns_path, &self.bin)
                .arg("status")
                .arg("--bpf-root")
                .arg(&self.bpf_root)
                .args(args),
        )
    }
}

impl Drop for KubeAgent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM);
            if let Err(still) = agent::wait_exit(&mut child, EXIT_TIMEOUT) {
                eprintln!(
                    "warning: the agent ignored SIGTERM for {EXIT_TIMEOUT:?} ({still}); killing it"
                );
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let mut cleanup = command_in(&self.netns_path, &self.bin);
        cleanup.arg("cleanup").arg("--bpf-root").arg(&self.bpf_root);
        if let Err(e) = run_cmd(&mut cleanup) {
            eprintln!("warning: agent cleanup failed: {e:#}");
        }
        agent::leave_nothing_behind(&self.bpf_root, &self.log_path, || self.log());
    }
}
