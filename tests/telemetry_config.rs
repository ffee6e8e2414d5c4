//! The telemetry keys (`signals.source`, the Prometheus poller's knobs, `prometheus_url`,
//! `telemetry.tracing`): defaults, environment overrides (`SLUICE_*`, OpenTelemetry's `OTEL_*`),
//! and errors that name the file or variable, the key and the reason.

use sluice_config::{Config, ConfigError, SignalSource};
use sluice_trace::SamplerKind;
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

#[test]
fn tracing_is_off_by_default_and_the_shipped_block_is_valid() {
    let t = load("{}", &[]).unwrap().telemetry.tracing;
    assert!(!t.enabled);
    assert_eq!(
        (t.sampler, t.ratio),
        (SamplerKind::ParentbasedTraceIdRatio, 1.0)
    );
    assert_eq!(t.traces_url(), "http://localhost:4318/v1/traces");
    let shipped = Config::embedded(&|_| None).unwrap().telemetry.tracing;
    assert_eq!(shipped, t, "conf/sluice.yaml's block states the defaults");
}

#[test]
fn the_file_sets_tracing_and_the_environment_overrides_it() {
    let file = "telemetry: {tracing: {enabled: true, endpoint: 'http://collector:4318', \
                sampler: traceidratio, ratio: 0.5, service_name: edge, \
                resource_attributes: {deployment.environment.name: prod}}}";
    let t = load(file, &[]).unwrap().telemetry.tracing;
    assert!(t.enabled);
    assert_eq!(t.traces_url(), "http://collector:4318/v1/traces");
    assert_eq!((t.sampler, t.ratio), (SamplerKind::TraceIdRatio, 0.5));
    assert_eq!(t.service_name, "edge");

    let t = load(
        file,
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://agent:4318"),
            ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.1"),
            ("OTEL_SERVICE_NAME", "sluice-eu"),
            ("OTEL_RESOURCE_ATTRIBUTES", "k8s.pod.name=sluice-0"),
        ],
    )
    .unwrap()
    .telemetry
    .tracing;
    assert_eq!(t.traces_url(), "http://agent:4318/v1/traces");
    assert_eq!(
        (t.sampler, t.ratio),
        (SamplerKind::ParentbasedTraceIdRatio, 0.1)
    );
    assert_eq!(t.service_name, "sluice-eu");
    assert_eq!(t.resource_attributes["k8s.pod.name"], "sluice-0");
    assert_eq!(t.resource_attributes["deployment.environment.name"], "prod");
    let t = load(
        "{}",
        &[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://agent:4318/custom/traces",
        )],
    )
    .unwrap()
    .telemetry
    .tracing;
    assert_eq!(t.traces_url(), "http://agent:4318/custom/traces");
    assert!(!t.enabled, "no OTEL_* variable turns tracing on");

    // SLUICE_TRACING_ENABLED turns it on; OpenTelemetry's switch off wins over it.
    let on = [("SLUICE_TRACING_ENABLED", "true")];
    assert!(load("{}", &on).unwrap().telemetry.tracing.enabled);
    let off = [on[0], ("OTEL_SDK_DISABLED", "true")];
    assert!(!load("{}", &off).unwrap().telemetry.tracing.enabled);
    let off = [on[0], ("OTEL_TRACES_EXPORTER", "none")];
    assert!(!load("{}", &off).unwrap().telemetry.tracing.enabled);
    // An unreadable sampler or ratio is ignored (OpenTelemetry's rule), not fatal.
    let t = load(
        file,
        &[
            ("OTEL_TRACES_SAMPLER", "jaeger_remote"),
            ("OTEL_TRACES_SAMPLER_ARG", "x"),
        ],
    )
    .unwrap()
    .telemetry
    .tracing;
    assert_eq!((t.sampler, t.ratio), (SamplerKind::TraceIdRatio, 0.5));
}

#[test]
fn tracing_errors_name_the_file_or_variable_the_key_and_the_reason() {
    let e = error("telemetry: {tracing: {ratio: 1.5}}");
    assert_eq!(
        (e.file.as_str(), e.key.as_str()),
        ("sluice.yaml", "telemetry.tracing.ratio")
    );
    assert!(e.reason.contains("between 0 and 1"), "{e}");

    let e = error("telemetry: {tracing: {endpoint: 'https://collector:4318'}}");
    assert_eq!(e.key, "telemetry.tracing.endpoint");
    assert!(e.reason.contains("https is not supported"), "{e}");

    let e = error("telemetry: {tracing: {endpoint: 'http://collector:4318/v1/traces'}}");
    assert_eq!(e.key, "telemetry.tracing.endpoint");
    assert!(e.reason.contains("traces_endpoint"), "{e}");

    let e = error("telemetry: {tracing: {queue_spans: 8, batch_spans: 16}}");
    assert_eq!(e.key, "telemetry.tracing.batch_spans");

    let e = error("telemetry: {tracing: {exporter: otlp}}");
    assert!(e.key.starts_with("telemetry.tracing"), "{e}");
    assert!(e.reason.contains("unknown field"), "{e}");

    let e = load("{}", &[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")]).unwrap_err();
    assert_eq!(
        (e.file.as_str(), e.key.as_str()),
        (
            "environment OTEL_EXPORTER_OTLP_ENDPOINT",
            "telemetry.tracing.endpoint"
        )
    );
    assert!(e.reason.contains("http://"), "{e}");

    let e = load("{}", &[("OTEL_EXPORTER_OTLP_HEADERS", "api key=1")]).unwrap_err();
    assert_eq!(
        (e.file.as_str(), e.key.as_str()),
        (
            "environment OTEL_EXPORTER_OTLP_HEADERS",
            "telemetry.tracing.headers"
        )
    );

    let e = load("{}", &[("SLUICE_TRACING_ENABLED", "maybe")]).unwrap_err();
    assert_eq!(
        (e.file.as_str(), e.key.as_str()),
        (
            "environment SLUICE_TRACING_ENABLED",
            "telemetry.tracing.enabled"
        )
    );
}
