//! The limits a request's head must keep, as configured per listener (`limits:`), and the
//! ones Pingora itself enforces, which the configured ones must stay within.

/// Pingora's own hard limits (`pingora-core` `v1::common::{MAX_HEADERS, MAX_HEADER_SIZE}`): ours
/// must stay within them or Pingora's bare 400 would answer first.
pub const PINGORA_MAX_HEADERS: usize = 256;
pub const PINGORA_MAX_HEADER_BYTES: usize = 1_048_575;

/// What the connection guard holds a request's head to.
#[derive(Debug, Clone, Copy)]
pub struct HeadLimits {
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub max_request_line_bytes: usize,
}
