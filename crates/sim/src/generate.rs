//! Plays one request out in time: queue for admission, prefill, then decode token by token at
//! the inter-token latency the current load implies.
//!
//! Timers are the only real cost of the simulator, so decode steps are booked against a running
//! deadline and slept in batches of a few milliseconds instead of one timer per token; the
//! average pace is still exact and load is re-read at every step.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;
use tokio::time::{sleep_until, Instant};

use super::api::{RequestSpec, SseFrames, SSE_DONE};
use super::engine::{ms_to_duration, Demand, Permit, TooLarge};
use super::metrics::Finish;
use super::stats::Admission;
use super::Sim;

/// Streams wake this often at most, so chunks still arrive spread out over time.
const STREAM_QUANTUM: Duration = Duration::from_millis(3);
/// Nobody watches a non-streamed body grow, so it can sleep in coarser steps.
const BATCH_QUANTUM: Duration = Duration::from_millis(20);
/// How far behind schedule (a slow reader) we tolerate before giving up on catching up, as a
/// real engine would not burst out tokens it could not deliver.
const CATCH_UP_LIMIT: Duration = Duration::from_millis(50);

/// A parsed request on its way through the engine.
pub(crate) struct Job {
    /// The response id, and the client's `x-request-id` if it sent one.
    pub id: String,
    pub request_id: Option<String>,
    pub spec: RequestSpec,
    /// Its KV cost, prompt blocks and priority, held until the job ends.
    pub demand: Demand,
    /// Which engine's metrics it counts towards.
    pub engine: usize,
    pub arrived: Instant,
}

/// How a non-streamed request was served, for the response headers.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Served {
    pub queued: Duration,
    pub cached_tokens: u64,
}

struct Pacer {
    next: Instant,
    quantum: Duration,
}

impl Pacer {
    fn new(quantum: Duration) -> Self {
        Self {
            next: Instant::now(),
            quantum,
        }
    }

    /// Books one more step; returns when to wake once we have run a quantum ahead of the clock.
    fn step(&mut self, step: Duration) -> Option<Instant> {
        let now = Instant::now();
        if self.next + CATCH_UP_LIMIT < now {
            self.next = now;
        }
        self.next += step;
        (self.next > now + self.quantum).then_some(self.next)
    }

    fn deadline(&self) -> Instant {
        self.next
    }
}

/// Records the request in vLLM's counters however it ends: finished, or aborted because the
/// client went away, whether it was still waiting or already running (the future that owns this
/// is dropped then, by hyper for a non-streamed request or by the stream task).
struct Progress<'a> {
    sim: &'a Sim,
    job: &'a Job,
    generated: u64,
    /// Inter-token gaps (seconds) of the tokens decoded since they were last handed to the
    /// metrics: handed over whenever the pacer sleeps and when the request ends, so the
    /// histogram keeps up with the decode within a quantum at one lock per wake-up, not per token.
    gaps: Vec<f64>,
    done: bool,
}

/// Gaps held back at most, should the pacer never sleep (an ITL of zero).
const GAPS_HELD: usize = 256;

impl<'a> Progress<'a> {
    fn new(sim: &'a Sim, job: &'a Job) -> Self {
        Self {
            sim,
            job,
            generated: 0,
            gaps: Vec::new(),
            done: false,
        }
    }

    /// The request leaves the waiting queue: vLLM's queue-time histogram and prefix-cache
    /// counters observe it here.
    fn scheduled(&self, permit: &Permit) -> Served {
        let (sim, job) = (self.sim, self.job);
        let queued = job.arrived.elapsed();
        sim.metrics.scheduled(job.engine, queued.as_secs_f64());
        let cached_tokens = permit.cached_tokens();
        // vLLM counts queries only when the cache is on.
        if sim.engine.prefix_block_tokens().is_some() {
            sim.metrics
                .prefix_cache(job.engine, job.spec.prompt_tokens, cached_tokens);
            sim.stats
                .prefix_cache(job.spec.prompt_tokens, cached_tokens);
        }
        sim.stats.admitted(Admission {
            seq: permit.seq(),
            id: job.id.clone(),
            request_id: job.request_id.clone(),
            model: job.spec.model.clone(),
            priority: job.demand.priority,
            queue_ms: queued.as_secs_f64() * 1000.0,
            cached_tokens,
        });
        Served {
            queued,
            cached_tokens,
        }
    }

    /// Prefill only computes the tokens the cache did not have.
    fn ttft(&self, served: Served) -> Duration {
        let uncached = self
            .job
            .spec
            .prompt_tokens
            .saturating_sub(served.cached_tokens);
        self.sim.engine.schedule_prefill(uncached) + ms_to_duration(self.sim.admin.get().extra_ms)
    }

    fn first_token(&mut self) {
        let ttft = self.job.arrived.elapsed().as_secs_f64();
        self.sim
            .metrics
            .first_token(self.job.engine, self.job.spec.prompt_tokens, ttft);
        self.generated = 1;
    }

    /// One more token decoded, `gap` after the one before it: vLLM observes the gap in its
    /// inter-token-latency histogram. The gap is the engine's decode step, booked by the pacer;
    /// a reader too slow to keep up does not count, as vLLM's engine does not wait for readers.
    fn decoded(&mut self, gap: Duration) {
        self.generated += 1;
        self.gaps.push(gap.as_secs_f64());
        if self.gaps.len() >= GAPS_HELD {
            self.flush_gaps();
        }
    }

    /// Hands the gaps observed so far to the metrics.
    fn flush_gaps(&mut self) {
        self.sim.metrics.inter_tokens(self.job.engine, &self.gaps);
        self.gaps.clear();
    }

    fn finish(mut self) {
        self.done = true;
        let reason = Finish::from_reason(self.job.spec.finish_reason);
        self.record(reason);
        self.sim.stats.completed();
    }

    /// A request the engine refused outright is neither finished nor aborted.
    fn refused(mut self) {
        self.done = true;
    }

    fn record(&mut self, reason: Finish) {
        self.flush_gaps();
        let e2e = self.job.arrived.elapsed().as_secs_f64();
        self.sim
            .metrics
            .finish(self.job.engine, reason, self.generated, e2e);
    }
}

impl Drop for Progress<'_> {
    fn drop(&mut self) {
        if !self.done {
            self.record(Finish::Abort);
            self.sim.stats.aborted();
        }
    }
}

/// Runs a non-streamed request to the end; dropping the future (the client went away) aborts it
/// and releases its KV.
pub(crate) async fn complete(sim: &Sim, job: &Job) -> Result<Served, TooLarge> {
    let mut progress = Progress::new(sim, job);
    let permit = match sim.engine.admit(job.demand.clone()).await {
        Ok(p) => p,
        Err(e) => {
            progress.refused();
            return Err(e);
        }
    };
    let served = progress.scheduled(&permit);
    tokio::time::sleep(progress.ttft(served)).await;
    progress.first_token();
    let mut pacer = Pacer::new(BATCH_QUANTUM);
    for _ in 1..job.spec.completion_tokens {
        let gap = sim.engine.itl();
        if let Some(at) = pacer.step(gap) {
            progress.flush_gaps();
            sleep_until(at).await;
        }
        progress.decoded(gap);
    }
    sleep_until(pacer.deadline()).await;
    progress.finish();
    Ok(served)
}

/// Sleeps until `at`, or returns false early if the client has gone.
async fn sleep_or_closed(tx: &mpsc::Sender<Bytes>, at: Instant) -> bool {
    tokio::select! {
        () = sleep_until(at) => true,
        () = tx.closed() => false,
    }
}

/// Streams a request into `tx` as server-sent events; returns when done or when the receiving
/// body is dropped (client disconnect), releasing its KV either way.
pub(crate) async fn stream(sim: Arc<Sim>, job: Job, frames: SseFrames, tx: mpsc::Sender<Bytes>) {
    let mut progress = Progress::new(&sim, &job);
    let admitted = tokio::select! {
        p = sim.engine.admit(job.demand.clone()) => p,
        () = tx.closed() => return,
    };
    let permit = match admitted {
        Ok(p) => p,
        Err(_) => return progress.refused(),
    };
    let served = progress.scheduled(&permit);
    if !sleep_or_closed(&tx, Instant::now() + progress.ttft(served)).await {
        return;
    }
    progress.first_token();
    if let Some(role) = &frames.role {
        if tx.send(role.clone()).await.is_err() {
            return;
        }
    }
    if tx.send(frames.token.clone()).await.is_err() {
        return;
    }
    let mut pacer = Pacer::new(STREAM_QUANTUM);
    for _ in 1..job.spec.completion_tokens {
        let gap = sim.engine.itl();
        if let Some(at) = pacer.step(gap) {
            progress.flush_gaps();
            if !sleep_or_closed(&tx, at).await {
                return;
            }
        }
        if tx.send(frames.token.clone()).await.is_err() {
            return;
        }
        progress.decoded(gap);
    }
    if !sleep_or_closed(&tx, pacer.deadline()).await {
        return;
    }
    let cached = sim.prompt_tokens_details.then_some(served.cached_tokens);
    let tail = [
        Some(frames.finish),
        frames.usage.map(|u| u.render(cached)),
        Some(Bytes::from_static(SSE_DONE)),
    ];
    for frame in tail.into_iter().flatten() {
        if tx.send(frame).await.is_err() {
            return;
        }
    }
    progress.finish();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn pacer_batches_sleeps_but_keeps_pace() {
        let mut p = Pacer::new(Duration::from_millis(3));
        let start = p.deadline();
        let wakes = (0..10)
            .filter(|_| p.step(Duration::from_millis(1)).is_some())
            .count();
        // Ten 1 ms steps booked instantly: only the ones beyond the 3 ms quantum need a timer.
        assert!(wakes <= 7, "{wakes}");
        assert_eq!(p.deadline() - start, Duration::from_millis(10));
    }
}
