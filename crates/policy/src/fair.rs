//! Token-fair share between the tenants queued in one tier: a virtual token counter per tenant
//! (the VTC scheduler of "Fairness in Serving Large Language Models", OSDI 2024). Each admission
//! charges the tenant its estimated tokens divided by its weight; when a slot frees, the queued
//! tenant with the lowest counter gets it, FIFO within a tenant and, on a tie, FIFO between
//! tenants. Pure: time is passed in, so the in-process coordinator, the Redis scripts (which
//! apply the same rules in Lua, `lua/prelude.lua`), the benchmark's model and the tests share
//! one definition.
//!
//! While every tenant keeps requests waiting, the counters alone divide the tokens by weight,
//! whatever the time each request holds its slot. Three rules cover the moments a tenant's own
//! queue is empty, which is where hold times came in (issue 50): at a GPU's pace a request holds
//! its slot for seconds, so a tenant holds several slots at once, each charged in full when it
//! was admitted, and a slot handed to another tenant is gone for that tenant's whole hold time.
//! - **Lift.** A tenant that starts waiting while others wait is lifted to the least of their
//!   counters, each less what it runs ahead of the service its tenant has had: the charges of
//!   its requests still running, and at least its latest one. Being idle earns no credit to
//!   spend later, but a tenant that finds every slot taken by another's requests, or whose
//!   queue emptied for a moment (closed-loop clients between an answer and the next request),
//!   is owed what those requests were charged in advance. Taking off the latest charge alone
//!   (before issue 50) is right when a request holds its slot ~0.1 s, not when a tenant holds
//!   four for ~2 s each. Nor is credit earned *waiting* taken by a lift: how far a tenant's
//!   counter was under the lowest other waiting counter when its latest waiter was admitted
//!   stays owed (fading like an excess), so a tenant that found another holding three of four
//!   slots for seconds, and whose queue then emptied for 25 ms, is not lifted over the turns it
//!   waited for.
//! - **Fade.** A tenant that comes back with *more* service than the lowest waiting tenant keeps
//!   only a fading part of that excess (halved every `half_life`), so a burst an hour ago does
//!   not cost it its share now.
//! - **Hold.** A slot freed by a tenant that has nobody waiting but is owed the next slot (its
//!   counter is at most the lowest waiting one) is kept for that tenant's next request for a
//!   grace of a quarter of the time the request held it (at most [`MAX_GRACE_MS`]), then goes
//!   to the queue. Handed on at once, it would go to a tenant whose request may hold it for
//!   several times longer than the gap before the next request of the tenant it was owed to.
//!   A tenant whose kept slot went unused gets none until one of its requests comes within the
//!   grace again, so a tenant that has nothing more to send costs the tier one grace, not one a
//!   request.

use std::collections::HashMap;

/// Tenants beyond which counters of idle tenants are forgotten (a tenant id can come from a
/// client header, so the set is unbounded without this).
const MAX_TRACKED: usize = 4096;

/// The longest a freed slot is kept for its tenant's next request: a client that takes longer
/// between an answer and its next request is thinking, not waiting.
pub const MAX_GRACE_MS: u64 = 500;

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

/// How long a slot freed by a request that held it `held_ms` is kept for its tenant: a quarter
/// of that, so a kept slot nobody takes idles for at most a fifth of the time it is busy.
pub fn grace_of(held_ms: u64) -> u64 {
    (held_ms / 4).min(MAX_GRACE_MS)
}

/// Whether a freed slot is kept for its tenant, whose counter is `value`, while others wait
/// with `lowest` the lowest counter: only for a tenant owed the next slot, whose latest kept
/// slot (if any) was used.
pub fn keeps(value: f64, lowest: f64, slow: bool) -> bool {
    !slow && value <= lowest
}

#[derive(Debug, Clone, Copy, PartialEq)]
struct Counter {
    value: f64,
    /// Its latest charge, paid when a request was admitted that may still be running.
    last: f64,
    /// The charges of its requests still running: service counted but not yet had.
    ahead: f64,
    /// When the tenant was last charged (ms, any monotonic origin).
    at_ms: u64,
    /// When a request of it last ended, and the grace a slot it freed then would be kept.
    ended_ms: u64,
    grace_ms: u64,
    /// A slot kept for it went unused, and none of its requests came within a grace since.
    slow: bool,
    /// How far under the other waiting tenants' counters it was when its latest waiter was
    /// admitted, and when: credit earned waiting, which a lift leaves it.
    owed: f64,
    owed_ms: u64,
}

impl Counter {
    fn new(value: f64, now_ms: u64) -> Self {
        Counter {
            value,
            last: 0.0,
            ahead: 0.0,
            at_ms: now_ms,
            ended_ms: 0,
            grace_ms: 0,
            slow: false,
            owed: 0.0,
            owed_ms: now_ms,
        }
    }
}

/// Takes `charge` back from what a tenant is ahead by; float sums drift, and a charge may come
/// back for a counter that was forgotten and made anew since.
pub fn ahead_after(ahead: f64, charge: f64) -> f64 {
    let left = ahead - charge;
    if left > 1e-6 {
        left
    } else {
        0.0
    }
}

/// What a tenant that starts waiting is measured against: the counters of those already
/// waiting.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Floor {
    /// The lowest counter: an excess above it fades.
    pub lowest: f64,
    /// The least of the counters, each less what it runs ahead of the service its tenant has
    /// had ([`ahead_of`]; at most `lowest`): a newcomer below it is lifted to it.
    pub served: f64,
}

impl Floor {
    /// The floor of waiting tenants given as (counter, what it is ahead by).
    pub fn of<I: IntoIterator<Item = (f64, f64)>>(waiting: I) -> Option<Floor> {
        waiting.into_iter().fold(None, |acc, (value, ahead)| {
            let served = value - ahead.max(0.0);
            Some(match acc {
                None => Floor {
                    lowest: value,
                    served,
                },
                Some(f) => Floor {
                    lowest: f.lowest.min(value),
                    served: f.served.min(served),
                },
            })
        })
    }
}

/// What a waiting tenant's counter is ahead of the service it has had, for [`Floor`]: its
/// running requests' charges, and at least its latest charge. The latest counts even when its
/// request has ended: a tenant whose queue emptied between an answer and its next request lost
/// that turn to it, not service it had.
pub fn ahead_of(last: f64, ahead: f64) -> f64 {
    last.max(ahead)
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

    /// The charges of a tenant's requests still running.
    pub fn ahead(&self, tenant: &str) -> f64 {
        self.counters.get(tenant).map_or(0.0, |c| c.ahead)
    }

    /// Charges an admission; [`finish`](Self::finish) it with the same charge when it ends.
    pub fn charge(&mut self, tenant: &str, charge: f64, now_ms: u64) {
        // The common case (a tenant seen before) allocates nothing on the request path.
        if let Some(c) = self.counters.get_mut(tenant) {
            c.value += charge;
            c.last = charge;
            c.ahead += charge;
            c.at_ms = now_ms;
            return;
        }
        if self.counters.len() >= MAX_TRACKED {
            self.forget_idle(now_ms);
        }
        let mut c = Counter::new(charge, now_ms);
        c.last = charge;
        c.ahead = charge;
        self.counters.insert(tenant.to_string(), c);
    }

    /// An admitted request ended (its slot was given back): its charge is service had.
    pub fn finish(&mut self, tenant: &str, charge: f64) {
        if let Some(c) = self.counters.get_mut(tenant) {
            c.ahead = ahead_after(c.ahead, charge);
        }
    }

    /// Takes back a charge whose admission did not happen (its waiter had gone).
    pub fn refund(&mut self, tenant: &str, charge: f64) {
        if let Some(c) = self.counters.get_mut(tenant) {
            c.value -= charge;
            c.last = (c.last - charge).max(0.0);
            c.ahead = ahead_after(c.ahead, charge);
        }
    }

    /// A request of `tenant` that held its slot `held_ms` ended (after [`finish`]) with nobody
    /// of `tenant` waiting; `lowest` is the lowest counter of the tenants that wait (`None` when
    /// nobody does). Returns how long the slot is kept for `tenant`'s next request, if it is.
    ///
    /// [`finish`]: Self::finish
    pub fn keep(
        &mut self,
        tenant: &str,
        held_ms: u64,
        lowest: Option<f64>,
        now_ms: u64,
    ) -> Option<u64> {
        let c = self.counters.get_mut(tenant)?;
        c.ended_ms = now_ms;
        c.grace_ms = grace_of(held_ms);
        let lowest = lowest?;
        (keeps(c.value, lowest, c.slow) && c.grace_ms > 0).then_some(c.grace_ms)
    }

    /// A waiter of `tenant` was admitted from the queue (after [`charge`](Self::charge)), with
    /// `waiting` the tenants still waiting (itself among them or not): what its counter stays
    /// under the lowest of the others' (the turns it is owed by the counters) is owed to it until
    /// it next waits.
    pub fn claimed<'a, I: IntoIterator<Item = &'a str>>(
        &mut self,
        tenant: &str,
        waiting: I,
        now_ms: u64,
    ) {
        let lowest = waiting
            .into_iter()
            .filter(|t| *t != tenant)
            .map(|t| self.value(t))
            .min_by(f64::total_cmp);
        if let Some(c) = self.counters.get_mut(tenant) {
            c.owed = lowest.map_or(0.0, |l| owed_under(c.value, l));
            c.owed_ms = now_ms;
        }
    }

    /// A slot kept for `tenant` went unused: none is kept for it until one of its requests
    /// comes within a grace of the end of the one before.
    pub fn unused(&mut self, tenant: &str) {
        if let Some(c) = self.counters.get_mut(tenant) {
            c.slow = true;
        }
    }

    /// A request of `tenant` arrives, before it takes a slot or waits.
    pub fn arrive(&mut self, tenant: &str, now_ms: u64) {
        if let Some(c) = self.counters.get_mut(tenant) {
            if c.slow && now_ms.saturating_sub(c.ended_ms) <= c.grace_ms {
                c.slow = false;
            }
        }
    }

    /// The floor the given waiting tenants set for a newcomer (`None` when nobody waits).
    pub fn floor<'a, I: IntoIterator<Item = &'a str>>(&self, waiting: I) -> Option<Floor> {
        Floor::of(waiting.into_iter().map(|t| {
            self.counters
                .get(t)
                .map_or((0.0, 0.0), |c| (c.value, ahead_of(c.last, c.ahead)))
        }))
    }

    /// A tenant starts waiting; `floor` is that of the tenants already waiting in the tier
    /// (`None` when nobody waits). Returns its counter afterwards.
    pub fn enter(&mut self, tenant: &str, floor: Option<Floor>, now_ms: u64) -> f64 {
        let Some(floor) = floor else {
            return self.value(tenant);
        };
        let half_life = self.half_life_ms;
        let c = self
            .counters
            .entry(tenant.to_string())
            .or_insert_with(|| Counter::new(floor.served, now_ms));
        let owed = faded(c.owed, c.owed_ms, now_ms, half_life);
        let value = entered(c.value, c.at_ms, floor, owed, now_ms, half_life);
        if value != c.value {
            // A lifted or faded counter owes nothing to its latest admission any more.
            c.value = value;
            c.last = 0.0;
        }
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

/// What a tenant whose counter is `value` is owed under the lowest other waiting counter.
pub fn owed_under(value: f64, lowest: f64) -> f64 {
    (lowest - value).max(0.0)
}

/// `amount` recorded at `at_ms`, halved every `half_life_ms` since.
pub fn faded(amount: f64, at_ms: u64, now_ms: u64, half_life_ms: u64) -> f64 {
    let since = now_ms.saturating_sub(at_ms) as f64;
    amount * 0.5f64.powf(since / half_life_ms.max(1) as f64)
}

/// The lift-and-fade rule for a tenant that starts waiting, still `owed` what it earned waiting
/// before ([`FairShare::claimed`], faded): below the floor's `served` less that it is lifted to
/// it; up to the `lowest` counter it keeps its own (it is owed the service the others were
/// charged for in advance); above, its excess halves every `half_life_ms` since it was last
/// charged.
pub fn entered(
    value: f64,
    at_ms: u64,
    floor: Floor,
    owed: f64,
    now_ms: u64,
    half_life_ms: u64,
) -> f64 {
    let lift = floor.served - owed.max(0.0);
    if value <= lift {
        return lift;
    }
    if value <= floor.lowest {
        return value;
    }
    floor.lowest + faded(value - floor.lowest, at_ms, now_ms, half_life_ms)
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

    fn floor(lowest: f64, served: f64) -> Option<Floor> {
        Some(Floor { lowest, served })
    }

    /// Issue 50's flaky start: heavy's requests (925 tokens, ~2.4 s each) took three of four
    /// slots, gold (245, ~0.9 s) waited through them on one slot, and its queue emptied for the
    /// 25 ms between its last waiter's admission and its next client's request. Lifted then to
    /// heavy's service, it lost ~6 of its requests' turns (0.84 of its share over 25 s).
    #[test]
    fn credit_earned_waiting_is_not_lifted_away_when_the_queue_empties_for_a_moment() {
        let mut f = FairShare::new(60_000);
        for _ in 0..3 {
            f.charge("heavy", 925.0, 0);
        }
        f.enter("heavy", None, 0);
        f.charge("gold", 245.0, 0);
        assert_eq!(f.enter("gold", f.floor(["heavy"]), 0), 245.0);
        // Gold's waiters take its one slot in turn while heavy's three run.
        for at in [900, 1800, 2900] {
            f.finish("gold", 245.0);
            f.charge("gold", 245.0, at);
            f.claimed("gold", ["heavy", "gold"], at);
        }
        assert_eq!(f.value("gold"), 980.0);
        // Heavy's three end; two of its waiters take their slots.
        for _ in 0..3 {
            f.finish("heavy", 925.0);
        }
        f.charge("heavy", 925.0, 2916);
        f.charge("heavy", 925.0, 2920);
        let floor = f.floor(["heavy"]);
        assert_eq!(
            floor,
            Some(Floor {
                lowest: 4625.0,
                served: 2775.0
            })
        );
        // Still owed the 1,795 it was under heavy when last admitted (less 44 ms of fading):
        // lifted by under a token, not to 2,775.
        let back = f.enter("gold", floor, 2944);
        assert!((980.0..981.0).contains(&back), "{back}");
        // Credit fades like an excess: after ten half-lives away it is (nearly) lifted.
        f.finish("gold", 245.0);
        let later = f.enter("gold", floor, 600_000);
        assert!(later > 2773.0 && later < 2775.0, "{later}");
        // A tenant that never waited under another is lifted as before.
        f.charge("light", 100.0, 0);
        assert_eq!(f.enter("light", floor, 2944), 2775.0);
    }

    #[test]
    fn a_newcomer_is_lifted_to_the_waiting_floor_less_what_it_was_charged_ahead() {
        let mut f = FairShare::new(60_000);
        f.charge("heavy", 400.0, 0);
        f.finish("heavy", 400.0);
        f.charge("heavy", 100.0, 0);
        let waiting = f.floor(["heavy"]);
        assert_eq!(waiting, floor(500.0, 400.0));
        assert_eq!(f.enter("light", waiting, 10), 400.0);
        // Ended, the latest charge still counts: one request's worth, no more.
        f.finish("heavy", 100.0);
        assert_eq!(f.floor(["heavy"]), floor(500.0, 400.0));
        // Nobody waiting: nothing to be lifted to.
        assert_eq!(f.enter("other", None, 10), 0.0);
        assert_eq!(f.floor(std::iter::empty()), None);
    }

    /// Issue 50: at a GPU's pace a tenant holds several slots at once, each charged in full
    /// when admitted. Lifted to the others' counters before their latest admission only, a
    /// tenant that found every slot taken was owed one of their requests' worth where it was
    /// owed all of them.
    #[test]
    fn a_newcomer_is_owed_every_charge_still_running() {
        let mut f = FairShare::new(60_000);
        for _ in 0..4 {
            f.charge("heavy", 920.0, 0);
        }
        let waiting = f.floor(["heavy"]);
        assert_eq!(waiting, floor(3680.0, 0.0));
        assert_eq!(f.enter("gold", waiting, 1), 0.0, "not lifted to 2760");
        for _ in 0..4 {
            f.finish("heavy", 920.0);
        }
        assert_eq!(f.ahead("heavy"), 0.0);
        assert_eq!(f.enter("late", f.floor(["heavy"]), 2), 2760.0);
    }

    /// Issue 41: charged in full when admitted, a tenant is ahead of one whose queue emptied
    /// for a moment by service it has not yet had. The returning tenant keeps its own counter
    /// down to the others' counters less their running charges (at least their latest), so it
    /// finishes its turn instead of being lifted level with them and losing the tie.
    #[test]
    fn a_tenant_back_from_a_momentary_empty_queue_keeps_its_turn() {
        let mut f = FairShare::new(60_000);
        f.charge("gold", 800.0, 0);
        f.charge("heavy", 920.0, 0);
        f.charge("heavy", 920.0, 1);
        f.finish("heavy", 920.0);
        f.charge("gold", 240.0, 2);
        let waiting = f.floor(["heavy"]);
        assert_eq!(waiting, floor(1840.0, 920.0));
        assert_eq!(
            f.enter("gold", waiting, 3),
            1040.0,
            "kept, not lifted to 1840"
        );
        // Long idle: lifted, though only to heavy's counter less its latest charge.
        let mut f = FairShare::new(60_000);
        f.charge("heavy", 920.0, 0);
        f.charge("heavy", 920.0, 1);
        f.finish("heavy", 920.0);
        f.finish("heavy", 920.0);
        assert_eq!(f.enter("gold", f.floor(["heavy"]), 2), 920.0);
    }

    #[test]
    fn a_refund_takes_back_the_charge_and_what_it_was_ahead_by() {
        let mut f = FairShare::new(60_000);
        f.charge("heavy", 400.0, 0);
        f.finish("heavy", 400.0);
        f.charge("heavy", 100.0, 0);
        f.refund("heavy", 100.0);
        assert_eq!(f.value("heavy"), 400.0);
        assert_eq!(f.ahead("heavy"), 0.0);
        assert_eq!(f.floor(["heavy"]), floor(400.0, 400.0));
        // A charge given back twice (or to a counter made anew) never goes below nothing.
        f.finish("heavy", 400.0);
        assert_eq!(f.ahead("heavy"), 0.0);
    }

    #[test]
    fn past_excess_fades_by_half_lives() {
        let mut f = FairShare::new(1000);
        f.charge("was-heavy", 1100.0, 0);
        f.finish("was-heavy", 1100.0);
        assert_eq!(f.enter("was-heavy", floor(100.0, 50.0), 0), 1100.0);
        let mut f = FairShare::new(1000);
        f.charge("was-heavy", 1100.0, 0);
        f.finish("was-heavy", 1100.0);
        let v = f.enter("was-heavy", floor(100.0, 50.0), 2000);
        assert!((v - 350.0).abs() < 1e-9, "{v}");
        // Faded: it owes nothing to its latest admission any more.
        assert_eq!(f.floor(["was-heavy"]), floor(v, v));
    }

    /// A freed slot is kept for a tenant owed it, a quarter of the time its request held it,
    /// and not again after it went unused until one of the tenant's requests comes in time.
    #[test]
    fn a_slot_is_kept_for_a_tenant_owed_it_until_a_kept_one_goes_unused() {
        assert_eq!(grace_of(600), 150);
        assert_eq!(grace_of(60_000), MAX_GRACE_MS);
        let mut f = FairShare::new(60_000);
        f.charge("gold", 80.0, 0);
        f.finish("gold", 80.0);
        assert_eq!(f.keep("gold", 600, Some(920.0), 600), Some(150));
        assert_eq!(f.keep("gold", 600, None, 600), None, "nobody waits");
        assert_eq!(f.keep("gold", 600, Some(50.0), 600), None, "not owed");
        assert_eq!(f.keep("stranger", 600, Some(920.0), 600), None);
        f.unused("gold");
        assert_eq!(f.keep("gold", 600, Some(920.0), 1000), None, "went unused");
        f.arrive("gold", 1200);
        assert_eq!(
            f.keep("gold", 600, Some(920.0), 2000),
            None,
            "came too late"
        );
        f.arrive("gold", 2150);
        assert_eq!(f.keep("gold", 600, Some(920.0), 3000), Some(150));
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

    /// One tenant of the event model: `clients` closed-loop clients, arriving from `start_ms`
    /// a millisecond apart, each sending its next request `think_ms` after its last answer;
    /// a request is `tokens` long and holds its slot `hold_ms`.
    #[derive(Clone, Copy)]
    struct Tenant {
        clients: usize,
        weight: f64,
        tokens: u64,
        hold_ms: u64,
        think_ms: u64,
        start_ms: u64,
    }

    /// The coordinators' rules (`local.rs`) as an event model, time passed in: a newcomer takes
    /// a slot kept for its tenant, or a free one only when nobody waits; a tenant whose queue
    /// was empty enters; a freed slot is kept for its tenant or goes to the next waiter by fair
    /// share (`keep`: as the coordinators do; without, handed on at once). Returns the tokens
    /// each tenant was served over `horizon_ms`, a request still
    /// running counting for the part of its hold that has passed.
    fn serve(tenants: &[Tenant], capacity: usize, horizon_ms: u64, keep: bool) -> Vec<f64> {
        use std::cmp::Reverse;
        use std::collections::{BinaryHeap, VecDeque};
        #[derive(PartialEq, Eq, PartialOrd, Ord)]
        enum Ev {
            Done(usize),
            Arrive(usize),
            /// A slot kept for a tenant (by its id) ends its grace.
            Unkeep(u64),
        }
        let mut f = FairShare::new(60_000);
        let mut events = BinaryHeap::new();
        let mut seq = 0u64;
        for (t, tenant) in tenants.iter().enumerate() {
            for c in 0..tenant.clients {
                events.push(Reverse((tenant.start_ms + c as u64, seq, Ev::Arrive(t))));
                seq += 1;
            }
        }
        let names: Vec<String> = (0..tenants.len()).map(|t| format!("t{t}")).collect();
        let charge = |t: usize| charge_of(tenants[t].tokens, tenants[t].weight);
        let mut queues: Vec<VecDeque<u64>> = vec![VecDeque::new(); tenants.len()];
        // Slots kept: (tenant, id).
        let mut kept: Vec<(usize, u64)> = Vec::new();
        // Slots taken by requests or kept.
        let mut taken = 0;
        let mut served = vec![0.0; tenants.len()];
        while let Some(Reverse((now, _, ev))) = events.pop() {
            if now > horizon_ms {
                if let Ev::Done(t) = ev {
                    let hold = tenants[t].hold_ms as f64;
                    let had = horizon_ms as f64 - (now as f64 - hold);
                    served[t] += tenants[t].tokens as f64 * (had / hold).clamp(0.0, 1.0);
                }
                continue;
            }
            let admit = |t: usize, f: &mut FairShare, seq: &mut u64, events: &mut BinaryHeap<_>| {
                f.charge(&names[t], charge(t), now);
                *seq += 1;
                events.push(Reverse((now + tenants[t].hold_ms, *seq, Ev::Done(t))));
            };
            // A slot that frees goes to the next waiter, or is no longer taken.
            let hand_on = |f: &mut FairShare,
                           queues: &mut Vec<VecDeque<u64>>,
                           seq: &mut u64,
                           events: &mut BinaryHeap<_>|
             -> bool {
                let next = next_of(queues.iter().enumerate().map(|(u, q)| {
                    q.front()
                        .map_or((f64::INFINITY, u64::MAX), |s| (f.value(&names[u]), *s))
                }));
                let Some(u) = next.filter(|&u| !queues[u].is_empty()) else {
                    return false;
                };
                queues[u].pop_front();
                admit(u, f, seq, events);
                true
            };
            match ev {
                Ev::Arrive(t) => {
                    f.arrive(&names[t], now);
                    if let Some(i) = kept.iter().position(|k| k.0 == t) {
                        kept.remove(i);
                        admit(t, &mut f, &mut seq, &mut events);
                        continue;
                    }
                    if taken < capacity && queues.iter().all(VecDeque::is_empty) {
                        taken += 1;
                        admit(t, &mut f, &mut seq, &mut events);
                        continue;
                    }
                    if queues[t].is_empty() {
                        let waiting = (0..tenants.len()).filter(|&u| !queues[u].is_empty());
                        let floor = f.floor(waiting.map(|u| names[u].as_str()));
                        f.enter(&names[t], floor, now);
                    }
                    seq += 1;
                    queues[t].push_back(seq);
                }
                Ev::Done(t) => {
                    served[t] += tenants[t].tokens as f64;
                    f.finish(&names[t], charge(t));
                    seq += 1;
                    events.push(Reverse((now + tenants[t].think_ms, seq, Ev::Arrive(t))));
                    if keep && queues[t].is_empty() {
                        let lowest = (0..tenants.len())
                            .filter(|&u| !queues[u].is_empty())
                            .map(|u| f.value(&names[u]))
                            .min_by(f64::total_cmp);
                        if let Some(grace) = f.keep(&names[t], tenants[t].hold_ms, lowest, now) {
                            seq += 1;
                            kept.push((t, seq));
                            events.push(Reverse((now + grace, seq, Ev::Unkeep(seq))));
                            continue;
                        }
                    }
                    if !hand_on(&mut f, &mut queues, &mut seq, &mut events) {
                        taken -= 1;
                    }
                }
                Ev::Unkeep(id) => {
                    let Some(i) = kept.iter().position(|k| k.1 == id) else {
                        continue;
                    };
                    f.unused(&names[kept.remove(i).0]);
                    if !hand_on(&mut f, &mut queues, &mut seq, &mut events) {
                        taken -= 1;
                    }
                }
            }
        }
        served
    }

    /// Issue 50's tenants: gold sends 200-token prompts for 40 tokens, heavy 800 for 120,
    /// capacity 4; a request holds its slot for its first token (20 ms), its prompt (50 µs a
    /// token) and its completion at `ms_per_token`. Gold's token share over heavy's.
    fn share(
        gold: (usize, f64),
        ms_per_token: f64,
        think_ms: u64,
        heavy_first: bool,
        horizon_ms: u64,
    ) -> f64 {
        let hold = |prompt: u64, completion: u64| {
            (20.0 + prompt as f64 * 0.05 + completion as f64 * ms_per_token).round() as u64
        };
        let (gold_start, heavy_start) = if heavy_first { (20, 0) } else { (0, 20) };
        let tenants = [
            Tenant {
                clients: gold.0,
                weight: gold.1,
                tokens: 240,
                hold_ms: hold(200, 40),
                think_ms,
                start_ms: gold_start,
            },
            Tenant {
                clients: 12,
                weight: 1.0,
                tokens: 920,
                hold_ms: hold(800, 120),
                think_ms,
                start_ms: heavy_start,
            },
        ];
        let served = serve(&tenants, 4, horizon_ms, true);
        served[0] / served[1]
    }

    fn assert_share(what: &str, share: f64, weight: f64) {
        eprintln!("{what}: token share {share:.3}");
        assert!(
            (share / weight - 1.0).abs() <= 0.15,
            "{what}: token share {share:.2}, want {weight} ± 15 %"
        );
    }

    /// Weights divide the tokens served whatever the hold times: at the project simulator's
    /// 1 ms a token and at a GPU's 15 and 40, whichever tenant takes the slots first, over the
    /// first 25 s. With heavy taking all four slots first at 15 ms a token, gold had 2.27 of 3
    /// (0.89 of 1) before issue 50: it was lifted to heavy's counter less one charge, where
    /// all four were still running.
    #[test]
    fn weighted_token_shares_hold_whatever_the_hold_times() {
        for ms_per_token in [1.0, 15.0, 40.0] {
            for think_ms in [0, 100] {
                for heavy_first in [true, false] {
                    for weight in [1.0, 3.0] {
                        let what = format!(
                            "{ms_per_token} ms a token, think {think_ms} ms, heavy first \
                             {heavy_first}, weights {weight}:1"
                        );
                        let s = share((12, weight), ms_per_token, think_ms, heavy_first, 25_000);
                        assert_share(&what, s, weight);
                    }
                }
            }
        }
    }

    /// A tenant whose few clients leave its queue empty between an answer and the next request
    /// (100 ms) keeps its share at GPU timings: the slot it frees is kept for it. Handed to
    /// heavy, each was gone for heavy's 1.9 s: before issue 50 gold's share was 0.26 at 1:1
    /// (four clients) and 1.3 at 3:1 (six). (Four clients that pause cannot fill the 3.1 slots
    /// of a 3:1 share.)
    #[test]
    fn a_tenant_with_few_closed_loop_clients_keeps_its_share_at_gpu_timings() {
        for (clients, weights) in [(4, &[1.0][..]), (6, &[1.0, 3.0][..])] {
            for ms_per_token in [15.0, 40.0] {
                for heavy_first in [true, false] {
                    for &weight in weights {
                        let what = format!(
                            "{clients} gold clients, {ms_per_token} ms a token, heavy first \
                             {heavy_first}, weights {weight}:1"
                        );
                        let s = share((clients, weight), ms_per_token, 100, heavy_first, 120_000);
                        assert_share(&what, s, weight);
                    }
                }
            }
        }
    }

    /// Issue 41's pauses (gold's queue empties now and then) at the simulator's pace.
    #[test]
    fn closed_loop_token_shares_follow_the_weights() {
        for think_ms in [0, 150, 170] {
            for weight in [1.0, 3.0] {
                let what = format!("think {think_ms} ms, weights {weight}:1");
                assert_share(
                    &what,
                    share((12, weight), 1.0, think_ms, false, 120_000),
                    weight,
                );
            }
        }
    }

    /// A kept slot nobody takes costs the tier little: gold's four clients pause 1 s, longer
    /// than any grace, and the tier serves within 1 % of what it serves with no slot kept.
    #[test]
    fn a_slot_kept_for_a_tenant_that_does_not_come_back_costs_little() {
        let hold = |ms| Tenant {
            clients: 4,
            weight: 1.0,
            tokens: 240,
            hold_ms: 630,
            think_ms: ms,
            start_ms: 0,
        };
        let heavy = Tenant {
            clients: 12,
            weight: 1.0,
            tokens: 920,
            hold_ms: 1860,
            think_ms: 0,
            start_ms: 20,
        };
        for think_ms in [300, 1000] {
            let tenants = [hold(think_ms), heavy];
            let kept: f64 = serve(&tenants, 4, 120_000, true).iter().sum();
            let not: f64 = serve(&tenants, 4, 120_000, false).iter().sum();
            eprintln!("think {think_ms} ms: served {kept:.0} with slots kept, {not:.0} without");
            assert!(
                kept >= 0.99 * not,
                "think {think_ms} ms: {kept:.0} against {not:.0}"
            );
        }
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
            let floor = f.floor(
                queues
                    .iter()
                    .filter(|(_, q)| !q.is_empty())
                    .map(|(t, _)| t.as_str()),
            );
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
