//! `SLUICE_*` environment overrides. One table ([`OVERRIDES`]) drives both the parsing and the
//! reference table of docs/configuration.md, so a knob cannot be documented without existing or vice versa. The
//! environment is read through a function so tests never touch the process environment.

use crate::error::ConfigError;
use crate::file::Config;
use sluice_policy::Tier;

pub type EnvFn = dyn Fn(&str) -> Option<String>;

pub fn process_env(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

type Setter = fn(&mut Config, &str) -> Result<(), String>;

/// (variable, config key it overrides, setter)
pub const OVERRIDES: &[(&str, &str, Setter)] = &[
    (
        "SLUICE_STATE_CONSECUTIVE_SAMPLES",
        "stability.consecutive_samples",
        |c, v| {
            c.stability.consecutive_samples = num(v)?;
            Ok(())
        },
    ),
    (
        "SLUICE_STATE_COOLDOWN_SECONDS",
        "stability.cooldown_seconds",
        |c, v| {
            c.stability.cooldown_seconds = num(v)?;
            Ok(())
        },
    ),
    ("SLUICE_STATE_HYSTERESIS", "stability.hysteresis", |c, v| {
        c.stability.hysteresis = num(v)?;
        Ok(())
    }),
    (
        "SLUICE_FALLBACK_PRESSURE_AT",
        "fallback.pressure_at",
        |c, v| {
            c.fallback.pressure_at = num(v)?;
            Ok(())
        },
    ),
    (
        "SLUICE_FALLBACK_RECOVER_BELOW",
        "fallback.recover_below",
        |c, v| {
            c.fallback.recover_below = num(v)?;
            Ok(())
        },
    ),
    (
        "SLUICE_FALLBACK_SUSTAINED_INTERVALS",
        "fallback.sustained_intervals",
        |c, v| {
            c.fallback.sustained_intervals = num(v)?;
            Ok(())
        },
    ),
    (
        "SLUICE_FALLBACK_COOLDOWN_SECONDS",
        "fallback.cooldown_seconds",
        |c, v| {
            c.fallback.cooldown_seconds = num(v)?;
            Ok(())
        },
    ),
    ("SLUICE_QUEUE_MAX_SIZE", "queue.max_size", |c, v| {
        c.queue.max_size = num(v)?;
        Ok(())
    }),
    (
        "SLUICE_QUEUE_MAX_WAIT_SECONDS",
        "queue.max_wait_seconds",
        |c, v| {
            c.queue.max_wait_seconds = num(v)?;
            Ok(())
        },
    ),
    ("SLUICE_QUEUE_POLL_SECONDS", "queue.poll_seconds", |c, v| {
        c.queue.poll_seconds = num(v)?;
        Ok(())
    }),
    (
        "SLUICE_TIER_INFLIGHT_CAPACITY",
        "tiers.<tier>.inflight_capacity",
        |c, v| {
            for part in v.split(',').filter(|p| !p.trim().is_empty()) {
                let (tier, n) = part
                    .split_once('=')
                    .ok_or_else(|| format!("expected Tier=N[,Tier=N…], got {part:?}"))?;
                let tier = Tier::parse(tier).ok_or_else(|| format!("unknown tier {tier:?}"))?;
                let n = Some(num(n)?);
                match tier {
                    Tier::Guaranteed => c.tiers.guaranteed.inflight_capacity = n,
                    Tier::Standard => c.tiers.standard.inflight_capacity = n,
                    Tier::BestEffort => c.tiers.best_effort.inflight_capacity = n,
                }
            }
            Ok(())
        },
    ),
    ("SLUICE_POLICY_MODE", "policy.mode", |c, v| {
        c.policy.mode = v.to_string();
        Ok(())
    }),
    ("SLUICE_MAX_BODY_BYTES", "limits.max_body_bytes", |c, v| {
        c.limits.max_body_bytes = num(v)?;
        Ok(())
    }),
    ("SLUICE_REQUIRE_API_KEY", "auth.require_api_key", |c, v| {
        c.auth.require_api_key = flag(v)?;
        Ok(())
    }),
    ("SLUICE_OPS_LISTEN", "ops_listen", |c, v| {
        // Comma separated, as a container's environment gives a list.
        c.ops_listen = v.split(',').map(|a| a.trim().to_string()).collect();
        Ok(())
    }),
    ("SLUICE_ADMIN_TOKEN", "auth.admin_token", |c, v| {
        c.auth.admin_token = Some(v.to_string());
        Ok(())
    }),
    ("SLUICE_DATABASE_URL", "database_url", |c, v| {
        c.database_url = Some(v.to_string());
        Ok(())
    }),
    ("SLUICE_LEDGER_SCHEMA", "ledger.schema", |c, v| {
        c.ledger.schema = v.to_string();
        Ok(())
    }),
    (
        "SLUICE_LEDGER_FLUSH_INTERVAL_MS",
        "ledger.flush_interval_ms",
        |c, v| {
            c.ledger.flush_interval_ms = num(v)?;
            Ok(())
        },
    ),
    ("SLUICE_LEDGER_BATCH_ROWS", "ledger.batch_rows", |c, v| {
        c.ledger.batch_rows = num(v)?;
        Ok(())
    }),
    ("SLUICE_SPOOL_DIR", "ledger.spool_dir", |c, v| {
        c.ledger.spool_dir = v.into();
        Ok(())
    }),
    ("SLUICE_REDIS_URL", "redis_url", |c, v| {
        c.redis_url = Some(v.to_string());
        Ok(())
    }),
    (
        "SLUICE_REDIS_PREFIX",
        "coordination.redis_prefix",
        |c, v| {
            c.coordination.redis_prefix = v.to_string();
            Ok(())
        },
    ),
    ("SLUICE_PROMETHEUS_URL", "prometheus_url", |c, v| {
        c.prometheus_url = Some(v.to_string());
        Ok(())
    }),
    ("SLUICE_SIGNALS_SOURCE", "signals.source", |c, v| {
        c.signals.source = super::SignalSource::parse(v)
            .ok_or_else(|| format!("expected scrape, prometheus or both, got {v:?}"))?;
        Ok(())
    }),
    (
        "SLUICE_TRACING_ENABLED",
        "telemetry.tracing.enabled",
        |c, v| {
            c.telemetry.tracing.enabled = flag(v)?;
            Ok(())
        },
    ),
];

/// The OTLP exporter's endpoint variables: either names a collector.
const COLLECTOR_VARIABLES: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// The process environment, in which a collector named by `OTEL_EXPORTER_OTLP_ENDPOINT` or
/// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` also turns tracing on (`SLUICE_TRACING_ENABLED=true`
/// unless that is set): what `sluice demo` reads, whose embedded config leaves tracing off and
/// has no file to turn it on in. `OTEL_SDK_DISABLED=true` still turns it off.
pub fn process_env_tracing_to_named_collector(name: &str) -> Option<String> {
    let named = || COLLECTOR_VARIABLES.iter().any(|v| process_env(v).is_some());
    match process_env(name) {
        None if name == "SLUICE_TRACING_ENABLED" && named() => Some("true".into()),
        v => v,
    }
}

fn flag(v: &str) -> Result<bool, String> {
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" => Ok(false),
        _ => Err(format!("expected true or false, got {v:?}")),
    }
}

fn num<T: std::str::FromStr>(v: &str) -> Result<T, String> {
    v.trim()
        .parse()
        .map_err(|_| format!("{v:?} is not a valid {}", std::any::type_name::<T>()))
}

/// The `SLUICE_*` overrides, then OpenTelemetry's `OTEL_*` variables over `telemetry.tracing`
/// (so `OTEL_SDK_DISABLED=true` wins over `SLUICE_TRACING_ENABLED`). A variable OpenTelemetry
/// says to ignore when unreadable (a sampler name, a number) is logged as a warning.
pub fn apply(cfg: &mut Config, env: &EnvFn) -> Result<(), ConfigError> {
    for (var, key, set) in OVERRIDES {
        if let Some(value) = env(var) {
            set(cfg, &value)
                .map_err(|reason| ConfigError::new(format!("environment {var}"), *key, reason))?;
        }
    }
    let warnings = cfg.telemetry.tracing.apply_env(env).map_err(|e| {
        let var = e.variable.unwrap_or("OTEL_*");
        ConfigError::new(format!("environment {var}"), e.key, e.reason)
    })?;
    for w in warnings {
        log::warn!(
            "{}",
            serde_json::json!({"event": "config_warning", "key": "telemetry.tracing", "warning": w})
        );
    }
    Ok(())
}
