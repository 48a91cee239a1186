//! Test-only fault injection for scripts/fault_test.sh, through the environment variable
//! `ATTNLAB_FAULT_INJECT` (comma-separated items; unset in normal use, where every hook is a no-op):
//!
//! - `checkpoint-sleep-ms=N`: sleep N ms in the middle of every checkpoint write (model written,
//!   optimizer and state.json not yet), so that a kill can be timed to land inside it.
//! - `checkpoint-die-at=STAGE`: the process kills itself (SIGKILL) at that stage of its next
//!   checkpoint write (`CHECKPOINT_STAGES`), so that a kill lands exactly there.
//! - `enospc-checkpoint=S`: writing the checkpoint of any step ≥ S fails with ENOSPC ("No space
//!   left on device"), after part of it was written, as a full disk would.
//! - `enospc-metrics=S`: appending a metrics row of any step ≥ S fails the same way.
use crate::{Error, Result};
use std::path::Path;

const VAR: &str = "ATTNLAB_FAULT_INJECT";

/// The value of item `key` in ATTNLAB_FAULT_INJECT, if set.
fn item(key: &str) -> Option<u64> {
    let v = std::env::var(VAR).ok()?;
    v.split(',').filter_map(|kv| kv.split_once('=')).find(|(k, _)| k.trim() == key).and_then(|(_, n)| n.trim().parse().ok())
}

/// The stages of a checkpoint write, in order, where `checkpoint-die-at` may kill it: after the
/// model file, after the optimizer file, after both were flushed and hashed, after state.json, after
/// the temporary folder was flushed, after the rename to its step, and in the middle of deleting an
/// old checkpoint (renamed, not yet removed).
pub const CHECKPOINT_STAGES: [&str; 7] = ["model", "optimizer", "hashed", "state", "synced", "renamed", "pruning"];

/// `checkpoint-die-at`: SIGKILL this process if `stage` is the one named.
pub fn checkpoint_stage(stage: &str) {
    debug_assert!(CHECKPOINT_STAGES.contains(&stage));
    let Ok(v) = std::env::var(VAR) else { return };
    if v.split(',').filter_map(|kv| kv.split_once('=')).any(|(k, s)| k.trim() == "checkpoint-die-at" && s.trim() == stage) {
        // SAFETY: raising a signal in our own process.
        unsafe { libc::raise(libc::SIGKILL) };
    }
}

/// `checkpoint-sleep-ms`: pause inside a checkpoint write.
pub fn checkpoint_pause() {
    if let Some(ms) = item("checkpoint-sleep-ms") {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
}

/// `enospc-<what>=S`: an injected "No space left on device" for `path` at `step` ≥ S.
pub fn io(what: &str, step: Option<u64>, path: &Path) -> Result<()> {
    match (item(&format!("enospc-{what}")), step) {
        (Some(from), Some(step)) if step >= from => Err(Error::io(path, std::io::Error::from_raw_os_error(libc::ENOSPC))),
        _ => Ok(()),
    }
}
