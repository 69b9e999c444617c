//! TLS of the broker connections (`amqps://`) and of the management API: which CA to trust
//! beyond the system's roots, and which client certificate to present.
//!
//! The settings travel in the AMQP URL as RabbitMQ's own URI query parameters (`cacertfile`,
//! `certfile`, `keyfile`), so every place that takes an AMQP URL or a cluster's list of URLs
//! (consumer, publisher, relay, tools, admin server) connects over TLS without a setting of its
//! own. [`AmqpTls`] writes them into a URL list; the files are read and checked whenever the
//! list is parsed (when a consumer or relay is built, and on every connect, so renewed
//! certificates are picked up on the next reconnect).

use std::{fmt, fs, path::Path, path::PathBuf, sync::Arc};

use lapin::tcp::{OwnedIdentity, OwnedTLSConfig};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use url::Url;

use crate::error::BrokerError;

/// The URL query parameter naming the CA file (PEM) trusted beside the system roots.
pub(crate) const CA_FILE_PARAM: &str = "cacertfile";
/// The URL query parameter naming the client certificate (PEM, the chain leaf first).
pub(crate) const CLIENT_CERT_PARAM: &str = "certfile";
/// The URL query parameter naming the client certificate's private key (PEM: PKCS#8, PKCS#1
/// or SEC1, unencrypted).
pub(crate) const CLIENT_KEY_PARAM: &str = "keyfile";

/// TLS files for `amqps://` connections. Without a CA file the server certificate is verified
/// against the system's roots; with one, against those and the file's certificates. A client
/// certificate (mutual TLS) needs both `client_cert` and `client_key`. The server's host name
/// is always checked against its certificate.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AmqpTls {
    /// PEM file of the CA certificate(s) that signed the broker's certificate.
    pub ca_file: Option<PathBuf>,
    /// PEM file of the client certificate, for brokers that require one.
    pub client_cert: Option<PathBuf>,
    /// PEM file of the client certificate's private key.
    pub client_key: Option<PathBuf>,
}

impl AmqpTls {
    /// No file set.
    pub fn is_empty(&self) -> bool {
        self.ca_file.is_none() && self.client_cert.is_none() && self.client_key.is_none()
    }

    /// `amqp_urls` (one URL or a comma-separated list) with these files set on every entry as
    /// `cacertfile`, `certfile` and `keyfile` query parameters, replacing an entry's own. The
    /// list is returned unchanged when no file is set.
    pub fn apply_to(&self, amqp_urls: &str) -> Result<String, BrokerError> {
        if self.is_empty() {
            return Ok(amqp_urls.to_owned());
        }
        let mut out = Vec::new();
        for entry in amqp_urls
            .split(',')
            .map(str::trim)
            .filter(|e| !e.is_empty())
        {
            let mut url = Url::parse(entry)
                .map_err(|e| BrokerError::InvalidAddress(format!("{}: {e}", redacted(entry))))?;
            let given = [
                (CA_FILE_PARAM, &self.ca_file),
                (CLIENT_CERT_PARAM, &self.client_cert),
                (CLIENT_KEY_PARAM, &self.client_key),
            ];
            let kept: Vec<(String, String)> = url
                .query_pairs()
                .filter(|(k, _)| !given.iter().any(|(name, v)| v.is_some() && k == name))
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect();
            url.set_query(None);
            {
                let mut query = url.query_pairs_mut();
                for (k, v) in &kept {
                    query.append_pair(k, v);
                }
                for (name, value) in given {
                    if let Some(path) = value {
                        query.append_pair(name, &path.to_string_lossy());
                    }
                }
            }
            out.push(url.to_string());
        }
        Ok(out.join(","))
    }

    /// The files named by `url`'s query parameters.
    pub(crate) fn from_url(url: &Url) -> Self {
        let mut tls = Self::default();
        for (key, value) in url.query_pairs() {
            let path = Some(PathBuf::from(value.as_ref()));
            match key.as_ref() {
                CA_FILE_PARAM => tls.ca_file = path,
                CLIENT_CERT_PARAM => tls.client_cert = path,
                CLIENT_KEY_PARAM => tls.client_key = path,
                _ => {}
            }
        }
        tls
    }

    /// Reads and checks the files: every error names the file and says what is wrong with it.
    pub(crate) fn load(&self) -> Result<TlsFiles, BrokerError> {
        let ca = match &self.ca_file {
            Some(path) => {
                let (pem, certs) = read_certificates(path, "CA file")?;
                let mut roots = rustls::RootCertStore::empty();
                for cert in certs {
                    roots.add(cert).map_err(|e| tls_file("CA file", path, e))?;
                }
                Some(pem)
            }
            None => None,
        };
        let identity = match (&self.client_cert, &self.client_key) {
            (None, None) => None,
            (Some(_), None) | (None, Some(_)) => {
                return Err(BrokerError::TlsSettings(format!(
                    "a client certificate needs both {CLIENT_CERT_PARAM} (the certificate) and \
                     {CLIENT_KEY_PARAM} (its private key)"
                )));
            }
            (Some(cert_path), Some(key_path)) => {
                let (cert_pem, certs) = read_certificates(cert_path, "client certificate")?;
                let key_pem = read(key_path, "client key")?;
                let key = PrivateKeyDer::from_pem_slice(&key_pem).map_err(|e| {
                    tls_file(
                        "client key",
                        key_path,
                        format!("no usable private key (PEM PKCS#8, PKCS#1 or SEC1): {e}"),
                    )
                })?;
                // Building a client configuration checks that the key is one rustls can sign
                // with and that it belongs to the certificate.
                rustls::ClientConfig::builder_with_provider(Arc::new(
                    rustls::crypto::aws_lc_rs::default_provider(),
                ))
                .with_safe_default_protocol_versions()
                .map_err(|e| BrokerError::TlsSettings(e.to_string()))?
                .with_root_certificates(rustls::RootCertStore::empty())
                .with_client_auth_cert(certs, key)
                .map_err(|e| {
                    tls_file(
                        "client key",
                        key_path,
                        format!("cannot be used with {}: {e}", cert_path.display()),
                    )
                })?;
                Some((cert_pem, key_pem))
            }
        };
        Ok(TlsFiles {
            source: self.clone(),
            ca_pem: ca.map(|pem| String::from_utf8_lossy(&pem).into_owned()),
            identity,
        })
    }
}

/// The contents of an [`AmqpTls`]'s files, checked.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsFiles {
    source: AmqpTls,
    ca_pem: Option<String>,
    /// Certificate and key, PEM.
    identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl fmt::Debug for TlsFiles {
    /// The file names only: never the key.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.source.fmt(f)
    }
}

impl TlsFiles {
    /// lapin's TLS settings: the CA certificates as extra roots, the client identity.
    pub(crate) fn lapin_config(&self) -> OwnedTLSConfig {
        OwnedTLSConfig {
            identity: self
                .identity
                .as_ref()
                .map(|(cert, key)| OwnedIdentity::PKCS8 {
                    pem: cert.clone(),
                    key: key.clone(),
                }),
            cert_chain: self.ca_pem.clone(),
        }
    }

    /// The files these were read from.
    pub fn files(&self) -> &AmqpTls {
        &self.source
    }

    /// The CA certificates, PEM, if a CA file was given.
    pub fn ca_pem(&self) -> Option<&str> {
        self.ca_pem.as_deref()
    }

    /// The client certificate and its key, PEM, if given.
    pub fn identity_pem(&self) -> Option<(&[u8], &[u8])> {
        self.identity
            .as_ref()
            .map(|(cert, key)| (cert.as_slice(), key.as_slice()))
    }
}

fn tls_file(what: &'static str, path: &Path, reason: impl ToString) -> BrokerError {
    BrokerError::TlsFile {
        what,
        path: path.to_owned(),
        reason: reason.to_string(),
    }
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, BrokerError> {
    fs::read(path).map_err(|e| tls_file(what, path, format!("cannot be read: {e}")))
}

/// The file's bytes and the certificates in it; at least one.
fn read_certificates(
    path: &Path,
    what: &'static str,
) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>), BrokerError> {
    let pem = read(path, what)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_file(what, path, format!("is not valid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(tls_file(
            what,
            path,
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
        ));
    }
    Ok((pem, certs))
}

/// `url` with any password replaced, for error messages.
pub(super) fn redacted(url: &str) -> String {
    let Some(scheme_end) = url.find("://").map(|i| i + 3) else {
        return url.to_owned();
    };
    let rest = &url[scheme_end..];
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let user = rest[..at].split(':').next().unwrap_or("");
            format!("{}{user}:***{}", &url[..scheme_end], &rest[at..])
        }
        None => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apply_to_sets_the_files_on_every_entry_and_keeps_other_parameters() {
        let tls = AmqpTls {
            ca_file: Some("/etc/ssl/my ca.pem".into()),
            client_cert: Some("/c.pem".into()),
            client_key: Some("/k.pem".into()),
        };
        let list = tls
            .apply_to("amqps://u:p@a:5671/%2f?heartbeat=10&cacertfile=/old.pem, amqps://b:5671/v")
            .expect("valid");
        let urls: Vec<Url> = list
            .split(',')
            .map(|u| Url::parse(u).expect("url"))
            .collect();
        assert_eq!(urls.len(), 2);
        for url in &urls {
            assert_eq!(AmqpTls::from_url(url), tls, "{url}");
        }
        assert!(list.contains("heartbeat=10"), "{list}");
        assert!(!list.contains("old.pem"), "{list}");
        assert_eq!(
            AmqpTls::default().apply_to("amqp://x").expect("same"),
            "amqp://x"
        );
    }

    #[test]
    fn errors_name_the_file_and_the_reason() {
        let missing = AmqpTls {
            ca_file: Some("/nonexistent/ca.pem".into()),
            ..AmqpTls::default()
        };
        let shown = missing.load().expect_err("missing").to_string();
        assert!(shown.contains("CA file /nonexistent/ca.pem"), "{shown}");
        assert!(shown.contains("cannot be read"), "{shown}");

        let dir =
            std::env::temp_dir().join(format!("rabbit-inbox-tls-unit-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("dir");
        let not_pem = dir.join("not-a-cert.pem");
        fs::write(&not_pem, "hello").expect("write");
        let shown = AmqpTls {
            ca_file: Some(not_pem.clone()),
            ..AmqpTls::default()
        }
        .load()
        .expect_err("no certificate")
        .to_string();
        assert!(shown.contains("not-a-cert.pem"), "{shown}");
        assert!(shown.contains("no PEM certificate"), "{shown}");

        let half = AmqpTls {
            client_cert: Some(not_pem),
            ..AmqpTls::default()
        };
        assert!(matches!(half.load(), Err(BrokerError::TlsSettings(_))));
        let _ = fs::remove_dir_all(dir);
    }
}
