//! What the pools section implies beyond itself: fallbacks with URLs of their own become
//! pools, the backends every pool reaches, and the shapes of the fleet the pair-era policy
//! rules still read (where the first fallback's model runs, whether spot is on-demand).

use crate::file::Config;
use crate::pools::{BackendTarget, NamedPool, PoolClass, PoolConfig};
use crate::url::backend_of_url;
use sluice_policy::tenant_policy::FallbackCapacity;
use sluice_policy::Pool;
use std::collections::BTreeSet;

impl Config {
    /// Every backend of the pools, in config order (an address may repeat); a fallback with a
    /// URL of its own is a pool by now, named by its own keys.
    pub fn backend_targets(&self) -> Vec<BackendTarget> {
        self.pools
            .iter()
            .flat_map(|p| {
                let (addr_key, tls_key) = p.keys();
                p.config
                    .backends
                    .iter()
                    .enumerate()
                    .map(move |(i, b)| BackendTarget {
                        addr: b.clone(),
                        addr_key: addr_key(i),
                        tls_key: tls_key.clone(),
                        tls: p.config.tls.clone(),
                    })
            })
            .collect()
    }
}

impl Config {
    /// A fallback with a URL outside every pool becomes a pool of its own serving its model;
    /// one whose URL is a backend of a pool that declares its models adds the model there.
    /// Runs once the URLs are known to parse.
    pub(crate) fn pools_from_fallbacks(&mut self) {
        for (i, f) in self.fallbacks.iter().enumerate() {
            let Some(Ok((addr, https))) = f.url.as_deref().map(backend_of_url) else {
                continue;
            };
            let owner = self
                .pools
                .0
                .iter_mut()
                .find(|p| p.config.backends.contains(&addr));
            match owner {
                Some(p) => {
                    if let Some(models) = p.config.models.as_mut() {
                        if !models.contains(&f.model) {
                            models.push(f.model.clone());
                        }
                    }
                }
                None => {
                    let mut tls = f.tls.clone();
                    tls.enabled |= https;
                    let health_check = self
                        .pools
                        .0
                        .first()
                        .map(|p| p.config.health_check.clone())
                        .unwrap_or_default();
                    self.pools.0.push(NamedPool {
                        name: format!("fallback:{}", f.name),
                        config: PoolConfig {
                            class: Some(PoolClass::OnDemand),
                            models: Some(vec![f.model.clone()]),
                            backends: vec![addr],
                            health_check,
                            tls,
                            ..PoolConfig::default()
                        },
                        from_fallback: Some(i),
                    });
                }
            }
        }
    }

    /// Where the first fallback's model runs, against the first on-demand and spot pools
    /// (what the adaptive ladders of a two-pool fleet assume).
    pub(crate) fn fallback_capacity(&self) -> FallbackCapacity {
        let Some(f) = self.fallbacks.first() else {
            return FallbackCapacity::None;
        };
        let serves = |class: PoolClass| {
            self.pools.first_of(class).is_some_and(|p| {
                p.from_fallback.is_none()
                    && (p
                        .config
                        .models
                        .as_ref()
                        .is_some_and(|m| m.contains(&f.model))
                        || f.url
                            .as_deref()
                            .and_then(|u| backend_of_url(u).ok())
                            .is_some_and(|(addr, _)| p.config.backends.contains(&addr)))
            })
        };
        if serves(PoolClass::OnDemand) {
            FallbackCapacity::On(Pool::OnDemand)
        } else if serves(PoolClass::Spot) {
            FallbackCapacity::On(Pool::Spot)
        } else {
            FallbackCapacity::Separate
        }
    }

    /// The first spot pool lists exactly the first on-demand pool's backends: one capacity.
    pub(crate) fn spot_is_on_demand(&self) -> bool {
        let set = |p: Option<&NamedPool>| {
            p.map(|p| p.config.backends.iter().cloned().collect::<BTreeSet<_>>())
                .unwrap_or_default()
        };
        let spot = set(self.pools.first_of(PoolClass::Spot));
        !spot.is_empty() && spot == set(self.pools.first_of(PoolClass::OnDemand))
    }
}
