//! Test helpers: the shared data folder's files, from `$ATTNLAB_SHARED`, `../shared` beside the
//! crate, or the gzip'd copies vendored in `tests/fixtures/shared` (so a clean clone tests alone).
use std::io::Read;

pub mod mutate;
use std::path::PathBuf;

/// Text of `rel` (e.g. `data/tokenizers/gpt-neox-20b.json`) from the first root that has it, plain or
/// as `rel.gz`; panics naming every place searched when none has it.
pub fn shared_text(rel: &str) -> String {
    let mut roots: Vec<PathBuf> = std::env::var_os("ATTNLAB_SHARED").map(PathBuf::from).into_iter().collect();
    roots.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../shared")));
    roots.push(PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/shared")));
    let mut tried = Vec::new();
    for root in roots {
        let plain = root.join(rel);
        if let Ok(s) = std::fs::read_to_string(&plain) {
            return s;
        }
        let gz = root.join(format!("{rel}.gz"));
        if let Ok(f) = std::fs::File::open(&gz) {
            let mut s = String::new();
            flate2::read::GzDecoder::new(f).read_to_string(&mut s).unwrap_or_else(|e| panic!("{}: {e}", gz.display()));
            return s;
        }
        tried.push(plain.display().to_string());
    }
    panic!("test data `{rel}` not found; tried {tried:?} (and .gz); set ATTNLAB_SHARED to the shared folder");
}

/// A tiny Llama-family config (2 layers, d 32, 4 heads of 8, 2 KV heads, tied) for `vocab` tokens.
pub fn tiny_llama(vocab: usize, family: crate::model::Family) -> crate::model::LlamaConfig {
    crate::model::LlamaConfig {
        vocab_size: vocab,
        hidden_size: 32,
        intermediate_size: 64,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        rope_scaling: crate::model::llama::RopeScaling::Default,
        tie_word_embeddings: true,
        max_position_embeddings: 256,
        family,
        attention: Default::default(),
    }
}

/// A softmax kind's options as a test writes them: `{kind, d_down (bottleneck kinds), window (all
/// but vanilla)}`, read through the spec's own serde (so a kind's refusals hold here too).
pub fn softmax(kind: crate::attention::AttentionKind, d_down: usize, window: usize) -> crate::attention::AttentionSpec {
    let mut m = serde_yaml::Mapping::new();
    m.insert("kind".into(), kind.name().into());
    if kind.has_bottleneck() {
        m.insert("d_down".into(), (d_down as i64).into());
    }
    if !kind.is_vanilla() {
        m.insert("window".into(), (window as i64).into());
    }
    serde_yaml::from_value(serde_yaml::Value::Mapping(m)).unwrap_or_else(|e| panic!("{kind:?}: {e}"))
}
