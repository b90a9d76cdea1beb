//! The truth about a running poolscope's kernel maps, read apart from poolscope:
//! its map ids from `/proc/<pid>/fdinfo`, each map's name from the kernel
//! (`BPF_OBJ_GET_INFO_BY_FD`), a hash map's entries by walking its keys
//! (`BPF_MAP_GET_NEXT_KEY`) and an array's values by looking each up
//! (`BPF_MAP_LOOKUP_ELEM`), with raw `bpf(2)` calls and none of poolscope's code.
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use anyhow::{Context as _, bail};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;

/// The leading fields of `struct bpf_map_info` (include/uapi/linux/bpf.h).
#[repr(C)]
#[derive(Default)]
struct MapInfo {
    map_type: u32,
    id: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    name: [u8; 16],
}

/// `bpf(cmd, attr)`: its result, or the errno as an error.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a valid, initialized `union bpf_attr` member of its size.
    let result = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            std::ptr::from_mut(attr),
            std::mem::size_of::<T>(),
        )
    };
    if result < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(result)
    }
}

/// The kernel's description of map `fd`.
fn map_info(fd: &OwnedFd, info: &mut MapInfo) -> anyhow::Result<()> {
    #[repr(C)]
    struct InfoAttr {
        fd: u32,
        len: u32,
        info: u64,
    }
    let mut attr = InfoAttr {
        fd: fd.as_raw_fd() as u32,
        len: std::mem::size_of::<MapInfo>() as u32,
        info: std::ptr::from_mut(info) as u64,
    };
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).context("BPF_OBJ_GET_INFO_BY_FD")?;
    Ok(())
}

/// The map `name` of process `pid` (an fd of its own) and its key size.
fn open_map(pid: u32, name: &str) -> anyhow::Result<(OwnedFd, usize)> {
    let fdinfo = format!("/proc/{pid}/fdinfo");
    for entry in std::fs::read_dir(&fdinfo).with_context(|| fdinfo.clone())? {
        let Ok(text) = std::fs::read_to_string(entry?.path()) else {
            continue;
        };
        let Some(id) = text
            .lines()
            .find_map(|line| line.strip_prefix("map_id:"))
            .and_then(|id| id.trim().parse::<u32>().ok())
        else {
            continue;
        };
        let mut by_id = [id, 0, 0];
        let raw = bpf(BPF_MAP_GET_FD_BY_ID, &mut by_id).context("BPF_MAP_GET_FD_BY_ID")?;
        // SAFETY: the call returned a new descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw as i32) };
        let mut info = MapInfo::default();
        map_info(&fd, &mut info)?;
        let length = info.name.iter().position(|&b| b == 0).unwrap_or(16);
        // The kernel keeps 15 bytes of a name.
        if info.name[..length] == name.as_bytes()[..name.len().min(15)] {
            return Ok((fd, info.key_size as usize));
        }
    }
    bail!("process {pid} holds no map named {name}")
}

/// The entries of poolscope's (process `pid`'s) hash map `name`, walked key by key.
pub fn walked_entries(pid: u32, name: &str) -> anyhow::Result<usize> {
    Ok(walked_keys(pid, name)?.len())
}

/// The keys of poolscope's (process `pid`'s) hash map `name`, walked one by one.
pub fn walked_keys(pid: u32, name: &str) -> anyhow::Result<Vec<Vec<u8>>> {
    let (fd, key_size) = open_map(pid, name)?;
    #[repr(C)]
    struct NextKeyAttr {
        fd: u32,
        _pad: u32,
        key: u64,
        next_key: u64,
    }
    let mut key = vec![0u8; key_size];
    let mut next = vec![0u8; key_size];
    let mut keys = Vec::new();
    let mut first = true;
    loop {
        let mut attr = NextKeyAttr {
            fd: fd.as_raw_fd() as u32,
            _pad: 0,
            // NULL: the first key.
            key: if first { 0 } else { key.as_ptr() as u64 },
            next_key: next.as_mut_ptr() as u64,
        };
        match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
            Ok(_) => {
                keys.push(next.clone());
                first = false;
                key.copy_from_slice(&next);
            }
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => return Ok(keys),
            Err(error) => return Err(error).context(format!("BPF_MAP_GET_NEXT_KEY of {name}")),
        }
    }
}

/// Every value of poolscope's (process `pid`'s) array map `name` of u64 values,
/// looked up index by index.
pub fn array_u64(pid: u32, name: &str) -> anyhow::Result<Vec<u64>> {
    let (fd, _) = open_map(pid, name)?;
    let mut info = MapInfo::default();
    map_info(&fd, &mut info)?;
    if info.value_size != 8 {
        bail!("{name} holds values of {} bytes, not u64", info.value_size);
    }
    #[repr(C)]
    struct LookupAttr {
        fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    (0..info.max_entries)
        .map(|index| {
            let mut value = 0u64;
            let mut attr = LookupAttr {
                fd: fd.as_raw_fd() as u32,
                _pad: 0,
                key: std::ptr::from_ref(&index) as u64,
                value: std::ptr::from_mut(&mut value) as u64,
                flags: 0,
            };
            bpf(BPF_MAP_LOOKUP_ELEM, &mut attr)
                .with_context(|| format!("BPF_MAP_LOOKUP_ELEM of {name}[{index}]"))?;
            Ok(value)
        })
        .collect()
}

/// Adds `delta` to the u64 at byte `offset` of entry `index` of poolscope's (process
/// `pid`'s) per-CPU array `name`, in the first CPU's copy: an update poolscope's
/// programs did not make, as a lost one leaves the counts. Racy with the programs
/// by design; call it while nothing else changes that entry.
pub fn add_to_per_cpu(
    pid: u32,
    name: &str,
    index: u32,
    offset: usize,
    delta: i64,
) -> anyhow::Result<()> {
    let (fd, _) = open_map(pid, name)?;
    let mut info = MapInfo::default();
    map_info(&fd, &mut info)?;
    let stride = (info.value_size as usize).next_multiple_of(8);
    let cpus =
        std::fs::read_to_string("/sys/devices/system/cpu/possible").context("possible CPUs")?;
    let possible = cpus
        .trim()
        .rsplit(['-', ','])
        .next()
        .and_then(|last| last.parse::<usize>().ok())
        .context("parsing /sys/devices/system/cpu/possible")?
        + 1;
    anyhow::ensure!(
        offset + 8 <= stride,
        "offset {offset} past a value of {stride} bytes"
    );
    let mut values = vec![0u8; stride * possible];
    #[repr(C)]
    struct ElemAttr {
        fd: u32,
        _pad: u32,
        key: u64,
        value: u64,
        flags: u64,
    }
    let mut attr = ElemAttr {
        fd: fd.as_raw_fd() as u32,
        _pad: 0,
        key: std::ptr::from_ref(&index) as u64,
        value: values.as_mut_ptr() as u64,
        flags: 0,
    };
    bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).with_context(|| format!("lookup of {name}[{index}]"))?;
    let field = &mut values[offset..offset + 8];
    let old = u64::from_ne_bytes(field.try_into()?);
    field.copy_from_slice(&old.wrapping_add_signed(delta).to_ne_bytes());
    attr.value = values.as_mut_ptr() as u64;
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).with_context(|| format!("update of {name}[{index}]"))?;
    Ok(())
}
