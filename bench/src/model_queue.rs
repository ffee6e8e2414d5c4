//! The model's tier queue: Sluice's in-process queue rules (`src/admission/local.rs`) in
//! simulated time, with the same pure fair-share core (`sluice_runtime::admission::fair`): a freed slot
//! goes to the waiting tenant with the least weighted token service, FIFO within a tenant; a
//! full queue lets a tenant with fewer waiters push out the longest-queued tenant's newest.
//! Without fair share it is plain FIFO.

use std::collections::VecDeque;

use sluice_policy::fair::{self, FairShare};

pub struct Waiting<T> {
    pub item: T,
    pub tenant: String,
    pub charge: f64,
    pub deadline: f64,
}

pub struct TierQueue<T> {
    /// Arrival order; deadlines are arrival plus one fixed wait, so the front expires first.
    items: VecDeque<Waiting<T>>,
    max: usize,
    fair: Option<FairShare>,
}

/// What joining a full queue did.
pub enum Joined<T> {
    Queued,
    /// Queued in the place of this waiter, pushed out.
    PushedOut(Waiting<T>),
    Full,
}

impl<T> TierQueue<T> {
    pub fn new(max: usize, fair_half_life_ms: Option<u64>) -> Self {
        Self {
            items: VecDeque::new(),
            max,
            fair: fair_half_life_ms.map(FairShare::new),
        }
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    fn counter(&self, tenant: &str) -> f64 {
        self.fair.as_ref().map_or(0.0, |f| f.value(tenant))
    }

    fn queued_of(&self, tenant: &str) -> usize {
        self.items.iter().filter(|w| w.tenant == tenant).count()
    }

    /// Charges an admission that did not wait.
    pub fn charge(&mut self, tenant: &str, charge: f64, now: f64) {
        if let Some(f) = self.fair.as_mut() {
            f.charge(tenant, charge, now as u64);
        }
    }

    pub fn join(&mut self, w: Waiting<T>, now: f64) -> Joined<T> {
        let mut pushed = None;
        if self.items.len() >= self.max {
            if self.fair.is_none() {
                return Joined::Full;
            }
            let mine = self.queued_of(&w.tenant);
            let mut longest: Option<(String, usize)> = None;
            for x in &self.items {
                if x.tenant != w.tenant && longest.as_ref().is_none_or(|(t, _)| *t != x.tenant) {
                    let n = self.queued_of(&x.tenant);
                    if longest.as_ref().is_none_or(|(_, m)| n > *m) {
                        longest = Some((x.tenant.clone(), n));
                    }
                }
            }
            let Some((victim, _)) = longest.filter(|(_, n)| *n > mine + 1) else {
                return Joined::Full;
            };
            let i = self
                .items
                .iter()
                .rposition(|x| x.tenant == victim)
                .expect("the victim waits");
            pushed = self.items.remove(i);
        }
        if self.queued_of(&w.tenant) == 0 {
            if let Some(f) = self.fair.as_mut() {
                let floor = f.floor(self.items.iter().map(|x| x.tenant.as_str()));
                f.enter(&w.tenant, floor, now as u64);
            }
        }
        self.items.push_back(w);
        match pushed {
            Some(p) => Joined::PushedOut(p),
            None => Joined::Queued,
        }
    }

    /// The oldest waiter, if its deadline has passed.
    pub fn pop_expired(&mut self, now: f64) -> Option<Waiting<T>> {
        if self.items.front().is_some_and(|w| w.deadline <= now) {
            return self.items.pop_front();
        }
        None
    }

    /// The waiter a freed slot goes to, charged.
    pub fn pop_next(&mut self, now: f64) -> Option<Waiting<T>> {
        let i = match self.fair {
            None => 0,
            Some(_) => {
                // Each tenant's oldest waiter, with its counter.
                let mut heads: Vec<(usize, f64, u64)> = Vec::new();
                for (i, w) in self.items.iter().enumerate() {
                    if !heads
                        .iter()
                        .any(|(j, _, _)| self.items[*j].tenant == w.tenant)
                    {
                        heads.push((i, self.counter(&w.tenant), i as u64));
                    }
                }
                let best = fair::next_of(heads.iter().map(|(_, c, s)| (*c, *s)))?;
                heads[best].0
            }
        };
        let w = self.items.remove(i)?;
        self.charge(&w.tenant.clone(), w.charge, now);
        Some(w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(id: usize, tenant: &str) -> Waiting<usize> {
        Waiting {
            item: id,
            tenant: tenant.into(),
            charge: 100.0,
            deadline: 1e9,
        }
    }

    #[test]
    fn fair_queue_alternates_tenants_and_pushes_out_the_longest() {
        let mut q = TierQueue::new(4, Some(60_000));
        q.charge("heavy", 100.0, 0.0);
        for i in 0..4 {
            assert!(matches!(q.join(w(i, "heavy"), 0.0), Joined::Queued));
        }
        match q.join(w(10, "light"), 1.0) {
            Joined::PushedOut(x) => assert_eq!(x.item, 3, "heavy's newest"),
            _ => panic!("light should take heavy's newest place"),
        }
        match q.join(w(11, "light"), 1.0) {
            Joined::PushedOut(x) => assert_eq!(x.item, 2),
            _ => panic!("heavy still waits two more than light"),
        }
        assert_eq!(q.len(), 4, "the bound holds");
        // Light is lifted to heavy's counter before its latest admission (0): one of heavy's
        // requests' worth ahead, then they alternate, ties going to the oldest head.
        let order: Vec<usize> = std::iter::from_fn(|| q.pop_next(2.0).map(|x| x.item)).collect();
        assert_eq!(order, [10, 0, 11, 1]);
    }

    #[test]
    fn fifo_queue_serves_by_arrival_and_refuses_when_full() {
        let mut q = TierQueue::new(2, None);
        assert!(matches!(q.join(w(0, "heavy"), 0.0), Joined::Queued));
        assert!(matches!(q.join(w(1, "heavy"), 0.0), Joined::Queued));
        assert!(matches!(q.join(w(2, "light"), 0.0), Joined::Full));
        assert_eq!(q.pop_next(1.0).map(|x| x.item), Some(0));
    }
}
