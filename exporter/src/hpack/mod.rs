//! HPACK (RFC 7541) decoding, for the header blocks of the HTTP/2 connections whose
//! routes are read (`kernel/h2_headers.rs`): one [`Decoder`] per connection and
//! direction keeps that direction's dynamic table; Huffman strings decode 4 bits a
//! step through a table built once from the code. Pure functions over bytes that the kernel copied from a peer:
//! every malformed input is an [`HpackError`], never a panic, and no input makes it
//! keep more than its table's allowed size.
use std::{collections::VecDeque, sync::LazyLock};

use self::tables::{HUFFMAN_CODES, STATIC_TABLE};

mod tables;

/// RFC 7541 §4.1: an entry's size is its name's and value's lengths plus 32.
const ENTRY_OVERHEAD: usize = 32;
/// RFC 9113's initial `SETTINGS_HEADER_TABLE_SIZE`.
pub const DEFAULT_TABLE_BYTES: usize = 4096;

/// What makes a header block undecodable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum HpackError {
    #[error("the block ends inside a field")]
    Truncated,
    #[error("an integer past 2^32")]
    IntegerOverflow,
    #[error("index {0} is in neither table")]
    BadIndex(usize),
    #[error("a Huffman string with EOS, or padded past 7 bits or not with ones")]
    BadHuffman,
    #[error("a table size update to {0} bytes, past the {1} allowed")]
    TableTooLarge(usize, usize),
}

/// One direction's decoding state: its dynamic table.
#[derive(Debug)]
pub struct Decoder {
    /// Newest first: index 62 is the front.
    entries: VecDeque<(Vec<u8>, Vec<u8>)>,
    size: usize,
    /// The size the encoder set (a table size update), and the most it may set.
    max: usize,
    allowed: usize,
}

impl Decoder {
    /// A decoder whose peer may grow its table to `allowed` bytes.
    pub fn new(allowed: usize) -> Self {
        Self {
            entries: VecDeque::new(),
            size: 0,
            max: DEFAULT_TABLE_BYTES.min(allowed),
            allowed,
        }
    }

    /// Decodes `block`, calling `field` with each field's name and value in order,
    /// for the fields whose name `wanted` says (the table takes every field: a value
    /// that does not enter it and whose name is not wanted is skipped undecoded).
    pub fn decode(
        &mut self,
        block: &[u8],
        wanted: impl Fn(&[u8]) -> bool,
        mut field: impl FnMut(&[u8], &[u8]),
    ) -> Result<(), HpackError> {
        let mut input = Input { bytes: block };
        while let Some(&first) = input.bytes.first() {
            if first & 0x80 != 0 {
                let index = input.integer(7)?;
                let (name, value) = self.entry(index)?;
                if wanted(name) {
                    field(name, value);
                }
            } else if first & 0x40 != 0 {
                let name = self.name(&mut input, 6)?;
                let value = input.string()?;
                if wanted(&name) {
                    field(&name, &value);
                }
                self.insert(name, value);
            } else if first & 0x20 != 0 {
                let max = input.integer(5)?;
                if max > self.allowed {
                    return Err(HpackError::TableTooLarge(max, self.allowed));
                }
                self.max = max;
                self.evict(0);
            } else {
                // Without indexing (0000) or never indexed (0001): both 4-bit.
                let name = self.name(&mut input, 4)?;
                if wanted(&name) {
                    field(&name, &input.string()?);
                } else {
                    input.skip_string()?;
                }
            }
        }
        Ok(())
    }

    /// Entry `index` of the static table, then the dynamic one.
    fn entry(&self, index: usize) -> Result<(&[u8], &[u8]), HpackError> {
        if let Some(&(name, value)) = index.checked_sub(1).and_then(|at| STATIC_TABLE.get(at)) {
            return Ok((name, value));
        }
        index
            .checked_sub(STATIC_TABLE.len() + 1)
            .and_then(|at| self.entries.get(at))
            .map(|(name, value)| (name.as_slice(), value.as_slice()))
            .ok_or(HpackError::BadIndex(index))
    }

    /// The name of a literal field whose name index has a `prefix`-bit prefix.
    fn name(&self, input: &mut Input<'_>, prefix: u8) -> Result<Vec<u8>, HpackError> {
        let index = input.integer(prefix)?;
        if index == 0 {
            input.string()
        } else {
            Ok(self.entry(index)?.0.to_vec())
        }
    }

    /// Adds an entry at the front, evicting the oldest to make room; one larger than
    /// the table empties it (RFC 7541 §4.4).
    fn insert(&mut self, name: Vec<u8>, value: Vec<u8>) {
        let size = name.len() + value.len() + ENTRY_OVERHEAD;
        if size > self.max {
            self.entries.clear();
            self.size = 0;
            return;
        }
        self.evict(size);
        self.size += size;
        self.entries.push_front((name, value));
    }

    /// Evicts the oldest entries until `room` more bytes fit.
    fn evict(&mut self, room: usize) {
        while self.size + room > self.max {
            let Some((name, value)) = self.entries.pop_back() else {
                self.size = 0;
                return;
            };
            self.size -= name.len() + value.len() + ENTRY_OVERHEAD;
        }
    }
}

/// The bytes of a block not decoded yet.
struct Input<'a> {
    bytes: &'a [u8],
}

impl Input<'_> {
    /// An integer with a `prefix`-bit prefix (RFC 7541 §5.1).
    fn integer(&mut self, prefix: u8) -> Result<usize, HpackError> {
        let (&first, mut rest) = self.bytes.split_first().ok_or(HpackError::Truncated)?;
        let mask = (1u16 << prefix) as usize - 1;
        let mut value = usize::from(first) & mask;
        if value == mask {
            let mut shift = 0;
            loop {
                let (&byte, after) = rest.split_first().ok_or(HpackError::Truncated)?;
                rest = after;
                if shift > 28 {
                    return Err(HpackError::IntegerOverflow);
                }
                value += usize::from(byte & 0x7f) << shift;
                shift += 7;
                if byte & 0x80 == 0 {
                    break;
                }
            }
        }
        self.bytes = rest;
        Ok(value)
    }

    /// A string literal (RFC 7541 §5.2), Huffman-coded or not.
    fn string(&mut self) -> Result<Vec<u8>, HpackError> {
        let huffman = self.bytes.first().is_some_and(|byte| byte & 0x80 != 0);
        let bytes = self.skip_string()?;
        if huffman {
            huffman_decode(bytes)
        } else {
            Ok(bytes.to_vec())
        }
    }

    /// Passes a string literal by its length; its coded bytes.
    fn skip_string(&mut self) -> Result<&[u8], HpackError> {
        let len = self.integer(7)?;
        let bytes = self.bytes.get(..len).ok_or(HpackError::Truncated)?;
        self.bytes = self.bytes.get(len..).ok_or(HpackError::Truncated)?;
        Ok(bytes)
    }
}

/// A node of the Huffman code's tree: its two children by the next bit, each a node
/// index or a leaf's symbol (`LEAF` set). The code has 257 symbols, so 256 inner
/// nodes: a node's index fits a `u8`.
type Node = [u16; 2];
const LEAF: u16 = 0x8000;
/// The symbol that ends a string: never sent inside one.
const EOS: u16 = 256;

/// The tree of [`HUFFMAN_CODES`].
fn huffman_tree() -> Vec<Node> {
    let mut tree: Vec<Node> = vec![[0, 0]];
    for (symbol, &(code, len)) in (0u16..).zip(HUFFMAN_CODES.iter()) {
        let mut node = 0;
        for bit in (0..len).rev() {
            let branch = ((code >> bit) & 1) as usize;
            if bit == 0 {
                tree[node][branch] = LEAF | symbol;
            } else {
                if tree[node][branch] == 0 {
                    tree.push([0, 0]);
                    tree[node][branch] = (tree.len() - 1) as u16;
                }
                node = usize::from(tree[node][branch]);
            }
        }
    }
    tree
}

/// Where 4 bits lead from a node: the node after them and the symbol they completed,
/// if one (a code is at least 5 bits long: 4 bits complete at most one), or EOS.
#[derive(Clone, Copy, Default)]
struct Step {
    next: u8,
    symbol: Option<u8>,
    eos: bool,
}

/// The decoder's table, built once from the tree: each node's 16 steps, and the nodes
/// a string may end at (the root, and the all-ones path's first 7 nodes: padding is
/// at most 7 bits of EOS's prefix).
struct Nibbles {
    steps: Vec<[Step; 16]>,
    ends: [bool; 256],
}

static NIBBLES: LazyLock<Nibbles> = LazyLock::new(|| {
    let tree = huffman_tree();
    let steps = (0..tree.len())
        .map(|from| {
            let mut row = [Step::default(); 16];
            for (nibble, step) in (0u8..).zip(row.iter_mut()) {
                let mut node = from;
                for bit in (0..4).rev() {
                    let next = tree[node][usize::from((nibble >> bit) & 1)];
                    if next & LEAF == 0 {
                        node = usize::from(next);
                    } else if next & !LEAF == EOS {
                        step.eos = true;
                    } else {
                        step.symbol = Some((next & !LEAF) as u8);
                        node = 0;
                    }
                }
                step.next = node as u8;
            }
            row
        })
        .collect();
    let mut ends = [false; 256];
    let mut node = 0;
    ends[0] = true;
    for _ in 0..7 {
        node = usize::from(tree[node][1]);
        ends[node] = true;
    }
    Nibbles { steps, ends }
});

/// Decodes a Huffman-coded string (RFC 7541 §5.2), 4 bits a step: its padding is at
/// most 7 bits, all ones (a prefix of EOS), and EOS itself is refused.
fn huffman_decode(bytes: &[u8]) -> Result<Vec<u8>, HpackError> {
    let nibbles = &*NIBBLES;
    let mut decoded = Vec::with_capacity(bytes.len() * 8 / 5);
    let mut node = 0u8;
    for &byte in bytes {
        for nibble in [byte >> 4, byte & 0xf] {
            let step = nibbles
                .steps
                .get(usize::from(node))
                .and_then(|row| row.get(usize::from(nibble)))
                .ok_or(HpackError::BadHuffman)?;
            if step.eos {
                return Err(HpackError::BadHuffman);
            }
            if let Some(symbol) = step.symbol {
                decoded.push(symbol);
            }
            node = step.next;
        }
    }
    if !nibbles.ends[usize::from(node)] {
        return Err(HpackError::BadHuffman);
    }
    Ok(decoded)
}

#[cfg(test)]
mod tests {
    use loona_hpack::Encoder;
    use proptest::prelude::*;

    use super::*;

    fn hex(text: &str) -> Vec<u8> {
        let digits: Vec<u8> = text.bytes().filter(u8::is_ascii_hexdigit).collect();
        digits
            .chunks(2)
            .map(|pair| u8::from_str_radix(std::str::from_utf8(pair).unwrap_or("zz"), 16))
            .collect::<Result<_, _>>()
            .unwrap_or_default()
    }

    fn fields(decoder: &mut Decoder, block: &[u8]) -> Result<Vec<(String, String)>, HpackError> {
        let mut fields = Vec::new();
        decoder.decode(
            block,
            |_| true,
            |name, value| {
                fields.push((
                    String::from_utf8_lossy(name).into_owned(),
                    String::from_utf8_lossy(value).into_owned(),
                ));
            },
        )?;
        Ok(fields)
    }

    fn owned(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
            .collect()
    }

    /// RFC 7541 Appendix C.4: three requests with Huffman coding, on one connection.
    #[test]
    fn the_rfcs_huffman_requests_decode_with_their_table() -> Result<(), HpackError> {
        let mut decoder = Decoder::new(DEFAULT_TABLE_BYTES);
        let first = fields(
            &mut decoder,
            &hex("8286 8441 8cf1 e3c2 e5f2 3a6b a0ab 90f4 ff"),
        )?;
        assert_eq!(
            first,
            owned(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
            ])
        );
        let second = fields(&mut decoder, &hex("8286 84be 5886 a8eb 1064 9cbf"))?;
        assert_eq!(
            second,
            owned(&[
                (":method", "GET"),
                (":scheme", "http"),
                (":path", "/"),
                (":authority", "www.example.com"),
                ("cache-control", "no-cache"),
            ])
        );
        let third = fields(
            &mut decoder,
            &hex("8287 85bf 4088 25a8 49e9 5ba9 7d7f 8925 a849 e95b b8e8 b4bf"),
        )?;
        assert_eq!(
            third,
            owned(&[
                (":method", "GET"),
                (":scheme", "https"),
                (":path", "/index.html"),
                (":authority", "www.example.com"),
                ("custom-key", "custom-value"),
            ])
        );
        assert_eq!(decoder.size, 164);
        Ok(())
    }

    /// Huffman-codes `bytes` with the table, padded with ones.
    fn huffman_encode(bytes: &[u8]) -> Vec<u8> {
        let (mut out, mut bits, mut pending) = (Vec::new(), 0u32, 0u64);
        for &byte in bytes {
            let (code, len) = HUFFMAN_CODES[usize::from(byte)];
            pending = (pending << len) | u64::from(code);
            bits += u32::from(len);
            while bits >= 8 {
                bits -= 8;
                out.push((pending >> bits) as u8);
            }
        }
        if bits > 0 {
            out.push(((pending << (8 - bits)) | ((1 << (8 - bits)) - 1)) as u8);
        }
        out
    }

    #[test]
    fn bad_huffman_padding_and_eos_are_refused() {
        // "a" is 00011 (5 bits): padded with 3 ones it decodes; with zeros it does not.
        assert_eq!(huffman_decode(&[0b0001_1111]), Ok(b"a".to_vec()));
        assert_eq!(huffman_decode(&[0b0001_1000]), Err(HpackError::BadHuffman));
        // EOS (30 ones) inside a string.
        assert_eq!(huffman_decode(&[0xff; 4]), Err(HpackError::BadHuffman));
        // 8 bits of padding.
        assert_eq!(
            huffman_decode(&[0b0001_1111, 0xff]),
            Err(HpackError::BadHuffman)
        );
    }

    #[test]
    fn malformed_blocks_are_errors() {
        let mut decoder = Decoder::new(DEFAULT_TABLE_BYTES);
        assert_eq!(
            decoder.decode(&[0x80], |_| true, |_, _| ()),
            Err(HpackError::BadIndex(0))
        );
        assert_eq!(
            decoder.decode(&[0xbe], |_| true, |_, _| ()),
            Err(HpackError::BadIndex(62))
        );
        assert_eq!(
            decoder.decode(&[0x40, 0x05, b'a'], |_| true, |_, _| ()),
            Err(HpackError::Truncated)
        );
        assert_eq!(
            decoder.decode(&[0xff; 8], |_| true, |_, _| ()),
            Err(HpackError::IntegerOverflow)
        );
        assert_eq!(
            decoder.decode(&[0x3f, 0xe1, 0xff, 0x03], |_| true, |_, _| ()),
            Err(HpackError::TableTooLarge(65_536, DEFAULT_TABLE_BYTES))
        );
    }

    proptest! {
        /// Any header lists, encoded by another implementation (loona-hpack's, which
        /// indexes what it can) on one connection, decode to themselves; Huffman
        /// strings of any bytes decode to themselves.
        #[test]
        fn what_an_encoder_writes_decodes_to_itself(
            lists in proptest::collection::vec(
                proptest::collection::vec(
                    (
                        prop_oneof![
                            Just(":path".to_owned()),
                            Just(":status".to_owned()),
                            Just("grpc-status".to_owned()),
                            "[a-z-]{1,12}",
                        ],
                        "[ -~]{0,40}",
                    ),
                    0..12,
                ),
                1..20,
            ),
            raw in proptest::collection::vec(any::<u8>(), 0..64),
        ) {
            let mut encoder = Encoder::new();
            let mut decoder = Decoder::new(DEFAULT_TABLE_BYTES);
            // One that skips the values of every field but `:path`.
            let mut paths = Decoder::new(DEFAULT_TABLE_BYTES);
            for list in &lists {
                let block = encoder.encode(list.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
                prop_assert_eq!(fields(&mut decoder, &block), Ok(list.clone()));
                let mut read = Vec::new();
                let decoded = paths.decode(&block, |name| name == b":path", |_, value| {
                    read.push(String::from_utf8_lossy(value).into_owned());
                });
                prop_assert_eq!(decoded, Ok(()));
                let expected: Vec<String> = list
                    .iter()
                    .filter(|(name, _)| name == ":path")
                    .map(|(_, value)| value.clone())
                    .collect();
                prop_assert_eq!(read, expected);
            }
            prop_assert!(decoder.size <= DEFAULT_TABLE_BYTES);
            prop_assert_eq!(huffman_decode(&huffman_encode(&raw)), Ok(raw));
        }

        #[test]
        fn any_bytes_decode_or_are_an_error(block in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut decoder = Decoder::new(DEFAULT_TABLE_BYTES);
            let _ = decoder.decode(&block, |_| true, |_, _| ());
            prop_assert!(decoder.size <= DEFAULT_TABLE_BYTES);
        }
    }
}
