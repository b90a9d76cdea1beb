//! Buffers a scrape fills and then frees, kept for the next scrape: the families'
//! sample and label buffers, the rendered exposition and the gzip compressor's state. At 110 services these are
//! ~2 MB a scrape, most in buffers above the heap's 128 KiB mmap threshold
//! (`stacks/heap.rs`), so each was a mapping of its own, faulted in page by page and
//! unmapped after: 345 page faults a scrape (`perf record -e page-faults`), with the
//! unmaps' TLB flushes about 17 % of poolscope's CPU while scraped back to back.
//! A kept buffer's pages stay mapped; the next scrape writes over them.
//!
//! A family's buffers are kept under its name, for the family of that name in the
//! next scrape: each is then as large as that family needs, and what is kept is
//! about one scrape's worth. (Handed out in any order instead, every buffer grew to
//! the largest family's size over a few scrapes.) Bounded: at most
//! [`KEPT_FAMILIES`] names and [`KEPT_BODIES`] bodies, each as large as the largest
//! it held, which the series cap (`limits.max_series`) bounds.
use std::{
    collections::HashMap,
    io,
    sync::{LazyLock, Mutex, PoisonError},
};

use flate2::{Compress, Compression, Crc, FlushCompress, Status};

use super::Sample;

/// Family names whose buffers are kept: more than a scrape makes (~50 families).
const KEPT_FAMILIES: usize = 256;
/// Rendered bodies kept: one per scrape in flight (`web.max_concurrent_scrapes`,
/// default 4); a body is given back once it is sent.
const KEPT_BODIES: usize = 8;
/// Compressors kept (one per scrape in flight, as bodies): each holds ~300 KB of
/// deflate state, which a fresh one maps and faults in.
const KEPT_COMPRESSORS: usize = KEPT_BODIES;

/// gzip's header (RFC 1952) for a member with no name, time or extra fields: deflate,
/// "fastest" compression, unknown OS.
const GZIP_HEADER: [u8; 10] = [0x1f, 0x8b, 8, 0, 0, 0, 0, 0, 4, 255];

/// The growing buffers of one family (see `Family`), emptied.
#[derive(Debug, Default)]
pub(super) struct FamilyBuffers {
    pub samples: Vec<Sample>,
    pub label_names: Vec<(&'static str, usize)>,
    pub label_values: String,
}

/// Kept values of one kind, at most `max`.
struct Kept<T> {
    values: Mutex<Vec<T>>,
    max: usize,
}

impl<T> Kept<T> {
    const fn new(max: usize) -> Self {
        Self {
            values: Mutex::new(Vec::new()),
            max,
        }
    }

    fn take(&self) -> Option<T> {
        // A panic elsewhere while holding the lock leaves a valid list of buffers.
        self.values
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    fn give(&self, value: T) {
        let mut values = self.values.lock().unwrap_or_else(PoisonError::into_inner);
        if values.len() < self.max {
            values.push(value);
        }
    }
}

/// The buffers each family name last used.
static FAMILIES: LazyLock<Mutex<HashMap<&'static str, FamilyBuffers>>> =
    LazyLock::new(Mutex::default);
static BODIES: Kept<Vec<u8>> = Kept::new(KEPT_BODIES);
static COMPRESSORS: Kept<Compress> = Kept::new(KEPT_COMPRESSORS);

/// Empty buffers for the family `name`: the ones it last used, if kept.
pub(super) fn family_buffers(name: &'static str) -> FamilyBuffers {
    let mut kept = FAMILIES.lock().unwrap_or_else(PoisonError::into_inner);
    kept.remove(name).unwrap_or_default()
}

/// Keeps the buffers of the family `name` for its next scrape.
pub(super) fn give_family_buffers(name: &'static str, mut buffers: FamilyBuffers) {
    buffers.samples.clear();
    buffers.label_names.clear();
    buffers.label_values.clear();
    let mut kept = FAMILIES.lock().unwrap_or_else(PoisonError::into_inner);
    if kept.len() < KEPT_FAMILIES || kept.contains_key(name) {
        kept.insert(name, buffers);
    }
}

/// A rendered exposition: its buffer goes back to be written over by a later scrape
/// when it is dropped (sent, or abandoned).
#[derive(Debug)]
pub struct Body(Vec<u8>);

impl Body {
    /// An empty body, in a kept buffer if any.
    pub(super) fn new() -> Self {
        Self(BODIES.take().unwrap_or_default())
    }

    pub(super) fn buffer(&mut self) -> &mut Vec<u8> {
        &mut self.0
    }

    /// The body as bytes for an HTTP response; the buffer is given back when the
    /// response is done with them.
    pub fn into_bytes(self) -> bytes::Bytes {
        bytes::Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for Body {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Body {
    fn drop(&mut self) {
        let mut buffer = std::mem::take(&mut self.0);
        buffer.clear();
        BODIES.give(buffer);
    }
}

/// `body` gzip-compressed at the fastest level (text exposition compresses ~15× even
/// so, and a scrape should not wait on the compressor), with a kept compressor.
pub fn gzip(body: &[u8]) -> io::Result<Vec<u8>> {
    let mut compress = COMPRESSORS
        .take()
        .unwrap_or_else(|| Compress::new(Compression::fast(), false));
    compress.reset();
    let mut out = Vec::with_capacity(GZIP_HEADER.len() + body.len() / 8 + 8);
    out.extend_from_slice(&GZIP_HEADER);
    loop {
        let consumed = usize::try_from(compress.total_in()).unwrap_or(usize::MAX);
        let rest = body.get(consumed..).unwrap_or_default();
        // Writes into `out`'s spare capacity only: more is made below when needed.
        let status = compress
            .compress_vec(rest, &mut out, FlushCompress::Finish)
            .map_err(io::Error::other)?;
        if status == Status::StreamEnd {
            break;
        }
        out.reserve(out.capacity().max(4096));
    }
    let mut crc = Crc::new();
    crc.update(body);
    out.extend_from_slice(&crc.sum().to_le_bytes());
    // ISIZE: the input's length modulo 2^32.
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    COMPRESSORS.give(compress);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_buffers_are_handed_out_again_up_to_the_bound() {
        let kept: Kept<Vec<u8>> = Kept::new(2);
        let buffers: Vec<Vec<u8>> = (0..3).map(|_| Vec::with_capacity(100_000)).collect();
        let addresses: Vec<*const u8> = buffers.iter().map(|buffer| buffer.as_ptr()).collect();
        for buffer in buffers {
            kept.give(buffer);
        }
        // The third was over the bound and freed; the two kept come back last first.
        let again: Vec<*const u8> = std::iter::from_fn(|| kept.take())
            .map(|buffer| buffer.as_ptr())
            .collect();
        assert_eq!(again, vec![addresses[1], addresses[0]]);
    }

    #[test]
    fn gzip_round_trips_with_a_kept_compressor() -> io::Result<()> {
        use std::io::Read as _;
        let text: Vec<u8> = (0..20_000)
            .flat_map(|i| {
                format!("poolscope_requests_total{{service=\"s{i}\"}} {i}\n").into_bytes()
            })
            .collect();
        // The later ones compress with the first's compressor, reset.
        for body in [&text[..], &text[..1000], &[][..]] {
            let mut read = Vec::new();
            flate2::read::GzDecoder::new(&gzip(body)?[..]).read_to_end(&mut read)?;
            assert_eq!(read, body);
        }
        Ok(())
    }

    #[test]
    fn a_family_gets_the_buffers_its_name_last_used_emptied() {
        // A name no other test uses (they run at once, sharing the kept buffers).
        const NAME: &str = "spare_test_family";
        let mut buffers = family_buffers(NAME);
        buffers.label_names.push(("service", 3));
        buffers.label_values.push_str("api");
        buffers.label_values.reserve(100_000);
        let address = buffers.label_values.as_ptr();
        give_family_buffers(NAME, buffers);
        assert_eq!(
            family_buffers("spare_test_other").label_values.capacity(),
            0
        );
        let buffers = family_buffers(NAME);
        assert_eq!(buffers.label_values.as_ptr(), address);
        assert!(buffers.samples.is_empty() && buffers.label_names.is_empty());
        assert!(buffers.label_values.is_empty());
    }
}
