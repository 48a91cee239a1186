//! The mutation harness of the file readers' tests: a seeded loop that takes a small valid file,
//! applies one random defect at a time (a bit flip, a truncation, inserted or deleted bytes, two
//! fields swapped, a huge integer written over a field) and loads the result. Every load must end
//! in a clean error naming the file, or in a load equal to the original's (the defect was harmless);
//! a panic, a load that differs, or memory growing past a bound fails the test, naming the seed and
//! the mutation so that it can be replayed.
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use std::ops::Range;
use std::path::Path;

/// One single-defect change of a file's bytes.
#[derive(Debug, Clone)]
pub enum Mutation {
    Flip { at: usize, bit: u8 },
    Truncate { len: usize },
    Insert { at: usize, bytes: Vec<u8> },
    Delete { at: usize, n: usize },
    /// Two non-overlapping `n`-byte fields exchanged.
    Swap { a: usize, b: usize, n: usize },
    /// A little-endian integer of `width` bytes written at `at`.
    Huge { at: usize, width: usize, value: u64 },
}

impl Mutation {
    pub fn apply(&self, original: &[u8]) -> Vec<u8> {
        let mut b = original.to_vec();
        match *self {
            Mutation::Flip { at, bit } => b[at] ^= 1 << bit,
            Mutation::Truncate { len } => b.truncate(len),
            Mutation::Insert { at, ref bytes } => {
                b.splice(at..at, bytes.iter().copied());
            }
            Mutation::Delete { at, n } => {
                b.drain(at..(at + n).min(b.len()));
            }
            Mutation::Swap { a, b: c, n } => {
                for i in 0..n {
                    b.swap(a + i, c + i);
                }
            }
            Mutation::Huge { at, width, value } => {
                let end = (at + width).min(b.len());
                b[at..end].copy_from_slice(&value.to_le_bytes()[..end - at]);
            }
        }
        b
    }
}

/// Integers that break readers: the largest of each width, sign bits, values near a power of two.
const HUGE: [u64; 8] = [u64::MAX, u64::MAX - 7, 1 << 63, (1 << 63) - 1, u32::MAX as u64, 1 << 31, 1 << 40, 0];

/// A random mutation of a file of `len` bytes, its defect inside `region` (truncations anywhere).
pub fn random(rng: &mut ChaCha8Rng, len: usize, region: &Range<usize>) -> Mutation {
    let at = |rng: &mut ChaCha8Rng| rng.random_range(region.clone());
    match rng.random_range(0..10) {
        0..=3 => Mutation::Flip { at: at(rng), bit: rng.random_range(0..8) },
        4 => Mutation::Truncate { len: rng.random_range(0..len) },
        5 => {
            let n = rng.random_range(1..=8);
            Mutation::Insert { at: at(rng), bytes: (0..n).map(|_| rng.random()).collect() }
        }
        6 => Mutation::Delete { at: at(rng), n: rng.random_range(1..=8) },
        7 => {
            let n = [1, 2, 4, 8][rng.random_range(0..4)];
            let (a, b) = (at(rng), at(rng));
            let (a, b) = (a.min(b), a.max(b));
            if b - a < n || b + n > region.end {
                Mutation::Flip { at: a, bit: rng.random_range(0..8) }
            } else {
                Mutation::Swap { a, b, n }
            }
        }
        _ => {
            // Written whole inside the region (a field of the header, not the payload after it).
            let width = [4, 8][rng.random_range(0..2)];
            match region.end.checked_sub(width).filter(|&last| last >= region.start) {
                Some(last) => Mutation::Huge { at: rng.random_range(region.start..=last), width, value: HUGE[rng.random_range(0..HUGE.len())] },
                None => Mutation::Flip { at: at(rng), bit: rng.random_range(0..8) },
            }
        }
    }
}

/// What a load of a mutated file gave: the same content as the original's, or different content
/// (described; a failure: the reader accepted a defect it should have caught).
pub enum Loaded {
    Same,
    Differs(String),
}

/// What one format's loop saw.
#[derive(Debug, Default, Clone, Copy)]
pub struct Tally {
    pub tried: usize,
    pub refused: usize,
    pub same: usize,
}

/// The peak resident memory of this process so far (VmHWM), in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status.lines().find_map(|l| l.strip_prefix("VmHWM:")).and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok()).map_or(0, |kb| kb * 1024)
}

/// Run `cases` mutations of `original` (seeded by `seed`, defects inside `region`), each written to
/// `file` (its name is what errors must name) and read by `load`. Panics naming the seed, the case
/// and the mutation on a panic inside `load`, on a load that differs, on an error that does not
/// name the file, or when the peak memory grows by more than `memory_bound` bytes.
pub fn run(format: &str, original: &[u8], file: &Path, region: Range<usize>, seed: u64, cases: usize, memory_bound: u64, load: impl Fn(&Path) -> Result<Loaded, String>) -> Tally {
    assert!(!region.is_empty() && region.end <= original.len(), "{format}: region {region:?} of a {}-byte file", original.len());
    std::fs::write(file, original).unwrap();
    assert!(matches!(load(file), Ok(Loaded::Same)), "{format}: the unmutated file does not load as itself");
    // An error names the file, or the folder it is part of (a Hugging Face folder, a run directory).
    let name = file.file_name().unwrap().to_string_lossy().into_owned();
    let folder = file.parent().unwrap().display().to_string();
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut tally = Tally::default();
    let before = peak_rss();
    for case in 0..cases {
        let m = random(&mut rng, original.len(), &region);
        std::fs::write(file, m.apply(original)).unwrap();
        let what = format!("{format} (seed {seed}, case {case}): {m:?}");
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| load(file))) {
            Err(p) => panic!("{what}: the reader panicked: {}", p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default()),
            Ok(Ok(Loaded::Differs(why))) => panic!("{what}: loaded, but not as the original: {why}"),
            Ok(Ok(Loaded::Same)) => tally.same += 1,
            Ok(Err(e)) => {
                assert!(e.contains(&name) || e.contains(&folder), "{what}: the error names neither the file nor its folder: {e}");
                tally.refused += 1;
            }
        }
        tally.tried += 1;
    }
    let grown = peak_rss().saturating_sub(before);
    assert!(grown <= memory_bound, "{format}: peak memory grew by {grown} bytes over {cases} mutations (bound {memory_bound})");
    eprintln!("{format}: {} mutations, {} refused, {} harmless (same load)", tally.tried, tally.refused, tally.same);
    tally
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each kind changes what it says and nothing else; the generator stays inside the region.
    #[test]
    fn mutations_do_what_they_say() {
        let b: Vec<u8> = (0..16).collect();
        assert_eq!(Mutation::Flip { at: 3, bit: 1 }.apply(&b)[3], 3 ^ 2);
        assert_eq!(Mutation::Truncate { len: 5 }.apply(&b), &b[..5]);
        assert_eq!(Mutation::Insert { at: 2, bytes: vec![99] }.apply(&b)[..4], [0, 1, 99, 2]);
        assert_eq!(Mutation::Delete { at: 14, n: 8 }.apply(&b), &b[..14]);
        assert_eq!(Mutation::Swap { a: 0, b: 8, n: 2 }.apply(&b)[..2], [8, 9]);
        assert_eq!(Mutation::Huge { at: 12, width: 8, value: u64::MAX }.apply(&b)[11..], [11, 255, 255, 255, 255]);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for _ in 0..1000 {
            match random(&mut rng, 16, &(4..10)) {
                Mutation::Huge { at, width, .. } => assert!(at >= 4 && at + width <= 10, "{at} + {width} leaves the region"),
                Mutation::Flip { at, .. } | Mutation::Insert { at, .. } | Mutation::Delete { at, .. } => assert!((4..10).contains(&at)),
                Mutation::Swap { a, b, n } => assert!((4..10).contains(&a) && a + n <= b && b + n <= 10),
                Mutation::Truncate { len } => assert!(len < 16),
            }
        }
    }
}
