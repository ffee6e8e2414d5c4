//! The global allocator of both binaries: mimalloc, called the way its own `malloc` is.
//!
//! Pingora's worker threads allocate and free per-request buffers across threads; glibc's arenas
//! serialise that (futex waits in the profile), mimalloc's thread-local free lists do not.
//!
//! The `mimalloc` crate's allocator passes every Rust allocation to `mi_malloc_aligned`, even an
//! alignment of 1 or 8 that every mimalloc block already has. That call's fast path covers only
//! blocks up to 1 KiB whose free-list head happens to be aligned; every larger one (Pingora's
//! header and body buffers, the log line, boxed futures) takes its generic path and, unless its
//! size is a power of two, the over-allocating fallback, which rounds the size up by the
//! alignment. Word alignment is guaranteed by `mi_malloc` for every size (block sizes are whole
//! words), so only stricter alignments go to the aligned calls.

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;
use libmimalloc_sys as ffi;

/// What every `mi_malloc` block is aligned to.
const WORD: usize = core::mem::size_of::<usize>();

pub struct Allocator;

// SAFETY: each method forwards to mimalloc, which returns blocks of at least the requested size
// aligned to at least `WORD`, and to the requested alignment through the aligned calls; every
// pointer it returns, aligned or not, is freed by `mi_free`.
unsafe impl GlobalAlloc for Allocator {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= WORD {
            ffi::mi_malloc(layout.size()) as *mut u8
        } else {
            ffi::mi_malloc_aligned(layout.size(), layout.align()) as *mut u8
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.align() <= WORD {
            ffi::mi_zalloc(layout.size()) as *mut u8
        } else {
            ffi::mi_zalloc_aligned(layout.size(), layout.align()) as *mut u8
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        ffi::mi_free(ptr as *mut c_void);
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if layout.align() <= WORD {
            ffi::mi_realloc(ptr as *mut c_void, new_size) as *mut u8
        } else {
            ffi::mi_realloc_aligned(ptr as *mut c_void, new_size, layout.align()) as *mut u8
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every size class boundary and both paths keep the alignment asked for and the bytes
    /// written, through growth and shrinking.
    #[test]
    fn alignment_and_contents_survive_alloc_and_realloc() {
        let a = Allocator;
        for align in [1, 2, 4, 8, 16, 64, 4096] {
            for size in [1, 7, 8, 24, 100, 1024, 1025, 4097, 70_000, 3 << 20] {
                let layout = Layout::from_size_align(size, align).unwrap();
                unsafe {
                    let p = a.alloc(layout);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "size {size} align {align}");
                    for i in 0..size {
                        *p.add(i) = (i % 251) as u8;
                    }
                    let grown = size * 2 + 3;
                    let q = a.realloc(p, layout, grown);
                    assert_eq!(q as usize % align, 0, "realloc to {grown}, align {align}");
                    assert!((0..size).all(|i| *q.add(i) == (i % 251) as u8));
                    let shrunk = (size / 2).max(1);
                    let r = a.realloc(q, Layout::from_size_align(grown, align).unwrap(), shrunk);
                    assert_eq!(r as usize % align, 0);
                    assert!((0..shrunk).all(|i| *r.add(i) == (i % 251) as u8));
                    a.dealloc(r, Layout::from_size_align(shrunk, align).unwrap());

                    let z = a.alloc_zeroed(layout);
                    assert_eq!(z as usize % align, 0);
                    assert!((0..size).all(|i| *z.add(i) == 0));
                    a.dealloc(z, layout);
                }
            }
        }
    }
}
