//! Where a pool's prompt heads live ([`Homes`]), and whether sending them there pays: each
//! answer to a request sent to its head's home says how many prompt tokens vLLM served from its
//! prefix cache (`usage.prompt_tokens_details.cached_tokens`, which vLLM reports with
//! `--enable-prompt-tokens-details`, in a stream's usage chunk with
//! `stream_options.include_usage`). Whether the head was there is judged by the policy core
//! ([`AffinityJudge`]); while the homes do not keep their heads, the pool spreads requests by
//! load ([`super::select`]).
//!
//! The hot path reads one atomic: when spreading ends. The judge's lock is taken once per
//! answer of a request sent home, and to start a trial.

use crate::fleet::load::since_start;
use serde::Serialize;
use sluice_policy::routing::{home_hit, AffinityJudge, AffinityMode};
use sluice_policy::Millis;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// Characters of a prompt that key its home (the proxy's prefix hash reads as many), in the
/// four-characters-a-token count the body estimate uses.
const KEY_TOKENS: u64 = 2048 / 4;

/// Not spreading (`spreading_until`).
const AFFINE: u64 = 0;

/// Where each prompt head lives, per pool: its home, and the replica its bursts spill to. A
/// request whose head has a home goes there while the home is within the load bound, else to
/// the spill replica while that one is, so a shared system prompt is cached on one replica, or
/// two when it is hot, instead of on every replica a burst happened to reach. Two generations
/// of at most `HOMES` heads each approximate an LRU: a head not seen for two generations is
/// forgotten and placed afresh.
#[derive(Default)]
pub struct Homes(std::sync::Mutex<(HashMap<u64, Home>, HashMap<u64, Home>)>);

#[derive(Clone)]
pub(super) struct Home {
    pub(super) first: Arc<str>,
    pub(super) spill: Option<Arc<str>>,
}

const HOMES: usize = 8192;

impl Homes {
    pub(super) fn get(&self, key: u64) -> Option<Home> {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = g.0.get(&key) {
            return Some(h.clone());
        }
        let h = g.1.remove(&key)?;
        Self::put(&mut g, key, h.clone());
        Some(h)
    }

    pub(super) fn set(&self, key: u64, home: Home) {
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        Self::put(&mut g, key, home);
    }

    fn put(g: &mut (HashMap<u64, Home>, HashMap<u64, Home>), key: u64, home: Home) {
        if g.0.len() >= HOMES {
            g.1 = std::mem::take(&mut g.0);
        }
        g.0.insert(key, home);
    }
}

/// One pool's prefix affinity: where its heads live and whether that pays.
#[derive(Default)]
pub struct Affinity {
    pub(super) homes: Homes,
    judge: Mutex<AffinityJudge>,
    /// While spreading, when the trial is due (ms since start, at least 1); else [`AFFINE`].
    spreading_until: AtomicU64,
    /// Answers of requests sent home: with a cached-token count, and without one.
    answered: AtomicU64,
    no_details: AtomicU64,
}

/// A request sent to its head's home: its answer is evidence.
pub struct AffinityTicket {
    affinity: Arc<Affinity>,
}

/// `/status` `pools[].affinity`.
#[derive(Debug, Clone, Serialize)]
pub struct AffinityStatus {
    /// `learning`, `paying`, `spreading` (requests go where load is least) or `trial`.
    pub state: &'static str,
    /// Whether requests go to their heads' homes now.
    pub paying: bool,
    /// The share of requests sent home that found their head in the home's cache (decayed,
    /// since the state began); `null` without evidence.
    pub hit_rate: Option<f64>,
    /// Requests sent home counted since the state began.
    pub samples: u64,
    /// The hit rate the state was entered on (`null` for `learning` and `trial`).
    pub verdict_hit_rate: Option<f64>,
    /// While spreading: ms until affinity is tried again.
    pub retry_in_ms: Option<u64>,
    /// Answers of requests sent home since start, and those that said nothing of the cache
    /// (vLLM without `--enable-prompt-tokens-details`, a stream without usage): the homes are
    /// kept but cannot be judged.
    pub answered: u64,
    pub without_cached_tokens: u64,
}

impl Affinity {
    /// Whether requests go to their heads' homes now; starts a due trial.
    pub(super) fn affine(&self) -> bool {
        let until = self.spreading_until.load(Ordering::Relaxed);
        if until == AFFINE {
            return true;
        }
        let now = since_start();
        if now < until {
            return false;
        }
        let mut judge = self.judge.lock().unwrap_or_else(|e| e.into_inner());
        let before = judge.mode();
        judge.tick(now);
        self.publish(&judge, before);
        judge.affine()
    }

    pub(super) fn ticket(self: &Arc<Self>) -> AffinityTicket {
        AffinityTicket {
            affinity: Arc::clone(self),
        }
    }

    /// Makes the judge's mode the hot path's, and logs a change from `before`.
    fn publish(&self, judge: &AffinityJudge, before: AffinityMode) {
        let after = judge.mode();
        let until = match after {
            AffinityMode::Spreading { until } => until.max(1),
            _ => AFFINE,
        };
        self.spreading_until.store(until, Ordering::Relaxed);
        if std::mem::discriminant(&before) != std::mem::discriminant(&after) {
            log::warn!(
                "{}",
                serde_json::json!({"event": "prefix_affinity", "state": after.as_str(),
                                   "was": before.as_str(), "hit_rate": judge.verdict()})
            );
        }
    }

    /// Evidence, at `now`.
    fn observe(&self, now: Millis, hit: bool) {
        let mut judge = self.judge.lock().unwrap_or_else(|e| e.into_inner());
        let before = judge.mode();
        judge.observe(now, hit);
        self.publish(&judge, before);
    }

    /// Moves the judge by hand (tests of selection).
    #[cfg(test)]
    pub(super) fn judge_with(&self, f: impl FnOnce(&mut AffinityJudge)) {
        let mut judge = self.judge.lock().unwrap_or_else(|e| e.into_inner());
        let before = judge.mode();
        f(&mut judge);
        self.publish(&judge, before);
    }

    pub fn status(&self) -> AffinityStatus {
        let now = since_start();
        let mut judge = self.judge.lock().unwrap_or_else(|e| e.into_inner());
        let before = judge.mode();
        judge.tick(now);
        self.publish(&judge, before);
        let mode = judge.mode();
        AffinityStatus {
            state: mode.as_str(),
            paying: judge.affine(),
            hit_rate: judge.hit_rate(),
            samples: judge.samples(),
            verdict_hit_rate: judge.verdict(),
            retry_in_ms: match mode {
                AffinityMode::Spreading { until } => Some(until.saturating_sub(now)),
                _ => None,
            },
            answered: self.answered.load(Ordering::Relaxed),
            without_cached_tokens: self.no_details.load(Ordering::Relaxed),
        }
    }
}

impl AffinityTicket {
    /// The request's answer is complete: `ok` when it succeeded whole; `tail`, the end of its
    /// body (a completion's usage, or a stream's usage chunk); `prompt_tokens` from its usage;
    /// `body_tokens`, the prompt's size estimated from its text (four bytes a token), for the
    /// share of it the head's key covers.
    pub fn answered(self, ok: bool, tail: &[u8], prompt_tokens: Option<u64>, body_tokens: u64) {
        if !ok {
            return;
        }
        let a = &self.affinity;
        a.answered.fetch_add(1, Ordering::Relaxed);
        let (Some(cached), Some(prompt)) = (cached_tokens(tail), prompt_tokens) else {
            a.no_details.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let key_share = KEY_TOKENS as f64 / body_tokens.max(1) as f64;
        a.observe(since_start(), home_hit(cached, prompt, key_share));
    }
}

/// `usage.prompt_tokens_details.cached_tokens`, the last in `tail`. The key in quotes followed by
/// a colon cannot occur inside a JSON string (its quotes would be escaped), so a match is the
/// key; the usage comes last in a body and in a stream.
pub fn cached_tokens(tail: &[u8]) -> Option<u64> {
    const KEY: &[u8] = b"\"cached_tokens\"";
    let at = tail.windows(KEY.len()).rposition(|w| w == KEY)?;
    let rest = tail[at + KEY.len()..]
        .trim_ascii_start()
        .strip_prefix(b":")?
        .trim_ascii_start();
    let digits = rest.iter().take_while(|b| b.is_ascii_digit()).count();
    if digits == 0 || digits > 19 {
        return None;
    }
    std::str::from_utf8(&rest[..digits]).ok()?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cached_count_is_read_from_a_body_or_a_streams_usage_chunk() {
        let body = br#"{"id":"x","choices":[{"message":{"content":"say \"cached_tokens\": 9"}}],
            "usage":{"prompt_tokens":2100,"completion_tokens":3,
            "prompt_tokens_details":{"cached_tokens":2000}}}"#;
        assert_eq!(cached_tokens(body), Some(2000));
        let sse = b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":9,\
            \"prompt_tokens_details\": { \"cached_tokens\" : 0 }}}\n\ndata: [DONE]\n\n";
        assert_eq!(cached_tokens(sse), Some(0));
        assert_eq!(cached_tokens(br#"{"usage":{"prompt_tokens":9}}"#), None);
        assert_eq!(
            cached_tokens(br#"{"prompt_tokens_details":{"cached_tokens":null}}"#),
            None
        );
    }

    #[test]
    fn answers_without_a_cached_count_are_counted_not_judged() {
        let a = Arc::new(Affinity::default());
        a.ticket()
            .answered(true, br#"{"usage":{"prompt_tokens":9}}"#, Some(9), 9);
        a.ticket().answered(false, b"", None, 9);
        let s = a.status();
        assert_eq!((s.answered, s.without_cached_tokens, s.samples), (1, 1, 0));
        assert_eq!((s.state, s.paying), ("learning", true));
        let hit = br#"{"usage":{"prompt_tokens_details":{"cached_tokens":2000}}}"#;
        a.ticket().answered(true, hit, Some(2100), 2150);
        let s = a.status();
        assert_eq!((s.samples, s.hit_rate), (1, Some(1.0)));
    }
}
