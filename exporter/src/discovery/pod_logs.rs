//! The kubelet's names for pod containers. A node's `/var/log/containers` holds one
//! link per container, named `<pod>_<namespace>_<container>-<container id>.log` (what
//! log shippers read), so listing that directory maps the container id a process's
//! cgroup gives to its pod, namespace and container name: no API server, no token,
//! no network, and nothing the process can change (its environment, which nginx
//! overwrites with its title). Only names are read; the links are not followed.
//!
//! The listing is read again only when the directory changed since (its mtime), so a
//! rescan of a node with hundreds of containers costs one `stat`.
use std::{
    collections::HashMap,
    fs, io,
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

/// Where a pod container runs, as the kubelet names it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContainerNames {
    pub pod: String,
    pub namespace: String,
    pub container: String,
}

/// The container id (64 hex digits) and names of a log link's file name; `None` for
/// any other name. Pod names, namespaces and container names are DNS labels or
/// subdomains, none holds `_`; a container name may hold `-`, so the id is what
/// follows the last one.
pub fn parse_link_name(name: &str) -> Option<(&str, ContainerNames)> {
    let (names, id) = name.strip_suffix(".log")?.rsplit_once('-')?;
    if id.len() != 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let mut parts = names.split('_');
    let (pod, namespace, container) = (parts.next()?, parts.next()?, parts.next()?);
    let valid = |part: &str| {
        !part.is_empty()
            && part
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
    };
    (parts.next().is_none() && valid(pod) && valid(namespace) && valid(container)).then(|| {
        (
            id,
            ContainerNames {
                pod: pod.to_owned(),
                namespace: namespace.to_owned(),
                container: container.to_owned(),
            },
        )
    })
}

/// A directory's mtime is kept at the kernel's coarse clock (a tick, up to 10 ms): a
/// listing read less than this after the last change may have missed a change made
/// within the same tick, and is read again at the next rescan.
const SETTLED: Duration = Duration::from_secs(1);

/// The container names of one listing, by container id; cheap to clone.
#[derive(Clone, Debug, Default)]
pub struct PodIndex(Arc<HashMap<String, Arc<ContainerNames>>>);

impl PodIndex {
    /// The names of the container with this full id, if the kubelet listed it.
    pub fn get(&self, id: &str) -> Option<Arc<ContainerNames>> {
        self.0.get(id).cloned()
    }
}

/// The container names the kubelet's log links give, listed again when they change.
#[derive(Debug)]
pub struct PodLogs {
    dir: PathBuf,
    /// The directory's mtime when the listing was read, if it had settled then.
    listed_at: Option<SystemTime>,
    index: PodIndex,
    /// Listings read (each a `readdir` of the whole directory).
    pub listings: u64,
    /// Refreshes that failed (the names listed before stay).
    pub failures: u64,
}

impl PodLogs {
    pub fn new(dir: PathBuf) -> Self {
        Self {
            dir,
            listed_at: None,
            index: PodIndex::default(),
            listings: 0,
            failures: 0,
        }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Reads the listing again if the directory changed. A directory that does not
    /// exist (not a Kubernetes node, or not mounted) leaves no names: processes are
    /// named as they would be without it. A listing that fails keeps the names listed
    /// before, and counts in `failures`.
    pub fn refresh(&mut self) -> io::Result<()> {
        let refreshed = self.list_if_changed();
        if refreshed.is_err() {
            self.failures += 1;
        }
        refreshed
    }

    fn list_if_changed(&mut self) -> io::Result<()> {
        let modified = match fs::metadata(&self.dir).and_then(|meta| meta.modified()) {
            Ok(modified) => modified,
            Err(error) if error.kind() == io::ErrorKind::NotFound => {
                self.index = PodIndex::default();
                self.listed_at = None;
                return Ok(());
            }
            Err(error) => return Err(error),
        };
        if self.listed_at == Some(modified) {
            return Ok(());
        }
        let mut by_id = HashMap::with_capacity(self.index.0.len());
        for entry in fs::read_dir(&self.dir)? {
            let name = entry?.file_name();
            if let Some((id, names)) = name.to_str().and_then(parse_link_name) {
                // A restarted container's old link may stay beside its new one: each
                // has its own id.
                by_id.insert(id.to_ascii_lowercase(), Arc::new(names));
            }
        }
        self.index = PodIndex(Arc::new(by_id));
        self.listings += 1;
        let settled = SystemTime::now()
            .duration_since(modified)
            .is_ok_and(|age| age >= SETTLED);
        self.listed_at = settled.then_some(modified);
        Ok(())
    }

    /// The names as last listed.
    pub fn index(&self) -> PodIndex {
        self.index.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f1c2a9be0d7c3b1a2f4e5d6c7b8a9f0e1d2c3b4a5f6e7d8c9b0a1f2e3d4c5b6";

    fn names(pod: &str, namespace: &str, container: &str) -> ContainerNames {
        ContainerNames {
            pod: pod.into(),
            namespace: namespace.into(),
            container: container.into(),
        }
    }

    #[test]
    fn link_names_as_the_kubelet_writes_them() {
        let cases = [
            (
                format!("web-7d9f8c6b5-x2k4q_prod_web-{ID}.log"),
                Some(names("web-7d9f8c6b5-x2k4q", "prod", "web")),
            ),
            // A pod name may be a subdomain (dots), a container name has dashes.
            (
                format!("api-0.shard_kube-system_istio-proxy-{ID}.log"),
                Some(names("api-0.shard", "kube-system", "istio-proxy")),
            ),
            (format!("web_prod_web-{}.log", &ID[..63]), None),
            (format!("web_prod_web-{ID}.log.gz"), None),
            (format!("web_prod-{ID}.log"), None),
            (format!("web_prod_web_x-{ID}.log"), None),
            (format!("_prod_web-{ID}.log"), None),
            (format!("Web_prod_web-{ID}.log"), None),
            (format!("web_prod_web-{}.log", ID.replace('4', "g")), None),
        ];
        for (name, expected) in cases {
            assert_eq!(
                parse_link_name(&name).map(|(_, names)| names),
                expected,
                "{name}"
            );
        }
        assert_eq!(
            parse_link_name(&format!("web_prod_web-{ID}.log")).map(|(id, _)| id),
            Some(ID)
        );
    }

    #[test]
    fn listing_follows_the_directory() -> io::Result<()> {
        let root = tempfile::tempdir()?;
        let dir = root.path().join("containers");
        let mut logs = PodLogs::new(dir.clone());
        logs.refresh()?;
        assert_eq!(logs.index().get(ID), None, "no directory: no names");
        fs::create_dir(&dir)?;
        fs::write(
            dir.join(format!("web-7d9f8c6b5-x2k4q_prod_web-{ID}.log")),
            "",
        )?;
        fs::write(dir.join("README"), "")?;
        logs.refresh()?;
        assert_eq!(
            logs.index().get(ID).as_deref(),
            Some(&names("web-7d9f8c6b5-x2k4q", "prod", "web"))
        );
        // Changed just now: read again at every refresh until it settles.
        let listings = logs.listings;
        logs.refresh()?;
        assert_eq!(logs.listings, listings + 1);
        fs::remove_file(dir.join(format!("web-7d9f8c6b5-x2k4q_prod_web-{ID}.log")))?;
        logs.refresh()?;
        assert_eq!(logs.index().get(ID), None);
        // Settled: not read again until it changes.
        let settled = SystemTime::now() - SETTLED * 2;
        fs::File::open(&dir)?.set_modified(settled)?;
        logs.refresh()?;
        let listings = logs.listings;
        logs.refresh()?;
        assert_eq!(logs.listings, listings);
        Ok(())
    }
}
