//! The report math (percentiles, SLA violations, goodput, transitions, flapping, recovery) and
//! its markdown rendering. Pure functions over [`Run`]s, unit-tested below.
//!
//! How a rejection counts: a 429 never reached the backend, so it has no latency to hold
//! against the SLA. Reporting violations only among completed requests would let a proxy look
//! perfect by rejecting everything, so every table shows both: `viol % served` (completed
//! requests over their tier's target) and `viol % all` (every request, where a rejection, an
//! error or a timeout counts as a violation). Targets are judged on `viol % all`.

use serde::Serialize;
use sluice_policy::slo::{Dim, Slo};
use sluice_policy::{PressureState, Tier};
use std::fmt::Write as _;

use crate::record::{RequestRecord, Run, Sample};

pub use crate::stats::percentile;

fn sorted(mut v: Vec<f64>) -> Vec<f64> {
    v.sort_by(f64::total_cmp);
    v
}

#[derive(Debug, Clone, Default, Serialize)]
pub struct TierSummary {
    pub tier: String,
    pub requests: usize,
    pub completed: usize,
    pub within_sla: usize,
    /// Completed over target / completed.
    pub viol_served_pct: Option<f64>,
    /// (Completed over target + rejected + errors) / requests.
    pub viol_all_pct: Option<f64>,
    pub p50_ms: Option<f64>,
    pub p95_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p95_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// Streamed answers' time per output token.
    pub tpot_p50_ms: Option<f64>,
    pub tpot_p95_ms: Option<f64>,
    /// The objective the requests were judged against (`TTFT 45 / TPOT 2 ms`).
    pub objective: String,
    /// Per dimension of the objective (by [`Dim::index`]: TTFT, TPOT, e2e), requests served
    /// within it; `None` where the objective does not set it.
    pub met_dim: [Option<usize>; 3],
    /// The same as a share of all requests (a refusal, an error or a timeout meets nothing).
    /// A whole (non-streamed) answer meets TTFT and TPOT together, by the deadline a stream
    /// meeting both would have kept, so its queueing counts on TPOT too.
    pub attain_dim_pct: [Option<f64>; 3],
    /// The pace alone: served streams whose measured TPOT is within the target, % of the
    /// served streams with a TPOT (two tokens or more).
    pub stream_tpot_met_pct: Option<f64>,
    pub degraded: usize,
    pub queued: usize,
    pub fallback: usize,
    pub rejected: usize,
    pub errors: usize,
    /// Requests completed within SLA (every dimension of the objective: SLO goodput) per
    /// second of the arrival window.
    pub goodput_rps: f64,
    /// Completion tokens of those requests per second.
    pub goodput_tps: f64,
    /// Requests that did not complete, by `x-sluice-reason` (or status).
    pub refusals: std::collections::BTreeMap<String, usize>,
    /// Completed requests by the pool that served them (`x-sluice-pool`, or the client's choice).
    pub pools: std::collections::BTreeMap<String, usize>,
}

pub fn tier_summary(
    records: &[RequestRecord],
    tier: Tier,
    slo: &Slo,
    duration_s: f64,
) -> TierSummary {
    let rs: Vec<&RequestRecord> = records.iter().filter(|r| r.tier == tier).collect();
    summary_of(tier.as_str(), &rs, slo, duration_s)
}

/// One tenant's requests (all of one tier in the scenarios), labelled with the tenant.
pub fn tenant_summary(run: &Run, tenant: &str) -> Option<TierSummary> {
    let rs: Vec<&RequestRecord> = run.records.iter().filter(|r| r.tenant == tenant).collect();
    let tier = rs.first()?.tier;
    Some(summary_of(
        tenant,
        &rs,
        &run.slo[tier.index()],
        run.duration_s,
    ))
}

fn summary_of(label: &str, rs: &[&RequestRecord], slo: &Slo, duration_s: f64) -> TierSummary {
    let completed: Vec<&&RequestRecord> = rs.iter().filter(|r| r.completed()).collect();
    let good: Vec<&&RequestRecord> = completed.iter().copied().filter(|r| r.met(slo)).collect();
    let lat = sorted(completed.iter().map(|r| r.latency_ms).collect());
    let ttft = sorted(completed.iter().filter_map(|r| r.ttft_ms).collect());
    let tpot = sorted(completed.iter().filter_map(|r| r.tpot_ms).collect());
    let pct = |num: usize, den: usize| (den > 0).then(|| 100.0 * num as f64 / den as f64);
    let met_dim = Dim::ALL.map(|d| {
        slo.get(d)
            .map(|_| rs.iter().filter(|r| r.met_dim(slo, d)).count())
    });
    let rejected = rs.iter().filter(|r| r.rejected()).count();
    let errors = rs.len() - completed.len() - rejected;
    let dur = duration_s.max(1e-9);
    TierSummary {
        tier: label.into(),
        requests: rs.len(),
        completed: completed.len(),
        within_sla: good.len(),
        viol_served_pct: pct(completed.len() - good.len(), completed.len()),
        viol_all_pct: pct(rs.len() - good.len(), rs.len()),
        p50_ms: percentile(&lat, 50.0),
        p95_ms: percentile(&lat, 95.0),
        p99_ms: percentile(&lat, 99.0),
        ttft_p50_ms: percentile(&ttft, 50.0),
        ttft_p95_ms: percentile(&ttft, 95.0),
        ttft_p99_ms: percentile(&ttft, 99.0),
        tpot_p50_ms: percentile(&tpot, 50.0),
        tpot_p95_ms: percentile(&tpot, 95.0),
        objective: crate::record::slo_label(slo),
        met_dim,
        attain_dim_pct: met_dim.map(|m| m.and_then(|m| pct(m, rs.len()))),
        stream_tpot_met_pct: slo.tpot_ms.and_then(|target| {
            let paced: Vec<f64> = completed.iter().filter_map(|r| r.tpot_ms).collect();
            let within = paced.iter().filter(|v| **v <= target as f64).count();
            pct(within, paced.len())
        }),
        degraded: rs.iter().filter(|r| r.degraded()).count(),
        queued: rs.iter().filter(|r| r.queued()).count(),
        fallback: rs.iter().filter(|r| r.fallback()).count(),
        rejected,
        errors,
        goodput_rps: good.len() as f64 / dur,
        goodput_tps: good.iter().map(|r| r.completion_tokens as f64).sum::<f64>() / dur,
        pools: completed.iter().fold(Default::default(), |mut m, r| {
            *m.entry(r.pool.clone()).or_insert(0) += 1;
            m
        }),
        refusals: rs
            .iter()
            .filter(|r| !r.completed())
            .fold(Default::default(), |mut m, r| {
                // A 429 is Sluice's refusal and its reason says why; any other failure was
                // let through by the policy, so its reason header explains nothing about it.
                let key = if r.reason.is_empty() || r.status != 429 {
                    format!("status {}", r.status)
                } else {
                    r.reason.clone()
                };
                *m.entry(key).or_insert(0) += 1;
                m
            }),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Transition {
    pub t_ms: u64,
    /// A tier name, or `fallback` for the fallback tracker.
    pub what: &'static str,
    pub from: &'static str,
    pub to: &'static str,
}

/// Tier-state and fallback changes between consecutive samples.
pub fn transitions(samples: &[Sample]) -> Vec<Transition> {
    let mut out = Vec::new();
    let mut prev: Option<&Sample> = None;
    for s in samples {
        if let Some(p) = prev {
            if let (Some(a), Some(b)) = (p.states, s.states) {
                for t in Tier::ALL {
                    let (x, y) = (a[t.index()], b[t.index()]);
                    if x != y {
                        out.push(Transition {
                            t_ms: s.t_ms,
                            what: t.as_str(),
                            from: x.as_str(),
                            to: y.as_str(),
                        });
                    }
                }
            }
            if let (Some(a), Some(b)) = (p.fallback_active, s.fallback_active) {
                if a != b {
                    let name = |v: bool| if v { "active" } else { "inactive" };
                    out.push(Transition {
                        t_ms: s.t_ms,
                        what: "fallback",
                        from: name(a),
                        to: name(b),
                    });
                }
            }
        }
        if s.states.is_some() {
            prev = Some(s);
        }
    }
    out
}

/// Changes that the same subject reversed within `window_ms` (A→B, then B→A within the window).
pub fn flapping(transitions: &[Transition], window_ms: u64) -> usize {
    let mut n = 0;
    for (i, t) in transitions.iter().enumerate() {
        let next = transitions[i + 1..].iter().find(|u| u.what == t.what);
        if let Some(u) = next {
            if u.to == t.from && u.t_ms.saturating_sub(t.t_ms) < window_ms {
                n += 1;
            }
        }
    }
    n
}

/// Recovery, measured two ways from the scenario's recovery marker.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Recovery {
    /// Marker → the last arrival that missed its SLA (rejections included); 0 when none did.
    pub sla_ms: Option<u64>,
    /// Whether some arrival after that last miss met its SLA (false: still missing at the end).
    pub sla_recovered: bool,
    /// Marker → the last tier-state or fallback change back towards Normal; Sluice runs only.
    pub state_ms: Option<u64>,
}

pub fn recovery(run: &Run) -> Recovery {
    let Some(marker) = run.recovery_marker_ms else {
        return Recovery::default();
    };
    let after: Vec<&RequestRecord> = run.records.iter().filter(|r| r.at_ms >= marker).collect();
    let met = |r: &RequestRecord| r.met(&run.slo[r.tier.index()]);
    let last_miss = after.iter().rposition(|r| !met(r));
    let (sla_ms, sla_recovered) = match last_miss {
        // No arrivals after the marker: nothing to measure recovery on.
        None if after.is_empty() => (None, false),
        None => (Some(0), true),
        Some(i) => (
            Some(after[i].at_ms - marker),
            after[i + 1..].iter().any(|r| met(r)),
        ),
    };
    let has_states = run.samples.iter().any(|s| s.states.is_some());
    let state_ms = has_states.then(|| {
        let all_normal = |s: &Sample| {
            s.states
                .is_some_and(|st| st.iter().all(|x| *x == PressureState::Normal))
                && s.fallback_active != Some(true)
        };
        // The first sample after the marker from which every later sample is calm.
        let later: Vec<&Sample> = run.samples.iter().filter(|s| s.t_ms >= marker).collect();
        let calm_from = later
            .iter()
            .rposition(|s| !all_normal(s))
            .map_or(0, |i| i + 1);
        later
            .get(calm_from)
            .map_or(u64::MAX, |s| s.t_ms.saturating_sub(marker))
    });
    Recovery {
        sla_ms,
        sla_recovered,
        state_ms: state_ms.filter(|v| *v != u64::MAX),
    }
}

/// States are sampled every 200 ms over HTTP, so an observed gap between two changes can be
/// that much (plus a request's latency) shorter than the real one. Sluice's stability model
/// allows a reversal exactly at the cooldown, so without this allowance such reversals would be
/// miscounted as flaps.
pub const FLAP_TOLERANCE_MS: u64 = 300;

#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub scenario: String,
    pub mode: String,
    pub engine: String,
    pub requests: usize,
    pub tiers: Vec<TierSummary>,
    /// Per tenant (the `tier` field holds the tenant's name).
    pub tenants: Vec<TierSummary>,
    pub all: TierSummary,
    pub overhead_p50_ms: Option<f64>,
    pub overhead_p99_ms: Option<f64>,
    pub transitions: usize,
    pub flaps: usize,
    /// Reversals within 10 s: slow oscillation that the cooldown alone would not call a flap.
    pub reversals_10s: usize,
    pub recovery: Recovery,
    pub max_send_lag_ms: f64,
    pub sluice_rss_kib: Option<u64>,
    pub notes: Vec<String>,
    /// How the controller treated an idle fleet; Sluice runs in adaptive mode only.
    pub idle: Option<IdleOpen>,
    /// The objectives are in TTFT / TPOT terms: the per-dimension table applies.
    pub per_dimension: bool,
}

/// "Idle means open": a pool is idle once nothing has waited in vLLM, its KV usage has stayed
/// below [`IDLE_KV_BELOW`] and (where the engine reports its pace) the batch has eaten less
/// than half of the tightest TPOT budget (target less the unloaded pace) for [`IDLE_FOR_MS`]
/// (by the run's samples): a batch that slows every decode step past that is the load a TPOT
/// target is spent on, evidence as a queue is, not an idle pool. The controller
/// must then refuse and cap nobody, and once vLLM's queue has emptied (with the cache below
/// the shaping floor, which may hold caps) its level must be back at 0 within
/// [`RELEASE_WITHIN_MS`].
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub struct IdleOpen {
    /// Requests decided while their pool was idle.
    pub decided: usize,
    /// Of those, refused or capped by the controller (its own reasons, not capacity or quota).
    pub refused_or_capped: usize,
    /// The longest a level stayed above 0 after vLLM's queue emptied (ms), over the stretches
    /// where it stayed empty and the cache below the shaping floor; a stretch that ended with
    /// the level still up counts its whole length.
    pub release_max_ms: f64,
    /// Stretches where the level was still up [`RELEASE_WITHIN_MS`] after the queue emptied.
    pub release_late: usize,
}

pub const IDLE_KV_BELOW: f64 = 50.0;
pub const IDLE_FOR_MS: u64 = 2000;
pub const RELEASE_WITHIN_MS: u64 = 3000;
/// The shipped `shape_pressure_at`: at or above it the level may rightly hold the caps.
const SHAPE_FLOOR_KV: f64 = 90.0;

/// The reasons for which the adaptive controller itself refuses or caps a request (its
/// TTFT refusal included: it reads the controller's queue delay and learned prefill).
const CONTROLLER_REASONS: [&str; 12] = [
    "degrade_slo_headroom",
    "fallback_cache_filling",
    "fallback_pool_reserved",
    "reject_pool_reserved",
    "degrade_brownout",
    "degrade_cache_nearly_full",
    "fallback_slo_headroom",
    "reject_slo_headroom",
    "degrade_work_limit",
    "fallback_work_limit",
    "reject_work_limit",
    "reject_slo_unattainable",
];

/// A pool's view in the samples: (time, KV %, waiting, level, the policy saw a full cache,
/// the batch has eaten half the tightest TPOT budget `tpot_ms`).
type PoolView = (u64, f64, f64, f64, bool, bool);

fn pool_track(samples: &[Sample], spot: bool, tpot_ms: Option<f64>) -> Vec<PoolView> {
    samples
        .iter()
        .filter_map(|s| {
            let (kv, waiting) = if spot {
                (s.kv_spot, s.waiting_spot)
            } else {
                (s.kv_on_demand, s.waiting_on_demand)
            };
            let pool = usize::from(spot);
            let shaping = s.shaping.is_some_and(|f| f[pool]);
            let busy = s.pace.zip(tpot_ms).is_some_and(|(p, target)| {
                let (now, unloaded) = p[pool];
                now - unloaded > 0.5 * (target - unloaded)
            });
            Some((s.t_ms, kv?, waiting?, s.levels?[pool], shaping, busy))
        })
        .collect()
}

pub fn idle_open(run: &Run) -> Option<IdleOpen> {
    let tpot = run
        .slo
        .iter()
        .filter_map(|s| s.tpot_ms)
        .min()
        .map(|t| t as f64);
    let tracks = [
        pool_track(&run.samples, false, tpot),
        pool_track(&run.samples, true, tpot),
    ];
    if tracks[0].is_empty() {
        return None;
    }
    let mut out = IdleOpen::default();
    // Since when each sample's pool has been idle.
    let idle_since: Vec<Vec<Option<u64>>> = tracks
        .iter()
        .map(|t| {
            let mut since = None;
            t.iter()
                .map(|&(at, kv, waiting, _, _, busy)| {
                    if waiting <= 0.0 && kv < IDLE_KV_BELOW && !busy {
                        since = since.or(Some(at));
                    } else {
                        since = None;
                    }
                    since
                })
                .collect()
        })
        .collect();
    for r in &run.records {
        // The pool whose controller judged it: spot for what ran there and for Best-Effort's
        // refusals (its tier's pool), on-demand for the rest (a fallback is decided there).
        let spot = r.pool == "spot" || (r.pool.is_empty() && r.tier == Tier::BestEffort);
        let (track, since) = (&tracks[usize::from(spot)], &idle_since[usize::from(spot)]);
        let i = track.partition_point(|s| s.0 <= r.at_ms);
        let idle = i > 0 && since[i - 1].is_some_and(|t| r.at_ms.saturating_sub(t) >= IDLE_FOR_MS);
        if idle {
            out.decided += 1;
            if CONTROLLER_REASONS.contains(&r.reason.as_str()) {
                out.refused_or_capped += 1;
            }
        }
    }
    for track in &tracks {
        let mut start: Option<u64> = None;
        let mut settled = false;
        let close = |start: Option<u64>, settled: bool, end: u64, out: &mut IdleOpen| {
            if let (Some(t0), false) = (start, settled) {
                let lag = end.saturating_sub(t0);
                out.release_max_ms = out.release_max_ms.max(lag as f64);
                if lag > RELEASE_WITHIN_MS {
                    out.release_late += 1;
                }
            }
        };
        for &(at, kv, waiting, level, shaping, busy) in track {
            // The policy samples less often than the run: a peak it saw and these samples
            // missed still holds the shaping floor.
            let clear = waiting <= 0.0 && kv < SHAPE_FLOOR_KV && !shaping && !busy;
            if !clear {
                close(start.take(), settled, at, &mut out);
                settled = false;
                continue;
            }
            let t0 = *start.get_or_insert(at);
            if !settled && level <= 0.0 {
                out.release_max_ms = out.release_max_ms.max(at.saturating_sub(t0) as f64);
                if at.saturating_sub(t0) > RELEASE_WITHIN_MS {
                    out.release_late += 1;
                }
                settled = true;
            }
        }
        let end = track.last().map_or(0, |s| s.0);
        close(start, settled, end, &mut out);
    }
    Some(out)
}

pub fn summarize(run: &Run) -> RunSummary {
    let tiers: Vec<TierSummary> = Tier::ALL
        .iter()
        .map(|&t| tier_summary(&run.records, t, &run.slo[t.index()], run.duration_s))
        .filter(|s| s.requests > 0)
        .collect();
    // "All tiers": each request against its own tier's target.
    let mut all = TierSummary {
        tier: "all".into(),
        ..Default::default()
    };
    for s in &tiers {
        all.requests += s.requests;
        all.completed += s.completed;
        all.within_sla += s.within_sla;
        all.degraded += s.degraded;
        all.queued += s.queued;
        all.fallback += s.fallback;
        all.rejected += s.rejected;
        all.errors += s.errors;
        all.goodput_rps += s.goodput_rps;
        all.goodput_tps += s.goodput_tps;
        for d in Dim::ALL {
            if let Some(m) = s.met_dim[d.index()] {
                *all.met_dim[d.index()].get_or_insert(0) += m;
            }
        }
    }
    let pct = |num: usize, den: usize| (den > 0).then(|| 100.0 * num as f64 / den as f64);
    all.viol_served_pct = pct(all.completed - all.within_sla, all.completed);
    all.viol_all_pct = pct(all.requests - all.within_sla, all.requests);
    // A dimension only some tiers set is reported over those tiers' requests.
    for d in Dim::ALL {
        let den: usize = tiers
            .iter()
            .filter(|s| s.met_dim[d.index()].is_some())
            .map(|s| s.requests)
            .sum();
        all.attain_dim_pct[d.index()] = all.met_dim[d.index()].and_then(|m| pct(m, den));
    }
    let tr = transitions(&run.samples);
    RunSummary {
        scenario: run.scenario.clone(),
        mode: run.mode.as_str().into(),
        engine: run.engine.into(),
        requests: run.records.len(),
        tiers,
        tenants: {
            let mut names: Vec<&str> = run.records.iter().map(|r| r.tenant.as_str()).collect();
            names.sort_unstable();
            names.dedup();
            names
                .into_iter()
                .filter_map(|t| tenant_summary(run, t))
                .collect()
        },
        all,
        overhead_p50_ms: run.overhead.map(|o| o.p50_ms),
        overhead_p99_ms: run.overhead.map(|o| o.p99_ms),
        transitions: tr.len(),
        flaps: flapping(&tr, run.cooldown_ms.saturating_sub(FLAP_TOLERANCE_MS)),
        reversals_10s: flapping(&tr, 10_000),
        recovery: recovery(run),
        max_send_lag_ms: run
            .records
            .iter()
            .map(|r| r.send_lag_ms)
            .fold(0.0, f64::max),
        sluice_rss_kib: run.sluice_rss_kib,
        notes: run.notes.clone(),
        idle: idle_open(run),
        per_dimension: crate::record::per_dimension(&run.slo),
    }
}

/// Quantiles of a Prometheus histogram summed over all its series (PromQL's
/// `histogram_quantile`: linear inside the bucket). Returns (count, p50, p99) in the metric's
/// unit.
pub fn histogram_quantiles(metrics: &str, name: &str) -> Option<(f64, f64, f64)> {
    let prefix = format!("{name}_bucket{{");
    let mut buckets: Vec<(f64, f64)> = Vec::new();
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(prefix.as_str()) else {
            continue;
        };
        let Some((labels, value)) = rest.rsplit_once("} ") else {
            continue;
        };
        let Some(le) = labels
            .split("le=\"")
            .nth(1)
            .and_then(|x| x.split('"').next())
        else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse().ok()?
        };
        let v: f64 = value.trim().parse().ok()?;
        match buckets.iter_mut().find(|b| b.0 == le) {
            Some(b) => b.1 += v,
            None => buckets.push((le, v)),
        }
    }
    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
    let total = buckets.last().filter(|b| b.0.is_infinite())?.1;
    if total <= 0.0 {
        return None;
    }
    let q = |p: f64| {
        let rank = p * total;
        let (mut prev_le, mut prev_c) = (0.0, 0.0);
        for &(le, c) in &buckets {
            if c >= rank {
                if le.is_infinite() {
                    return prev_le;
                }
                return prev_le + (le - prev_le) * (rank - prev_c) / (c - prev_c).max(1e-12);
            }
            (prev_le, prev_c) = (le, c);
        }
        prev_le
    };
    Some((total, q(0.5), q(0.99)))
}

pub fn fmt_opt(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "–".into(), |x| format!("{x:.digits$}"))
}

fn fmt_ms(v: Option<f64>) -> String {
    match v {
        None => "–".into(),
        Some(x) if x >= 10_000.0 => format!("{:.1} s", x / 1000.0),
        Some(x) => format!("{x:.0}"),
    }
}

/// One markdown table for a scenario: a row per (mode, tier).
pub fn scenario_table(summaries: &[RunSummary]) -> String {
    let mut s = String::new();
    s.push_str("| mode | tier | req | viol % all | viol % served | p50 ms | p95 ms | p99 ms | TTFT p50 / p95 ms | done | degraded | queued | fallback | rejected | errors | goodput req/s | goodput tok/s |\n");
    s.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for run in summaries {
        for t in run.tiers.iter().chain(std::iter::once(&run.all)) {
            let ttft = if t.tier == "all" {
                "".into()
            } else {
                format!("{} / {}", fmt_ms(t.ttft_p50_ms), fmt_ms(t.ttft_p95_ms))
            };
            let (p50, p95, p99) = if t.tier == "all" {
                (String::new(), String::new(), String::new())
            } else {
                (fmt_ms(t.p50_ms), fmt_ms(t.p95_ms), fmt_ms(t.p99_ms))
            };
            let bold = |x: String| {
                if t.tier == "all" {
                    x
                } else {
                    format!("**{x}**")
                }
            };
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.2} | {:.0} |",
                run.mode,
                t.tier,
                t.requests,
                bold(fmt_opt(t.viol_all_pct, 1)),
                fmt_opt(t.viol_served_pct, 1),
                p50,
                p95,
                p99,
                ttft,
                t.completed,
                t.degraded,
                t.queued,
                t.fallback,
                t.rejected,
                t.errors,
                t.goodput_rps,
                t.goodput_tps,
            );
        }
    }
    s
}

/// One markdown table for a scenario whose objectives are in TTFT / TPOT terms: a row per
/// (mode, tier) with the share of all its requests served within each dimension set and
/// within all of them (a refusal, an error or a timeout meets none), the streamed answers'
/// TTFT and TPOT, and the SLO goodput (requests within every dimension per second).
pub fn slo_table(summaries: &[RunSummary]) -> String {
    let dims: Vec<Dim> = Dim::ALL
        .into_iter()
        .filter(|d| {
            summaries
                .iter()
                .any(|r| r.tiers.iter().any(|t| t.met_dim[d.index()].is_some()))
        })
        .collect();
    let name = |d: Dim| match d {
        Dim::Ttft => "TTFT",
        Dim::Tpot => "TPOT",
        Dim::E2e => "e2e",
    };
    let mut s = String::from("| mode | tier | req | objective |");
    for d in &dims {
        let _ = write!(s, " {} met % |", name(*d));
    }
    s.push_str(" **SLO met %** | streams' pace within TPOT % | TTFT p50 / p95 ms (streamed) | TPOT p50 / p95 ms (streamed) | p95 latency ms | done | degraded | queued | fallback | rejected | errors | **SLO goodput req/s** |\n|---|---|---|---|");
    for _ in &dims {
        s.push_str("---|");
    }
    s.push_str("---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for run in summaries {
        for t in run.tiers.iter().chain(std::iter::once(&run.all)) {
            let all = t.tier == "all";
            let _ = write!(
                s,
                "| {} | {} | {} | {} |",
                run.mode,
                t.tier,
                t.requests,
                if all { "" } else { t.objective.as_str() }
            );
            for d in &dims {
                let _ = write!(s, " {} |", fmt_opt(t.attain_dim_pct[d.index()], 1));
            }
            let met = t.viol_all_pct.map(|v| 100.0 - v);
            let pair = |a: Option<f64>, b: Option<f64>, digits: usize| {
                if all {
                    String::new()
                } else {
                    format!("{} / {}", fmt_opt(a, digits), fmt_opt(b, digits))
                }
            };
            let _ = writeln!(
                s,
                " **{}** | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | **{:.2}** |",
                fmt_opt(met, 1),
                if all {
                    String::new()
                } else {
                    fmt_opt(t.stream_tpot_met_pct, 1)
                },
                pair(t.ttft_p50_ms, t.ttft_p95_ms, 0),
                pair(t.tpot_p50_ms, t.tpot_p95_ms, 2),
                if all { String::new() } else { fmt_ms(t.p95_ms) },
                t.completed,
                t.degraded,
                t.queued,
                t.fallback,
                t.rejected,
                t.errors,
                t.goodput_rps,
            );
        }
    }
    s
}

/// Per tenant and mode: what each tenant of a shared tier got.
pub fn tenant_table(summaries: &[RunSummary]) -> String {
    let mut out = String::from(
        "| tenant | mode | requests | served | within SLA | SLA violations (all) | p50 | p95 | refused | queued |\n|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let mut names: Vec<&str> = summaries
        .iter()
        .flat_map(|s| s.tenants.iter().map(|t| t.tier.as_str()))
        .collect();
    names.sort_unstable();
    names.dedup();
    for name in names {
        for s in summaries {
            let Some(t) = s.tenants.iter().find(|t| t.tier == name) else {
                continue;
            };
            out.push_str(&format!(
                "| {name} | {} | {} | {} | {} | {}% | {} | {} | {} | {} |\n",
                s.mode,
                t.requests,
                t.completed,
                t.within_sla,
                fmt_opt(t.viol_all_pct, 1),
                fmt_ms(t.p50_ms),
                fmt_ms(t.p95_ms),
                t.rejected,
                t.queued
            ));
        }
    }
    out
}

/// Run-level figures: overhead, transitions, flapping, recovery.
pub fn run_table(summaries: &[RunSummary]) -> String {
    let mut s = String::new();
    s.push_str("| mode | overhead p50 / p99 (Sluice histogram) | state transitions | flaps (reversed within cooldown) | reversals within 10 s | recovery: last SLA miss after marker | recovery: tiers back to Normal | max client send lag |\n");
    s.push_str("|---|---|---|---|---|---|---|---|\n");
    for r in summaries {
        let overhead = match (r.overhead_p50_ms, r.overhead_p99_ms) {
            (Some(a), Some(b)) => format!("{:.3} / {:.3} ms", a, b),
            _ => "–".into(),
        };
        let rec = match r.recovery.sla_ms {
            None => "–".into(),
            Some(ms) if r.recovery.sla_recovered => format!("{:.1} s", ms as f64 / 1000.0),
            Some(ms) => format!("not recovered (misses until +{:.1} s)", ms as f64 / 1000.0),
        };
        let state = if r.mode == "direct" || r.mode == "baseline" {
            "–".to_string()
        } else {
            r.recovery
                .state_ms
                .map_or("not within the run".into(), |ms| {
                    format!("{:.1} s", ms as f64 / 1000.0)
                })
        };
        let trans = if r.mode == "direct" || r.mode == "baseline" {
            ("–".to_string(), "–".to_string(), "–".to_string())
        } else {
            (
                r.transitions.to_string(),
                r.flaps.to_string(),
                r.reversals_10s.to_string(),
            )
        };
        let _ = writeln!(
            s,
            "| {} | {} | {} | {} | {} | {} | {} | {:.0} ms |",
            r.mode, overhead, trans.0, trans.1, trans.2, rec, state, r.max_send_lag_ms
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::Mode;

    fn rec(tier: Tier, at_ms: u64, status: u16, latency_ms: f64) -> RequestRecord {
        RequestRecord {
            id: 0,
            tenant: format!("{}-tenant", tier.as_str()),
            tier,
            at_ms,
            send_lag_ms: 0.0,
            status,
            latency_ms,
            ttft_ms: None,
            tpot_ms: None,
            stream: false,
            answer_tokens: 100,
            completion_tokens: if status == 200 { 100 } else { 0 },
            decision: "pass".into(),
            reason: String::new(),
            pool: "on-demand".into(),
            queue_wait_ms: None,
        }
    }

    #[test]
    fn histogram_quantiles_like_promql() {
        let m = "# TYPE h histogram\n\
                 h_bucket{tier=\"a\",le=\"0.001\"} 40\n\
                 h_bucket{tier=\"a\",le=\"0.002\"} 90\n\
                 h_bucket{tier=\"a\",le=\"+Inf\"} 100\n\
                 h_bucket{tier=\"b\",le=\"0.001\"} 60\n\
                 h_bucket{tier=\"b\",le=\"0.002\"} 100\n\
                 h_bucket{tier=\"b\",le=\"+Inf\"} 100\n\
                 h_sum 1\nh_count 200\n";
        let (count, p50, p99) = histogram_quantiles(m, "h").unwrap();
        assert_eq!(count, 200.0);
        // 100 of 200 at or below 1 ms: the median is the bucket's upper edge.
        assert!((p50 - 0.001).abs() < 1e-12);
        // Rank 198 lies in (+Inf) bucket's range: reported as the last finite bound.
        assert_eq!(p99, 0.002);
        assert!(histogram_quantiles("", "h").is_none());
    }

    #[test]
    fn percentiles_interpolate_between_ranks() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 0.0), Some(1.0));
        assert_eq!(percentile(&v, 50.0), Some(2.5));
        assert_eq!(percentile(&v, 100.0), Some(4.0));
        assert!((percentile(&v, 99.0).unwrap() - 3.97).abs() < 1e-9);
        assert_eq!(percentile(&[7.0], 95.0), Some(7.0));
        assert_eq!(percentile(&[], 50.0), None);
        let hundred: Vec<f64> = (1..=100).map(f64::from).collect();
        assert!((percentile(&hundred, 95.0).unwrap() - 95.05).abs() < 1e-9);
    }

    #[test]
    fn violations_goodput_and_rejections() {
        let g = Tier::Guaranteed;
        let mut rs = vec![
            rec(g, 0, 200, 100.0),
            rec(g, 10, 200, 2500.0), // over the 2000 ms target
            rec(g, 20, 429, 1.0),    // rejected
            rec(g, 30, 200, 2000.0), // exactly on target: within
            rec(g, 40, 502, 5.0),    // error
        ];
        rs[0].completion_tokens = 40;
        rs.push(rec(Tier::Standard, 50, 200, 10.0));
        let s = tier_summary(&rs, g, &Slo::e2e(2000), 10.0);
        assert_eq!((s.requests, s.completed, s.within_sla), (5, 3, 2));
        assert_eq!((s.rejected, s.errors), (1, 1));
        assert!((s.viol_served_pct.unwrap() - 100.0 / 3.0).abs() < 1e-9);
        assert_eq!(s.viol_all_pct, Some(60.0));
        assert!((s.goodput_rps - 0.2).abs() < 1e-12);
        assert!((s.goodput_tps - 14.0).abs() < 1e-12);
        assert_eq!(s.degraded, 1, "40 of 100 tokens: capped");
        assert_eq!(s.p50_ms, Some(2000.0));
    }

    fn sample(t_ms: u64, g: PressureState, st: PressureState, fb: bool) -> Sample {
        Sample {
            t_ms,
            states: Some([g, st, PressureState::Normal]),
            fallback_active: Some(fb),
            ..Default::default()
        }
    }

    #[test]
    fn transitions_and_flapping() {
        use PressureState::*;
        let samples = vec![
            sample(0, Normal, Normal, false),
            sample(1000, Normal, Elevated, false),
            sample(1500, Normal, Normal, false), // reversed after 500 ms: a flap at 2 s cooldown
            sample(2000, Normal, Normal, true),
            sample(9000, Normal, Elevated, true),
            sample(15000, Normal, Normal, false), // reversed after 6 s: no flap, one slow reversal
            Sample {
                t_ms: 16000,
                ..Default::default()
            }, // a failed sample is skipped, not a change
            sample(17000, Normal, Normal, false),
        ];
        let tr = transitions(&samples);
        assert_eq!(tr.len(), 6);
        assert_eq!(
            tr[0],
            Transition {
                t_ms: 1000,
                what: "Standard",
                from: "Normal",
                to: "Elevated"
            }
        );
        assert_eq!(tr.iter().filter(|t| t.what == "fallback").count(), 2);
        assert_eq!(flapping(&tr, 2000), 1);
        // Within 10 s, every Standard change is reversed by the next one (0.5, 7.5 and 6 s
        // later); the fallback's 13 s on-period is not.
        assert_eq!(flapping(&tr, 10_000), 3);
    }

    fn run(records: Vec<RequestRecord>, samples: Vec<Sample>) -> Run {
        Run {
            scenario: "t".into(),
            mode: Mode::Phase2,
            engine: "model",
            duration_s: 10.0,
            records,
            samples,
            overhead: None,
            cooldown_ms: 2000,
            recovery_marker_ms: Some(1000),
            slo: [2000, 1000, 500].map(Slo::e2e),
            sluice_rss_kib: None,
            notes: vec![],
        }
    }

    #[test]
    fn recovery_from_the_marker() {
        use PressureState::*;
        let g = Tier::Guaranteed;
        let r = run(
            vec![
                rec(g, 500, 200, 5000.0),              // before the marker: ignored
                rec(g, 1200, 200, 3000.0),             // miss
                rec(Tier::BestEffort, 3500, 429, 1.0), // miss (rejected)
                rec(g, 4000, 200, 100.0),
            ],
            vec![
                sample(1000, Elevated, Critical, true),
                sample(2000, Normal, Elevated, false),
                sample(6000, Normal, Normal, false),
                sample(7000, Normal, Normal, false),
            ],
        );
        let rec = recovery(&r);
        assert_eq!(rec.sla_ms, Some(2500));
        assert!(rec.sla_recovered);
        assert_eq!(rec.state_ms, Some(5000));
        let s = summarize(&r);
        assert_eq!(s.all.requests, 4);
        assert_eq!(s.all.within_sla, 1);
        assert_eq!(s.all.viol_all_pct, Some(75.0));
    }
}
