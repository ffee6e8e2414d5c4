//! The Redis coordinator: one in-flight bound and one FIFO queue per tier, shared by every
//! replica that points at the same Redis and key prefix.
//!
//! All state lives in Redis and changes only inside Lua scripts (`lua/*.lua`), so each
//! check-then-act (capacity check and slot take, head check and claim) is atomic across
//! replicas. Per tier, under `<prefix>:<tier>:`:
//! - `slots`: a sorted set of held slots (`<replica>:s<n>`) scored by lease expiry;
//! - `queue`: waiters scored by arrival (a Redis counter, `seq`), `deadlines` beside it.
//!
//! **Queue.** A newcomer is admitted only when nobody is queued, and only the waiter served
//! next may claim: with `queue.fair_share`, the oldest waiter of the waiting tenant with the
//! least weighted token service (`backlog`, `vtc`, each tenant's own FIFO `tq:<tenant>`; the
//! rules of [`fair`](sluice_policy::fair)), otherwise the oldest waiter — the same order on every
//! replica, since it is decided inside the claim script. Waiters poll (`queue.poll_seconds`); one
//! that gives up or whose client leaves removes its entry, and the entry of a waiter whose
//! replica died drops out at its deadline (≤ `queue.max_wait_seconds`). With fair share, each
//! charged slot notes its charge (`lent`), given back when it is released, and a released slot
//! may stay in `slots` for a short grace, kept for its tenant's next request (`kept`; the hold
//! rule of [`fair`](sluice_policy::fair)): that request takes it in the admit script, and
//! unclaimed it lapses like a lease, without counting as one reclaimed.
//!
//! **Leases.** A slot is not a counter but a lease that its replica renews every
//! `lease / 3` while the request (a whole SSE stream included) runs. Every script that counts
//! slots first removes expired leases, so the slots of a replica that died (SIGKILL, OOM, lost
//! node) return to the pool **at most `coordination.lease_seconds` (default 5 s) after its
//! last renewal — hence within `lease_seconds` of its death** — and `/status` shows them freed
//! within one more status refresh (~250 ms). All times are Redis's clock (`TIME`), so replica
//! clock skew does not matter. A lease that lapsed while its replica still ran (renewal blocked
//! for longer than two thirds of the lease) is not re-created: its capacity may already be in use.
//!
//! **Redis down ⇒ fail open.** Every call is bounded by `coordination.op_timeout_ms`. When a
//! call fails, admission stops asking Redis and admits with `fail_open: true` (no bound, no
//! Redis release) until the status refresher reaches Redis again (~250 ms probes), and
//! `/status` says so. Deliberate: availability over strict distributed bounds, as in the seed.
//!
//! Works with a single Redis node (or a Sentinel-managed primary); the keys of one deployment
//! are not hash-tagged for Redis Cluster, and the per-tenant queue keys are derived inside the
//! scripts.

use super::credits::{self, Credits};
use super::{Admission, AdmissionControl, Claim, FairShareSettings, QueueParams, Slot};
use super::{CoordinatorHealth, SharedStoreHealth, TenantShare, TierAdmission};
use crate::redis_link::{Messages, RedisError, RedisLink, Retry};
use async_trait::async_trait;
use pingora::server::ShutdownWatch;
use pingora::services::background::{background_service, BackgroundService};
use pingora::services::ServiceWithDependents;
use redis::{FromRedisValue, Script, ScriptInvocation};
use sluice_config::Config;
use sluice_policy::fair;
use sluice_policy::{Reason, Tier};
use std::collections::HashSet;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};
use tokio::runtime::Handle;

/// How often the cached cluster-wide figures behind the sync `status()` are refreshed; also
/// how soon admission returns to Redis after an outage.
const STATUS_EVERY: Duration = Duration::from_millis(250);
/// Leases renewed per script call: keeps each call short enough for the op timeout.
const RENEW_BATCH: usize = 500;
/// Consecutive failed refreshes after which a fresh connection is tried, for the case of a
/// connection that hangs without ever erroring (a peer gone without a reset).
const RECONNECT_AFTER_FAILURES: u32 = 8;

macro_rules! lua {
    ($file:literal) => {
        concat!(
            include_str!("../redis_clock.lua"),
            "\n",
            include_str!("lua/prelude.lua"),
            "\n",
            include_str!(concat!("lua/", $file))
        )
    };
}

struct Scripts {
    admit: Script,
    enqueue: Script,
    claim: Script,
    release: Script,
    leave: Script,
    renew: Script,
    status: Script,
    grant: Script,
}

static SCRIPTS: LazyLock<Scripts> = LazyLock::new(|| Scripts {
    admit: Script::new(lua!("admit.lua")),
    enqueue: Script::new(lua!("enqueue.lua")),
    claim: Script::new(lua!("claim.lua")),
    release: Script::new(lua!("release.lua")),
    leave: Script::new(lua!("leave.lua")),
    renew: Script::new(lua!("renew.lua")),
    status: Script::new(lua!("status.lua")),
    grant: Script::new(lua!("grant.lua")),
});

impl Scripts {
    fn all(&self) -> [&Script; 8] {
        [
            &self.grant,
            &self.admit,
            &self.enqueue,
            &self.claim,
            &self.release,
            &self.leave,
            &self.renew,
            &self.status,
        ]
    }
}

/// What the Redis coordinator needs from the config.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    pub url: String,
    pub prefix: String,
    pub lease: Duration,
    pub op_timeout: Duration,
    /// Names this replica in slot ids; a random suffix is added per process so a restarted
    /// pod with the same name and pid never mistakes its predecessor's leases for its own.
    pub replica: String,
    /// Reported by `status()` until the first admission of a tier says otherwise.
    pub capacities: [u32; 3],
    pub fair_share: FairShareSettings,
    /// `coordination.capacity_credits` (see [`credits`]).
    pub credits: bool,
}

impl RedisSettings {
    pub fn from_config(cfg: &Config, url: &str, replica: &str) -> Self {
        let rules = cfg.policy_rules();
        Self {
            url: url.to_string(),
            prefix: cfg.coordination.redis_prefix.clone(),
            lease: Duration::from_millis(cfg.coordination.lease_ms()),
            op_timeout: Duration::from_millis(cfg.coordination.op_timeout_ms),
            replica: replica.to_string(),
            capacities: Tier::ALL.map(|t| rules.tier(t).inflight_capacity),
            fair_share: FairShareSettings::from_config(cfg),
            credits: cfg.coordination.capacity_credits,
        }
    }
}

/// Waiting tenants listed per tier in `/status`.
const LISTED_TENANTS: usize = 20;

struct TierKeys {
    /// `<prefix>:<tier>`, from which the scripts derive each tenant's own queue key.
    base: String,
    slots: String,
    queue: String,
    deadlines: String,
    seq: String,
    backlog: String,
    vtc: String,
    vtc_at: String,
    wt: String,
    wc: String,
    pushed: String,
    vtc_last: String,
    before: String,
    credits: String,
    vtc_ahead: String,
    lent: String,
    kept: String,
    vtc_keep: String,
    vtc_owed: String,
}

impl TierKeys {
    fn new(base: String) -> Self {
        let k = |name: &str| format!("{base}:{name}");
        Self {
            slots: k("slots"),
            queue: k("queue"),
            deadlines: k("deadlines"),
            seq: k("seq"),
            backlog: k("backlog"),
            vtc: k("vtc"),
            vtc_at: k("vtc_at"),
            wt: k("wt"),
            wc: k("wc"),
            pushed: k("pushed"),
            vtc_last: k("vtc_last"),
            before: k("before"),
            credits: k("credits"),
            vtc_ahead: k("vtc_ahead"),
            lent: k("lent"),
            kept: k("kept"),
            vtc_keep: k("vtc_keep"),
            vtc_owed: k("vtc_owed"),
            base,
        }
    }

    /// The keys in the order `tier_keys` (lua/prelude.lua) reads them.
    fn add_keys(&self, inv: &mut ScriptInvocation<'_>) {
        inv.key(&self.slots)
            .key(&self.queue)
            .key(&self.deadlines)
            .key(&self.seq)
            .key(&self.backlog)
            .key(&self.vtc)
            .key(&self.vtc_at)
            .key(&self.wt)
            .key(&self.wc)
            .key(&self.pushed)
            .key(&self.vtc_last)
            .key(&self.before)
            .key(&self.credits)
            .key(&self.vtc_ahead)
            .key(&self.lent)
            .key(&self.kept)
            .key(&self.vtc_keep)
            .key(&self.vtc_owed);
    }

    /// A per-tier script's keys and its first argument, the key base.
    fn invoke<'a>(&self, script: &'a Script) -> ScriptInvocation<'a> {
        let mut inv = script.prepare_invoke();
        self.add_keys(&mut inv);
        inv.arg(&self.base);
        inv
    }
}

struct Inner {
    /// Admission consults Redis only while it is reachable; any failed call clears that and
    /// any successful one sets it again (the status refresher probes every 250 ms), so during
    /// an outage requests pay nothing but the bound — not a timeout each.
    link: RedisLink,
    /// When the status refresher last succeeded.
    refreshed_at: Mutex<Option<Instant>>,
    keys: [TierKeys; 3],
    lease_ms: u64,
    replica: String,
    next_id: AtomicU64,
    /// This replica's live leases, renewed by the background task.
    held: [Mutex<HashSet<String>>; 3],
    capacity: [AtomicU32; 3],
    /// Cluster-wide, as of the last refresh: leases held (requests and idle credits), which is
    /// what counts against the bound; idle credits of every replica; waiters.
    slots: [AtomicU64; 3],
    idle_credits: [AtomicU64; 3],
    queued: [AtomicU64; 3],
    waiting: [Mutex<Vec<TenantShare>>; 3],
    fair: FairShareSettings,
    fail_open_total: AtomicU64,
    fail_open_inflight: AtomicU64,
    reclaimed_total: AtomicU64,
    lost_total: AtomicU64,
    credits: [Mutex<Credits>; 3],
    credits_enabled: bool,
    /// Set when the process drains: idle credits go back and no new block is asked for.
    credits_retired: AtomicBool,
    credit_admissions_total: AtomicU64,
    /// Wakes the credit keeper when a tier's idle credits run low.
    credit_wake: tokio::sync::Notify,
    /// Slots given back, on their way to the release batcher (started on first use).
    releases: std::sync::OnceLock<tokio::sync::mpsc::UnboundedSender<(Tier, String)>>,
}

/// The distributed coordinator. Cheap to clone; clones share state.
#[derive(Clone)]
pub struct RedisAdmission {
    inner: Arc<Inner>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // The guarded data stays consistent across a panic elsewhere (single inserts/removes).
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl RedisAdmission {
    /// Parses the URL; connecting happens in [`connect`](Self::connect) or the background task,
    /// so a Redis that is down at startup only means failing open until it is up.
    pub fn new(s: RedisSettings) -> Result<Self, String> {
        let link = RedisLink::open(
            &s.url,
            s.op_timeout,
            STATUS_EVERY,
            SCRIPTS.all().to_vec(),
            // Every script is idempotent per member id, so a retry never takes a second slot.
            Retry::RefusedOrIo,
            Messages {
                up: "redis admission coordinator reachable: enforcing shared bounds",
                down: "redis admission coordinator unreachable, admitting fail-open",
            },
        )?;
        let keys = Tier::ALL.map(|t| TierKeys::new(format!("{}:{}", s.prefix, t.as_str())));
        let nonce = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish() as u32;
        Ok(Self {
            inner: Arc::new(Inner {
                link,
                refreshed_at: Mutex::default(),
                keys,
                lease_ms: (s.lease.as_millis() as u64).max(1),
                replica: format!("{}-{nonce:08x}", s.replica),
                next_id: AtomicU64::new(0),
                held: Default::default(),
                capacity: s.capacities.map(AtomicU32::new),
                slots: Default::default(),
                idle_credits: Default::default(),
                queued: Default::default(),
                waiting: Default::default(),
                fair: s.fair_share,
                fail_open_total: AtomicU64::new(0),
                fail_open_inflight: AtomicU64::new(0),
                reclaimed_total: AtomicU64::new(0),
                lost_total: AtomicU64::new(0),
                credits: Default::default(),
                credits_enabled: s.credits,
                credits_retired: AtomicBool::new(false),
                credit_admissions_total: AtomicU64::new(0),
                credit_wake: tokio::sync::Notify::new(),
                releases: std::sync::OnceLock::new(),
            }),
        })
    }

    /// Connects (one attempt) and preloads the scripts. The background task calls this until
    /// it succeeds; afterwards the connection manager reconnects by itself.
    pub async fn connect(&self) -> Result<(), RedisError> {
        self.inner.connect().await
    }

    /// Lease renewal and the status refresher (which also connects and reconnects); runs until
    /// its runtime ends.
    pub async fn run_background(&self) {
        tokio::join!(
            self.inner.status_loop(),
            self.inner.renew_loop(),
            self.inner.credit_loop()
        );
    }

    /// [`run_background`](Self::run_background) on the current runtime, for embedding without
    /// Pingora (tests, tools).
    pub fn spawn_background(&self) -> tokio::task::JoinHandle<()> {
        let me = self.clone();
        tokio::spawn(async move { me.run_background().await })
    }

    /// The Pingora service that runs [`run_background`](Self::run_background).
    pub fn background_service(&self) -> Box<dyn ServiceWithDependents> {
        Box::new(background_service(
            "redis admission",
            Background(self.clone()),
        ))
    }

    /// Gives every idle credit back and stops asking for more (the process is draining).
    pub async fn retire_credits(&self) {
        self.inner.credits_retired.store(true, Ordering::Release);
        for tier in Tier::ALL {
            self.inner.tend_credits(tier).await;
        }
    }

    /// A slot from this replica's credits, when the tier uses them and is not contended.
    fn credit_slot(&self, tier: Tier, capacity: u32) -> Option<Slot> {
        let inner = &self.inner;
        if !inner.credits_enabled {
            return None;
        }
        let block = credits::block_for(capacity)?;
        let (member, wake) = lock(&inner.credits[tier.index()]).take(block);
        if wake {
            inner.credit_wake.notify_one();
        }
        let member = member?;
        inner
            .credit_admissions_total
            .fetch_add(1, Ordering::Relaxed);
        let inner = Arc::clone(inner);
        Some(Slot::new(move || inner.return_credit(tier, member)))
    }

    fn fail_open(&self, queued_for: Option<Duration>) -> Admission {
        let inner = Arc::clone(&self.inner);
        inner.fail_open_total.fetch_add(1, Ordering::Relaxed);
        inner.fail_open_inflight.fetch_add(1, Ordering::Relaxed);
        // Nothing was taken in Redis, so nothing is given back there.
        let slot = Slot::new(move || {
            inner.fail_open_inflight.fetch_sub(1, Ordering::Relaxed);
        });
        Admission::Admitted {
            slot,
            queued_for,
            fail_open: true,
        }
    }
}

struct Background(RedisAdmission);

#[async_trait]
impl BackgroundService for Background {
    async fn start(&self, mut shutdown: ShutdownWatch) {
        // Streams still draining during a graceful shutdown hold slots whose leases must stay
        // renewed, so this keeps running until the runtime itself is dropped; only the idle
        // credits go back at once, for the replicas that stay.
        let run = self.0.run_background();
        tokio::pin!(run);
        tokio::select! {
            _ = &mut run => return,
            _ = shutdown.changed() => {}
        }
        self.0.retire_credits().await;
        run.await
    }
}

impl Inner {
    fn held(&self, tier: Tier) -> MutexGuard<'_, HashSet<String>> {
        lock(&self.held[tier.index()])
    }

    fn new_id(&self, kind: char) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{}:{kind}{n}", self.replica)
    }

    fn count_reclaimed(&self, n: u64) {
        if n > 0 {
            self.reclaimed_total.fetch_add(n, Ordering::Relaxed);
            log::info!(
                "reclaimed {n} expired admission lease(s) of a replica that stopped renewing"
            );
        }
    }

    async fn call<T: FromRedisValue>(&self, inv: &ScriptInvocation<'_>) -> Result<T, RedisError> {
        self.link.call(inv).await
    }

    async fn connect(&self) -> Result<(), RedisError> {
        self.link.connect().await
    }

    async fn refresh(&self) -> Result<(), RedisError> {
        let mut inv = SCRIPTS.status.prepare_invoke();
        for k in &self.keys {
            k.add_keys(&mut inv);
        }
        for k in &self.keys {
            inv.arg(&k.base);
        }
        // This replica's idle credits, so every replica can tell requests in flight from slots
        // leased ahead of them; the report holds as long as the leases would.
        inv.arg(LISTED_TENANTS)
            .arg(&self.replica)
            .arg(self.lease_ms);
        for c in &self.credits {
            inv.arg(lock(c).idle.len());
        }
        let figures: Vec<TierFigures> = self.call(&inv).await?;
        for (i, (slots, queued, reclaimed, waiting, idle)) in
            figures.into_iter().take(3).enumerate()
        {
            self.slots[i].store(slots, Ordering::Relaxed);
            self.idle_credits[i].store(idle, Ordering::Relaxed);
            self.queued[i].store(queued, Ordering::Relaxed);
            self.count_reclaimed(reclaimed);
            *lock(&self.waiting[i]) = tenant_shares(&waiting);
        }
        *lock(&self.refreshed_at) = Some(Instant::now());
        Ok(())
    }

    async fn status_loop(&self) {
        let mut tick = tokio::time::interval(STATUS_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut failures = 0u32;
        loop {
            tick.tick().await;
            let connected = self.link.connected();
            if !connected || failures >= RECONNECT_AFTER_FAILURES {
                match self.connect().await {
                    Ok(()) => failures = 0,
                    Err(_) => {
                        if !connected {
                            continue;
                        }
                        failures = 0;
                    }
                }
            }
            match self.refresh().await {
                Ok(()) => failures = 0,
                Err(_) => failures += 1,
            }
        }
    }

    async fn renew_loop(&self) {
        let mut tick = tokio::time::interval(Duration::from_millis((self.lease_ms / 3).max(1)));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            for tier in Tier::ALL {
                self.renew(tier).await;
            }
        }
    }

    async fn renew(&self, tier: Tier) {
        let members: Vec<String> = self.held(tier).iter().cloned().collect();
        for batch in members.chunks(RENEW_BATCH) {
            let mut inv = SCRIPTS.renew.prepare_invoke();
            inv.key(&self.keys[tier.index()].slots).arg(self.lease_ms);
            for m in batch {
                inv.arg(m);
            }
            // A failed renewal is retried next period; the lease outlives two missed ones.
            let Ok(missing) = self.call::<Vec<String>>(&inv).await else {
                return;
            };
            // Missing and already released is the normal race with a finishing request;
            // missing but still held means the lease lapsed while the request ran.
            let mut held = self.held(tier);
            let lost = missing.iter().filter(|m| held.remove(*m)).count() as u64;
            drop(held);
            if !missing.is_empty() {
                lock(&self.credits[tier.index()])
                    .idle
                    .retain(|m| !missing.contains(m));
            }
            if lost > 0 {
                self.lost_total.fetch_add(lost, Ordering::Relaxed);
                log::warn!(
                    "{lost} {} admission lease(s) expired before renewal; their requests \
                     continue outside the shared bound",
                    tier.as_str()
                );
            }
        }
    }

    /// A finished request's credit: back to this replica's block, or to Redis when the tier is
    /// contended. A credit whose lease lapsed is gone already.
    fn return_credit(self: &Arc<Self>, tier: Tier, member: String) {
        if !self.held(tier).contains(&member) {
            return;
        }
        let kept = lock(&self.credits[tier.index()]).give_back(member.clone());
        if !kept {
            self.held(tier).remove(&member);
            self.queue_release(tier, member);
        }
    }

    /// Keeps each tier's credits: idle ones go back while the tier is contended, a new block is
    /// asked for when they run low.
    async fn credit_loop(&self) {
        if !self.credits_enabled {
            return;
        }
        loop {
            tokio::select! {
                _ = self.credit_wake.notified() => {}
                _ = tokio::time::sleep(STATUS_EVERY) => {}
            }
            if !self.link.reachable() {
                continue;
            }
            for tier in Tier::ALL {
                self.tend_credits(tier).await;
            }
        }
    }

    async fn tend_credits(&self, tier: Tier) {
        let i = tier.index();
        let capacity = self.capacity[i].load(Ordering::Relaxed);
        let block = credits::block_for(capacity);
        let contended = block.is_none()
            || self.credits_retired.load(Ordering::Acquire)
            || credits::contended(
                capacity,
                self.slots[i].load(Ordering::Relaxed),
                self.queued[i].load(Ordering::Relaxed),
            );
        let (idle, grant) = {
            let mut c = lock(&self.credits[i]);
            c.returning = contended;
            if contended {
                (std::mem::take(&mut c.idle), None)
            } else {
                (Vec::new(), block.filter(|_| c.start_grant()))
            }
        };
        if !idle.is_empty() {
            {
                let mut held = self.held(tier);
                for m in &idle {
                    held.remove(m);
                }
            }
            let batch: Vec<(Tier, String)> = idle.into_iter().map(|m| (tier, m)).collect();
            self.release_many(&batch).await;
        }
        let Some(block) = grant else {
            return;
        };
        let first = self.next_id.fetch_add(u64::from(block), Ordering::Relaxed);
        let mut inv = self.keys[i].invoke(&SCRIPTS.grant);
        inv.arg(capacity)
            .arg(block)
            .arg(self.lease_ms)
            .arg(format!("{}:c", self.replica))
            .arg(first);
        let granted: Vec<String> = self.call(&inv).await.unwrap_or_default();
        // Held (renewed) before anyone can take them.
        self.held(tier).extend(granted.iter().cloned());
        let mut c = lock(&self.credits[i]);
        c.granting = false;
        c.idle.extend(granted);
    }

    async fn release(&self, tier: Tier, member: &str) {
        self.release_many(&[(tier, member.to_string())]).await;
    }

    /// Gives a slot back through the release batcher: releases that come while one batch is on
    /// the wire leave together in the next (one round trip per tier for all of them, and no
    /// added wait when only one is pending). Giving back a lease that was already reclaimed is
    /// a no-op (`release.lua`).
    fn queue_release(self: &Arc<Self>, tier: Tier, member: String) {
        let tx = self.releases.get_or_init(|| {
            let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
            match Handle::try_current() {
                Ok(h) => {
                    h.spawn(release_batches(Arc::downgrade(self), rx));
                }
                Err(_) => log::debug!("no runtime for the release batcher; leases will expire"),
            }
            tx
        });
        // A closed batcher (its runtime ended) leaves the lease to expire.
        let _ = tx.send((tier, member));
    }

    /// One script call per tier: it gives the charges back and may keep a slot for its
    /// tenant's next request, which a plain `ZREM` could not.
    async fn release_many(&self, batch: &[(Tier, String)]) {
        let fair_flag = if self.fair.enabled { "1" } else { "0" };
        for tier in Tier::ALL {
            let members: Vec<&str> = batch
                .iter()
                .filter(|(t, _)| *t == tier)
                .map(|(_, m)| m.as_str())
                .collect();
            if members.is_empty() {
                continue;
            }
            let mut inv = self.keys[tier.index()].invoke(&SCRIPTS.release);
            inv.arg(fair_flag).arg(members);
            // On failure the leases, no longer renewed, expire by themselves.
            let _ = self.call::<i64>(&inv).await;
        }
    }

    async fn leave(&self, tier: Tier, waiter: &str) {
        let mut inv = self.keys[tier.index()].invoke(&SCRIPTS.leave);
        inv.arg(waiter);
        // On failure the entry drops out at its deadline.
        let _ = self.call::<i64>(&inv).await;
    }
}

/// One tier in the status script's answer: slots held, queued, leases reclaimed, the waiting
/// tenants as flat (tenant, counter, queued) triples, and every replica's idle credits.
type TierFigures = (u64, u64, u64, Vec<redis::Value>, u64);

fn tenant_shares(flat: &[redis::Value]) -> Vec<TenantShare> {
    flat.chunks(3)
        .filter_map(|c| {
            let [tenant, service, queued] = c else {
                return None;
            };
            let service: String = redis::from_redis_value(service).ok()?;
            Some(TenantShare {
                tenant: redis::from_redis_value(tenant).ok()?,
                service: service.parse().ok()?,
                queued: redis::from_redis_value(queued).ok()?,
            })
        })
        .collect()
}

/// Redis state an admission attempt may have created that no [`Slot`] owns yet: the slot id
/// it asked for and its queue entry. If the attempt ends without handing them to a `Slot` —
/// the client went away and the future was dropped mid-call, or a call timed out after Redis
/// had already acted — dropping this removes both (idempotently), so no path leaks.
struct Pending {
    inner: Arc<Inner>,
    tier: Tier,
    member: Option<String>,
    waiter: Option<String>,
}

impl Pending {
    /// The script answered that it added nothing.
    fn nothing_taken(&mut self) {
        self.member = None;
    }

    fn into_slot(mut self) -> Slot {
        self.waiter = None;
        let member = self.member.take().unwrap_or_default();
        let inner = Arc::clone(&self.inner);
        let tier = self.tier;
        inner.held(tier).insert(member.clone());
        Slot::new(move || {
            inner.held(tier).remove(&member);
            inner.queue_release(tier, member);
        })
    }
}

impl Drop for Pending {
    fn drop(&mut self) {
        let (member, waiter) = (self.member.take(), self.waiter.take());
        if member.is_none() && waiter.is_none() {
            return;
        }
        // Without a runtime the queue deadline and the unrenewed lease clean up instead.
        let Ok(handle) = Handle::try_current() else {
            return;
        };
        let inner = Arc::clone(&self.inner);
        let tier = self.tier;
        handle.spawn(async move {
            if let Some(w) = waiter {
                inner.leave(tier, &w).await;
            }
            if let Some(m) = member {
                inner.release(tier, &m).await;
            }
        });
    }
}

/// Most releases a batch carries, so one round trip stays short however many pile up.
const RELEASE_BATCH_MAX: usize = 512;

/// The release batcher: waits for one release, takes whatever else is already queued, sends
/// them in one pipeline, repeats. Ends when the coordinator is dropped.
async fn release_batches(
    inner: std::sync::Weak<Inner>,
    mut rx: tokio::sync::mpsc::UnboundedReceiver<(Tier, String)>,
) {
    let mut batch = Vec::new();
    while rx.recv_many(&mut batch, RELEASE_BATCH_MAX).await > 0 {
        let Some(inner) = inner.upgrade() else {
            return;
        };
        inner.release_many(&batch).await;
        batch.clear();
    }
}

#[async_trait]
impl AdmissionControl for RedisAdmission {
    async fn admit_as(
        &self,
        tier: Tier,
        capacity: u32,
        queue: Option<QueueParams>,
        claim: &Claim<'_>,
    ) -> Admission {
        let inner = &self.inner;
        inner.capacity[tier.index()].store(capacity, Ordering::Relaxed);
        if !inner.link.reachable() {
            return self.fail_open(None);
        }
        if let Some(slot) = self.credit_slot(tier, capacity) {
            return Admission::Admitted {
                slot,
                queued_for: None,
                fail_open: false,
            };
        }
        let started = Instant::now();
        let keys = &inner.keys[tier.index()];
        let mut pending = Pending {
            inner: Arc::clone(inner),
            tier,
            member: Some(inner.new_id('s')),
            waiter: None,
        };
        let member = pending.member.clone().unwrap_or_default();
        let charge = fair::charge_of(claim.cost_tokens, claim.weight);
        let fair_flag = if inner.fair.enabled { "1" } else { "0" };

        let mut inv = keys.invoke(&SCRIPTS.admit);
        inv.arg(capacity)
            .arg(&member)
            .arg(inner.lease_ms)
            .arg(claim.tenant)
            .arg(charge)
            .arg(fair_flag);
        match inner.call::<(i64, u64)>(&inv).await {
            Ok((admitted, reclaimed)) => {
                inner.count_reclaimed(reclaimed);
                if admitted == 1 {
                    return Admission::Admitted {
                        slot: pending.into_slot(),
                        queued_for: None,
                        fail_open: false,
                    };
                }
                pending.nothing_taken();
            }
            Err(_) => return self.fail_open(None),
        }
        let Some(q) = queue else {
            return Admission::Refused {
                reason: Reason::TierAtCapacity,
                queued_for: None,
            };
        };

        let waiter = inner.new_id('q');
        pending.waiter = Some(waiter.clone());
        let mut inv = keys.invoke(&SCRIPTS.enqueue);
        inv.arg(&waiter)
            .arg(q.max_size)
            .arg(q.max_wait.as_millis() as u64)
            .arg(claim.tenant)
            .arg(charge)
            .arg(inner.fair.half_life_ms)
            .arg(fair_flag);
        match inner.call::<(i64, u64)>(&inv).await {
            Ok((-1, _)) => {
                pending.waiter = None;
                return Admission::Refused {
                    reason: Reason::QueueDropped,
                    queued_for: None,
                };
            }
            Ok(_) => {}
            Err(_) => return self.fail_open(None),
        }

        // Nothing wakes a waiter across replicas, so it polls: each claim both checks for the
        // head position and, if there is room, takes the slot in the same script.
        let deadline = started + q.max_wait;
        pending.member = Some(member.clone());
        loop {
            let mut inv = keys.invoke(&SCRIPTS.claim);
            inv.arg(&waiter)
                .arg(capacity)
                .arg(&member)
                .arg(inner.lease_ms)
                .arg(fair_flag);
            match inner.call::<(i64, u64)>(&inv).await {
                Ok((claimed, reclaimed)) => {
                    inner.count_reclaimed(reclaimed);
                    match claimed {
                        1 => {
                            return Admission::Admitted {
                                slot: pending.into_slot(),
                                queued_for: Some(started.elapsed()),
                                fail_open: false,
                            }
                        }
                        // Pushed out of the full queue by a tenant with fewer waiters.
                        -2 => {
                            pending.waiter = None;
                            pending.nothing_taken();
                            return Admission::Refused {
                                reason: Reason::QueueDropped,
                                queued_for: Some(started.elapsed()),
                            };
                        }
                        // Redis dropped the entry: its deadline passed.
                        -1 => {
                            pending.waiter = None;
                            pending.nothing_taken();
                            return Admission::Refused {
                                reason: Reason::QueueTimedOut,
                                queued_for: Some(started.elapsed()),
                            };
                        }
                        _ => {}
                    }
                }
                // `pending` drops with the attempt and removes the entry when Redis returns.
                Err(_) => return self.fail_open(Some(started.elapsed())),
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            tokio::time::sleep((deadline - now).min(q.poll)).await;
        }
        // Awaited, not left to `pending`'s drop, so the entry is gone before the 429 is sent.
        if let Some(w) = pending.waiter.take() {
            inner.leave(tier, &w).await;
        }
        pending.nothing_taken();
        Admission::Refused {
            reason: Reason::QueueTimedOut,
            queued_for: Some(started.elapsed()),
        }
    }

    /// Cluster-wide figures as of the last refresh (at most ~250 ms old while Redis is
    /// reachable; the last known ones otherwise). `capacity` is this replica's configured one.
    fn status(&self, tier: Tier) -> TierAdmission {
        let i = tier.index();
        let slots = self.inner.slots[i].load(Ordering::Relaxed);
        let idle = self.inner.idle_credits[i].load(Ordering::Relaxed);
        TierAdmission {
            // A credit taken or given back since a replica's last report can make the two
            // figures disagree by a few for one refresh; never below zero.
            inflight: slots.saturating_sub(idle),
            idle_credits: idle.min(slots),
            queued: self.inner.queued[i].load(Ordering::Relaxed),
            capacity: self.inner.capacity[i].load(Ordering::Relaxed),
        }
    }

    fn waiting_tenants(&self, tier: Tier, limit: usize) -> Vec<TenantShare> {
        let mut w = lock(&self.inner.waiting[tier.index()]).clone();
        w.truncate(limit);
        w
    }

    fn kind(&self) -> &'static str {
        "redis"
    }

    fn health(&self) -> CoordinatorHealth {
        let inner = &self.inner;
        let reachable = inner.link.reachable();
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        CoordinatorHealth {
            coordinator: "redis",
            healthy: reachable,
            shared: Some(SharedStoreHealth {
                reachable,
                last_error: inner.link.last_error(),
                fail_open_total: load(&inner.fail_open_total),
                fail_open_inflight: load(&inner.fail_open_inflight),
                reclaimed_leases_total: load(&inner.reclaimed_total),
                lost_leases_total: load(&inner.lost_total),
                held_slots: Tier::ALL.iter().map(|&t| inner.held(t).len()).sum(),
                idle_credits: Tier::ALL
                    .iter()
                    .map(|&t| lock(&inner.credits[t.index()]).idle.len())
                    .sum(),
                credit_admissions_total: load(&inner.credit_admissions_total),
                lease_ms: inner.lease_ms,
                status_age_ms: lock(&inner.refreshed_at).map(|t| t.elapsed().as_millis() as u64),
                replica: inner.replica.clone(),
            }),
        }
    }
}

/// The scripts against a real Redis (`SLUICE_TEST_REDIS_URL`, default 127.0.0.1:6379), each
/// test in its own random key prefix, deleted on drop.
#[cfg(test)]
mod tests {
    use super::*;
    use redis::aio::MultiplexedConnection;

    fn test_url() -> String {
        std::env::var("SLUICE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
    }

    struct Ns {
        prefix: String,
        conn: MultiplexedConnection,
    }

    impl Ns {
        async fn new() -> Self {
            let nonce = std::collections::hash_map::RandomState::new()
                .build_hasher()
                .finish();
            let client = redis::Client::open(test_url()).unwrap();
            let conn = client
                .get_multiplexed_async_connection()
                .await
                .expect("these tests need a Redis at SLUICE_TEST_REDIS_URL or 127.0.0.1:6379");
            Ns {
                prefix: format!("sluice-test-{nonce:016x}"),
                conn,
            }
        }

        fn keys(&self, tier: Tier) -> TierKeys {
            TierKeys::new(format!("{}:{}", self.prefix, tier.as_str()))
        }

        async fn admit(&mut self, k: &TierKeys, cap: u32, member: &str, lease: u64) -> (i64, u64) {
            self.admit_for(k, cap, member, lease, "t", 1.0).await
        }

        async fn admit_for(
            &mut self,
            k: &TierKeys,
            cap: u32,
            member: &str,
            lease: u64,
            tenant: &str,
            charge: f64,
        ) -> (i64, u64) {
            let mut inv = k.invoke(&SCRIPTS.admit);
            inv.arg(cap)
                .arg(member)
                .arg(lease)
                .arg(tenant)
                .arg(charge)
                .arg("1");
            inv.invoke_async(&mut self.conn).await.unwrap()
        }

        async fn enqueue(&mut self, k: &TierKeys, waiter: &str, max: usize, wait: u64) -> i64 {
            self.enqueue_for(k, waiter, max, wait, "t", 1.0).await
        }

        async fn enqueue_for(
            &mut self,
            k: &TierKeys,
            waiter: &str,
            max: usize,
            wait: u64,
            tenant: &str,
            charge: f64,
        ) -> i64 {
            let mut inv = k.invoke(&SCRIPTS.enqueue);
            inv.arg(waiter)
                .arg(max)
                .arg(wait)
                .arg(tenant)
                .arg(charge)
                .arg(60_000)
                .arg("1");
            let (r, _len): (i64, u64) = inv.invoke_async(&mut self.conn).await.unwrap();
            r
        }

        /// Releases `member` as a replica does, fair share on: the lease was still held (1) or
        /// not (0).
        async fn release(&mut self, k: &TierKeys, member: &str) -> i64 {
            let mut inv = k.invoke(&SCRIPTS.release);
            inv.arg("1").arg(member);
            inv.invoke_async(&mut self.conn).await.unwrap()
        }

        async fn hget(&mut self, key: &str, field: &str) -> Option<String> {
            redis::cmd("HGET")
                .arg(key)
                .arg(field)
                .query_async(&mut self.conn)
                .await
                .unwrap()
        }

        async fn claim(&mut self, k: &TierKeys, waiter: &str, cap: u32, member: &str) -> i64 {
            let mut inv = k.invoke(&SCRIPTS.claim);
            inv.arg(waiter).arg(cap).arg(member).arg(5000).arg("1");
            let (r, _): (i64, u64) = inv.invoke_async(&mut self.conn).await.unwrap();
            r
        }

        /// The status script as `replica` runs it, reporting `idle` credits per tier for
        /// `holds_ms`.
        async fn status(
            &mut self,
            replica: &str,
            holds_ms: u64,
            idle: [u64; 3],
        ) -> Vec<TierFigures> {
            let mut inv = SCRIPTS.status.prepare_invoke();
            let keys = Tier::ALL.map(|t| self.keys(t));
            for k in &keys {
                k.add_keys(&mut inv);
            }
            for k in &keys {
                inv.arg(&k.base);
            }
            inv.arg(LISTED_TENANTS).arg(replica).arg(holds_ms);
            for n in idle {
                inv.arg(n);
            }
            inv.invoke_async(&mut self.conn).await.unwrap()
        }

        async fn zcard(&mut self, key: &str) -> u64 {
            redis::cmd("ZCARD")
                .arg(key)
                .query_async(&mut self.conn)
                .await
                .unwrap()
        }

        /// `member`'s score in the sorted set `key` (a tenant's counter in `backlog`, or its
        /// counter less what it is ahead by in `before`).
        async fn zscore(&mut self, key: &str, member: &str) -> f64 {
            let v: Option<f64> = redis::cmd("ZSCORE")
                .arg(key)
                .arg(member)
                .query_async(&mut self.conn)
                .await
                .unwrap();
            v.unwrap_or_else(|| panic!("{member} not in {key}"))
        }
    }

    impl Drop for Ns {
        fn drop(&mut self) {
            let Ok(client) = redis::Client::open(test_url()) else {
                return;
            };
            let Ok(mut c) = client.get_connection() else {
                return;
            };
            let keys: Vec<String> = redis::cmd("KEYS")
                .arg(format!("{}:*", self.prefix))
                .query(&mut c)
                .unwrap_or_default();
            if !keys.is_empty() {
                let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut c);
            }
        }
    }

    #[tokio::test]
    async fn admit_takes_a_slot_only_below_capacity_and_with_nobody_queued() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        assert_eq!(ns.admit(&k, 2, "r:1", 5000).await, (1, 0));
        assert_eq!(ns.admit(&k, 2, "r:2", 5000).await, (1, 0));
        assert_eq!(ns.admit(&k, 2, "r:3", 5000).await, (0, 0), "at capacity");
        assert_eq!(ns.zcard(&k.slots).await, 2);

        assert_eq!(ns.release(&k, "r:1").await, 1);
        assert_eq!(
            ns.release(&k, "r:1").await,
            0,
            "a second release frees nothing"
        );

        // Room again, but a waiter is ahead: a newcomer must not overtake it.
        assert_eq!(ns.enqueue(&k, "w:1", 10, 5000).await, 1);
        assert_eq!(ns.admit(&k, 2, "r:4", 5000).await, (0, 0));
        assert_eq!(ns.claim(&k, "w:1", 2, "r:5").await, 1);
        assert_eq!(ns.zcard(&k.slots).await, 2);

        // Unlimited still records the slot, so status counts it and release finds it.
        assert_eq!(ns.admit(&k, 0, "r:6", 5000).await, (1, 0));
        assert_eq!(ns.zcard(&k.slots).await, 3);
        let other = ns.keys(Tier::Guaranteed);
        assert_eq!(ns.zcard(&other.slots).await, 0, "tiers are independent");
    }

    #[tokio::test]
    async fn enqueue_refuses_duplicates_enforces_the_bound_and_drops_expired() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        assert_eq!(ns.enqueue(&k, "w:1", 2, 5000).await, 1);
        assert_eq!(ns.enqueue(&k, "w:1", 2, 5000).await, -2, "duplicate");
        assert_eq!(ns.enqueue(&k, "w:2", 2, 80).await, 1);
        assert_eq!(ns.enqueue(&k, "w:3", 2, 5000).await, -1, "full");
        assert_eq!(ns.zcard(&k.queue).await, 2);
        tokio::time::sleep(Duration::from_millis(150)).await;
        // w:2's deadline passed: its place is free again, and its deadline entry is gone too.
        assert_eq!(ns.enqueue(&k, "w:3", 2, 5000).await, 1);
        assert_eq!(ns.zcard(&k.queue).await, 2);
        assert_eq!(ns.zcard(&k.deadlines).await, 2);
    }

    #[tokio::test]
    async fn only_the_head_claims_and_claiming_takes_the_slot() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        assert_eq!(ns.admit(&k, 1, "r:held", 5000).await, (1, 0));
        for w in ["w:1", "w:2", "w:3"] {
            assert_eq!(ns.enqueue(&k, w, 10, 5000).await, 1);
        }
        assert_eq!(ns.claim(&k, "w:1", 1, "r:a").await, 0, "head, but no room");
        assert_eq!(ns.release(&k, "r:held").await, 1);
        assert_eq!(ns.claim(&k, "w:2", 1, "r:b").await, 0, "not the head");
        assert_eq!(ns.claim(&k, "w:1", 1, "r:a").await, 1);
        assert_eq!(ns.zcard(&k.queue).await, 2);
        assert_eq!(ns.zcard(&k.slots).await, 1);
        assert_eq!(ns.claim(&k, "w:2", 1, "r:b").await, 0, "head now, but full");
        assert_eq!(ns.claim(&k, "w:9", 1, "r:z").await, -1, "never queued");

        let mut inv = k.invoke(&SCRIPTS.leave);
        inv.arg("w:2");
        let left: i64 = inv.invoke_async(&mut ns.conn).await.unwrap();
        assert_eq!(left, 1);
        let left: i64 = inv.invoke_async(&mut ns.conn).await.unwrap();
        assert_eq!(left, 0);
        assert_eq!(ns.zcard(&k.queue).await, 1, "w:3 remains");
        assert_eq!(ns.zcard(&k.deadlines).await, 1);
    }

    #[tokio::test]
    async fn expired_leases_are_reclaimed_renewed_ones_kept_and_lapsed_ones_reported() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        assert_eq!(ns.admit(&k, 3, "dead:1", 100).await.0, 1);
        assert_eq!(ns.admit(&k, 3, "dead:2", 100).await.0, 1);
        assert_eq!(ns.admit(&k, 3, "live:1", 100).await.0, 1);
        assert_eq!(ns.admit(&k, 3, "x", 100).await.0, 0);
        for _ in 0..3 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            let mut inv = SCRIPTS.renew.prepare_invoke();
            inv.key(&k.slots).arg(100).arg("live:1");
            let missing: Vec<String> = inv.invoke_async(&mut ns.conn).await.unwrap();
            assert!(missing.is_empty());
        }
        // The dead replica's two leases expired; the renewed one did not.
        assert_eq!(ns.admit(&k, 3, "new:1", 5000).await, (1, 2));
        assert_eq!(ns.zcard(&k.slots).await, 2);

        let mut inv = SCRIPTS.renew.prepare_invoke();
        inv.key(&k.slots).arg(5000).arg("new:1").arg("dead:1");
        let missing: Vec<String> = inv.invoke_async(&mut ns.conn).await.unwrap();
        assert_eq!(missing, vec!["dead:1".to_string()]);
        assert_eq!(
            ns.zcard(&k.slots).await,
            2,
            "a lapsed lease is not re-created"
        );
    }

    #[tokio::test]
    async fn status_sweeps_and_counts_every_tier() {
        let mut ns = Ns::new().await;
        let g = ns.keys(Tier::Guaranteed);
        let s = ns.keys(Tier::Standard);
        ns.admit(&g, 5, "a", 5000).await;
        ns.admit(&g, 5, "b", 50).await;
        ns.admit(&s, 1, "c", 5000).await;
        ns.enqueue(&s, "w1", 5, 5000).await;
        ns.enqueue(&s, "w2", 5, 50).await;
        tokio::time::sleep(Duration::from_millis(100)).await;
        let out = ns.status("r1", 5000, [0, 0, 0]).await;
        let figures: Vec<(u64, u64, u64)> = out.iter().map(|f| (f.0, f.1, f.2)).collect();
        assert_eq!(figures, vec![(1, 0, 1), (1, 1, 0), (0, 0, 0)]);
        assert_eq!(ns.zcard(&s.deadlines).await, 1);
        let waiting = tenant_shares(&out[1].3);
        assert_eq!(waiting.len(), 1);
        assert_eq!((waiting[0].tenant.as_str(), waiting[0].queued), ("t", 1));
    }

    /// Each replica's reported idle credits add up per tier; a report lapses when its replica
    /// stops refreshing (as its leases do), and a replica with none left removes its own.
    #[tokio::test]
    async fn status_adds_up_every_replicas_idle_credits() {
        let mut ns = Ns::new().await;
        let idle = |out: &[TierFigures]| out.iter().map(|f| f.4).collect::<Vec<_>>();
        assert_eq!(idle(&ns.status("r1", 5000, [16, 2, 0]).await), [16, 2, 0]);
        assert_eq!(idle(&ns.status("r2", 80, [16, 0, 0]).await), [32, 2, 0]);
        assert_eq!(idle(&ns.status("r1", 5000, [16, 0, 0]).await), [32, 0, 0]);
        tokio::time::sleep(Duration::from_millis(150)).await;
        assert_eq!(
            idle(&ns.status("r1", 5000, [16, 0, 0]).await),
            [16, 0, 0],
            "r2 lapsed"
        );
        assert_eq!(idle(&ns.status("r1", 5000, [0, 0, 0]).await), [0, 0, 0]);
        let credits = ns.keys(Tier::Guaranteed).credits;
        let left: u64 = redis::cmd("HLEN")
            .arg(credits)
            .query_async(&mut ns.conn)
            .await
            .unwrap();
        assert_eq!(left, 0, "no report is kept once nothing is idle");
    }

    #[tokio::test]
    async fn a_full_queue_pushes_out_the_longest_queued_tenants_newest() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        for w in ["h1", "h2", "h3"] {
            assert_eq!(ns.enqueue_for(&k, w, 3, 5000, "heavy", 1.0).await, 1);
        }
        assert_eq!(ns.enqueue_for(&k, "l1", 3, 5000, "light", 1.0).await, 1);
        assert_eq!(ns.zcard(&k.queue).await, 3, "the bound holds");
        assert_eq!(ns.claim(&k, "h3", 1, "m").await, -2, "h3 was pushed out");
        assert_eq!(ns.claim(&k, "h3", 1, "m").await, -1, "and told once");
        assert_eq!(
            ns.enqueue_for(&k, "l2", 3, 5000, "light", 1.0).await,
            -1,
            "light waits once, heavy twice: no swap"
        );
        assert_eq!(ns.zcard(&format!("{}:tq:heavy", k.base)).await, 2);
    }

    /// A tenant that comes back with more service than the waiting floor keeps its (fading)
    /// excess; one with less is lifted to the floor.
    #[tokio::test]
    async fn joining_lifts_to_the_floor_or_keeps_a_fading_excess() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        assert_eq!(ns.admit_for(&k, 1, "r", 5000, "heavy", 1000.0).await.0, 1);
        assert_eq!(ns.enqueue_for(&k, "l1", 10, 5000, "light", 1.0).await, 1);
        assert_eq!(ns.enqueue_for(&k, "h1", 10, 5000, "heavy", 1.0).await, 1);
        assert_eq!(ns.enqueue_for(&k, "n1", 10, 5000, "newcomer", 1.0).await, 1);
        assert_eq!(
            ns.zscore(&k.backlog, "light").await,
            0.0,
            "nobody waited: nothing to lift to"
        );
        let heavy = ns.zscore(&k.backlog, "heavy").await;
        assert!(
            (999.0..=1000.0).contains(&heavy),
            "excess kept, barely faded: {heavy}"
        );
        assert_eq!(
            ns.zscore(&k.backlog, "newcomer").await,
            0.0,
            "lifted to the floor (light's 0)"
        );
    }

    /// The scripts' side of fair.rs's `a_tenant_back_from_a_momentary_empty_queue_keeps_its_turn`:
    /// a tenant whose queue emptied for a moment is not lifted level with a tenant charged in
    /// advance for a request that may still run, so it is served next, not after it.
    #[tokio::test]
    async fn a_tenant_back_from_a_momentary_empty_queue_keeps_its_turn() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        for (member, tenant, charge) in [
            ("g0", "gold", 800.0),
            ("h0", "heavy", 920.0),
            ("h1", "heavy", 920.0),
        ] {
            assert_eq!(ns.admit_for(&k, 4, member, 5000, tenant, charge).await.0, 1);
        }
        // Heavy's first request ended; its second still runs when gold's next comes.
        assert_eq!(ns.release(&k, "h0").await, 1);
        assert_eq!(ns.admit_for(&k, 4, "g1", 5000, "gold", 240.0).await.0, 1);
        assert_eq!(ns.enqueue_for(&k, "hw", 10, 5000, "heavy", 920.0).await, 1);
        assert_eq!(ns.enqueue_for(&k, "gw", 10, 5000, "gold", 240.0).await, 1);
        assert_eq!(ns.zscore(&k.backlog, "gold").await, 1040.0, "not lifted");
        assert_eq!(ns.zscore(&k.before, "heavy").await, 920.0);
        assert_eq!(ns.claim(&k, "hw", 4, "m1").await, 0, "gold's turn first");
        assert_eq!(ns.claim(&k, "gw", 4, "m1").await, 1);
        assert_eq!(ns.claim(&k, "hw", 5, "m2").await, 1);
        assert_eq!(ns.zcard(&k.backlog).await, 0);
        assert_eq!(ns.zcard(&k.before).await, 0, "nobody waits any more");
    }

    /// The scripts' side of fair.rs's
    /// `credit_earned_waiting_is_not_lifted_away_when_the_queue_empties_for_a_moment`: gold
    /// waited on one slot while heavy held three; back after its queue emptied, it keeps what
    /// it was under heavy's counter when its last waiter was admitted instead of being lifted
    /// to heavy's service.
    #[tokio::test]
    async fn credit_earned_waiting_is_not_lifted_away_when_the_queue_empties_for_a_moment() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        for (member, tenant, charge) in [
            ("h0", "heavy", 925.0),
            ("h1", "heavy", 925.0),
            ("h2", "heavy", 925.0),
            ("g0", "gold", 245.0),
        ] {
            assert_eq!(ns.admit_for(&k, 4, member, 5000, tenant, charge).await.0, 1);
        }
        assert_eq!(ns.enqueue_for(&k, "hw1", 10, 5000, "heavy", 925.0).await, 1);
        assert_eq!(ns.enqueue_for(&k, "hw2", 10, 5000, "heavy", 925.0).await, 1);
        assert_eq!(ns.enqueue_for(&k, "gw1", 10, 5000, "gold", 245.0).await, 1);
        assert_eq!(ns.enqueue_for(&k, "gw2", 10, 5000, "gold", 245.0).await, 1);
        // Gold's waiters take its one slot in turn while heavy's three run.
        assert_eq!(ns.release(&k, "g0").await, 1);
        assert_eq!(ns.claim(&k, "gw1", 4, "g1").await, 1);
        assert_eq!(ns.release(&k, "g1").await, 1);
        assert_eq!(ns.claim(&k, "gw2", 4, "g2").await, 1);
        assert_eq!(ns.release(&k, "g2").await, 1);
        // Heavy's three end and one of its waiters takes a slot; the other still waits.
        for h in ["h0", "h1", "h2"] {
            assert_eq!(ns.release(&k, h).await, 1);
        }
        assert_eq!(ns.claim(&k, "hw1", 4, "h3").await, 1);
        assert_eq!(ns.enqueue_for(&k, "gw3", 10, 5000, "gold", 245.0).await, 1);
        assert_eq!(ns.zscore(&k.before, "heavy").await, 2775.0);
        let gold = ns.zscore(&k.backlog, "gold").await;
        assert!(
            (735.0..736.0).contains(&gold),
            "owed the 2,040 it was under heavy, not lifted to 2,775: {gold}"
        );
    }

    /// The claim script serves the waiting tenant with the least service, FIFO within each:
    /// a light tenant that queues behind a heavy tenant's burst is not served last.
    #[tokio::test]
    async fn claims_follow_fair_share_between_tenants_and_fifo_within() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        assert_eq!(ns.admit_for(&k, 1, "held", 5000, "heavy", 100.0).await.0, 1);
        for i in 0..4 {
            let w = format!("h{i}");
            assert_eq!(ns.enqueue_for(&k, &w, 10, 5000, "heavy", 100.0).await, 1);
        }
        for i in 0..2 {
            let w = format!("l{i}");
            assert_eq!(ns.enqueue_for(&k, &w, 10, 5000, "light", 100.0).await, 1);
        }
        // Each round frees the one slot and lets whoever may claim take it (once the grace of
        // a slot kept for light, whose last waiter has gone, has ended).
        let mut order = Vec::new();
        let mut held = "held".to_string();
        for round in 0..6 {
            assert_eq!(ns.release(&k, &held).await, 1);
            let mut claimed = Vec::new();
            for _ in 0..50 {
                for w in ["h0", "h1", "h2", "h3", "l0", "l1"] {
                    if order.contains(&w) {
                        continue;
                    }
                    let member = format!("m{round}-{w}");
                    if ns.claim(&k, w, 1, &member).await == 1 {
                        claimed.push(w);
                        held = member;
                    }
                }
                if !claimed.is_empty() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            assert_eq!(claimed.len(), 1, "exactly one claim per freed slot");
            order.extend(claimed);
        }
        // heavy was charged in advance for the slot it held, light was lifted only to heavy's
        // counter before that charge: light first, then a tie that heavy's older head wins;
        // then they alternate until light runs out.
        assert_eq!(order, ["l0", "h0", "l1", "h1", "h2", "h3"]);
        assert_eq!(ns.zcard(&k.backlog).await, 0, "nobody waits any more");
    }

    /// The scripts' side of fair.rs's hold rule: the slot a tenant owed the next one releases
    /// with nobody of its own waiting is kept for its next request for a quarter of the time it
    /// was held; unclaimed, it goes to the queue when the grace ends (not counted as a lease
    /// reclaimed), and none is kept for that tenant until one of its requests comes in time.
    #[tokio::test]
    async fn a_released_slot_is_kept_for_the_tenant_owed_it() {
        let mut ns = Ns::new().await;
        let k = ns.keys(Tier::Standard);
        assert_eq!(ns.admit_for(&k, 1, "b0", 5000, "big", 1000.0).await.0, 1);
        assert_eq!(ns.release(&k, "b0").await, 1);
        assert_eq!(ns.admit_for(&k, 1, "s0", 5000, "small", 100.0).await.0, 1);
        assert_eq!(ns.enqueue_for(&k, "bw", 10, 5000, "big", 1000.0).await, 1);
        assert_eq!(ns.hget(&k.vtc_ahead, "small").await.as_deref(), Some("100"));
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(ns.release(&k, "s0").await, 1);
        assert_eq!(ns.hget(&k.kept, "s0").await.as_deref(), Some("small"));
        assert_eq!(ns.hget(&k.vtc_ahead, "small").await, None, "service had");
        assert_eq!(ns.claim(&k, "bw", 1, "b1").await, 0, "kept for small");
        // Small's next request takes it at once, ahead of big's waiter.
        assert_eq!(ns.admit_for(&k, 1, "s1", 5000, "small", 100.0).await.0, 1);
        assert_eq!(ns.zcard(&k.slots).await, 1);
        assert_eq!(ns.hget(&k.kept, "s0").await, None);
        // Kept again; this time nobody of small's comes: big's waiter has it after the grace.
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert_eq!(ns.release(&k, "s1").await, 1);
        assert_eq!(ns.claim(&k, "bw", 1, "b1").await, 0);
        tokio::time::sleep(Duration::from_millis(600)).await;
        let mut inv = k.invoke(&SCRIPTS.claim);
        inv.arg("bw").arg(1).arg("b1").arg(5000).arg("1");
        let claimed: (i64, u64) = inv.invoke_async(&mut ns.conn).await.unwrap();
        assert_eq!(claimed, (1, 0), "claimed, and no lease counted reclaimed");
        assert!(ns
            .hget(&k.vtc_keep, "small")
            .await
            .is_some_and(|s| s.ends_with(" 1")));
        // A tenant with a waiter of its own keeps nothing: the waiter has it.
        assert_eq!(ns.enqueue_for(&k, "bw2", 10, 5000, "big", 1000.0).await, 1);
        assert_eq!(ns.release(&k, "b1").await, 1);
        assert_eq!(ns.hget(&k.kept, "b1").await, None, "big still has a waiter");
        assert_eq!(ns.claim(&k, "bw2", 1, "b2").await, 1);
    }

    fn settings(prefix: &str, url: &str) -> RedisSettings {
        RedisSettings {
            url: url.into(),
            prefix: prefix.into(),
            lease: Duration::from_secs(5),
            op_timeout: Duration::from_millis(250),
            replica: "unit".into(),
            capacities: [0, 0, 0],
            fair_share: Default::default(),
            credits: false,
        }
    }

    fn q(max_size: usize, wait_ms: u64) -> Option<QueueParams> {
        Some(QueueParams {
            max_size,
            max_wait: Duration::from_millis(wait_ms),
            poll: Duration::from_millis(10),
        })
    }

    #[tokio::test]
    async fn a_waiter_dropped_mid_wait_removes_its_entry_and_slots_release_on_drop() {
        let mut ns = Ns::new().await;
        let a = RedisAdmission::new(settings(&ns.prefix, &test_url())).unwrap();
        a.connect().await.unwrap();
        let k = ns.keys(Tier::Standard);
        let Admission::Admitted { slot, .. } = a.admit(Tier::Standard, 1, None).await else {
            panic!("refused")
        };
        assert_eq!(ns.zcard(&k.slots).await, 1);
        let a2 = a.clone();
        let gone = tokio::spawn(async move { a2.admit(Tier::Standard, 1, q(5, 5000)).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(ns.zcard(&k.queue).await, 1);
        gone.abort();
        let _ = gone.await;
        for _ in 0..50 {
            if ns.zcard(&k.queue).await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ns.zcard(&k.queue).await, 0, "the dropped waiter left");
        assert_eq!(ns.zcard(&k.deadlines).await, 0);
        drop(slot);
        for _ in 0..50 {
            if ns.zcard(&k.slots).await == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert_eq!(ns.zcard(&k.slots).await, 0, "the slot was released");
        assert_eq!(a.health().shared.unwrap().held_slots, 0);
    }

    #[tokio::test]
    async fn unreachable_redis_fails_open_without_waiting_and_says_so() {
        // Nothing listens on port 1: connecting fails fast.
        let a = RedisAdmission::new(settings("unused", "redis://127.0.0.1:1")).unwrap();
        assert!(a.connect().await.is_err());
        let started = Instant::now();
        for _ in 0..3 {
            match a.admit(Tier::Standard, 1, q(1, 1000)).await {
                Admission::Admitted { fail_open, .. } => assert!(fail_open),
                Admission::Refused { reason, .. } => panic!("refused: {reason:?}"),
            }
        }
        assert!(started.elapsed() < Duration::from_millis(50));
        let h = a.health();
        assert_eq!(h.coordinator, "redis");
        let h = h.shared.unwrap();
        assert!(!h.reachable);
        assert_eq!(h.fail_open_total, 3);
        assert_eq!(h.fail_open_inflight, 0, "fail-open slots were dropped");
        assert!(h.last_error.unwrap().contains("connecting"));
        assert_eq!(a.kind(), "redis");
    }

    /// Added latency per admission against the local Redis:
    /// `cargo test --release --lib admission::redis::tests::admission_latency -- --ignored --nocapture`
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    #[ignore]
    async fn admission_latency() {
        let ns = Ns::new().await;
        let a = RedisAdmission::new(settings(&ns.prefix, &test_url())).unwrap();
        a.connect().await.unwrap();
        let inner = Arc::clone(&a.inner);
        let n = 5000;
        let (mut admit, mut cycle) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for i in 0..n + 200 {
            let t0 = Instant::now();
            let Admission::Admitted {
                slot, fail_open, ..
            } = a.admit(Tier::Standard, 64, None).await
            else {
                panic!("refused")
            };
            assert!(!fail_open);
            let t1 = Instant::now();
            // The release the slot's drop would spawn, awaited here to time it.
            let member = inner.held(Tier::Standard).iter().next().cloned().unwrap();
            std::mem::forget(slot);
            inner.held(Tier::Standard).remove(&member);
            inner.release(Tier::Standard, &member).await;
            if i >= 200 {
                admit.push(t1 - t0);
                cycle.push(t0.elapsed());
            }
        }
        let pct = |v: &mut Vec<Duration>, p: f64| {
            v.sort();
            v[((v.len() as f64 * p) as usize).min(v.len() - 1)]
        };
        println!(
            "admit: p50 {:?} p99 {:?}; admit+release: p50 {:?} p99 {:?} ({n} rounds)",
            pct(&mut admit, 0.50),
            pct(&mut admit, 0.99),
            pct(&mut cycle, 0.50),
            pct(&mut cycle, 0.99)
        );
    }
}
