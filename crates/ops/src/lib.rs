//! Operations on their own listener (`ops_listen`, loopback by default): probes, metrics,
//! status, recent decisions, the `/dashboard` page and the admin signal overrides. Fed handles
//! to the services ([`OpsState`]), never the request path; off loopback everything but the
//! probes asks for the admin token ([`auth`]).

mod admin;
mod auth;
mod query;
mod respond;
mod server;
mod state;
mod status;

pub use server::OpsServer;
pub use state::OpsState;
