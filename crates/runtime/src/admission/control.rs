//! The admission interface every coordinator implements, and what it trades in.

use async_trait::async_trait;
use sluice_config::Config;
use sluice_policy::{Reason, Tier};
use std::time::Duration;

/// Queue bounds for one admission attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueParams {
    pub max_size: usize,
    pub max_wait: Duration,
    /// Re-check period for coordinators that cannot be woken directly.
    pub poll: Duration,
}

#[derive(Debug)]
pub enum Admission {
    Admitted {
        slot: Slot,
        /// Time spent in the queue, when the request waited.
        queued_for: Option<Duration>,
        /// The coordinator could not be reached and admitted without enforcing the bound.
        fail_open: bool,
    },
    /// `TierAtCapacity`, `QueueDropped`, `QueueTimedOut` or `Draining`.
    Refused {
        reason: Reason,
        queued_for: Option<Duration>,
    },
}

/// Who asks for a slot, for the fair share between tenants queued in one tier.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Claim<'a> {
    pub tenant: &'a str,
    pub weight: f64,
    /// Estimated prompt tokens plus the completion the request may produce.
    pub cost_tokens: u64,
}

impl Claim<'_> {
    /// A claim with no tenant to be fair to (tools and tests).
    pub const ANONYMOUS: Claim<'static> = Claim {
        tenant: sluice_config::tenancy::ANONYMOUS,
        weight: 1.0,
        cost_tokens: 1,
    };
}

/// `queue.fair_share*`: the same in the in-process and the Redis coordinator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FairShareSettings {
    pub enabled: bool,
    pub half_life_ms: u64,
}

impl Default for FairShareSettings {
    fn default() -> Self {
        Self {
            enabled: true,
            half_life_ms: 60_000,
        }
    }
}

impl FairShareSettings {
    pub fn from_config(cfg: &Config) -> Self {
        Self {
            enabled: cfg.queue.fair_share,
            half_life_ms: cfg.queue.fair_share_half_life_ms().max(1),
        }
    }
}

/// A tenant waiting in a tier, for `/status`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct TenantShare {
    pub tenant: String,
    pub queued: u64,
    /// Its virtual token counter: weighted tokens served; the lowest is served next.
    pub service: f64,
}

/// Per-tier counters for `/status` and `/metrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct TierAdmission {
    /// Requests holding a slot.
    pub inflight: u64,
    /// Slots leased as capacity credits that no request uses yet (Redis coordinator): they
    /// count against the capacity but are not requests.
    pub idle_credits: u64,
    pub queued: u64,
    pub capacity: u32,
}

#[async_trait]
pub trait AdmissionControl: Send + Sync {
    /// Takes a slot for `tier` if fewer than `capacity` are in flight (0 = unlimited) and
    /// nobody waits; otherwise waits in the tier's queue when `queue` is given, or refuses.
    /// Waiters are served by fair share between tenants, FIFO within a tenant.
    async fn admit_as(
        &self,
        tier: Tier,
        capacity: u32,
        queue: Option<QueueParams>,
        claim: &Claim<'_>,
    ) -> Admission;

    /// [`admit_as`](Self::admit_as) for a request without a tenant.
    async fn admit(&self, tier: Tier, capacity: u32, queue: Option<QueueParams>) -> Admission {
        self.admit_as(tier, capacity, queue, &Claim::ANONYMOUS)
            .await
    }

    fn status(&self, tier: Tier) -> TierAdmission;
    /// The tenants waiting in `tier`, least served first (at most `limit`).
    fn waiting_tenants(&self, _tier: Tier, _limit: usize) -> Vec<TenantShare> {
        Vec::new()
    }
    /// Which coordinator this is (`local`, `redis`), for `/status`.
    fn kind(&self) -> &'static str;
    /// Coordinator health for `/status` (reachability, fail-open count …).
    fn health(&self) -> CoordinatorHealth {
        CoordinatorHealth::in_process(self.kind())
    }
}

/// A coordinator's health, for `/status`, `/readyz`'s dependencies and the coordinator event
/// counters. The shared-store fields are absent for the in-process coordinator.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct CoordinatorHealth {
    pub coordinator: &'static str,
    pub healthy: bool,
    #[serde(flatten, skip_serializing_if = "Option::is_none")]
    pub shared: Option<SharedStoreHealth>,
}

impl CoordinatorHealth {
    pub fn in_process(kind: &'static str) -> Self {
        CoordinatorHealth {
            coordinator: kind,
            healthy: true,
            shared: None,
        }
    }

    /// Totals the coordinator owns (zero without a shared store).
    pub fn fail_open_total(&self) -> u64 {
        self.shared.as_ref().map_or(0, |s| s.fail_open_total)
    }
    pub fn reclaimed_leases_total(&self) -> u64 {
        self.shared.as_ref().map_or(0, |s| s.reclaimed_leases_total)
    }
    pub fn lost_leases_total(&self) -> u64 {
        self.shared.as_ref().map_or(0, |s| s.lost_leases_total)
    }
}

/// What a coordinator backed by a shared store (Redis) adds to its health.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct SharedStoreHealth {
    pub reachable: bool,
    pub last_error: Option<String>,
    pub fail_open_total: u64,
    pub fail_open_inflight: u64,
    pub reclaimed_leases_total: u64,
    pub lost_leases_total: u64,
    pub held_slots: usize,
    pub idle_credits: usize,
    pub credit_admissions_total: u64,
    pub lease_ms: u64,
    pub status_age_ms: Option<u64>,
    pub replica: String,
}

type Release = Box<dyn FnOnce() + Send + Sync>;

/// A held unit of a tier's capacity. Released exactly once, on drop.
pub struct Slot {
    release: Option<Release>,
}

impl Slot {
    pub fn new(release: impl FnOnce() + Send + Sync + 'static) -> Self {
        Self {
            release: Some(Box::new(release)),
        }
    }

    /// Forgets the slot without releasing it (its capacity was handed to someone else).
    pub(super) fn disarm(mut self) {
        self.release = None;
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

impl std::fmt::Debug for Slot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.release.is_some() {
            "Slot(held)"
        } else {
            "Slot(released)"
        })
    }
}
