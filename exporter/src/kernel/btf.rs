//! What poolscope reads of the kernel's BTF (/sys/kernel/btf/vmlinux): struct member
//! offsets (the kernel programs read a few `task_struct` and socket fields through
//! raw pointers, and aya-ebpf has no CO-RE, so user space finds each offset here and
//! passes it in at load time), and which BTF tracepoints the kernel has, with their
//! arguments (its `btf_trace_<event>` typedefs; tracefs is not needed). Only what
//! that needs is parsed: the type section's records, to skip them, struct members by
//! name, and typedefs of function pointers.

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BtfError {
    #[error("not BTF data (bad magic or truncated header)")]
    Header,
    #[error("truncated type record at byte {0}")]
    Truncated(usize),
    #[error("unknown BTF type kind {kind} at byte {at}")]
    UnknownKind { kind: u32, at: usize },
    #[error("struct {0} not found")]
    NoStruct(String),
    #[error("struct {strukt} has no member {member}")]
    NoMember { strukt: String, member: String },
    #[error("member {0} is a bitfield")]
    Bitfield(String),
    #[error("no tracepoint {0} (no typedef btf_trace_{0} of a function pointer)")]
    NoTracepoint(String),
    #[error("no function {0} (or it has no prototype)")]
    NoFunction(String),
    #[error("function {function} has no argument {param}")]
    NoParam { function: String, param: String },
}

const MAGIC: u16 = 0xeb9f;
const KIND_PTR: u32 = 2;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_TYPEDEF: u32 = 8;
const KIND_FUNC: u32 = 12;
const KIND_FUNC_PROTO: u32 = 13;

fn u32_at(data: &[u8], at: usize) -> Option<u32> {
    let bytes = data.get(at..at + 4)?;
    Some(u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]))
}

fn name_at(strings: &[u8], offset: u32) -> &[u8] {
    let rest = strings.get(offset as usize..).unwrap_or_default();
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    &rest[..end]
}

/// Bytes that follow a type record's 12-byte head, by kind (include/uapi/linux/btf.h).
fn trailer_len(kind: u32, vlen: usize) -> Option<usize> {
    Some(match kind {
        // int: one u32 of encoding; var, decl_tag: one u32.
        1 | 14 | 17 => 4,
        // ptr, fwd, typedef, volatile, const, restrict, func, float, type_tag
        2 | 7 | 8 | 9 | 10 | 11 | 12 | 16 | 18 => 0,
        // array: element type, index type, count
        3 => 12,
        // struct, union: members of (name, type, offset); datasec: (type, offset, size);
        // enum64: (name, lo32, hi32)
        4 | 5 | 15 | 19 => 12 * vlen,
        // enum: (name, value); func_proto: (name, type)
        6 | 13 => 8 * vlen,
        _ => return None,
    })
}

/// The type and string sections of raw little-endian BTF, with each type record's
/// start by type id.
struct Types<'a> {
    types: &'a [u8],
    strings: &'a [u8],
    /// Where each record starts in `types`; type id n is at index n - 1.
    records: Vec<usize>,
}

impl<'a> Types<'a> {
    fn parse(btf: &'a [u8]) -> Result<Self, BtfError> {
        if btf.len() < 24 || u16::from_le_bytes([btf[0], btf[1]]) != MAGIC {
            return Err(BtfError::Header);
        }
        let header = |at| u32_at(btf, at).ok_or(BtfError::Header);
        let header_len = header(4)? as usize;
        let (type_off, type_len) = (header(8)? as usize, header(12)? as usize);
        let (str_off, str_len) = (header(16)? as usize, header(20)? as usize);
        let types = btf
            .get(header_len + type_off..header_len + type_off + type_len)
            .ok_or(BtfError::Header)?;
        let strings = btf
            .get(header_len + str_off..header_len + str_off + str_len)
            .ok_or(BtfError::Header)?;
        let mut records = Vec::new();
        let mut at = 0;
        while at < types.len() {
            let info = u32_at(types, at + 4).ok_or(BtfError::Truncated(at))?;
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            records.push(at);
            at += 12 + trailer_len(kind, vlen).ok_or(BtfError::UnknownKind { kind, at })?;
        }
        Ok(Self {
            types,
            strings,
            records,
        })
    }

    /// The kind of the record at `at`.
    fn kind(&self, at: usize) -> Option<u32> {
        u32_at(self.types, at + 4).map(|info| (info >> 24) & 0x1f)
    }

    /// The first record of `kind` named `name`.
    fn named(&self, kind: u32, name: &str) -> Option<usize> {
        self.records.iter().copied().find(|&at| {
            self.kind(at) == Some(kind)
                && u32_at(self.types, at)
                    .is_some_and(|offset| name_at(self.strings, offset) == name.as_bytes())
        })
    }

    /// The record a type id refers to (its `type` field: at byte 8 of the head).
    fn referenced(&self, at: usize) -> Option<usize> {
        let id = u32_at(self.types, at + 8)? as usize;
        self.records.get(id.checked_sub(1)?).copied()
    }
}

/// The byte offset of `member` in `struct strukt`, from raw little-endian BTF.
pub fn member_offset(btf: &[u8], strukt: &str, member: &str) -> Result<u32, BtfError> {
    let types = Types::parse(btf)?;
    let Some(found) = types.named(KIND_STRUCT, strukt) else {
        return Err(BtfError::NoStruct(strukt.to_owned()));
    };
    match types.find(found, member, 0, 0)? {
        Some(bits) => Ok(bits / 8),
        None => Err(BtfError::NoMember {
            strukt: strukt.to_owned(),
            member: member.to_owned(),
        }),
    }
}

/// How many arguments the kernel passes a BTF program on tracepoint `event`
/// (`btf_trace_<event>` is a pointer to a function of a context pointer and them).
pub fn tracepoint_args(btf: &[u8], event: &str) -> Result<u32, BtfError> {
    let types = Types::parse(btf)?;
    let missing = || BtfError::NoTracepoint(event.to_owned());
    let typedef = types
        .named(KIND_TYPEDEF, &format!("btf_trace_{event}"))
        .ok_or_else(missing)?;
    let pointer = types
        .referenced(typedef)
        .filter(|&at| types.kind(at) == Some(KIND_PTR))
        .ok_or_else(missing)?;
    let proto = types
        .referenced(pointer)
        .filter(|&at| types.kind(at) == Some(KIND_FUNC_PROTO))
        .ok_or_else(missing)?;
    let params = u32_at(types.types, proto + 4).ok_or(BtfError::Truncated(proto))? & 0xffff;
    params.checked_sub(1).ok_or_else(missing)
}

/// The position (from 0) of argument `param` of kernel function `function`.
pub fn function_param(btf: &[u8], function: &str, param: &str) -> Result<u32, BtfError> {
    let types = Types::parse(btf)?;
    let missing = || BtfError::NoFunction(function.to_owned());
    let func = types.named(KIND_FUNC, function).ok_or_else(missing)?;
    let proto = types
        .referenced(func)
        .filter(|&at| types.kind(at) == Some(KIND_FUNC_PROTO))
        .ok_or_else(missing)?;
    let params = u32_at(types.types, proto + 4).ok_or(BtfError::Truncated(proto))? & 0xffff;
    (0..params)
        .find(|&index| {
            // Each parameter is (name, type) after the 12-byte head.
            u32_at(types.types, proto + 12 + 8 * index as usize)
                .is_some_and(|name| name_at(types.strings, name) == param.as_bytes())
        })
        .ok_or_else(|| BtfError::NoParam {
            function: function.to_owned(),
            param: param.to_owned(),
        })
}

/// Member lookup through anonymous structs and unions, as C sees their members.
impl Types<'_> {
    /// The bit offset of `member` in the struct or union whose record starts at `at`,
    /// itself at bit `base`; `depth` bounds the descent into anonymous members.
    fn find(
        &self,
        at: usize,
        member: &str,
        base: u32,
        depth: u32,
    ) -> Result<Option<u32>, BtfError> {
        let info = u32_at(self.types, at + 4).ok_or(BtfError::Truncated(at))?;
        let vlen = (info & 0xffff) as usize;
        let bitfield_offsets = info >> 31 == 1;
        for index in 0..vlen {
            let record = at + 12 + 12 * index;
            let (Some(name), Some(type_id), Some(offset)) = (
                u32_at(self.types, record),
                u32_at(self.types, record + 4),
                u32_at(self.types, record + 8),
            ) else {
                return Err(BtfError::Truncated(record));
            };
            // With the kind flag, the top 8 bits are a bitfield size.
            let (bits, bitfield_size) = if bitfield_offsets {
                (offset & 0x00ff_ffff, offset >> 24)
            } else {
                (offset, 0)
            };
            let name = name_at(self.strings, name);
            if name == member.as_bytes() {
                if bitfield_size != 0 || bits % 8 != 0 {
                    return Err(BtfError::Bitfield(member.to_owned()));
                }
                return Ok(Some(base + bits));
            }
            if !name.is_empty() || depth >= MAX_ANONYMOUS_DEPTH {
                continue;
            }
            let Some(&inner) = (type_id as usize)
                .checked_sub(1)
                .and_then(|index| self.records.get(index))
            else {
                continue;
            };
            let inner_kind = u32_at(self.types, inner + 4).map(|info| (info >> 24) & 0x1f);
            if matches!(inner_kind, Some(KIND_STRUCT | KIND_UNION))
                && let Some(found) = self.find(inner, member, base + bits, depth + 1)?
            {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }
}

/// How deep anonymous structs and unions may nest (the kernel's go 3 deep).
const MAX_ANONYMOUS_DEPTH: u32 = 8;

#[cfg(test)]
mod tests {
    use super::*;

    /// A BTF blob with `int` and `struct task { int a; int pid; }` (plus a union and
    /// an enum to skip), built as the kernel lays it out.
    fn fixture() -> Vec<u8> {
        let strings = b"\0int\0task\0a\0pid\0u\0e\0x\0btf_trace_ev\0recv\0";
        let name = |s: &str| {
            let needle = format!("\0{s}\0");
            strings
                .windows(needle.len())
                .position(|w| w == needle.as_bytes())
                .map_or(0, |p| p as u32 + 1)
        };
        let mut types = Vec::new();
        let mut push = |values: &[u32]| {
            for value in values {
                types.extend_from_slice(&value.to_le_bytes());
            }
        };
        // [1] int: name, info (kind 1), size, encoding
        push(&[name("int"), 1 << 24, 4, 32]);
        // [2] union u { int x; }
        push(&[name("u"), (5 << 24) | 1, 4, name("x"), 1, 0]);
        // [3] enum e { x = 0 }
        push(&[name("e"), (6 << 24) | 1, 4, name("x"), 0]);
        // [4] struct task { int a; int pid; }: offsets in bits
        push(&[
            name("task"),
            (4 << 24) | 2,
            8,
            name("a"),
            1,
            0,
            name("pid"),
            1,
            32,
        ]);
        // [5] func_proto (void *, int) returning void; [6] pointer to it; [7] typedef
        // btf_trace_ev of the pointer: a tracepoint `ev` with one argument.
        push(&[0, (13 << 24) | 2, 0, 0, 0, 0, 1]);
        push(&[0, 2 << 24, 5]);
        push(&[name("btf_trace_ev"), 8 << 24, 6]);
        // [8] func_proto (int a, int pid) returning int; [9] func recv of it.
        push(&[0, (13 << 24) | 2, 1, name("a"), 1, name("pid"), 1]);
        push(&[name("recv"), 12 << 24, 8]);
        let mut blob = Vec::new();
        blob.extend_from_slice(&MAGIC.to_le_bytes());
        blob.extend_from_slice(&[1, 0]);
        for value in [
            24,
            0,
            types.len() as u32,
            types.len() as u32,
            strings.len() as u32,
        ] {
            blob.extend_from_slice(&value.to_le_bytes());
        }
        blob.extend_from_slice(&types);
        blob.extend_from_slice(strings);
        blob
    }

    #[test]
    fn finds_a_member_after_skipping_other_kinds() {
        let blob = fixture();
        assert_eq!(member_offset(&blob, "task", "pid"), Ok(4));
        assert_eq!(member_offset(&blob, "task", "a"), Ok(0));
        assert_eq!(
            member_offset(&blob, "task", "tgid"),
            Err(BtfError::NoMember {
                strukt: "task".into(),
                member: "tgid".into()
            })
        );
        assert_eq!(
            member_offset(&blob, "mm", "pid"),
            Err(BtfError::NoStruct("mm".into()))
        );
    }

    #[test]
    fn finds_a_tracepoints_arguments() {
        let blob = fixture();
        assert_eq!(tracepoint_args(&blob, "ev"), Ok(1));
        assert_eq!(
            tracepoint_args(&blob, "task"),
            Err(BtfError::NoTracepoint("task".into()))
        );
    }

    #[test]
    fn finds_a_functions_argument_by_name() {
        let blob = fixture();
        assert_eq!(function_param(&blob, "recv", "a"), Ok(0));
        assert_eq!(function_param(&blob, "recv", "pid"), Ok(1));
        assert_eq!(
            function_param(&blob, "recv", "flags"),
            Err(BtfError::NoParam {
                function: "recv".into(),
                param: "flags".into()
            })
        );
        // A typedef is no function.
        assert_eq!(
            function_param(&blob, "btf_trace_ev", "a"),
            Err(BtfError::NoFunction("btf_trace_ev".into()))
        );
    }

    #[test]
    fn refuses_garbage_and_truncation() {
        assert_eq!(
            member_offset(b"not btf at all, no", "a", "b"),
            Err(BtfError::Header)
        );
        let mut blob = fixture();
        // Cut the string section short: the header now points past the end.
        blob.truncate(blob.len() - 3);
        assert_eq!(member_offset(&blob, "task", "pid"), Err(BtfError::Header));
    }

    #[test]
    fn this_kernels_task_struct_when_readable() {
        // Ground truth is the kernel's own BTF; skipped where it is not exposed, but
        // not in CI, whose machines have it.
        let vmlinux = match std::fs::read("/sys/kernel/btf/vmlinux") {
            Ok(vmlinux) => vmlinux,
            Err(error) => {
                poolscope_tests::skip(
                    "this_kernels_task_struct_when_readable",
                    &format!("/sys/kernel/btf/vmlinux not readable: {error}"),
                );
                return;
            }
        };
        let pid = member_offset(&vmlinux, "task_struct", "pid");
        let tgid = member_offset(&vmlinux, "task_struct", "tgid");
        // pid_t pid; pid_t tgid; are adjacent in every kernel since 2.6.
        assert!(matches!((pid, tgid), (Ok(p), Ok(t)) if t == p + 4));
        // In an anonymous struct in an anonymous union: `__be16 skc_dport; __u16
        // skc_num;` make up `skc_portpair`.
        let portpair = member_offset(&vmlinux, "sock_common", "skc_portpair");
        let dport = member_offset(&vmlinux, "sock_common", "skc_dport");
        let num = member_offset(&vmlinux, "sock_common", "skc_num");
        assert!(matches!((portpair, dport, num), (Ok(p), Ok(d), Ok(n)) if p == d && n == d + 2));
        // sched_switch(bool preempt, prev, next, unsigned int prev_state) since 5.18;
        // sched_process_exit(p) gained `bool group_dead` in 6.16.
        assert_eq!(tracepoint_args(&vmlinux, "sched_switch"), Ok(4));
        assert!(matches!(
            tracepoint_args(&vmlinux, "sched_process_exit"),
            Ok(1 | 2)
        ));
        assert!(matches!(
            tracepoint_args(&vmlinux, "no_such_event"),
            Err(BtfError::NoTracepoint(_))
        ));
        // tcp_recvmsg(sk, msg, len, flags, addr_len) since 5.19; (sk, msg, len,
        // nonblock, flags, addr_len) before.
        assert_eq!(function_param(&vmlinux, "tcp_recvmsg", "sk"), Ok(0));
        assert!(matches!(
            function_param(&vmlinux, "tcp_recvmsg", "flags"),
            Ok(3 | 4)
        ));
    }
}
