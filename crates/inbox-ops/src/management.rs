//! The RabbitMQ management HTTP API (plugin `rabbitmq_management`), read-only: how the broker
//! actually has a queue declared, arguments and effective policy included. AMQP cannot tell
//! that (a passive declare says only whether a queue exists), so checks of the topology read it
//! here.

use std::time::Duration;

use reqwest::{StatusCode, Url};
use serde_json::{Map, Value};

use rabbit_inbox::{
    BrokerError,
    broker::{AmqpAddresses, TlsFiles},
};

/// How long one management API request may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);

/// The management API's port when it is derived from an `amqp://` URL.
pub const DEFAULT_MANAGEMENT_PORT: u16 = 15672;

/// The management API's port (HTTPS) when it is derived from an `amqps://` URL.
pub const DEFAULT_MANAGEMENT_TLS_PORT: u16 = 15671;

/// Why the management API could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ManagementError {
    /// The URL cannot be used (not http or https, no host).
    #[error("invalid management URL: {0}")]
    InvalidUrl(String),
    /// The TLS files of the AMQP URL cannot be used.
    #[error("management API over HTTPS: {0}")]
    Tls(#[source] BrokerError),
    /// Nothing answered (plugin not enabled, port closed, timeout).
    #[error("management API unreachable at {url}: {source}")]
    Unreachable {
        /// The address asked, without credentials.
        url: String,
        /// What failed.
        source: reqwest::Error,
    },
    /// The credentials were refused, or the user lacks the `monitoring` tag.
    #[error("management API refused the credentials of user {user:?} ({status})")]
    Unauthorized {
        /// The user.
        user: String,
        /// 401 or 403.
        status: StatusCode,
    },
    /// Any other unexpected answer.
    #[error("management API answered {status} for {url}")]
    Status {
        /// The address asked, without credentials.
        url: String,
        /// The status.
        status: StatusCode,
    },
    /// The answer was not the JSON expected.
    #[error("management API answer from {url} is not understood: {source}")]
    Decode {
        /// The address asked, without credentials.
        url: String,
        /// What failed.
        source: reqwest::Error,
    },
}

/// A queue as the broker has it declared.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueInfo {
    /// Queue name.
    pub name: String,
    /// `classic`, `quorum` or `stream`.
    pub queue_type: String,
    /// The `x-` arguments it was declared with.
    pub arguments: Map<String, Value>,
    /// The policy applied to it, if any.
    pub policy: Option<String>,
    /// The effective policy definition (policy and operator policy merged), keys without `x-`.
    pub effective_policy: Map<String, Value>,
}

/// A queue's message and consumer counts as the management API last sampled them (the broker
/// refreshes them every few seconds); `None` for a count the broker has not reported yet (a
/// queue declared a moment ago).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct QueueCounts {
    /// Messages ready for delivery.
    pub ready: Option<u64>,
    /// Messages delivered and not yet acked or rejected: held by consumers.
    pub unacknowledged: Option<u64>,
    /// Consumers subscribed.
    pub consumers: Option<u64>,
}

/// Where a queue setting comes from.
#[derive(Clone, Debug, PartialEq)]
pub struct QueueSetting {
    /// The effective value.
    pub value: Value,
    /// `argument` or `policy <name>`.
    pub source: String,
}

impl QueueInfo {
    /// The effective value of `key` (the policy key, e.g. `dead-letter-exchange`; the argument
    /// is `x-<key>`). The broker lets a queue argument win over a policy, except for
    /// `message-ttl` and `delivery-limit`, where the lower of the two applies.
    pub fn setting(&self, key: &str) -> Option<QueueSetting> {
        let argument = self
            .arguments
            .get(&format!("x-{key}"))
            .map(|v| QueueSetting {
                value: v.clone(),
                source: "argument".into(),
            });
        let policy = self.effective_policy.get(key).map(|v| QueueSetting {
            value: v.clone(),
            source: format!("policy {}", self.policy.as_deref().unwrap_or("(operator)")),
        });
        match (argument, policy) {
            (Some(a), Some(p)) if matches!(key, "message-ttl" | "delivery-limit") => {
                match (a.value.as_u64(), p.value.as_u64()) {
                    (Some(av), Some(pv)) if pv < av => Some(p),
                    _ => Some(a),
                }
            }
            (Some(a), _) => Some(a),
            (None, p) => p,
        }
    }
}

/// A read-only client of the management API of one virtual host. Every node of a cluster
/// serves the whole cluster's API, so with several addresses the first that answers is used.
#[derive(Clone, Debug)]
pub struct ManagementClient {
    http: reqwest::Client,
    /// In the order they are tried; never empty.
    bases: Vec<Url>,
    user: String,
    password: String,
    vhost: String,
}

/// `%XX` escapes decoded (URL user info and paths are percent-encoded).
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

impl ManagementClient {
    /// A client for the virtual host of `amqp_url` (one AMQP URL, or a comma-separated list
    /// of a cluster's nodes). The API is at `management_url` when given
    /// (`http://user:password@host:15672`, `https://…`, or several separated by commas), else on
    /// each AMQP URL's host: `http://host:15672` for `amqp://`, `https://host:15671` for
    /// `amqps://`. Credentials come from the management URL, else from the (first) AMQP URL,
    /// else `guest`. HTTPS trusts the system roots and the CA file of the AMQP URL
    /// (`cacertfile`), and presents its client certificate if it names one.
    pub fn new(amqp_url: &str, management_url: Option<&str>) -> Result<Self, ManagementError> {
        let entries = |list: &str| -> Vec<String> {
            list.split(',')
                .map(str::trim)
                .filter(|e| !e.is_empty())
                .map(str::to_owned)
                .collect()
        };
        let amqp: Vec<Url> = entries(amqp_url)
            .iter()
            .map(|u| {
                Url::parse(u).map_err(|e| ManagementError::InvalidUrl(format!("AMQP URL: {e}")))
            })
            .collect::<Result<_, _>>()?;
        let first_amqp = amqp
            .first()
            .ok_or_else(|| ManagementError::InvalidUrl("no AMQP URL given".into()))?;
        let mut bases: Vec<Url> = match management_url {
            Some(m) => entries(m)
                .iter()
                .map(|u| Url::parse(u).map_err(|e| ManagementError::InvalidUrl(e.to_string())))
                .collect::<Result<_, _>>()?,
            None => amqp
                .iter()
                .map(|a| {
                    let host = a.host_str().ok_or_else(|| {
                        ManagementError::InvalidUrl("the AMQP URL names no host".into())
                    })?;
                    let base = match a.scheme() {
                        "amqps" => format!("https://{host}:{DEFAULT_MANAGEMENT_TLS_PORT}/"),
                        _ => format!("http://{host}:{DEFAULT_MANAGEMENT_PORT}/"),
                    };
                    Url::parse(&base).map_err(|e| ManagementError::InvalidUrl(e.to_string()))
                })
                .collect::<Result<_, _>>()?,
        };
        bases.dedup();
        let first_base = bases
            .first()
            .ok_or_else(|| ManagementError::InvalidUrl("no management URL given".into()))?;
        if let Some(other) = bases
            .iter()
            .find(|b| !matches!(b.scheme(), "http" | "https"))
        {
            return Err(ManagementError::InvalidUrl(format!(
                "{}: only http and https are supported",
                other.scheme()
            )));
        }
        let credentials = |u: &Url| {
            (!u.username().is_empty()).then(|| {
                (
                    percent_decoded(u.username()),
                    percent_decoded(u.password().unwrap_or_default()),
                )
            })
        };
        let (user, password) = management_url
            .and(credentials(first_base))
            .or_else(|| credentials(first_amqp))
            .unwrap_or_else(|| ("guest".into(), "guest".into()));
        let vhost = match first_amqp.path().strip_prefix('/').unwrap_or_default() {
            "" => "/".to_owned(),
            path => percent_decoded(path),
        };
        // Credentials travel as basic auth, not in the URL errors show.
        for base in &mut bases {
            let _ = base.set_username("");
            let _ = base.set_password(None);
        }
        let addresses = AmqpAddresses::parse(amqp_url).map_err(|e| match e {
            BrokerError::InvalidAddress(reason) => ManagementError::InvalidUrl(reason),
            other => ManagementError::Tls(other),
        })?;
        let mut builder = reqwest::Client::builder().timeout(REQUEST_TIMEOUT);
        if let Some(tls) = addresses.tls() {
            builder = configure_http(tls, builder).map_err(ManagementError::Tls)?;
        }
        let http = builder
            .build()
            .map_err(|e| ManagementError::InvalidUrl(e.to_string()))?;
        Ok(Self {
            http,
            bases,
            user,
            password,
            vhost,
        })
    }

    /// The API's first address, without credentials.
    pub fn url(&self) -> &str {
        self.bases.first().map_or("", Url::as_str)
    }

    /// The virtual host whose queues are read.
    pub fn vhost(&self) -> &str {
        &self.vhost
    }

    fn endpoint(base: &Url, segments: &[&str]) -> Result<Url, ManagementError> {
        let mut url = base.clone();
        url.path_segments_mut()
            .map_err(|()| ManagementError::InvalidUrl(base.to_string()))?
            .pop_if_empty()
            .extend(segments);
        Ok(url)
    }

    /// GET of `segments` from the first address that answers; `None` on 404.
    async fn get(&self, segments: &[&str]) -> Result<Option<Value>, ManagementError> {
        let mut unreachable = None;
        for base in &self.bases {
            match self.get_from(base, segments).await {
                Err(e @ ManagementError::Unreachable { .. }) => unreachable = Some(e),
                answered => return answered,
            }
        }
        Err(unreachable
            .unwrap_or_else(|| ManagementError::InvalidUrl("no management address".into())))
    }

    async fn get_from(
        &self,
        base: &Url,
        segments: &[&str],
    ) -> Result<Option<Value>, ManagementError> {
        let url = Self::endpoint(base, segments)?;
        let shown = url.to_string();
        let response = self
            .http
            .get(url)
            .basic_auth(&self.user, Some(&self.password))
            .send()
            .await
            .map_err(|source| ManagementError::Unreachable {
                url: shown.clone(),
                source,
            })?;
        match response.status() {
            StatusCode::NOT_FOUND => Ok(None),
            s @ (StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN) => {
                Err(ManagementError::Unauthorized {
                    user: self.user.clone(),
                    status: s,
                })
            }
            s if s.is_success() => response
                .json()
                .await
                .map(Some)
                .map_err(|source| ManagementError::Decode { url: shown, source }),
            status => Err(ManagementError::Status { url: shown, status }),
        }
    }

    /// The broker's version (`/api/overview`); also tells whether the API answers at all.
    pub async fn broker_version(&self) -> Result<String, ManagementError> {
        let overview = self.get(&["api", "overview"]).await?.unwrap_or_default();
        Ok(overview
            .get("rabbitmq_version")
            .and_then(Value::as_str)
            .unwrap_or("unknown")
            .to_owned())
    }

    /// The counts of queue `name` of the virtual host; `None` if it does not exist.
    pub async fn queue_counts(&self, name: &str) -> Result<Option<QueueCounts>, ManagementError> {
        let Some(q) = self.get(&["api", "queues", &self.vhost, name]).await? else {
            return Ok(None);
        };
        let count = |key: &str| q.get(key).and_then(Value::as_u64);
        Ok(Some(QueueCounts {
            ready: count("messages_ready"),
            unacknowledged: count("messages_unacknowledged"),
            consumers: count("consumers"),
        }))
    }

    /// Queue `name` of the virtual host; `None` if it does not exist.
    pub async fn queue(&self, name: &str) -> Result<Option<QueueInfo>, ManagementError> {
        let Some(q) = self.get(&["api", "queues", &self.vhost, name]).await? else {
            return Ok(None);
        };
        // An empty Erlang map may come as `[]`.
        let object = |key: &str| q.get(key).and_then(Value::as_object).cloned();
        Ok(Some(QueueInfo {
            name: name.to_owned(),
            queue_type: q
                .get("type")
                .and_then(Value::as_str)
                .unwrap_or("classic")
                .to_owned(),
            arguments: object("arguments").unwrap_or_default(),
            policy: q.get("policy").and_then(Value::as_str).map(str::to_owned),
            effective_policy: object("effective_policy_definition").unwrap_or_default(),
        }))
    }
}

/// `tls`'s CA certificates trusted beside the system roots, and its client identity, for the
/// management API over HTTPS.
fn configure_http(
    tls: &TlsFiles,
    mut builder: reqwest::ClientBuilder,
) -> Result<reqwest::ClientBuilder, BrokerError> {
    let unusable = |what: &'static str, path: &Option<std::path::PathBuf>, e: reqwest::Error| {
        BrokerError::TlsFile {
            what,
            path: path.clone().unwrap_or_default(),
            reason: e.to_string(),
        }
    };
    if let Some(pem) = tls.ca_pem() {
        let certs = reqwest::Certificate::from_pem_bundle(pem.as_bytes())
            .map_err(|e| unusable("CA file", &tls.files().ca_file, e))?;
        builder = builder.tls_certs_merge(certs);
    }
    if let Some((cert, key)) = tls.identity_pem() {
        let identity = reqwest::Identity::from_pem(&[cert, b"\n".as_slice(), key].concat())
            .map_err(|e| unusable("client certificate", &tls.files().client_cert, e))?;
        builder = builder.identity(identity);
    }
    Ok(builder)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn derived_from_the_amqp_url() {
        let c = ManagementClient::new("amqp://app:s%40cret@rabbit.local:5672/%2f", None)
            .expect("valid");
        assert_eq!(c.url(), "http://rabbit.local:15672/");
        assert_eq!((c.user.as_str(), c.password.as_str()), ("app", "s@cret"));
        assert_eq!(c.vhost(), "/");
        let queue =
            ManagementClient::endpoint(&c.bases[0], &["api", "queues", "/", "a/b"]).expect("url");
        assert_eq!(
            queue.as_str(),
            "http://rabbit.local:15672/api/queues/%2F/a%2Fb"
        );

        let c = ManagementClient::new(
            "amqp://app:pw@rabbit.local/billing",
            Some("http://admin:adm@mgmt:8080/rabbit/"),
        )
        .expect("valid");
        assert_eq!(c.url(), "http://mgmt:8080/rabbit/");
        assert_eq!((c.user.as_str(), c.vhost()), ("admin", "billing"));
        assert!(ManagementClient::new("amqp://h/", Some("ftp://h:15671")).is_err());
    }

    #[test]
    fn an_amqps_url_gives_the_https_api() {
        let c = ManagementClient::new("amqps://app:pw@rabbit.local:5671/%2f", None).expect("valid");
        assert_eq!(c.url(), "https://rabbit.local:15671/");
        let c = ManagementClient::new("amqp://h/", Some("https://h:15671")).expect("valid");
        assert_eq!(c.url(), "https://h:15671/");
        let err = ManagementClient::new("amqps://h/?cacertfile=/nonexistent/ca.pem", None)
            .expect_err("unreadable CA file");
        assert!(matches!(err, ManagementError::Tls(_)), "{err}");
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
    }

    #[test]
    fn a_cluster_list_gives_one_api_address_per_node() {
        let c = ManagementClient::new(
            "amqp://app:pw@node-a:5672/billing, amqp://app:pw@node-b:5673/billing,",
            None,
        )
        .expect("valid");
        let bases: Vec<&str> = c.bases.iter().map(Url::as_str).collect();
        assert_eq!(bases, ["http://node-a:15672/", "http://node-b:15672/"]);
        assert_eq!((c.user.as_str(), c.vhost()), ("app", "billing"));
        // Nodes of one host share its API.
        let c = ManagementClient::new("amqp://h:5672/,amqp://h:5673/", None).expect("valid");
        assert_eq!(c.bases.len(), 1);
        let c = ManagementClient::new("amqp://h/", Some("http://u:p@m1:15672,http://m2:15672"))
            .expect("valid");
        let bases: Vec<&str> = c.bases.iter().map(Url::as_str).collect();
        assert_eq!(bases, ["http://m1:15672/", "http://m2:15672/"]);
        assert_eq!(c.user, "u");
        assert!(ManagementClient::new(" , ", None).is_err());
    }

    #[test]
    fn arguments_win_over_policies_but_the_lower_ttl_applies() {
        let q = QueueInfo {
            name: "q".into(),
            queue_type: "quorum".into(),
            arguments: json!({ "x-dead-letter-exchange": "", "x-message-ttl": 5000 })
                .as_object()
                .cloned()
                .unwrap_or_default(),
            policy: Some("dlx".into()),
            effective_policy: json!({
                "dead-letter-exchange": "elsewhere",
                "dead-letter-routing-key": "q.retry",
                "message-ttl": 1000
            })
            .as_object()
            .cloned()
            .unwrap_or_default(),
        };
        let get = |k| q.setting(k).map(|s| (s.value, s.source));
        assert_eq!(
            get("dead-letter-exchange"),
            Some((json!(""), "argument".into()))
        );
        assert_eq!(
            get("dead-letter-routing-key"),
            Some((json!("q.retry"), "policy dlx".into()))
        );
        assert_eq!(get("message-ttl"), Some((json!(1000), "policy dlx".into())));
        assert_eq!(get("delivery-limit"), None);
    }
}
