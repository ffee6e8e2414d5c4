//! `/status`, `/decisions/recent` and the state-mirroring gauges of `/metrics`.

use crate::query::query_param;
use crate::state::OpsState;
use serde::Serialize;
use serde_json::{json, Value};
use sluice_policy::adaptive::{Movement, RailKind};
use sluice_policy::pressure::{Threshold, Thresholds};
use sluice_policy::tenant_policy::PolicyRules;
use sluice_policy::{PolicyMode, PolicyState, Pool, SignalKind, Tier};
use sluice_record::decision::RecentFilter;
use sluice_runtime::signals::hub::SignalPool;

/// `/readyz`: ready once a backend of the on-demand pool has passed its health check and the
/// policy has sampled the signals (before that every decision would fail open), until the
/// process drains.
#[derive(Debug, Serialize)]
pub struct Readiness {
    pub ready: bool,
    pub draining: bool,
    pub signals_sampled: bool,
    pub on_demand_healthy_backends: usize,
    pub coordinator: &'static str,
}

pub fn readiness(ops: &OpsState) -> Readiness {
    let healthy = ops.pools.healthy_count(&ops.pools.on_demand);
    let draining = ops.lifecycle.draining();
    let sampled = ops.hub.sampled();
    Readiness {
        ready: healthy > 0 && !draining && sampled,
        draining,
        signals_sampled: sampled,
        on_demand_healthy_backends: healthy,
        coordinator: ops.admission.kind(),
    }
}

const SIGNALS: [SignalKind; 3] = [
    SignalKind::Pressure,
    SignalKind::QueueDepth,
    SignalKind::SlaViolationRate,
];
const POOLS: [(SignalPool, &str); 2] = [
    (SignalPool::OnDemand, "on-demand"),
    (SignalPool::Spot, "spot"),
];

pub fn status(app: &OpsState) -> Value {
    let now = app.hub.clock().now_ms();
    let state = app.hub.state();
    let rules = app.hub.rules();
    let mut signals = serde_json::Map::new();
    for (pool, name) in POOLS {
        let mut m = serde_json::Map::new();
        for kind in SIGNALS {
            m.insert(
                kind.as_str().into(),
                json!(app.hub.reading(pool, kind, now)),
            );
        }
        if let Some(round) = app.hub.last_scrape(pool) {
            m.insert("scraped_backends".into(), json!(round.backends));
        }
        signals.insert(name.into(), Value::Object(m));
    }
    let tiers: Vec<Value> = Tier::ALL
        .iter()
        .map(|&t| {
            let s = state.tier(t);
            let a = app.admission.status(t);
            let r = rules.tier(t);
            let mut tier = json!({
                "tier": t.as_str(),
                "state": s.state.as_str(),
                "capacity": r.inflight_capacity,
                "inflight": a.inflight,
                "idle_credits": a.idle_credits,
                "queued": a.queued,
                // Least served first: the head of this list is served next.
                "waiting_tenants": app.admission.waiting_tenants(t, 20),
                "sla_target_ms": r.sla_target_ms,
                "max_tokens_cap": r.max_tokens_cap,
                "brownout_max_tokens": r.brownout_max_tokens,
                "pool": r.preferred_pool.as_str(),
            });
            let extra = match rules.mode {
                PolicyMode::Thresholds => json!({
                    "driver": s.driver.as_str(),
                    "fail_open": s.fail_open,
                    "thresholds": thresholds(&r.thresholds),
                }),
                // The state is the admission level's (what it does to the tier); the thresholds
                // decide nothing here, and their stability model's driver names no cause.
                PolicyMode::Adaptive => json!({
                    "thresholds_mode": {"in_force": false, "thresholds": thresholds(&r.thresholds)},
                }),
            };
            if let (Some(tier), Value::Object(extra)) = (tier.as_object_mut(), extra) {
                tier.extend(extra);
            }
            tier
        })
        .collect();
    let pools: Vec<Value> = app
        .pools
        .all()
        .map(|h| json!(app.pools.status(h)))
        .collect();
    let fallback = app.pools.active_fallback();
    json!({
        "replica": app.replica,
        "uptime_seconds": app.started.elapsed().as_secs(),
        "coordinator": app.admission.kind(),
        "policy_mode": rules.mode.as_str(),
        "policy_sampled_ms_ago": now.saturating_sub(state.at),
        "admission_control": admission_control(&state, &rules),
        "signals": signals,
        "tiers": tiers,
        "spot_state": state.spot_state.as_str(),
        "spot_eviction": thresholds(&rules.spot_eviction),
        "fallback": {
            "active": fallback_routing(app, &state),
            "sustained_pressure": state.fallback_active,
            "target": fallback.map(|h| h.name.clone()),
            "model": fallback.and_then(|h| h.model.clone()),
        },
        "pools": pools,
        "admission": app.admission.health(),
        "quotas": app.quotas.status(),
        "ledger": app.sinks.iter().map(|s| s.status()).collect::<Vec<_>>(),
        "telemetry": telemetry(app, now),
        "dependencies": dependencies(app, now)
            .into_iter()
            .map(|(name, up)| (name.to_string(), json!(up)))
            .collect::<serde_json::Map<_, _>>(),
    })
}

/// Adaptive mode, per pool: the level, what each step does and how much of it applies, each
/// tier's headroom and latency, and why the level last moved.
fn admission_control(state: &PolicyState, rules: &PolicyRules) -> Value {
    let pools: serde_json::Map<String, Value> = [Pool::OnDemand, Pool::Spot]
        .into_iter()
        .zip(&state.pools)
        .map(|(pool, c)| {
            let steps: Vec<Value> = c
                .steps
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    json!({"tier": s.tier.as_str(), "action": s.kind.as_str(),
                           "applies_to": (c.level - i as f64).clamp(0.0, 1.0)})
                })
                .collect();
            let tiers: serde_json::Map<String, Value> = Tier::ALL
                .into_iter()
                .map(|t| {
                    let sh = c.shares(t);
                    let v = json!({
                        "headroom": c.headroom[t.index()],
                        "unloaded_latency_ms": c.unloaded_ms[t.index()],
                        "target_unattainable": c.unattainable[t.index()],
                        "latency_p_ms": c.latency_ms[t.index()],
                        "lead_p_ms": c.lead_ms[t.index()],
                        "sla_target_ms": rules.tier(t).sla_target_ms,
                        "capped": sh.cap, "fallback": sh.fallback, "shed": sh.shed,
                    });
                    (t.as_str().to_string(), v)
                })
                .collect();
            let moved = match c.moved {
                Movement::Hold => json!({"direction": "hold"}),
                Movement::Down => json!({"direction": "down",
                    "why": "every protected tier has headroom above relax_above"}),
                Movement::Calm => json!({"direction": "down",
                    "why": "vLLM queues nothing and the cache is below shape_pressure_at"}),
                Movement::Idle => json!({"direction": "down",
                    "why": "idle: nothing queued and KV-cache usage below idle_pressure_below for idle_release_ms"}),
                Movement::Up { tier, headroom } => json!({"direction": "up",
                    "why": format!("{} headroom {headroom:.2} below escalate_below", tier.as_str()),
                    "tier": tier.as_str(), "headroom": headroom}),
                Movement::Rail(kind) => json!({"direction": "rail", "why": match kind {
                    RailKind::Pressure => "KV-cache usage at rail_pressure_at",
                    RailKind::QueueDepth => "vLLM waiting queue at rail_queue_depth_at",
                }}),
                Movement::Shape => json!({"direction": "up",
                    "why": "KV-cache usage at shape_pressure_at: every cap and brownout in force"}),
            };
            let v = json!({
                "level": c.level,
                "max_level": c.steps.len(),
                "steps": steps,
                "tiers": tiers,
                "vllm_queue_delay_ms": c.delay_ms,
                "moved": moved,
                "saturated": c.saturated,
                "shaping": c.shaping,
                "idle": c.idle,
                "work_limit_tokens": c.work_limit,
                "inflight_work_tokens": c.inflight_work,
            });
            (pool.as_str().to_string(), v)
        })
        .collect();
    json!({
        "enabled": rules.mode == PolicyMode::Adaptive,
        "shared_capacity": rules.spot_is_on_demand,
        "pools": pools,
    })
}

fn thresholds(t: &Thresholds) -> Value {
    let one = |t: Threshold| json!({"elevated_at": t.elevated_at, "critical_at": t.critical_at});
    json!({
        "pressure": one(t.pressure),
        "queue_depth": one(t.queue_depth),
        "sla_violation_rate": one(t.sla_violation_rate),
    })
}

/// Which source feeds the signals, and the Prometheus poller's last round when it runs.
fn telemetry(app: &OpsState, now: u64) -> Value {
    json!({
        "source": app.hub.source(),
        "prometheus": app
            .hub
            .prometheus_health()
            .map(|h| h.to_json(now, app.hub.stale_after_ms())),
    })
}

/// Each configured external dependency and whether it is healthy right now. The in-process
/// coordinator and the in-memory ring are not dependencies, so they are not listed.
fn dependencies(app: &OpsState, now: u64) -> Vec<(&'static str, bool)> {
    let mut deps = Vec::new();
    // A sink reports health under one of these keys; the first present one counts.
    let healthy = |v: &Value| {
        ["healthy", "connected", "reachable", "up"]
            .iter()
            .find_map(|k| v.get(*k).and_then(Value::as_bool))
    };
    if !app.sinks.is_empty() {
        let statuses: Vec<Option<bool>> = app.sinks.iter().map(|s| healthy(&s.status())).collect();
        if statuses.iter().any(Option::is_some) {
            let up = statuses.iter().all(|s| s.unwrap_or(true));
            deps.push(("ledger", up));
        }
    }
    if app.admission.kind() != "local" {
        if let Some(up) = healthy(&app.admission.health()) {
            deps.push(("coordinator", up));
        }
    }
    if let Some(h) = app.hub.prometheus_health() {
        deps.push(("prometheus", h.up(now, app.hub.stale_after_ms())));
    }
    deps
}

const MAX_RECENT: usize = 1000;

pub fn recent_filter(query: &str) -> RecentFilter {
    RecentFilter {
        limit: query_param(query, "limit")
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(50)
            .min(MAX_RECENT),
        tenant: query_param(query, "tenant").map(str::to_string),
        tier: query_param(query, "tier")
            .and_then(Tier::parse)
            .map(|t| t.as_str().to_string()),
        decision: query_param(query, "decision").map(str::to_string),
        since_ms: query_param(query, "since").and_then(|v| v.parse().ok()),
    }
}

/// From durable storage when configured and reachable, else from this replica's ring.
pub async fn recent(app: &OpsState, query: &str) -> Value {
    let filter = recent_filter(query);
    if let Some(q) = &app.query {
        match q.recent(&filter).await {
            Ok(items) => return json!({"source": "ledger", "decisions": items}),
            Err(e) => log::warn!("{}", json!({"event": "ledger_query_failed", "error": e})),
        }
    }
    let items = app.decisions.recent(&filter);
    let items: Vec<&sluice_record::decision::DecisionRecord> =
        items.iter().map(|r| r.as_ref()).collect();
    json!({"source": "memory", "decisions": items})
}

/// Routing to the fallback needs both the sustained pressure and a usable target; the tracker
/// alone says nothing when no fallback is configured or it is down.
fn fallback_routing(app: &OpsState, state: &PolicyState) -> bool {
    state.fallback_active && app.pools.active_fallback().is_some()
}

pub fn refresh_gauges(app: &OpsState) {
    let m = &app.metrics;
    let health = app.admission.health();
    for (event, key) in [
        ("fail_open", "fail_open_total"),
        ("reclaimed_lease", "reclaimed_leases_total"),
        ("lost_lease", "lost_leases_total"),
    ] {
        // The coordinator owns the totals; the counter catches up to them (never goes back).
        let total = health.get(key).and_then(Value::as_u64).unwrap_or(0);
        let counter = m.coordinator_events.with_label_values(&[event]);
        counter.inc_by(total.saturating_sub(counter.get()));
    }
    let dropped = sluice_runtime::log_writer::stderr_dropped();
    m.log_dropped
        .inc_by(dropped.saturating_sub(m.log_dropped.get()));
    let now = app.hub.clock().now_ms();
    let state = app.hub.state();
    let rules = app.hub.rules();
    for (pool, name) in POOLS {
        for kind in SIGNALS {
            let r = app.hub.reading(pool, kind, now);
            m.signal_available
                .with_label_values(&[name, kind.as_str()])
                .set(i64::from(r.value.is_some()));
            match r.value {
                Some(v) => {
                    m.signal_value
                        .with_label_values(&[name, kind.as_str()])
                        .set(v);
                    m.signal_age
                        .with_label_values(&[name, kind.as_str()])
                        .set(r.age_ms.unwrap_or(0) as f64 / 1000.0);
                }
                None => {
                    // Absent, not zero: an unavailable signal must not read as "no pressure".
                    let _ = m.signal_value.remove_label_values(&[name, kind.as_str()]);
                    let _ = m.signal_age.remove_label_values(&[name, kind.as_str()]);
                }
            }
        }
    }
    for t in Tier::ALL {
        let a = app.admission.status(t);
        m.tier_state
            .with_label_values(&[t.as_str()])
            .set(state.tier(t).state.level());
        m.inflight
            .with_label_values(&[t.as_str()])
            .set(a.inflight as i64);
        m.idle_credits
            .with_label_values(&[t.as_str()])
            .set(a.idle_credits as i64);
        m.queued
            .with_label_values(&[t.as_str()])
            .set(a.queued as i64);
        m.capacity
            .with_label_values(&[t.as_str()])
            .set(i64::from(rules.tier(t).inflight_capacity));
    }
    m.fallback_active
        .set(i64::from(fallback_routing(app, &state)));
    m.spot_state.set(state.spot_state.level());
    for (pool, c) in [Pool::OnDemand, Pool::Spot].into_iter().zip(&state.pools) {
        m.admission_level
            .with_label_values(&[pool.as_str()])
            .set(c.level);
        for t in Tier::ALL {
            let labels = [pool.as_str(), t.as_str()];
            match c.headroom[t.index()] {
                Some(h) => m.tier_headroom.with_label_values(&labels).set(h),
                None => {
                    let _ = m.tier_headroom.remove_label_values(&labels);
                }
            }
            match c.unloaded_ms[t.index()] {
                Some(ms) => m
                    .tier_unloaded_latency
                    .with_label_values(&labels)
                    .set(ms / 1000.0),
                None => {
                    let _ = m.tier_unloaded_latency.remove_label_values(&labels);
                }
            }
            m.tier_target_unattainable
                .with_label_values(&labels)
                .set(f64::from(u8::from(c.unattainable[t.index()])));
        }
    }
    for t in Tier::ALL {
        let r = rules.tier(t);
        m.sla_target
            .with_label_values(&[t.as_str()])
            .set(r.sla_target_ms as f64 / 1000.0);
        let th = &r.thresholds;
        for (signal, threshold) in [
            (SignalKind::Pressure, th.pressure),
            (SignalKind::QueueDepth, th.queue_depth),
            (SignalKind::SlaViolationRate, th.sla_violation_rate),
        ] {
            for (level, at) in [
                ("elevated", threshold.elevated_at),
                ("critical", threshold.critical_at),
            ] {
                let labels = [t.as_str(), signal.as_str(), level];
                // Adaptive mode decides without them: not shown as if in force.
                let at = at.filter(|_| rules.mode == PolicyMode::Thresholds);
                match at {
                    Some(v) => m.tier_threshold.with_label_values(&labels).set(v),
                    // Hot reload can disable a step or change the mode: drop its series rather
                    // than leave it stale.
                    None => {
                        let _ = m.tier_threshold.remove_label_values(&labels);
                    }
                }
            }
        }
    }
    for (dep, up) in dependencies(app, now) {
        m.dependency_up.with_label_values(&[dep]).set(i64::from(up));
    }
    for h in app.pools.all() {
        for b in app.pools.status(h).backends {
            m.backend_healthy
                .with_label_values(&[&h.name, &b.backend])
                .set(i64::from(b.healthy));
        }
    }
}
