//! Booting the guest under qemu: KVM where a guest boots under it, software emulation
//! otherwise; each boot with a fresh work directory, stopped at its timeout or when
//! the guest's kernel reports a fault of the emulation.
use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::Path,
    process::{Command, Stdio},
    thread::sleep,
    time::{Duration, Instant},
};

use anyhow::Context as _;

use super::image::{Boot, Guest};

const GUEST_MEMORY_MIB: u32 = 2048;
/// What the guest's kernel prints when software emulation, not poolscope, breaks it:
/// a CPU stuck because its timers stalled ("rcu ... timer wakeup didn't happen"), and
/// the int3 that live code patching leaves in a static branch (flipped as probes
/// attach and detach) executed by another emulated CPU before the patch completed
/// (`Oops: int3` in `__schedule`).
const EMULATION_FAULTS: [&str; 2] = ["watchdog: BUG: soft lockup", "Oops: int3"];
/// The start of the reason [`boot`] gives for a guest stopped by one of them.
pub(super) const EMULATION_FAULT: &str = "was stopped: its kernel reported";
/// How long a guest under KVM may take to boot and power off before KVM is taken as
/// not working here (nested virtualization often hangs rather than fails).
const KVM_PROBE_TIMEOUT: Duration = Duration::from_secs(40);

/// KVM where a guest boots under it; software emulation otherwise.
pub(super) fn accelerator(
    guest: &Guest,
    boot_files: &Boot,
    root: &Path,
    work: &Path,
) -> anyhow::Result<&'static str> {
    let kvm = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm");
    if let Err(error) = kvm {
        eprintln!("xtask: no usable /dev/kvm ({error}): software emulation");
        return Ok("tcg");
    }
    prepare_work(work, &format!("echo {BOOTED}\n{POWER_OFF}"))?;
    let release = root.join("target/release");
    let booted = boot(guest, boot_files, "kvm", &release, work, KVM_PROBE_TIMEOUT)?.is_none()
        && fs::read_to_string(work.join("serial.log")).is_ok_and(|s| s.contains(BOOTED));
    if booted {
        return Ok("kvm");
    }
    eprintln!(
        "xtask: /dev/kvm is there but a guest did not boot under it within {} s \
         (nested virtualization?): software emulation",
        KVM_PROBE_TIMEOUT.as_secs()
    );
    Ok("tcg")
}

/// Printed by the guest script once it runs.
pub(super) const BOOTED: &str = "poolscope-vm: booted";
/// Powers the guest off; the sleep keeps init alive until it is off (an init that
/// exits panics the kernel).
pub(super) const POWER_OFF: &str = "echo o > /proc/sysrq-trigger\nsleep 60\n";

/// A fresh work directory holding `script` as `run`.
pub(super) fn prepare_work(work: &Path, script: &str) -> anyhow::Result<()> {
    let _ = fs::remove_dir_all(work);
    fs::create_dir_all(work.join("tests"))
        .with_context(|| format!("creating {}", work.display()))?;
    let run = work.join("run");
    fs::write(&run, format!("#!/bin/sh\n{script}"))
        .with_context(|| format!("writing {}", run.display()))?;
    fs::set_permissions(&run, fs::Permissions::from_mode(0o755))?;
    Ok(())
}

/// Boots the guest until it powers off; `Some(reason)` if it had to be stopped.
pub(super) fn boot(
    guest: &Guest,
    boot_files: &Boot,
    accel: &str,
    release: &Path,
    work: &Path,
    timeout: Duration,
) -> anyhow::Result<Option<String>> {
    // Under software emulation, one host thread runs both vCPUs in turn
    // (`thread=single`): with a thread per vCPU, a vCPU can still execute the int3 that
    // live patching of a static branch leaves for a moment after the kernel's own sync
    // with every CPU (`Oops: int3` in `__schedule` on 6.12, three boots in a row in one
    // CI run); taking turns, no vCPU runs code another one is patching.
    let (cpu, accel) = if accel == "kvm" {
        ("host", "kvm")
    } else {
        ("max", "tcg,thread=single")
    };
    let share = |path: &Path, tag: &str, extra: &str| {
        format!(
            "local,path={},mount_tag={tag},security_model=none{extra}",
            path.display()
        )
    };
    let mut child = Command::new("qemu-system-x86_64")
        .args(["-machine", "q35", "-accel", accel])
        .args([
            "-cpu",
            cpu,
            "-smp",
            "2",
            "-m",
            &GUEST_MEMORY_MIB.to_string(),
        ])
        .args(["-display", "none", "-no-reboot"])
        .arg("-serial")
        .arg(format!("file:{}", work.join("serial.log").display()))
        .arg("-kernel")
        .arg(&boot_files.kernel)
        .arg("-initrd")
        .arg(&boot_files.initrd)
        .args([
            "-append",
            "root=/dev/vda rw console=ttyS0 init=/sbin/poolscope-vm-init panic=-1 quiet",
        ])
        .arg("-drive")
        .arg(format!(
            "file={},format=raw,if=virtio,snapshot=on",
            guest.image.display()
        ))
        .args(["-virtfs", &share(release, "release", ",readonly=on")])
        .args(["-virtfs", &share(work, "work", "")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(fs::File::create(work.join("qemu.log"))?)
        .spawn()
        .context("starting qemu-system-x86_64")?;
    let deadline = Instant::now() + timeout;
    let fault = || {
        let serial = fs::read_to_string(work.join("serial.log")).unwrap_or_default();
        emulation_fault(&serial).map(|fault| format!("{EMULATION_FAULT} `{fault}` (serial.log)"))
    };
    loop {
        if let Some(status) = child.try_wait()? {
            // A panicked guest powers off (panic=-1, -no-reboot): say why.
            return Ok(fault()
                .or_else(|| (!status.success()).then(|| format!("qemu exited with {status}"))));
        }
        let fault = fault();
        if fault.is_some() || Instant::now() >= deadline {
            let _ = child.kill();
            let _ = child.wait();
            return Ok(Some(fault.unwrap_or_else(|| {
                format!("was stopped after {} s", timeout.as_secs())
            })));
        }
        sleep(Duration::from_millis(200));
    }
}

/// The first of [`EMULATION_FAULTS`] the guest's kernel log holds.
fn emulation_fault(serial: &str) -> Option<&'static str> {
    EMULATION_FAULTS
        .into_iter()
        .find(|fault| serial.contains(fault))
}

#[cfg(test)]
mod tests {
    use super::emulation_fault;

    #[test]
    fn emulation_faults_are_told_from_the_guest_kernels_log() {
        let lockup =
            "[  148.6] watchdog: BUG: soft lockup - CPU#0 stuck for 45s! [tokio-rt-worker:385]";
        assert_eq!(emulation_fault(lockup), Some("watchdog: BUG: soft lockup"));
        let int3 = "[   78.5] Oops: int3: 0000 [#1] PREEMPT SMP NOPTI\n[   78.5] RIP: 0010:__schedule+0x34e/0xc00";
        assert_eq!(emulation_fault(int3), Some("Oops: int3"));
        assert_eq!(
            emulation_fault("poolscope-vm: booted 6.1.0-50-amd64\n"),
            None
        );
        // Another Oops (a general protection fault, a NULL dereference) is no
        // emulation fault: the run fails with it.
        assert_eq!(
            emulation_fault("Oops: general protection fault, probably for non-canonical address"),
            None
        );
    }
}
