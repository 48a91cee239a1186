//! Checkpoints: `checkpoints/<step>/` holding `model.safetensors` (Hugging Face names),
//! `optimizer.safetensors` (`exp_avg.<name>`, `exp_avg_sq.<name>`) and `state.json`. Written into a
//! temporary folder and renamed, so a folder named by a number is always complete.
use super::optim::AdamW;
use crate::model::neox::is_ignored_buffer;
use crate::{Error, IoContext, Result};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use tch::{nn::VarStore, Tensor};

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct State {
    /// Optimizer steps completed.
    pub step: u64,
    pub tokens: u64,
    pub elapsed_s: f64,
}

/// Complete checkpoints under `run/checkpoints`, oldest first.
pub fn list(run: &Path) -> Vec<(u64, PathBuf)> {
    let mut out: Vec<(u64, PathBuf)> = std::fs::read_dir(run.join("checkpoints"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let step = e.file_name().to_str()?.parse::<u64>().ok()?;
            e.path().join("state.json").is_file().then(|| (step, e.path()))
        })
        .collect();
    out.sort();
    out
}

pub fn save(run: &Path, vs: &VarStore, opt: &AdamW, state: &State, keep: usize) -> Result<PathBuf> {
    let dir = run.join("checkpoints");
    let tmp = dir.join(format!(".tmp-{}", state.step));
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::create_dir_all(&tmp).at(&tmp)?;
    let mut vars: Vec<(String, Tensor)> = vs.variables().into_iter().collect();
    vars.sort_by(|a, b| a.0.cmp(&b.0));
    Tensor::write_safetensors(&vars, tmp.join("model.safetensors"))?;
    let mut moments: Vec<(String, Tensor)> = Vec::new();
    for s in &opt.slots {
        moments.push((format!("exp_avg.{}", s.name), s.exp_avg.shallow_clone()));
        moments.push((format!("exp_avg_sq.{}", s.name), s.exp_avg_sq.shallow_clone()));
    }
    Tensor::write_safetensors(&moments, tmp.join("optimizer.safetensors"))?;
    let sp = tmp.join("state.json");
    std::fs::write(&sp, serde_json::to_string_pretty(state)?).at(&sp)?;
    let fin = dir.join(state.step.to_string());
    let _ = std::fs::remove_dir_all(&fin);
    std::fs::rename(&tmp, &fin).at(&fin)?;
    // Keep the newest `keep`.
    let all = list(run);
    for (_, p) in all.iter().take(all.len().saturating_sub(keep)) {
        let _ = std::fs::remove_dir_all(p);
    }
    Ok(fin)
}

/// Copy weights from a safetensors file into `vs` (HF GPT-NeoX buffers skipped, `lm_head` read as
/// `embed_out`): every variable must be present with its shape; other extras are errors.
pub fn load_weights(vs: &VarStore, file: &Path) -> Result<()> {
    let tensors = Tensor::read_safetensors(file).map_err(|e| Error::Data(format!("{}: {e}", file.display())))?;
    let mut by_name: HashMap<String, Tensor> = tensors.into_iter().filter(|(n, _)| !is_ignored_buffer(n)).collect();
    // transformers ≥ 5 names GPT-NeoX's head `lm_head` in memory; checkpoints say `embed_out`.
    if vs.variables().contains_key("embed_out.weight") && !by_name.contains_key("embed_out.weight") {
        if let Some(t) = by_name.remove("lm_head.weight") {
            by_name.insert("embed_out.weight".into(), t);
        }
    }
    crate::model::hf::copy_into(vs, by_name, file)
}

/// Restore model, optimizer moments and step counter from a checkpoint folder.
pub fn load(dir: &Path, vs: &VarStore, opt: &mut AdamW) -> Result<State> {
    load_weights(vs, &dir.join("model.safetensors"))?;
    let f = dir.join("optimizer.safetensors");
    let moments: HashMap<String, Tensor> = Tensor::read_safetensors(&f).map_err(|e| Error::Data(format!("{}: {e}", f.display())))?.into_iter().collect();
    tch::no_grad(|| -> Result<()> {
        for s in &mut opt.slots {
            for (key, dst) in [(format!("exp_avg.{}", s.name), &mut s.exp_avg), (format!("exp_avg_sq.{}", s.name), &mut s.exp_avg_sq)] {
                let src = moments.get(&key).ok_or_else(|| Error::Data(format!("{}: missing {key}", f.display())))?;
                dst.copy_(src);
            }
        }
        Ok(())
    })?;
    let sp = dir.join("state.json");
    let state: State = serde_json::from_str(&std::fs::read_to_string(&sp).at(&sp)?)?;
    opt.set_steps_done(state.step);
    Ok(state)
}
