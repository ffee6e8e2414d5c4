//! What a backend receives on the wire. A request with a small body reaches it as one TCP
//! segment, header and body in a single send (`PeerOptions::coalesce_request_header`,
//! vendor/pingora-core), byte for byte; a body past the coalescing bound and a client that
//! waits for `100 Continue` are served as before.
//!
//! The backend here is a plain TCP server, not the simulator, so the test can ask the kernel
//! (`ss -ti`) how many segments each of its connections has received.

mod common;

use common::*;
use serde_json::json;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// One chat request as the backend read it.
#[derive(Clone, Debug)]
struct Seen {
    head: String,
    body: Vec<u8>,
    /// Segments the connection had received once the request was read (`ss`'s `segs_in`).
    segs_in: u64,
}

struct Backend {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Backend {
    fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let record = Arc::clone(&seen);
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let record = Arc::clone(&record);
                std::thread::spawn(move || answer(conn, port, &record));
            }
        });
        Backend { port, seen }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn requests(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

/// Answers requests on one connection until it closes: /health, vLLM's /metrics, and chat
/// completions, which are recorded with the connection's segment count.
fn answer(conn: TcpStream, port: u16, seen: &Mutex<Vec<Seen>>) {
    let peer = conn.peer_addr().unwrap().port();
    let mut out = conn.try_clone().unwrap();
    let mut reader = BufReader::new(conn);
    loop {
        let mut head = String::new();
        loop {
            let mut line = String::new();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            head.push_str(&line);
            if line == "\r\n" {
                break;
            }
        }
        let lower = head.to_ascii_lowercase();
        let length = lower
            .lines()
            .find_map(|l| l.strip_prefix("content-length:"))
            .map_or(0, |v| v.trim().parse::<usize>().unwrap());
        if lower.contains("\r\nexpect: 100-continue") {
            out.write_all(b"HTTP/1.1 100 Continue\r\n\r\n").unwrap();
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let path = head.split(' ').nth(1).unwrap_or("").to_string();
        let (kind, answer) = match path.as_str() {
            "/health" => ("text/plain", "ok".to_string()),
            "/metrics" => (
                "text/plain",
                "vllm:kv_cache_usage_perc{model_name=\"m\"} 0.1\n\
                 vllm:num_requests_waiting{model_name=\"m\"} 0\n"
                    .to_string(),
            ),
            _ => {
                let segs_in = segs_in(port, peer);
                seen.lock().unwrap().push(Seen {
                    head: head.clone(),
                    body: body.clone(),
                    segs_in,
                });
                (
                    "application/json",
                    json!({"id": "c1", "object": "chat.completion", "model": "m",
                           "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                                        "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}})
                    .to_string(),
                )
            }
        };
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {kind}\r\ncontent-length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if out.write_all(response.as_bytes()).is_err() {
            return;
        }
    }
}

/// The kernel's count of segments received by the backend's end of one connection.
fn segs_in(local: u16, peer: u16) -> u64 {
    let filter = format!("( sport = :{local} and dport = :{peer} )");
    let out = std::process::Command::new("ss")
        .args(["-tinH", "state", "established", &filter])
        .output()
        .expect("ss (iproute2)");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split_whitespace()
        .find_map(|w| w.strip_prefix("segs_in:"))
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no segs_in for :{local} <- :{peer} in {text:?}"))
}

/// A chat request written by the test itself in one `write_all`: the segment count a
/// single-send request gives on a fresh connection (handshake included).
fn one_send_baseline(backend: &Backend) -> u64 {
    let body = br#"{"model":"m","messages":[]}"#;
    let mut c = TcpStream::connect(backend.addr()).unwrap();
    let mut req = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    )
    .into_bytes();
    req.extend_from_slice(body);
    c.write_all(&req).unwrap();
    let mut first = [0u8; 12];
    c.read_exact(&mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    let seen = backend.requests();
    assert_eq!(seen.len(), 1);
    backend.seen.lock().unwrap().clear();
    seen[0].segs_in
}

/// The model is declared, so the backend sees only proxied requests (no `/v1/models` asks).
fn config_for(backend: &Backend) -> serde_json::Value {
    let mut cfg = config(&[&backend.addr()], &[]);
    merge(&mut cfg, json!({"pools": {"on-demand": {"models": ["m"]}}}));
    cfg
}

#[tokio::test]
async fn a_small_body_reaches_the_backend_with_its_header_in_one_segment() {
    let backend = Backend::start();
    let baseline = one_send_baseline(&backend);
    let sluice = serve(&config_for(&backend)).await;

    let body =
        json!({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5});
    let r = sluice.chat("support-bot", body.clone()).await;
    assert_eq!(r.status(), 200, "{:?}", r.text().await);

    let seen = backend.requests();
    assert_eq!(seen.len(), 1, "{seen:?}");
    let got: serde_json::Value = serde_json::from_slice(&seen[0].body).unwrap();
    assert_eq!(got, body, "the body arrives as sent");
    assert!(
        seen[0]
            .head
            .to_ascii_lowercase()
            .contains("\r\nx-request-id: "),
        "{}",
        seen[0].head
    );
    assert_eq!(
        seen[0].segs_in, baseline,
        "header and body in one segment, as a single write from a client gives"
    );
}

#[tokio::test]
async fn a_large_body_and_an_expect_continue_request_still_arrive_whole() {
    let backend = Backend::start();
    let sluice = serve(&config_for(&backend)).await;

    // Past the 16 KiB coalescing bound (and past the guard's read-ahead).
    let content = "x".repeat(100 * 1024);
    let body =
        json!({"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 5});
    let r = sluice.chat("support-bot", body.clone()).await;
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let got: serde_json::Value = serde_json::from_slice(&backend.requests()[0].body).unwrap();
    assert_eq!(got, body);

    // A client that sends its body only after `100 Continue`.
    let small = br#"{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":5}"#;
    let addr = sluice.proc.addr.clone();
    let answer = tokio::task::spawn_blocking(move || {
        let mut c = TcpStream::connect(addr).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let head = format!(
            "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\nx-tenant-id: support-bot\r\ncontent-type: application/json\r\nexpect: 100-continue\r\ncontent-length: {}\r\n\r\n",
            small.len()
        );
        c.write_all(head.as_bytes()).unwrap();
        let mut reader = BufReader::new(c.try_clone().unwrap());
        let mut status = String::new();
        reader.read_line(&mut status).unwrap();
        if status.starts_with("HTTP/1.1 100") {
            let mut blank = String::new();
            reader.read_line(&mut blank).unwrap();
            c.write_all(small).unwrap();
            status.clear();
            reader.read_line(&mut status).unwrap();
        }
        status
    })
    .await
    .unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer:?}");
    let seen = backend.requests();
    assert_eq!(seen.len(), 2, "{seen:?}");
    assert_eq!(seen[1].body, small.to_vec());
}
