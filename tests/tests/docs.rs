//! The figures of docs/ that the code can vouch for, read from the docs and held
//! to the code: each map's capacity in docs/maps.md against the object the agent
//! loads, the defaults of docs/operations.md's flag table against the agent's
//! `--help`, and docs/architecture.md's code map against the source files. A
//! change to either side that leaves the other behind fails here, naming both.
//!
//! No root needed: nothing is loaded, only read.

use std::{
    collections::{BTreeMap, BTreeSet},
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use ebpf_proxy_tests::agent;
use proxy_common::{MAX_CT_NEW, map_names};

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ is in the workspace")
        .to_owned()
}

/// A doc by its path in the workspace (`docs/maps.md`).
fn doc(name: &str) -> String {
    let path = workspace().join(name);
    fs::read_to_string(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// The cells of each row of the first Markdown table after `heading`.
fn table(text: &str, heading: &str) -> Vec<Vec<String>> {
    let start = text
        .find(heading)
        .unwrap_or_else(|| panic!("no {heading:?} in the doc"));
    text[start..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .skip(2)
        .map(|row| {
            let row = row.trim().trim_start_matches('|').trim_end_matches('|');
            row.split(" | ").map(|c| c.trim().to_owned()).collect()
        })
        .collect()
}

/// What a cell writes in backticks.
fn quoted(cell: &str) -> Vec<&str> {
    cell.split('`').skip(1).step_by(2).collect()
}

/// The first number a cell writes (`262,144` or `4096`).
fn first_number(cell: &str) -> Option<u64> {
    let digits: String = cell
        .chars()
        .skip_while(|c| !c.is_ascii_digit())
        .take_while(|c| c.is_ascii_digit() || *c == ',')
        .filter(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// `ebpf-proxy run --help`'s flags: each one's default and environment
/// variable, where it has them.
#[derive(Debug, Default)]
struct Flag {
    default: Option<String>,
    env: Option<String>,
}

fn run_flags() -> BTreeMap<String, Flag> {
    let bin = agent::binary().expect("the agent binary");
    let out = Command::new(&bin)
        .args(["run", "--help"])
        .output()
        .unwrap_or_else(|e| panic!("{} run --help: {e}", bin.display()));
    let help = String::from_utf8_lossy(&out.stdout);
    let mut flags: BTreeMap<String, Flag> = BTreeMap::new();
    let mut current = None;
    for line in help.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("--") {
            let name = rest.split([' ', '=']).next().unwrap_or_default();
            current = Some(format!("--{name}"));
            flags.entry(format!("--{name}")).or_default();
        } else if let Some(flag) = current.as_ref().and_then(|c| flags.get_mut(c)) {
            if let Some(v) = line.strip_prefix("[default: ") {
                flag.default = Some(v.trim_end_matches(']').to_owned());
            } else if let Some(v) = line.strip_prefix("[env: ") {
                flag.env = Some(v.split('=').next().unwrap_or_default().to_owned());
            }
        }
    }
    assert!(
        flags.contains_key("--conntrack-min"),
        "no --conntrack-min in `ebpf-proxy run --help`:\n{help}"
    );
    flags
}

/// Every map's size in docs/maps.md is the one the agent loads it with: the
/// object's for most, the loader's for the two of flows not yet assured, and
/// for the two conntrack maps kube-proxy's sizing at its smallest (two entries
/// a connection of `--conntrack-min`).
#[test]
fn map_capacities_in_maps_md_are_the_codes() {
    let object = aya_obj::Object::parse(proxy_userspace::datapath::EBPF_OBJECT)
        .expect("parsing the agent's eBPF object (built by proxy-userspace's build script)");
    let flags = run_flags();
    let conntrack_min: u64 = flags["--conntrack-min"]
        .default
        .as_deref()
        .and_then(|d| d.parse().ok())
        .expect("--conntrack-min's default");
    let mut differ = Vec::new();
    let mut documented = BTreeSet::new();
    for row in table(&doc("docs/maps.md"), "## The maps") {
        let (Some(name), Some(size)) = (row.first(), row.get(1)) else {
            continue;
        };
        let name = name.trim_matches('`');
        documented.insert(name.to_owned());
        let expected = match name {
            map_names::CONNTRACK | map_names::CONNTRACK6 => {
                if !size.contains("--conntrack-max") {
                    differ.push(format!("{name}: {size:?} does not name --conntrack-max"));
                }
                Some(2 * conntrack_min)
            }
            map_names::CT_NEW | map_names::CT_NEW6 => Some(u64::from(MAX_CT_NEW)),
            // aya-log's own ring buffer: sized in bytes by aya-log, not by this code.
            map_names::AYA_LOGS => None,
            _ => match object.maps.get(name) {
                // Socket-local storage has no entries of its own to count.
                Some(map) if map.max_entries() == 0 => None,
                Some(map) => Some(u64::from(map.max_entries())),
                None => {
                    differ.push(format!("{name}: documented, but no such map in the object"));
                    None
                }
            },
        };
        if let Some(expected) = expected
            && first_number(size) != Some(expected)
        {
            differ.push(format!(
                "{name}: the doc says {size:?}, the code {expected}"
            ));
        }
    }
    let undocumented: Vec<&String> = object
        .maps
        .keys()
        .filter(|m| !m.starts_with('.') && !documented.contains(*m))
        .collect();
    if !undocumented.is_empty() {
        differ.push(format!(
            "maps of the object without a row: {undocumented:?}"
        ));
    }
    assert!(
        differ.is_empty(),
        "docs/maps.md's table and the code differ:\n  {}",
        differ.join("\n  ")
    );
}

/// Defaults the flag tables give that are not clap's: the flag, the value the
/// doc gives, and why.
const DEFAULTS_NOT_CLAPS: [(&str, &str); 3] = [
    // Unset, the mode is read as kube-proxy's default, iptables.
    ("--proxy-mode", "iptables"),
    // Unset, the host's cgroup v2 mount is found at start.
    ("--cgroup-root", "/sys/fs/cgroup"),
    ("--cgroup-root", "/sys/fs/cgroup/unified"),
];

/// Each flag of the flag tables (docs/operations.md's, README.md's) has, as its
/// default, what the agent's `--help` says: every default clap has for a flag
/// of the row is in the row's default cell, and every value that cell quotes is
/// a default or an environment variable of one of its flags.
#[test]
fn flag_defaults_in_the_docs_are_claps() {
    let flags = run_flags();
    let mut differ = Vec::new();
    for (file, row) in ["docs/operations.md", "README.md"]
        .into_iter()
        .flat_map(|file| {
            table(&doc(file), "| flag | default | what |")
                .into_iter()
                .map(move |row| (file, row))
        })
    {
        let (Some(names), Some(default)) = (row.first(), row.get(1)) else {
            continue;
        };
        let names: Vec<&str> = quoted(names)
            .into_iter()
            .filter_map(|n| n.split_whitespace().next())
            .map(|n| n.split("[=").next().unwrap_or(n))
            .collect();
        let given = quoted(default);
        let known: Vec<(&str, &Flag)> = names
            .iter()
            .filter_map(|n| flags.get(*n).map(|f| (*n, f)))
            .collect();
        for (name, flag) in &known {
            if let Some(d) = &flag.default
                && !given.contains(&d.as_str())
            {
                differ.push(format!(
                    "{file}: {name}: clap's default is {d:?}, the doc's cell {default:?}"
                ));
            }
        }
        for value in &given {
            let claps = known.iter().any(|(_, f)| {
                f.default.as_deref() == Some(*value) || f.env.as_deref() == Some(*value)
            });
            let excused = DEFAULTS_NOT_CLAPS
                .iter()
                .any(|(n, v)| names.contains(n) && v == value);
            if !claps && !excused {
                differ.push(format!(
                    "{file}: {names:?}: the doc gives {value:?} as a default, which is no \
                     flag's default or environment variable in --help"
                ));
            }
        }
    }
    assert!(
        differ.is_empty(),
        "the docs' flag defaults and `ebpf-proxy run --help` differ:\n  {}",
        differ.join("\n  ")
    );
}

/// The Rust files under `dir`, relative to the workspace.
fn rust_files(root: &Path, dir: &Path, out: &mut Vec<String>) {
    let Ok(entries) = fs::read_dir(root.join(dir)) else {
        return;
    };
    for entry in entries {
        let path = dir.join(entry.expect("a directory entry").file_name());
        if root.join(&path).is_dir() {
            rust_files(root, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.to_string_lossy().into_owned());
        }
    }
}

/// Every source file of the crates named below is named by docs/architecture.md's
/// code map, itself or through its folder (`planner/`), or a module's file through
/// the module (`config.rs` names `config/tests.rs`). A cell's names after its first
/// path are in that path's folder (`cli.rs`, `config.rs`).
#[test]
fn the_code_map_names_every_source_file() {
    let root = workspace();
    let mut named = Vec::new();
    for row in table(&doc("docs/architecture.md"), "## Code map") {
        let Some(cell) = row.first() else { continue };
        let mut folder = String::new();
        for entry in quoted(cell) {
            let path = if entry.contains("/src") || entry.starts_with("tests/") {
                entry.to_owned()
            } else {
                format!("{folder}{entry}")
            };
            folder = match path.rfind('/') {
                Some(at) => path[..=at].to_owned(),
                None => String::new(),
            };
            if let Some(module) = path.strip_suffix(".rs") {
                named.push(format!("{module}/"));
            }
            named.push(path);
        }
    }
    let mut files = Vec::new();
    for dir in [
        "proxy-userspace/src",
        "proxy-ebpf/src",
        "proxy-common/src",
        "xtask/src",
        "tests/src",
    ] {
        rust_files(&root, Path::new(dir), &mut files);
    }
    files.sort();
    let unnamed: Vec<&String> = files
        .iter()
        .filter(|f| {
            !named
                .iter()
                .any(|n| *f == n || (n.ends_with('/') && f.starts_with(n.as_str())))
        })
        .collect();
    assert!(
        unnamed.is_empty(),
        "source files docs/architecture.md's code map does not name (a row, or a \
         folder of one): {unnamed:?}"
    );
}
