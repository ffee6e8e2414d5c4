//! Work-based admission (adaptive mode): the admission level acts on latencies, which arrive
//! a second or two after the load that caused them; a burst is admitted in full before the
//! level can move. What Sluice knows at once is the work it has in flight on each pool — every
//! admitted request's estimated KV footprint (prompt tokens plus the completion it may
//! generate, after any cap). So each pool also learns a *work limit*: when its protected tiers
//! run short of headroom the limit falls to just under the work that was in flight (Vegas-style:
//! that much was too much), and while the headroom is fine and the limit binds it grows back
//! by a tenth per sample. Lower tiers may only fill part of it (`work_share_*`), so the last
//! slice of the pool stays free for the tiers above them: a Standard or Best-Effort request
//! that would push the pool's in-flight work past its tier's share is capped if that brings it
//! under, moved to the fallback where the tier may and the fallback is other capacity, and
//! otherwise refused. Guaranteed is never gated.

use crate::types::{Millis, Tier};

/// A limit never falls below this share of the work in flight when it is cut: one bad sample
/// must not shut lower tiers out for the minute it would take to grow back.
const FLOOR_OF_INFLIGHT: f64 = 0.5;
/// The cut: just under what was in flight when the headroom ran short.
const BACKOFF: f64 = 0.9;
/// Growth per sample while the limit binds and every protected tier has headroom.
const GROWTH: f64 = 1.1;
/// The limit binds when the work in flight reaches this share of it.
const BINDS_AT: f64 = 0.8;

/// A request's estimated KV footprint in tokens.
pub fn work_of(prompt_tokens: u64, max_tokens: Option<u64>, cap: Option<u32>, assumed: u64) -> f64 {
    let completion = max_tokens.unwrap_or(assumed);
    let completion = cap.map_or(completion, |c| completion.min(u64::from(c)));
    (prompt_tokens + completion) as f64
}

/// Prompt tokens from the size of a request body: about four bytes of JSON per token (the
/// OpenAI rule of thumb for English text), which is all Sluice can know before vLLM tokenises.
pub fn prompt_tokens_of_body(body_bytes: usize) -> u64 {
    (body_bytes / 4) as u64
}

/// Tokens a chat template adds around each message (role header and end marker; Llama 3's
/// take five, ChatML's four).
const TEMPLATE_TOKENS_PER_MESSAGE: u64 = 4;

/// Prompt tokens from the bytes of a prompt's text (and tool definitions) and its number of
/// messages: about four bytes per token, as above, plus what the chat template adds.
pub fn prompt_tokens_of_text(text_bytes: u64, messages: u64) -> u64 {
    text_bytes.div_ceil(4) + TEMPLATE_TOKENS_PER_MESSAGE * messages
}

/// The learned limit of one pool.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkLimit {
    limit: Option<f64>,
    last_cut: Option<Millis>,
}

impl WorkLimit {
    pub fn get(&self) -> Option<f64> {
        self.limit
    }

    /// One sample: `inflight` is the pool's work in flight now (unknown when Sluice does not
    /// count it), `short` whether a protected tier is short of headroom (the level rose or a
    /// rail tripped). One cut per `hold_ms`: the latencies that follow a cut were mostly
    /// started before it, and cutting on them again would ratchet the limit down for a load
    /// already gone.
    pub fn sample(
        &mut self,
        inflight: Option<f64>,
        short: bool,
        now: Millis,
        hold_ms: Millis,
    ) -> Option<f64> {
        let Some(w) = inflight.filter(|w| w.is_finite() && *w > 0.0) else {
            return self.limit;
        };
        let held = self
            .last_cut
            .is_some_and(|t| now.saturating_sub(t) < hold_ms);
        if short && !held {
            let cut = BACKOFF * self.limit.map_or(w, |l| l.min(w));
            self.limit = Some(cut.max(FLOOR_OF_INFLIGHT * w));
            self.last_cut = Some(now);
        } else if !short {
            if let Some(l) = self.limit.filter(|l| w >= BINDS_AT * l) {
                self.limit = Some(l * GROWTH);
            }
        }
        self.limit
    }
}

/// The share of a pool's work limit `tier` may fill; `None` for a tier that is never gated.
pub fn share(tier: Tier, standard: f64, best_effort: f64) -> Option<f64> {
    match tier {
        Tier::Guaranteed => None,
        Tier::Standard => Some(standard),
        Tier::BestEffort => Some(best_effort),
    }
}

/// Whether admitting `work` more would take the pool past `share` of its limit.
pub fn over(inflight: f64, work: f64, limit: Option<f64>, share: f64) -> bool {
    limit.is_some_and(|l| inflight + work > share * l)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_sample_cuts_to_just_under_what_was_in_flight_once_per_hold() {
        let mut w = WorkLimit::default();
        assert_eq!(
            w.sample(Some(10_000.0), false, 0, 2000),
            None,
            "nothing learned yet"
        );
        assert_eq!(w.sample(Some(10_000.0), true, 0, 2000), Some(9_000.0));
        assert_eq!(
            w.sample(Some(6_000.0), true, 1000, 2000),
            Some(9_000.0),
            "held"
        );
        // Still short with less in flight: cut again, but never below half of what flies.
        assert_eq!(w.sample(Some(6_000.0), true, 2000, 2000), Some(5_400.0));
        assert_eq!(w.sample(Some(20_000.0), true, 4000, 2000), Some(10_000.0));
    }

    #[test]
    fn it_grows_back_only_while_it_binds_and_nothing_is_short() {
        let mut w = WorkLimit::default();
        w.sample(Some(10_000.0), true, 0, 2000);
        assert_eq!(
            w.sample(Some(1_000.0), false, 500, 2000),
            Some(9_000.0),
            "not binding"
        );
        let grown = w.sample(Some(8_000.0), false, 1000, 2000).unwrap();
        assert!((grown - 9_900.0).abs() < 1e-6);
        assert_eq!(
            w.sample(None, true, 5000, 2000),
            Some(grown),
            "no count, no change"
        );
    }

    #[test]
    fn work_counts_the_capped_completion() {
        assert_eq!(work_of(100, Some(500), None, 1024), 600.0);
        assert_eq!(work_of(100, Some(500), Some(256), 1024), 356.0);
        assert_eq!(work_of(100, None, None, 1024), 1124.0);
        assert!(over(900.0, 200.0, Some(1_000.0), 1.0));
        assert!(!over(900.0, 200.0, None, 1.0));
        assert!(!over(500.0, 200.0, Some(1_000.0), 0.7));
        assert_eq!(share(Tier::Guaranteed, 0.9, 0.7), None);
    }
}
