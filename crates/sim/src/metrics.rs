//! vLLM's Prometheus metrics, in text exposition format 0.0.4.
//!
//! Names, label keys and HELP strings follow vLLM (v0.10+, the inter-token histogram as v0.11
//! names it; with `legacy` the pre-0.10 KV gauge name, and the inter-token histogram also under
//! its ≤ 0.10 name) so anything that scrapes a real engine can scrape the simulator unchanged. With
//! several engines, each request is counted on one engine and the gauges are split so sums and
//! averages across the `engine` label come out right.

use std::fmt::Write as _;
use std::sync::{Mutex, PoisonError};

const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
];
/// vLLM's bounds for `vllm:inter_token_latency_seconds` (and the older
/// `vllm:time_per_output_token_seconds`).
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
];

/// Why a request left the engine, as vLLM's `finished_reason` label spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Finish {
    Stop,
    Length,
    Abort,
}

impl Finish {
    const ALL: [Finish; 3] = [Finish::Stop, Finish::Length, Finish::Abort];

    pub(crate) fn from_reason(reason: &str) -> Self {
        match reason {
            "length" => Finish::Length,
            "abort" => Finish::Abort,
            _ => Finish::Stop,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Abort => "abort",
        }
    }
}

#[derive(Debug, Clone)]
struct Histogram {
    bounds: &'static [f64],
    /// Per-bucket (not cumulative) counts; the last slot is the +Inf overflow.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    fn observe(&mut self, v: f64) {
        let i = self
            .bounds
            .iter()
            .position(|b| v <= *b)
            .unwrap_or(self.bounds.len());
        if let Some(c) = self.counts.get_mut(i) {
            *c += 1;
        }
        self.sum += v;
        self.count += 1;
    }
}

#[derive(Debug, Clone)]
struct EngineCounters {
    prompt_tokens: u64,
    generation_tokens: u64,
    success: [u64; 3],
    /// Prompt tokens looked up in the prefix cache, and those found, as vLLM v1 counts them.
    prefix_queries: u64,
    prefix_hits: u64,
    ttft: Histogram,
    /// The gap before each decoded token after a request's first, as vLLM observes
    /// `vllm:inter_token_latency_seconds`.
    itl: Histogram,
    e2e: Histogram,
    /// Waiting-queue time, observed when a request is scheduled (as vLLM does).
    queue_time: Histogram,
}

impl EngineCounters {
    fn new() -> Self {
        Self {
            prompt_tokens: 0,
            generation_tokens: 0,
            success: [0; 3],
            prefix_queries: 0,
            prefix_hits: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            queue_time: Histogram::new(E2E_BUCKETS),
        }
    }
}

/// The gauges as they should be reported in total, before splitting across engines.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Gauges {
    pub running: u64,
    pub waiting: u64,
    pub kv_usage: f64,
}

pub(crate) struct Metrics {
    engines: Mutex<Vec<EngineCounters>>,
}

impl Metrics {
    pub(crate) fn new(engines: usize) -> Self {
        Self {
            engines: Mutex::new(vec![EngineCounters::new(); engines.max(1)]),
        }
    }

    fn with(&self, engine: usize, f: impl FnOnce(&mut EngineCounters)) {
        let mut all = self.engines.lock().unwrap_or_else(PoisonError::into_inner);
        let n = all.len();
        if let Some(e) = all.get_mut(engine % n.max(1)) {
            f(e);
        }
    }

    /// A request left the waiting queue after `wait_secs`.
    pub(crate) fn scheduled(&self, engine: usize, wait_secs: f64) {
        self.with(engine, |e| e.queue_time.observe(wait_secs));
    }

    /// A scheduled request looked up `queried` prompt tokens in the prefix cache and found `hit`.
    pub(crate) fn prefix_cache(&self, engine: usize, queried: u64, hit: u64) {
        self.with(engine, |e| {
            e.prefix_queries += queried;
            e.prefix_hits += hit;
        });
    }

    pub(crate) fn first_token(&self, engine: usize, prompt_tokens: u64, ttft_secs: f64) {
        self.with(engine, |e| {
            e.prompt_tokens += prompt_tokens;
            e.ttft.observe(ttft_secs);
        });
    }

    /// Decoded tokens after a request's first, each with the gap (seconds) since the token
    /// before it: one inter-token-latency observation each, as vLLM makes one per token.
    pub(crate) fn inter_tokens(&self, engine: usize, gaps: &[f64]) {
        if gaps.is_empty() {
            return;
        }
        self.with(engine, |e| {
            for gap in gaps {
                e.itl.observe(*gap);
            }
        });
    }

    /// Records a finished (or aborted) request with the tokens it actually generated.
    pub(crate) fn finish(&self, engine: usize, reason: Finish, generated: u64, e2e_secs: f64) {
        self.with(engine, |e| {
            e.generation_tokens += generated;
            if let Some(c) = Finish::ALL
                .iter()
                .position(|r| *r == reason)
                .and_then(|i| e.success.get_mut(i))
            {
                *c += 1;
            }
            e.e2e.observe(e2e_secs);
        });
    }

    pub(crate) fn render(&self, model: &str, legacy: bool, g: Gauges) -> String {
        let engines = self
            .engines
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let n = engines.len() as u64;
        let model = escape_label(model);
        let labels = |i: usize| format!("model_name=\"{model}\",engine=\"{i}\"");
        let mut out = String::with_capacity(4096);

        header(
            &mut out,
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            "gauge",
        );
        for i in 0..engines.len() {
            let v = split(g.running, n, i as u64);
            sample(&mut out, "vllm:num_requests_running", &labels(i), v as f64);
        }
        header(
            &mut out,
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            "gauge",
        );
        for i in 0..engines.len() {
            let v = split(g.waiting, n, i as u64);
            sample(&mut out, "vllm:num_requests_waiting", &labels(i), v as f64);
        }
        let (kv_name, kv_help) = if legacy {
            (
                "vllm:gpu_cache_usage_perc",
                "GPU KV-cache usage. 1 means 100 percent usage.",
            )
        } else {
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
            )
        };
        header(&mut out, kv_name, kv_help, "gauge");
        for i in 0..engines.len() {
            // Usage is a fraction of each engine's own cache, so with an even split every
            // engine reports the same value.
            sample(&mut out, kv_name, &labels(i), g.kv_usage.clamp(0.0, 1.0));
        }

        // vLLM v1 declares these as counters `vllm:prefix_cache_queries` / `_hits`;
        // prometheus_client exposes counters with the `_total` suffix.
        for (name, help, value) in [
            (
                "vllm:prefix_cache_queries_total",
                "Prefix cache queries, in terms of number of queried tokens.",
                (|e: &EngineCounters| e.prefix_queries) as fn(&EngineCounters) -> u64,
            ),
            (
                "vllm:prefix_cache_hits_total",
                "Prefix cache hits, in terms of number of cached tokens.",
                |e: &EngineCounters| e.prefix_hits,
            ),
        ] {
            header(&mut out, name, help, "counter");
            for (i, e) in engines.iter().enumerate() {
                sample(&mut out, name, &labels(i), value(e) as f64);
            }
        }

        let name = "vllm:prompt_tokens_total";
        header(
            &mut out,
            name,
            "Number of prefill tokens processed.",
            "counter",
        );
        for (i, e) in engines.iter().enumerate() {
            sample(&mut out, name, &labels(i), e.prompt_tokens as f64);
        }
        let name = "vllm:generation_tokens_total";
        header(
            &mut out,
            name,
            "Number of generation tokens processed.",
            "counter",
        );
        for (i, e) in engines.iter().enumerate() {
            sample(&mut out, name, &labels(i), e.generation_tokens as f64);
        }
        let name = "vllm:request_success_total";
        header(
            &mut out,
            name,
            "Count of successfully processed requests.",
            "counter",
        );
        for (i, e) in engines.iter().enumerate() {
            for (reason, count) in Finish::ALL.iter().zip(e.success) {
                let l = format!("{},finished_reason=\"{}\"", labels(i), reason.as_str());
                sample(&mut out, name, &l, count as f64);
            }
        }

        let name = "vllm:time_to_first_token_seconds";
        header(
            &mut out,
            name,
            "Histogram of time to first token in seconds.",
            "histogram",
        );
        for (i, e) in engines.iter().enumerate() {
            histogram(&mut out, name, &labels(i), &e.ttft);
        }
        // vLLM ≤ 0.10 named this histogram `vllm:time_per_output_token_seconds`; 0.11 exports
        // both names, the old one deprecated.
        let mut itl_names = vec![(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
        )];
        if legacy {
            itl_names.push((
                "vllm:time_per_output_token_seconds",
                "Histogram of time per output token in seconds.",
            ));
        }
        for (name, help) in itl_names {
            header(&mut out, name, help, "histogram");
            for (i, e) in engines.iter().enumerate() {
                histogram(&mut out, name, &labels(i), &e.itl);
            }
        }
        let name = "vllm:request_queue_time_seconds";
        header(
            &mut out,
            name,
            "Histogram of time spent in WAITING phase for request.",
            "histogram",
        );
        for (i, e) in engines.iter().enumerate() {
            histogram(&mut out, name, &labels(i), &e.queue_time);
        }
        let name = "vllm:e2e_request_latency_seconds";
        header(
            &mut out,
            name,
            "Histogram of e2e request latency in seconds.",
            "histogram",
        );
        for (i, e) in engines.iter().enumerate() {
            histogram(&mut out, name, &labels(i), &e.e2e);
        }
        out
    }
}

/// Engine `i`'s share of `total` when split as evenly as integers allow.
fn split(total: u64, n: u64, i: u64) -> u64 {
    let n = n.max(1);
    total / n + u64::from(i < total % n)
}

fn header(out: &mut String, name: &str, help: &str, kind: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn sample(out: &mut String, name: &str, labels: &str, v: f64) {
    let _ = writeln!(out, "{name}{{{labels}}} {}", fmt_value(v));
}

fn histogram(out: &mut String, name: &str, labels: &str, h: &Histogram) {
    let mut cumulative = 0;
    for (bound, count) in h.bounds.iter().zip(&h.counts) {
        cumulative += count;
        let l = format!("{labels},le=\"{}\"", fmt_value(*bound));
        sample(out, &format!("{name}_bucket"), &l, cumulative as f64);
    }
    sample(
        out,
        &format!("{name}_bucket"),
        &format!("{labels},le=\"+Inf\""),
        h.count as f64,
    );
    sample(out, &format!("{name}_sum"), labels, h.sum);
    sample(out, &format!("{name}_count"), labels, h.count as f64);
}

/// Formats like Python's prometheus_client (`1.0`, not `1`), which is what vLLM emits.
fn fmt_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Parses every sample line into `name{labels}` → value, failing on anything malformed.
    fn parse(text: &str) -> HashMap<String, f64> {
        let mut out = HashMap::new();
        let mut typed = Vec::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let mut parts = rest.split(' ');
                typed.push(parts.next().unwrap().to_string());
                assert!(matches!(
                    parts.next(),
                    Some("gauge" | "counter" | "histogram")
                ));
                continue;
            }
            if line.starts_with("# HELP ") {
                continue;
            }
            let (series, value) = line.rsplit_once(' ').unwrap();
            let name = series.split('{').next().unwrap();
            assert!(
                typed.iter().any(|t| name.starts_with(t.as_str())),
                "sample before its TYPE: {line}"
            );
            assert!(series.ends_with('}'), "{line}");
            out.insert(series.to_string(), value.parse::<f64>().unwrap());
        }
        out
    }

    #[test]
    fn renders_vllm_names_and_values() {
        let m = Metrics::new(1);
        m.prefix_cache(0, 100, 64);
        m.prefix_cache(0, 20, 0);
        m.first_token(0, 10, 0.015);
        m.finish(0, Finish::Length, 7, 0.2);
        let text = m.render(
            "llama",
            false,
            Gauges {
                running: 3,
                waiting: 2,
                kv_usage: 0.25,
            },
        );
        let s = parse(&text);
        let l = "model_name=\"llama\",engine=\"0\"";
        assert_eq!(s[&format!("vllm:num_requests_running{{{l}}}")], 3.0);
        assert_eq!(s[&format!("vllm:num_requests_waiting{{{l}}}")], 2.0);
        assert_eq!(s[&format!("vllm:kv_cache_usage_perc{{{l}}}")], 0.25);
        assert_eq!(s[&format!("vllm:prompt_tokens_total{{{l}}}")], 10.0);
        assert_eq!(s[&format!("vllm:prefix_cache_queries_total{{{l}}}")], 120.0);
        assert_eq!(s[&format!("vllm:prefix_cache_hits_total{{{l}}}")], 64.0);
        assert!(text.contains("# TYPE vllm:prefix_cache_hits_total counter\n"));
        assert_eq!(s[&format!("vllm:generation_tokens_total{{{l}}}")], 7.0);
        assert_eq!(
            s[&format!("vllm:request_success_total{{{l},finished_reason=\"length\"}}")],
            1.0
        );
        assert_eq!(
            s[&format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"0.01\"}}")],
            0.0
        );
        assert_eq!(
            s[&format!("vllm:time_to_first_token_seconds_bucket{{{l},le=\"0.02\"}}")],
            1.0
        );
        assert_eq!(
            s[&format!("vllm:e2e_request_latency_seconds_bucket{{{l},le=\"+Inf\"}}")],
            1.0
        );
        assert_eq!(
            s[&format!("vllm:e2e_request_latency_seconds_count{{{l}}}")],
            1.0
        );
        assert_eq!(
            s[&format!("vllm:e2e_request_latency_seconds_sum{{{l}}}")],
            0.2
        );
        assert!(text.contains("# TYPE vllm:time_to_first_token_seconds histogram\n"));
        assert!(!text.contains("gpu_cache_usage_perc"));
        assert!(text.contains("vllm:num_requests_running{model_name=\"llama\",engine=\"0\"} 3.0\n"));
    }

    #[test]
    fn legacy_name_and_engine_split() {
        let m = Metrics::new(2);
        let text = m.render(
            "m",
            true,
            Gauges {
                running: 5,
                waiting: 1,
                kv_usage: 0.5,
            },
        );
        let s = parse(&text);
        assert!(!text.contains("vllm:kv_cache_usage_perc"));
        let running: f64 = (0..2)
            .map(|i| s[&format!("vllm:num_requests_running{{model_name=\"m\",engine=\"{i}\"}}")])
            .sum();
        assert_eq!(running, 5.0);
        let waiting: f64 = (0..2)
            .map(|i| s[&format!("vllm:num_requests_waiting{{model_name=\"m\",engine=\"{i}\"}}")])
            .sum();
        assert_eq!(waiting, 1.0);
        for i in 0..2 {
            assert_eq!(
                s[&format!("vllm:gpu_cache_usage_perc{{model_name=\"m\",engine=\"{i}\"}}")],
                0.5
            );
        }
    }

    #[test]
    fn inter_token_latency_under_its_name_and_with_legacy_also_the_old_one() {
        let m = Metrics::new(2);
        m.inter_tokens(1, &[0.02, 0.02, 0.3]);
        m.inter_tokens(1, &[]);
        let g = Gauges {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
        };
        let current = m.render("m", false, g);
        assert!(!current.contains("vllm:time_per_output_token_seconds"));
        let legacy = m.render("m", true, g);
        assert!(legacy.contains("# TYPE vllm:time_per_output_token_seconds histogram\n"));
        for (text, name) in [
            (&current, "vllm:inter_token_latency_seconds"),
            (&legacy, "vllm:inter_token_latency_seconds"),
            (&legacy, "vllm:time_per_output_token_seconds"),
        ] {
            assert!(text.contains(&format!("# TYPE {name} histogram\n")));
            let s = parse(text);
            let l = |i: usize| format!("model_name=\"m\",engine=\"{i}\"");
            assert_eq!(s[&format!("{name}_count{{{}}}", l(0))], 0.0);
            assert_eq!(s[&format!("{name}_count{{{}}}", l(1))], 3.0);
            assert!((s[&format!("{name}_sum{{{}}}", l(1))] - 0.34).abs() < 1e-12);
            // vLLM's bounds: 10 ms, 25 ms, … 80 s.
            let bucket = |le: &str| s[&format!("{name}_bucket{{{},le=\"{le}\"}}", l(1))];
            assert_eq!(bucket("0.01"), 0.0);
            assert_eq!(bucket("0.025"), 2.0);
            assert_eq!(bucket("0.2"), 2.0);
            assert_eq!(bucket("0.3"), 3.0);
            assert_eq!(bucket("80.0"), 3.0);
            assert_eq!(bucket("+Inf"), 3.0);
        }
    }

    #[test]
    fn value_formatting() {
        assert_eq!(fmt_value(1.0), "1.0");
        assert_eq!(fmt_value(0.25), "0.25");
        assert_eq!(fmt_value(f64::INFINITY), "+Inf");
        assert_eq!(escape_label("a\"b"), "a\\\"b");
    }
}
