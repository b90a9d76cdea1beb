//! The stacks part of [`Kernel`] ([`Stacks`]): the epoch that rotates the three
//! generations of `STACKS` and `STACK_COUNTS`, their drain, the stack copies and
//! hints for unwinding, the off-CPU capture counts, and the profiling session slots
//! with their samplers.
use std::collections::HashMap as StdHashMap;

use aya::{
    Ebpf,
    maps::{Array, HashMap, MapData, PerCpuArray, RingBuf, stack_trace::StackTraceMap},
    programs::{PerfEvent, perf_event::PerfEventLinkId},
};
use poolscope_shared::{
    LOST_FRAME_ADDRESS, MAX_PROFILE_SESSIONS, OVERFLOW_STACK, OffcpuCaptures, ProfileSession,
    SHORTENED_STACK, STACK_GENERATIONS, StackCopy, StackCount, StackHint, StackKey,
    StackVariantKey,
    maps::{self, CountedMap},
    overflow_stacks,
};

use super::{
    Kernel, KernelError, MapSizes,
    attach::{attach_cpu_clock, detach_all, session_sampler, typed_program},
    take,
};
use crate::config::Limits;

/// The sampled stacks, their counts and copies, and the profiling sessions.
pub(super) struct Stacks {
    stack_epoch: Array<MapData, u32>,
    /// The epoch in `stack_epoch` (user space is its only writer).
    epoch: u32,
    stack_counts: HashMap<MapData, StackKey, StackCount>,
    /// `STACKS`: one stack map per generation, and `STACK_OVERFLOWS`, its overflow.
    generations: Vec<StackTraceMap<MapData>>,
    overflows: Vec<StackTraceMap<MapData>>,
    /// The user stacks' copies for unwinding, and which stacks were copied.
    stack_copies: RingBuf<MapData>,
    stack_copied: Array<MapData, u64>,
    /// Where the callers behind one user stack id part, by id (see
    /// `stacks/repairs.rs`), as last written; and the caller paths copied.
    stack_hints: Array<MapData, StackHint>,
    hints_written: StdHashMap<u32, StackHint>,
    stack_variants: HashMap<MapData, StackVariantKey, u32>,
    offcpu_captures: PerCpuArray<MapData, OffcpuCaptures>,
    profile_sessions: Array<MapData, ProfileSession>,
    /// The cpu-clock perf events of each session slot's sampler, while it runs.
    session_links: [Vec<PerfEventLinkId>; MAX_PROFILE_SESSIONS as usize],
}

impl Stacks {
    /// The sizes `limits` gives these maps: each generation's stack map, their
    /// counts, and per stack id of each generation (and of the lock stacks) its
    /// copied flag and hint.
    pub fn sizes(limits: &Limits) -> MapSizes {
        let copy_stride = limits.stack_copy_stride();
        let generations = maps::STACKS.iter().map(|&name| (name, limits.stacks));
        let overflows =
            (maps::STACK_OVERFLOWS.iter()).map(|&name| (name, overflow_stacks(limits.stacks)));
        generations
            .chain(overflows)
            .chain([
                (maps::STACK_COUNTS, limits.stack_counts),
                (maps::STACK_COPIED, (STACK_GENERATIONS + 1) * copy_stride),
                (maps::STACK_HINTS, limits.stacks),
            ])
            .collect()
    }

    /// The load-time globals `limits` gives these programs: the slots per stack map
    /// in `STACK_COPIED`.
    pub fn globals(limits: &Limits) -> Vec<(&'static str, u32)> {
        vec![("STACK_COPY_STRIDE", limits.stack_copy_stride())]
    }

    /// Takes the stack and profiling maps out of `ebpf`.
    pub fn take(ebpf: &mut Ebpf) -> Result<Self, KernelError> {
        let generations = maps::STACKS
            .iter()
            .map(|name| take(ebpf, name))
            .collect::<Result<_, _>>()?;
        let overflows = maps::STACK_OVERFLOWS
            .iter()
            .map(|name| take(ebpf, name))
            .collect::<Result<_, _>>()?;
        Ok(Self {
            stack_epoch: take(ebpf, maps::STACK_EPOCH)?,
            epoch: 0,
            stack_counts: take(ebpf, maps::STACK_COUNTS)?,
            generations,
            overflows,
            stack_copies: take(ebpf, maps::STACK_COPIES)?,
            stack_copied: take(ebpf, maps::STACK_COPIED)?,
            stack_hints: take(ebpf, maps::STACK_HINTS)?,
            hints_written: StdHashMap::new(),
            stack_variants: take(ebpf, maps::STACK_VARIANTS)?,
            offcpu_captures: take(ebpf, maps::OFFCPU_CAPTURES)?,
            profile_sessions: take(ebpf, maps::PROFILE_SESSIONS)?,
            session_links: std::array::from_fn(|_| Vec::new()),
        })
    }

    /// Off-CPU blocks captured in full, sampled and left out, summed over CPUs.
    pub fn offcpu_captures(&self) -> Result<OffcpuCaptures, KernelError> {
        let mut captures = OffcpuCaptures::default();
        let per_cpu = (self.offcpu_captures.get(&0, 0)).map_err(|source| KernelError::Map {
            map: maps::OFFCPU_CAPTURES,
            source,
        })?;
        for cpu in per_cpu.iter() {
            captures.full += cpu.full;
            captures.sampled += cpu.sampled;
            captures.skipped += cpu.skipped;
        }
        Ok(captures)
    }

    /// How many profiling session slots hold an active session.
    pub fn active_sessions(&self) -> u64 {
        self.profile_sessions
            .iter()
            .filter(|session| session.as_ref().is_ok_and(|s| s.active != 0))
            .count() as u64
    }

    fn set_profile_session(
        &mut self,
        slot: u32,
        session: ProfileSession,
    ) -> Result<(), KernelError> {
        self.profile_sessions
            .set(slot, session, 0)
            .map_err(|source| KernelError::Map {
                map: maps::PROFILE_SESSIONS,
                source,
            })
    }
}

/// The return addresses (innermost first) of stack `id` of a stack map (of its
/// `overflow` map for an [`OVERFLOW_STACK`] id); `None` for a negative id (not
/// captured) or one the map no longer holds. A stack kept less its innermost frame
/// begins with [`LOST_FRAME_ADDRESS`] in that frame's place, so that its first real
/// address is read as the return address it is.
pub(super) fn addresses(
    map: &StackTraceMap<MapData>,
    overflow: Option<&StackTraceMap<MapData>>,
    id: i32,
) -> Option<Vec<u64>> {
    let shortened = id & SHORTENED_STACK != 0;
    let map = if id & OVERFLOW_STACK != 0 {
        overflow?
    } else {
        map
    };
    let id = u32::try_from(id & !(SHORTENED_STACK | OVERFLOW_STACK)).ok()?;
    let trace = map.get(&id, 0).ok()?;
    let lost = shortened.then_some(LOST_FRAME_ADDRESS);
    Some(
        lost.into_iter()
            .chain(trace.frames().iter().map(|frame| frame.ip))
            .collect(),
    )
}
/// Removes every stack of `map`; the ids it held.
fn empty(map: &mut StackTraceMap<MapData>) -> Vec<u32> {
    let ids: Vec<u32> = map.stack_ids().filter_map(Result::ok).collect();
    for id in &ids {
        let _ = map.remove(id);
    }
    ids
}

impl Kernel {
    /// Starts a new stack epoch. Returns the generation to drain: the one of two
    /// epochs back, to which nothing can be added any more (see `stacks.rs` of
    /// the kernel side).
    pub fn advance_stack_epoch(&mut self) -> Result<u32, KernelError> {
        let next = self.stacks.epoch.wrapping_add(1);
        self.stacks
            .stack_epoch
            .set(0, next, 0)
            .map_err(|source| KernelError::Map {
                map: maps::STACK_EPOCH,
                source,
            })?;
        self.stacks.epoch = next;
        Ok((next + 1) % STACK_GENERATIONS)
    }

    /// The stack counts of `generation`.
    pub fn stack_counts(&self, generation: u32) -> Vec<(StackKey, StackCount)> {
        self.stacks
            .stack_counts
            .iter()
            .filter_map(Result::ok)
            .filter(|(key, _)| key.generation == generation)
            .collect()
    }

    /// The frames (innermost first) of stack `id` of `generation`.
    pub fn stack(&self, generation: u32, id: i32) -> Option<Vec<u64>> {
        let generation = generation as usize;
        addresses(
            self.stacks.generations.get(generation)?,
            self.stacks.overflows.get(generation),
            id,
        )
    }

    /// Empties `generation` (its counts and its stack map) for reuse.
    pub fn clear_stacks(&mut self, generation: u32, counted: &[StackKey]) {
        // One gone already (someone else cleared it) was counted by its remover.
        let removed = counted
            .iter()
            .filter(|key| self.stacks.stack_counts.remove(key).is_ok())
            .count();
        self.health
            .count_own_entries(CountedMap::StackCounts, -(removed as i64));
        let paths: Vec<StackVariantKey> = (self.stacks.stack_variants.keys())
            .filter_map(Result::ok)
            .filter(|key| key.generation == generation)
            .collect();
        for key in paths {
            let _ = self.stacks.stack_variants.remove(&key);
        }
        let generation_index = generation as usize;
        if let Some(map) = self.stacks.overflows.get_mut(generation_index) {
            empty(map);
        }
        let Some(map) = self.stacks.generations.get_mut(generation_index) else {
            return;
        };
        let stride = self.limits.stack_copy_stride();
        for id in empty(map) {
            // The id may stand for another stack from now on: copy it again.
            let _ = self.stacks.stack_copied.set(generation * stride + id, 0, 0);
        }
    }

    /// Gives the kernel `hints` (user stack id → hint), writing only those that
    /// changed. A failed write leaves that id's callers merged as before: logged.
    pub fn set_stack_hints(&mut self, hints: &[(u32, StackHint)]) {
        for (id, hint) in hints {
            let written = self
                .stacks
                .hints_written
                .get(id)
                .copied()
                .unwrap_or_default();
            if written == *hint {
                continue;
            }
            match self.stacks.stack_hints.set(*id, *hint, 0) {
                Ok(()) if hint.count == 0 => {
                    self.stacks.hints_written.remove(id);
                }
                Ok(()) => {
                    self.stacks.hints_written.insert(*id, *hint);
                }
                Err(error) => tracing::debug!(%error, id, "cannot write a stack hint"),
            }
        }
    }

    /// The stack copies the kernel made since the last call, oldest first.
    pub fn stack_copies(&mut self) -> Vec<Box<StackCopy>> {
        let mut copies = Vec::new();
        while let Some(record) = self.stacks.stack_copies.next() {
            if record.len() < size_of::<StackCopy>() {
                continue;
            }
            // SAFETY: StackCopy is repr(C) of integers, any bit pattern is valid, and
            // read_unaligned does not need alignment.
            let copy = unsafe { std::ptr::read_unaligned(record.as_ptr().cast::<StackCopy>()) };
            copies.push(Box::new(copy));
        }
        copies
    }

    /// Starts `session` in `slot`: the kernel counts its off-CPU blocks at once and,
    /// with `hz`, the slot's sampler ticks on every CPU at that rate.
    pub fn start_profile(
        &mut self,
        slot: u32,
        session: ProfileSession,
        hz: Option<u32>,
    ) -> Result<(), KernelError> {
        let name = session_sampler(slot)?;
        self.stacks.set_profile_session(slot, session)?;
        if let Some(hz) = hz {
            let attached = typed_program::<PerfEvent>(&mut self.ebpf, name)
                .and_then(|program| attach_cpu_clock(program, name, hz));
            match attached {
                Ok(links) => self.stacks.session_links[slot as usize] = links,
                Err(error) => {
                    self.stacks
                        .set_profile_session(slot, ProfileSession::default())?;
                    return Err(error);
                }
            }
        }
        Ok(())
    }

    /// Ends the session in `slot`: its perf events are closed and the slot freed.
    /// Returns the session as the kernel last saw it (with its first sample time).
    pub fn stop_profile(&mut self, slot: u32) -> Result<ProfileSession, KernelError> {
        let name = session_sampler(slot)?;
        let links = std::mem::take(&mut self.stacks.session_links[slot as usize]);
        if !links.is_empty() {
            detach_all(typed_program::<PerfEvent>(&mut self.ebpf, name)?, links);
        }
        let session = self
            .stacks
            .profile_sessions
            .get(&slot, 0)
            .map_err(|source| KernelError::Map {
                map: maps::PROFILE_SESSIONS,
                source,
            })?;
        self.stacks
            .set_profile_session(slot, ProfileSession::default())?;
        Ok(session)
    }
}
