//! `cargo xtask`: the way to set up, build, run and test ebpf-proxy on a fresh machine
//! (Debian 12, root). See docs/building.md for why the eBPF side needs Debian's rustc-web
//! and bpf-linker rather than rustup components.

mod demo;
mod image;
mod netfilter_tools;
mod profile;
mod setup;
mod test_lanes;

use std::{
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use ebpf_proxy_tests::{agent, describe, require_root};

#[derive(Parser)]
#[command(name = "cargo xtask", about = "Set up, build, run and test ebpf-proxy")]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what the build and the tests need (Debian packages, bpf-linker, a bpffs
    /// mount); idempotent, says what it installs.
    Setup,
    /// Set up, then build the agent (eBPF object embedded) into target/release/ebpf-proxy.
    Build,
    /// Build, then run the demo: a sandbox of network namespaces with a client and
    /// three backends behind the ClusterIP of deploy/examples/demo.yaml, and a live
    /// table of who served how many connections. Ctrl-C removes the sandbox.
    /// With `-- ARGS`, runs `ebpf-proxy run ARGS` instead.
    Run {
        /// End the demo after this many seconds.
        #[arg(long)]
        seconds: Option<u64>,
        /// Arguments for `ebpf-proxy run` (instead of the demo).
        #[arg(last = true)]
        args: Vec<String>,
    },
    /// Set up, build, and run the benchmarks (needs root): per-packet cost of the
    /// datapath, control-plane cost against kube-proxy's iptables mode, end to end
    /// through a ClusterIP, and NodePort connections from outside the cluster through
    /// XDP, tc and kube-proxy's iptables mode; then the datapath on a million random
    /// and mutated frames, every output checked. Writes markdown tables and a plot to
    /// bench/results/ and prints the tables.
    Bench {
        /// Smaller sizes and fewer repeats (about two and a half minutes).
        #[arg(long)]
        quick: bool,
    },
    /// Build, then the agent's OCI image `ebpf-proxy:<version>` (buildah, no
    /// daemon, nothing downloaded): target/image/ebpf-proxy-<version>.oci.tar and
    /// .docker.tar, `-arm64` before the extension for arm64 (needs root).
    Image {
        /// The architecture: amd64 (the host's), or arm64 (cross-built: needs
        /// `rustup target add aarch64-unknown-linux-gnu` and `apt-get install
        /// gcc-aarch64-linux-gnu libc6-dev-arm64-cross`).
        #[arg(long, value_enum, default_value = "amd64")]
        arch: image::Arch,
        /// The repository URL for the `org.opencontainers.image.source`
        /// annotation (default: the `origin` remote's).
        #[arg(long)]
        source: Option<String>,
    },
    /// Sample every CPU with perf for a while and say where the agent's running
    /// packet programs spend their time, by source line, and which kernel functions
    /// they call from where (needs root, `perf` and a running agent).
    Profile {
        /// How long to sample.
        #[arg(long, default_value_t = 10)]
        seconds: u64,
        /// A program to profile (repeatable; default: every packet program).
        #[arg(long = "program")]
        programs: Vec<String>,
        /// How many lines and called functions to print per program.
        #[arg(long, default_value_t = 25)]
        top: usize,
    },
    /// Set up, build, and run every unit and integration test (needs root).
    Test {
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(last = true)]
        args: Vec<String>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.command {
        Cmd::Setup => setup::run(),
        Cmd::Build => build().map(|_| ()),
        Cmd::Run { seconds, args } => {
            if args.is_empty() {
                // Before the build, not minutes after it.
                require_root()
                    .context("the demo builds network namespaces and loads BPF programs")?;
            }
            let bin = build()?;
            if args.is_empty() {
                demo::run(&bin, seconds)
            } else {
                if seconds.is_some() {
                    bail!("--seconds is for the demo; it does not go with `-- ARGS`");
                }
                let err = Command::new(&bin).arg("run").args(&args).exec();
                Err(err).with_context(|| format!("exec {}", bin.display()))
            }
        }
        Cmd::Image { arch, source } => {
            require_root().context("buildah builds the image as root")?;
            let bin = image::build_agent(arch)?;
            image::build(&bin, &image::Options { arch, source }).map(|_| ())
        }
        Cmd::Profile {
            seconds,
            programs,
            top,
        } => profile::run(&profile::Options {
            seconds,
            programs: if programs.is_empty() {
                profile::PACKET_PROGRAMS.map(String::from).to_vec()
            } else {
                programs
            },
            top,
        }),
        Cmd::Test { args } => test(&args),
        Cmd::Bench { quick } => bench(quick),
    }
}

/// The workspace root (xtask lives one level below it).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask is inside the workspace")
        .to_owned()
}

/// The cargo target directory: this binary runs from `<target>/<profile>/xtask`, which
/// also covers a `CARGO_TARGET_DIR` set elsewhere.
fn target_dir() -> PathBuf {
    std::env::current_exe()
        .ok()
        .and_then(|exe| Some(exe.parent()?.parent()?.to_owned()))
        .unwrap_or_else(|| workspace_root().join("target"))
}

/// The cargo that runs us (so the same toolchain builds everything).
fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    cmd.current_dir(workspace_root());
    cmd
}

fn run_status(cmd: &mut Command) -> Result<()> {
    println!("+ {}", describe(cmd));
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(cmd));
    }
    Ok(())
}

/// Setup, then the release build of the agent; returns the binary's path.
fn build() -> Result<PathBuf> {
    setup::run()?;
    // proxy-userspace's build script builds the eBPF object with /usr/bin/rustc and
    // bpf-linker and embeds it.
    run_status(cargo().args(["build", "--release", "-p", "proxy-userspace"]))?;
    built_agent()
}

/// The agent binary a release build just made.
fn built_agent() -> Result<PathBuf> {
    let bin = target_dir().join("release/ebpf-proxy");
    if !bin.is_file() {
        bail!(
            "the build succeeded but {} does not exist; has the binary another name?",
            bin.display()
        );
    }
    println!("agent binary: {}", bin.display());
    Ok(bin)
}

const DEBIAN_PYTHON: &str = "/usr/bin/python3";

fn bench(quick: bool) -> Result<()> {
    require_root().context("the benchmarks build network namespaces and load BPF programs")?;
    let bin = build()?;
    ebpf_proxy_tests::remove_stale_state(Some(&bin))?;
    let out = workspace_root().join("bench/results");
    for name in [
        "datapath",
        "control_plane",
        "source_idle",
        "scale",
        "e2e",
        "nodeport",
        "fuzz",
    ] {
        let mut cmd = cargo();
        cmd.args(["bench", "-p", "ebpf-proxy-tests", "--bench", name, "--"])
            .arg("--out")
            .arg(&out)
            .env(agent::BIN_ENV, &bin);
        if quick {
            cmd.arg("--quick");
        }
        run_status(&mut cmd)?;
    }
    // Debian's interpreter, which is the one python3-matplotlib installs for
    // (a python3 earlier on PATH, e.g. pyenv's, would not see it).
    let has_matplotlib = Command::new(DEBIAN_PYTHON)
        .args(["-c", "import matplotlib"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_matplotlib {
        println!("installing python3-matplotlib for the plot");
        run_status(Command::new("apt-get").args(["install", "-y", "-q", "python3-matplotlib"]))?;
    }
    run_status(
        Command::new(DEBIAN_PYTHON)
            .arg(workspace_root().join("xtask/plot_bench.py"))
            .arg(&out),
    )?;
    println!("results in {}", out.display());
    Ok(())
}

fn test(extra: &[String]) -> Result<()> {
    require_root()
        .context("the integration tests build network namespaces and load BPF programs")?;
    setup::run()?;
    // proxy-ebpf targets bpfel-unknown-none (no_std, no_main) and is built by
    // proxy-userspace's build script; it cannot be compiled for the host.
    const TEST: [&str; 5] = [
        "test",
        "--workspace",
        "--exclude",
        "proxy-ebpf",
        "--release",
    ];
    // Everything the tests run is built first, the agent binary included
    // (proxy-userspace's own tests run it), with the features the workspace's
    // test dependencies unify: a separate `cargo build` of the agent would
    // compile every crate whose features differ (kube, rustls, the agent)
    // twice, and tests/image.rs must find the image of the binary the tests run.
    let built = cargo()
        .args(TEST)
        .args(["--no-run", "--message-format=json-render-diagnostics"])
        .stderr(std::process::Stdio::inherit())
        .output()
        .context("cannot start cargo test --no-run")?;
    if !built.status.success() {
        bail!("cargo test --no-run failed ({})", built.status);
    }
    let bin = built_agent()?;
    ebpf_proxy_tests::remove_stale_state(Some(&bin))?;
    image::build(&bin, &image::Options::default())?;
    if !extra.is_empty() {
        // --no-fail-fast: one failing test binary must not hide the results of the others.
        return run_status(
            cargo()
                .args(TEST)
                .arg("--no-fail-fast")
                .args(extra)
                .env(agent::BIN_ENV, &bin),
        );
    }
    let binaries = test_lanes::from_cargo_messages(
        &String::from_utf8_lossy(&built.stdout),
        &workspace_root(),
    )?;
    let lanes = test_lanes::run(binaries, test_lanes::LANES, &[(agent::BIN_ENV, &bin)]);
    // The doc tests (compile checks of the examples in doc comments), which
    // no executable of the build holds.
    let docs = run_status(cargo().args(TEST).arg("--doc").env(agent::BIN_ENV, &bin));
    lanes.and(docs)
}
