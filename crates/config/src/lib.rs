//! Configuration: the YAML file (`conf/sluice.yaml`) plus `conf/tenants.yaml`, overridden by
//! `SLUICE_*` environment variables (see [`env`]), then command-line flags. Precedence is
//! CLI > environment > file > built-in default. [`Config::load`] returns either a validated
//! config or a [`ConfigError`] naming the file, the key and the reason. Also what the config
//! points at and only this crate should read: tenants and API keys ([`tenancy`]), certificate
//! and CA files ([`tls`]), the header limits ([`limits`]).

mod derive;
pub mod env;
mod error;
mod file;
pub mod limits;
mod load;
mod pools;
pub mod tenancy;
pub mod tls;
mod url;
mod validate;

pub use error::ConfigError;
pub use file::*;
pub use load::{EMBEDDED_DEFAULT, EMBEDDED_TENANTS};
pub use pools::{
    BackendTarget, BackendTlsConfig, EjectionConfig, FallbackTarget, HealthCheckConfig, NamedPool,
    PoolClass, PoolConfig, PoolsConfig, Selection,
};
pub use url::backend_of_url;
