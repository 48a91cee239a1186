//! `attnlab export RUN --out DIR`: a training run's checkpoint as a Hugging Face folder
//! (config.json, model.safetensors, tokenizer.json), or a llama GGUF as one (`model::gguf::export`). Llama / OLMo 2 runs export with their attention
//! (DAR and window settings under `attnlab_attention`); GPT-NeoX runs only when vanilla.
use crate::model::{hf, Model};
use crate::{Error, Result};
use std::path::Path;

/// Write `run` at checkpoint `step` (default: the newest) to `out`; returns the step written.
pub fn export(run: &Path, out: &Path, step: Option<u64>) -> Result<u64> {
    if crate::model::gguf::is_gguf(&run.to_string_lossy()) {
        if let Some(s) = step {
            return Err(Error::Other(format!("{}: --step {s}: a GGUF file has no checkpoints", run.display())));
        }
        crate::model::gguf::export(&run.to_string_lossy(), out)?;
        return Ok(0);
    }
    let loaded = crate::train::run::load(run, step, Some("cpu"))?;
    let bad = |msg: String| Error::Run { dir: run.into(), msg };
    let config = match &loaded.model {
        Model::Llama(m) if m.variant().is_some() => return Err(bad("linearize runs write their export/ themselves".into())),
        Model::Llama(m) => m.cfg.to_hf_json(),
        Model::Neox(m) if m.cfg.attention.is_vanilla() => hf::neox_config_json(&m.cfg, loaded.spec.seq_len()),
        Model::Neox(_) => return Err(bad(format!("{} attention has no Hugging Face architecture; only vanilla runs export", loaded.spec.attention.kind().name()))),
    };
    hf::save_folder(&loaded.vs, &config, out)?;
    let tok = loaded.tok.inner.to_string(true).map_err(|e| Error::Other(format!("tokenizer: {e}")))?;
    let path = out.join("tokenizer.json");
    std::fs::write(&path, tok).map_err(|e| Error::io(&path, e))?;
    Ok(loaded.step)
}
