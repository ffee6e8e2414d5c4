//! Reads vLLM's Prometheus text exposition. Pure: bytes in, numbers out.
//!
//! KV usage comes from `vllm:kv_cache_usage_perc` (vLLM ≥ 0.10) or `vllm:gpu_cache_usage_perc`
//! (older), both 0–1 fractions, averaged over `engine` series (each engine owns its own cache);
//! the waiting queue is `vllm:num_requests_waiting`, summed over engines. The delay histograms
//! (`vllm:request_queue_time_seconds`, `vllm:time_to_first_token_seconds`) and the pace histogram
//! (`vllm:inter_token_latency_seconds`, vLLM ≥ 0.11, or its older name
//! `vllm:time_per_output_token_seconds`: one observation per decoded token after a request's
//! first) are read as their cumulative `_sum` and `_count`, summed over series: a mean over an
//! interval is the difference of two scrapes.

/// The shortest span a delay is read over. A queue served by a few requests per scrape gives a
/// Little's-law estimate (waiting × interval / served) that swings by multiples between two short
/// intervals, and the controller extrapolates the growth between readings: so with scrapes
/// closer together than this the difference is taken against an older scrape.
pub const DELAY_SPAN_MS: f64 = 500.0;

/// Recent scrapes' cumulative readings, to diff the newest against one at least
/// [`DELAY_SPAN_MS`] older.
#[derive(Debug, Clone, Default)]
pub struct DelaySpan<T> {
    rounds: std::collections::VecDeque<(f64, T)>,
}

impl<T: Copy> DelaySpan<T> {
    /// Records the reading taken at `at_ms` and returns the one to diff it against: the newest
    /// held at least the span older, else the oldest held (none at the first reading).
    pub fn push(&mut self, at_ms: f64, reading: T) -> Option<(f64, T)> {
        while self.rounds.len() > 1 && at_ms - self.rounds[1].0 >= DELAY_SPAN_MS {
            self.rounds.pop_front();
        }
        let base = self.rounds.front().copied();
        self.rounds.push_back((at_ms, reading));
        base
    }
}

/// How long vLLM's waiting queue has served nobody. At a GPU's pace requests leave the queue
/// seconds apart, so a span with no leaver says only "at least the span"; but the request at the
/// head has waited at least since the first reading of this stall (the queue was not empty and
/// nobody left it since), a lower bound that grows while the stall lasts.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct QueueStall {
    /// When the stall was first seen, and the queue histogram's count then.
    since: Option<(f64, f64)>,
}

impl QueueStall {
    /// Records the queue at `at_ms`: its waiting requests and how many have left it so far (the
    /// queue-time histogram's count). Returns how long it has served nobody while requests
    /// waited (0 when someone left since the last reading, or nobody waits).
    pub fn observe(&mut self, at_ms: f64, waiting: f64, left: Option<f64>) -> f64 {
        let Some(left) = left.filter(|_| waiting > 0.0) else {
            self.since = None;
            return 0.0;
        };
        match self.since {
            Some((t, c)) if c == left => (at_ms - t).max(0.0),
            _ => {
                self.since = Some((at_ms, left));
                0.0
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct BackendReading {
    /// KV-cache usage as a fraction 0–1.
    pub kv_usage: Option<f64>,
    pub waiting: Option<f64>,
    pub queue_time: Option<Histogram>,
    pub ttft: Option<Histogram>,
    /// The inter-token latency histogram (under either name).
    pub itl: Option<Histogram>,
    /// The prefix cache's cumulative hit and queried prompt tokens, summed over engines.
    pub prefix_cache: Option<PrefixCache>,
}

/// A histogram's cumulative sum (seconds) and count.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Histogram {
    pub sum: f64,
    pub count: f64,
}

impl Histogram {
    /// Mean in milliseconds of what was observed between `earlier` and `self`; `None` when
    /// nothing was observed or a counter went backwards (a restarted backend).
    pub fn mean_ms_since(&self, earlier: &Histogram) -> Option<f64> {
        let (ds, dc) = (self.sum - earlier.sum, self.count - earlier.count);
        (dc > 0.0 && ds >= 0.0).then(|| 1000.0 * ds / dc)
    }

    /// The wait a request joining vLLM's queue now can expect, from two readings of the
    /// queue-time histogram `interval_ms` apart and the current `waiting` count: the larger of
    /// the mean wait of those who left the queue (what was) and, by Little's law, the waiting
    /// requests over the rate at which the queue is served (what a newcomer meets). A queue
    /// nobody left while requests sat in it has waited at least the interval.
    pub fn interval_delay_ms(
        &self,
        earlier: &Histogram,
        waiting: f64,
        interval_ms: f64,
    ) -> Option<f64> {
        if self.count < earlier.count || self.sum < earlier.sum {
            return None;
        }
        let served = self.count - earlier.count;
        let ahead = if waiting <= 0.0 {
            0.0
        } else if served > 0.0 {
            waiting * interval_ms / served
        } else {
            interval_ms
        };
        Some(self.mean_ms_since(earlier).unwrap_or(0.0).max(ahead))
    }

    pub fn add(a: Option<Histogram>, b: Option<Histogram>) -> Option<Histogram> {
        match (a, b) {
            (Some(a), Some(b)) => Some(Histogram {
                sum: a.sum + b.sum,
                count: a.count + b.count,
            }),
            (a, b) => a.or(b),
        }
    }
}

const KV_CURRENT: &str = "vllm:kv_cache_usage_perc";
const KV_LEGACY: &str = "vllm:gpu_cache_usage_perc";
const WAITING: &str = "vllm:num_requests_waiting";
const QUEUE_TIME_SUM: &str = "vllm:request_queue_time_seconds_sum";
const QUEUE_TIME_COUNT: &str = "vllm:request_queue_time_seconds_count";
const TTFT_SUM: &str = "vllm:time_to_first_token_seconds_sum";
const TTFT_COUNT: &str = "vllm:time_to_first_token_seconds_count";
const ITL_SUM: &str = "vllm:inter_token_latency_seconds_sum";
const ITL_COUNT: &str = "vllm:inter_token_latency_seconds_count";
const ITL_LEGACY_SUM: &str = "vllm:time_per_output_token_seconds_sum";
const ITL_LEGACY_COUNT: &str = "vllm:time_per_output_token_seconds_count";
/// vLLM v1 declares counters `vllm:prefix_cache_hits` and `_queries` (tokens), which
/// Prometheus's client exposes with `_total`; some releases named them `gpu_prefix_cache_*`.
const PREFIX_HITS: [&str; 2] = [
    "vllm:prefix_cache_hits_total",
    "vllm:gpu_prefix_cache_hits_total",
];
const PREFIX_QUERIES: [&str; 2] = [
    "vllm:prefix_cache_queries_total",
    "vllm:gpu_prefix_cache_queries_total",
];

pub use crate::fleet::PrefixCache;

pub fn parse(text: &str) -> BackendReading {
    let (mut kv_now, mut kv_old, mut waiting) = (Vec::new(), Vec::new(), Vec::new());
    // (sum, count) seen for each histogram; both halves are needed for a reading.
    let mut queue = (None::<f64>, None::<f64>);
    let mut ttft = (None::<f64>, None::<f64>);
    let mut itl = (None::<f64>, None::<f64>);
    let mut itl_old = (None::<f64>, None::<f64>);
    // (hits, queries) under the current names and the older ones.
    let mut prefix = [(None::<f64>, None::<f64>); 2];
    let add = |slot: &mut Option<f64>, v: f64| *slot = Some(slot.unwrap_or(0.0) + v);
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
            QUEUE_TIME_SUM => add(&mut queue.0, value),
            QUEUE_TIME_COUNT => add(&mut queue.1, value),
            TTFT_SUM => add(&mut ttft.0, value),
            TTFT_COUNT => add(&mut ttft.1, value),
            ITL_SUM => add(&mut itl.0, value),
            ITL_COUNT => add(&mut itl.1, value),
            ITL_LEGACY_SUM => add(&mut itl_old.0, value),
            ITL_LEGACY_COUNT => add(&mut itl_old.1, value),
            n => {
                if let Some(i) = PREFIX_HITS.iter().position(|p| *p == n) {
                    add(&mut prefix[i].0, value);
                } else if let Some(i) = PREFIX_QUERIES.iter().position(|p| *p == n) {
                    add(&mut prefix[i].1, value);
                }
            }
        }
    }
    let kv = if kv_now.is_empty() { kv_old } else { kv_now };
    let histogram = |(sum, count): (Option<f64>, Option<f64>)| {
        Some(Histogram {
            sum: sum?,
            count: count?,
        })
    };
    BackendReading {
        kv_usage: (!kv.is_empty()).then(|| kv.iter().sum::<f64>() / kv.len() as f64),
        waiting: (!waiting.is_empty()).then(|| waiting.iter().sum()),
        queue_time: histogram(queue),
        ttft: histogram(ttft),
        // vLLM 0.11 exports both names for the same observations: the current one wins.
        itl: histogram(itl).or_else(|| histogram(itl_old)),
        prefix_cache: prefix.iter().find_map(|(hits, queries)| {
            Some(PrefixCache {
                hits: (*hits)?,
                queries: (*queries)?,
            })
        }),
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
    fn prefix_cache_counters_are_summed_over_engines_under_either_name() {
        let text = "# TYPE vllm:prefix_cache_hits_total counter\n\
                    vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 600\n\
                    vllm:prefix_cache_hits_total{engine=\"1\",model_name=\"m\"} 400\n\
                    vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"m\"} 3000\n\
                    vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"m\"} 1000\n";
        let p = parse(text).prefix_cache.unwrap();
        assert_eq!((p.hits, p.queries), (1000.0, 4000.0));
        let older = "vllm:gpu_prefix_cache_hits_total{engine=\"0\"} 5\n\
                     vllm:gpu_prefix_cache_queries_total{engine=\"0\"} 10\n";
        assert_eq!(parse(older).prefix_cache.unwrap().rate(), Some(0.5));
        let half = "vllm:prefix_cache_hits_total 5\n";
        assert_eq!(parse(half).prefix_cache, None, "hits without queries");
    }

    #[test]
    fn delay_histograms_are_summed_and_differenced() {
        let text = "vllm:request_queue_time_seconds_sum{engine=\"0\"} 1.5\n\
                    vllm:request_queue_time_seconds_count{engine=\"0\"} 3\n\
                    vllm:request_queue_time_seconds_sum{engine=\"1\"} 0.5\n\
                    vllm:request_queue_time_seconds_count{engine=\"1\"} 1\n\
                    vllm:request_queue_time_seconds_bucket{engine=\"1\",le=\"+Inf\"} 1\n\
                    vllm:time_to_first_token_seconds_sum 2\n";
        let r = parse(text);
        let q = r.queue_time.unwrap();
        assert_eq!((q.sum, q.count), (2.0, 4.0));
        assert_eq!(r.ttft, None, "a sum without its count is no reading");
        let later = Histogram {
            sum: 3.0,
            count: 6.0,
        };
        assert_eq!(later.mean_ms_since(&q), Some(500.0));
        assert_eq!(q.mean_ms_since(&q), None, "nothing observed");
        assert_eq!(q.mean_ms_since(&later), None, "counter reset");
        // 2 left the queue in 1 s with a mean wait of 500 ms; 6 still wait: a newcomer meets
        // 6 / (2 per s) = 3 s.
        assert_eq!(later.interval_delay_ms(&q, 6.0, 1000.0), Some(3000.0));
        assert_eq!(later.interval_delay_ms(&q, 0.0, 1000.0), Some(500.0));
        assert_eq!(
            q.interval_delay_ms(&q, 2.0, 1000.0),
            Some(1000.0),
            "a stalled queue"
        );
        assert_eq!(
            q.interval_delay_ms(&later, 0.0, 1000.0),
            None,
            "counter reset"
        );
    }

    #[test]
    fn the_pace_histogram_under_either_name() {
        // Two engines, summed; vLLM 0.11 exports the old name too, and the current one wins.
        let text = "vllm:inter_token_latency_seconds_sum{engine=\"0\",model_name=\"m\"} 0.5\n\
                    vllm:inter_token_latency_seconds_count{engine=\"0\",model_name=\"m\"} 20.0\n\
                    vllm:inter_token_latency_seconds_sum{engine=\"1\",model_name=\"m\"} 1.5\n\
                    vllm:inter_token_latency_seconds_count{engine=\"1\",model_name=\"m\"} 30.0\n\
                    vllm:inter_token_latency_seconds_bucket{engine=\"1\",le=\"+Inf\"} 30.0\n\
                    vllm:time_per_output_token_seconds_sum{engine=\"0\",model_name=\"m\"} 9\n\
                    vllm:time_per_output_token_seconds_count{engine=\"0\",model_name=\"m\"} 9\n\
                    vllm:request_time_per_output_token_seconds_sum{engine=\"0\"} 7\n\
                    vllm:request_time_per_output_token_seconds_count{engine=\"0\"} 7\n";
        assert_eq!(
            parse(text).itl,
            Some(Histogram {
                sum: 2.0,
                count: 50.0
            })
        );
        // vLLM ≤ 0.10: only the old name.
        let old = "vllm:time_per_output_token_seconds_sum{engine=\"0\"} 0.25\n\
                   vllm:time_per_output_token_seconds_count{engine=\"0\"} 10\n\
                   vllm:time_per_output_token_seconds_sum{engine=\"1\"} 0.75\n\
                   vllm:time_per_output_token_seconds_count{engine=\"1\"} 30\n";
        assert_eq!(
            parse(old).itl,
            Some(Histogram {
                sum: 1.0,
                count: 40.0
            })
        );
        assert_eq!(
            parse("vllm:inter_token_latency_seconds_sum{engine=\"0\"} 2\n").itl,
            None,
            "a sum without its count is no reading"
        );
        assert_eq!(
            parse("vllm:time_per_output_token_seconds_count{engine=\"0\"} 2\n").itl,
            None,
            "nor a count without its sum"
        );
        assert_eq!(parse("vllm:kv_cache_usage_perc 0.5\n").itl, None);
    }

    /// At a GPU's pace nobody may leave vLLM's queue for seconds: the head has then waited at
    /// least since the stall was first seen, and a leaver or an empty queue ends the stall.
    #[test]
    fn a_queue_that_serves_nobody_has_waited_since_the_stall_began() {
        let mut s = QueueStall::default();
        assert_eq!(s.observe(0.0, 3.0, Some(10.0)), 0.0);
        assert_eq!(s.observe(250.0, 4.0, Some(10.0)), 250.0);
        assert_eq!(s.observe(4000.0, 6.0, Some(10.0)), 4000.0);
        // One left: a new stall starts from this reading.
        assert_eq!(s.observe(4250.0, 6.0, Some(11.0)), 0.0);
        assert_eq!(s.observe(4500.0, 6.0, Some(11.0)), 250.0);
        // Nothing waits, or no histogram: no stall.
        assert_eq!(s.observe(4750.0, 0.0, Some(11.0)), 0.0);
        assert_eq!(s.observe(5000.0, 2.0, None), 0.0);
        assert_eq!(s.observe(5250.0, 2.0, Some(11.0)), 0.0);
        assert_eq!(s.observe(5500.0, 2.0, Some(11.0)), 250.0);
    }

    #[test]
    fn delays_are_read_over_at_least_the_span() {
        // Scrapes 250 ms apart: the first has nothing to diff against, the second only the
        // first, and from then on each diffs against the newest scrape at least 500 ms older.
        let mut span = DelaySpan::default();
        let diffed: Vec<Option<f64>> = [0.0, 250.0, 500.0, 750.0, 1000.0, 1400.0, 3000.0]
            .into_iter()
            .map(|at| span.push(at, at).map(|(base, _)| base))
            .collect();
        assert_eq!(
            diffed,
            [
                None,
                Some(0.0),
                Some(0.0),
                Some(250.0),
                Some(500.0),
                Some(750.0),
                Some(1400.0)
            ]
        );
        // One request served per 250 ms, 20 waiting: one short interval alone swings between
        // a stalled queue and 5 s; over the span the estimate is the queue's real 5 s, and one
        // interval with nobody served no longer reads as a stall.
        let h = |count: f64| Histogram { sum: count, count };
        assert_eq!(h(3.0).interval_delay_ms(&h(2.0), 20.0, 250.0), Some(5000.0));
        assert_eq!(h(3.0).interval_delay_ms(&h(3.0), 20.0, 250.0), Some(250.0));
        assert_eq!(h(3.0).interval_delay_ms(&h(1.0), 20.0, 500.0), Some(5000.0));
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
