//! Exported metrics (one prometheus registry, served on `/metrics`). Request-path metrics are
//! updated in the `logging` phase; gauges that mirror state (signals, tier states, in-flight,
//! backend health) are refreshed when `/metrics` is rendered, so no background job keeps them.
//! Label cardinality is bounded: tier, decision, reason, pool, backend, signal and dependency are
//! all finite sets. There is deliberately no tenant label (tenants are unbounded); per-tenant
//! questions are answered from the decision records (`/decisions/recent`, the ledger).

mod sharded;

use prometheus::{
    Encoder, GaugeVec, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// From 5 ms to 120 s: LLM latencies span a cached short answer to a long generation.
const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
];
/// Microsecond buckets for Sluice's own added time.
const OVERHEAD_BUCKETS: &[f64] = &[
    0.000_010, 0.000_025, 0.000_050, 0.000_100, 0.000_250, 0.000_500, 0.001, 0.0025, 0.005, 0.010,
    0.025, 0.1,
];
/// The OpenTelemetry GenAI conventions' boundaries for `gen_ai.server.time_to_first_token`.
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
/// ... and for `gen_ai.server.time_per_output_token`.
const TPOT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
];
const QUEUE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0,
];

pub struct Metrics {
    registry: Registry,
    /// Tenants that have their own label value (bounded by `metrics.max_tenants`).
    tenants: std::sync::Mutex<std::collections::HashSet<String>>,
    /// Tells this registry's children apart in the per-thread caches ([`request_path`]).
    id: usize,
    /// Written by every request: one copy per worker shard (see [`sharded`]).
    decisions: Sharded<IntCounterVec>,
    request_duration: Sharded<HistogramVec>,
    ttfb: Sharded<HistogramVec>,
    overhead: Sharded<HistogramVec>,
    pub queue_wait: HistogramVec,
    /// Streamed answers' time to first token and time per output token, by tier and pool.
    pub ttft: HistogramVec,
    pub tpot: HistogramVec,
    /// Requests that missed a dimension of their objective, by tier and dimension.
    pub slo_violations: IntCounterVec,
    pub tier_slo_headroom: GaugeVec,
    pub tier_slo_target: GaugeVec,
    pub upstream_errors: IntCounterVec,
    pub signal_value: GaugeVec,
    pub signal_age: GaugeVec,
    pub tier_state: IntGaugeVec,
    pub fallback_active: IntGauge,
    pub inflight: IntGaugeVec,
    pub idle_credits: IntGaugeVec,
    pub queued: IntGaugeVec,
    pub capacity: IntGaugeVec,
    pub backend_healthy: IntGaugeVec,
    pub backend_inflight: IntGaugeVec,
    pub backend_share: GaugeVec,
    /// Retries of requests that failed before their first byte, by the pool they failed in and
    /// cause; failures not retried, by why; ejections of replicas, by cause; and which replicas
    /// are ejected now. Mirrored from the pools' own counts when `/metrics` is rendered.
    pub upstream_retries: IntCounterVec,
    pub upstream_retries_denied: IntCounterVec,
    pub backend_ejections: IntCounterVec,
    pub backend_ejected: IntGaugeVec,
    /// Coordinator events counted by the coordinator itself (fail-open admissions, reclaimed and
    /// lost leases), mirrored here when `/metrics` is rendered.
    pub coordinator_events: IntCounterVec,
    sla: Sharded<IntCounterVec>,
    pub tenant_requests: IntCounterVec,
    pub tenant_tokens: IntCounterVec,
    pub signal_available: IntGaugeVec,
    pub spot_state: IntGauge,
    pub tier_threshold: GaugeVec,
    pub admission_level: GaugeVec,
    pub tier_headroom: GaugeVec,
    pub tier_unloaded_latency: GaugeVec,
    pub tier_target_unattainable: GaugeVec,
    pub sla_target: GaugeVec,
    pub dependency_up: IntGaugeVec,
    pub log_dropped: IntCounter,
    /// Open client connections per listener (the connection guard's count).
    pub client_connections: IntGaugeVec,
    /// Requests and connections the connection guard answered itself, by listener and code
    /// (`too_many_connections`, `request_header_too_large`, `ambiguous_framing`, ...).
    pub edge_refusals: IntCounterVec,
    /// Connections closed because the client was too slow or idle (`header_read`, `body_lookahead`).
    pub edge_timeouts: IntCounterVec,
    /// Requests of tenants over their budget served one tier lower, by own tier and tier used.
    pub quota_demotions: IntCounterVec,
    /// Spans of sampled requests by what became of them (`exported`, `dropped`, `failed`),
    /// mirrored from the trace exporter's own counts when `/metrics` is rendered.
    pub trace_spans: IntCounterVec,
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let hist_vec = |name: &str, help: &str, buckets: &[f64], labels: &[&str]| {
            HistogramVec::new(
                HistogramOpts::new(name, help).buckets(buckets.to_vec()),
                labels,
            )
            .expect("static histogram definition")
        };
        // Names are static: a second registration of one is a programming error, found at start.
        fn reg<C: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: C) -> C {
            registry
                .register(Box::new(c.clone()))
                .expect("unique metric name");
            c
        }
        let hist = |name: &str, help: &str, buckets: &[f64], labels: &[&str]| {
            reg(&registry, hist_vec(name, help, buckets, labels))
        };
        let sharded_hist = |name: &str, help: &str, buckets: &[f64], labels: &[&str]| {
            reg(
                &registry,
                Sharded::new(|| hist_vec(name, help, buckets, labels)),
            )
        };
        let counter_vec = |name: &str, help: &str, labels: &[&str]| {
            IntCounterVec::new(Opts::new(name, help), labels).expect("static counter definition")
        };
        let sharded_counter = |name: &str, help: &str, labels: &[&str]| {
            reg(&registry, Sharded::new(|| counter_vec(name, help, labels)))
        };
        let counter = |name: &str, help: &str, labels: &[&str]| {
            reg(&registry, counter_vec(name, help, labels))
        };
        let igauge = |name: &str, help: &str, labels: &[&str]| {
            let g =
                IntGaugeVec::new(Opts::new(name, help), labels).expect("static gauge definition");
            reg(&registry, g)
        };
        let gauge = |name: &str, help: &str, labels: &[&str]| {
            let g = GaugeVec::new(Opts::new(name, help), labels).expect("static gauge definition");
            reg(&registry, g)
        };
        let single = |name: &str, help: &str| {
            reg(
                &registry,
                IntGauge::new(name, help).expect("static gauge definition"),
            )
        };
        let single_counter = |name: &str, help: &str| {
            reg(
                &registry,
                IntCounter::new(name, help).expect("static counter definition"),
            )
        };
        let metrics = Metrics {
            decisions: sharded_counter("sluice_decisions_total", "Decisions by tier, decision and reason.", &["tier", "decision", "reason"]),
            request_duration: sharded_hist("sluice_request_duration_seconds", "End-to-end request latency seen by Sluice, to the last byte.", LATENCY_BUCKETS, &["tier", "decision"]),
            ttfb: sharded_hist("sluice_time_to_first_byte_seconds", "Time from request arrival to the first response body byte.", LATENCY_BUCKETS, &["tier", "decision"]),
            overhead: sharded_hist("sluice_proxy_overhead_seconds", "Time Sluice adds before the request is sent upstream (queue wait excluded).", OVERHEAD_BUCKETS, &["tier"]),
            queue_wait: hist("sluice_queue_wait_seconds", "Time spent in a tier's queue.", QUEUE_BUCKETS, &["tier", "outcome"]),
            ttft: hist("sluice_ttft_seconds", "Streamed answers' time to first token: from Sluice receiving the request (its queue included) to the first token byte sent to the client.", TTFT_BUCKETS, &["tier", "pool"]),
            tpot: hist("sluice_tpot_seconds", "Streamed answers' time per output token after the first: (last token - first token) / (completion tokens - 1).", TPOT_BUCKETS, &["tier", "pool"]),
            slo_violations: counter("sluice_slo_violations_total", "Served requests that missed a dimension of their objective (ttft, tpot, e2e), by tier and dimension; a request missing two counts in both.", &["tier", "dimension"]),
            tier_slo_headroom: gauge("sluice_tier_slo_headroom", "Adaptive mode: the share of each dimension's budget (target less the tier's unloaded value) still unspent, per pool, tier and dimension; absent without evidence.", &["pool", "tier", "dimension"]),
            tier_slo_target: gauge("sluice_tier_slo_target_seconds", "Configured target per tier and dimension (ttft, tpot, e2e); absent when the tier sets none.", &["tier", "dimension"]),
            upstream_errors: counter("sluice_upstream_errors_total", "Upstream failures by pool and kind.", &["pool", "kind"]),
            signal_value: gauge("sluice_signal_value", "Current signal value per pool (pressure %, queue depth, SLA-violation rate); absent when unavailable.", &["pool", "signal"]),
            signal_age: gauge("sluice_signal_age_seconds", "Age of the signal value in use.", &["pool", "signal"]),
            tier_state: igauge("sluice_tier_state", "Pressure state per tier: 0 Normal, 1 Elevated, 2 Critical.", &["tier"]),
            fallback_active: single("sluice_fallback_active", "1 while sustained pressure routes eligible tiers to the fallback model."),
            inflight: igauge("sluice_inflight_requests", "Admitted requests in flight per tier (cluster-wide with Redis; capacity credits not in use are not requests: see sluice_idle_credits).", &["tier"]),
            idle_credits: igauge("sluice_idle_credits", "Slots leased as capacity credits that no request uses yet, per tier (Redis coordinator, cluster-wide): they count against the capacity.", &["tier"]),
            queued: igauge("sluice_queued_requests", "Requests waiting in a tier's queue.", &["tier"]),
            capacity: igauge("sluice_tier_capacity", "Configured in-flight capacity per tier (0 = unlimited).", &["tier"]),
            backend_healthy: igauge("sluice_backend_healthy", "1 when the backend is usable (passed a health check and is healthy).", &["pool", "backend"]),
            backend_inflight: igauge("sluice_backend_inflight", "Requests Sluice has in flight on the backend now (what least-load and the prefix affinity's load bound count).", &["pool", "backend"]),
            backend_share: gauge("sluice_backend_share", "The backend's share of its pool's requests since start (0-1).", &["pool", "backend"]),
            upstream_retries: counter("sluice_upstream_retries_total", "Requests sent again to another replica after failing before their first byte, by the pool they failed in and cause (connect, reset, 5xx).", &["pool", "cause"]),
            upstream_retries_denied: counter("sluice_upstream_retries_denied_total", "Failures before the first byte that were not sent again, by pool and why: budget (routing.retry_budget spent), limit (the pool's retries used up), no_replica (none left untried).", &["pool", "reason"]),
            backend_ejections: counter("sluice_backend_ejections_total", "Replicas taken out of selection for failing in a row (pools.<name>.ejection), by pool and the last failure's cause.", &["pool", "cause"]),
            backend_ejected: igauge("sluice_backend_ejected", "1 while the backend is ejected from its pool for failing.", &["pool", "backend"]),
            coordinator_events: counter("sluice_coordinator_events_total", "Admission coordinator events: fail_open (admitted while Redis was unreachable), reclaimed_lease (a dead replica's slot returned), lost_lease (a live replica's lease expired).", &["event"]),
            signal_available: igauge("sluice_signal_available", "1 when the pool's signal has a fresh value, 0 when unavailable (value absent).", &["pool", "signal"]),
            spot_state: single("sluice_spot_state", "Spot pool's own pressure against the eviction thresholds: 0 Normal, 2 Critical (Best-Effort evicted to on-demand)."),
            tier_threshold: gauge("sluice_tier_threshold", "Thresholds mode: configured threshold per tier, signal and level (elevated, critical); absent when the step is disabled or adaptive mode decides.", &["tier", "signal", "level"]),
            admission_level: gauge("sluice_admission_level", "Adaptive mode: the pool's admission level, in ladder steps (0 admits everything; see /status admission_control for the steps).", &["pool"]),
            tier_headroom: gauge("sluice_tier_headroom", "Adaptive mode: the share of the tier's queueing budget (SLA target less its unloaded latency) still unspent by its latency quantile and vLLM's queue delay, per pool and tier; absent without evidence.", &["pool", "tier"]),
            tier_unloaded_latency: gauge("sluice_tier_unloaded_latency_seconds", "Adaptive mode: the tier's learned unloaded latency (its latency quantile with no vLLM queue), per pool; absent until learned.", &["pool", "tier"]),
            tier_target_unattainable: gauge("sluice_tier_target_unattainable", "Adaptive mode: 1 while the tier's SLA target is below its unloaded latency on the pool (no shedding can meet it, so it sheds nobody).", &["pool", "tier"]),
            sla_target: gauge("sluice_tier_sla_target_seconds", "Configured SLA latency target per tier.", &["tier"]),
            dependency_up: igauge("sluice_dependency_up", "1 when a configured dependency (ledger, coordinator, prometheus) is healthy, 0 when not.", &["dependency"]),
            sla: sharded_counter("sluice_sla_requests_total", "Completed proxied requests by tier and whether they met their tier's SLA target.", &["tier", "outcome"]),
            tenant_tokens: counter("sluice_tenant_tokens_total", "Tokens served by tenant, prompt plus completion from the response's usage (only with metrics.tenant_label; tenants past metrics.max_tenants are counted as other): each tenant's share of its tier.", &["tenant", "tier"]),
            tenant_requests: counter("sluice_tenant_requests_total", "Requests by tenant (only with metrics.tenant_label; tenants past metrics.max_tenants are counted as other).", &["tenant", "tier", "decision"]),
            log_dropped: single_counter("sluice_log_lines_dropped_total", "Log records (request lines included) dropped because the log reader fell behind; decisions are still recorded in the ring and the ledger."),
            client_connections: igauge("sluice_client_connections", "Open client connections per listener.", &["listener"]),
            edge_refusals: counter("sluice_edge_refusals_total", "Connections and requests refused by the connection guard before Pingora parsed them, by listener and error code (too_many_connections is the per-listener connection limit).", &["listener", "code"]),
            edge_timeouts: counter("sluice_edge_timeouts_total", "Client connections closed by the connection guard for slowness: header_read (limits.header_read_timeout_ms), body_lookahead (limits.body_read_timeout_ms while checking a small body's framing).", &["listener", "phase"]),
            quota_demotions: counter("sluice_quota_demotions_total", "Requests of tenants over their budget (tenants.<name>.quota) served as the next lower tier, by the tenant's tier and the tier used.", &["tier", "served_as"]),
            trace_spans: counter("sluice_trace_spans_total", "Spans of sampled requests (telemetry.tracing) by outcome: exported (accepted by the collector), dropped (the export queue was full), failed (lost with a batch the collector refused or did not answer in time). Requests never wait for export.", &["outcome"]),
            tenants: Default::default(),
            id: request_path::next_id(),
            registry,
        };
        // Zero series for the finite upstream-error label set, so `rate()` and dashboards see
        // 0 rather than no data until the first failure.
        for pool in ["on-demand", "spot", "fallback"] {
            for kind in ["upstream_error", "upstream_timeout"] {
                metrics.upstream_errors.with_label_values(&[pool, kind]);
            }
        }
        for tier in sluice_policy::Tier::ALL {
            for d in sluice_policy::slo::Dim::ALL {
                metrics
                    .slo_violations
                    .with_label_values(&[tier.as_str(), d.as_str()]);
            }
        }
        metrics
    }

    /// The tenant's label value: its name while fewer than `max` tenants have one, else `other`.
    pub fn tenant_label(&self, tenant: &str, max: usize) -> String {
        let mut seen = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(tenant) || (seen.len() < max && seen.insert(tenant.to_string())) {
            tenant.to_string()
        } else {
            "other".to_string()
        }
    }

    pub fn render(&self) -> Vec<u8> {
        let mut out = Vec::new();
        // Encoding into a Vec cannot fail for well-formed families.
        let _ = TextEncoder::new().encode(&self.registry.gather(), &mut out);
        out
    }
}

/// Raises the counter `labels` of `vec`, which mirrors a count kept elsewhere, to `total` (a
/// counter never goes back).
pub fn catch_up(vec: &IntCounterVec, labels: &[&str], total: u64) {
    let c = vec.with_label_values(labels);
    c.inc_by(total.saturating_sub(c.get()));
}

/// What one request's outcome adds to the request-path metrics.
#[derive(Clone, Copy, Debug, Default)]
pub struct RequestObservations {
    /// Seconds to the last byte, time to the first body byte, and Sluice's own added time:
    /// proxied requests only.
    pub duration: Option<f64>,
    pub ttfb: Option<f64>,
    pub overhead: Option<f64>,
    /// Whether it missed its objective, when judged.
    pub sla_violated: Option<bool>,
}

/// What a served request showed of its objective's dimensions.
pub struct SloObservations<'a> {
    pub tier: &'a str,
    pub pool: &'a str,
    /// Seconds, streamed answers only.
    pub ttft: Option<f64>,
    pub tpot: Option<f64>,
    pub missed: [bool; 3],
}

impl Metrics {
    pub fn record_slo(&self, o: SloObservations) {
        if let Some(v) = o.ttft {
            self.ttft.with_label_values(&[o.tier, o.pool]).observe(v);
        }
        if let Some(v) = o.tpot {
            self.tpot.with_label_values(&[o.tier, o.pool]).observe(v);
        }
        for d in sluice_policy::slo::Dim::ALL {
            if o.missed[d.index()] {
                self.slo_violations
                    .with_label_values(&[o.tier, d.as_str()])
                    .inc();
            }
        }
    }
}

/// The metrics `logging` updates on every request, by label values that are static strings
/// (tier, decision, reason, outcome). `with_label_values` hashes each value byte by byte, takes
/// the vector's lock and clones the child's `Arc`: ~190 instructions and four atomic
/// read-modify-writes on cache lines both workers' cores share, five times a request. Here each
/// thread keeps the children of its own shard for each (tier, decision, reason), found in one
/// lookup keyed by the label values' addresses (a static string keeps its address), so a request
/// only updates the children themselves. A child is resolved on its first use, so the exposition
/// has exactly the series requests have touched. Nothing removes a child of these vectors (a
/// removed one would live on in the caches, updated unseen).
impl Metrics {
    pub fn record_request(
        &self,
        tier: &'static str,
        decision: &'static str,
        reason: &'static str,
        o: RequestObservations,
    ) {
        let key = (
            self.id,
            [tier, decision, reason].map(|l| (l.as_ptr() as usize, l.len())),
        );
        request_path::CHILDREN.with(|cache| {
            let mut cache = cache.borrow_mut();
            let c = cache.entry(key).or_default();
            c.decision
                .get_or_insert_with(|| {
                    self.decisions
                        .mine()
                        .with_label_values(&[tier, decision, reason])
                })
                .inc();
            observe(
                &mut c.duration,
                &self.request_duration,
                o.duration,
                &[tier, decision],
            );
            observe(&mut c.ttfb, &self.ttfb, o.ttfb, &[tier, decision]);
            observe(&mut c.overhead, &self.overhead, o.overhead, &[tier]);
            if let Some(violated) = o.sla_violated {
                let outcome = if violated { "violated" } else { "met" };
                c.sla[usize::from(violated)]
                    .get_or_insert_with(|| self.sla.mine().with_label_values(&[tier, outcome]))
                    .inc();
            }
        });
    }
}

fn observe(
    child: &mut Option<Histogram>,
    vec: &Sharded<HistogramVec>,
    value: Option<f64>,
    labels: &[&str],
) {
    if let Some(v) = value {
        child
            .get_or_insert_with(|| vec.mine().with_label_values(labels))
            .observe(v);
    }
}

use prometheus::Histogram;
use sharded::Sharded;

mod request_path {
    use prometheus::{Histogram, IntCounter};
    use std::cell::RefCell;
    use std::collections::HashMap;
    use std::hash::{BuildHasherDefault, Hasher};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Registry id, and the (address, length) of the tier, decision and reason.
    type Key = (usize, [(usize, usize); 3]);

    /// One (tier, decision, reason)'s children in this thread's shard.
    #[derive(Default)]
    pub struct Children {
        pub decision: Option<IntCounter>,
        pub duration: Option<Histogram>,
        pub ttfb: Option<Histogram>,
        pub overhead: Option<Histogram>,
        /// Met, violated.
        pub sla: [Option<IntCounter>; 2],
    }

    thread_local! {
        pub static CHILDREN: RefCell<HashMap<Key, Children, BuildHasherDefault<Fx>>> =
            RefCell::default();
    }

    static NEXT_ID: AtomicUsize = AtomicUsize::new(0);

    pub fn next_id() -> usize {
        NEXT_ID.fetch_add(1, Ordering::Relaxed)
    }

    /// Multiply-rotate hashing of a few words (rustc's FxHash): the keys are addresses, not
    /// attacker-chosen, so SipHash's flooding resistance buys nothing here.
    #[derive(Default)]
    pub struct Fx(u64);

    impl Hasher for Fx {
        fn write(&mut self, bytes: &[u8]) {
            for &b in bytes {
                self.write_u64(u64::from(b));
            }
        }

        fn write_u8(&mut self, n: u8) {
            self.write_u64(u64::from(n));
        }

        fn write_usize(&mut self, n: usize) {
            self.write_u64(n as u64);
        }

        fn write_u64(&mut self, n: u64) {
            self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }

        fn finish(&self) -> u64 {
            self.0
        }
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

#[cfg(test)]
mod tests {
    use super::{Metrics, RequestObservations};

    fn count(m: &Metrics, tier: &'static str, decision: &'static str, reason: &'static str) {
        m.record_request(tier, decision, reason, RequestObservations::default());
    }

    /// `/metrics` as a scraper reads it: the lines of `name` (with labels), in order.
    fn lines(m: &Metrics, name: &str) -> Vec<String> {
        String::from_utf8(m.render())
            .unwrap()
            .lines()
            .filter(|l| l.starts_with(name))
            .map(str::to_string)
            .collect()
    }

    /// The cached children are the registry's own, and two registries on one thread (a reload
    /// in tests, two apps in one process) never share one.
    #[test]
    fn cached_updates_reach_their_own_registry() {
        let (a, b) = (Metrics::new(), Metrics::new());
        for _ in 0..2 {
            count(&a, "Standard", "pass", "");
        }
        count(&b, "Standard", "pass", "");
        let served = RequestObservations {
            duration: Some(0.2),
            overhead: Some(0.0001),
            sla_violated: Some(false),
            ..Default::default()
        };
        a.record_request("Standard", "pass", "", served);
        let pass = r#"sluice_decisions_total{decision="pass",reason="",tier="Standard"}"#;
        assert_eq!(lines(&a, pass), [format!("{pass} 3")]);
        assert_eq!(lines(&b, pass), [format!("{pass} 1")]);
        assert_eq!(
            lines(&a, "sluice_sla_requests_total"),
            [r#"sluice_sla_requests_total{outcome="met",tier="Standard"} 1"#]
        );
        let duration = lines(&a, "sluice_request_duration_seconds_");
        assert!(duration.contains(
            &r#"sluice_request_duration_seconds_sum{decision="pass",tier="Standard"} 0.2"#.into()
        ));
        assert!(duration.contains(
            &r#"sluice_request_duration_seconds_count{decision="pass",tier="Standard"} 1"#.into()
        ));
        assert!(lines(&a, "sluice_proxy_overhead_seconds_count")
            .contains(&r#"sluice_proxy_overhead_seconds_count{tier="Standard"} 1"#.into()));
        // Only what requests observed has a series: no TTFB was seen, nothing was violated.
        assert!(lines(&b, "sluice_request_duration_seconds_count").is_empty());
        assert!(lines(&a, "sluice_time_to_first_byte_seconds_count").is_empty());
    }

    /// Each worker writes its own shard; a scrape sums the shards into one series per label
    /// set, counts, sums and every bucket alike.
    #[test]
    fn workers_shards_are_summed_at_scrape() {
        let m = Metrics::new();
        std::thread::scope(|s| {
            // Powers of two: their sum is exact whatever order the shards are added in.
            for secs in [0.00390625, 0.03125, 0.25, 4.0] {
                let m = &m;
                s.spawn(move || {
                    count(m, "Best-Effort", "reject", "capacity");
                    let ttfb = RequestObservations {
                        ttfb: Some(secs),
                        ..Default::default()
                    };
                    m.record_request("Guaranteed", "pass", "", ttfb);
                });
            }
        });
        count(&m, "Guaranteed", "pass", "");
        assert_eq!(
            lines(&m, "sluice_decisions_total"),
            [
                r#"sluice_decisions_total{decision="pass",reason="",tier="Guaranteed"} 5"#,
                r#"sluice_decisions_total{decision="reject",reason="capacity",tier="Best-Effort"} 4"#,
            ]
        );
        let ttfb = lines(&m, "sluice_time_to_first_byte_seconds_");
        let series = |s: &str| format!(r#"sluice_time_to_first_byte_seconds_{s}"#);
        for (le, n) in [
            ("0.005", 1),
            ("0.05", 2),
            ("0.25", 3),
            ("2", 3),
            ("5", 4),
            ("+Inf", 4),
        ] {
            let bucket = series(&format!(
                r#"bucket{{decision="pass",tier="Guaranteed",le="{le}"}} {n}"#
            ));
            assert!(ttfb.contains(&bucket), "{bucket} not in {ttfb:#?}");
        }
        assert!(ttfb.contains(&series(
            r#"sum{decision="pass",tier="Guaranteed"} 4.28515625"#
        )));
        assert!(ttfb.contains(&series(r#"count{decision="pass",tier="Guaranteed"} 4"#)));
    }
}
