//! The agent under test: `ebpf-proxy run` started in a node namespace with its own
//! bpffs root, its health endpoint polled until the first sync is in the maps, and
//! everything (process, attachments, pins) removed on drop.

use std::{
    ffi::OsStr,
    fs::{self, File},
    io::{Read, Write},
    net::{SocketAddr, SocketAddrV4, TcpStream},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    thread,
    time::Duration,
};

use anyhow::{Context, Result, anyhow, bail};
use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};

use crate::{
    NotYet, describe,
    netns::{NetNs, command_in, owner_pid, pid_alive, run_in, unique_stem},
    run_cmd, wait_for,
};

/// How fast the agent must apply a manifest change: within one second.
pub const SYNC_DEADLINE: Duration = Duration::from_secs(1);

/// Environment variable naming the agent binary; `cargo xtask test` sets it.
pub const BIN_ENV: &str = "EBPF_PROXY_BIN";

/// Where per-test bpffs roots go: `/sys/fs/bpf/ebpf-proxy-test-<stem>`.
const BPF_ROOT_PREFIX: &str = "/sys/fs/bpf/ebpf-proxy-test-";

/// The agent's health endpoint inside its namespace (each namespace has its own
/// loopback, so every agent can use the same one).
pub const HEALTHZ: SocketAddrV4 = SocketAddrV4::new(std::net::Ipv4Addr::LOCALHOST, 10256);

/// How long the agent may take from start to a healthy /healthz.
const READY_TIMEOUT: Duration = Duration::from_mins(1);

/// How long the agent may take to exit after SIGTERM.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// Waits until the agent process `child`, in the namespace at `netns`, answers
/// 200 on [`HEALTHZ`], for at most `within`: how long it took, or the last
/// answer seen ([`NotYet::Never`] at once if the process exits first).
pub fn wait_healthy(child: &mut Child, netns: &Path, within: Duration) -> Result<Duration, NotYet> {
    let mut last = String::from("no answer yet");
    wait_for(within, Duration::from_millis(100), || {
        match child.try_wait() {
            Ok(Some(status)) => {
                return Err(NotYet::Never(format!(
                    "the agent exited ({status}) before becoming healthy (last /healthz: {last})"
                )));
            }
            Ok(None) => {}
            Err(e) => return Err(NotYet::Never(format!("cannot wait for the agent: {e}"))),
        }
        last = match run_in(netns, || http_status(HEALTHZ, "/healthz")) {
            Ok(Ok(200)) => return Ok(()),
            Ok(Ok(code)) => format!("HTTP {code}"),
            Ok(Err(e)) | Err(e) => format!("{e:#}"),
        };
        Err(NotYet::Again(last.clone()))
    })
    .map(|((), took)| took)
}

/// Waits up to `within` for `child` (sent a signal to stop) to exit: its status,
/// or what was seen (it still runs, or cannot be waited for). The process is
/// left as it is.
pub fn wait_exit(child: &mut Child, within: Duration) -> Result<ExitStatus, NotYet> {
    wait_for(within, Duration::from_millis(20), || {
        match child.try_wait() {
            Ok(Some(status)) => Ok(status),
            Ok(None) => Err(NotYet::Again(format!("pid {} still runs", child.id()))),
            Err(e) => Err(NotYet::Never(format!(
                "cannot wait for pid {}: {e}",
                child.id()
            ))),
        }
    })
    .map(|(status, _)| status)
}

/// The agent binary: `$EBPF_PROXY_BIN`, else `release/ebpf-proxy` in
/// `$CARGO_TARGET_DIR` or in the workspace's `target/`.
pub fn binary() -> Result<PathBuf> {
    let path = if let Some(p) = std::env::var_os(BIN_ENV) {
        PathBuf::from(p)
    } else {
        let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(
            || Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"),
            PathBuf::from,
        );
        target.join("release/ebpf-proxy")
    };
    if !path.is_file() {
        bail!(
            "the agent binary {} does not exist: run `cargo xtask build` first (or point {BIN_ENV} at it)",
            path.display()
        );
    }
    Ok(path)
}

/// Removes bpffs roots left by test processes that are gone: runs `ebpf-proxy cleanup`
/// on each (when `bin` is known) and deletes the directory. Returns what it removed.
pub fn remove_stale_bpf_roots(bin: Option<&Path>) -> Result<Vec<PathBuf>> {
    let mut removed = Vec::new();
    let parent = Path::new(BPF_ROOT_PREFIX)
        .parent()
        .expect("prefix has a parent");
    let prefix = Path::new(BPF_ROOT_PREFIX)
        .file_name()
        .expect("prefix has a file name")
        .to_string_lossy()
        .into_owned();
    let entries = match fs::read_dir(parent) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(e).context(parent.display().to_string()),
    };
    for entry in entries {
        let entry = entry?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(stem) = name.strip_prefix(&prefix) else {
            continue;
        };
        if owner_pid(stem).is_some_and(|pid| !pid_alive(pid)) {
            let path = entry.path();
            if let Some(bin) = bin {
                // Best effort: the directory goes below whatever cleanup manages.
                let _ = Command::new(bin)
                    .arg("cleanup")
                    .arg("--bpf-root")
                    .arg(&path)
                    .output();
            }
            if path.exists() {
                fs::remove_dir_all(&path).with_context(|| format!("remove {}", path.display()))?;
            }
            removed.push(path);
        }
    }
    Ok(removed)
}

/// A running `ebpf-proxy run`. Declare it after the topology it runs in, so it is
/// dropped (stopped and cleaned up) while the node namespace still exists.
#[derive(Debug)]
pub struct Agent {
    bin: PathBuf,
    child: Option<Child>,
    netns_path: PathBuf,
    bpf_root: PathBuf,
    log_path: PathBuf,
    cleaned_up: bool,
}

impl Agent {
    /// Starts the agent in `node` on the manifests at `manifests` and waits until
    /// /healthz says 200.
    pub fn start(node: &NetNs, manifests: &Path) -> Result<Agent> {
        Self::start_with(node, manifests, &[])
    }

    /// [`Agent::start`] with extra arguments for `ebpf-proxy run`.
    pub fn start_with(node: &NetNs, manifests: &Path, extra_args: &[&str]) -> Result<Agent> {
        let bpf_root = PathBuf::from(format!("{BPF_ROOT_PREFIX}{}", unique_stem()));
        Self::start_on_root(node, manifests, extra_args, bpf_root)
    }

    /// [`Agent::start_with`] on a given bpffs root, such as an earlier agent's (an
    /// agent restarted or upgraded in place).
    pub fn start_on_root(
        node: &NetNs,
        manifests: &Path,
        extra_args: &[&str],
        bpf_root: PathBuf,
    ) -> Result<Agent> {
        let source = [OsStr::new("--manifests"), manifests.as_os_str()];
        Self::spawn(node, &source, extra_args, bpf_root)
    }

    /// [`Agent::start_with`] with the agent started by `launcher` (a program and
    /// its arguments that exec the agent's command line, such as `setpriv ... --`).
    pub fn start_under(
        node: &NetNs,
        manifests: &Path,
        launcher: &[&str],
        extra_args: &[&str],
    ) -> Result<Agent> {
        let bpf_root = PathBuf::from(format!("{BPF_ROOT_PREFIX}{}", unique_stem()));
        let source = [OsStr::new("--manifests"), manifests.as_os_str()];
        Self::spawn_under(node, launcher, &source, extra_args, bpf_root)
    }

    /// [`Agent::start_with`] on the Kubernetes API at `master` (`--master URL`)
    /// instead of manifests.
    pub fn start_on_api(node: &NetNs, master: &str, extra_args: &[&str]) -> Result<Agent> {
        let bpf_root = PathBuf::from(format!("{BPF_ROOT_PREFIX}{}", unique_stem()));
        let source = [OsStr::new("--master"), OsStr::new(master)];
        Self::spawn(node, &source, extra_args, bpf_root)
    }

    /// [`Agent::start_with`] on a kube-proxy configuration file (`--config
    /// FILE`), which names the API server through its kubeconfig.
    pub fn start_with_config(node: &NetNs, config: &Path, extra_args: &[&str]) -> Result<Agent> {
        let bpf_root = PathBuf::from(format!("{BPF_ROOT_PREFIX}{}", unique_stem()));
        let source = [OsStr::new("--config"), config.as_os_str()];
        Self::spawn(node, &source, extra_args, bpf_root)
    }

    fn spawn(
        node: &NetNs,
        source: &[&OsStr],
        extra_args: &[&str],
        bpf_root: PathBuf,
    ) -> Result<Agent> {
        Self::spawn_under(node, &[], source, extra_args, bpf_root)
    }

    fn spawn_under(
        node: &NetNs,
        launcher: &[&str],
        source: &[&OsStr],
        extra_args: &[&str],
        bpf_root: PathBuf,
    ) -> Result<Agent> {
        let bin = binary()?;
        // nsenter --net (not `ip netns exec`, which would hide /sys/fs/bpf) and then
        // execs the agent, so the child's pid is the agent's.
        let mut cmd = match launcher.split_first() {
            None => node.command(&bin),
            Some((program, args)) => {
                let mut cmd = node.command(program);
                cmd.args(args).arg(&bin);
                cmd
            }
        };
        cmd.arg("run")
            .args(source)
            .arg("--bpf-root")
            .arg(&bpf_root)
            .arg("--healthz-bind-address")
            .arg(HEALTHZ.to_string())
            .arg("--node-name")
            .arg(node.name())
            .args(extra_args);
        Self::launch(cmd, bin, node, bpf_root)
    }

    /// A bpffs root of its own for [`Agent::start_exact`], removed with the
    /// agent.
    pub fn unique_bpf_root() -> PathBuf {
        PathBuf::from(format!("{BPF_ROOT_PREFIX}{}", unique_stem()))
    }

    /// The agent started in `node` with exactly `program args`, none of the
    /// harness's own arguments added (no `run`, no `--node-name`, no
    /// `--healthz-bind-address`): as a distribution starts kube-proxy, with
    /// `program` a `kube-proxy` symlink to [`binary`]. `args` must name
    /// `bpf_root` (from [`Agent::unique_bpf_root`]) with `--bpf-root`, which
    /// status and cleanup then use, and serve /healthz on [`HEALTHZ`]
    /// (kube-proxy's default, 0.0.0.0:10256, does).
    pub fn start_exact(
        node: &NetNs,
        program: &Path,
        args: &[String],
        bpf_root: PathBuf,
    ) -> Result<Agent> {
        let bin = binary()?;
        let mut cmd = node.command(program);
        cmd.args(args);
        Self::launch(cmd, bin, node, bpf_root)
    }

    /// Starts `cmd` (the agent, its output into a log file, in its own process
    /// group) and waits until it is healthy.
    fn launch(mut cmd: Command, bin: PathBuf, node: &NetNs, bpf_root: PathBuf) -> Result<Agent> {
        let stem = unique_stem();
        let log_path = std::env::temp_dir().join(format!("{stem}-agent.log"));
        let log =
            File::create(&log_path).with_context(|| format!("create {}", log_path.display()))?;
        cmd.env_remove("KUBECONFIG")
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            // Its own process group: a Ctrl-C at the terminal reaches only the harness,
            // which then stops the agent and cleans up in order.
            .process_group(0);
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "info");
        }
        let child = cmd
            .spawn()
            .with_context(|| format!("cannot start {}", describe(&cmd)))?;
        let mut agent = Agent {
            bin,
            child: Some(child),
            netns_path: node.path(),
            bpf_root,
            log_path,
            cleaned_up: false,
        };
        agent.wait_ready(READY_TIMEOUT)?;
        Ok(agent)
    }

    /// `ebpf-proxy status` on this agent's pins: what an operator sees.
    pub fn status(&self) -> Result<String> {
        run_cmd(
            self.on_its_node()
                .arg("status")
                .arg("--bpf-root")
                .arg(&self.bpf_root),
        )
    }

    /// `ebpf-proxy status` with `args` (`--output json`, `--service ...`).
    pub fn status_with(&self, args: &[&str]) -> Result<String> {
        run_cmd(
            self.on_its_node()
                .arg("status")
                .args(args)
                .arg("--bpf-root")
                .arg(&self.bpf_root),
        )
    }

    /// `ebpf-proxy status --flows`: the status and every translated flow.
    pub fn status_flows(&self) -> Result<String> {
        run_cmd(
            self.on_its_node()
                .args(["status", "--flows"])
                .arg("--bpf-root")
                .arg(&self.bpf_root),
        )
    }

    /// The agent's binary, to be run in the agent's network namespace as an
    /// operator runs it on the node (what `status` says of the node's own
    /// sockets is of that namespace), or where the test runs once that
    /// namespace is gone.
    fn on_its_node(&self) -> Command {
        if self.netns_path.exists() {
            command_in(&self.netns_path, &self.bin)
        } else {
            Command::new(&self.bin)
        }
    }

    /// The datapath counter `name` (summed over CPUs), as `status` shows it.
    pub fn counter(&self, name: &str) -> Result<u64> {
        let status = self.status()?;
        let prefix = format!("counter {name}: ");
        status
            .lines()
            .find_map(|l| l.strip_prefix(&prefix))
            .and_then(|v| v.trim().parse().ok())
            .ok_or_else(|| anyhow!("no counter {name} in the status:\n{status}"))
    }

    /// The datapath's counters that are not zero, as `status` lists them
    /// (`name: value, ...`), for failure messages; what went wrong instead
    /// where the status cannot be read.
    pub fn nonzero_counters(&self) -> String {
        match self.status() {
            Ok(status) => status
                .lines()
                .filter_map(|l| l.strip_prefix("counter "))
                .filter(|l| !l.ends_with(": 0"))
                .collect::<Vec<_>>()
                .join(", "),
            Err(e) => format!("(no status: {e:#})"),
        }
    }

    /// Polls /healthz until it answers 200; fails early if the agent exits.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let child = self
            .child
            .as_mut()
            .ok_or_else(|| anyhow!("the agent is not running"))?;
        match wait_healthy(child, &self.netns_path, timeout) {
            Ok(_) => Ok(()),
            Err(NotYet::Never(why)) => bail!("{why}; its output:\n{}", self.log()),
            Err(NotYet::Again(last)) => bail!(
                "the agent was not healthy after {timeout:?} (last /healthz: {last}); its output:\n{}",
                self.log()
            ),
        }
    }

    /// The status code of `GET /healthz`.
    pub fn healthz(&self) -> Result<u16> {
        run_in(&self.netns_path, || http_status(HEALTHZ, "/healthz"))?
    }

    /// The agent's process id while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn bpf_root(&self) -> &Path {
        &self.bpf_root
    }

    /// Every pin (file) below the agent's bpffs root, sorted.
    pub fn pins(&self) -> Vec<PathBuf> {
        let mut pins = files_below(&self.bpf_root);
        pins.sort();
        pins
    }

    /// Everything the agent printed so far.
    pub fn log(&self) -> String {
        fs::read_to_string(&self.log_path)
            .unwrap_or_else(|e| format!("(cannot read {}: {e})", self.log_path.display()))
    }

    /// Where the agent's log ends now, for [`Agent::wait_synced_since`].
    pub fn log_mark(&self) -> usize {
        self.log().len()
    }

    /// Waits until the agent, after `mark` in its log ([`Agent::log_mark`]),
    /// has read a manifest change and then finished a sync: a change written
    /// after the mark is then in the maps. Panics after `within`, with the log
    /// since the mark.
    #[track_caller]
    pub fn wait_synced_since(&self, mark: usize, within: Duration) -> Duration {
        self.wait_synced_file_since(mark, "", within)
    }

    /// [`Agent::wait_synced_since`] for a change of the manifest file named
    /// `file` (`web.yaml`) in particular: a change of another file read
    /// since the mark (a Node the test wrote earlier) does not count.
    #[track_caller]
    pub fn wait_synced_file_since(&self, mark: usize, file: &str, within: Duration) -> Duration {
        crate::eventually("the agent syncing a manifest change", within, || {
            let log = self.log();
            let since = log.get(mark..).unwrap_or_default();
            let read = since
                .match_indices("manifests changed")
                .map(|(at, _)| at)
                .find(|&at| {
                    let line = since[at..].lines().next().unwrap_or_default();
                    file.is_empty() || line.contains(&format!("/{file}\""))
                })
                .ok_or_else(|| {
                    format!("no change of {file:?} read yet; its log since:\n{since}")
                })?;
            // The text format's `synced ops=…`, or the JSON format's message.
            let synced = since[read..]
                .lines()
                .any(|l| l.contains(" synced ops=") || l.contains("\"message\":\"synced\""));
            if synced {
                Ok(())
            } else {
                Err(format!("no sync since the change; its log since:\n{since}"))
            }
        })
    }

    /// Sends SIGTERM and waits for the agent to exit (SIGKILL after a grace period,
    /// reported as an error).
    pub fn terminate(&mut self) -> Result<ExitStatus> {
        let mut child = self
            .child
            .take()
            .ok_or_else(|| anyhow!("the agent is not running"))?;
        if let Some(status) = child.try_wait()? {
            return Ok(status);
        }
        kill(Pid::from_raw(child.id() as i32), Signal::SIGTERM).context("SIGTERM the agent")?;
        match wait_exit(&mut child, EXIT_TIMEOUT) {
            Ok(status) => Ok(status),
            Err(still) => {
                let _ = child.kill();
                let _ = child.wait();
                bail!(
                    "the agent did not exit within {EXIT_TIMEOUT:?} of SIGTERM ({still}); killed it"
                )
            }
        }
    }

    /// Runs `ebpf-proxy cleanup` for this agent's bpffs root, in its namespace.
    pub fn cleanup(&mut self) -> Result<()> {
        self.cleanup_with(&[]).map(drop)
    }

    /// [`Agent::cleanup`] with extra arguments for `ebpf-proxy cleanup` (such as
    /// `--handoff`); returns what it printed on stdout and stderr (also appended to
    /// the agent's log). Once it succeeded, dropping the agent runs no other cleanup.
    pub fn cleanup_with(&mut self, extra_args: &[&str]) -> Result<String> {
        // Where the namespace is gone, so is every interface the agent attached
        // to; the pins are what is left.
        let mut cmd = self.on_its_node();
        cmd.arg("cleanup")
            .args(extra_args)
            .arg("--bpf-root")
            .arg(&self.bpf_root);
        let output = cmd
            .output()
            .with_context(|| format!("cannot start {}", describe(&cmd)))?;
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        if let Ok(mut log) = fs::OpenOptions::new().append(true).open(&self.log_path) {
            let _ = writeln!(log, "--- {}:\n{printed}", describe(&cmd));
        }
        if !output.status.success() {
            bail!(
                "{} failed ({}): {}",
                describe(&cmd),
                output.status,
                printed.trim()
            );
        }
        self.cleaned_up = true;
        Ok(printed)
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if self.child.is_some()
            && let Err(e) = self.terminate()
        {
            eprintln!("warning: {e:#}");
        }
        if !self.cleaned_up
            && let Err(e) = self.cleanup()
        {
            eprintln!("warning: agent cleanup failed: {e:#}");
        }
        leave_nothing_behind(&self.bpf_root, &self.log_path, || self.log());
    }
}

/// The flow slots a `status` output shows marked (its "prefilter flow marks"
/// line), None where it has no readable such line.
pub fn marked_flow_slots(status: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("prefilter flow marks: "))?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// The entries a `status` output shows map `map` holding (its "map fill MAP: N
/// of ..." line), None where it has no readable such line.
pub fn map_fill(status: &str, map: &str) -> Option<u64> {
    status
        .lines()
        .find_map(|l| {
            l.strip_prefix("map fill ")?
                .strip_prefix(map)?
                .strip_prefix(": ")
        })?
        .split(' ')
        .next()?
        .parse()
        .ok()
}

/// What an agent of a test leaves once stopped and cleaned up: its bpffs root
/// is removed, and its log too, after printing it if the test failed.
pub fn leave_nothing_behind(bpf_root: &Path, log_path: &Path, log: impl FnOnce() -> String) {
    if bpf_root.exists()
        && let Err(e) = fs::remove_dir_all(bpf_root)
    {
        eprintln!("warning: cannot remove {}: {e}", bpf_root.display());
    }
    if thread::panicking() {
        eprintln!(
            "----- agent output ({}) -----\n{}----- end of agent output -----",
            log_path.display(),
            log()
        );
    }
    let _ = fs::remove_file(log_path);
}

/// Every file below `dir`, sorted (none where it cannot be read).
pub fn files_below(dir: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                out.extend(files_below(&path));
            } else {
                out.push(path);
            }
        }
    }
    out
}

/// `GET path` over plain HTTP/1.1 from the calling thread's namespace; returns the
/// status code.
pub fn http_status(addr: SocketAddrV4, path: &str) -> Result<u16> {
    http_get(addr, path).map(|(status, _)| status)
}

/// `GET path` over plain HTTP/1.1 from the calling thread's namespace, to an
/// address of either family; returns the status code and the whole response
/// (status line, headers and body).
pub fn http_get(addr: impl Into<SocketAddr>, path: &str) -> Result<(u16, String)> {
    let addr: SocketAddr = addr.into();
    let timeout = Duration::from_secs(2);
    let mut stream =
        TcpStream::connect_timeout(&addr, timeout).with_context(|| format!("connect to {addr}"))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
    )?;
    let mut response = Vec::new();
    stream.read_to_end(&mut response)?;
    let response = String::from_utf8_lossy(&response).into_owned();
    let status_line = response.lines().next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .ok_or_else(|| anyhow!("not an HTTP response: {status_line:?}"))?;
    Ok((status, response))
}
