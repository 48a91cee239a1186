//! Evaluation: rolling perplexity (evaluation.md §2), the WikiText document rules, generation with KV caches.
pub mod babilong;
pub mod command;
pub mod decode_bench;
pub mod generate;
pub mod infer;
pub mod lm_eval;
pub mod perplexity;
pub mod recall;
pub mod ruler;
pub mod tasks;
pub mod wikitext;

pub use perplexity::{CorpusResult, EvalCorpus};
