//! attnlab: experiments with attention variants that spend less memory on distant tokens.
//!
//! Data flow (ARCHITECTURE.md): spec (YAML) → data (tokenize, shard, batch) → model (GPT-NeoX with
//! vanilla / DAR / uniform attention) → train (AdamW, checkpoints, metrics) → eval (perplexity).
pub mod attention;
pub mod bench;
pub mod data;
pub mod device;
pub mod error;
pub mod eval;
pub mod export;
pub mod finetune;
pub mod hub;
pub mod kernels;
pub mod linearize;
pub mod lora;
pub mod model;
pub mod perplexity;
#[cfg(feature = "analysis")]
pub mod plots;
pub mod progress;
pub mod recall;
pub mod run_kind;
#[cfg(feature = "analysis")]
pub mod report;
pub mod runs;
pub mod spec;
pub mod student_export;
pub mod sweep;
pub mod tensorboard;
pub mod train;
pub mod util;

#[cfg(test)]
pub mod testutil;

pub use error::{Error, IoContext, Result};
