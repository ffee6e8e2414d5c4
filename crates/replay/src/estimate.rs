//! What a request would have measured under a decision it did not get. Replay cannot know it;
//! it borrows it from requests that did get that decision at about the same time: per
//! dimension, the median of the [`NEAREST`] served requests nearest in arrival time with the
//! same tier, pool and action that measured it — end-to-end latency from all of them, time to
//! first token and time per output token from the streamed ones, completion tokens from those
//! whose usage was read. With none of those recorded, there is no estimate (and the report
//! counts the request, or the dimension, as unknown rather than guessing).

use super::source::Item;
use sluice_policy::slo::Measured;
use sluice_policy::{Pool, Tier};
use sluice_record::inputs::ActionKind;
use std::collections::HashMap;

pub const NEAREST: usize = 20;

pub const DESCRIPTION: &str = "a request whose candidate decision serves it differently than \
     recorded (refused before, or capped / moved / passed instead) borrows, per dimension, the \
     median of the 20 served requests nearest to it in arrival time that had the candidate's \
     tier, pool and action: their end-to-end latency, and the TTFT and TPOT of the streamed ones \
     among them. A streamed request (a refused one, whose form was not recorded, is taken to \
     stream when most of those 20 did) is judged on the borrowed TTFT and TPOT; a whole answer \
     by the deadline a stream meeting both would have kept, for the median of their completion \
     tokens. Each is judged on every dimension of its tier's objective in the candidate config; \
     a dimension nothing was recorded for is unknown, and so is the request. Decisions that do \
     not change keep their recorded measurements, judged again on the candidate's objective.";

type Key = (Tier, Pool, ActionKind);

/// (arrival, value) of served requests of one key, by arrival.
type Series = Vec<(u64, f64)>;

#[derive(Default)]
struct Measures {
    latency: Series,
    ttft: Series,
    tpot: Series,
    tokens: Series,
    /// 1 for a streamed answer, 0 for a whole one.
    stream: Series,
}

impl Measures {
    fn all(&mut self) -> [&mut Series; 5] {
        [
            &mut self.latency,
            &mut self.ttft,
            &mut self.tpot,
            &mut self.tokens,
            &mut self.stream,
        ]
    }
}

pub struct Estimator {
    served: HashMap<Key, Measures>,
}

/// Pushes `v` when it is a finite measurement.
fn push(series: &mut Series, at: u64, v: Option<f64>) {
    if let Some(v) = v.filter(|v| v.is_finite()) {
        series.push((at, v));
    }
}

/// The values of the [`NEAREST`] entries nearest `at` (fewer when the series is shorter).
fn nearest(v: &Series, at: u64) -> impl Iterator<Item = f64> + '_ {
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
    v[lo..hi].iter().map(|(_, x)| *x)
}

/// The median of the nearest entries; `None` for an empty series.
fn median(v: &Series, at: u64) -> Option<f64> {
    let mut near: Vec<f64> = nearest(v, at).collect();
    if near.is_empty() {
        return None;
    }
    near.sort_by(f64::total_cmp);
    let n = near.len();
    Some(if n % 2 == 1 {
        near[n / 2]
    } else {
        (near[n / 2 - 1] + near[n / 2]) / 2.0
    })
}

impl Estimator {
    pub fn new(items: &[Item]) -> Self {
        let mut served: HashMap<Key, Measures> = HashMap::new();
        for it in items {
            let Some(s) = it.served.filter(|s| s.measured.latency_ms.is_finite()) else {
                continue;
            };
            let (d, m, at) = (&it.inputs.decided, &s.measured, it.received_at_ms);
            let e = served.entry((it.tier, d.pool, d.action)).or_default();
            push(&mut e.latency, at, Some(m.latency_ms));
            push(&mut e.stream, at, Some(if m.stream { 1.0 } else { 0.0 }));
            push(&mut e.tokens, at, m.completion_tokens.map(|t| t as f64));
            if m.stream {
                push(&mut e.ttft, at, m.ttft_ms);
                push(&mut e.tpot, at, m.tpot_ms);
            }
        }
        for m in served.values_mut() {
            for v in m.all() {
                v.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)));
            }
        }
        Estimator { served }
    }

    /// The end-to-end latency alone.
    pub fn estimate(&self, tier: Tier, pool: Pool, action: ActionKind, at: u64) -> Option<f64> {
        median(&self.served.get(&(tier, pool, action))?.latency, at)
    }

    /// What a request arriving `at` would have measured with `action` on `pool`: `None` when no
    /// request of that tier, pool and action was served. `stream` is its own form when known
    /// (it was served as recorded); unknown, it streams when most of its neighbours did. A
    /// streamed one's TTFT or TPOT is `None` when none of its neighbours measured it.
    pub fn measured(
        &self,
        tier: Tier,
        pool: Pool,
        action: ActionKind,
        at: u64,
        stream: Option<bool>,
    ) -> Option<Measured> {
        let m = self.served.get(&(tier, pool, action))?;
        let latency_ms = median(&m.latency, at)?;
        let stream = stream.unwrap_or_else(|| {
            let near: Vec<f64> = nearest(&m.stream, at).collect();
            near.iter().sum::<f64>() * 2.0 >= near.len() as f64
        });
        Some(Measured {
            latency_ms,
            ttft_ms: median(&m.ttft, at).filter(|_| stream),
            tpot_ms: median(&m.tpot, at).filter(|_| stream),
            completion_tokens: median(&m.tokens, at).map(|t| t.round() as u64),
            stream,
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
        it.served = Some(Served::e2e(latency_ms, false));
        it
    }

    fn streamed(at: u64, ttft_ms: f64, tpot_ms: Option<f64>, tokens: u64) -> Item {
        let mut it = served(at, ttft_ms + 1000.0, ActionKind::Pass);
        let s = it.served.as_mut().unwrap();
        s.measured.stream = true;
        s.measured.ttft_ms = Some(ttft_ms);
        s.measured.tpot_ms = tpot_ms;
        s.measured.completion_tokens = Some(tokens);
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
        // Whole answers only: a request of unknown form is taken as whole, and has no TTFT.
        let m = e
            .measured(Tier::Standard, Pool::OnDemand, ActionKind::Pass, 500, None)
            .unwrap();
        assert!(!m.stream && m.ttft_ms.is_none() && m.tpot_ms.is_none());
        assert_eq!(
            Some(m.latency_ms),
            e.estimate(Tier::Standard, Pool::OnDemand, ActionKind::Pass, 500)
        );
        // Known to stream: the TTFT and TPOT nobody measured are left unknown.
        let m = e
            .measured(
                Tier::Standard,
                Pool::OnDemand,
                ActionKind::Pass,
                500,
                Some(true),
            )
            .unwrap();
        assert!(m.stream && m.ttft_ms.is_none());
    }

    #[test]
    fn ttft_and_tpot_come_from_the_nearest_streamed_requests() {
        // Whole answers every 10 ms, streams every 30 ms with TTFT = arrival / 10, TPOT 5 + a
        // tenth of that, except one-token streams (no pace) every 90 ms.
        let mut items = Vec::new();
        for i in 0..300u64 {
            if i % 3 == 0 {
                let tpot = (i % 9 != 0).then(|| 5.0 + i as f64 / 10.0);
                items.push(streamed(i * 10, i as f64, tpot, 100 + i));
            } else {
                items.push(served(i * 10, 1.0, ActionKind::Pass));
            }
        }
        let e = Estimator::new(&items);
        let at = 1500;
        let m = e
            .measured(
                Tier::Standard,
                Pool::OnDemand,
                ActionKind::Pass,
                at,
                Some(true),
            )
            .unwrap();
        // The 20 streams nearest t=1500 (i = 150 ± 30 by threes): TTFT 120..=177 or 123..=180,
        // median ~150.
        let ttft = m.ttft_ms.unwrap();
        assert!((147.0..=153.0).contains(&ttft), "{ttft}");
        let tpot = m.tpot_ms.unwrap();
        assert!((19.0..=21.0).contains(&tpot), "{tpot}");
        // Its end-to-end latency from every served request near it (mostly whole, 1 ms).
        assert_eq!(m.latency_ms, 1.0);
        // One in three of its neighbours streamed: a request of unknown form is taken as whole.
        let whole = e
            .measured(Tier::Standard, Pool::OnDemand, ActionKind::Pass, at, None)
            .unwrap();
        assert!(!whole.stream && whole.ttft_ms.is_none());
        assert!(whole.completion_tokens.is_some());
    }
}
