//! `telemetry.tracing`: the YAML section, OpenTelemetry's standard environment variables over
//! it, and one `validate()`.
//!
//! ```yaml
//! telemetry:
//!   tracing:
//!     enabled: true                         # default false
//!     endpoint: http://otel-collector:4318  # OTLP/HTTP base; /v1/traces is appended
//!     sampler: parentbased_traceidratio     # the OTEL_TRACES_SAMPLER names
//!     ratio: 0.1                            # default 1.0
//! ```
//!
//! The environment overrides the file (read through a function, so tests never touch the
//! process environment). An empty variable counts as unset. As OpenTelemetry specifies, a
//! sampler name or number that cannot be read is ignored with a warning (returned for the caller
//! to log), and a malformed `OTEL_RESOURCE_ATTRIBUTES` is discarded whole with a warning; a
//! malformed endpoint or header list is an error naming the variable, since exporting nowhere
//! would otherwise go unnoticed.
//!
//! | variable | overrides |
//! |---|---|
//! | `OTEL_SDK_DISABLED=true`, `OTEL_TRACES_EXPORTER=none` | `enabled: false` |
//! | `OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG` | `sampler`, `ratio` |
//! | `OTEL_EXPORTER_OTLP_ENDPOINT` | `endpoint` (base: `/v1/traces` appended) |
//! | `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` | `traces_endpoint` (used as is; wins over `endpoint`) |
//! | `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TRACES_HEADERS` | merged into `headers` |
//! | `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_EXPORTER_OTLP_TRACES_TIMEOUT` | `timeout_ms` |
//! | `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_QUEUE_SIZE`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` | `flush_ms`, `queue_spans`, `batch_spans` |
//! | `OTEL_SERVICE_NAME` | `service_name` (over a `service.name` in `OTEL_RESOURCE_ATTRIBUTES`) |
//! | `OTEL_RESOURCE_ATTRIBUTES` | merged into `resource_attributes` (percent-decoded) |
//!
//! `OTEL_EXPORTER_OTLP_PROTOCOL` other than `http/protobuf` and `OTEL_EXPORTER_OTLP_COMPRESSION`
//! are warned about: only uncompressed protobuf over plain HTTP is sent. No variable turns
//! tracing on; that is `enabled` (or the Sluice override the configuration crate maps to it).

use crate::sampler::SamplerKind;
use crate::semconv::{SERVICE_NAME, SERVICE_VERSION};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;

/// Where a collector listens when nothing says otherwise (OpenTelemetry's default).
pub const DEFAULT_ENDPOINT: &str = "http://localhost:4318";
pub const TRACES_PATH: &str = "/v1/traces";

/// `telemetry.tracing` in the YAML file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TracingConfig {
    /// Whether spans are recorded and exported. Default false: Sluice then leaves `traceparent`
    /// and `tracestate` alone.
    pub enabled: bool,
    /// The collector's OTLP/HTTP base URL, `http://` only; `/v1/traces` is appended. Default
    /// `http://localhost:4318`.
    pub endpoint: Option<String>,
    /// The full traces URL, used as is; wins over `endpoint`.
    pub traces_endpoint: Option<String>,
    /// Default `parentbased_traceidratio`: follow the caller's sampled flag, and sample `ratio`
    /// of the traces Sluice starts.
    pub sampler: SamplerKind,
    /// The share of traces sampled by the ratio samplers, 0 to 1. Default 1.
    pub ratio: f64,
    /// The resource's `service.name`. Default `sluice`.
    pub service_name: String,
    /// More resource attributes (`deployment.environment.name`, `k8s.pod.name`, ...).
    pub resource_attributes: BTreeMap<String, String>,
    /// Headers sent with every export (an API key a collector asks for).
    pub headers: BTreeMap<String, String>,
    /// Finished spans waiting for export; when full, new spans are dropped and counted. Default
    /// 4096.
    pub queue_spans: usize,
    /// Spans a request to the collector at most; a full batch is sent at once. Default 512.
    pub batch_spans: usize,
    /// The longest a span waits before its batch is sent. Default 1000.
    pub flush_ms: u64,
    /// The bound on one export request; past it the batch is dropped. Default 2000.
    pub timeout_ms: u64,
}

impl Default for TracingConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            endpoint: None,
            traces_endpoint: None,
            sampler: SamplerKind::default(),
            ratio: 1.0,
            service_name: "sluice".into(),
            resource_attributes: BTreeMap::new(),
            headers: BTreeMap::new(),
            queue_spans: 4096,
            batch_spans: 512,
            flush_ms: 1000,
            timeout_ms: 2000,
        }
    }
}

/// A `telemetry.tracing` problem: the key, the environment variable it came from if any, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracingConfigError {
    /// The environment variable that set the value, `None` for the file.
    pub variable: Option<&'static str>,
    /// The full key, such as `telemetry.tracing.ratio`.
    pub key: &'static str,
    pub reason: String,
}

impl fmt::Display for TracingConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.variable {
            Some(var) => write!(f, "environment {var}: {}: {}", self.key, self.reason),
            None => write!(f, "{}: {}", self.key, self.reason),
        }
    }
}

impl std::error::Error for TracingConfigError {}

/// The environment, as a function (`None` when unset).
pub type EnvFn<'a> = &'a dyn Fn(&str) -> Option<String>;

const K_ENDPOINT: &str = "telemetry.tracing.endpoint";
const K_TRACES_ENDPOINT: &str = "telemetry.tracing.traces_endpoint";
const K_HEADERS: &str = "telemetry.tracing.headers";

impl TracingConfig {
    /// Applies OpenTelemetry's variables over the file's values; returns the warnings to log.
    pub fn apply_env(&mut self, env: EnvFn) -> Result<Vec<String>, TracingConfigError> {
        let get = |name: &str| env(name).filter(|v| !v.trim().is_empty());
        let mut warnings = Vec::new();
        let flag = |name: &'static str, warnings: &mut Vec<String>| match get(name) {
            Some(v) if v.trim().eq_ignore_ascii_case("true") => true,
            Some(v) if v.trim().eq_ignore_ascii_case("false") => false,
            Some(v) => {
                warnings.push(format!("{name}={v:?} is not true or false; ignored"));
                false
            }
            None => false,
        };
        if flag("OTEL_SDK_DISABLED", &mut warnings) {
            self.enabled = false;
        }
        if let Some(v) = get("OTEL_TRACES_EXPORTER") {
            match v.trim() {
                "none" => self.enabled = false,
                "otlp" => {}
                other => warnings.push(format!(
                    "OTEL_TRACES_EXPORTER={other:?} is not supported (otlp or none); ignored"
                )),
            }
        }
        if let Some(v) = get("OTEL_TRACES_SAMPLER") {
            match SamplerKind::parse(&v) {
                Some(k) => self.sampler = k,
                None => warnings.push(format!(
                    "OTEL_TRACES_SAMPLER={v:?} is not one of always_on, always_off, traceidratio, \
                     parentbased_always_on, parentbased_always_off, parentbased_traceidratio; ignored"
                )),
            }
        }
        if let Some(v) = get("OTEL_TRACES_SAMPLER_ARG") {
            match v.trim().parse::<f64>() {
                Ok(r) if (0.0..=1.0).contains(&r) => self.ratio = r,
                _ => warnings.push(format!(
                    "OTEL_TRACES_SAMPLER_ARG={v:?} is not a ratio between 0 and 1; ignored"
                )),
            }
        }
        for (var, key, slot) in [
            (
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                K_ENDPOINT,
                &mut self.endpoint,
            ),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                K_TRACES_ENDPOINT,
                &mut self.traces_endpoint,
            ),
        ] {
            if let Some(v) = get(var) {
                let v = v.trim().to_string();
                check_url(&v).map_err(|reason| TracingConfigError {
                    variable: Some(var),
                    key,
                    reason,
                })?;
                *slot = Some(v);
            }
        }
        for var in [
            "OTEL_EXPORTER_OTLP_HEADERS",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        ] {
            if let Some(v) = get(var) {
                let pairs = parse_key_values(&v).map_err(|reason| TracingConfigError {
                    variable: Some(var),
                    key: K_HEADERS,
                    reason,
                })?;
                for (k, v) in pairs {
                    check_header(&k, &v).map_err(|reason| TracingConfigError {
                        variable: Some(var),
                        key: K_HEADERS,
                        reason,
                    })?;
                    self.headers.insert(k, v);
                }
            }
        }
        let number = |var: &'static str, warnings: &mut Vec<String>| -> Option<u64> {
            let v = get(var)?;
            match v.trim().parse::<u64>() {
                Ok(n) if n > 0 && n < 1 << 31 => Some(n),
                _ => {
                    warnings.push(format!(
                        "{var}={v:?} is not a whole number from 1 to 2^31-1; ignored"
                    ));
                    None
                }
            }
        };
        for var in [
            "OTEL_EXPORTER_OTLP_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
        ] {
            if let Some(n) = number(var, &mut warnings) {
                self.timeout_ms = n;
            }
        }
        if let Some(n) = number("OTEL_BSP_SCHEDULE_DELAY", &mut warnings) {
            self.flush_ms = n;
        }
        if let Some(n) = number("OTEL_BSP_MAX_QUEUE_SIZE", &mut warnings) {
            self.queue_spans = n as usize;
        }
        if let Some(n) = number("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", &mut warnings) {
            self.batch_spans = n as usize;
        }
        if let Some(v) = get("OTEL_RESOURCE_ATTRIBUTES") {
            match parse_key_values(&v) {
                Ok(pairs) => {
                    for (k, v) in pairs {
                        if k == SERVICE_NAME {
                            self.service_name = v;
                        } else {
                            self.resource_attributes.insert(k, v);
                        }
                    }
                }
                Err(reason) => {
                    warnings.push(format!("OTEL_RESOURCE_ATTRIBUTES discarded: {reason}"))
                }
            }
        }
        if let Some(v) = get("OTEL_SERVICE_NAME") {
            self.service_name = v.trim().to_string();
        }
        for var in [
            "OTEL_EXPORTER_OTLP_PROTOCOL",
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        ] {
            if let Some(v) = get(var).filter(|v| v.trim() != "http/protobuf") {
                warnings.push(format!(
                    "{var}={v:?}: Sluice exports http/protobuf only; sending http/protobuf"
                ));
            }
        }
        for var in [
            "OTEL_EXPORTER_OTLP_COMPRESSION",
            "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION",
        ] {
            if let Some(v) = get(var).filter(|v| v.trim() != "none") {
                warnings.push(format!(
                    "{var}={v:?}: Sluice does not compress exports; sending uncompressed"
                ));
            }
        }
        Ok(warnings)
    }

    /// Checks every value, enabled or not, so a typo surfaces before tracing is switched on.
    pub fn validate(&self) -> Result<(), TracingConfigError> {
        let err = |key: &'static str, reason: String| {
            Err(TracingConfigError {
                variable: None,
                key,
                reason,
            })
        };
        if !(0.0..=1.0).contains(&self.ratio) {
            return err(
                "telemetry.tracing.ratio",
                format!("must be between 0 and 1, got {}", self.ratio),
            );
        }
        if !(1..=1 << 20).contains(&self.queue_spans) {
            return err(
                "telemetry.tracing.queue_spans",
                "must be between 1 and 1048576".into(),
            );
        }
        if self.batch_spans == 0 || self.batch_spans > self.queue_spans {
            return err(
                "telemetry.tracing.batch_spans",
                format!(
                    "must be between 1 and queue_spans ({}), got {}",
                    self.queue_spans, self.batch_spans
                ),
            );
        }
        if self.flush_ms == 0 {
            return err("telemetry.tracing.flush_ms", "must be > 0".into());
        }
        if self.timeout_ms == 0 {
            return err("telemetry.tracing.timeout_ms", "must be > 0".into());
        }
        if let Some(url) = &self.endpoint {
            if let Err(reason) = check_url(url) {
                return err(K_ENDPOINT, reason);
            }
            if url.trim_end_matches('/').ends_with(TRACES_PATH) {
                return err(
                    K_ENDPOINT,
                    format!(
                        "{url} ends in {TRACES_PATH}, which is appended to the base URL \
                         (or OTEL_EXPORTER_OTLP_ENDPOINT): give the base, or the full URL as \
                         traces_endpoint"
                    ),
                );
            }
        }
        if let Some(url) = &self.traces_endpoint {
            if let Err(reason) = check_url(url) {
                return err(K_TRACES_ENDPOINT, reason);
            }
        }
        if self.service_name.trim().is_empty() {
            return err("telemetry.tracing.service_name", "must not be empty".into());
        }
        if self.resource_attributes.keys().any(|k| k.trim().is_empty()) {
            return err(
                "telemetry.tracing.resource_attributes",
                "a key is empty".into(),
            );
        }
        for (k, v) in &self.headers {
            if let Err(reason) = check_header(k, v) {
                return err(K_HEADERS, reason);
            }
        }
        Ok(())
    }

    /// The URL spans are posted to: `traces_endpoint` as is, else `endpoint` (or the default)
    /// with `/v1/traces` appended.
    pub fn traces_url(&self) -> String {
        if let Some(url) = &self.traces_endpoint {
            return url.trim().to_string();
        }
        let base = self.endpoint.as_deref().unwrap_or(DEFAULT_ENDPOINT).trim();
        format!("{}{TRACES_PATH}", base.trim_end_matches('/'))
    }

    /// The resource's attributes: `service.name` first, `service.version` (Sluice's, unless
    /// given), then the others by key.
    pub fn resource(&self) -> Vec<(String, String)> {
        let mut out = vec![(SERVICE_NAME.to_string(), self.service_name.clone())];
        if !self.resource_attributes.contains_key(SERVICE_VERSION) {
            out.push((
                SERVICE_VERSION.to_string(),
                env!("CARGO_PKG_VERSION").to_string(),
            ));
        }
        out.extend(
            self.resource_attributes
                .iter()
                .filter(|(k, _)| *k != SERVICE_NAME)
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        out
    }
}

/// A plain-HTTP URL with a host.
pub(crate) fn check_url(url: &str) -> Result<http::Uri, String> {
    let uri: http::Uri = url
        .trim()
        .parse()
        .map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    match uri.scheme_str() {
        Some("http") => {}
        Some("https") => {
            return Err(format!(
                "{url}: https is not supported by the exporter; send to a collector's plain-HTTP \
                 OTLP port (4318), such as an OpenTelemetry Collector on the node or in the cluster"
            ))
        }
        _ => return Err(format!("{url}: the URL must start with http://")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("{url}: no host"));
    }
    Ok(uri)
}

fn check_header(name: &str, value: &str) -> Result<(), String> {
    http::HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| format!("{name:?} is not a valid header name"))?;
    http::HeaderValue::from_str(value)
        .map_err(|_| format!("the value of {name} is not a valid header value"))?;
    Ok(())
}

/// Reads `k=v,k2=v2` (`OTEL_RESOURCE_ATTRIBUTES`, `OTEL_EXPORTER_OTLP_HEADERS`): members
/// trimmed, keys and values percent-decoded, empty members skipped.
pub fn parse_key_values(list: &str) -> Result<Vec<(String, String)>, String> {
    let mut out = Vec::new();
    for member in list.split(',') {
        let member = member.trim();
        if member.is_empty() {
            continue;
        }
        let Some((k, v)) = member.split_once('=') else {
            return Err(format!("{member:?} is not key=value"));
        };
        let key = percent_decode(k.trim())?;
        if key.is_empty() {
            return Err(format!("{member:?} has an empty key"));
        }
        out.push((key, percent_decode(v.trim())?));
    }
    Ok(out)
}

/// `%XX` escapes decoded; the result must be UTF-8.
pub fn percent_decode(s: &str) -> Result<String, String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = bytes
                .get(i + 1..i + 3)
                .and_then(|h| std::str::from_utf8(h).ok())
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| format!("{s:?} has a bad percent escape"))?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} does not decode to UTF-8"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k: &str| map.get(k).cloned()
    }

    #[test]
    fn defaults_are_documented_ones() {
        let c = TracingConfig::default();
        assert!(!c.enabled);
        assert_eq!(c.sampler, SamplerKind::ParentbasedTraceIdRatio);
        assert_eq!((c.ratio, c.queue_spans, c.batch_spans), (1.0, 4096, 512));
        assert_eq!((c.flush_ms, c.timeout_ms), (1000, 2000));
        assert_eq!(c.traces_url(), "http://localhost:4318/v1/traces");
        c.validate().unwrap();
    }

    #[test]
    fn the_yaml_section_reads_and_rejects_unknown_keys() {
        let c: TracingConfig = serde_yaml::from_str(
            "enabled: true\nendpoint: http://collector:4318/\nsampler: traceidratio\nratio: 0.25\n\
             queue_spans: 100\nbatch_spans: 10\nflush_ms: 50\ntimeout_ms: 500\n\
             resource_attributes: {deployment.environment.name: prod}\n",
        )
        .unwrap();
        assert!(c.enabled);
        assert_eq!(c.sampler, SamplerKind::TraceIdRatio);
        assert_eq!(c.traces_url(), "http://collector:4318/v1/traces");
        c.validate().unwrap();
        assert!(serde_yaml::from_str::<TracingConfig>("endpoint_url: x").is_err());
        assert!(serde_yaml::from_str::<TracingConfig>("sampler: sometimes").is_err());
    }

    #[test]
    fn validation_names_the_key() {
        let bad = |f: fn(&mut TracingConfig)| {
            let mut c = TracingConfig::default();
            f(&mut c);
            c.validate().unwrap_err().key
        };
        assert_eq!(bad(|c| c.ratio = 1.5), "telemetry.tracing.ratio");
        assert_eq!(
            bad(|c| c.batch_spans = 5000),
            "telemetry.tracing.batch_spans"
        );
        assert_eq!(bad(|c| c.queue_spans = 0), "telemetry.tracing.queue_spans");
        assert_eq!(bad(|c| c.flush_ms = 0), "telemetry.tracing.flush_ms");
        assert_eq!(bad(|c| c.timeout_ms = 0), "telemetry.tracing.timeout_ms");
        assert_eq!(
            bad(|c| c.endpoint = Some("https://c:4318".into())),
            K_ENDPOINT
        );
        assert_eq!(
            bad(|c| c.endpoint = Some("http://c:4318/v1/traces".into())),
            K_ENDPOINT
        );
        assert_eq!(
            bad(|c| c.traces_endpoint = Some("c:4318".into())),
            K_TRACES_ENDPOINT
        );
        assert_eq!(
            bad(|c| {
                c.headers.insert("bad header".into(), "x".into());
            }),
            K_HEADERS
        );
    }

    #[test]
    fn endpoints_follow_the_otlp_rules() {
        let mut c = TracingConfig {
            endpoint: Some("http://file:4318".into()),
            ..Default::default()
        };
        c.apply_env(&env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://env:4318/")]))
            .unwrap();
        assert_eq!(c.traces_url(), "http://env:4318/v1/traces");
        c.apply_env(&env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://env:4318/base",
        )]))
        .unwrap();
        assert_eq!(c.traces_url(), "http://env:4318/base/v1/traces");
        c.apply_env(&env(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://env:9999/custom",
        )]))
        .unwrap();
        assert_eq!(c.traces_url(), "http://env:9999/custom", "used as is");
        let e = c
            .apply_env(&env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "https://x")]))
            .unwrap_err();
        assert_eq!(e.variable, Some("OTEL_EXPORTER_OTLP_ENDPOINT"));
    }

    #[test]
    fn sampler_variables_override_and_bad_ones_are_ignored_with_a_warning() {
        let mut c = TracingConfig::default();
        let w = c
            .apply_env(&env(&[
                ("OTEL_TRACES_SAMPLER", "always_off"),
                ("OTEL_TRACES_SAMPLER_ARG", "0.5"),
            ]))
            .unwrap();
        assert!(w.is_empty());
        assert_eq!((c.sampler, c.ratio), (SamplerKind::AlwaysOff, 0.5));
        let w = c
            .apply_env(&env(&[
                ("OTEL_TRACES_SAMPLER", "jaeger_remote"),
                ("OTEL_TRACES_SAMPLER_ARG", "2"),
                ("OTEL_BSP_MAX_QUEUE_SIZE", "-1"),
            ]))
            .unwrap();
        assert_eq!(w.len(), 3, "{w:?}");
        assert_eq!((c.sampler, c.ratio), (SamplerKind::AlwaysOff, 0.5));
        let w = c
            .apply_env(&env(&[
                ("OTEL_TRACES_SAMPLER", ""),
                ("OTEL_SERVICE_NAME", " "),
            ]))
            .unwrap();
        assert!(w.is_empty(), "empty means unset");
        assert_eq!(c.service_name, "sluice");
    }

    #[test]
    fn resource_attributes_are_percent_decoded_and_service_name_wins() {
        let mut c = TracingConfig::default();
        c.resource_attributes.insert("team".into(), "file".into());
        c.apply_env(&env(&[(
            "OTEL_RESOURCE_ATTRIBUTES",
            "service.name=from-attrs, team=a%2Cb%3Dc ,k8s.pod.name=sluice-0,,",
        )]))
        .unwrap();
        assert_eq!(c.service_name, "from-attrs");
        assert_eq!(c.resource_attributes["team"], "a,b=c");
        c.apply_env(&env(&[("OTEL_SERVICE_NAME", "edge")])).unwrap();
        let r = c.resource();
        assert_eq!(r[0], ("service.name".into(), "edge".into()));
        assert!(r.contains(&("k8s.pod.name".into(), "sluice-0".into())));
        assert!(r.iter().any(|(k, _)| k == "service.version"));
    }

    #[test]
    fn a_malformed_resource_list_is_discarded_whole() {
        let mut c = TracingConfig::default();
        let w = c
            .apply_env(&env(&[("OTEL_RESOURCE_ATTRIBUTES", "a=1,broken,b=2")]))
            .unwrap();
        assert_eq!(w.len(), 1);
        assert!(c.resource_attributes.is_empty());
        let w = c
            .apply_env(&env(&[("OTEL_RESOURCE_ATTRIBUTES", "a=%zz")]))
            .unwrap();
        assert_eq!(w.len(), 1);
        assert_eq!(percent_decode("%E2%9C%93 ok").unwrap(), "✓ ok");
        assert!(percent_decode("%ff").is_err());
        assert!(percent_decode("50%").is_err());
        assert!(parse_key_values("=v").is_err());
    }

    #[test]
    fn exporter_variables_override_the_file() {
        let mut c = TracingConfig {
            enabled: true,
            ..Default::default()
        };
        let w = c
            .apply_env(&env(&[
                ("OTEL_EXPORTER_OTLP_HEADERS", "api-key=abc%20d,x-a=1"),
                ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-a=2"),
                ("OTEL_EXPORTER_OTLP_TIMEOUT", "300"),
                ("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "400"),
                ("OTEL_BSP_SCHEDULE_DELAY", "50"),
                ("OTEL_BSP_MAX_QUEUE_SIZE", "64"),
                ("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ]))
            .unwrap();
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(c.headers["api-key"], "abc d");
        assert_eq!(c.headers["x-a"], "2");
        assert_eq!((c.timeout_ms, c.flush_ms), (400, 50));
        assert_eq!((c.queue_spans, c.batch_spans), (64, 8));
        assert!(c.enabled);
        c.apply_env(&env(&[("OTEL_SDK_DISABLED", "TRUE")])).unwrap();
        assert!(!c.enabled);
        let e = c
            .apply_env(&env(&[("OTEL_EXPORTER_OTLP_HEADERS", "bad header=1")]))
            .unwrap_err();
        assert_eq!(e.variable, Some("OTEL_EXPORTER_OTLP_HEADERS"));
    }
}
