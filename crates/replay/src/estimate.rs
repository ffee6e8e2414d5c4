//! The latency a request would have had under a decision it did not get. Replay cannot know it;
//! it borrows it from requests that did get that decision at about the same time: the median
//! recorded latency of the [`NEAREST`] served requests nearest in arrival time with the same
//! tier, pool and action. With none of those recorded, there is no estimate (and the report
//! counts the request as unknown rather than guessing).

use super::source::Item;
use sluice_policy::{Pool, Tier};
use sluice_record::inputs::ActionKind;
use std::collections::HashMap;

pub const NEAREST: usize = 20;

pub const DESCRIPTION: &str = "a request whose candidate decision serves it differently than \
     recorded (refused before, or capped / moved / passed instead) is given the median recorded \
     latency of the 20 served requests nearest to it in arrival time that had the candidate's \
     tier, pool and action, and is counted late when that exceeds its tier's sla_target_ms in \
     the candidate config; with no such request recorded it is counted as unknown. Decisions \
     that do not change keep their recorded latency.";

type Key = (Tier, Pool, ActionKind);

pub struct Estimator {
    /// Per key: (arrival, latency) of served requests, by arrival.
    served: HashMap<Key, Vec<(u64, f64)>>,
}

impl Estimator {
    pub fn new(items: &[Item]) -> Self {
        let mut served: HashMap<Key, Vec<(u64, f64)>> = HashMap::new();
        for it in items {
            if let Some(s) = it.served.filter(|s| s.latency_ms.is_finite()) {
                let d = &it.inputs.decided;
                served
                    .entry((it.tier, d.pool, d.action))
                    .or_default()
                    .push((it.received_at_ms, s.latency_ms));
            }
        }
        for v in served.values_mut() {
            v.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
        }
        Estimator { served }
    }

    pub fn estimate(&self, tier: Tier, pool: Pool, action: ActionKind, at: u64) -> Option<f64> {
        let v = self.served.get(&(tier, pool, action))?;
        if v.is_empty() {
            return None;
        }
        // Grow a window around `at` one nearest neighbour at a time.
        let mut hi = v.partition_point(|(t, _)| *t < at);
        let mut lo = hi;
        while hi - lo < NEAREST.min(v.len()) {
            let left = (lo > 0).then(|| at - v[lo - 1].0);
            let right = v.get(hi).map(|(t, _)| t - at);
            match (left, right) {
                (Some(l), Some(r)) if l <= r => lo -= 1,
                (Some(_), None) => lo -= 1,
                _ => hi += 1,
            }
        }
        let mut near: Vec<f64> = v[lo..hi].iter().map(|(_, l)| *l).collect();
        near.sort_by(f64::total_cmp);
        let n = near.len();
        Some(if n % 2 == 1 {
            near[n / 2]
        } else {
            (near[n / 2 - 1] + near[n / 2]) / 2.0
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::source::Served;
    use super::*;

    fn served(at: u64, latency_ms: f64, action: ActionKind) -> Item {
        let mut it = super::super::compare::tests::item(Tier::Standard, at);
        it.inputs.decided.action = action;
        it.served = Some(Served {
            latency_ms,
            violated: false,
        });
        it
    }

    #[test]
    fn median_of_the_nearest_with_the_same_decision() {
        let mut items: Vec<Item> = (0..100)
            .map(|i| served(i * 10, i as f64, ActionKind::Pass))
            .collect();
        items.push(served(500, 10_000.0, ActionKind::Degrade));
        let e = Estimator::new(&items);
        // Nearest 20 to t=500: arrivals 410..=590 minus one end; latencies 41..=60.
        let m = e
            .estimate(Tier::Standard, Pool::OnDemand, ActionKind::Pass, 500)
            .unwrap();
        assert!((49.5..=50.5).contains(&m), "{m}");
        // At the edge the window slides inwards.
        assert_eq!(
            e.estimate(Tier::Standard, Pool::OnDemand, ActionKind::Pass, 0),
            Some(9.5)
        );
        assert_eq!(
            e.estimate(Tier::Standard, Pool::OnDemand, ActionKind::Degrade, 0),
            Some(10_000.0)
        );
        assert_eq!(
            e.estimate(Tier::Standard, Pool::Spot, ActionKind::Pass, 0),
            None
        );
    }
}
