//! One pass over a parsed config that reports the first problem with its file, key and reason.

use crate::error::ConfigError;
use crate::file::Config;
use crate::pools::PoolConfig;
use crate::pools::{BackendTlsConfig, HealthCheckConfig};
use crate::url::{backend_of_url, host_port};
use sluice_policy::Tier;
use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::path::PathBuf;

/// The fallbacks, checked before those with a URL of their own become pools.
pub(super) fn fallbacks(c: &Config) -> Result<(), ConfigError> {
    let file = c.source.as_str();
    let err = |key: String, reason: String| Err(ConfigError::new(file, key, reason));
    let mut names = HashSet::new();
    for (i, f) in c.fallbacks.iter().enumerate() {
        let key = format!("fallbacks[{i}]");
        if !names.insert(f.name.as_str()) {
            return err(
                format!("{key}.name"),
                format!("duplicate fallback name {:?}", f.name),
            );
        }
        if f.model.trim().is_empty() {
            return err(
                format!("{key}.model"),
                "must name the fallback model".into(),
            );
        }
        if let Some(Err(reason)) = f.url.as_deref().map(backend_of_url) {
            return err(format!("{key}.url"), reason);
        }
    }
    Ok(())
}

pub(super) fn validate(c: &Config) -> Result<(), ConfigError> {
    let file = c.source.as_str();
    let err = |key: &str, reason: String| Err(ConfigError::new(file, key, reason));

    if c.listen.is_empty() {
        return err("listen", "at least one listen address is required".into());
    }
    for (i, addr) in c.listen.iter().enumerate() {
        if addr.parse::<SocketAddr>().is_err() {
            return err(
                &format!("listen[{i}]"),
                format!("{addr:?} is not an ip:port address"),
            );
        }
    }
    for (i, addr) in c.ops_listen.iter().enumerate() {
        let key = format!("ops_listen[{i}]");
        if addr.parse::<SocketAddr>().is_err() {
            return err(&key, format!("{addr:?} is not an ip:port address"));
        }
        let taken = c.listen.contains(addr) || c.listen_tls.iter().any(|l| &l.listen == addr);
        if taken {
            return err(
                &key,
                format!("{addr} is also a proxy listener: operations get their own address"),
            );
        }
    }
    for (i, l) in c.listen_tls.iter().enumerate() {
        let key = format!("listen_tls[{i}]");
        if l.listen.parse::<SocketAddr>().is_err() {
            return err(
                &format!("{key}.listen"),
                format!("{:?} is not an ip:port address", l.listen),
            );
        }
        if c.listen.contains(&l.listen) {
            return err(
                &format!("{key}.listen"),
                format!("{} is also a plain listen address", l.listen),
            );
        }
        if let Err((which, reason)) = crate::tls::load_certified_key(&l.cert, &l.key) {
            return err(&format!("{key}.{which}"), reason);
        }
    }
    c.server_conf()?;
    pools(c)?;
    if c.routing.models_refresh_ms == 0 || c.routing.models_timeout_ms == 0 {
        return err(
            "routing",
            "models_refresh_ms and models_timeout_ms must be > 0".into(),
        );
    }
    retry_budget(c)?;
    ledger(c)?;
    backend_tls(c)?;

    let s = &c.signals;
    if s.scrape_interval_ms == 0 || s.scrape_timeout_ms == 0 {
        return err(
            "signals",
            "scrape_interval_ms and scrape_timeout_ms must be > 0".into(),
        );
    }
    if s.stale_after_ms <= s.scrape_interval_ms {
        return err(
            "signals.stale_after_ms",
            "must be larger than scrape_interval_ms".into(),
        );
    }
    if c.stability.consecutive_samples == 0 {
        return err("stability.consecutive_samples", "must be at least 1".into());
    }
    for (key, v) in [
        ("stability.cooldown_seconds", c.stability.cooldown_seconds),
        ("stability.hysteresis", c.stability.hysteresis),
        (
            "stability.queue_depth_hysteresis",
            c.stability.queue_depth_hysteresis,
        ),
        (
            "stability.sla_rate_hysteresis",
            c.stability.sla_rate_hysteresis,
        ),
        ("fallback.cooldown_seconds", c.fallback.cooldown_seconds),
        ("queue.poll_seconds", c.queue.poll_seconds),
    ] {
        if !(v.is_finite() && v >= 0.0) {
            return err(key, format!("must be a non-negative number, got {v}"));
        }
    }
    if c.fallback.sustained_intervals == 0 {
        return err("fallback.sustained_intervals", "must be at least 1".into());
    }
    if c.fallback.recover_below > c.fallback.pressure_at {
        return err(
            "fallback.recover_below",
            format!(
                "must not exceed fallback.pressure_at ({})",
                c.fallback.pressure_at
            ),
        );
    }
    let half_life = c.queue.fair_share_half_life_seconds;
    if !(half_life.is_finite() && (0.001..=86_400.0).contains(&half_life)) {
        return err(
            "queue.fair_share_half_life_seconds",
            "must be between 0.001 and 86400".into(),
        );
    }
    if !(c.queue.max_wait_seconds.is_finite() && c.queue.max_wait_seconds > 0.0) {
        return err("queue.max_wait_seconds", "must be > 0".into());
    }
    if c.metrics.tenant_label && !(1..=10_000).contains(&c.metrics.max_tenants) {
        return err("metrics.max_tenants", "must be between 1 and 10000".into());
    }
    limits(c)?;
    coordination(c)?;
    telemetry(c)?;
    adaptive(c)?;

    // The tiers' effective rules (defaults filled in), for the checks across keys.
    let rules = super::file::policy_rules(c);
    for tier in Tier::ALL {
        let t = c.tiers.get(tier);
        let base = format!("tiers.{}", tier.as_str());
        if let Some(pool) = &t.pool {
            if pool != "on-demand" && pool != "spot" {
                return err(
                    &format!("{base}.pool"),
                    format!("{pool:?} is not on-demand or spot"),
                );
            }
        }
        let r = rules.tier(tier);
        if let Some(slo) = &t.slo {
            for (name, v) in [
                ("ttft_ms", slo.ttft_ms),
                ("tpot_ms", slo.tpot_ms),
                ("e2e_ms", slo.e2e_ms),
            ] {
                if v == Some(0) {
                    return err(
                        &format!("{base}.slo.{name}"),
                        "0 ms is a target nothing meets; leave the key out to not judge it".into(),
                    );
                }
            }
        }
        if t.sla_target_ms == Some(0) {
            return err(
                &format!("{base}.sla_target_ms"),
                "0 ms is a target nothing meets; leave the key out to not judge it".into(),
            );
        }
        if let (Some(b), Some(cap)) = (r.brownout_max_tokens, r.max_tokens_cap) {
            if b >= cap {
                return err(
                    &format!("{base}.brownout_max_tokens"),
                    format!("{b} is not below the tier's max_tokens_cap ({cap}): the brownout cap is the deeper one"),
                );
            }
        }
        let th = &t.thresholds;
        for (name, limit, value) in [
            ("pressure", 100.0, th.pressure),
            ("queue_depth", f64::INFINITY, th.queue_depth),
            ("sla_violation_rate", 1.0, th.sla_violation_rate),
        ] {
            let Some(v) = value else { continue };
            let key = format!("{base}.thresholds.{name}");
            for x in [v.elevated_at, v.critical_at].into_iter().flatten() {
                if !(x.is_finite() && (0.0..=limit).contains(&x)) {
                    return err(&key, format!("{x} is outside 0..={limit}"));
                }
            }
            if let (Some(e), Some(cr)) = (v.elevated_at, v.critical_at) {
                if e > cr {
                    return err(
                        &key,
                        format!("elevated_at ({e}) is above critical_at ({cr})"),
                    );
                }
            }
        }
    }

    let tfile = c.tenants_source.as_str();
    for (name, t) in &c.tenants {
        if Tier::parse(&t.tier).is_none() {
            return Err(ConfigError::new(
                tfile,
                format!("tenants.{name}"),
                format!(
                    "{:?} is not a tier (Guaranteed, Standard, Best-Effort)",
                    t.tier
                ),
            ));
        }
        if !(t.weight.is_finite() && (0.01..=1000.0).contains(&t.weight)) {
            return Err(ConfigError::new(
                tfile,
                format!("tenants.{name}.weight"),
                format!("{} must be between 0.01 and 1000", t.weight),
            ));
        }
        if let Some(q) = &t.quota {
            for (key, v) in [
                ("tokens_per_minute", q.tokens_per_minute),
                ("requests_per_minute", q.requests_per_minute),
            ] {
                if v == Some(0) {
                    return Err(ConfigError::new(
                        tfile,
                        format!("tenants.{name}.quota.{key}"),
                        "must be at least 1 (leave it out for no limit)",
                    ));
                }
            }
        }
    }
    for (i, k) in c.api_keys.iter().enumerate() {
        let key = format!("api_keys[{i}]");
        if !c.tenants.contains_key(&k.tenant) {
            return Err(ConfigError::new(
                tfile,
                format!("{key}.tenant"),
                format!("unknown tenant {:?}", k.tenant),
            ));
        }
        if k.sha256.len() != 64 || !k.sha256.chars().all(|ch| ch.is_ascii_hexdigit()) {
            return Err(ConfigError::new(
                tfile,
                format!("{key}.sha256"),
                "must be 64 hex characters (SHA-256 of the key)",
            ));
        }
    }
    let unknown = c.auth.unknown_tenant.as_str();
    if unknown != "reject" && Tier::parse(unknown).is_none() {
        return err(
            "auth.unknown_tenant",
            format!("{unknown:?} is neither a tier nor \"reject\""),
        );
    }
    if c.auth.require_api_key && c.api_keys.is_empty() {
        return err(
            "auth.require_api_key",
            "API keys are required but none are configured".into(),
        );
    }
    Ok(())
}

/// `policy:`: the mode's name and the adaptive controller's knobs, each in its range.
fn adaptive(c: &Config) -> Result<(), ConfigError> {
    let file = c.source.as_str();
    let err = |key: &str, reason: String| Err(ConfigError::new(file, key, reason));
    if sluice_policy::PolicyMode::parse(&c.policy.mode).is_none() {
        return err(
            "policy.mode",
            format!("{:?} is not adaptive or thresholds", c.policy.mode),
        );
    }
    let a = &c.policy.adaptive;
    let key = |k: &str| format!("policy.adaptive.{k}");
    if a.window_ms == 0 {
        return err(&key("window_ms"), "must be > 0".into());
    }
    if !(a.quantile > 0.0 && a.quantile <= 1.0) {
        return err(
            &key("quantile"),
            format!("{} is outside (0, 1]", a.quantile),
        );
    }
    if a.min_samples == 0 {
        return err(&key("min_samples"), "must be at least 1".into());
    }
    for (name, v) in [
        ("escalate_below", a.escalate_below),
        ("relax_above", a.relax_above),
    ] {
        if !(v.is_finite() && (-1.0..1.0).contains(&v)) {
            return err(&key(name), format!("{v} is outside -1..1 (a headroom)"));
        }
    }
    if a.relax_above < a.escalate_below {
        return err(
            &key("relax_above"),
            format!(
                "must be at least escalate_below ({}), or the level would rise and fall on the same reading",
                a.escalate_below
            ),
        );
    }
    // Each in (0, max], with what its unit is.
    for (name, v, max, unit) in [
        ("max_step_up", a.max_step_up, 10.0, "steps per sample"),
        ("min_step_up", a.min_step_up, 10.0, "steps per sample"),
        ("step_down", a.step_down, 10.0, "steps per sample"),
        (
            "rise_gain",
            a.rise_gain,
            100.0,
            "steps per unit of headroom shortfall",
        ),
        (
            "work_share_standard",
            a.work_share_standard,
            2.0,
            "(a share of the work limit)",
        ),
        (
            "work_share_best_effort",
            a.work_share_best_effort,
            2.0,
            "(a share of the work limit)",
        ),
    ] {
        if !(v.is_finite() && v > 0.0 && v <= max) {
            return err(&key(name), format!("{v} is outside (0, {max}] {unit}"));
        }
    }
    if a.work_share_best_effort > a.work_share_standard {
        return err(
            &key("work_share_best_effort"),
            format!(
                "must not exceed work_share_standard ({}): a lower tier may not fill more of a pool",
                a.work_share_standard
            ),
        );
    }
    if a.assumed_max_tokens == 0 {
        return err(&key("assumed_max_tokens"), "must be at least 1".into());
    }
    if a.min_step_up > a.max_step_up {
        return err(
            &key("min_step_up"),
            format!("must not exceed max_step_up ({})", a.max_step_up),
        );
    }
    for (name, at) in [
        ("rail_pressure_at", a.rail_pressure_at),
        ("shape_pressure_at", a.shape_pressure_at),
        ("fallback_pressure_at", a.fallback_pressure_at),
        ("idle_pressure_below", a.idle_pressure_below),
    ] {
        if let Some(p) = at.filter(|p| !(p.is_finite() && (0.0..=100.0).contains(p))) {
            return err(&key(name), format!("{p} is outside 0..=100"));
        }
    }
    if a.reserve_guaranteed_pool == Some(true) && a.fallback_pressure_at.is_none() {
        return err(
            &key("reserve_guaranteed_pool"),
            "needs fallback_pressure_at: it moves a request only to a fallback whose cache is \
             below that mark"
                .into(),
        );
    }
    if let Some(x) = a
        .reserve_ttft_below_x
        .filter(|x| !(x.is_finite() && *x > 1.0))
    {
        return err(
            &key("reserve_ttft_below_x"),
            format!("{x} must be above 1: a target under its unloaded value is never met"),
        );
    }
    if let Some(q) = a.rail_queue_depth_at {
        if !(q.is_finite() && q >= 0.0) {
            return err(&key("rail_queue_depth_at"), format!("{q} must be >= 0"));
        }
    }
    let k = a.queue_lookahead_samples;
    if !(k.is_finite() && (0.0..=20.0).contains(&k)) {
        return err(
            &key("queue_lookahead_samples"),
            format!("{k} is outside 0..=20 samples"),
        );
    }
    if a.baseline_half_life_ms == 0 {
        return err(&key("baseline_half_life_ms"), "must be > 0".into());
    }
    Ok(())
}

/// The Redis URL and the `coordination:` knobs. The lease must leave room for three renewal
/// attempts of at most `op_timeout_ms` each, or a merely slow Redis would expire live slots.
fn coordination(c: &Config) -> Result<(), ConfigError> {
    let file = c.source.as_str();
    let err = |key: &str, reason: String| Err(ConfigError::new(file, key, reason));
    if let Some(url) = &c.redis_url {
        if let Err(e) = redis::Client::open(url.as_str()) {
            return err("redis_url", format!("not a usable Redis URL: {e}"));
        }
    }
    let co = &c.coordination;
    let prefix = co.redis_prefix.as_str();
    if prefix.is_empty()
        || prefix.len() > 128
        || prefix
            .chars()
            .any(|ch| ch.is_whitespace() || ch.is_control())
    {
        return err(
            "coordination.redis_prefix",
            format!("{prefix:?} must be 1 to 128 characters without whitespace"),
        );
    }
    if co.op_timeout_ms == 0 || co.op_timeout_ms > 10_000 {
        return err(
            "coordination.op_timeout_ms",
            format!("{} is outside 1..=10000", co.op_timeout_ms),
        );
    }
    let lease = co.lease_seconds;
    if !(lease.is_finite() && lease > 0.0 && lease <= 3600.0) {
        return err(
            "coordination.lease_seconds",
            format!("{lease} is outside (0, 3600]"),
        );
    }
    if co.lease_ms() < 3 * co.op_timeout_ms {
        return err(
            "coordination.lease_seconds",
            format!(
                "{lease} s is shorter than 3 x coordination.op_timeout_ms ({} ms)",
                co.op_timeout_ms
            ),
        );
    }
    Ok(())
}

/// `prometheus_url`, the Prometheus keys under `signals:` and `telemetry.tracing`. Checked
/// whatever the source and whether tracing is on, so a typo surfaces before someone switches
/// `signals.source` or tracing on in production.
fn telemetry(c: &Config) -> Result<(), ConfigError> {
    let file = c.source.as_str();
    let err = |key: &str, reason: String| Err(ConfigError::new(file, key, reason));
    let s = &c.signals;
    if let Some(url) = &c.prometheus_url {
        if let Err(reason) = prometheus_url(url) {
            return err("prometheus_url", reason);
        }
    } else if s.source.polls_prometheus() {
        return err(
            "signals.source",
            format!(
                "{} needs prometheus_url (or SLUICE_PROMETHEUS_URL)",
                s.source.as_str()
            ),
        );
    }
    if s.prometheus_poll_ms == 0 {
        return err("signals.prometheus_poll_ms", "must be > 0".into());
    }
    if s.prometheus_timeout_ms == 0 {
        return err("signals.prometheus_timeout_ms", "must be > 0".into());
    }
    if s.source.polls_prometheus() && s.stale_after_ms <= s.prometheus_poll_ms {
        return err(
            "signals.stale_after_ms",
            "must be larger than prometheus_poll_ms".into(),
        );
    }
    for (name, sel) in &s.pool_selectors.0 {
        let key = format!("signals.pool_selectors.{name}");
        let Some(pool) = c.pools.iter().find(|p| p.name == *name) else {
            return err(&key, format!("no pool is named {name:?}"));
        };
        // The policy decides on on-demand pools' signals: one left unpolled would be blind.
        if sel.is_empty() && pool.class() == crate::pools::PoolClass::OnDemand {
            return err(
                &key,
                "an on-demand pool must be polled: give its label matchers".into(),
            );
        }
        if sel.contains(['{', '}', '\n']) {
            return err(
                &key,
                format!("{sel:?}: give the label matchers without braces, e.g. pool=\"spot\""),
            );
        }
    }
    for (key, q) in [
        ("signals.queries.kv_usage", &s.queries.kv_usage),
        ("signals.queries.waiting", &s.queries.waiting),
    ] {
        if !q.contains("{selector}") {
            return err(
                key,
                "must contain the {selector} placeholder, or every pool reads the same series"
                    .into(),
            );
        }
    }
    // Checked enabled or not, like the Prometheus keys.
    c.telemetry.tracing.validate().map_err(|e| {
        let source = e
            .variable
            .map_or_else(|| file.to_string(), |v| format!("environment {v}"));
        ConfigError::new(source, e.key, e.reason)
    })
}

/// `http://host[:port][/path-prefix]`. Plain HTTP only: Prometheus is queried inside the cluster.
fn prometheus_url(url: &str) -> Result<(), String> {
    let uri: http::Uri = url
        .parse()
        .map_err(|e| format!("{url:?} is not a URL: {e}"))?;
    if uri.scheme_str() != Some("http") {
        return Err(format!(
            "{url:?} must start with http:// (Prometheus is queried over plain HTTP)"
        ));
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(format!("{url:?} has no host"));
    }
    if uri.query().is_some() {
        return Err(format!("{url:?} must not have a query string"));
    }
    Ok(())
}

fn pools(c: &Config) -> Result<(), ConfigError> {
    let file = c.source.as_str();
    if c.pools.iter().all(|p| p.config.backends.is_empty()) {
        let key = match c.pools.iter().next() {
            Some(p) => format!("pools.{}.backends", p.name),
            None => "pools".into(),
        };
        return Err(ConfigError::new(
            file,
            key,
            "at least one pool with a backend is required",
        ));
    }
    for p in c.pools.iter().filter(|p| p.from_fallback.is_none()) {
        let base = format!("pools.{}", p.name);
        if p.name.trim().is_empty() || p.name.contains(['{', '}', '"', '\n']) {
            return Err(ConfigError::new(
                file,
                base,
                "a pool name is a plain label (no braces, quotes or newlines)",
            ));
        }
        pool(file, &base, &p.config)?;
    }
    Ok(())
}

/// The most retries a pool may ask for: each is a whole new attempt on another replica, and
/// Pingora stops at `server.max_retries` attempts (16 by default) anyway.
const MAX_RETRIES: u32 = 10;

fn retry_budget(c: &Config) -> Result<(), ConfigError> {
    let b = &c.routing.retry_budget;
    let err = |key: &str, reason: String| {
        Err(ConfigError::new(
            &c.source,
            format!("routing.retry_budget.{key}"),
            reason,
        ))
    };
    if !(b.ratio.is_finite() && (0.0..=1.0).contains(&b.ratio)) {
        return err(
            "ratio",
            format!(
                "{} must be a share of requests between 0 and 1 (0.2: retries at most a fifth of them)",
                b.ratio
            ),
        );
    }
    if !(100..=3_600_000).contains(&b.window_ms) {
        return err(
            "window_ms",
            format!("{} must be between 100 and 3600000", b.window_ms),
        );
    }
    if b.min_retries > 1000 {
        return err(
            "min_retries",
            format!("{} must be at most 1000", b.min_retries),
        );
    }
    Ok(())
}

fn ejection(file: &str, base: &str, p: &PoolConfig) -> Result<(), ConfigError> {
    let e = &p.ejection;
    let err = |key: &str, reason: String| {
        Err(ConfigError::new(
            file,
            format!("{base}.ejection.{key}"),
            reason,
        ))
    };
    if e.consecutive_failures > 1000 {
        return err(
            "consecutive_failures",
            format!(
                "{} must be at most 1000 (0 turns ejection off)",
                e.consecutive_failures
            ),
        );
    }
    if e.consecutive_failures == 0 {
        return Ok(());
    }
    if e.base_ejection_ms == 0 {
        return err("base_ejection_ms", "must be > 0".into());
    }
    if e.max_ejection_ms < e.base_ejection_ms {
        return err(
            "max_ejection_ms",
            format!(
                "{} is below base_ejection_ms ({})",
                e.max_ejection_ms, e.base_ejection_ms
            ),
        );
    }
    if e.max_ejected_percent > 100 {
        return err(
            "max_ejected_percent",
            format!("{} must be at most 100", e.max_ejected_percent),
        );
    }
    Ok(())
}

fn pool(file: &str, base: &str, p: &PoolConfig) -> Result<(), ConfigError> {
    if p.retries > MAX_RETRIES {
        return Err(ConfigError::new(
            file,
            format!("{base}.retries"),
            format!("{} must be at most {MAX_RETRIES}", p.retries),
        ));
    }
    ejection(file, base, p)?;
    if let Some(models) = &p.models {
        if let Some(i) = models.iter().position(|m| m.trim().is_empty()) {
            return Err(ConfigError::new(
                file,
                format!("{base}.models[{i}]"),
                "a model name cannot be empty",
            ));
        }
    }
    if !(p.load_bound >= 1.0 && p.load_bound.is_finite()) {
        return Err(ConfigError::new(
            file,
            format!("{base}.load_bound"),
            format!(
                "{} must be at least 1 (a replica may take the pool's mean load)",
                p.load_bound
            ),
        ));
    }
    for (i, b) in p.backends.iter().enumerate() {
        if let Err(reason) = host_port(b) {
            return Err(ConfigError::new(
                file,
                format!("{base}.backends[{i}]"),
                reason,
            ));
        }
    }
    let hc: &HealthCheckConfig = &p.health_check;
    if !hc.path.starts_with('/') {
        return Err(ConfigError::new(
            file,
            format!("{base}.health_check.path"),
            "must start with /",
        ));
    }
    if hc.interval_ms == 0 || hc.timeout_ms == 0 {
        return Err(ConfigError::new(
            file,
            format!("{base}.health_check"),
            "interval_ms and timeout_ms must be > 0",
        ));
    }
    if hc.consecutive_success == 0 || hc.consecutive_failure == 0 {
        return Err(ConfigError::new(
            file,
            format!("{base}.health_check"),
            "consecutive_success/failure must be >= 1",
        ));
    }
    Ok(())
}

/// The TLS blocks of pools and fallbacks. One address takes one TLS setting wherever it is
/// listed: Pingora pools upstream connections per address and SNI (not per CA), and health
/// is recorded per address, so two settings would share connections and results.
fn backend_tls(c: &Config) -> Result<(), ConfigError> {
    let err = |key: &str, reason: String| Err(ConfigError::new(&c.source, key, reason));
    let mut checked = HashSet::new();
    // Server name, CA file and verify of a TLS address; `None` for plain HTTP.
    type Setting<'a> = Option<(String, Option<&'a PathBuf>, bool)>;
    let mut first: HashMap<&str, (&str, Setting)> = HashMap::new();
    let targets = c.backend_targets();
    for t in &targets {
        let tls = &t.tls;
        let setting = tls
            .enabled
            .then(|| (tls.server_name(&t.addr), tls.ca_file.as_ref(), tls.verify));
        match first.get(t.addr.as_str()) {
            Some((key, s)) if *s != setting => {
                return err(
                    &t.tls_key,
                    format!(
                        "backend {} is also in {key} with other TLS settings; one address takes one setting",
                        t.addr
                    ),
                )
            }
            Some(_) => {}
            None => {
                first.insert(&t.addr, (&t.tls_key, setting));
            }
        }
        if !tls.enabled {
            if *tls != BackendTlsConfig::default() {
                let hint = if t.tls_key.starts_with("fallbacks") {
                    "the url is http://: write https:// to use TLS"
                } else {
                    "set enabled: true to use TLS, or remove sni, ca_file and verify"
                };
                return err(&format!("{}.enabled", t.tls_key), hint.into());
            }
            continue;
        }
        let name = tls.server_name(&t.addr);
        if pingora::tls::ServerName::try_from(name.as_str()).is_err() {
            return match &tls.sni {
                Some(_) => err(
                    &format!("{}.sni", t.tls_key),
                    format!("{name:?} is not a DNS name or IP address"),
                ),
                None => err(
                    &t.addr_key,
                    format!(
                        "host {name:?} is not a TLS server name; set {}.sni",
                        t.tls_key
                    ),
                ),
            };
        }
        if let Some(path) = &tls.ca_file {
            if checked.insert(path) {
                if let Err(reason) = crate::tls::read_ca(path) {
                    return err(&format!("{}.ca_file", t.tls_key), reason);
                }
            }
        }
    }
    Ok(())
}

/// `database_url` and the `ledger:` knobs. The schema becomes an unquoted identifier in SQL and
/// in the connection's `search_path`, so it is held to plain lower-case identifier characters.
fn ledger(c: &Config) -> Result<(), ConfigError> {
    let file = c.source.as_str();
    let err = |key: &str, reason: String| Err(ConfigError::new(file, key, reason));
    if let Some(url) = &c.database_url {
        if let Err(e) = url.parse::<postgres::Config>() {
            return err("database_url", format!("not a usable PostgreSQL URL: {e}"));
        }
    }
    let l = &c.ledger;
    if l.flush_interval_ms == 0 || l.flush_interval_ms > 60_000 {
        return err(
            "ledger.flush_interval_ms",
            format!("{} is outside 1..=60000", l.flush_interval_ms),
        );
    }
    if l.buffer_rows == 0 {
        return err("ledger.buffer_rows", "must be at least 1".into());
    }
    if l.batch_rows == 0 || l.batch_rows > l.buffer_rows {
        return err(
            "ledger.batch_rows",
            format!(
                "{} is outside 1..=ledger.buffer_rows ({})",
                l.batch_rows, l.buffer_rows
            ),
        );
    }
    if !l.spool_dir.is_absolute() {
        return err(
            "ledger.spool_dir",
            format!(
                "{:?} must be an absolute path (a daemon runs from /)",
                l.spool_dir
            ),
        );
    }
    if l.spool_max_bytes < 64 * 1024 {
        return err(
            "ledger.spool_max_bytes",
            format!("{} is below the minimum of 65536", l.spool_max_bytes),
        );
    }
    if l.retention_days == 0 {
        return err("ledger.retention_days", "must be at least 1".into());
    }
    if l.sla_window_seconds == 0 || l.sla_window_seconds > 86_400 {
        return err(
            "ledger.sla_window_seconds",
            format!("{} is outside 1..=86400", l.sla_window_seconds),
        );
    }
    let schema = l.schema.as_str();
    let ident = schema.len() <= 63
        && schema
            .chars()
            .next()
            .is_some_and(|ch| ch.is_ascii_lowercase() || ch == '_')
        && schema
            .chars()
            .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || ch == '_');
    if !ident || schema.starts_with("pg_") {
        return err(
            "ledger.schema",
            format!(
                "{schema:?} must be 1 to 63 of a-z, 0-9 and _, not starting with a digit or pg_"
            ),
        );
    }
    Ok(())
}

/// Bounds the connection guard needs: zero would refuse every request or never time out.
fn limits(c: &Config) -> Result<(), ConfigError> {
    let l = &c.limits;
    let err = |key: &str, reason: String| Err(ConfigError::new(&c.source, key, reason));
    for (key, v) in [
        ("limits.max_body_bytes", l.max_body_bytes as u64),
        ("limits.header_read_timeout_ms", l.header_read_timeout_ms),
        ("limits.body_read_timeout_ms", l.body_read_timeout_ms),
        ("limits.keepalive_timeout_ms", l.keepalive_timeout_ms),
        ("limits.max_connections", l.max_connections as u64),
    ] {
        if v == 0 {
            return err(key, "must be > 0".into());
        }
    }
    if !(1..=crate::limits::PINGORA_MAX_HEADERS).contains(&l.max_headers) {
        return err(
            "limits.max_headers",
            format!(
                "must be between 1 and {} (Pingora's own limit)",
                crate::limits::PINGORA_MAX_HEADERS
            ),
        );
    }
    if !(1024..=crate::limits::PINGORA_MAX_HEADER_BYTES).contains(&l.max_header_bytes) {
        return err(
            "limits.max_header_bytes",
            format!(
                "must be between 1024 and {} (Pingora's own limit)",
                crate::limits::PINGORA_MAX_HEADER_BYTES
            ),
        );
    }
    if l.max_request_line_bytes < 64 || l.max_request_line_bytes > l.max_header_bytes {
        return err(
            "limits.max_request_line_bytes",
            format!(
                "must be between 64 and limits.max_header_bytes ({})",
                l.max_header_bytes
            ),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use crate::file::Config;
    use std::path::Path;

    fn load(yaml: &str) -> Result<Config, crate::ConfigError> {
        Config::from_yaml(yaml, "sluice.yaml", Path::new("."), None, &|_| None)
    }

    #[test]
    fn retries_ejection_and_the_budget_default_as_shipped() {
        let empty = load("{}").unwrap();
        let shipped = Config::embedded(&|_| None).unwrap();
        for cfg in [&empty, &shipped] {
            let b = &cfg.routing.retry_budget;
            assert_eq!((b.ratio, b.window_ms, b.min_retries), (0.2, 10_000, 10));
            for p in cfg.pools.iter() {
                assert_eq!(p.config.retries, 2, "{}", p.name);
                assert_eq!(p.config.ejection, crate::EjectionConfig::default());
            }
        }
        let e = crate::EjectionConfig::default();
        assert_eq!(
            (
                e.consecutive_failures,
                e.base_ejection_ms,
                e.max_ejection_ms,
                e.max_ejected_percent
            ),
            (5, 30_000, 300_000, 50)
        );
    }

    #[test]
    fn bad_retry_settings_name_their_key() {
        for (yaml, key) in [
            (
                "pools: {on-demand: {backends: ['127.0.0.1:1'], retries: 11}}",
                "pools.on-demand.retries",
            ),
            (
                "pools: {on-demand: {backends: ['127.0.0.1:1'], ejection: {base_ejection_ms: 0}}}",
                "pools.on-demand.ejection.base_ejection_ms",
            ),
            (
                "pools: {on-demand: {backends: ['127.0.0.1:1'], ejection: {max_ejection_ms: 10}}}",
                "pools.on-demand.ejection.max_ejection_ms",
            ),
            (
                "pools: {on-demand: {backends: ['127.0.0.1:1'], ejection: {max_ejected_percent: 101}}}",
                "pools.on-demand.ejection.max_ejected_percent",
            ),
            (
                "routing: {retry_budget: {ratio: 1.5}}",
                "routing.retry_budget.ratio",
            ),
            (
                "routing: {retry_budget: {window_ms: 0}}",
                "routing.retry_budget.window_ms",
            ),
        ] {
            let e = load(yaml).expect_err(yaml);
            assert_eq!(e.key, key, "{yaml}: {e}");
            assert_eq!(e.file, "sluice.yaml");
        }
        // Ejection off needs no timing.
        let off = "pools: {on-demand: {backends: ['127.0.0.1:1'], ejection: {consecutive_failures: 0, base_ejection_ms: 0}}}";
        assert!(load(off).is_ok());
    }

    #[test]
    fn a_reserved_guaranteed_pool_needs_the_fill_mark() {
        let shipped = load("{}").unwrap().policy.adaptive;
        assert!(shipped.reserves_guaranteed_pool());
        let off = "policy: {adaptive: {reserve_guaranteed_pool: false}}";
        assert!(!load(off)
            .unwrap()
            .policy
            .adaptive
            .reserves_guaranteed_pool());
        let e =
            load("policy: {adaptive: {reserve_guaranteed_pool: true, fallback_pressure_at: null}}")
                .expect_err("no fill mark");
        assert_eq!(e.key, "policy.adaptive.reserve_guaranteed_pool", "{e}");
        assert!(e.to_string().contains("fallback_pressure_at"), "{e}");
        // Unset, it follows the fill mark rather than failing a config that turns the mark off.
        let no_mark = load("policy: {adaptive: {fallback_pressure_at: null}}").unwrap();
        assert!(!no_mark.policy.adaptive.reserves_guaranteed_pool());
        let e = load("policy: {adaptive: {reserve_ttft_below_x: 0.5}}").expect_err("below 1");
        assert_eq!(e.key, "policy.adaptive.reserve_ttft_below_x", "{e}");
    }
}
