//! Evaluation: rolling perplexity (evaluation.md §2), the WikiText document rules, generation with KV caches.
pub mod babilong;
pub mod command;
pub mod decode_bench;
pub mod generate;
pub mod infer;
pub mod lm_eval;
pub mod recall;
pub mod stepper;
pub mod ruler;
pub mod saliency_words;
pub mod tasks;
/// The WikiText rules live with the text sources (`data::wikitext`); this path stays for callers.
pub use crate::data::wikitext;
/// Perplexity lives below train, which evaluates with it (`src/perplexity.rs`); this path stays for callers.
pub use crate::perplexity;

pub use perplexity::{CorpusResult, EvalCorpus};
