//! Thread pools (DESIGN §3): the pool of each followed thread, named by its
//! normalized thread name within its service, and the dense pool ids the kernel
//! counts by. The kernel follows threads by itself once a process is watched; user
//! space only names them (when first seen and when renamed) and follows the threads
//! a process already had when it started being watched. Their numbers are
//! `metrics/pools.rs`'.
use std::path::PathBuf;

use poolscope_shared::{Activity, Thread, maps};

use crate::{
    clock::monotonic_ns,
    discovery::ids::DenseIds,
    discovery::procfs,
    idmap::{IdMap, IdSet},
    kernel::{MapErrors, ThreadTable},
};

/// The pool of a thread: its normalized name, except that threads which kept their
/// process's name (never named by the runtime: Node.js and libuv helpers, Python
/// threads, Go's Ms) are a pool apart from the main thread, `<name>-threads`, so that
/// an event loop or a worker process's main thread is not averaged with its helpers.
pub fn pool_name(comm: &str, is_main: bool, main_comm: Option<&str>) -> String {
    let name = normalize_thread_name(comm);
    if !is_main && main_comm == Some(comm) {
        format!("{name}-threads")
    } else {
        name
    }
}

/// A thread name without trailing digits and separators (`http-nio-8080-exec-12` →
/// `http-nio-8080-exec`); a name that is all digits and separators stays as it is.
pub fn normalize_thread_name(comm: &str) -> String {
    let trimmed = comm.trim_end_matches(|c: char| {
        c.is_ascii_digit() || matches!(c, '-' | '_' | '.' | ':' | '#' | '/' | ' ')
    });
    if trimmed.is_empty() {
        comm.to_owned()
    } else {
        trimmed.to_owned()
    }
}

/// What a thread found already running is doing, from its /proc state letter. It
/// holds no request we saw start, so any wait but uninterruptible sleep is idle.
pub fn initial_activity(state: char) -> Activity {
    match state {
        'R' => Activity::Runnable,
        'D' => Activity::OffDisk,
        _ => Activity::OffIdle,
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PoolKey {
    service: u32,
    name: String,
}

/// A pool as the scrape sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolView {
    pub id: u32,
    pub service: u32,
    pub name: String,
}

#[derive(Debug)]
pub struct Pools {
    ids: DenseIds<PoolKey>,
    /// tid → the pool we put it in; threads not here are named at the next sync.
    named: IdMap<u32, u32>,
    procfs_root: PathBuf,
    /// Threads left in their creator's pool because `limits.max_pools` was reached.
    pub pools_refused: u64,
    /// Inserts into `THREADS`/`THREAD_POOLS` that failed (counted as `THREADS`, as
    /// the kernel side does: one limit sizes both).
    pub map_errors: MapErrors,
}

/// A thread's process: its tgid and its main thread's name.
type ProcessOf<'a> = Option<(u32, &'a str)>;

impl Pools {
    pub fn new(procfs_root: PathBuf, max_pools: u32) -> Self {
        Self {
            ids: DenseIds::new(max_pools),
            named: IdMap::default(),
            procfs_root,
            pools_refused: 0,
            map_errors: MapErrors::default(),
        }
    }

    fn get_or_allocate(&mut self, kernel: &mut dyn ThreadTable, key: &PoolKey) -> Option<u32> {
        let (id, new) = self.ids.get_or_allocate(key)?;
        // A reused id starts from zero.
        if new && let Err(error) = kernel.reset_pool(id) {
            tracing::warn!(id, %error, "cannot reset the stats of a pool");
            self.ids.free(id);
            return None;
        }
        Some(id)
    }

    /// The process of a thread the kernel reported, from procfs.
    fn process_of(&self, tid: u32) -> Option<(u32, String)> {
        let tgid = procfs::thread_group(&self.procfs_root, tid)?;
        Some((tgid, procfs::thread_comm(&self.procfs_root, tgid)?))
    }

    /// Puts `tid` of `service` in the pool its name (and its process's) says.
    fn name_thread(
        &mut self,
        kernel: &mut dyn ThreadTable,
        tid: u32,
        service: u32,
        comm: &str,
        process: ProcessOf<'_>,
    ) {
        let key = PoolKey {
            service,
            name: pool_name(
                comm,
                process.is_some_and(|(tgid, _)| tgid == tid),
                process.map(|(_, main_comm)| main_comm),
            ),
        };
        let Some(pool) = self.get_or_allocate(kernel, &key) else {
            self.pools_refused += 1;
            // Once per thread, possibly thousands: the health check logs the onset.
            tracing::debug!(
                tid,
                comm,
                "limits.max_pools reached; thread left in its creator's pool"
            );
            // Do not try again at every sync.
            self.named.insert(tid, u32::MAX);
            return;
        };
        if self.named.get(&tid) == Some(&pool) {
            return;
        }
        match kernel.set_thread_pool(tid, pool) {
            Ok(()) => {
                self.named.insert(tid, pool);
            }
            Err(error) => {
                self.map_errors.count(maps::THREADS, &error);
                tracing::debug!(tid, %error, "cannot set the pool of a thread");
            }
        }
    }

    /// Follows the threads `pid` already has when it starts being watched.
    pub fn follow_process(&mut self, kernel: &mut dyn ThreadTable, pid: u32, service: u32) {
        let now = monotonic_ns();
        let tasks = procfs::tasks(&self.procfs_root, pid);
        let main_comm = tasks
            .iter()
            .find(|task| task.tid == pid)
            .map(|task| task.comm.clone());
        for task in &tasks {
            let thread = Thread::new(service, initial_activity(task.state), now);
            if let Err(error) = kernel.follow_thread(task.tid, thread) {
                self.map_errors.count(maps::THREADS, &error);
                tracing::debug!(tid = task.tid, %error, "cannot follow thread");
                continue;
            }
            // It may have exited between the listing and the insert, after the kernel
            // dropped its entry: ours would then stay forever. Checked after the
            // insert: an exit that begins later finds the entry and drops it.
            if procfs::task_exiting(&self.procfs_root, pid, task.tid) {
                kernel.forget_thread(task.tid);
                continue;
            }
            let process = main_comm.as_deref().map(|main_comm| (pid, main_comm));
            self.name_thread(kernel, task.tid, service, &task.comm, process);
        }
    }

    /// Stops following the threads of `pid`, which is no longer watched.
    pub fn forget_process(&mut self, kernel: &mut dyn ThreadTable, pid: u32) {
        for task in procfs::tasks(&self.procfs_root, pid) {
            kernel.forget_thread(task.tid);
            self.named.remove(&task.tid);
        }
    }

    /// A followed thread changed its name.
    pub fn renamed(&mut self, kernel: &mut dyn ThreadTable, tid: u32, service: u32) {
        if let Some(comm) = procfs::thread_comm(&self.procfs_root, tid) {
            let process = self.process_of(tid);
            let process = process.as_ref().map(|(tgid, main)| (*tgid, main.as_str()));
            self.name_thread(kernel, tid, service, &comm, process);
        }
    }

    /// Given the threads the kernel follows now (`threads` of a [`Readout`]): names
    /// the ones it started following by itself, forgets the ones it dropped, and
    /// drops the threads and pools of services that are gone.
    pub fn sync(
        &mut self,
        kernel: &mut dyn ThreadTable,
        live_services: &[u32],
        threads: &[(u32, Thread, Option<u32>)],
    ) {
        let live: IdSet<u32> = live_services.iter().copied().collect();
        let present: IdSet<u32> = threads.iter().map(|(tid, ..)| *tid).collect();
        self.named.retain(|tid, _| present.contains(tid));
        for (tid, thread, _) in threads {
            if !live.contains(&thread.service) {
                kernel.forget_thread(*tid);
                continue;
            }
            if self.named.contains_key(tid) {
                continue;
            }
            if let Some(comm) = procfs::thread_comm(&self.procfs_root, *tid) {
                let process = self.process_of(*tid);
                let process = process.as_ref().map(|(tgid, main)| (*tgid, main.as_str()));
                self.name_thread(kernel, *tid, thread.service, &comm, process);
            }
        }
        let gone: Vec<u32> = self
            .ids
            .iter()
            .filter(|(_, key)| !live.contains(&key.service))
            .map(|(id, _)| id)
            .collect();
        if !gone.is_empty() {
            kernel.release_pools(&gone);
            self.ids.retain(|key| live.contains(&key.service));
        }
    }

    /// Ids of every pool.
    pub fn ids(&self) -> Vec<u32> {
        self.ids.iter().map(|(id, _)| id).collect()
    }

    pub fn views(&self) -> Vec<PoolView> {
        self.ids
            .iter()
            .map(|(id, key)| PoolView {
                id,
                service: key.service,
                name: key.name.clone(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernel::fake::FakeTables;

    /// A procfs with process `pid` whose threads are (tid, name).
    fn process(pid: u32, threads: &[(u32, &str)]) -> std::io::Result<tempfile::TempDir> {
        let root = tempfile::tempdir()?;
        for (tid, comm) in threads {
            let task = root.path().join(format!("{pid}/task/{tid}"));
            std::fs::create_dir_all(&task)?;
            std::fs::write(
                task.join("stat"),
                format!("{tid} ({comm}) S 1 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 0 0"),
            )?;
        }
        Ok(root)
    }

    fn pool_names(pools: &Pools) -> Vec<String> {
        let mut names: Vec<String> = pools.views().into_iter().map(|v| v.name).collect();
        names.sort();
        names
    }

    #[test]
    fn a_watched_process_threads_are_followed_in_the_pools_their_names_say() -> std::io::Result<()>
    {
        let threads = [
            (100, "java"),
            (101, "http-nio-8080-exec-1"),
            (102, "http-nio-8080-exec-2"),
            (103, "GC Thread#0"),
        ];
        let root = process(100, &threads)?;
        let mut pools = Pools::new(root.path().to_owned(), 8);
        let mut tables = FakeTables::default();
        pools.follow_process(&mut tables, 100, 3);
        assert_eq!(
            tables.threads.keys().copied().collect::<Vec<_>>(),
            [100, 101, 102, 103]
        );
        assert!(tables.threads.values().all(|thread| thread.service == 3));
        assert_eq!(tables.thread_pools.get(&101), tables.thread_pools.get(&102));
        assert_ne!(tables.thread_pools.get(&100), tables.thread_pools.get(&101));
        assert_eq!(
            pool_names(&pools),
            ["GC Thread", "http-nio-8080-exec", "java"]
        );
        // Every new pool id starts from zero in the kernel.
        assert_eq!(tables.pools_reset.len(), 3);

        pools.forget_process(&mut tables, 100);
        assert!(tables.threads.is_empty() && tables.thread_pools.is_empty());
        Ok(())
    }

    #[test]
    fn pools_beyond_the_limit_are_refused_and_their_threads_left_unnamed() -> std::io::Result<()> {
        let root = process(100, &[(100, "server"), (101, "worker-1"), (102, "io-1")])?;
        let mut pools = Pools::new(root.path().to_owned(), 2);
        let mut tables = FakeTables::default();
        pools.follow_process(&mut tables, 100, 0);
        assert_eq!(pools.views().len(), 2);
        assert_eq!(pools.pools_refused, 1);
        // Still followed (its time counts in its creator's pool), just not named.
        assert_eq!(tables.threads.len(), 3);
        assert_eq!(tables.thread_pools.len(), 2);
        Ok(())
    }

    #[test]
    fn a_sync_drops_the_threads_and_pools_of_services_gone() -> std::io::Result<()> {
        let root = process(100, &[(100, "server"), (101, "worker-1")])?;
        let mut pools = Pools::new(root.path().to_owned(), 8);
        let mut tables = FakeTables::default();
        pools.follow_process(&mut tables, 100, 4);
        let threads: Vec<(u32, Thread, Option<u32>)> = tables
            .threads
            .iter()
            .map(|(&tid, &thread)| (tid, thread, tables.thread_pools.get(&tid).copied()))
            .collect();
        pools.sync(&mut tables, &[4], &threads);
        assert_eq!(pools.views().len(), 2, "service 4 is live");
        assert!(tables.pools_released.is_empty());
        pools.sync(&mut tables, &[], &threads);
        assert!(pools.views().is_empty());
        assert!(tables.threads.is_empty());
        assert_eq!(tables.pools_released.len(), 2, "both pools of service 4");
        Ok(())
    }

    #[test]
    fn thread_names_lose_trailing_numbers_and_separators() {
        assert_eq!(
            normalize_thread_name("http-nio-8080-exec-12"),
            "http-nio-8080-exec"
        );
        assert_eq!(normalize_thread_name("worker-3"), "worker");
        assert_eq!(normalize_thread_name("pool-1-thread-2"), "pool-1-thread");
        assert_eq!(normalize_thread_name("gunicorn"), "gunicorn");
        assert_eq!(normalize_thread_name("V8Worker"), "V8Worker");
        assert_eq!(normalize_thread_name("tokio-rt-w#7"), "tokio-rt-w");
        assert_eq!(normalize_thread_name("1234"), "1234");
    }

    #[test]
    fn threads_that_kept_the_process_name_are_apart_from_the_main_thread() {
        // Node.js: the loop is the main thread; its helpers inherited "node".
        assert_eq!(pool_name("node", true, Some("node")), "node");
        assert_eq!(pool_name("node", false, Some("node")), "node-threads");
        // Named threads go by their name.
        assert_eq!(pool_name("worker-2", false, Some("threadpool")), "worker");
        // A single-threaded worker process (nginx, gunicorn sync) is its main thread.
        assert_eq!(pool_name("nginx", true, Some("nginx")), "nginx");
        // Process gone: by name only.
        assert_eq!(pool_name("worker-2", false, None), "worker");
    }
}
