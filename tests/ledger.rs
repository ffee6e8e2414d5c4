//! The PostgreSQL decision ledger against a real server on 127.0.0.1:5432 (database `test`, user
//! `postgres`, trust auth). Every test works in its own schema `sluice_t_<random>`, dropped at
//! the end, and its own spool directory.

mod common;
use common::*;
use serde_json::{json, Value};
use sluice_ledger::db::{Db, SlaWindow};
use sluice_ledger::row::LedgerRow;
use sluice_record::decision::{DecisionRecord, RecentFilter};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

const PG_URL: &str = "postgres://postgres@127.0.0.1:5432/test";

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

async fn wait_rows(schema: &Schema, n: usize, within: Duration) -> HashMap<String, i64> {
    wait_for(within, &format!("{n} ledger rows"), || async {
        let counts = row_counts(schema).await;
        (counts.values().sum::<i64>() as usize >= n).then_some(counts)
    })
    .await
}

/// A test config with the ledger on `url`; the SLA-rate thresholds are switched off unless a
/// test is about them, so a slow test machine cannot shed requests through them.
fn ledger_config(od: &Proc, sp: &Proc, url: &str, schema: &Schema, sla_thresholds: bool) -> Value {
    let mut cfg = config(&[&od.addr], &[&sp.addr]);
    merge(
        &mut cfg,
        json!({
            "database_url": url,
            "ledger": {
                "schema": schema.0,
                "spool_dir": schema.spool_dir().display().to_string(),
                "flush_interval_ms": 50,
            },
        }),
    );
    if !sla_thresholds {
        let off = json!({"thresholds": {"sla_violation_rate": {}}});
        merge(
            &mut cfg,
            json!({"tiers": {"Guaranteed": off, "Standard": off, "Best-Effort": off}}),
        );
    }
    cfg
}

/// What the client saw of one request.
#[derive(Debug, Clone)]
struct Sent {
    id: String,
    tier: String,
    decision: String,
    reason: String,
    status: u16,
    completion_tokens: Option<i64>,
    elapsed: Duration,
}

async fn send(s: &Sluice, tenant: &str, max_tokens: u64) -> Sent {
    let started = Instant::now();
    let r = s
        .chat(tenant, chat_body("llama-3-70b", Some(max_tokens)))
        .await;
    let mut sent = Sent {
        id: header(&r, "x-request-id").to_string(),
        tier: header(&r, "x-sluice-tier").to_string(),
        decision: header(&r, "x-sluice-decision").to_string(),
        reason: header(&r, "x-sluice-reason").to_string(),
        status: r.status().as_u16(),
        completion_tokens: None,
        elapsed: Duration::ZERO,
    };
    let body: Value = r.json().await.unwrap_or(Value::Null);
    sent.completion_tokens = body["usage"]["completion_tokens"].as_i64();
    sent.elapsed = started.elapsed();
    assert!(!sent.id.is_empty(), "every response carries x-request-id");
    sent
}

fn ledger_status(status: &Value) -> Value {
    status["ledger"][0].clone()
}

#[test]
fn migrations_apply_once_even_when_replicas_race() {
    // Not created beforehand: the racers also race on CREATE SCHEMA.
    let schema = Schema(Schema::name());
    let threads: Vec<_> = (0..4)
        .map(|_| {
            let name = schema.0.clone();
            std::thread::spawn(move || sluice_ledger::migrate::run(&mut pg(), &name).unwrap())
        })
        .collect();
    let mut applied: Vec<Vec<i32>> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    applied.sort();
    let all: Vec<i32> = sluice_ledger::migrate::MIGRATIONS
        .iter()
        .map(|m| m.0)
        .collect();
    assert_eq!(applied, vec![vec![], vec![], vec![], all.clone()]);

    let mut c = pg();
    let versions: Vec<(i32, i64)> = c
        .query(
            &format!(
                "SELECT version, count(*) FROM {} GROUP BY version ORDER BY version",
                schema.table("ledger_migrations")
            ),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        versions,
        all.iter().map(|v| (*v, 1)).collect::<Vec<_>>(),
        "each version recorded exactly once"
    );
    for table in ["decisions", "queue_events"] {
        let found: Option<String> = c
            .query_one("SELECT to_regclass($1)::text", &[&schema.table(table)])
            .unwrap()
            .get(0);
        assert!(found.is_some(), "{table} exists");
    }
    assert!(
        sluice_ledger::migrate::run(&mut c, &schema.0)
            .unwrap()
            .is_empty(),
        "a second start applies nothing"
    );
}

fn scripted(
    id: &str,
    tier: &str,
    received: u64,
    latency: f64,
    violated: Option<bool>,
) -> LedgerRow {
    LedgerRow {
        request_id: id.into(),
        received_at_ms: received,
        replica: "test".into(),
        tenant: format!("tenant-{tier}"),
        tier: tier.to_string().into(),
        method: "POST".into(),
        path: "/v1/chat/completions".into(),
        decision: if violated.is_some() {
            sluice_record::Verdict::Pass
        } else {
            sluice_record::Verdict::Reject
        },
        reason: if violated.is_some() {
            ""
        } else {
            "reject_pressure_critical"
        }
        .into(),
        state: "Normal".into(),
        status: if violated.is_some() { 200 } else { 429 },
        latency_ms: latency,
        sla_violated: violated,
        ..Default::default()
    }
}

#[test]
fn sla_rate_recent_and_retention_match_a_hand_count() {
    let schema = Schema::create();
    let db = Db::new(PG_URL, &schema.0).unwrap();
    db.migrate().unwrap();
    let now = now_ms();
    let mut rows = Vec::new();
    let mut add = |tier: &str, ago_s: u64, latency_s: f64, violated: Option<bool>| {
        let id = format!("r{}", rows.len());
        let received = now - ago_s * 1000;
        rows.push(scripted(&id, tier, received, latency_s * 1000.0, violated));
    };
    // In the window (completed within the last 60 s):
    for v in [true, true, true, false] {
        add("Standard", 20, 0.5, Some(v));
    }
    for v in [true, false] {
        add("Best-Effort", 30, 0.2, Some(v));
    }
    for _ in 0..3 {
        add("Guaranteed", 40, 1.0, Some(false));
    }
    // Arrived 70 s ago, but a 65 s stream: it completed 5 s ago and counts.
    add("Standard", 70, 65.0, Some(true));
    // Not completions: rejections and Sluice's own errors carry no sla_violated.
    for _ in 0..5 {
        add("Best-Effort", 10, 0.0, None);
    }
    // Completed before the window.
    for _ in 0..4 {
        add("Standard", 200, 1.0, Some(true));
    }
    assert_eq!(db.insert(&rows).unwrap(), rows.len() as u64);
    assert_eq!(db.insert(&rows).unwrap(), 0, "a replayed batch is skipped");

    let w = db.sla_window(now - 60_000, None).unwrap();
    let hand = SlaWindow {
        completed: 10,
        violated: 5,
        per_tier: BTreeMap::from([
            ("Best-Effort".to_string(), (2, 1)),
            ("Guaranteed".to_string(), (3, 0)),
            ("Standard".to_string(), (5, 4)),
        ]),
    };
    assert_eq!(w, hand);
    assert_eq!(w.rate(), 0.5);
    // The newest 3 completions: the long stream (5 s ago), then two Standard ones (19.5 s ago).
    let last3 = db.sla_window(now - 60_000, Some(3)).unwrap();
    assert_eq!((last3.completed, last3.violated), (3, 3));
    let empty = db.sla_window(now + 3_600_000, None).unwrap();
    assert_eq!((empty.completed, empty.rate()), (0, 0.0));

    // /decisions/recent: filters, newest first, the record's own field names.
    let all = db
        .recent(&RecentFilter {
            limit: 5000,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(all.len(), rows.len());
    let received: Vec<u64> = all
        .iter()
        .map(|v| v["received_at_ms"].as_u64().unwrap())
        .collect();
    assert!(received.windows(2).all(|w| w[0] >= w[1]), "newest first");
    let record_keys: Vec<String> = serde_json::to_value(DecisionRecord::default())
        .unwrap()
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let keys: Vec<String> = all[0].as_object().unwrap().keys().cloned().collect();
    assert_eq!(keys, record_keys);
    let r0 = all.iter().find(|v| v["request_id"] == "r0").unwrap();
    assert_eq!(r0, &serde_json::to_value(&rows[0]).unwrap());
    let q = |f: RecentFilter| db.recent(&f).unwrap().len();
    let f = |limit| RecentFilter {
        limit,
        ..Default::default()
    };
    assert_eq!(q(f(3)), 3);
    assert_eq!(
        q(RecentFilter {
            tier: Some("Standard".into()),
            ..f(100)
        }),
        9
    );
    assert_eq!(
        q(RecentFilter {
            tenant: Some("tenant-Best-Effort".into()),
            decision: Some("reject".into()),
            ..f(100)
        }),
        5
    );
    assert_eq!(
        q(RecentFilter {
            since_ms: Some(now - 25_000),
            ..f(100)
        }),
        9,
        "4 Standard at -20 s and 5 rejections at -10 s"
    );

    // Queue events travel with their decision, in the same transaction.
    let mut queued = scripted("q1", "Standard", now - 1000, 300.0, Some(false));
    queued.queue_outcome = Some(sluice_record::QueueOutcome::Released);
    queued.queue_wait_ms = Some(120.0);
    let mut dropped = scripted("q2", "Standard", now - 1000, 0.0, None);
    dropped.queue_outcome = Some(sluice_record::QueueOutcome::Dropped);
    // Retention: rows older than the cutoff go, in batches; newer ones stay.
    let mut old: Vec<LedgerRow> = (0..7)
        .map(|i| {
            scripted(
                &format!("old{i}"),
                "Standard",
                now - 40 * 86_400_000,
                1.0,
                Some(false),
            )
        })
        .collect();
    old[0].queue_outcome = Some(sluice_record::QueueOutcome::TimedOut);
    old[0].queue_wait_ms = Some(2000.0);
    old.push(queued);
    old.push(dropped);
    db.insert(&old).unwrap();
    let mut c = pg();
    let events: Vec<(String, String)> = c
        .query(
            &format!(
                "SELECT request_id, event FROM {} ORDER BY request_id, at_ms, event",
                schema.table("queue_events")
            ),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let ev = |a: &str, b: &str| (a.to_string(), b.to_string());
    assert_eq!(
        events,
        [
            ev("old0", "queue_queued"),
            ev("old0", "queue_timed_out"),
            ev("q1", "queue_queued"),
            ev("q1", "queue_released"),
            ev("q2", "queue_dropped"),
        ]
    );
    let cutoff = now - 30 * 86_400_000;
    let mut deleted = 0;
    loop {
        let n = db.delete_older_than(cutoff, 3).unwrap();
        if n == 0 {
            break;
        }
        deleted += n;
    }
    assert_eq!(deleted, 7 + 2, "7 old decisions and their 2 queue events");
    let left: i64 = c
        .query_one(
            &format!("SELECT count(*) FROM {}", schema.table("decisions")),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(left as usize, rows.len() + 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_request_gets_exactly_its_row() {
    let schema = create_schema().await;
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&ledger_config(&od, &sp, PG_URL, &schema, false)).await;

    let mut sent = Vec::new();
    for tenant in ["support-bot", "coding-assistant", "batch-analytics"] {
        for _ in 0..3 {
            sent.push(send(&s, tenant, 20).await);
        }
    }
    s.set_signal("/admin/pressure", 75.0).await;
    s.wait_tier_state("Standard", "Elevated").await;
    for _ in 0..3 {
        sent.push(send(&s, "coding-assistant", 1000).await);
        sent.push(send(&s, "batch-analytics", 20).await);
        sent.push(send(&s, "support-bot", 20).await);
    }
    let mut by_decision = BTreeMap::new();
    for x in &sent {
        *by_decision.entry(x.decision.as_str()).or_insert(0) += 1;
    }
    assert_eq!(
        by_decision,
        BTreeMap::from([("degrade", 3), ("pass", 12), ("reject", 3)])
    );

    let counts = wait_rows(&schema, sent.len(), Duration::from_secs(15)).await;
    assert_eq!(counts.len(), sent.len(), "exactly one row per request");
    assert!(counts.values().all(|&n| n == 1));
    let t = schema.table("decisions");
    let rows: HashMap<String, (String, String, String, i32, Option<i64>)> = sql(move |c| {
        c.query(
            &format!(
                "SELECT request_id, tier, decision, reason, status, completion_tokens FROM {t}"
            ),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), (r.get(1), r.get(2), r.get(3), r.get(4), r.get(5))))
        .collect()
    })
    .await;
    for x in &sent {
        let row = rows
            .get(&x.id)
            .unwrap_or_else(|| panic!("row for {}", x.id));
        assert_eq!(
            row,
            &(
                x.tier.clone(),
                x.decision.clone(),
                x.reason.clone(),
                i32::from(x.status),
                x.completion_tokens
            ),
            "{x:?}"
        );
    }
    assert!(sent
        .iter()
        .filter(|x| x.decision == "degrade")
        .all(|x| x.completion_tokens == Some(256)));

    // Every row is durable, so the log keeps only the requests not plainly served
    // (`decisions.log_requests: auto`): the degraded and rejected ones, none of the passes.
    let exceptions = sent.iter().filter(|x| x.decision != "pass").count();
    s.log_when("a line for each request not plainly served", |log| {
        log.matches("\"request_id\"").count() >= exceptions
    })
    .await;
    // A pass's line, had one been written, may trail the last exception's by a writer poll
    // (10 ms): read the log again after several.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let log = s.log();
    let logged: Vec<Value> = log
        .lines()
        .filter(|l| l.contains("\"request_id\""))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for x in &sent {
        let lines = logged.iter().filter(|l| l["request_id"] == x.id.as_str());
        let want = usize::from(x.decision != "pass");
        assert_eq!(lines.count(), want, "{x:?} in the log:\n{log}");
    }

    // /decisions/recent now answers from PostgreSQL, with the ring's field names.
    let recent: Value = client()
        .get(s.ops_url("/decisions/recent?decision=degrade&limit=1000"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(recent["source"], "ledger");
    let items = recent["decisions"].as_array().unwrap();
    assert_eq!(items.len(), 3);
    assert!(items.iter().all(|d| d["decision"] == "degrade"
        && d["tier"] == "Standard"
        && d["applied_max_tokens"] == 256
        && d["signals"]["pressure"] == 75.0));

    let status = ledger_status(&s.status().await);
    assert_eq!(status["reachable"], true, "{status}");
    assert_eq!(status["rows_written"], sent.len());
    assert_eq!(status["dropped"], 0);
    assert!(status["last_flush_ms_ago"].as_u64().is_some());
}

/// A TCP forwarder to PostgreSQL that a test can cut (listener and every live connection) and
/// restore on the same port.
struct Forwarder {
    port: u16,
    accept: Option<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Forwarder {
    async fn start(port: u16) -> Forwarder {
        let mut f = Forwarder {
            port,
            accept: None,
            conns: Arc::default(),
        };
        f.restore().await;
        f
    }

    async fn restore(&mut self) {
        let listener = wait_for(Duration::from_secs(5), "forwarder port", || async {
            TcpListener::bind(("127.0.0.1", self.port)).await.ok()
        })
        .await;
        let conns = Arc::clone(&self.conns);
        self.accept = Some(tokio::spawn(async move {
            while let Ok((mut down, _)) = listener.accept().await {
                let task = tokio::spawn(async move {
                    if let Ok(mut up) = TcpStream::connect("127.0.0.1:5432").await {
                        let _ = tokio::io::copy_bidirectional(&mut down, &mut up).await;
                    }
                });
                conns.lock().unwrap().push(task.abort_handle());
            }
        }));
    }

    async fn cut(&mut self) {
        if let Some(accept) = self.accept.take() {
            accept.abort();
            let _ = accept.await;
        }
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
        // Let the aborted connection tasks drop their sockets.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_outage_loses_nothing_and_doubles_nothing() {
    let schema = create_schema().await;
    let mut fwd = Forwarder::start(free_port()).await;
    let url = format!("postgres://postgres@127.0.0.1:{}/test", fwd.port);
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&ledger_config(&od, &sp, &url, &schema, false)).await;
    let tenants = ["support-bot", "coding-assistant", "batch-analytics"];

    let mut sent = Vec::new();
    for i in 0..10 {
        sent.push(send(&s, tenants[i % 3], 10).await);
    }
    wait_rows(&schema, 10, Duration::from_secs(10)).await;

    fwd.cut().await;
    for i in 0..20 {
        let x = send(&s, tenants[i % 3], 10).await;
        assert_eq!(x.status, 200, "requests do not depend on the ledger");
        sent.push(x);
    }
    let down = wait_for(Duration::from_secs(10), "rows to spool", || async {
        let l = ledger_status(&s.status().await);
        (l["reachable"] == false && l["spooled_rows"].as_u64() >= Some(1)).then_some(l)
    })
    .await;
    assert!(down["last_error"].is_string(), "{down}");
    let recent: Value = client()
        .get(s.ops_url("/decisions/recent"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(recent["source"], "memory", "falls back while unreachable");
    let status = s.status().await;
    let sla = &status["signals"]["on-demand"]["sla_violation_rate"];
    assert!(
        sla["unavailable"]
            .as_str()
            .is_some_and(|u| u.starts_with("ledger unreachable")),
        "{sla}"
    );

    fwd.restore().await;
    let counts = wait_rows(&schema, sent.len(), Duration::from_secs(20)).await;
    for x in &sent {
        assert_eq!(counts.get(&x.id), Some(&1), "{} exactly once", x.id);
    }
    assert_eq!(counts.len(), sent.len());
    let settled = wait_for(Duration::from_secs(10), "spool to empty", || async {
        let l = ledger_status(&s.status().await);
        (l["spooled_rows"] == 0 && l["buffered_rows"] == 0 && l["reachable"] == true).then_some(l)
    })
    .await;
    assert_eq!(settled["dropped"], 0);
    assert!(settled["rows_spilled"].as_u64() >= Some(1), "{settled}");
    // The reconnection is logged as the spool drains; its line reaches the log file up to a
    // poll of the log writer later than the status that shows it.
    s.log_when("the outage and the reconnection logged", |log| {
        log.contains("ledger_unreachable") && log.contains("ledger_reconnected")
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_while_unreachable_spools_for_the_next_start() {
    let schema = create_schema().await;
    let port = free_port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/test");
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let mut first = serve(&ledger_config(&od, &sp, &url, &schema, false)).await;
    let mut sent = Vec::new();
    for tenant in [
        "support-bot",
        "coding-assistant",
        "batch-analytics",
        "support-bot",
    ] {
        sent.push(send(&first, tenant, 10).await);
    }
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &first.pid().to_string()])
        .status()
        .unwrap();
    assert!(killed.success());
    wait_for(Duration::from_secs(10), "sluice to exit", || {
        let exited = first.proc.child.try_wait().unwrap().is_some();
        async move { exited.then_some(()) }
    })
    .await;
    let lines: usize = std::fs::read_dir(schema.spool_dir())
        .unwrap()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().ends_with(".jsonl"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap().lines().count())
        .sum();
    assert_eq!(lines, sent.len(), "every record is in the spool at exit");

    // The database is back (on the same address) and the next start replays the spool.
    let _fwd = Forwarder::start(port).await;
    let second = serve(&ledger_config(&od, &sp, &url, &schema, false)).await;
    let counts = wait_rows(&schema, sent.len(), Duration::from_secs(15)).await;
    for x in &sent {
        assert_eq!(counts.get(&x.id), Some(&1));
    }
    wait_for(Duration::from_secs(10), "spool files to go", || async {
        let l = ledger_status(&second.status().await);
        let files = std::fs::read_dir(schema.spool_dir()).map_or(0, |d| d.count());
        (l["spooled_rows"] == 0 && files == 0).then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_locked_table_does_not_slow_requests() {
    let schema = create_schema().await;
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    let s = serve(&ledger_config(&od, &sp, PG_URL, &schema, false)).await;
    let mut sent = Vec::new();
    for _ in 0..3 {
        sent.push(send(&s, "coding-assistant", 10).await);
    }
    wait_rows(&schema, 3, Duration::from_secs(10)).await;

    let hold = Duration::from_secs(3);
    let table = schema.table("decisions");
    let (locked_tx, locked_rx) = std::sync::mpsc::channel();
    let locker = std::thread::spawn(move || {
        let mut c = pg();
        let mut tx = c.transaction().unwrap();
        tx.batch_execute(&format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE"))
            .unwrap();
        locked_tx.send(()).unwrap();
        std::thread::sleep(hold);
        tx.commit().unwrap();
    });
    tokio::task::spawn_blocking(move || locked_rx.recv().unwrap())
        .await
        .unwrap();
    let locked_at = Instant::now();
    for i in 0..10 {
        let x = send(&s, ["coding-assistant", "support-bot"][i % 2], 10).await;
        assert_eq!(x.status, 200);
        assert!(
            x.elapsed < Duration::from_millis(800),
            "request took {:?} while the table was locked",
            x.elapsed
        );
        sent.push(x);
    }
    let during = ledger_status(&s.status().await);
    assert!(
        locked_at.elapsed() < hold,
        "the requests ran while the lock was held"
    );
    assert!(
        during["inflight_rows"].as_u64().unwrap() + during["buffered_rows"].as_u64().unwrap() > 0,
        "rows wait while the table is locked: {during}"
    );
    tokio::task::spawn_blocking(move || locker.join().unwrap())
        .await
        .unwrap();
    let counts = wait_rows(&schema, sent.len(), Duration::from_secs(15)).await;
    for x in &sent {
        assert_eq!(counts.get(&x.id), Some(&1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sla_violations_drive_tiers_to_critical() {
    let schema = create_schema().await;
    let od = sim("llama-3-70b", &[]).await;
    let sp = sim("llama-3-70b", &[]).await;
    for sim in [&od, &sp] {
        let r = client()
            .put(sim.url("/admin/latency"))
            .json(&json!({"extra_ms": 1500}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200);
    }
    let mut cfg = ledger_config(&od, &sp, PG_URL, &schema, true);
    // End-to-end objectives a 1.5 s answer misses (the built-in TTFT and TPOT ones give a
    // five-token Best-Effort answer until 2.8 s).
    merge(
        &mut cfg,
        json!({"tiers": {"Standard": {"sla_target_ms": 1000}, "Best-Effort": {"sla_target_ms": 500}}}),
    );
    let s = Arc::new(serve(&cfg).await);
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let s = Arc::clone(&s);
            tokio::spawn(async move {
                let tenant = ["coding-assistant", "batch-analytics"][i % 2];
                send(&s, tenant, 5).await
            })
        })
        .collect();
    for t in tasks {
        let x = t.await.unwrap();
        assert_eq!(x.status, 200);
        assert!(x.elapsed >= Duration::from_millis(1500));
    }
    s.wait_tier_state("Best-Effort", "Critical").await;
    s.wait_tier_state("Standard", "Critical").await;
    let status = s.status().await;
    for tier in ["Best-Effort", "Standard"] {
        let t = tier_status(&status, tier);
        assert_eq!(t["driver"], "sla_violation_rate", "{t}");
    }
    let reading = &status["signals"]["on-demand"]["sla_violation_rate"];
    assert_eq!(reading["value"], 1.0, "{reading}");
    assert_eq!(reading["source"], "ledger");
    let sla = &ledger_status(&status)["sla"];
    assert_eq!(sla["rate"], 1.0, "{sla}");
    assert_eq!(sla["completed"], 8);
    assert_eq!(sla["per_tier"]["Standard"]["violated"], 4);
}

/// Sustained writer throughput: `cargo test --release --test ledger -- --ignored --nocapture
/// writer_throughput`. Pushes 50k realistic records through the sink and times the writer
/// draining them into PostgreSQL in `batch_rows` batches.
#[test]
#[ignore]
fn writer_throughput() {
    let schema = Schema::create();
    let n: usize = std::env::var("LEDGER_BENCH_ROWS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(50_000);
    let mut cfg = sluice_config::Config::default();
    cfg.ledger.schema = schema.0.clone();
    cfg.ledger.spool_dir = schema.spool_dir();
    cfg.ledger.buffer_rows = n;
    let ledger = sluice_ledger::open(&cfg, PG_URL).unwrap();
    assert_eq!(ledger.step(), sluice_ledger::writer::Step::Idle, "migrates");
    let start = now_ms();
    for i in 0..n {
        ledger.push(Arc::new(DecisionRecord {
            request_id: format!("bench-{i:08}"),
            received_at_ms: start + i as u64,
            replica: "bench-1".into(),
            tenant: "coding-assistant".into(),
            tier: "Standard".into(),
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            decision: sluice_record::Verdict::Pass,
            reason: "".into(),
            state: "Normal".into(),
            pool: Some("on-demand".into()),
            route_reason: Some("route_tier_pool".into()),
            backend: Some("10.0.0.1:8000".into()),
            requested_model: Some("llama-3-70b".into()),
            routed_model: Some("llama-3-70b".into()),
            requested_max_tokens: Some(256),
            applied_max_tokens: None,
            stream: i % 2 == 0,
            queue_wait_ms: (i % 10 == 0).then_some(12.5),
            status: 200,
            latency_ms: 420.0,
            ttfb_ms: Some(80.0),
            overhead_us: Some(95.0),
            prompt_tokens: Some(42),
            completion_tokens: Some(256),
            sla_target_ms: Some(1000),
            sla_violated: Some(false),
            ttft_ms: None,
            tpot_ms: None,
            ttft_target_ms: None,
            tpot_target_ms: None,
            slo_missed: None,
            attempts: Some(1),
            tried: None,
            trace_id: None,
            signals: Default::default(),
            queue_outcome: (i % 10 == 0).then_some(sluice_record::QueueOutcome::Released),
            error: None,
            inputs: None,
        }));
    }
    let t = Instant::now();
    ledger.drain();
    let secs = t.elapsed().as_secs_f64();
    let status = ledger.status();
    assert_eq!(status.rows_written, n as u64);
    println!(
        "ledger writer: {n} rows in {secs:.2} s = {:.0} rows/s (batch_rows {})",
        n as f64 / secs,
        cfg.ledger.batch_rows
    );
}

#[test]
fn ledger_config_has_defaults_overrides_and_named_errors() {
    use sluice_config::Config;
    let parse = |yaml: &str, env: &[(&str, &str)]| {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let lookup = move |name: &str| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone());
        Config::from_yaml(yaml, "test.yaml", std::path::Path::new("."), None, &lookup)
    };
    let c = parse("{}", &[]).unwrap();
    let l = &c.ledger;
    assert_eq!(
        (l.flush_interval_ms, l.batch_rows, l.buffer_rows),
        (100, 5_000, 20_000)
    );
    assert_eq!(l.spool_dir, PathBuf::from("/tmp/sluice-spool"));
    assert_eq!(l.spool_max_bytes, 256 * 1024 * 1024);
    assert_eq!(
        (l.retention_days, l.sla_window_seconds, l.schema.as_str()),
        (30, 60, "public")
    );
    use sluice_config::LogRequests;
    let logs = c.decisions.log_requests;
    assert_eq!(
        (logs, logs.resolve(true), logs.resolve(false)),
        (LogRequests::Auto, LogRequests::Exceptions, LogRequests::All)
    );
    let shipped = Config::embedded(&|_| None).unwrap().ledger;
    assert_eq!(
        (shipped.batch_rows, shipped.schema.as_str()),
        (5_000, "public"),
        "conf/sluice.yaml documents the defaults"
    );

    let c = parse(
        "ledger: {schema: from_file}",
        &[
            ("SLUICE_LEDGER_SCHEMA", "sluice_env"),
            ("SLUICE_SPOOL_DIR", "/var/spool/sluice"),
            ("SLUICE_LEDGER_FLUSH_INTERVAL_MS", "50"),
            ("SLUICE_LEDGER_BATCH_ROWS", "800"),
        ],
    )
    .unwrap();
    assert_eq!(c.ledger.schema, "sluice_env");
    assert_eq!(c.ledger.spool_dir, PathBuf::from("/var/spool/sluice"));
    assert_eq!((c.ledger.flush_interval_ms, c.ledger.batch_rows), (50, 800));
    // An override is validated as the file's value would be, and named by its key.
    let e = parse("", &[("SLUICE_LEDGER_FLUSH_INTERVAL_MS", "0")]).unwrap_err();
    assert!(e.key.contains("flush_interval_ms"), "{e}");

    for (yaml, key) in [
        ("ledger: {schema: Bad-Name}", "ledger.schema"),
        ("ledger: {schema: pg_catalog}", "ledger.schema"),
        (
            "ledger: {batch_rows: 20, buffer_rows: 10}",
            "ledger.batch_rows",
        ),
        ("ledger: {spool_dir: spool}", "ledger.spool_dir"),
        ("ledger: {flush_interval_ms: 0}", "ledger.flush_interval_ms"),
        ("ledger: {retention_days: 0}", "ledger.retention_days"),
        ("ledger: {spool_max_bytes: 10}", "ledger.spool_max_bytes"),
        (
            "ledger: {sla_window_seconds: 0}",
            "ledger.sla_window_seconds",
        ),
        ("database_url: \"postgres://h:notaport/db\"", "database_url"),
        (
            "decisions: {log_requests: sometimes}",
            "decisions.log_requests",
        ),
    ] {
        let e = parse(yaml, &[]).unwrap_err();
        assert_eq!(
            (e.file.as_str(), e.key.as_str()),
            ("test.yaml", key),
            "{yaml}: {e}"
        );
        assert!(!e.reason.is_empty());
    }
    assert!(
        parse("ledger: {flush_every: 5}", &[]).is_err(),
        "unknown keys"
    );
}

#[test]
fn a_row_postgres_refuses_is_dropped_alone() {
    let schema = Schema::create();
    let mut cfg = sluice_config::Config::default();
    cfg.ledger.schema = schema.0.clone();
    cfg.ledger.spool_dir = schema.spool_dir();
    let ledger = sluice_ledger::open(&cfg, PG_URL).unwrap();
    // Too large for a btree index entry even compressed: PostgreSQL refuses it (SQLSTATE 54000).
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let huge: String = (0..12_000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            char::from(b'!' + (x % 90) as u8)
        })
        .collect();
    for (i, tenant) in ["a", huge.as_str(), "b"].into_iter().enumerate() {
        ledger.push(Arc::new(DecisionRecord {
            request_id: format!("poison-{i}"),
            received_at_ms: now_ms(),
            tenant: tenant.into(),
            tier: "Standard".into(),
            decision: sluice_record::Verdict::Pass,
            ..Default::default()
        }));
    }
    ledger.drain();
    let s = ledger.status();
    assert_eq!(s.rows_written, 2, "{s:?}");
    assert_eq!(s.rows_rejected, 1);
    assert_eq!(s.spooled_rows, 0);
    assert!(s.reachable);
}

/// A tiny deterministic generator, so a failing case can be replayed.
struct Xorshift(u64);

impl Xorshift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Random completions spread over the last ~100 s (some in the same millisecond, some
/// rejections), a few long streams, and rows completed in the future (clock skew).
fn random_rows(seed: u64, n: usize, now: u64) -> Vec<LedgerRow> {
    let mut x = Xorshift(seed);
    (0..n)
        .map(|i| {
            let tier = ["Guaranteed", "Standard", "Best-Effort"][x.below(3) as usize];
            let violated = match x.below(10) {
                0 => None,
                1..=3 => Some(true),
                _ => Some(false),
            };
            let latency = match x.below(20) {
                0 => 30_000.0 + x.below(40_000) as f64,
                _ => x.below(2_000) as f64 + 0.25,
            };
            // Coarse arrival times, so many rows share a completion millisecond.
            let received = now + 2_000 - 100_000 + x.below(1_000) * 100;
            scripted(
                &format!("rand-{seed}-{i}"),
                tier,
                received,
                latency,
                violated,
            )
        })
        .collect()
}

/// The window as the ledger computed it before per-second counts: every row, newest first.
fn sla_window_by_rows(schema: &Schema, since: u64, last_n: Option<u64>) -> SlaWindow {
    let mut c = pg();
    let rows = c
        .query(
            &format!(
                "SELECT tier, count(*), count(*) FILTER (WHERE sla_violated)
                 FROM (SELECT tier, sla_violated FROM {}
                       WHERE sla_violated IS NOT NULL AND completed_at_ms >= $1
                       ORDER BY completed_at_ms DESC, ctid LIMIT $2) w
                 GROUP BY tier",
                schema.table("decisions")
            ),
            &[&(since as i64), &last_n.map(|n| n as i64)],
        )
        .unwrap();
    let mut w = SlaWindow::default();
    for r in rows {
        let (tier, c, v): (String, i64, i64) = (r.get(0), r.get(1), r.get(2));
        w.completed += c as u64;
        w.violated += v as u64;
        w.per_tier.insert(tier, (c as u64, v as u64));
    }
    w
}

fn check_windows(db: &Db, schema: &Schema, now: u64) {
    for since_ago in [
        0, 1, 999, 1_000, 1_001, 7_345, 60_000, 60_500, 95_000, 200_000,
    ] {
        let since = now - since_ago;
        for last_n in [None, Some(1), Some(2), Some(17), Some(250), Some(1_000_000)] {
            assert_eq!(
                db.sla_window(since, last_n).unwrap(),
                sla_window_by_rows(schema, since, last_n),
                "window from {since_ago} ms ago, last {last_n:?}"
            );
        }
    }
}

#[test]
fn the_sla_window_from_per_second_counts_equals_a_count_of_its_rows() {
    let schema = Schema::create();
    let db = Db::new(PG_URL, &schema.0).unwrap();
    db.migrate().unwrap();
    let now = now_ms();
    let rows = random_rows(7, 3_000, now);
    // Both ways in: COPY for fresh rows, INSERT … ON CONFLICT for a replay (half of it again).
    let mut copy = sluice_ledger::batch::CopyBatch::default();
    for chunk in rows.chunks(700) {
        copy.encode(chunk);
        assert_eq!(db.copy(&copy).unwrap(), chunk.len() as u64);
    }
    assert_eq!(
        db.insert(&rows[..1_500]).unwrap(),
        0,
        "a replay adds nothing"
    );
    let extra = random_rows(8, 500, now);
    assert_eq!(db.insert(&extra).unwrap(), 500);
    let counted: i64 = pg()
        .query_one(
            &format!(
                "SELECT coalesce(sum(completed), 0)::int8 FROM {}",
                schema.table("sla_seconds")
            ),
            &[],
        )
        .unwrap()
        .get(0);
    let expected = rows
        .iter()
        .chain(&extra)
        .filter(|r| r.sla_violated.is_some())
        .count();
    assert_eq!(counted as usize, expected, "every completion counted once");
    check_windows(&db, &schema, now);
}

/// Replay inputs as a request path captures them.
fn inputs(ticket: u64) -> sluice_record::PolicyInputs {
    use sluice_policy::{decide, PolicyState, RequestFacts, Tier};
    let rules = sluice_policy::tenant_policy::PolicyRules::default();
    let state = PolicyState::initial();
    let facts = RequestFacts {
        tier: Tier::Standard,
        shapeable: true,
        fallback_available: false,
        spot_healthy: true,
        fallback_pool: None,
        ticket,
        prompt_tokens: 9,
        max_tokens: Some(1000),
        inflight_work: [10.5, 0.25],
    };
    let d = decide(&state, &rules, &facts);
    let clock = sluice_policy::Clock::new();
    sluice_record::PolicyInputs::capture(&state, &rules, &facts, &d, clock)
}

#[test]
fn fresh_rows_are_copied_with_their_queue_events_and_a_reused_id_still_lands_once() {
    let schema = Schema::create();
    let mut cfg = sluice_config::Config::default();
    cfg.ledger.schema = schema.0.clone();
    cfg.ledger.spool_dir = schema.spool_dir();
    cfg.ledger.batch_rows = 50;
    let ledger = sluice_ledger::open(&cfg, PG_URL).unwrap();
    let now = now_ms();
    let mut pushed = Vec::new();
    for i in 0..120u64 {
        let mut r = scripted(
            &format!("copy-{i}"),
            "Standard",
            now - 5_000 + i,
            40.0,
            Some(i % 4 == 0),
        );
        match i % 10 {
            1 => {
                r.queue_outcome = Some(sluice_record::QueueOutcome::Released);
                r.queue_wait_ms = Some(12.5);
            }
            2 => r.queue_outcome = Some(sluice_record::QueueOutcome::Dropped),
            4..=6 => r.inputs = Some(inputs(i)),
            // NUL and a non-finite latency: sanitised on the way in, not refused.
            3 => {
                r.requested_model = Some("model\0x".into());
                r.latency_ms = f64::INFINITY;
            }
            _ => {}
        }
        pushed.push(r);
    }
    // A client reusing its x-request-id in the same millisecond: the same key twice in one
    // batch, which the COPY refuses and the INSERT fallback takes once.
    let mut again = pushed[60].clone();
    again.tenant = "someone-else".into();
    pushed.insert(61, again);
    for r in &pushed {
        ledger.push(Arc::new(r.clone()));
    }
    ledger.drain();
    let s = ledger.status();
    assert_eq!(s.rows_written, 120, "{s:?}");
    assert_eq!(s.rows_duplicate, 1, "{s:?}");
    assert_eq!(s.rows_rejected, 0, "{s:?}");
    let mut c = pg();
    let count =
        |c: &mut postgres::Client, sql: &str| -> i64 { c.query_one(sql, &[]).unwrap().get(0) };
    let events = count(
        &mut c,
        &format!("SELECT count(*) FROM {}", schema.table("queue_events")),
    );
    assert_eq!(
        events,
        12 * 2 + 12,
        "released: queued + released; dropped: one event"
    );
    let model: String = c
        .query_one(
            &format!(
                "SELECT requested_model FROM {} WHERE request_id = 'copy-3'",
                schema.table("decisions")
            ),
            &[],
        )
        .unwrap()
        .get(0);
    assert_eq!(model, "model\u{FFFD}x");
    // The replay inputs are stored in their binary form, a fraction of their JSON's ~300 bytes,
    // by COPY (rows 4-6, 14-16 …) and by the INSERT fallback (64-66, in copy-60's batch) alike.
    let (with_inputs, binary, longest): (i64, i64, i32) = {
        let r = c
            .query_one(
                &format!(
                    "SELECT count(*), count(*) FILTER (WHERE get_byte(inputs, 0) = 0),
                            max(octet_length(inputs))
                     FROM {} WHERE inputs IS NOT NULL",
                    schema.table("decisions")
                ),
                &[],
            )
            .unwrap();
        (r.get(0), r.get(1), r.get(2))
    };
    assert_eq!((with_inputs, binary), (36, 36));
    assert!(longest < 100, "{longest} bytes");
    // What went in by COPY reads back exactly as it was pushed.
    let back = ledger
        .db()
        .recent(&RecentFilter {
            limit: 1000,
            ..Default::default()
        })
        .unwrap();
    let by_id: HashMap<String, &Value> = back
        .iter()
        .map(|v| (v["request_id"].as_str().unwrap().to_string(), v))
        .collect();
    for r in pushed
        .iter()
        .filter(|r| r.request_id != "copy-3" && r.latency_ms.is_finite())
    {
        let want = serde_json::to_value(r).unwrap();
        let got = by_id[&r.request_id];
        if r.request_id == "copy-60" {
            assert_eq!(
                got["tenant"], "tenant-Standard",
                "the first of the two is kept"
            );
        } else {
            assert_eq!(got, &want, "{}", r.request_id);
        }
    }
    let w = ledger.db().sla_window(now - 60_000, None).unwrap();
    assert_eq!((w.completed, w.violated), (120, 30));
}

/// A schema holding a ledger as the first `n` migrations left it, and a connection.
fn ledger_at_version(n: usize) -> (Schema, postgres::Client) {
    let schema = Schema::create();
    let mut c = pg();
    let mut previous = String::new();
    for (version, name, sql) in &sluice_ledger::migrate::MIGRATIONS[..n] {
        previous += &format!(
            "{sql}\nINSERT INTO ledger_migrations (version, name) VALUES ({version}, '{name}');\n"
        );
    }
    c.batch_execute(&format!(
        "SET search_path TO {s};
         CREATE TABLE ledger_migrations (version integer PRIMARY KEY, name text NOT NULL,
                                         applied_at timestamptz NOT NULL DEFAULT now());
         {previous}
         RESET search_path;",
        s = schema.0
    ))
    .unwrap();
    (schema, c)
}

#[test]
fn migrations_3_and_4_keep_an_existing_ledger_and_count_its_recent_completions() {
    // A ledger written by the previous release: every migration before this one.
    let (schema, mut c) = ledger_at_version(2);
    let db = Db::new(PG_URL, &schema.0).unwrap();
    let now = now_ms();
    let mut rows = random_rows(11, 2_000, now);
    // And rows from long ago, which the backfill leaves out (no window reaches them).
    rows.extend((0..5).map(|i| {
        scripted(
            &format!("old-{i}"),
            "Standard",
            now - 5 * 86_400_000,
            10.0,
            Some(true),
        )
    }));
    for (i, r) in rows.iter_mut().take(20).enumerate() {
        r.inputs = Some(inputs(i as u64));
    }
    // Written as the previous release wrote them: the INSERT alone, no per-second counts, the
    // inputs as `jsonb` (this build's INSERT sends them as `bytea`, so they go in apart).
    let without_inputs: Vec<_> = rows
        .iter()
        .map(|r| sluice_ledger::row::LedgerRow {
            inputs: None,
            ..r.clone()
        })
        .collect();
    let batch = sluice_ledger::batch::Batch::build(&without_inputs);
    let (older, kept) = insert_rows_sql_without(&SLO_COLUMNS);
    let n = kept.len();
    let params = batch.decision_params();
    let params: Vec<_> = kept.iter().map(|i| params[*i]).collect();
    let written = c
        .execute(
            &older
                .replace(
                    "INTO decisions",
                    &format!("INTO {}", schema.table("decisions")),
                )
                .replace(
                    &format!("${n}::bytea[]"),
                    &format!("${n}::bytea[]::text[]::jsonb[]"),
                ),
            &params,
        )
        .unwrap();
    assert_eq!(written, rows.len() as u64);
    for r in rows.iter().filter(|r| r.inputs.is_some()) {
        let json = serde_json::to_string(&r.inputs).unwrap();
        c.execute(
            &format!(
                "UPDATE {} SET inputs = $1::text::jsonb WHERE request_id = $2",
                schema.table("decisions")
            ),
            &[&json, &r.request_id],
        )
        .unwrap();
    }

    assert_eq!(db.migrate().unwrap(), vec![3, 4, 5]);
    // The replay inputs, converted from jsonb to json and then to bytea, read back as they
    // were written.
    let back = db
        .recent(&RecentFilter {
            limit: 1000,
            since_ms: Some(0),
            ..Default::default()
        })
        .unwrap();
    let mut seen = 0;
    for r in rows.iter().filter(|r| r.inputs.is_some()) {
        if let Some(got) = back
            .iter()
            .find(|v| v["request_id"] == r.request_id.as_str())
        {
            assert_eq!(got["inputs"], serde_json::to_value(r.inputs).unwrap());
            seen += 1;
        }
    }
    assert!(seen > 0, "some rows with inputs among the newest 1000");
    let ty: String = c
        .query_one(
            "SELECT data_type FROM information_schema.columns
             WHERE table_schema = $1 AND table_name = 'decisions' AND column_name = 'inputs'",
            &[&schema.0],
        )
        .unwrap()
        .get(0);
    assert_eq!(ty, "bytea");
    let count =
        |c: &mut postgres::Client, sql: &str| -> i64 { c.query_one(sql, &[]).unwrap().get(0) };
    assert_eq!(
        count(
            &mut c,
            &format!("SELECT count(*) FROM {}", schema.table("decisions"))
        ),
        rows.len() as i64
    );
    let pk: String = c
        .query_one(
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint
             WHERE conrelid = $1::text::regclass AND contype = 'p'",
            &[&schema.table("decisions")],
        )
        .unwrap()
        .get(0);
    assert_eq!(pk, "PRIMARY KEY (received_at_ms, request_id)");
    let indexes: Vec<String> = c
        .query(
            "SELECT indexname FROM pg_indexes WHERE schemaname = $1 AND tablename = 'decisions'
             ORDER BY indexname",
            &[&schema.0],
        )
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(
        indexes,
        [
            "decisions_completed_idx",
            "decisions_decision_idx",
            "decisions_pkey",
            "decisions_tenant_idx"
        ]
    );
    assert_eq!(
        count(
            &mut c,
            &format!(
                "SELECT count(*) FROM {} WHERE second_ms < {}",
                schema.table("sla_seconds"),
                now - 86_400_000 * 2
            )
        ),
        0,
        "only recent seconds are backfilled"
    );
    check_windows(&db, &schema, now);
    // Replaying the old rows after the migration adds nothing, counts included.
    assert_eq!(db.insert(&rows).unwrap(), 0);
    check_windows(&db, &schema, now);
    assert!(sluice_ledger::migrate::run(&mut c, &schema.0)
        .unwrap()
        .is_empty());
}

/// The columns migration 5 added.
const SLO_COLUMNS: [&str; 8] = [
    "ttft_ms",
    "tpot_ms",
    "ttft_target_ms",
    "tpot_target_ms",
    "slo_missed",
    "attempts",
    "tried",
    "trace_id",
];

/// This build's batch INSERT into `decisions` without `dropped` (what a build before the
/// migration that added them sent), and the positions of the parameters it keeps among
/// [`sluice_ledger::batch::Batch::decision_params`].
fn insert_rows_sql_without(dropped: &[&str]) -> (String, Vec<usize>) {
    let sql = sluice_ledger::batch::insert_rows_sql();
    let between = |from: &str, to: &str| {
        let start = sql.find(from).unwrap() + from.len();
        let end = start + sql[start..].find(to).unwrap();
        sql[start..end].to_string()
    };
    let names = between("INSERT INTO decisions (", ") SELECT");
    let arrays = between("unnest(", ") ON CONFLICT");
    let names: Vec<&str> = names.split(", ").collect();
    // `$7::int8[]`: the type after the cast.
    let types: Vec<&str> = arrays
        .split(", ")
        .map(|a| a.split_once("::").unwrap().1)
        .collect();
    assert_eq!(names.len(), types.len(), "{sql}");
    for d in dropped {
        assert!(names.contains(d), "{d} is not a column of {sql}");
    }
    let kept: Vec<usize> = (0..names.len())
        .filter(|i| !dropped.contains(&names[*i]))
        .collect();
    let cols: Vec<&str> = kept.iter().map(|i| names[*i]).collect();
    let casts: Vec<String> = kept
        .iter()
        .enumerate()
        .map(|(n, i)| format!("${}::{}", n + 1, types[*i]))
        .collect();
    (
        format!(
            "INSERT INTO decisions ({}) SELECT * FROM unnest({}) \
             ON CONFLICT (request_id, received_at_ms) DO NOTHING",
            cols.join(", "),
            casts.join(", ")
        ),
        kept,
    )
}

/// A streamed answer that missed its TTFT and TPOT targets, a whole one judged by the stream's
/// deadline, an end-to-end miss, and a stream whose pace could not be measured (a non-finite
/// value, which the ledger stores as NULL).
fn slo_rows(now: u64) -> Vec<LedgerRow> {
    let served = |id: &str, ago_ms: u64, violated: bool| {
        let mut r = scripted(id, "Standard", now - ago_ms, 900.0, Some(violated));
        r.backend = Some("10.0.0.1:8000".into());
        r.completion_tokens = Some(40);
        r.ttft_target_ms = Some(500);
        r.tpot_target_ms = Some(20);
        r
    };
    let mut late_stream = served("slo-stream-late", 4_000, true);
    late_stream.stream = true;
    late_stream.ttfb_ms = Some(612.5);
    late_stream.ttft_ms = Some(612.5);
    late_stream.tpot_ms = Some(24.125);
    late_stream.slo_missed = Some("ttft,tpot".into());
    let mut on_time_stream = served("slo-stream-on-time", 3_000, false);
    on_time_stream.stream = true;
    on_time_stream.ttft_ms = Some(120.0);
    on_time_stream.tpot_ms = Some(7.5);
    // Asked for a tighter first token than its tier's (x-llm-d-slo-ttft-ms).
    on_time_stream.ttft_target_ms = Some(150);
    let mut whole_late = served("slo-whole-late", 2_000, true);
    whole_late.slo_missed = Some("ttft,tpot".into());
    let mut e2e = scripted("slo-e2e", "Guaranteed", now - 1_000, 2_500.0, Some(true));
    e2e.sla_target_ms = Some(2_000);
    e2e.slo_missed = Some("e2e".into());
    let mut unmeasured = served("slo-stream-unmeasured", 500, false);
    unmeasured.stream = true;
    unmeasured.ttft_ms = Some(80.0);
    unmeasured.tpot_ms = Some(f64::INFINITY);
    vec![late_stream, on_time_stream, whole_late, e2e, unmeasured]
}

#[test]
fn ttft_tpot_and_the_dimensions_missed_round_trip_through_the_writer() {
    let schema = Schema::create();
    let mut cfg = sluice_config::Config::default();
    cfg.ledger.schema = schema.0.clone();
    cfg.ledger.spool_dir = schema.spool_dir();
    let ledger = sluice_ledger::open(&cfg, PG_URL).unwrap();
    let now = now_ms();
    let rows = slo_rows(now);
    // Fresh rows go in by COPY; a spool replay of the same ones and one more by INSERT.
    for r in &rows {
        ledger.push(Arc::new(r.clone()));
    }
    ledger.drain();
    let s = ledger.status();
    assert_eq!(
        (s.rows_written, s.rows_rejected),
        (rows.len() as u64, 0),
        "{s:?}"
    );
    let mut more = rows[0].clone();
    more.request_id = "slo-inserted".into();
    more.received_at_ms = now - 100;
    let mut replayed = rows.clone();
    replayed.push(more);
    assert_eq!(
        ledger.db().insert(&replayed).unwrap(),
        1,
        "only the new row"
    );

    // /decisions/recent's reader gives back each record as it was pushed (the non-finite pace
    // as null).
    let back = ledger
        .db()
        .recent(&RecentFilter {
            limit: 100,
            ..Default::default()
        })
        .unwrap();
    assert_eq!(back.len(), replayed.len());
    let by_id: HashMap<&str, &Value> = back
        .iter()
        .map(|v| (v["request_id"].as_str().unwrap(), v))
        .collect();
    for r in &replayed {
        let mut want = r.clone();
        want.tpot_ms = want.tpot_ms.filter(|v| v.is_finite());
        assert_eq!(
            by_id[r.request_id.as_str()],
            &serde_json::to_value(&want).unwrap(),
            "{}",
            r.request_id
        );
    }
    let late = by_id["slo-stream-late"];
    assert_eq!(
        (
            &late["ttft_ms"],
            &late["tpot_ms"],
            &late["ttft_target_ms"],
            &late["tpot_target_ms"],
            &late["slo_missed"],
            &late["sla_violated"]
        ),
        (
            &json!(612.5),
            &json!(24.125),
            &json!(500),
            &json!(20),
            &json!("ttft,tpot"),
            &json!(true)
        )
    );
    assert_eq!(by_id["slo-stream-unmeasured"]["tpot_ms"], Value::Null);

    // The columns hold them as written, and `sla_violated` (a miss of any dimension) feeds the
    // SLA window as before.
    type Stored = (
        String,
        Option<f64>,
        Option<f64>,
        Option<i64>,
        Option<String>,
    );
    let stored: Vec<Stored> = pg()
        .query(
            &format!(
                "SELECT request_id, ttft_ms, tpot_ms, ttft_target_ms, slo_missed FROM {}
                 ORDER BY received_at_ms",
                schema.table("decisions")
            ),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2), r.get(3), r.get(4)))
        .collect();
    let row = |id: &str| stored.iter().find(|r| r.0 == id).unwrap().clone();
    assert_eq!(
        row("slo-stream-on-time"),
        (
            "slo-stream-on-time".into(),
            Some(120.0),
            Some(7.5),
            Some(150),
            None
        )
    );
    assert_eq!(
        row("slo-whole-late"),
        (
            "slo-whole-late".into(),
            None,
            None,
            Some(500),
            Some("ttft,tpot".into())
        )
    );
    let w = ledger.db().sla_window(now - 60_000, None).unwrap();
    assert_eq!((w.completed, w.violated), (6, 4));
}

#[test]
fn migration_5_keeps_a_version_4_ledger_readable_with_the_new_fields_null() {
    // A ledger as the release before migration 5 left it.
    let (schema, mut c) = ledger_at_version(4);
    let now = now_ms();
    let mut rows = random_rows(21, 300, now);
    for (i, r) in rows.iter_mut().enumerate().take(12) {
        r.inputs = Some(inputs(i as u64));
        r.stream = i % 2 == 0;
        r.ttfb_ms = Some(40.0 + i as f64);
        r.sla_target_ms = Some(1_000);
    }
    // Written as that release's writer wrote them: the rows and their per-second counts in one
    // statement, without the columns it did not know.
    let (older, kept) = insert_rows_sql_without(&SLO_COLUMNS);
    let statement = sluice_ledger::batch::insert_decisions_sql()
        .replace(&sluice_ledger::batch::insert_rows_sql(), &older);
    assert_ne!(statement, sluice_ledger::batch::insert_decisions_sql());
    let batch = sluice_ledger::batch::Batch::build(&rows);
    let params = batch.decision_params();
    let params: Vec<_> = kept.iter().map(|i| params[*i]).collect();
    let mut tx = c.transaction().unwrap();
    tx.batch_execute(&format!("SET LOCAL search_path TO {}", schema.0))
        .unwrap();
    let inserted: i64 = tx.query_one(&statement, &params).unwrap().get(0);
    tx.commit().unwrap();
    assert_eq!(inserted as usize, rows.len());

    let db = Db::new(PG_URL, &schema.0).unwrap();
    let recent = |db: &Db| {
        db.recent(&RecentFilter {
            limit: 1000,
            since_ms: Some(0),
            ..Default::default()
        })
        .unwrap()
    };
    let window_before = db.sla_window(now - 60_000, None).unwrap();
    let violated = |c: &mut postgres::Client| -> Vec<(String, Option<bool>)> {
        c.query(
            &format!(
                "SELECT request_id, sla_violated FROM {} ORDER BY request_id",
                schema.table("decisions")
            ),
            &[],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
    };
    let violated_before = violated(&mut c);
    let filenode = |c: &mut postgres::Client| -> u32 {
        c.query_one(
            "SELECT relfilenode FROM pg_class WHERE oid = $1::text::regclass",
            &[&schema.table("decisions")],
        )
        .unwrap()
        .get(0)
    };
    let file_before = filenode(&mut c);

    assert_eq!(db.migrate().unwrap(), vec![5]);
    // Nullable columns: the catalog changes, the table is not rewritten.
    assert_eq!(
        filenode(&mut c),
        file_before,
        "migration 5 rewrote the table"
    );
    let types: Vec<(String, String, String)> = c
        .query(
            "SELECT column_name::text, data_type::text, is_nullable::text
             FROM information_schema.columns
             WHERE table_schema = $1 AND table_name = 'decisions'
               AND column_name::text = ANY($2::text[]) ORDER BY ordinal_position",
            &[&schema.0, &SLO_COLUMNS.to_vec()],
        )
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let col = |n: &str, t: &str| (n.to_string(), t.to_string(), "YES".to_string());
    assert_eq!(
        types,
        [
            col("ttft_ms", "double precision"),
            col("tpot_ms", "double precision"),
            col("ttft_target_ms", "bigint"),
            col("tpot_target_ms", "bigint"),
            col("slo_missed", "text"),
            col("attempts", "bigint"),
            col("tried", "text"),
            col("trace_id", "text"),
        ]
    );

    // Every existing row reads back as before: the new fields null, sla_violated unchanged.
    let after = recent(&db);
    assert_eq!(after.len(), rows.len());
    let by_id: HashMap<&str, &Value> = after
        .iter()
        .map(|v| (v["request_id"].as_str().unwrap(), v))
        .collect();
    for r in &rows {
        let got = by_id[r.request_id.as_str()];
        assert_eq!(got, &serde_json::to_value(r).unwrap(), "{}", r.request_id);
        for f in SLO_COLUMNS {
            assert_eq!(got[f], Value::Null, "{} {f}", r.request_id);
        }
    }
    assert!(after.iter().any(|v| v["sla_violated"] == true));
    assert!(after.iter().any(|v| v["inputs"].is_object()));
    assert_eq!(violated(&mut c), violated_before);
    assert_eq!(db.sla_window(now - 60_000, None).unwrap(), window_before);
    check_windows(&db, &schema, now);

    // This build writes the new fields into the migrated table, and applies nothing again.
    let fresh = slo_rows(now);
    assert_eq!(db.insert(&fresh).unwrap(), fresh.len() as u64);
    let back = recent(&db);
    let late = back
        .iter()
        .find(|v| v["request_id"] == "slo-stream-late")
        .unwrap();
    assert_eq!(late["slo_missed"], "ttft,tpot");
    assert_eq!(late["ttft_ms"], 612.5);
    assert!(sluice_ledger::migrate::run(&mut c, &schema.0)
        .unwrap()
        .is_empty());
}
