//! `cargo xtask test`'s test binaries, a few side by side. Most of the
//! privileged tests wait far more than they compute (an agent's sync, a
//! timeout running out, a connection draining), and each already names
//! everything it makes after its own process, so that binaries run at once
//! as safely as the tests inside one do (docs/testing.md, "Running"). Each
//! binary's output is held until it ends and printed whole, as `cargo
//! test` prints it, so that a failure reads as it would there.

use std::{
    collections::VecDeque,
    fs::File,
    io::{Read, Seek},
    os::unix::fs::OpenOptionsExt,
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
    sync::{Mutex, mpsc},
    time::{Duration, Instant},
};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// Test binaries run at once: with two cores, a third lane keeps them
/// busy while two binaries wait on their namespaces' agents.
pub const LANES: usize = 3;

/// One test executable cargo built.
#[derive(Debug, PartialEq, Eq)]
pub struct TestBinary {
    /// Its source, relative to the workspace (`tests/tests/datapath.rs`),
    /// as `cargo test` names it.
    pub name: String,
    pub exe: PathBuf,
    /// Its package's directory, where `cargo test` runs it.
    pub dir: PathBuf,
}

/// The test executables in the JSON messages of `cargo test --no-run
/// --message-format=json`, in the order cargo built them (each once).
pub fn from_cargo_messages(messages: &str, workspace: &Path) -> Result<Vec<TestBinary>> {
    let mut binaries = Vec::new();
    for line in messages.lines().filter(|l| l.starts_with('{')) {
        let message: Value = serde_json::from_str(line)
            .with_context(|| format!("cargo printed a message that is not JSON: {line}"))?;
        if message["reason"] != "compiler-artifact" || message["profile"]["test"] != true {
            continue;
        }
        let Some(exe) = message["executable"].as_str() else {
            continue;
        };
        fn field<'a>(value: &'a Value, name: &str, exe: &str) -> Result<&'a Path> {
            value[name]
                .as_str()
                .map(Path::new)
                .with_context(|| format!("cargo's artifact message for {exe} has no {name}"))
        }
        let src = field(&message["target"], "src_path", exe)?;
        let manifest = field(&message, "manifest_path", exe)?;
        let binary = TestBinary {
            name: src
                .strip_prefix(workspace)
                .unwrap_or(src)
                .display()
                .to_string(),
            exe: exe.into(),
            dir: manifest
                .parent()
                .with_context(|| format!("{} has no directory", manifest.display()))?
                .to_owned(),
        };
        if !binaries.iter().any(|b: &TestBinary| b.exe == binary.exe) {
            binaries.push(binary);
        }
    }
    Ok(binaries)
}

/// How one binary ended.
struct Ran {
    name: String,
    status: ExitStatus,
    output: String,
    took: Duration,
}

/// Runs every binary of `binaries` to its end, `lanes` at a time, each in
/// its package's directory with `env` set, printing each one's output whole
/// as it ends. `Err` names every binary that failed, after all have run
/// (one failing binary must not hide the others' results).
pub fn run(binaries: Vec<TestBinary>, lanes: usize, env: &[(&str, &Path)]) -> Result<()> {
    let total = binaries.len();
    let lanes = lanes.max(1);
    let started = Instant::now();
    let queue = Mutex::new(VecDeque::from(binaries));
    let (done, finished) = mpsc::channel::<Result<Ran>>();
    let mut failed = Vec::new();
    std::thread::scope(|scope| {
        for _ in 0..lanes {
            let (queue, done) = (&queue, done.clone());
            scope.spawn(move || {
                while let Some(binary) = queue.lock().ok().and_then(|mut q| q.pop_front()) {
                    let name = binary.name.clone();
                    let ran = run_one(binary, env).with_context(|| format!("cannot run {name}"));
                    if done.send(ran).is_err() {
                        return;
                    }
                }
            });
        }
        drop(done);
        for ran in finished {
            match ran {
                Ok(ran) => {
                    println!(
                        "     Ran {} ({:.1} s, {})\n{}",
                        ran.name,
                        ran.took.as_secs_f64(),
                        ran.status,
                        ran.output
                    );
                    if !ran.status.success() {
                        failed.push(ran.name);
                    }
                }
                Err(e) => {
                    println!("{e:#}");
                    failed.push(format!("{e:#}"));
                }
            }
        }
    });
    println!(
        "{total} test binaries, {lanes} lanes, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if !failed.is_empty() {
        bail!(
            "{} of {total} test binaries failed: {}",
            failed.len(),
            failed.join(", ")
        );
    }
    Ok(())
}

/// Runs one binary, its stdout and stderr into one file, so that the
/// output keeps the order it was written in.
fn run_one(binary: TestBinary, env: &[(&str, &Path)]) -> Result<Ran> {
    let mut out = tempfile()?;
    let started = Instant::now();
    let status = Command::new(&binary.exe)
        .current_dir(&binary.dir)
        .env("CARGO_MANIFEST_DIR", &binary.dir)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(out.try_clone()?)
        .stderr(out.try_clone()?)
        .status()
        .with_context(|| format!("start {}", binary.exe.display()))?;
    let took = started.elapsed();
    let mut output = Vec::new();
    out.rewind()?;
    out.read_to_end(&mut output)?;
    Ok(Ran {
        name: binary.name,
        status,
        output: String::from_utf8_lossy(&output).into_owned(),
        took,
    })
}

/// An unnamed file in the temporary directory, gone when closed.
fn tempfile() -> Result<File> {
    let dir = std::env::temp_dir();
    File::options()
        .read(true)
        .write(true)
        .custom_flags(libc::O_TMPFILE)
        .open(&dir)
        .with_context(|| format!("an unnamed file in {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Cargo's messages as `cargo test --no-run --message-format=json`
    /// prints them: a library without tests' artifact, a test binary twice
    /// (two profiles' messages name one executable), a build script's.
    #[test]
    fn the_test_executables_are_read_from_cargos_messages() {
        let ws = Path::new("/w");
        let artifact = |src: &str, manifest: &str, test: bool, exe: Option<&str>| {
            serde_json::json!({
                "reason": "compiler-artifact",
                "manifest_path": manifest,
                "target": {"src_path": src, "kind": ["test"]},
                "profile": {"test": test},
                "executable": exe,
            })
            .to_string()
        };
        let messages = [
            artifact(
                "/w/proxy-common/src/lib.rs",
                "/w/proxy-common/Cargo.toml",
                false,
                None,
            ),
            "   Compiling something".into(),
            artifact(
                "/w/tests/tests/datapath.rs",
                "/w/tests/Cargo.toml",
                true,
                Some("/w/target/release/deps/datapath-1"),
            ),
            r#"{"reason":"build-script-executed","package_id":"x"}"#.into(),
            artifact(
                "/w/tests/tests/datapath.rs",
                "/w/tests/Cargo.toml",
                true,
                Some("/w/target/release/deps/datapath-1"),
            ),
            artifact(
                "/w/proxy-common/src/lib.rs",
                "/w/proxy-common/Cargo.toml",
                true,
                Some("/w/target/release/deps/proxy_common-2"),
            ),
            r#"{"reason":"build-finished","success":true}"#.into(),
        ]
        .join("\n");
        let binaries = from_cargo_messages(&messages, ws).expect("cargo's messages");
        assert_eq!(
            binaries,
            [
                TestBinary {
                    name: "tests/tests/datapath.rs".into(),
                    exe: "/w/target/release/deps/datapath-1".into(),
                    dir: "/w/tests".into(),
                },
                TestBinary {
                    name: "proxy-common/src/lib.rs".into(),
                    exe: "/w/target/release/deps/proxy_common-2".into(),
                    dir: "/w/proxy-common".into(),
                },
            ]
        );
        let err = from_cargo_messages("{not json", ws).expect_err("a broken message");
        assert!(
            format!("{err:#}").contains("{not json"),
            "the error does not quote the message: {err:#}"
        );
    }

    /// A shell script standing in for a test binary.
    fn script(dir: &Path, name: &str, body: &str) -> TestBinary {
        let exe = dir.join(name);
        std::fs::write(&exe, format!("#!/bin/sh\n{body}\n")).expect("write a script");
        let mut perm = std::fs::metadata(&exe).expect("its metadata").permissions();
        std::os::unix::fs::PermissionsExt::set_mode(&mut perm, 0o755);
        std::fs::set_permissions(&exe, perm).expect("make it executable");
        TestBinary {
            name: name.into(),
            exe,
            dir: dir.to_owned(),
        }
    }

    /// Every binary runs once, in its own directory with the environment
    /// given, side by side (three that each wait for the others to start
    /// end only when three lanes run them at once); a failing one fails the
    /// run by its name, after the others have run.
    #[test]
    fn every_binary_runs_once_side_by_side_and_failures_are_named() {
        let dir = std::env::temp_dir().join(format!("xtask-lanes-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        struct Remove(PathBuf);
        impl Drop for Remove {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let _remove = Remove(dir.clone());
        // Each marks its start, then waits (up to 10 s) for all three marks.
        let meet = |n: u32| {
            script(
                &dir,
                &format!("meet{n}"),
                &format!(
                    "touch started{n}; i=0; while [ $(ls started* | wc -l) -lt 3 ]; do \
                     i=$((i+1)); [ $i -gt 200 ] && exit 3; sleep 0.05; done; \
                     echo \"$LANES_PROBE\" > ran{n}"
                ),
            )
        };
        let binaries = vec![meet(1), meet(2), meet(3), script(&dir, "fails", "exit 1")];
        let probe = dir.join("probe");
        let err = run(binaries, 3, &[("LANES_PROBE", &probe)]).expect_err("one binary fails");
        assert_eq!(
            format!("{err:#}"),
            "1 of 4 test binaries failed: fails",
            "the run's error"
        );
        for n in 1..=3 {
            let ran = std::fs::read_to_string(dir.join(format!("ran{n}")))
                .unwrap_or_else(|e| panic!("meet{n} did not end with the others at once: {e}"));
            assert_eq!(
                ran.trim(),
                probe.display().to_string(),
                "meet{n}'s environment"
            );
        }
    }
}
