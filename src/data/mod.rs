//! Data: tokenizers, text sources, the built-in synthetic corpus, tokenized u16 shards with an
//! index (memory-mapped for training), Megatron `.bin`/`.idx` token data read in place, and
//! deterministic batches f(seed, step).
pub mod batches;
pub mod megatron;
pub mod needles;
pub mod niah;
pub mod shards;
pub mod sources;
pub mod synthetic;
pub mod tokenizer;
pub mod wikitext;
pub mod chat;

pub use batches::{Batcher, TokenSource};
pub use shards::TokenStream;
pub use tokenizer::Tok;

/// End-of-document id (GPT-NeoX `<|endoftext|>`; also id 0 in the synthetic vocabulary).
pub const EOD: u32 = 0;

use crate::spec::SourceSpec;
use std::path::Path;
use std::sync::Arc;

/// Make a training source ready to open (tokenize text into the cache, download hub files) without
/// keeping it open: in data-parallel runs rank 0 does this while the others wait.
pub fn prepare_train(src: &SourceSpec, tok: &Tok, cache: &Path, quiet: bool) -> crate::Result<()> {
    match src {
        SourceSpec::Megatron { megatron } => megatron::MegatronData::from_spec(megatron).map(drop),
        _ => shards::ensure_prepared(src, tok, cache, quiet).map(drop),
    }
}

/// The training batches of a source: shuffled blocks of its prepared shards, or a Megatron `.bin`
/// in stream order from `start_sample` (which must hold `samples_needed` samples after it).
pub fn train_batcher(src: &SourceSpec, tok: &Tok, cache: &Path, seq_len: usize, seed: u64, samples_needed: u64, quiet: bool) -> crate::Result<Batcher> {
    match src {
        SourceSpec::Megatron { megatron } => {
            let data = megatron::MegatronData::from_spec(megatron)?;
            Batcher::sequential(Arc::new(data), seq_len, megatron.start_sample, samples_needed)
        }
        _ => Batcher::new(Arc::new(TokenStream::open(&shards::ensure_prepared(src, tok, cache, quiet)?)?), seq_len, seed),
    }
}
