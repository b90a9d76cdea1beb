//! What the unwinder found in the kernel's stack copies, kept until it is used and
//! put into the kernel's frame-pointer walks: a generation's stacks when it is
//! drained (its stack map is cleared then, and its ids reused), a lock stack's for as
//! long as `LOCK_STACKS` keeps it (it evicts nothing). Two callers behind one
//! frame-pointer stack (one function pointer, one call site in a library without
//! frame pointers) reach the same stack id: the hints made here ([`StackHint`]) let
//! the kernel tell their paths apart, and each path is copied, unwound and repaired
//! on its own. Splicing and hints are pure functions.
use std::{
    collections::{BTreeMap, HashMap},
    ops::Range,
    path::Path,
};

use poolscope_shared::{STACK_COPY_LOCKS, STACK_HINT_WORDS, StackCopy, StackHint};

use crate::{
    discovery::procfs::{self, Mapping},
    stacks::unwind::{Unwinder, Unwound, mapped_file},
};

/// What the unwinder found for the stacks copied so far, until they are used: a
/// generation's stacks when it is drained (its stack map is cleared then, and its
/// ids reused), a lock stack's for as long as `LOCK_STACKS` keeps it (it evicts
/// nothing).
pub struct StackRepairs {
    pub unwinder: Unwinder,
    /// (generation, user stack id, caller path) → what was unwound.
    generations: HashMap<(u32, i32, u32), Unwound>,
    /// Lock stack id → frames unwound.
    locks: HashMap<i32, Vec<u64>>,
}

impl StackRepairs {
    pub fn new(memory_limit: u64) -> Self {
        Self {
            unwinder: Unwinder::new(memory_limit),
            generations: HashMap::new(),
            locks: HashMap::new(),
        }
    }

    /// Unwinds `copies` of processes whose files are under `procfs_root`.
    pub fn add(&mut self, copies: &[Box<StackCopy>], procfs_root: &Path) {
        let mut by_process: BTreeMap<u32, Vec<&StackCopy>> = BTreeMap::new();
        for copy in copies {
            by_process.entry(copy.tgid).or_default().push(copy);
        }
        for (tgid, copies) in by_process {
            let mappings = procfs::maps(procfs_root, tgid);
            let open = |mapping: &Mapping| mapped_file(procfs_root, tgid, mapping);
            let unwound = self.unwinder.unwind(&copies, &mappings, &open);
            for (copy, frames) in copies.into_iter().zip(unwound) {
                let Some(frames) = frames else {
                    continue;
                };
                if copy.map == STACK_COPY_LOCKS {
                    self.locks.insert(copy.stack, frames.frames);
                } else {
                    let key = (copy.map, copy.stack, copy.variant);
                    self.generations.insert(key, frames);
                }
            }
        }
    }

    /// Puts the skipped frames back into the user stacks of `generation` (`stacks`:
    /// id → the kernel's walk), which is being drained: what was found for it is
    /// used now or never. `paths` are the (stack id, caller path) pairs its counts
    /// hold; each path other than 0 gets frames of its own.
    pub fn repair_generation(
        &mut self,
        generation: u32,
        stacks: &mut HashMap<i32, Vec<u64>>,
        paths: impl IntoIterator<Item = (i32, u32)>,
    ) -> Repaired {
        let mut repaired = Repaired::default();
        for (id, variant) in paths {
            let Some(walked) = stacks.get(&id).filter(|_| variant != 0) else {
                continue;
            };
            // A path whose copy was not unwound keeps the walk: never the frames
            // of another path.
            let frames = match self.generations.get(&(generation, id, variant)) {
                Some(unwound) => splice(&unwound.frames, walked),
                None => walked.clone(),
            };
            repaired.caller_paths.insert((id, variant), frames);
        }
        self.generations
            .retain(|&(unwound_in, id, variant), unwound| {
                if unwound_in != generation {
                    return true;
                }
                if variant == 0
                    && let Some(walked) = stacks.get_mut(&id)
                {
                    if let (Some(hint), Ok(id)) = (hint(unwound, walked), u32::try_from(id)) {
                        repaired.hints.push((id, hint));
                    }
                    *walked = splice(&unwound.frames, walked);
                }
                false
            });
        repaired
    }

    /// Lock stack `id` (the kernel's walk `walked`) with its skipped frames put back.
    pub fn repair_lock(&self, id: i32, walked: Vec<u64>) -> Vec<u64> {
        match self.locks.get(&id) {
            Some(unwound) => splice(unwound, &walked),
            None => walked,
        }
    }
}

/// `unwound` (by unwind tables, as far as the copy reached) joined with `walked`
/// (by frame pointers, as far as the stack goes), both innermost first and from the
/// same instruction: the unwound frames up to the first one the walk also has, then
/// the walk from there. Without a frame in common, the longer of the two. From two
/// instructions (an id that stands for another stack by now), the walk.
pub fn splice(unwound: &[u64], walked: &[u64]) -> Vec<u64> {
    if unwound.first() != walked.first() {
        return walked.to_vec();
    }
    match in_common(unwound, walked) {
        Some((index, position)) => {
            let mut frames = unwound[..=index].to_vec();
            frames.extend_from_slice(&walked[position + 1..]);
            frames
        }
        None if unwound.len() > walked.len() => unwound.to_vec(),
        None => walked.to_vec(),
    }
}

/// The first frame after the innermost that `unwound` and `walked` both have: its
/// index in each.
fn in_common(unwound: &[u64], walked: &[u64]) -> Option<(usize, usize)> {
    unwound
        .iter()
        .enumerate()
        .skip(1)
        .find_map(|(index, frame)| {
            let position = walked.iter().skip(1).position(|walk| walk == frame)?;
            Some((index, position + 1))
        })
}

/// The frames of `unwound` that [`splice`] puts in front of `walked`: its frames
/// before the first one in common, or all of it when it wins whole.
fn skipped(unwound: &[u64], walked: &[u64]) -> Range<usize> {
    match in_common(unwound, walked) {
        Some((index, _)) => 1..index,
        None if unwound.len() > walked.len() => 1..unwound.len(),
        None => 1..1,
    }
}

/// The kernel's hint for the stack id whose walk is `walked` and one copy of which
/// unwound to `unwound`: where (and which) return addresses the walk skipped, up to
/// [`STACK_HINT_WORDS`] of them. A hint of no words where the walk skipped nothing
/// (a stale hint goes); `None` for a copy of another stack (another instruction).
pub fn hint(unwound: &Unwound, walked: &[u64]) -> Option<StackHint> {
    let ip = *unwound.frames.first()?;
    if walked.first() != Some(&ip) {
        return None;
    }
    let mut hint = StackHint {
        ip,
        ..StackHint::default()
    };
    let known = skipped(&unwound.frames, walked).filter_map(|index| {
        let slot = (*unwound.slots.get(index)?)?;
        Some((slot, *unwound.frames.get(index)?))
    });
    for (word, (slot, address)) in known.take(STACK_HINT_WORDS).enumerate() {
        hint.offsets[word] = slot;
        hint.words[word] = address;
        hint.count = word as u32 + 1;
    }
    Some(hint)
}

/// A drained generation's caller paths, and the hints the kernel is to have.
#[derive(Debug, Default)]
pub struct Repaired {
    /// (user stack id, caller path other than 0) → its frames, innermost first.
    pub caller_paths: HashMap<(i32, u32), Vec<u64>>,
    /// User stack id → its hint (of no words: none any more).
    pub hints: Vec<(u32, StackHint)>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn skipped_frames_are_put_back_in_front_of_the_walk() {
        // The walk went from glibc's syscall (0x10) straight to the named function's
        // caller (0x40): the library's frame (0x20) and the named function (0x30)
        // were skipped.
        let walked = [0x10, 0x40, 0x50, 0x60];
        let unwound = [0x10, 0x20, 0x30, 0x40, 0x50];
        assert_eq!(
            splice(&unwound, &walked),
            [0x10, 0x20, 0x30, 0x40, 0x50, 0x60]
        );
    }

    #[test]
    fn an_unwind_that_agrees_changes_nothing() {
        let walked = [0x10, 0x40, 0x50];
        assert_eq!(splice(&[0x10, 0x40], &walked), walked);
        assert_eq!(splice(&[0x10], &walked), walked);
    }

    #[test]
    fn an_unwind_of_another_stack_is_not_spliced() {
        // The id was cleared and reused: the copy began at another instruction.
        assert_eq!(splice(&[0x11, 0x20, 0x40], &[0x10, 0x40]), [0x10, 0x40]);
    }

    #[test]
    fn without_a_frame_in_common_the_longer_stack_wins() {
        // An interpreter without frame pointers: the walk has its innermost frame
        // and garbage; the unwind the interpreter's frames.
        assert_eq!(splice(&[1, 2, 3, 4], &[1, 99]), [1, 2, 3, 4]);
        assert_eq!(splice(&[1, 2], &[1, 7, 8]), [1, 7, 8]);
    }

    fn unwound(frames: &[u64], slots: &[Option<u16>]) -> Unwound {
        Unwound {
            frames: frames.to_vec(),
            slots: slots.to_vec(),
        }
    }

    #[test]
    fn a_hint_holds_the_skipped_return_addresses_and_where_they_were() {
        // glibc's sleep (0x10) → its inner frame (0x20) → the named caller (0x30) →
        // the caller's caller (0x40), which the walk has.
        let walked = [0x10, 0x40, 0x50];
        let stack = unwound(
            &[0x10, 0x20, 0x30, 0x40, 0x50],
            &[None, Some(3), Some(9), Some(14), Some(20)],
        );
        let hint = hint(&stack, &walked).expect("same instruction");
        assert_eq!(hint.ip, 0x10);
        assert_eq!(hint.count, 2);
        assert_eq!(hint.offsets[..2], [3, 9]);
        assert_eq!(hint.words[..2], [0x20, 0x30]);
    }

    #[test]
    fn a_walk_that_skipped_nothing_needs_no_hint() {
        let stack = unwound(&[0x10, 0x40], &[None, Some(2)]);
        assert_eq!(hint(&stack, &[0x10, 0x40, 0x50]).map(|h| h.count), Some(0));
        // Another instruction: the copy is of another stack, the hint stays as is.
        assert_eq!(hint(&stack, &[0x11, 0x40]), None);
    }

    #[test]
    fn a_hint_keeps_at_most_its_words_and_leaves_out_unknown_slots() {
        // A walk of garbage past the innermost frame: the unwind wins whole.
        let frames: Vec<u64> = (1..=10).collect();
        let slots: Vec<Option<u16>> = (0..10).map(|i| (i % 3 != 0).then_some(i)).collect();
        let hint = hint(&unwound(&frames, &slots), &[1, 99]).expect("same instruction");
        assert_eq!(hint.count as usize, STACK_HINT_WORDS);
        assert_eq!(hint.words, [2, 3, 5, 6, 8, 9]);
        assert_eq!(hint.offsets, [1, 2, 4, 5, 7, 8]);
    }

    #[test]
    fn each_caller_path_gets_its_own_frames_and_the_hint_comes_from_path_zero() {
        let mut repairs = StackRepairs::new(0);
        let walk = vec![0x10, 0x90];
        repairs.generations.insert(
            (1, 7, 0),
            unwound(&[0x10, 0x30, 0x90], &[None, Some(4), Some(8)]),
        );
        repairs.generations.insert(
            (1, 7, 5),
            unwound(&[0x10, 0x31, 0x90], &[None, Some(4), Some(8)]),
        );
        let mut stacks = HashMap::from([(7, walk)]);
        // Path 6 was counted but its copy never unwound: the walk, not path 0's frames.
        let repaired = repairs.repair_generation(1, &mut stacks, [(7, 0), (7, 5), (7, 6)]);
        assert_eq!(stacks[&7], [0x10, 0x30, 0x90]);
        assert_eq!(repaired.caller_paths[&(7, 5)], [0x10, 0x31, 0x90]);
        assert_eq!(repaired.caller_paths[&(7, 6)], [0x10, 0x90]);
        assert_eq!(repaired.hints.len(), 1);
        let (id, hint) = repaired.hints[0];
        assert_eq!(
            (id, hint.count, hint.words[0], hint.offsets[0]),
            (7, 1, 0x30, 4)
        );
        assert!(repairs.generations.is_empty());
    }
}
