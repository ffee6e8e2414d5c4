//! The append-only spool: rows PostgreSQL could not take yet, kept on local disk as JSON lines
//! and replayed in the order they were appended once it is back.
//!
//! The spool is a queue of segment files `<prefix><seq>.jsonl` in the spool directory. Appends
//! go to the newest segment this process owns (a new one past the rotation size); replay reads
//! from the oldest. Reading never removes anything: [`Spool::commit`] advances the read position
//! only after the rows were committed to PostgreSQL, and a segment file is deleted only once all
//! its rows were. A crash in between replays a few rows twice, which the INSERT's
//! `ON CONFLICT … DO NOTHING` absorbs.
//!
//! Each process holds an exclusive `flock` on the segments it owns. Segments in the directory
//! that nobody holds belong to a process that exited (or a previous run of this one): they are
//! adopted, in sequence order, ahead of this process's own rows. The prefix names the database
//! and schema, so a spool directory shared by differently configured instances never replays
//! rows into the wrong database.

use super::row::LedgerRow;
use std::borrow::Borrow;
use std::collections::VecDeque;
use std::fs::{File, OpenOptions, TryLockError};
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

const SUFFIX: &str = ".jsonl";

struct Segment {
    seq: u64,
    path: PathBuf,
    /// Opened read + append and `flock`ed for as long as this process owns the segment.
    file: File,
    len: u64,
    /// Offset up to which rows are committed.
    read_at: u64,
    /// Lines after `read_at`.
    rows: u64,
    /// No more appends: adopted from another process or rotated.
    sealed: bool,
}

/// Rows read from the front of the spool, not yet committed.
#[derive(Debug)]
pub struct Peek {
    seq: u64,
    end: u64,
    lines: u64,
    pub rows: Vec<LedgerRow>,
    /// Lines that were not a row (a torn last line after a crash); skipped on commit.
    pub corrupt: u64,
}

/// What [`Spool::append`] did with the rows it was given.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    pub written: u64,
    /// Rows refused because the spool reached its size limit.
    pub dropped: u64,
}

pub struct Spool {
    dir: PathBuf,
    prefix: String,
    max_bytes: u64,
    rotate_bytes: u64,
    segments: VecDeque<Segment>,
    last_seq: u64,
}

/// Reads a file at an offset without moving any shared cursor.
struct ReadAt<'a> {
    file: &'a File,
    pos: u64,
}

impl Read for ReadAt<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.file.read_at(buf, self.pos)?;
        self.pos += n as u64;
        Ok(n)
    }
}

fn count_lines(file: &File, from: u64) -> io::Result<u64> {
    let mut reader = BufReader::new(ReadAt { file, pos: from });
    let mut lines = 0;
    let mut last = b'\n';
    loop {
        let buf = reader.fill_buf()?;
        if buf.is_empty() {
            break;
        }
        lines += buf.iter().filter(|&&b| b == b'\n').count() as u64;
        last = buf[buf.len() - 1];
        let n = buf.len();
        reader.consume(n);
    }
    Ok(lines + u64::from(last != b'\n'))
}

/// `Ok(true)` when this process now holds the lock, `Ok(false)` when another one does.
fn try_lock(file: &File) -> io::Result<bool> {
    match file.try_lock() {
        Ok(()) => Ok(true),
        Err(TryLockError::WouldBlock) => Ok(false),
        Err(TryLockError::Error(e)) => Err(e),
    }
}

impl Spool {
    /// Opens (creating) the spool directory and adopts the segments no live process holds.
    /// `prefix` names the database and schema; `max_bytes` bounds the disk used.
    pub fn open(dir: &Path, prefix: &str, max_bytes: u64) -> io::Result<Spool> {
        std::fs::create_dir_all(dir)?;
        let mut spool = Spool {
            dir: dir.to_path_buf(),
            prefix: prefix.to_string(),
            max_bytes,
            rotate_bytes: (max_bytes / 8).clamp(64 * 1024, 16 * 1024 * 1024),
            segments: VecDeque::new(),
            last_seq: 0,
        };
        spool.adopt_orphans()?;
        Ok(spool)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Ledger segments in the directory under another prefix (another database or schema,
    /// possibly this one's before its host or port changed): never replayed here.
    pub fn foreign_segments(&self) -> usize {
        std::fs::read_dir(&self.dir).map_or(0, |entries| {
            entries
                .filter_map(Result::ok)
                .filter(|e| {
                    e.file_name().to_str().is_some_and(|n| {
                        n.starts_with("ledger-")
                            && n.ends_with(SUFFIX)
                            && !n.starts_with(self.prefix.as_str())
                    })
                })
                .count()
        })
    }

    /// Adopts segments in the directory that no process holds; returns the rows they add.
    pub fn adopt_orphans(&mut self) -> io::Result<u64> {
        let mut found = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let entry = entry?;
            let name = entry.file_name();
            let Some(seq) = name
                .to_str()
                .and_then(|n| n.strip_prefix(self.prefix.as_str()))
                .and_then(|n| n.strip_suffix(SUFFIX))
                .and_then(|n| n.parse::<u64>().ok())
            else {
                continue;
            };
            if self.segments.iter().any(|s| s.seq == seq) {
                continue;
            }
            found.push((seq, entry.path()));
        }
        found.sort();
        let mut added = 0;
        for (seq, path) in found {
            let file = match OpenOptions::new().read(true).append(true).open(&path) {
                Ok(f) => f,
                // Its owner finished replaying it and deleted it between listing and opening.
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            if !try_lock(&file)? {
                continue;
            }
            let len = file.metadata()?.len();
            if len == 0 {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            let rows = count_lines(&file, 0)?;
            added += rows;
            self.last_seq = self.last_seq.max(seq);
            let at = self
                .segments
                .iter()
                .position(|s| s.seq > seq)
                .unwrap_or(self.segments.len());
            self.segments.insert(
                at,
                Segment {
                    seq,
                    path,
                    file,
                    len,
                    read_at: 0,
                    rows,
                    sealed: true,
                },
            );
        }
        Ok(added)
    }

    /// Rows waiting to be replayed.
    pub fn rows(&self) -> u64 {
        self.segments.iter().map(|s| s.rows).sum()
    }

    /// Bytes on disk, committed prefixes of live segments included.
    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.len).sum()
    }

    pub fn is_empty(&self) -> bool {
        self.rows() == 0
    }

    fn new_segment(&mut self) -> io::Result<&mut Segment> {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        let mut seq = now.max(self.last_seq + 1);
        let (path, file) = loop {
            let path = self.dir.join(format!("{}{seq:020}{SUFFIX}", self.prefix));
            match OpenOptions::new()
                .read(true)
                .append(true)
                .create_new(true)
                .open(&path)
            {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => seq += 1,
                Err(e) => return Err(e),
            }
        };
        // A filesystem without flock still spools; it only loses the guard against two
        // processes adopting the same orphan (which replays rows twice, harmlessly).
        let _ = try_lock(&file);
        self.last_seq = seq;
        self.segments.push_back(Segment {
            seq,
            path,
            file,
            len: 0,
            read_at: 0,
            rows: 0,
            sealed: false,
        });
        let last = self.segments.len() - 1;
        Ok(&mut self.segments[last])
    }

    fn active(&mut self) -> io::Result<&mut Segment> {
        let rotate = self.rotate_bytes;
        let usable = match self.segments.back_mut() {
            Some(s) if !s.sealed && s.len < rotate => true,
            Some(s) => {
                s.sealed = true;
                false
            }
            None => false,
        };
        if !usable {
            return self.new_segment();
        }
        let last = self.segments.len() - 1;
        Ok(&mut self.segments[last])
    }

    /// Appends rows at the end, in order, and syncs them to disk. Rows that would take the spool
    /// past its size limit are refused and counted in [`Appended::dropped`]; on an I/O error
    /// nothing of this call is kept.
    pub fn append<R: Borrow<LedgerRow>>(&mut self, rows: &[R]) -> io::Result<Appended> {
        let mut out = Appended::default();
        let mut buf = Vec::new();
        let used = self.bytes();
        for row in rows {
            let line = serde_json::to_vec(row.borrow()).map_err(io::Error::other)?;
            if used + (buf.len() + line.len() + 1) as u64 > self.max_bytes {
                out.dropped += 1;
                continue;
            }
            buf.extend_from_slice(&line);
            buf.push(b'\n');
            out.written += 1;
        }
        if buf.is_empty() {
            return Ok(out);
        }
        let seg = self.active()?;
        let before = seg.len;
        let written = seg.file.write_all(&buf).and_then(|()| seg.file.sync_data());
        if let Err(e) = written {
            // Never leave a torn line behind: the next append would glue onto it.
            let _ = seg.file.set_len(before);
            return Err(e);
        }
        seg.len += buf.len() as u64;
        seg.rows += out.written;
        Ok(out)
    }

    /// Reads up to `max_rows` rows from the front segment without consuming them.
    pub fn peek(&mut self, max_rows: usize) -> io::Result<Option<Peek>> {
        loop {
            let Some(seg) = self.segments.front() else {
                return Ok(None);
            };
            if seg.read_at >= seg.len {
                self.pop_front();
                continue;
            }
            let mut reader = BufReader::new(ReadAt {
                file: &seg.file,
                pos: seg.read_at,
            });
            let mut peek = Peek {
                seq: seg.seq,
                end: seg.read_at,
                lines: 0,
                rows: Vec::new(),
                corrupt: 0,
            };
            let mut line = Vec::new();
            while peek.rows.len() < max_rows.max(1) && peek.end < seg.len {
                line.clear();
                let n = reader.read_until(b'\n', &mut line)?;
                if n == 0 {
                    break;
                }
                peek.end += n as u64;
                peek.lines += 1;
                let complete = line.last() == Some(&b'\n');
                match serde_json::from_slice::<LedgerRow>(&line) {
                    Ok(row) if complete => peek.rows.push(row),
                    _ => peek.corrupt += 1,
                }
            }
            return Ok(Some(peek));
        }
    }

    /// Marks a peeked range committed; deletes the segment once all of it is. A peek from a
    /// segment that is no longer at the front is ignored (its rows will be read again).
    pub fn commit(&mut self, peek: &Peek) {
        let Some(seg) = self.segments.front_mut() else {
            return;
        };
        if seg.seq != peek.seq || peek.end <= seg.read_at {
            return;
        }
        seg.read_at = peek.end;
        seg.rows = seg.rows.saturating_sub(peek.lines);
        if seg.read_at >= seg.len {
            self.pop_front();
        }
    }

    fn pop_front(&mut self) {
        if let Some(seg) = self.segments.pop_front() {
            // Delete before the handle (and its lock) goes, so no other process adopts a
            // segment whose rows are already committed.
            let _ = std::fs::remove_file(&seg.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "sluice-spool-unit-{name}-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    fn rows(from: usize, n: usize) -> Vec<LedgerRow> {
        (from..from + n)
            .map(|i| LedgerRow {
                // Fixed width, so every line has the same length (the size-limit test counts).
                request_id: format!("r{i:06}"),
                received_at_ms: 1_000_000 + i as u64,
                latency_ms: 1.0,
                ..Default::default()
            })
            .collect()
    }

    fn ids(rows: &[LedgerRow]) -> Vec<String> {
        rows.iter().map(|r| r.request_id.clone()).collect()
    }

    fn drain(spool: &mut Spool, batch: usize) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(p) = spool.peek(batch).unwrap() {
            out.extend(ids(&p.rows));
            spool.commit(&p);
        }
        out
    }

    fn files(d: &Path) -> usize {
        std::fs::read_dir(d).map_or(0, |r| r.count())
    }

    #[test]
    fn append_then_replay_in_order_across_rotations() {
        let d = dir("order");
        let mut s = Spool::open(&d, "ledger-x-", 64 * 1024 * 8).unwrap();
        // Each row is ~700 bytes: a few hundred rows span several 64 KiB segments.
        for chunk in 0..6 {
            let a = s.append(&rows(chunk * 100, 100)).unwrap();
            assert_eq!(
                a,
                Appended {
                    written: 100,
                    dropped: 0
                }
            );
        }
        assert_eq!(s.rows(), 600);
        assert!(s.segments.len() > 1, "rotated");
        let got = drain(&mut s, 37);
        assert_eq!(got, ids(&rows(0, 600)));
        assert!(s.is_empty());
        assert_eq!(files(&d), 0, "committed segments are deleted");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn nothing_is_removed_until_committed() {
        let d = dir("commit");
        {
            let mut s = Spool::open(&d, "p-", 1 << 20).unwrap();
            s.append(&rows(0, 10)).unwrap();
            let p = s.peek(4).unwrap().unwrap();
            assert_eq!(ids(&p.rows), ids(&rows(0, 4)));
            // Not committed: the same rows come back.
            let again = s.peek(4).unwrap().unwrap();
            assert_eq!(ids(&again.rows), ids(&rows(0, 4)));
            s.commit(&again);
            assert_eq!(s.rows(), 6);
            // Dropped here without committing the rest: a crash.
        }
        // The next start adopts the orphan and replays it whole (rows 0..4 included: the
        // commit offset is not persisted, and the database ignores the duplicates).
        let mut s = Spool::open(&d, "p-", 1 << 20).unwrap();
        assert_eq!(s.rows(), 10);
        assert_eq!(drain(&mut s, 100), ids(&rows(0, 10)));
        assert_eq!(files(&d), 0);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn size_limit_drops_and_counts() {
        let d = dir("limit");
        let mut s = Spool::open(&d, "p-", 64 * 1024).unwrap();
        let line = serde_json::to_vec(&rows(0, 1)[0]).unwrap().len() as u64 + 1;
        let fit = 64 * 1024 / line;
        let a = s.append(&rows(0, fit as usize + 5)).unwrap();
        assert_eq!(a.written, fit);
        assert_eq!(a.dropped, 5);
        assert!(s.bytes() <= 64 * 1024);
        let a = s.append(&rows(1000, 3)).unwrap();
        assert_eq!(
            a,
            Appended {
                written: 0,
                dropped: 3
            }
        );
        // Replaying frees room again.
        drain(&mut s, 1000);
        assert_eq!(s.append(&rows(2000, 3)).unwrap().written, 3);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn live_segments_are_not_adopted_and_orphans_come_first() {
        let d = dir("adopt");
        {
            let mut old = Spool::open(&d, "p-", 1 << 20).unwrap();
            old.append(&rows(0, 3)).unwrap();
        }
        let mut live = Spool::open(&d, "p-", 1 << 20).unwrap();
        assert_eq!(live.rows(), 3, "the previous run's rows are adopted");
        live.append(&rows(3, 2)).unwrap();
        let mut other = Spool::open(&d, "p-", 1 << 20).unwrap();
        assert_eq!(
            other.rows(),
            0,
            "segments held by a live process stay with it"
        );
        assert_eq!(other.adopt_orphans().unwrap(), 0);
        let mut foreign = Spool::open(&d, "q-", 1 << 20).unwrap();
        assert_eq!(
            foreign.adopt_orphans().unwrap(),
            0,
            "another database's prefix"
        );
        assert_eq!(drain(&mut live, 2), ids(&rows(0, 5)));
        drop((other, foreign));
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn a_torn_last_line_is_skipped() {
        let d = dir("torn");
        {
            let mut s = Spool::open(&d, "p-", 1 << 20).unwrap();
            s.append(&rows(0, 2)).unwrap();
            let path = s.segments[0].path.clone();
            let mut f = OpenOptions::new().append(true).open(path).unwrap();
            f.write_all(b"{\"request_id\":\"half").unwrap();
        }
        let mut s = Spool::open(&d, "p-", 1 << 20).unwrap();
        assert_eq!(s.rows(), 3);
        let p = s.peek(10).unwrap().unwrap();
        assert_eq!(ids(&p.rows), ids(&rows(0, 2)));
        assert_eq!(p.corrupt, 1);
        s.commit(&p);
        assert!(s.is_empty());
        assert_eq!(files(&d), 0);
        let _ = std::fs::remove_dir_all(&d);
    }
}
