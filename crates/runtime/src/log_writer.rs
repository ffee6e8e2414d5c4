//! Sluice's log output (the per-request JSON line and every other log record), written off the
//! request path. A synchronous write to stderr stalls a worker thread whenever the reader of
//! that pipe (kubelet, journald, a terminal) is slow, and costs a locked syscall per request even
//! when it is fast. Records go into a bounded queue instead, and one thread writes them in
//! batches; all output goes through that one thread, so lines never interleave. When the queue is
//! full a record is dropped and counted (`sluice_log_lines_dropped_total`): decisions themselves
//! are kept by the ring and the ledger, so the log is what may give way under a stalled reader.

use crate::log_pages::PageRecycler;
use sluice_record::decision::DecisionRecord;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TryRecvError, TrySendError};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Records held while the writer is behind. A request's is its decision record (840 bytes plus
/// its strings, shared with the ring until the ring lets it go), so a stalled reader holds at
/// most ~60 MiB.
const QUEUE_RECORDS: usize = 64 * 1024;
/// Records written per flush at most, so a busy stream still reaches the reader promptly.
const BATCH_RECORDS: usize = 512;
/// While records keep coming, the writer polls at this pace instead of blocking: a blocked
/// receiver must be woken by the sender (a futex call and a context switch per request). Each
/// poll is a timed sleep, which cost ~30 % of this thread's CPU at a 2 ms pace (a flame graph of
/// the overhead bench); a line that waits 10 ms costs no reader anything.
const BUSY_POLL: Duration = Duration::from_millis(10);
/// Empty polls in a row before the writer blocks again.
const IDLE_POLLS: u32 = 5;

enum Msg {
    Record(Vec<u8>),
    /// A request's decision record, encoded into its JSON line here, on the writer thread:
    /// encoding it on a worker was a tenth of the request path's instructions, spread through
    /// every request; here it runs in batches, off the request path. The flag says whether the
    /// line carries the policy inputs.
    Decision(Arc<DecisionRecord>, bool),
    Flush(SyncSender<()>),
}

pub struct LogWriter {
    tx: SyncSender<Msg>,
    dropped: AtomicU64,
}

/// `None` when the writer thread could not be started (logging then stays off).
static STDERR: OnceLock<Option<LogWriter>> = OnceLock::new();

impl LogWriter {
    /// A writer thread over `out`, queueing up to `records`; `pages` recycles `out`'s page cache
    /// when it is a regular file (the process's stderr).
    fn spawn<W: Write + Send + 'static>(
        out: W,
        records: usize,
        pages: Option<PageRecycler>,
    ) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel(records);
        std::thread::Builder::new()
            .name("sluice-log".into())
            .spawn(move || write_records(rx, out, pages))?;
        Ok(Self {
            tx,
            dropped: AtomicU64::new(0),
        })
    }

    /// Never blocks. `record` is written as is (it carries its own newline).
    pub fn write(&self, record: Vec<u8>) {
        self.send(Msg::Record(record));
    }

    /// Never blocks. Writes `record` as one JSON line ([`sluice_record::line::write_record_packed`]),
    /// with its policy inputs when `with_inputs`.
    pub fn write_decision(&self, record: Arc<DecisionRecord>, with_inputs: bool) {
        self.send(Msg::Decision(record, with_inputs));
    }

    fn send(&self, msg: Msg) {
        if let Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) = self.tx.try_send(msg) {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::Relaxed)
    }

    /// Waits (blocking) until everything queued before the call is written, or `timeout`.
    pub fn flush(&self, timeout: Duration) -> bool {
        let (ack, done) = sync_channel(1);
        let deadline = std::time::Instant::now() + timeout;
        let mut msg = Msg::Flush(ack);
        loop {
            match self.tx.try_send(msg) {
                Ok(()) => break,
                Err(TrySendError::Full(m)) if std::time::Instant::now() < deadline => {
                    msg = m;
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(_) => return false,
            }
        }
        done.recv_timeout(deadline.saturating_duration_since(std::time::Instant::now()))
            .is_ok()
    }
}

/// The process's stderr writer, started on first use.
pub fn stderr() -> Option<&'static LogWriter> {
    STDERR
        .get_or_init(|| {
            let pages = PageRecycler::for_fd(std::io::stderr().as_raw_fd());
            LogWriter::spawn(std::io::stderr(), QUEUE_RECORDS, pages).ok()
        })
        .as_ref()
}

fn started() -> Option<&'static LogWriter> {
    STDERR.get().and_then(Option::as_ref)
}

/// Records dropped by the stderr writer so far (0 when it never started).
pub fn stderr_dropped() -> u64 {
    started().map_or(0, LogWriter::dropped)
}

/// Flushes the stderr writer before the process exits (drain, shutdown).
pub fn flush_stderr(timeout: Duration) {
    if let Some(w) = started() {
        w.flush(timeout);
    }
}

/// `env_logger`'s target: each formatted record becomes one queued write.
pub struct Pipe(pub &'static LogWriter);

impl Write for Pipe {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf.to_vec());
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn write_records<W: Write>(rx: Receiver<Msg>, out: W, mut pages: Option<PageRecycler>) {
    let mut out = std::io::BufWriter::with_capacity(256 * 1024, out);
    // One line's buffer, reused for every decision record.
    let mut line = Vec::with_capacity(2048);
    let mut idle = 0;
    // Ends when the writer is dropped (never, for the process-wide one).
    loop {
        let first = match rx.try_recv() {
            Ok(msg) => msg,
            Err(TryRecvError::Disconnected) => break,
            Err(TryRecvError::Empty) if idle < IDLE_POLLS => {
                idle += 1;
                std::thread::sleep(BUSY_POLL);
                continue;
            }
            Err(TryRecvError::Empty) => match rx.recv() {
                Ok(msg) => msg,
                Err(_) => break,
            },
        };
        idle = 0;
        let mut next = Some(first);
        let mut n = 0;
        let mut acks = Vec::new();
        while let Some(msg) = next {
            match msg {
                Msg::Record(r) => {
                    let _ = out.write_all(&r);
                }
                Msg::Decision(record, with_inputs) => {
                    line.clear();
                    sluice_record::line::write_record_packed(&mut line, &record, with_inputs);
                    line.push(b'\n');
                    let _ = out.write_all(&line);
                }
                Msg::Flush(ack) => acks.push(ack),
            }
            n += 1;
            next = if n < BATCH_RECORDS {
                rx.try_recv().ok()
            } else {
                None
            };
        }
        let _ = out.flush();
        if let Some(p) = pages.as_mut() {
            p.after_flush();
        }
        for ack in acks {
            let _ = ack.try_send(());
        }
    }
    let _ = out.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Instant;

    #[derive(Clone, Default)]
    struct Shared(Arc<Mutex<Vec<u8>>>);

    impl Write for Shared {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    /// A reader that never reads: every write blocks until released.
    struct Stalled(Receiver<()>);

    impl Write for Stalled {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            let _ = self.0.recv();
            Err(std::io::ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn records_arrive_whole_and_in_order_and_flush_waits_for_them() {
        let out = Shared::default();
        let w = LogWriter::spawn(out.clone(), QUEUE_RECORDS, None).unwrap();
        let mut want = String::new();
        for i in 0..2000 {
            let line = format!("{{\"n\":{i}}}\n");
            want.push_str(&line);
            w.write(line.into_bytes());
        }
        assert!(w.flush(Duration::from_secs(5)));
        assert_eq!(
            String::from_utf8(out.0.lock().unwrap().clone()).unwrap(),
            want
        );
        assert_eq!(w.dropped(), 0);
    }

    #[test]
    fn a_stalled_reader_never_blocks_the_caller_and_drops_are_counted() {
        let (release, stall) = std::sync::mpsc::channel();
        let w = LogWriter::spawn(Stalled(stall), 100, None).unwrap();
        let started = Instant::now();
        // The writer takes at most one batch into its buffer before it blocks; the queue holds
        // 100 more; everything past that is dropped at once.
        let n = 100 + BATCH_RECORDS + 1000;
        for _ in 0..n {
            w.write(b"{}\n".to_vec());
        }
        assert!(started.elapsed() < Duration::from_secs(2), "never blocked");
        let dropped = w.dropped();
        assert!(
            (1000..=1000 + BATCH_RECORDS as u64).contains(&dropped),
            "dropped {dropped}"
        );
        assert!(!w.flush(Duration::from_millis(50)), "flush gives up");
        drop(release);
    }
}
