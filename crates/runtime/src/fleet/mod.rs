//! The fleet as routing sees it: which pools and backends serve which model ([`routes`]) and
//! what each backend carries right now ([`load`]).

pub mod load;
pub mod routes;

pub use load::{BackendLoad, BackendLoads, Lease, PrefixCache};
pub use routes::{Discovered, Fleet, PoolModels, PoolSpec, Route, Routes};
