//! The HTTP server's listener: accepts TCP connections and, when the web
//! configuration in force has TLS (`--web.config.file`), runs each one's TLS handshake
//! in a task of its own with a timeout, so that a slow or broken client holds neither
//! the accept loop nor a task for long. A failed handshake closes that connection,
//! is logged at debug and counted (`tls_handshake_errors_total`); the server goes on.
//! The web configuration is looked up for each connection, so a reload (SIGHUP)
//! applies to the next one.
//!
//! [`Listener`] implements axum's `serve::Listener`, so that `axum::serve` keeps
//! serving, shutting down gracefully and giving handlers the client's address.
use std::{
    io,
    net::SocketAddr,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::mpsc,
};

use crate::{
    web::server::{HandshakeError, ScrapeGate},
    web::webconfig::WebState,
};

/// The longest a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Connections ready for HTTP that `axum::serve` has not taken yet.
const READY_BACKLOG: usize = 64;

/// A connection: plain TCP or TLS over TCP.
#[derive(Debug)]
pub enum Stream {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Self::Plain(stream) => stream.is_write_vectored(),
            Self::Tls(stream) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_flush(cx),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Self::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
        }
    }
}

/// Connections ready for HTTP, from a background task that accepts and handshakes.
/// Serve it through `ListenerExt::tap_io` (a no-op tap) so that
/// `into_make_service_with_connect_info::<SocketAddr>()` applies: axum implements
/// `Connected` for the address of tapped listeners only.
#[derive(Debug)]
pub struct Listener {
    ready: mpsc::Receiver<(Stream, SocketAddr)>,
    local: SocketAddr,
}

impl Listener {
    /// Starts accepting on each of `tcp` (`--web.listen-address` repeated), into one
    /// queue; stops when the listener is dropped. A TLS handshake has
    /// `handshake_timeout` ([`HANDSHAKE_TIMEOUT`]) to complete.
    pub fn spawn(
        tcp: Vec<TcpListener>,
        web: Arc<WebState>,
        gate: Arc<ScrapeGate>,
        handshake_timeout: Duration,
    ) -> io::Result<Self> {
        let Some(first) = tcp.first() else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "no address to listen on",
            ));
        };
        let local = first.local_addr()?;
        let (sender, ready) = mpsc::channel(READY_BACKLOG);
        for tcp in tcp {
            let (web, gate, sender) = (web.clone(), gate.clone(), sender.clone());
            tokio::spawn(accept_loop(tcp, web, gate, sender, handshake_timeout));
        }
        Ok(Self { ready, local })
    }
}

impl axum::serve::Listener for Listener {
    type Io = Stream;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(connection) => connection,
            // The accept loop ends only when this listener is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Self::Addr> {
        Ok(self.local)
    }
}

async fn accept_loop(
    tcp: TcpListener,
    web: Arc<WebState>,
    gate: Arc<ScrapeGate>,
    ready: mpsc::Sender<(Stream, SocketAddr)>,
    handshake_timeout: Duration,
) {
    loop {
        let accepted = tokio::select! {
            () = ready.closed() => return,
            accepted = tcp.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(connection) => connection,
            Err(error) if is_connection_error(&error) => continue,
            Err(error) => {
                // Out of file descriptors and the like: wait rather than spin.
                tracing::error!(%error, "accepting a connection failed");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let Some(tls) = web.current().tls.clone() else {
            if ready.send((Stream::Plain(stream), peer)).await.is_err() {
                return;
            }
            continue;
        };
        let (ready, gate) = (ready.clone(), gate.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(handshake_timeout, tls.acceptor.accept(stream)).await {
                Ok(Ok(stream)) => {
                    let _ = ready.send((Stream::Tls(Box::new(stream)), peer)).await;
                }
                Ok(Err(error)) => {
                    tracing::debug!(%peer, %error, "TLS handshake failed");
                    gate.count_handshake_error(HandshakeError::Failed);
                }
                Err(_) => {
                    tracing::debug!(%peer, timeout = ?handshake_timeout, "TLS handshake timed out");
                    gate.count_handshake_error(HandshakeError::Timeout);
                }
            }
        });
    }
}

/// Errors of one connection (it was reset before we took it), not of the listener.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use axum::{Router, extract::ConnectInfo, routing::get, serve::Listener as _};
    use rustls::{
        ClientConfig, RootCertStore,
        pki_types::{CertificateDer, PrivateKeyDer, ServerName, pem::PemObject as _},
    };
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

    use super::*;
    use crate::{
        config::ScrapeLimits,
        web::webconfig::{
            authorize,
            test_pki::{Ca, Error, Leaf},
        },
    };

    const REQUEST: &[u8] = b"GET /peer HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

    /// poolscope's server as `lib.rs` runs it, on a route that answers the client's
    /// address as the handlers see it.
    struct Server {
        address: SocketAddr,
        gate: Arc<ScrapeGate>,
        web: Arc<WebState>,
        _stop: tokio::sync::oneshot::Sender<()>,
    }

    async fn serve(web_config: &Path, handshake_timeout: Duration) -> Result<Server, Error> {
        let web = Arc::new(WebState::load(Some(web_config))?);
        let gate = Arc::new(ScrapeGate::new(ScrapeLimits {
            max_concurrent: 4,
            timeout: Duration::from_secs(10),
            timeout_offset: Duration::from_millis(500),
        }));
        let tcp = TcpListener::bind("127.0.0.1:0").await?;
        let listener = Listener::spawn(vec![tcp], web.clone(), gate.clone(), handshake_timeout)?;
        let address = listener.local_addr()?;
        let app = Router::new()
            .route(
                "/peer",
                get(|ConnectInfo(peer): ConnectInfo<SocketAddr>| async move {
                    format!("peer {}", peer.ip())
                }),
            )
            .layer(axum::middleware::from_fn_with_state(web.clone(), authorize));
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let listener = axum::serve::ListenerExt::tap_io(listener, |_| {});
        let server = axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async {
            let _ = stopped.await;
        });
        tokio::spawn(server.into_future());
        Ok(Server {
            address,
            gate,
            web,
            _stop: stop,
        })
    }

    /// GET /peer over TLS trusting `ca`, with `client`'s certificate if given.
    async fn https(server: &Server, ca: &Ca, client: Option<&Leaf>) -> Result<String, Error> {
        let mut roots = RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca.pem().as_bytes()) {
            roots.add(cert?)?;
        }
        let builder =
            ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
                .with_safe_default_protocol_versions()?
                .with_root_certificates(roots);
        let config = match client {
            Some(leaf) => builder.with_client_auth_cert(
                CertificateDer::pem_slice_iter(leaf.cert.as_bytes()).collect::<Result<_, _>>()?,
                PrivateKeyDer::from_pem_slice(leaf.key.as_bytes())?,
            )?,
            None => builder.with_no_client_auth(),
        };
        let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
        let tcp = TcpStream::connect(server.address).await?;
        let mut tls = connector
            .connect(ServerName::try_from("localhost")?, tcp)
            .await?;
        tls.write_all(REQUEST).await?;
        let mut response = String::new();
        tls.read_to_string(&mut response).await?;
        Ok(response)
    }

    /// GET /peer over plain TCP; whatever comes back (nothing, for a TLS server).
    async fn http(server: &Server) -> Result<String, Error> {
        let mut tcp = TcpStream::connect(server.address).await?;
        tcp.write_all(REQUEST).await?;
        let mut response = Vec::new();
        // A TLS server answers with an alert, or closes.
        let _ = tcp.read_to_end(&mut response).await;
        Ok(String::from_utf8_lossy(&response).into_owned())
    }

    async fn failures_reach(server: &Server, error: HandshakeError, count: u64) -> bool {
        for _ in 0..200 {
            if server.gate.handshake_errors(error) == count {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }

    struct Files {
        dir: tempfile::TempDir,
        ca: Ca,
    }

    impl Files {
        fn new() -> Result<Self, Error> {
            let dir = tempfile::tempdir()?;
            let ca = Ca::new("server CA")?;
            let server = ca.server()?;
            std::fs::write(dir.path().join("ca.pem"), ca.pem())?;
            std::fs::write(dir.path().join("server.pem"), server.cert)?;
            std::fs::write(dir.path().join("server.key"), server.key)?;
            Ok(Self { dir, ca })
        }

        fn web_config(&self, yaml: &str) -> Result<std::path::PathBuf, Error> {
            let path = self.dir.path().join("web.yml");
            std::fs::write(&path, yaml)?;
            Ok(path)
        }
    }

    const TLS: &str = "tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n";

    #[tokio::test]
    async fn tls_serves_https_with_the_clients_address_and_refuses_plain_http() -> Result<(), Error>
    {
        let files = Files::new()?;
        let server = serve(&files.web_config(TLS)?, HANDSHAKE_TIMEOUT).await?;
        let response = https(&server, &files.ca, None).await?;
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        assert!(response.ends_with("peer 127.0.0.1"), "{response}");
        let plain = http(&server).await?;
        assert!(!plain.contains("HTTP/1.1 200"), "{plain}");
        assert!(failures_reach(&server, HandshakeError::Failed, 1).await);
        // The server goes on.
        assert!(
            https(&server, &files.ca, None)
                .await?
                .ends_with("peer 127.0.0.1")
        );
        // A client that trusts another CA gives up.
        assert!(https(&server, &Ca::new("other")?, None).await.is_err());
        Ok(())
    }

    #[tokio::test]
    async fn mutual_tls_takes_only_certificates_of_the_client_ca() -> Result<(), Error> {
        let files = Files::new()?;
        let clients = Ca::new("client CA")?;
        std::fs::write(files.dir.path().join("clients.pem"), clients.pem())?;
        let yaml = format!(
            "{TLS}  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: clients.pem\n"
        );
        let server = serve(&files.web_config(&yaml)?, HANDSHAKE_TIMEOUT).await?;
        let trusted = clients.client("prometheus")?;
        let response = https(&server, &files.ca, Some(&trusted)).await?;
        assert!(response.starts_with("HTTP/1.1 200 OK\r\n"), "{response}");
        let refused = [None, Some(Ca::new("stranger CA")?.client("prometheus")?)];
        for (index, client) in refused.iter().enumerate() {
            let outcome = https(&server, &files.ca, client.as_ref()).await;
            assert!(
                outcome.as_ref().is_err() || outcome.as_ref().is_ok_and(|r| !r.contains("200 OK")),
                "{outcome:?}"
            );
            assert!(failures_reach(&server, HandshakeError::Failed, index as u64 + 1).await);
        }
        Ok(())
    }

    #[tokio::test]
    async fn a_stalled_handshake_times_out_and_is_counted() -> Result<(), Error> {
        let files = Files::new()?;
        let server = serve(&files.web_config(TLS)?, Duration::from_millis(200)).await?;
        let mut silent = TcpStream::connect(server.address).await?;
        assert!(failures_reach(&server, HandshakeError::Timeout, 1).await);
        let mut rest = Vec::new();
        assert_eq!(silent.read_to_end(&mut rest).await?, 0, "closed");
        assert!(
            https(&server, &files.ca, None)
                .await?
                .ends_with("peer 127.0.0.1")
        );
        Ok(())
    }

    #[tokio::test]
    async fn a_reload_applies_to_the_next_connection() -> Result<(), Error> {
        let files = Files::new()?;
        let path = files.web_config("")?;
        let server = serve(&path, HANDSHAKE_TIMEOUT).await?;
        let plain = http(&server).await?;
        assert!(plain.ends_with("peer 127.0.0.1"), "{plain}");
        std::fs::write(&path, TLS)?;
        assert!(server.web.reload());
        assert!(
            https(&server, &files.ca, None)
                .await?
                .ends_with("peer 127.0.0.1")
        );
        assert!(!http(&server).await?.contains("200 OK"));
        Ok(())
    }
}
