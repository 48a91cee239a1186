//! Small helpers shared across modules.
use sha2::{Digest, Sha256};

/// First 12 hex digits of SHA-256: names cache folders and run directories by content.
pub fn short_hash(s: &str) -> String {
    format!("{:x}", Sha256::digest(s.as_bytes()))[..12].to_string()
}
