//! The export folder of a linearized (STILL / LoLCATs) student, as inference reads it: its files
//! (`model.safetensors`, `config.json` with the operator under `attnlab_attention`, `hybrid.yaml`,
//! `tokenizer.json`), loading it with the operator's options overridden, and what eval asks of a
//! linearized Llama (its operator, the probe, oracle routing). `linearize` writes the folder
//! (`Llama::save_export` in `linearize/student.rs`); `eval` and `generate` load it from here, below
//! both (ARCHITECTURE.md, imports point down).
use crate::attention::cache::repeat_kv;
use crate::attention::still::Probe;
use crate::attention::{Attention, Variant};
use crate::data::Tok;
use crate::model::hf;
use crate::model::llama::{Llama, Pass};
use crate::run_kind::RunKind;
use crate::spec::TokenizerSpec;
use crate::{Error, IoContext, Result};
use serde::Deserialize;
use std::path::Path;
use tch::{nn, nn::VarStore, Device, Tensor};

/// File names of an export folder (besides `config.json`).
pub const EXPORT_WEIGHTS: &str = "model.safetensors";
pub const EXPORT_VARIANT: &str = "hybrid.yaml";

/// Where a finished run keeps its merged model ([`Llama::save_export`] plus `tokenizer.json`).
pub const EXPORT_DIR: &str = "export";

/// A finished linearization loaded for inference, from its run directory or its export folder: the
/// student (LoRA merged) and its tokenizer (the folder's tokenizer.json; for exports written before it
/// was saved there, the run spec's tokenizer or the teacher's).
pub fn load_exported(path: &Path, device: Device) -> Result<(VarStore, Llama, Tok)> {
    load_exported_with(path, device, &[])
}

/// [`load_exported`] with the operator's options overridden (`attention.KEY=VALUE`, see
/// [`Llama::load_export_with`]): evaluate the same weights at another κ, routing or normalizer.
pub fn load_exported_with(path: &Path, device: Device, overrides: &[String]) -> Result<(VarStore, Llama, Tok)> {
    let in_export = path.join(EXPORT_VARIANT).is_file();
    let (run, export) = if in_export { (path.parent().unwrap_or(Path::new(".")).to_path_buf(), path.to_path_buf()) } else { (path.to_path_buf(), path.join(EXPORT_DIR)) };
    if !export.join(EXPORT_VARIANT).is_file() {
        return Err(Error::Run { dir: path.into(), msg: format!("has no {EXPORT_DIR}/{} (is the linearize run finished?)", EXPORT_VARIANT) });
    }
    let (vs, hybrid) = Llama::load_export_with(&export, device, overrides)?;
    let tj = export.join("tokenizer.json");
    let tok = if tj.is_file() {
        Tok::load(&TokenizerSpec::Path(tj.display().to_string()))?
    } else {
        let spec: TeacherOf = crate::spec::read_with_overrides(&run.join("config.yaml"), &[]).map_err(|e| Error::Other(format!("{}: no tokenizer.json, and no linearize spec beside it to find one: {e}", export.display())))?;
        teacher_tokenizer(&spec.teacher, spec.tokenizer.as_ref())?
    };
    Ok((vs, hybrid, tok))
}

/// What an export's linearize spec says of its tokenizer (for exports written before tokenizer.json
/// was saved in them).
#[derive(Deserialize)]
struct TeacherOf {
    teacher: String,
    #[serde(default)]
    tokenizer: Option<TokenizerSpec>,
}

/// The spec's `tokenizer`, else the teacher's: its run directory's, or its folder's tokenizer.json.
pub fn teacher_tokenizer(teacher: &str, tokenizer: Option<&TokenizerSpec>) -> Result<Tok> {
    if let Some(spec) = tokenizer {
        return Tok::load(spec);
    }
    let local = Path::new(teacher);
    let cfg = local.join("config.yaml");
    let export = local.join("export").join("tokenizer.json");
    if cfg.is_file() && RunKind::of(local)? == RunKind::Finetune && export.is_file() {
        // A finetune run: the tokenizer its export carries.
        return Tok::load(&TokenizerSpec::Path(export.display().to_string()));
    }
    if cfg.is_file() {
        let spec = crate::spec::from_str(&std::fs::read_to_string(&cfg).at(&cfg)?, &cfg.display().to_string(), &[])?;
        return Tok::load(spec.data.tokenizer.as_ref().expect("resolved"));
    }
    if crate::model::gguf::is_gguf(teacher) {
        return crate::model::gguf::load_tok(teacher);
    }
    let tj = crate::model::hf::resolve(teacher)?.join("tokenizer.json");
    if !tj.is_file() {
        return Err(Error::Other(format!("{teacher}: no tokenizer.json; set `tokenizer:` in the spec")));
    }
    Tok::load(&TokenizerSpec::Path(tj.display().to_string()))
}

impl Llama {
    /// The linearized operator, if this model has one.
    pub fn variant(&self) -> Option<&Variant> {
        match &self.cfg.attention {
            Attention::Linearized(v) => Some(v),
            Attention::Softmax(_) => None,
        }
    }

    /// Load an export folder ([`Llama::save_export`], or one written before the students were Llamas)
    /// onto `device`, with the operator's options changed by `overrides` (`attention.KEY=VALUE`, YAML
    /// values) without retraining: e.g. `attention.tokens_per_chunk=16`, `attention.routing=oracle`,
    /// `attention.linear_branch=false`, `attention.normalizer=max_compensated`. LoRA merged, no adapters.
    pub fn load_export_with(dir: &Path, device: tch::Device, overrides: &[String]) -> Result<(nn::VarStore, Llama)> {
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).at(dir.join(name));
        let mut cfg = hf::read_config(dir)?;
        cfg.attention = Attention::Linearized(variant_with_overrides(&read(EXPORT_VARIANT)?, overrides, &dir.join(EXPORT_VARIANT))?);
        let file = dir.join(EXPORT_WEIGHTS);
        let tensors: std::collections::HashMap<String, Tensor> = crate::model::weights::read_safetensors(&file)?.into_iter().collect();
        hf::check_config(&cfg, &tensors, &dir.join("config.json"))?;
        let vs = nn::VarStore::new(device);
        let m = Llama::build(&vs.root(), cfg)?;
        crate::model::weights::copy_into(&vs, tensors, &file)?;
        Ok((vs, m))
    }

    /// Per layer, what the last token's attention reads (`Still::probe`: its Sel and Win sets and the
    /// shares of its normalizer); `None` for other layers. Inference mode, LoRA applied.
    pub fn probe(&self, ids: &Tensor) -> Vec<Option<Probe>> {
        let _guard = tch::no_grad_guard();
        let (cos, sin) = self.rope_tables(ids.size()[1], ids.device());
        let mut x = self.embed(ids);
        let mut out = Vec::new();
        for (i, b) in self.layers.iter().enumerate() {
            let a = self.kv_input(i, &x);
            let (q, k, v) = self.layer_qkv(i, &a, &cos, &sin, Pass::Eval);
            out.push(b.attn.still().map(|s| s.probe(&q, &repeat_kv(&k, &q))));
            let o = self.layer_attention(i, &b.attn, &a, (q, k, v), &cos, &sin, false);
            x = self.layer_finish(i, &x, &o, Pass::Eval);
        }
        out
    }

    /// The positions every STILL layer with `routing: oracle` selects from now on (see `Still::set_oracle`).
    pub fn set_oracle(&self, positions: Option<Vec<i64>>) {
        for b in &self.layers {
            if let Some(s) = b.attn.still() {
                s.set_oracle(positions.clone());
            }
        }
    }
}

/// The operator of an export's `hybrid.yaml` text with `attention.KEY=VALUE` overrides applied.
pub fn variant_with_overrides(yaml: &str, overrides: &[String], file: &Path) -> Result<Variant> {
    let bad = |msg: String| Error::Data(format!("{}: {msg}", file.display()));
    let mut map = serde_yaml::Mapping::new();
    map.insert("attention".into(), serde_yaml::from_str(yaml).map_err(|e| bad(e.to_string()))?);
    let mut root = serde_yaml::Value::Mapping(map);
    for o in overrides {
        if !o.starts_with("attention.") {
            return Err(bad(format!("--set {o}: a linearized model takes only attention.KEY=VALUE overrides (its operator's options)")));
        }
        crate::spec::apply_override(&mut root, o).map_err(|e| bad(format!("--set {o}: {e}")))?;
    }
    serde_yaml::from_value(root["attention"].clone()).map_err(|e| bad(format!("with {}: {e}", if overrides.is_empty() { "no overrides".to_string() } else { overrides.join(" ") })))
}
