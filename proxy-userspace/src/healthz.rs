//! Whether the proxy is healthy, and what /healthz, /livez and /readyz
//! answer (docs/kube-proxy-semantics.md, "Health"); `http` serves them.
//!
//! /healthz is kube-proxy's: 503 until the first full sync is in the maps;
//! afterwards 503 while a queued change has waited longer than the health
//! timeout (2 x `--sync-period`) without being programmed, a change whose
//! writes keep failing included, and while this node is not eligible for
//! traffic (its Node is being deleted or is tainted
//! `ToBeDeletedByClusterAutoscaler`); 200 otherwise. It is what load
//! balancers and monitoring read.
//!
//! /livez and /readyz are for the kubelet, whose probes restart or hold back
//! the pod, and so fail only on what that fixes. /readyz: 200 once the first
//! sync has run over everything listed and the datapath is attached, for
//! good (writes it left failing are retried by the agent, not by a new
//! pod); the node's eligibility is left out, so that a drained node does not
//! turn into a restart loop. /livez: 503 until then, as kube-proxy's;
//! afterwards 503 only while a queued change has waited longer than the
//! health timeout without the sync loop even trying it (the loop is stuck,
//! which a restart fixes); a change tried and failed, say on a full map,
//! leaves it 200, as does the node's eligibility.
//!
//! The bodies are byte for byte kube-proxy's, which prints Go `time.Time`
//! values with `%q`: `{"lastUpdated": "…","currentTime": "…", "nodeEligible":
//! true}` (/livez and /readyz without `nodeEligible`), `lastUpdated` equal
//! to `currentTime` while the answer is 200.

use std::{
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, Instant, SystemTime},
};

use axum::http::StatusCode;
use k8s_openapi::jiff::Timestamp;

/// kube-proxy's health timeout for its default `--sync-period` of 30 s.
pub const DEFAULT_HEALTH_TIMEOUT: Duration = Duration::from_mins(1);

/// Shared with the sync loop: when the datapath was last fully programmed,
/// since when a change has been waiting, and whether this node takes traffic.
#[derive(Clone)]
pub struct Health {
    inner: Arc<Mutex<Progress>>,
    timeout: Duration,
    /// What Go's monotonic clock readings (`m=+…`) count from: the start.
    started: Instant,
}

#[derive(Debug)]
struct Progress {
    /// When every queued change was last in the maps; None before the
    /// first full sync.
    last_updated: Option<(Instant, SystemTime)>,
    /// The oldest change queued since then; None when nothing waits.
    oldest_queued: Option<Instant>,
    /// The oldest change queued since the sync loop last ran (whatever its
    /// writes came to); None when the loop has tried everything queued.
    oldest_untried: Option<Instant>,
    /// The first sync has run over everything listed and the datapath is
    /// attached, however its writes went; never unset.
    started: bool,
    /// Eligible until a Node says otherwise, as kube-proxy starts.
    node_eligible: bool,
}

impl Default for Progress {
    fn default() -> Self {
        Progress {
            last_updated: None,
            oldest_queued: None,
            oldest_untried: None,
            started: false,
            node_eligible: true,
        }
    }
}

/// What /healthz, /livez and /readyz answer at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[expect(
    clippy::struct_excessive_bools,
    reason = "independent facts, each the answer of one endpoint or part of one; no state machine orders them"
)]
pub struct HealthStatus {
    /// The proxy itself: synced once and nothing overdue (kube-proxy's
    /// rule, /healthz's without the node).
    pub healthy: bool,
    /// Started (/readyz's rule) and the sync loop has tried every change
    /// queued longer than the timeout ago (/livez's rule).
    pub alive: bool,
    /// The first sync ran and the datapath is attached (/readyz's rule).
    pub started: bool,
    pub last_updated: Option<SystemTime>,
    pub node_eligible: bool,
}

impl HealthStatus {
    /// /healthz's rule: the proxy is healthy and the node takes traffic.
    pub fn serving(&self) -> bool {
        self.healthy && self.node_eligible
    }
}

/// Which endpoint is asked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Probe {
    Healthz,
    Livez,
    Readyz,
}

impl Default for Health {
    fn default() -> Self {
        Self::new(DEFAULT_HEALTH_TIMEOUT)
    }
}

impl Health {
    /// A queued change unprogrammed for longer than `timeout` makes the
    /// agent unhealthy.
    pub fn new(timeout: Duration) -> Self {
        Health {
            inner: Arc::default(),
            timeout,
            started: Instant::now(),
        }
    }

    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    fn progress(&self) -> MutexGuard<'_, Progress> {
        // Plain fields: whatever a panicking holder left is still usable.
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A change arrived that the maps do not hold yet (kube-proxy's
    /// `QueuedUpdate`): the oldest such change starts the clock.
    pub fn queued(&self) {
        self.queued_at(Instant::now());
    }

    pub fn queued_at(&self, now: Instant) {
        let mut progress = self.progress();
        progress.oldest_queued.get_or_insert(now);
        progress.oldest_untried.get_or_insert(now);
    }

    /// The sync loop ran over everything queued until now, whatever its
    /// writes came to (a failed write is the loop's to retry): /livez
    /// stays 200.
    pub fn tried(&self) {
        self.progress().oldest_untried = None;
    }

    /// The first sync has run and the datapath is attached: /readyz is 200
    /// from now on.
    pub fn mark_started(&self) {
        self.progress().started = true;
    }

    /// Every queued change is in the maps (kube-proxy's `Updated`).
    pub fn mark_synced(&self) {
        self.mark_synced_at(Instant::now());
    }

    pub fn mark_synced_at(&self, now: Instant) {
        let mut progress = self.progress();
        progress.last_updated = Some((now, wall_clock_at(now)));
        progress.oldest_queued = None;
        progress.oldest_untried = None;
        progress.started = true;
    }

    /// This node's Node as last seen (kube-proxy's `SyncNode`); returns
    /// whether eligibility changed.
    pub fn set_node_eligible(&self, eligible: bool) -> bool {
        let mut progress = self.progress();
        std::mem::replace(&mut progress.node_eligible, eligible) != eligible
    }

    pub fn status(&self) -> HealthStatus {
        self.status_at(Instant::now())
    }

    /// At `now`: healthy when synced once and nothing has been queued for
    /// as long as the timeout; alive when started and nothing has waited
    /// that long for the loop to try it.
    pub fn status_at(&self, now: Instant) -> HealthStatus {
        let progress = self.progress();
        let overdue = |since: Option<Instant>| {
            since.is_some_and(|queued| now.saturating_duration_since(queued) >= self.timeout)
        };
        HealthStatus {
            healthy: progress.last_updated.is_some() && !overdue(progress.oldest_queued),
            alive: progress.started && !overdue(progress.oldest_untried),
            started: progress.started,
            last_updated: progress.last_updated.map(|(_, wall)| wall),
            node_eligible: progress.node_eligible,
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.status().healthy
    }

    /// What kube-proxy's health check node ports call the service proxy
    /// being healthy: kube-proxy's rule without the Node (those ports
    /// answer for a Service's local endpoints, not for the node).
    pub fn is_synced(&self) -> bool {
        self.is_healthy()
    }

    /// The status code and body `probe` answers at `now`.
    pub fn answer_at(&self, probe: Probe, now: Instant) -> (StatusCode, String) {
        let status = self.status_at(now);
        let current = GoTime::at(wall_clock_at(now), now, self.started);
        let ok = match probe {
            Probe::Healthz => status.serving(),
            Probe::Livez => status.alive,
            Probe::Readyz => status.started,
        };
        // kube-proxy reports a healthy proxy as updated just now, for
        // clients of older releases that read it as "the last sync ran".
        let last_updated = match (ok, self.progress().last_updated) {
            (true, _) => current.to_string(),
            (false, Some((mono, wall))) => GoTime::at(wall, mono, self.started).to_string(),
            (false, None) => GoTime::ZERO.to_string(),
        };
        let body = match probe {
            Probe::Healthz => format!(
                r#"{{"lastUpdated": "{last_updated}","currentTime": "{current}", "nodeEligible": {}}}"#,
                status.node_eligible
            ),
            Probe::Livez | Probe::Readyz => {
                format!(r#"{{"lastUpdated": "{last_updated}","currentTime": "{current}"}}"#)
            }
        };
        let code = if ok {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (code, body)
    }
}

/// The wall clock time of the monotonic instant `at`.
fn wall_clock_at(at: Instant) -> SystemTime {
    let (now, wall) = (Instant::now(), SystemTime::now());
    match now.checked_duration_since(at) {
        Some(ago) => wall - ago,
        None => wall + at.duration_since(now),
    }
}

/// A time as Go's `time.Time.String` prints it (what kube-proxy's `%q`
/// writes): `2006-01-02 15:04:05.999999999 +0000 UTC m=+12.345678901`, the
/// fraction without trailing zeros, the monotonic reading in seconds since
/// the process started; the zero time without one.
#[derive(Clone, Copy, Debug)]
struct GoTime {
    wall: Option<SystemTime>,
    monotonic: Option<Duration>,
}

impl GoTime {
    const ZERO: GoTime = GoTime {
        wall: None,
        monotonic: None,
    };

    fn at(wall: SystemTime, at: Instant, started: Instant) -> GoTime {
        GoTime {
            wall: Some(wall),
            monotonic: Some(at.saturating_duration_since(started)),
        }
    }
}

impl std::fmt::Display for GoTime {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Some(t) = self.wall.and_then(|w| Timestamp::try_from(w).ok()) else {
            return f.write_str("0001-01-01 00:00:00 +0000 UTC");
        };
        write!(f, "{}", t.strftime("%Y-%m-%d %H:%M:%S"))?;
        let nanos = t.subsec_nanosecond();
        if nanos > 0 {
            let fraction = format!("{nanos:09}");
            write!(f, ".{}", fraction.trim_end_matches('0'))?;
        }
        f.write_str(" +0000 UTC")?;
        if let Some(m) = self.monotonic {
            write!(f, " m=+{}.{:09}", m.as_secs(), m.subsec_nanos())?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text` is a Go `time.Time` as `String` prints it, with a monotonic
    /// reading when `monotonic`.
    fn assert_go_time(text: &str, monotonic: bool, what: &str) {
        let (wall, mono) = match text.split_once(" m=+") {
            Some((wall, mono)) => (wall, Some(mono)),
            None => (text, None),
        };
        assert_eq!(mono.is_some(), monotonic, "{what}: {text:?}");
        if let Some(mono) = mono {
            let (secs, nanos) = mono.split_once('.').unwrap_or_default();
            assert!(
                secs.parse::<u64>().is_ok() && nanos.len() == 9 && nanos.parse::<u32>().is_ok(),
                "{what}: monotonic reading {mono:?} is not seconds with 9 decimals"
            );
        }
        let wall = wall
            .strip_suffix(" +0000 UTC")
            .unwrap_or_else(|| panic!("{what}: {text:?} does not end in +0000 UTC"));
        let (seconds, fraction) = wall.split_once('.').unwrap_or((wall, "1"));
        assert!(
            !fraction.is_empty() && fraction.len() <= 9 && !fraction.ends_with('0'),
            "{what}: fraction {fraction:?} of {text:?} is not Go's (1-9 digits, no trailing 0)"
        );
        let iso = seconds.replacen(' ', "T", 1) + "Z";
        assert!(
            iso.parse::<Timestamp>().is_ok() && seconds.len() == 19,
            "{what}: {text:?} is not `YYYY-MM-DD hh:mm:ss`"
        );
    }

    /// The body's two times, checked to be in kube-proxy's exact layout.
    fn fields(probe: Probe, body: &str, eligible: bool) -> (String, String) {
        let json: serde_json::Value = serde_json::from_str(body)
            .unwrap_or_else(|e| panic!("{probe:?} body {body:?} is not JSON: {e}"));
        let last = json["lastUpdated"].as_str().unwrap_or_default().to_owned();
        let current = json["currentTime"].as_str().unwrap_or_default().to_owned();
        let expected = match probe {
            Probe::Healthz => format!(
                r#"{{"lastUpdated": "{last}","currentTime": "{current}", "nodeEligible": {eligible}}}"#
            ),
            Probe::Livez | Probe::Readyz => {
                format!(r#"{{"lastUpdated": "{last}","currentTime": "{current}"}}"#)
            }
        };
        assert_eq!(body, expected, "{probe:?}: not kube-proxy's layout");
        assert_go_time(&current, true, "currentTime");
        (last, current)
    }

    #[test]
    fn go_time_is_printed_as_go_does() {
        let started = Instant::now();
        let wall = SystemTime::UNIX_EPOCH + Duration::from_millis(1_700_000_000_500);
        let at = started + Duration::from_nanos(12_000_000_345);
        assert_eq!(
            GoTime::at(wall, at, started).to_string(),
            "2023-11-14 22:13:20.5 +0000 UTC m=+12.000000345"
        );
        let whole = SystemTime::UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(
            GoTime::at(whole, started, started).to_string(),
            "2023-11-14 22:13:20 +0000 UTC m=+0.000000000",
            "no fraction at all when it is zero"
        );
        assert_eq!(GoTime::ZERO.to_string(), "0001-01-01 00:00:00 +0000 UTC");
    }

    #[test]
    fn unhealthy_before_the_first_sync_and_while_a_change_is_overdue() {
        let health = Health::new(Duration::from_mins(1));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        assert!(!health.status_at(t0).healthy, "never synced: 503");
        health.queued_at(t0);
        assert!(
            !health.status_at(at(1)).healthy,
            "queued, never synced: 503"
        );
        health.mark_synced_at(at(2));
        assert!(health.status_at(at(2)).healthy, "synced: 200");
        assert!(
            health.status_at(at(1000)).healthy,
            "nothing queued: 200 however long"
        );

        health.queued_at(at(1000));
        health.queued_at(at(1030));
        assert!(
            health.status_at(at(1059)).healthy,
            "queued 59 s ago, timeout 60 s: still 200"
        );
        assert!(
            !health.status_at(at(1060)).healthy,
            "the oldest change (not the newest) counts: 503 60 s after it"
        );
        health.mark_synced_at(at(1070));
        assert!(health.status_at(at(1070)).healthy, "programmed: 200 again");
        assert!(health.is_synced(), "health check ports see the same rule");
    }

    #[test]
    fn each_transition_answers_as_kube_proxy() {
        let health = Health::new(Duration::from_mins(1));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let ok = StatusCode::OK;
        let unavailable = StatusCode::SERVICE_UNAVAILABLE;
        // (what, when, /healthz, /livez, nodeEligible, lastUpdated)
        let check = |what: &str, now: Instant, want: (StatusCode, StatusCode), eligible: bool| {
            let (code, body) = health.answer_at(Probe::Healthz, now);
            assert_eq!(code, want.0, "{what}: /healthz answered {body}");
            let (healthz_last, healthz_now) = fields(Probe::Healthz, &body, eligible);
            let (code, body) = health.answer_at(Probe::Livez, now);
            assert_eq!(code, want.1, "{what}: /livez answered {body}");
            let (livez_last, livez_now) = fields(Probe::Livez, &body, eligible);
            for (probe, code, last, current) in [
                ("/healthz", want.0, healthz_last, healthz_now),
                ("/livez", want.1, livez_last, livez_now),
            ] {
                if code == ok {
                    assert_eq!(last, current, "{what}: {probe} healthy: lastUpdated is now");
                }
            }
        };

        check(
            "before the first sync",
            at(0),
            (unavailable, unavailable),
            true,
        );
        let (_, body) = health.answer_at(Probe::Livez, at(0));
        assert!(
            body.starts_with(r#"{"lastUpdated": "0001-01-01 00:00:00 +0000 UTC","#),
            "never updated: Go's zero time: {body}"
        );

        health.mark_synced_at(at(1));
        check("synced", at(2), (ok, ok), true);

        assert!(health.set_node_eligible(false), "a change of eligibility");
        check("node tainted or deleted", at(3), (unavailable, ok), false);
        assert!(!health.set_node_eligible(false), "no change");
        health.set_node_eligible(true);
        check("taint removed", at(4), (ok, ok), true);

        health.queued_at(at(10));
        check("queued, not late", at(69), (ok, ok), true);
        check("queued 60 s ago", at(70), (unavailable, unavailable), true);
        let (_, body) = health.answer_at(Probe::Healthz, at(70));
        let (last, _) = fields(Probe::Healthz, &body, true);
        assert_go_time(&last, true, "lastUpdated of an overdue proxy");
        // The monotonic reading is exact; the wall clock is derived from it.
        let synced_at = GoTime::at(SystemTime::now(), at(1), health.started).to_string();
        assert_eq!(
            last.split_once(" m=").map(|(_, m)| m),
            synced_at.split_once(" m=").map(|(_, m)| m),
            "overdue: lastUpdated is the last sync"
        );

        health.set_node_eligible(false);
        check(
            "overdue and not eligible",
            at(71),
            (unavailable, unavailable),
            false,
        );
        health.mark_synced_at(at(72));
        check(
            "programmed, still not eligible",
            at(72),
            (unavailable, ok),
            false,
        );
    }

    /// /livez and /readyz, the kubelet's probes, fail only on what a restart
    /// fixes: a full map or a failing write is retried by the loop, and a
    /// drained node is not the proxy's fault; a loop that stops trying what
    /// is queued is.
    #[test]
    fn the_kubelets_probes_fail_only_on_what_a_restart_fixes() {
        let health = Health::new(Duration::from_mins(1));
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let code = |probe: Probe, now: Instant| {
            let (code, body) = health.answer_at(probe, now);
            fields(probe, &body, health.status_at(now).node_eligible);
            code
        };
        let codes = |now: Instant| {
            [Probe::Healthz, Probe::Livez, Probe::Readyz].map(|probe| code(probe, now).as_u16())
        };

        health.queued_at(at(0));
        health.tried();
        assert_eq!(
            codes(at(100)),
            [503, 503, 503],
            "the first sync ran but is not attached or in the maps: 503 everywhere"
        );
        health.mark_started();
        assert_eq!(
            codes(at(101)),
            [503, 200, 200],
            "started with writes left failing: /healthz 503, the kubelet's probes 200"
        );

        health.mark_synced_at(at(110));
        health.queued_at(at(120));
        health.tried();
        assert_eq!(
            codes(at(500)),
            [503, 200, 200],
            "a change tried and failed for minutes (a full map): only /healthz 503"
        );
        health.set_node_eligible(false);
        assert_eq!(
            codes(at(501)),
            [503, 200, 200],
            "a node being drained: only /healthz 503"
        );
        health.set_node_eligible(true);

        health.queued_at(at(600));
        assert_eq!(
            codes(at(659)),
            [503, 200, 200],
            "untried for 59 s, timeout 60 s: alive"
        );
        assert_eq!(
            codes(at(660)),
            [503, 503, 200],
            "untried for the timeout: the loop is stuck, /livez 503"
        );
        health.tried();
        assert_eq!(codes(at(661)), [503, 200, 200], "the loop ran again");
        health.mark_synced_at(at(662));
        assert_eq!(codes(at(662)), [200, 200, 200], "all in the maps");
    }
}
