//! What a configuration problem looks like to a user: the file, the key and the reason.

use std::fmt;

/// A configuration problem a user can fix: which file, which key, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub file: String,
    pub key: String,
    pub reason: String,
}

impl ConfigError {
    pub fn new(file: impl Into<String>, key: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            file: file.into(),
            key: key.into(),
            reason: reason.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}: {}", self.file, self.key, self.reason)
    }
}

impl std::error::Error for ConfigError {}

/// serde_yaml's messages already carry the key path ("tiers.Standard.inflight_capacity: invalid
/// type …"); split it out so every error has the same file/key/reason shape.
pub(crate) fn yaml_error(label: &str, e: &serde_yaml::Error) -> ConfigError {
    let msg = e.to_string();
    match msg.split_once(": ") {
        Some((key, reason)) if !key.contains(' ') => ConfigError::new(label, key, reason),
        _ => ConfigError::new(label, "(document)", msg),
    }
}
