//! Evaluation: rolling perplexity (evaluation.md §2) and the WikiText document rules.
pub mod perplexity;
pub mod wikitext;

pub use perplexity::{CorpusResult, EvalCorpus};
