//! `sluice replay` end to end: real traffic through a real `sluice serve` in front of the vLLM
//! simulator, recorded in PostgreSQL (127.0.0.1:5432, database `test`, a schema per test), then
//! decided again by the `sluice replay` binary — from the ledger and from JSONL — under the
//! same config (nothing may change) and under a stricter one (what changes is counted from the
//! recorded rows by the test itself).

mod common;
use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// The recording config: the ledger in `schema`, SLA-rate thresholds off (a slow machine must
/// not shed through them), and in thresholds mode a tier's state is the one its sample's
/// signals call for (one sample, no cooldown, no hysteresis), so the test can tell from a row's
/// signals what any thresholds would have decided.
fn recording(od: &Proc, sp: &Proc, schema: &Schema, patch: Value) -> Value {
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    let off = json!({"thresholds": {"sla_violation_rate": {}}});
    merge(
        &mut cfg,
        json!({
            "database_url": PG_URL,
            "ledger": {"schema": schema.0, "spool_dir": schema.spool_dir().display().to_string(),
                       "flush_interval_ms": 50},
            "stability": {"consecutive_samples": 1, "cooldown_seconds": 0, "hysteresis": 0,
                          "queue_depth_hysteresis": 0, "sla_rate_hysteresis": 0},
            "tiers": {"Guaranteed": off, "Standard": off, "Best-Effort": off},
        }),
    );
    merge(&mut cfg, patch);
    cfg
}

const TENANTS: [&str; 3] = ["support-bot", "coding-assistant", "batch-analytics"];

/// `n` concurrent requests from each of `tenants`; returns how many were sent.
async fn burst(s: &Arc<Sluice>, tenants: &[&'static str], n: usize) -> usize {
    let tasks: Vec<_> = tenants
        .iter()
        .flat_map(|t| std::iter::repeat_n(*t, n))
        .map(|tenant| {
            let s = Arc::clone(s);
            tokio::spawn(async move {
                let r = s.chat(tenant, chat_body("llama-3-70b", Some(300))).await;
                let _ = r.bytes().await;
            })
        })
        .collect();
    let sent = tasks.len();
    for t in tasks {
        t.await.unwrap();
    }
    sent
}

/// Pins the simulator's reported KV usage and waits until Sluice's policy reads it.
async fn pin_kv(s: &Sluice, sim: &Proc, usage: Option<f64>) {
    sim_admin(sim, "/admin/kv", json!({"usage": usage})).await;
    if let Some(u) = usage {
        wait_for(Duration::from_secs(5), "the pinned KV usage", || async {
            let v = s.status().await["signals"]["on-demand"]["pressure"]["value"].as_f64();
            v.filter(|p| (p - u * 100.0).abs() < 1e-6).map(|_| ())
        })
        .await;
        // One more sample, so every request of the next burst reads it.
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

async fn wait_rows(schema: &Schema, n: usize) {
    wait_for(
        Duration::from_secs(15),
        &format!("{n} ledger rows"),
        || async { (row_counts(schema).await.values().sum::<i64>() as usize >= n).then_some(()) },
    )
    .await;
}

/// The recorded rows, as the ledger has them.
async fn rows(schema: &Schema) -> Vec<Value> {
    let t = schema.table("decisions");
    sql(move |c| {
        c.query(
            &format!(
                "SELECT request_id, tier, reason, signal_pressure, signal_queue_depth, sla_violated,
                        inputs FROM {t}"
            ),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| {
            json!({
                "request_id": r.get::<_, String>(0),
                "tier": r.get::<_, String>(1),
                "reason": r.get::<_, String>(2),
                "pressure": r.get::<_, Option<f64>>(3),
                "queue_depth": r.get::<_, Option<f64>>(4),
                "sla_violated": r.get::<_, Option<bool>>(5),
                // Binary (first byte 0), decoded to the object form; `null` when unreadable.
                "inputs": r.get::<_, Option<Vec<u8>>>(6).map(|b| {
                    let i = (b.first() == Some(&0))
                        .then(|| sluice_record::binary::decode(&b))
                        .flatten();
                    serde_json::to_value(i).unwrap()
                }),
            })
        })
        .collect()
    })
    .await
}

/// Runs `sluice replay ARGS --format json` and parses its report.
fn replay(args: &[&str]) -> Value {
    let out = std::process::Command::new(BIN)
        .arg("replay")
        .args(args)
        .args(["--format", "json"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "sluice replay {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn replay_text(args: &[&str]) -> String {
    let out = std::process::Command::new(BIN)
        .arg("replay")
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

/// A candidate config file in the recording's directory: its config with `patch`.
fn candidate(s: &Sluice, patch: Value) -> std::path::PathBuf {
    let mut c: Value =
        serde_yaml::from_str(&std::fs::read_to_string(s.dir.join("sluice.yaml")).unwrap()).unwrap();
    merge(&mut c, patch);
    let p = s.dir.join("candidate.yaml");
    std::fs::write(&p, serde_yaml::to_string(&c).unwrap()).unwrap();
    p
}

fn path(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn changed_ids(report: &Value) -> BTreeSet<String> {
    report["changes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["request_id"].as_str().unwrap().to_string())
        .collect()
}

fn assert_nothing_changes(report: &Value, rows: usize) {
    assert_eq!(report["records"]["read"], rows, "{report:#}");
    assert_eq!(
        report["records"]["replayed"], rows,
        "every request was decided by the policy"
    );
    assert_eq!(report["total"]["changed"], 0, "{:#}", report["changes"]);
    assert_eq!(report["total"]["reason_only"], 0);
    assert_eq!(
        report["total"]["sla"]["recorded"],
        report["total"]["sla"]["estimated"]
    );
    // Judged on the objectives they were recorded under: every dimension's attainment too.
    for tier in ["Guaranteed", "Standard", "Best-Effort"] {
        let a = &report["tiers"][tier]["attainment"];
        assert_eq!(a["recorded"], a["estimated"], "{tier}: {a:#}");
    }
}

/// Thresholds mode: the ledger replayed with the config in force changes nothing; with
/// Best-Effort's KV-pressure critical_at lowered from 60 to 40, exactly the Best-Effort
/// requests the ledger shows admitted at 40 % or more turn into refusals.
/// The ledger since `since` replayed under the config that recorded it: pass, degrade and
/// reject were all recorded (so the check can fail), and no decision changes.
fn replay_ledger_unchanged(
    config: &std::path::Path,
    schema: &Schema,
    since: &str,
    sent: usize,
) -> Value {
    let out = replay(&[
        "--config",
        path(config),
        "--database-url",
        PG_URL,
        "--schema",
        &schema.0,
        "--since",
        since,
    ]);
    let actions = &out["total"]["recorded"];
    for a in ["pass", "degrade", "reject"] {
        assert!(
            actions[a].as_u64().unwrap() > 0,
            "no {a} recorded: {actions}"
        );
    }
    assert_nothing_changes(&out, sent);
    out
}

#[tokio::test]
async fn the_ledger_replays_unchanged_under_its_config_and_a_stricter_threshold_is_counted() {
    let od = sim("llama-3-70b", &["--itl-ms", "1.5"]).await;
    let sp = sim("llama-3-70b", &["--itl-ms", "1.5"]).await;
    let schema = create_schema().await;
    let cfg = recording(&od, &sp, &schema, json!({}));
    let since = now_ms().to_string();
    let s = Arc::new(serve(&cfg).await);

    let mut sent = 0;
    for usage in [
        Some(0.2),
        Some(0.45),
        Some(0.65),
        Some(0.75),
        Some(0.95),
        None,
    ] {
        pin_kv(&s, &od, usage).await;
        sent += burst(&s, &TENANTS, 4).await;
    }
    wait_rows(&schema, sent).await;
    let rows = rows(&schema).await;
    assert_eq!(rows.len(), sent);
    // The ledger stores them in their binary form; they read back whole, and
    // /decisions/recent and the export write them as objects.
    assert!(
        rows.iter().all(|r| r["inputs"]["v"] == 2),
        "every row has binary inputs: {}",
        rows[0]["inputs"]
    );
    let recent = s.recent("limit=3").await;
    assert!(recent
        .iter()
        .all(|d| d["inputs"]["decided"]["action"].is_string()));

    // The test can only fail if the recording exercised the policy: several actions.
    let recorded = replay_ledger_unchanged(&s.dir.join("sluice.yaml"), &schema, &since, sent);
    assert_eq!(recorded["state"]["tier_state_rebuilt"], 0);

    // By hand from the rows: Best-Effort is Critical at pressure ≥ 40 or queue ≥ 8 now.
    let be: Vec<&Value> = rows.iter().filter(|r| r["tier"] == "Best-Effort").collect();
    let refused_now = |r: &Value| {
        r["pressure"].as_f64().is_some_and(|p| p >= 40.0)
            || r["queue_depth"].as_f64().is_some_and(|q| q >= 8.0)
    };
    let expected: Vec<&Value> = be
        .iter()
        .copied()
        .filter(|r| !r["reason"].as_str().unwrap().starts_with("reject_") && refused_now(r))
        .collect();
    assert!(
        !expected.is_empty(),
        "the 45 % phase admitted Best-Effort under the recorded thresholds"
    );
    let count = |violated: bool| {
        expected
            .iter()
            .filter(|r| r["sla_violated"] == violated)
            .count()
    };

    let strict = candidate(
        &s,
        json!({"tiers": {"Best-Effort": {"thresholds": {"pressure": {"critical_at": 40}}}}}),
    );
    let args = [
        "--config",
        path(&strict),
        "--database-url",
        PG_URL,
        "--schema",
        &schema.0,
        "--since",
        &since,
    ];
    let r = replay(&args);
    let n = expected.len();
    assert_eq!(r["total"]["changed"], n, "{:#}", r["changes"]);
    let t = &r["tiers"]["Best-Effort"];
    assert_eq!(t["changed"], n);
    assert_eq!(t["transitions"], json!({"pass->reject": n}));
    assert_eq!(
        t["candidate"]["reject"].as_u64().unwrap() - t["recorded"]["reject"].as_u64().unwrap(),
        n as u64
    );
    assert_eq!(t["sla"]["late_to_refused"], count(true));
    assert_eq!(t["sla"]["on_time_to_refused"], count(false));
    assert_eq!(r["tiers"]["Standard"]["changed"], 0);
    assert_eq!(r["tiers"]["Guaranteed"]["changed"], 0);
    assert_eq!(r["tenants"]["batch-analytics"]["changed"], n);
    assert_eq!(
        r["state"]["tier_state_rebuilt"],
        be.len(),
        "only Best-Effort's rules differ"
    );
    let ids: BTreeSet<String> = expected
        .iter()
        .map(|r| r["request_id"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(changed_ids(&r), ids);
    for c in r["changes"].as_array().unwrap() {
        assert_eq!(c["candidate"]["action"], "reject");
        assert_eq!(c["candidate"]["reason"], "reject_pressure_critical");
        assert_eq!(c["estimated_outcome"], "refused");
    }
    let text = replay_text(&args);
    assert!(
        text.contains(&format!("changed decisions ({n}, in arrival order")),
        "{text}"
    );
    assert!(text.contains(ids.first().unwrap().as_str()), "{text}");
    assert!(
        text.contains("estimator:") && text.contains("limits:"),
        "{text}"
    );
    assert!(text.contains("attainment per tier"), "{text}");

    // A Standard objective no answer meets (its first token within 1 ms, 1 ms a token after):
    // no decision changes, and every Standard answer served is judged late on both dimensions
    // (a whole answer by the stream's deadline, 1 ms a token in all).
    let tight = candidate(
        &s,
        json!({"tiers": {"Standard": {"slo": {"ttft_ms": 1, "tpot_ms": 1}}}}),
    );
    let r = replay(&[
        "--config",
        path(&tight),
        "--database-url",
        PG_URL,
        "--schema",
        &schema.0,
        "--since",
        &since,
    ]);
    assert_eq!(r["total"]["changed"], 0, "{:#}", r["changes"]);
    let served = rows
        .iter()
        .filter(|r| r["tier"] == "Standard" && !r["sla_violated"].is_null())
        .count();
    assert!(served > 0, "Standard was served");
    let st = &r["tiers"]["Standard"];
    let a = &st["attainment"];
    assert_eq!(a["in_force"], json!(["ttft", "tpot"]), "{a:#}");
    for dim in ["ttft", "tpot", "overall"] {
        assert_eq!(a["estimated"][dim]["judged"], served, "{dim}: {a:#}");
        assert_eq!(a["estimated"][dim]["on_time"], 0, "{dim}: {a:#}");
    }
    assert_eq!(st["sla"]["estimated"]["late"], served);
    assert_eq!(st["sla"]["estimated"]["on_time"], 0);
    // The other tiers' objectives did not change: nor did their verdicts.
    for tier in ["Guaranteed", "Best-Effort"] {
        let a = &r["tiers"][tier]["attainment"];
        assert_eq!(a["recorded"], a["estimated"], "{tier}: {a:#}");
    }
}

/// Adaptive mode, read from JSONL: the ledger's export and the request log both replay
/// unchanged under the config in force; with the KV rail lowered to 40 %, every lower-tier
/// request admitted on a pool at 40 % or more is shed, and nothing else changes.
#[tokio::test]
async fn jsonl_exports_and_the_request_log_replay_like_the_ledger_in_adaptive_mode() {
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let schema = create_schema().await;
    let cfg = recording(
        &od,
        &sp,
        &schema,
        json!({
            "policy": {"mode": "adaptive",
                       // A twentieth of a step a sample (every 100 ms here): the climb through
                       // Standard's cap lasts seconds, so its bursts meet it however fast a
                       // busy machine puts Guaranteed past its target.
                       "adaptive": {"window_ms": 2500, "min_samples": 3, "hold_ms": 500,
                                    "max_step_up": 0.05, "min_step_up": 0.05}},
            "tiers": {"Guaranteed": {"sla_target_ms": 1000}},
            // With a ledger the log keeps only exceptions, without the inputs, unless asked.
            "decisions": {"log_inputs": true, "log_requests": "all"},
        }),
    );
    let since = now_ms().to_string();
    let s = Arc::new(serve(&cfg).await);

    let mut sent = burst(&s, &TENANTS, 3).await;
    // KV at 50 %: no SLA is at risk, everything is admitted.
    pin_kv(&s, &od, Some(0.5)).await;
    sent += burst(&s, &TENANTS, 3).await;
    pin_kv(&s, &od, None).await;
    // On-demand slow and queueing: Guaranteed's answers take ~0.9 s of its 1 s, the level
    // rises a little at a time and Standard is capped before anything is shed.
    sim_admin(&od, "/admin/latency", json!({"extra_ms": 600})).await;
    sim_admin(&od, "/admin/kv", json!({"waiting": 1})).await;
    let mut degraded = false;
    for _ in 0..40 {
        sent += burst(&s, &["support-bot"], 5).await;
        sent += burst(&s, &["coding-assistant"], 4).await;
        let recent = s.recent("limit=4&tier=Standard").await;
        if recent.iter().any(|d| d["decision"] == "degrade") {
            degraded = true;
            break;
        }
    }
    assert!(degraded, "Standard was never capped");
    sim_admin(&od, "/admin/latency", json!({"extra_ms": 0})).await;
    sim_admin(&od, "/admin/kv", json!({"waiting": null})).await;
    // KV at the rail: Standard shed at once.
    pin_kv(&s, &od, Some(1.0)).await;
    sent += burst(&s, &TENANTS, 2).await;
    pin_kv(&s, &od, None).await;
    wait_rows(&schema, sent).await;

    let dir = s.dir.clone();
    let export = dir.join("export.jsonl");
    let out = std::process::Command::new(BIN)
        .args([
            "replay",
            "export",
            "--database-url",
            PG_URL,
            "--schema",
            &schema.0,
        ])
        .args(["--since", &since, "--output", path(&export)])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let exported: Vec<Value> = std::fs::read_to_string(&export)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(exported.len(), sent);
    assert!(exported.iter().all(|r| r["inputs"]["v"] == 2));
    let log = dir.join("requests.jsonl");
    let logged = s
        .log_when("a line for each request", |log| {
            log.matches("\"request_id\"").count() >= sent
        })
        .await;
    std::fs::write(&log, logged).unwrap();

    let config = dir.join("sluice.yaml");
    let from_ledger = replay_ledger_unchanged(&config, &schema, &since, sent);
    for file in [&export, &log] {
        let r = replay(&["--config", path(&config), "--jsonl", path(file)]);
        assert_nothing_changes(&r, sent);
        assert_eq!(r["tiers"], from_ledger["tiers"]);
        assert_eq!(r["tenants"], from_ledger["tenants"]);
    }

    // By hand from the export: a non-Guaranteed request is shed at once when the pool it was
    // judged on is at 40 % KV or more; the rows the recorded policy refused stay refused.
    let expected: BTreeSet<String> = exported
        .iter()
        .filter(|r| r["tier"] != "Guaranteed")
        .filter(|r| r["inputs"]["decided"]["action"] != "reject")
        .filter(|r| {
            let pool = usize::from(r["inputs"]["decided"]["pool"] == "spot");
            r["inputs"]["pools"][pool]["pressure"]
                .as_f64()
                .is_some_and(|p| p >= 40.0)
        })
        .map(|r| r["request_id"].as_str().unwrap().to_string())
        .collect();
    assert!(!expected.is_empty(), "the 50 % phase admitted Standard");
    let strict = candidate(
        &s,
        json!({"policy": {"adaptive": {"rail_pressure_at": 40}}}),
    );
    let r = replay(&["--config", path(&strict), "--jsonl", path(&export)]);
    assert_eq!(changed_ids(&r), expected, "{:#}", r["changes"]);
    assert_eq!(r["total"]["changed"], expected.len());
    assert_eq!(r["tiers"]["Guaranteed"]["changed"], 0);
    assert_eq!(
        r["state"]["level_under_other_knobs"], sent,
        "the rail is a controller knob: the report says the levels are the recorded ones"
    );
    for c in r["changes"].as_array().unwrap() {
        assert_eq!(c["candidate"]["reason"], "reject_pressure_rail", "{c}");
    }
    let rails = exported
        .iter()
        .filter(|r| r["reason"] == "reject_pressure_rail")
        .count();
    assert!(rails > 0, "the rail phase shed Standard");
    assert_eq!(
        r["total"]["candidate"]["reject"].as_u64().unwrap(),
        r["total"]["recorded"]["reject"].as_u64().unwrap() + expected.len() as u64
    );
}
