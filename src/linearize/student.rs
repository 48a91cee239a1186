//! The student of `attnlab linearize` (`../shared/specs/still.md` §1, §8): a Llama-family model —
//! Llama, OLMo 2, a DAR fine-tune: anything `hf::load_llama` or a llama run directory loads — whose
//! every layer's attention is replaced by a STILL or LoLCATs operator (`attention::Layer::Still` /
//! `Lolcats`). The layer's original attention is kept beside it (`Block::teacher`) as the target of
//! attention transfer and for the teacher's forward (`Pass::Teacher`: the original attention, base
//! projections without LoRA). LoRA adapters sit on the attention projections (`lora::Linear`)
//! and on STILL's gate. Exported students hold the merged weights, `config.json` (the attention in
//! `attnlab_attention`) and `hybrid.yaml` (the operator, what `--set attention.KEY=V` edits).
use crate::attention::cache::repeat_kv;
use crate::attention::still::Probe;
use crate::attention::{is_bottleneck_param, Attention, Layer, LayerDims, Variant};
use crate::model::hf;
use crate::model::llama::{Llama, LlamaConfig, Pass};
use crate::lora::{Lora, LoraConfig};
use crate::{Error, IoContext, Result};
use std::collections::BTreeMap;
use std::path::Path;
use tch::{nn, Kind, Tensor};

/// File names of an export folder (besides `config.json`).
pub const EXPORT_WEIGHTS: &str = "model.safetensors";
pub const EXPORT_VARIANT: &str = "hybrid.yaml";

/// The name of a layer's attention parameter, e.g. `model.layers.3.self_attn.q_proj.weight`.
pub fn attn_param(layer: usize, proj: &str) -> String {
    format!("model.layers.{layer}.self_attn.{proj}.weight")
}

impl Llama {
    /// Build the student in `vs` (empty): a Llama of the teacher's config `cfg` holding a copy of every
    /// variable of `teacher_vs`, then `variant`'s operator in every layer, then LoRA adapters (`lora`,
    /// may have no targets). In this order, so that seeded initialisation of the operators does not
    /// depend on how the base weights were filled.
    pub fn linearized(vs: &nn::VarStore, teacher_vs: &nn::VarStore, cfg: LlamaConfig, variant: &Variant, lora: &LoraConfig) -> Result<Llama> {
        if matches!(cfg.attention, Attention::Linearized(_)) {
            return Err(Error::Other(format!("the teacher is already linearized ({}); linearize a softmax-attention model", cfg.attention.label())));
        }
        let mut m = Llama::build(&vs.root(), cfg)?;
        let src = teacher_vs.variables();
        tch::no_grad(|| -> Result<()> {
            for (name, var) in vs.variables() {
                let s = src.get(&name).ok_or_else(|| Error::Other(format!("teacher has no parameter {name}")))?;
                var.shallow_clone().copy_(&s.to_device(var.device()).to_kind(var.kind()));
            }
            Ok(())
        })?;
        m.replace_attention(&vs.root(), variant)?;
        m.add_lora(&vs.root(), lora)?;
        Ok(m)
    }

    /// Every layer's attention becomes `variant`'s operator (new parameters under `…self_attn.`); the
    /// old attention is kept as the layer's teacher.
    fn replace_attention(&mut self, root: &nn::Path, variant: &Variant) -> Result<()> {
        let attention = Attention::Linearized(variant.clone());
        let c = &self.cfg;
        let (h, hd, d) = (c.num_attention_heads as i64, c.head_dim() as i64, c.hidden_size as i64);
        for (i, b) in self.layers.iter_mut().enumerate() {
            let p = root / "model" / "layers" / i / "self_attn";
            let op = Layer::new(&p, &attention, LayerDims { heads: h, head_dim: hd, d_model: d, layer: i as i64 })?;
            b.teacher = Some(std::mem::replace(&mut b.attn, op));
        }
        self.cfg.attention = attention;
        Ok(())
    }

    /// LoRA adapters on `lora.targets` (q_proj, k_proj, v_proj, o_proj; g_proj for a gated STILL) of
    /// every layer, `<module>.lora_A` / `.lora_B`.
    fn add_lora(&mut self, root: &nn::Path, lora: &LoraConfig) -> Result<()> {
        for (i, b) in self.layers.iter_mut().enumerate() {
            for t in &lora.targets {
                let p = root / "model" / "layers" / i / "self_attn" / t.as_str();
                match (t.as_str(), b.attn.still_mut()) {
                    ("q_proj", _) => b.q_proj.add_lora(&p, lora),
                    ("k_proj", _) => b.k_proj.add_lora(&p, lora),
                    ("v_proj", _) => b.v_proj.add_lora(&p, lora),
                    ("o_proj", _) => b.o_proj.add_lora(&p, lora),
                    ("g_proj", Some(s)) => {
                        if let Some(w) = &s.g_proj {
                            let (o, inp) = (w.size()[0], w.size()[1]);
                            s.g_lora = Some(Lora::new(&p, inp, o, lora));
                        }
                    }
                    // An ungated STILL or LoLCATs layer has no gate to adapt.
                    ("g_proj", _) => {}
                    _ => return Err(Error::Other(format!("lora target `{t}`: no parameter {}", attn_param(i, t)))),
                }
            }
        }
        Ok(())
    }

    /// The linearized operator, if this model has one.
    pub fn variant(&self) -> Option<&Variant> {
        match &self.cfg.attention {
            Attention::Linearized(v) => Some(v),
            Attention::Softmax(_) => None,
        }
    }

    /// Stage 1 (§8): teacher-forced attention transfer. Every layer gets the teacher's hidden state;
    /// q, k, v come from the (frozen, shared) base projections; the loss is 1000 · mean over layers of
    /// mean((y_student − y_teacher)²) over the per-head outputs `[B, H, T, D]`, in fp32, where
    /// y_teacher is the layer's original attention (softmax, or DAR for a DAR teacher). Returns (loss,
    /// per-layer MSE `[L]`, detached).
    pub fn attention_transfer_loss(&self, ids: &Tensor) -> (Tensor, Tensor) {
        let (cos, sin) = self.rope_tables(ids.size()[1], ids.device());
        let mut mses = Vec::new();
        let mut x = tch::no_grad(|| self.embed(ids));
        let n = self.layers.len();
        for i in 0..n {
            let b = &self.layers[i];
            let teacher = b.teacher.as_ref().expect("attention transfer needs a linearized model");
            let a = tch::no_grad(|| self.kv_input(i, &x));
            let ((q, k, v), y_teacher) = tch::no_grad(|| {
                let (q, k, v) = self.layer_qkv(i, &a, &cos, &sin, Pass::Teacher);
                let y = self.layer_attention(i, teacher, &a, (q.shallow_clone(), k.shallow_clone(), v.shallow_clone()), &cos, &sin, false);
                ((q, k, v), y)
            });
            let y = self.layer_attention(i, &b.attn, &a, (q, k, v), &cos, &sin, false);
            mses.push((y.to_kind(Kind::Float) - y_teacher.to_kind(Kind::Float)).square().mean(Kind::Float));
            if i + 1 < n {
                // The teacher's next hidden state from the heads already computed (what
                // `layer_pass(.., Pass::Teacher)` computes, without a second attention).
                x = tch::no_grad(|| self.layer_finish(i, &x, &y_teacher, Pass::Teacher));
            }
        }
        let per_layer = Tensor::stack(&mses, 0);
        (per_layer.mean(Kind::Float) * 1000.0, per_layer.detach())
    }

    /// Mean next-token cross-entropy of the function `pass` names (the student in training or not, or
    /// its teacher), targets `-100` ignored, in fp32.
    pub fn masked_loss(&self, inputs: &Tensor, targets: &Tensor, pass: Pass) -> Tensor {
        let logits = self.logits(&self.hidden_pass(inputs, None, pass)).to_kind(Kind::Float);
        let v = logits.size()[2];
        logits.view([-1, v]).cross_entropy_loss::<Tensor>(&targets.reshape([-1]), None, tch::Reduction::Mean, -100, 0.0)
    }

    /// Every adapter by the name of the weight it adapts (`model.layers.N.self_attn.q_proj.weight`).
    pub fn adapters(&self) -> BTreeMap<String, &Lora> {
        let mut out = BTreeMap::new();
        for (i, b) in self.layers.iter().enumerate() {
            for (t, l) in [("q_proj", &b.q_proj), ("k_proj", &b.k_proj), ("v_proj", &b.v_proj), ("o_proj", &b.o_proj)] {
                if let Some(a) = &l.lora {
                    out.insert(attn_param(i, t), a);
                }
            }
            if let Some(s) = b.attn.still() {
                if let Some(a) = &s.g_lora {
                    out.insert(attn_param(i, "g_proj"), a);
                }
            }
        }
        out
    }

    /// The LoRA tensors alone (`<param>.lora_A` / `.lora_B`), sorted.
    pub fn lora_weights(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::new();
        for (name, l) in self.adapters() {
            let module = name.trim_end_matches(".weight");
            out.push((format!("{module}.lora_A"), l.a.detach().copy()));
            out.push((format!("{module}.lora_B"), l.b.detach().copy()));
        }
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Every variable of the student (`vs` holds the model), each LoRA-adapted weight replaced by its
    /// merged W + (α/r)·B·A, the adapters and the teacher's own parameters (a DAR teacher's
    /// bottlenecks) left out: what an exported student holds.
    pub fn merged_weights(&self, vs: &nn::VarStore) -> Vec<(String, Tensor)> {
        let adapters = self.adapters();
        let teacher_only = |n: &str| self.variant().is_some() && is_bottleneck_param(n);
        let mut out: Vec<(String, Tensor)> = vs
            .variables()
            .into_iter()
            .filter(|(n, _)| !n.ends_with(".lora_A") && !n.ends_with(".lora_B") && !teacher_only(n))
            .map(|(n, w)| {
                let t = match adapters.get(&n) {
                    Some(l) => tch::no_grad(|| l.merged(&w)),
                    None => w.detach().copy(),
                };
                (n, t)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Write the export folder of a linearized model: `model.safetensors` ([`Llama::merged_weights`]),
    /// `config.json` (Hugging Face format, the operator under `attnlab_attention`) and `hybrid.yaml`.
    pub fn save_export(&self, vs: &nn::VarStore, dir: &Path) -> Result<()> {
        let variant = self.variant().ok_or_else(|| Error::Other("save_export: the model is not linearized".into()))?;
        std::fs::create_dir_all(dir).at(dir)?;
        Tensor::write_safetensors(&self.merged_weights(vs), dir.join(EXPORT_WEIGHTS))?;
        let cp = dir.join("config.json");
        std::fs::write(&cp, serde_json::to_string_pretty(&self.cfg.to_hf_json())?).at(&cp)?;
        let hp = dir.join(EXPORT_VARIANT);
        std::fs::write(&hp, serde_yaml::to_string(variant).expect("serializes")).at(&hp)
    }

    /// Load an export folder ([`Llama::save_export`], or one written before the students were Llamas)
    /// onto `device`, with the operator's options changed by `overrides` (`attention.KEY=VALUE`, YAML
    /// values) without retraining: e.g. `attention.tokens_per_chunk=16`, `attention.routing=oracle`,
    /// `attention.linear_branch=false`, `attention.normalizer=max_compensated`. LoRA merged, no adapters.
    pub fn load_export_with(dir: &Path, device: tch::Device, overrides: &[String]) -> Result<(nn::VarStore, Llama)> {
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).at(dir.join(name));
        let mut cfg = LlamaConfig::from_hf_json(&read("config.json")?)?;
        cfg.attention = Attention::Linearized(variant_with_overrides(&read(EXPORT_VARIANT)?, overrides, &dir.join(EXPORT_VARIANT))?);
        let vs = nn::VarStore::new(device);
        let m = Llama::build(&vs.root(), cfg)?;
        let file = dir.join(EXPORT_WEIGHTS);
        let tensors = Tensor::read_safetensors(&file).map_err(|e| Error::Data(format!("{}: {e}", file.display())))?;
        hf::copy_into(&vs, tensors.into_iter().collect(), &file)?;
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

#[cfg(test)]
mod tests;
