//! The telemetry keys (`signals.source`, the Prometheus poller's knobs, `prometheus_url`):
//! defaults, environment overrides, and errors that name the file, the key and the reason.

use sluice_config::{Config, ConfigError, SignalSource};
use std::path::Path;

fn load(yaml: &str, env: &[(&str, &str)]) -> Result<Config, ConfigError> {
    let env: Vec<(String, String)> = env
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let lookup = move |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
    Config::from_yaml(yaml, "sluice.yaml", Path::new("."), None, &lookup)
}

fn error(yaml: &str) -> ConfigError {
    load(yaml, &[]).expect_err("config must be refused")
}

#[test]
fn defaults_scrape_and_read_both_vllm_generations() {
    let cfg = load("{}", &[]).unwrap();
    let s = &cfg.signals;
    assert_eq!(s.source, SignalSource::Scrape);
    assert_eq!((s.prometheus_poll_ms, s.prometheus_timeout_ms), (1000, 500));
    assert_eq!(s.pool_selectors.of("on-demand"), r#"pool="on-demand""#);
    assert_eq!(s.pool_selectors.of("spot"), r#"pool="spot""#);
    assert!(s
        .queries
        .kv_usage
        .contains("vllm:kv_cache_usage_perc{{selector}}"));
    assert!(s
        .queries
        .kv_usage
        .contains("vllm:gpu_cache_usage_perc{{selector}}"));
    assert_eq!(
        s.queries.waiting,
        "sum(vllm:num_requests_waiting{{selector}})"
    );
    let shipped = Config::embedded(&|_| None).unwrap();
    assert_eq!(shipped.signals.source, SignalSource::Scrape);
}

#[test]
fn environment_selects_the_source() {
    let cfg = load(
        "{}",
        &[
            ("SLUICE_SIGNALS_SOURCE", "both"),
            ("SLUICE_PROMETHEUS_URL", "http://prometheus:9090/prom/"),
        ],
    )
    .unwrap();
    assert_eq!(cfg.signals.source, SignalSource::Both);
    let e = load("{}", &[("SLUICE_SIGNALS_SOURCE", "graphite")]).unwrap_err();
    assert_eq!(
        (e.file.as_str(), e.key.as_str()),
        ("environment SLUICE_SIGNALS_SOURCE", "signals.source")
    );
    assert!(e.reason.contains("scrape, prometheus or both"), "{e}");
}

#[test]
fn errors_name_the_key_and_the_reason() {
    let e = error("signals: {source: prometheus}");
    assert_eq!(
        (e.file.as_str(), e.key.as_str()),
        ("sluice.yaml", "signals.source")
    );
    assert!(e.reason.contains("needs prometheus_url"), "{e}");

    let e = error("prometheus_url: https://prom:9090");
    assert_eq!(e.key, "prometheus_url");
    assert!(e.reason.contains("http://"), "{e}");

    let e = error("signals: {source: influx}");
    assert_eq!(e.key, "signals.source", "{e}");

    let url = "prometheus_url: http://127.0.0.1:9090\n";
    let e = error(&format!(
        "{url}signals: {{source: prometheus, queries: {{kv_usage: 'avg(vllm:kv_cache_usage_perc)'}}}}"
    ));
    assert_eq!(e.key, "signals.queries.kv_usage");
    assert!(e.reason.contains("{selector}"), "{e}");

    let e = error(&format!(
        "{url}signals: {{pool_selectors: {{spot: '{{pool=\"spot\"}}'}}}}"
    ));
    assert_eq!(e.key, "signals.pool_selectors.spot");
    assert!(e.reason.contains("without braces"), "{e}");

    let e = error(&format!(
        "{url}signals: {{pool_selectors: {{on-demand: ''}}}}"
    ));
    assert_eq!(e.key, "signals.pool_selectors.on-demand");

    let e = error(&format!("{url}signals: {{prometheus_poll_ms: 0}}"));
    assert_eq!(e.key, "signals.prometheus_poll_ms");
    let e = error(&format!("{url}signals: {{prometheus_timeout_ms: 0}}"));
    assert_eq!(e.key, "signals.prometheus_timeout_ms");

    let e = error(&format!(
        "{url}signals: {{source: prometheus, prometheus_poll_ms: 6000, stale_after_ms: 5000}}"
    ));
    assert_eq!(e.key, "signals.stale_after_ms");
    assert!(e.reason.contains("prometheus_poll_ms"), "{e}");

    // An empty spot selector is allowed: the spot pool is then not polled.
    load(
        &format!("{url}signals: {{source: prometheus, pool_selectors: {{spot: ''}}}}"),
        &[],
    )
    .unwrap();
}
