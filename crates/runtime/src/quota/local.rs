//! In-process buckets: the whole store without Redis, and with Redis the fail-open store and
//! this replica's last known copy of the shared state (for `/status`, the headers of requests
//! that take nothing, and a fail-open that starts from where Redis left off).
//!
//! One map behind one lock, held for a hash lookup and a few float operations; only tenants
//! with a budget ever reach it.

use sluice_config::QuotaConfig;
use sluice_policy::bucket::{Bucket, Verdict};
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Instant;

pub struct LocalBuckets {
    started: Instant,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl Default for LocalBuckets {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            buckets: Mutex::default(),
        }
    }
}

impl LocalBuckets {
    pub fn now_ms(&self) -> u64 {
        self.started.elapsed().as_millis() as u64
    }

    fn map(&self) -> MutexGuard<'_, HashMap<String, Bucket>> {
        // A bucket is a few floats written together: a panic elsewhere cannot leave it torn.
        self.buckets.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn with<T>(&self, tenant: &str, q: &QuotaConfig, f: impl FnOnce(&mut Bucket, u64) -> T) -> T {
        let now = self.now_ms();
        let mut map = self.map();
        let bucket = match map.get_mut(tenant) {
            Some(b) => b,
            None => map
                .entry(tenant.to_string())
                .or_insert_with(|| Bucket::full(q, now)),
        };
        f(bucket, now)
    }

    pub fn take(&self, tenant: &str, q: &QuotaConfig, tokens: u64) -> Verdict {
        self.with(tenant, q, |b, now| b.check_and_take(q, now, tokens))
    }

    pub fn charge(&self, tenant: &str, q: &QuotaConfig, requests: f64, tokens: f64) {
        self.with(tenant, q, |b, now| b.charge(q, now, requests, tokens))
    }

    pub fn peek(&self, tenant: &str, q: &QuotaConfig) -> Verdict {
        self.with(tenant, q, |b, now| {
            b.refill(q, now);
            b.verdict(q)
        })
    }

    /// Takes over the shared store's levels (as of now).
    pub fn mirror(&self, tenant: &str, q: &QuotaConfig, v: &Verdict) {
        self.with(tenant, q, |b, now| b.set(v, now))
    }

    /// Forgets tenants that no longer have a budget (a reload removed it).
    pub fn retain(&self, keep: &HashSet<&str>) {
        self.map().retain(|t, _| keep.contains(t.as_str()));
    }
}
