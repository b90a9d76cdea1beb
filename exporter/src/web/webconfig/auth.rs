//! The web configuration in force ([`WebState`], replaced on SIGHUP) and basic auth:
//! the [`authorize`] middleware, bcrypt verification and its bounded cache.
use std::{
    collections::HashSet,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError, RwLock},
};

use axum::{
    extract::{Request, State},
    http::{HeaderMap, HeaderValue, StatusCode, header},
    middleware::Next,
    response::{IntoResponse, Response},
};
use base64::Engine as _;

use super::{WebConfig, WebConfigError};

/// Successful basic-auth verifications remembered (bcrypt takes 50–250 ms each).
const MAX_VERIFIED: usize = 100;

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

#[cfg(test)]
mod tests {
    use axum::{Router, body::Body, routing::get};
    use http_body_util::BodyExt as _;
    use tower::ServiceExt as _;

    use super::*;
    use crate::web::webconfig::{
        test_pki::Error,
        tests::{Fixture, TLS},
    };

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
