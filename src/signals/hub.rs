//! The meeting point of background samplers, admin overrides and the request path.

use crate::policy::tenant_policy::PolicyRules;
use crate::policy::{Millis, PolicyEngine, PolicyState, PoolSignals, SignalKind};
use arc_swap::ArcSwap;
use serde::Serialize;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// The monotonic clock the policy's `now` comes from.
#[derive(Debug, Clone, Copy)]
pub struct Clock(Instant);

impl Clock {
    pub fn new() -> Self {
        Clock(Instant::now())
    }
    pub fn now_ms(&self) -> Millis {
        self.0.elapsed().as_millis() as Millis
    }
}

impl Default for Clock {
    fn default() -> Self {
        Self::new()
    }
}

/// The index of a pool's signals: the on-demand pool drives tier states, spot drives eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum SignalPool {
    #[serde(rename = "on-demand")]
    OnDemand,
    #[serde(rename = "spot")]
    Spot,
}

impl SignalPool {
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "on-demand" => Some(SignalPool::OnDemand),
            "spot" => Some(SignalPool::Spot),
            _ => None,
        }
    }
    fn index(self) -> usize {
        self as usize
    }
}

/// One scrape of one backend.
#[derive(Debug, Clone, Serialize)]
pub struct BackendScrape {
    pub backend: String,
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
    pub error: Option<String>,
}

/// One round of scraping a pool, aggregated: mean KV pressure (%) over the backends that answered
/// (requests are spread over them, so the mean is what a new request meets), summed waiting queue.
#[derive(Debug, Clone, Default)]
pub struct ScrapeRound {
    pub at: Millis,
    pub pressure: Option<f64>,
    pub queue_depth: Option<f64>,
    pub backends: Vec<BackendScrape>,
}

impl ScrapeRound {
    pub fn aggregate(at: Millis, backends: Vec<BackendScrape>) -> Self {
        let kv: Vec<f64> = backends.iter().filter_map(|b| b.kv_usage).collect();
        let waiting: Vec<f64> = backends.iter().filter_map(|b| b.waiting).collect();
        ScrapeRound {
            at,
            pressure: (!kv.is_empty()).then(|| 100.0 * kv.iter().sum::<f64>() / kv.len() as f64),
            queue_depth: (!waiting.is_empty()).then(|| waiting.iter().sum()),
            backends,
        }
    }
}

/// How one signal is known right now, for `/status` and the decision record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SignalReading {
    pub value: Option<f64>,
    pub age_ms: Option<u64>,
    /// `scrape`, `admin`, or `none`.
    pub source: &'static str,
    /// Why the value is unavailable, when it is.
    pub unavailable: Option<String>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Overrides {
    values: [Option<(f64, Millis)>; 3],
}

/// A value computed elsewhere (the ledger's SLA-violation rate): value or why it is missing.
#[derive(Debug, Clone)]
struct External {
    at: Millis,
    value: Result<f64, String>,
}

struct PoolCell {
    scraped: ArcSwap<Option<ScrapeRound>>,
    overrides: Mutex<Overrides>,
    external: Mutex<[Option<External>; 3]>,
}

pub struct SignalHub {
    clock: Clock,
    stale_after_ms: Millis,
    pools: [PoolCell; 2],
    engine: Mutex<PolicyEngine>,
    state: ArcSwap<PolicyState>,
}

fn kind_index(kind: SignalKind) -> usize {
    match kind {
        SignalKind::Pressure => 0,
        SignalKind::QueueDepth => 1,
        SignalKind::SlaViolationRate => 2,
    }
}

impl SignalHub {
    pub fn new(clock: Clock, stale_after_ms: Millis, rules: PolicyRules) -> Self {
        let cell = || PoolCell {
            scraped: ArcSwap::from_pointee(None),
            overrides: Mutex::new(Overrides::default()),
            external: Mutex::new([None, None, None]),
        };
        Self {
            clock,
            stale_after_ms,
            pools: [cell(), cell()],
            engine: Mutex::new(PolicyEngine::new(rules)),
            state: ArcSwap::from_pointee(PolicyState::initial()),
        }
    }

    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// The latest policy state; lock-free for the request path.
    pub fn state(&self) -> Arc<PolicyState> {
        self.state.load_full()
    }

    pub fn rules(&self) -> PolicyRules {
        self.engine_lock().rules().clone()
    }

    pub fn set_rules(&self, rules: PolicyRules) {
        self.engine_lock().set_rules(rules);
    }

    fn engine_lock(&self) -> std::sync::MutexGuard<'_, PolicyEngine> {
        self.engine.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn overrides(&self, pool: SignalPool) -> std::sync::MutexGuard<'_, Overrides> {
        self.pools[pool.index()]
            .overrides
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    pub fn record_scrape(&self, pool: SignalPool, round: ScrapeRound) {
        self.pools[pool.index()]
            .scraped
            .store(Arc::new(Some(round)));
    }

    pub fn last_scrape(&self, pool: SignalPool) -> Option<ScrapeRound> {
        (*self.pools[pool.index()].scraped.load_full()).clone()
    }

    pub fn set_override(&self, pool: SignalPool, kind: SignalKind, value: Option<f64>) {
        let now = self.clock.now_ms();
        self.overrides(pool).values[kind_index(kind)] = value.map(|v| (v, now));
    }

    /// Records a value computed by another background service (e.g. the SLA-violation rate from
    /// the ledger); `Err` says why it is unavailable. It is subject to the same staleness bound.
    pub fn record_external(&self, pool: SignalPool, kind: SignalKind, value: Result<f64, String>) {
        let at = self.clock.now_ms();
        let mut ext = self.pools[pool.index()]
            .external
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        ext[kind_index(kind)] = Some(External { at, value });
    }

    fn external(&self, pool: SignalPool, kind: SignalKind) -> Option<External> {
        let ext = self.pools[pool.index()]
            .external
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        ext[kind_index(kind)].clone()
    }

    pub fn reading(&self, pool: SignalPool, kind: SignalKind, now: Millis) -> SignalReading {
        if let Some((v, at)) = self.overrides(pool).values[kind_index(kind)] {
            return SignalReading {
                value: Some(v),
                age_ms: Some(now.saturating_sub(at)),
                source: "admin",
                unavailable: None,
            };
        }
        let unavailable = |why: String| SignalReading {
            value: None,
            age_ms: None,
            source: "none",
            unavailable: Some(why),
        };
        if let Some(ext) = self.external(pool, kind) {
            let age = now.saturating_sub(ext.at);
            return match ext.value {
                _ if age > self.stale_after_ms => {
                    unavailable(format!("stale: last sample {age} ms ago"))
                }
                Ok(v) => SignalReading {
                    value: Some(v),
                    age_ms: Some(age),
                    source: "ledger",
                    unavailable: None,
                },
                Err(e) => unavailable(e),
            };
        }
        let round = self.pools[pool.index()].scraped.load();
        let Some(round) = round.as_ref() else {
            return unavailable(match kind {
                SignalKind::SlaViolationRate => "no source: set /admin/sla-violation-rate".into(),
                _ => "not scraped yet".into(),
            });
        };
        let age = now.saturating_sub(round.at);
        let value = match kind {
            SignalKind::Pressure => round.pressure,
            SignalKind::QueueDepth => round.queue_depth,
            SignalKind::SlaViolationRate => {
                return unavailable("no source: set /admin/sla-violation-rate".into())
            }
        };
        if age > self.stale_after_ms {
            return unavailable(format!("stale: last sample {age} ms ago"));
        }
        match value {
            Some(v) => SignalReading {
                value: Some(v),
                age_ms: Some(age),
                source: "scrape",
                unavailable: None,
            },
            None => unavailable(
                round
                    .backends
                    .iter()
                    .find_map(|b| b.error.clone())
                    .map(|e| format!("no backend answered: {e}"))
                    .unwrap_or_else(|| format!("no backend exports {}", kind.as_str())),
            ),
        }
    }

    pub fn signals(&self, pool: SignalPool, now: Millis) -> PoolSignals {
        PoolSignals {
            pressure: self.reading(pool, SignalKind::Pressure, now).value,
            queue_depth: self.reading(pool, SignalKind::QueueDepth, now).value,
            sla_violation_rate: self.reading(pool, SignalKind::SlaViolationRate, now).value,
        }
    }

    /// Advances the policy by one sample and publishes the new state.
    pub fn tick(&self) -> Arc<PolicyState> {
        let now = self.clock.now_ms();
        let on_demand = self.signals(SignalPool::OnDemand, now);
        let spot = self.signals(SignalPool::Spot, now);
        let state = Arc::new(self.engine_lock().observe(&on_demand, &spot, now));
        self.state.store(Arc::clone(&state));
        state
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::policy::PressureState;

    #[test]
    fn overrides_win_and_stale_samples_are_unavailable() {
        let hub = SignalHub::new(Clock::new(), 50, PolicyRules::default());
        let backends = vec![BackendScrape {
            backend: "a".into(),
            kv_usage: Some(0.4),
            waiting: Some(2.0),
            error: None,
        }];
        hub.record_scrape(
            SignalPool::OnDemand,
            ScrapeRound::aggregate(hub.clock().now_ms(), backends),
        );
        let now = hub.clock().now_ms();
        let r = hub.reading(SignalPool::OnDemand, SignalKind::Pressure, now);
        assert_eq!((r.value, r.source), (Some(40.0), "scrape"));
        hub.set_override(SignalPool::OnDemand, SignalKind::Pressure, Some(65.0));
        assert_eq!(hub.signals(SignalPool::OnDemand, now).pressure, Some(65.0));
        hub.set_override(SignalPool::OnDemand, SignalKind::Pressure, None);
        let later = now + 100;
        let r = hub.reading(SignalPool::OnDemand, SignalKind::QueueDepth, later);
        assert_eq!(r.value, None);
        assert!(r.unavailable.unwrap().starts_with("stale"));
    }

    #[test]
    fn ticks_drive_the_engine() {
        let hub = SignalHub::new(Clock::new(), 60_000, PolicyRules::default());
        hub.set_override(SignalPool::OnDemand, SignalKind::Pressure, Some(65.0));
        hub.tick();
        let s = hub.tick();
        assert_eq!(
            s.tier(crate::policy::Tier::BestEffort).state,
            PressureState::Critical
        );
        assert_eq!(
            s.tier(crate::policy::Tier::Guaranteed).state,
            PressureState::Normal
        );
    }
}
