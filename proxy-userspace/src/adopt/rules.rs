//! kube-proxy's rules, found and removed as `kube-proxy --cleanup` would remove
//! them, and netfilter's NAT kept alive while they are gone.
//!
//! What counts as kube-proxy's (k/k `pkg/proxy`, read at its current main):
//! - iptables mode, `iptables/proxier.go`: `iptablesJumpChains` and
//!   `CleanupLeftovers` name KUBE-SERVICES, KUBE-NODEPORTS and KUBE-POSTROUTING
//!   (nat), KUBE-SERVICES, KUBE-EXTERNAL-SERVICES, KUBE-FORWARD, KUBE-NODEPORTS and
//!   KUBE-PROXY-FIREWALL (filter); `isServiceChainName` the per-service nat chains
//!   KUBE-SVC-, KUBE-SVL-, KUBE-EXT-, KUBE-FW-, KUBE-SEP- and, before 1.24,
//!   KUBE-XLB- (`deprecatedServiceLBChainNamePrefix`); `syncProxyRules` writes
//!   KUBE-MARK-MASQ (nat), and the iptables `Monitor` KUBE-PROXY-CANARY in mangle,
//!   nat and filter. Its own cleanup leaves KUBE-MARK-MASQ, KUBE-PROXY-FIREWALL and
//!   KUBE-PROXY-CANARY behind; they are kube-proxy's all the same (no other
//!   component writes them since the kubelet stopped writing KUBE-MARK-MASQ), so
//!   they go too.
//! - IPVS mode, `ipvs/proxier.go`: `iptablesCleanupChains` adds KUBE-NODE-PORT and
//!   KUBE-LOAD-BALANCER (nat), KUBE-NODE-PORT, KUBE-SOURCE-RANGES-FIREWALL,
//!   KUBE-IPVS-FILTER and KUBE-IPVS-OUT-FILTER (filter); `cleanupLeftovers` flushes
//!   every IPVS virtual server, deletes the `kube-ipvs0` dummy link and destroys the
//!   `ipsetInfo` sets (all named `KUBE-`, `KUBE-6-` for IPv6).
//! - nftables mode, `nftables/proxier.go` `CleanupLeftovers`: the `kube-proxy`
//!   table of family `ip` and of family `ip6`, nothing else.
//!
//! Not kube-proxy's, and left alone: the kubelet's KUBE-FIREWALL,
//! KUBE-KUBELET-CANARY, KUBE-MARK-DROP and KUBE-IPTABLES-HINT (k/k
//! `pkg/kubelet/kubelet_network_linux.go`), which kube-proxy itself never deletes.
//! Old IPVS-mode kube-proxy also had a nat-table KUBE-FIREWALL; its name is the
//! kubelet's, only chains of kube-proxy's reach it, and flushing those leaves it
//! unreferenced and inert, so it is left rather than risk the kubelet's.
//!
//! The tools are run, not reimplemented: `*-save` reads a backend, one
//! `*-restore --noflush` per table removes from it, so each table changes in one
//! transaction, and `nft` handles the tables. Each command runs in the calling
//! thread's network namespace (a child inherits it), which is how the tests work
//! in a namespace of their own.

use std::{
    fmt,
    io::{self, Write as _},
    path::{Path, PathBuf},
    process::{Command, ExitStatus, Stdio},
};

/// The table [`keep_nat_alive`] creates, in family `ip` and `ip6`.
pub const NAT_KEEPALIVE_TABLE: &str = "ebpf-proxy-nat";

/// The dummy link IPVS-mode kube-proxy binds every service address to.
pub const IPVS_LINK: &str = "kube-ipvs0";

/// How long a restore waits for the xtables lock another writer holds.
const XTABLES_WAIT_SECONDS: &str = "--wait=30";

#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    #[error("{tool} not found on PATH, in /usr/sbin or in /sbin")]
    ToolMissing { tool: String },
    #[error("running `{command}`: {source}")]
    Spawn { command: String, source: io::Error },
    #[error("`{command}` failed ({status}): {stderr}")]
    Failed {
        command: String,
        status: ExitStatus,
        stderr: String,
    },
    #[error("reading {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("`{command}` printed what could not be read: {reason}")]
    Parse { command: String, reason: String },
}

/// Which of iptables' two implementations a rule set lives in: they do not see
/// each other's rules, and kube-proxy picks whichever the node's other rules use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IptablesBackend {
    Legacy,
    Nft,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IpFamily {
    V4,
    V6,
}

impl IptablesBackend {
    fn tool(self, family: IpFamily, verb: &str) -> String {
        let base = match family {
            IpFamily::V4 => "iptables",
            IpFamily::V6 => "ip6tables",
        };
        let backend = match self {
            Self::Legacy => "legacy",
            Self::Nft => "nft",
        };
        format!("{base}-{backend}-{verb}")
    }
}

impl fmt::Display for IptablesBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Legacy => "iptables-legacy",
            Self::Nft => "iptables-nft",
        })
    }
}

impl fmt::Display for IpFamily {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::V4 => "IPv4",
            Self::V6 => "IPv6",
        })
    }
}

/// kube-proxy's part of one iptables table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableLeftovers {
    /// `nat`, `filter` or `mangle`.
    pub table: String,
    /// kube-proxy's chains, in `*-save` order.
    pub chains: Vec<String>,
    /// Rules inside those chains.
    pub rules: usize,
    /// Rules of other chains that jump (`-j`, `-g`) to them, as `*-save` prints
    /// them: a chain cannot be deleted while one remains.
    pub jumps: Vec<String>,
}

/// kube-proxy's rules in one backend and family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IptablesLeftovers {
    pub backend: IptablesBackend,
    pub family: IpFamily,
    pub tables: Vec<TableLeftovers>,
}

/// An nftables-mode `kube-proxy` table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NftLeftovers {
    /// `ip` or `ip6`.
    pub family: String,
    pub chains: usize,
    pub rules: usize,
    /// Sets and maps.
    pub sets: usize,
}

/// What kube-proxy left in the caller's network namespace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Leftovers {
    pub iptables: Vec<IptablesLeftovers>,
    pub nftables: Vec<NftLeftovers>,
    /// The `kube-ipvs0` link exists.
    pub ipvs_link: bool,
    /// IPVS virtual servers (zero when the kernel has no IPVS).
    pub ipvs_virtual_servers: usize,
    pub ipsets: Vec<String>,
    /// Backends that could not be looked at or acted on, and why.
    pub skipped: Vec<String>,
}

impl Leftovers {
    /// Nothing of kube-proxy's was found.
    pub fn is_empty(&self) -> bool {
        self.iptables.is_empty()
            && self.nftables.is_empty()
            && !self.ipvs_link
            && self.ipvs_virtual_servers == 0
            && self.ipsets.is_empty()
    }

    fn describe(&self, f: &mut fmt::Formatter<'_>, verb: &str) -> fmt::Result {
        if self.is_empty() {
            write!(f, "{verb} no kube-proxy rules")?;
        } else {
            write!(f, "{verb} kube-proxy's")?;
            let mut sep = " ";
            for ipt in &self.iptables {
                write!(f, "{sep}{} {}:", ipt.backend, ipt.family)?;
                for (i, t) in ipt.tables.iter().enumerate() {
                    write!(
                        f,
                        "{} {} ({} chains, {} rules, {} jumps from other chains)",
                        if i == 0 { "" } else { "," },
                        t.table,
                        t.chains.len(),
                        t.rules,
                        t.jumps.len()
                    )?;
                }
                sep = "; ";
            }
            for t in &self.nftables {
                write!(
                    f,
                    "{sep}nftables table {} kube-proxy ({} chains, {} rules, {} sets and maps)",
                    t.family, t.chains, t.rules, t.sets
                )?;
                sep = "; ";
            }
            if self.ipvs_link {
                write!(f, "{sep}link {IPVS_LINK}")?;
                sep = "; ";
            }
            if self.ipvs_virtual_servers > 0 {
                write!(f, "{sep}{} IPVS virtual servers", self.ipvs_virtual_servers)?;
                sep = "; ";
            }
            if !self.ipsets.is_empty() {
                write!(f, "{sep}ipsets {}", self.ipsets.join(", "))?;
            }
        }
        if !self.skipped.is_empty() {
            write!(f, " (skipped: {})", self.skipped.join("; "))?;
        }
        Ok(())
    }
}

impl fmt::Display for Leftovers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.describe(f, "found")
    }
}

/// What [`remove`] removed, in the shape [`find`] reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed(pub Leftovers);

impl fmt::Display for Removed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.describe(f, "removed")
    }
}

/// kube-proxy's leftovers in the caller's network namespace, per backend.
pub fn find() -> Result<Leftovers, RulesError> {
    let mut found = Leftovers::default();
    for backend in [IptablesBackend::Legacy, IptablesBackend::Nft] {
        for family in [IpFamily::V4, IpFamily::V6] {
            match iptables_leftovers(backend, family)? {
                Ok(Some(ipt)) => found.iptables.push(ipt),
                Ok(None) => {}
                Err(skipped) => found.skipped.push(skipped),
            }
        }
    }
    match tool("nft") {
        Some(nft) => {
            let tables = nft_tables(&nft)?;
            for family in ["ip", "ip6"] {
                if tables.iter().any(|(f, t)| f == family && t == "kube-proxy") {
                    found.nftables.push(nft_counts(&nft, family)?);
                }
            }
        }
        None => found.skipped.push("nftables: nft not found".to_owned()),
    }
    found.ipvs_link = link_exists(IPVS_LINK);
    found.ipvs_virtual_servers = ipvs_virtual_servers()?;
    match tool("ipset") {
        Some(ipset) => found.ipsets = kube_ipsets(&ipset)?,
        None => found.skipped.push("ipsets: ipset not found".to_owned()),
    }
    Ok(found)
}

/// Removes exactly kube-proxy's part of what [`find`] reported, as it is now (a
/// table is read again right before it is changed), and leaves every other rule,
/// chain, table and link as it was. Finding nothing, it does nothing. Call
/// [`keep_nat_alive`] first, or kube-proxy's established connections are cut.
/// A failure stops at the command that failed: what was removed before it stays
/// removed, and the next [`find`] reports the rest.
pub fn remove(leftovers: &Leftovers) -> Result<Removed, RulesError> {
    let mut removed = Leftovers::default();
    for ipt in &leftovers.iptables {
        let (save, restore) = (
            ipt.backend.tool(ipt.family, "save"),
            ipt.backend.tool(ipt.family, "restore"),
        );
        let save_path = tool(&save).ok_or(RulesError::ToolMissing { tool: save })?;
        let restore_path = tool(&restore).ok_or(RulesError::ToolMissing { tool: restore })?;
        let mut tables = Vec::new();
        for table in leftovers_in(&run(&save_path, &[], None)?) {
            run(
                &restore_path,
                &["--noflush", XTABLES_WAIT_SECONDS],
                Some(&restore_input(&table)),
            )?;
            tables.push(table);
        }
        if !tables.is_empty() {
            removed.iptables.push(IptablesLeftovers {
                backend: ipt.backend,
                family: ipt.family,
                tables,
            });
        }
    }
    if !leftovers.nftables.is_empty() {
        let nft = tool("nft").ok_or(RulesError::ToolMissing {
            tool: "nft".to_owned(),
        })?;
        let present = nft_tables(&nft)?;
        for t in &leftovers.nftables {
            if present
                .iter()
                .any(|(f, name)| *f == t.family && name == "kube-proxy")
            {
                let counts = nft_counts(&nft, &t.family)?;
                run(&nft, &["delete", "table", &t.family, "kube-proxy"], None)?;
                removed.nftables.push(counts);
            }
        }
    }
    // kube-proxy flushes every virtual server (`ipvs.Flush()`), not only the ones
    // it made: a node in IPVS mode has no others. This kernel has no IPVS, so this
    // path is untested here.
    if leftovers.ipvs_virtual_servers > 0 {
        let count = ipvs_virtual_servers()?;
        if count > 0 {
            match tool("ipvsadm") {
                Some(ipvsadm) => {
                    run(&ipvsadm, &["--clear"], None)?;
                    removed.ipvs_virtual_servers = count;
                }
                None => removed.skipped.push(format!(
                    "IPVS: ipvsadm not found, {count} virtual servers left"
                )),
            }
        }
    }
    if leftovers.ipvs_link && link_exists(IPVS_LINK) {
        let ip = tool("ip").ok_or(RulesError::ToolMissing {
            tool: "ip".to_owned(),
        })?;
        run(&ip, &["link", "del", IPVS_LINK], None)?;
        removed.ipvs_link = true;
    }
    // After the iptables rules: a set still matched by a rule cannot be destroyed.
    if !leftovers.ipsets.is_empty() {
        let ipset = tool("ipset").ok_or(RulesError::ToolMissing {
            tool: "ipset".to_owned(),
        })?;
        let present = kube_ipsets(&ipset)?;
        for set in leftovers.ipsets.iter().filter(|s| present.contains(s)) {
            run(&ipset, &["destroy", set], None)?;
            removed.ipsets.push(set.clone());
        }
    }
    Ok(Removed(removed))
}

/// Keeps the namespace's NAT running with no NAT rule of kube-proxy's left.
///
/// kube-proxy's established connections to a Service address are translated by
/// their conntrack entries' NAT bindings alone, no rule involved. But the kernel
/// applies those bindings only while something keeps two sets of hooks
/// registered in the namespace: conntrack's, held by any rule expression that
/// uses conntrack (kube-proxy's `dnat`, `masquerade`, `ct state` and `-m
/// conntrack`), and NAT's, held for every hook of a family by any nat-type chain
/// of that family. Removing kube-proxy's rules, its iptables chains or its
/// `kube-proxy` tables, drops both when nothing else holds them (iptables' nat
/// table and built-in chains, which stay, do not), and every such connection is
/// reset on its next packet: the tests show it for each mode, and that an empty
/// nat chain alone is not enough, as it keeps NAT's hooks but not conntrack's.
///
/// So each family gets a nat chain at postrouting, just after the source NAT
/// priority, whose one rule matches `ct state new` and accepts, as its policy
/// would: it translates nothing and changes no verdict, it only holds both.
/// [`release_nat`] drops it once those connections are gone. Calling this
/// again rewrites the chain in one transaction, so it never holds two rules and
/// never lets go in between.
///
/// `nft` is required: without it this fails, rather than fall back to an
/// iptables nat chain, which would have to pick one of two iptables backends and
/// would look like a leftover of kube-proxy's to the next reader; the agent's
/// image ships `nft`.
pub fn keep_nat_alive() -> Result<(), RulesError> {
    let nft = tool("nft").ok_or(RulesError::ToolMissing {
        tool: "nft".to_owned(),
    })?;
    let mut script = String::new();
    for family in ["ip", "ip6"] {
        script.push_str(&format!(
            "add table {family} {NAT_KEEPALIVE_TABLE} {{ comment \"holds NAT for connections set up before ebpf-proxy\" ; }}\n\
             add chain {family} {NAT_KEEPALIVE_TABLE} keep-nat {{ type nat hook postrouting priority srcnat + 1 ; policy accept ; }}\n\
             flush chain {family} {NAT_KEEPALIVE_TABLE} keep-nat\n\
             add rule {family} {NAT_KEEPALIVE_TABLE} keep-nat ct state new accept\n"
        ));
    }
    run(&nft, &["-f", "-"], Some(&script))?;
    Ok(())
}

/// Deletes [`keep_nat_alive`]'s tables; false when there were none.
pub fn release_nat() -> Result<bool, RulesError> {
    let nft = tool("nft").ok_or(RulesError::ToolMissing {
        tool: "nft".to_owned(),
    })?;
    let mut released = false;
    for (family, table) in nft_tables(&nft)? {
        if table == NAT_KEEPALIVE_TABLE {
            run(&nft, &["delete", "table", &family, &table], None)?;
            released = true;
        }
    }
    Ok(released)
}

/// One backend and family's leftovers; `Err` says why it was skipped.
fn iptables_leftovers(
    backend: IptablesBackend,
    family: IpFamily,
) -> Result<Result<Option<IptablesLeftovers>, String>, RulesError> {
    let save = backend.tool(family, "save");
    let Some(path) = tool(&save) else {
        return Ok(Err(format!("{backend} {family}: {save} not found")));
    };
    // A legacy table exists in a namespace once something used it; `*-save -t`
    // would create it, and with the nat table its NAT hooks. Saving without `-t`
    // reads only the tables this file lists, and an absent file means no table.
    if backend == IptablesBackend::Legacy {
        let names = match family {
            IpFamily::V4 => "/proc/thread-self/net/ip_tables_names",
            IpFamily::V6 => "/proc/thread-self/net/ip6_tables_names",
        };
        match std::fs::read_to_string(names) {
            Ok(tables) if tables.trim().is_empty() => return Ok(Ok(None)),
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Ok(None)),
            Err(source) => {
                return Err(RulesError::Read {
                    path: names.to_owned(),
                    source,
                });
            }
        }
    }
    let tables = leftovers_in(&run(&path, &[], None)?);
    Ok(Ok((!tables.is_empty()).then_some(IptablesLeftovers {
        backend,
        family,
        tables,
    })))
}

/// One table of `*-save` output.
#[derive(Debug, Default)]
struct SavedTable {
    name: String,
    chains: Vec<String>,
    /// (chain, the rule's line as printed).
    rules: Vec<(String, String)>,
}

fn parse_save(text: &str) -> Vec<SavedTable> {
    let mut tables = Vec::new();
    let mut current: Option<SavedTable> = None;
    for line in text.lines().map(str::trim_end) {
        if let Some(name) = line.strip_prefix('*') {
            current = Some(SavedTable {
                name: name.to_owned(),
                ..SavedTable::default()
            });
        } else if line == "COMMIT" {
            tables.extend(current.take());
        } else if let Some(t) = current.as_mut() {
            if let Some(chain) = line.strip_prefix(':') {
                t.chains
                    .extend(chain.split_whitespace().next().map(str::to_owned));
            } else if let Some(chain) = line
                .strip_prefix("-A ")
                .and_then(|rule| rule.split_whitespace().next())
            {
                t.rules.push((chain.to_owned(), line.to_owned()));
            }
        }
    }
    tables
}

/// kube-proxy's chains of `table`, per the module's list.
fn is_kube_proxy_chain(table: &str, chain: &str) -> bool {
    const SERVICE_PREFIXES: [&str; 6] = [
        "KUBE-SVC-",
        "KUBE-SVL-",
        "KUBE-EXT-",
        "KUBE-FW-",
        "KUBE-SEP-",
        "KUBE-XLB-",
    ];
    match table {
        "nat" => {
            matches!(
                chain,
                "KUBE-SERVICES"
                    | "KUBE-NODEPORTS"
                    | "KUBE-POSTROUTING"
                    | "KUBE-MARK-MASQ"
                    | "KUBE-PROXY-CANARY"
                    | "KUBE-NODE-PORT"
                    | "KUBE-LOAD-BALANCER"
            ) || SERVICE_PREFIXES.iter().any(|p| chain.starts_with(p))
        }
        "filter" => matches!(
            chain,
            "KUBE-SERVICES"
                | "KUBE-EXTERNAL-SERVICES"
                | "KUBE-NODEPORTS"
                | "KUBE-FORWARD"
                | "KUBE-PROXY-FIREWALL"
                | "KUBE-PROXY-CANARY"
                | "KUBE-NODE-PORT"
                | "KUBE-SOURCE-RANGES-FIREWALL"
                | "KUBE-IPVS-FILTER"
                | "KUBE-IPVS-OUT-FILTER"
        ),
        "mangle" => chain == "KUBE-PROXY-CANARY",
        _ => false,
    }
}

/// A rule's words as iptables-restore reads them: `"..."` quoting, with `\"`
/// and `\\` inside it (how `*-save` prints a comment).
fn words(rule: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut quoted = false;
    let mut chars = rule.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' if quoted => word.extend(chars.next()),
            '"' => {
                quoted = !quoted;
                in_word = true;
            }
            c if c.is_whitespace() && !quoted => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            c => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if in_word {
        out.push(word);
    }
    out
}

/// The chain a rule jumps or goes to, if any.
fn target(rule: &str) -> Option<String> {
    let words = words(rule);
    words
        .windows(2)
        .find(|w| matches!(w[0].as_str(), "-j" | "-g" | "--jump" | "--goto"))
        .map(|w| w[1].clone())
}

/// kube-proxy's part of each table of `*-save` output.
fn leftovers_in(save: &str) -> Vec<TableLeftovers> {
    parse_save(save)
        .into_iter()
        .filter_map(|t| {
            let chains: Vec<String> = t
                .chains
                .iter()
                .filter(|c| is_kube_proxy_chain(&t.name, c))
                .cloned()
                .collect();
            if chains.is_empty() {
                return None;
            }
            let rules = t.rules.iter().filter(|(c, _)| chains.contains(c)).count();
            let jumps = t
                .rules
                .iter()
                .filter(|(c, rule)| {
                    !chains.contains(c) && target(rule).is_some_and(|to| chains.contains(&to))
                })
                .map(|(_, rule)| rule.clone())
                .collect();
            Some(TableLeftovers {
                table: t.name,
                chains,
                rules,
                jumps,
            })
        })
        .collect()
}

/// One `*-restore --noflush` transaction removing `table`'s leftovers: a chain
/// line flushes an existing chain (as kube-proxy's own cleanup relies on), each
/// jump is deleted by the rule `*-save` printed, then the emptied chains go.
fn restore_input(table: &TableLeftovers) -> String {
    let mut input = format!("*{}\n", table.table);
    for chain in &table.chains {
        input.push_str(&format!(":{chain} - [0:0]\n"));
    }
    for jump in &table.jumps {
        input.push_str("-D");
        input.push_str(jump.strip_prefix("-A").unwrap_or(jump));
        input.push('\n');
    }
    for chain in &table.chains {
        input.push_str(&format!("-X {chain}\n"));
    }
    input.push_str("COMMIT\n");
    input
}

/// (family, name) of every nftables table.
fn nft_tables(nft: &Path) -> Result<Vec<(String, String)>, RulesError> {
    let out = run(nft, &["list", "tables"], None)?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            match (w.next(), w.next(), w.next()) {
                (Some("table"), Some(family), Some(name)) => {
                    Some((family.to_owned(), name.to_owned()))
                }
                _ => None,
            }
        })
        .collect())
}

fn nft_counts(nft: &Path, family: &str) -> Result<NftLeftovers, RulesError> {
    let out = run(nft, &["-j", "list", "table", family, "kube-proxy"], None)?;
    let parse_error = |reason: String| RulesError::Parse {
        command: format!("{} -j list table {family} kube-proxy", nft.display()),
        reason,
    };
    let json: serde_json::Value =
        serde_json::from_str(&out).map_err(|e| parse_error(e.to_string()))?;
    let objects = json
        .get("nftables")
        .and_then(serde_json::Value::as_array)
        .ok_or_else(|| parse_error("no \"nftables\" array".to_owned()))?;
    let count = |kinds: &[&str]| {
        objects
            .iter()
            .filter(|o| kinds.iter().any(|k| o.get(k).is_some()))
            .count()
    };
    Ok(NftLeftovers {
        family: family.to_owned(),
        chains: count(&["chain"]),
        rules: count(&["rule"]),
        sets: count(&["set", "map"]),
    })
}

fn link_exists(name: &str) -> bool {
    // The ioctl's socket is opened in the calling thread's namespace, where sysfs
    // would show the namespace it was mounted in.
    nix::net::if_::if_nametoindex(name).is_ok()
}

/// Virtual servers in `/proc/net/ip_vs`: one line each, its real servers
/// indented under it; the file is absent when the kernel has no IPVS.
fn ipvs_virtual_servers() -> Result<usize, RulesError> {
    let path = "/proc/thread-self/net/ip_vs";
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text
            .lines()
            .filter(|l| {
                ["TCP ", "UDP ", "SCTP ", "FWM "]
                    .iter()
                    .any(|p| l.starts_with(p))
            })
            .count()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(0),
        Err(source) => Err(RulesError::Read {
            path: path.to_owned(),
            source,
        }),
    }
}

/// IPVS mode's sets: every one is `KUBE-` (`KUBE-6-` for IPv6) and nothing
/// else names sets so. Untested here: this machine has no `ipset`.
fn kube_ipsets(ipset: &Path) -> Result<Vec<String>, RulesError> {
    Ok(run(ipset, &["list", "-n"], None)?
        .lines()
        .map(str::trim)
        .filter(|s| s.starts_with("KUBE-"))
        .map(str::to_owned)
        .collect())
}

/// `name` on PATH, else in /usr/sbin or /sbin (a PATH without the sbin
/// directories is common in containers).
fn tool(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
        .map(|dir| dir.join(name))
        .find(|p| p.is_file())
}

/// Runs `program` with `stdin`, returning its stdout; a failure names the
/// command and carries its stderr.
fn run(program: &Path, args: &[&str], stdin: Option<&str>) -> Result<String, RulesError> {
    let command = std::iter::once(program.display().to_string())
        .chain(args.iter().map(|a| (*a).to_owned()))
        .collect::<Vec<_>>()
        .join(" ");
    let spawn_error = |source| RulesError::Spawn {
        command: command.clone(),
        source,
    };
    let mut child = Command::new(program)
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(spawn_error)?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(input.as_bytes()).map_err(spawn_error)?;
    }
    let out = child.wait_with_output().map_err(spawn_error)?;
    if !out.status.success() {
        return Err(RulesError::Failed {
            command,
            status: out.status,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[cfg(test)]
mod tests;
