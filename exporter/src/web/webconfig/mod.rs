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
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use axum::http::{HeaderName, HeaderValue};
use tokio_rustls::TlsAcceptor;

mod auth;
mod validate;

pub use auth::{WebState, authorize};
use validate::{File, RawWebConfig, validate};

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
    use super::{
        test_pki::{Ca, Error},
        *,
    };

    /// A directory with a CA, a server certificate and key (`server.pem`,
    /// `server.key`), the CA (`ca.pem`) and the web config file `web.yml`.
    pub(super) struct Fixture {
        pub(super) dir: tempfile::TempDir,
    }

    impl Fixture {
        pub(super) fn new() -> Result<Self, Error> {
            let dir = tempfile::tempdir()?;
            let ca = Ca::new("test CA")?;
            let server = ca.server()?;
            std::fs::write(dir.path().join("ca.pem"), ca.pem())?;
            std::fs::write(dir.path().join("server.pem"), &server.cert)?;
            std::fs::write(dir.path().join("server.key"), &server.key)?;
            Ok(Self { dir })
        }

        pub(super) fn path(&self) -> PathBuf {
            self.dir.path().join("web.yml")
        }

        pub(super) fn load(&self, yaml: &str) -> Result<WebConfig, WebConfigError> {
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

    pub(super) const TLS: &str =
        "tls_server_config:\n  cert_file: server.pem\n  key_file: server.key\n";

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
}
