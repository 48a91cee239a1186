//! Data: tokenizers, text sources, the built-in synthetic corpus, tokenized u16 shards with an
//! index (memory-mapped for training), and deterministic batches f(seed, step).
pub mod batches;
pub mod needles;
pub mod shards;
pub mod sources;
pub mod synthetic;
pub mod tokenizer;
pub mod chat;

pub use batches::Batcher;
pub use shards::TokenStream;
pub use tokenizer::Tok;

/// End-of-document id (GPT-NeoX `<|endoftext|>`; also id 0 in the synthetic vocabulary).
pub const EOD: u32 = 0;
