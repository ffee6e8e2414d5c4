//! The KV-cache and scheduling model of one vLLM engine.
//!
//! vLLM's scheduler only starts a sequence when it can hold the whole KV footprint it may need,
//! caps the running batch at `max_num_seqs`, and serves the waiting queue strictly in order (of
//! arrival, or of priority then arrival under the priority policy), so a large request at the
//! head holds back smaller ones behind it. Latency grows with the share of KV in use because
//! bigger batches make every decode step slower. This module reproduces exactly that, and nothing
//! about HTTP.
//!
//! With prefix caching, a prompt's full blocks live in a shared cache ([`super::prefix`]): the
//! blocks a request finds cached cost it neither prefill nor new KV, and blocks of finished
//! requests stay cached in free KV until a new request needs the room.
//!
//! Two things are counted apart: the KV a sequence *reserves* (what admission and vLLM's
//! `kv_cache_usage_perc` see) and the KV it *writes* (prompt + the tokens its answer really has,
//! what decode has to read). They are equal unless the engine reserves for `max_tokens`, where a
//! reservation nobody writes into still blocks admission but costs no memory bandwidth. The
//! written share counts each answer whole from admission rather than token by token: that keeps
//! a running set exactly as fast under either reservation model, so switching models changes
//! admission alone, and keeps the default model's latency what it always was.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use super::prefix::{Lookup, PrefixCache};

/// How much KV a sequence holds from admission to its end.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum KvReserve {
    /// Prompt + the completion tokens the request will actually generate
    #[default]
    Output,
    /// Prompt + max_tokens, held until the request ends even when it stops early (vLLM without
    /// preemption)
    MaxTokens,
}

impl KvReserve {
    pub(crate) fn footprint(self, prompt: u64, output: u64, max_tokens: u64) -> Footprint {
        let written = prompt.saturating_add(output);
        let reserved = match self {
            KvReserve::Output => written,
            // An answer never outgrows its cap, but a caller passing one that does must not get
            // a reservation smaller than what it writes.
            KvReserve::MaxTokens => prompt.saturating_add(max_tokens.max(output)),
        };
        Footprint { reserved, written }
    }
}

/// One sequence's KV cost in tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Footprint {
    /// Held from admission to the end; decides admission and the reported usage.
    pub reserved: u64,
    /// Prompt + the answer's real length; decides how slow decode gets.
    pub written: u64,
}

impl From<u64> for Footprint {
    fn from(tokens: u64) -> Self {
        Self {
            reserved: tokens,
            written: tokens,
        }
    }
}

impl Footprint {
    /// At least one token (an empty request still occupies a slot), and never more written than
    /// reserved.
    fn normalized(self) -> Self {
        let reserved = self.reserved.max(1);
        Self {
            reserved,
            written: self.written.clamp(1, reserved),
        }
    }
}

/// A request as the scheduler sees it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Demand {
    pub need: Footprint,
    /// Chained hashes of the prompt's full blocks; empty without prefix caching.
    pub blocks: Vec<u64>,
    /// How many leading blocks the cache may serve.
    pub max_hit: usize,
    /// Lower is served first; always 0 under FCFS.
    pub priority: i64,
}

impl From<Footprint> for Demand {
    fn from(need: Footprint) -> Self {
        Self {
            need,
            ..Self::default()
        }
    }
}

impl From<u64> for Demand {
    fn from(tokens: u64) -> Self {
        Footprint::from(tokens).into()
    }
}

/// The numbers that shape admission and latency.
#[derive(Debug, Clone)]
pub(crate) struct EngineConfig {
    pub kv_tokens: u64,
    pub max_running: usize,
    pub ttft_ms: f64,
    pub prefill_us_per_token: f64,
    pub itl_ms: f64,
    pub load_slowdown: f64,
    pub kv_reserve: KvReserve,
    /// Tokens per KV block, the prefix cache's unit.
    pub block_tokens: u64,
    pub prefix_caching: bool,
    /// At most this many tokens of cached blocks nobody uses stay cached; `None`: as many as
    /// the free KV holds.
    pub prefix_cache_tokens: Option<u64>,
    /// Prefills take turns on the engine's compute, as on a GPU (vLLM fills each step's token
    /// budget with the waiting prefills in order): a prefill starts when the one before it is
    /// done, so every uncached prompt token delays the prompts behind it, and a prefix-cache
    /// hit frees compute for them. Off: each prefill takes its own time whatever runs beside it.
    pub serial_prefill: bool,
}

/// A request whose KV need exceeds the whole budget: vLLM rejects these instead of queueing them
/// forever.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct TooLarge {
    pub need: u64,
    pub budget: u64,
}

/// A point-in-time view of the scheduler, for metrics and stats.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub(crate) struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    /// Tokens in use by running requests (shared blocks once), the numerator of `kv_usage`.
    pub kv_used: u64,
    pub kv_written: u64,
    /// Tokens in cached blocks nobody uses: free, but a later prompt's head may hit them.
    pub kv_cached_free: u64,
    pub kv_usage: f64,
    pub peak_running: usize,
    pub peak_in_flight: usize,
}

#[derive(Clone)]
pub(crate) struct Engine {
    inner: Arc<Inner>,
}

struct Inner {
    cfg: EngineConfig,
    state: Mutex<State>,
    /// Mirrors of the used and written KV so per-token latency checks never contend on the lock.
    kv_used: AtomicU64,
    kv_written: AtomicU64,
    /// With `serial_prefill`: when the prefills already scheduled will be done.
    prefill_free: Mutex<Option<Instant>>,
}

#[derive(Default)]
struct State {
    running: usize,
    /// Tokens the running requests hold outside the cache's shared blocks.
    own: u64,
    kv_written: u64,
    cache: PrefixCache,
    /// Served in key order: (priority, arrival), so FCFS when every priority is 0.
    queue: BTreeMap<(i64, u64), Waiter>,
    next_ticket: u64,
    admitted: u64,
    peak_running: usize,
    peak_in_flight: usize,
}

struct Waiter {
    demand: Demand,
    wake: oneshot::Sender<Grant>,
}

/// What an admitted request holds.
#[derive(Debug)]
struct Grant {
    /// Tokens outside shared blocks: the prompt's tail and private blocks, plus the answer.
    own: u64,
    /// Cache blocks it holds a reference on.
    held: Vec<u64>,
    /// Prompt tokens served from the cache.
    cached: u64,
    /// Admission order, 1-based.
    seq: u64,
}

/// Holds a running slot and its KV; dropping it (request done, or the client went away and the
/// future was dropped) frees both and admits whoever is next. Its prompt blocks stay cached.
pub(crate) struct Permit {
    inner: Arc<Inner>,
    need: Footprint,
    grant: Grant,
}

impl Permit {
    /// Prompt tokens whose prefill the cache saved.
    pub(crate) fn cached_tokens(&self) -> u64 {
        self.grant.cached
    }

    /// Where this request came in the order of admissions.
    pub(crate) fn seq(&self) -> u64 {
        self.grant.seq
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        let mut st = self.inner.lock();
        self.inner.release(&mut st, self.need, &self.grant);
        self.inner.admit_waiters(&mut st);
    }
}

/// Cleans up a queued request whose future is dropped before it learns it was admitted.
struct Pending<'a> {
    inner: &'a Inner,
    key: (i64, u64),
    need: Footprint,
    rx: oneshot::Receiver<Grant>,
    armed: bool,
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let mut st = self.inner.lock();
        if st.queue.remove(&self.key).is_none() {
            // Only `admit_waiters` takes entries out of the queue besides us, and it sends the
            // grant under the lock we now hold, so it is waiting here to be given back.
            if let Ok(grant) = self.rx.try_recv() {
                self.inner.release(&mut st, self.need, &grant);
            }
        }
        // Leaving the head of the queue may unblock the requests behind us.
        self.inner.admit_waiters(&mut st);
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing panics while holding the lock, and the counters stay usable even if it did.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn block_tokens(&self) -> u64 {
        self.cfg.block_tokens.max(1)
    }

    fn kv_used(&self, st: &State) -> u64 {
        st.own + self.block_tokens() * st.cache.used_blocks()
    }

    /// The KV tokens of `d` that are not in its full prompt blocks.
    fn unblocked(&self, d: &Demand) -> u64 {
        d.need
            .reserved
            .saturating_sub(self.block_tokens() * d.blocks.len() as u64)
    }

    /// How `d` would be admitted now, or `None` if the batch or the KV has no room for it.
    /// Cached-but-free blocks count as room: admitting evicts them.
    fn plan(&self, st: &State, d: &Demand) -> Option<Lookup> {
        if st.running >= self.cfg.max_running {
            return None;
        }
        let lookup = st.cache.lookup(&d.blocks, d.max_hit);
        let cost = self.unblocked(d) + self.block_tokens() * (lookup.claimed + lookup.private);
        (self.kv_used(st).saturating_add(cost) <= self.cfg.kv_tokens).then_some(lookup)
    }

    fn take(&self, st: &mut State, d: &Demand, lookup: Lookup) -> Grant {
        let bt = self.block_tokens();
        let held = st.cache.acquire(&d.blocks, lookup.hit);
        let own = self.unblocked(d) + bt * lookup.private;
        st.own += own;
        st.running += 1;
        st.kv_written += d.need.written;
        let room = self.cfg.kv_tokens.saturating_sub(self.kv_used(st));
        st.cache.evict_to(self.cached_room(room) / bt);
        st.admitted += 1;
        st.peak_running = st.peak_running.max(st.running);
        st.peak_in_flight = st.peak_in_flight.max(st.running + st.queue.len());
        self.mirror(st);
        Grant {
            own,
            held,
            cached: bt * lookup.hit as u64,
            seq: st.admitted,
        }
    }

    fn release(&self, st: &mut State, need: Footprint, grant: &Grant) {
        st.running = st.running.saturating_sub(1);
        st.own = st.own.saturating_sub(grant.own);
        st.kv_written = st.kv_written.saturating_sub(need.written);
        st.cache.release(&grant.held);
        if let Some(cap) = self.cfg.prefix_cache_tokens {
            st.cache.evict_to(cap / self.block_tokens());
        }
        self.mirror(st);
    }

    /// The free KV cached blocks may keep: `room`, or less with a capped prefix cache.
    fn cached_room(&self, room: u64) -> u64 {
        self.cfg
            .prefix_cache_tokens
            .map_or(room, |cap| cap.min(room))
    }

    fn mirror(&self, st: &State) {
        self.kv_used.store(self.kv_used(st), Ordering::Relaxed);
        self.kv_written.store(st.kv_written, Ordering::Relaxed);
    }

    fn admit_waiters(&self, st: &mut State) {
        while let Some((&key, head)) = st.queue.first_key_value() {
            let Some(lookup) = self.plan(st, &head.demand) else {
                break;
            };
            let Some(w) = st.queue.remove(&key) else {
                break;
            };
            let grant = self.take(st, &w.demand, lookup);
            // The receiver lives in the waiter's `Pending`, which removes the entry under the
            // lock before it goes away, so this only fails if that contract is ever broken.
            if let Err(grant) = w.wake.send(grant) {
                self.release(st, w.demand.need, &grant);
            }
        }
    }
}

impl Engine {
    pub(crate) fn new(cfg: EngineConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                cfg,
                state: Mutex::new(State::default()),
                kv_used: AtomicU64::new(0),
                kv_written: AtomicU64::new(0),
                prefill_free: Mutex::new(None),
            }),
        }
    }

    pub(crate) fn budget(&self) -> u64 {
        self.inner.cfg.kv_tokens
    }

    /// The block size when prefix caching is on.
    pub(crate) fn prefix_block_tokens(&self) -> Option<u64> {
        self.inner
            .cfg
            .prefix_caching
            .then(|| self.inner.block_tokens())
    }

    /// What a request of this shape costs under the configured reservation model.
    pub(crate) fn footprint(&self, prompt: u64, output: u64, max_tokens: u64) -> Footprint {
        self.inner
            .cfg
            .kv_reserve
            .footprint(prompt, output, max_tokens)
    }

    /// A request for the scheduler. vLLM always computes a prompt's last token, so however much
    /// of a prompt is cached, its last block is computed again.
    pub(crate) fn demand(
        &self,
        need: Footprint,
        prompt_tokens: u64,
        blocks: Vec<u64>,
        priority: i64,
    ) -> Demand {
        let max_hit = prompt_tokens.saturating_sub(1) / self.inner.block_tokens();
        Demand {
            need,
            blocks: if self.inner.cfg.prefix_caching {
                blocks
            } else {
                Vec::new()
            },
            max_hit: usize::try_from(max_hit).unwrap_or(usize::MAX),
            priority,
        }
    }

    /// Waits until the KV and a running slot are free for `demand` and it is first in line (by
    /// priority, then arrival), then holds them until the returned permit is dropped.
    pub(crate) async fn admit(&self, demand: impl Into<Demand>) -> Result<Permit, TooLarge> {
        let mut demand = demand.into();
        demand.need = demand.need.normalized();
        let need = demand.need;
        let budget = self.inner.cfg.kv_tokens;
        if need.reserved > budget {
            return Err(TooLarge {
                need: need.reserved,
                budget,
            });
        }
        let (key, rx) = {
            let mut st = self.inner.lock();
            if st.queue.is_empty() {
                if let Some(lookup) = self.inner.plan(&st, &demand) {
                    let grant = self.inner.take(&mut st, &demand, lookup);
                    return Ok(self.permit(need, grant));
                }
            }
            let key = (demand.priority, st.next_ticket);
            st.next_ticket += 1;
            let (wake, rx) = oneshot::channel();
            st.queue.insert(key, Waiter { demand, wake });
            st.peak_in_flight = st.peak_in_flight.max(st.running + st.queue.len());
            // A request that goes ahead of a blocked head may fit where the head did not.
            self.inner.admit_waiters(&mut st);
            (key, rx)
        };
        let mut pending = Pending {
            inner: &self.inner,
            key,
            need,
            rx,
            armed: true,
        };
        // The sender lives in the queue, which only `admit_waiters` drains (sending first), so
        // this resolves only on admission.
        match (&mut pending.rx).await {
            Ok(grant) => {
                pending.armed = false;
                Ok(self.permit(need, grant))
            }
            Err(_) => Err(TooLarge {
                need: need.reserved,
                budget,
            }),
        }
    }

    fn permit(&self, need: Footprint, grant: Grant) -> Permit {
        Permit {
            inner: Arc::clone(&self.inner),
            need,
            grant,
        }
    }

    fn share(&self, tokens: &AtomicU64) -> f64 {
        let budget = self.inner.cfg.kv_tokens.max(1) as f64;
        (tokens.load(Ordering::Relaxed) as f64 / budget).clamp(0.0, 1.0)
    }

    /// The share in use by running requests: what vLLM's scheduler counts as used blocks, so what
    /// it reports. Cached blocks nobody uses are free, as in vLLM.
    pub(crate) fn kv_usage(&self) -> f64 {
        self.share(&self.inner.kv_used)
    }

    /// Decode reads the KV that is written, so a reservation nobody writes into does not slow
    /// anyone down.
    fn load_factor(&self) -> f64 {
        1.0 + self.inner.cfg.load_slowdown * self.share(&self.inner.kv_written)
    }

    /// Prefill time of `prompt_tokens` uncached tokens at the current load (without any
    /// admin-injected delay), taken alone.
    #[cfg(test)]
    pub(crate) fn ttft(&self, prompt_tokens: u64) -> Duration {
        let (fixed, compute) = self.prefill_parts(prompt_tokens);
        fixed + compute
    }

    /// A first token's fixed part and the compute of `prompt_tokens` uncached tokens, both at
    /// the current load.
    fn prefill_parts(&self, prompt_tokens: u64) -> (Duration, Duration) {
        let (cfg, lf) = (&self.inner.cfg, self.load_factor());
        (
            ms_to_duration(cfg.ttft_ms * lf),
            ms_to_duration(prompt_tokens as f64 * cfg.prefill_us_per_token / 1000.0 * lf),
        )
    }

    /// How long from now until the first token of a request whose `prompt_tokens` uncached
    /// tokens start prefilling now: [`Engine::ttft`], or with `serial_prefill` the fixed part
    /// plus the wait for the prefills scheduled before it and its own compute, which it then
    /// holds the engine's prefill for.
    pub(crate) fn schedule_prefill(&self, prompt_tokens: u64) -> Duration {
        let (fixed, compute) = self.prefill_parts(prompt_tokens);
        if !self.inner.cfg.serial_prefill {
            return fixed + compute;
        }
        let now = Instant::now();
        let mut free = self
            .inner
            .prefill_free
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        let done = free.filter(|t| *t > now).unwrap_or(now) + compute;
        *free = Some(done);
        fixed + (done - now)
    }

    /// One decode step at the current load.
    pub(crate) fn itl(&self) -> Duration {
        ms_to_duration(self.inner.cfg.itl_ms * self.load_factor())
    }

    pub(crate) fn snapshot(&self) -> Snapshot {
        let st = self.inner.lock();
        Snapshot {
            running: st.running,
            waiting: st.queue.len(),
            kv_used: self.inner.kv_used(&st),
            kv_written: st.kv_written,
            kv_cached_free: self.inner.block_tokens() * st.cache.free_blocks(),
            kv_usage: self.kv_usage(),
            peak_running: st.peak_running,
            peak_in_flight: st.peak_in_flight,
        }
    }

    /// Restarts the high-water marks from the current load.
    pub(crate) fn reset_peaks(&self) {
        let mut st = self.inner.lock();
        st.peak_running = st.running;
        st.peak_in_flight = st.running + st.queue.len();
    }

    /// Forgets every cached block, as vLLM's `/reset_prefix_cache`: refused (false) while any
    /// running request uses one.
    pub(crate) fn reset_prefix_cache(&self) -> bool {
        self.inner.lock().cache.reset()
    }
}

/// Converts milliseconds to a `Duration` without the panics `from_secs_f64` has on odd input.
pub(crate) fn ms_to_duration(ms: f64) -> Duration {
    if !ms.is_finite() || ms <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(ms.min(1e12) / 1000.0).unwrap_or(Duration::ZERO)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(kv_tokens: u64, max_running: usize) -> Engine {
        reserving(KvReserve::Output, kv_tokens, max_running)
    }

    fn reserving(kv_reserve: KvReserve, kv_tokens: u64, max_running: usize) -> Engine {
        Engine::new(EngineConfig {
            kv_tokens,
            max_running,
            ttft_ms: 20.0,
            prefill_us_per_token: 50.0,
            itl_ms: 1.0,
            load_slowdown: 3.0,
            kv_reserve,
            block_tokens: 16,
            prefix_caching: true,
            prefix_cache_tokens: None,
            serial_prefill: false,
        })
    }

    /// Admits `need` on a task that reports `name` once admitted and then holds the permit until
    /// told to finish.
    fn queue(
        e: &Engine,
        name: &'static str,
        need: Footprint,
        admitted: &tokio::sync::mpsc::UnboundedSender<&'static str>,
    ) -> (tokio::task::JoinHandle<()>, oneshot::Sender<()>) {
        let (done, finish) = oneshot::channel::<()>();
        let (e, admitted) = (e.clone(), admitted.clone());
        let task = tokio::spawn(async move {
            let p = e.admit(need).await.unwrap();
            admitted.send(name).unwrap();
            let _ = finish.await;
            drop(p);
        });
        (task, done)
    }

    async fn settle() {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    async fn admitted_within(
        fut: impl std::future::Future<Output = Result<Permit, TooLarge>>,
    ) -> Option<Permit> {
        tokio::time::timeout(Duration::from_millis(20), fut)
            .await
            .ok()
            .map(|r| r.unwrap())
    }

    #[tokio::test]
    async fn kv_budget_blocks_and_drop_releases() {
        let e = engine(100, 8);
        let a = e.admit(60).await.unwrap();
        assert_eq!(e.snapshot().kv_used, 60);
        assert!(admitted_within(e.admit(60)).await.is_none());
        // The timed-out waiter must have left the queue.
        assert_eq!(e.snapshot().waiting, 0);
        drop(a);
        assert_eq!(e.snapshot().kv_used, 0);
        assert_eq!(e.snapshot().running, 0);
        let b = admitted_within(e.admit(100)).await;
        assert!(b.is_some());
        assert_eq!(e.kv_usage(), 1.0);
    }

    #[tokio::test]
    async fn max_running_limits_batch() {
        let e = engine(1000, 2);
        let _a = e.admit(1).await.unwrap();
        let b = e.admit(1).await.unwrap();
        assert!(admitted_within(e.admit(1)).await.is_none());
        drop(b);
        assert!(admitted_within(e.admit(1)).await.is_some());
        assert_eq!(e.snapshot().peak_running, 2);
    }

    #[tokio::test]
    async fn too_large_is_rejected() {
        let e = engine(100, 2);
        assert_eq!(
            e.admit(101).await.err(),
            Some(TooLarge {
                need: 101,
                budget: 100
            })
        );
    }

    #[tokio::test]
    async fn admission_is_strict_fifo() {
        let e = engine(100, 8);
        let first = e.admit(90).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        // A big request queues first; a small one that would fit must still wait behind it.
        for (name, need) in [("big", 50u64), ("small", 5u64)] {
            let e = e.clone();
            let tx = tx.clone();
            tasks.push(tokio::spawn(async move {
                let p = e.admit(need).await.unwrap();
                tx.send(name).unwrap();
                tokio::time::sleep(Duration::from_millis(5)).await;
                drop(p);
            }));
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(e.snapshot().waiting, 2);
        assert!(rx.try_recv().is_err());
        drop(first);
        assert_eq!(rx.recv().await, Some("big"));
        assert_eq!(rx.recv().await, Some("small"));
        for t in tasks {
            t.await.unwrap();
        }
        let s = e.snapshot();
        assert_eq!((s.running, s.waiting, s.kv_used), (0, 0, 0));
        assert_eq!(s.peak_in_flight, 3);
    }

    #[tokio::test]
    async fn dropped_head_unblocks_followers() {
        let e = engine(100, 8);
        let first = e.admit(60).await.unwrap();
        let e2 = e.clone();
        let head = tokio::spawn(async move { e2.admit(50).await.map(|_| ()) });
        tokio::time::sleep(Duration::from_millis(5)).await;
        let e3 = e.clone();
        let follower = tokio::spawn(async move {
            let p = e3.admit(30).await.unwrap();
            std::mem::forget(p);
        });
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert_eq!(e.snapshot().waiting, 2);
        head.abort();
        follower.await.unwrap();
        assert_eq!(e.snapshot().kv_used, 90);
        drop(first);
    }

    #[tokio::test]
    async fn latency_grows_with_usage() {
        let e = engine(100, 8);
        let idle_itl = e.itl();
        let idle_ttft = e.ttft(100);
        assert_eq!(idle_itl, Duration::from_millis(1));
        // 20 ms + 100 tokens * 50 us.
        assert_eq!(idle_ttft, Duration::from_millis(25));
        let p = e.admit(50).await.unwrap();
        assert_eq!(e.itl(), Duration::from_micros(2500));
        assert!(e.ttft(100) > idle_ttft);
        drop(p);
        assert_eq!(e.itl(), idle_itl);
    }

    #[test]
    fn footprints_per_reservation_model() {
        // 10 prompt tokens, an answer that stops after 5 of its 100 allowed tokens.
        assert_eq!(
            KvReserve::Output.footprint(10, 5, 100),
            Footprint {
                reserved: 15,
                written: 15
            }
        );
        assert_eq!(
            KvReserve::MaxTokens.footprint(10, 5, 100),
            Footprint {
                reserved: 110,
                written: 15
            }
        );
        assert_eq!(
            KvReserve::MaxTokens.footprint(u64::MAX, 5, 100).reserved,
            u64::MAX
        );
    }

    #[tokio::test]
    async fn max_tokens_reservation_is_held_by_an_early_ending_request() {
        let e = reserving(KvReserve::MaxTokens, 200, 8);
        let need = e.footprint(10, 5, 100);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let (first, end_first) = queue(&e, "first", need, &tx);
        assert_eq!(rx.recv().await, Some("first"));
        let s = e.snapshot();
        assert_eq!((s.kv_used, s.kv_written), (110, 15));
        assert_eq!(e.kv_usage(), 0.55);

        // 15 + 15 tokens are all either would write, but 110 + 110 reserved exceed 200.
        let (second, end_second) = queue(&e, "second", need, &tx);
        settle().await;
        assert_eq!((e.snapshot().running, e.snapshot().waiting), (1, 1));
        assert!(rx.try_recv().is_err());

        // The same two requests fit side by side when only their output is reserved.
        let out = engine(200, 8);
        let a = out.admit(out.footprint(10, 5, 100)).await.unwrap();
        assert!(admitted_within(out.admit(out.footprint(10, 5, 100)))
            .await
            .is_some());
        drop(a);

        end_first.send(()).unwrap();
        first.await.unwrap();
        assert_eq!(rx.recv().await, Some("second"));
        assert_eq!(e.snapshot().kv_used, 110);
        end_second.send(()).unwrap();
        second.await.unwrap();
        let s = e.snapshot();
        assert_eq!(
            (s.running, s.waiting, s.kv_used, s.kv_written),
            (0, 0, 0, 0)
        );
    }

    #[tokio::test]
    async fn a_big_reservation_at_the_head_blocks_smaller_ones() {
        let e = reserving(KvReserve::MaxTokens, 200, 8);
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let (first, end_first) = queue(&e, "first", e.footprint(10, 5, 100), &tx);
        assert_eq!(rx.recv().await, Some("first"));
        // 160 reserved does not fit next to 110; 30 would, but it queued behind.
        let (big, end_big) = queue(&e, "big", e.footprint(10, 5, 150), &tx);
        settle().await;
        let (small, end_small) = queue(&e, "small", e.footprint(10, 5, 20), &tx);
        settle().await;
        let s = e.snapshot();
        assert_eq!(
            (s.running, s.waiting, s.kv_used, s.kv_written),
            (1, 2, 110, 15)
        );
        assert!(rx.try_recv().is_err());

        end_first.send(()).unwrap();
        first.await.unwrap();
        assert_eq!(rx.recv().await, Some("big"));
        assert_eq!(rx.recv().await, Some("small"));
        let s = e.snapshot();
        assert_eq!(
            (s.running, s.waiting, s.kv_used, s.kv_written),
            (2, 0, 190, 30)
        );
        for (task, end) in [(big, end_big), (small, end_small)] {
            end.send(()).unwrap();
            task.await.unwrap();
        }
        assert_eq!(e.snapshot().kv_used, 0);
    }

    #[tokio::test]
    async fn slowdown_follows_written_kv_not_the_reservation() {
        let close = |a: Duration, b: Duration| a.abs_diff(b) < Duration::from_micros(1);
        let e = reserving(KvReserve::MaxTokens, 100, 8);
        // Reserves 90 % of the cache but writes only 20 %.
        let p = e.admit(e.footprint(10, 10, 80)).await.unwrap();
        assert_eq!(e.kv_usage(), 0.9);
        // 1 ms * (1 + 3 * 0.2), not 1 ms * (1 + 3 * 0.9).
        assert!(close(e.itl(), Duration::from_micros(1600)), "{:?}", e.itl());
        // The same request costs the same decode time under either reservation model.
        let out = engine(100, 8);
        let q = out.admit(out.footprint(10, 10, 80)).await.unwrap();
        assert_eq!(out.kv_usage(), 0.2);
        assert_eq!(out.itl(), e.itl());
        assert_eq!(out.ttft(100), e.ttft(100));
        drop((p, q));
        assert_eq!(e.itl(), Duration::from_millis(1));
    }

    /// A prompt of `blocks.len()` full blocks of 16 tokens and a 10-token answer.
    fn prompt(e: &Engine, blocks: &[u64], priority: i64) -> Demand {
        let prompt = 16 * blocks.len() as u64;
        e.demand(
            e.footprint(prompt, 10, 10),
            prompt,
            blocks.to_vec(),
            priority,
        )
    }

    #[tokio::test]
    async fn priority_orders_the_queue_then_arrival() {
        let e = engine(1000, 1);
        let first = e.admit(1).await.unwrap();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks = Vec::new();
        for (name, priority) in [("p5", 5), ("p1a", 1), ("p3", 3), ("p1b", 1), ("m2", -2)] {
            let (e, tx) = (e.clone(), tx.clone());
            tasks.push(tokio::spawn(async move {
                let d = Demand {
                    priority,
                    ..Demand::from(1)
                };
                let p = e.admit(d).await.unwrap();
                tx.send((name, p.seq())).unwrap();
            }));
            settle().await;
        }
        assert_eq!(e.snapshot().waiting, 5);
        drop(first);
        let mut order = Vec::new();
        for _ in 0..5 {
            order.push(rx.recv().await.unwrap());
        }
        order.sort_by_key(|(_, seq)| *seq);
        let names: Vec<&str> = order.iter().map(|(n, _)| *n).collect();
        assert_eq!(names, ["m2", "p1a", "p1b", "p3", "p5"]);
        for t in tasks {
            t.await.unwrap();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn serial_prefills_wait_for_the_ones_before_them() {
        let mut cfg = reserving(KvReserve::Output, 1000, 8).inner.cfg.clone();
        let parallel = Engine::new(cfg.clone());
        cfg.serial_prefill = true;
        let serial = Engine::new(cfg);
        // 1,000 uncached tokens at 50 us are 50 ms of compute, plus the fixed 20 ms.
        for _ in 0..3 {
            assert_eq!(parallel.schedule_prefill(1000), Duration::from_millis(70));
        }
        let waits: Vec<_> = (0..3).map(|_| serial.schedule_prefill(1000)).collect();
        assert_eq!(
            waits,
            [70, 120, 170].map(Duration::from_millis),
            "each waits for the compute scheduled before it"
        );
        // A cached prompt computes nothing, so it waits only for what is ahead of it; once
        // that is done, a prefill runs alone again.
        assert_eq!(serial.schedule_prefill(0), Duration::from_millis(170));
        tokio::time::advance(Duration::from_millis(150)).await;
        assert_eq!(serial.schedule_prefill(1000), Duration::from_millis(70));
    }

    #[tokio::test]
    async fn a_cached_head_is_shared_and_costs_no_new_kv() {
        let e = engine(1000, 8);
        let a = e.admit(prompt(&e, &[1, 2, 3, 4], 0)).await.unwrap();
        assert_eq!((a.cached_tokens(), e.snapshot().kv_used), (0, 74));
        // The same prompt hits all but its last block, which it computes again into its own copy.
        let b = e.admit(prompt(&e, &[1, 2, 3, 4], 0)).await.unwrap();
        assert_eq!(b.cached_tokens(), 48);
        assert_eq!(e.snapshot().kv_used, 74 + 10 + 16);
        assert!(e.ttft(64 - b.cached_tokens()) < e.ttft(64));
        drop(a);
        // Block 4 now only sits in the cache, free; 1-3 are still b's.
        let s = e.snapshot();
        assert_eq!((s.kv_used, s.kv_cached_free), (26 + 48, 16));
        drop(b);
        let s = e.snapshot();
        assert_eq!((s.kv_used, s.kv_cached_free, s.kv_usage), (0, 64, 0.0));

        // Without prefix caching nothing is shared.
        let off = Engine::new(EngineConfig {
            prefix_caching: false,
            ..e.inner.cfg.clone()
        });
        let a = off.admit(prompt(&off, &[1, 2, 3, 4], 0)).await.unwrap();
        let b = off.admit(prompt(&off, &[1, 2, 3, 4], 0)).await.unwrap();
        assert_eq!((b.cached_tokens(), off.snapshot().kv_used), (0, 148));
        drop((a, b));
        assert_eq!(off.snapshot().kv_cached_free, 0);
    }

    #[tokio::test]
    async fn cached_blocks_make_room_for_requests_that_need_it_tail_first() {
        let e = engine(100, 8);
        drop(e.admit(prompt(&e, &[1, 2, 3], 0)).await.unwrap());
        assert_eq!(e.snapshot().kv_cached_free, 48);
        // 60 unrelated tokens fit although 60 + 48 cached exceed the budget: the oldest block,
        // the earlier prompt's tail, goes.
        let big = e.admit(60).await.unwrap();
        let s = e.snapshot();
        assert_eq!((s.kv_used, s.kv_cached_free), (60, 32));
        drop(big);
        let again = e.admit(prompt(&e, &[1, 2, 3], 0)).await.unwrap();
        assert_eq!(again.cached_tokens(), 32);
        drop(again);
        // A request that needs the whole cache evicts all of it.
        drop(e.admit(100).await.unwrap());
        assert_eq!(e.snapshot().kv_cached_free, 0);
        let cold = e.admit(prompt(&e, &[1, 2, 3], 0)).await.unwrap();
        assert_eq!(cold.cached_tokens(), 0);
        assert!(!e.reset_prefix_cache());
        drop(cold);
        assert!(e.reset_prefix_cache());
        assert_eq!(e.snapshot().kv_cached_free, 0);
    }

    #[tokio::test]
    async fn a_capped_prefix_cache_keeps_only_the_heads_it_holds() {
        // Plenty of KV for running requests, but 32 tokens (two blocks) of free cache.
        let e = Engine::new(EngineConfig {
            prefix_cache_tokens: Some(32),
            ..engine(1000, 8).inner.cfg.clone()
        });
        let a = e.admit(prompt(&e, &[1, 2, 3], 0)).await.unwrap();
        let b = e.admit(prompt(&e, &[7, 8], 0)).await.unwrap();
        // Blocks in use are never capped.
        assert_eq!(e.snapshot().kv_used, 58 + 42);
        drop(a);
        // a's three blocks were freed, tail first, and only two stay: its head.
        assert_eq!(e.snapshot().kv_cached_free, 32);
        drop(b);
        // b's freed blocks are newer: they push a's out.
        assert_eq!(e.snapshot().kv_cached_free, 32);
        let again = e.admit(prompt(&e, &[7, 8], 0)).await.unwrap();
        assert_eq!(again.cached_tokens(), 16, "all but the last block");
        drop(again);
        let cold = e.admit(prompt(&e, &[1, 2, 3], 0)).await.unwrap();
        assert_eq!(cold.cached_tokens(), 0, "evicted by the cap, not by KV");
    }

    #[test]
    fn odd_durations_do_not_panic() {
        assert_eq!(ms_to_duration(f64::NAN), Duration::ZERO);
        assert_eq!(ms_to_duration(-1.0), Duration::ZERO);
        assert!(ms_to_duration(f64::MAX) > Duration::ZERO);
    }
}
