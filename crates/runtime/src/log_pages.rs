//! Keeps the request log's pages from piling up in the page cache when stderr is a regular file
//! (`sluice serve 2>>sluice.log`, systemd's `StandardError=append:`).
//!
//! Without a ledger every request writes a ~1 KB line, so the file grows by tens of MB a second
//! and every byte lands in a page-cache page that is never read again. Those pages evict what
//! is worth caching (a co-located PostgreSQL's tables), and each new one is a fresh page: on a
//! virtual machine whose host backs memory lazily and takes freed pages back (virtio-balloon free
//! page reporting), the first write to such a page costs a host-side fault, 35× a reused page's
//! write on the bench machine (`bench/first_touch.sh`: 180 vs 6,300 MB/s), paid by the log
//! thread on the proxy's cores. So the writer starts writeback of each chunk as it completes
//! and drops the chunk before it (written back by then) from the cache: the log then cycles
//! through a few MiB of the same pages, which the allocator hands straight back.
//!
//! A pipe, a terminal or `/dev/null` is left alone (there is no page cache behind them).

use std::os::fd::RawFd;

/// Bytes between two writeback starts. Large enough that the syscalls cost nothing per line
/// (one pair per ~4,000 lines), small enough that the pages cycled stay a few MiB.
const CHUNK: i64 = 4 << 20;

pub struct PageRecycler {
    fd: RawFd,
    /// The file offset up to which writeback has been started.
    started: i64,
    /// Where this writer began (or the file was last truncated to): drops start here.
    base: i64,
}

impl PageRecycler {
    /// A recycler for `fd` when it is a regular file; `None` for anything else.
    pub fn for_fd(fd: RawFd) -> Option<Self> {
        // SAFETY: fstat writes only into the zeroed struct it is given.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstat(fd, &mut st) } != 0 || st.st_mode & libc::S_IFMT != libc::S_IFREG {
            return None;
        }
        let at = Self::position(fd)?;
        Some(Self {
            fd,
            started: at,
            base: at,
        })
    }

    fn position(fd: RawFd) -> Option<i64> {
        // SAFETY: lseek only reads the descriptor's offset.
        let at = unsafe { libc::lseek(fd, 0, libc::SEEK_CUR) };
        (at >= 0).then_some(at as i64)
    }

    /// Called after each flush of the writer's buffer to the file.
    pub fn after_flush(&mut self) {
        let Some(end) = Self::position(self.fd) else {
            return;
        };
        if end < self.started {
            // Truncated under us (logrotate's copytruncate): start over from there.
            self.started = end;
            self.base = end;
            return;
        }
        if end - self.started < CHUNK {
            return;
        }
        // SAFETY: both calls only act on the page cache of the descriptor's file; an error
        // (an old kernel, a file system without support) leaves the cache as it was.
        unsafe {
            // What was started one chunk ago has reached the disk or is about to: dirty pages
            // and pages under writeback are skipped by DONTNEED, so nothing unwritten is lost.
            // The range starts at the base, not at the last drop: a page a slow disk still had
            // under writeback then is dropped now (the kernel walks only the cached pages).
            if self.started > self.base {
                libc::posix_fadvise(
                    self.fd,
                    self.base,
                    self.started - self.base,
                    libc::POSIX_FADV_DONTNEED,
                );
            }
            libc::sync_file_range(
                self.fd,
                self.started,
                end - self.started,
                libc::SYNC_FILE_RANGE_WRITE,
            );
        }
        self.started = end;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;

    /// Pages of `file` in the page cache, from mincore over a mapping of it.
    fn cached_pages(file: &std::fs::File, len: usize) -> usize {
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        // SAFETY: a read-only shared mapping of a file we hold open, unmapped below.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED,
                file.as_raw_fd(),
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        let mut vec = vec![0u8; len.div_ceil(page)];
        assert_eq!(unsafe { libc::mincore(addr, len, vec.as_mut_ptr()) }, 0);
        unsafe { libc::munmap(addr, len) };
        vec.iter().filter(|&&b| b & 1 == 1).count()
    }

    #[test]
    fn a_growing_log_file_keeps_only_its_last_chunks_cached_and_loses_no_byte() {
        // Not std::env::temp_dir(): a tmpfs /tmp has no page cache to give back.
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("target")
            .join(format!("sluice-log-pages-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("log");
        let mut file = std::fs::File::create(&path).unwrap();
        let mut r = PageRecycler::for_fd(file.as_raw_fd()).expect("a regular file");
        let line = [b'x'; 1023];
        let mut written = 0;
        let mut write_chunks = |n: usize, file: &mut std::fs::File, r: &mut PageRecycler| {
            for _ in 0..n * CHUNK as usize / (256 * 1024) {
                for _ in 0..256 {
                    file.write_all(&line).unwrap();
                    file.write_all(b"\n").unwrap();
                    written += 1024;
                }
                r.after_flush();
            }
        };
        write_chunks(8, &mut file, &mut r);
        // The writeback started along the way finishes at the disk's pace; once it has, the
        // next chunk's flush drops every page before the last start.
        file.sync_all().unwrap();
        write_chunks(1, &mut file, &mut r);
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let cached = cached_pages(&std::fs::File::open(&path).unwrap(), written) * page;
        assert!(
            cached <= 3 * CHUNK as usize,
            "{} of {} KiB still cached",
            cached / 1024,
            written / 1024
        );
        let back = std::fs::read(&path).unwrap();
        assert_eq!(back.len(), written);
        assert!(back
            .chunks(1024)
            .all(|c| c[..1023] == line && c[1023] == b'\n'));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn pipes_are_left_alone() {
        let mut fds = [0; 2];
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        assert!(PageRecycler::for_fd(fds[1]).is_none());
        unsafe {
            libc::close(fds[0]);
            libc::close(fds[1]);
        }
    }
}
