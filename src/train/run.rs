//! A run directory and what can be rebuilt from it (spec, tokenizer, model at a checkpoint).
use super::checkpoint;
use crate::data::Tok;
use crate::perplexity::CorpusResult;
use crate::model::{Family, GptNeox, LlamaConfig, Model, NeoxConfig};
use crate::run_kind::RunKind;
use crate::spec::{Arch, Spec};
use serde::Serialize;
use crate::{Error, IoContext, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::nn::VarStore;

pub struct RunDir {
    pub path: PathBuf,
}

/// Record the embedding size in the spec (the tokenizer's vocabulary padded to a multiple of 128).
pub fn with_vocab(mut spec: Spec, tok: &Tok) -> Spec {
    spec.model.vocab.get_or_insert(tok.padded_vocab());
    spec
}

pub fn model_config(spec: &Spec) -> NeoxConfig {
    NeoxConfig::from_spec(spec, spec.model.vocab.expect("vocab resolved"))
}

/// The Llama / OLMo 2 config a resolved spec describes (arch llama or olmo2, attention as the spec's).
pub fn llama_config(spec: &Spec) -> LlamaConfig {
    let s = spec.shape();
    LlamaConfig {
        vocab_size: spec.model.vocab.expect("vocab resolved"),
        hidden_size: s.d_model,
        intermediate_size: spec.model.ffn.expect("resolved"),
        num_hidden_layers: s.layers,
        num_attention_heads: s.heads,
        num_key_value_heads: spec.model.kv_heads.unwrap_or(s.heads),
        rms_norm_eps: 1e-5,
        rope_theta: spec.model.rotary_base.unwrap_or(10000.0),
        rope_scaling: crate::model::llama::RopeScaling::Default,
        tie_word_embeddings: spec.model.tie_embeddings.unwrap_or(true),
        max_position_embeddings: spec.seq_len(),
        family: if spec.model.arch == Some(Arch::Olmo2) { Family::Olmo2 } else { Family::Llama },
        attention: crate::attention::Attention::Softmax(spec.model_attention()),
    }
}

/// Build the model a resolved spec describes under `vs` (parameters initialised as the architecture's recipe).
pub fn build_model(spec: &Spec, vs: &VarStore) -> Model {
    match spec.model.arch.unwrap_or_default() {
        Arch::Neox => Model::Neox(GptNeox::new(&vs.root(), model_config(spec))),
        Arch::Llama | Arch::Olmo2 => Model::Llama(crate::model::Llama::new(&vs.root(), llama_config(spec))),
    }
}

impl RunDir {
    /// Create the run directory for `spec` (or reopen it): writes config.yaml on first use and
    /// refuses a directory whose recorded config differs.
    pub fn prepare(spec: &Spec) -> Result<RunDir> {
        let path = spec.output.clone().ok_or_else(|| Error::Spec { file: "spec".into(), key: "output".into(), line: None, msg: "no run directory: set `output:` or pass --out".into() })?;
        let cfg = path.join("config.yaml");
        // Compare meaning, not text: an older config without a key added since resolves to the same
        // spec. The device may differ (a run may resume on another GPU or on the CPU), and so may the
        // data-parallel devices: any worker count dividing the global batch sees the same data.
        let same_device = |s: &mut Spec| {
            s.train.device = None;
            (s.train.devices, s.train.dist_timeout_s) = (None, None);
        };
        RunDir::open(&path, RunKind::Train, spec, |text| crate::spec::from_str(text, &cfg.display().to_string(), &[]), same_device)
    }

    /// Create the run directory `path` for the `kind` run `spec` describes, or reopen it: the one
    /// creator of run directories (train, finetune, linearize). Takes the directory's lock first (one
    /// writer from before the first write to the end of the process); config.yaml is written once,
    /// with `command: <kind>`; a recorded config that `parse`s to a different spec after `normalize`
    /// (which blanks what may change between sessions, e.g. the device) is refused, naming the first
    /// differing line.
    pub fn open<S: PartialEq + Clone + Serialize>(path: &Path, kind: RunKind, spec: &S, parse: impl Fn(&str) -> Result<S>, normalize: impl Fn(&mut S)) -> Result<RunDir> {
        std::fs::create_dir_all(path).at(path)?;
        super::lock::hold(path)?;
        let cfg = path.join("config.yaml");
        let yaml = serde_yaml::to_string(spec).expect("spec serializes");
        if cfg.is_file() {
            let old = parse(&kind.strip(&std::fs::read_to_string(&cfg).at(&cfg)?))?;
            let norm = |s: &S| {
                let mut s = s.clone();
                normalize(&mut s);
                s
            };
            if norm(&old) != norm(spec) {
                let diff = first_difference(&serde_yaml::to_string(&old).expect("spec serializes"), &yaml);
                return Err(Error::Run { dir: path.into(), msg: format!("holds a {} run with a different config ({diff}); choose another output directory", kind.name()) });
            }
        } else {
            std::fs::write(&cfg, kind.record(&yaml)).at(&cfg)?;
        }
        Ok(RunDir { path: path.into() })
    }

    pub fn is_done(&self) -> bool {
        self.path.join("DONE").is_file()
    }

    pub fn mark_done(&self) -> Result<()> {
        let p = self.path.join("DONE");
        std::fs::write(&p, "").at(&p)
    }

    pub fn write_eval(&self, step: u64, results: &BTreeMap<String, CorpusResult>) -> Result<()> {
        let p = self.path.join("eval.json");
        let v = serde_json::json!({"step": step, "corpora": results});
        std::fs::write(&p, serde_json::to_string_pretty(&v)?).at(&p)
    }

    pub fn read_eval(&self) -> Result<BTreeMap<String, CorpusResult>> {
        let p = self.path.join("eval.json");
        let v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).at(&p)?)?;
        Ok(serde_json::from_value(v["corpora"].clone())?)
    }
}

fn first_difference(a: &str, b: &str) -> String {
    for (la, lb) in a.lines().zip(b.lines()) {
        if la != lb {
            return format!("recorded `{}`, now `{}`", la.trim(), lb.trim());
        }
    }
    "different length".into()
}

/// A trained run loaded back: its spec, tokenizer and model at a checkpoint.
pub struct Loaded {
    pub spec: Spec,
    pub tok: Tok,
    pub vs: VarStore,
    pub model: Model,
    pub step: u64,
    pub device: tch::Device,
}

/// Load `run` at checkpoint `step` (default: the newest complete one) on the spec's device.
pub fn load(run: &Path, step: Option<u64>, device: Option<&str>) -> Result<Loaded> {
    let cfg = run.join("config.yaml");
    let text = std::fs::read_to_string(&cfg).at(&cfg)?;
    let spec = crate::spec::from_str(&text, &cfg.display().to_string(), &[])?;
    let tok = Tok::load(spec.data.tokenizer.as_ref().expect("resolved"))?;
    let device = crate::device::parse_device(device.unwrap_or(spec.train.device.as_deref().unwrap_or("auto")))?;
    // Read-only: no lock, and a corrupt checkpoint is skipped (with a warning), not renamed.
    let (step, dir) = match step {
        Some(s) => {
            let c = checkpoint::list(run).into_iter().find(|c| c.0 == s).ok_or_else(|| Error::Run { dir: run.into(), msg: format!("has no complete checkpoint for step {s}") })?;
            checkpoint::verify(&c.1).map_err(|why| Error::Run { dir: run.into(), msg: format!("checkpoint {} is corrupt: {why}", c.1.display()) })?;
            c
        }
        None => checkpoint::newest_verified(run)?.ok_or_else(|| Error::Run { dir: run.into(), msg: "has no complete checkpoint".into() })?,
    };
    let vs = VarStore::new(device);
    let model = build_model(&spec, &vs);
    checkpoint::load_weights(&vs, &dir.join("model.safetensors"))?;
    Ok(Loaded { spec, tok, vs, model, step, device })
}
