//! A request-path metric vector kept in one copy per worker shard and summed when `/metrics`
//! is gathered. One shared copy had both workers' cores take turns owning the cache lines of
//! every count, bucket and sum a request updates (four read-modify-writes per histogram
//! observation, one per counter increment, fourteen a request); a worker now writes lines no
//! other core touches, and the scrape, a few times a minute, pays for the sum.

use crate::worker_shard;
use prometheus::core::{Collector, Desc};
use prometheus::proto::{Bucket, Counter, Histogram, LabelPair, Metric, MetricFamily, MetricType};
use std::collections::HashMap;

#[derive(Clone)]
pub struct Sharded<V> {
    shards: Box<[V]>,
}

impl<V> Sharded<V> {
    pub fn new(make: impl Fn() -> V) -> Self {
        Sharded {
            shards: (0..worker_shard::COUNT).map(|_| make()).collect(),
        }
    }

    /// The copy this thread writes.
    pub fn mine(&self) -> &V {
        &self.shards[worker_shard::index()]
    }
}

impl<V: Collector> Collector for Sharded<V> {
    fn desc(&self) -> Vec<&Desc> {
        self.shards[0].desc()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut families = self.shards.iter().flat_map(|s| s.collect());
        let Some(mut total) = families.next() else {
            return Vec::new();
        };
        let kind = total.get_field_type();
        let mut at: HashMap<Vec<(String, String)>, usize> = total
            .get_metric()
            .iter()
            .enumerate()
            .map(|(i, m)| (labels_of(m), i))
            .collect();
        for mut family in families {
            for m in family.take_metric() {
                let labels = labels_of(&m);
                match at.get(&labels) {
                    Some(&i) => add_into(&mut total.mut_metric()[i], &m, kind),
                    None => {
                        at.insert(labels, total.get_metric().len());
                        total.mut_metric().push(m);
                    }
                }
            }
        }
        vec![total]
    }
}

fn labels_of(m: &Metric) -> Vec<(String, String)> {
    m.get_label()
        .iter()
        .map(|l: &LabelPair| (l.name().to_string(), l.value().to_string()))
        .collect()
}

/// Adds `m` into `into`, the same series of another shard (same buckets: one definition).
fn add_into(into: &mut Metric, m: &Metric, kind: MetricType) {
    match kind {
        MetricType::COUNTER => {
            let mut c = Counter::default();
            c.set_value(into.get_counter().get_value() + m.get_counter().get_value());
            into.set_counter(c);
        }
        MetricType::HISTOGRAM => {
            let (a, b) = (into.get_histogram(), m.get_histogram());
            let mut h = Histogram::default();
            h.set_sample_count(a.get_sample_count() + b.get_sample_count());
            h.set_sample_sum(a.get_sample_sum() + b.get_sample_sum());
            h.set_bucket(
                a.get_bucket()
                    .iter()
                    .zip(b.get_bucket())
                    .map(|(x, y)| {
                        let mut bucket = Bucket::default();
                        bucket.set_upper_bound(x.upper_bound());
                        bucket.set_cumulative_count(x.cumulative_count() + y.cumulative_count());
                        bucket
                    })
                    .collect(),
            );
            into.set_histogram(h);
        }
        // Gauges are set, not summed, so they are never sharded.
        _ => {}
    }
}
