//! New trace and span ids: SplitMix64 over a per-thread state, seeded from the standard
//! library's per-process random hash keys (OS randomness), the clock and the process id. Fast and
//! lock-free; not cryptographic, which ids need not be (the spec asks them to be unique and, for
//! the sampler, the trace id's low 56 bits uniformly random).

use crate::context::{SpanId, TraceId};
use std::cell::Cell;
use std::hash::{BuildHasher, Hasher};

thread_local! {
    static STATE: Cell<u64> = Cell::new(thread_seed());
}

fn thread_seed() -> u64 {
    // Each RandomState is keyed from OS randomness drawn once per thread, then stepped.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    h.write_u64(now);
    h.write_u32(std::process::id());
    h.finish()
}

/// The next 64 random bits of this thread (SplitMix64).
pub fn next_u64() -> u64 {
    STATE.with(|s| {
        let x = s.get().wrapping_add(0x9e37_79b9_7f4a_7c15);
        s.set(x);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    })
}

/// A new valid (non-zero) trace id, all 128 bits random.
pub fn new_trace_id() -> TraceId {
    loop {
        let mut id = [0u8; 16];
        id[..8].copy_from_slice(&next_u64().to_be_bytes());
        id[8..].copy_from_slice(&next_u64().to_be_bytes());
        let id = TraceId(id);
        if id.is_valid() {
            return id;
        }
    }
}

/// A new valid (non-zero) span id.
pub fn new_span_id() -> SpanId {
    loop {
        let id = SpanId(next_u64().to_be_bytes());
        if id.is_valid() {
            return id;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn ids_are_valid_and_distinct_across_threads() {
        let per_thread = 20_000;
        let ids: Vec<Vec<TraceId>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..4)
                .map(|_| s.spawn(|| (0..per_thread).map(|_| new_trace_id()).collect()))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let all: HashSet<TraceId> = ids.into_iter().flatten().collect();
        assert_eq!(all.len(), 4 * per_thread);
        assert!(all.iter().all(TraceId::is_valid));
        let spans: HashSet<SpanId> = (0..per_thread).map(|_| new_span_id()).collect();
        assert_eq!(spans.len(), per_thread);
    }

    #[test]
    fn the_low_56_bits_look_uniform() {
        let n = 100_000;
        let below_half = (0..n)
            .filter(|_| new_trace_id().randomness() < 1 << 55)
            .count();
        assert!((49_000..51_000).contains(&below_half), "{below_half}");
    }
}
