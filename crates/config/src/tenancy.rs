//! Who is asking: `Authorization: Bearer <key>` (matched against SHA-256 hashes in constant time)
//! or `X-Tenant-ID`, mapped to a tier. A client cannot promote itself: when keys are required the
//! header is ignored, and a key that is presented but unknown is refused rather than downgraded.

use crate::file::{Config, QuotaConfig};
use sha2::{Digest, Sha256};
use sluice_policy::{Reason, Tier};
use std::collections::HashMap;

/// Name recorded for requests that carry no tenant at all.
pub const ANONYMOUS: &str = "anonymous";
const MAX_TENANT_LEN: usize = 128;

#[derive(Debug, Clone, PartialEq)]
pub struct Identity {
    pub tenant: String,
    pub tier: Tier,
    pub via_api_key: bool,
    /// Share of a contended tier (`tenants.<name>.weight`; 1 for unknown tenants).
    pub weight: f64,
    pub quota: Option<QuotaConfig>,
    /// Its requests may tighten their TTFT/TPOT targets by header (`tenants.<name>.slo_headers`).
    pub slo_headers: bool,
}

/// What the directory knows of a configured tenant.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Known {
    tier: Tier,
    weight: f64,
    quota: Option<QuotaConfig>,
    slo_headers: bool,
}

#[derive(Debug, Clone)]
pub struct TenantDirectory {
    tiers: HashMap<String, Known>,
    keys: Vec<([u8; 32], String)>,
    require_key: bool,
    /// `None` = unknown tenants are refused.
    unknown_tier: Option<Tier>,
}

impl TenantDirectory {
    /// Builds from a validated config (tier names and hashes were checked by validation).
    pub fn from_config(cfg: &Config) -> Self {
        let tiers = cfg
            .tenants
            .iter()
            .filter_map(|(name, t)| {
                let known = Known {
                    tier: Tier::parse(&t.tier)?,
                    weight: t.weight,
                    quota: t.quota,
                    slo_headers: t.slo_headers,
                };
                Some((name.clone(), known))
            })
            .collect();
        let keys = cfg
            .api_keys
            .iter()
            .filter_map(|k| Some((decode_hex32(&k.sha256)?, k.tenant.clone())))
            .collect();
        Self {
            tiers,
            keys,
            require_key: cfg.auth.require_api_key,
            unknown_tier: Tier::parse(&cfg.auth.unknown_tenant),
        }
    }

    pub fn len(&self) -> usize {
        self.tiers.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tiers.is_empty()
    }

    /// `Err` carries the reason for a 401 (or 400 for a malformed header).
    pub fn resolve(
        &self,
        tenant_header: Option<&[u8]>,
        authorization: Option<&[u8]>,
    ) -> Result<Identity, Reason> {
        // Without configured keys a bearer token belongs to the backend (vLLM's --api-key), not us.
        let bearer = authorization
            .and_then(bearer_token)
            .filter(|_| !self.keys.is_empty());
        if let Some(key) = bearer {
            let tenant = self.match_key(key).ok_or(Reason::InvalidApiKey)?;
            let known = self
                .tiers
                .get(tenant)
                .copied()
                .ok_or(Reason::InvalidApiKey)?;
            return Ok(known.identity(tenant, true));
        }
        if self.require_key {
            return Err(Reason::MissingApiKey);
        }
        let name = match tenant_header {
            Some(raw) => Some(valid_tenant(raw).ok_or(Reason::InvalidTenantHeader)?),
            None => None,
        };
        if let Some((name, known)) = name.and_then(|n| Some((n, self.tiers.get(n)?))) {
            return Ok(known.identity(name, false));
        }
        let tier = self.unknown_tier.ok_or(Reason::UnknownTenant)?;
        let known = Known {
            tier,
            weight: 1.0,
            quota: None,
            slo_headers: true,
        };
        Ok(known.identity(name.unwrap_or(ANONYMOUS), false))
    }

    /// Compares against every key without an early exit, so timing reveals neither which key
    /// matched nor how many bytes did.
    fn match_key(&self, key: &[u8]) -> Option<&str> {
        let digest: [u8; 32] = Sha256::digest(key).into();
        let mut found = None;
        for (hash, tenant) in &self.keys {
            let diff = hash
                .iter()
                .zip(digest.iter())
                .fold(0u8, |acc, (a, b)| acc | (a ^ b));
            if diff == 0 {
                found = Some(tenant.as_str());
            }
        }
        found
    }
}

impl Known {
    fn identity(&self, tenant: &str, via_api_key: bool) -> Identity {
        Identity {
            tenant: tenant.to_string(),
            tier: self.tier,
            via_api_key,
            weight: self.weight,
            quota: self.quota,
            slo_headers: self.slo_headers,
        }
    }
}

fn bearer_token(value: &[u8]) -> Option<&[u8]> {
    let v = value
        .strip_prefix(b"Bearer ")
        .or_else(|| value.strip_prefix(b"bearer "))?;
    let v = v.trim_ascii();
    (!v.is_empty()).then_some(v)
}

fn valid_tenant(raw: &[u8]) -> Option<&str> {
    let s = std::str::from_utf8(raw).ok()?.trim();
    let ok = !s.is_empty() && s.len() <= MAX_TENANT_LEN && s.bytes().all(|b| b.is_ascii_graphic());
    ok.then_some(s)
}

fn decode_hex32(s: &str) -> Option<[u8; 32]> {
    let mut out = [0u8; 32];
    if s.len() != 64 {
        return None;
    }
    for (i, chunk) in s.as_bytes().chunks(2).enumerate() {
        let hex = std::str::from_utf8(chunk).ok()?;
        out[i] = u8::from_str_radix(hex, 16).ok()?;
    }
    Some(out)
}

/// SHA-256 hex of a key, as stored in config (`printf %s KEY | sha256sum`).
pub fn hash_key(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ApiKey;

    fn dir(require: bool, unknown: &str) -> TenantDirectory {
        let mut cfg = Config::default();
        cfg.tenants
            .insert("support-bot".into(), "Guaranteed".into());
        cfg.tenants
            .insert("batch-analytics".into(), "Best-Effort".into());
        cfg.api_keys.push(ApiKey {
            tenant: "support-bot".into(),
            sha256: hash_key("sk-support"),
        });
        cfg.auth.require_api_key = require;
        cfg.auth.unknown_tenant = unknown.into();
        TenantDirectory::from_config(&cfg)
    }

    #[test]
    fn header_maps_to_tier_and_unknown_gets_default() {
        let d = dir(false, "Best-Effort");
        assert_eq!(
            d.resolve(Some(b"support-bot"), None).unwrap().tier,
            Tier::Guaranteed
        );
        let anon = d.resolve(None, None).unwrap();
        assert_eq!(
            (anon.tenant.as_str(), anon.tier),
            (ANONYMOUS, Tier::BestEffort)
        );
        assert_eq!(
            d.resolve(Some(b"nobody"), None).unwrap().tier,
            Tier::BestEffort
        );
        assert_eq!(
            dir(false, "reject").resolve(Some(b"nobody"), None),
            Err(Reason::UnknownTenant)
        );
    }

    #[test]
    fn keys_win_and_cannot_be_bypassed() {
        let d = dir(true, "Best-Effort");
        let id = d
            .resolve(Some(b"batch-analytics"), Some(b"Bearer sk-support"))
            .unwrap();
        assert_eq!(
            (id.tenant.as_str(), id.tier, id.via_api_key),
            ("support-bot", Tier::Guaranteed, true)
        );
        assert_eq!(
            d.resolve(Some(b"support-bot"), None),
            Err(Reason::MissingApiKey),
            "header ignored"
        );
        assert_eq!(
            d.resolve(None, Some(b"Bearer wrong")),
            Err(Reason::InvalidApiKey)
        );
        let open = dir(false, "Best-Effort");
        assert_eq!(
            open.resolve(Some(b"support-bot"), Some(b"Bearer wrong")),
            Err(Reason::InvalidApiKey)
        );
    }

    #[test]
    fn malformed_header_is_refused() {
        let d = dir(false, "Best-Effort");
        assert_eq!(
            d.resolve(Some(b"bad tenant"), None),
            Err(Reason::InvalidTenantHeader)
        );
        assert_eq!(
            d.resolve(Some(&[0xff, 0xfe]), None),
            Err(Reason::InvalidTenantHeader)
        );
        assert_eq!(
            d.resolve(Some(&[b'a'; 200]), None),
            Err(Reason::InvalidTenantHeader)
        );
    }

    #[test]
    fn hash_matches_sha256sum() {
        assert_eq!(
            hash_key("abc"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }
}
