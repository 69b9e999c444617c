//! The listener: HTTP/1.1, over TLS when a certificate is given, with the limits that keep a
//! slow or hostile client from holding the server.
//!
//! - **TLS** (rustls, TLS 1.2 and 1.3) from PEM files. An address other machines can reach is
//!   refused without it unless `insecure_http` says clear text is intended; that is logged as a
//!   warning at start and reported on `/readyz`.
//! - **Header-read timeout**: a connection that has not sent a whole request head (and TLS
//!   handshake) within `header_read_timeout` is closed, idle keep-alive connections included;
//!   a body must arrive within the same time.
//! - **Connection limit**: at most `max_connections` at once; one more is closed at accept.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use axum::{Router, extract::ConnectInfo};
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::{
    rt::{TokioIo, TokioTimer},
    server::graceful::GracefulShutdown,
};
use rustls::ServerConfig;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
use tokio::{net::TcpListener, sync::Semaphore};
use tokio_rustls::TlsAcceptor;
use tower::ServiceExt as _;

use crate::{
    auth::{TokenError, Tokens},
    host::AllowedHosts,
};

/// Why the server stopped.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address may not be bound without tokens.
    #[error(transparent)]
    Tokens(#[from] TokenError),
    /// The listening options are refused (TLS, allowed hosts, limits).
    #[error("{0}")]
    Config(String),
    /// Listening or serving failed.
    #[error("admin server: {0}")]
    Io(#[from] std::io::Error),
}

/// A certificate chain and its private key, PEM files.
#[derive(Clone, Debug)]
pub struct TlsFiles {
    /// The certificate chain, leaf first.
    pub cert: PathBuf,
    /// The leaf's private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
}

/// How the server listens. [`ServeOptions::default`] is loopback-grade: no TLS, no extra host.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// Serve HTTPS with this certificate.
    pub tls: Option<TlsFiles>,
    /// Serve clear-text HTTP on an address other machines can reach (refused otherwise).
    pub insecure_http: bool,
    /// Host names (or `host:port`) requests may be addressed to, besides the bind address
    /// (and, on loopback, `localhost`).
    pub allowed_hosts: Vec<String>,
    /// A client must send a request's head (and finish the TLS handshake) within this, and
    /// its body within this again.
    pub header_read_timeout: Duration,
    /// Connections served at once; more are closed at accept.
    pub max_connections: usize,
    /// How often `/readyz`'s background check runs.
    pub readiness_interval: Duration,
}

/// Default of [`ServeOptions::header_read_timeout`].
pub const DEFAULT_HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Default of [`ServeOptions::max_connections`].
pub const DEFAULT_MAX_CONNECTIONS: usize = 128;
/// Default of [`ServeOptions::readiness_interval`].
pub const DEFAULT_READINESS_INTERVAL: Duration = Duration::from_secs(10);

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            tls: None,
            insecure_http: false,
            allowed_hosts: Vec::new(),
            header_read_timeout: DEFAULT_HEADER_READ_TIMEOUT,
            max_connections: DEFAULT_MAX_CONNECTIONS,
            readiness_interval: DEFAULT_READINESS_INTERVAL,
        }
    }
}

impl ServeOptions {
    /// Refuses a configuration that would expose the inbox: a non-loopback address without
    /// tokens, or without TLS (unless `insecure_http`), an address that names no host without
    /// `allowed_hosts`, and zero limits. Returns the allowed hosts.
    pub(crate) fn check(
        &self,
        addr: SocketAddr,
        tokens: &Tokens,
    ) -> Result<AllowedHosts, ServeError> {
        tokens.check_bind(addr)?;
        if !addr.ip().is_loopback() && self.tls.is_none() && !self.insecure_http {
            return Err(ServeError::Config(format!(
                "refusing to serve clear-text HTTP on {addr}: tokens and messages would cross \
                 the network readable by anyone on the path. Give --tls-cert and --tls-key, \
                 listen on a loopback address behind a TLS-terminating proxy, or pass \
                 --insecure-http if the network is trusted"
            )));
        }
        if self.max_connections == 0 || self.header_read_timeout.is_zero() {
            return Err(ServeError::Config(
                "the connection limit and the header-read timeout must be above zero".into(),
            ));
        }
        AllowedHosts::new(addr, &self.allowed_hosts).map_err(ServeError::Config)
    }

    /// Checks what [`serve`](crate::serve) would refuse for `addr`, before anything is
    /// started, and loads the TLS files.
    pub fn validate(&self, addr: SocketAddr, tokens: &Tokens) -> Result<(), ServeError> {
        self.check(addr, tokens)?;
        if let Some(files) = &self.tls {
            tls_config(files)?;
        }
        Ok(())
    }

    /// Clear-text HTTP on an address other machines can reach.
    pub(crate) fn serves_insecure_http(&self, addr: SocketAddr) -> bool {
        self.tls.is_none() && !addr.ip().is_loopback()
    }
}

fn tls_error(path: &Path, what: &str, e: impl std::fmt::Display) -> ServeError {
    ServeError::Config(format!("{}: {what}: {e}", path.display()))
}

/// The rustls configuration of `files` (aws-lc-rs, TLS 1.2 and 1.3, HTTP/1.1 by ALPN).
pub(crate) fn tls_config(files: &TlsFiles) -> Result<Arc<ServerConfig>, ServeError> {
    let chain = CertificateDer::pem_file_iter(&files.cert)
        .map_err(|e| tls_error(&files.cert, "reading the certificate", e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| tls_error(&files.cert, "reading the certificate", e))?;
    if chain.is_empty() {
        return Err(tls_error(
            &files.cert,
            "no certificate",
            "the file holds none",
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key)
        .map_err(|e| tls_error(&files.key, "reading the private key", e))?;
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| ServeError::Config(format!("TLS: {e}")))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| tls_error(&files.key, "the key does not fit the certificate", e))?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Serves `app` on `listener` until `shutdown`, then lets open requests finish (up to the
/// header-read timeout).
pub(crate) async fn run(
    listener: TcpListener,
    app: Router,
    options: &ServeOptions,
    tls: Option<TlsAcceptor>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let connections = Arc::new(Semaphore::new(options.max_connections));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(options.header_read_timeout)
        .max_buf_size(64 * 1024);
    let handshake_timeout = options.header_read_timeout;
    tokio::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before accept: go on.
                    tracing::warn!(error = %e, "admin server: accepting a connection failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = connections.clone().try_acquire_owned() else {
            tracing::warn!(
                %peer,
                limit = options.max_connections,
                "admin server: connection limit reached, connection closed"
            );
            continue;
        };
        let (http, tls, app) = (http.clone(), tls.clone(), app.clone());
        let watcher = graceful.watcher();
        tokio::spawn(async move {
            let _permit = permit;
            let service = service_fn(move |mut request: hyper::Request<Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                app.clone().oneshot(request)
            });
            let served = match tls {
                None => {
                    watcher
                        .watch(http.serve_connection(TokioIo::new(stream), service))
                        .await
                }
                Some(acceptor) => {
                    match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                        Ok(Ok(stream)) => {
                            watcher
                                .watch(http.serve_connection(TokioIo::new(stream), service))
                                .await
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "admin server: TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "admin server: TLS handshake timed out");
                            return;
                        }
                    }
                }
            };
            if let Err(e) = served {
                tracing::debug!(%peer, error = %e, "admin server: connection ended with an error");
            }
        });
    }
    drop(listener);
    if tokio::time::timeout(options.header_read_timeout, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!("admin server: some connections were still open at shutdown");
    }
    Ok(())
}
