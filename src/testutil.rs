//! Test helpers: the shared data folder's files, from `$ATTNLAB_SHARED`, `../shared` beside the
//! crate, or the gzip'd copies vendored in `tests/fixtures/shared` (so a clean clone tests alone).
use std::io::Read;

pub mod mutate;
use std::path::PathBuf;

/// The SmolLM2 experiments' prose + Alpaca mix at smoke size, from the test data a clean clone has
/// (no ../shared beside it): 20,000 characters of WikiText-2 and the Alpaca sample, written into
/// `dir` as prose.txt and alpaca.jsonl.
pub fn smoke_prose_and_alpaca(dir: &std::path::Path) -> (PathBuf, PathBuf) {
    let (prose, alpaca) = (dir.join("prose.txt"), dir.join("alpaca.jsonl"));
    std::fs::write(&prose, shared_text("data/text/wikitext-2/test.raw.txt").chars().take(20_000).collect::<String>()).expect("writing prose.txt");
    std::fs::write(&alpaca, shared_text("data/alpaca/alpaca_200.jsonl")).expect("writing alpaca.jsonl");
    (prose, alpaca)
}

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

/// A [`tiny_llama`] model in fp64 on the CPU, weights drawn from `seed`, with the attention `yaml`
/// (any kind's options with `kind:`, as a config.json records them) or, for "", vanilla.
pub fn tiny_llama_model(yaml: &str, vocab: usize, seed: i64) -> (tch::nn::VarStore, crate::model::Model) {
    let _rng = seeded(seed);
    let mut cfg = tiny_llama(vocab, crate::model::Family::Llama);
    if !yaml.is_empty() {
        cfg.attention = serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"));
    }
    let mut vs = tch::nn::VarStore::new(tch::Device::Cpu);
    let m = crate::model::Llama::build(&vs.root(), cfg).unwrap_or_else(|e| panic!("{yaml}: {e}"));
    vs.double();
    (vs, crate::model::Model::Llama(m))
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

/// libtorch's random generator is process-wide and cargo runs tests in parallel threads: a test that
/// draws from it (random tensors, a model's initial weights, a training run, sampling) holds this
/// guard from its first draw to its last, so that seeding it gives the same stream whatever runs
/// beside it. The lock is re-entrant on the thread that holds it (a helper that seeds may take it
/// again inside a test that holds it) and survives a test that panicked while holding it.
pub struct RngGuard {
    _lock: Option<std::sync::MutexGuard<'static, ()>>,
}

static RNG_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

thread_local! {
    /// How many guards this thread holds (the lock is taken by the first, released with it).
    static RNG_DEPTH: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

/// The generator to this test alone until the guard drops (no seed set: for a test whose draws
/// only must not disturb a seeded test beside it, or that seeds through the code it runs).
pub fn rng() -> RngGuard {
    let depth = RNG_DEPTH.with(|d| d.replace(d.get() + 1));
    let lock = (depth == 0).then(|| RNG_LOCK.lock().unwrap_or_else(std::sync::PoisonError::into_inner));
    RngGuard { _lock: lock }
}

/// [`rng`], then `tch::manual_seed(seed)`: the same draws follow as in any other run.
pub fn seeded(seed: i64) -> RngGuard {
    let g = rng();
    tch::manual_seed(seed);
    g
}

impl Drop for RngGuard {
    fn drop(&mut self) {
        RNG_DEPTH.with(|d| d.set(d.get() - 1));
    }
}
