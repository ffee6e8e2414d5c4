//! Reads vLLM's Prometheus text exposition. Pure: bytes in, numbers out.
//!
//! KV usage comes from `vllm:kv_cache_usage_perc` (vLLM ≥ 0.10) or `vllm:gpu_cache_usage_perc`
//! (older), both 0–1 fractions, averaged over `engine` series (each engine owns its own cache);
//! the waiting queue is `vllm:num_requests_waiting`, summed over engines.

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BackendReading {
    /// KV-cache usage as a fraction 0–1.
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
}

const KV_CURRENT: &str = "vllm:kv_cache_usage_perc";
const KV_LEGACY: &str = "vllm:gpu_cache_usage_perc";
const WAITING: &str = "vllm:num_requests_waiting";

pub fn parse(text: &str) -> BackendReading {
    let (mut kv_now, mut kv_old, mut waiting) = (Vec::new(), Vec::new(), Vec::new());
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let Some((name, value)) = sample(line) else {
            continue;
        };
        match name {
            KV_CURRENT => kv_now.push(value),
            KV_LEGACY => kv_old.push(value),
            WAITING => waiting.push(value),
            _ => {}
        }
    }
    let kv = if kv_now.is_empty() { kv_old } else { kv_now };
    BackendReading {
        kv_usage: (!kv.is_empty()).then(|| kv.iter().sum::<f64>() / kv.len() as f64),
        waiting: (!waiting.is_empty()).then(|| waiting.iter().sum()),
    }
}

/// `name{labels} value [timestamp]` → (name, value). Non-finite values are dropped: a NaN
/// gauge must read as unavailable, never as a number.
fn sample(line: &str) -> Option<(&str, f64)> {
    let (name, rest) = match line.find('{') {
        Some(i) => {
            let close = line[i..].find('}')? + i;
            (&line[..i], &line[close + 1..])
        }
        None => line.split_once(char::is_whitespace)?,
    };
    let value: f64 = rest.split_whitespace().next()?.parse().ok()?;
    value.is_finite().then_some((name.trim(), value))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn averages_kv_and_sums_waiting_over_engines() {
        let text = "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n\
# TYPE vllm:kv_cache_usage_perc gauge\n\
vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.5\n\
vllm:kv_cache_usage_perc{engine=\"1\",model_name=\"m\"} 0.7\n\
vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 3.0\n\
vllm:num_requests_waiting{engine=\"1\",model_name=\"m\"} 4.0\n\
vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 9.0\n";
        let r = parse(text);
        assert!((r.kv_usage.unwrap() - 0.6).abs() < 1e-9);
        assert_eq!(r.waiting, Some(7.0));
    }

    #[test]
    fn legacy_name_and_missing_metrics() {
        let r = parse("vllm:gpu_cache_usage_perc{model_name=\"m\"} 0.25 1700000000000\n");
        assert_eq!(r.kv_usage, Some(0.25));
        assert_eq!(r.waiting, None);
        assert_eq!(parse("up 1\n"), BackendReading::default());
    }

    #[test]
    fn nan_and_garbage_are_unavailable() {
        let r = parse("vllm:kv_cache_usage_perc{engine=\"0\"} NaN\nvllm:num_requests_waiting{engine=\"0\"} abc\n");
        assert_eq!(r, BackendReading::default());
    }
}
