//! Stage 5, ClusterRouting: a QoS choice between pools, never load balancing across them.
//! Guaranteed and Standard go on-demand; Best-Effort prefers spot unless spot has no healthy
//! backend or its own pressure is Critical, in which case it is evicted to on-demand.

use crate::reason::Reason;
use crate::tenant_policy::TierPlan;
use crate::types::{Action, Millis, Pool, PressureState};

pub fn route(
    plan: &TierPlan,
    action: &Action,
    spot_state: PressureState,
    spot_healthy: bool,
) -> (Pool, Reason) {
    if matches!(action, Action::Fallback { .. }) {
        return (Pool::Fallback, Reason::RouteFallback);
    }
    match plan.preferred_pool {
        Pool::Spot if !spot_healthy => (Pool::OnDemand, Reason::RouteSpotUnhealthy),
        Pool::Spot if spot_state == PressureState::Critical => {
            (Pool::OnDemand, Reason::RouteSpotPressure)
        }
        pool => (pool, Reason::RouteTierPool),
    }
}

// ---------------------------------------------------------------------------------------------
// Prefix affinity: whether sending a prompt head to its home pays.

/// Whether a request sent to its head's home found the head there. `key_share` is the part of
/// the prompt that keys the head (its first few thousand characters): every request with the
/// same key shares at least that part, so a home that kept the head serves at least half of it
/// from cache; one that did not serves nothing, or a stray block or two another head shares (a
/// chat template's first tokens). Evicted heads go tail first, one head at a time, so a home
/// serves either most of a head or almost none of it: a yes or no per request, which a
/// multi-turn chat (that hits far more than its system prompt) cannot skew.
pub fn home_hit(cached_tokens: u64, prompt_tokens: u64, key_share: f64) -> bool {
    let keyed = prompt_tokens as f64 * key_share.clamp(0.0, 1.0);
    cached_tokens > 0 && cached_tokens as f64 >= 0.5 * keyed
}

/// How long a home's hit or miss weighs in the hit rate: half as much after this.
pub const AFFINITY_HALF_LIFE_MS: Millis = 10_000;
/// Evidence a verdict needs: requests sent home since the evidence was last restarted...
pub const AFFINITY_MIN_SAMPLES: u64 = 20;
/// ... over at least this long, so a cold start's first misses (a head's second request
/// arriving while its first still prefills) do not decide alone.
pub const AFFINITY_MIN_SPAN_MS: Millis = 5_000;
/// Homes that serve fewer of their requests' heads than this do not keep their prefixes: the
/// load affinity concentrates on them buys too few hits, and requests are spread by load. Homes
/// that keep their heads serve nearly all (a miss is a head's first request after a cold start
/// or a burst); a cache that thrashes still serves many, since a head evicted tail first keeps
/// its start a while and heads in use are never evicted (seven or eight in ten, with ten heads
/// a replica and room for three), but least load then does better.
pub const AFFINITY_LEAVE_BELOW: f64 = 0.85;
/// Affinity comes back when its homes serve at least this share (higher than the share that
/// ends it, so a pool on the edge does not flap).
pub const AFFINITY_RETURN_AT: f64 = 0.92;
/// How long requests are spread before affinity is tried again, doubled for each trial that
/// failed in a row up to [`AFFINITY_SPREAD_MAX_MS`]: heads that fit in their homes' caches only
/// while affinity keeps each on one replica cannot show it while they are spread.
pub const AFFINITY_SPREAD_MS: Millis = 60_000;
pub const AFFINITY_SPREAD_MAX_MS: Millis = 480_000;
/// How long a trial of affinity runs before it is judged (with [`AFFINITY_MIN_SAMPLES`]).
pub const AFFINITY_TRIAL_MS: Millis = 10_000;

/// Where a pool's prefix affinity stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AffinityMode {
    /// Homes are used; too little evidence yet to judge them.
    Learning,
    /// Homes are used: requests sent home find their head there.
    Paying,
    /// Homes do not keep their heads: requests go where load is least until `until`, then a
    /// trial. Requests that least load happens to send home still count, and bring affinity
    /// back at once when their homes serve them.
    Spreading { until: Millis },
    /// Homes are used again since `since`, to see whether they keep their heads now.
    Trial { since: Millis },
}

impl AffinityMode {
    pub fn as_str(self) -> &'static str {
        match self {
            AffinityMode::Learning => "learning",
            AffinityMode::Paying => "paying",
            AffinityMode::Spreading { .. } => "spreading",
            AffinityMode::Trial { .. } => "trial",
        }
    }
}

/// Judges whether a pool's homes keep their heads, from whether requests sent home hit
/// ([`home_hit`]). Pure: the caller passes the time (ms on a monotonic clock it owns).
#[derive(Debug, Clone, PartialEq)]
pub struct AffinityJudge {
    mode: AffinityMode,
    /// Hits and requests, decayed by [`AFFINITY_HALF_LIFE_MS`] to `at`.
    hits: f64,
    weight: f64,
    at: Millis,
    /// Requests counted since the evidence was restarted, and when the first came.
    count: u64,
    first: Option<Millis>,
    /// Spreading periods in a row that a trial did not end.
    strikes: u32,
    /// The hit rate the last change of mode was decided on.
    verdict: Option<f64>,
}

impl Default for AffinityJudge {
    fn default() -> Self {
        AffinityJudge {
            mode: AffinityMode::Learning,
            hits: 0.0,
            weight: 0.0,
            at: 0,
            count: 0,
            first: None,
            strikes: 0,
            verdict: None,
        }
    }
}

impl AffinityJudge {
    pub fn mode(&self) -> AffinityMode {
        self.mode
    }

    /// Whether requests go to their heads' homes now (every mode but spreading).
    pub fn affine(&self) -> bool {
        !matches!(self.mode, AffinityMode::Spreading { .. })
    }

    /// The decayed share of requests sent home that hit, since the evidence was restarted.
    pub fn hit_rate(&self) -> Option<f64> {
        (self.weight > 0.0).then(|| self.hits / self.weight)
    }

    /// The hit rate the last change of mode was decided on (none for a trial, which time
    /// starts).
    pub fn verdict(&self) -> Option<f64> {
        self.verdict
    }

    /// Requests sent home counted since the evidence was restarted (at each change of mode but
    /// the first verdict).
    pub fn samples(&self) -> u64 {
        self.count
    }

    /// Time alone moves a spreading pool to its trial.
    pub fn tick(&mut self, now: Millis) {
        if let AffinityMode::Spreading { until } = self.mode {
            if now >= until {
                self.enter(AffinityMode::Trial { since: now }, now);
            }
        }
    }

    /// A request sent to its head's home (by affinity, or by least load while spreading)
    /// answered; `hit`: whether its head was there ([`home_hit`]).
    pub fn observe(&mut self, now: Millis, hit: bool) {
        self.tick(now);
        self.decay(now);
        self.hits += f64::from(u8::from(hit));
        self.weight += 1.0;
        self.count += 1;
        let first = *self.first.get_or_insert(now);
        let Some(rate) = self.hit_rate() else { return };
        let judged =
            self.count >= AFFINITY_MIN_SAMPLES && now.saturating_sub(first) >= AFFINITY_MIN_SPAN_MS;
        match self.mode {
            AffinityMode::Learning | AffinityMode::Paying if judged => {
                if rate < AFFINITY_LEAVE_BELOW {
                    self.spread(now);
                } else if self.mode == AffinityMode::Learning {
                    self.mode = AffinityMode::Paying;
                    self.verdict = Some(rate);
                }
            }
            AffinityMode::Trial { since }
                if judged && now.saturating_sub(since) >= AFFINITY_TRIAL_MS =>
            {
                if rate >= AFFINITY_RETURN_AT {
                    self.pays(now);
                } else {
                    self.spread(now);
                }
            }
            AffinityMode::Spreading { .. } if judged && rate >= AFFINITY_RETURN_AT => {
                self.pays(now);
            }
            _ => {}
        }
    }

    fn decay(&mut self, now: Millis) {
        if now > self.at {
            let k = 0.5f64.powf((now - self.at) as f64 / AFFINITY_HALF_LIFE_MS as f64);
            self.hits *= k;
            self.weight *= k;
            self.at = now;
        }
    }

    fn pays(&mut self, now: Millis) {
        self.strikes = 0;
        self.enter(AffinityMode::Paying, now);
    }

    fn spread(&mut self, now: Millis) {
        let wait = AFFINITY_SPREAD_MS
            .saturating_mul(1 << self.strikes.min(16))
            .min(AFFINITY_SPREAD_MAX_MS);
        self.strikes = self.strikes.saturating_add(1);
        self.enter(
            AffinityMode::Spreading {
                until: now.saturating_add(wait),
            },
            now,
        );
    }

    /// A new mode judges on its own evidence: what homes did under the last one says little of
    /// what they do under this one.
    fn enter(&mut self, mode: AffinityMode, now: Millis) {
        self.verdict = self
            .hit_rate()
            .filter(|_| !matches!(mode, AffinityMode::Trial { .. }));
        self.mode = mode;
        self.hits = 0.0;
        self.weight = 0.0;
        self.at = now;
        self.count = 0;
        self.first = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tenant_policy::Intervention;

    fn plan(pool: Pool) -> TierPlan {
        TierPlan {
            intervention: Intervention::None(Reason::BelowTierThreshold),
            queue_eligible: false,
            preferred_pool: pool,
        }
    }

    #[test]
    fn spot_eviction_rules() {
        use PressureState::*;
        let be = plan(Pool::Spot);
        assert_eq!(
            route(&be, &Action::Pass, Normal, true),
            (Pool::Spot, Reason::RouteTierPool)
        );
        assert_eq!(
            route(&be, &Action::Pass, Normal, false),
            (Pool::OnDemand, Reason::RouteSpotUnhealthy)
        );
        assert_eq!(
            route(&be, &Action::Pass, Critical, true),
            (Pool::OnDemand, Reason::RouteSpotPressure)
        );
        assert_eq!(route(&be, &Action::Pass, Elevated, true).0, Pool::Spot);
        let g = plan(Pool::OnDemand);
        assert_eq!(
            route(&g, &Action::Pass, Normal, false),
            (Pool::OnDemand, Reason::RouteTierPool)
        );
        let fb = Action::Fallback { max_tokens: None };
        assert_eq!(
            route(&g, &fb, Normal, true),
            (Pool::Fallback, Reason::RouteFallback)
        );
    }

    /// `n` requests sent home, one every `gap` ms from `from`, each hitting with `rate` (spread
    /// evenly: every k-th misses); returns the time after the last.
    fn feed(j: &mut AffinityJudge, from: Millis, gap: Millis, n: u64, rate: f64) -> Millis {
        let mut acc = 0.0;
        for i in 0..n {
            acc += rate;
            let hit = acc >= 1.0;
            if hit {
                acc -= 1.0;
            }
            j.observe(from + i * gap, hit);
        }
        from + n * gap
    }

    #[test]
    fn a_home_hit_is_at_least_half_the_keyed_head() {
        // 2,100 prompt tokens of which the key is a quarter (525): a home that kept the head
        // serves ~2,000; one that lost it serves a stray block.
        assert!(home_hit(2000, 2100, 0.25));
        assert!(home_hit(263, 2100, 0.25));
        assert!(!home_hit(16, 2100, 0.25));
        assert!(!home_hit(0, 2100, 0.25));
        // A short prompt is keyed whole: a repeat hits all but its last block.
        assert!(home_hit(96, 100, 1.0));
        assert!(!home_hit(0, 0, 1.0));
    }

    #[test]
    fn homes_that_keep_their_heads_keep_affinity() {
        let mut j = AffinityJudge::default();
        assert_eq!(j.mode(), AffinityMode::Learning);
        // Many requests within the first seconds are not enough to judge: a cold start, where
        // a head's next requests come while its first still prefills.
        let t = feed(&mut j, 0, 100, 10, 0.6);
        assert_eq!(j.mode(), AffinityMode::Learning);
        // Then the homes serve 95 % of their heads: the early misses never decide.
        for i in 0..200 {
            let at = t + i * 100;
            j.observe(at, i % 20 != 0);
            assert!(j.affine(), "at {at} ms: {:?} {:?}", j.mode(), j.hit_rate());
        }
        assert_eq!(j.mode(), AffinityMode::Paying);
        assert!(j.hit_rate().unwrap() > 0.9, "{:?}", j.hit_rate());
    }

    #[test]
    fn homes_that_lose_their_heads_spread_then_try_again_later_and_later() {
        let mut j = AffinityJudge::default();
        let t = feed(&mut j, 0, 100, 51, 0.6);
        let AffinityMode::Spreading { until } = j.mode() else {
            panic!("{:?}", j.mode());
        };
        assert!(!j.affine());
        assert!(
            j.verdict().unwrap() < AFFINITY_LEAVE_BELOW,
            "{:?}",
            j.verdict()
        );
        assert_eq!(
            (j.hit_rate(), j.samples()),
            (None, 0),
            "spreading judges afresh"
        );
        // It left as soon as the evidence allowed: 20 requests over 5 s.
        assert_eq!(until, 5_000 + AFFINITY_SPREAD_MS);
        // Requests least load sends home still thrash: spreading goes on until the trial.
        let t = feed(&mut j, t, 100, 100, 0.7);
        assert!(!j.affine());
        j.tick(until - 1);
        assert!(!j.affine());
        j.tick(until);
        assert_eq!(j.mode(), AffinityMode::Trial { since: until });
        assert!(j.affine());
        assert!(t < until);
        // The trial needs its full time: a bad start does not end it early.
        let t = feed(&mut j, until, 100, 50, 0.2);
        assert!(matches!(j.mode(), AffinityMode::Trial { .. }));
        let t = feed(&mut j, t, 100, 60, 0.7);
        let AffinityMode::Spreading { until: next } = j.mode() else {
            panic!("{:?}", j.mode());
        };
        assert_eq!(next, until + AFFINITY_TRIAL_MS + 2 * AFFINITY_SPREAD_MS);
        assert!(t > until + AFFINITY_TRIAL_MS);
        // The waits double up to their cap.
        let mut until = next;
        let mut waits = Vec::new();
        for _ in 0..5 {
            j.tick(until);
            feed(&mut j, until, 100, 101, 0.0);
            let AffinityMode::Spreading { until: u } = j.mode() else {
                panic!("{:?}", j.mode());
            };
            waits.push(u - until - AFFINITY_TRIAL_MS);
            until = u;
        }
        assert_eq!(waits, [240_000, 480_000, 480_000, 480_000, 480_000]);
    }

    #[test]
    fn a_trial_that_hits_brings_affinity_back_and_resets_the_wait() {
        let mut j = AffinityJudge::default();
        feed(&mut j, 0, 100, 60, 0.2);
        let AffinityMode::Spreading { until } = j.mode() else {
            panic!("{:?}", j.mode());
        };
        j.tick(until);
        let t = feed(&mut j, until, 100, 120, 0.95);
        assert_eq!(j.mode(), AffinityMode::Paying);
        // Losing the heads again spreads for the first wait, not a doubled one.
        feed(&mut j, t, 100, 300, 0.1);
        let AffinityMode::Spreading { until: again } = j.mode() else {
            panic!("{:?}", j.mode());
        };
        let left = again - AFFINITY_SPREAD_MS;
        assert!(left > t && left <= t + 300 * 100, "{left}");
    }

    #[test]
    fn homes_that_serve_their_heads_while_spread_end_spreading_at_once() {
        let mut j = AffinityJudge::default();
        let t = feed(&mut j, 0, 100, 51, 0.2);
        assert!(!j.affine());
        // Load fell, caches hold every head now: requests that land home hit.
        let t = feed(&mut j, t, 250, 40, 1.0);
        assert_eq!(j.mode(), AffinityMode::Paying, "after {t} ms");
    }

    #[test]
    fn the_verdict_is_a_function_of_the_evidence_and_the_time() {
        let run = || {
            let mut j = AffinityJudge::default();
            let mut modes = Vec::new();
            let mut t = 0;
            for (n, rate) in [(80, 0.4), (30, 0.9), (500, 0.5), (200, 1.0)] {
                t = feed(&mut j, t, 137, n, rate);
                j.tick(t);
                modes.push((j.mode(), j.samples()));
            }
            modes
        };
        assert_eq!(run(), run());
    }
}
