//! Test-only fault injection for scripts/fault_test.sh, through the environment variable
//! `ATTNLAB_FAULT_INJECT` (comma-separated items; unset in normal use, where every hook is a no-op):
//!
//! - `checkpoint-sleep-ms=N`: sleep N ms in the middle of every checkpoint write (model written,
//!   optimizer and state.json not yet), so that a kill can be timed to land inside it.
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
