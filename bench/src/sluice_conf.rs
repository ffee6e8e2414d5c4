//! The Sluice configuration of each mode, generated from the scenario. The live run writes it to
//! a file for `sluice serve`; the in-process model parses the very same text with Sluice's own
//! config loader and takes its `PolicyRules`, so both engines run one policy.

use serde_json::{json, Value};
use sluice_config::Config;
use sluice_policy::Tier;
use std::path::Path;

use crate::record::Mode;
use crate::scenario::Scenario;

/// Where the processes of a run listen.
#[derive(Debug, Clone)]
pub struct Addrs {
    pub sluice: String,
    /// Sluice's operations listener.
    pub ops: String,
    pub on_demand: String,
    pub spot: String,
}

impl Addrs {
    /// Placeholders for the model, which binds nothing (one address for both pools when the
    /// scenario shares one backend, as the live run does).
    pub fn placeholder() -> Self {
        Self {
            sluice: "127.0.0.1:1".into(),
            ops: "127.0.0.1:4".into(),
            on_demand: "127.0.0.1:2".into(),
            spot: "127.0.0.1:3".into(),
        }
    }

    pub fn placeholder_for(s: &Scenario) -> Self {
        let mut a = Self::placeholder();
        if s.backends.shared {
            a.spot = a.on_demand.clone();
        }
        a
    }
}

/// Where phase 2's SLA-violation-rate signal comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SlaSignal {
    /// Sluice's PostgreSQL ledger computes it (the product path); needs PostgreSQL.
    Ledger,
    /// The harness PUTs its own rolling rate to `/admin/sla-violation-rate` (same definition:
    /// completed requests over their tier's target in the window, all tiers pooled).
    Harness,
    /// No SLA-rate signal.
    Off,
}

pub const FALLBACK_MODEL: &str = "llama-3-8b";
pub const MODEL: &str = "llama-3-70b";
pub const LEDGER_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

/// Deep-merges `patch` into `base` (objects merge, everything else replaces).
pub use sluice_testkit::merge;

fn tier_key(t: Tier) -> &'static str {
    t.as_str()
}

/// The config of `mode` (`None` for the proxy-less modes).
pub fn for_mode(
    s: &Scenario,
    mode: Mode,
    addrs: &Addrs,
    dir: &Path,
    sla: SlaSignal,
) -> Option<Value> {
    if !mode.uses_sluice() {
        return None;
    }
    if mode == Mode::Adaptive {
        return Some(shipped(s, addrs, dir, sla));
    }
    if mode == Mode::Fifo {
        let mut cfg = shipped(s, addrs, dir, sla);
        merge(&mut cfg, &json!({"queue": {"fair_share": false}}));
        return Some(cfg);
    }
    let hc = json!({"path": "/health", "interval_ms": 250, "timeout_ms": 500,
                    "consecutive_success": 1, "consecutive_failure": 2});
    let tenants: serde_json::Map<String, Value> = s
        .tenants
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                json!(Tier::parse(&t.tier).map_or("Best-Effort", |x| x.as_str())),
            )
        })
        .collect();
    let mut tiers = serde_json::Map::new();
    for t in Tier::ALL {
        tiers.insert(tier_key(t).into(), objective(s, t));
    }
    let mut cfg = json!({
        "listen": [addrs.sluice],
        "ops_listen": [addrs.ops],
        "server": server_block(dir),
        "tenants": tenants,
        "pools": {
            "on-demand": {"backends": [addrs.on_demand], "health_check": hc},
            "spot": {"backends": [addrs.spot], "health_check": hc},
        },
        "fallbacks": [{"name": "small", "url": format!("http://{}", addrs.spot), "model": FALLBACK_MODEL}],
        "signals": {"scrape_interval_ms": 500, "scrape_timeout_ms": 400, "stale_after_ms": 3000},
        "tiers": tiers,
        // A generation under overload can wait a long time for its first token; the benchmark
        // wants to see that latency, not a 504.
        "limits": {"upstream_read_timeout_ms": 120000},
        // Phases 1 and 2 are the prototype's threshold policy (phase 2 with every signal).
        "policy": {"mode": "thresholds"},
    });
    let mut knobs = s.sluice.clone();
    if mode == Mode::Phase1 {
        // Phase 1 is the prototype's pressure-only policy: the shipped per-tier thresholds, only
        // the scenario's timings (scrape interval, stability) carry over.
        if let Some(o) = knobs.as_object_mut() {
            o.remove("tiers");
        }
    }
    // A scenario without tuned knobs (no `sluice:` block) leaves the generated config alone.
    if !knobs.is_null() {
        merge(&mut cfg, &knobs);
    }
    match mode {
        Mode::Phase1 => {
            for t in Tier::ALL {
                merge(
                    &mut cfg["tiers"][tier_key(t)],
                    &json!({"inflight_capacity": 0, "queue": false, "fallback": false,
                            "thresholds": {"queue_depth": {}, "sla_violation_rate": {}}}),
                );
            }
            cfg["fallbacks"] = json!([]);
            cfg["routing"] =
                json!({"spot_evict_pressure_at": null, "spot_evict_queue_depth_at": null});
            if let Some(o) = cfg.as_object_mut() {
                o.remove("database_url");
                o.remove("ledger");
            }
        }
        Mode::Phase2 if sla == SlaSignal::Ledger => {
            merge(
                &mut cfg,
                &json!({"database_url": LEDGER_URL,
                        "ledger": {"schema": "sluice_bench",
                                   "spool_dir": dir.join("spool").display().to_string()}}),
            );
        }
        _ => {}
    }
    Some(cfg)
}

/// A tier's objective as config keys: `slo: {ttft_ms, tpot_ms}` when the scenario sets TTFT
/// and TPOT targets, else `sla_target_ms` (the prototype's end-to-end target).
fn objective(s: &Scenario, t: Tier) -> Value {
    match s.slo_ms {
        Some(slo) => {
            let o = slo.get(t);
            json!({"slo": {"ttft_ms": o.ttft_ms, "tpot_ms": o.tpot_ms}})
        }
        None => json!({"sla_target_ms": s.sla_ms.get(t)}),
    }
}

/// Pingora's settings for a benchmark process: its own pid and upgrade files, no grace.
fn server_block(dir: &Path) -> Value {
    json!({
        "threads": 2,
        "grace_period_seconds": 0,
        "graceful_shutdown_timeout_seconds": 1,
        "upgrade_sock": dir.join("upgrade.sock").display().to_string(),
        "pid_file": dir.join("sluice.pid").display().to_string(),
    })
}

/// The shipped `conf/sluice.yaml` as a user deploys it: only what names this run's processes
/// (listen address, backends, tenants, pid and upgrade files) and the scenario's SLA targets
/// change; no knob is tuned for the scenario.
fn shipped(s: &Scenario, addrs: &Addrs, dir: &Path, sla: SlaSignal) -> Value {
    const SHIPPED: &str = include_str!("../../conf/sluice.yaml");
    let yaml: serde_yaml::Value = serde_yaml::from_str(SHIPPED).unwrap_or_default();
    let mut cfg = serde_json::to_value(yaml).unwrap_or_default();
    if let Some(o) = cfg.as_object_mut() {
        o.remove("tenants_file");
    }
    let tenants: serde_json::Map<String, Value> = s
        .tenants
        .iter()
        .map(|t| {
            let tier = Tier::parse(&t.tier).map_or("Best-Effort", |x| x.as_str());
            (t.name.clone(), json!(tier))
        })
        .collect();
    let mut patch = json!({
        "listen": [addrs.sluice],
        "ops_listen": [addrs.ops],
        "server": server_block(dir),
        "tenants": tenants,
        "pools": {
            "on-demand": {"backends": [addrs.on_demand]},
            "spot": {"backends": [addrs.spot]},
        },
    });
    // The scenario's objective replaces the shipped one whole: an end-to-end run sets only
    // `sla_target_ms` (the prototype's config, today's figures), a TTFT/TPOT run only `slo`.
    for t in Tier::ALL {
        if let Some(tier) = cfg["tiers"][tier_key(t)].as_object_mut() {
            tier.remove("slo");
            tier.remove("sla_target_ms");
        }
        patch["tiers"][tier_key(t)] = objective(s, t);
    }
    merge(&mut cfg, &patch);
    if let Some(f) = cfg["fallbacks"].get_mut(0) {
        f["url"] = json!(format!("http://{}", addrs.spot));
        f["model"] = json!(FALLBACK_MODEL);
    }
    if sla == SlaSignal::Ledger {
        merge(
            &mut cfg,
            &json!({"database_url": LEDGER_URL,
                    "ledger": {"schema": "sluice_bench",
                               "spool_dir": dir.join("spool").display().to_string()}}),
        );
    }
    if !s.explore.is_null() {
        merge(&mut cfg, &s.explore);
    }
    cfg
}

/// Parses a generated config with Sluice's own loader (which also validates it).
pub fn parse(cfg: &Value, dir: &Path) -> Result<Config, String> {
    let yaml = serde_yaml::to_string(cfg).map_err(|e| e.to_string())?;
    Config::from_yaml(&yaml, "(generated bench config)", dir, None, &|_| None)
        .map_err(|e| e.to_string())
}

/// The SLA window the ledger uses (and the harness and the model mirror).
pub fn sla_window_ms(cfg: &Value) -> u64 {
    cfg["ledger"]["sla_window_seconds"]
        .as_f64()
        .map_or(60_000, |s| (s * 1000.0) as u64)
}

/// The knobs a reader needs to judge a Sluice run, one line each.
pub fn knobs(cfg: &Config) -> Vec<String> {
    let rules = cfg.policy_rules();
    let mut out = vec![format!(
        "signals: scrape every {} ms; stability: {} samples, cooldown {} ms, hysteresis {}; fallback at {} for {} samples, recover below {}; queue max {} wait {} ms",
        cfg.signals.scrape_interval_ms,
        rules.stability.consecutive_samples,
        rules.stability.cooldown_ms,
        rules.stability.hysteresis,
        rules.fallback.pressure_at,
        rules.fallback.sustained_intervals,
        rules.fallback.recover_below,
        cfg.queue.max_size,
        cfg.queue.max_wait_ms(),
    )];
    for t in Tier::ALL {
        let r = rules.tier(t);
        let th = |x: sluice_policy::pressure::Threshold| match (x.elevated_at, x.critical_at) {
            (None, None) => "off".to_string(),
            (e, c) => format!(
                "{}/{}",
                e.map_or("–".into(), |v| v.to_string()),
                c.map_or("–".into(), |v| v.to_string())
            ),
        };
        out.push(format!(
            "{}: capacity {}, cap {}, brownout cap {}, queue {}, fallback {}, pool {}, thresholds pressure {} queue {} sla-rate {}",
            t.as_str(),
            if r.inflight_capacity == 0 { "unlimited".into() } else { r.inflight_capacity.to_string() },
            r.max_tokens_cap.map_or("none".into(), |c| c.to_string()),
            r.brownout_max_tokens.map_or("none".into(), |c| c.to_string()),
            r.queue_eligible,
            r.fallback_eligible,
            r.preferred_pool.as_str(),
            th(r.thresholds.pressure),
            th(r.thresholds.queue_depth),
            th(r.thresholds.sla_violation_rate),
        ));
    }
    let spot = &rules.spot_eviction;
    let opt = |v: Option<f64>| v.map_or("off".to_string(), |x| x.to_string());
    out.push(format!(
        "spot eviction at spot pressure {} / waiting {}; fallbacks: {}",
        opt(spot.pressure.critical_at),
        opt(spot.queue_depth.critical_at),
        if cfg.fallbacks.is_empty() {
            "none".to_string()
        } else {
            cfg.fallbacks
                .iter()
                .map(|f| f.model.clone())
                .collect::<Vec<_>>()
                .join(", ")
        },
    ));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phase1_is_pressure_only_and_phase2_keeps_the_tuning() {
        let s = Scenario::built_in("tiny").unwrap();
        let dir = std::env::temp_dir();
        let p1 = for_mode(
            &s,
            Mode::Phase1,
            &Addrs::placeholder(),
            &dir,
            SlaSignal::Off,
        )
        .unwrap();
        let c1 = parse(&p1, &dir).unwrap();
        let r1 = c1.policy_rules();
        for t in Tier::ALL {
            let r = r1.tier(t);
            assert_eq!(r.inflight_capacity, 0);
            assert!(!r.queue_eligible && !r.fallback_eligible);
            assert_eq!(r.thresholds.queue_depth.elevated_at, None);
            assert_eq!(r.thresholds.queue_depth.critical_at, None);
            assert_eq!(r.thresholds.sla_violation_rate.critical_at, None);
            assert!(
                r.thresholds.pressure.critical_at.is_some()
                    || r.thresholds.pressure.elevated_at.is_some()
            );
        }
        assert!(c1.fallbacks.is_empty());
        assert_eq!(r1.spot_eviction.pressure.critical_at, None);
        let p2 = for_mode(
            &s,
            Mode::Phase2,
            &Addrs::placeholder(),
            &dir,
            SlaSignal::Off,
        )
        .unwrap();
        let c2 = parse(&p2, &dir).unwrap();
        assert_eq!(c2.fallbacks.len(), 1);
        assert_eq!(
            c2.policy_rules().tier(Tier::Guaranteed).slo.e2e_ms,
            Some(s.sla_ms.guaranteed)
        );
        // The shipped config's own TTFT/TPOT targets give way to the scenario's objective.
        let dir_ = &dir;
        let adaptive = |s: &Scenario| {
            let cfg = for_mode(
                s,
                Mode::Adaptive,
                &Addrs::placeholder(),
                dir_,
                SlaSignal::Off,
            )
            .unwrap();
            parse(&cfg, dir_).unwrap().policy_rules()
        };
        let e2e = adaptive(&s).tier(Tier::Standard).slo;
        assert_eq!(e2e, sluice_policy::slo::Slo::e2e(s.sla_ms.standard));
        let slo = s.clone().with_slo_x(2.0).unwrap();
        let want = slo.slo_ms.unwrap().get(Tier::Standard);
        let got = adaptive(&slo).tier(Tier::Standard).slo;
        assert_eq!(
            (got.ttft_ms, got.tpot_ms, got.e2e_ms),
            (Some(want.ttft_ms), Some(want.tpot_ms), None)
        );
        assert_eq!(slo.objective(Tier::Standard), got);
        let p2 = for_mode(
            &slo,
            Mode::Phase2,
            &Addrs::placeholder(),
            &dir,
            SlaSignal::Off,
        );
        let p2 = parse(&p2.unwrap(), &dir).unwrap().policy_rules();
        assert_eq!(p2.tier(Tier::Standard).slo, got);
        assert!(for_mode(
            &s,
            Mode::Direct,
            &Addrs::placeholder(),
            &dir,
            SlaSignal::Off
        )
        .is_none());
    }
}
