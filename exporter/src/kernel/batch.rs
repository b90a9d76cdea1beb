//! Whole-map reads in a few syscalls (`BPF_MAP_LOOKUP_BATCH`, Linux 5.6; poolscope
//! needs 6.1): a scrape reads every thread, pool and service, and aya's per-key
//! lookups cost one syscall per key (two per entry when iterating a hash map), which
//! at 110 services was most of a scrape's time.
use std::{
    cell::RefCell,
    io,
    mem::{MaybeUninit, size_of},
    ops::Range,
    os::fd::{AsFd as _, AsRawFd as _, OwnedFd},
};

use aya::{Ebpf, Pod, maps::Map};

use super::KernelError;

/// `BPF_MAP_LOOKUP_BATCH` of include/uapi/linux/bpf.h.
const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;

/// Entries asked for per call of a hash map: more than any bucket holds (the call
/// fails with ENOSPC if one bucket does not fit).
const HASH_CHUNK: u32 = 1024;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// A map's own descriptor (a duplicate of aya's, which keeps the map itself).
#[derive(Debug)]
pub(super) struct BatchMap {
    fd: OwnedFd,
    /// Values and keys of the last array read, kept for the next; in u64s, so that
    /// values of 8-byte alignment are read in place.
    buffer: RefCell<Vec<u64>>,
}

impl BatchMap {
    /// A descriptor for `map` (a hash map or an array, per-CPU or not).
    fn of(map: &Map) -> io::Result<Self> {
        let data = match map {
            Map::HashMap(data) | Map::Array(data) | Map::PerCpuArray(data) => data,
            _ => return Err(io::Error::from(io::ErrorKind::Unsupported)),
        };
        Ok(Self {
            fd: data.fd().as_fd().try_clone_to_owned()?,
            buffer: RefCell::new(Vec::new()),
        })
    }

    /// A descriptor for the map `name` of `ebpf`, which must still hold it (taken
    /// out, a map is no longer found by name).
    pub fn named(ebpf: &Ebpf, name: &'static str) -> Result<Self, KernelError> {
        let map = ebpf.map(name).ok_or(KernelError::MissingMap(name))?;
        Self::of(map).map_err(|source| KernelError::Batch { map: name, source })
    }

    /// One `BPF_MAP_LOOKUP_BATCH` call; the entries it filled, and whether the map
    /// has no more (ENOENT).
    fn lookup(
        &self,
        in_batch: Option<&u64>,
        out_batch: &mut u64,
        keys: *mut u8,
        values: *mut u8,
        count: u32,
    ) -> io::Result<(u32, bool)> {
        let mut attr = BatchAttr {
            in_batch: in_batch.map_or(0, |token| std::ptr::from_ref(token) as u64),
            out_batch: std::ptr::from_mut(out_batch) as u64,
            keys: keys as u64,
            values: values as u64,
            count,
            map_fd: self.fd.as_raw_fd() as u32,
            ..BatchAttr::default()
        };
        // SAFETY: `attr` is a valid bpf_attr prefix of its own size; the kernel writes
        // at most `count` keys and values into buffers the callers sized for `count`,
        // and a token of at most 8 bytes (a u32 bucket or index) into `out_batch`.
        let result = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                BPF_MAP_LOOKUP_BATCH,
                std::ptr::from_mut(&mut attr),
                size_of::<BatchAttr>(),
            )
        };
        if result == 0 {
            return Ok((attr.count, false));
        }
        let error = io::Error::last_os_error();
        match error.raw_os_error() {
            Some(libc::ENOENT) => Ok((attr.count, true)),
            _ => Err(error),
        }
    }

    /// Every entry of a hash map of `K` → `V`.
    pub fn hash_entries<K: Pod, V: Pod>(&self) -> io::Result<Vec<(K, V)>> {
        let chunk = HASH_CHUNK as usize;
        let mut keys: Vec<MaybeUninit<K>> = Vec::with_capacity(chunk);
        let mut values: Vec<MaybeUninit<V>> = Vec::with_capacity(chunk);
        let mut entries = Vec::new();
        let (mut token, mut next) = (0u64, 0u64);
        let mut first = true;
        loop {
            let (filled, done) = self.lookup(
                (!first).then_some(&token),
                &mut next,
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                HASH_CHUNK,
            )?;
            let filled = (filled as usize).min(chunk);
            // SAFETY: the kernel wrote `filled` whole keys and values, and K and V are
            // Pod: any bytes are a valid value.
            entries.extend((0..filled).map(|i| unsafe {
                (
                    keys.as_ptr().add(i).read().assume_init(),
                    values.as_ptr().add(i).read().assume_init(),
                )
            }));
            if done {
                return Ok(entries);
            }
            token = next;
            first = false;
        }
    }

    /// Calls `each(index, value)` for every value of the entries `range` of an array
    /// of `V`: `cpus` per entry for a per-CPU array, one for a plain one. The values
    /// are read into one buffer kept between calls (a scrape reads megabytes), and
    /// lent from it in place.
    pub fn array_each<V: Pod>(
        &self,
        range: Range<u32>,
        cpus: usize,
        mut each: impl FnMut(usize, &V),
    ) -> io::Result<()> {
        const WORD: usize = size_of::<u64>();
        let count = range.len();
        if count == 0 {
            return Ok(());
        }
        // The kernel copies per-CPU values at a stride of their size rounded up to 8.
        let stride = if cpus > 1 {
            size_of::<V>().next_multiple_of(WORD)
        } else {
            size_of::<V>()
        };
        let per_entry = stride * cpus;
        let mut buffer = self.buffer.borrow_mut();
        let values = (per_entry * count).next_multiple_of(WORD);
        let keys = count * size_of::<u32>();
        buffer.resize((values + keys).div_ceil(WORD), 0);
        let bytes: &mut [u8] = bytemuck_bytes(&mut buffer);
        let (value_bytes, key_bytes) = bytes.split_at_mut(values);
        // The kernel starts after the key given (an array's is its index), or at 0.
        let before = range.start.checked_sub(1).map(u64::from);
        let mut next = 0u64;
        let (filled, _) = self.lookup(
            before.as_ref(),
            &mut next,
            key_bytes.as_mut_ptr(),
            value_bytes.as_mut_ptr(),
            count as u32,
        )?;
        if filled as usize != count {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "{filled} of {count} array entries from {} read",
                    range.start
                ),
            ));
        }
        let value_bytes = &value_bytes[..per_entry * count];
        for (offset, entry) in value_bytes.chunks_exact(per_entry).enumerate() {
            let index = range.start as usize + offset;
            for value in entry.chunks_exact(stride) {
                let at = value.as_ptr().cast::<V>();
                if at.is_aligned() {
                    // SAFETY: the chunk holds one whole V (stride ≥ its size) at an
                    // address aligned for V, and V is Pod: any bytes are a valid V.
                    each(index, unsafe { &*at });
                } else {
                    // SAFETY: as above; read_unaligned needs no alignment.
                    each(index, &unsafe { at.read_unaligned() });
                }
            }
        }
        Ok(())
    }

    /// [`Self::array_each`] over the entries `ids` only: one read per run of
    /// consecutive ids, so that ids left out cost nothing.
    pub fn array_each_of<V: Pod>(
        &self,
        ids: &[u32],
        cpus: usize,
        mut each: impl FnMut(usize, &V),
    ) -> io::Result<()> {
        for run in runs(ids) {
            self.array_each(run, cpus, &mut each)?;
        }
        Ok(())
    }

    /// The entries `ids` of an array of `V` indexed by dense id, each summed over its
    /// `cpus` values with `add`, in id order: the values come by id, each id's CPUs
    /// together, so each sum is made in place at the end of the list.
    pub fn sum_by_id<V: Pod + Default>(
        &self,
        ids: &[u32],
        cpus: usize,
        add: impl Fn(&mut V, &V),
    ) -> io::Result<Vec<(u32, V)>> {
        let mut sums: Vec<(u32, V)> = Vec::with_capacity(ids.len());
        self.array_each_of::<V>(ids, cpus, |index, value| {
            let id = index as u32;
            if sums.last().is_none_or(|(last, _)| *last != id) {
                sums.push((id, V::default()));
            }
            if let Some((_, sum)) = sums.last_mut() {
                add(sum, value);
            }
        })?;
        Ok(sums)
    }
}

/// `ids` as runs of consecutive ids, in order (duplicates once).
fn runs(ids: &[u32]) -> Vec<Range<u32>> {
    let mut sorted = ids.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut runs: Vec<Range<u32>> = Vec::new();
    for id in sorted {
        match runs.last_mut() {
            Some(run) if run.end == id => run.end = id + 1,
            _ => runs.push(id..id + 1),
        }
    }
    runs
}

/// The bytes of `words`.
fn bytemuck_bytes(words: &mut [u64]) -> &mut [u8] {
    // SAFETY: any u64 is 8 initialized bytes, u8 has no alignment, and the slice
    // borrows `words` mutably for as long as it lives.
    unsafe { std::slice::from_raw_parts_mut(words.as_mut_ptr().cast(), size_of_val(words)) }
}

#[cfg(test)]
mod tests {
    use super::runs;

    #[test]
    fn ids_group_into_runs_of_consecutive_ids() {
        assert_eq!(runs(&[]), vec![]);
        assert_eq!(runs(&[7]), vec![7..8]);
        assert_eq!(runs(&[3, 1, 2, 2, 9, 10, 0]), vec![0..4, 9..11]);
        assert_eq!(runs(&[5, 7, 9]), vec![5..6, 7..8, 9..10]);
    }
}
