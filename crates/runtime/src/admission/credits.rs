//! Capacity credits for the Redis coordinator: while a tier is far from its bound, a replica
//! leases a block of its slots at once (`lua/grant.lua`) and admits its own requests from that
//! block without a Redis round trip; a finished request's slot goes back to the block. Near the
//! bound — someone waits, or the tier is three quarters full — the replica gives its idle credits
//! back and admission returns to one script per request, with its exact FIFO and fair share.
//!
//! Pure bookkeeping: the coordinator does the Redis calls.

/// Capacities below this keep one script per request: a block would be too large a share.
pub const MIN_CAPACITY: u32 = 64;
/// A block is this fraction of the capacity (at most [`MAX_BLOCK`]).
const BLOCK_DIVISOR: u32 = 16;
const MAX_BLOCK: u32 = 64;

/// Slots one grant asks for, or `None` where credits are not used. An unlimited tier (0) has no
/// bound to approach: its slots are counted only for `/status`.
pub fn block_for(capacity: u32) -> Option<u32> {
    match capacity {
        0 => Some(MAX_BLOCK),
        c if c >= MIN_CAPACITY => Some((c / BLOCK_DIVISOR).clamp(1, MAX_BLOCK)),
        _ => None,
    }
}

/// Whether the tier, as the last cluster-wide refresh saw it, is near enough its bound that
/// idle credits must go back and new admissions take the exact path.
pub fn contended(capacity: u32, inflight: u64, queued: u64) -> bool {
    capacity != 0 && (queued > 0 || inflight * 4 >= u64::from(capacity) * 3)
}

/// One tier's credits on this replica.
#[derive(Debug, Default)]
pub struct Credits {
    /// Granted and not in use.
    pub idle: Vec<String>,
    /// A grant is on its way (at most one per tier).
    pub granting: bool,
    /// Set while the tier is contended: a credit finished with goes back to Redis.
    pub returning: bool,
    /// A request found the block running low: blocks are leased only where requests come.
    pub wanted: bool,
}

impl Credits {
    /// A credit for a new request, unless the tier is contended; notes when a new block is
    /// worth asking for (true: wake the keeper).
    pub fn take(&mut self, block: u32) -> (Option<String>, bool) {
        if self.returning {
            return (None, false);
        }
        let credit = self.idle.pop();
        let wake = !self.granting && self.idle.len() < (block as usize).div_ceil(2);
        self.wanted |= wake;
        (credit, wake)
    }

    /// A finished request's credit: kept (true) or to be given back to Redis (false).
    pub fn give_back(&mut self, member: String) -> bool {
        if self.returning {
            return false;
        }
        self.idle.push(member);
        true
    }

    /// Whether to ask for a new block now (a request wanted one and none is on its way).
    pub fn start_grant(&mut self) -> bool {
        let go = self.wanted && !self.returning && !self.granting;
        self.wanted = false;
        self.granting |= go;
        go
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_only_for_large_capacities() {
        assert_eq!(block_for(32), None);
        assert_eq!(block_for(64), Some(4));
        assert_eq!(block_for(10_000), Some(64));
        assert_eq!(block_for(0), Some(64), "unlimited");
    }

    #[test]
    fn contention_is_a_waiter_or_three_quarters_full() {
        assert!(!contended(64, 47, 0));
        assert!(contended(64, 48, 0));
        assert!(contended(64, 0, 1));
        assert!(
            !contended(0, 1000, 0),
            "an unlimited tier is never near its bound"
        );
    }

    #[test]
    fn credits_circulate_until_the_tier_is_contended() {
        let mut c = Credits {
            idle: vec!["c1".into(), "c2".into(), "c3".into()],
            ..Default::default()
        };
        let (m, wake) = c.take(4);
        assert!(!wake, "half a block left is enough");
        assert!(c.give_back(m.unwrap()));
        assert_eq!(c.idle.len(), 3);
        assert!(!c.start_grant(), "nobody asked");
        let _ = c.take(4);
        let (_, wake) = c.take(4);
        assert!(
            wake && c.start_grant() && !c.start_grant(),
            "one grant at a time"
        );
        c.granting = false;
        c.returning = true;
        assert_eq!(c.take(4), (None, false));
        assert!(!c.give_back("c4".into()), "goes back to Redis");
    }
}
