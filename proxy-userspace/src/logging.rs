//! The agent's log on standard error: tracing's text format, coloured only
//! for a person at a terminal, or one JSON object per line for log
//! collectors. Both carry the same things: time, level, target, the
//! event's fields and the fields of the spans it happened in.

use std::{ffi::OsStr, io::IsTerminal};

use clap::ValueEnum;
use tracing_subscriber::{EnvFilter, filter::FromEnvError};

/// `--log-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// One line per event, as a person reads it.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, the event's
    /// fields (`message` among them) at the top level, `span` (the innermost
    /// span) and `spans` (every enclosing span, outermost first), each with
    /// its `name` and fields.
    Json,
}

#[derive(Debug, thiserror::Error)]
pub enum LoggingError {
    #[error("installing the log subscriber: {0}")]
    Install(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// Where the filter comes from when `RUST_LOG` is unset.
const DEFAULT_FILTER: &str = "info";

/// Whether the text log may carry ANSI colour: only a terminal renders the
/// escape sequences (a file, a pipe, `kubectl logs` and log collectors show
/// them raw), and never when `NO_COLOR` is set to anything but the empty
/// string (no-color.org's rule).
pub fn use_colour(stream_is_terminal: bool, no_color: Option<&OsStr>) -> bool {
    stream_is_terminal && no_color.is_none_or(OsStr::is_empty)
}

/// Installs the process's subscriber. An unparsable `RUST_LOG` is reported in
/// the log itself (naming the variable and the reason) and the default
/// filter used instead: a typo there must not silence the agent or stop it.
pub fn init(format: LogFormat) -> Result<(), LoggingError> {
    let (filter, bad_filter) = match EnvFilter::try_from_default_env() {
        Ok(filter) => (filter, None),
        Err(e) => (EnvFilter::new(DEFAULT_FILTER), unparsable(&e)),
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(passing_datapath(filter))
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder
            .with_ansi(use_colour(
                std::io::stderr().is_terminal(),
                std::env::var_os("NO_COLOR").as_deref(),
            ))
            .try_init(),
        LogFormat::Json => builder
            .json()
            .with_ansi(false)
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(true)
            .try_init(),
    }
    .map_err(LoggingError::Install)?;
    if let Some(reason) = bad_filter {
        tracing::warn!(
            variable = "RUST_LOG",
            error = %reason,
            "not a log filter; logging at {DEFAULT_FILTER}"
        );
    }
    Ok(())
}

/// The datapath's records are filtered where they are made (by
/// `--datapath-log`): unless the filter says otherwise of their target, it
/// lets them all through, so that `--datapath-log debug` shows debug
/// records in an agent logging at info.
fn passing_datapath(filter: EnvFilter) -> EnvFilter {
    let target = crate::datapath::event_log::TARGET;
    if filter.to_string().contains(target) {
        return filter;
    }
    match format!("{target}=trace").parse() {
        Ok(directive) => filter.add_directive(directive),
        Err(_) => filter,
    }
}

/// The reason `RUST_LOG` was refused, or `None` when it is merely unset.
fn unparsable(error: &FromEnvError) -> Option<String> {
    std::env::var_os(EnvFilter::DEFAULT_ENV).map(|_| error.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn colour_only_on_a_terminal_without_no_color() {
        let cases: [(bool, Option<&str>, bool); 6] = [
            (true, None, true),
            (true, Some(""), true),
            (true, Some("1"), false),
            (true, Some("false"), false),
            (false, None, false),
            (false, Some("1"), false),
        ];
        for (terminal, no_color, want) in cases {
            assert_eq!(
                use_colour(terminal, no_color.map(OsStr::new)),
                want,
                "terminal {terminal}, NO_COLOR {no_color:?}"
            );
        }
    }
}
