//! Smoke test of the benchmark harness (`sluice-bench`, bench/): its live mode on the tiny
//! scenario — real simulators, a real `sluice serve`, real HTTP — plus the in-process model on
//! the same arrivals, so the harness cannot silently rot. A few seconds of traffic.

use serde_json::Value;
use std::process::Command;

#[test]
fn live_tiny_scenario_reports_every_tier_with_sane_numbers() {
    let out = std::env::temp_dir().join(format!("sluice-bench-smoke-{}", std::process::id()));
    let run = Command::new(env!("CARGO_BIN_EXE_sluice-bench"))
        .args(["run", "--scenarios", "tiny", "--engine", "both"])
        .args(["--modes", "direct,phase2", "--sla-signal", "harness"])
        .arg("--out")
        .arg(&out)
        .arg("--sluice-bin")
        .arg(env!("CARGO_BIN_EXE_sluice"))
        .output()
        .expect("run sluice-bench");
    assert!(
        run.status.success(),
        "sluice-bench failed:\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("tiny.json")).unwrap()).unwrap();
    let svg = std::fs::read_to_string(out.join("tiny.svg")).unwrap();
    let _ = std::fs::remove_dir_all(&out);
    assert!(svg.starts_with("<svg") && svg.contains("phase2 (live)"));

    let runs = report["runs"].as_array().unwrap();
    let key = |r: &Value| {
        format!(
            "{}/{}",
            r["engine"].as_str().unwrap(),
            r["mode"].as_str().unwrap()
        )
    };
    let keys: Vec<String> = runs.iter().map(key).collect();
    assert_eq!(
        keys,
        ["model/direct", "model/phase2", "live/direct", "live/phase2"]
    );
    for r in runs {
        let name = key(r);
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
