//! Evaluation: rolling perplexity (evaluation.md §2), the WikiText document rules, generation with KV caches.
pub mod babilong;
pub mod cells_file;
pub mod decode_bench;
pub mod generate;
pub mod perplexity;
pub mod ruler;
pub mod tasks;
pub mod wikitext;

pub use perplexity::{CorpusResult, EvalCorpus};
