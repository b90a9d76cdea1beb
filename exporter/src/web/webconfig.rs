//! `--web.config.file`: the web configuration file shared by Prometheus exporters
//! (the YAML format of exporter-toolkit's `docs/web-configuration.md`): TLS with
//! optional client certificates, basic auth with bcrypt hashes, extra response headers.
//!
//! This module owns that file: reading it ([`RawWebConfig`], as written), refusing what
//! poolscope does not do (every refusal names the file, the key and the reason: an
//! unknown or unsupported key is never ignored), validating it into a [`WebConfig`]
//! (certificates and keys parsed and matched, hashes checked to be bcrypt), the
//! [`WebState`] that holds the one in force (replaced on SIGHUP; a bad file then keeps
//! the running one) and the [`authorize`] middleware that asks every request for basic
//! auth when users are configured. Relative paths in the file are relative to the
//! file's directory, as exporter-toolkit reads them. The listener that uses the TLS
//! settings is `listener.rs`.
use std::{
    collections::{BTreeMap, HashSet},
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError, RwLock},
};

use axum::{
    extract::{Request, State},
    http::{HeaderMap, HeaderName, HeaderValue, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use base64::Engine as _;
use rustls::{
    DistinguishedName, RootCertStore, ServerConfig, SignatureScheme,
    client::danger::HandshakeSignatureValid,
    crypto::CryptoProvider,
    pki_types::{CertificateDer, PrivateKeyDer, UnixTime, pem::PemObject as _},
    server::{
        WebPkiClientVerifier,
        danger::{ClientCertVerified, ClientCertVerifier},
    },
};
use serde::Deserialize;
use tokio_rustls::TlsAcceptor;

/// Successful basic-auth verifications remembered (bcrypt takes 50–250 ms each).
const MAX_VERIFIED: usize = 100;

/// The response headers that `http_server_config.headers` may set, and the values
/// each accepts (`None`: any), as exporter-toolkit allows them.
const ALLOWED_HEADERS: [(&str, Option<&[&str]>); 5] = [
    ("Content-Security-Policy", None),
    ("X-Frame-Options", Some(&["deny", "sameorigin"])),
    ("X-Content-Type-Options", Some(&["nosniff"])),
    ("X-XSS-Protection", None),
    ("Strict-Transport-Security", None),
];

/// The file as written. Keys of exporter-toolkit's format that poolscope does not
/// implement are read so that their refusal can say why.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawWebConfig {
    tls_server_config: Option<RawTls>,
    http_server_config: Option<RawHttp>,
    basic_auth_users: Option<BTreeMap<String, String>>,
    /// Refused.
    rate_limit: Option<serde_norway::Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTls {
    /// Inline PEM, instead of `cert_file`.
    cert: Option<String>,
    /// Inline PEM, instead of `key_file`.
    key: Option<String>,
    /// Inline PEM, instead of `client_ca_file`.
    client_ca: Option<String>,
    cert_file: Option<PathBuf>,
    key_file: Option<PathBuf>,
    client_ca_file: Option<PathBuf>,
    client_auth_type: Option<String>,
    min_version: Option<String>,
    max_version: Option<String>,
    prefer_server_cipher_suites: Option<bool>,
    /// Refused unless empty.
    client_allowed_sans: Option<Vec<String>>,
    /// Refused unless empty.
    cipher_suites: Option<Vec<String>>,
    /// Refused unless empty.
    curve_preferences: Option<Vec<String>>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawHttp {
    http2: Option<bool>,
    headers: Option<BTreeMap<String, String>>,
}

/// A refused web configuration file.
#[derive(Debug, thiserror::Error)]
pub enum WebConfigError {
    #[error("web config file {}: {reason}", .path.display())]
    File { path: PathBuf, reason: String },
    #[error("web config file {}: key `{key}`: {reason}", .path.display())]
    Key {
        path: PathBuf,
        key: String,
        reason: String,
    },
}

/// exporter-toolkit's `client_auth_type`, Go's `tls.ClientAuthType` names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientAuth {
    /// No client certificate asked for.
    NoClientCert,
    /// Asked for, not required, not verified.
    RequestClientCert,
    /// Required, not verified (only its signature of the handshake).
    RequireAnyClientCert,
    /// Verified against `client_ca_file` when given.
    VerifyClientCertIfGiven,
    /// Required and verified against `client_ca_file`.
    RequireAndVerifyClientCert,
}

impl ClientAuth {
    const ALL: [Self; 5] = [
        Self::NoClientCert,
        Self::RequestClientCert,
        Self::RequireAnyClientCert,
        Self::VerifyClientCertIfGiven,
        Self::RequireAndVerifyClientCert,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::NoClientCert => "NoClientCert",
            Self::RequestClientCert => "RequestClientCert",
            Self::RequireAnyClientCert => "RequireAnyClientCert",
            Self::VerifyClientCertIfGiven => "VerifyClientCertIfGiven",
            Self::RequireAndVerifyClientCert => "RequireAndVerifyClientCert",
        }
    }

    fn verifies(self) -> bool {
        matches!(
            self,
            Self::VerifyClientCertIfGiven | Self::RequireAndVerifyClientCert
        )
    }
}

/// Validated TLS settings.
#[derive(Clone)]
pub struct Tls {
    pub acceptor: TlsAcceptor,
    pub client_auth: ClientAuth,
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls")
            .field("client_auth", &self.client_auth)
            .finish_non_exhaustive()
    }
}

/// A validated web configuration; the default one serves plain HTTP to anyone.
#[derive(Debug, Default)]
pub struct WebConfig {
    /// `None`: plain HTTP.
    pub tls: Option<Tls>,
    /// User name → bcrypt hash; empty: no basic auth.
    users: BTreeMap<String, String>,
    /// Verified for unknown users (the result ignored), so that they take as long
    /// as known ones: the hash of the costliest user.
    dummy_hash: String,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl WebConfig {
    /// Reads and validates the file at `path`.
    pub fn load(path: &Path) -> Result<Self, WebConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| WebConfigError::File {
            path: path.to_owned(),
            reason: format!("cannot read it: {error}"),
        })?;
        Self::parse(&text, path)
    }

    /// Validates `text`, the content of the file at `path` (whose directory relative
    /// paths are taken from).
    pub fn parse(text: &str, path: &Path) -> Result<Self, WebConfigError> {
        let raw: Option<RawWebConfig> =
            serde_norway::from_str(text).map_err(|error| WebConfigError::File {
                path: path.to_owned(),
                reason: format!("not a valid web configuration: {error}"),
            })?;
        let file = File {
            path,
            dir: path.parent().unwrap_or_else(|| Path::new(".")),
        };
        validate(raw.unwrap_or_default(), &file)
    }

    /// The names of the basic-auth users.
    pub fn users(&self) -> impl Iterator<Item = &str> {
        self.users.keys().map(String::as_str)
    }

    /// One line for the log: what this configuration turns on.
    pub fn summary(&self) -> String {
        let tls = match &self.tls {
            None => "plain HTTP".to_owned(),
            Some(tls) => format!("TLS, client_auth_type {}", tls.client_auth.name()),
        };
        format!(
            "{tls}, {} basic auth user(s), {} extra header(s)",
            self.users.len(),
            self.headers.len()
        )
    }
}

/// The file being validated, for errors and relative paths.
struct File<'a> {
    path: &'a Path,
    dir: &'a Path,
}

impl File<'_> {
    fn invalid(&self, key: &str, reason: impl std::fmt::Display) -> WebConfigError {
        WebConfigError::Key {
            path: self.path.to_owned(),
            key: key.to_owned(),
            reason: reason.to_string(),
        }
    }

    /// The PEM text of `key`: inline (`inline_key`) or from the file it names, which is
    /// relative to this file's directory; `None` when neither is given.
    fn pem(
        &self,
        (inline_key, inline): (&str, Option<String>),
        (file_key, file): (&str, Option<PathBuf>),
    ) -> Result<Option<(String, Vec<u8>)>, WebConfigError> {
        let inline = inline.filter(|text| !text.trim().is_empty());
        let file = file.filter(|path| !path.as_os_str().is_empty());
        match (inline, file) {
            (Some(_), Some(_)) => Err(self.invalid(
                inline_key,
                format!("give either `{inline_key}` or `{file_key}`, not both"),
            )),
            (Some(text), None) => Ok(Some((inline_key.to_owned(), text.into_bytes()))),
            (None, Some(file)) => {
                let full = self.dir.join(&file);
                let bytes = std::fs::read(&full).map_err(|error| {
                    self.invalid(file_key, format!("cannot read {}: {error}", full.display()))
                })?;
                Ok(Some((file_key.to_owned(), bytes)))
            }
            (None, None) => Ok(None),
        }
    }
}

fn validate(raw: RawWebConfig, file: &File<'_>) -> Result<WebConfig, WebConfigError> {
    if raw.rate_limit.is_some() {
        return Err(file.invalid(
            "rate_limit",
            "not supported by poolscope: scrapes are bounded by [web] max_concurrent_scrapes \
             in the TOML configuration",
        ));
    }
    let tls = match raw.tls_server_config {
        Some(tls) => validate_tls(tls, file)?,
        None => None,
    };
    let headers = match raw.http_server_config {
        Some(http) => validate_http(http, file)?,
        None => Vec::new(),
    };
    let users = raw.basic_auth_users.unwrap_or_default();
    let mut costliest: Option<(u32, &String)> = None;
    for (user, hash) in &users {
        let key = format!("basic_auth_users.{user}");
        if user.is_empty() || user.contains(':') {
            return Err(file.invalid(
                &key,
                "a user name must not be empty nor contain ':' (basic auth splits at the first ':')",
            ));
        }
        // The hash is a secret: not repeated in the message.
        let parts = hash.parse::<bcrypt::HashParts>().map_err(|error| {
            file.invalid(
                &key,
                format!(
                    "not a bcrypt hash ({error}); make one with `htpasswd -nbBC 10 \"\" PASSWORD | tr -d ':\\n'`"
                ),
            )
        })?;
        if costliest.is_none_or(|(cost, _)| parts.get_cost() > cost) {
            costliest = Some((parts.get_cost(), hash));
        }
    }
    let dummy_hash = costliest.map(|(_, hash)| hash.clone()).unwrap_or_default();
    Ok(WebConfig {
        tls,
        users,
        dummy_hash,
        headers,
    })
}

fn validate_http(
    raw: RawHttp,
    file: &File<'_>,
) -> Result<Vec<(HeaderName, HeaderValue)>, WebConfigError> {
    if raw.http2 == Some(true) {
        return Err(file.invalid(
            "http_server_config.http2",
            "poolscope serves HTTP/1.1 only (Prometheus scrapes over HTTP/1.1 then); \
             set it to false or remove it",
        ));
    }
    let mut headers = Vec::new();
    for (name, value) in raw.headers.unwrap_or_default() {
        let key = format!("http_server_config.headers.{name}");
        let Some((_, allowed)) = ALLOWED_HEADERS.iter().find(|(known, _)| *known == name) else {
            let known: Vec<&str> = ALLOWED_HEADERS.iter().map(|(known, _)| *known).collect();
            return Err(file.invalid(
                &key,
                format!(
                    "this header cannot be set; want one of {}",
                    known.join(", ")
                ),
            ));
        };
        // Blank: unset, as exporter-toolkit has it.
        if value.is_empty() {
            continue;
        }
        if let Some(allowed) = allowed
            && !allowed.contains(&value.as_str())
        {
            return Err(file.invalid(
                &key,
                format!(
                    "{value:?} is not allowed; want one of {}",
                    allowed.join(", ")
                ),
            ));
        }
        let parsed = HeaderValue::from_str(&value)
            .map_err(|error| file.invalid(&key, format!("not a header value: {error}")))?;
        let name = HeaderName::from_bytes(name.as_bytes())
            .map_err(|error| file.invalid(&key, format!("not a header name: {error}")))?;
        headers.push((name, parsed));
    }
    Ok(headers)
}

/// `TLS12` or `TLS13`.
fn tls_version(
    file: &File<'_>,
    key: &str,
    value: Option<&str>,
    default: &'static rustls::SupportedProtocolVersion,
) -> Result<&'static rustls::SupportedProtocolVersion, WebConfigError> {
    match value.filter(|value| !value.is_empty()) {
        None => Ok(default),
        Some("TLS12") => Ok(&rustls::version::TLS12),
        Some("TLS13") => Ok(&rustls::version::TLS13),
        Some("TLS10" | "TLS11") => Err(file.invalid(
            key,
            "TLS 1.0 and 1.1 are not offered (rustls): want TLS12 or TLS13",
        )),
        Some(other) => Err(file.invalid(key, format!("{other:?}: want TLS12 or TLS13"))),
    }
}

fn validate_tls(raw: RawTls, file: &File<'_>) -> Result<Option<Tls>, WebConfigError> {
    const SECTION: &str = "tls_server_config";
    let key = |name: &str| format!("{SECTION}.{name}");
    let refused = [
        (
            "cipher_suites",
            &raw.cipher_suites,
            "not supported: poolscope's TLS (rustls) offers its own modern suites only \
             (TLS 1.3: AES-GCM and ChaCha20-Poly1305; TLS 1.2: ECDHE with AES-GCM or \
             ChaCha20-Poly1305); remove the key",
        ),
        (
            "curve_preferences",
            &raw.curve_preferences,
            "not supported: rustls chooses among X25519, P-256 and P-384; remove the key",
        ),
        (
            "client_allowed_sans",
            &raw.client_allowed_sans,
            "not supported: poolscope does not match client certificates' SANs; use a \
             client CA that signs only the certificates of allowed clients",
        ),
    ];
    for (name, value, reason) in refused {
        if value.as_ref().is_some_and(|values| !values.is_empty()) {
            return Err(file.invalid(&key(name), reason));
        }
    }

    let cert = file.pem((&key("cert"), raw.cert), (&key("cert_file"), raw.cert_file))?;
    let private_key = file.pem((&key("key"), raw.key), (&key("key_file"), raw.key_file))?;
    let client_ca = file.pem(
        (&key("client_ca"), raw.client_ca),
        (&key("client_ca_file"), raw.client_ca_file),
    )?;
    let client_auth = match raw.client_auth_type.as_deref().filter(|t| !t.is_empty()) {
        None => ClientAuth::NoClientCert,
        Some(name) => ClientAuth::ALL
            .into_iter()
            .find(|auth| auth.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = ClientAuth::ALL.iter().map(|auth| auth.name()).collect();
                file.invalid(
                    &key("client_auth_type"),
                    format!("{name:?}: want one of {}", names.join(", ")),
                )
            })?,
    };
    let (cert, private_key) = match (cert, private_key) {
        (Some(cert), Some(private_key)) => (cert, private_key),
        (None, None) => {
            // An empty section: no TLS, as exporter-toolkit has it. Anything else in
            // it would be ignored, so it is refused.
            let set = client_ca.is_some()
                || client_auth != ClientAuth::NoClientCert
                || raw.min_version.is_some()
                || raw.max_version.is_some()
                || raw.prefer_server_cipher_suites.is_some();
            return if set {
                Err(file.invalid(
                    &key("cert_file"),
                    "missing: TLS needs cert_file (or cert) and key_file (or key)",
                ))
            } else {
                Ok(None)
            };
        }
        (None, Some(_)) => {
            return Err(file.invalid(
                &key("cert_file"),
                "missing: key_file is given, so TLS needs cert_file (or cert) too",
            ));
        }
        (Some(_), None) => {
            return Err(file.invalid(
                &key("key_file"),
                "missing: cert_file is given, so TLS needs key_file (or key) too",
            ));
        }
    };

    let (cert_key, cert_pem) = cert;
    let chain = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|error| file.invalid(&cert_key, format!("not PEM certificates: {error}")))?;
    if chain.is_empty() {
        return Err(file.invalid(&cert_key, "holds no PEM certificate"));
    }
    let (private_key_key, private_key_pem) = private_key;
    let private_key = PrivateKeyDer::from_pem_slice(&private_key_pem).map_err(|error| {
        file.invalid(
            &private_key_key,
            format!("no PEM private key (PKCS#8, PKCS#1 or SEC1) in it: {error}"),
        )
    })?;

    let min = tls_version(
        file,
        &key("min_version"),
        raw.min_version.as_deref(),
        &rustls::version::TLS12,
    )?;
    let max = tls_version(
        file,
        &key("max_version"),
        raw.max_version.as_deref(),
        &rustls::version::TLS13,
    )?;
    let versions: Vec<&'static rustls::SupportedProtocolVersion> = match (min.version, max.version)
    {
        (rustls::ProtocolVersion::TLSv1_3, rustls::ProtocolVersion::TLSv1_2) => {
            return Err(file.invalid(&key("min_version"), "is above max_version"));
        }
        (low, high) if low == high => vec![min],
        _ => vec![&rustls::version::TLS12, &rustls::version::TLS13],
    };

    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ClientCertVerifier> = match (client_auth, client_ca) {
        (ClientAuth::NoClientCert, None) => Arc::new(rustls::server::NoClientAuth),
        (auth @ (ClientAuth::RequestClientCert | ClientAuth::RequireAnyClientCert), None) => {
            Arc::new(AnyClientCert {
                mandatory: auth == ClientAuth::RequireAnyClientCert,
                provider: provider.clone(),
            })
        }
        (auth, Some((ca_key, _))) if !auth.verifies() => {
            return Err(file.invalid(
                &ca_key,
                format!(
                    "client_auth_type {} does not verify client certificates; the client \
                     CA is used by VerifyClientCertIfGiven and RequireAndVerifyClientCert \
                     (RequireAndVerifyClientCert is the one that makes clients authenticate)",
                    auth.name()
                ),
            ));
        }
        (auth, None) => {
            return Err(file.invalid(
                &key("client_ca_file"),
                format!(
                    "missing: client_auth_type {} verifies client certificates against it",
                    auth.name()
                ),
            ));
        }
        (auth, Some((ca_key, ca_pem))) => {
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_slice_iter(&ca_pem) {
                let cert = cert.map_err(|error| {
                    file.invalid(&ca_key, format!("not PEM certificates: {error}"))
                })?;
                roots.add(cert).map_err(|error| {
                    file.invalid(&ca_key, format!("not a CA certificate: {error}"))
                })?;
            }
            if roots.is_empty() {
                return Err(file.invalid(&ca_key, "holds no PEM certificate"));
            }
            let builder =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone());
            let builder = if auth == ClientAuth::VerifyClientCertIfGiven {
                builder.allow_unauthenticated()
            } else {
                builder
            };
            builder
                .build()
                .map_err(|error| file.invalid(&ca_key, error))?
        }
    };

    let mut config = ServerConfig::builder_with_provider(provider)
        .with_protocol_versions(&versions)
        .map_err(|error| file.invalid(&key("min_version"), error))?
        .with_client_cert_verifier(verifier)
        .with_single_cert(chain, private_key)
        .map_err(|error| {
            file.invalid(
                &private_key_key,
                format!("not usable with the certificate of {cert_key}: {error}"),
            )
        })?;
    // exporter-toolkit's default is true: the server's order of suites.
    config.ignore_client_order = raw.prefer_server_cipher_suites.unwrap_or(true);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Some(Tls {
        acceptor: TlsAcceptor::from(Arc::new(config)),
        client_auth,
    }))
}

/// `RequestClientCert` and `RequireAnyClientCert`: any certificate is taken (its key
/// must still sign the handshake), as Go does for these insecure modes.
#[derive(Debug)]
struct AnyClientCert {
    mandatory: bool,
    provider: Arc<CryptoProvider>,
}

impl ClientCertVerifier for AnyClientCert {
    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// The web configuration in force, and what basic auth remembers.
pub struct WebState {
    path: Option<PathBuf>,
    current: RwLock<Arc<WebConfig>>,
    /// SHA-256 of (user, password, hash) of verifications that succeeded.
    verified: Mutex<HashSet<[u8; 32]>>,
    /// bcrypt verifications running at once (each takes a CPU for ~50–250 ms).
    verifying: Arc<tokio::sync::Semaphore>,
}

impl std::fmt::Debug for WebState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WebState")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl WebState {
    /// The file at `path` (read now), or plain HTTP for everyone without one.
    pub fn load(path: Option<&Path>) -> Result<Self, WebConfigError> {
        let config = match path {
            Some(path) => WebConfig::load(path)?,
            None => WebConfig::default(),
        };
        Ok(Self::new(path.map(Path::to_owned), config))
    }

    pub fn new(path: Option<PathBuf>, config: WebConfig) -> Self {
        let cpus = std::thread::available_parallelism().map_or(2, std::num::NonZero::get);
        Self {
            path,
            current: RwLock::new(Arc::new(config)),
            verified: Mutex::new(HashSet::new()),
            verifying: Arc::new(tokio::sync::Semaphore::new(cpus)),
        }
    }

    pub fn current(&self) -> Arc<WebConfig> {
        self.current
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Reads the file again (SIGHUP); a bad one keeps the running configuration and
    /// logs why. New connections and requests get the new one. Whether it was loaded.
    pub fn reload(&self) -> bool {
        let Some(path) = &self.path else {
            return true;
        };
        match WebConfig::load(path) {
            Ok(config) => {
                tracing::info!(
                    file = %path.display(),
                    config = config.summary(),
                    "web configuration reloaded"
                );
                *self.current.write().unwrap_or_else(PoisonError::into_inner) = Arc::new(config);
                self.verified
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .clear();
                true
            }
            Err(error) => {
                tracing::error!(%error, "web configuration reload refused; keeping the running one");
                false
            }
        }
    }

    /// Whether `headers` carry the basic-auth credentials of one of `config`'s users.
    /// Unknown users are verified against a dummy hash, so that they take as long.
    async fn authenticated(&self, config: &WebConfig, headers: &HeaderMap) -> bool {
        let Some((user, password)) = basic_credentials(headers) else {
            return false;
        };
        let (known, hash) = match config.users.get(&user) {
            Some(hash) => (true, hash.clone()),
            None => (false, config.dummy_hash.clone()),
        };
        let key = cache_key(&user, &password, &hash);
        if known
            && self
                .verified
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(&key)
        {
            return true;
        }
        let Ok(_permit) = self.verifying.clone().acquire_owned().await else {
            return false;
        };
        let valid = tokio::task::spawn_blocking(move || bcrypt::verify(password, &hash))
            .await
            .is_ok_and(|verified| verified.unwrap_or(false));
        if known && valid {
            let mut verified = self.verified.lock().unwrap_or_else(PoisonError::into_inner);
            if verified.len() >= MAX_VERIFIED
                && let Some(old) = verified.iter().next().copied()
            {
                verified.remove(&old);
            }
            verified.insert(key);
        }
        known && valid
    }

    #[cfg(test)]
    fn verified_len(&self) -> usize {
        self.verified
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}

/// (user, password) of an `Authorization: Basic …` header.
fn basic_credentials(headers: &HeaderMap) -> Option<(String, Vec<u8>)> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, encoded) = value.trim().split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(encoded.trim())
        .ok()?;
    let colon = decoded.iter().position(|&byte| byte == b':')?;
    let user = String::from_utf8(decoded[..colon].to_vec()).ok()?;
    Some((user, decoded[colon + 1..].to_vec()))
}

fn cache_key(user: &str, password: &[u8], hash: &str) -> [u8; 32] {
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    for part in [user.as_bytes(), password, hash.as_bytes()] {
        digest.update(&(part.len() as u64).to_le_bytes());
        digest.update(part);
    }
    let mut key = [0; 32];
    key.copy_from_slice(digest.finish().as_ref());
    key
}

/// Middleware for every route: basic auth when users are configured (401 with
/// `WWW-Authenticate: Basic` otherwise), then the configured response headers.
pub async fn authorize(
    State(state): State<Arc<WebState>>,
    request: Request,
    next: Next,
) -> Response {
    let config = state.current();
    let allowed = config.users.is_empty() || state.authenticated(&config, request.headers()).await;
    let mut response = if allowed {
        next.run(request).await
    } else {
        (
            StatusCode::UNAUTHORIZED,
            [(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Basic realm=\"poolscope\""),
            )],
            "Unauthorized\n",
        )
            .into_response()
    };
    for (name, value) in &config.headers {
        response.headers_mut().insert(name.clone(), value.clone());
    }
    response
}

/// Test certificates: CAs and the certificates they sign, made with rcgen.
#[cfg(test)]
pub(crate) mod test_pki {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose,
        IsCa, KeyPair, KeyUsagePurpose,
    };

    pub type Error = Box<dyn std::error::Error + Send + Sync>;

    /// A CA: its certificate in PEM and what signs with it.
    pub struct Ca {
        issuer: CertifiedIssuer<'static, KeyPair>,
    }

    /// A certificate and its private key, in PEM.
    pub struct Leaf {
        pub cert: String,
        pub key: String,
    }

    impl Ca {
        pub fn new(name: &str) -> Result<Self, Error> {
            let mut params = CertificateParams::new(Vec::<String>::new())?;
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.distinguished_name.push(DnType::CommonName, name);
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            Ok(Self {
                issuer: CertifiedIssuer::self_signed(params, KeyPair::generate()?)?,
            })
        }

        pub fn pem(&self) -> String {
            self.issuer.pem()
        }

        /// A server certificate for localhost and 127.0.0.1.
        pub fn server(&self) -> Result<Leaf, Error> {
            self.leaf(
                vec!["localhost".to_owned(), "127.0.0.1".to_owned()],
                ExtendedKeyUsagePurpose::ServerAuth,
            )
        }

        /// A client certificate.
        pub fn client(&self, name: &str) -> Result<Leaf, Error> {
            self.leaf(vec![name.to_owned()], ExtendedKeyUsagePurpose::ClientAuth)
        }

        fn leaf(&self, names: Vec<String>, usage: ExtendedKeyUsagePurpose) -> Result<Leaf, Error> {
            let mut params = CertificateParams::new(names)?;
            params.extended_key_usages = vec![usage];
            params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
            let key = KeyPair::generate()?;
            let cert = params.signed_by(&key, &self.issuer)?;
            Ok(Leaf {
                cert: cert.pem(),
                key: key.serialize_pem(),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use axum::{Router, body::Body, routing::get};
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::{
        test_pki::{Ca, Error},
        *,
    };

    /// A directory with a CA, a server certificate and key (`server.pem`,
    /// `server.key`), the CA (`ca.pem`) and the web config file `web.yml`.
    struct Fixture {
        dir: tempfile::TempDir,
    }

    impl Fixture {
        fn new() -> Result<Self, Error> {
            let dir = tempfile::tempdir()?;
            let ca = Ca::new("test CA")?;
            let server = ca.server()?;
            std::fs::write(dir.path().join("ca.pem"), ca.pem())?;
            std::fs::write(dir.path().join("server.pem"), &server.cert)?;
            std::fs::write(dir.path().join("server.key"), &server.key)?;
            Ok(Self { dir })
        }

        fn path(&self) -> PathBuf {
            self.dir.path().join("web.yml")
        }

        fn load(&self, yaml: &str) -> Result<WebConfig, WebConfigError> {
            std::fs::write(self.path(), yaml).map_err(|error| WebConfigError::File {
                path: self.path(),
                reason: error.to_string(),
            })?;
            WebConfig::load(&self.path())
        }

        /// The error of `yaml`, which must be refused.
        fn refusal(&self, yaml: &str) -> String {
            match self.load(yaml) {
                Ok(_) => panic!("accepted:\n{yaml}"),
                Err(error) => error.to_string(),
            }
        }
    }

    const TLS: &str = "tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n";

    #[test]
    fn an_empty_file_or_section_serves_plain_http() -> Result<(), Error> {
        let fixture = Fixture::new()?;
        for yaml in [
            "",
            "# nothing\n",
            "tls_server_config:\n",
            "tls_server_config: {}\n",
        ] {
            let config = fixture.load(yaml)?;
            assert!(config.tls.is_none(), "{yaml}");
            assert_eq!(config.users().count(), 0);
        }
        Ok(())
    }

    #[test]
    fn tls_files_are_relative_to_the_files_directory() -> Result<(), Error> {
        let fixture = Fixture::new()?;
        let config = fixture.load(TLS)?;
        let tls = config.tls.as_ref().ok_or("no TLS")?;
        assert_eq!(tls.client_auth, ClientAuth::NoClientCert);
        assert_eq!(
            config.summary(),
            "TLS, client_auth_type NoClientCert, 0 basic auth user(s), 0 extra header(s)"
        );
        // The same by absolute paths, read from another working directory.
        let absolute = format!(
            "tls_server_config:\n  cert_file: {}\n  key_file: {}\n",
            fixture.dir.path().join("server.pem").display(),
            fixture.dir.path().join("server.key").display()
        );
        assert!(fixture.load(&absolute)?.tls.is_some());
        Ok(())
    }

    #[test]
    fn inline_certificates_and_every_client_auth_type() -> Result<(), Error> {
        let fixture = Fixture::new()?;
        let read = |name: &str| std::fs::read_to_string(fixture.dir.path().join(name));
        let indent = |pem: String| pem.trim_end().replace('\n', "\n    ");
        let inline = format!(
            "tls_server_config:\n  cert: |\n    {}\n  key: |\n    {}\n  min_version: TLS13\n",
            indent(read("server.pem")?),
            indent(read("server.key")?)
        );
        assert!(fixture.load(&inline)?.tls.is_some());
        for auth in ClientAuth::ALL {
            let ca = if auth.verifies() {
                "  client_ca_file: ca.pem\n"
            } else {
                ""
            };
            let yaml = format!("{TLS}  client_auth_type: {}\n{ca}", auth.name());
            let config = fixture.load(&yaml)?;
            assert_eq!(config.tls.ok_or("no TLS")?.client_auth, auth);
        }
        Ok(())
    }

    #[test]
    fn refusals_name_the_file_the_key_and_the_reason() -> Result<(), Error> {
        let fixture = Fixture::new()?;
        let with_tls = |rest: &str| format!("{TLS}{rest}");
        let cases: Vec<(String, &str, &str)> = vec![
            ("foo: 1\n".into(), "foo", "unknown field `foo`"),
            (
                with_tls("  cert_fil: x.pem\n"),
                "cert_fil",
                "unknown field `cert_fil`",
            ),
            (
                with_tls("  cipher_suites: [TLS_AES_128_GCM_SHA256]\n"),
                "`tls_server_config.cipher_suites`",
                "not supported",
            ),
            (
                with_tls("  curve_preferences: [X25519]\n"),
                "`tls_server_config.curve_preferences`",
                "not supported",
            ),
            (
                with_tls("  client_allowed_sans: [a.example]\n"),
                "`tls_server_config.client_allowed_sans`",
                "not supported",
            ),
            (
                "rate_limit:\n  interval: 1s\n  burst: 5\n".into(),
                "`rate_limit`",
                "not supported",
            ),
            (
                "http_server_config:\n  http2: true\n".into(),
                "`http_server_config.http2`",
                "HTTP/1.1 only",
            ),
            (
                "http_server_config:\n  headers:\n    X-Powered-By: rust\n".into(),
                "`http_server_config.headers.X-Powered-By`",
                "cannot be set",
            ),
            (
                "http_server_config:\n  headers:\n    X-Frame-Options: allow\n".into(),
                "`http_server_config.headers.X-Frame-Options`",
                "want one of deny, sameorigin",
            ),
            (
                with_tls("  min_version: TLS10\n"),
                "`tls_server_config.min_version`",
                "TLS 1.0 and 1.1 are not offered",
            ),
            (
                with_tls("  max_version: SSL3\n"),
                "`tls_server_config.max_version`",
                "want TLS12 or TLS13",
            ),
            (
                with_tls("  min_version: TLS13\n  max_version: TLS12\n"),
                "`tls_server_config.min_version`",
                "above max_version",
            ),
            (
                with_tls("  client_auth_type: RequireClientCert\n"),
                "`tls_server_config.client_auth_type`",
                "want one of NoClientCert, RequestClientCert",
            ),
            (
                with_tls("  client_auth_type: RequireAndVerifyClientCert\n"),
                "`tls_server_config.client_ca_file`",
                "missing",
            ),
            (
                with_tls("  client_ca_file: ca.pem\n"),
                "`tls_server_config.client_ca_file`",
                "NoClientCert does not verify client certificates",
            ),
            (
                "tls_server_config:\n  cert_file: nope.pem\n  key_file: server.key\n".into(),
                "`tls_server_config.cert_file`",
                "nope.pem: No such file",
            ),
            (
                "tls_server_config:\n  cert_file: server.pem\n".into(),
                "`tls_server_config.key_file`",
                "missing",
            ),
            (
                "tls_server_config:\n  client_auth_type: RequireAnyClientCert\n".into(),
                "`tls_server_config.cert_file`",
                "missing",
            ),
            (
                with_tls("  cert: \"-----BEGIN CERTIFICATE-----\"\n"),
                "`tls_server_config.cert`",
                "not both",
            ),
            (
                "tls_server_config:\n  cert_file: server.key\n  key_file: server.key\n".into(),
                "`tls_server_config.cert_file`",
                "no PEM certificate",
            ),
            (
                "tls_server_config:\n  cert_file: server.pem\n  key_file: server.pem\n".into(),
                "`tls_server_config.key_file`",
                "no PEM private key",
            ),
            (
                "basic_auth_users:\n  alice: secret\n".into(),
                "`basic_auth_users.alice`",
                "not a bcrypt hash",
            ),
            (
                "basic_auth_users:\n  \"a:b\": \"$2y$04$000000000000000000000u6QH6Fv7ONvhrs0R8wlBkDDDYIXyf.y\"\n"
                    .into(),
                "`basic_auth_users.a:b`",
                "must not be empty nor contain ':'",
            ),
            ("basic_auth_users: [alice]\n".into(), "basic_auth_users", "invalid type"),
        ];
        let file = fixture.path().display().to_string();
        for (yaml, key, reason) in cases {
            let error = fixture.refusal(&yaml);
            assert!(
                error.starts_with(&format!("web config file {file}: ")),
                "{yaml}→ {error}"
            );
            assert!(error.contains(key), "{yaml}→ {error} (want key {key})");
            assert!(error.contains(reason), "{yaml}→ {error} (want {reason:?})");
        }
        // The hash is a secret: a refusal does not repeat it.
        let error = fixture.refusal("basic_auth_users:\n  alice: hunter2hunter2\n");
        assert!(!error.contains("hunter2"), "{error}");
        // A file that is not there.
        let missing = WebConfig::load(Path::new("/nonexistent/web.yml"))
            .err()
            .ok_or("accepted")?
            .to_string();
        assert!(
            missing.starts_with("web config file /nonexistent/web.yml: cannot read it"),
            "{missing}"
        );
        Ok(())
    }

    #[test]
    fn a_key_that_does_not_match_the_certificate_is_refused() -> Result<(), Error> {
        let fixture = Fixture::new()?;
        let other = Ca::new("other CA")?.server()?;
        std::fs::write(fixture.dir.path().join("other.key"), other.key)?;
        let error =
            fixture.refusal("tls_server_config:\n  cert_file: server.pem\n  key_file: other.key\n");
        assert!(error.contains("`tls_server_config.key_file`"), "{error}");
        assert!(
            error.contains("not usable with the certificate of tls_server_config.cert_file"),
            "{error}"
        );
        Ok(())
    }

    /// A router whose routes answer 200, behind [`authorize`].
    fn guarded(state: Arc<WebState>) -> Router {
        Router::new()
            .route("/metrics", get(|| async { "metrics\n" }))
            .route("/healthz", get(|| async { "ok\n" }))
            .layer(axum::middleware::from_fn_with_state(state, authorize))
    }

    async fn send(router: &Router, path: &str, auth: Option<&str>) -> Result<Response, Error> {
        let mut request = axum::http::Request::get(path);
        if let Some(auth) = auth {
            request = request.header(header::AUTHORIZATION, auth);
        }
        Ok(router.clone().oneshot(request.body(Body::empty())?).await?)
    }

    fn basic(user_and_password: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(user_and_password)
        )
    }

    #[tokio::test]
    async fn basic_auth_guards_every_path_and_remembers_successes() -> Result<(), Error> {
        let fixture = Fixture::new()?;
        let hash = bcrypt::hash("s3cret:with colon", 4)?;
        let config = fixture.load(&format!(
            "basic_auth_users:\n  alice: \"{hash}\"\n  bob: \"{}\"\n\
             http_server_config:\n  headers:\n    X-Frame-Options: deny\n    X-XSS-Protection: \"\"\n",
            bcrypt::hash("other", 4)?
        ))?;
        assert_eq!(config.users().collect::<Vec<_>>(), ["alice", "bob"]);
        let state = Arc::new(WebState::new(Some(fixture.path()), config));
        let router = guarded(state.clone());
        let refused = [
            None,
            Some(basic("alice:wrong")),
            Some(basic("bob:s3cret:with colon")),
            Some(basic("mallory:s3cret:with colon")),
            Some(basic("alice")),
            Some("Basic !!!".to_owned()),
            Some("Bearer abc".to_owned()),
        ];
        for path in ["/metrics", "/healthz", "/nope"] {
            for auth in &refused {
                let response = send(&router, path, auth.as_deref()).await?;
                assert_eq!(
                    response.status(),
                    StatusCode::UNAUTHORIZED,
                    "{path} {auth:?}"
                );
                let challenge = response
                    .headers()
                    .get(header::WWW_AUTHENTICATE)
                    .and_then(|value| value.to_str().ok());
                assert!(challenge.is_some_and(|value| value.starts_with("Basic")));
                assert_eq!(
                    response
                        .headers()
                        .get("x-frame-options")
                        .map(|v| v.as_bytes()),
                    Some(&b"deny"[..])
                );
            }
        }
        assert_eq!(state.verified_len(), 0);
        let right = basic("alice:s3cret:with colon");
        for path in ["/metrics", "/healthz"] {
            let response = send(&router, path, Some(&right)).await?;
            assert_eq!(response.status(), StatusCode::OK, "{path}");
            assert!(response.headers().get("x-xss-protection").is_none());
            let body = response.into_body().collect().await?.to_bytes();
            assert!(!body.is_empty());
        }
        let lowercase = format!("basic {}", right.trim_start_matches("Basic "));
        assert_eq!(
            send(&router, "/metrics", Some(&lowercase)).await?.status(),
            StatusCode::OK
        );
        assert_eq!(state.verified_len(), 1);
        assert_eq!(
            send(&router, "/nope", Some(&right)).await?.status(),
            StatusCode::NOT_FOUND
        );
        Ok(())
    }

    #[tokio::test]
    async fn the_verified_cache_is_bounded() -> Result<(), Error> {
        let hash = bcrypt::hash("pw", 4)?;
        let mut config = WebConfig {
            dummy_hash: hash.clone(),
            ..WebConfig::default()
        };
        for user in 0..MAX_VERIFIED + 20 {
            config.users.insert(format!("user{user}"), hash.clone());
        }
        let state = Arc::new(WebState::new(None, config));
        let router = guarded(state.clone());
        for user in 0..MAX_VERIFIED + 20 {
            let response =
                send(&router, "/metrics", Some(&basic(&format!("user{user}:pw")))).await?;
            assert_eq!(response.status(), StatusCode::OK);
        }
        assert_eq!(state.verified_len(), MAX_VERIFIED);
        Ok(())
    }

    #[test]
    fn a_bad_reload_keeps_the_running_configuration() -> Result<(), Error> {
        let fixture = Fixture::new()?;
        std::fs::write(fixture.path(), TLS)?;
        let state = WebState::load(Some(&fixture.path()))?;
        assert!(state.current().tls.is_some());
        std::fs::write(
            fixture.path(),
            "tls_server_config:\n  cert_file: gone.pem\n",
        )?;
        assert!(!state.reload());
        assert!(state.current().tls.is_some());
        std::fs::write(
            fixture.path(),
            format!(
                "basic_auth_users:
  alice: \"{}\"
",
                bcrypt::hash("pw", 4)?
            ),
        )?;
        assert!(state.reload());
        let current = state.current();
        assert!(current.tls.is_none());
        assert_eq!(current.users().collect::<Vec<_>>(), ["alice"]);
        Ok(())
    }
}
