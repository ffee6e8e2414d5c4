//! Sluice's runtime services, each owning its own I/O and publishing through handles the request
//! path reads without waiting: the signal hub and its samplers, the pools and their health
//! checks, admission (in-process or Redis), quotas, metrics, the decision ring and the request
//! log writer.

pub mod admission;
pub mod alloc;
pub mod backend_http;
pub mod backend_tls;
pub mod fleet;
pub mod lifecycle;
mod log_pages;
pub mod log_writer;
pub mod metrics;
pub mod pools;
pub mod quota;
pub mod redis_link;
pub mod replica;
pub mod ring;
pub mod signals;
pub mod worker_shard;
