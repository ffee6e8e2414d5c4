//! The Prometheus poller: a background service that reads each pool's KV-cache usage and
//! waiting-queue depth from Prometheus' HTTP API (`GET /api/v1/query`) every
//! `signals.prometheus_poll_ms`, and hands them to the [`SignalHub`] aged by the timestamp
//! Prometheus returned with the sample (an instant query's evaluation time), so a late or cached
//! answer is held to the staleness bound like any other sample.
//!
//! Anything short of one finite number — unreachable, timed out, an HTTP or API error, no series,
//! several series, a non-numeric value, NaN — is recorded as *unavailable* with the reason, never
//! as a zero. With `signals.source: prometheus` the poller advances the policy once per round, as
//! the direct scraper does; with `both` the scraper does, so a sample is never counted twice
//! toward the stability model's consecutive-samples rule.
//!
//! Only those two gauges are asked of Prometheus. vLLM's delay and pace histograms — queue time
//! (`vllm:request_queue_time_seconds`), TTFT (`vllm:time_to_first_token_seconds`) and the
//! inter-token latency (`vllm:inter_token_latency_seconds`, or the older
//! `vllm:time_per_output_token_seconds`) — are read by the direct scrape alone, as interval means
//! over its own rounds ([`ScrapeRound`](super::hub::ScrapeRound)): with `signals.source:
//! prometheus` the adaptive controller has no queue delay, vLLM TTFT or pool pace, only Sluice's
//! own latencies; `both` gives it all of them.

use super::health::{PrometheusHealth, QueryHealth};
use super::hub::{PoolIndex, SignalHub};
use async_trait::async_trait;
use bytes::Bytes;
use futures_util::future::join_all;
use http_body_util::{BodyExt, Empty};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use pingora::server::ShutdownWatch;
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::ServiceWithDependents;
use serde_json::{json, Value};
use sluice_config::{Config, SignalSource};
use sluice_policy::{Millis, SignalKind};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// An instant-query answer is a few hundred bytes; anything near this is not one.
const MAX_RESPONSE_BYTES: usize = 1024 * 1024;
/// How much of an unexpected body is quoted in a reason.
const QUOTE_BYTES: usize = 200;

/// The Prometheus services `cfg` asks for: the poller when `signals.source` is `prometheus` or
/// `both`, nothing otherwise. The direct scraper is added separately (it runs unless the source
/// is `prometheus`). Also tells the hub which source runs, for `/status`.
pub fn services(cfg: &Config, hub: Arc<SignalHub>) -> Vec<Box<dyn ServiceWithDependents>> {
    hub.set_source(cfg.signals.source.as_str());
    match PrometheusPoller::new(cfg, hub) {
        Some(poller) => vec![Box::new(background_service("prometheus poller", poller))],
        None => {
            if cfg.prometheus_url.is_some() {
                log::warn!(
                    "{}",
                    json!({"event": "prometheus_unused", "message": "prometheus_url is set but signals.source is scrape: Prometheus is not queried"})
                );
            }
            Vec::new()
        }
    }
}

/// One instant-query sample: the value and its Unix timestamp in seconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sample {
    pub value: f64,
    pub timestamp: f64,
}

/// Why a query gave no value. `Transport` means Prometheus did not answer the API properly
/// (unreachable, timeout, HTTP error, not JSON); `Data` means it answered and the data is unusable.
#[derive(Debug, Clone, PartialEq)]
pub enum QueryError {
    Transport(String),
    Data(String),
}

impl QueryError {
    fn message(&self) -> &str {
        match self {
            QueryError::Transport(m) | QueryError::Data(m) => m,
        }
    }
}

/// Reads a `/api/v1/query` response. Pure, so every failure mode is a unit test.
pub fn parse_response(status: u16, body: &[u8]) -> Result<Sample, QueryError> {
    let json: Option<Value> = serde_json::from_slice(body).ok();
    if !(200..300).contains(&status) {
        let detail = json
            .as_ref()
            .and_then(api_error)
            .unwrap_or_else(|| quote(body));
        return Err(QueryError::Transport(format!("HTTP {status}: {detail}")));
    }
    let Some(json) = json else {
        return Err(QueryError::Transport(format!(
            "response is not JSON: {}",
            quote(body)
        )));
    };
    if json.get("status").and_then(Value::as_str) != Some("success") {
        let detail = api_error(&json).unwrap_or_else(|| quote(body));
        return Err(QueryError::Transport(format!("query failed: {detail}")));
    }
    let data = json.get("data").unwrap_or(&Value::Null);
    let result = data.get("result").unwrap_or(&Value::Null);
    let pair = match data.get("resultType").and_then(Value::as_str) {
        Some("vector") => {
            let series = result.as_array().map(Vec::as_slice).unwrap_or_default();
            match series {
                [] => {
                    return Err(QueryError::Data(
                        "no series: nothing matches the query (check the pool selector and that Prometheus scrapes the backends)".into(),
                    ))
                }
                [one] => one.get("value").unwrap_or(&Value::Null),
                many => {
                    return Err(QueryError::Data(format!(
                        "{} series: the query must aggregate to one (avg, sum)",
                        many.len()
                    )))
                }
            }
        }
        Some("scalar") => result,
        other => {
            return Err(QueryError::Data(format!(
                "unsupported result type {}: the query must return an instant vector or a scalar",
                other.unwrap_or("(none)")
            )))
        }
    };
    let (Some(ts), Some(raw)) = (
        pair.get(0).and_then(Value::as_f64),
        pair.get(1).and_then(Value::as_str),
    ) else {
        return Err(QueryError::Data(format!(
            "malformed sample {}",
            quote(pair.to_string().as_bytes())
        )));
    };
    let value: f64 = raw
        .parse()
        .map_err(|_| QueryError::Data(format!("non-numeric value {raw:?}")))?;
    if value.is_nan() {
        return Err(QueryError::Data("value is NaN".into()));
    }
    if !value.is_finite() {
        return Err(QueryError::Data(format!("value is not finite ({raw})")));
    }
    Ok(Sample {
        value,
        timestamp: ts,
    })
}

fn api_error(json: &Value) -> Option<String> {
    let error = json.get("error")?.as_str()?;
    Some(match json.get("errorType").and_then(Value::as_str) {
        Some(kind) => format!("{kind}: {error}"),
        None => error.to_string(),
    })
}

fn quote(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    match text.char_indices().nth(QUOTE_BYTES) {
        Some((cut, _)) => format!("{:?}…", &text[..cut]),
        None if text.is_empty() => "(empty body)".into(),
        None => format!("{text:?}"),
    }
}

/// Query-string encoding: everything but RFC 3986's unreserved characters is escaped.
pub fn encode_query(q: &str) -> String {
    let mut out = String::with_capacity(q.len() * 3);
    for b in q.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// A template from `signals.queries` with the pool's selector in place of `{selector}`.
pub fn render_query(template: &str, selector: &str) -> String {
    template.replace("{selector}", selector)
}

/// One query the poller runs each round.
#[derive(Debug, Clone)]
struct Target {
    pool: PoolIndex,
    /// The pool's name, for `/status`.
    pool_name: &'static str,
    kind: SignalKind,
    /// `None` when the pool has no selector: recorded as unavailable without asking.
    query: Option<String>,
}

impl Target {
    /// Prometheus' number → the hub's unit: KV usage is a 0–1 fraction reported in percent.
    fn convert(&self, v: f64) -> Result<f64, String> {
        match self.kind {
            // 1e-6 of slack: float sums over engines can land a hair above 1.
            SignalKind::Pressure if (0.0..=1.000_001).contains(&v) => Ok(100.0 * v.min(1.0)),
            SignalKind::Pressure => Err(format!(
                "KV usage {v} is not a 0–1 fraction (signals.queries.kv_usage must return vLLM's fraction)"
            )),
            _ if v >= 0.0 => Ok(v),
            _ => Err(format!("negative {} {v}", self.kind.as_str())),
        }
    }
}

type HttpClient = Client<HttpConnector, Empty<Bytes>>;

pub struct PrometheusPoller {
    hub: Arc<SignalHub>,
    /// `<prometheus_url>/api/v1/query?query=`
    endpoint: String,
    targets: Vec<Target>,
    interval: Duration,
    timeout: Duration,
    /// Whether this poller advances the policy (only when it is the sole source).
    ticks: bool,
    client: HttpClient,
    health: Mutex<PrometheusHealth>,
}

impl PrometheusPoller {
    /// `None` unless `signals.source` asks for Prometheus and `prometheus_url` is set (validation
    /// guarantees the URL whenever the source needs it).
    pub fn new(cfg: &Config, hub: Arc<SignalHub>) -> Option<Self> {
        let s = &cfg.signals;
        if !s.source.polls_prometheus() {
            return None;
        }
        let url = cfg
            .prometheus_url
            .as_deref()?
            .trim_end_matches('/')
            .to_string();
        let mut targets = Vec::new();
        for (pool, p) in cfg.pools.iter().enumerate() {
            let selector = s.pool_selectors.of(&p.name);
            // Named once for the process: the status rows borrow it.
            let pool_name: &'static str = Box::leak(p.name.clone().into_boxed_str());
            for (kind, template) in [
                (SignalKind::Pressure, &s.queries.kv_usage),
                (SignalKind::QueueDepth, &s.queries.waiting),
            ] {
                targets.push(Target {
                    pool,
                    pool_name,
                    kind,
                    query: (!selector.trim().is_empty()).then(|| render_query(template, &selector)),
                });
            }
        }
        let queries = targets
            .iter()
            .map(|t| QueryHealth {
                pool: t.pool_name,
                signal: t.kind.as_str(),
                query: t.query.clone(),
                error: None,
                last_good_at: None,
            })
            .collect();
        let health = PrometheusHealth {
            url: url.clone(),
            rounds: 0,
            last_round_at: 0,
            answered: false,
            last_answered_at: None,
            last_error: None,
            last_error_at: None,
            queries,
        };
        Some(Self {
            hub,
            endpoint: format!("{url}/api/v1/query?query="),
            targets,
            interval: Duration::from_millis(s.prometheus_poll_ms),
            timeout: Duration::from_millis(s.prometheus_timeout_ms),
            ticks: s.source == SignalSource::Prometheus,
            client: Client::builder(TokioExecutor::new()).build_http(),
            health: Mutex::new(health),
        })
    }

    async fn query(&self, query: &str) -> Result<Sample, QueryError> {
        let uri: http::Uri = format!("{}{}", self.endpoint, encode_query(query))
            .parse()
            .map_err(|e| QueryError::Transport(format!("bad query URL: {e}")))?;
        let fetch = async {
            let resp = self
                .client
                .get(uri)
                .await
                .map_err(|e| QueryError::Transport(format!("unreachable: {}", chain(&e))))?;
            let status = resp.status().as_u16();
            let body = http_body_util::Limited::new(resp.into_body(), MAX_RESPONSE_BYTES)
                .collect()
                .await
                .map_err(|e| QueryError::Transport(format!("reading the response: {e}")))?
                .to_bytes();
            parse_response(status, &body)
        };
        match tokio::time::timeout(self.timeout, fetch).await {
            Ok(r) => r,
            Err(_) => Err(QueryError::Transport(format!(
                "timed out after {} ms",
                self.timeout.as_millis()
            ))),
        }
    }

    /// Runs every query once, records the results in the hub, and advances the policy when this
    /// poller is the sole source.
    pub async fn poll_once(&self) {
        let results = join_all(self.targets.iter().map(|t| async move {
            match &t.query {
                Some(q) => Some(self.query(q).await),
                None => None,
            }
        }))
        .await;
        let now = self.hub.clock().now_ms();
        let wall_now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let mut health = self.health.lock().unwrap_or_else(|e| e.into_inner());
        let mut answered = true;
        let mut round_error = None;
        for ((target, result), qh) in self.targets.iter().zip(results).zip(&mut health.queries) {
            let outcome = match result {
                None => Err("no selector configured for this pool (signals.pool_selectors)".into()),
                Some(Ok(sample)) => {
                    // Prometheus' clock may run ahead of ours: a future sample is age 0.
                    let age_ms = ((wall_now - sample.timestamp) * 1000.0).max(0.0) as Millis;
                    target.convert(sample.value).map(|v| (v, age_ms))
                }
                Some(Err(e)) => {
                    if matches!(e, QueryError::Transport(_)) {
                        answered = false;
                    }
                    Err(e.message().to_string())
                }
            };
            match &outcome {
                Ok(_) => {
                    qh.error = None;
                    qh.last_good_at = Some(now);
                }
                Err(e) => {
                    qh.error = Some(e.clone());
                    round_error.get_or_insert_with(|| {
                        format!("{} {}: {e}", target.pool_name, target.kind.as_str())
                    });
                }
            }
            let outcome = outcome.map_err(|e| match qh.last_good_at {
                Some(t) => format!("{e} (last good sample {} ms ago)", now.saturating_sub(t)),
                None => e,
            });
            self.hub.record_polled(target.pool, target.kind, outcome);
        }
        health.rounds += 1;
        health.last_round_at = now;
        health.answered = answered;
        if answered {
            health.last_answered_at = Some(now);
        }
        if let Some(e) = round_error {
            health.last_error = Some(e);
            health.last_error_at = Some(now);
        }
        self.hub.set_prometheus_health(health.clone());
        drop(health);
        if self.ticks {
            self.hub.tick();
        }
    }
}

/// hyper-util's errors say only "client error (Connect)"; the cause is further down the chain.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

#[async_trait]
impl BackgroundService for PrometheusPoller {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        let mut ticker = tokio::time::interval(self.interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticker.tick() => self.poll_once().await,
                _ = shutdown.changed() => {
                    // Keep polling through the grace period so draining requests still see a
                    // live policy; the runtime drop ends this task.
                    if *shutdown.borrow() {
                        loop { ticker.tick().await; self.poll_once().await; }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(body: &str) -> Result<Sample, QueryError> {
        parse_response(200, body.as_bytes())
    }

    fn data_err(r: Result<Sample, QueryError>) -> String {
        match r {
            Err(QueryError::Data(m)) => m,
            other => panic!("expected a data error, got {other:?}"),
        }
    }

    fn transport_err(r: Result<Sample, QueryError>) -> String {
        match r {
            Err(QueryError::Transport(m)) => m,
            other => panic!("expected a transport error, got {other:?}"),
        }
    }

    #[test]
    fn one_series_and_scalar() {
        let v = ok(
            r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1700000000.5,"0.75"]}]}}"#,
        );
        assert_eq!(
            v,
            Ok(Sample {
                value: 0.75,
                timestamp: 1_700_000_000.5
            })
        );
        let s =
            ok(r#"{"status":"success","data":{"resultType":"scalar","result":[1700000001,"3"]}}"#);
        assert_eq!(s.unwrap().value, 3.0);
    }

    #[test]
    fn empty_result_is_unavailable_not_zero() {
        let m = data_err(ok(
            r#"{"status":"success","data":{"resultType":"vector","result":[]}}"#,
        ));
        assert!(m.starts_with("no series"), "{m}");
    }

    #[test]
    fn nan_inf_and_non_numeric_values_are_unavailable() {
        let body = |v: &str| {
            format!(
                r#"{{"status":"success","data":{{"resultType":"vector","result":[{{"metric":{{}},"value":[1700000000,"{v}"]}}]}}}}"#
            )
        };
        assert_eq!(data_err(ok(&body("NaN"))), "value is NaN");
        assert_eq!(data_err(ok(&body("+Inf"))), "value is not finite (+Inf)");
        assert_eq!(data_err(ok(&body("abc"))), r#"non-numeric value "abc""#);
        let m = data_err(ok(
            r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{},"value":[1700000000,5]}]}}"#,
        ));
        assert!(m.starts_with("malformed sample"), "{m}");
    }

    #[test]
    fn several_series_and_other_result_types_are_refused() {
        let m = data_err(ok(
            r#"{"status":"success","data":{"resultType":"vector","result":[{"metric":{"a":"1"},"value":[1,"1"]},{"metric":{"a":"2"},"value":[1,"2"]}]}}"#,
        ));
        assert!(m.starts_with("2 series"), "{m}");
        let m = data_err(ok(
            r#"{"status":"success","data":{"resultType":"matrix","result":[]}}"#,
        ));
        assert!(m.contains("unsupported result type matrix"), "{m}");
    }

    #[test]
    fn http_and_api_errors_name_the_cause() {
        let m = transport_err(parse_response(
            400,
            br#"{"status":"error","errorType":"bad_data","error":"parse error at char 5"}"#,
        ));
        assert_eq!(m, "HTTP 400: bad_data: parse error at char 5");
        let m = transport_err(parse_response(502, b"<html>Bad Gateway</html>"));
        assert_eq!(m, r#"HTTP 502: "<html>Bad Gateway</html>""#);
        let m = transport_err(parse_response(503, b""));
        assert_eq!(m, "HTTP 503: (empty body)");
        let m = transport_err(ok("not json"));
        assert!(m.starts_with("response is not JSON"), "{m}");
        let m = transport_err(ok(
            r#"{"status":"error","errorType":"timeout","error":"query timed out"}"#,
        ));
        assert_eq!(m, "query failed: timeout: query timed out");
    }

    #[test]
    fn queries_are_rendered_and_encoded() {
        let q = render_query(
            "avg(vllm:kv_cache_usage_perc{{selector}}) or avg(vllm:gpu_cache_usage_perc{{selector}})",
            r#"pool="spot""#,
        );
        assert_eq!(
            q,
            r#"avg(vllm:kv_cache_usage_perc{pool="spot"}) or avg(vllm:gpu_cache_usage_perc{pool="spot"})"#
        );
        assert_eq!(
            encode_query(r#"sum(x{pool="a b"})+1"#),
            "sum%28x%7Bpool%3D%22a%20b%22%7D%29%2B1"
        );
    }

    #[test]
    fn kv_usage_must_be_a_fraction() {
        let t = Target {
            pool: 0,
            pool_name: "on-demand",
            kind: SignalKind::Pressure,
            query: None,
        };
        assert_eq!(t.convert(0.75), Ok(75.0));
        assert!(t.convert(75.0).unwrap_err().contains("not a 0–1 fraction"));
        let w = Target {
            kind: SignalKind::QueueDepth,
            ..t
        };
        assert_eq!(w.convert(7.0), Ok(7.0));
        assert!(w.convert(-1.0).is_err());
    }
}
