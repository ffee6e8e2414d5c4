//! Token-fair share between the tenants queued in one tier: a virtual token counter per tenant
//! (the VTC scheduler of "Fairness in Serving Large Language Models", OSDI 2024). Each admission
//! charges the tenant its estimated tokens divided by its weight; when a slot frees, the queued
//! tenant with the lowest counter gets it, FIFO within a tenant and, on a tie, FIFO between
//! tenants. Pure: time is passed in, so the in-process coordinator, the Redis scripts (which
//! apply the same rules in Lua, `lua/fair.lua`) and the tests share one definition.
//!
//! Two rules keep history from dominating:
//! - **Lift.** A tenant that starts waiting while others wait is lifted to the lowest counter
//!   among them: being idle earns no credit to spend later against tenants that kept waiting.
//! - **Fade.** A tenant that comes back with *more* service than the lowest waiting tenant keeps
//!   only a fading part of that excess (halved every `half_life`), so a burst an hour ago does
//!   not cost it its share now.

use std::collections::HashMap;

/// Tenants beyond which counters of idle tenants are forgotten (a tenant id can come from a
/// client header, so the set is unbounded without this).
const MAX_TRACKED: usize = 4096;

/// How much of a tier's capacity one request is charged: its estimated prompt tokens plus the
/// completion it may produce, over its tenant's weight.
pub fn charge_of(cost_tokens: u64, weight: f64) -> f64 {
    let w = if weight.is_finite() && weight > 0.0 {
        weight
    } else {
        1.0
    };
    cost_tokens.max(1) as f64 / w
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Counter {
    value: f64,
    /// When the tenant was last charged (ms, any monotonic origin).
    at_ms: u64,
}

/// The virtual token counters of one tier.
#[derive(Debug, Clone)]
pub struct FairShare {
    counters: HashMap<String, Counter>,
    half_life_ms: u64,
}

impl FairShare {
    pub fn new(half_life_ms: u64) -> Self {
        Self {
            counters: HashMap::new(),
            half_life_ms: half_life_ms.max(1),
        }
    }

    pub fn value(&self, tenant: &str) -> f64 {
        self.counters.get(tenant).map_or(0.0, |c| c.value)
    }

    /// Charges an admission.
    pub fn charge(&mut self, tenant: &str, charge: f64, now_ms: u64) {
        // The common case (a tenant seen before) allocates nothing on the request path.
        if let Some(c) = self.counters.get_mut(tenant) {
            c.value += charge;
            c.at_ms = now_ms;
            return;
        }
        if self.counters.len() >= MAX_TRACKED {
            self.forget_idle(now_ms);
        }
        let c = self.counters.entry(tenant.to_string()).or_insert(Counter {
            value: 0.0,
            at_ms: now_ms,
        });
        c.value += charge;
        c.at_ms = now_ms;
    }

    /// A tenant starts waiting; `floor` is the lowest counter among the tenants already
    /// waiting in the tier (`None` when nobody waits). Returns its counter afterwards.
    pub fn enter(&mut self, tenant: &str, floor: Option<f64>, now_ms: u64) -> f64 {
        let Some(floor) = floor else {
            return self.value(tenant);
        };
        let half_life = self.half_life_ms;
        let c = self.counters.entry(tenant.to_string()).or_insert(Counter {
            value: floor,
            at_ms: now_ms,
        });
        c.value = entered(c.value, c.at_ms, floor, now_ms, half_life);
        c.value
    }

    /// Drops the counters of tenants idle for ten half-lives (their excess has faded to
    /// nothing, and lifting covers any deficit).
    fn forget_idle(&mut self, now_ms: u64) {
        let horizon = self.half_life_ms.saturating_mul(10);
        self.counters
            .retain(|_, c| now_ms.saturating_sub(c.at_ms) < horizon);
        if self.counters.len() >= MAX_TRACKED {
            self.counters.clear();
        }
    }
}

/// The lift-and-fade rule for a tenant that starts waiting: below the floor it is lifted to it;
/// above, its excess halves every `half_life_ms` since it was last charged.
pub fn entered(value: f64, at_ms: u64, floor: f64, now_ms: u64, half_life_ms: u64) -> f64 {
    if value <= floor {
        return floor;
    }
    let idle = now_ms.saturating_sub(at_ms) as f64;
    floor + (value - floor) * 0.5f64.powf(idle / half_life_ms.max(1) as f64)
}

/// Among waiting tenants given as (counter, arrival sequence of its oldest waiter), the index of
/// the one served next: lowest counter, then earliest arrival.
pub fn next_of<I: IntoIterator<Item = (f64, u64)>>(waiting: I) -> Option<usize> {
    waiting
        .into_iter()
        .enumerate()
        .min_by(|(_, a), (_, b)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)))
        .map(|(i, _)| i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_newcomer_is_lifted_to_the_waiting_floor_not_given_credit() {
        let mut f = FairShare::new(60_000);
        f.charge("heavy", 500.0, 0);
        assert_eq!(f.enter("light", Some(500.0), 10), 500.0);
        // Nobody waiting: nothing to be lifted to.
        assert_eq!(f.enter("other", None, 10), 0.0);
    }

    #[test]
    fn past_excess_fades_by_half_lives() {
        let mut f = FairShare::new(1000);
        f.charge("was-heavy", 1100.0, 0);
        assert_eq!(f.enter("was-heavy", Some(100.0), 0), 1100.0);
        let mut f = FairShare::new(1000);
        f.charge("was-heavy", 1100.0, 0);
        let v = f.enter("was-heavy", Some(100.0), 2000);
        assert!((v - 350.0).abs() < 1e-9, "{v}");
    }

    #[test]
    fn weights_divide_the_charge() {
        assert_eq!(charge_of(300, 3.0), 100.0);
        assert_eq!(charge_of(300, 0.0), 300.0, "a bad weight counts as 1");
        assert_eq!(charge_of(0, 1.0), 1.0, "every request costs something");
    }

    #[test]
    fn next_is_lowest_counter_then_oldest() {
        assert_eq!(next_of([(5.0, 1), (3.0, 9), (3.0, 4)]), Some(2));
        assert_eq!(next_of(std::iter::empty()), None);
    }

    #[test]
    fn tracked_tenants_stay_bounded() {
        let mut f = FairShare::new(10);
        for i in 0..(MAX_TRACKED as u64 * 2) {
            f.charge(&format!("t{i}"), 1.0, i);
        }
        assert!(f.counters.len() <= MAX_TRACKED);
    }

    /// The scenario as an event model: capacity 2, a heavy tenant queues 40, a light
    /// one 8 just after; completion order follows admission order.
    #[test]
    fn light_tenant_is_not_stuck_behind_a_heavy_burst() {
        let mut f = FairShare::new(60_000);
        let mut queues: Vec<(String, std::collections::VecDeque<u64>)> = vec![
            ("heavy".into(), Default::default()),
            ("light".into(), Default::default()),
        ];
        let mut seq = 0;
        // Two heavy requests go straight in.
        let mut order = vec!["heavy"; 2];
        f.charge("heavy", 200.0, 0);
        for (i, n) in [(0usize, 38), (1, 8)] {
            let floor = queues
                .iter()
                .filter(|(_, q)| !q.is_empty())
                .map(|(t, _)| f.value(t))
                .reduce(f64::min);
            let name = queues[i].0.clone();
            f.enter(&name, floor, 1);
            for _ in 0..n {
                seq += 1;
                queues[i].1.push_back(seq);
            }
        }
        while let Some(i) = next_of(
            queues
                .iter()
                .map(|(t, q)| q.front().map(|s| (f.value(t), *s)))
                .map(|o| o.unwrap_or((f64::INFINITY, u64::MAX))),
        ) {
            if queues[i].1.pop_front().is_none() {
                break;
            }
            let name = queues[i].0.clone();
            f.charge(&name, 100.0, 2);
            order.push(if i == 0 { "heavy" } else { "light" });
        }
        let ranks: Vec<f64> = order
            .iter()
            .enumerate()
            .filter(|(_, t)| **t == "light")
            .map(|(r, _)| (r + 1) as f64 / order.len() as f64)
            .collect();
        let mean = ranks.iter().sum::<f64>() / ranks.len() as f64;
        assert_eq!(order.len(), 48);
        assert!(mean < 0.3, "light mean completion rank {mean}");
    }
}
