//! Reading a configuration: the file, the tenants file it names, the `SLUICE_*` environment,
//! then one validation; and the settings derived from it (Pingora's, the policy's).

use crate::env;
use crate::error::{yaml_error, ConfigError};
use crate::file::{Config, TenantsFile};
use crate::validate;
use sluice_policy::tenant_policy::PolicyRules;
use std::path::{Path, PathBuf};

/// The configuration shipped inside the binary, used by `sluice demo` and as the base of tests.
pub const EMBEDDED_DEFAULT: &str = include_str!("../../../conf/sluice.yaml");
pub const EMBEDDED_TENANTS: &str = include_str!("../../../conf/tenants.yaml");

impl Config {
    /// Reads, merges and validates the config at `path` using the process environment.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        Self::load_with_env(path, &env::process_env)
    }

    pub fn load_with_env(path: &Path, env: &env::EnvFn) -> Result<Config, ConfigError> {
        let label = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|e| ConfigError::new(&label, "(file)", format!("cannot read: {e}")))?;
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        Self::from_yaml(&text, &label, &dir, None, env)
    }

    /// Parses a config from text. `tenants_text` supplies the tenants file's contents when the
    /// config names one that does not exist on disk (the embedded demo).
    pub fn from_yaml(
        text: &str,
        label: &str,
        dir: &Path,
        tenants_text: Option<&str>,
        env: &env::EnvFn,
    ) -> Result<Config, ConfigError> {
        let mut cfg: Config = serde_yaml::from_str(text).map_err(|e| yaml_error(label, &e))?;
        cfg.source = label.to_string();
        let ca_files = cfg
            .pools
            .0
            .iter_mut()
            .map(|p| &mut p.config.tls)
            .chain(cfg.fallbacks.iter_mut().map(|f| &mut f.tls))
            .filter_map(|t| t.ca_file.as_mut());
        let listener_files = cfg
            .listen_tls
            .iter_mut()
            .flat_map(|l| [&mut l.cert, &mut l.key]);
        for path in listener_files.chain(ca_files) {
            if path.is_relative() {
                *path = dir.join(&*path);
            }
        }
        if let Some(rel) = cfg.tenants_file.clone() {
            let path = if rel.is_absolute() {
                rel
            } else {
                dir.join(rel)
            };
            let tlabel = path.display().to_string();
            let ttext = match (std::fs::read_to_string(&path), tenants_text) {
                (Ok(t), _) => t,
                (Err(_), Some(t)) => t.to_string(),
                (Err(e), None) => {
                    return Err(ConfigError::new(
                        label,
                        "tenants_file",
                        format!("cannot read {tlabel}: {e}"),
                    ))
                }
            };
            let tf: TenantsFile =
                serde_yaml::from_str(&ttext).map_err(|e| yaml_error(&tlabel, &e))?;
            for (name, entry) in tf.tenants {
                cfg.tenants.entry(name).or_insert(entry);
            }
            cfg.api_keys.extend(tf.api_keys);
            cfg.tenants_source = tlabel;
        } else {
            cfg.tenants_source = label.to_string();
        }
        env::apply(&mut cfg, env)?;
        validate::fallbacks(&cfg)?;
        cfg.pools_from_fallbacks();
        validate::validate(&cfg)?;
        Ok(cfg)
    }

    /// The embedded default, as `sluice demo` runs it.
    pub fn embedded(env: &env::EnvFn) -> Result<Config, ConfigError> {
        Self::from_yaml(
            EMBEDDED_DEFAULT,
            "(embedded conf/sluice.yaml)",
            &PathBuf::from("conf"),
            Some(EMBEDDED_TENANTS),
            env,
        )
    }

    /// Pingora's server settings from the `server:` section. `threads` defaults to the
    /// machine's cores: Pingora's default of one worker thread would leave cores idle.
    pub fn server_conf(&self) -> Result<pingora::server::configuration::ServerConf, ConfigError> {
        let mut map = self.server.clone();
        let threads = serde_yaml::Value::from("threads");
        if !map.contains_key(&threads) {
            let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
            map.insert(threads, serde_yaml::Value::from(cores as u64));
        }
        let conf: pingora::server::configuration::ServerConf =
            serde_yaml::from_value(serde_yaml::Value::Mapping(map)).map_err(|e| {
                let e = yaml_error(&self.source, &e);
                ConfigError::new(e.file, format!("server.{}", e.key), e.reason)
            })?;
        conf.validate()
            .map_err(|e| ConfigError::new(&self.source, "server", e.to_string()))
    }

    pub fn policy_rules(&self) -> PolicyRules {
        crate::file::policy_rules(self)
    }
}
