//! Smoke tests of the benchmark harness (`sluice-bench`, bench/), so it cannot silently rot: its
//! live mode on the tiny scenario — real simulators, a real `sluice serve`, real HTTP — plus the
//! in-process model on the same arrivals; then every other built-in scenario compressed in time
//! (`--time-scale 0.05`: seed's 60 s become 3 s) in every mode. The compressed runs check that
//! the harness completes and reports a sane structure, never performance targets: at that scale
//! no scenario gets anywhere near its overload.
//!
//! Each test runs real processes and paces requests in real time, so they take turns (one lock
//! for the whole file): side by side on a 2-core machine they would slow each other down.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

static SERIAL: Mutex<()> = Mutex::new(());

/// `sluice` itself, which the live engine runs: built by the workspace's test command.
fn sluice_bin() -> PathBuf {
    sluice_testkit::binary("sluice").unwrap_or_else(|e| panic!("{e}"))
}

fn serial() -> MutexGuard<'static, ()> {
    // A failed test poisons the lock; the next one should still run.
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// An output directory, removed when the test ends (passed or not).
struct OutDir(PathBuf);

impl OutDir {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("sluice-bench-smoke-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Self(dir)
    }
}

impl Drop for OutDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `sluice-bench run` over one scenario, with the SLA-rate signal fed by the harness (no
/// PostgreSQL needed).
fn bench_run(scenario: &str, extra: &[&str], out: &Path) -> Output {
    let started = Instant::now();
    let run = Command::new(env!("CARGO_BIN_EXE_sluice-bench"))
        .args(["run", "--scenarios", scenario, "--engine", "both"])
        .args(["--sla-signal", "harness"])
        .args(extra)
        .arg("--out")
        .arg(out)
        .arg("--sluice-bin")
        .arg(sluice_bin())
        .output()
        .expect("run sluice-bench");
    eprintln!(
        "sluice-bench {scenario}: {:.1} s",
        started.elapsed().as_secs_f64()
    );
    assert!(
        run.status.success(),
        "sluice-bench {scenario} failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    run
}

fn read_report(out: &Path, scenario: &str) -> (Value, String) {
    let json = std::fs::read_to_string(out.join(format!("{scenario}.json")))
        .unwrap_or_else(|e| panic!("{scenario}.json: {e}"));
    let svg = std::fs::read_to_string(out.join(format!("{scenario}.svg")))
        .unwrap_or_else(|e| panic!("{scenario}.svg: {e}"));
    (serde_json::from_str(&json).unwrap(), svg)
}

fn run_key(r: &Value) -> String {
    format!(
        "{}/{}",
        r["engine"].as_str().unwrap(),
        r["mode"].as_str().unwrap()
    )
}

#[test]
fn live_tiny_scenario_reports_every_tier_with_sane_numbers() {
    let _turn = serial();
    let out = OutDir::new("tiny");
    bench_run("tiny", &["--modes", "direct,phase2"], &out.0);
    let (report, svg) = read_report(&out.0, "tiny");
    assert!(svg.starts_with("<svg") && svg.contains("phase2 (live)"));

    let runs = report["runs"].as_array().unwrap();
    let keys: Vec<String> = runs.iter().map(run_key).collect();
    assert_eq!(
        keys,
        ["model/direct", "model/phase2", "live/direct", "live/phase2"]
    );
    for r in runs {
        let name = run_key(r);
        assert_eq!(r["requests"], 40, "{name}");
        let tiers = r["tiers"].as_array().unwrap();
        let names: Vec<&str> = tiers.iter().map(|t| t["tier"].as_str().unwrap()).collect();
        assert_eq!(names, ["Guaranteed", "Standard", "Best-Effort"], "{name}");
        let total: u64 = tiers.iter().map(|t| t["requests"].as_u64().unwrap()).sum();
        assert_eq!(total, 40, "{name}");
        for t in tiers {
            let f = |k: &str| t[k].as_f64().unwrap_or_else(|| panic!("{name} {k}: {t}"));
            // Three seconds of light traffic: everything completes, well within every target.
            assert_eq!(t["completed"], t["requests"], "{name}: {t}");
            assert!(f("viol_all_pct") <= 10.0, "{name}: {t}");
            let (p50, p95, p99) = (f("p50_ms"), f("p95_ms"), f("p99_ms"));
            assert!(
                0.0 < p50 && p50 <= p95 && p95 <= p99 && p99 < 2000.0,
                "{name}: {t}"
            );
            assert!(
                f("goodput_rps") > 0.0 && f("goodput_tps") > 0.0,
                "{name}: {t}"
            );
        }
        if name == "live/phase2" {
            let p50 = r["overhead_p50_ms"]
                .as_f64()
                .expect("overhead from /metrics");
            assert!(p50 > 0.0 && p50 < 5.0, "{p50}");
            assert!(r["transitions"].is_u64() && r["flaps"] == 0);
        }
    }
}

/// Objectives in TTFT and TPOT (`--slo-x`): the config carries `slo` targets, the live run
/// measures each stream's first token and pace, and every tier's row judges each dimension.
#[test]
fn live_tiny_with_ttft_and_tpot_objectives() {
    let _turn = serial();
    let out = OutDir::new("tiny-slo");
    bench_run(
        "tiny",
        &["--modes", "direct,adaptive", "--slo-x", "4"],
        &out.0,
    );
    let (report, _) = read_report(&out.0, "tiny+slo4");
    let slo = &report["scenario"]["slo_ms"];
    for tier in ["Guaranteed", "Standard", "Best-Effort"] {
        let t = |k: &str| {
            slo[tier][k]
                .as_u64()
                .unwrap_or_else(|| panic!("{tier} {k}: {slo}"))
        };
        assert!(t("ttft_ms") > 0 && t("tpot_ms") > 0, "{slo}");
    }
    let runs = report["runs"].as_array().unwrap();
    let keys: Vec<String> = runs.iter().map(run_key).collect();
    assert_eq!(
        keys,
        [
            "model/direct",
            "model/adaptive",
            "live/direct",
            "live/adaptive"
        ]
    );
    for r in runs {
        let name = run_key(r);
        assert_eq!(r["per_dimension"], true, "{name}");
        check_run(&name, r);
        let mut paced = 0;
        for t in r["tiers"].as_array().unwrap() {
            let attain = t["attain_dim_pct"].as_array().unwrap();
            for (i, a) in attain.iter().enumerate() {
                // TTFT and TPOT are judged, the end-to-end latency is not.
                match (i, a.as_f64()) {
                    (0 | 1, Some(v)) => assert!((0.0..=100.0).contains(&v), "{name}: {t}"),
                    (2, None) => {}
                    _ => panic!("{name}: dimension {i}: {t}"),
                }
            }
            assert_eq!(
                t["rejected"], 0,
                "{name}: light traffic is refused nothing: {t}"
            );
            if let (Some(ttft), Some(tpot)) = (t["ttft_p50_ms"].as_f64(), t["tpot_p50_ms"].as_f64())
            {
                // Tiny's engines: a 5 ms first token plus prefill, 1 ms a token.
                assert!(ttft > 0.0 && ttft < 1000.0, "{name}: {t}");
                assert!(tpot > 0.2 && tpot < 100.0, "{name}: {t}");
                paced += 1;
            }
        }
        assert!(paced > 0, "{name}: no streamed tier reported TTFT and TPOT");
    }
}

/// Every mode; the harness skips those a scenario does not run in (`baseline` without
/// `baseline: true`, anything outside its `modes:`). All six scenarios in all modes took about
/// 65 s on a 2-core machine (debug build), so nothing is left out.
const MODES: &str = "baseline,direct,phase1,phase2";
const SMOKE_SCALE: &str = "0.05";

/// Runs a built-in scenario at smoke scale and checks the report's structure.
fn smoke(scenario: &str) {
    let _turn = serial();
    let out = OutDir::new(scenario);
    bench_run(
        scenario,
        &["--modes", MODES, "--time-scale", SMOKE_SCALE],
        &out.0,
    );
    let (report, svg) = read_report(&out.0, scenario);
    let s = &report["scenario"];
    let label = format!("time-scaled ×{SMOKE_SCALE}");
    assert!(
        s["description"].as_str().unwrap().contains(&label),
        "a scaled run must say so: {}",
        s["description"]
    );
    assert!(
        svg.starts_with("<svg") && svg.contains(&label),
        "{scenario}.svg"
    );

    let runs = report["runs"].as_array().unwrap();
    let keys: Vec<String> = runs.iter().map(run_key).collect();
    assert_eq!(keys, expected_runs(s), "{scenario}");
    let arrivals = s["requests"].as_u64().unwrap()
        + s["bursts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|b| b["requests"].as_u64().unwrap())
            .sum::<u64>();
    for r in runs {
        let name = format!("{scenario} {}", run_key(r));
        check_run(&name, r);
        if r["mode"] != "baseline" {
            assert_eq!(r["requests"], arrivals, "{name}");
        }
        if run_key(r) == "live/phase2" {
            let p50 = r["overhead_p50_ms"].as_f64();
            let p99 = r["overhead_p99_ms"].as_f64();
            assert!(
                p50.is_some_and(|p| p > 0.0) && p99 >= p50,
                "{name}: overhead from /metrics: {p50:?} {p99:?}"
            );
        }
    }
    // Both engines replay the very same arrivals, and baseline is direct's Guaranteed share.
    let counts = |key: &str| -> Vec<(String, u64)> {
        let r = runs.iter().find(|r| run_key(r) == key).unwrap();
        r["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| {
                (
                    t["tier"].as_str().unwrap().to_string(),
                    t["requests"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    for key in keys.iter().filter(|k| k.starts_with("model/")) {
        let live = key.replacen("model/", "live/", 1);
        assert_eq!(counts(key), counts(&live), "{scenario}: {key} vs {live}");
    }
    if keys.iter().any(|k| k == "live/baseline") {
        let direct = counts("live/direct");
        assert_eq!(counts("live/baseline"), direct[..1].to_vec(), "{scenario}");
    }
}

/// The (engine, mode) pairs the harness should have run, in its order.
fn expected_runs(scenario: &Value) -> Vec<String> {
    let only: Vec<&str> = scenario["modes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    let runs_in = |mode: &str| {
        (mode != "baseline" || scenario["baseline"] == true)
            && (only.is_empty() || only.contains(&mode))
    };
    let mut out = Vec::new();
    for engine in ["model", "live"] {
        for mode in MODES.split(',').filter(|m| runs_in(m)) {
            out.push(format!("{engine}/{mode}"));
        }
    }
    out
}

/// Structure only: every tier present and accounted for, counts and percentiles consistent.
fn check_run(name: &str, r: &Value) {
    let tiers = r["tiers"].as_array().unwrap();
    let names: Vec<&str> = tiers.iter().map(|t| t["tier"].as_str().unwrap()).collect();
    let expected: &[&str] = if r["mode"] == "baseline" {
        &["Guaranteed"]
    } else {
        &["Guaranteed", "Standard", "Best-Effort"]
    };
    assert_eq!(names, expected, "{name}");
    let requests = r["requests"].as_u64().unwrap();
    assert!(requests > 0, "{name}");
    let total: u64 = tiers.iter().map(|t| t["requests"].as_u64().unwrap()).sum();
    assert_eq!(total, requests, "{name}");
    assert_eq!(r["all"]["requests"], requests, "{name}");
    for t in tiers {
        let n = |k: &str| t[k].as_u64().unwrap_or_else(|| panic!("{name} {k}: {t}"));
        assert!(n("requests") > 0, "{name}: {t}");
        assert!(n("within_sla") <= n("completed"), "{name}: {t}");
        assert!(n("completed") <= n("requests"), "{name}: {t}");
        assert_eq!(
            n("completed") + n("rejected") + n("errors"),
            n("requests"),
            "{name}: {t}"
        );
        let p = |k: &str| t[k].as_f64();
        match (p("p50_ms"), p("p95_ms"), p("p99_ms")) {
            (Some(p50), Some(p95), Some(p99)) => {
                assert!(0.0 < p50 && p50 <= p95 && p95 <= p99, "{name}: {t}")
            }
            (None, None, None) => assert_eq!(n("completed"), 0, "{name}: {t}"),
            _ => panic!("{name}: some percentiles missing: {t}"),
        }
    }
}

#[test]
fn smoke_seed() {
    smoke("seed");
}

#[test]
fn smoke_seed_forced() {
    smoke("seed-forced");
}

#[test]
fn smoke_seed_defaults() {
    smoke("seed-defaults");
}

#[test]
fn smoke_overload() {
    smoke("overload");
}

#[test]
fn smoke_spot_failure() {
    smoke("spot-failure");
}

#[test]
fn smoke_bursty() {
    smoke("bursty");
}
