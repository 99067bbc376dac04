//! What the agent refused of each Service, kept in the pinned
//! `SERVICE_REFUSALS` map for `ebpf-proxy status`: a refusal outlives the
//! log line and the Event that told it, and is read with the rest of the
//! node's state, even while no agent runs.
//!
//! A Service's refusals are entries `0..n` under its name; writing its
//! refusals anew overwrites those and deletes the ones past the new count.

use aya::maps::{HashMap, MapData, MapError};
use proxy_common::{RefusalKey, RefusalRecord};

use crate::planner::encode;

/// Why a Service's refusals could not be recorded.
#[derive(Debug, thiserror::Error)]
pub enum RefusalRecordsError {
    // Boxed: aya's `MapError` would make every `Result` of these large.
    #[error("recording refusal {index} of {service}: {source}")]
    Write {
        service: String,
        index: u32,
        #[source]
        source: Box<MapError>,
    },
    #[error("reading the recorded refusals: {0}")]
    Read(#[source] Box<MapError>),
}

/// One refusal as recorded: its reason's label and its account.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Recorded {
    pub reason: String,
    pub text: String,
}

/// The pinned `SERVICE_REFUSALS` map, written by the sync loop.
pub struct RefusalRecords {
    map: HashMap<MapData, RefusalKey, RefusalRecord>,
}

impl std::fmt::Debug for RefusalRecords {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RefusalRecords")
    }
}

impl RefusalRecords {
    pub fn new(map: HashMap<MapData, RefusalKey, RefusalRecord>) -> Self {
        Self { map }
    }

    /// Forgets every record: an earlier agent's are of its own syncs, and
    /// this agent's first sync writes the ones still true.
    pub fn clear(&mut self) -> Result<(), RefusalRecordsError> {
        let keys: Vec<RefusalKey> = self
            .map
            .keys()
            .collect::<Result<_, _>>()
            .map_err(|e| RefusalRecordsError::Read(Box::new(e)))?;
        for key in keys {
            // Gone already is as good as deleted.
            let _ = self.map.remove(&key);
        }
        Ok(())
    }

    /// Records `now` as the refusals of `namespace`/`name`, which had
    /// `before` of them recorded. Entries that could not be written leave
    /// the ones before them in place; the caller tries again later.
    pub fn write(
        &mut self,
        namespace: &str,
        name: &str,
        now: &[(&str, String)],
        before: usize,
    ) -> Result<(), RefusalRecordsError> {
        for (index, (reason, text)) in (0u32..).zip(now) {
            let key = encode::refusal_key(namespace, name, index);
            self.map
                .insert(key, encode::refusal_record(reason, text), 0)
                .map_err(|source| RefusalRecordsError::Write {
                    service: format!("{namespace}/{name}"),
                    index,
                    source: Box::new(source),
                })?;
        }
        for index in now.len()..before {
            let index = u32::try_from(index).unwrap_or(u32::MAX);
            let _ = self
                .map
                .remove(&encode::refusal_key(namespace, name, index));
        }
        Ok(())
    }
}

/// Every recorded refusal of `map`, by (namespace, name), in index order.
pub fn read(
    map: &HashMap<MapData, RefusalKey, RefusalRecord>,
) -> Result<std::collections::BTreeMap<(String, String), Vec<Recorded>>, RefusalRecordsError> {
    let mut by_service: std::collections::BTreeMap<(String, String), Vec<(u32, Recorded)>> =
        std::collections::BTreeMap::new();
    for entry in map {
        let (key, value) = entry.map_err(|e| RefusalRecordsError::Read(Box::new(e)))?;
        by_service
            .entry((
                encode::name_text(&key.namespace),
                encode::name_text(&key.name),
            ))
            .or_default()
            .push((
                key.index,
                Recorded {
                    reason: encode::name_text(&value.reason),
                    text: encode::name_text(&value.text),
                },
            ));
    }
    Ok(by_service
        .into_iter()
        .map(|(service, mut records)| {
            records.sort_by_key(|(index, _)| *index);
            (service, records.into_iter().map(|(_, r)| r).collect())
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use proxy_common::REFUSAL_TEXT_LEN;

    use crate::planner::encode;

    #[test]
    fn a_record_reads_back_and_a_long_account_is_cut_with_an_ellipsis() {
        let record = encode::refusal_record("cluster_ip", "externalIP 10.96.0.11");
        assert_eq!(
            (
                encode::name_text(&record.reason),
                encode::name_text(&record.text)
            ),
            (
                "cluster_ip".to_string(),
                "externalIP 10.96.0.11".to_string()
            )
        );
        // A multi-byte character across the cut is not split.
        let long = format!("{}é{}", "x".repeat(REFUSAL_TEXT_LEN - 4), "y".repeat(50));
        let text = encode::name_text(&encode::refusal_record("budget", &long).text);
        assert!(
            text.len() <= REFUSAL_TEXT_LEN && text.ends_with("...") && !text.contains('\u{fffd}'),
            "cut to {} bytes: {text:?}",
            text.len()
        );
        let key = encode::refusal_key("shop", "web", 3);
        assert_eq!(
            (
                encode::name_text(&key.namespace),
                encode::name_text(&key.name),
                key.index
            ),
            ("shop".to_string(), "web".to_string(), 3)
        );
    }
}
