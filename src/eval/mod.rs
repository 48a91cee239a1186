//! Evaluation: rolling perplexity (evaluation.md §2), the WikiText document rules, generation with KV caches.
pub mod babilong;
pub mod command;
pub mod decode_bench;
pub mod generate;
pub mod infer;
pub mod lm_eval;
pub mod perplexity;
pub mod ruler;
pub mod tasks;
/// The WikiText rules live with the text sources (`data::wikitext`); this path stays for callers.
pub use crate::data::wikitext;

pub use perplexity::{CorpusResult, EvalCorpus};
