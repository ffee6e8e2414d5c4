//! Child processes of a run (simulators, `sluice serve`, nginx), through the test kit shared
//! with the integration tests, and the small HTTP client the harness talks to them with. Every
//! child is stopped when its handle drops, so an aborted run leaves nothing listening.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::TokioExecutor;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

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

pub use sluice_testkit::{gauge_sum, Proc};

pub fn free_port() -> Result<u16, String> {
    Ok(sluice_testkit::free_port())
}

pub fn free_addr() -> Result<String, String> {
    Ok(sluice_testkit::free_addr())
}

/// The `sluice` binary: the flag, else the one built next to this binary.
pub fn sluice_bin(flag: Option<&Path>) -> Result<PathBuf, String> {
    match flag {
        Some(p) => Ok(p.to_path_buf()),
        None => sluice_testkit::binary("sluice"),
    }
}

pub async fn start_sim(
    bin: &Path,
    name: &str,
    models: &str,
    params: &SimParams,
    dir: &Path,
) -> Result<Proc, String> {
    start_sim_with(bin, name, models, params, dir, &[]).await
}

/// [`start_sim`] with more of the simulator's flags (`--scheduling-policy priority`).
pub async fn start_sim_with(
    bin: &Path,
    name: &str,
    models: &str,
    params: &SimParams,
    dir: &Path,
    extra: &[&str],
) -> Result<Proc, String> {
    let mut flags = vec!["--model".to_string(), models.to_string()];
    flags.extend(params.flags());
    flags.extend(extra.iter().map(|f| f.to_string()));
    sluice_testkit::start_sim(bin, name, &flags, Some(dir.join(format!("{name}.log")))).await
}

/// Writes `cfg` next to the logs and starts `sluice serve` on it; ready once `/readyz` on its
/// operations listener is 200.
pub async fn start_sluice(bin: &Path, cfg: &Value, dir: &Path) -> Result<Proc, String> {
    let path = dir.join("sluice.yaml");
    let yaml = serde_yaml::to_string(cfg).map_err(|e| e.to_string())?;
    std::fs::write(&path, yaml).map_err(|e| format!("{}: {e}", path.display()))?;
    let addr = cfg["listen"][0].as_str().unwrap_or_default().to_string();
    let ops = cfg["ops_listen"][0]
        .as_str()
        .unwrap_or_default()
        .to_string();
    let mut cmd = Command::new(bin);
    // The shipped log level (one JSON line per request), so what is measured is what runs.
    cmd.arg("serve")
        .arg("--config")
        .arg(&path)
        .env_remove("RUST_LOG");
    let mut p = Proc::spawn("sluice", &mut cmd, ops, Some(dir.join("sluice.log")))?;
    p.wait_ok("/readyz", Duration::from_secs(30)).await?;
    // From here on the handle names the tenant-facing address, the one requests go to.
    p.ops = Some(std::mem::replace(&mut p.addr, addr));
    Ok(p)
}

/// `sluice-bench bare-proxy` (this very binary) in front of `upstream`.
pub async fn start_bare_pingora(upstream: &str, threads: u32, dir: &Path) -> Result<Proc, String> {
    let addr = free_addr()?;
    let me = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut cmd = Command::new(me);
    cmd.args(["bare-proxy", "--listen", &addr, "--upstream", upstream])
        .arg(format!("--threads={threads}"));
    let mut p = Proc::spawn("pingora", &mut cmd, addr, Some(dir.join("pingora.log")))?;
    p.wait_ok("/health", Duration::from_secs(10)).await?;
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
