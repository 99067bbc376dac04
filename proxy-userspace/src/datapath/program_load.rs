//! What loading the datapath's programs cost, program by program: the
//! kernel verifies a program in its `BPF_PROG_LOAD`, and that verification is
//! most of the agent's start before anything is programmed. Kept so that the
//! agent can say at start which programs took the time, and so that the
//! datapath benchmark can tabulate it.

use std::{fmt, time::Duration};

/// One program's load.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProgramLoad {
    pub name: &'static str,
    /// The program's `load` (for the socket notes' iterators, also reading
    /// the kernel's BTF their load resolves its target in, and pinning their
    /// link, which the same call does).
    pub took: Duration,
    /// The instructions the verifier processed (`verified_insns` of the
    /// program's info, Linux 5.16); None on a kernel that does not count
    /// them.
    pub verified_insns: Option<u32>,
}

/// The time all of `loads` took, one after another.
pub fn total(loads: &[ProgramLoad]) -> Duration {
    loads.iter().map(|l| l.took).sum()
}

/// The `n` slowest of `loads`, slowest first; of equal times, the one loaded
/// first first, so that the order does not depend on the sort.
pub fn slowest(loads: &[ProgramLoad], n: usize) -> Vec<&ProgramLoad> {
    let mut by_time: Vec<&ProgramLoad> = loads.iter().collect();
    by_time.sort_by_key(|load| std::cmp::Reverse(load.took));
    by_time.truncate(n);
    by_time
}

/// `slowest(loads, n)` for a log line: `name took (N insns)`, comma
/// separated.
pub struct Slowest<'a>(pub &'a [ProgramLoad], pub usize);

impl fmt::Display for Slowest<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, load) in slowest(self.0, self.1).into_iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{} {}ms", load.name, load.took.as_millis())?;
            match load.verified_insns {
                Some(insns) => write!(f, " ({insns} insns)")?,
                None => f.write_str(" (insns not counted)")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(name: &'static str, ms: u64, verified_insns: Option<u32>) -> ProgramLoad {
        ProgramLoad {
            name,
            took: Duration::from_millis(ms),
            verified_insns,
        }
    }

    #[test]
    fn total_adds_every_load() {
        let loads = [
            load("tc_ingress", 700, Some(6_052)),
            load("xdp_ingress6", 1_100, Some(3_817)),
            load("clock_probe", 2, None),
        ];
        assert_eq!(
            total(&loads),
            Duration::from_millis(1_802),
            "the sum of 700, 1,100 and 2 ms"
        );
        assert_eq!(total(&[]), Duration::ZERO, "nothing loaded took nothing");
    }

    #[test]
    fn slowest_first_and_ties_in_load_order() {
        let loads = [
            load("sock_connect4", 20, Some(400)),
            load("tc_ingress", 700, Some(6_052)),
            load("sock_sendmsg4", 20, Some(300)),
            load("xdp_ingress6", 1_100, Some(3_817)),
        ];
        let names: Vec<&str> = slowest(&loads, 3).iter().map(|l| l.name).collect();
        assert_eq!(
            names,
            ["xdp_ingress6", "tc_ingress", "sock_connect4"],
            "the three slowest, slowest first; of the two at 20 ms the one loaded first"
        );
        assert_eq!(
            slowest(&loads, 10).len(),
            4,
            "asking for more than were loaded gives all of them"
        );
    }

    #[test]
    fn log_line_names_time_and_instructions() {
        let loads = [
            load("tc_ingress", 700, Some(6_052)),
            load("xdp_ingress6", 1_100, None),
            load("clock_probe", 2, Some(5)),
        ];
        assert_eq!(
            Slowest(&loads, 2).to_string(),
            "xdp_ingress6 1100ms (insns not counted), tc_ingress 700ms (6052 insns)",
            "the two slowest with their instruction counts, or the lack of one"
        );
        assert_eq!(
            Slowest(&[], 3).to_string(),
            "",
            "no programs, nothing to name"
        );
    }
}
