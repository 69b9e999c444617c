//! The `Host` check: a request is served only when the name it was sent to is the address the
//! server listens on (and, on loopback, `localhost`) or one the operator allowed. This is what
//! defeats DNS rebinding: a page on `rebind.evil.example` whose name now points at the server
//! still sends `Host: rebind.evil.example`, and is refused whatever tokens are configured.

use std::{net::SocketAddr, sync::Arc};

use axum::{
    extract::{Request, State},
    http::{StatusCode, header, uri::Authority},
    middleware::Next,
    response::Response,
};

use crate::error::ApiError;

/// One allowed name, with the port it must come with (any port when `None`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct Allowed {
    name: String,
    port: Option<u16>,
}

/// The names requests may be addressed to.
#[derive(Clone, Debug, Default)]
pub(crate) struct AllowedHosts {
    allowed: Vec<Allowed>,
}

/// A host name as compared: lower case, without a trailing dot or IPv6 brackets.
fn normalize(name: &str) -> String {
    name.trim_end_matches('.')
        .trim_start_matches('[')
        .trim_end_matches(']')
        .to_ascii_lowercase()
}

fn parse(text: &str) -> Option<Allowed> {
    let authority: Authority = text.trim().parse().ok()?;
    if authority.as_str().contains('@') {
        return None;
    }
    let name = normalize(authority.host());
    (!name.is_empty()).then_some(Allowed {
        name,
        port: authority.port_u16(),
    })
}

impl AllowedHosts {
    /// The bind address (any port; on loopback also `localhost` and the other loopback
    /// addresses) and `extra` (`name` for any port, `name:port` for one). An unspecified bind
    /// address (`0.0.0.0`, `::`) names no host: only `extra` is allowed then.
    pub(crate) fn new(bind: SocketAddr, extra: &[String]) -> Result<Self, String> {
        let mut allowed = Vec::new();
        let ip = bind.ip();
        if ip.is_loopback() {
            for name in ["localhost", "127.0.0.1", "::1"] {
                allowed.push(Allowed {
                    name: name.into(),
                    port: None,
                });
            }
        }
        if !ip.is_unspecified() {
            allowed.push(Allowed {
                name: normalize(&ip.to_string()),
                port: None,
            });
        }
        for text in extra {
            allowed.push(parse(text).ok_or_else(|| {
                format!("--allowed-host {text:?} is not a host name, an address or host:port")
            })?);
        }
        if allowed.is_empty() {
            return Err(format!(
                "listening on {bind} names no host: give the names clients use to reach the \
                 server with --allowed-host (for example --allowed-host admin.example.com)"
            ));
        }
        Ok(Self { allowed })
    }

    /// `host` (a `Host` header or a request URI's authority) is allowed.
    pub(crate) fn allows(&self, host: &str) -> bool {
        let Some(asked) = parse(host) else {
            return false;
        };
        self.allowed
            .iter()
            .any(|a| a.name == asked.name && a.port.is_none_or(|p| asked.port == Some(p)))
    }
}

/// Middleware: refuses a request addressed to a host not allowed, with 421.
pub(crate) async fn check(
    State(hosts): State<Arc<AllowedHosts>>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    // An absolute-form request line names its host in the URI, which then takes precedence.
    let host = match request.uri().authority() {
        Some(authority) => Some(authority.as_str()),
        None => request
            .headers()
            .get(header::HOST)
            .and_then(|h| h.to_str().ok()),
    };
    match host {
        Some(host) if hosts.allows(host) => Ok(next.run(request).await),
        Some(host) => {
            tracing::warn!(host = %host.escape_debug(), "admin API: request for a host not served here refused");
            Err(ApiError::new(
                StatusCode::MISDIRECTED_REQUEST,
                format!(
                    "this server does not answer for host {host:?}; an operator can allow it \
                     with --allowed-host"
                ),
            ))
        }
        None => Err(ApiError::bad_request("a Host header is required")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hosts(bind: &str, extra: &[&str]) -> AllowedHosts {
        let extra: Vec<String> = extra.iter().map(|s| (*s).to_owned()).collect();
        AllowedHosts::new(bind.parse().expect("address"), &extra).expect("valid")
    }

    #[test]
    fn loopback_answers_for_its_own_names_only() {
        let h = hosts("127.0.0.1:9480", &[]);
        for ok in [
            "127.0.0.1:9480",
            "localhost:9480",
            "LOCALHOST",
            "[::1]:9480",
            "localhost.",
        ] {
            assert!(h.allows(ok), "{ok}");
        }
        for refused in [
            "rebind.evil.example",
            "rebind.evil.example:9480",
            "127.0.0.1.evil.example",
            "user@127.0.0.1",
            "",
        ] {
            assert!(!h.allows(refused), "{refused}");
        }
    }

    #[test]
    fn allowed_hosts_match_name_and_port_when_given() {
        let h = hosts(
            "0.0.0.0:9480",
            &["admin.example.com", "proxy.internal:8443"],
        );
        assert!(h.allows("admin.example.com:9480"));
        assert!(h.allows("Admin.Example.Com"));
        assert!(h.allows("proxy.internal:8443"));
        assert!(!h.allows("proxy.internal:9480"));
        assert!(!h.allows("0.0.0.0:9480"));
        assert!(!h.allows("10.1.2.3:9480"));
        let bound = hosts("10.1.2.3:9480", &[]);
        assert!(bound.allows("10.1.2.3:9480"));
        assert!(!bound.allows("localhost:9480"));
    }

    #[test]
    fn an_unspecified_address_needs_allowed_hosts() {
        let e = AllowedHosts::new("0.0.0.0:9480".parse().expect("address"), &[])
            .expect_err("names no host");
        assert!(e.contains("--allowed-host"), "{e}");
        assert!(
            AllowedHosts::new("127.0.0.1:1".parse().expect("address"), &["a b".into()]).is_err()
        );
    }
}
