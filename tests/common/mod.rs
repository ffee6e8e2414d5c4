//! Shared harness for integration tests: starts real `sluice sim` backends and a real
//! `sluice serve` on free ports, each in its own process, and tears them down on drop.
#![allow(dead_code)]

pub mod pki;

use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

pub use sluice_testkit::{free_port, Proc};

pub const BIN: &str = env!("CARGO_BIN_EXE_sluice");

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// Polls `f` until it returns `Some` or `timeout` passes.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let start = Instant::now();
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// GET `url` and parse its JSON body.
pub async fn get_json(url: &str) -> Value {
    client()
        .get(url)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// Waits until `url` answers 200.
pub async fn wait_ok(url: &str, within: Duration, what: &str) {
    let c = client();
    wait_for(within, what, || {
        let c = c.clone();
        async move {
            c.get(url)
                .send()
                .await
                .ok()
                .filter(|r| r.status() == 200)
                .map(|_| ())
        }
    })
    .await
}

/// Starts a vLLM simulator serving `models` (comma separated) with extra flags.
pub async fn sim(models: &str, extra: &[&str]) -> Proc {
    let mut flags = vec!["--model".to_string(), models.to_string()];
    flags.extend(extra.iter().map(|s| s.to_string()));
    sluice_testkit::start_sim(std::path::Path::new(BIN), "sim", &flags, None)
        .await
        .expect("sluice sim answers /health")
}

/// A test config: fast sampling and health checks so state changes take a fraction of a second.
/// It runs the prototype's `thresholds` policy, whose behaviours these tests pin; adaptive-mode
/// tests switch `policy.mode` back.
pub fn config(on_demand: &[&str], spot: &[&str]) -> Value {
    let hc = json!({"path": "/health", "interval_ms": 100, "timeout_ms": 500, "consecutive_success": 1, "consecutive_failure": 1});
    json!({
        "listen": [format!("127.0.0.1:{}", free_port())],
        "ops_listen": [format!("127.0.0.1:{}", free_port())],
        "server": {"threads": 2, "grace_period_seconds": 0, "graceful_shutdown_timeout_seconds": 1},
        "tenants": {"support-bot": "Guaranteed", "coding-assistant": "Standard", "batch-analytics": "Best-Effort"},
        "pools": {
            "on-demand": {"backends": on_demand, "health_check": hc},
            "spot": {"backends": spot, "health_check": hc},
        },
        "signals": {"scrape_interval_ms": 100, "scrape_timeout_ms": 300, "stale_after_ms": 2000},
        "stability": {"consecutive_samples": 2, "cooldown_seconds": 0.2},
        "fallback": {"sustained_intervals": 3, "cooldown_seconds": 0.2},
        "policy": {"mode": "thresholds"},
    })
}

/// Deep-merges `patch` into `base` (objects merge, everything else replaces).
pub fn merge(base: &mut Value, patch: Value) {
    sluice_testkit::merge(base, &patch)
}

/// A running `sluice serve`: `url` is its tenant-facing listener, `ops_url` its operations one.
pub struct Sluice {
    pub proc: Proc,
    pub ops: String,
    pub dir: PathBuf,
}

impl Drop for Sluice {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl std::ops::Deref for Sluice {
    type Target = Proc;
    fn deref(&self) -> &Proc {
        &self.proc
    }
}

/// `sluice check --config PATH`, as an operator runs it before a reload.
pub fn sluice_check(path: &std::path::Path) -> std::process::Output {
    std::process::Command::new(BIN)
        .args(["check", "--config"])
        .arg(path)
        .output()
        .unwrap()
}

/// `sluice check` accepts the config at `path`.
pub fn assert_check_ok(path: &std::path::Path) {
    let out = sluice_check(path);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

pub fn write_config(cfg: &Value) -> (PathBuf, PathBuf) {
    // A free port alone is no unique name: two tests of one binary asking at once can be handed
    // the same one, and then one's `sluice check` reads the other's config (seen in CI).
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "sluice-test-{}-{n}-{}",
        std::process::id(),
        free_port()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let mut cfg = cfg.clone();
    merge(
        &mut cfg,
        json!({"server": {
            "upgrade_sock": dir.join("upgrade.sock").display().to_string(),
            "pid_file": dir.join("sluice.pid").display().to_string(),
        }}),
    );
    let path = dir.join("sluice.yaml");
    std::fs::write(&path, serde_yaml::to_string(&cfg).unwrap()).unwrap();
    (dir, path)
}

/// Waits up to 15 s for `url` to answer 200 from `proc` and its tenant address to take a
/// connection; its output goes to `log`. A listen port is free when a test picks it, but another
/// process's connection can take it before the child binds it, and Pingora then retries the
/// bind for 30 s: `false` when the log says an address is in use, so the caller starts it again
/// on fresh ports. A child that exits or is not ready for another reason fails the test with
/// its own log.
pub async fn wait_started(proc: &mut Proc, url: &str, log: &std::path::Path) -> bool {
    let c = client();
    let in_use = || std::fs::read_to_string(log).is_ok_and(|l| l.contains("is in use"));
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(15) {
        if in_use() || proc.child.try_wait().unwrap().is_some() {
            break;
        }
        // Bounded: whatever holds the port may accept and never answer. The tenant listener
        // is bound by its own service, possibly after the operations one answers: started
        // means both take connections.
        if let Ok(r) = c.get(url).timeout(Duration::from_secs(1)).send().await {
            if r.status() == 200 && tokio::net::TcpStream::connect(&proc.addr).await.is_ok() {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        in_use(),
        "{url} did not become ready within 15 s; the log:\n{}",
        std::fs::read_to_string(log).unwrap_or_default()
    );
    let _ = proc.child.kill();
    let _ = proc.child.wait();
    false
}

/// Starts `sluice serve` on `cfg` with extra environment, and waits until it is ready (an
/// on-demand backend has passed a health check). `wait_ready = false` only waits for /livez.
/// Started again with fresh loopback listen ports when its own are taken ([`wait_started`]).
pub async fn serve_with(cfg: &Value, env: &[(&str, &str)], wait_ready: bool) -> Sluice {
    let mut cfg = cfg.clone();
    for _ in 0..3 {
        let (dir, path) = write_config(&cfg);
        let addr = cfg["listen"][0].as_str().unwrap().to_string();
        let log_path = dir.join("sluice.log");
        let log = std::fs::File::create(&log_path).unwrap();
        let mut cmd = Command::new(BIN);
        cmd.args(["serve", "--config"])
            .arg(&path)
            .stdout(log.try_clone().unwrap())
            .stderr(log);
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd.spawn().expect("spawn sluice serve");
        let ops = cfg["ops_listen"][0]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let mut s = Sluice {
            proc: Proc::new(child, addr),
            ops,
            dir,
        };
        let url = s.ops_url(if wait_ready { "/readyz" } else { "/livez" });
        if wait_started(&mut s.proc, &url, &log_path).await {
            return s;
        }
        for key in ["listen", "ops_listen"] {
            for l in cfg[key].as_array_mut().into_iter().flatten() {
                if l.as_str().is_some_and(|a| a.starts_with("127.0.0.1:")) {
                    *l = json!(format!("127.0.0.1:{}", free_port()));
                }
            }
        }
    }
    panic!("sluice found its listen address in use three times");
}

pub async fn serve(cfg: &Value) -> Sluice {
    serve_with(cfg, &[], true).await
}

/// One tier's entry of a `/status` document (`Null` when absent).
pub fn tier_status(status: &Value, tier: &str) -> Value {
    status["tiers"]
        .as_array()
        .and_then(|ts| ts.iter().find(|t| t["tier"] == tier))
        .cloned()
        .unwrap_or(Value::Null)
}

/// Flips a simulator switch (`/admin/health`, `/admin/latency`, `/admin/kv`).
pub async fn sim_admin(sim: &Proc, path: &str, body: Value) {
    let r = client()
        .put(sim.url(path))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "simulator {path}");
}

impl Sluice {
    /// A URL on the operations listener.
    pub fn ops_url(&self, path: &str) -> String {
        format!("http://{}{}", self.ops, path)
    }

    /// The `/metrics` text.
    pub async fn metrics(&self) -> String {
        client()
            .get(self.ops_url("/metrics"))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    /// `/status` of one tier.
    pub async fn tier(&self, tier: &str) -> Value {
        tier_status(&self.status().await, tier)
    }

    /// The `decisions` of `/decisions/recent?QUERY`.
    pub async fn recent(&self, query: &str) -> Vec<Value> {
        let url = self.ops_url(&format!("/decisions/recent?{query}"));
        let v = get_json(&url).await;
        v["decisions"].as_array().cloned().unwrap_or_default()
    }

    /// The record of the request whose response carried `request_id`. Records are made in
    /// Pingora's logging phase, after the response is written, so a client can see the answer
    /// before the record exists: wait for it.
    pub async fn record(&self, request_id: &str) -> Value {
        wait_for(Duration::from_secs(3), "the decision record", || async {
            self.recent("limit=50")
                .await
                .into_iter()
                .find(|d| d["request_id"] == request_id)
        })
        .await
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("sluice.log")).unwrap_or_default()
    }

    /// The log once `done` holds of it (or `what` times out): lines reach stderr through the
    /// log writer, up to one poll (10 ms) after the response that wrote them, and a reload's
    /// verdict after the reload has run.
    pub async fn log_when(&self, what: &str, done: impl Fn(&str) -> bool) -> String {
        wait_for(Duration::from_secs(10), what, || async {
            let log = self.log();
            done(&log).then_some(log)
        })
        .await
    }

    pub async fn status(&self) -> Value {
        get_json(&self.ops_url("/status")).await
    }

    pub async fn set_signal(&self, path: &str, value: f64) {
        let r = client()
            .put(self.ops_url(path))
            .json(&json!({"value": value}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "admin {path}");
    }

    /// Takes back an operator override set with [`set_signal`](Self::set_signal).
    pub async fn clear_signal(&self, path: &str) {
        let r = client().delete(self.ops_url(path)).send().await.unwrap();
        assert_eq!(r.status(), 200, "admin DELETE {path}");
    }

    /// Waits until `/status` shows `tier` in `state`.
    pub async fn wait_tier_state(&self, tier: &str, state: &str) {
        wait_for(
            Duration::from_secs(10),
            &format!("{tier} to be {state}"),
            || async { (self.tier(tier).await["state"] == state).then_some(()) },
        )
        .await
    }

    /// Waits for the fallback `target` (`fallback:NAME`) to be healthy, then holds on-demand's
    /// pressure above `fallback.pressure_at` until fallback routing is active.
    pub async fn activate_fallback(&self, target: &str) {
        wait_for(
            Duration::from_secs(5),
            "the fallback backend to be healthy",
            || async { (self.status().await["fallback"]["target"] == target).then_some(()) },
        )
        .await;
        self.set_signal("/admin/pressure", 87.0).await;
        wait_for(Duration::from_secs(5), "fallback to activate", || async {
            (self.status().await["fallback"]["active"] == true).then_some(())
        })
        .await;
    }

    pub async fn chat(&self, tenant: &str, body: Value) -> reqwest::Response {
        client()
            .post(self.url("/v1/chat/completions"))
            .header("x-tenant-id", tenant)
            .json(&body)
            .send()
            .await
            .unwrap()
    }
}

pub fn chat_body(model: &str, max_tokens: Option<u64>) -> Value {
    let mut b = json!({"model": model, "messages": [{"role": "user", "content": "Tell me about sluices."}]});
    if let Some(m) = max_tokens {
        b["max_tokens"] = json!(m);
    }
    b
}

pub async fn sim_stats(sim: &Proc) -> Value {
    get_json(&sim.url("/admin/stats")).await
}

pub fn header<'a>(r: &'a reqwest::Response, name: &str) -> &'a str {
    r.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

/// A Redis server of the test's own on `port` (no persistence), for tests that stop Redis:
/// the machine's shared server is never touched.
pub struct PrivateRedis {
    pub child: Child,
    pub port: u16,
}

impl PrivateRedis {
    pub async fn start(port: u16) -> Self {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &port.to_string(),
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH");
        let url = format!("redis://127.0.0.1:{port}");
        wait_for(Duration::from_secs(5), "private redis-server", || async {
            redis::Client::open(url.as_str())
                .and_then(|c| c.get_connection())
                .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                .ok()
                .map(|_| ())
        })
        .await;
        PrivateRedis { child, port }
    }

    pub fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A client of the machine's PostgreSQL (trust auth, database `test`).
pub fn pg() -> postgres::Client {
    postgres::Client::connect(
        "host=127.0.0.1 port=5432 user=postgres dbname=test",
        postgres::NoTls,
    )
    .expect("PostgreSQL on 127.0.0.1:5432, database test")
}

/// A schema of this test's own, dropped (with everything in it) at the end; also names the
/// test's spool directory.
pub struct Schema(pub String);

impl Schema {
    pub fn name() -> String {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .subsec_nanos();
        format!(
            "sluice_t_{}_{:x}_{}",
            std::process::id(),
            nanos,
            free_port()
        )
    }

    pub fn create() -> Schema {
        let s = Schema(Self::name());
        pg().batch_execute(&format!("CREATE SCHEMA {}", s.0))
            .unwrap();
        s
    }

    pub fn spool_dir(&self) -> PathBuf {
        std::env::temp_dir().join(format!("sluice-spool-{}", self.0))
    }

    pub fn table(&self, t: &str) -> String {
        format!("{}.{t}", self.0)
    }
}

impl Drop for Schema {
    fn drop(&mut self) {
        let name = self.0.clone();
        let _ = std::fs::remove_dir_all(self.spool_dir());
        // A thread of its own: this may run inside an async test, where the sync client's
        // runtime cannot start.
        let _ = std::thread::spawn(move || {
            if let Ok(mut c) = postgres::Client::connect(
                "host=127.0.0.1 port=5432 user=postgres dbname=test",
                postgres::NoTls,
            ) {
                let _ = c.batch_execute(&format!("DROP SCHEMA IF EXISTS {name} CASCADE"));
            }
        })
        .join();
    }
}

/// Runs SQL from an async test on a blocking thread.
pub async fn sql<T: Send + 'static>(
    f: impl FnOnce(&mut postgres::Client) -> T + Send + 'static,
) -> T {
    tokio::task::spawn_blocking(move || f(&mut pg()))
        .await
        .unwrap()
}

pub async fn create_schema() -> Schema {
    tokio::task::spawn_blocking(Schema::create).await.unwrap()
}

/// request id → number of rows with it.
pub async fn row_counts(schema: &Schema) -> HashMap<String, i64> {
    let t = schema.table("decisions");
    sql(move |c| {
        c.query(
            &format!("SELECT request_id, count(*) FROM {t} GROUP BY request_id"),
            &[],
        )
        .map(|rows| {
            rows.iter()
                .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1)))
                .collect()
        })
        .unwrap_or_default()
    })
    .await
}

/// The machine's shared Redis (or `SLUICE_TEST_REDIS_URL`).
pub fn shared_redis_url() -> String {
    std::env::var("SLUICE_TEST_REDIS_URL").unwrap_or_else(|_| "redis://127.0.0.1:6379".into())
}

/// A random key prefix of one test in a Redis; its keys are deleted on drop.
pub struct RedisNs {
    pub prefix: String,
    pub url: String,
}

impl RedisNs {
    pub fn new(url: &str) -> Self {
        use std::hash::{BuildHasher, Hasher};
        let n = std::collections::hash_map::RandomState::new()
            .build_hasher()
            .finish();
        RedisNs {
            prefix: format!("sluice-test-{n:016x}"),
            url: url.into(),
        }
    }

    pub fn conn(&self) -> redis::Connection {
        redis::Client::open(self.url.as_str())
            .unwrap()
            .get_connection()
            .expect("these tests need a Redis at SLUICE_TEST_REDIS_URL or 127.0.0.1:6379")
    }

    /// Members of a tier's sorted set (`slots`, `queue`, `deadlines`); `None` while Redis is down.
    pub fn zcard(&self, tier: &str, kind: &str) -> Option<u64> {
        let mut c = redis::Client::open(self.url.as_str())
            .ok()?
            .get_connection()
            .ok()?;
        redis::cmd("ZCARD")
            .arg(format!("{}:{tier}:{kind}", self.prefix))
            .query(&mut c)
            .ok()
    }

    /// Every tier's slots, queue, deadlines and waiting tenants are empty, and no tenant's own
    /// queue or waiter record is left behind.
    pub fn idle(&self) -> bool {
        let sets_empty = ["Guaranteed", "Standard", "Best-Effort"].iter().all(|t| {
            ["slots", "queue", "deadlines", "backlog", "before"]
                .iter()
                .all(|k| self.zcard(t, k) == Some(0))
        });
        let leftovers = || -> Option<usize> {
            let mut c = self.conn();
            let mut n = 0;
            for pattern in ["*:tq:*", "*:wt", "*:wc"] {
                let keys: Vec<String> = redis::cmd("KEYS")
                    .arg(format!("{}:{pattern}", self.prefix))
                    .query(&mut c)
                    .ok()?;
                n += keys.len();
            }
            Some(n)
        };
        sets_empty && leftovers() == Some(0)
    }
}

impl Drop for RedisNs {
    fn drop(&mut self) {
        let Ok(mut c) = redis::Client::open(self.url.as_str()).and_then(|c| c.get_connection())
        else {
            return;
        };
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("{}:*", self.prefix))
            .query(&mut c)
            .unwrap_or_default();
        if !keys.is_empty() {
            let _: redis::RedisResult<()> = redis::cmd("DEL").arg(keys).query(&mut c);
        }
    }
}
