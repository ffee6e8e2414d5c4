//! Query strings of the operations endpoints.

/// Parses `a=1&b=x` (no percent-decoding needed for our parameter values).
pub(crate) fn query_param<'a>(query: &'a str, key: &str) -> Option<&'a str> {
    query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == key)
        .map(|(_, v)| v)
}
