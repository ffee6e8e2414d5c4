//! vLLM's automatic prefix cache: prompt blocks kept inside the KV budget.
//!
//! Blocks are named by chained hashes ([`crate::prompt::Prompt::block_hashes`]), so a lookup can
//! only match a shared head of a prompt. Running requests share the blocks they have in common
//! (reference counted); when the last user of a block ends, the block stays cached but is free:
//! vLLM's usage gauge counts it as free, and it is evicted, least recently freed first, as soon
//! as a request needs its room. Only the accounting lives here; the engine decides admission.

use std::collections::{BTreeMap, HashMap};

#[derive(Debug, Clone, Copy)]
struct Block {
    refs: u32,
    /// Its key in `free` while `refs` is 0.
    freed_at: u64,
}

#[derive(Debug, Default)]
pub(crate) struct PrefixCache {
    blocks: HashMap<u64, Block>,
    /// Unused blocks by the time they were freed: the eviction order.
    free: BTreeMap<u64, u64>,
    clock: u64,
}

/// What admitting one prompt would take from the cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lookup {
    /// Leading blocks found in the cache.
    pub hit: usize,
    /// Blocks that start being used: cached-but-free hits plus new blocks.
    pub claimed: u64,
    /// Blocks beyond the hit whose hash is cached already (a block vLLM recomputes because a
    /// prompt's last token is always computed): the request holds its own copy.
    pub private: u64,
}

impl PrefixCache {
    /// How much of `hashes` is cached, at most `max_hit` blocks.
    pub(crate) fn lookup(&self, hashes: &[u64], max_hit: usize) -> Lookup {
        let hit = hashes
            .iter()
            .take(max_hit)
            .take_while(|h| self.blocks.contains_key(h))
            .count();
        let revived = hashes[..hit]
            .iter()
            .filter(|h| self.blocks.get(h).is_some_and(|b| b.refs == 0))
            .count() as u64;
        let private = hashes[hit..]
            .iter()
            .filter(|h| self.blocks.contains_key(h))
            .count() as u64;
        let new = (hashes.len() - hit) as u64 - private;
        Lookup {
            hit,
            claimed: revived + new,
            private,
        }
    }

    /// Takes a reference on the first `hit` blocks and caches the prompt's uncached blocks;
    /// returns the blocks now held, to give back with [`Self::release`].
    pub(crate) fn acquire(&mut self, hashes: &[u64], hit: usize) -> Vec<u64> {
        let mut held = Vec::with_capacity(hashes.len());
        for (i, h) in hashes.iter().enumerate() {
            match self.blocks.get_mut(h) {
                Some(b) if i < hit => {
                    if b.refs == 0 {
                        self.free.remove(&b.freed_at);
                    }
                    b.refs += 1;
                }
                Some(_) => continue,
                None => {
                    self.blocks.insert(
                        *h,
                        Block {
                            refs: 1,
                            freed_at: 0,
                        },
                    );
                }
            }
            held.push(*h);
        }
        held
    }

    /// Drops one reference on each held block; blocks nobody uses any more become evictable,
    /// the prompt's tail first (as vLLM frees a request's blocks in reverse), since a tail is
    /// the least likely part to be shared.
    pub(crate) fn release(&mut self, held: &[u64]) {
        for h in held.iter().rev() {
            let Some(b) = self.blocks.get_mut(h) else {
                continue;
            };
            b.refs = b.refs.saturating_sub(1);
            if b.refs == 0 {
                self.clock += 1;
                b.freed_at = self.clock;
                self.free.insert(self.clock, *h);
            }
        }
    }

    /// Evicts least recently freed blocks until at most `keep` free ones remain.
    pub(crate) fn evict_to(&mut self, keep: u64) {
        while self.free.len() as u64 > keep {
            let Some((_, h)) = self.free.pop_first() else {
                break;
            };
            self.blocks.remove(&h);
        }
    }

    /// Blocks some running request uses.
    pub(crate) fn used_blocks(&self) -> u64 {
        (self.blocks.len() - self.free.len()) as u64
    }

    /// Cached blocks nobody uses: free KV that still holds a prefix.
    pub(crate) fn free_blocks(&self) -> u64 {
        self.free.len() as u64
    }

    /// vLLM's `reset_prefix_cache`: forgets every cached block, but only when none is in use.
    pub(crate) fn reset(&mut self) -> bool {
        if self.used_blocks() > 0 {
            return false;
        }
        self.blocks.clear();
        self.free.clear();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shared_heads_are_reference_counted_and_stay_cached() {
        let mut c = PrefixCache::default();
        assert_eq!(
            c.lookup(&[1, 2, 3], 3),
            Lookup {
                hit: 0,
                claimed: 3,
                private: 0
            }
        );
        let a = c.acquire(&[1, 2, 3], 0);
        // A second prompt sharing two blocks claims only its own third one.
        let l = c.lookup(&[1, 2, 4], 3);
        assert_eq!(
            l,
            Lookup {
                hit: 2,
                claimed: 1,
                private: 0
            }
        );
        let b = c.acquire(&[1, 2, 4], l.hit);
        assert_eq!((c.used_blocks(), c.free_blocks()), (4, 0));
        c.release(&a);
        assert_eq!((c.used_blocks(), c.free_blocks()), (3, 1));
        c.release(&b);
        assert_eq!((c.used_blocks(), c.free_blocks()), (0, 4));

        // Free hits come back into use and count as claimed again.
        assert_eq!(
            c.lookup(&[1, 2, 3], 3),
            Lookup {
                hit: 3,
                claimed: 3,
                private: 0
            }
        );
    }

    #[test]
    fn the_capped_last_block_is_a_private_copy() {
        let mut c = PrefixCache::default();
        let a = c.acquire(&[1, 2], 0);
        // The same prompt again may only hit its first block: its last is recomputed.
        let l = c.lookup(&[1, 2], 1);
        assert_eq!(
            l,
            Lookup {
                hit: 1,
                claimed: 0,
                private: 1
            }
        );
        let b = c.acquire(&[1, 2], l.hit);
        assert_eq!(b, vec![1]);
        c.release(&b);
        c.release(&a);
        assert_eq!((c.used_blocks(), c.free_blocks()), (0, 2));
    }

    #[test]
    fn eviction_takes_the_oldest_tails_first_and_reset_needs_no_users() {
        let mut c = PrefixCache::default();
        let a = c.acquire(&[1, 2, 3], 0);
        let b = c.acquire(&[7, 8], 0);
        c.release(&a);
        assert!(!c.reset());
        c.release(&b);
        c.evict_to(3);
        // a was freed first, tail first: 3 and 2 went, 1 stays.
        assert_eq!(c.lookup(&[1, 2, 3], 3).hit, 1);
        assert_eq!(c.lookup(&[7, 8], 2).hit, 2);
        c.evict_to(0);
        assert_eq!(c.free_blocks(), 0);
        let d = c.acquire(&[5], 0);
        assert!(!c.reset());
        c.release(&d);
        assert!(c.reset());
        assert_eq!(c.lookup(&[5], 1).hit, 0);
    }
}
