//! Text generation with a KV cache per model and attention variant (vanilla: keys/values of every
//! token; DAR / uniform: dar.md §3's latent cache; Llama: per KV head; STILL / LoLCATs students:
//! still.md §6's bounded cache), and the decode benchmark.
use crate::data::Tok;
use crate::linearize;
use crate::linearize::student::EXPORT_VARIANT;
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
        tch::no_grad(|| match (self, cache) {
            (Model::Neox(m), Cache::Neox(c)) => m.extend(c, ids),
            (Model::Llama(m), Cache::Llama(c)) => m.extend(c, ids),
            _ => panic!("cache of another model family"),
        })
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
    let exported = path.join(EXPORT_VARIANT).is_file() || path.join(linearize::EXPORT_DIR).join(EXPORT_VARIANT).is_file();
    let kind = crate::run_kind::RunKind::of(path).ok();
    if !exported {
        if kind == Some(crate::run_kind::RunKind::Linearize) {
            return Err(Error::Run { dir: path.into(), msg: format!("is a linearize run without {}/ (not finished yet)", linearize::EXPORT_DIR) });
        }
        if let Some(o) = overrides.first() {
            return Err(Error::Run { dir: path.into(), msg: format!("--set {o}: overrides apply to linearized (STILL / LoLCATs) models only") });
        }
        if kind == Some(crate::run_kind::RunKind::Finetune) {
            return load_finetuned(path, step, device);
        }
        let l = crate::train::run::load(path, step, device)?;
        return Ok(Loaded { eos: linearize::eos_id(&l.tok), model: l.model, tok: l.tok, device: l.device, step: l.step, chat: None, vs: l.vs });
    }
    if let Some(s) = step {
        return Err(Error::Run { dir: path.into(), msg: format!("--step {s}: a linearize run is loaded from its final export, not from a checkpoint") });
    }
    let device = crate::device::parse_device(device.unwrap_or("auto"))?;
    let (vs, hybrid, tok) = linearize::load_exported_with(path, device, overrides)?;
    let run = if path.join(EXPORT_VARIANT).is_file() { path.parent().unwrap_or(path) } else { path };
    let step = crate::train::checkpoint::list(run).last().map_or(0, |c| c.0);
    Ok(Loaded { eos: linearize::eos_id(&tok), model: Model::Llama(hybrid), tok, device, step, chat: None, vs })
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
    Ok(Loaded { eos: linearize::eos_id(&tok), model: Model::Llama(m), tok, device, step, chat, vs })
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
    let eos = crate::model::gguf::tokenizer::eos_id(&g).unwrap_or_else(|| linearize::eos_id(&tok));
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
}

/// Prefill in blocks of this many tokens: the explicit attention of a block over the cache costs
/// O(block × context) memory.
const PREFILL_BLOCK: i64 = 1024;

pub fn prefill(model: &Model, cache: &mut Cache, ids: &Tensor) -> Tensor {
    let n = ids.size()[1];
    let mut last = Tensor::new();
    let mut at = 0;
    while at < n {
        let len = PREFILL_BLOCK.min(n - at);
        last = model.extend(cache, &ids.narrow(1, at, len)).narrow(1, len - 1, 1);
        at += len;
    }
    last
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// Continue `prompt` by up to `max_new` tokens (stopping after `stop` if given).
pub fn generate(model: &Model, prompt: &[u32], max_new: usize, sampling: Sampling, stop: Option<u32>, device: Device) -> Generated {
    let kind = model.head_weight().kind();
    let mut cache = model.new_cache(1, kind, device);
    let ids = Tensor::from_slice(&prompt.iter().map(|&t| t as i64).collect::<Vec<_>>()).view([1, -1]).to_device(device);
    let t0 = Instant::now();
    let mut logits = prefill(model, &mut cache, &ids);
    sync(device);
    let prefill_s = t0.elapsed().as_secs_f64();
    tch::manual_seed(sampling.seed as i64);
    let mut out = Vec::new();
    let t1 = Instant::now();
    for _ in 0..max_new {
        let l = logits.view([-1]).to_kind(Kind::Float);
        let next = if sampling.temperature <= 0.0 { l.argmax(0, false) } else { (l / sampling.temperature).softmax(0, Kind::Float).multinomial(1, false).view([]) };
        let id = next.int64_value(&[]) as u32;
        out.push(id);
        if Some(id) == stop {
            break;
        }
        logits = model.extend(&mut cache, &Tensor::from_slice(&[id as i64]).view([1, 1]).to_device(device));
    }
    sync(device);
    let secs = t1.elapsed().as_secs_f64().max(1e-9);
    Generated { decode_tokens_per_s: out.len() as f64 / secs, tokens: out, prompt_tokens: prompt.len(), prefill_s, cache_bytes: cache.bytes(), cache_tokens: cache.len() }
}

#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct DecodeBench {
    pub attention: String,
    pub context: i64,
    pub cache_bytes: i64,
    pub cache_bytes_per_token: f64,
    pub prefill_s: f64,
    pub decode_tokens_per_s: f64,
}

/// Prefill `context` random tokens, then decode `new_tokens` greedily; report cache size and speed.
pub fn decode_bench(model: &Model, attention: &str, context: i64, new_tokens: usize, device: Device) -> DecodeBench {
    let vocab = model.vocab() as i64;
    tch::manual_seed(0);
    let prompt: Vec<u32> = Vec::<i64>::try_from(Tensor::randint(vocab.min(50277), [context], (Kind::Int64, Device::Cpu))).expect("ids").into_iter().map(|x| x as u32).collect();
    let g = generate(model, &prompt, new_tokens, Sampling { temperature: 0.0, seed: 0 }, None, device);
    let total = g.cache_tokens;
    DecodeBench {
        attention: attention.to_string(),
        context,
        cache_bytes: g.cache_bytes,
        cache_bytes_per_token: g.cache_bytes as f64 / total as f64,
        prefill_s: g.prefill_s,
        decode_tokens_per_s: g.decode_tokens_per_s,
    }
}
