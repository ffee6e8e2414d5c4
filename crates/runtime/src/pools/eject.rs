//! Passive ejection, Envoy's outlier detection by consecutive failures: a replica whose last
//! `consecutive_failures` upstream attempts failed (connection refused or timed out, reset or
//! closed before the response head, a 5xx answer) is left out of selection for
//! `base_ejection_ms` × the times it has been ejected, at most `max_ejection_ms`, and never more
//! than `max_ejected_percent` of a pool's replicas at once. Slowness is not a failure. The
//! ejection ends when its time is up, or sooner when a health check passes after one failed
//! during it (the check saw the replica go down and come back). The times-ejected count falls by
//! one for each base period the replica then stays in, so a replica that failed once long ago
//! starts again from the base time.
//!
//! One [`Passive`] per backend of a pool (a backend listed in two pools is judged by each): the
//! success path is one relaxed load of its failure count; the rest takes its lock, only on
//! failures.

use serde::Serialize;
use sluice_config::EjectionConfig;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// What went wrong with an upstream attempt: the `cause` of a retry and of an ejection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum FailureCause {
    /// Connection refused, timed out or otherwise not made.
    #[serde(rename = "connect")]
    Connect,
    /// Reset or closed before the response head (or, for ejection, cut mid-answer).
    #[serde(rename = "reset")]
    Reset,
    /// The replica answered 5xx (retried for 502, 503 and 504).
    #[serde(rename = "5xx")]
    Status5xx,
}

impl FailureCause {
    pub const ALL: [FailureCause; 3] = [
        FailureCause::Connect,
        FailureCause::Reset,
        FailureCause::Status5xx,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FailureCause::Connect => "connect",
            FailureCause::Reset => "reset",
            FailureCause::Status5xx => "5xx",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// How long the `times`-th ejection lasts: the base time that many times, at most the maximum.
pub fn ejection_time(cfg: &EjectionConfig, times: u32) -> Duration {
    let ms = cfg
        .base_ejection_ms
        .saturating_mul(u64::from(times.max(1)))
        .min(cfg.max_ejection_ms);
    Duration::from_millis(ms)
}

/// The times-ejected count of a replica ejected again: the previous count, less one for each
/// base period it has stayed in since it came back, plus this ejection.
pub fn times_when_ejected(previous: u32, back_for: Option<Duration>, base: Duration) -> u32 {
    let forgiven = match back_for {
        Some(d) if !base.is_zero() => {
            (d.as_millis() / base.as_millis()).min(u128::from(u32::MAX)) as u32
        }
        _ => 0,
    };
    previous.saturating_sub(forgiven).saturating_add(1)
}

/// Whether one more of a pool's `replicas` may be ejected while `ejected` are: at most
/// `max_percent` of them out at once (a pool of one never ejects its replica).
pub fn may_eject(ejected: usize, replicas: usize, max_percent: u32) -> bool {
    (ejected as u64 + 1) * 100 <= replicas as u64 * u64::from(max_percent)
}

/// An ejection that just began.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ejected {
    pub cause: FailureCause,
    pub duration: Duration,
    /// How many times it has been ejected, this one included (after forgiveness).
    pub times: u32,
}

/// A replica's ejection now, as `/status` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct EjectionStatus {
    pub cause: FailureCause,
    /// Unix milliseconds when it ends at the latest.
    pub until_ms: u64,
    pub remaining_ms: u64,
    pub times: u32,
}

#[derive(Debug, Default)]
struct State {
    times: u32,
    cause: Option<FailureCause>,
    until: Option<Instant>,
    until_unix_ms: u64,
    /// When it last came back (ejection ended), for forgiveness.
    back_at: Option<Instant>,
    /// A health check failed since this ejection began.
    check_failed: bool,
}

/// One backend's passive health in one pool.
#[derive(Debug, Default)]
pub struct Passive {
    /// Failed attempts in a row.
    failures: AtomicU32,
    ejected: AtomicBool,
    state: Mutex<State>,
}

impl Passive {
    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// An attempt that got an answer (not 5xx): the run of failures is over.
    pub fn succeeded(&self) {
        // Read first: the common case writes nothing, so the line stays shared between cores.
        if self.failures.load(Ordering::Relaxed) != 0 {
            self.failures.store(0, Ordering::Relaxed);
        }
    }

    /// Counts a failed attempt; whether the run reached `threshold` (0: never) on a replica
    /// not ejected yet, so the pool should consider ejecting it.
    pub fn failed(&self, threshold: u32) -> bool {
        let run = self
            .failures
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        threshold > 0 && run >= threshold && !self.is_ejected()
    }

    pub fn failures(&self) -> u32 {
        self.failures.load(Ordering::Relaxed)
    }

    pub fn is_ejected(&self) -> bool {
        self.ejected.load(Ordering::Acquire)
    }

    /// Takes it out of selection now.
    pub fn eject(&self, cfg: &EjectionConfig, cause: FailureCause, now: Instant) -> Ejected {
        let mut s = self.state();
        let base = Duration::from_millis(cfg.base_ejection_ms);
        let times = times_when_ejected(s.times, s.back_at.map(|b| now.duration_since(b)), base);
        let duration = ejection_time(cfg, times);
        s.times = times;
        s.cause = Some(cause);
        s.until = Some(now + duration);
        s.until_unix_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis() as u64)
            .saturating_add(duration.as_millis() as u64);
        s.check_failed = false;
        self.failures.store(0, Ordering::Relaxed);
        self.ejected.store(true, Ordering::Release);
        Ejected {
            cause,
            duration,
            times,
        }
    }

    fn bring_back(&self, s: &mut State, now: Instant) {
        s.until = None;
        s.back_at = Some(now);
        s.check_failed = false;
        self.failures.store(0, Ordering::Relaxed);
        self.ejected.store(false, Ordering::Release);
    }

    /// Ends an ejection whose time is up; whether it did.
    pub fn expire(&self, now: Instant) -> bool {
        if !self.is_ejected() {
            return false;
        }
        let mut s = self.state();
        match s.until {
            Some(until) if now >= until => {
                self.bring_back(&mut s, now);
                true
            }
            _ => false,
        }
    }

    /// A health check's result. A pass after a failed check during the ejection brings the
    /// replica back now; whether it did. While every check passes the ejection runs its time: a
    /// replica answering its health check but failing requests stays out.
    pub fn checked(&self, passed: bool, now: Instant) -> bool {
        if !self.is_ejected() {
            return false;
        }
        let mut s = self.state();
        if !passed {
            s.check_failed = true;
            return false;
        }
        if s.check_failed {
            self.bring_back(&mut s, now);
            return true;
        }
        false
    }

    /// When the ejection ends, while ejected.
    pub fn until(&self) -> Option<Instant> {
        if !self.is_ejected() {
            return None;
        }
        self.state().until
    }

    /// The ejection now; `None` once its time is up (it ends at the pool's next pick).
    pub fn status(&self, now: Instant) -> Option<EjectionStatus> {
        if !self.is_ejected() {
            return None;
        }
        let s = self.state();
        if s.until.is_some_and(|u| u <= now) {
            return None;
        }
        Some(EjectionStatus {
            cause: s.cause?,
            until_ms: s.until_unix_ms,
            remaining_ms: s
                .until
                .map_or(0, |u| u.saturating_duration_since(now).as_millis() as u64),
            times: s.times,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> EjectionConfig {
        EjectionConfig::default()
    }

    #[test]
    fn ejection_time_grows_with_the_times_ejected_up_to_the_maximum() {
        let c = cfg();
        let secs = |t| ejection_time(&c, t).as_secs();
        assert_eq!(
            [1, 2, 3, 9, 10, 11, 1000].map(secs),
            [30, 60, 90, 270, 300, 300, 300]
        );
        assert_eq!(secs(0), 30, "a first ejection is the base time");
        assert_eq!(secs(u32::MAX), 300, "no overflow");
    }

    #[test]
    fn the_count_is_forgiven_one_per_base_period_back_in() {
        let base = Duration::from_secs(30);
        assert_eq!(times_when_ejected(0, None, base), 1);
        assert_eq!(
            times_when_ejected(3, Some(Duration::from_secs(29)), base),
            4
        );
        assert_eq!(
            times_when_ejected(3, Some(Duration::from_secs(30)), base),
            3
        );
        assert_eq!(
            times_when_ejected(3, Some(Duration::from_secs(95)), base),
            1
        );
        assert_eq!(
            times_when_ejected(3, Some(Duration::from_secs(3600)), base),
            1
        );
    }

    #[test]
    fn at_most_the_share_of_a_pool_is_out_at_once() {
        // Half: one of two, one of three, two of four; a lone replica never.
        assert!(may_eject(0, 2, 50));
        assert!(!may_eject(1, 2, 50));
        assert!(may_eject(0, 3, 50) && !may_eject(1, 3, 50));
        assert!(may_eject(1, 4, 50) && !may_eject(2, 4, 50));
        assert!(!may_eject(0, 1, 50));
        assert!(may_eject(0, 1, 100) && !may_eject(1, 1, 100));
        assert!(!may_eject(0, 10, 0));
    }

    #[test]
    fn five_failures_in_a_row_eject_and_a_success_breaks_the_run() {
        let p = Passive::default();
        for _ in 0..4 {
            assert!(!p.failed(5));
        }
        p.succeeded();
        assert_eq!(p.failures(), 0);
        for _ in 0..4 {
            assert!(!p.failed(5));
        }
        assert!(p.failed(5));
        assert!(!Passive::default().failed(0), "0 turns ejection off");
    }

    #[test]
    fn an_ejection_ends_with_its_time_or_a_check_that_saw_it_recover() {
        let c = cfg();
        let t0 = Instant::now();
        let p = Passive::default();
        let e = p.eject(&c, FailureCause::Connect, t0);
        assert_eq!((e.times, e.duration.as_secs()), (1, 30));
        assert!(p.is_ejected());
        assert_eq!(p.status(t0).unwrap().remaining_ms, 30_000);
        // Passing checks alone do not end it: the replica answers /health but failed requests.
        assert!(!p.checked(true, t0 + Duration::from_secs(1)));
        assert!(!p.expire(t0 + Duration::from_secs(29)));
        assert!(p.status(t0 + Duration::from_secs(30)).is_none(), "over");
        assert!(p.expire(t0 + Duration::from_secs(30)));
        assert!(!p.is_ejected() && p.status(t0).is_none());
        // Ejected again at once: twice as long; a failed check then a pass bring it back.
        let t1 = t0 + Duration::from_secs(31);
        assert_eq!(
            p.eject(&c, FailureCause::Status5xx, t1).duration.as_secs(),
            60
        );
        assert!(!p.checked(false, t1));
        assert!(p.is_ejected());
        assert!(p.checked(true, t1 + Duration::from_secs(2)));
        assert!(!p.is_ejected());
        // Long back in: forgiven down to the base time.
        let t2 = t1 + Duration::from_secs(600);
        assert_eq!(p.eject(&c, FailureCause::Reset, t2).times, 1);
    }
}
