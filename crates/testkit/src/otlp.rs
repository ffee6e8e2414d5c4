//! A test OpenTelemetry collector: an OTLP/HTTP trace receiver on a free loopback port. It
//! accepts `POST /v1/traces` with `content-type: application/x-protobuf`, decodes the
//! `ExportTraceServiceRequest` with the `opentelemetry-proto` crate's generated types (so what
//! Sluice encodes is read by an independent decoder) and keeps every span, with its resource,
//! for assertions.
//!
//! Modes ([`OtlpMode`]) make it answer slowly, refuse (HTTP 500) or be down (the port closed and
//! open connections cut), switchable while it runs; every request it sees is listed
//! ([`OtlpReceiver::requests`]) whatever the mode.

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use opentelemetry_proto::tonic::common::v1::KeyValue;
use opentelemetry_proto::tonic::trace::v1::span::SpanKind;
use opentelemetry_proto::tonic::trace::v1::Span;
use prost::Message;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tokio::sync::{watch, Notify};
use tokio::task::JoinSet;

pub use opentelemetry_proto::tonic as otlp_proto;

/// How the receiver answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OtlpMode {
    /// 200 at once, spans kept.
    Accept,
    /// Waits this long, then answers as `Accept` (a client that gave up first leaves nothing).
    Slow(Duration),
    /// 500, spans not kept.
    Refuse,
    /// The port closed: connections refused, open ones cut.
    Down,
}

/// One request the receiver saw.
#[derive(Debug, Clone)]
pub struct ReceivedRequest {
    pub path: String,
    pub content_type: Option<String>,
    /// Spans in it (0 when it did not decode).
    pub spans: usize,
    pub at: Instant,
    pub mode: OtlpMode,
}

/// A kept span, with the resource and scope it came under.
#[derive(Debug, Clone)]
pub struct ReceivedSpan {
    pub resource: Vec<KeyValue>,
    pub scope_name: String,
    pub span: Span,
}

fn find<'a>(attrs: &'a [KeyValue], key: &str) -> Option<&'a AnyValue> {
    attrs
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| kv.value.as_ref())
        .and_then(|v| v.value.as_ref())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl ReceivedSpan {
    pub fn name(&self) -> &str {
        &self.span.name
    }

    pub fn kind(&self) -> SpanKind {
        SpanKind::try_from(self.span.kind).unwrap_or(SpanKind::Unspecified)
    }

    pub fn trace_id(&self) -> String {
        hex(&self.span.trace_id)
    }

    pub fn span_id(&self) -> String {
        hex(&self.span.span_id)
    }

    /// Empty for a root span.
    pub fn parent_span_id(&self) -> String {
        hex(&self.span.parent_span_id)
    }

    pub fn attr(&self, key: &str) -> Option<&AnyValue> {
        find(&self.span.attributes, key)
    }

    pub fn attr_str(&self, key: &str) -> Option<&str> {
        match self.attr(key)? {
            AnyValue::StringValue(s) => Some(s),
            _ => None,
        }
    }

    pub fn attr_i64(&self, key: &str) -> Option<i64> {
        match self.attr(key)? {
            AnyValue::IntValue(i) => Some(*i),
            _ => None,
        }
    }

    pub fn attr_f64(&self, key: &str) -> Option<f64> {
        match self.attr(key)? {
            AnyValue::DoubleValue(d) => Some(*d),
            _ => None,
        }
    }

    pub fn attr_bool(&self, key: &str) -> Option<bool> {
        match self.attr(key)? {
            AnyValue::BoolValue(b) => Some(*b),
            _ => None,
        }
    }

    /// A string-array attribute.
    pub fn attr_strs(&self, key: &str) -> Option<Vec<String>> {
        match self.attr(key)? {
            AnyValue::ArrayValue(a) => a
                .values
                .iter()
                .map(|v| match &v.value {
                    Some(AnyValue::StringValue(s)) => Some(s.clone()),
                    _ => None,
                })
                .collect(),
            _ => None,
        }
    }

    pub fn resource_str(&self, key: &str) -> Option<&str> {
        match find(&self.resource, key)? {
            AnyValue::StringValue(s) => Some(s),
            _ => None,
        }
    }

    /// `(name, time)` of each event.
    pub fn events(&self) -> Vec<(&str, u64)> {
        self.span
            .events
            .iter()
            .map(|e| (e.name.as_str(), e.time_unix_nano))
            .collect()
    }
}

#[derive(Default)]
struct Store {
    spans: Mutex<Vec<ReceivedSpan>>,
    requests: Mutex<Vec<ReceivedRequest>>,
    changed: Notify,
}

impl Store {
    fn record(&self, r: ReceivedRequest) {
        lock(&self.requests).push(r);
        self.changed.notify_waiters();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The receiver; stopped on drop.
pub struct OtlpReceiver {
    addr: SocketAddr,
    store: Arc<Store>,
    mode: watch::Sender<OtlpMode>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for OtlpReceiver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl OtlpReceiver {
    /// Starts accepting on a free loopback port (inside a tokio runtime).
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port on 127.0.0.1");
        let addr = listener.local_addr().expect("the listener's address");
        let store = Arc::new(Store::default());
        let (mode, mode_rx) = watch::channel(OtlpMode::Accept);
        let task = tokio::spawn(serve(listener, addr, store.clone(), mode_rx));
        Self {
            addr,
            store,
            mode,
            task,
        }
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The base URL (`OTEL_EXPORTER_OTLP_ENDPOINT`'s form): `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The full traces URL: `http://127.0.0.1:PORT/v1/traces`.
    pub fn traces_url(&self) -> String {
        format!("http://{}/v1/traces", self.addr)
    }

    pub fn set_mode(&self, mode: OtlpMode) {
        self.mode.send_replace(mode);
    }

    pub fn mode(&self) -> OtlpMode {
        *self.mode.borrow()
    }

    /// Every span kept so far, in arrival order.
    pub fn spans(&self) -> Vec<ReceivedSpan> {
        lock(&self.store.spans).clone()
    }

    /// Every request seen so far, kept or not.
    pub fn requests(&self) -> Vec<ReceivedRequest> {
        lock(&self.store.requests).clone()
    }

    /// Forgets what was received.
    pub fn clear(&self) {
        lock(&self.store.spans).clear();
        lock(&self.store.requests).clear();
    }

    pub fn find(&self, pred: impl Fn(&ReceivedSpan) -> bool) -> Vec<ReceivedSpan> {
        lock(&self.store.spans)
            .iter()
            .filter(|s| pred(s))
            .cloned()
            .collect()
    }

    pub fn by_name(&self, name: &str) -> Vec<ReceivedSpan> {
        self.find(|s| s.name() == name)
    }

    pub fn by_kind(&self, kind: SpanKind) -> Vec<ReceivedSpan> {
        self.find(|s| s.kind() == kind)
    }

    /// The spans of one trace (its id in lower-case hex).
    pub fn by_trace(&self, trace_id: &str) -> Vec<ReceivedSpan> {
        self.find(|s| s.trace_id() == trace_id)
    }

    /// Waits until at least `n` spans are kept; all of them, or why not.
    pub async fn wait_for_spans(
        &self,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<ReceivedSpan>, String> {
        self.wait(timeout, || {
            let spans = lock(&self.store.spans);
            (spans.len() >= n).then(|| spans.clone())
        })
        .await
        .map_err(|_| {
            format!(
                "{} spans within {timeout:?}, wanted {n}; requests: {:?}",
                lock(&self.store.spans).len(),
                self.requests()
                    .iter()
                    .map(|r| (r.path.as_str(), r.spans, r.mode))
                    .collect::<Vec<_>>()
            )
        })
    }

    /// Waits until at least `n` requests were seen (kept or not).
    pub async fn wait_for_requests(
        &self,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<ReceivedRequest>, String> {
        self.wait(timeout, || {
            let r = lock(&self.store.requests);
            (r.len() >= n).then(|| r.clone())
        })
        .await
        .map_err(|_| {
            format!(
                "{} requests within {timeout:?}, wanted {n}",
                self.requests().len()
            )
        })
    }

    async fn wait<T>(&self, timeout: Duration, ready: impl Fn() -> Option<T>) -> Result<T, ()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let changed = self.store.changed.notified();
            if let Some(v) = ready() {
                return Ok(v);
            }
            if tokio::time::timeout_at(deadline, changed).await.is_err() {
                return ready().ok_or(());
            }
        }
    }
}

/// Accepts while the mode is not `Down`; on `Down` closes the port and cuts every connection,
/// and opens the same port again when the mode changes back.
async fn serve(
    listener: TcpListener,
    addr: SocketAddr,
    store: Arc<Store>,
    mut mode: watch::Receiver<OtlpMode>,
) {
    let mut listener = Some(listener);
    let mut conns = JoinSet::new();
    loop {
        if *mode.borrow_and_update() == OtlpMode::Down {
            listener = None;
            conns.abort_all();
            while *mode.borrow_and_update() == OtlpMode::Down {
                if mode.changed().await.is_err() {
                    return;
                }
            }
        }
        let l = match listener.take() {
            Some(l) => l,
            None => match rebind(addr).await {
                Some(l) => l,
                None => return,
            },
        };
        let accepted = tokio::select! {
            a = l.accept() => a,
            r = mode.changed() => {
                if r.is_err() {
                    return;
                }
                listener = Some(l);
                continue;
            }
        };
        listener = Some(l);
        let Ok((stream, _)) = accepted else { continue };
        let (store, mode) = (store.clone(), mode.clone());
        conns.spawn(async move {
            let svc = service_fn(move |req| handle(req, store.clone(), mode.clone()));
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
        while conns.try_join_next().is_some() {}
    }
}

async fn rebind(addr: SocketAddr) -> Option<TcpListener> {
    for _ in 0..100 {
        if let Ok(l) = TcpListener::bind(addr).await {
            return Some(l);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    None
}

async fn handle(
    req: Request<Incoming>,
    store: Arc<Store>,
    mode: watch::Receiver<OtlpMode>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let mode = *mode.borrow();
    let path = req.uri().path().to_string();
    let content_type = req
        .headers()
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let answer = |status: StatusCode| {
        let mut r = Response::new(Full::new(Bytes::new()));
        *r.status_mut() = status;
        r.headers_mut().insert(
            http::header::CONTENT_TYPE,
            http::HeaderValue::from_static("application/x-protobuf"),
        );
        Ok(r)
    };
    let body = req.into_body().collect().await.map(|b| b.to_bytes());
    let decoded = body
        .ok()
        .and_then(|b| ExportTraceServiceRequest::decode(b).ok());
    let spans = decoded.as_ref().map_or(0, |d| {
        d.resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum()
    });
    store.record(ReceivedRequest {
        path: path.clone(),
        content_type: content_type.clone(),
        spans,
        at: Instant::now(),
        mode,
    });
    if path != "/v1/traces" {
        return answer(StatusCode::NOT_FOUND);
    }
    if content_type.as_deref() != Some("application/x-protobuf") {
        return answer(StatusCode::UNSUPPORTED_MEDIA_TYPE);
    }
    match mode {
        OtlpMode::Refuse | OtlpMode::Down => return answer(StatusCode::INTERNAL_SERVER_ERROR),
        OtlpMode::Slow(d) => tokio::time::sleep(d).await,
        OtlpMode::Accept => {}
    }
    let Some(decoded) = decoded else {
        return answer(StatusCode::BAD_REQUEST);
    };
    {
        let mut kept = lock(&store.spans);
        for rs in decoded.resource_spans {
            let resource = rs.resource.map(|r| r.attributes).unwrap_or_default();
            for ss in rs.scope_spans {
                let scope_name = ss.scope.map(|s| s.name).unwrap_or_default();
                for span in ss.spans {
                    kept.push(ReceivedSpan {
                        resource: resource.clone(),
                        scope_name: scope_name.clone(),
                        span,
                    });
                }
            }
        }
    }
    store.changed.notify_waiters();
    answer(StatusCode::OK)
}
