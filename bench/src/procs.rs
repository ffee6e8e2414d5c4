//! Child processes of a run (simulators, `sluice serve`, nginx) and the small HTTP client the
//! harness talks to them with. Every child is killed when its handle drops, so an aborted run
//! leaves nothing listening.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::scenario::SimParams;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(1024)
        .build(conn)
}

pub async fn request(
    c: &HttpClient,
    method: &str,
    url: &str,
    body: Option<&Value>,
) -> Result<(u16, Bytes), String> {
    let body = body.map_or_else(Bytes::new, |b| Bytes::from(b.to_string()));
    let req = http::Request::builder()
        .method(method)
        .uri(url)
        .header("content-type", "application/json")
        .body(Full::new(body))
        .map_err(|e| e.to_string())?;
    let fut = async {
        let resp = c
            .request(req)
            .await
            .map_err(|e| format!("{method} {url}: {e}"))?;
        let status = resp.status().as_u16();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("{method} {url}: {e}"))?
            .to_bytes();
        Ok((status, body))
    };
    tokio::time::timeout(Duration::from_secs(10), fut)
        .await
        .map_err(|_| format!("{method} {url}: timed out"))?
}

pub async fn get_json(c: &HttpClient, url: &str) -> Result<Value, String> {
    let (status, body) = request(c, "GET", url, None).await?;
    if status != 200 {
        return Err(format!("GET {url}: {status}"));
    }
    serde_json::from_slice(&body).map_err(|e| format!("GET {url}: {e}"))
}

pub async fn put_json(c: &HttpClient, url: &str, body: &Value) -> Result<(), String> {
    match request(c, "PUT", url, Some(body)).await? {
        (200, _) => Ok(()),
        (s, b) => Err(format!("PUT {url}: {s} {}", String::from_utf8_lossy(&b))),
    }
}

pub fn free_port() -> Result<u16, String> {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|e| format!("no free port: {e}"))
}

pub fn free_addr() -> Result<String, String> {
    Ok(format!("127.0.0.1:{}", free_port()?))
}

/// The `sluice` binary: the flag, else the one built next to this binary.
pub fn sluice_bin(flag: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(p) = flag {
        return Ok(p.to_path_buf());
    }
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let dir = me
        .parent()
        .ok_or("no parent directory of the running binary")?;
    // Integration tests run from target/<profile>/deps; the binaries sit one level up.
    for d in [dir, dir.parent().unwrap_or(dir)] {
        let p = d.join("sluice");
        if p.is_file() {
            return Ok(p);
        }
    }
    Err(format!(
        "no sluice binary next to {}; build it (cargo build --release) or pass --sluice-bin",
        me.display()
    ))
}

/// A child process stopped on drop.
pub struct Proc {
    pub child: Child,
    pub addr: String,
    pub name: String,
    pub log: PathBuf,
}

/// How long a stopped child may take to exit before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(3);

impl Drop for Proc {
    /// SIGTERM first, SIGKILL only if that is not enough: a SIGKILLed nginx master leaves its
    /// workers running, still listening, one set per bench run.
    fn drop(&mut self) {
        let asked = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        let deadline = Instant::now() + STOP_GRACE;
        while asked && Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Proc {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Fails if the process already exited (it could not bind, or its config was refused).
    fn check_alive(&mut self) -> Result<(), String> {
        if let Ok(Some(status)) = self.child.try_wait() {
            return Err(format!(
                "{} exited ({status}); log {}:\n{}",
                self.name,
                self.log.display(),
                self.log_tail()
            ));
        }
        Ok(())
    }

    /// Waits until GET `path` answers 200.
    pub async fn wait_ok(
        &mut self,
        c: &HttpClient,
        path: &str,
        timeout: Duration,
    ) -> Result<(), String> {
        let start = Instant::now();
        let url = self.url(path);
        loop {
            self.check_alive()?;
            if let Ok((200, _)) = request(c, "GET", &url, None).await {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(format!(
                    "{} did not answer 200 on {path} within {timeout:?}; log {}:\n{}",
                    self.name,
                    self.log.display(),
                    self.log_tail()
                ));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

fn spawn(name: &str, cmd: &mut Command, addr: String, log: PathBuf) -> Result<Proc, String> {
    let file = std::fs::File::create(&log).map_err(|e| format!("{}: {e}", log.display()))?;
    let err = file.try_clone().map_err(|e| e.to_string())?;
    let child = cmd
        .stdout(Stdio::from(file))
        .stderr(Stdio::from(err))
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot start {name}: {e}"))?;
    Ok(Proc {
        child,
        addr,
        name: name.into(),
        log,
    })
}

pub async fn start_sim(
    bin: &Path,
    name: &str,
    models: &str,
    params: &SimParams,
    dir: &Path,
    c: &HttpClient,
) -> Result<Proc, String> {
    let addr = free_addr()?;
    let mut cmd = Command::new(bin);
    cmd.args(["sim", "--listen", &addr, "--model", models])
        .args(params.flags())
        .env("RUST_LOG", "warn");
    let mut p = spawn(name, &mut cmd, addr, dir.join(format!("{name}.log")))?;
    p.wait_ok(c, "/health", Duration::from_secs(15)).await?;
    Ok(p)
}

/// Writes `cfg` next to the logs and starts `sluice serve` on it; ready once `/readyz` is 200.
pub async fn start_sluice(
    bin: &Path,
    cfg: &Value,
    dir: &Path,
    c: &HttpClient,
) -> Result<Proc, String> {
    let path = dir.join("sluice.yaml");
    let yaml = serde_yaml::to_string(cfg).map_err(|e| e.to_string())?;
    std::fs::write(&path, yaml).map_err(|e| format!("{}: {e}", path.display()))?;
    let addr = cfg["listen"][0].as_str().unwrap_or_default().to_string();
    let mut cmd = Command::new(bin);
    // The shipped log level (one JSON line per request), so what is measured is what runs.
    cmd.arg("serve")
        .arg("--config")
        .arg(&path)
        .env_remove("RUST_LOG");
    let mut p = spawn("sluice", &mut cmd, addr, dir.join("sluice.log"))?;
    p.wait_ok(c, "/readyz", Duration::from_secs(30)).await?;
    Ok(p)
}

/// `sluice-bench bare-proxy` (this very binary) in front of `upstream`.
pub async fn start_bare_pingora(
    upstream: &str,
    threads: u32,
    dir: &Path,
    c: &HttpClient,
) -> Result<Proc, String> {
    let addr = free_addr()?;
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(me);
    cmd.args(["bare-proxy", "--listen", &addr, "--upstream", upstream])
        .arg(format!("--threads={threads}"));
    let mut p = spawn("pingora", &mut cmd, addr, dir.join("pingora.log"))?;
    p.wait_ok(c, "/health", Duration::from_secs(10)).await?;
    Ok(p)
}

/// Resident set size of a process, from /proc/<pid>/status.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    text.lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

/// A scratch directory for one run's configs and logs, removed on drop unless kept.
pub struct WorkDir {
    pub path: PathBuf,
    pub keep: bool,
}

impl WorkDir {
    pub fn new(label: &str) -> Result<Self, String> {
        let path = std::env::temp_dir().join(format!(
            "sluice-bench-{}-{}-{}",
            std::process::id(),
            label,
            free_port()?
        ));
        std::fs::create_dir_all(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        Ok(Self { path, keep: false })
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        if !self.keep {
            let _ = std::fs::remove_dir_all(&self.path);
        }
    }
}

/// The sum, over every series, of one vLLM gauge in a /metrics text; `None` when absent.
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
}
