//! Choosing the replica inside a pool, among its usable backends that serve the request's
//! model: round robin, least load, or prefix affinity with bounded loads (consistent hashing
//! on Pingora's Ketama ring: a prompt head keeps its replica, whose prefix cache holds it,
//! until that replica carries more than `load_bound` times the pool's mean; then the next
//! replica on the ring, as in Mirrokni, Thorup and Zadimoghaddam, 2018).

use super::BackendInfo;
use pingora::lb::Backend;
use pingora_ketama::{Bucket, Continuum};
use sluice_config::Selection;
use std::cell::RefCell;

/// What a pick needs to know of the request.
#[derive(Clone, Copy, Default)]
pub struct Want<'a> {
    /// Backends allowed (the model's, by name); `None`: all.
    pub serves: Option<&'a dyn Fn(&str) -> bool>,
    /// The hash of the prompt's head, for prefix affinity.
    pub prefix: Option<u64>,
    /// The backend that just failed to connect: avoided while another is usable.
    pub exclude: Option<&'a str>,
}

/// A pool's usable backends, in the balancer's order, each with its [`BackendInfo`], and the
/// ring over them (built with the set, which changes only when health does).
pub(super) struct UsableSet {
    pub(super) generation: u64,
    pub(super) backends: Box<[(Backend, BackendInfo)]>,
    ring: Option<Continuum>,
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
        }
    }

    /// The backend for a request, by the pool's `selection`; `ordinal` keys this thread's
    /// round-robin counter for the pool.
    pub(super) fn pick(
        &self,
        selection: Selection,
        load_bound: f64,
        ordinal: usize,
        want: Want<'_>,
    ) -> Option<(Backend, BackendInfo)> {
        let ok = |info: &BackendInfo| want.serves.is_none_or(|serves| serves(&info.name));
        let avoid = |info: &BackendInfo| want.exclude.is_some_and(|x| *info.name == *x);
        let start = next(ordinal);
        let n = self.backends.len();
        let at = |i: usize| &self.backends[(start + i) % n.max(1)];
        let candidates = || (0..n).map(at).filter(|(_, info)| ok(info));
        let chosen = match selection {
            Selection::RoundRobin => candidates().find(|(_, info)| !avoid(info)),
            Selection::LeastLoad => least_loaded(candidates().filter(|(_, i)| !avoid(i))),
            Selection::PrefixAffinity => match (want.prefix, &self.ring) {
                (Some(key), Some(ring)) => self
                    .bounded(ring, key, load_bound, &|info| ok(info) && !avoid(info))
                    .or_else(|| least_loaded(candidates().filter(|(_, i)| !avoid(i)))),
                _ => least_loaded(candidates().filter(|(_, i)| !avoid(i))),
            },
        };
        // The backend that failed is still better than none.
        chosen.or_else(|| candidates().next()).cloned()
    }

    /// The first backend on the ring from `key` that may take the request and whose requests
    /// in flight stay within `load_bound` of the mean over the allowed backends (counting this
    /// one).
    fn bounded(
        &self,
        ring: &Continuum,
        key: u64,
        load_bound: f64,
        allowed: &dyn Fn(&BackendInfo) -> bool,
    ) -> Option<&(Backend, BackendInfo)> {
        let allowed_set: Vec<&(Backend, BackendInfo)> =
            self.backends.iter().filter(|(_, i)| allowed(i)).collect();
        if allowed_set.is_empty() {
            return None;
        }
        let total: u64 = allowed_set
            .iter()
            .map(|(_, i)| u64::from(i.load.inflight()))
            .sum();
        let bound = (load_bound * (total + 1) as f64 / allowed_set.len() as f64).ceil();
        let mut seen = 0usize;
        let mut tried: Vec<std::net::SocketAddr> = Vec::with_capacity(allowed_set.len());
        for addr in ring.node_iter(&key.to_le_bytes()) {
            if tried.contains(addr) {
                continue;
            }
            tried.push(*addr);
            let Some(entry) = self
                .backends
                .iter()
                .find(|(b, _)| b.addr.as_inet() == Some(addr))
            else {
                continue;
            };
            if allowed(&entry.1) {
                seen += 1;
                if f64::from(entry.1.load.inflight()) + 1.0 <= bound {
                    return Some(entry);
                }
            }
            if seen == allowed_set.len() || tried.len() == self.backends.len() {
                break;
            }
        }
        None
    }
}

/// The backend where one more request would wait least: peak-EWMA cost (work ahead times time
/// to first byte), so a replica that answers slowly gets less even at equal counts. One not
/// measured yet is priced at the mean of those that are.
fn least_loaded<'a>(
    it: impl Iterator<Item = &'a (Backend, BackendInfo)> + Clone,
) -> Option<&'a (Backend, BackendInfo)> {
    let (sum, n) = it
        .clone()
        .filter_map(|(_, i)| i.load.ttfb_ms())
        .fold((0.0, 0u32), |(s, n), t| (s + t, n + 1));
    let default = if n == 0 { 1.0 } else { sum / f64::from(n) };
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
                    },
                )
            })
            .collect();
        UsableSet::new(0, backends)
    }

    fn name(p: Option<(Backend, BackendInfo)>) -> String {
        p.unwrap().1.name.to_string()
    }

    #[test]
    fn round_robin_rotates_and_avoids_the_backend_that_failed() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], &mut loads);
        let pick = |exclude: Option<&str>| {
            let want = Want {
                exclude,
                ..Want::default()
            };
            name(set.pick(Selection::RoundRobin, 1.25, 0, want))
        };
        let mut round: Vec<String> = (0..3).map(|_| pick(None)).collect();
        round.sort();
        assert_eq!(round, ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]);
        let avoiding: Vec<String> = (0..6).map(|_| pick(Some("127.0.0.1:2"))).collect();
        assert!(avoiding.iter().all(|n| n != "127.0.0.1:2"), "{avoiding:?}");
        let only = set_of(&["127.0.0.1:9"], &mut loads);
        let want = Want {
            exclude: Some("127.0.0.1:9"),
            ..Want::default()
        };
        assert_eq!(
            name(only.pick(Selection::RoundRobin, 1.25, 0, want)),
            "127.0.0.1:9",
            "the backend that failed is still better than none"
        );
        let empty = UsableSet::new(0, Box::new([]));
        assert!(empty
            .pick(Selection::LeastLoad, 1.25, 0, Want::default())
            .is_none());
    }

    #[test]
    fn least_load_goes_where_fewest_requests_are_in_flight() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2"], &mut loads);
        let busy = loads.get("127.0.0.1:1").unwrap();
        let _held: Vec<_> = (0..3).map(|_| busy.lease()).collect();
        for _ in 0..5 {
            let p = set.pick(Selection::LeastLoad, 1.25, 1, Want::default());
            assert_eq!(name(p), "127.0.0.1:2");
        }
        // vLLM's own queue counts too.
        loads.record_scrape("127.0.0.1:2", Some(0.5), Some(10.0));
        let p = set.pick(Selection::LeastLoad, 1.25, 1, Want::default());
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
        let pick = || name(set.pick(Selection::LeastLoad, 1.25, 3, Want::default()));
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
        assert!(after <= before && after > 350.0, "{before} -> {after}");
        slow.observe_ttfb(Duration::from_millis(900));
        assert!(slow.ttfb_ms().unwrap() > 850.0);
    }

    #[test]
    fn a_prompt_head_keeps_its_replica_until_the_load_bound() {
        let mut loads = BackendLoads::default();
        let set = set_of(&["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"], &mut loads);
        let want = |key| Want {
            prefix: Some(key),
            ..Want::default()
        };
        for key in [7u64, 99, 12345] {
            let first = name(set.pick(Selection::PrefixAffinity, 1.25, 2, want(key)));
            for _ in 0..5 {
                let again = name(set.pick(Selection::PrefixAffinity, 1.25, 2, want(key)));
                assert_eq!(again, first, "same head, same replica while unloaded");
            }
        }
        // Holding requests on the key's replica pushes it past the bound: the next one goes on.
        let home = name(set.pick(Selection::PrefixAffinity, 1.25, 2, want(7)));
        let mut held = Vec::new();
        let mut moved_at = None;
        for i in 0..10 {
            let p = set
                .pick(Selection::PrefixAffinity, 1.25, 2, want(7))
                .unwrap();
            if *p.1.name != *home {
                moved_at = Some(i);
                break;
            }
            held.push(p.1.load.lease());
        }
        // Mean with the request is (i + 1) / 3; a bound of 1.25 lets the home replica hold
        // ceil(1.25 (i + 1) / 3) requests, so it sheds the second one.
        assert_eq!(moved_at, Some(1), "home {home}");
        drop(held);
        let mut spread: std::collections::HashMap<String, usize> = Default::default();
        for k in 0..300u64 {
            let key = k.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            *spread
                .entry(name(set.pick(
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
                    exclude: None,
                };
                assert_eq!(name(set.pick(selection, 1.25, 3, want)), "127.0.0.1:3");
            }
        }
        let none = |_: &str| false;
        let want = Want {
            serves: Some(&none),
            ..Want::default()
        };
        assert!(set.pick(Selection::RoundRobin, 1.25, 3, want).is_none());
    }
}
