//! The token-bucket math, pure (time is passed in). `lua/prelude.lua` does the same arithmetic
//! in Redis; the two must agree, so any change here is mirrored there.
//!
//! Each dimension (requests, tokens) is a bucket whose capacity is its per-minute limit and
//! which refills continuously at `limit / 60` per second. A tenant has room while every
//! configured bucket holds at least one unit; a charge after the fact (completion tokens) may
//! push a bucket below zero, and that debt is paid back by the refill before it has room again.

use serde::Deserialize;

/// A tenant's budget. Over it, the tenant is served as the next lower tier (refused only where
/// that tier refuses); a budget left out is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct QuotaConfig {
    /// Prompt tokens (estimated at admission) plus completion tokens (from the response's usage).
    pub tokens_per_minute: Option<u64>,
    pub requests_per_minute: Option<u64>,
}

const MINUTE_MS: f64 = 60_000.0;

/// One dimension's limit and level at the moment of a verdict.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Dim {
    pub limit: u64,
    pub level: f64,
}

impl Dim {
    /// Whole units left (never negative: a bucket in debt has none).
    pub fn remaining(&self) -> u64 {
        self.level.max(0.0).floor() as u64
    }

    /// Until the bucket is full again (what OpenAI's `x-ratelimit-reset-*` means).
    pub fn full_in_ms(&self) -> u64 {
        ms_to_reach(self.level, self.limit as f64, self.limit)
    }

    /// Until the bucket holds one unit again, i.e. until a request has room.
    pub fn room_in_ms(&self) -> u64 {
        ms_to_reach(self.level, 1.0, self.limit)
    }

    fn has_room(&self) -> bool {
        self.level >= 1.0
    }
}

fn ms_to_reach(level: f64, target: f64, limit: u64) -> u64 {
    if level >= target || limit == 0 {
        return 0;
    }
    ((target - level) * MINUTE_MS / limit as f64).ceil() as u64
}

/// A check's outcome: whether the tenant had room, and each configured dimension after it.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Verdict {
    pub room: bool,
    pub requests: Option<Dim>,
    pub tokens: Option<Dim>,
}

impl Verdict {
    pub fn dims(&self) -> impl Iterator<Item = (&'static str, Dim)> {
        [("requests", self.requests), ("tokens", self.tokens)]
            .into_iter()
            .filter_map(|(n, d)| Some((n, d?)))
    }

    /// Until every bucket that is short has room again.
    pub fn room_in_ms(&self) -> u64 {
        self.dims().map(|(_, d)| d.room_in_ms()).max().unwrap_or(0)
    }
}

/// A tenant's buckets. A dimension that is not configured has no level; one that becomes
/// configured (a reload) starts full.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    requests: Option<f64>,
    tokens: Option<f64>,
    at_ms: u64,
}

fn limits(q: &QuotaConfig) -> (Option<u64>, Option<u64>) {
    (q.requests_per_minute, q.tokens_per_minute)
}

impl Bucket {
    pub fn full(q: &QuotaConfig, now_ms: u64) -> Self {
        let (r, t) = limits(q);
        Bucket {
            requests: r.map(|l| l as f64),
            tokens: t.map(|l| l as f64),
            at_ms: now_ms,
        }
    }

    /// Adds what the time since the last update refilled, capped at the (possibly reloaded)
    /// limits. Time never runs backwards here: an older `now_ms` refills nothing.
    pub fn refill(&mut self, q: &QuotaConfig, now_ms: u64) {
        let elapsed = now_ms.saturating_sub(self.at_ms) as f64;
        let grow = |level: Option<f64>, limit: Option<u64>| {
            let limit = limit? as f64;
            let level = level.unwrap_or(limit) + elapsed * limit / MINUTE_MS;
            Some(level.min(limit))
        };
        let (r, t) = limits(q);
        self.requests = grow(self.requests, r);
        self.tokens = grow(self.tokens, t);
        self.at_ms = self.at_ms.max(now_ms);
    }

    pub fn verdict(&self, q: &QuotaConfig) -> Verdict {
        let (r, t) = limits(q);
        let dim = |limit: Option<u64>, level: Option<f64>| {
            Some(Dim {
                limit: limit?,
                level: level?,
            })
        };
        let mut v = Verdict {
            room: false,
            requests: dim(r, self.requests),
            tokens: dim(t, self.tokens),
        };
        v.room = v.dims().all(|(_, d)| d.has_room());
        v
    }

    /// Refill, then take one request and `tokens` when every bucket has room; otherwise take
    /// nothing. The verdict shows the buckets after the take.
    pub fn check_and_take(&mut self, q: &QuotaConfig, now_ms: u64, tokens: u64) -> Verdict {
        self.refill(q, now_ms);
        let room = self.verdict(q).room;
        if room {
            self.add(q, -1.0, -(tokens as f64));
        }
        Verdict {
            room,
            ..self.verdict(q)
        }
    }

    /// Refill, then add signed amounts: negative charges (completion tokens, which may leave a
    /// debt), positive refunds (a request refused after its take), never above the limit.
    pub fn charge(&mut self, q: &QuotaConfig, now_ms: u64, requests: f64, tokens: f64) {
        self.refill(q, now_ms);
        self.add(q, requests, tokens);
    }

    fn add(&mut self, q: &QuotaConfig, requests: f64, tokens: f64) {
        let (r, t) = limits(q);
        let apply = |level: &mut Option<f64>, limit: Option<u64>, delta: f64| {
            if let (Some(l), Some(limit)) = (level.as_mut(), limit) {
                *l = (*l + delta).min(limit as f64);
            }
        };
        apply(&mut self.requests, r, requests);
        apply(&mut self.tokens, t, tokens);
    }

    /// Replaces the levels with ones read elsewhere (Redis), as of `now_ms`.
    pub fn set(&mut self, v: &Verdict, now_ms: u64) {
        self.requests = v.requests.map(|d| d.level);
        self.tokens = v.tokens.map(|d| d.level);
        self.at_ms = now_ms;
    }
}

/// OpenAI's duration format for `x-ratelimit-reset-*` (Go's `time.Duration` style): `250ms`,
/// `1s`, `1.5s`, `6m0s`, `1h2m3s`.
pub fn openai_duration(ms: u64) -> String {
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m) = (ms / 3_600_000, (ms / 60_000) % 60);
    let s_ms = ms % 60_000;
    let secs = if s_ms.is_multiple_of(1000) {
        format!("{}s", s_ms / 1000)
    } else {
        let frac = format!("{:03}", s_ms % 1000);
        format!("{}.{}s", s_ms / 1000, frac.trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => secs,
        (0, m) => format!("{m}m{secs}"),
        (h, m) => format!("{h}h{m}m{secs}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(rpm: Option<u64>, tpm: Option<u64>) -> QuotaConfig {
        QuotaConfig {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
        }
    }

    #[test]
    fn starts_full_and_takes_one_request_and_the_prompt() {
        let q = q(Some(3), Some(100));
        let mut b = Bucket::full(&q, 0);
        let v = b.check_and_take(&q, 0, 30);
        assert!(v.room);
        assert_eq!(v.requests.unwrap().remaining(), 2);
        assert_eq!(v.tokens.unwrap().remaining(), 70);
    }

    #[test]
    fn an_empty_bucket_takes_nothing_and_refills_at_limit_per_minute() {
        let q = q(Some(60), None);
        let mut b = Bucket::full(&q, 0);
        for _ in 0..60 {
            assert!(b.check_and_take(&q, 0, 0).room);
        }
        let v = b.check_and_take(&q, 0, 0);
        assert!(!v.room);
        assert_eq!(
            v.requests.unwrap().level,
            0.0,
            "a refused check takes nothing"
        );
        assert_eq!(v.room_in_ms(), 1000, "60/min is one a second");
        assert_eq!(v.requests.unwrap().full_in_ms(), 60_000);
        assert!(!b.check_and_take(&q, 999, 0).room);
        assert!(b.check_and_take(&q, 1000, 0).room);
        // Refill is capped at the limit however long the tenant was idle.
        b.refill(&q, 10 * 60_000);
        assert_eq!(b.verdict(&q).requests.unwrap().level, 60.0);
    }

    #[test]
    fn completion_tokens_leave_a_debt_paid_back_by_the_refill() {
        let q = q(None, Some(600)); // 10 tokens a second
        let mut b = Bucket::full(&q, 0);
        assert!(b.check_and_take(&q, 0, 100).room);
        b.charge(&q, 0, 0.0, -2000.0);
        let v = b.verdict(&q);
        assert_eq!(v.tokens.unwrap().level, -1500.0);
        assert!(!v.room);
        assert_eq!(v.tokens.unwrap().remaining(), 0);
        // From -1500 to 1 token at 10/s: 150.1 s.
        assert_eq!(v.room_in_ms(), 150_100);
        assert_eq!(v.tokens.unwrap().full_in_ms(), 210_000);
        assert!(!b.check_and_take(&q, 150_000, 5).room);
        assert!(b.check_and_take(&q, 150_100, 5).room);
    }

    #[test]
    fn either_dimension_short_means_no_room_and_nothing_is_taken_from_the_other() {
        let q = q(Some(10), Some(50));
        let mut b = Bucket::full(&q, 0);
        assert!(b.check_and_take(&q, 0, 50).room);
        let v = b.check_and_take(&q, 0, 1);
        assert!(!v.room, "tokens are empty");
        assert_eq!(v.requests.unwrap().remaining(), 9, "requests untouched");
        assert_eq!(v.room_in_ms(), 1200, "one token at 50/min");
    }

    #[test]
    fn refunds_never_overfill_and_reloaded_limits_apply_at_once() {
        let small = q(Some(2), None);
        let mut b = Bucket::full(&small, 0);
        b.check_and_take(&small, 0, 0);
        b.charge(&small, 0, 5.0, 0.0);
        assert_eq!(b.verdict(&small).requests.unwrap().level, 2.0);
        // Lowered: capped to the new limit. Raised: refills at the new rate from here.
        let tiny = q(Some(1), Some(100));
        b.refill(&tiny, 0);
        let v = b.verdict(&tiny);
        assert_eq!(v.requests.unwrap().level, 1.0);
        assert_eq!(
            v.tokens.unwrap().level,
            100.0,
            "a new dimension starts full"
        );
        let none = q(None, Some(100));
        b.refill(&none, 0);
        assert_eq!(b.verdict(&none).requests, None);
        assert!(b.verdict(&none).room);
    }

    #[test]
    fn time_going_backwards_refills_nothing() {
        let q = q(Some(60), None);
        let mut b = Bucket::full(&q, 5000);
        for _ in 0..60 {
            b.check_and_take(&q, 5000, 0);
        }
        assert!(!b.check_and_take(&q, 1000, 0).room);
        assert!(b.check_and_take(&q, 6000, 0).room);
    }

    #[test]
    fn durations_in_openai_format() {
        assert_eq!(openai_duration(0), "0s");
        assert_eq!(openai_duration(250), "250ms");
        assert_eq!(openai_duration(1000), "1s");
        assert_eq!(openai_duration(1500), "1.5s");
        assert_eq!(openai_duration(1020), "1.02s");
        assert_eq!(openai_duration(360_000), "6m0s");
        assert_eq!(openai_duration(90_500), "1m30.5s");
        assert_eq!(openai_duration(3_723_000), "1h2m3s");
    }
}
