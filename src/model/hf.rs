//! Hugging Face checkpoint folders: `config.json` + `model.safetensors`, or a sharded
//! `model.safetensors.index.json`; from a local directory or a hub repo id.
use super::{Llama, LlamaConfig};
use crate::{Error, IoContext, Result};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Tensor};

/// The safetensors files of a checkpoint folder (one file, or the shards its index names).
pub fn weight_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok(vec![single]);
    }
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index).map_err(|_| Error::Data(format!("{}: neither model.safetensors nor model.safetensors.index.json", dir.display())))?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let map = v["weight_map"].as_object().ok_or_else(|| Error::Data(format!("{}: no weight_map", index.display())))?;
    let mut files: Vec<PathBuf> = map.values().filter_map(|f| f.as_str()).map(|f| dir.join(f)).collect();
    files.sort();
    files.dedup();
    Ok(files)
}

/// All tensors of a checkpoint folder by name.
pub fn read_weights(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for f in weight_files(dir)? {
        for (name, t) in Tensor::read_safetensors(&f).map_err(|e| Error::Data(format!("{}: {e}", f.display())))? {
            out.insert(name, t);
        }
    }
    Ok(out)
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
    let cp = dir.join("config.json");
    let cfg = LlamaConfig::from_hf_json(&std::fs::read_to_string(&cp).at(&cp)?)?;
    let vs = VarStore::new(device);
    let model = Llama::new(&vs.root(), cfg);
    copy_into(&vs, read_weights(dir)?, dir)?;
    Ok((vs, model))
}

/// A pretrained Llama-family model from wherever one is named: a `.gguf` file or `gguf:NAME`
/// ([`super::gguf`]), a Hugging Face folder, or `hf:owner/name`.
pub fn load_pretrained(source: &str, device: tch::Device) -> Result<(VarStore, Llama)> {
    if super::gguf::is_gguf(source) {
        return super::gguf::load_llama(source, device);
    }
    load_llama(&resolve(source)?, device)
}

/// Copy named tensors into `vs`: every variable must be present with its shape; a tied `lm_head`
/// may be absent or present (then equal to the embedding); other extras are errors.
pub fn copy_into(vs: &VarStore, mut tensors: HashMap<String, Tensor>, origin: &Path) -> Result<()> {
    let vars = vs.variables();
    if !vars.contains_key("lm_head.weight") {
        tensors.remove("lm_head.weight");
    }
    tensors.retain(|n, _| !n.ends_with("rotary_emb.inv_freq"));
    let mut missing: Vec<&String> = vars.keys().filter(|k| !tensors.contains_key(*k)).collect();
    let mut extra: Vec<&String> = tensors.keys().filter(|k| !vars.contains_key(*k)).collect();
    missing.sort();
    extra.sort();
    if !missing.is_empty() || !extra.is_empty() {
        return Err(Error::Data(format!("{}: missing {missing:?}, unexpected {extra:?}", origin.display())));
    }
    tch::no_grad(|| {
        for (name, var) in &vars {
            let src = &tensors[name];
            if src.size() != var.size() {
                return Err(Error::Data(format!("{}: {name} has shape {:?}, model wants {:?}", origin.display(), src.size(), var.size())));
            }
            var.shallow_clone().copy_(src);
        }
        Ok(())
    })
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
