//! Text generation with a KV cache per model and attention variant (vanilla: keys/values of every
//! token; DAR / uniform: dar.md §3's latent cache; Llama: per KV head; STILL / LoLCATs students:
//! still.md §6's bounded cache), and the decode benchmark. A prompt is prefilled in one call through
//! the variant's fast forward, the cache is sized for the whole request, tokens are chosen on the
//! device; prompts of several lengths decode together in left-padded batches (`generate_batch`).
use crate::data::Tok;
use crate::data::tokenizer::eos_id;
use crate::student_export::{self, EXPORT_DIR, EXPORT_VARIANT};
use crate::model::llama::LlamaCache;
use crate::model::neox::decode::NeoxCache;
use crate::model::Model;
use crate::{Error, Result};
use serde::Serialize;
use std::path::Path;
use std::time::Instant;
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};

pub enum Cache {
    Neox(NeoxCache),
    Llama(LlamaCache),
}

impl Cache {
    pub fn bytes(&self) -> i64 {
        match self {
            Cache::Neox(c) => c.bytes(),
            Cache::Llama(c) => c.bytes(),
        }
    }

    pub fn len(&self) -> i64 {
        match self {
            Cache::Neox(c) => c.len,
            Cache::Llama(c) => c.len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The most bytes the layers declare they hold after `tokens` tokens (`DecodeCache::bound`).
    pub fn bound(&self, tokens: i64) -> Option<i64> {
        match self {
            Cache::Neox(c) | Cache::Llama(c) => c.bound(tokens),
        }
    }

    /// Count `n` tokens written by device-side steps (`Model::extend_hidden_at`).
    pub fn advance(&mut self, n: i64) {
        match self {
            Cache::Neox(c) | Cache::Llama(c) => c.advance(n),
        }
    }
}

impl Model {
    pub fn new_cache(&self, batch: i64, kind: Kind, device: Device) -> Cache {
        match self {
            Model::Neox(m) => Cache::Neox(m.new_cache(batch, kind, device)),
            Model::Llama(m) => Cache::Llama(m.new_cache(batch, kind, device)),
        }
    }

    /// Logits `[B, n, V]` of `ids` (`[B, n]`) following the cached tokens; extends the cache.
    pub fn extend(&self, cache: &mut Cache, ids: &Tensor) -> Tensor {
        self.logits(&self.extend_hidden(cache, ids))
    }

    /// Final hidden states `[B, n, d]` of `ids` following the cached tokens; extends the cache.
    pub fn extend_hidden(&self, cache: &mut Cache, ids: &Tensor) -> Tensor {
        tch::no_grad(|| match (self, cache) {
            (Model::Neox(m), Cache::Neox(c)) => m.extend_hidden(c, ids),
            (Model::Llama(m), Cache::Llama(c)) => m.extend_hidden(c, ids),
            _ => panic!("cache of another model family"),
        })
    }

    /// One token per row `[B, 1]` at the device-side position `at.pos`: final hidden states
    /// `[B, 1, d]`, every layer's cache written in place and nothing counted on the host (the
    /// caller's `Cache::advance`), so that a CUDA graph captures it (`eval::stepper`). None when
    /// the layers have no such step. Call [`Model::prepare_step_at`] for the position first.
    pub fn extend_hidden_at(&self, cache: &mut Cache, ids: &Tensor, at: &crate::attention::cache::StepAt) -> Option<Tensor> {
        tch::no_grad(|| match (self, cache) {
            (Model::Neox(m), Cache::Neox(c)) => m.extend_hidden_at(c, ids, at),
            (Model::Llama(m), Cache::Llama(c)) => m.extend_hidden_at(c, ids, at),
            _ => panic!("cache of another model family"),
        })
    }

    /// Before the device-side step at position `pos` (known on the host), outside any CUDA graph:
    /// every layer's `LayerOp::prepare_at` (STILL / LoLCATs route a chunk where one starts).
    pub fn prepare_step_at(&self, cache: &mut Cache, pos: i64, reserved: i64) {
        tch::no_grad(|| match (self, cache) {
            (Model::Neox(m), Cache::Neox(c)) => m.prepare_at(c, pos, reserved),
            (Model::Llama(m), Cache::Llama(c)) => m.prepare_at(c, pos, reserved),
            _ => panic!("cache of another model family"),
        })
    }

    /// Whether a device-side step would find every state its first call makes already made (DAR's
    /// absorbed maps, made by the first step): a graph may then record the step without an eager
    /// call before it (`kernels::cuda::graph_warm_once`).
    pub fn step_state_made(&self, cache: &mut Cache) -> bool {
        match (self, cache) {
            (Model::Neox(m), Cache::Neox(c)) => m.step_state_made(c),
            (Model::Llama(m), Cache::Llama(c)) => m.step_state_made(c),
            _ => panic!("cache of another model family"),
        }
    }

    /// An upper estimate of the memory one sample of `tokens` tokens takes in a padded batch: the
    /// prefill's `[T, T]` mask (boolean, and the float bias SDPA may make of it), every layer's keys
    /// and values (and DAR's latents: fewer), and one layer's activations.
    pub fn sample_bytes(&self, tokens: u64) -> u64 {
        let elt = self.head_weight().kind().elt_size_in_bytes() as u64;
        let (d, layers) = match self {
            Model::Neox(m) => (m.cfg.d_model as u64, m.cfg.layers as u64),
            Model::Llama(m) => (m.cfg.hidden_size as u64, m.cfg.num_hidden_layers as u64),
        };
        5 * tokens * tokens + tokens * d * elt * (2 * layers + 16)
    }

    /// Whether rows of one batch may hold prompts of different lengths, left-padded: every layer is
    /// a softmax variant (vanilla, DAR, uniform, window). STILL's / LoLCATs' chunks count from
    /// position 0, so a shifted row would be computed differently.
    pub fn pads_rows(&self) -> bool {
        match self {
            Model::Neox(_) => true,
            Model::Llama(m) => matches!(m.cfg.attention, crate::attention::Attention::Softmax(_)),
        }
    }
}

/// A model loaded for generation, with its tokenizer.
pub struct Loaded {
    pub model: Model,
    pub tok: Tok,
    pub device: Device,
    /// The checkpoint's step (a linearize run: its last).
    pub step: u64,
    /// The tokenizer's end-of-sequence token, which ends a generation.
    pub eos: u32,
    /// The model's own chat template (a GGUF's `tokenizer.chat_template`, an HF folder's
    /// tokenizer_config.json); None for models attnlab trained from scratch.
    pub chat: Option<crate::data::chat::ChatTemplate>,
    /// Owns the model's variables.
    pub vs: VarStore,
}

/// Load what `generate` and `eval --task` read: a llama `.gguf` file or `gguf:NAME`, a training run directory (at checkpoint `step`, default
/// the newest), a finished `finetune` run directory (its export), a finished `linearize` run directory, or its `export/` folder (STILL / LoLCATs students,
/// LoRA merged). `device` overrides the run's (`auto` for exports).
pub fn load(path: &Path, step: Option<u64>, device: Option<&str>) -> Result<Loaded> {
    load_with(path, step, device, &[])
}

/// [`load`] with `--set attention.KEY=VALUE` overrides of a linearized model's operator (other run
/// kinds take none: their attention is part of what was trained).
pub fn load_with(path: &Path, step: Option<u64>, device: Option<&str>, overrides: &[String]) -> Result<Loaded> {
    if crate::model::gguf::is_gguf(&path.to_string_lossy()) {
        return load_gguf(path, step, device, overrides);
    }
    let exported = path.join(EXPORT_VARIANT).is_file() || path.join(EXPORT_DIR).join(EXPORT_VARIANT).is_file();
    let kind = crate::run_kind::RunKind::of(path).ok();
    if !exported {
        if kind == Some(crate::run_kind::RunKind::Linearize) {
            return Err(Error::Run { dir: path.into(), msg: format!("is a linearize run without {}/ (not finished yet)", EXPORT_DIR) });
        }
        if let Some(o) = overrides.first() {
            return Err(Error::Run { dir: path.into(), msg: format!("--set {o}: overrides apply to linearized (STILL / LoLCATs) models only") });
        }
        if kind == Some(crate::run_kind::RunKind::Finetune) {
            return load_finetuned(path, step, device);
        }
        let l = crate::train::run::load(path, step, device)?;
        return Ok(Loaded { eos: eos_id(&l.tok), model: l.model, tok: l.tok, device: l.device, step: l.step, chat: None, vs: l.vs });
    }
    if let Some(s) = step {
        return Err(Error::Run { dir: path.into(), msg: format!("--step {s}: a linearize run is loaded from its final export, not from a checkpoint") });
    }
    let device = crate::device::parse_device(device.unwrap_or("auto"))?;
    let (vs, hybrid, tok) = student_export::load_exported_with(path, device, overrides)?;
    let run = if path.join(EXPORT_VARIANT).is_file() { path.parent().unwrap_or(path) } else { path };
    let step = crate::train::checkpoint::list(run).last().map_or(0, |c| c.0);
    // The teacher's chat template and EOS, when the export carries them (linearize writes them).
    let export = if path.join(EXPORT_VARIANT).is_file() { path.to_path_buf() } else { path.join(EXPORT_DIR) };
    let config = export.join("tokenizer_config.json");
    let chat = if config.is_file() { crate::data::chat::ChatTemplate::from_tokenizer_config(&config)? } else { None };
    let eos = chat.as_ref().and_then(|c| tok.inner.token_to_id(&c.eos_token)).unwrap_or_else(|| eos_id(&tok));
    Ok(Loaded { eos, model: Model::Llama(hybrid), tok, device, step, chat, vs })
}

/// A finished `finetune` run: its `export/` folder (a Hugging Face Llama / OLMo 2 folder, DAR
/// settings in `attnlab_attention`, with its tokenizer).
fn load_finetuned(path: &Path, step: Option<u64>, device: Option<&str>) -> Result<Loaded> {
    let bad = |msg: String| Error::Run { dir: path.into(), msg };
    if let Some(s) = step {
        return Err(bad(format!("--step {s}: a finetune run is loaded from its final export, not from a checkpoint")));
    }
    let export = path.join("export");
    if !export.join("config.json").is_file() {
        return Err(bad("is a finetune run without export/ (not finished yet)".into()));
    }
    let device = crate::device::parse_device(device.unwrap_or("auto"))?;
    let (vs, m) = crate::model::hf::load_llama(&export, device)?;
    let tok = Tok::load(&crate::spec::TokenizerSpec::Path(export.join("tokenizer.json").display().to_string()))?;
    let step = crate::train::checkpoint::list(path).last().map_or(0, |c| c.0);
    let chat = crate::data::chat::ChatTemplate::from_tokenizer_config(&export.join("tokenizer_config.json")).ok().flatten();
    Ok(Loaded { eos: eos_id(&tok), model: Model::Llama(m), tok, device, step, chat, vs })
}

/// A pretrained llama GGUF: fp32 weights, its tokenizer, EOS and chat template from the metadata.
fn load_gguf(path: &Path, step: Option<u64>, device: Option<&str>, overrides: &[String]) -> Result<Loaded> {
    let source = path.to_string_lossy();
    let bad = |msg: String| Error::Other(format!("{source}: {msg}"));
    if let Some(s) = step {
        return Err(bad(format!("--step {s}: a GGUF file has no checkpoints")));
    }
    if let Some(o) = overrides.first() {
        return Err(bad(format!("--set {o}: overrides apply to linearized (STILL / LoLCATs) models only")));
    }
    let device = crate::device::parse_device(device.unwrap_or("auto"))?;
    let file = crate::model::gguf::resolve(&source)?;
    let g = crate::model::gguf::Gguf::open(&file)?;
    let (vs, m) = crate::model::gguf::load_llama(&file.to_string_lossy(), device)?;
    let tok = crate::model::gguf::load_tok(&file.to_string_lossy())?;
    let eos = crate::model::gguf::tokenizer::eos_id(&g).unwrap_or_else(|| eos_id(&tok));
    let chat = crate::model::gguf::tokenizer::chat_template(&g)?;
    Ok(Loaded { eos, model: Model::Llama(m), tok, device, step: 0, chat, vs })
}

/// Greedy when `temperature` is 0, else sampling from softmax(logits / temperature) with `seed`.
#[derive(Debug, Clone, Copy)]
pub struct Sampling {
    pub temperature: f64,
    pub seed: u64,
}

#[derive(Debug, Serialize)]
pub struct Generated {
    pub tokens: Vec<u32>,
    pub prompt_tokens: usize,
    pub prefill_s: f64,
    pub decode_tokens_per_s: f64,
    pub cache_bytes: i64,
    /// Tokens held by the cache at the end.
    pub cache_tokens: i64,
    /// Whether the decode steps ran as CUDA-graph replays.
    pub graphed: bool,
    /// Forward steps run after the prefill.
    pub steps: i64,
}

/// Run the prompt `ids` `[B, T]` into an empty `cache` in one call, through each variant's fast
/// forward (softmax variants: the training kernels; STILL / LoLCATs: the chunk-parallel prefill):
/// logits `[B, 1, V]` of its last token.
pub fn prefill(model: &Model, cache: &mut Cache, ids: &Tensor) -> Tensor {
    let n = ids.size()[1];
    let hidden = model.extend_hidden(cache, ids);
    tch::no_grad(|| model.logits(&hidden.narrow(1, n - 1, 1)))
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

pub use super::stepper::STOP_CHECK_EVERY;

/// Continue `prompt` by up to `max_new` tokens (stopping after `stop` if given). The cache is sized
/// for the whole request up front; each token is chosen on the device and fed back without a trip
/// through the host (`super::stepper`: CUDA graphs where the variant has a device-side step), which
/// reads the tokens every [`STOP_CHECK_EVERY`] steps, so the cache may hold a few tokens past the stop.
pub fn generate(model: &Model, prompt: &[u32], max_new: usize, sampling: Sampling, stop: Option<u32>, device: Device) -> Generated {
    generate_traced(model, prompt, max_new, sampling, stop, device, None).expect("generation without a profiler has no error to return")
}

/// Which part of a generation `bench-decode --profile` traces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Traced {
    /// The decode steps (the default).
    Decode,
    /// The prefill alone: its time in the row is then the profiled one.
    Prefill,
}

impl Traced {
    /// What `bench-decode --profile` traces: ATTNLAB_PROFILE_PREFILL=1 says the prefill.
    pub fn from_env() -> Self {
        if std::env::var("ATTNLAB_PROFILE_PREFILL").is_ok_and(|v| v == "1") {
            Traced::Prefill
        } else {
            Traced::Decode
        }
    }

    /// Its name in trace files and profile lines: `decode` or `prefill`.
    pub fn name(self) -> &'static str {
        match self {
            Traced::Decode => "decode",
            Traced::Prefill => "prefill",
        }
    }
}

/// `generate`, with its decode steps or its prefill under libtorch's profiler when `trace` says which
/// and where: the Chrome trace goes there (`bench-decode --profile`).
pub fn generate_traced(model: &Model, prompt: &[u32], max_new: usize, sampling: Sampling, stop: Option<u32>, device: Device, trace: Option<(&Path, Traced)>) -> Result<Generated> {
    let kind = model.head_weight().kind();
    let mut cache = model.new_cache(1, kind, device);
    let reserved = (prompt.len() + max_new) as i64;
    reserve(&mut cache, reserved);
    let ids = Tensor::from_slice(&prompt.iter().map(|&t| t as i64).collect::<Vec<_>>()).view([1, -1]).to_device(device);
    if let Some((_, Traced::Prefill)) = trace {
        crate::kernels::profiler_start(device.is_cuda())?;
    }
    let t0 = Instant::now();
    let logits = prefill(model, &mut cache, &ids);
    sync(device);
    let prefill_s = t0.elapsed().as_secs_f64();
    if let Some((path, Traced::Prefill)) = trace {
        crate::kernels::profiler_stop(path)?;
    }
    if let Some((_, Traced::Decode)) = trace {
        crate::kernels::profiler_start(device.is_cuda())?;
    }
    let t1 = Instant::now();
    let d = super::stepper::decode(model, &mut cache, &logits, max_new, sampling, stop, reserved);
    sync(device);
    let secs = t1.elapsed().as_secs_f64().max(1e-9);
    if let Some((path, Traced::Decode)) = trace {
        crate::kernels::profiler_stop(path)?;
    }
    // Decode steps per second (one forward per token, as hf_decode.py counts).
    let tokens = d.rows.into_iter().next().unwrap_or_default();
    Ok(Generated { decode_tokens_per_s: d.steps as f64 / secs, tokens, prompt_tokens: prompt.len(), prefill_s, cache_bytes: cache.bytes(), cache_tokens: cache.len(), graphed: d.graphed, steps: d.steps })
}

/// Greedy continuations of several prompts in one batch (softmax variants; see
/// [`Model::pads_rows`]): the prompts are left-padded to the longest (`DecodeCache::set_padding`),
/// prefilled in one forward and decoded together, each row up to `max_new` tokens or its first `stop`
/// (included). Equal to [`generate`] on each prompt alone, up to rounding.
pub fn generate_batch(model: &Model, prompts: &[&[u32]], max_new: usize, stop: Option<u32>, device: Device) -> Vec<Vec<u32>> {
    assert!(model.pads_rows(), "generate_batch: STILL / LoLCATs models decode one prompt at a time");
    let b = prompts.len();
    let len = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    assert!(len > 0, "generate_batch: empty prompts");
    let mut flat = Vec::with_capacity(b * len);
    let mut pads = Vec::with_capacity(b);
    for p in prompts {
        pads.push((len - p.len()) as i64);
        // Filler: token 0, never read by a real token.
        flat.extend(std::iter::repeat_n(0i64, len - p.len()).chain(p.iter().map(|&t| t as i64)));
    }
    let mut cache = model.new_cache(b as i64, model.head_weight().kind(), device);
    let reserved = (len + max_new) as i64;
    reserve(&mut cache, reserved);
    match &mut cache {
        Cache::Neox(c) => c.set_padding(&Tensor::from_slice(&pads).to_device(device)),
        Cache::Llama(c) => c.set_padding(&Tensor::from_slice(&pads).to_device(device)),
    }
    let ids = Tensor::from_slice(&flat).view([b as i64, len as i64]).to_device(device);
    let logits = prefill(model, &mut cache, &ids);
    super::stepper::decode(model, &mut cache, &logits, max_new, Sampling { temperature: 0.0, seed: 0 }, stop, reserved).rows
}

/// Preallocate a cache for `tokens` tokens in all.
pub fn reserve(cache: &mut Cache, tokens: i64) {
    match cache {
        Cache::Neox(c) => c.reserve(tokens),
        Cache::Llama(c) => c.reserve(tokens),
    }
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct DecodeBench {
    pub attention: String,
    pub context: i64,
    pub cache_bytes: i64,
    pub cache_bytes_per_token: f64,
    pub prefill_s: f64,
    pub decode_tokens_per_s: f64,
    /// Which repeat of the (attention, context) measurement (0-based; rows of older runs read as 0).
    #[serde(default)]
    pub repeat: usize,
    /// Tokens decoded.
    #[serde(default)]
    pub new_tokens: usize,
    /// Whether the decode steps ran as CUDA-graph replays (rows of older runs read as false).
    #[serde(default)]
    pub graphed: bool,
    /// FNV-1a of the greedy tokens: rows of one model and context that decode the same tokens
    /// (graphed vs eager: `ATTNLAB_CUDA_GRAPHS=0`) show the same digest.
    #[serde(default)]
    pub tokens_digest: String,
    /// The greedy tokens themselves (where two digests differ: from which step on).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tokens: Vec<u32>,
    /// Decode steps (forward passes) timed (rows of older runs read as 0).
    #[serde(default)]
    pub steps: i64,
}

/// FNV-1a (64 bit) of token ids, as hex.
pub fn tokens_digest(tokens: &[u32]) -> String {
    let h = tokens.iter().flat_map(|t| t.to_le_bytes()).fold(0xcbf29ce484222325u64, |h, b| (h ^ b as u64).wrapping_mul(0x100000001b3));
    format!("{h:016x}")
}

/// Prefill `context` random tokens, then decode `new_tokens` greedily; report cache size and speed.
/// With `trace`, the decode steps run under libtorch's profiler (slower), its trace written there.
pub fn decode_bench(model: &Model, attention: &str, context: i64, new_tokens: usize, device: Device, trace: Option<(&Path, Traced)>) -> Result<DecodeBench> {
    let vocab = model.vocab() as i64;
    tch::manual_seed(0);
    let prompt: Vec<u32> = Vec::<i64>::try_from(Tensor::randint(vocab.min(50277), [context], (Kind::Int64, Device::Cpu))).expect("ids").into_iter().map(|x| x as u32).collect();
    let g = generate_traced(model, &prompt, new_tokens, Sampling { temperature: 0.0, seed: 0 }, None, device, trace)?;
    let total = g.cache_tokens;
    Ok(DecodeBench {
        attention: attention.to_string(),
        context,
        cache_bytes: g.cache_bytes,
        cache_bytes_per_token: g.cache_bytes as f64 / total as f64,
        prefill_s: g.prefill_s,
        decode_tokens_per_s: g.decode_tokens_per_s,
        repeat: 0,
        new_tokens,
        graphed: g.graphed,
        tokens_digest: tokens_digest(&g.tokens),
        tokens: g.tokens,
        steps: g.steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{GptNeox, NeoxConfig};
    use crate::spec::{AttentionKind, Gelu};

    fn tiny(kind: AttentionKind, d_down: usize, window: usize) -> (VarStore, Model) {
        let _rng = crate::testutil::seeded(5);
        let mut vs = VarStore::new(Device::Cpu);
        let attention = crate::testutil::softmax(kind, d_down, window);
        let cfg = NeoxConfig { vocab: 61, d_model: 32, layers: 2, heads: 4, ffn: 64, rotary_pct: 0.25, rotary_base: 10000.0, ln_eps: 1e-5, gelu: Gelu::Erf, attention };
        let m = GptNeox::new(&vs.root(), cfg);
        vs.double();
        (vs, Model::Neox(m))
    }

    /// `n` greedy tokens after `prompt` by the host loop over full forward passes (argmax of the
    /// last logits, appended, again): what cached generation must equal.
    fn forward_loop(m: &Model, prompt: &[u32], n: usize) -> Vec<u32> {
        let mut seq: Vec<i64> = prompt.iter().map(|&t| t as i64).collect();
        let mut out = Vec::new();
        for _ in 0..n {
            let logits = tch::no_grad(|| m.forward(&Tensor::from_slice(&seq).view([1, -1])));
            let id = logits.select(1, -1).argmax(-1, false).int64_value(&[0]);
            out.push(id as u32);
            seq.push(id);
        }
        out
    }

    /// Greedy generation with the token chosen on the device equals the host loop over full forward
    /// passes (argmax of the last logits, appended, again), for every softmax variant; with a stop
    /// token, the output ends at its first occurrence (read back every STOP_CHECK_EVERY steps).
    #[test]
    fn greedy_generation_equals_the_forward_loop_and_stops_at_the_stop_token() {
        let _rng = crate::testutil::rng();
        for (kind, d_down, w) in [(AttentionKind::Vanilla, 0, 0), (AttentionKind::Dar, 8, 3), (AttentionKind::Uniform, 8, 0), (AttentionKind::Window, 0, 4)] {
            let (_vs, m) = tiny(kind, d_down, w);
            let prompt: Vec<u32> = vec![3, 17, 42, 8, 8, 29, 1];
            let want = forward_loop(&m, &prompt, 40);
            let greedy = Sampling { temperature: 0.0, seed: 0 };
            let g = generate(&m, &prompt, 40, greedy, None, Device::Cpu);
            assert_eq!(g.tokens, want, "{kind:?}");
            assert_eq!(g.cache_tokens, (prompt.len() + 39) as i64, "{kind:?}: every new token but the last cached");
            // The same prompts of several lengths in one left-padded batch, and a stop token.
            let prompts: Vec<Vec<u32>> = vec![prompt.clone(), vec![9, 4], vec![11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]];
            let alone: Vec<Vec<u32>> = prompts.iter().map(|p| generate(&m, p, 30, greedy, Some(want[5]), Device::Cpu).tokens).collect();
            let refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
            assert_eq!(generate_batch(&m, &refs, 30, Some(want[5]), Device::Cpu), alone, "{kind:?} batch");
            // Stop tokens taken from inside the first and the second read-back window.
            for pick in [2, STOP_CHECK_EVERY + 9] {
                let at = want.iter().position(|&t| t == want[pick]).unwrap();
                let g = generate(&m, &prompt, 40, greedy, Some(want[pick]), Device::Cpu);
                assert_eq!(g.tokens, want[..=at], "{kind:?}: stop token {} first at {at}", want[pick]);
            }
        }
    }

    /// `bench-decode --profile` traces the part asked for: the prefill once per layer, or every
    /// decode step; the tokens are those of an untraced generation.
    #[test]
    fn traced_generation_profiles_the_prefill_or_the_decode_steps() {
        let _rng = crate::testutil::rng();
        let (_vs, m) = tiny(AttentionKind::Vanilla, 0, 0);
        let prompt: Vec<u32> = vec![3, 17, 42, 8, 8, 29, 1];
        let greedy = Sampling { temperature: 0.0, seed: 0 };
        let want = generate(&m, &prompt, 12, greedy, None, Device::Cpu).tokens;
        let dir = tempfile::tempdir().unwrap();
        let mut norms = Vec::new();
        for part in [Traced::Prefill, Traced::Decode] {
            let path = dir.path().join(format!("{part:?}.json"));
            let g = generate_traced(&m, &prompt, 12, greedy, None, Device::Cpu, Some((&path, part))).unwrap();
            assert_eq!(g.tokens, want, "{part:?}");
            let trace = std::fs::read_to_string(&path).unwrap();
            norms.push(trace.matches("\"aten::layer_norm\"").count());
        }
        // Two layers and the final norm: 5 in the prefill, 5 a step in the 11 decode steps.
        assert!(norms[0] >= 5 && norms[1] >= 5 * norms[0], "layer norms traced (prefill, decode): {norms:?}");
    }

    /// The same for Llama models: vanilla, and STILL / LoLCATs students: 40 greedy tokens after a
    /// 7-token prompt cross five chunk starts of C = 8, and equal the forward loop.
    #[test]
    fn llama_greedy_generation_equals_the_forward_loop() {
        let _rng = crate::testutil::rng();
        let variants = ["", "{kind: still, chunk: 8, tokens_per_chunk: 2}", "{kind: still, chunk: 8, budget: {m: 20, max_len: 48}}", "{kind: lolcats, window: 8}"];
        for yaml in variants {
            let (_vs, m) = crate::testutil::tiny_llama_model(yaml, 61, 6);
            let prompt: Vec<u32> = vec![3, 17, 42, 8, 8, 29, 1];
            let want = forward_loop(&m, &prompt, 40);
            let g = generate(&m, &prompt, 40, Sampling { temperature: 0.0, seed: 0 }, None, Device::Cpu);
            assert_eq!(g.tokens, want, "{yaml}");
            let pick = STOP_CHECK_EVERY + 9;
            let at = want.iter().position(|&t| t == want[pick]).unwrap();
            let g = generate(&m, &prompt, 40, Sampling { temperature: 0.0, seed: 0 }, Some(want[pick]), Device::Cpu);
            assert_eq!(g.tokens, want[..=at], "{yaml}: stop token");
        }
    }
}
