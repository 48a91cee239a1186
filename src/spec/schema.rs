//! Spec structs, their defaults (pythia.md §3, dar.md §4.1) and validation. Field names are the
//! YAML contract: add keys, never rename them.
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::PathBuf;

pub use crate::attention::{AttentionImpl, AttentionInit, AttentionKind, AttentionSpec, DarAct};
pub use crate::error::Invalid;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Spec {
    /// Human-readable run name (defaults to the output folder's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    #[serde(default)]
    pub model: ModelSpec,
    #[serde(default)]
    pub attention: AttentionSpec,
    pub data: DataSpec,
    #[serde(default)]
    pub train: TrainSpec,
    #[serde(default)]
    pub eval: EvalSpec,
    #[serde(default)]
    pub checkpoint: CheckpointSpec,
    /// Run directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Flavor {
    #[serde(rename = "tiny")]
    Tiny,
    #[serde(rename = "pythia-14m")]
    Pythia14m,
    #[serde(rename = "pythia-70m")]
    Pythia70m,
    #[serde(rename = "pythia-160m")]
    Pythia160m,
    #[serde(rename = "pythia-410m")]
    Pythia410m,
    /// Llama architecture, tests and CPU teachers: 2 × 64, 4 heads, 2 KV heads, tied embeddings.
    #[serde(rename = "llama-tiny")]
    LlamaTiny,
    /// Llama teacher for GPU runs: 8 × 384, 6 heads, 2 KV heads, SwiGLU 1024, tied (≈ 32M params with a 50k vocab).
    #[serde(rename = "llama-30m")]
    Llama30m,
    /// Llama teacher for GPU runs: 12 × 768, 12 heads, 4 KV heads, SwiGLU 2048, tied (≈ 115M params with a 50k vocab).
    #[serde(rename = "llama-120m")]
    Llama120m,
    /// OLMo 2 architecture, tests and CPU runs: the shape of llama-tiny.
    #[serde(rename = "olmo2-tiny")]
    Olmo2Tiny,
    /// OLMo 2 for GPU runs: the shape of llama-30m.
    #[serde(rename = "olmo2-30m")]
    Olmo230m,
    /// OLMo 2 for GPU runs: the shape of llama-120m.
    #[serde(rename = "olmo2-120m")]
    Olmo2120m,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// GPT-NeoX / Pythia (pythia.md).
    #[default]
    Neox,
    /// Llama (RMSNorm, SwiGLU, full-head RoPE, grouped-query attention).
    Llama,
    /// OLMo 2: Llama's blocks with QK-norm and norms after (not before) attention and MLP.
    Olmo2,
}

impl Arch {
    /// Llama and OLMo 2 share the `model::Llama` code and its spec options.
    pub fn is_llama_family(self) -> bool {
        matches!(self, Arch::Llama | Arch::Olmo2)
    }
}

impl Flavor {
    /// (layers, d_model, heads, peak lr, min lr) from the Pythia configs (pythia.md §3).
    pub fn shape(self) -> (usize, usize, usize, f64, f64) {
        match self {
            Flavor::Tiny => (2, 64, 4, 1e-3, 1e-4),
            Flavor::Pythia14m => (6, 128, 4, 1e-3, 1e-4),
            Flavor::Pythia70m => (6, 512, 8, 1e-3, 1e-4),
            Flavor::Pythia160m => (12, 768, 12, 6e-4, 6e-5),
            Flavor::Pythia410m => (24, 1024, 16, 3e-4, 3e-5),
            Flavor::LlamaTiny | Flavor::Olmo2Tiny => (2, 64, 4, 1e-3, 1e-4),
            Flavor::Llama30m | Flavor::Olmo230m => (8, 384, 6, 1e-3, 1e-4),
            Flavor::Llama120m | Flavor::Olmo2120m => (12, 768, 12, 6e-4, 6e-5),
        }
    }

    /// (architecture, KV heads, MLP width) for the flavor.
    pub fn arch(self) -> (Arch, Option<usize>, Option<usize>) {
        match self {
            Flavor::LlamaTiny => (Arch::Llama, Some(2), Some(176)),
            Flavor::Llama30m => (Arch::Llama, Some(2), Some(1024)),
            Flavor::Llama120m => (Arch::Llama, Some(4), Some(2048)),
            Flavor::Olmo2Tiny => (Arch::Olmo2, Some(2), Some(176)),
            Flavor::Olmo230m => (Arch::Olmo2, Some(2), Some(1024)),
            Flavor::Olmo2120m => (Arch::Olmo2, Some(4), Some(2048)),
            _ => (Arch::Neox, None, None),
        }
    }

    /// Small flavors default to short sequences and batches (CPU-sized).
    fn is_tiny(self) -> bool {
        matches!(self, Flavor::Tiny | Flavor::LlamaTiny | Flavor::Olmo2Tiny)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Gelu {
    /// Exact erf GELU, as Hugging Face GPT-NeoX (pythia.md §1.4).
    #[default]
    Erf,
    /// tanh approximation, as GPT-NeoX's fused bias-GELU used in the original Pythia runs.
    Tanh,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ModelSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flavor: Option<Flavor>,
    /// neox (default for pythia flavors and explicit shapes), llama or olmo2 (defaults for their flavors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arch: Option<Arch>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layers: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub d_model: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heads: Option<usize>,
    /// Embedding rows; default: the tokenizer's vocabulary padded up to a multiple of 128.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vocab: Option<usize>,
    /// MLP width (default 4·d_model).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ffn: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotary_pct: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rotary_base: Option<f64>,
    #[serde(default)]
    pub gelu: Gelu,
    /// Llama: key/value heads (grouped-query attention; default = heads).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_heads: Option<usize>,
    /// Llama: tie lm_head to embed_tokens (default true for llama flavors).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tie_embeddings: Option<bool>,
}

/// Where a tokenizer comes from.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenizerSpec {
    /// `builtin` (the synthetic corpus's word-level vocabulary) or a path to a tokenizer.json.
    Path(String),
    /// `{hf: EleutherAI/pythia-70m}`: tokenizer.json of a Hugging Face model repo.
    Hub { hf: String },
}

/// A text source: local files, Hugging Face dataset files, or the built-in synthetic corpus.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SourceSpec {
    Local(LocalSource),
    Hub { hf: HubSource },
    Synthetic { synthetic: SyntheticSpec },
    /// RULER-format needle documents (evaluation.md §3): a haystack with needles, the question and
    /// its answer. Mixed into real text, it teaches a teacher to fetch a fact from far back.
    Needles { needles: NeedleSpec },
    /// The documents of several sources (batches shuffle blocks, so they interleave in training).
    Mix { mix: Vec<SourceSpec> },
    /// Token ids in Megatron's `.bin` (+ `.idx`) format, read in order (`data.train` only).
    Megatron { megatron: super::megatron::MegatronSource },
}

impl SourceSpec {
    /// Problems a reader would only hit later: (key suffix such as `.needles.docs`, message).
    pub fn check(&self) -> Result<(), Invalid> {
        match self {
            SourceSpec::Synthetic { synthetic } => {
                if synthetic.docs == 0 {
                    return Err((".synthetic.docs".into(), "must be > 0".into()));
                }
                if let Some(RecallGap::Range([lo, hi])) = synthetic.recall_gap {
                    if lo > hi {
                        return Err((".synthetic.recall_gap".into(), format!("[{lo}, {hi}]: want [LO, HI] with LO ≤ HI")));
                    }
                }
                match synthetic.recall_facts {
                    Some(_) if synthetic.recall_gap.is_none() => Err((".synthetic.recall_facts".into(), "is an option of the recall corpus: give recall_gap too".into())),
                    Some(k) if k == 0 || k > MAX_RECALL_FACTS => Err((".synthetic.recall_facts".into(), format!("{k} must be in 1..={MAX_RECALL_FACTS} (one code per person name)"))),
                    _ => Ok(()),
                }
            }
            SourceSpec::Needles { needles: n } => {
                if n.docs == 0 {
                    return Err((".needles.docs".into(), "must be > 0".into()));
                }
                if n.min_words == 0 || n.min_words > n.max_words {
                    return Err((".needles.min_words".into(), format!("need 0 < min_words ({}) ≤ max_words ({})", n.min_words, n.max_words)));
                }
                if n.tasks.is_empty() {
                    return Err((".needles.tasks".into(), "lists no task".into()));
                }
                for (i, t) in n.tasks.iter().enumerate() {
                    let Some(task) = super::ruler_tasks::task(t) else {
                        return Err((format!(".needles.tasks[{i}]"), format!("unknown RULER task `{t}` (one of {})", super::ruler_tasks::TASKS.join(", "))));
                    };
                    if task.haystack == super::ruler_tasks::Haystack::Essay && n.essay.is_none() {
                        return Err((".needles.essay".into(), format!("task `{t}` has an essay haystack: give the essay file")));
                    }
                }
                Ok(())
            }
            SourceSpec::Mix { mix } => {
                if mix.is_empty() {
                    return Err((".mix".into(), "lists no source".into()));
                }
                for (i, s) in mix.iter().enumerate() {
                    if matches!(s, SourceSpec::Megatron { .. }) {
                        return Err((format!(".mix[{i}]"), "a megatron source is already tokenized and in its order; it cannot be mixed".into()));
                    }
                    s.check().map_err(|(k, m)| (format!(".mix[{i}]{k}"), m))?;
                }
                Ok(())
            }
            SourceSpec::Megatron { megatron } => megatron.check(),
            _ => Ok(()),
        }
    }
}

/// Generated needle documents (`crate::data::needles`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NeedleSpec {
    /// RULER task names whose format the documents follow (default: the three S-NIAH tasks).
    #[serde(default = "default_needle_tasks")]
    pub tasks: Vec<String>,
    pub docs: usize,
    #[serde(default = "default_syn_seed")]
    pub seed: u64,
    /// Haystack length in words, drawn uniformly per document from [min_words, max_words].
    #[serde(default = "default_min_words")]
    pub min_words: usize,
    pub max_words: usize,
    /// RULER's essay haystack (`{"text": …}` JSON[.gz] or plain text); needed by essay tasks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub essay: Option<PathBuf>,
}

fn default_needle_tasks() -> Vec<String> {
    vec!["niah_single_1".into(), "niah_single_2".into(), "niah_single_3".into()]
}
fn default_min_words() -> usize {
    50
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LocalSource {
    /// A file (.txt, .jsonl, .jsonl.zst, .jsonl.gz, .json.gz, .parquet), a directory of them, or a
    /// directory prepared by `attnlab data prepare` (holds index.json).
    pub path: PathBuf,
    /// Text field of JSON lines / parquet rows.
    #[serde(default = "default_field")]
    pub field: String,
    /// `text`: one document per file/row; `wikitext`: lm-eval's WikiText document split + detokenizer.
    #[serde(default)]
    pub format: TextFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum TextFormat {
    #[default]
    Text,
    Wikitext,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HubSource {
    pub repo: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    pub files: Vec<String>,
    #[serde(default = "default_field")]
    pub field: String,
}

fn default_field() -> String {
    "text".into()
}

/// The built-in corpus (data::synthetic documents what it generates).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SyntheticSpec {
    #[serde(default = "default_syn_seed")]
    pub seed: u64,
    #[serde(default = "default_syn_docs")]
    pub docs: usize,
    /// The recall corpus instead (data::synthetic::recall_document): codes stated once and asked
    /// for at least this many tokens later; `[LO, HI]`: each document's gap drawn uniformly from
    /// LO..=HI. Unset = the mixed corpus (and no change to config hashes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recall_gap: Option<RecallGap>,
    /// Recall corpus: codes stated (and asked) per document (default: 2–4, drawn per document).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recall_facts: Option<usize>,
}

/// The recall corpus's gap: one value, or `[LO, HI]` drawn uniformly per document.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RecallGap {
    One(usize),
    Range([usize; 2]),
}

impl RecallGap {
    /// (smallest, largest) gap.
    pub fn bounds(self) -> (usize, usize) {
        match self {
            RecallGap::One(g) => (g, g),
            RecallGap::Range([lo, hi]) => (lo, hi),
        }
    }
}

impl std::fmt::Display for RecallGap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RecallGap::One(g) => write!(f, "{g}"),
            RecallGap::Range([lo, hi]) => write!(f, "{lo}–{hi}"),
        }
    }
}

/// The most codes one recall document can state: one per person name of the built-in corpus
/// (data::synthetic: 12 × 12 two-syllable names).
pub const MAX_RECALL_FACTS: usize = 144;

/// The most words a recall document with gap ≤ `gap` and `facts` codes (None: at most 4) can have,
/// without the EOD before it: 9 words per code stated (`the code of NAME is d d d .`), the gap plus
/// at most 7 words of the filler sentence that crosses it, 15 per question (`question : what is
/// the code of NAME ? answer : d d d .`).
pub fn recall_max_words(gap: usize, facts: Option<usize>) -> usize {
    let k = facts.unwrap_or(4);
    9 * k + gap + 7 + 15 * k
}

fn default_syn_seed() -> u64 {
    1
}
fn default_syn_docs() -> usize {
    4000
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSpec {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<TokenizerSpec>,
    pub train: SourceSpec,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<usize>,
    /// Evaluation corpora by name.
    #[serde(default)]
    pub eval: BTreeMap<String, SourceSpec>,
    /// Where tokenized shards of non-prepared sources are cached (default data/cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<PathBuf>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// bf16 autocast on CUDA, fp32 on CPU.
    #[default]
    Auto,
    Fp32,
    Bf16,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct TrainSpec {
    /// Optimizer steps (or give `tokens`; one of the two).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub steps: Option<i64>,
    /// Token budget; steps = ceil(tokens / (batch_size · seq_len)).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens: Option<u64>,
    /// Sequences per optimizer step (global batch).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<i64>,
    /// Micro-batches per step (gradient accumulation); batch_size must divide evenly.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_accum: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lr: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_lr: Option<f64>,
    /// Warmup: a fraction of the decay steps when < 1, else a number of steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<f64>,
    /// Steps of the cosine decay (default = steps).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub decay_steps: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub betas: Option<[f64; 2]>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eps: Option<f64>,
    /// Global-norm gradient clipping (0 = off).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clip: Option<f64>,
    #[serde(default)]
    pub precision: Precision,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    /// auto | cpu | cuda | cuda:N
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// Log a metrics row every N steps.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub log_every: Option<i64>,
    /// Data parallelism: one worker process per entry, `[0, 1]` (GPU indices), `[cuda:0, cuda:1]`
    /// or `[cpu, cpu]` (CPU workers, for tests); the count must divide batch_size. Same as
    /// `attnlab train --gpus 0,1`. Not part of a run's identity: a run resumes with any count.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub devices: Option<Vec<DeviceEntry>>,
    /// Data-parallel gradient all-reduce in fp32 (default) or bf16 (half the traffic).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grad_reduce: Option<GradReduce>,
    /// Data-parallel all-reduce bucket size in MB (default 25).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket_mb: Option<f64>,
    /// Data parallelism: a worker that waits longer than this for its peers stops the job (default 600).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dist_timeout_s: Option<f64>,
}

/// An entry of `train.devices`: a GPU index or a device name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceEntry {
    Index(u32),
    Name(String),
}

impl std::fmt::Display for DeviceEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceEntry::Index(i) => write!(f, "{i}"),
            DeviceEntry::Name(s) => f.write_str(s),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum GradReduce {
    #[default]
    Fp32,
    Bf16,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum EvalProtocol {
    /// Convention A (evaluation.md §2.2): per-document rolling windows, every token scored once.
    #[default]
    Rolling,
    /// Packed stream of T+1-token blocks: fast tracking only, reported as `stream_ppl`.
    Stream,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct EvalSpec {
    /// Evaluate every N steps during training (0 = only at the end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<i64>,
    /// Stop scoring a corpus after this many tokens (finishing the current document).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<usize>,
    /// Windows per forward pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<i64>,
    #[serde(default)]
    pub protocol: EvalProtocol,
    /// The recall test (src/recall.rs) at every evaluation and at the end: `recall/g<G>/{digits,
    /// codes,loss}` in metrics.jsonl, recall.json at the end. Needs the built-in tokenizer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recall: Option<RecallEvalSpec>,
    /// A RULER task scored once on the trained model before the run is marked done: ruler.json and
    /// ruler_samples/ in the run directory, as `attnlab eval RUN --task ruler:<task>` writes them, so
    /// that the score travels with the run's small files where its checkpoint cannot (a GPU machine
    /// that is handed back between calls).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ruler: Option<RulerEvalSpec>,
}

/// `eval.ruler`: the RULER task the trainer scores at the end (`attnlab eval --task ruler:…`'s options).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RulerEvalSpec {
    /// A RULER task name (e.g. niah_single_1).
    pub task: String,
    /// Context lengths in tokens (`--lengths`).
    pub lengths: Vec<usize>,
    /// Samples per length (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<usize>,
    /// Tokens generated per sample (default: RULER's 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_new_tokens: Option<usize>,
    /// RULER's essay haystack, needed by the essay tasks (`--essay`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub essay: Option<PathBuf>,
}

/// `eval.recall`: which recall documents the trainer scores.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RecallEvalSpec {
    /// Gaps scored, each on its own documents (`attnlab eval --task recall --lengths`).
    pub gaps: Vec<usize>,
    /// Documents per gap (default 100).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples: Option<usize>,
    /// Codes per document (default: the training corpus's `recall_facts`, else 2–4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub facts: Option<usize>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct CheckpointSpec {
    /// Save every N steps (0 = only at the end); the final step is always saved.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub every: Option<i64>,
    /// Keep the newest K checkpoints (the final one is never deleted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep: Option<i64>,
}

/// Model shape after defaults: everything explicit.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Shape {
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
}

impl Spec {
    fn flavor_or_tiny(&self) -> Flavor {
        self.model.flavor.unwrap_or(Flavor::Tiny)
    }

    /// Model shape, from explicit keys or the flavor.
    pub fn shape(&self) -> Shape {
        let (l, d, h, _, _) = self.flavor_or_tiny().shape();
        Shape { layers: self.model.layers.unwrap_or(l), d_model: self.model.d_model.unwrap_or(d), heads: self.model.heads.unwrap_or(h) }
    }

    /// Fill every default and check every value. Returns the resolved spec (what config.yaml records)
    /// or the first invalid key with a message. `vocab` stays unresolved until the tokenizer is known.
    pub fn resolve(mut self) -> Result<Spec, Invalid> {
        let bad = |k: &str, m: String| Err((k.to_string(), m));
        let flavor = self.flavor_or_tiny();
        let (_, _, _, lr, min_lr) = flavor.shape();
        let tiny = flavor.is_tiny();
        let (flavor_arch, flavor_kv, flavor_ffn) = flavor.arch();
        let arch = *self.model.arch.get_or_insert(flavor_arch);
        let shape = self.shape();
        for (k, v) in [("model.layers", shape.layers), ("model.d_model", shape.d_model), ("model.heads", shape.heads)] {
            if v == 0 {
                return bad(k, "must be > 0".into());
            }
        }
        if shape.d_model % shape.heads != 0 {
            return bad("model.heads", format!("d_model {} is not divisible by {} heads", shape.d_model, shape.heads));
        }
        self.model.layers = Some(shape.layers);
        self.model.d_model = Some(shape.d_model);
        self.model.heads = Some(shape.heads);
        let ffn = *self.model.ffn.get_or_insert(flavor_ffn.filter(|_| arch == flavor_arch).unwrap_or(4 * shape.d_model));
        if ffn == 0 {
            return bad("model.ffn", "must be > 0".into());
        }
        if arch.is_llama_family() {
            let kv = *self.model.kv_heads.get_or_insert(flavor_kv.unwrap_or(shape.heads));
            if kv == 0 || shape.heads % kv != 0 {
                return bad("model.kv_heads", format!("{kv} must divide heads = {}", shape.heads));
            }
            self.model.tie_embeddings.get_or_insert(true);
            if (shape.d_model / shape.heads) % 2 != 0 {
                return bad("model.heads", "Llama RoPE needs an even head dimension".into());
            }
            for (k, set) in [("model.rotary_pct", self.model.rotary_pct.is_some()), ("model.gelu", self.model.gelu != Gelu::Erf)] {
                if set {
                    return bad(k, "is a GPT-NeoX option; Llama rotates the whole head and uses SwiGLU".into());
                }
            }
            self.model.rotary_base.get_or_insert(10000.0);
        } else {
            for (k, set) in [("model.kv_heads", self.model.kv_heads.is_some()), ("model.tie_embeddings", self.model.tie_embeddings.is_some())] {
                if set {
                    return bad(k, "is a Llama option (GPT-NeoX has full multi-head attention and an untied head)".into());
                }
            }
        }
        let pct = if arch.is_llama_family() { 1.0 } else { *self.model.rotary_pct.get_or_insert(0.25) };
        if !(0.0..=1.0).contains(&pct) {
            return bad("model.rotary_pct", format!("{pct} is not in [0, 1]"));
        }
        let hd = shape.d_model / shape.heads;
        let r = (hd as f64 * pct) as usize;
        if r % 2 != 0 {
            return bad("model.rotary_pct", format!("gives an odd number of rotary dims ({r}) for head dim {hd}"));
        }
        self.model.rotary_base.get_or_insert(10000.0);
        if self.model.vocab == Some(0) {
            return bad("model.vocab", "must be > 0".into());
        }

        // Attention: the kind's own options resolve themselves.
        self.attention.resolve(shape.d_model)?;

        // Data.
        let seq_len = *self.data.seq_len.get_or_insert(if tiny { 128 } else { 2048 });
        if seq_len < 2 {
            return bad("data.seq_len", format!("{seq_len} is too short (need ≥ 2)"));
        }
        if self.data.tokenizer.is_none() {
            self.data.tokenizer = Some(match &self.data.train {
                SourceSpec::Synthetic { .. } => TokenizerSpec::Path("builtin".into()),
                _ => TokenizerSpec::Hub { hf: "EleutherAI/pythia-70m".into() },
            });
        }
        if let Err((key, msg)) = self.data.train.check() {
            return bad(&format!("data.train{key}"), msg);
        }
        for (name, src) in &self.data.eval {
            if name.is_empty() || name.contains('/') || name.contains('=') {
                return bad(&format!("data.eval.{name}"), "corpus names must be non-empty and contain no '/' or '='".into());
            }
            if matches!(src, SourceSpec::Megatron { .. }) {
                return bad(&format!("data.eval.{name}"), "a megatron source holds token ids, not text; it can only be data.train".into());
            }
            if let SourceSpec::Hub { hf } = src {
                if hf.files.is_empty() {
                    return bad(&format!("data.eval.{name}.hf.files"), "lists no files".into());
                }
            }
        }
        self.data.cache.get_or_insert_with(|| PathBuf::from("data/cache"));

        // Training.
        let t = &mut self.train;
        let batch = *t.batch_size.get_or_insert(if tiny { 16 } else { 1024 });
        if batch <= 0 {
            return bad("train.batch_size", format!("{batch} must be > 0"));
        }
        let accum = *t.grad_accum.get_or_insert(1);
        if accum <= 0 || batch % accum != 0 {
            return bad("train.grad_accum", format!("{accum} must be > 0 and divide batch_size {batch}"));
        }
        if let Some(d) = &t.devices {
            if d.is_empty() || batch % d.len() as i64 != 0 {
                return bad("train.devices", format!("{} workers must be at least 1 and divide batch_size {batch}", d.len()));
            }
        }
        let steps = match (t.steps, t.tokens) {
            (Some(_), Some(_)) => return bad("train.tokens", "give either train.steps or train.tokens, not both".into()),
            (Some(s), None) => s,
            (None, Some(tok)) => tok.div_ceil(batch as u64 * seq_len as u64) as i64,
            (None, None) => return bad("train.steps", "is required (or give train.tokens)".into()),
        };
        if steps <= 0 {
            return bad(if t.tokens.is_some() { "train.tokens" } else { "train.steps" }, format!("gives {steps} steps; need > 0"));
        }
        t.steps = Some(steps);
        t.tokens = None;
        let peak = *t.lr.get_or_insert(lr);
        let floor = *t.min_lr.get_or_insert(min_lr);
        if !(peak > 0.0) || !peak.is_finite() {
            return bad("train.lr", format!("{peak} must be > 0"));
        }
        if !(0.0..=peak).contains(&floor) {
            return bad("train.min_lr", format!("{floor} is not in [0, lr = {peak}]"));
        }
        let decay = *t.decay_steps.get_or_insert(steps);
        if decay <= 0 {
            return bad("train.decay_steps", format!("{decay} must be > 0"));
        }
        let warm = *t.warmup.get_or_insert(0.01);
        if !(warm >= 0.0) || (warm >= 1.0 && warm.fract() != 0.0) || warm > decay as f64 {
            return bad("train.warmup", format!("{warm} must be a fraction in [0, 1) or a whole number of steps ≤ decay_steps"));
        }
        let wd = *t.weight_decay.get_or_insert(0.1);
        if !(wd >= 0.0) {
            return bad("train.weight_decay", format!("{wd} must be ≥ 0"));
        }
        let [b1, b2] = *t.betas.get_or_insert([0.9, 0.95]);
        if !(0.0..1.0).contains(&b1) || !(0.0..1.0).contains(&b2) {
            return bad("train.betas", format!("[{b1}, {b2}] must lie in [0, 1)"));
        }
        let eps = *t.eps.get_or_insert(1e-8);
        if !(eps > 0.0) {
            return bad("train.eps", format!("{eps} must be > 0"));
        }
        let clip = *t.clip.get_or_insert(1.0);
        if !(clip >= 0.0) {
            return bad("train.clip", format!("{clip} must be ≥ 0 (0 = off)"));
        }
        t.seed.get_or_insert(1234);
        let dev = t.device.get_or_insert_with(|| "auto".into()).clone();
        if !(dev == "auto" || dev == "cpu" || dev == "cuda" || dev.strip_prefix("cuda:").is_some_and(|n| n.parse::<usize>().is_ok())) {
            return bad("train.device", format!("`{dev}` is not auto, cpu, cuda or cuda:N"));
        }
        let log = *t.log_every.get_or_insert(10);
        if log <= 0 {
            return bad("train.log_every", format!("{log} must be > 0"));
        }

        // Evaluation and checkpoints.
        let every = *self.eval.every.get_or_insert(if tiny { 0 } else { 500 });
        if every < 0 {
            return bad("eval.every", format!("{every} must be ≥ 0"));
        }
        if self.eval.max_tokens == Some(0) {
            return bad("eval.max_tokens", "must be > 0 (omit it for no limit)".into());
        }
        let eb = *self.eval.batch_size.get_or_insert(if tiny { 32 } else { 8 });
        if eb <= 0 {
            return bad("eval.batch_size", format!("{eb} must be > 0"));
        }
        if let Some(r) = &mut self.eval.recall {
            if r.gaps.is_empty() {
                return bad("eval.recall.gaps", "lists no gap".into());
            }
            if let Some(g) = r.gaps.iter().enumerate().find_map(|(i, g)| r.gaps[..i].contains(g).then_some(g)) {
                return bad("eval.recall.gaps", format!("gap {g} is listed twice"));
            }
            let samples = *r.samples.get_or_insert(100);
            if samples == 0 {
                return bad("eval.recall.samples", "must be > 0".into());
            }
            if r.facts.is_none() {
                if let SourceSpec::Synthetic { synthetic } = &self.data.train {
                    r.facts = synthetic.recall_facts;
                }
            }
            if let Some(k) = r.facts.filter(|&k| k == 0 || k > MAX_RECALL_FACTS) {
                return bad("eval.recall.facts", format!("{k} must be in 1..={MAX_RECALL_FACTS} (one code per person name)"));
            }
            if let Some(&g) = r.gaps.iter().find(|&&g| recall_max_words(g, r.facts) + 1 > seq_len) {
                return bad("eval.recall.gaps", format!("gap {g}: its documents reach {} tokens, more than data.seq_len = {seq_len}", recall_max_words(g, r.facts) + 1));
            }
            if !matches!(&self.data.tokenizer, Some(TokenizerSpec::Path(p)) if p == "builtin") {
                return bad("eval.recall", "the recall test needs the built-in word-level tokenizer (data.tokenizer: builtin)".into());
            }
        }
        if let Some(r) = &mut self.eval.ruler {
            let Some(task) = super::ruler_tasks::task(&r.task) else {
                return bad("eval.ruler.task", format!("unknown RULER task `{}` (one of {})", r.task, super::ruler_tasks::TASKS.join(", ")));
            };
            if task.haystack == super::ruler_tasks::Haystack::Essay && r.essay.is_none() {
                return bad("eval.ruler.essay", format!("task `{}` has an essay haystack: give the essay file", r.task));
            }
            if r.lengths.is_empty() || r.lengths.contains(&0) {
                return bad("eval.ruler.lengths", format!("{:?}: want one or more lengths > 0", r.lengths));
            }
            if *r.samples.get_or_insert(100) == 0 {
                return bad("eval.ruler.samples", "must be > 0".into());
            }
            if r.max_new_tokens == Some(0) {
                return bad("eval.ruler.max_new_tokens", "must be > 0".into());
            }
        }
        let ce = *self.checkpoint.every.get_or_insert(if tiny { 0 } else { 1000 });
        if ce < 0 {
            return bad("checkpoint.every", format!("{ce} must be ≥ 0"));
        }
        let keep = *self.checkpoint.keep.get_or_insert(3);
        if keep <= 0 {
            return bad("checkpoint.keep", format!("{keep} must be ≥ 1"));
        }
        if self.name.is_none() {
            self.name = self.output.as_ref().and_then(|o| o.file_name()).map(|s| s.to_string_lossy().into_owned());
        }
        Ok(self)
    }

    // Accessors for resolved specs (resolve() filled every Option these unwrap).
    pub fn steps(&self) -> u64 {
        self.train.steps.expect("resolved") as u64
    }
    pub fn seq_len(&self) -> usize {
        self.data.seq_len.expect("resolved")
    }
    pub fn batch_size(&self) -> usize {
        self.train.batch_size.expect("resolved") as usize
    }
    pub fn grad_accum(&self) -> usize {
        self.train.grad_accum.expect("resolved") as usize
    }
    pub fn seed(&self) -> u64 {
        self.train.seed.expect("resolved")
    }
    /// Warmup in steps (fractions are of decay_steps, as Pythia's `warmup: 0.01`).
    pub fn warmup_steps(&self) -> u64 {
        let w = self.train.warmup.expect("resolved");
        let decay = self.train.decay_steps.expect("resolved") as f64;
        if w < 1.0 { (w * decay).round() as u64 } else { w as u64 }
    }
    pub fn window(&self) -> usize {
        self.attention.window_len().unwrap_or(0)
    }
    pub fn d_down(&self) -> usize {
        self.attention.d_down_width().unwrap_or(0)
    }
    /// The attention a model built from this spec runs: the spec's, with the run's seed for the
    /// kind's own parameter stream.
    pub fn model_attention(&self) -> AttentionSpec {
        self.attention.clone().with_init_seed(self.train.seed.unwrap_or(1234))
    }
    /// The spec as YAML (what config.yaml holds).
    pub fn to_yaml(&self) -> String {
        serde_yaml::to_string(self).expect("spec serializes")
    }
}

impl Spec {
    /// The same experiment with another attention kind (for side-by-side comparisons): each kind
    /// keeps what applies to it (`SoftmaxKind::adopt`: vanilla nothing but the implementation, uniform
    /// the bottleneck, DAR also its window, window-only DAR's window), then resolves.
    pub fn with_attention(&self, kind: AttentionKind) -> Result<Spec, Invalid> {
        let mut s = self.clone();
        s.attention = self.attention.to_kind(kind);
        s.resolve()
    }
}
