//! Layer surgery (`../shared/specs/still.md` §1, §8): a Llama whose attention in every layer is a STILL
//! or LoLCATs operator, built from a teacher's weights. The base weights (embeddings, projections, MLP,
//! norms) are the teacher's, copied into a new VarStore that also holds the new attention parameters
//! (`model.layers.N.self_attn.{feature_map_q,feature_map_k,g_proj,window_factors}…`) and, optionally,
//! LoRA adapters (`<param>.lora_A` / `.lora_B`, see `train::lora`).
//!
//! The wrapped [`Llama`] is the teacher itself: it never sees the hybrid operators nor LoRA, so
//! `hybrid.llama.hidden(ids)` is the teacher's forward, and [`Hybrid::attention_transfer_loss`] runs it
//! layer by layer (teacher forcing).
use super::llama::apply_rope;
use super::Llama;
use crate::attention::lolcats::{Lolcats, LolcatsConfig};
use crate::attention::still::{LayerDims, Still, StillConfig};
use crate::train::lora::{Lora, LoraConfig};
use crate::{Error, IoContext, Result};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use tch::{nn, Kind, Tensor};

/// Which operator replaces softmax attention, with its options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Variant {
    Still(StillConfig),
    Lolcats(LolcatsConfig),
}

pub enum HybridAttention {
    Still(Still),
    Lolcats(Lolcats),
}

impl HybridAttention {
    /// Output `[B, H, T, hd]` of rotated, GQA-expanded q, k, v; `gate` = σ(W_g x) for STILL (or None).
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, gate: Option<&Tensor>) -> Tensor {
        match self {
            HybridAttention::Still(s) => s.forward(q, k, v, gate),
            HybridAttention::Lolcats(l) => l.forward(q, k, v),
        }
    }
}

/// The student: the teacher's weights plus one hybrid operator per layer, plus LoRA adapters.
pub struct Hybrid {
    pub llama: Llama,
    pub attn: Vec<HybridAttention>,
    /// LoRA adapters by the name of the weight they adapt (`model.layers.N.self_attn.q_proj.weight`).
    pub lora: BTreeMap<String, Lora>,
    /// Every variable of the VarStore by name (the base projection weights are read from here).
    weights: HashMap<String, Tensor>,
}

/// File names of an export folder (besides the Llama's `config.json`).
pub const EXPORT_WEIGHTS: &str = "model.safetensors";
pub const EXPORT_VARIANT: &str = "hybrid.yaml";

/// The name of a layer's attention parameter, e.g. `model.layers.3.self_attn.q_proj.weight`.
pub fn attn_param(layer: usize, proj: &str) -> String {
    format!("model.layers.{layer}.self_attn.{proj}.weight")
}

/// Whether a parameter name belongs to the new attention operators (stage-1 trainables).
pub fn is_attention_param(name: &str) -> bool {
    name.contains(".self_attn.feature_map_") || name.contains(".self_attn.g_proj.") || name.ends_with(".self_attn.window_factors")
}

impl Hybrid {
    /// Build the student in `vs` (empty), copying every variable of `teacher_vs` (a Llama with config
    /// `cfg`), adding the operators of `variant` and LoRA adapters (`lora`, may have no targets).
    pub fn from_teacher(vs: &nn::VarStore, teacher_vs: &nn::VarStore, cfg: super::LlamaConfig, variant: &Variant, lora: &LoraConfig) -> Result<Hybrid> {
        if cfg.family != super::Family::Llama || cfg.attention.has_bottleneck() {
            return Err(Error::Other("layer surgery needs a vanilla Llama teacher (not OLMo 2, not DAR)".into()));
        }
        let src = teacher_vs.variables();
        Self::build(vs, cfg, variant, lora, |vs| {
            tch::no_grad(|| -> Result<()> {
                for (name, var) in vs.variables() {
                    let s = src.get(&name).ok_or_else(|| Error::Other(format!("teacher has no parameter {name}")))?;
                    var.shallow_clone().copy_(&s.to_device(var.device()).to_kind(var.kind()));
                }
                Ok(())
            })
        })
    }

    /// A hybrid with freshly initialised weights (HF's init for the Llama part): to load a checkpoint
    /// into, or for speed and memory benchmarks.
    pub fn new(vs: &nn::VarStore, cfg: super::LlamaConfig, variant: &Variant, lora: &LoraConfig) -> Result<Hybrid> {
        Self::build(vs, cfg, variant, lora, |_| Ok(()))
    }

    /// The Llama variables, then `init_base` on them, then the operators and the adapters (in this
    /// order, so that seeded initialisation does not depend on how the base weights are filled).
    fn build(vs: &nn::VarStore, cfg: super::LlamaConfig, variant: &Variant, lora: &LoraConfig, init_base: impl FnOnce(&nn::VarStore) -> Result<()>) -> Result<Hybrid> {
        let root = vs.root();
        let llama = Llama::new(&root, cfg);
        init_base(vs)?;
        let c = &llama.cfg;
        let (heads, hd) = (c.num_attention_heads as i64, c.head_dim() as i64);
        let mut attn = Vec::new();
        for i in 0..c.num_hidden_layers {
            let p = &root / "model" / "layers" / i / "self_attn";
            attn.push(match variant {
                Variant::Still(sc) => HybridAttention::Still(Still::new(&p, sc, LayerDims { heads, head_dim: hd, d_model: c.hidden_size as i64, layer: i as i64 })?),
                Variant::Lolcats(lc) => HybridAttention::Lolcats(Lolcats::new(&p, lc, heads, hd)?),
            });
        }
        let gated = matches!(variant, Variant::Still(s) if s.gate);
        let mut adapters = BTreeMap::new();
        for i in 0..c.num_hidden_layers {
            for t in &lora.targets {
                if t == "g_proj" && !gated {
                    continue;
                }
                let name = attn_param(i, t);
                let w = vs.variables().get(&name).ok_or_else(|| Error::Other(format!("lora target `{t}`: no parameter {name}")))?.shallow_clone();
                let (o, inp) = (w.size()[0], w.size()[1]);
                let p = &root / "model" / "layers" / i / "self_attn" / t.as_str();
                adapters.insert(name, Lora::new(&p, inp, o, lora));
            }
        }
        let weights = vs.variables();
        Ok(Hybrid { llama, attn, lora: adapters, weights })
    }

    /// x W_nameᵀ (+ the LoRA update when `name` has an adapter).
    fn proj(&self, name: &str, x: &Tensor, train: bool) -> Tensor {
        let w = &self.weights[name];
        match self.lora.get(name) {
            Some(l) => l.forward(w, x, train),
            None => x.matmul(&w.tr()),
        }
    }

    /// σ(W_g a) `[B, H, T, hd]` for a gated STILL layer (W_g with its LoRA), else None.
    fn gate(&self, i: usize, a: &Tensor, train: bool) -> Option<Tensor> {
        let HybridAttention::Still(s) = &self.attn[i] else { return None };
        s.g_proj.as_ref()?;
        let (b, t) = (a.size()[0], a.size()[1]);
        let g = self.proj(&attn_param(i, "g_proj"), a, train).sigmoid();
        Some(g.view([b, t, s.dims.heads, s.dims.head_dim]).transpose(1, 2))
    }

    /// Final hidden states `[B, T, d]` of the student (hybrid attention everywhere, LoRA applied).
    pub fn hidden(&self, ids: &Tensor, train: bool) -> Tensor {
        let (cos, sin) = self.llama.rope_tables(ids.size()[1], ids.device());
        let mut x = self.llama.embed(ids);
        for i in 0..self.attn.len() {
            let (q, k, v, g) = self.layer_qkvg(i, &x, &cos, &sin, train);
            let o = self.attn[i].forward(&q, &k, &v, g.as_ref());
            x = self.layer_out(i, &x, &o, train);
        }
        self.llama.final_norm(&x)
    }

    /// Layer `i`'s rotated q and rotated, GQA-expanded k, v `[B, H, T, hd]`, and its gate, for the
    /// residual stream x `[B, T, d]` at the positions of (cos, sin); LoRA applied.
    fn layer_qkvg(&self, i: usize, x: &Tensor, cos: &Tensor, sin: &Tensor, train: bool) -> (Tensor, Tensor, Tensor, Option<Tensor>) {
        let c = &self.llama.cfg;
        let (bs, t) = (x.size()[0], x.size()[1]);
        let (h, kvh, hd) = (c.num_attention_heads as i64, c.num_key_value_heads as i64, c.head_dim() as i64);
        let rep = h / kvh;
        let heads = |x: Tensor, n: i64| x.view([bs, t, n, hd]).transpose(1, 2);
        let expand = |x: Tensor| if rep == 1 { x } else { x.repeat_interleave_self_int(rep, 1, None) };
        let a = self.llama.input_norm(i, x);
        let q = apply_rope(&heads(self.proj(&attn_param(i, "q_proj"), &a, train), h), cos, sin);
        let k = expand(apply_rope(&heads(self.proj(&attn_param(i, "k_proj"), &a, train), kvh), cos, sin));
        let v = expand(heads(self.proj(&attn_param(i, "v_proj"), &a, train), kvh));
        let g = self.gate(i, &a, train);
        (q, k, v, g)
    }

    /// The residual stream after layer `i`, from its input x and the attention heads o `[B, H, T, hd]`.
    fn layer_out(&self, i: usize, x: &Tensor, o: &Tensor, train: bool) -> Tensor {
        let (bs, h, t, hd) = (o.size()[0], o.size()[1], o.size()[2], o.size()[3]);
        let o = o.transpose(1, 2).reshape([bs, t, h * hd]);
        let hres = x + self.proj(&attn_param(i, "o_proj"), &o, train);
        self.llama.mlp_residual(i, &hres)
    }

    /// Per layer, what the last token's attention reads (`Still::probe`: its Sel and Win sets and the
    /// shares of its normalizer); `None` for LoLCATs layers. Inference mode, LoRA applied.
    pub fn probe(&self, ids: &Tensor) -> Vec<Option<crate::attention::still::Probe>> {
        let _guard = tch::no_grad_guard();
        let (cos, sin) = self.llama.rope_tables(ids.size()[1], ids.device());
        let mut x = self.llama.embed(ids);
        let mut out = Vec::new();
        for i in 0..self.attn.len() {
            let (q, k, v, g) = self.layer_qkvg(i, &x, &cos, &sin, false);
            out.push(match &self.attn[i] {
                HybridAttention::Still(s) => Some(s.probe(&q, &k)),
                HybridAttention::Lolcats(_) => None,
            });
            let o = self.attn[i].forward(&q, &k, &v, g.as_ref());
            x = self.layer_out(i, &x, &o, false);
        }
        out
    }

    /// The positions every STILL layer with `routing: oracle` selects from now on (see `Still::set_oracle`).
    pub fn set_oracle(&self, positions: Option<Vec<i64>>) {
        for a in &self.attn {
            if let HybridAttention::Still(s) = a {
                s.set_oracle(positions.clone());
            }
        }
    }

    pub fn logits(&self, ids: &Tensor, train: bool) -> Tensor {
        self.llama.logits(&self.hidden(ids, train))
    }

    /// Stage 1 (§8): teacher-forced attention transfer. Every layer gets the teacher's hidden state;
    /// q, k, v come from the (frozen, shared) projections; the loss is
    /// 1000 · mean over layers of mean((y_student − y_teacher)²) over the per-head outputs `[B,H,T,D]`,
    /// in fp32. Returns (loss, per-layer MSE `[L]`, detached).
    pub fn attention_transfer_loss(&self, ids: &Tensor) -> (Tensor, Tensor) {
        let t = ids.size()[1];
        let (cos, sin) = self.llama.rope_tables(t, ids.device());
        let mut mses = Vec::new();
        let mut x = tch::no_grad(|| self.llama.embed(ids));
        for i in 0..self.attn.len() {
            let a = tch::no_grad(|| self.llama.input_norm(i, &x));
            let (q, k, v, y_teacher) = tch::no_grad(|| {
                let (q, k, v) = self.llama.layer_qkv(i, &a, &cos, &sin);
                let y = crate::attention::causal(&q, &k, &v, crate::spec::AttentionImpl::Auto);
                (q, k, v, y)
            });
            let g = self.gate(i, &a, false);
            let y = self.attn[i].forward(&q, &k, &v, g.as_ref());
            mses.push((y.to_kind(Kind::Float) - y_teacher.to_kind(Kind::Float)).square().mean(Kind::Float));
            if i + 1 < self.attn.len() {
                x = tch::no_grad(|| self.llama.layer_forward(i, &x, &cos, &sin));
            }
        }
        let per_layer = Tensor::stack(&mses, 0);
        (per_layer.mean(Kind::Float) * 1000.0, per_layer.detach())
    }

    /// Next-token cross-entropy of the student, targets `-100` ignored.
    pub fn loss(&self, inputs: &Tensor, targets: &Tensor, train: bool) -> Tensor {
        let logits = self.logits(inputs, train).to_kind(Kind::Float);
        let v = logits.size()[2];
        logits.view([-1, v]).cross_entropy_loss::<Tensor>(&targets.reshape([-1]), None, tch::Reduction::Mean, -100, 0.0)
    }

    /// The same loss for the teacher (the wrapped Llama, no hybrid operators, no LoRA).
    pub fn teacher_loss(&self, inputs: &Tensor, targets: &Tensor) -> Tensor {
        let logits = self.llama.logits(&self.llama.hidden(inputs)).to_kind(Kind::Float);
        let v = logits.size()[2];
        logits.view([-1, v]).cross_entropy_loss::<Tensor>(&targets.reshape([-1]), None, tch::Reduction::Mean, -100, 0.0)
    }

    /// Every variable, with each LoRA-adapted weight replaced by its merged W + (α/r)·B·A and the
    /// adapters left out: what an exported hybrid checkpoint holds.
    pub fn merged_weights(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = self
            .weights
            .iter()
            .filter(|(n, _)| !n.ends_with(".lora_A") && !n.ends_with(".lora_B"))
            .map(|(n, w)| {
                let t = match self.lora.get(n) {
                    Some(l) => tch::no_grad(|| l.merged(w)),
                    None => w.detach().copy(),
                };
                (n.clone(), t)
            })
            .collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }

    /// Write the export folder of a linearized model: `model.safetensors` ([`Hybrid::merged_weights`]),
    /// `config.json` (the Llama's, Hugging Face format) and `hybrid.yaml` (`variant`).
    pub fn save_export(&self, variant: &Variant, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).at(dir)?;
        Tensor::write_safetensors(&self.merged_weights(), dir.join(EXPORT_WEIGHTS))?;
        let cp = dir.join("config.json");
        std::fs::write(&cp, serde_json::to_string_pretty(&self.llama.cfg.to_hf_json())?).at(&cp)?;
        let hp = dir.join(EXPORT_VARIANT);
        std::fs::write(&hp, serde_yaml::to_string(variant).expect("serializes")).at(&hp)
    }

    /// Load an export folder ([`Hybrid::save_export`]) onto `device`: the weights, LoRA merged, no adapters.
    pub fn load_export(dir: &Path, device: tch::Device) -> Result<(nn::VarStore, Hybrid)> {
        Self::load_export_with(dir, device, &[])
    }

    /// [`Hybrid::load_export`] with the operator's options changed by `overrides`
    /// (`attention.KEY=VALUE`, YAML values) without retraining: e.g. `attention.tokens_per_chunk=16`,
    /// `attention.routing=oracle`, `attention.linear_branch=false`, `attention.normalizer=max_compensated`.
    pub fn load_export_with(dir: &Path, device: tch::Device, overrides: &[String]) -> Result<(nn::VarStore, Hybrid)> {
        let read = |name: &str| std::fs::read_to_string(dir.join(name)).at(dir.join(name));
        let cfg = super::LlamaConfig::from_hf_json(&read("config.json")?)?;
        let variant = variant_with_overrides(&read(EXPORT_VARIANT)?, overrides, &dir.join(EXPORT_VARIANT))?;
        let vs = nn::VarStore::new(device);
        let h = Hybrid::new(&vs, cfg, &variant, &LoraConfig { targets: vec![], ..LoraConfig::default() })?;
        let file = dir.join(EXPORT_WEIGHTS);
        let tensors = Tensor::read_safetensors(&file).map_err(|e| Error::Data(format!("{}: {e}", file.display())))?;
        super::hf::copy_into(&vs, tensors.into_iter().collect(), &file)?;
        Ok((vs, h))
    }

    /// The LoRA tensors alone (`<param>.lora_A` / `.lora_B`), sorted.
    pub fn lora_weights(&self) -> Vec<(String, Tensor)> {
        let mut out: Vec<(String, Tensor)> = self.weights.iter().filter(|(n, _)| n.ends_with(".lora_A") || n.ends_with(".lora_B")).map(|(n, t)| (n.clone(), t.detach().copy())).collect();
        out.sort_by(|a, b| a.0.cmp(&b.0));
        out
    }
}

/// The hybrid operator of an export's `hybrid.yaml` text with `attention.KEY=VALUE` overrides applied.
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

pub mod decode;

#[cfg(test)]
mod tests;
