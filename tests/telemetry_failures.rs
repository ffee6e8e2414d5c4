//! How the Prometheus poller treats answers that carry no usable number: an HTTP error, a hung
//! server, NaN, no series, a non-numeric value and a sample older than the staleness bound each
//! leave the signal unavailable with a reason that names the cause — never a panic, never a zero.
//! A poll round advances the policy only when Prometheus is the sole source.
//!
//! The server here is a tiny fake speaking Prometheus' `/api/v1/query` answers. A fake is
//! acceptable only because a real Prometheus cannot be made to return these failures on demand;
//! the healthy path and the outage are tested against a real one in `telemetry_prometheus.rs`.

use sluice_config::Config;
use sluice_policy::Clock;
use sluice_policy::SignalKind;
use sluice_runtime::signals::prometheus::PrometheusPoller;
use sluice_runtime::signals::{SignalHub, SignalReading};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Answers by the `case` label the pool selector puts into the query.
async fn fake_prometheus() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        loop {
            let Ok((mut sock, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut req = Vec::new();
                let mut buf = [0u8; 4096];
                while !req.windows(4).any(|w| w == b"\r\n\r\n") {
                    match sock.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => req.extend_from_slice(&buf[..n]),
                    }
                }
                let head = String::from_utf8_lossy(&req).to_string();
                let now = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap()
                    .as_secs_f64();
                let vector = |ts: f64, v: &str| {
                    format!(
                        r#"{{"status":"success","data":{{"resultType":"vector","result":[{{"metric":{{}},"value":[{ts},"{v}"]}}]}}}}"#
                    )
                };
                let (code, body) = if head.contains("http503") {
                    (
                        503,
                        r#"{"status":"error","errorType":"unavailable","error":"TSDB not ready"}"#
                            .to_string(),
                    )
                } else if head.contains("hang") {
                    tokio::time::sleep(Duration::from_secs(30)).await;
                    return;
                } else if head.contains("nan") {
                    (200, vector(now, "NaN"))
                } else if head.contains("empty") {
                    (
                        200,
                        r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#
                            .to_string(),
                    )
                } else if head.contains("text") {
                    (200, vector(now, "lots"))
                } else if head.contains("old") {
                    (200, vector(now - 60.0, "0.5"))
                } else {
                    (200, vector(now, "0.5"))
                };
                let resp = format!(
                    "HTTP/1.1 {code} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                    body.len()
                );
                let _ = sock.write_all(resp.as_bytes()).await;
            });
        }
    });
    addr
}

/// A hub and a poller against the fake with these two pool selectors.
fn poller(
    addr: &str,
    source: &str,
    on_demand: &str,
    spot: &str,
) -> (Arc<SignalHub>, PrometheusPoller) {
    let yaml = format!(
        r#"
prometheus_url: "http://{addr}"
signals:
  source: {source}
  prometheus_poll_ms: 200
  prometheus_timeout_ms: 300
  stale_after_ms: 5000
  pool_selectors: {{on-demand: 'case="{on_demand}"', spot: 'case="{spot}"'}}
"#
    );
    let cfg = Config::from_yaml(&yaml, "test.yaml", Path::new("."), None, &|_| None).unwrap();
    let hub = Arc::new(SignalHub::pair(
        Clock::new(),
        cfg.signals.stale_after_ms,
        cfg.policy_rules(),
    ));
    let poller = PrometheusPoller::new(&cfg, Arc::clone(&hub)).expect("source polls prometheus");
    (hub, poller)
}

/// One poll round with these two pool selectors; returns both pools' pressure.
async fn poll(addr: &str, on_demand: &str, spot: &str) -> (SignalReading, SignalReading) {
    let (hub, poller) = poller(addr, "prometheus", on_demand, spot);
    poller.poll_once().await;
    let now = hub.clock().now_ms();
    (
        hub.reading(0, SignalKind::Pressure, now),
        hub.reading(1, SignalKind::Pressure, now),
    )
}

fn why(r: &SignalReading) -> String {
    assert_eq!(r.value, None, "{r:?} must be unavailable, not a number");
    assert_eq!(r.source, "none");
    r.unavailable.clone().unwrap_or_default()
}

#[tokio::test]
async fn http_error_and_timeout_are_unavailable_with_their_cause() {
    let addr = fake_prometheus().await;
    let (a, b) = poll(&addr, "http503", "hang").await;
    assert_eq!(why(&a), "prometheus: HTTP 503: unavailable: TSDB not ready");
    assert_eq!(why(&b), "prometheus: timed out after 300 ms");
}

#[tokio::test]
async fn nan_empty_non_numeric_and_stale_answers_are_unavailable() {
    let addr = fake_prometheus().await;
    let (a, b) = poll(&addr, "nan", "empty").await;
    assert_eq!(why(&a), "prometheus: value is NaN");
    assert!(why(&b).starts_with("prometheus: no series"), "{b:?}");
    let (a, b) = poll(&addr, "text", "old").await;
    assert_eq!(why(&a), r#"prometheus: non-numeric value "lots""#);
    let stale = why(&b);
    assert!(
        stale.starts_with("prometheus: stale: sample is 6") && stale.ends_with(" ms old"),
        "the sample's own timestamp (60 s ago) makes it stale: {stale}"
    );
}

#[tokio::test]
async fn a_good_answer_is_read_as_percent() {
    let addr = fake_prometheus().await;
    let (a, _) = poll(&addr, "fresh", "fresh").await;
    assert_eq!((a.value, a.source), (Some(50.0), "prometheus"));
}

#[tokio::test]
async fn only_the_sole_source_advances_the_policy() {
    let addr = fake_prometheus().await;
    // `both`: the direct scraper ticks the policy; a poll round must not count as a sample.
    let (hub, both) = poller(&addr, "both", "fresh", "fresh");
    let before = hub.state();
    both.poll_once().await;
    assert!(Arc::ptr_eq(&before, &hub.state()));
    let (hub, alone) = poller(&addr, "prometheus", "fresh", "fresh");
    let before = hub.state();
    alone.poll_once().await;
    assert!(!Arc::ptr_eq(&before, &hub.state()));
    assert_eq!(hub.state().domain(0).signals.pressure, Some(50.0));
}
