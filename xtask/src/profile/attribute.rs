//! Samples to source lines: each sample's call chain (leaf first, as `perf script`
//! prints it) is matched against the programs' JIT images. A sample whose leaf is in a
//! program is that program's own instruction, at the source line whose JIT stretch
//! holds it; a sample further down the chain is time in the kernel function the
//! program called, charged to that function and to the line of the call (the
//! datapath's own line last before it, `Line::ours`).

use std::collections::HashMap;

/// One function's JIT image: the program's main body or one of its subprograms.
#[derive(Debug, Clone, Copy)]
pub struct Function {
    pub start: u64,
    pub len: u32,
}

/// Where the JIT image of one line info record starts, and its source.
#[derive(Debug, Clone)]
pub struct Line {
    pub addr: u64,
    pub file: String,
    pub number: u32,
    pub text: String,
    /// `place` of the last line of the datapath's own sources at or before this one
    /// in the image (`Program::new`). BTF line info names only the innermost line
    /// of inlined code, so a library's line (aya's map helpers, `core`'s
    /// comparisons) says nothing of which lookup or comparison it was; the
    /// datapath's line before it in the image says where the code was.
    pub ours: Option<String>,
}

impl Line {
    /// `file:line`, the file by its name alone.
    pub fn place(&self) -> String {
        let file = self.file.rsplit('/').next().unwrap_or(&self.file);
        format!("{file}:{}", self.number)
    }

    /// Whether the line is the datapath's own, not a library's.
    fn is_ours(&self) -> bool {
        OUR_SOURCES.iter().any(|dir| self.file.contains(dir))
    }

    /// `place`, and for a library's line the datapath's line before it.
    pub fn described(&self) -> String {
        match &self.ours {
            Some(ours) if !self.is_ours() => format!("{} after {ours}", self.place()),
            _ => self.place(),
        }
    }

    /// The datapath's own line this is, or the last before it.
    fn site(&self) -> String {
        self.ours.clone().unwrap_or_else(|| self.place())
    }
}

/// The source directories of the datapath's own code.
const OUR_SOURCES: [&str; 2] = ["proxy-ebpf/src/", "proxy-common/src/"];

/// A loaded program: its functions' images and its lines, by address.
#[derive(Debug, Clone)]
pub struct Program {
    pub id: u32,
    pub name: String,
    functions: Vec<Function>,
    lines: Vec<Line>,
}

impl Program {
    pub fn new(id: u32, name: String, functions: Vec<Function>, mut lines: Vec<Line>) -> Self {
        lines.sort_by_key(|l| l.addr);
        let mut ours = None;
        for line in &mut lines {
            if line.is_ours() {
                ours = Some(line.place());
            }
            line.ours.clone_from(&ours);
        }
        Program {
            id,
            name,
            functions,
            lines,
        }
    }

    /// The lowest and past-the-highest address of its functions' images.
    #[cfg(test)]
    pub fn bounds(&self) -> Option<(u64, u64)> {
        let first = self.functions.iter().map(|f| f.start).min()?;
        let last = self
            .functions
            .iter()
            .map(|f| f.start + u64::from(f.len))
            .max()?;
        Some((first, last))
    }

    /// Its line records, by address.
    #[cfg(test)]
    pub fn lines(&self) -> &[Line] {
        &self.lines
    }

    fn holds(&self, ip: u64) -> bool {
        self.functions
            .iter()
            .any(|f| ip >= f.start && ip < f.start + u64::from(f.len))
    }

    /// The line whose stretch holds `ip`: the last to start at or before it.
    fn line_at(&self, ip: u64) -> Option<&Line> {
        let after = self.lines.partition_point(|l| l.addr <= ip);
        after.checked_sub(1).map(|i| &self.lines[i])
    }
}

/// One frame of a sample's call chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub ip: u64,
    pub symbol: String,
}

/// The samples of `perf script -F ip,sym` over a recording with call chains: one
/// block of frames per sample, leaf first, blocks apart by blank lines. A line that is
/// not a frame (a header, a command name) is skipped.
pub fn parse_samples(text: &str) -> Vec<Vec<Frame>> {
    let mut samples = Vec::new();
    let mut frames = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() {
            if !frames.is_empty() {
                samples.push(std::mem::take(&mut frames));
            }
            continue;
        }
        let (ip, symbol) = line.split_once(char::is_whitespace).unwrap_or((line, ""));
        if let Ok(ip) = u64::from_str_radix(ip, 16) {
            frames.push(Frame {
                ip,
                symbol: symbol.trim().to_string(),
            });
        }
    }
    if !frames.is_empty() {
        samples.push(frames);
    }
    samples
}

/// A program's share of the samples.
#[derive(Debug, Default)]
pub struct Profile {
    /// Samples anywhere in the program or in what it called.
    pub samples: u64,
    /// Samples at its own instructions, by line (`Line::described`, with its text).
    pub own: HashMap<(String, String), u64>,
    /// Samples in kernel functions it called: by function, and the line of the call.
    pub called: HashMap<(String, String), u64>,
}

impl Profile {
    pub fn own_samples(&self) -> u64 {
        self.own.values().sum()
    }

    /// `map`'s entries, most samples first (ties by name, for a stable order).
    pub fn ranked(map: &HashMap<(String, String), u64>) -> Vec<(&(String, String), u64)> {
        let mut v: Vec<_> = map.iter().map(|(k, &n)| (k, n)).collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        v
    }
}

/// Each program's profile from `samples`, in `programs`' order.
pub fn attribute(programs: &[Program], samples: &[Vec<Frame>]) -> Vec<Profile> {
    let mut profiles: Vec<Profile> = programs.iter().map(|_| Profile::default()).collect();
    for frames in samples {
        let Some((depth, p)) = frames.iter().enumerate().find_map(|(depth, f)| {
            programs
                .iter()
                .position(|p| p.holds(f.ip))
                .map(|p| (depth, p))
        }) else {
            continue;
        };
        let program = &programs[p];
        let profile = &mut profiles[p];
        profile.samples += 1;
        let unknown = || ("?".to_string(), String::new());
        if depth == 0 {
            let key = program
                .line_at(frames[0].ip)
                .map_or_else(unknown, |l| (l.described(), l.text.clone()));
            *profile.own.entry(key).or_default() += 1;
        } else {
            // The program's frame holds the return address: the call is just before.
            let site = program
                .line_at(frames[depth].ip - 1)
                .map_or_else(|| "?".to_string(), Line::site);
            let callee = frames[depth - 1].symbol.clone();
            *profile.called.entry((callee, site)).or_default() += 1;
        }
    }
    profiles
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program() -> Program {
        let line = |addr, line: u32, text: &str| Line {
            addr,
            file: "/src/proxy-ebpf/src/flow_cache.rs".to_string(),
            number: line,
            text: text.to_string(),
            ours: None,
        };
        Program::new(
            7,
            "tc_ingress".to_string(),
            vec![
                Function {
                    start: 0x1000,
                    len: 0x100,
                },
                Function {
                    start: 0x2000,
                    len: 0x10,
                },
            ],
            // Out of order, as the kernel may list a subprogram's first.
            vec![
                line(0x2000, 90, "sub"),
                line(0x1000, 10, "entry"),
                line(0x1040, 20, "lookup"),
                Line {
                    addr: 0x1060,
                    file: "/registry/aya-ebpf-bindings/src/x86_64/helpers.rs".to_string(),
                    number: 10,
                    text: "fun(map, key)".to_string(),
                    ours: None,
                },
                line(0x1080, 30, "after"),
            ],
        )
    }

    #[test]
    fn perf_script_blocks_become_samples_leaf_first() {
        let text = "\tffffffff81000010 htab_map_hash\n\tffffffffc0001050 bpf_prog_ab_tc_ingress\n\n\
                    \tffffffffc0001044 bpf_prog_ab_tc_ingress\n\tffffffff81eaf60e net_rx_action\n";
        let samples = parse_samples(text);
        assert_eq!(samples.len(), 2, "two blocks: {samples:?}");
        assert_eq!(samples[0][0].symbol, "htab_map_hash");
        assert_eq!(samples[0][1].ip, 0xffff_ffff_c000_1050);
        assert_eq!(samples[1].len(), 2);
    }

    #[test]
    fn own_instructions_go_to_the_line_whose_stretch_holds_them() {
        let samples = vec![
            vec![Frame {
                ip: 0x1044,
                symbol: "p".into(),
            }],
            vec![Frame {
                ip: 0x1050,
                symbol: "p".into(),
            }],
            vec![Frame {
                ip: 0x1080,
                symbol: "p".into(),
            }],
            vec![Frame {
                ip: 0x2004,
                symbol: "p".into(),
            }],
            // Another program's: not this one's.
            vec![Frame {
                ip: 0x3000,
                symbol: "q".into(),
            }],
        ];
        let profile = &attribute(&[program()], &samples)[0];
        assert_eq!(
            profile.samples, 4,
            "the sample at 0x3000 is outside every image"
        );
        let own = |place: &str| {
            profile
                .own
                .iter()
                .filter(|((p, _), _)| p == place)
                .map(|(_, n)| *n)
                .sum::<u64>()
        };
        assert_eq!(
            [
                own("flow_cache.rs:20"),
                own("flow_cache.rs:30"),
                own("flow_cache.rs:90")
            ],
            [2, 1, 1],
            "own samples by line: {:?}",
            profile.own
        );
    }

    #[test]
    fn a_librarys_line_is_told_with_the_datapaths_line_before_it() {
        let samples = vec![
            vec![Frame {
                ip: 0x1064,
                symbol: "p".into(),
            }],
            vec![
                Frame {
                    ip: 0xffff_ffff_8100_0000,
                    symbol: "htab_lru_map_update_elem".into(),
                },
                Frame {
                    ip: 0x1070,
                    symbol: "p".into(),
                },
            ],
        ];
        let profile = &attribute(&[program()], &samples)[0];
        let own: Vec<_> = profile
            .own
            .keys()
            .map(|(place, _)| place.as_str())
            .collect();
        assert_eq!(own, ["helpers.rs:10 after flow_cache.rs:20"]);
        let called: Vec<_> = profile.called.keys().collect();
        assert_eq!(
            called,
            [&(
                "htab_lru_map_update_elem".to_string(),
                "flow_cache.rs:20".to_string()
            )],
            "a call from a library's line is charged to the datapath's line around it"
        );
    }

    #[test]
    fn time_in_a_called_function_goes_to_it_and_the_line_of_the_call() {
        // The program's frame holds the return address, the first byte of line 30's
        // stretch: the call is line 20's.
        let samples = vec![vec![
            Frame {
                ip: 0xffff_ffff_8100_0000,
                symbol: "lookup_nulls_elem_raw".into(),
            },
            Frame {
                ip: 0xffff_ffff_8100_0100,
                symbol: "__htab_map_lookup_elem".into(),
            },
            Frame {
                ip: 0x1080,
                symbol: "bpf_prog_ab_tc_ingress".into(),
            },
        ]];
        let profile = &attribute(&[program()], &samples)[0];
        assert_eq!(profile.own_samples(), 0);
        let called: Vec<_> = Profile::ranked(&profile.called);
        assert_eq!(
            called,
            vec![(
                &(
                    "__htab_map_lookup_elem".to_string(),
                    "flow_cache.rs:20".to_string()
                ),
                1
            )],
            "charged to the function the program called, at the call's line"
        );
    }
}
