//! The student of `attnlab linearize` (`../shared/specs/still.md` §1, §8): a Llama-family model —
//! Llama, OLMo 2, a DAR fine-tune: anything `hf::load_llama` or a llama run directory loads — whose
//! every layer's attention is replaced by a registered hybrid's operator (STILL, LoLCATs, …:
//! `attention::Variant`). The layer's original attention is kept beside it (`Block::teacher`) as the target of
//! attention transfer and for the teacher's forward (`Pass::Teacher`: the original attention, base
//! projections without LoRA). LoRA adapters sit on the attention projections (`lora::Linear`)
//! and on STILL's gate. Exported students hold the merged weights, `config.json` (the attention in
//! `attnlab_attention`) and `hybrid.yaml` (the operator, what `--set attention.KEY=V` edits).
use crate::attention::{is_bottleneck_param, Attention, Layer, LayerDims, Variant};
use crate::model::llama::{Llama, LlamaConfig, Pass};
use crate::lora::{Lora, LoraConfig};
use crate::student_export::{EXPORT_VARIANT, EXPORT_WEIGHTS};
use crate::{Error, IoContext, Result};
use std::collections::BTreeMap;
use std::path::Path;
use tch::{nn, Kind, Tensor};

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

    /// The names in `vs` of the parameters the layers' operators add (each declares its own,
    /// `LayerOp::parameters`): what stage 1 trains.
    pub fn operator_params(&self, vs: &nn::VarStore) -> std::collections::BTreeSet<String> {
        // A parameter's handle and its variable share storage: the same address.
        let own: std::collections::HashSet<usize> = self.layers.iter().flat_map(|b| b.attn.parameters()).map(|t| t.data_ptr() as usize).collect();
        vs.variables().into_iter().filter(|(_, t)| own.contains(&(t.data_ptr() as usize))).map(|(n, _)| n).collect()
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
        let config = self.cfg.to_hf_json();
        std::fs::write(&cp, serde_json::to_string_pretty(&config)?).at(&cp)?;
        // The modeling code that runs the student in transformers (trust_remote_code).
        crate::model::hf::write_remote_code(dir, &config)?;
        let hp = dir.join(EXPORT_VARIANT);
        std::fs::write(&hp, serde_yaml::to_string(variant).expect("serializes")).at(&hp)
    }
}

#[cfg(test)]
mod tests;
