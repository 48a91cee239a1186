//! Small helpers shared across modules.
use sha2::{Digest, Sha256};

/// First 12 hex digits of SHA-256: names cache folders and run directories by content.
pub fn short_hash(s: &str) -> String {
    format!("{:x}", Sha256::digest(s.as_bytes()))[..12].to_string()
}

/// Counts writes of parameters that libtorch's version counters may not see: our C++ shim's fused
/// optimizer step and NCCL's in-place collectives. What is made from parameters and kept between
/// calls (the feature maps' folded matrices) keys on it beside the counters.
static PARAMETER_WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Say that parameters were written behind the version counters' back (see [`parameter_writes`]).
pub fn parameters_written() {
    PARAMETER_WRITES.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
}

/// How many times [`parameters_written`] was called in this process.
pub fn parameter_writes() -> u64 {
    PARAMETER_WRITES.load(std::sync::atomic::Ordering::SeqCst)
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
