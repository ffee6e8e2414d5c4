//! Flame graphs of the overhead bench's proxies (issue 13 item 5): `perf record` of one proxy
//! process during one wrk run, folded by `inferno-collapse-perf`, drawn by `inferno-flamegraph`.
//!
//! perf samples the `cpu-clock` software event (no hardware counters on the bench machine) at
//! 999 Hz. Stacks are walked by frame pointers (`--call-graph fp`), so the binaries must be
//! built with `RUSTFLAGS="-C force-frame-pointers=yes"` (bench/flamegraphs.sh does, in its own
//! target directory). DWARF unwinding (`SLUICE_FLAME_CALL_GRAPH=dwarf,65528`) works on the
//! plain release build but stops at the first tokio task frame in ~90 % of the samples: Pingora's
//! request futures are polled in stack frames larger than the 64 KiB perf can copy, so the
//! request path appears as `[unknown]` roots. The folded stacks are also kept (gzipped) so the
//! shares quoted in bench/RESULTS.md can be re-read with [`shares`].

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// Sampling frequency: 999 Hz, not 1000, so the sampling does not beat with millisecond timers.
const FREQ: &str = "999";

/// perf's `--call-graph` mode: frame pointers unless `SLUICE_FLAME_CALL_GRAPH` says otherwise.
fn call_graph() -> String {
    std::env::var("SLUICE_FLAME_CALL_GRAPH").unwrap_or_else(|_| "fp".into())
}

/// The tools a flame graph needs, checked before any proxy starts.
pub fn check_tools() -> Result<(), String> {
    for (tool, hint) in [
        ("perf", "apt-get install linux-perf"),
        ("inferno-collapse-perf", "cargo install inferno --locked"),
        ("inferno-flamegraph", "cargo install inferno --locked"),
        ("gzip", "apt-get install gzip"),
    ] {
        let found = Command::new("sh")
            .args(["-c", &format!("command -v {tool}")])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !found {
            return Err(format!("{tool} is required for --flamegraphs ({hint})"));
        }
    }
    Ok(())
}

/// A running `perf record -p PID`, stopped by SIGINT (perf then writes its data and exits).
pub struct Recording {
    child: Option<Child>,
    pub data: PathBuf,
    log: PathBuf,
}

impl Recording {
    pub fn start(pid: u32, data: &Path) -> Result<Self, String> {
        let log = data.with_extension("perf.log");
        let out = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
        let err = out.try_clone().map_err(|e| e.to_string())?;
        let child = Command::new("perf")
            .args([
                "record",
                "-e",
                "cpu-clock",
                "-F",
                FREQ,
                "--call-graph",
                &call_graph(),
            ])
            .arg("-p")
            .arg(pid.to_string())
            .arg("-o")
            .arg(data)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| format!("cannot start perf: {e}"))?;
        // perf needs a moment to open its events on every thread before the load starts.
        std::thread::sleep(Duration::from_millis(500));
        let mut r = Self {
            child: Some(child),
            data: data.to_path_buf(),
            log,
        };
        if let Some(Ok(Some(status))) = r.child.as_mut().map(|c| c.try_wait()) {
            r.child = None;
            return Err(format!(
                "perf record exited ({status}): {}",
                std::fs::read_to_string(&r.log).unwrap_or_default().trim()
            ));
        }
        Ok(r)
    }

    /// Stops perf and waits until it has written its data.
    pub fn stop(mut self) -> Result<PathBuf, String> {
        let mut child = self.child.take().ok_or("perf is not running")?;
        interrupt(child.id());
        let status = child.wait().map_err(|e| e.to_string())?;
        // perf exits with the interrupt's status after writing its data; judge it by the file.
        let size = std::fs::metadata(&self.data).map(|m| m.len()).unwrap_or(0);
        if size == 0 {
            return Err(format!(
                "perf record ({status}) wrote no data: {}",
                std::fs::read_to_string(&self.log)
                    .unwrap_or_default()
                    .trim()
            ));
        }
        Ok(self.data.clone())
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            interrupt(c.id());
            let _ = c.wait();
        }
    }
}

fn interrupt(pid: u32) {
    let _ = Command::new("kill")
        .args(["-INT", &pid.to_string()])
        .status();
}

/// `perf script | inferno-collapse-perf`: the folded stacks of a recording, one
/// `thread;outermost;…;innermost count` line per distinct stack.
pub fn fold(data: &Path) -> Result<String, String> {
    let mut script = Command::new("perf")
        .args(["script", "--no-inline"])
        .arg("-i")
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run perf script: {e}"))?;
    let stdout = script.stdout.take().ok_or("perf script: no stdout")?;
    let collapse = Command::new("inferno-collapse-perf")
        .stdin(Stdio::from(stdout))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run inferno-collapse-perf: {e}"))?;
    let out = collapse.wait_with_output().map_err(|e| e.to_string())?;
    let _ = script.wait();
    if !out.status.success() || out.stdout.is_empty() {
        return Err(format!(
            "inferno-collapse-perf ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    String::from_utf8(out.stdout).map_err(|e| e.to_string())
}

/// Draws `folded` as an SVG; frames narrower than 0.5 % of the width are left out, which keeps
/// the file small without hiding anything worth reading.
pub fn draw(folded: &str, title: &str, svg: &Path) -> Result<(), String> {
    let out = std::fs::File::create(svg).map_err(|e| format!("{}: {e}", svg.display()))?;
    let mut child = Command::new("inferno-flamegraph")
        .args(["--minwidth", "0.5", "--hash", "--title", title])
        .stdin(Stdio::piped())
        .stdout(out)
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("cannot run inferno-flamegraph: {e}"))?;
    let written = child
        .stdin
        .take()
        .ok_or("inferno-flamegraph: no stdin")?
        .write_all(folded.as_bytes());
    let out = child.wait_with_output().map_err(|e| e.to_string())?;
    if !out.status.success() || written.is_err() {
        return Err(format!(
            "inferno-flamegraph ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

/// Writes `text` gzipped to `path`.
pub fn write_gz(text: &str, path: &Path) -> Result<(), String> {
    let out = std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let mut child = Command::new("gzip")
        .args(["-9", "-n"])
        .stdin(Stdio::piped())
        .stdout(out)
        .spawn()
        .map_err(|e| format!("cannot run gzip: {e}"))?;
    child
        .stdin
        .take()
        .ok_or("gzip: no stdin")?
        .write_all(text.as_bytes())
        .map_err(|e| e.to_string())?;
    match child.wait() {
        Ok(s) if s.success() => Ok(()),
        Ok(s) => Err(format!("gzip: {s}")),
        Err(e) => Err(e.to_string()),
    }
}

/// What one flame graph holds, read from its folded stacks.
#[derive(Debug, Default, PartialEq)]
pub struct Shares {
    /// The samples' weight (sum of periods: ns of CPU for cpu-clock).
    pub total: u64,
    /// Samples per thread name (the folded stacks' first frame), most first.
    pub threads: Vec<(String, u64)>,
    /// Samples whose stack contains the frame (inclusive, counted once per stack), most first.
    pub inclusive: Vec<(String, u64)>,
}

/// Reads folded stacks: totals per thread, and per frame for the frames `keep` accepts.
pub fn shares(folded: &str, keep: impl Fn(&str) -> bool) -> Shares {
    let mut total = 0;
    let mut threads: HashMap<String, u64> = HashMap::new();
    let mut inclusive: HashMap<&str, u64> = HashMap::new();
    for line in folded.lines() {
        let Some((stack, n)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(n) = n.parse::<u64>() else { continue };
        total += n;
        let mut frames = stack.split(';');
        if let Some(t) = frames.next() {
            *threads.entry(thread_group(t)).or_default() += n;
        }
        let mut seen = HashSet::new();
        for f in frames.filter(|f| keep(f)) {
            if seen.insert(f) {
                *inclusive.entry(f).or_default() += n;
            }
        }
    }
    let sorted = |m: HashMap<String, u64>| {
        let mut v: Vec<_> = m.into_iter().collect();
        v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        v
    };
    Shares {
        total,
        threads: sorted(threads),
        inclusive: sorted(
            inclusive
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        ),
    }
}

/// A thread's name without its per-instance number ("Pingora HTTP Proxy Service-3" and
/// "…-4" are one row; a runtime's workers differ only by it).
fn thread_group(name: &str) -> String {
    let trimmed = name.trim_end_matches(|c: char| c.is_ascii_digit() || c == '-' || c == '#');
    if trimmed.is_empty() {
        name.to_string()
    } else {
        trimmed.trim_end().to_string()
    }
}

/// Sluice's own frames (its binary's and its crates', and the bench's bare proxy's): the code
/// Pingora calls into.
pub fn is_own_frame(f: &str) -> bool {
    ["sluice::", "<sluice::", "sluice_", "<sluice_"]
        .iter()
        .any(|p| f.starts_with(p))
}

/// The markdown summary of one graph: threads, and the top `n` own frames by inclusive share.
pub fn summary(name: &str, s: &Shares, n: usize) -> String {
    let pct = |x: u64| 100.0 * x as f64 / s.total.max(1) as f64;
    let mut out = String::new();
    let _ = writeln!(out, "### {name} ({})\n", cpu(s.total));
    let _ = writeln!(out, "| thread | % of samples |\n|---|---|");
    for (t, c) in s.threads.iter().filter(|(_, c)| pct(*c) >= 0.5) {
        let _ = writeln!(out, "| {} | {:.1} |", t.replace('|', "/"), pct(*c));
    }
    let _ = writeln!(out, "\n| own frame (inclusive) | % of samples |\n|---|---|");
    for (f, c) in s.inclusive.iter().take(n) {
        let _ = writeln!(out, "| `{}` | {:.1} |", f.replace('|', "/"), pct(*c));
    }
    out.push('\n');
    out
}

/// The folded stacks' weight: inferno-collapse-perf sums the samples' periods, which for the
/// cpu-clock event are nanoseconds of CPU.
pub fn cpu(total: u64) -> String {
    format!(
        "{:.0} ms CPU, ~{:.0} samples",
        total as f64 / 1e6,
        total as f64 / 1e9 * 999.0
    )
}

/// The call-graph mode the recordings use, for the summary.
pub fn call_graph_mode() -> String {
    call_graph()
}

/// Shares of a few named frame families, for the comparison table: each is the share of
/// samples whose stack contains any frame with one of the substrings.
pub fn family_shares(folded: &str, families: &[(&str, &[&str])]) -> BTreeMap<String, f64> {
    let mut total = 0u64;
    let mut hits: BTreeMap<String, u64> = BTreeMap::new();
    for line in folded.lines() {
        let Some((stack, n)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(n) = n.parse::<u64>() else { continue };
        total += n;
        for (name, subs) in families {
            if subs.iter().any(|s| stack.contains(s)) {
                *hits.entry((*name).to_string()).or_default() += n;
            }
        }
    }
    families
        .iter()
        .map(|(name, _)| {
            let h = hits.get(*name).copied().unwrap_or(0);
            ((*name).to_string(), 100.0 * h as f64 / total.max(1) as f64)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const FOLDED: &str = "\
Pingora HTTP Pr-1;tokio::run;sluice_proxy::outcome::logging;sluice::log::json_line;memcpy 30
Pingora HTTP Pr-2;tokio::run;sluice_proxy::outcome::logging;write 10
Pingora HTTP Pr-2;tokio::run;<sluice_proxy::Sluice as pingora_proxy::ProxyHttp>::request_filter;sluice::a;sluice::a 20
BG ledger;sluice_ledger::writer::run 15
swapper;cpu_idle 25
";

    #[test]
    fn shares_count_threads_and_each_frame_once_per_stack() {
        let s = shares(FOLDED, is_own_frame);
        assert_eq!(s.total, 100);
        assert_eq!(s.threads[0], ("Pingora HTTP Pr".to_string(), 60));
        assert!(s.threads.contains(&("BG ledger".to_string(), 15)));
        assert_eq!(
            s.inclusive[0],
            ("sluice_proxy::outcome::logging".to_string(), 40)
        );
        // A recursive frame counts its stack once.
        assert!(s.inclusive.contains(&("sluice::a".to_string(), 20)));
        assert!(!s.inclusive.iter().any(|(f, _)| f == "tokio::run"));
        let md = summary("sluice", &s, 3);
        assert!(md.contains("| `sluice_proxy::outcome::logging` | 40.0 |"));
    }

    #[test]
    fn families_are_shares_of_all_samples() {
        let f = family_shares(
            FOLDED,
            &[
                ("log line", &["json_line"]),
                ("request path", &["request_filter", "outcome::logging"]),
                ("none", &["nothing"]),
            ],
        );
        assert_eq!(f["log line"], 30.0);
        assert_eq!(f["request path"], 60.0);
        assert_eq!(f["none"], 0.0);
    }

    #[test]
    fn thread_groups_drop_instance_numbers_only() {
        assert_eq!(thread_group("Pingora HTTP Pr-12"), "Pingora HTTP Pr");
        assert_eq!(thread_group("tokio-runtime-w"), "tokio-runtime-w");
        assert_eq!(thread_group("1234"), "1234");
    }
}
