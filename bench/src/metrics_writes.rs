//! `sluice-bench metrics-writes`: the five metric updates `logging` makes per request (a
//! decision and an SLA count, the duration, time-to-first-byte and overhead histograms), from
//! several threads at once, through Sluice's per-worker shards and through one prometheus
//! vector every thread shares (the layout before the shards, its children resolved once per
//! thread, so the comparison flatters it). Wall time per request-set, best of three rounds: on a
//! shared machine the best round is the one least disturbed by other work.

use prometheus::{HistogramOpts, HistogramVec, IntCounterVec, Opts};
use sluice_runtime::metrics::{Metrics, RequestObservations};
use std::time::Instant;

pub fn run(threads: usize, per_thread: u64) {
    let hist = |name: &str, labels: &[&str]| {
        let opts = HistogramOpts::new(name, "bench").buckets(vec![0.001, 0.01, 0.1, 1.0, 10.0]);
        HistogramVec::new(opts, labels).expect("static histogram")
    };
    let (duration, ttfb, overhead) = (
        hist("d", &["tier", "decision"]),
        hist("t", &["tier", "decision"]),
        hist("o", &["tier"]),
    );
    let counter = |name: &str, labels: &[&str]| {
        IntCounterVec::new(Opts::new(name, "bench"), labels).expect("static counter")
    };
    let (decisions, sla) = (
        counter("n", &["tier", "decision", "reason"]),
        counter("s", &["tier", "outcome"]),
    );
    let shared = || {
        let d = duration.with_label_values(&["Standard", "pass"]);
        let t = ttfb.with_label_values(&["Standard", "pass"]);
        let o = overhead.with_label_values(&["Standard"]);
        let n = decisions.with_label_values(&["Standard", "pass", ""]);
        let s = sla.with_label_values(&["Standard", "met"]);
        for i in 0..per_thread {
            let secs = (i % 1000) as f64 * 1e-4;
            n.inc();
            d.observe(secs);
            t.observe(secs / 2.0);
            o.observe(secs / 100.0);
            s.inc();
        }
    };
    let metrics = Metrics::new();
    let sharded = || {
        for i in 0..per_thread {
            let secs = (i % 1000) as f64 * 1e-4;
            let o = RequestObservations {
                duration: Some(secs),
                ttfb: Some(secs / 2.0),
                overhead: Some(secs / 100.0),
                sla_violated: Some(false),
            };
            metrics.record_request("Standard", "pass", "", o);
        }
    };
    let time = |work: &(dyn Fn() + Sync)| {
        (0..3)
            .map(|_| {
                let start = Instant::now();
                std::thread::scope(|s| {
                    for _ in 0..threads {
                        s.spawn(work);
                    }
                });
                start.elapsed().as_nanos() as f64 / per_thread as f64
            })
            .fold(f64::INFINITY, f64::min)
    };
    println!(
        "{threads} threads × {per_thread} requests, ns per request on each thread (best of 3):"
    );
    println!("  one shared vector   {:7.1}", time(&shared));
    println!("  per-worker shards   {:7.1}", time(&sharded));
}
