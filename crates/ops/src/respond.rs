//! The operations listener's answers: whole bodies, never streamed, never cached.

use http::{header, HeaderValue, Response};
use serde::Serialize;

pub(crate) fn bad(code: &str, msg: impl Into<String>) -> serde_json::Value {
    serde_json::json!({"error": {"type": "sluice_ops", "code": code, "message": msg.into()}})
}

pub(crate) fn json_response(status: u16, body: &impl Serialize) -> Response<Vec<u8>> {
    let body = serde_json::to_vec(body).unwrap_or_else(|_| b"{}".to_vec());
    response(status, "application/json", body)
}

pub(crate) fn response(
    status: u16,
    content_type: &'static str,
    body: Vec<u8>,
) -> Response<Vec<u8>> {
    let mut resp = Response::new(body);
    *resp.status_mut() = http::StatusCode::from_u16(status).unwrap_or(http::StatusCode::OK);
    let h = resp.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    let len = resp.body().len();
    resp.headers_mut()
        .insert(header::CONTENT_LENGTH, HeaderValue::from(len));
    resp
}

pub(crate) fn with_header(
    mut resp: Response<Vec<u8>>,
    name: &'static str,
    value: &'static str,
) -> Response<Vec<u8>> {
    resp.headers_mut()
        .insert(name, HeaderValue::from_static(value));
    resp
}
