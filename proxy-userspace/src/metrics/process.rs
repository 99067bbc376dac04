//! The process metrics of Prometheus' client libraries (the Go one's names,
//! which kube-proxy's dashboards read), from /proc/self at scrape time.

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

#[derive(Debug, thiserror::Error)]
pub enum ProcessError {
    #[error("reading {path}: {source}")]
    Read {
        path: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {what}")]
    Format { path: &'static str, what: String },
}

/// What /proc/self/stat says, in its own units.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stat {
    /// User and system time, in clock ticks.
    pub cpu_ticks: u64,
    /// Start, in clock ticks after boot.
    pub start_ticks: u64,
    pub virtual_bytes: u64,
    pub resident_pages: u64,
}

/// Parses /proc/self/stat (proc(5)): the command name, in parentheses, may
/// hold spaces and parentheses itself, so fields are counted after its last
/// `)`.
pub fn parse_stat(text: &str) -> Result<Stat, ProcessError> {
    let bad = |what: String| ProcessError::Format {
        path: "/proc/self/stat",
        what,
    };
    let rest = text
        .rsplit_once(')')
        .map(|(_, rest)| rest)
        .ok_or_else(|| bad("no command name in parentheses".into()))?;
    // Field 3 (state) is the first after the name.
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let field = |n: usize| -> Result<u64, ProcessError> {
        let text = fields
            .get(n - 3)
            .ok_or_else(|| bad(format!("{} fields, field {n} missing", fields.len() + 2)))?;
        text.parse()
            .map_err(|_| bad(format!("field {n} is {text:?}, not a number")))
    };
    Ok(Stat {
        cpu_ticks: field(14)? + field(15)?,
        start_ticks: field(22)?,
        virtual_bytes: field(23)?,
        resident_pages: field(24)?,
    })
}

/// The boot time in seconds since the epoch, from /proc/stat's `btime`.
pub fn parse_boot_time(text: &str) -> Result<u64, ProcessError> {
    text.lines()
        .find_map(|line| line.strip_prefix("btime "))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| ProcessError::Format {
            path: "/proc/stat",
            what: "no btime line".into(),
        })
}

fn read(path: &'static str) -> Result<String, ProcessError> {
    std::fs::read_to_string(path).map_err(|source| ProcessError::Read { path, source })
}

fn sysconf(name: libc::c_int) -> u64 {
    // SAFETY: sysconf only reads a configuration value.
    let value = unsafe { libc::sysconf(name) };
    u64::try_from(value).unwrap_or(0).max(1)
}

/// The process' metrics at one moment.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sample {
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub start_time_seconds: f64,
    pub open_fds: u64,
    pub max_fds: u64,
}

impl Sample {
    pub fn read() -> Result<Sample, ProcessError> {
        let stat = parse_stat(&read("/proc/self/stat")?)?;
        let boot = parse_boot_time(&read("/proc/stat")?)?;
        let ticks = sysconf(libc::_SC_CLK_TCK) as f64;
        let open_fds = std::fs::read_dir("/proc/self/fd")
            .map_err(|source| ProcessError::Read {
                path: "/proc/self/fd",
                source,
            })?
            .count() as u64;
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the limit it reads into `limit`.
        let max_fds = match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) } {
            0 => limit.rlim_cur,
            _ => 0,
        };
        Ok(Sample {
            cpu_seconds: stat.cpu_ticks as f64 / ticks,
            resident_bytes: stat.resident_pages * sysconf(libc::_SC_PAGESIZE),
            virtual_bytes: stat.virtual_bytes,
            start_time_seconds: boot as f64 + stat.start_ticks as f64 / ticks,
            open_fds,
            max_fds,
        })
    }
}

#[derive(Debug, Default)]
pub struct ProcessCollector;

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let sample = match Sample::read() {
            Ok(sample) => sample,
            Err(e) => {
                tracing::warn!(error = %e, "process metrics left out of this scrape");
                return Ok(());
            }
        };
        let cpu = ConstCounter::new(sample.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges = [
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                sample.resident_bytes as f64,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                sample.virtual_bytes as f64,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                sample.start_time_seconds,
            ),
            (
                "process_open_fds",
                "Number of open file descriptors",
                sample.open_fds as f64,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                sample.max_fds as f64,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_fields_are_counted_after_the_command_name() {
        // A command name with spaces and parentheses, as a process may set.
        let text = "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 900 0 0 0 \
                    150 50 0 0 20 0 4 0 12345 104857600 2560 18446744073709551615 \
                    1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(text).expect("a valid stat line"),
            Stat {
                cpu_ticks: 200,
                start_ticks: 12345,
                virtual_bytes: 104_857_600,
                resident_pages: 2560,
            }
        );
        let err = parse_stat("4242 (x) S 1 2").expect_err("truncated");
        assert!(err.to_string().contains("field 14 missing"), "{err}");
        let err = parse_stat("no name here").expect_err("no name");
        assert!(err.to_string().contains("parentheses"), "{err}");
    }

    #[test]
    fn boot_time_comes_from_btime() {
        assert_eq!(
            parse_boot_time("cpu 1 2 3\nbtime 1700000000\nprocesses 5\n").ok(),
            Some(1_700_000_000)
        );
        assert!(parse_boot_time("cpu 1 2 3\n").is_err());
    }

    #[test]
    fn this_process_reads_as_itself() {
        let sample = Sample::read().expect("/proc/self");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs_f64();
        assert!(
            sample.start_time_seconds <= now + 1.0 && sample.start_time_seconds > now - 86_400.0,
            "start time {} is not within the last day (now {now})",
            sample.start_time_seconds
        );
        assert!(sample.resident_bytes > 1 << 20, "{sample:?}");
        assert!(
            sample.open_fds >= 3 && sample.open_fds <= sample.max_fds,
            "{sample:?}"
        );
    }
}
