//! Sluice: a QoS-aware capacity-governance proxy for self-hosted LLM inference.
//!
//! Data flows one way: request → [`tenancy`] (tenant & tier) → [`policy`] (pure decision) →
//! [`admission`] (in-flight slots and queue) → [`shaping`] (body rewrite) → [`pools`] (upstream
//! choice) → upstream → outcome → [`decisions`] / [`metrics`]. The Pingora phases in [`proxy`]
//! only glue these steps together; background services in [`signals`] and [`pools`] own all I/O.

pub mod sim;
pub mod policy;
pub mod config;
pub mod tenancy;
pub mod shaping;
pub mod admission;
