//! Attribute names and values as the request path hands them over: a key is a `&'static str`
//! (the names in [`crate::semconv`]); a string is borrowed, shared or owned, so the proxy passes
//! what it already holds.

use std::fmt;
use std::sync::Arc;

/// An attribute name: one of [`crate::semconv`]'s constants.
pub type Key = &'static str;

/// A string attribute value or name, without copying what the caller already owns.
#[derive(Clone)]
pub enum Str {
    Static(&'static str),
    Shared(Arc<str>),
    Owned(String),
}

impl Str {
    pub fn as_str(&self) -> &str {
        match self {
            Str::Static(s) => s,
            Str::Shared(s) => s,
            Str::Owned(s) => s,
        }
    }
}

/// By their text, whoever owns it.
impl PartialEq for Str {
    fn eq(&self, other: &Self) -> bool {
        self.as_str() == other.as_str()
    }
}

impl Eq for Str {}

impl Default for Str {
    fn default() -> Self {
        Str::Static("")
    }
}

impl fmt::Debug for Str {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self.as_str(), f)
    }
}

impl fmt::Display for Str {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl AsRef<str> for Str {
    fn as_ref(&self) -> &str {
        self.as_str()
    }
}

impl From<&'static str> for Str {
    fn from(s: &'static str) -> Self {
        Str::Static(s)
    }
}

impl From<String> for Str {
    fn from(s: String) -> Self {
        Str::Owned(s)
    }
}

impl From<Arc<str>> for Str {
    fn from(s: Arc<str>) -> Self {
        Str::Shared(s)
    }
}

impl From<&Arc<str>> for Str {
    fn from(s: &Arc<str>) -> Self {
        Str::Shared(s.clone())
    }
}

/// An attribute value: the OTLP `AnyValue`s Sluice uses, owned (what [`Attributes::get`] decodes;
/// setters take any [`AttrValue`], borrowed).
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    Str(Str),
    Int(i64),
    Double(f64),
    Bool(bool),
    StrArray(Vec<Str>),
}

impl<T: Into<Str>> From<T> for Value {
    fn from(s: T) -> Self {
        Value::Str(s.into())
    }
}

impl From<Vec<&'static str>> for Value {
    fn from(v: Vec<&'static str>) -> Self {
        Value::StrArray(v.into_iter().map(Str::Static).collect())
    }
}
