//! The in-process coordinator: exact within one replica. A released slot is handed directly to
//! the next waiter (so waiters are woken rather than polling): the queued tenant with the least
//! weighted service (see [`fair`](super::fair)), FIFO within a tenant — or, with fair share, kept
//! for a short grace for the next request of the tenant that freed it when that tenant is owed
//! it and has nobody waiting (`fair`'s hold rule).

use super::{Admission, AdmissionControl, Claim, FairShareSettings, QueueParams, Slot};
use super::{TenantShare, TierAdmission};
use async_trait::async_trait;
use sluice_policy::fair::{self, FairShare};
use sluice_policy::{Reason, Tier};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::oneshot;

/// Origin of the fair-share clock (any monotonic origin will do).
static ORIGIN: LazyLock<Instant> = LazyLock::new(Instant::now);

fn now_ms() -> u64 {
    ORIGIN.elapsed().as_millis() as u64
}

struct Waiter {
    id: u64,
    charge: f64,
    /// The slot itself travels through the channel: if the waiter has gone (client hung up),
    /// dropping the undelivered slot releases it again, so capacity cannot leak.
    tx: oneshot::Sender<Slot>,
}

/// What an admission was charged, given back when its slot is released.
struct Charged {
    tenant: String,
    charge: f64,
    at_ms: u64,
}

struct TierSlots {
    inflight: u64,
    capacity: u32,
    next_waiter: u64,
    /// Waiting tenants (only those with someone waiting), each FIFO.
    waiting: HashMap<String, VecDeque<Waiter>>,
    queued: usize,
    /// `None`: plain FIFO across tenants.
    fair: Option<FairShare>,
    /// Slots kept for a tenant's next request (tenant, id); counted in `inflight`.
    kept: Vec<(String, u64)>,
    next_kept: u64,
}

impl TierSlots {
    fn new(settings: FairShareSettings) -> Self {
        Self {
            inflight: 0,
            capacity: 0,
            next_waiter: 0,
            waiting: HashMap::new(),
            queued: 0,
            fair: settings
                .enabled
                .then(|| FairShare::new(settings.half_life_ms)),
            kept: Vec::new(),
            next_kept: 0,
        }
    }

    fn counter(&self, tenant: &str) -> f64 {
        self.fair.as_ref().map_or(0.0, |f| f.value(tenant))
    }

    /// Charges an admission; what to give back when its slot is released.
    fn charge(&mut self, tenant: &str, charge: f64) -> Option<Charged> {
        let f = self.fair.as_mut()?;
        let at_ms = now_ms();
        f.charge(tenant, charge, at_ms);
        Some(Charged {
            tenant: tenant.to_string(),
            charge,
            at_ms,
        })
    }

    /// Charges a waiter admitted from the queue, and notes what its tenant is owed for having
    /// waited under the others still waiting.
    fn charge_waiter(&mut self, tenant: &str, charge: f64) -> Option<Charged> {
        let charged = self.charge(tenant, charge);
        if let Some(f) = self.fair.as_mut() {
            f.claimed(tenant, self.waiting.keys().map(String::as_str), now_ms());
        }
        charged
    }

    fn enqueue(&mut self, tenant: &str, waiter: Waiter) {
        if !self.waiting.contains_key(tenant) {
            if let Some(f) = self.fair.as_mut() {
                let floor = f.floor(self.waiting.keys().map(String::as_str));
                f.enter(tenant, floor, now_ms());
            }
        }
        self.waiting
            .entry(tenant.to_string())
            .or_default()
            .push_back(waiter);
        self.queued += 1;
    }

    /// An admitted request ended: its charge is service had, and its slot is kept for its
    /// tenant's next request when the tenant is owed it. Returns the kept slot's id and grace.
    fn finish(&mut self, c: &Charged) -> Option<(u64, Duration)> {
        let over = self.capacity != 0 && self.inflight > u64::from(self.capacity);
        let f = self.fair.as_mut()?;
        f.finish(&c.tenant, c.charge);
        // Over a lowered capacity the slot is not the tier's to keep.
        if over || self.waiting.contains_key(&c.tenant) {
            return None;
        }
        let lowest = self
            .waiting
            .keys()
            .map(|t| f.value(t))
            .min_by(f64::total_cmp);
        let now = now_ms();
        let grace = f.keep(&c.tenant, now.saturating_sub(c.at_ms), lowest, now)?;
        self.next_kept += 1;
        self.kept.push((c.tenant.clone(), self.next_kept));
        Some((self.next_kept, Duration::from_millis(grace)))
    }

    /// Takes a slot kept for `tenant`, if there is one.
    fn take_kept(&mut self, tenant: &str) -> bool {
        let Some(i) = self.kept.iter().position(|(t, _)| t == tenant) else {
            return false;
        };
        self.kept.swap_remove(i);
        true
    }

    /// The next waiter by fair share (or arrival, without it), removed from the queue.
    fn pop_next(&mut self) -> Option<(String, Waiter)> {
        let tenants: Vec<&String> = self.waiting.keys().collect();
        let i = fair::next_of(tenants.iter().map(|t| {
            let head = self.waiting[*t].front().map_or(u64::MAX, |w| w.id);
            (self.counter(t), head)
        }))?;
        let tenant = tenants[i].clone();
        let q = self.waiting.get_mut(&tenant)?;
        let w = q.pop_front()?;
        if q.is_empty() {
            self.waiting.remove(&tenant);
        }
        self.queued -= 1;
        Some((tenant, w))
    }

    /// Makes room in a full queue for a tenant with fewer waiters than the longest-queued one, by
    /// dropping that tenant's newest waiter (its sender is dropped: it answers `QueueDropped`).
    /// False when the newcomer's tenant already waits as much as anyone: then it is refused.
    fn push_out_for(&mut self, tenant: &str) -> bool {
        if self.fair.is_none() {
            return false;
        }
        let mine = self.waiting.get(tenant).map_or(0, VecDeque::len);
        let longest = self
            .waiting
            .iter()
            .filter(|(t, _)| t.as_str() != tenant)
            .max_by_key(|(t, q)| (q.len(), std::cmp::Reverse(t.as_str())))
            .map(|(t, q)| (t.clone(), q.len()));
        let Some((victim, len)) = longest.filter(|(_, len)| *len > mine + 1) else {
            return false;
        };
        let q = self.waiting.get_mut(&victim).expect("listed above");
        q.pop_back();
        if len == 1 {
            self.waiting.remove(&victim);
        }
        self.queued -= 1;
        true
    }

    /// Removes a waiter that gave up; false when it was no longer queued.
    fn remove(&mut self, tenant: &str, id: u64) -> bool {
        let Some(q) = self.waiting.get_mut(tenant) else {
            return false;
        };
        let before = q.len();
        q.retain(|w| w.id != id);
        let removed = q.len() != before;
        if q.is_empty() {
            self.waiting.remove(tenant);
        }
        if removed {
            self.queued -= 1;
        }
        removed
    }
}

struct Inner {
    tiers: [Mutex<TierSlots>; 3],
}

impl Inner {
    fn lock(&self, tier: Tier) -> MutexGuard<'_, TierSlots> {
        // A poisoned lock only means another thread panicked mid-update of plain counters;
        // keep serving rather than cascading the panic onto the request path.
        self.tiers[tier.index()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    fn slot(self: &Arc<Self>, tier: Tier, charged: Option<Charged>) -> Slot {
        let inner = Arc::clone(self);
        Slot::new(move || inner.release(tier, charged))
    }

    fn release(self: &Arc<Self>, tier: Tier, charged: Option<Charged>) {
        if let Some(c) = charged {
            let kept = {
                let mut t = self.lock(tier);
                let kept = t.finish(&c);
                // Only where a timer can give it back.
                match (kept, tokio::runtime::Handle::try_current()) {
                    (Some((id, grace)), Ok(rt)) => Some((id, grace, rt)),
                    (Some((id, _)), Err(_)) => {
                        t.kept.retain(|(_, k)| *k != id);
                        None
                    }
                    (None, _) => None,
                }
            };
            if let Some((id, grace, rt)) = kept {
                let inner = Arc::clone(self);
                rt.spawn(async move {
                    tokio::time::sleep(grace).await;
                    inner.unkeep(tier, id);
                });
                return;
            }
        }
        self.hand_on(tier);
    }

    /// A kept slot's grace ended: if its tenant did not take it, it goes on.
    fn unkeep(self: &Arc<Self>, tier: Tier, id: u64) {
        {
            let mut t = self.lock(tier);
            let Some(i) = t.kept.iter().position(|(_, k)| *k == id) else {
                return;
            };
            let (tenant, _) = t.kept.swap_remove(i);
            if let Some(f) = t.fair.as_mut() {
                f.unused(&tenant);
            }
        }
        self.hand_on(tier);
    }

    /// A slot freed: to the next waiter, or back to the tier.
    fn hand_on(self: &Arc<Self>, tier: Tier) {
        loop {
            let (tenant, waiter, charged) = {
                let mut t = self.lock(tier);
                let over = t.capacity != 0 && t.inflight > u64::from(t.capacity);
                match t.pop_next() {
                    Some((tenant, w)) if !over => {
                        let charged = t.charge_waiter(&tenant, w.charge);
                        (tenant, w, charged)
                    }
                    other => {
                        if let Some((tenant, w)) = other {
                            // Back to the head of its own queue: nobody overtakes it.
                            t.queued += 1;
                            t.waiting.entry(tenant).or_default().push_front(w);
                        }
                        t.inflight = t.inflight.saturating_sub(1);
                        return;
                    }
                }
            };
            match waiter.tx.send(self.slot(tier, charged)) {
                Ok(()) => return,
                // The waiter is gone: take the slot back (without releasing), refund the
                // charge and try the next.
                Err(slot) => {
                    slot.disarm();
                    if let Some(f) = self.lock(tier).fair.as_mut() {
                        f.refund(&tenant, waiter.charge);
                    }
                }
            }
        }
    }
}

#[derive(Clone)]
pub struct LocalAdmission {
    inner: Arc<Inner>,
}

impl Default for LocalAdmission {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalAdmission {
    pub fn new() -> Self {
        Self::with_fair_share(FairShareSettings::default())
    }

    pub fn with_fair_share(settings: FairShareSettings) -> Self {
        Self {
            inner: Arc::new(Inner {
                tiers: std::array::from_fn(|_| Mutex::new(TierSlots::new(settings))),
            }),
        }
    }
}

#[async_trait]
impl AdmissionControl for LocalAdmission {
    async fn admit_as(
        &self,
        tier: Tier,
        capacity: u32,
        queue: Option<QueueParams>,
        claim: &Claim<'_>,
    ) -> Admission {
        let started = Instant::now();
        let charge = fair::charge_of(claim.cost_tokens, claim.weight);
        let (id, rx, max_wait) = {
            let mut t = self.inner.lock(tier);
            t.capacity = capacity;
            if let Some(f) = t.fair.as_mut() {
                f.arrive(claim.tenant, now_ms());
            }
            let kept = t.take_kept(claim.tenant);
            if kept || capacity == 0 || (t.inflight < u64::from(capacity) && t.queued == 0) {
                if !kept {
                    t.inflight += 1;
                }
                let charged = t.charge(claim.tenant, charge);
                drop(t);
                return Admission::Admitted {
                    slot: self.inner.slot(tier, charged),
                    queued_for: None,
                    fail_open: false,
                };
            }
            let Some(q) = queue else {
                return Admission::Refused {
                    reason: Reason::TierAtCapacity,
                    queued_for: None,
                };
            };
            if t.queued >= q.max_size && !t.push_out_for(claim.tenant) {
                return Admission::Refused {
                    reason: Reason::QueueDropped,
                    queued_for: None,
                };
            }
            let (tx, rx) = oneshot::channel();
            t.next_waiter += 1;
            let id = t.next_waiter;
            t.enqueue(claim.tenant, Waiter { id, charge, tx });
            (id, rx, q.max_wait)
        };
        let mut rx = rx;
        let slot = match tokio::time::timeout(max_wait, &mut rx).await {
            Ok(Ok(slot)) => Some(slot),
            // Pushed out of a full queue by a tenant with fewer waiters.
            Ok(Err(_)) => {
                return Admission::Refused {
                    reason: Reason::QueueDropped,
                    queued_for: Some(started.elapsed()),
                }
            }
            Err(_) => {
                let still_queued = self.inner.lock(tier).remove(claim.tenant, id);
                // Not in the queue any more: a slot was handed over just as the deadline hit.
                if still_queued {
                    None
                } else {
                    rx.await.ok()
                }
            }
        };
        let queued_for = Some(started.elapsed());
        match slot {
            Some(slot) => Admission::Admitted {
                slot,
                queued_for,
                fail_open: false,
            },
            None => Admission::Refused {
                reason: Reason::QueueTimedOut,
                queued_for,
            },
        }
    }

    fn status(&self, tier: Tier) -> TierAdmission {
        let t = self.inner.lock(tier);
        TierAdmission {
            inflight: t.inflight,
            idle_credits: 0,
            queued: t.queued as u64,
            capacity: t.capacity,
        }
    }

    fn waiting_tenants(&self, tier: Tier, limit: usize) -> Vec<TenantShare> {
        let t = self.inner.lock(tier);
        let mut out: Vec<TenantShare> = t
            .waiting
            .iter()
            .map(|(name, q)| TenantShare {
                tenant: name.clone(),
                queued: q.len() as u64,
                service: t.counter(name),
            })
            .collect();
        out.sort_by(|a, b| {
            a.service
                .total_cmp(&b.service)
                .then(a.tenant.cmp(&b.tenant))
        });
        out.truncate(limit);
        out
    }

    fn kind(&self) -> &'static str {
        "local"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn q(max_size: usize, wait_ms: u64) -> Option<QueueParams> {
        Some(QueueParams {
            max_size,
            max_wait: Duration::from_millis(wait_ms),
            poll: Duration::from_millis(50),
        })
    }

    fn admitted(a: Admission) -> Slot {
        match a {
            Admission::Admitted { slot, .. } => slot,
            Admission::Refused { reason, .. } => panic!("refused: {reason:?}"),
        }
    }

    fn refused(a: Admission) -> Reason {
        match a {
            Admission::Refused { reason, .. } => reason,
            Admission::Admitted { .. } => panic!("admitted"),
        }
    }

    #[tokio::test]
    async fn capacity_is_a_hard_bound_and_slots_release_on_drop() {
        let a = LocalAdmission::new();
        let s1 = admitted(a.admit(Tier::Guaranteed, 2, None).await);
        let _s2 = admitted(a.admit(Tier::Guaranteed, 2, None).await);
        assert_eq!(
            refused(a.admit(Tier::Guaranteed, 2, None).await),
            Reason::TierAtCapacity
        );
        assert_eq!(a.status(Tier::Guaranteed).inflight, 2);
        drop(s1);
        assert_eq!(a.status(Tier::Guaranteed).inflight, 1);
        let _s3 = admitted(a.admit(Tier::Guaranteed, 2, None).await);
        assert_eq!(
            a.status(Tier::Standard).inflight,
            0,
            "tiers are independent"
        );
    }

    #[tokio::test]
    async fn queue_releases_in_fifo_order() {
        let a = LocalAdmission::new();
        let held = admitted(a.admit(Tier::Standard, 1, None).await);
        let (done_tx, mut done_rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..3 {
            let a = a.clone();
            let done = done_tx.clone();
            tokio::spawn(async move {
                let slot = admitted(a.admit(Tier::Standard, 1, q(10, 5000)).await);
                done.send(i).unwrap();
                tokio::time::sleep(Duration::from_millis(20)).await;
                drop(slot);
            });
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(a.status(Tier::Standard).queued, 3);
        drop(held);
        let order: Vec<i32> = vec![
            done_rx.recv().await.unwrap(),
            done_rx.recv().await.unwrap(),
            done_rx.recv().await.unwrap(),
        ];
        assert_eq!(order, vec![0, 1, 2]);
        // The last holder keeps its slot 20 ms after its turn; a loaded machine may take longer.
        for _ in 0..200 {
            if a.status(Tier::Standard).inflight == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(
            a.status(Tier::Standard),
            TierAdmission {
                inflight: 0,
                idle_credits: 0,
                queued: 0,
                capacity: 1
            }
        );
    }

    #[tokio::test]
    async fn queue_bound_and_deadline() {
        let a = LocalAdmission::new();
        let _held = admitted(a.admit(Tier::Standard, 1, None).await);
        let a2 = a.clone();
        let waiter =
            tokio::spawn(async move { refused(a2.admit(Tier::Standard, 1, q(1, 100)).await) });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert_eq!(
            refused(a.admit(Tier::Standard, 1, q(1, 100)).await),
            Reason::QueueDropped
        );
        assert_eq!(waiter.await.unwrap(), Reason::QueueTimedOut);
        assert_eq!(
            a.status(Tier::Standard).queued,
            0,
            "timed-out entries are removed"
        );
        assert_eq!(a.status(Tier::Standard).inflight, 1);
    }

    fn claim(tenant: &str) -> Claim<'_> {
        Claim {
            tenant,
            weight: 1.0,
            cost_tokens: 100,
        }
    }

    /// A full queue is not first come, first served between tenants: a tenant with fewer
    /// waiters takes the place of the longest-queued tenant's newest waiter.
    #[tokio::test]
    async fn a_full_queue_pushes_out_the_longest_queued_tenants_newest() {
        let a = LocalAdmission::new();
        let _held = admitted(a.admit(Tier::Standard, 1, None).await);
        let mut heavy = Vec::new();
        for _ in 0..3 {
            let a = a.clone();
            heavy.push(tokio::spawn(async move {
                a.admit_as(Tier::Standard, 1, q(3, 500), &claim("heavy"))
                    .await
            }));
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let a2 = a.clone();
        let light = tokio::spawn(async move {
            a2.admit_as(Tier::Standard, 1, q(3, 500), &claim("light"))
                .await
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(a.status(Tier::Standard).queued, 3, "the bound holds");
        let newest = heavy.pop().unwrap().await.unwrap();
        assert_eq!(refused(newest), Reason::QueueDropped);
        // Light now waits once, heavy twice: one more light newcomer is refused, not swapped.
        assert_eq!(
            refused(
                a.admit_as(Tier::Standard, 1, q(3, 500), &claim("light"))
                    .await
            ),
            Reason::QueueDropped
        );
        let waiting = a.waiting_tenants(Tier::Standard, 10);
        let counts: Vec<(&str, u64)> = waiting
            .iter()
            .map(|w| (w.tenant.as_str(), w.queued))
            .collect();
        assert!(counts.contains(&("heavy", 2)) && counts.contains(&("light", 1)));
        // Plain FIFO (fair share off) refuses the newcomer instead.
        let fifo = LocalAdmission::with_fair_share(FairShareSettings {
            enabled: false,
            half_life_ms: 1,
        });
        let _held = admitted(fifo.admit(Tier::Standard, 1, None).await);
        let f2 = fifo.clone();
        let _w = tokio::spawn(async move {
            f2.admit_as(Tier::Standard, 1, q(1, 500), &claim("heavy"))
                .await
        });
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert_eq!(
            refused(
                fifo.admit_as(Tier::Standard, 1, q(1, 500), &claim("light"))
                    .await
            ),
            Reason::QueueDropped
        );
        drop(light);
    }

    fn claim_of(tenant: &str, cost_tokens: u64) -> Claim<'_> {
        Claim {
            tenant,
            weight: 1.0,
            cost_tokens,
        }
    }

    /// The slot a tenant owed the next one frees is kept for its next request for a quarter of
    /// the time it was held, while another tenant waits; unused, it goes to that waiter.
    #[tokio::test]
    async fn a_freed_slot_is_kept_for_the_tenant_owed_it_then_handed_on() {
        let a = LocalAdmission::new();
        // Big has been served more than small: small is owed the next slot.
        drop(admitted(
            a.admit_as(Tier::Standard, 1, None, &claim_of("big", 1000))
                .await,
        ));
        let held = admitted(
            a.admit_as(Tier::Standard, 1, None, &claim_of("small", 100))
                .await,
        );
        let a2 = a.clone();
        let big = tokio::spawn(async move {
            let s = admitted(
                a2.admit_as(Tier::Standard, 1, q(10, 5000), &claim_of("big", 1000))
                    .await,
            );
            (Instant::now(), s)
        });
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert_eq!(a.status(Tier::Standard).queued, 1);
        drop(held);
        // Small's next request comes within the grace (~100 ms) and goes ahead of big's.
        tokio::time::sleep(Duration::from_millis(20)).await;
        let held = admitted(
            a.admit_as(Tier::Standard, 1, q(10, 5000), &claim_of("small", 100))
                .await,
        );
        assert!(!big.is_finished(), "big waits");
        tokio::time::sleep(Duration::from_millis(400)).await;
        drop(held);
        let freed = Instant::now();
        // Nobody of small's comes: big has it after the grace.
        let (at, _slot) = big.await.unwrap();
        let after = at.duration_since(freed);
        assert!(
            after >= Duration::from_millis(50) && after < Duration::from_millis(1000),
            "handed on {after:?} after the release"
        );
        assert_eq!(a.status(Tier::Standard).inflight, 1);
    }

    #[tokio::test]
    async fn a_waiter_that_goes_away_does_not_leak_the_slot() {
        let a = LocalAdmission::new();
        let held = admitted(a.admit(Tier::Standard, 1, None).await);
        let a2 = a.clone();
        let gone = tokio::spawn(async move { a2.admit(Tier::Standard, 1, q(5, 5000)).await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        gone.abort();
        let _ = gone.await;
        drop(held);
        assert_eq!(a.status(Tier::Standard).inflight, 0);
        assert_eq!(a.status(Tier::Standard).queued, 0);
    }

    #[tokio::test]
    async fn unlimited_capacity_still_counts() {
        let a = LocalAdmission::new();
        let slots: Vec<_> = futures_join(&a, 50).await;
        assert_eq!(a.status(Tier::BestEffort).inflight, 50);
        drop(slots);
        assert_eq!(a.status(Tier::BestEffort).inflight, 0);
    }

    async fn futures_join(a: &LocalAdmission, n: usize) -> Vec<Slot> {
        let mut v = Vec::new();
        for _ in 0..n {
            v.push(admitted(a.admit(Tier::BestEffort, 0, None).await));
        }
        v
    }
}
