//! The state-mirroring gauges of `/metrics`, refreshed before each scrape.

use super::{active_fallback, dependencies, SIGNALS};
use crate::state::OpsState;
use sluice_policy::slo::Dim;
use sluice_policy::{PolicyMode, SignalKind, Tier};
use sluice_runtime::metrics::catch_up;
use sluice_runtime::pools::{FailureCause, RetryDenied};
use std::sync::atomic::Ordering::Relaxed;

pub fn refresh_gauges(app: &OpsState) {
    let m = &app.metrics;
    let health = app.admission.health();
    for (event, total) in [
        ("fail_open", health.fail_open_total()),
        ("reclaimed_lease", health.reclaimed_leases_total()),
        ("lost_lease", health.lost_leases_total()),
    ] {
        // The coordinator owns the totals; the counter catches up to them (never goes back).
        let counter = m.coordinator_events.with_label_values(&[event]);
        counter.inc_by(total.saturating_sub(counter.get()));
    }
    // The exporter owns the span totals; the counters catch up to them.
    let spans = &app.tracer.stats();
    for (outcome, total) in [
        ("exported", &spans.spans_exported),
        ("dropped", &spans.spans_dropped),
        ("failed", &spans.spans_failed),
    ] {
        catch_up(&m.trace_spans, &[outcome], total.load(Relaxed));
    }
    let dropped = sluice_runtime::log_writer::stderr_dropped();
    m.log_dropped
        .inc_by(dropped.saturating_sub(m.log_dropped.get()));
    let now = app.hub.clock().now_ms();
    let snap = app.hub.state();
    let state = snap.domain(0);
    let rules = app.hub.rules();
    for (pool, name) in app.pools.all().map(|h| (h.index, h.label)) {
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
    m.fallback_active.set(i64::from(
        state.fallback_active && active_fallback(app, &snap).is_some(),
    ));
    m.spot_state.set(state.spot_state.level());
    let controls = app
        .pools
        .all()
        .filter_map(|h| Some((h.label, &snap.fleet.pools.get(h.index)?.control)));
    for (pool, c) in controls {
        m.admission_level.with_label_values(&[pool]).set(c.level);
        for t in Tier::ALL {
            let labels = [pool, t.as_str()];
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
            for d in Dim::ALL {
                let labels = [pool, t.as_str(), d.as_str()];
                match c.dims[t.index()][d.index()].headroom {
                    Some(h) => m.tier_slo_headroom.with_label_values(&labels).set(h),
                    None => {
                        let _ = m.tier_slo_headroom.remove_label_values(&labels);
                    }
                }
            }
        }
    }
    for t in Tier::ALL {
        let r = rules.tier(t);
        match r.slo.e2e_ms {
            Some(ms) => m
                .sla_target
                .with_label_values(&[t.as_str()])
                .set(ms as f64 / 1000.0),
            None => {
                let _ = m.sla_target.remove_label_values(&[t.as_str()]);
            }
        }
        for d in Dim::ALL {
            let labels = [t.as_str(), d.as_str()];
            match r.slo.get(d) {
                Some(ms) => m
                    .tier_slo_target
                    .with_label_values(&labels)
                    .set(ms as f64 / 1000.0),
                None => {
                    let _ = m.tier_slo_target.remove_label_values(&labels);
                }
            }
        }
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
        // The pools own the totals; the counters catch up to them (never go back).
        for cause in FailureCause::ALL {
            let labels = [h.label, cause.as_str()];
            catch_up(&m.upstream_retries, &labels, h.stats.retries(cause));
            catch_up(&m.backend_ejections, &labels, h.stats.ejections(cause));
        }
        for why in RetryDenied::ALL {
            let labels = [h.label, why.as_str()];
            catch_up(&m.upstream_retries_denied, &labels, h.stats.denials(why));
        }
        for b in app.pools.status(h).backends {
            let labels = [h.label, b.backend.as_str()];
            m.backend_ejected
                .with_label_values(&labels)
                .set(i64::from(b.ejected.is_some()));
            m.backend_healthy
                .with_label_values(&labels)
                .set(i64::from(b.healthy));
            m.backend_inflight
                .with_label_values(&labels)
                .set(i64::from(b.inflight));
            m.backend_share.with_label_values(&labels).set(b.share);
        }
    }
}
