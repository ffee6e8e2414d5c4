//! What each backend carries right now, as replica choice and `/status` read it: the requests
//! Sluice has in flight there (exact, it sent them) and what the last scrape of its `/metrics`
//! said (KV usage, vLLM's waiting queue).

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Scraped figures older than this are ignored (a backend that stopped answering its
/// `/metrics` is judged by Sluice's own count alone).
const SCRAPE_STALE: Duration = Duration::from_secs(5);
const UNKNOWN: u32 = u32::MAX;

/// Milliseconds since the first call, on a monotonic clock.
pub(crate) fn since_start() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// How fast a backend's latency estimate forgets: a backend avoided for being slow is tried again
/// once its estimate has decayed (Finagle's and Linkerd's peak-EWMA use the same scale).
const EWMA_DECAY_MS: f64 = 10_000.0;

#[derive(Debug)]
pub struct BackendLoad {
    inflight: AtomicU32,
    picks: AtomicU64,
    /// Peak-EWMA of time to first byte, in microseconds as f64 bits (0: never observed).
    ttfb_ewma_us: AtomicU64,
    ttfb_at: AtomicU64,
    /// KV-cache usage in thousandths, or `UNKNOWN`.
    kv_milli: AtomicU32,
    /// vLLM's waiting requests, or `UNKNOWN`.
    waiting: AtomicU32,
    scraped_at: AtomicU64,
    /// vLLM's prefix-cache counters: the last reading, and what they grew by lately.
    prefix: Mutex<PrefixWindow>,
}

/// Prompt tokens served from a prefix cache, and those asked.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PrefixCache {
    pub hits: f64,
    pub queries: f64,
}

impl PrefixCache {
    pub fn rate(&self) -> Option<f64> {
        (self.queries > 0.0).then(|| (self.hits / self.queries).clamp(0.0, 1.0))
    }
}

impl std::ops::Add for PrefixCache {
    type Output = PrefixCache;

    fn add(self, o: PrefixCache) -> PrefixCache {
        PrefixCache {
            hits: self.hits + o.hits,
            queries: self.queries + o.queries,
        }
    }
}

/// How fast the prefix-cache growth forgets: half as much after this. Long enough to average a
/// few dozen scrapes, short enough to show a cache that started thrashing within a minute.
const PREFIX_HALF_LIFE_MS: f64 = 15_000.0;

#[derive(Debug, Default)]
struct PrefixWindow {
    last: Option<PrefixCache>,
    /// The counters' growth, decayed to `at`.
    grown: PrefixCache,
    at: u64,
}

impl PrefixWindow {
    fn decayed(&self, now: u64) -> PrefixCache {
        let k = 0.5f64.powf(now.saturating_sub(self.at) as f64 / PREFIX_HALF_LIFE_MS);
        PrefixCache {
            hits: self.grown.hits * k,
            queries: self.grown.queries * k,
        }
    }

    fn record(&mut self, now: u64, reading: PrefixCache) {
        let grown = self.decayed(now);
        // Counters that went back belong to a restarted replica: its growth starts again.
        let delta = match self.last {
            Some(l) if reading.hits >= l.hits && reading.queries >= l.queries => PrefixCache {
                hits: reading.hits - l.hits,
                queries: reading.queries - l.queries,
            },
            _ => PrefixCache::default(),
        };
        self.grown = grown + delta;
        self.at = now;
        self.last = Some(reading);
    }
}

impl Default for BackendLoad {
    fn default() -> Self {
        BackendLoad {
            inflight: AtomicU32::new(0),
            picks: AtomicU64::new(0),
            ttfb_ewma_us: AtomicU64::new(0),
            ttfb_at: AtomicU64::new(0),
            kv_milli: AtomicU32::new(UNKNOWN),
            waiting: AtomicU32::new(UNKNOWN),
            scraped_at: AtomicU64::new(0),
            prefix: Mutex::default(),
        }
    }
}

/// One request on a backend: counted in its in-flight work until dropped (however the request
/// ends); its first byte feeds the backend's latency estimate.
#[derive(Debug)]
pub struct Lease {
    load: Arc<BackendLoad>,
    sent: Instant,
    answered: bool,
}

impl Lease {
    /// The backend's first byte of the answer arrived: once per request.
    pub fn first_byte(&mut self) {
        if !std::mem::replace(&mut self.answered, true) {
            self.load.observe_ttfb(self.sent.elapsed());
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.load.inflight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl BackendLoad {
    pub fn lease(self: &Arc<Self>) -> Lease {
        self.inflight.fetch_add(1, Ordering::Relaxed);
        self.picks.fetch_add(1, Ordering::Relaxed);
        Lease {
            load: Arc::clone(self),
            sent: Instant::now(),
            answered: false,
        }
    }

    /// Peak-EWMA: a slower answer than the estimate is taken at once, a faster one blends in
    /// by the time since the last; racing updates may lose one sample, which an estimate bears.
    pub(crate) fn observe_ttfb(&self, took: Duration) {
        let now = since_start();
        let rtt = took.as_secs_f64() * 1e6;
        let prev = f64::from_bits(self.ttfb_ewma_us.load(Ordering::Relaxed));
        let next = if prev == 0.0 || rtt > prev {
            rtt
        } else {
            let elapsed = now.saturating_sub(self.ttfb_at.load(Ordering::Relaxed)) as f64;
            let w = (-elapsed / EWMA_DECAY_MS).exp();
            prev * w + rtt * (1.0 - w)
        };
        self.ttfb_ewma_us
            .store(next.max(1.0).to_bits(), Ordering::Relaxed);
        self.ttfb_at.store(now, Ordering::Relaxed);
    }

    /// The time-to-first-byte estimate in ms, decayed by the time since it was last fed: a
    /// backend left alone for being slow looks cheaper again and is retried.
    pub fn ttfb_ms(&self) -> Option<f64> {
        let v = f64::from_bits(self.ttfb_ewma_us.load(Ordering::Relaxed));
        if v == 0.0 {
            return None;
        }
        let idle = since_start().saturating_sub(self.ttfb_at.load(Ordering::Relaxed)) as f64;
        Some(v / 1000.0 * (-idle / EWMA_DECAY_MS).exp())
    }

    pub fn inflight(&self) -> u32 {
        self.inflight.load(Ordering::Relaxed)
    }

    pub fn picks(&self) -> u64 {
        self.picks.load(Ordering::Relaxed)
    }

    pub fn set_scraped(&self, kv_usage: Option<f64>, waiting: Option<f64>) {
        let kv = kv_usage.map_or(UNKNOWN, |k| (k.clamp(0.0, 1.0) * 1000.0).round() as u32);
        let waiting = waiting.map_or(UNKNOWN, |w| w.clamp(0.0, 1e6) as u32);
        self.kv_milli.store(kv, Ordering::Relaxed);
        self.waiting.store(waiting, Ordering::Relaxed);
        // Zero means never: a scrape in the process's first millisecond is stamped 1.
        self.scraped_at
            .store(since_start().max(1), Ordering::Relaxed);
    }

    /// A scrape's prefix-cache counters (cumulative tokens hit and asked).
    pub fn set_prefix_counters(&self, reading: PrefixCache) {
        let mut w = self.prefix.lock().unwrap_or_else(|e| e.into_inner());
        w.record(since_start(), reading);
    }

    /// What the prefix cache served lately (decayed growth of its counters); nothing once the
    /// scrapes stopped answering.
    pub fn prefix_cache(&self) -> PrefixCache {
        if !self.fresh() {
            return PrefixCache::default();
        }
        let w = self.prefix.lock().unwrap_or_else(|e| e.into_inner());
        w.decayed(since_start())
    }

    fn fresh(&self) -> bool {
        let at = self.scraped_at.load(Ordering::Relaxed);
        at > 0 && since_start().saturating_sub(at) <= SCRAPE_STALE.as_millis() as u64
    }

    /// KV usage (0–1) from a fresh scrape.
    pub fn kv_usage(&self) -> Option<f64> {
        let v = self.kv_milli.load(Ordering::Relaxed);
        (v != UNKNOWN && self.fresh()).then(|| f64::from(v) / 1000.0)
    }

    /// vLLM's waiting requests from a fresh scrape.
    pub fn waiting(&self) -> Option<u32> {
        let v = self.waiting.load(Ordering::Relaxed);
        (v != UNKNOWN && self.fresh()).then_some(v)
    }

    /// Least-load order: Sluice's requests there plus those vLLM says wait there, KV usage
    /// (0–1) breaking ties between equal counts.
    pub fn score(&self) -> f64 {
        f64::from(self.inflight())
            + f64::from(self.waiting().unwrap_or(0))
            + self.kv_usage().unwrap_or(0.0)
    }

    /// The expected wait of one more request (peak-EWMA cost): the work ahead of it ([`score`],
    /// plus itself) times how long this backend takes to start answering. `default_ttfb_ms`
    /// stands in for a backend not yet measured.
    ///
    /// [`score`]: BackendLoad::score
    pub fn cost(&self, default_ttfb_ms: f64) -> f64 {
        (self.score() + 1.0) * self.ttfb_ms().unwrap_or(default_ttfb_ms).max(0.001)
    }
}

/// Every backend's load, by the name the balancer gives it (`ip:port`) and by the address as
/// configured (which a scrape reaches, and which may name several).
#[derive(Debug, Default)]
pub struct BackendLoads {
    by_name: HashMap<String, Arc<BackendLoad>>,
    by_config: HashMap<String, Vec<Arc<BackendLoad>>>,
}

impl BackendLoads {
    /// The load of backend `name`, resolved from configured address `configured`; one load per
    /// name however many pools list it.
    pub fn register(&mut self, configured: &str, name: &str) -> Arc<BackendLoad> {
        let load = Arc::clone(self.by_name.entry(name.to_string()).or_default());
        let entry = self.by_config.entry(configured.to_string()).or_default();
        if !entry.iter().any(|l| Arc::ptr_eq(l, &load)) {
            entry.push(Arc::clone(&load));
        }
        load
    }

    pub fn get(&self, name: &str) -> Option<&Arc<BackendLoad>> {
        self.by_name.get(name)
    }

    /// A scrape of the configured address `configured`.
    pub fn record_scrape(&self, configured: &str, kv_usage: Option<f64>, waiting: Option<f64>) {
        for l in self.by_config.get(configured).into_iter().flatten() {
            l.set_scraped(kv_usage, waiting);
        }
    }

    /// The prefix-cache counters of a scrape of `configured`.
    pub fn record_prefix_counters(&self, configured: &str, reading: PrefixCache) {
        for l in self.by_config.get(configured).into_iter().flatten() {
            l.set_prefix_counters(reading);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(hits: f64, queries: f64) -> PrefixCache {
        PrefixCache { hits, queries }
    }

    #[test]
    fn the_prefix_cache_rate_is_the_counters_recent_growth() {
        let mut w = PrefixWindow::default();
        // Since start the replica hit half; what it does now is what counts.
        w.record(0, counters(5_000.0, 10_000.0));
        assert_eq!(w.decayed(0).rate(), None, "one reading: no growth yet");
        w.record(1_000, counters(5_100.0, 11_000.0));
        assert_eq!(w.decayed(1_000).rate(), Some(0.1));
        // Older growth weighs half after the half-life.
        w.record(16_000, counters(6_100.0, 12_000.0));
        let r = w.decayed(16_000).rate().unwrap();
        assert!((r - 1050.0 / 1500.0).abs() < 1e-9, "{r}");
        // A restarted replica's counters start again from zero: no negative growth, and the
        // next reading grows from the restart's.
        let before = w.decayed(17_000);
        w.record(17_000, counters(10.0, 20.0));
        assert_eq!(w.decayed(17_000), before);
        w.record(17_000, counters(10.0, 520.0));
        assert_eq!(w.decayed(17_000).queries, before.queries + 500.0);
    }
}
