//! Who may read what on the operations listener. The probes answer anyone (a kubelet probes
//! from the node's address). Everything else reveals tenants (`/decisions/recent`) or moves the
//! controller (`/admin/*`): from loopback it answers as it is, from anywhere else only with
//! `Authorization: Bearer $SLUICE_ADMIN_TOKEN`. `/admin/*` asks for the token on loopback too
//! once one is configured, as it always did.

use std::net::IpAddr;

/// The endpoints that answer without a token, wherever the caller is.
pub(crate) const PROBES: [&str; 3] = ["/healthz", "/livez", "/readyz"];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    Allowed,
    /// No or a wrong token: 401.
    Unauthorized(&'static str),
}

pub(crate) fn check(
    path: &str,
    peer: Option<IpAddr>,
    token: Option<&str>,
    given: Option<&[u8]>,
) -> Verdict {
    if PROBES.contains(&path) {
        return Verdict::Allowed;
    }
    let loopback = peer.is_some_and(|ip| ip.is_loopback());
    let admin = path.starts_with("/admin/");
    match token {
        Some(token) if !loopback || admin => {
            if given.is_some_and(|g| constant_time_eq(g, token.as_bytes())) {
                Verdict::Allowed
            } else {
                Verdict::Unauthorized("this endpoint needs Authorization: Bearer $SLUICE_ADMIN_TOKEN")
            }
        }
        None if !loopback => Verdict::Unauthorized(
            "no admin token is configured (SLUICE_ADMIN_TOKEN): this endpoint answers loopback only",
        ),
        _ => Verdict::Allowed,
    }
}

/// The `Bearer` credentials of an `Authorization` header.
pub(crate) fn bearer(header: Option<&[u8]>) -> Option<&[u8]> {
    header.and_then(|v| v.strip_prefix(b"Bearer "))
}

/// Length leaks nothing useful; the byte comparison itself takes the same time for any
/// mismatch position.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOCAL: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
    const REMOTE: Option<IpAddr> = Some(IpAddr::V4(std::net::Ipv4Addr::new(10, 1, 2, 3)));

    #[test]
    fn probes_answer_anyone() {
        for p in PROBES {
            assert_eq!(check(p, REMOTE, None, None), Verdict::Allowed);
            assert_eq!(check(p, REMOTE, Some("t"), None), Verdict::Allowed);
        }
    }

    #[test]
    fn off_loopback_everything_else_needs_the_token() {
        for p in [
            "/status",
            "/metrics",
            "/decisions/recent",
            "/dashboard",
            "/admin/pressure",
        ] {
            assert!(
                matches!(check(p, REMOTE, None, None), Verdict::Unauthorized(_)),
                "{p}"
            );
            assert!(
                matches!(check(p, REMOTE, Some("t"), None), Verdict::Unauthorized(_)),
                "{p}"
            );
            assert!(
                matches!(
                    check(p, REMOTE, Some("t"), Some(b"x")),
                    Verdict::Unauthorized(_)
                ),
                "{p}"
            );
            assert_eq!(
                check(p, REMOTE, Some("t"), Some(b"t")),
                Verdict::Allowed,
                "{p}"
            );
        }
    }

    #[test]
    fn loopback_reads_freely_and_admin_asks_for_a_configured_token() {
        assert_eq!(check("/status", LOCAL, Some("t"), None), Verdict::Allowed);
        assert_eq!(
            check("/admin/pressure", LOCAL, None, None),
            Verdict::Allowed
        );
        assert!(matches!(
            check("/admin/pressure", LOCAL, Some("t"), None),
            Verdict::Unauthorized(_)
        ));
        assert_eq!(bearer(Some(b"Bearer abc")), Some(&b"abc"[..]));
        assert_eq!(bearer(Some(b"Basic abc")), None);
    }
}
