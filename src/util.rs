//! Small helpers shared across modules.
use sha2::{Digest, Sha256};

/// First 12 hex digits of SHA-256: names cache folders and run directories by content.
pub fn short_hash(s: &str) -> String {
    format!("{:x}", Sha256::digest(s.as_bytes()))[..12].to_string()
}

/// Whether autograd records ops (the thread's grad mode: off under `tch::no_grad`). tch sets it but
/// cannot read it; libtorch's setter returns the mode it replaces.
pub fn grad_enabled() -> bool {
    // SAFETY: plain calls that set the thread-local mode and put it back as it was.
    unsafe {
        let was = torch_sys::at_grad_set_enabled(0);
        torch_sys::at_grad_set_enabled(was);
        was != 0
    }
}
