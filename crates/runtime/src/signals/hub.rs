//! The meeting point of background samplers, admin overrides and the request path.

use super::health::PrometheusHealth;
use super::vllm_text::{DelaySpan, Histogram, QueueStall};
use crate::fleet::Routes;
use arc_swap::{ArcSwap, ArcSwapOption};
use serde::Serialize;
use sluice_policy::adaptive::{ladder_with, Outcome};
use sluice_policy::fleet::{FleetState, Layout};
use sluice_policy::tenant_policy::PolicyRules;
use sluice_policy::{
    Clock, Millis, PolicyEngine, PolicyState, Pool, PoolSignals, SignalKind, Tier,
};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex, OnceLock};

/// A pool's index in the fleet (config order), as the policy and the routing table count.
pub type PoolIndex = usize;

/// One scrape of one backend.
#[derive(Debug, Clone, Serialize)]
pub struct BackendScrape {
    pub backend: String,
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
    /// vLLM's cumulative queue-time, TTFT and inter-token-latency histograms (sum and count).
    #[serde(skip)]
    pub queue_time: Option<Histogram>,
    #[serde(skip)]
    pub ttft: Option<Histogram>,
    #[serde(skip)]
    pub itl: Option<Histogram>,
    /// vLLM's prefix-cache counters (cumulative hit and queried tokens).
    #[serde(skip)]
    pub prefix_cache: Option<crate::fleet::PrefixCache>,
    pub error: Option<String>,
}

/// One round of scraping a pool, aggregated: mean KV pressure (%) over the backends that answered
/// (requests are spread over them, so the mean is what a new request meets), summed waiting queue.
#[derive(Debug, Clone, Default)]
pub struct ScrapeRound {
    pub at: Millis,
    pub pressure: Option<f64>,
    pub queue_depth: Option<f64>,
    /// The pool's delay and pace histograms summed over backends (cumulative).
    pub queue_time: Option<Histogram>,
    pub ttft: Option<Histogram>,
    pub itl: Option<Histogram>,
    /// Mean queue delay, TTFT and inter-token latency over at least the delay span, set by
    /// [`SignalHub::record_scrape`]. The inter-token latency is the pool's pace: the mean gap
    /// between consecutive tokens of the requests its backends decoded over the span, `None`
    /// when they decoded none after a first token.
    pub queue_time_ms: Option<f64>,
    pub ttft_ms: Option<f64>,
    pub itl_ms: Option<f64>,
    pub backends: Vec<BackendScrape>,
    /// The histograms of this round and the ones before it that the span still needs.
    span: DelaySpan<SpanReading>,
    stall: QueueStall,
}

/// The cumulative histograms a span is diffed over: queue time, TTFT, inter-token latency.
type SpanReading = (Option<Histogram>, Option<Histogram>, Option<Histogram>);

impl ScrapeRound {
    pub fn aggregate(at: Millis, backends: Vec<BackendScrape>) -> Self {
        let kv: Vec<f64> = backends.iter().filter_map(|b| b.kv_usage).collect();
        let waiting: Vec<f64> = backends.iter().filter_map(|b| b.waiting).collect();
        let sum = |f: fn(&BackendScrape) -> Option<Histogram>| {
            backends.iter().map(f).fold(None, Histogram::add)
        };
        ScrapeRound {
            at,
            pressure: (!kv.is_empty()).then(|| 100.0 * kv.iter().sum::<f64>() / kv.len() as f64),
            queue_depth: (!waiting.is_empty()).then(|| waiting.iter().sum()),
            queue_time: sum(|b| b.queue_time),
            ttft: sum(|b| b.ttft),
            itl: sum(|b| b.itl),
            queue_time_ms: None,
            ttft_ms: None,
            itl_ms: None,
            backends,
            span: DelaySpan::default(),
            stall: QueueStall::default(),
        }
    }

    /// The means since the newest earlier round at least the delay span old
    /// ([`DELAY_SPAN_MS`](super::vllm_text::DELAY_SPAN_MS)). A queue nobody left during the
    /// whole interval while requests wait has a delay of at least the interval, not an unknown
    /// one.
    fn with_delays_since(mut self, prev: Option<&ScrapeRound>) -> Self {
        self.span = prev.map(|p| p.span.clone()).unwrap_or_default();
        self.stall = prev.map(|p| p.stall).unwrap_or_default();
        let waiting = self.queue_depth.unwrap_or(0.0);
        let stalled = self
            .stall
            .observe(self.at as f64, waiting, self.queue_time.map(|h| h.count));
        let Some((at, (queue_time, ttft, itl))) = self
            .span
            .push(self.at as f64, (self.queue_time, self.ttft, self.itl))
        else {
            return self;
        };
        let interval = (self.at as f64 - at).max(0.0);
        self.queue_time_ms = match (self.queue_time, queue_time) {
            (Some(now), Some(then)) => now
                .interval_delay_ms(&then, waiting, interval)
                .map(|d| d.max(stalled)),
            _ => None,
        };
        self.ttft_ms = match (self.ttft, ttft) {
            (Some(now), Some(then)) => now.mean_ms_since(&then),
            _ => None,
        };
        self.itl_ms = match (self.itl, itl) {
            (Some(now), Some(then)) => now.mean_ms_since(&then),
            _ => None,
        };
        self
    }
}

/// How one signal is known right now, for `/status` and the decision record.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SignalReading {
    pub value: Option<f64>,
    pub age_ms: Option<u64>,
    /// `scrape`, `prometheus`, `ledger`, `admin`, or `none`.
    pub source: &'static str,
    /// Why the value is unavailable, when it is.
    pub unavailable: Option<String>,
}

#[derive(Debug, Clone, Copy, Default)]
struct Overrides {
    values: [Option<(f64, Millis)>; 3],
}

/// What Prometheus answered for one signal. The sample may already have been old when it
/// arrived, so its age is `age_at_receipt` plus the time since `received`.
#[derive(Debug, Clone)]
struct Polled {
    received: Millis,
    age_at_receipt: Millis,
    value: Result<f64, String>,
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
    /// The Prometheus poller's latest answer per signal.
    polled: Mutex<[Option<Polled>; 3]>,
}

/// What one sample published: the fleet's policy state and the routing table it was computed
/// for (so a request's route and the domain it is judged on always agree).
#[derive(Debug)]
pub struct Snapshot {
    pub fleet: FleetState,
    pub routes: Arc<Routes>,
}

impl Snapshot {
    /// The two-pool state a request routed by `route` is decided on.
    pub fn domain(&self, domain: usize) -> &PolicyState {
        self.fleet
            .domains
            .get(domain)
            .or_else(|| self.fleet.domains.first())
            .expect("a fleet has at least one domain")
    }
}

pub struct SignalHub {
    clock: Clock,
    stale_after_ms: Millis,
    /// Pool names, by index.
    names: Vec<String>,
    pools: Vec<PoolCell>,
    engine: Mutex<PolicyEngine>,
    state: ArcSwap<Snapshot>,
    /// The routing table the next sample follows (model discovery replaces it).
    routes: ArcSwap<Routes>,
    rules: ArcSwap<PolicyRules>,
    prometheus: ArcSwapOption<PrometheusHealth>,
    /// The `signals.source` the samplers were started with (a reload cannot change it).
    source: OnceLock<&'static str>,
    /// Request outcomes on their way from `logging` to the next tick, by pool index.
    outcomes: (SyncSender<PoolOutcome>, Mutex<Receiver<PoolOutcome>>),
    outcomes_dropped: std::sync::atomic::AtomicU64,
    /// The work this replica has in flight and the requests it has sent and not finished, one
    /// shard per worker ([`crate::worker_shard`]): charged and given back on every
    /// request, one shared counter, lock and map had both cores pull their cache lines back
    /// and forth several times a request. Readers (a tick, `/status`) sum the shards.
    work: Box<[Arc<WorkShard>]>,
    /// The policy has had its first sample (readiness waits for it).
    sampled: std::sync::atomic::AtomicBool,
}

/// Requests in flight by (pool index, decided at, sequence), oldest first within a pool.
#[derive(Debug, Default)]
struct Outstanding {
    requests: std::collections::BTreeMap<(usize, Millis, u64), Running>,
    next: u64,
}

/// What the controller hears of a request in flight: its tier, whether it streams, and when its
/// first token came (ms after its decision), once it has.
#[derive(Debug, Clone, Copy)]
struct Running {
    tier: Tier,
    stream: bool,
    first_token_ms: Option<f64>,
}

/// One worker's share of the work in flight: estimated KV tokens by pool index, and its
/// outstanding requests.
#[derive(Debug)]
struct WorkShard {
    inflight: Box<[std::sync::atomic::AtomicU64]>,
    outstanding: Mutex<Outstanding>,
}

/// Outstanding requests reported per pool and tick, oldest first (a bound on the tick's work).
const OUTSTANDING_REPORTED: usize = 4096;

/// A request's share of its pool's work in flight, given back when it is dropped (the request's
/// context ends however the request does); it also keeps the request in the outstanding
/// registry until then.
#[derive(Debug)]
pub struct WorkCharge {
    shard: Arc<WorkShard>,
    pool: usize,
    tokens: u64,
    key: (usize, Millis, u64),
}

impl WorkCharge {
    /// The request streams: while it runs, its age bounds its first token's time until that
    /// token comes.
    pub fn streaming(&self) {
        self.update(|r| r.stream = true);
    }

    /// Its first token reached the client `ttft_ms` after the request was received.
    pub fn first_token(&self, ttft_ms: f64) {
        self.update(|r| r.first_token_ms = Some(ttft_ms));
    }

    fn update(&self, f: impl FnOnce(&mut Running)) {
        let mut o = self
            .shard
            .outstanding
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if let Some(r) = o.requests.get_mut(&self.key) {
            f(r);
        }
    }
}

impl Drop for WorkCharge {
    fn drop(&mut self) {
        self.shard.inflight[self.pool].fetch_sub(self.tokens, std::sync::atomic::Ordering::Relaxed);
        self.shard
            .outstanding
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .requests
            .remove(&self.key);
    }
}

/// An outcome and the index of the pool whose controller hears it.
type PoolOutcome = (usize, Outcome);

/// Outcomes buffered between two ticks; past it they are dropped (and counted).
const OUTCOME_BUFFER: usize = 16_384;

fn kind_index(kind: SignalKind) -> usize {
    match kind {
        SignalKind::Pressure => 0,
        SignalKind::QueueDepth => 1,
        SignalKind::SlaViolationRate => 2,
    }
}

impl SignalHub {
    /// A hub for the fleet `routes` describes (pool names by index).
    pub fn new(
        clock: Clock,
        stale_after_ms: Millis,
        rules: PolicyRules,
        names: Vec<String>,
        routes: Arc<Routes>,
    ) -> Self {
        let n = names.len();
        let cell = || PoolCell {
            scraped: ArcSwap::from_pointee(None),
            overrides: Mutex::new(Overrides::default()),
            external: Mutex::new([None, None, None]),
            polled: Mutex::new([None, None, None]),
        };
        // The ladders are known from the rules alone: `/status` shows them before the first
        // sample instead of an empty list.
        let initial = Snapshot {
            fleet: initial_state(&rules, &routes.layout),
            routes: Arc::clone(&routes),
        };
        Self {
            clock,
            stale_after_ms,
            names,
            pools: (0..n).map(|_| cell()).collect(),
            rules: ArcSwap::from_pointee(rules.clone()),
            engine: Mutex::new(PolicyEngine::with_layout(rules, routes.layout.clone())),
            state: ArcSwap::from_pointee(initial),
            routes: ArcSwap::new(routes),
            prometheus: ArcSwapOption::empty(),
            source: OnceLock::new(),
            outcomes: {
                let (tx, rx) = sync_channel(OUTCOME_BUFFER);
                (tx, Mutex::new(rx))
            },
            outcomes_dropped: Default::default(),
            work: (0..crate::worker_shard::COUNT)
                .map(|_| {
                    Arc::new(WorkShard {
                        inflight: (0..n).map(|_| Default::default()).collect(),
                        outstanding: Default::default(),
                    })
                })
                .collect(),
            sampled: Default::default(),
        }
    }

    /// A hub over the two-pool fleet (on-demand, spot), for tests and tools.
    pub fn pair(clock: Clock, stale_after_ms: Millis, rules: PolicyRules) -> Self {
        let routes = Routes::pair(rules.spot_is_on_demand);
        let names = vec!["on-demand".to_string(), "spot".to_string()];
        Self::new(clock, stale_after_ms, rules, names, Arc::new(routes))
    }

    /// Pool names, by index.
    pub fn pool_names(&self) -> &[String] {
        &self.names
    }

    pub fn pool_index(&self, name: &str) -> Option<PoolIndex> {
        self.names.iter().position(|n| n == name)
    }

    /// The routing table the next sample follows.
    pub fn set_routes(&self, routes: Arc<Routes>) {
        self.routes.store(routes);
    }

    /// Whether the policy has had a sample: before it, every decision fails open.
    pub fn sampled(&self) -> bool {
        self.sampled.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn clock(&self) -> Clock {
        self.clock
    }

    /// The latest sample; lock-free for the request path.
    pub fn state(&self) -> Arc<Snapshot> {
        self.state.load_full()
    }

    /// The rules in force; lock-free, so the request path never waits on a policy tick.
    pub fn rules(&self) -> Arc<PolicyRules> {
        self.rules.load_full()
    }

    pub fn set_rules(&self, rules: PolicyRules) {
        self.rules.store(Arc::new(rules.clone()));
        self.engine_lock().set_rules(rules);
    }

    fn engine_lock(&self) -> std::sync::MutexGuard<'_, PolicyEngine> {
        self.engine.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn overrides(&self, pool: PoolIndex) -> std::sync::MutexGuard<'_, Overrides> {
        self.pools[pool]
            .overrides
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    pub fn record_scrape(&self, pool: PoolIndex, round: ScrapeRound) {
        let Some(cell) = self.pools.get(pool).map(|p| &p.scraped) else {
            return;
        };
        let round = round.with_delays_since(cell.load().as_ref().as_ref());
        cell.store(Arc::new(Some(round)));
    }

    /// Hands one finished (or refused) request to the adaptive controller of the pool that
    /// served it. Never blocks: a full buffer drops the outcome (the controller only needs a
    /// sample of them), counted in `outcomes_dropped`.
    pub fn record_outcome(&self, pool: usize, outcome: Outcome) {
        if self.outcomes.0.try_send((pool, outcome)).is_err() {
            self.outcomes_dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Counts `tokens` of work in flight on the pool with signal index `pool` until the returned
    /// charge is dropped, and reports the request (of `tier`, decided at `since` on the hub's
    /// clock) as outstanding on that pool at every tick until then.
    pub fn charge_work(
        &self,
        pool: usize,
        tokens: u64,
        tier: Tier,
        since: Millis,
    ) -> Option<WorkCharge> {
        let shard = &self.work[crate::worker_shard::index()];
        shard
            .inflight
            .get(pool)?
            .fetch_add(tokens, std::sync::atomic::Ordering::Relaxed);
        let key = {
            let mut o = shard.outstanding.lock().unwrap_or_else(|e| e.into_inner());
            o.next += 1;
            let key = (pool, since, o.next);
            o.requests.insert(
                key,
                Running {
                    tier,
                    stream: false,
                    first_token_ms: None,
                },
            );
            key
        };
        Some(WorkCharge {
            shard: Arc::clone(shard),
            pool,
            tokens,
            key,
        })
    }

    /// The requests in flight at `now`, oldest first, by pool index: each with its age so far,
    /// as the controller hears them at every tick.
    pub fn outstanding_at(&self, now: Millis) -> Vec<Vec<Outcome>> {
        (0..self.pools.len())
            .map(|pool| {
                // The oldest of each shard, then the oldest of those (by decision time; within one
                // millisecond, shard by shard in the order each charged them).
                let mut oldest: Vec<(Millis, usize, u64, Running)> = Vec::new();
                for (i, shard) in self.work.iter().enumerate() {
                    let o = shard.outstanding.lock().unwrap_or_else(|e| e.into_inner());
                    oldest.extend(
                        o.requests
                            .range((pool, 0, 0)..(pool + 1, 0, 0))
                            .take(OUTSTANDING_REPORTED)
                            .map(|(&(_, since, seq), &r)| (since, i, seq, r)),
                    );
                }
                oldest.sort_unstable_by_key(|&(since, i, seq, _)| (since, i, seq));
                oldest
                    .into_iter()
                    .take(OUTSTANDING_REPORTED)
                    .map(|(since, _, _, r)| {
                        let o = Outcome::pending(now, r.tier, now.saturating_sub(since) as f64);
                        if r.stream {
                            o.streamed(r.first_token_ms, None)
                        } else {
                            o
                        }
                    })
                    .collect()
            })
            .collect()
    }

    /// Work in flight now on pool `i`.
    pub fn inflight_work_on(&self, i: PoolIndex) -> f64 {
        self.work
            .iter()
            .filter_map(|s| s.inflight.get(i))
            .map(|a| a.load(std::sync::atomic::Ordering::Relaxed))
            .sum::<u64>() as f64
    }

    /// Work in flight now, by pool index.
    pub fn inflight_work(&self) -> Vec<f64> {
        (0..self.pools.len())
            .map(|i| self.inflight_work_on(i))
            .collect()
    }

    pub fn outcomes_dropped(&self) -> u64 {
        self.outcomes_dropped
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn last_scrape(&self, pool: PoolIndex) -> Option<ScrapeRound> {
        (*self.pools.get(pool)?.scraped.load_full()).clone()
    }

    pub fn set_override(&self, pool: PoolIndex, kind: SignalKind, value: Option<f64>) {
        let now = self.clock.now_ms();
        self.overrides(pool).values[kind_index(kind)] = value.map(|v| (v, now));
    }

    /// Records a value computed by another background service (e.g. the SLA-violation rate from
    /// the ledger); `Err` says why it is unavailable. It is subject to the same staleness bound.
    pub fn record_external(&self, pool: PoolIndex, kind: SignalKind, value: Result<f64, String>) {
        let at = self.clock.now_ms();
        let mut ext = self.pools[pool]
            .external
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        ext[kind_index(kind)] = Some(External { at, value });
    }

    /// [`record_external`](Self::record_external) on every on-demand pool (a fleet-wide
    /// figure, such as the ledger's SLA-violation rate).
    pub fn record_external_on_demand(&self, kind: SignalKind, value: Result<f64, String>) {
        let layout = self.engine_lock().layout().clone();
        for (i, p) in layout.pools.iter().enumerate() {
            if p.class == Pool::OnDemand {
                self.record_external(i, kind, value.clone());
            }
        }
    }

    fn external(&self, pool: PoolIndex, kind: SignalKind) -> Option<External> {
        let ext = self.pools[pool]
            .external
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        ext[kind_index(kind)].clone()
    }

    /// Records what Prometheus answered for one signal: the value with the age of the sample
    /// itself (so a value Prometheus has held for a while is aged correctly), or why there is
    /// none. Preferred over the direct scrape while fresh.
    pub fn record_polled(
        &self,
        pool: PoolIndex,
        kind: SignalKind,
        value: Result<(f64, Millis), String>,
    ) {
        let (age_at_receipt, value) = match value {
            Ok((v, age)) => (age, Ok(v)),
            Err(e) => (0, Err(e)),
        };
        let entry = Polled {
            received: self.clock.now_ms(),
            age_at_receipt,
            value,
        };
        let mut polled = self.pools[pool]
            .polled
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        polled[kind_index(kind)] = Some(entry);
    }

    fn polled(&self, pool: PoolIndex, kind: SignalKind) -> Option<Polled> {
        let polled = self.pools[pool]
            .polled
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        polled[kind_index(kind)].clone()
    }

    pub fn set_prometheus_health(&self, health: PrometheusHealth) {
        self.prometheus.store(Some(Arc::new(health)));
    }

    /// The Prometheus poller's last round, when it runs.
    pub fn prometheus_health(&self) -> Option<Arc<PrometheusHealth>> {
        self.prometheus.load_full()
    }

    /// Records which `signals.source` runs; the first call wins, as the samplers are started once.
    pub fn set_source(&self, source: &'static str) {
        let _ = self.source.set(source);
    }

    /// The `signals.source` that runs (`scrape` unless set).
    pub fn source(&self) -> &'static str {
        self.source.get().copied().unwrap_or("scrape")
    }

    pub fn stale_after_ms(&self) -> Millis {
        self.stale_after_ms
    }

    /// Precedence: admin override > external (ledger) > Prometheus > direct scrape. A source
    /// that has no fresh value is skipped, and the reading says why each one failed.
    pub fn reading(&self, pool: PoolIndex, kind: SignalKind, now: Millis) -> SignalReading {
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
        let Some(polled) = self.polled(pool, kind) else {
            return self.scraped_reading(pool, kind, now);
        };
        let age = now.saturating_sub(polled.received) + polled.age_at_receipt;
        let why = match polled.value {
            Ok(v) if age <= self.stale_after_ms => {
                return SignalReading {
                    value: Some(v),
                    age_ms: Some(age),
                    source: "prometheus",
                    unavailable: None,
                }
            }
            Ok(_) => format!("prometheus: stale: sample is {age} ms old"),
            Err(e) => format!("prometheus: {e}"),
        };
        if self.pools[pool].scraped.load().is_none() {
            return unavailable(why);
        }
        let scraped = self.scraped_reading(pool, kind, now);
        match scraped.unavailable {
            None => scraped,
            Some(s) => unavailable(format!("{why}; scrape: {s}")),
        }
    }

    fn scraped_reading(&self, pool: PoolIndex, kind: SignalKind, now: Millis) -> SignalReading {
        let unavailable = |why: String| SignalReading {
            value: None,
            age_ms: None,
            source: "none",
            unavailable: Some(why),
        };
        let round = self.pools[pool].scraped.load();
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

    pub fn signals(&self, pool: PoolIndex, now: Millis) -> PoolSignals {
        let round = self.pools[pool].scraped.load();
        let fresh = round
            .as_ref()
            .as_ref()
            .filter(|r| now.saturating_sub(r.at) <= self.stale_after_ms);
        PoolSignals {
            pressure: self.reading(pool, SignalKind::Pressure, now).value,
            queue_depth: self.reading(pool, SignalKind::QueueDepth, now).value,
            sla_violation_rate: self.reading(pool, SignalKind::SlaViolationRate, now).value,
            queue_time_ms: fresh.and_then(|r| r.queue_time_ms),
            ttft_ms: fresh.and_then(|r| r.ttft_ms),
            itl_ms: fresh.and_then(|r| r.itl_ms),
            inflight_work: Some(self.inflight_work_on(pool)),
        }
    }

    /// Advances the policy by one sample, with the outcomes recorded since the last one, and
    /// publishes the new state.
    pub fn tick(&self) -> Arc<Snapshot> {
        let now = self.clock.now_ms();
        let n = self.pools.len();
        let signals: Vec<PoolSignals> = (0..n).map(|i| self.signals(i, now)).collect();
        let mut outcomes: Vec<Vec<Outcome>> = vec![Vec::new(); n];
        {
            let rx = self.outcomes.1.lock().unwrap_or_else(|e| e.into_inner());
            while let Ok((pool, o)) = rx.try_recv() {
                if let Some(v) = outcomes.get_mut(pool) {
                    v.push(o);
                }
            }
        }
        for (v, pending) in outcomes.iter_mut().zip(self.outstanding_at(now)) {
            v.extend(pending);
        }
        let routes = self.routes.load_full();
        let fleet = {
            let mut engine = self.engine_lock();
            if *engine.layout() != routes.layout {
                engine.set_layout(routes.layout.clone());
            }
            let outcomes: Vec<&[Outcome]> = outcomes.iter().map(Vec::as_slice).collect();
            engine.sample_fleet(&signals, &outcomes, now)
        };
        let snapshot = Arc::new(Snapshot { fleet, routes });
        warn_of_unattainable_targets(&self.names, &self.state.load().fleet, &snapshot.fleet);
        self.state.store(Arc::clone(&snapshot));
        self.sampled
            .store(true, std::sync::atomic::Ordering::Relaxed);
        snapshot
    }
}

/// Every pool idle with its ladder, before the first sample.
fn initial_state(rules: &PolicyRules, layout: &Layout) -> FleetState {
    FleetState::initial(layout, |i| {
        let p = &layout.pools[i];
        let relieves = p
            .fallback_relieves
            .unwrap_or_else(|| rules.fallback_relieves(p.class));
        ladder_with(rules, relieves)
    })
}

/// Logs once, when it is first measured, a tier whose target is below its learned unloaded
/// latency on a pool: the controller will not shed anyone for it, and an operator who set
/// the target should hear why.
fn warn_of_unattainable_targets(names: &[String], before: &FleetState, now: &FleetState) {
    for (p, is) in now.pools.iter().enumerate() {
        let is = &is.control;
        let was = before.pools.get(p).map(|w| &w.control);
        for tier in Tier::ALL {
            let i = tier.index();
            if is.unattainable[i] && !was.is_some_and(|w| w.unattainable[i]) {
                log::warn!(
                    "{tier}'s SLA target is below its unloaded latency on the {} pool ({:.0} ms): no shedding can meet it, so it sheds nobody (see /status admission_control)",
                    names.get(p).map_or("?", String::as_str),
                    is.unloaded_ms[i].unwrap_or(0.0)
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_policy::PressureState;

    #[test]
    fn work_in_flight_is_given_back_when_the_request_ends() {
        let hub = SignalHub::pair(Clock::new(), 50, PolicyRules::default());
        let a = hub.charge_work(1, 600, Tier::Standard, 0);
        let b = hub.charge_work(1, 400, Tier::Standard, 0);
        assert!(
            hub.charge_work(2, 1, Tier::Standard, 0).is_none(),
            "no such pool"
        );
        assert_eq!(hub.inflight_work(), [0.0, 1000.0]);
        assert_eq!(hub.signals(1, 0).inflight_work, Some(1000.0));
        drop(a);
        assert_eq!(hub.inflight_work(), [0.0, 400.0]);
        drop(b);
        assert_eq!(hub.inflight_work(), [0.0, 0.0]);
    }

    /// A request counts as outstanding, with its age, from its charge until its context ends,
    /// however it ends: the controller hears a stuck request before it answers.
    #[test]
    fn outstanding_requests_are_reported_with_their_age_until_they_end() {
        let hub = SignalHub::pair(Clock::new(), 50, PolicyRules::default());
        let old = hub.charge_work(0, 100, Tier::Guaranteed, 1_000);
        let young = hub.charge_work(0, 100, Tier::Standard, 2_500);
        let spot = hub.charge_work(1, 100, Tier::BestEffort, 2_000);
        let v = hub.outstanding_at(3_000);
        let (od, sp) = (&v[0], &v[1]);
        assert_eq!(
            *od,
            [
                Outcome::pending(3_000, Tier::Guaranteed, 2_000.0),
                Outcome::pending(3_000, Tier::Standard, 500.0)
            ]
        );
        assert_eq!(*sp, [Outcome::pending(3_000, Tier::BestEffort, 1_000.0)]);
        drop(old);
        drop(spot);
        let v = hub.outstanding_at(3_000);
        let (od, sp) = (&v[0], &v[1]);
        assert_eq!((od.len(), sp.len()), (1, 0));
        drop(young);
        assert!(hub.outstanding_at(3_000).iter().all(Vec::is_empty));
    }

    /// Charged on several workers (each its own shard), the work and the outstanding requests
    /// are still one replica's: summed, and reported oldest first across the workers.
    #[test]
    fn work_charged_on_several_workers_is_summed_and_ordered_by_age() {
        let hub = Arc::new(SignalHub::pair(Clock::new(), 50, PolicyRules::default()));
        let charges: Vec<WorkCharge> = [
            (2_000, Tier::Standard),
            (1_000, Tier::Guaranteed),
            (1_500, Tier::BestEffort),
        ]
        .into_iter()
        .map(|(since, tier)| {
            let hub = Arc::clone(&hub);
            std::thread::spawn(move || hub.charge_work(0, 100, tier, since).unwrap())
                .join()
                .unwrap()
        })
        .collect();
        assert_eq!(hub.inflight_work(), [300.0, 0.0]);
        let v = hub.outstanding_at(3_000);
        let od = &v[0];
        assert_eq!(
            *od,
            [
                Outcome::pending(3_000, Tier::Guaranteed, 2_000.0),
                Outcome::pending(3_000, Tier::BestEffort, 1_500.0),
                Outcome::pending(3_000, Tier::Standard, 1_000.0),
            ]
        );
        drop(charges);
        assert_eq!(hub.inflight_work(), [0.0, 0.0]);
        assert!(hub.outstanding_at(3_000).iter().all(Vec::is_empty));
    }

    #[test]
    fn the_queue_delay_is_read_over_the_span_not_the_last_interval() {
        let hub = SignalHub::pair(Clock::new(), 10_000, PolicyRules::default());
        let round = |at: Millis, sum: f64, count: f64| {
            let backends = vec![BackendScrape {
                backend: "a".into(),
                kv_usage: Some(0.5),
                waiting: Some(0.0),
                queue_time: Some(Histogram { sum, count }),
                ttft: None,
                itl: None,
                prefix_cache: None,
                error: None,
            }];
            hub.record_scrape(0, ScrapeRound::aggregate(at, backends));
            hub.signals(0, at).queue_time_ms
        };
        assert_eq!(round(0, 0.0, 0.0), None, "nothing to diff against yet");
        assert_eq!(round(250, 1.0, 1.0), Some(1000.0));
        assert_eq!(round(500, 2.0, 2.0), Some(1000.0));
        // Scrapes 250 ms apart: the last interval alone (one leaver after 200 ms) would say
        // 200 ms; over the 500 ms since the scrape at 250 two left, after 1 s and 200 ms.
        let d = round(750, 2.2, 3.0).unwrap();
        assert!((d - 600.0).abs() < 1e-6, "{d}");
    }

    /// The pool's pace: the inter-token gaps of all its backends over at least the span, the
    /// mean of what was decoded in it (Δsum / Δcount), none when nothing was, none when stale.
    #[test]
    fn the_pace_is_the_pools_mean_gap_over_the_span() {
        let hub = SignalHub::pair(Clock::new(), 1_000, PolicyRules::default());
        let round = |at: Millis, a: (f64, f64), b: (f64, f64)| {
            let backend = |name: &str, (sum, count): (f64, f64)| BackendScrape {
                backend: name.into(),
                kv_usage: Some(0.5),
                waiting: Some(0.0),
                queue_time: None,
                ttft: None,
                itl: Some(Histogram { sum, count }),
                prefix_cache: None,
                error: None,
            };
            let backends = vec![backend("a", a), backend("b", b)];
            hub.record_scrape(0, ScrapeRound::aggregate(at, backends));
            hub.signals(0, at).itl_ms
        };
        assert_eq!(round(0, (1.0, 100.0), (0.0, 0.0)), None, "nothing to diff");
        // 40 gaps of 20 ms on a, 10 of 70 ms on b: (0.8 + 0.7) s over 50 gaps.
        let v = round(250, (1.8, 140.0), (0.7, 10.0)).unwrap();
        assert!((v - 30.0).abs() < 1e-9, "{v}");
        // 250 ms later: still diffed against the scrape at 0, the span's start.
        let v = round(500, (1.8, 140.0), (1.6, 20.0)).unwrap();
        assert!((v - 40.0).abs() < 1e-9, "{v}");
        // Over the span since 250: b's 10 gaps of 90 ms alone.
        let v = round(750, (1.8, 140.0), (1.6, 20.0)).unwrap();
        assert!((v - 90.0).abs() < 1e-9, "{v}");
        // Since 500: no token decoded after a first one.
        assert_eq!(round(1_000, (1.8, 140.0), (1.6, 20.0)), None);
        let v = round(1_250, (2.0, 150.0), (1.6, 20.0));
        assert!((v.unwrap() - 20.0).abs() < 1e-9, "{v:?}");
        assert_eq!(hub.signals(0, 1_250 + 1_001).itl_ms, None, "stale");
    }

    #[test]
    fn overrides_win_and_stale_samples_are_unavailable() {
        let hub = SignalHub::pair(Clock::new(), 50, PolicyRules::default());
        let backends = vec![BackendScrape {
            backend: "a".into(),
            kv_usage: Some(0.4),
            waiting: Some(2.0),
            queue_time: None,
            ttft: None,
            itl: None,
            prefix_cache: None,
            error: None,
        }];
        hub.record_scrape(0, ScrapeRound::aggregate(hub.clock().now_ms(), backends));
        let now = hub.clock().now_ms();
        let r = hub.reading(0, SignalKind::Pressure, now);
        assert_eq!((r.value, r.source), (Some(40.0), "scrape"));
        hub.set_override(0, SignalKind::Pressure, Some(65.0));
        assert_eq!(hub.signals(0, now).pressure, Some(65.0));
        hub.set_override(0, SignalKind::Pressure, None);
        let later = now + 100;
        let r = hub.reading(0, SignalKind::QueueDepth, later);
        assert_eq!(r.value, None);
        assert!(r.unavailable.unwrap().starts_with("stale"));
    }

    #[test]
    fn prometheus_wins_while_fresh_and_the_scrape_stands_in() {
        let hub = SignalHub::pair(Clock::new(), 1000, PolicyRules::default());
        let pool = 0;
        let kv = |v| {
            vec![BackendScrape {
                backend: "a".into(),
                kv_usage: Some(v),
                waiting: None,
                queue_time: None,
                ttft: None,
                itl: None,
                prefix_cache: None,
                error: None,
            }]
        };
        hub.record_scrape(pool, ScrapeRound::aggregate(hub.clock().now_ms(), kv(0.4)));
        hub.record_polled(pool, SignalKind::Pressure, Ok((75.0, 10)));
        let now = hub.clock().now_ms();
        let r = hub.reading(pool, SignalKind::Pressure, now);
        assert_eq!((r.value, r.source), (Some(75.0), "prometheus"));
        assert!(r.age_ms.unwrap() >= 10, "the sample's own age counts");

        hub.record_polled(pool, SignalKind::Pressure, Err("unreachable".into()));
        let r = hub.reading(pool, SignalKind::Pressure, now);
        assert_eq!((r.value, r.source), (Some(40.0), "scrape"));

        hub.record_polled(pool, SignalKind::Pressure, Ok((75.0, 5000)));
        let r = hub.reading(pool, SignalKind::Pressure, now);
        assert_eq!(
            (r.value, r.source),
            (Some(40.0), "scrape"),
            "stale is skipped"
        );

        // From the clock after the sample's receipt: `now` was read before it, and a millisecond
        // tick in between made the age 6999.
        let later = hub.clock().now_ms() + 2000;
        let why = hub
            .reading(pool, SignalKind::Pressure, later)
            .unavailable
            .unwrap();
        assert!(
            why.starts_with("prometheus: stale: sample is 7") && why.contains("; scrape: stale"),
            "{why}"
        );

        hub.set_override(pool, SignalKind::Pressure, Some(10.0));
        let r = hub.reading(pool, SignalKind::Pressure, later);
        assert_eq!((r.value, r.source), (Some(10.0), "admin"));

        // Prometheus alone (no scrape ever): only its reason.
        let spot = 1;
        hub.record_polled(spot, SignalKind::QueueDepth, Err("value is NaN".into()));
        let r = hub.reading(spot, SignalKind::QueueDepth, later);
        assert_eq!(r.unavailable.as_deref(), Some("prometheus: value is NaN"));
    }

    #[test]
    fn ticks_drive_the_engine() {
        let rules = PolicyRules {
            mode: sluice_policy::PolicyMode::Thresholds,
            ..PolicyRules::default()
        };
        let hub = SignalHub::pair(Clock::new(), 60_000, rules);
        hub.set_override(0, SignalKind::Pressure, Some(65.0));
        hub.tick();
        let s = hub.tick();
        assert_eq!(
            s.domain(0).tier(sluice_policy::Tier::BestEffort).state,
            PressureState::Critical
        );
        assert_eq!(
            s.domain(0).tier(sluice_policy::Tier::Guaranteed).state,
            PressureState::Normal
        );
    }
}
