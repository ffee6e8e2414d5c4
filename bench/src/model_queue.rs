//! The model's tier queue: Sluice's in-process queue rules (`src/admission/local.rs`) in
//! simulated time, with the same pure fair-share core (`sluice_runtime::admission::fair`): a freed slot
//! goes to the waiting tenant with the least weighted token service, FIFO within a tenant, or
//! is kept for a grace for the next request of the tenant that freed it when that tenant is
//! owed it (the hold rule); a full queue lets a tenant with fewer waiters push out the
//! longest-queued tenant's newest. Without fair share it is plain FIFO.

use std::collections::VecDeque;

use sluice_policy::fair::{self, FairShare};

pub struct Waiting<T> {
    pub item: T,
    pub tenant: String,
    pub charge: f64,
    pub deadline: f64,
}

/// What an admission was charged (fair share), given back when its slot is released.
#[derive(Debug, Clone)]
pub struct Lent {
    tenant: String,
    charge: f64,
    at: f64,
}

pub struct TierQueue<T> {
    /// Arrival order; deadlines are arrival plus one fixed wait, so the front expires first.
    items: VecDeque<Waiting<T>>,
    max: usize,
    fair: Option<FairShare>,
    /// Slots kept for a tenant's next request: (tenant, end of the grace).
    kept: Vec<(String, f64)>,
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
            kept: Vec::new(),
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

    /// Charges an admission; what to give back when its slot is released.
    pub fn charge(&mut self, tenant: &str, charge: f64, now: f64) -> Option<Lent> {
        let f = self.fair.as_mut()?;
        f.charge(tenant, charge, now as u64);
        Some(Lent {
            tenant: tenant.to_string(),
            charge,
            at: now,
        })
    }

    /// A request of `tenant` arrives: takes a slot kept for it, if there is one.
    pub fn take_kept(&mut self, tenant: &str, now: f64) -> bool {
        let Some(f) = self.fair.as_mut() else {
            return false;
        };
        f.arrive(tenant, now as u64);
        let Some(i) = self.kept.iter().position(|(t, _)| t == tenant) else {
            return false;
        };
        self.kept.swap_remove(i);
        true
    }

    /// A charged request ended: its charge is service had, and its slot is kept for its tenant
    /// when the tenant is owed it and has nobody waiting. True when it was kept (it stays
    /// taken).
    pub fn release(&mut self, lent: Lent, now: f64) -> bool {
        let Some(f) = self.fair.as_mut() else {
            return false;
        };
        f.finish(&lent.tenant, lent.charge);
        if self.items.iter().any(|w| w.tenant == lent.tenant) {
            return false;
        }
        let lowest = self
            .items
            .iter()
            .map(|w| f.value(&w.tenant))
            .min_by(f64::total_cmp);
        let held = (now - lent.at).max(0.0) as u64;
        let Some(grace) = f.keep(&lent.tenant, held, lowest, now as u64) else {
            return false;
        };
        self.kept.push((lent.tenant, now + grace as f64));
        true
    }

    /// Kept slots whose grace ended unused: how many slots that frees.
    pub fn expire_kept(&mut self, now: f64) -> u32 {
        let before = self.kept.len();
        let fair = &mut self.fair;
        self.kept.retain(|(tenant, until)| {
            let lapsed = *until <= now;
            if lapsed {
                if let Some(f) = fair.as_mut() {
                    f.unused(tenant);
                }
            }
            !lapsed
        });
        (before - self.kept.len()) as u32
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
    pub fn pop_next(&mut self, now: f64) -> Option<(Waiting<T>, Option<Lent>)> {
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
        let lent = self.charge(&w.tenant.clone(), w.charge, now);
        if let Some(f) = self.fair.as_mut() {
            let waiting = self.items.iter().map(|x| x.tenant.as_str());
            f.claimed(&w.tenant, waiting, now as u64);
        }
        Some((w, lent))
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
        let _ = q.charge("heavy", 100.0, 0.0);
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
        let order: Vec<usize> =
            std::iter::from_fn(|| q.pop_next(2.0).map(|(x, _)| x.item)).collect();
        assert_eq!(order, [10, 0, 11, 1]);
    }

    #[test]
    fn fifo_queue_serves_by_arrival_and_refuses_when_full() {
        let mut q = TierQueue::new(2, None);
        assert!(matches!(q.join(w(0, "heavy"), 0.0), Joined::Queued));
        assert!(matches!(q.join(w(1, "heavy"), 0.0), Joined::Queued));
        assert!(matches!(q.join(w(2, "light"), 0.0), Joined::Full));
        assert_eq!(q.pop_next(1.0).map(|(x, _)| x.item), Some(0));
    }

    /// The slot a tenant owed the next one frees is kept for its next request; unused, it is
    /// freed when the grace ends.
    #[test]
    fn a_freed_slot_is_kept_for_the_tenant_owed_it() {
        let mut q = TierQueue::new(4, Some(60_000));
        let big = q.charge("big", 1000.0, 0.0).unwrap();
        assert!(!q.release(big, 10.0), "nobody waits");
        let small = q.charge("small", 100.0, 0.0).unwrap();
        assert!(matches!(q.join(w(0, "big"), 1.0), Joined::Queued));
        assert!(q.release(small, 400.0), "kept for 100 ms");
        assert!(q.take_kept("small", 450.0));
        let small = q.charge("small", 100.0, 450.0).unwrap();
        assert!(q.release(small, 850.0));
        assert_eq!(q.expire_kept(900.0), 0);
        assert_eq!(q.expire_kept(950.0), 1, "unused");
        let small = q.charge("small", 100.0, 950.0).unwrap();
        assert!(
            !q.release(small, 1350.0),
            "not again until small comes in time"
        );
    }
}
