//! Sluice: a QoS-aware capacity-governance proxy for self-hosted LLM inference.
//!
//! Data flows one way: request → [`tenancy`] (tenant & tier) → [`policy`] (pure decision) →
//! [`admission`] (in-flight slots and queue) → [`shaping`] (body rewrite) → [`pools`] (upstream
//! choice) → upstream → outcome → [`decisions`] / [`metrics`]. The Pingora phases in [`proxy`]
//! only glue these steps together; background services in [`signals`] and [`pools`] own all I/O.

pub mod admission;
pub mod alloc;
pub mod backend_tls;
pub mod config;
pub mod decisions;
pub mod demo;
pub mod json_line;
pub mod ledger;
pub mod lifecycle;
mod log_pages;
pub mod log_writer;
pub mod metrics;
pub mod ops;
pub mod policy;
pub mod pools;
pub mod proxy;
pub mod quota;
mod redis_conn;
pub mod replay;
pub mod server;
pub mod shaping;
pub mod signals;
pub mod sim;
pub mod tenancy;
pub mod worker_shard;
