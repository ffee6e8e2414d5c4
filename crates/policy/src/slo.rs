//! Service-level objectives in the units users set them: time to first token (TTFT), time per
//! output token (TPOT) and, as the prototype had it, end-to-end latency. A tier sets any subset;
//! a request meets its tier's objective when it meets every dimension set.
//!
//! A non-streamed response has no first token of its own for the client: it arrives whole. It
//! meets TTFT and TPOT when it is complete by the time a stream meeting both would have been:
//! `ttft_ms + tpot_ms × (completion_tokens − 1)`. Pure: durations come in measured.

use crate::types::Tier;

/// One dimension of an objective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Dim {
    /// Time to first token, from the moment Sluice received the request (its own queue counts)
    /// to the first token byte sent to the client.
    Ttft,
    /// Time per output token after the first: (last − first) ÷ (completion tokens − 1).
    Tpot,
    /// End-to-end latency (`sla_target_ms`).
    E2e,
}

impl Dim {
    pub const ALL: [Dim; 3] = [Dim::Ttft, Dim::Tpot, Dim::E2e];

    pub fn as_str(self) -> &'static str {
        match self {
            Dim::Ttft => "ttft",
            Dim::Tpot => "tpot",
            Dim::E2e => "e2e",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }

    /// The configuration key of its target (`tiers.<tier>.slo.<key>`).
    pub fn target_key(self) -> &'static str {
        match self {
            Dim::Ttft => "ttft_ms",
            Dim::Tpot => "tpot_ms",
            Dim::E2e => "e2e_ms",
        }
    }
}

/// A tier's (or one request's) targets, in milliseconds; `None` leaves a dimension unjudged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Slo {
    pub ttft_ms: Option<u64>,
    pub tpot_ms: Option<u64>,
    pub e2e_ms: Option<u64>,
}

impl Slo {
    /// The prototype's objective: one end-to-end target.
    pub fn e2e(ms: u64) -> Self {
        Slo {
            e2e_ms: Some(ms),
            ..Slo::default()
        }
    }

    pub fn get(&self, d: Dim) -> Option<u64> {
        match d {
            Dim::Ttft => self.ttft_ms,
            Dim::Tpot => self.tpot_ms,
            Dim::E2e => self.e2e_ms,
        }
    }

    /// The dimensions set, in [`Dim::ALL`] order.
    pub fn dims(&self) -> impl Iterator<Item = Dim> + '_ {
        Dim::ALL.into_iter().filter(|d| self.get(*d).is_some())
    }

    pub fn is_empty(&self) -> bool {
        self.dims().next().is_none()
    }

    /// The request's own targets from `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms`: each may
    /// only tighten the tier's (a target the tier leaves unset is tightened from "none").
    pub fn tightened(self, ttft_ms: Option<u64>, tpot_ms: Option<u64>) -> Slo {
        let tighter = |tier: Option<u64>, asked: Option<u64>| match (tier, asked) {
            (Some(t), Some(a)) => Some(t.min(a)),
            (t, a) => t.or(a),
        };
        Slo {
            ttft_ms: tighter(self.ttft_ms, ttft_ms),
            tpot_ms: tighter(self.tpot_ms, tpot_ms),
            e2e_ms: self.e2e_ms,
        }
    }

    /// When a non-streamed answer of `tokens` completion tokens must be complete to meet TTFT
    /// and TPOT: `None` unless both are set (TTFT alone says nothing of how long the rest may
    /// take, so a whole answer is then judged on its other dimensions only).
    pub fn whole_deadline_ms(&self, tokens: u64) -> Option<f64> {
        let (ttft, tpot) = (self.ttft_ms?, self.tpot_ms?);
        Some(ttft as f64 + tpot as f64 * tokens.saturating_sub(1) as f64)
    }

    /// The latest a request's first token may come with its objective still within reach: the
    /// TTFT target for a stream. A whole answer is judged on its deadline only, which grows by
    /// `tpot_ms` a token while decoding takes `pace_ms`: its first token may come as late as the
    /// deadline less that decode, at the length most in its favour up to `max_tokens` (a refusal
    /// must be sure; an unknown pace leaves the TTFT target). `None` when nothing judges the
    /// first token (a whole answer without both TTFT and TPOT set).
    pub fn first_token_budget_ms(
        &self,
        stream: bool,
        max_tokens: u64,
        pace_ms: Option<f64>,
    ) -> Option<f64> {
        let ttft = self.ttft_ms? as f64;
        if stream {
            return Some(ttft);
        }
        let tpot = self.tpot_ms? as f64;
        let spare = pace_ms
            .filter(|p| p.is_finite())
            .map_or(0.0, |p| (tpot - p).max(0.0));
        Some(ttft + spare * max_tokens.saturating_sub(1) as f64)
    }
}

/// What a request asks of its pool, for the refusal of one that cannot be served in time: its
/// objective (its tier's, tightened by its headers), whether it streams, and the most completion
/// tokens it may produce after shaping.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Asked {
    pub slo: Slo,
    pub stream: bool,
    pub max_tokens: u64,
}

/// What was measured of one served request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Measured {
    /// From receipt to the last byte, ms.
    pub latency_ms: f64,
    /// Streamed: from receipt to the first token byte sent to the client, ms.
    pub ttft_ms: Option<f64>,
    /// Streamed with at least two tokens: the pace after the first, ms a token.
    pub tpot_ms: Option<f64>,
    pub completion_tokens: Option<u64>,
    pub stream: bool,
}

impl Measured {
    /// A stream of `tokens` whose first came at `ttft_ms` and the rest at `tpot_ms` each.
    pub fn stream(ttft_ms: f64, tpot_ms: f64, tokens: u64) -> Self {
        Measured {
            latency_ms: ttft_ms + tpot_ms * tokens.saturating_sub(1) as f64,
            ttft_ms: Some(ttft_ms),
            tpot_ms: Some(tpot_ms),
            completion_tokens: Some(tokens),
            stream: true,
        }
    }

    /// TPOT from the first and last token times: `None` under two tokens (no pace to speak of).
    pub fn tpot_of(first_ms: f64, last_ms: f64, tokens: u64) -> Option<f64> {
        (tokens >= 2 && last_ms >= first_ms).then(|| (last_ms - first_ms) / (tokens - 1) as f64)
    }
}

/// How a served request fared against its objective: which dimensions it missed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Judged {
    pub missed: [bool; 3],
    /// At least one dimension was judged.
    pub judged: bool,
}

impl Judged {
    pub fn met(&self) -> bool {
        !self.missed.iter().any(|m| *m)
    }

    /// The dimensions missed, in [`Dim::ALL`] order.
    pub fn missed_dims(&self) -> impl Iterator<Item = Dim> + '_ {
        Dim::ALL.into_iter().filter(|d| self.missed[d.index()])
    }

    /// The missed dimensions as the ledger and the log carry them: `"ttft,tpot"`, or `None`.
    pub fn missed_label(&self) -> Option<&'static str> {
        match self.missed {
            [false, false, false] => None,
            [true, false, false] => Some("ttft"),
            [false, true, false] => Some("tpot"),
            [false, false, true] => Some("e2e"),
            [true, true, false] => Some("ttft,tpot"),
            [true, false, true] => Some("ttft,e2e"),
            [false, true, true] => Some("tpot,e2e"),
            [true, true, true] => Some("ttft,tpot,e2e"),
        }
    }
}

/// Judges a served request against `slo`. A streamed answer is judged on its first token and
/// its pace (a capped answer is no faster for being short); a whole one on the deadline a
/// stream meeting both would have kept, and counts as missing both when late.
pub fn judge(slo: &Slo, m: &Measured) -> Judged {
    let mut j = Judged::default();
    let mut miss = |d: Dim, late: bool| {
        j.judged = true;
        j.missed[d.index()] = late;
    };
    if let Some(e2e) = slo.e2e_ms {
        miss(Dim::E2e, m.latency_ms > e2e as f64);
    }
    if m.stream {
        if let (Some(t), Some(ttft)) = (slo.ttft_ms, m.ttft_ms) {
            miss(Dim::Ttft, ttft > t as f64);
        }
        if let (Some(t), Some(tpot)) = (slo.tpot_ms, m.tpot_ms) {
            miss(Dim::Tpot, tpot > t as f64);
        }
    } else if let Some(deadline) = slo.whole_deadline_ms(m.completion_tokens.unwrap_or(1)) {
        let late = m.latency_ms > deadline;
        miss(Dim::Ttft, late);
        miss(Dim::Tpot, late);
    }
    j
}

/// The first token a request arriving now can expect on a pool: vLLM's queue delay there plus
/// the unloaded time to first token (prefill at idle) learned on it. `None` while the queue
/// delay is unknown or nothing queues: nothing is refused on a guess, and a target the pool
/// misses unloaded is the controller's to flag (it sheds nobody), not a reason to refuse a
/// tier's every request.
pub fn ttft_estimate(delay_ms: Option<f64>, unloaded_ttft_ms: Option<f64>) -> Option<f64> {
    let d = delay_ms.filter(|d| d.is_finite() && *d > 0.0)?;
    Some(d + unloaded_ttft_ms.filter(|u| u.is_finite()).unwrap_or(0.0))
}

/// Whether a request of `tier` whose first token must come within `budget_ms`
/// ([`Slo::first_token_budget_ms`]) is refused before it costs GPU time: the pool's estimate
/// is already past it. Guaranteed is never refused for it; it is judged late instead.
pub fn unattainable(tier: Tier, budget_ms: Option<f64>, estimate_ms: Option<f64>) -> bool {
    tier != Tier::Guaranteed && budget_ms.zip(estimate_ms).is_some_and(|(b, e)| e > b)
}

/// The refusal of a Standard or Best-Effort request whose objective its pool cannot meet now:
/// for a decision that neither refuses it nor moves it to the fallback (judged where it runs),
/// the estimate of its first token ([`ttft_estimate`]: vLLM's queue delay on the decision's pool
/// plus the tier's learned unloaded TTFT there, else the lowest another tier learned) when it is
/// past the latest its first token may come ([`Slo::first_token_budget_ms`], a whole answer
/// decoding at the pool's pace). The proxy and the benchmark's model ask the same.
pub fn refused_estimate(
    state: &crate::PolicyState,
    decision: &crate::Decision,
    asked: &Asked,
) -> Option<f64> {
    use crate::Action;
    if decision.action == Action::Reject || matches!(decision.action, Action::Fallback { .. }) {
        return None;
    }
    let ctl = &state.pools[decision.pool.signal_index()?];
    // The tier's own value, else the lowest another tier has on this pool: its learned
    // unloaded value, or its reading over the window.
    let read = |d: Dim, unloaded: bool| {
        let of = |t: Tier| {
            let r = &ctl.dims[t.index()][d.index()];
            if unloaded {
                r.unloaded_ms
            } else {
                r.observed_ms
            }
        };
        of(decision.tier).or_else(|| Tier::ALL.into_iter().filter_map(of).min_by(f64::total_cmp))
    };
    let estimate = ttft_estimate(ctl.delay_ms, read(Dim::Ttft, true));
    // The batch's pace now (vLLM's, else the window's), else the learned unloaded one.
    let pace = ctl
        .pace_ms
        .or_else(|| read(Dim::Tpot, false))
        .or_else(|| read(Dim::Tpot, true));
    let max_tokens = decision
        .action
        .max_tokens_cap()
        .map_or(asked.max_tokens, |cap| asked.max_tokens.min(u64::from(cap)));
    let budget = asked
        .slo
        .first_token_budget_ms(asked.stream, max_tokens, pace);
    unattainable(decision.tier, budget, estimate)
        .then_some(estimate)
        .flatten()
}

/// A per-request target header's value: a positive whole number of milliseconds. Anything
/// else is ignored (a malformed hint never loosens or breaks a request).
pub fn parse_target_header(v: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(v).ok()?.trim();
    if s.is_empty() || s.len() > 9 || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok().filter(|v| *v > 0)
}

/// The per-request target headers, newest name first.
pub const TTFT_HEADERS: [&str; 2] = ["x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"];
pub const TPOT_HEADERS: [&str; 2] = ["x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"];

#[cfg(test)]
mod tests {
    use super::*;

    fn slo(ttft: u64, tpot: u64) -> Slo {
        Slo {
            ttft_ms: Some(ttft),
            tpot_ms: Some(tpot),
            e2e_ms: None,
        }
    }

    fn stream(ttft: f64, tpot: f64, tokens: u64) -> Measured {
        Measured::stream(ttft, tpot, tokens)
    }

    #[test]
    fn a_stream_is_judged_on_each_dimension_set() {
        let s = slo(500, 40);
        assert!(judge(&s, &stream(450.0, 39.0, 100)).met());
        let late_first = judge(&s, &stream(600.0, 20.0, 100));
        assert_eq!(late_first.missed_label(), Some("ttft"));
        let slow = judge(&s, &stream(100.0, 45.0, 100));
        assert_eq!(slow.missed_label(), Some("tpot"));
        // An end-to-end target alone: the prototype's judgement, untouched by TTFT or TPOT.
        let e = Slo::e2e(2000);
        assert!(judge(&e, &stream(1500.0, 1.0, 100)).met());
        assert_eq!(
            judge(&e, &stream(1500.0, 10.0, 100)).missed_label(),
            Some("e2e")
        );
        assert!(!judge(&Slo::default(), &stream(9e9, 9e9, 2)).judged);
    }

    #[test]
    fn a_capped_stream_is_no_faster_for_being_short() {
        // Ten tokens at a late first token miss TTFT however short the answer.
        let j = judge(&slo(500, 40), &stream(700.0, 10.0, 10));
        assert_eq!(j.missed_label(), Some("ttft"));
    }

    #[test]
    fn a_whole_answer_meets_ttft_and_tpot_by_the_streams_deadline() {
        let s = slo(500, 40);
        // 100 tokens: a stream meeting both ends by 500 + 40 × 99 = 4460 ms.
        assert_eq!(s.whole_deadline_ms(100), Some(4460.0));
        let whole = |latency_ms| Measured {
            latency_ms,
            completion_tokens: Some(100),
            ..Measured::default()
        };
        assert!(judge(&s, &whole(4460.0)).met());
        let late = judge(&s, &whole(4461.0));
        assert_eq!(late.missed_label(), Some("ttft,tpot"));
        // One token: the deadline is the first token's.
        assert_eq!(s.whole_deadline_ms(1), Some(500.0));
        // TTFT alone gives a whole answer no deadline: it is not judged on it.
        let ttft_only = Slo { tpot_ms: None, ..s };
        assert!(!judge(&ttft_only, &whole(1e9)).judged);
    }

    #[test]
    fn headers_tighten_and_never_loosen() {
        let tier = slo(500, 40);
        assert_eq!(tier.tightened(Some(200), None), slo(200, 40));
        assert_eq!(tier.tightened(Some(900), Some(90)), tier);
        assert_eq!(tier.tightened(Some(300), Some(25)), slo(300, 25));
        // A tier without a TTFT target takes the request's.
        let e = Slo::e2e(2000);
        assert_eq!(e.tightened(Some(300), None).ttft_ms, Some(300));
        assert_eq!(e.tightened(None, None), e);
    }

    #[test]
    fn header_values_are_positive_whole_milliseconds() {
        assert_eq!(parse_target_header(b"250"), Some(250));
        assert_eq!(parse_target_header(b" 40 "), Some(40));
        for bad in [
            &b""[..],
            b"0",
            b"-5",
            b"1.5",
            b"abc",
            b"99999999999",
            b"\xff",
        ] {
            assert_eq!(parse_target_header(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn only_lower_tiers_are_refused_a_first_token_the_pool_cannot_give() {
        // 700 ms of vLLM queue and 80 ms of prefill: a 500 ms first token is out of reach.
        let e = ttft_estimate(Some(700.0), Some(80.0));
        assert_eq!(e, Some(780.0));
        assert!(unattainable(Tier::Standard, Some(500.0), e));
        assert!(unattainable(Tier::BestEffort, Some(500.0), e));
        assert!(!unattainable(Tier::Guaranteed, Some(500.0), e));
        // Within reach, no target, or no queue reading: admitted.
        assert!(!unattainable(Tier::Standard, Some(800.0), e));
        assert!(!unattainable(Tier::Standard, None, e));
        assert!(!unattainable(
            Tier::Standard,
            Some(1.0),
            ttft_estimate(None, Some(80.0))
        ));
        // No queue: nothing is refused, whatever the prefill.
        assert_eq!(ttft_estimate(Some(0.0), Some(900.0)), None);
        assert!(!unattainable(
            Tier::Standard,
            Some(1.0),
            ttft_estimate(Some(0.0), Some(900.0))
        ));
    }

    #[test]
    fn a_whole_answer_may_start_as_late_as_its_deadline_leaves_room_for() {
        let slo = Slo {
            ttft_ms: Some(500),
            tpot_ms: Some(50),
            e2e_ms: None,
        };
        // A stream: its first token by the TTFT target, however long the answer.
        assert_eq!(
            slo.first_token_budget_ms(true, 200, Some(20.0)),
            Some(500.0)
        );
        // A whole answer of up to 200 tokens decoding at 20 ms: its deadline grows 50 ms a
        // token and its decode 20, so its first token may come 30 × 199 ms later.
        assert_eq!(
            slo.first_token_budget_ms(false, 200, Some(20.0)),
            Some(500.0 + 30.0 * 199.0)
        );
        // Decoding slower than its TPOT target: the shortest answer is its best chance.
        assert_eq!(
            slo.first_token_budget_ms(false, 200, Some(80.0)),
            Some(500.0)
        );
        // Pace unknown, or a single token: the TTFT target.
        assert_eq!(slo.first_token_budget_ms(false, 200, None), Some(500.0));
        assert_eq!(slo.first_token_budget_ms(false, 1, Some(20.0)), Some(500.0));
        // TTFT alone does not judge a whole answer (it has no deadline), nor does TPOT alone.
        let ttft_only = Slo {
            tpot_ms: None,
            ..slo
        };
        assert_eq!(
            ttft_only.first_token_budget_ms(false, 200, Some(20.0)),
            None
        );
        assert_eq!(
            ttft_only.first_token_budget_ms(true, 200, Some(20.0)),
            Some(500.0)
        );
        let tpot_only = Slo {
            ttft_ms: None,
            ..slo
        };
        assert_eq!(tpot_only.first_token_budget_ms(true, 200, Some(20.0)), None);
        // 780 ms of first token: the stream is refused, the whole answer of 200 tokens is not,
        // a whole answer of one token is.
        let e = ttft_estimate(Some(700.0), Some(80.0));
        assert!(unattainable(
            Tier::Standard,
            slo.first_token_budget_ms(true, 200, Some(20.0)),
            e
        ));
        assert!(!unattainable(
            Tier::Standard,
            slo.first_token_budget_ms(false, 200, Some(20.0)),
            e
        ));
        assert!(unattainable(
            Tier::Standard,
            slo.first_token_budget_ms(false, 1, Some(20.0)),
            e
        ));
    }

    #[test]
    fn tpot_needs_two_tokens() {
        assert_eq!(Measured::tpot_of(100.0, 1090.0, 100), Some(10.0));
        assert_eq!(Measured::tpot_of(100.0, 100.0, 1), None);
    }
}
