//! `/status`, `/decisions/recent` and the state-mirroring gauges of `/metrics`.

use crate::query::query_param;
use crate::state::OpsState;
mod gauges;
mod view;

pub use gauges::refresh_gauges;
pub use view::Status;

use serde::Serialize;
use serde_json::json;
use sluice_policy::tenant_policy::PolicyRules;
use sluice_policy::{PolicyMode, SignalKind, Tier};
use sluice_record::decision::RecentFilter;
use sluice_runtime::signals::hub::Snapshot;
use view::{
    AdmissionControl, DimControl, Fallback, Moved, PoolAdmission, PoolSignals, StepView, Telemetry,
    ThresholdsNotInForce, ThresholdsView, TierControl, TierMode, TierStatus,
};

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
    let healthy = ops
        .pools
        .all()
        .filter(|h| h.class == sluice_config::PoolClass::OnDemand)
        .map(|h| ops.pools.healthy_count(h))
        .sum();
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

pub fn status(app: &OpsState) -> Status {
    let now = app.hub.clock().now_ms();
    let snap = app.hub.state();
    // Tier states and spot eviction as the first domain (the first on-demand and spot pools)
    // sees them: what a two-pool fleet always showed.
    let state = snap.domain(0);
    let rules = app.hub.rules();
    let signals = app
        .pools
        .all()
        .map(|h| (h.index, h.label))
        .map(|(pool, name)| {
            let readings = SIGNALS
                .into_iter()
                .map(|kind| (kind.as_str(), app.hub.reading(pool, kind, now)))
                .collect();
            let scraped_backends = app.hub.last_scrape(pool).map(|round| round.backends);
            let signals = PoolSignals {
                readings,
                scraped_backends,
            };
            (name, signals)
        })
        .collect();
    let tiers = Tier::ALL
        .iter()
        .map(|&t| {
            let s = state.tier(t);
            let a = app.admission.status(t);
            let r = rules.tier(t);
            let thresholds = ThresholdsView::from(&r.thresholds);
            TierStatus {
                tier: t.as_str(),
                state: s.state.as_str(),
                capacity: r.inflight_capacity,
                inflight: a.inflight,
                idle_credits: a.idle_credits,
                queued: a.queued,
                waiting_tenants: app.admission.waiting_tenants(t, 20),
                sla_target_ms: r.slo.e2e_ms,
                slo: sluice_policy::slo::Dim::ALL
                    .into_iter()
                    .filter_map(|d| Some((d.target_key(), r.slo.get(d)?)))
                    .collect(),
                max_tokens_cap: r.max_tokens_cap,
                brownout_max_tokens: r.brownout_max_tokens,
                pool: r.preferred_pool.as_str(),
                mode: match rules.mode {
                    PolicyMode::Thresholds => TierMode::Thresholds {
                        driver: s.driver.as_str(),
                        fail_open: s.fail_open,
                        thresholds,
                    },
                    PolicyMode::Adaptive => TierMode::Adaptive {
                        thresholds_mode: ThresholdsNotInForce {
                            in_force: false,
                            thresholds,
                        },
                    },
                },
            }
        })
        .collect();
    let fallback = active_fallback(app, &snap);
    Status {
        replica: app.replica.to_string(),
        uptime_seconds: app.started.elapsed().as_secs(),
        coordinator: app.admission.kind(),
        policy_mode: rules.mode.as_str(),
        policy_sampled_ms_ago: now.saturating_sub(snap.fleet.at),
        admission_control: admission_control(app, &snap, &rules),
        routes: routes(app, &snap),
        signals,
        tiers,
        spot_state: state.spot_state.as_str(),
        spot_eviction: ThresholdsView::from(&rules.spot_eviction),
        fallback: Fallback {
            active: state.fallback_active && fallback.is_some(),
            sustained_pressure: state.fallback_active,
            target: fallback.as_ref().map(|(_, pool)| pool.to_string()),
            model: fallback.map(|(model, _)| model),
        },
        pools: app.pools.all().map(|h| app.pools.status(h)).collect(),
        admission: app.admission.health(),
        quotas: app.quotas.status(),
        ledger: app.sinks.iter().map(|s| s.status()).collect(),
        telemetry: Telemetry {
            source: app.hub.source(),
            prometheus: app
                .hub
                .prometheus_health()
                .map(|h| h.view(now, app.hub.stale_after_ms())),
            tracing: app.tracer.status(),
        },
        dependencies: dependencies(app, now).into_iter().collect(),
    }
}

fn admission_control(app: &OpsState, snap: &Snapshot, rules: &PolicyRules) -> AdmissionControl {
    let pools = app
        .pools
        .all()
        .filter_map(|h| Some((h.label, &snap.fleet.pools.get(h.index)?.control)))
        .map(|(pool, c)| {
            let steps = c
                .steps
                .iter()
                .enumerate()
                .map(|(i, s)| StepView {
                    tier: s.tier.as_str(),
                    action: s.kind.as_str(),
                    applies_to: (c.level - i as f64).clamp(0.0, 1.0),
                })
                .collect();
            let tiers = Tier::ALL
                .into_iter()
                .map(|t| {
                    let sh = c.shares(t);
                    let i = t.index();
                    let control = TierControl {
                        headroom: c.headroom[i],
                        unloaded_latency_ms: c.unloaded_ms[i],
                        target_unattainable: c.unattainable[i],
                        latency_p_ms: c.latency_ms[i],
                        lead_p_ms: c.lead_ms[i],
                        sla_target_ms: rules.tier(t).slo.e2e_ms,
                        slo: rules
                            .tier(t)
                            .slo
                            .dims()
                            .map(|d| {
                                let r = &c.dims[i][d.index()];
                                let view = DimControl {
                                    target_ms: r.target_ms,
                                    headroom: r.headroom,
                                    observed_p_ms: r.observed_ms,
                                    unloaded_ms: r.unloaded_ms,
                                    target_unattainable: r.unattainable,
                                    missed: r.missed,
                                };
                                (d.as_str(), view)
                            })
                            .collect(),
                        capped: sh.cap,
                        fallback: sh.fallback,
                        shed: sh.shed,
                    };
                    (t.as_str(), control)
                })
                .collect();
            let view = PoolAdmission {
                level: c.level,
                max_level: c.steps.len(),
                steps,
                tiers,
                vllm_queue_delay_ms: c.delay_ms,
                moved: Moved::from(c.moved),
                saturated: c.saturated,
                shaping: c.shaping,
                filling: c.filling,
                idle: c.idle,
                busy: c.busy,
                work_limit_tokens: c.work_limit,
                inflight_work_tokens: c.inflight_work,
            };
            (pool, view)
        })
        .collect();
    AdmissionControl {
        enabled: rules.mode == PolicyMode::Adaptive,
        shared_capacity: rules.spot_is_on_demand,
        pools,
    }
}

/// Each configured external dependency and whether it is healthy right now. The in-process
/// coordinator and the in-memory ring are not dependencies, so they are not listed.
fn dependencies(app: &OpsState, now: u64) -> Vec<(&'static str, bool)> {
    let mut deps = Vec::new();
    let sinks: Vec<bool> = app.sinks.iter().filter_map(|s| s.healthy()).collect();
    if !sinks.is_empty() {
        deps.push(("ledger", sinks.iter().all(|&up| up)));
    }
    let coordinator = app.admission.health();
    if coordinator.shared.is_some() {
        deps.push(("coordinator", coordinator.healthy));
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
pub async fn recent(app: &OpsState, query: &str) -> serde_json::Value {
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

/// The first fallback model a pool with a usable backend serves, and that pool's name.
pub(super) fn active_fallback(app: &OpsState, snap: &Snapshot) -> Option<(String, &'static str)> {
    let cfg = app.config.load();
    cfg.fallbacks.iter().find_map(|f| {
        let r = snap.routes.route(Some(&f.model))?;
        let pool = [Some(r.primary), r.spot]
            .into_iter()
            .flatten()
            .filter_map(|p| app.pools.get(p))
            .find(|h| app.pools.any_usable_for(h, &snap.routes, Some(&f.model)))?;
        Some((f.model.clone(), pool.label))
    })
}

/// Which pools serve which model, as requests are routed now.
fn routes(app: &OpsState, snap: &Snapshot) -> view::Routes {
    let name = |i: usize| app.pools.get(i).map_or("?", |h| h.label);
    let models = snap
        .routes
        .models()
        .filter_map(|m| {
            let r = snap.routes.route(Some(m))?;
            Some(view::ModelRoute {
                model: m.to_string(),
                pool: name(r.primary),
                spot_pool: r.spot.map(name),
            })
        })
        .collect();
    view::Routes {
        generation: snap.routes.generation,
        complete: snap.routes.complete(),
        models,
    }
}
