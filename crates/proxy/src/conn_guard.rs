//! The connection guard: a `ServerApp` wrapped around Pingora's HTTP/1 proxy that owns each
//! client connection before Pingora parses anything on it.
//!
//! Pingora 0.9.1 bounds a request header only by fixed sizes (1 MiB, 256 fields) and reads it
//! with a per-read timeout, so a client trickling one byte a minute holds a connection forever;
//! it has no connection limit that can answer, and it answers bad framing with an empty 400.
//! The guard reads each request's head itself — under `limits.header_read_timeout_ms` counted
//! from the connection's accept (or, on a kept-alive connection, from the next request's first
//! byte), `limits.max_header_bytes`, `max_headers` and `max_request_line_bytes` — checks the
//! framing ([`super::head_check`]), reads a small body ahead to check its framing too, then
//! hands the bytes to Pingora as the session's pre-read prefix, so nothing is parsed twice
//! differently. Refusals are JSON in the API's error shape, followed by a lingering close.

use super::head_check::{self, BodyVerdict, Framing, HeadLimits, HeadVerdict, Refusal};
use super::{ProxyState, Sluice};
use async_trait::async_trait;
use bytes::BytesMut;
use pingora::apps::{HttpPersistentSettings, ServerApp};
use pingora::protocols::http::ServerSession;
use pingora::protocols::{Stream, ALPN};
use pingora::proxy::HttpProxy;
use pingora::server::ShutdownWatch;
use serde_json::json;
use sluice_config::LimitsConfig;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::{sleep_until, timeout_at, Instant, Sleep};

/// A refused connection over the limit is lingered on at most this long: a flood of them must
/// not hold sockets for the full drain time.
const OVER_LIMIT_LINGER: Duration = Duration::from_secs(1);
/// Read granularity; a head is checked after every read.
const READ_CHUNK: usize = 8 * 1024;

pub struct ConnGuard {
    proxy: Arc<HttpProxy<Sluice>>,
    app: Arc<ProxyState>,
    listeners: Vec<Listener>,
    /// Flipped when the service stops listening: idle keep-alive connections waiting for their
    /// next request close, as Pingora's own would. One channel per worker shard: every read
    /// that waits subscribes, checks the value and registers a waiter, and on one channel
    /// those counters and locks moved between the cores on every request.
    stopping: Box<[tokio::sync::watch::Sender<bool>]>,
}

/// One configured listener and its open-connection count.
struct Listener {
    name: String,
    port: Option<u16>,
    open: AtomicUsize,
}

/// Decrements the listener's count when the connection ends, however it ends.
struct Open<'a> {
    listener: &'a Listener,
    app: &'a ProxyState,
}

impl Drop for Open<'_> {
    fn drop(&mut self) {
        let now = self.listener.open.fetch_sub(1, Ordering::AcqRel) - 1;
        self.app
            .metrics
            .client_connections
            .with_label_values(&[&self.listener.name])
            .set(now as i64);
    }
}

enum Read {
    /// A complete head (and, for small bodies, body) whose framing passed the checks.
    Ready(BytesMut),
    Refuse(Refusal),
    Close,
}

/// A connection's read deadlines, one timer per kind, armed once and moved on per read.
///
/// A tokio timer armed while the other worker sleeps in the I/O driver wakes that worker (an
/// eventfd write, often behind a contended wheel lock): a fresh `timeout_at` per read did so on
/// most requests, Sluice's main excess of syscalls over bare Pingora. Moving a registered timer
/// to a later deadline is one atomic store, and each kind's deadline only ever moves later on
/// one connection, so the wheel is touched about once per deadline period instead.
struct Deadlines<'a> {
    /// The next request's first byte on a kept-alive connection.
    idle: Pin<&'a mut Sleep>,
    /// The rest of a request's head.
    head: Pin<&'a mut Sleep>,
    /// Each gap while a small body is read ahead.
    body: Pin<&'a mut Sleep>,
}

enum Stop {
    Eof,
    Timeout,
    Other,
}

impl ConnGuard {
    pub fn new(proxy: HttpProxy<Sluice>, app: Arc<ProxyState>, listen: &[String]) -> Self {
        let mut listeners: Vec<Listener> = listen
            .iter()
            .map(|addr| Listener {
                name: addr.clone(),
                port: addr.parse::<std::net::SocketAddr>().ok().map(|a| a.port()),
                open: AtomicUsize::new(0),
            })
            .collect();
        // Connections on an address not in the config (never expected) share one count.
        listeners.push(Listener {
            name: "other".into(),
            port: None,
            open: AtomicUsize::new(0),
        });
        for l in &listeners {
            app.metrics
                .client_connections
                .with_label_values(&[&l.name])
                .set(0);
        }
        ConnGuard {
            proxy: Arc::new(proxy),
            app,
            listeners,
            stopping: (0..sluice_runtime::worker_shard::COUNT)
                .map(|_| tokio::sync::watch::channel(false).0)
                .collect(),
        }
    }

    fn listener_of(&self, stream: &Stream) -> &Listener {
        let port = stream
            .get_socket_digest()
            .and_then(|d| d.local_addr().and_then(|a| a.as_inet()).map(|a| a.port()));
        self.listeners
            .iter()
            .find(|l| l.port.is_some() && l.port == port)
            .unwrap_or_else(|| &self.listeners[self.listeners.len() - 1])
    }

    async fn serve_http1(
        &self,
        mut stream: Stream,
        limits: &LimitsConfig,
        listener: &Listener,
        shutdown: &ShutdownWatch,
    ) {
        let mut accepted = Some(Instant::now());
        let mut settings: Option<HttpPersistentSettings> = None;
        let (idle, head, body) = (unarmed(), unarmed(), unarmed());
        tokio::pin!(idle, head, body);
        let mut deadlines = Deadlines {
            idle: idle.as_mut(),
            head: head.as_mut(),
            body: body.as_mut(),
        };
        loop {
            let prefix = match self
                .read_request(
                    &mut stream,
                    limits,
                    accepted.take(),
                    listener,
                    &mut deadlines,
                )
                .await
            {
                Read::Ready(prefix) => prefix,
                Read::Refuse(r) => {
                    let linger = Duration::from_millis(limits.refused_body_drain_ms);
                    self.refuse(stream, r, listener, limits, linger).await;
                    return;
                }
                Read::Close => return,
            };
            let mut session = ServerSession::new_http1(stream);
            match settings.take() {
                Some(s) => s.apply_to_session(&mut session),
                None => session.set_keepalive(Some(limits.keepalive_timeout_ms.div_ceil(1000))),
            }
            if *shutdown.borrow() {
                session.set_keepalive(None);
            }
            // Bounds each gap while the body streams in (Pingora's default is 60 s).
            session.set_read_timeout(Some(Duration::from_millis(limits.body_read_timeout_ms)));
            session.set_pipelined_prefix(prefix);
            // Names go upstream in canonical case (`admit::request_filter`), so their parsed
            // case is not kept (vendor/pingora-core).
            session.set_preserve_header_case(false);
            // Awaited in place: the trait's `process_new_http` boxes the request's whole state
            // machine and copies it into the box, ~13 KiB a request (vendor/pingora-proxy).
            let Some(reused) = self.proxy.process_new_http_unboxed(session, shutdown).await else {
                return;
            };
            let (next, next_settings) = reused.consume();
            stream = next;
            settings = next_settings;
        }
    }

    /// Reads one request's head, and a small body, within the limits. `accepted` is the accept
    /// time of a new connection; a kept-alive one first waits idle for the next request.
    async fn read_request(
        &self,
        stream: &mut Stream,
        limits: &LimitsConfig,
        accepted: Option<Instant>,
        listener: &Listener,
        deadlines: &mut Deadlines<'_>,
    ) -> Read {
        let head_limits = HeadLimits {
            max_header_bytes: limits.max_header_bytes,
            max_headers: limits.max_headers,
            max_request_line_bytes: limits.max_request_line_bytes,
        };
        let header_timeout = Duration::from_millis(limits.header_read_timeout_ms);
        let mut buf = BytesMut::with_capacity(READ_CHUNK);
        let head_deadline = match accepted {
            Some(t) => t + header_timeout,
            None => {
                let idle = Instant::now() + Duration::from_millis(limits.keepalive_timeout_ms);
                let timer = deadlines.idle.as_mut();
                if self.read_some(stream, &mut buf, timer, idle).await.is_err() {
                    return Read::Close;
                }
                Instant::now() + header_timeout
            }
        };
        let head = loop {
            match head_check::check_head(&buf, &head_limits) {
                HeadVerdict::Complete(head) => break head,
                HeadVerdict::Refuse(r) => return Read::Refuse(r),
                HeadVerdict::Incomplete => {
                    let timer = deadlines.head.as_mut();
                    match self.read_some(stream, &mut buf, timer, head_deadline).await {
                        Ok(()) => {}
                        Err(Stop::Timeout) => {
                            self.timed_out(stream, listener, "header_read", buf.len());
                            return Read::Close;
                        }
                        Err(Stop::Eof | Stop::Other) => return Read::Close,
                    }
                }
            }
        };
        let body_gap = Duration::from_millis(limits.body_read_timeout_ms);
        let body_end = match head.framing {
            // A client that waits for `100 Continue` sends nothing more until answered.
            _ if head.expect_continue => return Read::Ready(buf),
            Framing::NoBody => head.len,
            Framing::Length(n) if n <= head_check::BODY_LOOKAHEAD as u64 => {
                let end = head.len + n as usize;
                while buf.len() < end {
                    if !self
                        .read_body(stream, listener, &mut buf, deadlines, body_gap)
                        .await
                    {
                        return Read::Close;
                    }
                }
                end
            }
            Framing::Length(_) => return Read::Ready(buf),
            Framing::Chunked => loop {
                match head_check::check_chunked(&buf[head.len..]) {
                    BodyVerdict::Complete(n) => break head.len + n,
                    BodyVerdict::Refuse(r) => return Read::Refuse(r),
                    // Too large to hold: Pingora's parser frames the rest as it streams.
                    BodyVerdict::Incomplete
                        if buf.len() - head.len >= head_check::BODY_LOOKAHEAD =>
                    {
                        return Read::Ready(buf)
                    }
                    BodyVerdict::Incomplete => {
                        if !self
                            .read_body(stream, listener, &mut buf, deadlines, body_gap)
                            .await
                        {
                            return Read::Close;
                        }
                    }
                }
            },
        };
        // Bytes past the body already sent are a second request the client did not wait to
        // be answered: pipelining, or a request smuggled behind the first. Refused either way.
        if buf.len() > body_end {
            return Read::Refuse(head_check::TRAILING_DATA);
        }
        Read::Ready(buf)
    }

    /// More of a body being read ahead, at most `gap` after the last bytes; false when the
    /// client stopped sending (a timeout is logged and counted) or went away.
    async fn read_body(
        &self,
        stream: &mut Stream,
        listener: &Listener,
        buf: &mut BytesMut,
        deadlines: &mut Deadlines<'_>,
        gap: Duration,
    ) -> bool {
        let timer = deadlines.body.as_mut();
        match self
            .read_some(stream, buf, timer, Instant::now() + gap)
            .await
        {
            Ok(()) => true,
            Err(stop) => {
                if matches!(stop, Stop::Timeout) {
                    self.timed_out(stream, listener, "body_lookahead", buf.len());
                }
                false
            }
        }
    }

    async fn read_some(
        &self,
        stream: &mut Stream,
        buf: &mut BytesMut,
        mut timer: Pin<&mut Sleep>,
        deadline: Instant,
    ) -> Result<(), Stop> {
        if buf.capacity() - buf.len() < READ_CHUNK / 2 {
            buf.reserve(READ_CHUNK);
        }
        if timer.deadline() != deadline {
            timer.as_mut().reset(deadline);
        }
        let mut stopping = self.stopping[sluice_runtime::worker_shard::index()].subscribe();
        tokio::select! {
            // Bytes already sent win over the deadline and over stopping: a request that
            // arrived is served.
            biased;
            r = stream.read_buf(buf) => match r {
                Ok(0) => Err(Stop::Eof),
                Ok(_) => Ok(()),
                Err(_) => Err(Stop::Other),
            },
            _ = timer => Err(Stop::Timeout),
            _ = stopping.wait_for(|s| *s) => Err(Stop::Other),
        }
    }

    fn timed_out(&self, stream: &Stream, listener: &Listener, phase: &str, bytes: usize) {
        self.app
            .metrics
            .edge_timeouts
            .with_label_values(&[&listener.name, phase])
            .inc();
        log::warn!(
            target: "sluice::edge",
            "{}",
            json!({"event": "client_timeout", "phase": phase, "listener": listener.name,
                   "peer": peer(stream), "bytes_received": bytes})
        );
    }

    /// Answers with the refusal and closes the connection, lingering so a client still
    /// sending its request reads the answer instead of a reset.
    async fn refuse(
        &self,
        mut stream: Stream,
        r: Refusal,
        listener: &Listener,
        limits: &LimitsConfig,
        linger: Duration,
    ) {
        self.app
            .metrics
            .edge_refusals
            .with_label_values(&[&listener.name, r.code])
            .inc();
        log::warn!(
            target: "sluice::edge",
            "{}",
            json!({"event": "request_refused", "status": r.status, "code": r.code,
                   "listener": listener.name, "peer": peer(&stream)})
        );
        let body = json!({"error": {"type": "sluice_request", "code": r.code, "reason": r.code,
                                    "message": r.message}})
        .to_string();
        let retry_after = if r.status == 503 {
            "retry-after: 1\r\n"
        } else {
            ""
        };
        let head = format!(
            "HTTP/1.1 {} {}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             cache-control: no-store\r\nconnection: close\r\nx-sluice-decision: reject\r\n\
             x-sluice-reason: {}\r\n{retry_after}\r\n",
            r.status,
            http::StatusCode::from_u16(r.status)
                .ok()
                .and_then(|s| s.canonical_reason())
                .unwrap_or(""),
            body.len(),
            r.code,
        );
        let deadline = Instant::now() + linger;
        let written = async {
            stream.write_all(head.as_bytes()).await?;
            stream.write_all(body.as_bytes()).await?;
            stream.flush().await?;
            AsyncWriteExt::shutdown(&mut stream).await
        };
        if !matches!(timeout_at(deadline, written).await, Ok(Ok(()))) {
            return;
        }
        linger_drain(&mut stream, limits.refused_body_drain_bytes, deadline).await;
    }
}

/// A timer not yet armed: tokio registers a `Sleep` with its wheel only when first polled.
fn unarmed() -> Sleep {
    sleep_until(Instant::now() + Duration::from_secs(365 * 24 * 3600))
}

/// Reads and discards what the client still sends, until it closes, `max` bytes or `deadline`.
async fn linger_drain(stream: &mut Stream, max: usize, deadline: Instant) {
    let mut sink = vec![0u8; READ_CHUNK];
    let mut seen = 0usize;
    while seen <= max {
        match timeout_at(deadline, stream.read(&mut sink)).await {
            Ok(Ok(n)) if n > 0 => seen += n,
            _ => return,
        }
    }
}

fn peer(stream: &Stream) -> String {
    stream
        .get_socket_digest()
        .and_then(|d| d.peer_addr().map(|a| a.to_string()))
        .unwrap_or_default()
}

#[async_trait]
impl ServerApp for ConnGuard {
    async fn process_new(
        self: &Arc<Self>,
        stream: Stream,
        shutdown: &ShutdownWatch,
    ) -> Option<Stream> {
        let listener = self.listener_of(&stream);
        let limits = self.app.config.load().limits.clone();
        let open = listener.open.fetch_add(1, Ordering::AcqRel) + 1;
        let _open = Open {
            listener,
            app: &self.app,
        };
        self.app
            .metrics
            .client_connections
            .with_label_values(&[&listener.name])
            .set(open as i64);
        if open > limits.max_connections {
            let linger = OVER_LIMIT_LINGER.min(Duration::from_millis(limits.refused_body_drain_ms));
            self.refuse(
                stream,
                head_check::TOO_MANY_CONNECTIONS,
                listener,
                &limits,
                linger,
            )
            .await;
            return None;
        }
        // HTTP/2 (negotiated over TLS) has its own framing and limits: Pingora's h2 handles it.
        if matches!(stream.selected_alpn_proto(), Some(ALPN::H2)) {
            return ServerApp::process_new(&self.proxy, stream, shutdown).await;
        }
        self.serve_http1(stream, &limits, listener, shutdown).await;
        None
    }

    async fn cleanup(&self) {
        for shard in &self.stopping {
            shard.send_replace(true);
        }
        ServerApp::cleanup(&*self.proxy).await;
    }
}
