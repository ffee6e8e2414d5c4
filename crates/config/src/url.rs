//! A backend's address from its URL, for the config's fallbacks and their validation alike.

/// `http://host:port[/]` → (`host:port`, false); `https://…` → (…, true), TLS on.
pub fn backend_of_url(url: &str) -> Result<(String, bool), String> {
    let (rest, tls) = match (url.strip_prefix("http://"), url.strip_prefix("https://")) {
        (Some(rest), _) => (rest, false),
        (_, Some(rest)) => (rest, true),
        _ => return Err(format!("{url:?} must start with http:// or https://")),
    };
    let hostport = rest.trim_end_matches('/');
    if hostport.contains('/') {
        return Err(format!("{url:?} must not have a path"));
    }
    host_port(hostport)?;
    Ok((hostport.to_string(), tls))
}

/// `host:port` with a non-empty host and a port from 1 to 65535.
pub(crate) fn host_port(s: &str) -> Result<(), String> {
    match s.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0) => {
            Ok(())
        }
        _ => Err(format!("{s:?} is not host:port")),
    }
}
