//! A kube-proxy command line made one of `ebpf-proxy`: the binary called
//! as `kube-proxy` (a symlink, in place of kube-proxy's binary) runs as
//! `ebpf-proxy run`, and Go's flag syntax, which clap does not have, is
//! written as clap's.
//!
//! Go (pflag with Kubernetes' normalization) takes `-flag` as `--flag` and
//! `_` as `-` in a flag's name (`-v=2`, `--log_file`); kube-proxy's
//! `--cleanup` and `--version` are flags of its one command where here they
//! are a subcommand and a top-level flag.

use std::{ffi::OsString, path::Path};

/// The name the binary answers to as kube-proxy.
pub const KUBE_PROXY: &str = "kube-proxy";

/// `args` (argv, the program first) as `ebpf-proxy` takes them. `is_run_flag`
/// tells the long flags of `run` (without dashes), so that a single-dash
/// token is read as a flag only when it names one (`-998` stays a value).
pub fn rewrite(mut args: Vec<OsString>, is_run_flag: &dyn Fn(&str) -> bool) -> Vec<OsString> {
    let Some(program) = args.first().cloned() else {
        return args;
    };
    let as_kube_proxy = Path::new(&program).file_name() == Some(std::ffi::OsStr::new(KUBE_PROXY));
    let subcommand = args.get(1).and_then(|a| a.to_str()).map(str::to_owned);
    let named = subcommand
        .as_deref()
        .is_some_and(|s| matches!(s, "run" | "cleanup" | "status" | "datapath-log" | "help"));
    if as_kube_proxy && !named {
        args.insert(1, "run".into());
    } else if subcommand.as_deref() != Some("run") {
        return args;
    }

    let mut out: Vec<OsString> = vec![program.clone(), "run".into()];
    let mut cleanup = false;
    let mut version = false;
    let mut rest = args.into_iter().skip(2);
    while let Some(arg) = rest.next() {
        let Some(text) = arg.to_str() else {
            out.push(arg);
            continue;
        };
        if text == "--" {
            out.push(arg);
            out.extend(rest.by_ref());
            break;
        }
        let Some(flag) = go_flag(text, is_run_flag) else {
            out.push(arg);
            continue;
        };
        let (name, value) = flag
            .split_once('=')
            .map_or((flag.as_str(), None), |(n, v)| (n, Some(v)));
        match name {
            "cleanup" => match value.map_or(Ok(true), crate::kube_proxy_flags::parse_go_bool) {
                Ok(on) => cleanup |= on,
                Err(_) => out.push(format!("--{flag}").into()),
            },
            // verflag's values: true, false, raw, or a version to report.
            "version" => version |= value != Some("false"),
            _ => out.push(format!("--{flag}").into()),
        }
    }
    if version {
        return vec![program, "--version".into()];
    }
    if cleanup {
        // Only where the pins are carries over: kube-proxy's other flags
        // (its configuration, its logging) mean nothing to a cleanup.
        let mut cleanup_args = vec![program, "cleanup".into()];
        let mut tokens = out.into_iter().skip(2);
        while let Some(token) = tokens.next() {
            if token == "--bpf-root" {
                cleanup_args.push(token);
                cleanup_args.extend(tokens.next());
            } else if token.to_str().is_some_and(|t| t.starts_with("--bpf-root=")) {
                cleanup_args.push(token);
            }
        }
        return cleanup_args;
    }
    out
}

/// The flag `text` names, as `name[=value]` with Go's spellings normalized,
/// or None when `text` is no flag (a value, `-`, a short flag of clap's).
fn go_flag(text: &str, is_run_flag: &dyn Fn(&str) -> bool) -> Option<String> {
    let (single, body) = match text.strip_prefix("--") {
        Some(body) => (false, body),
        None => (true, text.strip_prefix('-')?),
    };
    let (name, value) = body
        .split_once('=')
        .map_or((body, None), |(n, v)| (n, Some(v)));
    if name.is_empty() {
        return None;
    }
    let name = name.replace('_', "-");
    let known = is_run_flag(&name) || matches!(name.as_str(), "cleanup" | "version");
    // A single dash names a long flag only when it is one: `-998` is a
    // value and `-h` clap's short help.
    if single && (!known || name == "h") {
        return None;
    }
    Some(match value {
        Some(value) => format!("{name}={value}"),
        None => name,
    })
}

/// The long flags (and their aliases) of `run` in `command`, for
/// [`rewrite`].
pub fn run_flags(command: &clap::Command) -> Vec<String> {
    let mut names: Vec<String> = command
        .get_arguments()
        .chain(
            command
                .find_subcommand("run")
                .into_iter()
                .flat_map(clap::Command::get_arguments),
        )
        .flat_map(|arg| {
            arg.get_long()
                .into_iter()
                .chain(arg.get_all_aliases().unwrap_or_default())
                .map(str::to_owned)
        })
        .collect();
    names.sort();
    names.dedup();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewritten(args: &[&str]) -> Vec<String> {
        let flags = [
            "v",
            "log-file",
            "hostname-override",
            "oom-score-adj",
            "config",
            "bpf-root",
        ];
        rewrite(args.iter().map(OsString::from).collect(), &|name| {
            flags.contains(&name)
        })
        .into_iter()
        .map(|a| a.into_string().unwrap())
        .collect()
    }

    #[test]
    fn kube_proxy_without_a_subcommand_runs() {
        assert_eq!(
            rewritten(&[
                "/usr/local/bin/kube-proxy",
                "--config=/c",
                "--hostname-override",
                "n"
            ]),
            [
                "/usr/local/bin/kube-proxy",
                "run",
                "--config=/c",
                "--hostname-override",
                "n"
            ]
        );
        assert_eq!(rewritten(&["kube-proxy"]), ["kube-proxy", "run"]);
        assert_eq!(
            rewritten(&["kube-proxy", "status"]),
            ["kube-proxy", "status"],
            "a subcommand of ours is left alone"
        );
        assert_eq!(
            rewritten(&["/bin/ebpf-proxy", "--config=/c"]),
            ["/bin/ebpf-proxy", "--config=/c"],
            "only as kube-proxy"
        );
        assert_eq!(
            rewritten(&["/bin/kube-proxy-old", "--v=2"]),
            ["/bin/kube-proxy-old", "--v=2"],
            "the file name exactly"
        );
    }

    #[test]
    fn go_spellings_become_clap_ones() {
        assert_eq!(
            rewritten(&[
                "kube-proxy",
                "-v=2",
                "-v",
                "3",
                "--log_file=/var/log/kube_proxy.log",
                "-log_file",
                "/x_y",
                "--oom-score-adj",
                "-998",
                "-h",
                "-x",
                "--",
                "-v=1",
            ]),
            [
                "kube-proxy",
                "run",
                "--v=2",
                "--v",
                "3",
                "--log-file=/var/log/kube_proxy.log",
                "--log-file",
                "/x_y",
                "--oom-score-adj",
                "-998",
                "-h",
                "-x",
                "--",
                "-v=1",
            ],
            "names only, not values; a single dash only for a flag of run; nothing after --"
        );
        assert_eq!(
            rewritten(&["ebpf-proxy", "run", "-v=2", "--log_dir=/l"]),
            ["ebpf-proxy", "run", "--v=2", "--log-dir=/l"],
            "ebpf-proxy run takes Go's spellings too"
        );
        assert_eq!(
            rewritten(&["ebpf-proxy", "status", "-v=2"]),
            ["ebpf-proxy", "status", "-v=2"],
            "only run's flags are kube-proxy's"
        );
    }

    #[test]
    fn cleanup_and_version_are_what_kube_proxy_means_by_them() {
        assert_eq!(
            rewritten(&["kube-proxy", "--cleanup", "--config=/c", "--v=4"]),
            ["kube-proxy", "cleanup"]
        );
        assert_eq!(
            rewritten(&["kube-proxy", "-cleanup=true", "--bpf-root", "/b", "--v=4"]),
            ["kube-proxy", "cleanup", "--bpf-root", "/b"]
        );
        assert_eq!(
            rewritten(&["ebpf-proxy", "run", "--cleanup=1", "--bpf-root=/b"]),
            ["ebpf-proxy", "cleanup", "--bpf-root=/b"]
        );
        assert_eq!(
            rewritten(&["kube-proxy", "--cleanup=false", "--v=4"]),
            ["kube-proxy", "run", "--v=4"]
        );
        assert_eq!(
            rewritten(&["kube-proxy", "--cleanup=maybe"]),
            ["kube-proxy", "run", "--cleanup=maybe"],
            "left for clap to refuse"
        );
        for version in ["--version", "--version=true", "--version=raw", "-version"] {
            assert_eq!(
                rewritten(&["/usr/local/bin/kube-proxy", version, "--v=2"]),
                ["/usr/local/bin/kube-proxy", "--version"],
                "{version}"
            );
        }
        assert_eq!(
            rewritten(&["kube-proxy", "--version=false"]),
            ["kube-proxy", "run"]
        );
    }
}
