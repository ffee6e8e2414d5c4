//! What Sluice exports for monitoring, checked against a live `sluice serve`:
//! - `signals.source: both` with Prometheus unreachable: the direct scrape stands in and the
//!   outage shows in `/status` and in `sluice_dependency_up{dependency="prometheus"} 0`;
//! - every metric family the issue lists is on `/metrics` after real traffic, with the latency
//!   buckets it asks for;
//! - `k8s/grafana-dashboard.json` is valid JSON whose every PromQL expression names only metrics
//!   that live `/metrics` page has;
//! - `conf/prometheus.yml` passes `promtool check config`.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::time::Duration;

const GRAFANA: &str = include_str!("../k8s/grafana-dashboard.json");

/// Metric names in a PromQL expression: identifiers that are not functions, aggregations,
/// keywords, label names in grouping clauses, label matchers, ranges or string literals.
fn promql_metric_names(expr: &str) -> BTreeSet<String> {
    const KEYWORDS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        "and",
        "or",
        "unless",
    ];
    let chars: Vec<char> = expr.chars().collect();
    let mut names = BTreeSet::new();
    let mut i = 0;
    let mut skip_group = false;
    let ident_start = |c: char| c.is_ascii_alphabetic() || c == '_' || c == ':';
    let ident_char = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    while i < chars.len() {
        let c = chars[i];
        match c {
            '"' | '\'' => {
                i += 1;
                while i < chars.len() && chars[i] != c {
                    i += if chars[i] == '\\' { 2 } else { 1 };
                }
                i += 1;
            }
            '{' | '[' => {
                let close = if c == '{' { '}' } else { ']' };
                while i < chars.len() && chars[i] != close {
                    if chars[i] == '"' {
                        i += 1;
                        while i < chars.len() && chars[i] != '"' {
                            i += if chars[i] == '\\' { 2 } else { 1 };
                        }
                    }
                    i += 1;
                }
                i += 1;
            }
            '(' if skip_group => {
                while i < chars.len() && chars[i] != ')' {
                    i += 1;
                }
                i += 1;
                skip_group = false;
            }
            c if c.is_ascii_digit() || c == '.' => {
                while i < chars.len() && (chars[i].is_ascii_alphanumeric() || chars[i] == '.') {
                    i += 1;
                }
            }
            '$' => {
                i += 1;
                while i < chars.len() && ident_char(chars[i]) {
                    i += 1;
                }
            }
            c if ident_start(c) => {
                let start = i;
                while i < chars.len() && ident_char(chars[i]) {
                    i += 1;
                }
                let word: String = chars[start..i].iter().collect();
                let mut j = i;
                while j < chars.len() && chars[j].is_whitespace() {
                    j += 1;
                }
                let rest: String = chars[j..].iter().collect();
                // `sum(…)`, and aggregations written `sum by (…) (…)`.
                let is_call = rest.starts_with('(')
                    || ["by", "without"].iter().any(|k| {
                        rest.strip_prefix(k)
                            .is_some_and(|r| r.trim_start().starts_with('('))
                    });
                skip_group = false;
                if KEYWORDS.contains(&word.as_str()) {
                    skip_group = matches!(
                        word.as_str(),
                        "by" | "without" | "on" | "ignoring" | "group_left" | "group_right"
                    );
                } else if !is_call {
                    names.insert(word);
                }
            }
            _ => i += 1,
        }
    }
    names
}

#[test]
fn promql_names_are_extracted() {
    let names = promql_metric_names(
        r#"histogram_quantile(0.95, sum by (tier, le) (rate(sluice_request_duration_seconds_bucket{tier="a",le=~"1|1.0"}[$__rate_interval]))) / on (tier) group_left max by (tier) (sluice_tier_sla_target_seconds) or vector(0)"#,
    );
    let expected: BTreeSet<String> = [
        "sluice_request_duration_seconds_bucket",
        "sluice_tier_sla_target_seconds",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    assert_eq!(names, expected);
}

/// Metric names on a live `/metrics` page.
fn exported_names(text: &str) -> BTreeSet<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .map(str::to_string)
        .collect()
}

/// Every panel with queries, rows' nested panels included.
fn panels(dash: &Value) -> Vec<&Value> {
    let mut out = Vec::new();
    for p in dash["panels"].as_array().expect("panels array") {
        if p["type"] == "row" {
            out.extend(p["panels"].as_array().into_iter().flatten());
        } else {
            out.push(p);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_sources_exported_metrics_and_the_grafana_dashboard() {
    let on_demand = sim("llama-3-70b", &[]).await;
    let spot = sim("llama-3-70b", &[]).await;
    // Nothing listens on this port: Prometheus is down from the start.
    let dead_prometheus = format!("http://127.0.0.1:{}", free_port());
    let mut cfg = config(&[&on_demand.addr], &[&spot.addr]);
    merge(
        &mut cfg,
        json!({
            "prometheus_url": dead_prometheus,
            "signals": {"source": "both", "prometheus_poll_ms": 200, "prometheus_timeout_ms": 300},
            "tiers": {"Standard": {"inflight_capacity": 1}},
        }),
    );
    let sluice = serve(&cfg).await;

    // `both`: Prometheus first, and the direct scrape when Prometheus has nothing.
    let s = wait_for(
        Duration::from_secs(10),
        "scrape standing in for Prometheus",
        || async {
            let s = sluice.status().await;
            let r = &s["signals"]["on-demand"]["pressure"];
            let ok = r["source"] == "scrape"
                && s["telemetry"]["prometheus"]["rounds"].as_u64() > Some(0);
            ok.then_some(s)
        },
    )
    .await;
    assert_eq!(s["telemetry"]["source"], "both");
    assert_eq!(s["dependencies"]["prometheus"], false);
    let prom = &s["telemetry"]["prometheus"];
    assert_eq!(prom["up"], false);
    assert!(
        prom["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("unreachable")),
        "{prom}"
    );
    assert!(prom["queries"][0]["query"]
        .as_str()
        .is_some_and(|q| q.contains(r#"vllm:kv_cache_usage_perc{pool="on-demand"}"#)));

    // Traffic for every request-path family: each tier passes, a Standard request queues
    // behind a slow one (capacity 1), Best-Effort is rejected under pressure.
    for tenant in ["support-bot", "coding-assistant", "batch-analytics"] {
        let r = sluice.chat(tenant, chat_body("llama-3-70b", Some(8))).await;
        assert_eq!(r.status(), 200, "{tenant}");
    }
    // A stream: its first token and pace (TTFT and TPOT histograms).
    let mut streamed = chat_body("llama-3-70b", Some(8));
    streamed["stream"] = json!(true);
    let r = sluice.chat("support-bot", streamed).await;
    assert_eq!(r.status(), 200);
    let _ = r.text().await;
    let r = client()
        .put(on_demand.url("/admin/latency"))
        .json(&json!({"extra_ms": 400}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (a, b) = tokio::join!(
        sluice.chat("coding-assistant", chat_body("llama-3-70b", Some(8))),
        async {
            tokio::time::sleep(Duration::from_millis(100)).await;
            sluice
                .chat("coding-assistant", chat_body("llama-3-70b", Some(8)))
                .await
        }
    );
    assert_eq!((a.status().as_u16(), b.status().as_u16()), (200, 200));
    assert_eq!(header(&b, "x-sluice-decision"), "queue");
    sluice.set_signal("/admin/pressure", 65.0).await;
    sluice.wait_tier_state("Best-Effort", "Critical").await;
    let r = sluice
        .chat("batch-analytics", chat_body("llama-3-70b", Some(8)))
        .await;
    assert_eq!(r.status(), 429);

    let text = sluice.metrics().await;
    let exported = exported_names(&text);
    for name in [
        "sluice_request_duration_seconds_bucket",
        "sluice_time_to_first_byte_seconds_bucket",
        "sluice_proxy_overhead_seconds_bucket",
        "sluice_queue_wait_seconds_bucket",
        "sluice_decisions_total",
        "sluice_inflight_requests",
        "sluice_idle_credits",
        "sluice_queued_requests",
        "sluice_tier_capacity",
        "sluice_signal_value",
        "sluice_signal_age_seconds",
        "sluice_signal_available",
        "sluice_tier_state",
        "sluice_spot_state",
        "sluice_tier_threshold",
        "sluice_tier_slo_target_seconds",
        "sluice_slo_violations_total",
        "sluice_ttft_seconds_bucket",
        "sluice_tpot_seconds_bucket",
        "sluice_fallback_active",
        "sluice_backend_healthy",
        "sluice_dependency_up",
    ] {
        assert!(exported.contains(name), "/metrics lacks {name}:\n{text}");
    }
    for line in [
        r#"sluice_dependency_up{dependency="prometheus"} 0"#,
        r#"sluice_tier_state{tier="Best-Effort"} 2"#,
        r#"sluice_tier_threshold{level="critical",signal="pressure",tier="Best-Effort"} 60"#,
        r#"sluice_decisions_total{decision="queue",reason="queue_released",tier="Standard"} 1"#,
    ] {
        assert!(text.contains(line), "/metrics lacks `{line}`:\n{text}");
    }
    // Latency buckets from 5 ms to 120 s; overhead in microseconds.
    assert!(text.contains(
        r#"sluice_request_duration_seconds_bucket{decision="pass",tier="Standard",le="0.005"}"#
    ));
    assert!(text.contains(
        r#"sluice_request_duration_seconds_bucket{decision="pass",tier="Standard",le="120"}"#
    ));
    assert!(text.contains(r#"sluice_proxy_overhead_seconds_bucket{tier="Standard",le="0.00001"}"#));
    assert!(
        !text.contains("tenant="),
        "no tenant label: its cardinality is unbounded"
    );

    // The Grafana dashboard reads only what Sluice exports.
    let dash: Value = serde_json::from_str(GRAFANA).expect("k8s/grafana-dashboard.json is JSON");
    let panels = panels(&dash);
    assert!(panels.len() >= 10, "dashboard has {} panels", panels.len());
    let mut ids = BTreeSet::new();
    let mut used = BTreeSet::new();
    for p in &panels {
        assert!(
            ids.insert(p["id"].as_u64().expect("panel id")),
            "duplicate panel id"
        );
        let targets = p["targets"].as_array().expect("panel targets");
        assert!(!targets.is_empty(), "panel {} has no query", p["title"]);
        for t in targets {
            let expr = t["expr"].as_str().expect("PromQL expr");
            let names = promql_metric_names(expr);
            assert!(!names.is_empty(), "{expr} names no metric");
            for n in names {
                assert!(
                    exported.contains(&n),
                    "panel {} uses {n}, which Sluice does not export",
                    p["title"]
                );
                used.insert(n);
            }
        }
    }
    for must in [
        "sluice_backend_healthy",
        "sluice_signal_value",
        "sluice_tier_threshold",
        "sluice_decisions_total",
        "sluice_request_duration_seconds_bucket",
        "sluice_ttft_seconds_bucket",
        "sluice_tpot_seconds_bucket",
        "sluice_tier_slo_target_seconds",
        "sluice_queued_requests",
        "sluice_inflight_requests",
    ] {
        assert!(used.contains(must), "the dashboard never shows {must}");
    }
}

#[test]
fn shipped_prometheus_config_is_valid() {
    let promtool = "/usr/bin/promtool";
    assert!(
        std::path::Path::new(promtool).exists(),
        "{promtool} is missing: install Debian's prometheus package (scripts/test.sh does)"
    );
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/conf/prometheus.yml");
    let out = std::process::Command::new(promtool)
        .args(["check", "config", path])
        .output()
        .expect("run promtool");
    assert!(
        out.status.success(),
        "promtool check config {path}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(path).unwrap();
    assert!(text.contains("labels: {pool: on-demand}") && text.contains("labels: {pool: spot}"));
}
