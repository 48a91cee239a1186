//! Hugging Face checkpoint folders: `config.json` + `model.safetensors`, or a sharded
//! `model.safetensors.index.json`; from a local directory or a hub repo id. The safetensors files
//! are read and checked by `super::weights`; config.json is checked against their tensors before a
//! layer is built ([`check_config`]).
use super::weights::{copy_into, read_safetensors};
use super::{Llama, LlamaConfig};
use crate::{Error, IoContext, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Tensor};

/// `dir` must be a folder (a Hugging Face checkpoint is a folder, a GGUF model a `.gguf` file).
fn folder(dir: &Path) -> Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(Error::Data(format!(
            "{}: is a file, not a Hugging Face model folder (config.json + model.safetensors); a GGUF model's name ends in .gguf",
            dir.display()
        ))),
        Err(e) => Err(Error::io(dir, e)),
    }
}

/// The safetensors files of a checkpoint folder (one file, or the shards its index names).
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    folder(dir)?;
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).map_err(|_| Error::Data(format!("{}: neither model.safetensors nor model.safetensors.index.json", dir.display())))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Data(format!("{}: {e}", index.display())))?;
    let map = v["weight_map"].as_object().ok_or_else(|| Error::Data(format!("{}: no weight_map", index.display())))?;
    let mut files = Vec::new();
    for (tensor, f) in map {
        // A shard is a file of this folder: no path above or beside it.
        let name = f.as_str().filter(|f| !f.is_empty() && Path::new(f).components().all(|c| matches!(c, std::path::Component::Normal(_))));
        let name = name.ok_or_else(|| Error::Data(format!("{}: weight_map.{tensor} = {f}: expected the name of a file in the folder", index.display())))?;
        files.push(dir.join(name));
    }
    files.sort();
    files.dedup();
    Ok(files)
}

/// All tensors of a checkpoint folder by name (a name in two shards is an error).
pub fn read_weights(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    let mut from: HashMap<String, PathBuf> = HashMap::new();
    for f in weight_files(dir)? {
        for (name, t) in read_safetensors(&f)? {
            if let Some(other) = from.insert(name.clone(), f.clone()) {
                return Err(Error::Data(format!("{}: tensor `{name}` is in two shards, {} and {}", dir.display(), other.display(), f.display())));
            }
            out.insert(name, t);
        }
    }
    Ok(out)
}

/// config.json against the tensors before a layer is built (so that a config claiming a thousand
/// layers or a huge width is an error naming its key, not an allocation that never ends): the layer
/// count against the `model.layers.N` present, the vocabulary and width against
/// `model.embed_tokens.weight`, the FFN width against `model.layers.0.mlp.up_proj.weight`. The full
/// check of every tensor is `copy_into`'s.
pub fn check_config(cfg: &LlamaConfig, tensors: &HashMap<String, Tensor>, config: &Path) -> Result<()> {
    let bad = |msg: String| Error::Data(format!("{}: {msg}", config.display()));
    let layers: std::collections::BTreeSet<usize> =
        tensors.keys().filter_map(|n| n.strip_prefix("model.layers.")?.split_once('.')?.0.parse().ok()).collect();
    let have = layers.last().map_or(0, |&l| l + 1);
    if have != cfg.num_hidden_layers {
        let range = if have == 0 { "no model.layers.N".to_string() } else { format!("layers model.layers.0 to model.layers.{}", have - 1) };
        return Err(bad(format!("num_hidden_layers = {}, but the weights have {range}", cfg.num_hidden_layers)));
    }
    let shape = |name: &str| tensors.get(name).map(|t| t.size()).ok_or_else(|| bad(format!("the weights have no `{name}`")));
    let embed = shape("model.embed_tokens.weight")?;
    if embed != [cfg.vocab_size as i64, cfg.hidden_size as i64] {
        return Err(bad(format!("vocab_size = {}, hidden_size = {}, but model.embed_tokens.weight has shape {embed:?}", cfg.vocab_size, cfg.hidden_size)));
    }
    if cfg.num_hidden_layers > 0 {
        let up = shape("model.layers.0.mlp.up_proj.weight")?;
        if up != [cfg.intermediate_size as i64, cfg.hidden_size as i64] {
            return Err(bad(format!("intermediate_size = {}, but model.layers.0.mlp.up_proj.weight has shape {up:?}", cfg.intermediate_size)));
        }
    }
    Ok(())
}

/// config.json of folder `dir`, its errors naming the file.
pub fn read_config(dir: &Path) -> Result<LlamaConfig> {
    folder(dir)?;
    let cp = dir.join("config.json");
    let text = std::fs::read_to_string(&cp).at(&cp)?;
    LlamaConfig::from_hf_json(&text).map_err(|e| match e {
        Error::Data(m) => Error::Data(format!("{}: {}", cp.display(), m.strip_prefix("config.json: ").unwrap_or(&m))),
        e => e,
    })
}

/// A local folder as is, or `hf:owner/name` fetched through the hub (config, index, shards, tokenizer).
pub fn resolve(source: &str) -> Result<PathBuf> {
    let Some(repo) = source.strip_prefix("hf:") else { return Ok(PathBuf::from(source)) };
    let config = crate::hub::model_file(repo, "config.json")?;
    let dir = config.parent().expect("file has a folder").to_path_buf();
    if crate::hub::model_file(repo, "model.safetensors").is_err() {
        let index = crate::hub::model_file(repo, "model.safetensors.index.json")?;
        for f in weight_files(index.parent().expect("folder"))? {
            crate::hub::model_file(repo, &f.file_name().expect("file").to_string_lossy())?;
        }
    }
    let _ = crate::hub::model_file(repo, "tokenizer.json");
    Ok(dir)
}

/// Load a Llama checkpoint folder into a new model on `device`.
pub fn load_llama(dir: &Path, device: tch::Device) -> Result<(VarStore, Llama)> {
    let cfg = read_config(dir)?;
    let weights = read_weights(dir)?;
    check_config(&cfg, &weights, &dir.join("config.json"))?;
    let vs = VarStore::new(device);
    let model = Llama::build(&vs.root(), cfg)?;
    copy_into(&vs, weights, dir)?;
    Ok((vs, model))
}

/// Write a Llama model as a Hugging Face folder: config.json + model.safetensors (fp32).
pub fn save_llama(vs: &VarStore, cfg: &LlamaConfig, dir: &Path) -> Result<()> {
    save_folder(vs, &cfg.to_hf_json(), dir)
}

/// Hugging Face `config.json` of a GPT-NeoX model: `GPTNeoXForCausalLM` when vanilla, else attnlab's
/// own architecture with its remote code ([`remote_code`]) and the attention under `attnlab_attention`.
pub fn neox_config_json(c: &super::NeoxConfig, max_positions: usize) -> serde_json::Value {
    let mut v = serde_json::json!({
        "architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
        "vocab_size": c.vocab, "hidden_size": c.d_model, "num_hidden_layers": c.layers,
        "num_attention_heads": c.heads, "intermediate_size": c.ffn, "rotary_pct": c.rotary_pct,
        "rotary_emb_base": c.rotary_base, "layer_norm_eps": c.ln_eps, "use_parallel_residual": true,
        "hidden_act": if c.gelu == crate::spec::Gelu::Erf { "gelu" } else { "gelu_new" },
        "tie_word_embeddings": false, "max_position_embeddings": max_positions,
        "bos_token_id": 0, "eos_token_id": 0, "attention_bias": true, "torch_dtype": "float32"
    });
    if !c.attention.is_vanilla() {
        v[ATTENTION_KEY] = serde_json::to_value(&c.attention).expect("serializes");
        remote_code(&mut v, RemoteFamily::Neox, true);
    }
    v
}

/// config.json key holding the attention of an attnlab model.
pub const ATTENTION_KEY: &str = "attnlab_attention";

/// A model family under attnlab's own architecture names (python/attnlab_hf/).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteFamily {
    Neox,
    Llama,
    Olmo2,
}

impl RemoteFamily {
    /// (model_type, module, class stem): `attnlab_llama`, `attnlab_llama.py`, `AttnlabLlama{Config, ForCausalLM}`.
    pub fn names(self) -> (&'static str, &'static str, &'static str) {
        match self {
            RemoteFamily::Neox => ("attnlab_gpt_neox", "attnlab_gpt_neox", "AttnlabGPTNeoX"),
            RemoteFamily::Llama => ("attnlab_llama", "attnlab_llama", "AttnlabLlama"),
            RemoteFamily::Olmo2 => ("attnlab_olmo2", "attnlab_olmo2", "AttnlabOlmo2"),
        }
    }
}

/// The modeling code every remote-code export carries (python/attnlab_hf/, built into the binary).
pub const REMOTE_CODE: [(&str, &str); 5] = [
    ("attnlab_attention.py", include_str!("../../python/attnlab_hf/attnlab_attention.py")),
    ("attnlab_linearized.py", include_str!("../../python/attnlab_hf/attnlab_linearized.py")),
    ("attnlab_gpt_neox.py", include_str!("../../python/attnlab_hf/attnlab_gpt_neox.py")),
    ("attnlab_llama.py", include_str!("../../python/attnlab_hf/attnlab_llama.py")),
    ("attnlab_olmo2.py", include_str!("../../python/attnlab_hf/attnlab_olmo2.py")),
];

/// Make `config` name attnlab's architecture for `family`: a `model_type` and `architectures` stock
/// transformers does not know, so that a non-vanilla model never loads silently as the stock class
/// (which would drop its bottleneck, or ignore its window, and compute another model). With
/// `runnable` (the remote code implements the attention), `auto_map` points `AutoConfig` and
/// `AutoModelForCausalLM` at the modeling files [`write_remote_code`] then writes beside it; without
/// it, loading fails even with `trust_remote_code`.
pub fn remote_code(config: &mut serde_json::Value, family: RemoteFamily, runnable: bool) {
    let (model_type, module, stem) = family.names();
    config["model_type"] = model_type.into();
    config["architectures"] = serde_json::json!([format!("{stem}ForCausalLM")]);
    if runnable {
        config["auto_map"] = serde_json::json!({
            "AutoConfig": format!("{module}.{stem}Config"),
            "AutoModelForCausalLM": format!("{module}.{stem}ForCausalLM"),
        });
    }
}

/// The modeling files of [`REMOTE_CODE`] into `dir` when `config`'s `auto_map` names them.
pub fn write_remote_code(dir: &Path, config: &serde_json::Value) -> Result<()> {
    if config.get("auto_map").is_some() {
        for (name, code) in REMOTE_CODE {
            let p = dir.join(name);
            std::fs::write(&p, code).at(&p)?;
        }
    }
    Ok(())
}

/// Write `vs` as a Hugging Face folder with the given config.json (fp32 safetensors), and the
/// modeling files of [`REMOTE_CODE`] when the config's `auto_map` names them.
pub fn save_folder(vs: &VarStore, config: &serde_json::Value, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir).at(dir)?;
    let cp = dir.join("config.json");
    std::fs::write(&cp, serde_json::to_string_pretty(config)?).at(&cp)?;
    write_remote_code(dir, config)?;
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&vars, dir.join("model.safetensors"))?;
    Ok(())
}
