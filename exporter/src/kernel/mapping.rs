//! BPF arrays created `BPF_F_MMAPABLE`, mapped into user space ([`Mapping`]): what a
//! scrape reads whole and often (the thread array, the lock-wait counters, the busy
//! services' request times) is read there without a system call per entry.
use std::{
    io,
    marker::PhantomData,
    os::fd::{AsFd as _, AsRawFd as _},
    ptr::NonNull,
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
};

use aya::{Ebpf, Pod, maps::Map};

use super::KernelError;

/// A shared, writable mapping of a BPF array's values.
#[derive(Debug)]
pub(super) struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain shared memory; every access goes through atomics or
// volatile copies, whichever thread makes it.
unsafe impl Send for Mapping {}

impl Mapping {
    /// Maps the values of the array `name` of `ebpf`: `entries` of `value_size` bytes.
    pub fn of(
        ebpf: &Ebpf,
        name: &'static str,
        entries: u32,
        value_size: usize,
    ) -> Result<Self, KernelError> {
        Self::map(ebpf, name, entries as usize * value_size)
            .map_err(|source| KernelError::Mmap { map: name, source })
    }

    fn map(ebpf: &Ebpf, name: &'static str, len: usize) -> io::Result<Self> {
        let Some(Map::Array(data)) = ebpf.map(name) else {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("no array {name}"),
            ));
        };
        // SAFETY: a new shared mapping of the map's fd (created BPF_F_MMAPABLE),
        // no larger than its values; nothing else is at the address the kernel picks.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                data.fd().as_fd().as_raw_fd(),
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base = NonNull::new(base.cast::<u8>()).ok_or_else(io::Error::last_os_error)?;
        Ok(Self { base, len })
    }

    /// The first value.
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }

    /// The `index`th value of an array of u64s, which the kernel and user space only
    /// ever access atomically.
    ///
    /// # Safety
    /// `index` is below the array's size.
    pub unsafe fn word(&self, index: usize) -> &AtomicU64 {
        debug_assert!((index + 1) * size_of::<u64>() <= self.len);
        // SAFETY: in the mapping (the caller's promise), 8-byte aligned in a
        // page-aligned mapping of u64s.
        unsafe { AtomicU64::from_ptr(self.base().cast::<u64>().add(index)) }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: our own mapping, unmapped once; nothing borrows it past `self`.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.len) };
    }
}

/// A mapped array of u64 counters that the kernel adds to atomically.
#[derive(Debug)]
pub(super) struct Counters(Mapping);

impl Counters {
    /// Maps the array `name` of `ebpf`, of `entries` counters.
    pub fn of(ebpf: &Ebpf, name: &'static str, entries: u32) -> Result<Self, KernelError> {
        Ok(Self(Mapping::of(ebpf, name, entries, size_of::<u64>())?))
    }

    /// Counter `index`, 0 past the end.
    pub fn get(&self, index: u32) -> u64 {
        self.word(index)
            .map_or(0, |word| word.load(Ordering::Acquire))
    }

    /// Sets counter `index` to 0 (its entry gets a new owner).
    pub fn reset(&self, index: u32) {
        if let Some(word) = self.word(index) {
            word.store(0, Ordering::Release);
        }
    }

    fn word(&self, index: u32) -> Option<&AtomicU64> {
        let index = index as usize;
        // SAFETY: below the array's size (its mapping's), checked.
        (index < self.0.len / size_of::<u64>()).then(|| unsafe { self.0.word(index) })
    }
}

/// A mapped array of values made only of u64 words, which the kernel adds to
/// atomically from any CPU (histograms shared by all CPUs).
#[derive(Debug)]
pub(super) struct SharedValues<V> {
    mapping: Mapping,
    entries: usize,
    value: PhantomData<V>,
}

impl<V: Pod> SharedValues<V> {
    /// Words per value.
    const WORDS: usize = size_of::<V>() / size_of::<u64>();

    /// Maps the array `name` of `ebpf`, of `entries` values.
    pub fn of(ebpf: &Ebpf, name: &'static str, entries: u32) -> Result<Self, KernelError> {
        // The kernel lays array values out at their size rounded up to 8: a value of
        // whole words sits at `index * size_of::<V>()`, word-aligned.
        if !size_of::<V>().is_multiple_of(size_of::<u64>()) || align_of::<V>() < align_of::<u64>() {
            return Err(KernelError::Mmap {
                map: name,
                source: io::Error::new(io::ErrorKind::InvalidInput, "values not of u64 words"),
            });
        }
        Ok(Self {
            mapping: Mapping::of(ebpf, name, entries, size_of::<V>())?,
            entries: entries as usize,
            value: PhantomData,
        })
    }

    /// A copy of value `index` (`None` past the end), each word loaded atomically. A
    /// copy made while the kernel adds may hold part of a record; its count, which
    /// the kernel moves after the record, brings a later read.
    pub fn get(&self, index: u32) -> Option<Arc<V>> {
        let words = self.words(index)?;
        let mut value = Arc::<V>::new_uninit();
        let into = Arc::get_mut(&mut value)?.as_mut_ptr().cast::<u64>();
        for (offset, word) in words.iter().enumerate() {
            // SAFETY: `into` is a fresh V of `WORDS` words, written only here.
            unsafe { into.add(offset).write(word.load(Ordering::Relaxed)) };
        }
        // SAFETY: every word of V written above, and V is Pod: any bytes are a V.
        Some(unsafe { value.assume_init() })
    }

    /// Sets value `index` to zeros (its entry gets a new owner).
    pub fn reset(&self, index: u32) {
        for word in self.words(index).unwrap_or_default() {
            word.store(0, Ordering::Relaxed);
        }
    }

    fn words(&self, index: u32) -> Option<&[AtomicU64]> {
        let index = index as usize;
        (index < self.entries).then(|| {
            // SAFETY: value `index` is inside the mapping (checked), word-aligned
            // (checked in `of`), and the kernel and user space access its words
            // only atomically.
            unsafe {
                let first = self.mapping.base().add(index * size_of::<V>());
                std::slice::from_raw_parts(first.cast::<AtomicU64>(), Self::WORDS)
            }
        })
    }
}
