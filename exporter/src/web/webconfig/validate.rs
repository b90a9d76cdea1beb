//! The file as written (`Raw*`, exporter-toolkit's keys) and its validation into a
//! [`WebConfig`]: refusals that name the key and the reason, headers, TLS versions,
//! certificates, keys and client authentication (rustls).
use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::Arc,
};

use axum::http::{HeaderName, HeaderValue};
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

use super::{ClientAuth, Tls, WebConfig, WebConfigError};

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
pub(super) struct RawWebConfig {
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

/// The file being validated, for errors and relative paths.
pub(super) struct File<'a> {
    pub(super) path: &'a Path,
    pub(super) dir: &'a Path,
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

pub(super) fn validate(raw: RawWebConfig, file: &File<'_>) -> Result<WebConfig, WebConfigError> {
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
