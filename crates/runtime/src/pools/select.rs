//! Choosing the replica inside a pool, among its usable backends that serve the request's
//! model: round robin, least load, or prefix affinity with bounded loads (consistent hashing
//! on Pingora's Ketama ring: a prompt head keeps its replica, whose prefix cache holds it,
//! until that replica carries more than `load_bound` times the pool's mean; then the next
//! replica on the ring, as in Mirrokni, Thorup and Zadimoghaddam, 2018).

use super::affinity::{Affinity, AffinityTicket, Home, Homes};
use super::BackendInfo;
use pingora::lb::Backend;
use pingora_ketama::{Bucket, Continuum};
use sluice_config::Selection;
use std::cell::RefCell;
use std::sync::Arc;

/// What a pick needs to know of the request.
#[derive(Clone, Copy, Default)]
pub struct Want<'a> {
    /// Backends allowed (the model's, by name); `None`: all.
    pub serves: Option<&'a dyn Fn(&str) -> bool>,
    /// The hash of the prompt's head, for prefix affinity.
    pub prefix: Option<u64>,
    /// The backends this request already tried and failed on: never picked again for it.
    pub exclude: &'a [Arc<str>],
}

/// Requests' worth of waiting a home may hold above the pool's mean whatever `load_bound`
/// allows, counted on the quickest replica: a spill costs the head's whole prefill again (about
/// three answers' time to first token where the head is cached, for a 2,000-token head), and
/// vLLM runs a batch at once, so a few more in flight than the mean is not yet a queue. With a
/// handful of requests per replica a bound of 1.25x the mean alone would spill a shared prompt
/// on every ordinary burst (and its cache with it).
const BOUND_SLACK: f64 = 3.0;

/// A pool's usable backends, in the balancer's order, each with its [`BackendInfo`], and the
/// ring over them (built with the set, which changes only when health does).
pub(super) struct UsableSet {
    pub(super) generation: u64,
    pub(super) backends: Box<[(Backend, BackendInfo)]>,
    ring: Option<Continuum>,
    /// When the earliest ejection of a backend left out of the set ends.
    pub(super) expires: Option<std::time::Instant>,
}

impl UsableSet {
    pub(super) fn new(generation: u64, backends: Box<[(Backend, BackendInfo)]>) -> Self {
        let buckets: Vec<Bucket> = backends
            .iter()
            .filter_map(|(b, _)| b.addr.as_inet().map(|a| Bucket::new(*a, 1)))
            .collect();
        let ring = (buckets.len() > 1).then(|| Continuum::new(&buckets));
        UsableSet {
            generation,
            backends,
            ring,
            expires: None,
        }
    }

    /// The backend for a request, by the pool's `selection`; `ordinal` keys this thread's
    /// round-robin counter for the pool. With prefix affinity, a request sent to its head's home
    /// comes with a ticket: its answer tells whether the home kept the head.
    pub(super) fn pick(
        &self,
        selection: Selection,
        load_bound: f64,
        ordinal: usize,
        want: Want<'_>,
        affinity: &Arc<Affinity>,
    ) -> Option<(Backend, BackendInfo, Option<AffinityTicket>)> {
        let ok = |info: &BackendInfo| want.serves.is_none_or(|serves| serves(&info.name));
        let avoid = |info: &BackendInfo| want.exclude.contains(&info.name);
        let start = next(ordinal);
        let allowed = |info: &BackendInfo| ok(info) && !avoid(info);
        let candidates = || self.rotated(start, &allowed);
        let (chosen, home) = match selection {
            Selection::RoundRobin => (candidates().next(), false),
            Selection::LeastLoad => (least_loaded(candidates()), false),
            Selection::PrefixAffinity => match want.prefix {
                Some(key) if affinity.affine() => {
                    split(self.affine(key, load_bound, start, &affinity.homes, &allowed))
                }
                Some(key) => split(self.spread(key, start, &affinity.homes, &allowed)),
                None => (least_loaded(candidates()), false),
            },
        };
        let (b, info) = chosen?;
        Some((b.clone(), info.clone(), home.then(|| affinity.ticket())))
    }

    /// What loads are priced in over `set`: the time to first byte of a backend not measured
    /// yet, and one request's worth of waiting on the quickest replica.
    fn prices<'a>(set: impl Iterator<Item = &'a (Backend, BackendInfo)> + Clone) -> (f64, f64) {
        let default = unmeasured_ttfb_ms(set.clone());
        let unit = set
            .map(|(_, i)| i.load.ttfb_ms().unwrap_or(default))
            .fold(f64::INFINITY, f64::min)
            .max(0.001);
        (default, unit)
    }

    /// The usable backends `allowed` keeps, walked from `start` (the round-robin counter) as
    /// least load walks them: equal loads share the traffic instead of all going to the first.
    fn rotated<'s: 'f, 'f>(
        &'s self,
        start: usize,
        allowed: &'f dyn Fn(&BackendInfo) -> bool,
    ) -> impl Iterator<Item = &'s (Backend, BackendInfo)> + Clone + 'f {
        let n = self.backends.len().max(1);
        (0..self.backends.len())
            .map(move |i| &self.backends[(start + i) % n])
            .filter(move |(_, i)| allowed(i))
    }

    /// Prefix affinity with bounded loads (Mirrokni, Thorup and Zadimoghaddam): the head's home
    /// while its load with this request stays within `load_bound` × the pool's mean (or the
    /// mean plus [`BOUND_SLACK`] requests on the quickest replica); past it the head's spill
    /// replica while that one is within the bound, else the least loaded, which becomes the
    /// spill replica. The home is kept. A load is least load's price (work ahead times time to
    /// first byte), so a replica that answers slowly keeps fewer heads. A head without a usable
    /// home goes where least load would send it, so a head seen once (every head, when prompts
    /// share nothing) costs exactly what least load would; its Ketama ring node is taken
    /// instead when within half a request of that (so Sluice replicas agree on where a head
    /// lives whenever the loads leave them the choice). The flag says the request went to its
    /// head's home.
    fn affine(
        &self,
        key: u64,
        load_bound: f64,
        start: usize,
        homes: &Homes,
        allowed: &dyn Fn(&BackendInfo) -> bool,
    ) -> Option<(&(Backend, BackendInfo), bool)> {
        let allowed_set = || self.rotated(start, allowed);
        let n = allowed_set().count();
        if n == 0 {
            return None;
        }
        // Loads are priced as least load prices them (work ahead times time to first byte),
        // so a replica that answers slowly reaches its bound with fewer requests.
        let (default, unit) = Self::prices(allowed_set());
        let load = |e: &(Backend, BackendInfo)| e.1.load.cost(default);
        let mean = allowed_set().map(load).sum::<f64>() / n as f64;
        let bound = (load_bound * mean).max(mean + BOUND_SLACK * unit);
        let find = |name: &Arc<str>| allowed_set().find(|(_, i)| i.name == *name);
        if let Some(mut home) = homes.get(key) {
            if let Some(first) = find(&home.first) {
                if load(first) <= bound {
                    return Some((first, true));
                }
                if let Some(spill) = home.spill.as_ref().and_then(find) {
                    if load(spill) <= bound {
                        return Some((spill, false));
                    }
                }
                let spill = least_loaded(allowed_set().filter(|(_, i)| i.name != home.first))
                    .unwrap_or(first);
                home.spill = Some(Arc::clone(&spill.1.name));
                homes.set(key, home);
                return Some((spill, spill.1.name == first.1.name));
            }
        }
        let on_ring = self.ring.as_ref().and_then(|ring| {
            let addr = ring
                .node_iter(&key.to_le_bytes())
                .find(|a| allowed_set().any(|(b, _)| b.addr.as_inet() == Some(*a)))?;
            allowed_set().find(|(b, _)| b.addr.as_inet() == Some(addr))
        });
        let least = least_loaded(allowed_set())?;
        let placed = match on_ring {
            Some(e) if load(e) <= load(least) + 0.5 * unit => e,
            _ => least,
        };
        homes.set(
            key,
            Home {
                first: Arc::clone(&placed.1.name),
                spill: None,
            },
        );
        Some((placed, false))
    }

    /// Spreading by load, when homes do not keep their heads: the least loaded replica, or the
    /// head's home when it is within half a request of it (on the quickest replica): as good a
    /// place for the load, it may still hold the head, and its answer keeps the evidence coming
    /// that ends the spreading. A head first seen now makes the replica chosen its home, for a
    /// trial of affinity to start from.
    fn spread(
        &self,
        key: u64,
        start: usize,
        homes: &Homes,
        allowed: &dyn Fn(&BackendInfo) -> bool,
    ) -> Option<(&(Backend, BackendInfo), bool)> {
        let allowed_set = || self.rotated(start, allowed);
        let least = least_loaded(allowed_set())?;
        let Some(home) = homes.get(key) else {
            homes.set(
                key,
                Home {
                    first: Arc::clone(&least.1.name),
                    spill: None,
                },
            );
            return Some((least, false));
        };
        let Some(first) = allowed_set().find(|(_, i)| i.name == home.first) else {
            return Some((least, false));
        };
        let (default, unit) = Self::prices(allowed_set());
        if first.1.load.cost(default) <= least.1.load.cost(default) + 0.5 * unit {
            return Some((first, true));
        }
        Some((least, false))
    }
}

/// A pick and whether it is the head's home, as optional parts.
fn split(p: Option<(&(Backend, BackendInfo), bool)>) -> (Option<&(Backend, BackendInfo)>, bool) {
    p.map_or((None, false), |(e, home)| (Some(e), home))
}

/// The time to first byte a backend not measured yet is priced at: the mean of those that are
/// (1 ms when none is, which makes costs plain counts).
fn unmeasured_ttfb_ms<'a>(it: impl Iterator<Item = &'a (Backend, BackendInfo)>) -> f64 {
    let (sum, n) = it
        .filter_map(|(_, i)| i.load.ttfb_ms())
        .fold((0.0, 0u32), |(s, n), t| (s + t, n + 1));
    if n == 0 {
        1.0
    } else {
        sum / f64::from(n)
    }
}

/// The backend where one more request would wait least: peak-EWMA cost (work ahead times time
/// to first byte), so a replica that answers slowly gets less even at equal counts. One not
/// measured yet is priced at the mean of those that are.
fn least_loaded<'a>(
    it: impl Iterator<Item = &'a (Backend, BackendInfo)> + Clone,
) -> Option<&'a (Backend, BackendInfo)> {
    let default = unmeasured_ttfb_ms(it.clone());
    // The first of equal costs wins, and the walk starts at a rotating place: equal backends
    // share the traffic.
    it.fold(None, |best: Option<(&(Backend, BackendInfo), f64)>, b| {
        let score = b.1.load.cost(default);
        match best {
            Some((_, s)) if s <= score => best,
            _ => Some((b, score)),
        }
    })
    .map(|(b, _)| b)
}

/// This thread's counter for pool `ordinal`: each worker rotates on its own, which spreads
/// requests as evenly as one shared counter without both cores writing it; one counter per
/// pool, so picks alternating between pools still rotate in each.
fn next(ordinal: usize) -> usize {
    thread_local! {
        static NEXT: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    }
    NEXT.with_borrow_mut(|next| {
        if next.len() <= ordinal {
            next.resize(ordinal + 1, 0);
        }
        let v = next[ordinal];
        next[ordinal] = v.wrapping_add(1);
        v
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fleet::BackendLoads;
    use std::time::Duration;

    thread_local! {
        // One pool's homes per test (each test runs on its own thread).
        static AFFINITY: Arc<Affinity> = Arc::default();
    }

    impl UsableSet {
        fn pick4(
            &self,
            selection: Selection,
            load_bound: f64,
            ordinal: usize,
            want: Want<'_>,
        ) -> Option<(Backend, BackendInfo)> {
            AFFINITY
                .with(|a| self.pick(selection, load_bound, ordinal, want, a))
                .map(|(b, i, _)| (b, i))
        }
    }

    fn set_of(addrs: &[&str], loads: &mut BackendLoads) -> UsableSet {
        let backends = addrs
            .iter()
            .map(|a| {
                let b = Backend::new(a).unwrap();
                let name: std::sync::Arc<str> = b.addr.to_string().into();
                let load = loads.register(a, &name);
                (
                    b,
                    BackendInfo {
                        name,
                        tls: None,
                        load,
                        passive: Default::default(),
                    },
                )
            })
            .collect();
        UsableSet::new(0, backends)
    }

    /// A request whose prompt head hashes to `key`.
    fn want(key: u64) -> Want<'static> {
        Want {
            prefix: Some(key),
            ..Want::default()
        }
    }

    fn name(p: Option<(Backend, BackendInfo)>) -> String {
        p.unwrap().1.name.to_string()
    }

    #[test]
    fn round_robin_rotates_and_avoids_the_backend_that_failed() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], &mut loads);
        let pick = |exclude: &[Arc<str>]| {
            let want = Want {
                exclude,
                ..Want::default()
            };
            name(set.pick4(Selection::RoundRobin, 1.25, 0, want))
        };
        let mut round: Vec<String> = (0..3).map(|_| pick(&[])).collect();
        round.sort();
        assert_eq!(round, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]);
        let two: [Arc<str>; 1] = ["127.0.0.1:2".into()];
        let avoiding: Vec<String> = (0..6).map(|_| pick(&two)).collect();
        assert!(avoiding.iter().all(|n| n != "127.0.0.1:2"), "{avoiding:?}");
        let both: [Arc<str>; 2] = ["127.0.0.1:2".into(), "127.0.0.1:3".into()];
        let left: Vec<String> = (0..3).map(|_| pick(&both)).collect();
        assert_eq!(left, ["127.0.0.1:1"; 3], "every replica tried is avoided");
        let only = set_of(&["127.0.0.1:9"], &mut loads);
        let tried: [Arc<str>; 1] = ["127.0.0.1:9".into()];
        for selection in [
            Selection::RoundRobin,
            Selection::LeastLoad,
            Selection::PrefixAffinity,
        ] {
            let want = Want {
                exclude: &tried,
                prefix: Some(7),
                ..Want::default()
            };
            assert!(
                only.pick4(selection, 1.25, 0, want).is_none(),
                "a replica already tried is not tried again"
            );
        }
        let empty = UsableSet::new(0, Box::new([]));
        assert!(empty
            .pick4(Selection::LeastLoad, 1.25, 0, Want::default())
            .is_none());
    }

    #[test]
    fn least_load_goes_where_fewest_requests_are_in_flight() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2"], &mut loads);
        let busy = loads.get("127.0.0.1:1").unwrap();
        let _held: Vec<_> = (0..3).map(|_| busy.lease()).collect();
        for _ in 0..5 {
            let p = set.pick4(Selection::LeastLoad, 1.25, 1, Want::default());
            assert_eq!(name(p), "127.0.0.1:2");
        }
        // vLLM's own queue counts too.
        loads.record_scrape("127.0.0.1:2", Some(0.5), Some(10.0));
        let p = set.pick4(Selection::LeastLoad, 1.25, 1, Want::default());
        assert_eq!(name(p), "127.0.0.1:1");
    }

    #[test]
    fn least_load_prices_a_slow_replica_by_its_time_to_first_byte() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2"], &mut loads);
        let (slow, fast) = (
            loads.get("127.0.0.1:1").unwrap(),
            loads.get("127.0.0.1:2").unwrap(),
        );
        slow.observe_ttfb(Duration::from_millis(400));
        fast.observe_ttfb(Duration::from_millis(50));
        let pick = || name(set.pick4(Selection::LeastLoad, 1.25, 3, Want::default()));
        // Equal counts: the fast one; the slow one only once the fast one has 8 ahead.
        let mut held = Vec::new();
        for _ in 0..7 {
            assert_eq!(pick(), "127.0.0.1:2");
            held.push(fast.lease());
        }
        held.push(fast.lease());
        assert_eq!(pick(), "127.0.0.1:1");
        // A faster answer blends in by the time since the last (here none: no weight) rather
        // than replacing the estimate; a slower one is taken at once (peak).
        let before = slow.ttfb_ms().unwrap();
        slow.observe_ttfb(Duration::from_millis(10));
        let after = slow.ttfb_ms().unwrap();
        // `before` may be read a millisecond into its decay and `after` at none: a hair above.
        assert!(
            after <= before * 1.001 && after > 350.0,
            "{before} -> {after}"
        );
        slow.observe_ttfb(Duration::from_millis(900));
        assert!(slow.ttfb_ms().unwrap() > 850.0);
    }

    #[test]
    fn a_prompt_head_keeps_its_replica_until_the_load_bound() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], &mut loads);
        for key in [7u64, 99, 12345] {
            let first = name(set.pick4(Selection::PrefixAffinity, 1.25, 2, want(key)));
            for _ in 0..5 {
                let again = name(set.pick4(Selection::PrefixAffinity, 1.25, 2, want(key)));
                assert_eq!(again, first, "same head, same replica while unloaded");
            }
        }
        // Holding requests on the key's replica pushes it past the bound: the next one goes on.
        let home = name(set.pick4(Selection::PrefixAffinity, 1.25, 2, want(7)));
        let mut held = Vec::new();
        let mut moved_at = None;
        for i in 0..10 {
            let p = set
                .pick4(Selection::PrefixAffinity, 1.25, 2, want(7))
                .unwrap();
            if *p.1.name != *home {
                moved_at = Some((i, p.1.name.to_string()));
                held.push(p.1.load.lease());
                break;
            }
            held.push(p.1.load.lease());
        }
        // Unmeasured replicas cost their work ahead plus one each: with i held at home the
        // mean is (i + 3) / 3 and the home (i + 1) may exceed it by three, so it sheds the
        // sixth.
        let (at, spill) = moved_at.expect("the home sheds past its bound");
        assert_eq!(at, 5, "home {home}");
        // The burst's next request that the home cannot take follows the first to the same
        // spill replica.
        let home_load = loads.get(&home).unwrap();
        held.push(home_load.lease());
        let next = name(set.pick4(Selection::PrefixAffinity, 1.25, 2, want(7)));
        assert_eq!(next, spill);
        drop(held);
        // The spill was that burst's alone: the head still lives where it did.
        let back = name(set.pick4(Selection::PrefixAffinity, 1.25, 2, want(7)));
        assert_eq!(back, home);
        let mut spread: std::collections::HashMap<String, usize> = Default::default();
        for k in 0..300u64 {
            let key = k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            *spread
                .entry(name(set.pick4(
                    Selection::PrefixAffinity,
                    1.25,
                    2,
                    want(key),
                )))
                .or_default() += 1;
        }
        assert_eq!(
            spread.len(),
            3,
            "different heads spread over the ring: {spread:?}"
        );
    }

    /// A head seen for the first time goes where least load would send it, not to a ring node
    /// as busy as the mean: with prompts that share nothing every head is new, and affinity
    /// must then balance as least load does.
    #[test]
    fn a_new_head_goes_where_least_load_would() {
        let mut loads = BackendLoads::default();
        let addrs = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"];
        let set = set_of(&addrs, &mut loads);
        // Two requests on the first replica, one on the second, none on the third: the second
        // is as busy as the mean, a whole request above the idle one.
        let _held: Vec<_> = [addrs[0], addrs[0], addrs[1]]
            .iter()
            .map(|a| loads.get(a).unwrap().lease())
            .collect();
        for k in 0..50u64 {
            let key = k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            let p = set.pick4(Selection::PrefixAffinity, 1.25, 3, want(key));
            assert_eq!(name(p), "127.0.0.1:3", "head {key}");
        }
    }

    #[test]
    fn a_home_that_answers_slowly_keeps_fewer_requests_of_its_head() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], &mut loads);
        let pick = |key| {
            set.pick4(Selection::PrefixAffinity, 1.25, 4, want(key))
                .unwrap()
        };
        for b in ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"] {
            loads
                .get(b)
                .unwrap()
                .observe_ttfb(Duration::from_millis(50));
        }
        // Requests of one head held at its home until it spills. At equal speeds a home may
        // exceed the mean by three requests: with j held the home costs 50(j + 1) ms against a
        // mean of 50(j + 3) / 3, so it takes five.
        let held_until_spill = |key| {
            let home = pick(key).1.name.clone();
            let mut held = Vec::new();
            loop {
                let p = pick(key);
                if p.1.name != home {
                    return (home, held.len());
                }
                held.push(p.1.load.lease());
            }
        };
        let (home, at_equal_speed) = held_until_spill(11);
        assert_eq!(at_equal_speed, 5);
        // The home now answers twice as slowly: a request there is worth two elsewhere, so
        // the head moves on after fewer.
        loads
            .get(&home)
            .unwrap()
            .observe_ttfb(Duration::from_millis(100));
        let (still_home, when_slow) = held_until_spill(11);
        assert_eq!(
            still_home, home,
            "a slow home keeps its head while unloaded"
        );
        assert_eq!(when_slow, 2);
    }

    #[test]
    fn homes_that_do_not_keep_their_heads_give_way_to_least_load() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], &mut loads);
        let affinity: Arc<Affinity> = Arc::default();
        let pick = |key| {
            set.pick(Selection::PrefixAffinity, 1.25, 5, want(key), &affinity)
                .map(|(_, i, t)| (i, t.is_some()))
                .unwrap()
        };
        // Placed: not sent home yet, so its answer says nothing of the home.
        let (home, ticket) = pick(7);
        assert!(!ticket);
        let mut held = vec![home.load.lease(), home.load.lease()];
        // Affinity: home within its bound, with a ticket for the answer.
        let (again, ticket) = pick(7);
        assert_eq!((&*again.name, ticket), (&*home.name, true));
        // The homes lose their heads: requests go where load is least.
        affinity.judge_with(|j| {
            for t in 0..60u64 {
                j.observe(t * 100, false);
            }
        });
        assert!(!affinity.status().paying);
        for _ in 0..4 {
            let (p, ticket) = pick(7);
            assert_ne!(&*p.name, &*home.name);
            assert!(!ticket);
            held.push(p.load.lease());
        }
        // Now the home is as loaded as the rest: it is as good a place, and may hold the head.
        let (p, ticket) = pick(7);
        assert_eq!((&*p.name, ticket), (&*home.name, true));
        drop(held);
        // A head first seen while spreading goes where load is least, and lives there.
        let (first, ticket) = pick(99);
        assert!(!ticket);
        let (second, ticket) = pick(99);
        assert_eq!((&*second.name, ticket), (&*first.name, true));
    }

    #[test]
    fn only_backends_serving_the_model_are_picked() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], &mut loads);
        let serves = |b: &str| b == "127.0.0.1:3";
        for selection in [
            Selection::RoundRobin,
            Selection::LeastLoad,
            Selection::PrefixAffinity,
        ] {
            for key in 0..20u64 {
                let want = Want {
                    serves: Some(&serves),
                    prefix: Some(key),
                    exclude: &[],
                };
                assert_eq!(name(set.pick4(selection, 1.25, 3, want)), "127.0.0.1:3");
            }
        }
        let none = |_: &str| false;
        let want = Want {
            serves: Some(&none),
            ..Want::default()
        };
        assert!(set.pick4(Selection::RoundRobin, 1.25, 3, want).is_none());
    }
}
