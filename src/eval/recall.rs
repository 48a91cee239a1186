//! `attnlab eval RUN --task recall`: the long-range recall test lives below train, which scores it
//! during training (`src/recall.rs`); this path stays for callers.
pub use crate::recall::*;
