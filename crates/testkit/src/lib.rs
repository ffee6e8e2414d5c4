//! The kit Sluice's integration tests and benchmarks share (dev-only): free ports, child
//! processes stopped on drop, the binaries built next to the running one, the simulator
//! launcher, and the small readers both need (JSON deep merge, a Prometheus gauge's sum).
//! No HTTP client: readiness is a bare HTTP/1.1 GET over a socket, so either side keeps its own.

use serde_json::Value;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub mod otlp;
pub use otlp::{OtlpMode, OtlpReceiver, ReceivedRequest, ReceivedSpan};

pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on 127.0.0.1")
}

pub fn free_addr() -> String {
    format!("127.0.0.1:{}", free_port())
}

/// A binary of the workspace: beside the running one (a binary in target/<profile>), or one
/// level up (an integration test in target/<profile>/deps).
pub fn binary(name: &str) -> Result<PathBuf, String> {
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = me
        .parent()
        .ok_or("no parent directory of the running binary")?;
    for d in [dir, dir.parent().unwrap_or(dir)] {
        let p = d.join(name);
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(format!(
        "no {name} binary next to {}: build the workspace first (cargo build --workspace)",
        me.display()
    ))
}

/// A child process, stopped on drop.
pub struct Proc {
    pub child: Child,
    pub addr: String,
    pub name: String,
    /// Where its output goes, when kept.
    pub log: Option<PathBuf>,
    /// Its operations listener, when it has one apart (`sluice serve`).
    pub ops: Option<String>,
}

/// How long a stopped child may take to exit before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(3);

impl Drop for Proc {
    /// SIGTERM first, SIGKILL only if that is not enough: a SIGKILLed nginx master leaves its
    /// workers running, still listening.
    fn drop(&mut self) {
        // SAFETY: kill(2) on the pid of a child we own and have not reaped.
        let asked = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGTERM) } == 0;
        let deadline = Instant::now() + STOP_GRACE;
        while asked && Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn new(child: Child, addr: impl Into<String>) -> Self {
        Self {
            child,
            addr: addr.into(),
            name: "process".into(),
            log: None,
            ops: None,
        }
    }

    /// Starts `cmd`, its output to `log` (or discarded).
    pub fn spawn(
        name: &str,
        cmd: &mut Command,
        addr: String,
        log: Option<PathBuf>,
    ) -> Result<Self, String> {
        let (out, err) = match &log {
            Some(path) => {
                let file =
                    std::fs::File::create(path).map_err(|e| format!("{}: {e}", path.display()))?;
                let err = file.try_clone().map_err(|e| e.to_string())?;
                (Stdio::from(file), Stdio::from(err))
            }
            None => (Stdio::null(), Stdio::null()),
        };
        let child = cmd
            .stdout(out)
            .stderr(err)
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| format!("cannot start {name}: {e}"))?;
        Ok(Self {
            child,
            addr,
            name: name.into(),
            log,
            ops: None,
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// A URL on its operations listener (its own address when it has none apart).
    pub fn ops_url(&self, path: &str) -> String {
        format!(
            "http://{}{}",
            self.ops.as_deref().unwrap_or(&self.addr),
            path
        )
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log_tail(&self) -> String {
        let Some(log) = &self.log else {
            return "(output not kept)".into();
        };
        let text = std::fs::read_to_string(log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        format!(
            "log {}:\n{}",
            log.display(),
            lines[lines.len().saturating_sub(15)..].join("\n")
        )
    }

    /// Waits until GET `path` on its address answers 200, failing early if it exited.
    pub async fn wait_ok(&mut self, path: &str, timeout: Duration) -> Result<(), String> {
        let start = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(format!(
                    "{} exited ({status}); {}",
                    self.name,
                    self.log_tail()
                ));
            }
            if http_status(&self.addr, path).await == Some(200) {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "{} did not answer 200 on {path} within {timeout:?}; {}",
                    self.name,
                    self.log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// The status of a bare `GET path` on `addr`, or `None` when it cannot be had.
pub async fn http_status(addr: &str, path: &str) -> Option<u16> {
    let io = async {
        let mut s = tokio::net::TcpStream::connect(addr).await.ok()?;
        let req = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
        s.write_all(req.as_bytes()).await.ok()?;
        let mut head = [0u8; 16];
        let n = s.read(&mut head).await.ok()?;
        let line = std::str::from_utf8(&head[..n]).ok()?;
        line.strip_prefix("HTTP/1.1 ")?.get(..3)?.parse().ok()
    };
    tokio::time::timeout(Duration::from_secs(2), io)
        .await
        .ok()
        .flatten()
}

/// Starts `sluice sim` on a free port with `flags` (`--model` and the engine's knobs), ready once
/// `/health` answers; its output goes to `log` when given.
pub async fn start_sim(
    bin: &Path,
    name: &str,
    flags: &[String],
    log: Option<PathBuf>,
) -> Result<Proc, String> {
    // A port free when picked can be taken by another process's outgoing connection before
    // the child binds it; the simulator then exits at once, so it is started again on a fresh
    // port. A simulator that exits three times, or never answers, fails with its own reason.
    let mut last = String::new();
    for _ in 0..3 {
        let addr = free_addr();
        let mut cmd = Command::new(bin);
        cmd.args(["sim", "--listen", &addr])
            .args(flags)
            .env("RUST_LOG", "warn");
        let mut p = Proc::spawn(name, &mut cmd, addr, log.clone())?;
        match p.wait_ok("/health", Duration::from_secs(15)).await {
            Ok(()) => return Ok(p),
            Err(e) if p.child.try_wait().ok().flatten().is_some() => last = e,
            Err(e) => return Err(e),
        }
    }
    Err(last)
}

/// Deep-merges `patch` into `base`: objects key by key, anything else replaced.
pub fn merge(base: &mut Value, patch: &Value) {
    match (base, patch) {
        (Value::Object(b), Value::Object(p)) => {
            for (k, v) in p {
                merge(b.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
        (b, p) => *b = p.clone(),
    }
}

/// The sum, over every series, of one gauge in a Prometheus text; `None` when absent.
pub fn gauge_sum(metrics: &str, name: &str) -> Option<f64> {
    let mut found = None;
    for line in metrics.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        if let Some(v) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) {
            *found.get_or_insert(0.0) += v;
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_sum_over_series_and_ignore_prefix_matches() {
        let m = "# HELP x\nvllm:num_requests_waiting{model_name=\"m\",engine=\"0\"} 3\n\
                 vllm:num_requests_waiting{model_name=\"m\",engine=\"1\"} 2\n\
                 vllm:num_requests_waiting_total 99\n";
        assert_eq!(gauge_sum(m, "vllm:num_requests_waiting"), Some(5.0));
        assert_eq!(gauge_sum(m, "vllm:kv_cache_usage_perc"), None);
    }

    #[test]
    fn merge_goes_deep_and_replaces_the_rest() {
        let mut a = serde_json::json!({"x": {"y": 1, "z": 2}, "l": [1]});
        merge(&mut a, &serde_json::json!({"x": {"y": 3}, "l": [2]}));
        assert_eq!(a, serde_json::json!({"x": {"y": 3, "z": 2}, "l": [2]}));
    }
}
