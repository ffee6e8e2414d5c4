//! Where a request for a model goes: the pools serving it (its domain, as the policy judges
//! it), and inside a pool the backends that serve it. Rebuilt from the declared and discovered
//! models whenever they change, and published whole, so a request reads one consistent table.

use sluice_config::{Config, PoolClass};
use sluice_policy::fleet::{Domain, Layout, PoolLayout};
use sluice_policy::Pool;
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;

/// What one backend answered on `/v1/models`: its entries in OpenAI's shape, or nothing yet.
pub type Discovered = HashMap<String, Vec<serde_json::Value>>;

/// A pool as routing sees it, fixed for the process.
#[derive(Debug, Clone)]
pub struct PoolSpec {
    pub name: String,
    pub class: PoolClass,
    /// The models it is configured to serve; `None`: discovered per backend.
    pub declared: Option<Vec<String>>,
    /// Its backends by name (`ip:port`, as the balancer knows them).
    pub backends: Vec<String>,
}

/// The fleet's pools, in config order.
#[derive(Debug, Clone)]
pub struct Fleet {
    pub pools: Vec<PoolSpec>,
    /// `fallbacks[]`: (model, the models whose requests may move to it, or every other).
    pub fallbacks: Vec<(String, Option<Vec<String>>)>,
}

impl Fleet {
    /// The pools with the backends each one's balancer holds (`backends` by pool index).
    pub fn from_config(cfg: &Config, backends: Vec<Vec<String>>) -> Self {
        let pools = cfg
            .pools
            .iter()
            .zip(backends)
            .map(|(p, backends)| PoolSpec {
                name: p.name.clone(),
                class: p.class(),
                declared: p.config.models.clone(),
                backends,
            })
            .collect();
        let fallbacks = cfg
            .fallbacks
            .iter()
            .map(|f| (f.model.clone(), f.from.clone()))
            .collect();
        Fleet { pools, fallbacks }
    }

    pub fn names(&self) -> Vec<String> {
        self.pools.iter().map(|p| p.name.clone()).collect()
    }
}

/// Which models one pool serves, per backend.
#[derive(Debug, Clone, Default)]
pub struct PoolModels {
    /// By backend name: the models it serves, or `None` while unknown (not yet discovered).
    backends: HashMap<String, Option<Arc<HashSet<String>>>>,
    /// Every backend is known and serves the same models: no per-backend filtering needed.
    pub uniform: bool,
    /// At least one backend's models are known (or the pool declares them).
    pub known: bool,
}

impl PoolModels {
    /// The models `backend` serves, sorted, once known.
    pub fn models_of(&self, backend: &str) -> Option<Vec<String>> {
        let set = self.backends.get(backend)?.as_ref()?;
        let mut v: Vec<String> = set.iter().cloned().collect();
        v.sort();
        Some(v)
    }

    /// Whether a backend of the pool is known to serve `model`.
    pub fn serves_model(&self, model: &str) -> bool {
        self.backends
            .values()
            .any(|s| s.as_ref().is_some_and(|s| s.contains(model)))
    }

    /// Whether `backend` can take a request for `model` (`None`: the request names none).
    pub fn serves(&self, backend: &str, model: Option<&str>) -> bool {
        let Some(model) = model else { return true };
        match self.backends.get(backend) {
            Some(Some(models)) => models.contains(model),
            // Not yet known (or not a backend of this pool's list): the pool's route was chosen
            // for it, so do not second-guess the request.
            _ => true,
        }
    }
}

/// A model's pools.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Route {
    /// Index of the policy domain (in [`Routes::layout`]) the request is decided on.
    pub domain: usize,
    pub primary: usize,
    pub spot: Option<usize>,
}

#[derive(Debug, Default)]
pub struct Routes {
    /// Bumped on every rebuild: the policy follows the layout when it moves.
    pub generation: u64,
    pub layout: Layout,
    pub pools: Vec<PoolModels>,
    by_model: HashMap<String, Route>,
    /// For a model no known pool serves while some pool's models are still unknown: those
    /// pools, as before discovery.
    wildcard: Option<Route>,
    /// For a request that names no model.
    default: Option<Route>,
    /// The union of every backend's `/v1/models` entries and the declared models, by id.
    listing: BTreeMap<String, serde_json::Value>,
    /// By pool index: the fallback models served elsewhere (the pools moving traffic to them
    /// relieves).
    pub fallback_pools: Vec<(String, Vec<usize>)>,
}

impl Routes {
    /// The two-pool fleet (on-demand 0, spot 1) with nothing known of its models: every
    /// request goes to the pair, as before discovery.
    pub fn pair(spot_is_on_demand: bool) -> Self {
        let route = Route {
            domain: 0,
            primary: 0,
            spot: Some(1),
        };
        Routes {
            layout: Layout::pair(spot_is_on_demand),
            pools: vec![PoolModels::default(), PoolModels::default()],
            wildcard: Some(route),
            default: Some(route),
            ..Routes::default()
        }
    }

    /// Builds the table from the fleet and what each backend answered on `/v1/models`.
    pub fn build(fleet: &Fleet, discovered: &Discovered, generation: u64) -> Self {
        let mut pools = Vec::with_capacity(fleet.pools.len());
        // model → pools serving it, in config order.
        let mut serving: BTreeMap<String, BTreeSet<usize>> = BTreeMap::new();
        let mut listing: BTreeMap<String, serde_json::Value> = BTreeMap::new();
        let mut unknown_pools = Vec::new();
        for (i, p) in fleet.pools.iter().enumerate() {
            let mut models = PoolModels::default();
            match &p.declared {
                Some(declared) => {
                    let set: Arc<HashSet<String>> = Arc::new(declared.iter().cloned().collect());
                    for b in &p.backends {
                        models.backends.insert(b.clone(), Some(Arc::clone(&set)));
                    }
                    for m in declared {
                        serving.entry(m.clone()).or_default().insert(i);
                        listing.entry(m.clone()).or_insert_with(|| card(m));
                    }
                    models.known = true;
                    models.uniform = true;
                }
                None => {
                    let mut sets: Vec<Arc<HashSet<String>>> = Vec::new();
                    for b in &p.backends {
                        let Some(entries) = discovered.get(b) else {
                            models.backends.insert(b.clone(), None);
                            continue;
                        };
                        let mut set = HashSet::new();
                        for e in entries {
                            let Some(id) = e.get("id").and_then(|v| v.as_str()) else {
                                continue;
                            };
                            set.insert(id.to_string());
                            serving.entry(id.to_string()).or_default().insert(i);
                            listing.entry(id.to_string()).or_insert_with(|| e.clone());
                        }
                        let set = Arc::new(set);
                        sets.push(Arc::clone(&set));
                        models.backends.insert(b.clone(), Some(set));
                    }
                    models.known = !sets.is_empty();
                    models.uniform =
                        sets.len() == p.backends.len() && sets.windows(2).all(|w| w[0] == w[1]);
                    if !models.known && !p.backends.is_empty() {
                        unknown_pools.push(i);
                    }
                }
            }
            pools.push(models);
        }

        let class = |i: usize| fleet.pools[i].class;
        let mut domains: Vec<Domain> = Vec::new();
        let mut domain_of = |primary: usize, spot: Option<usize>| -> usize {
            let d = Domain { primary, spot };
            match domains.iter().position(|x| *x == d) {
                Some(i) => i,
                None => {
                    domains.push(d);
                    domains.len() - 1
                }
            }
        };
        let route_over = |set: &mut dyn Iterator<Item = usize>,
                          domain_of: &mut dyn FnMut(usize, Option<usize>) -> usize|
         -> Option<Route> {
            let set: Vec<usize> = set.collect();
            let primary = set
                .iter()
                .copied()
                .find(|&i| class(i) == PoolClass::OnDemand)
                .or_else(|| set.first().copied())?;
            let spot = set
                .iter()
                .copied()
                .find(|&i| class(i) == PoolClass::Spot && i != primary);
            Some(Route {
                domain: domain_of(primary, spot),
                primary,
                spot,
            })
        };
        // The first domain is the first on-demand and spot pools: a request that names no model
        // is judged where a two-pool fleet always judged it, and the policy's first domain is
        // that pair.
        let all: Vec<usize> = (0..fleet.pools.len())
            .filter(|&i| !fleet.pools[i].backends.is_empty() || i == 0)
            .collect();
        let default = route_over(&mut all.iter().copied(), &mut domain_of);
        let wildcard = (!unknown_pools.is_empty())
            .then(|| route_over(&mut unknown_pools.iter().copied(), &mut domain_of))
            .flatten();
        let by_model = serving
            .iter()
            .filter_map(|(m, set)| {
                let route = route_over(&mut set.iter().copied(), &mut domain_of)?;
                Some((m.clone(), route))
            })
            .collect();

        // Which pools each fallback model runs on, and so which pools it relieves.
        let fallback_pools: Vec<(String, Vec<usize>)> = fleet
            .fallbacks
            .iter()
            .map(|(m, _)| {
                let on: Vec<usize> = serving
                    .get(m)
                    .map(|s| s.iter().copied().collect())
                    .unwrap_or_default();
                (m.clone(), on)
            })
            .collect();
        let layout_pools = fleet
            .pools
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let shares_with = (0..i).find(|&j| {
                    let set = |x: &PoolSpec| x.backends.iter().cloned().collect::<BTreeSet<_>>();
                    !p.backends.is_empty() && set(&fleet.pools[j]) == set(p)
                });
                // Moving traffic relieves this pool only onto a backend it does not run on:
                // a fallback pool over the same servers (another name, the same GPUs) adds no
                // capacity.
                let mine: BTreeSet<&String> = p.backends.iter().collect();
                let relieves =
                    fallback_pools
                        .iter()
                        .find(|(_, on)| !on.is_empty())
                        .map(|(_, on)| {
                            on.iter()
                                .any(|&j| fleet.pools[j].backends.iter().any(|b| !mine.contains(b)))
                        });
                PoolLayout {
                    class: match p.class {
                        PoolClass::OnDemand => Pool::OnDemand,
                        PoolClass::Spot => Pool::Spot,
                    },
                    shares_with,
                    fallback_relieves: relieves,
                }
            })
            .collect();
        Routes {
            generation,
            layout: Layout {
                pools: layout_pools,
                domains,
            },
            pools,
            by_model,
            wildcard,
            default,
            listing,
            fallback_pools,
        }
    }

    /// The pools of a request for `model` (`None`: the request names no model). `None` back:
    /// no pool serves it and every pool's models are known.
    pub fn route(&self, model: Option<&str>) -> Option<Route> {
        match model {
            Some(m) => self.by_model.get(m).copied().or(self.wildcard),
            None => self.default,
        }
    }

    /// Whether every pool's models are known, so a model none serves gets a 404 here.
    pub fn complete(&self) -> bool {
        self.wildcard.is_none()
    }

    /// `GET /v1/models`: the union, sorted by id.
    pub fn listing(&self) -> impl Iterator<Item = &serde_json::Value> {
        self.listing.values()
    }

    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.listing.keys().map(String::as_str)
    }
}

/// A model card for a declared model (vLLM's `/v1/models` entry shape).
fn card(id: &str) -> serde_json::Value {
    serde_json::json!({"id": id, "object": "model", "owned_by": "sluice"})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(name: &str, class: PoolClass, models: &[&str], backends: &[&str]) -> PoolSpec {
        PoolSpec {
            name: name.into(),
            class,
            declared: Some(models.iter().map(|m| m.to_string()).collect()),
            backends: backends.iter().map(|b| b.to_string()).collect(),
        }
    }

    fn relieves(pools: Vec<PoolSpec>) -> Vec<Option<bool>> {
        let fleet = Fleet {
            pools,
            fallbacks: vec![("small".into(), None)],
        };
        Routes::build(&fleet, &Discovered::new(), 1)
            .layout
            .pools
            .iter()
            .map(|p| p.fallback_relieves)
            .collect()
    }

    #[test]
    fn a_fallback_on_the_same_servers_relieves_nothing_under_any_pool_name() {
        let one = "10.0.0.1:8000";
        let got = relieves(vec![
            pool("on-demand", PoolClass::OnDemand, &["big", "small"], &[one]),
            pool("spot", PoolClass::Spot, &["big", "small"], &[one]),
            pool("fallback", PoolClass::Spot, &["small"], &[one]),
        ]);
        assert_eq!(got, [Some(false); 3]);
    }

    #[test]
    fn a_fallback_on_other_servers_relieves_the_pools_it_does_not_run_on() {
        let got = relieves(vec![
            pool(
                "on-demand",
                PoolClass::OnDemand,
                &["big"],
                &["10.0.0.1:8000"],
            ),
            pool(
                "spot",
                PoolClass::Spot,
                &["big", "small"],
                &["10.0.0.2:8000"],
            ),
        ]);
        assert_eq!(got, [Some(true), Some(false)]);
    }
}
