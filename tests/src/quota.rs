//! A cgroup with a CPU quota for the tests' servers: half a CPU, on whichever
//! hierarchy has the `cpu` controller.
use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use anyhow::Context as _;

/// A cgroup with a CPU quota, removed when dropped.
pub struct QuotaCgroup {
    dir: PathBuf,
}

impl QuotaCgroup {
    /// Half a CPU, on the hierarchy that has the `cpu` controller: v2 if its root
    /// delegates `cpu`, else v1's `cpu` mount.
    pub fn half_cpu() -> anyhow::Result<Option<Self>> {
        let root = Path::new("/sys/fs/cgroup");
        let name = format!("poolscope-capacity-{}", std::process::id());
        let v2_controllers = std::fs::read_to_string(root.join("cgroup.subtree_control"));
        let dir = if v2_controllers.is_ok_and(|c| c.split_whitespace().any(|c| c == "cpu")) {
            let dir = root.join(&name);
            std::fs::create_dir(&dir)?;
            std::fs::write(dir.join("cpu.max"), "50000 100000")?;
            dir
        } else if root.join("cpu/cpu.cfs_quota_us").exists() {
            let dir = root.join("cpu").join(&name);
            std::fs::create_dir(&dir)?;
            std::fs::write(dir.join("cpu.cfs_period_us"), "100000")?;
            std::fs::write(dir.join("cpu.cfs_quota_us"), "50000")?;
            dir
        } else {
            return Ok(None);
        };
        Ok(Some(Self { dir }))
    }

    pub fn add(&self, pid: u32) -> anyhow::Result<()> {
        std::fs::write(self.dir.join("cgroup.procs"), pid.to_string())
            .with_context(|| format!("moving {pid} into {}", self.dir.display()))
    }
}

impl Drop for QuotaCgroup {
    fn drop(&mut self) {
        // Its processes are gone by now (dropped first); rmdir fails while any is left.
        for _ in 0..50 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}
