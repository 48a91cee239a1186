//! Llama (Llama-2/3.x, and the small teachers attnlab trains): RMSNorm, SwiGLU MLP, RoPE over the
//! whole head with the `rope_scaling` variants of Llama-3.x configs, grouped-query attention, tied
//! or untied embeddings. Parameter names are Hugging Face's (`model.layers.N.self_attn.q_proj.weight`,
//! …, `lm_head.weight`), so checkpoints load as they are.
//!
//! The same code runs OLMo 2 (`Family::Olmo2`, HF `Olmo2ForCausalLM`): no input norm, RMSNorm over the
//! whole q and k projections (`q_norm`, `k_norm`) before the head split and RoPE, and the
//! `post_attention_layernorm` / `post_feedforward_layernorm` applied to each sublayer's OUTPUT before
//! the residual add.
//!
//! Each layer's attention is a `crate::attention::Layer` (vanilla, DAR, uniform, window, STILL,
//! LoLCATs): the model computes the rotated heads and hands them over with the tensor that feeds
//! k_proj / v_proj (`input_layernorm(x)` for Llama, the residual stream x for OLMo 2) and its own k / v
//! map (`KvMap`: the same k_proj / v_proj, k_norm, RoPE), which DAR's distant keys go through. The
//! attention projections are LoRA-capable (`lora::Linear`), so `attnlab linearize` adapts them
//! in place (`crate::linearize::student`). Packed rows: `hidden_docs` takes per-token document ids
//! (block-diagonal mask, positions restarting at every document).
use crate::attention::cache::{CacheShape, DecodeCache, SpanTables, StepAt, StepTables};
use crate::attention::{self, AbsorbedKv, Attention, AttentionSpec, Heads, KvMap, Layer, LayerDims, Positions, forward_prefix};
use crate::lora::Linear;
use super::stacked::Stacked;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::nn::{self, Init, Module};
use tch::{Device, Kind, Tensor};

/// RoPE frequency scaling (HF `rope_scaling` / `rope_parameters`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// No scaling.
    Default,
    /// Positions divided by `factor` (all frequencies / factor).
    Linear { factor: f64 },
    /// Llama 3.1: low frequencies / factor, high ones kept, a smooth ramp between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: f64 },
}

/// Which Hugging Face layer layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// `LlamaForCausalLM`: pre-norm (input_layernorm, post_attention_layernorm before the MLP).
    #[default]
    Llama,
    /// `Olmo2ForCausalLM`: QK-norm, norms on the sublayer outputs, no input norm.
    Olmo2,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LlamaConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub family: Family,
    /// Vanilla unless DAR was added (spec `attention:` or `add_dar`) or the model was linearized.
    #[serde(default)]
    pub attention: Attention,
}

/// config.json key holding the attention of an attnlab model.
use super::hf::ATTENTION_KEY;

impl LlamaConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Read a Hugging Face `config.json` (`rope_scaling` of transformers 4, or `rope_parameters` of 5);
    /// `model_type` llama (or absent) or olmo2.
    pub fn from_hf_json(text: &str) -> Result<LlamaConfig> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| Error::Data(format!("config.json: {e}")))?;
        let get = |k: &str| v.get(k).filter(|x| !x.is_null());
        let family = match get("model_type").and_then(|x| x.as_str()) {
            None | Some("llama") | Some("mistral") | Some("attnlab_llama") => Family::Llama,
            Some("olmo2") | Some("attnlab_olmo2") => Family::Olmo2,
            Some(other) => return Err(Error::Data(format!("config.json: model_type `{other}` is not supported (llama, olmo2, attnlab_llama, attnlab_olmo2)"))),
        };
        let attention = match get(ATTENTION_KEY) {
            None => Attention::default(),
            Some(a) => serde_json::from_value(a.clone()).map_err(|e| Error::Data(format!("config.json: {ATTENTION_KEY}: {e}")))?,
        };
        // Sizes are integers ≥ 1 (their upper bounds are the weights': `hf::check_config`).
        let size = |k: &str| -> Result<usize> {
            match get(k) {
                None => Err(Error::Data(format!("config.json: missing number `{k}`"))),
                Some(x) => x.as_u64().filter(|&n| n >= 1 && n <= u32::MAX as u64).map(|n| n as usize).ok_or_else(|| Error::Data(format!("config.json: `{k}` = {x}: expected an integer from 1 to 2^32 - 1"))),
            }
        };
        let positive = |k: &str, default: f64| -> Result<f64> {
            match get(k) {
                None => Ok(default),
                Some(x) => x.as_f64().filter(|v| v.is_finite() && *v > 0.0).ok_or_else(|| Error::Data(format!("config.json: `{k}` = {x}: expected a finite number above 0"))),
            }
        };
        let heads = size("num_attention_heads")?;
        let (hidden, kv_heads) = (size("hidden_size")?, if get("num_key_value_heads").is_some() { size("num_key_value_heads")? } else { heads });
        if hidden % heads != 0 || heads % kv_heads != 0 || (hidden / heads) % 2 != 0 {
            return Err(Error::Data(format!(
                "config.json: hidden_size {hidden}, num_attention_heads {heads}, num_key_value_heads {kv_heads}: expected heads that divide the width into an even head dim, and KV heads that divide the heads"
            )));
        }
        let scaling = get("rope_scaling").or_else(|| get("rope_parameters"));
        let theta = match scaling.and_then(|s| s.get("rope_theta")).filter(|x| !x.is_null()) {
            Some(x) => x.as_f64().filter(|v| v.is_finite() && *v > 0.0).ok_or_else(|| Error::Data(format!("config.json: `rope_scaling.rope_theta` = {x}: expected a finite number above 0")))?,
            None => positive("rope_theta", 10000.0)?,
        };
        let rope_scaling = match scaling {
            None => RopeScaling::Default,
            Some(s) => {
                let mut s = s.clone();
                let obj = s.as_object_mut().ok_or_else(|| Error::Data("config.json: rope_scaling is not an object".into()))?;
                // transformers 4 used `type`, 5 uses `rope_type`; drop keys our enum does not model.
                if let Some(t) = obj.remove("type") {
                    obj.entry("rope_type").or_insert(t);
                }
                obj.remove("rope_theta");
                obj.remove("partial_rotary_factor");
                serde_json::from_value(s).map_err(|e| Error::Data(format!("config.json: unsupported rope scaling: {e}")))?
            }
        };
        if get("head_dim").is_some() && size("head_dim")? * heads != hidden {
            return Err(Error::Data("config.json: head_dim × heads ≠ hidden_size is not supported".into()));
        }
        let tie = match get("tie_word_embeddings") {
            None => false,
            Some(x) => x.as_bool().ok_or_else(|| Error::Data(format!("config.json: `tie_word_embeddings` = {x}: expected true or false")))?,
        };
        Ok(LlamaConfig {
            vocab_size: size("vocab_size")?,
            hidden_size: hidden,
            intermediate_size: size("intermediate_size")?,
            num_hidden_layers: size("num_hidden_layers")?,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            rms_norm_eps: positive("rms_norm_eps", 1e-6)?,
            rope_theta: theta,
            rope_scaling,
            tie_word_embeddings: tie,
            max_position_embeddings: if get("max_position_embeddings").is_some() { size("max_position_embeddings")? } else { 2048 },
            family,
            attention,
        })
    }

    /// A Hugging Face `config.json` for this model: LlamaForCausalLM or Olmo2ForCausalLM when vanilla;
    /// otherwise attnlab's architecture with the remote code that runs it (`hf::remote_code`) and the
    /// attention (a softmax kind, or the STILL / LoLCATs operator) under `attnlab_attention`.
    pub fn to_hf_json(&self) -> serde_json::Value {
        let scaling = match &self.rope_scaling {
            RopeScaling::Default => serde_json::Value::Null,
            s => serde_json::to_value(s).expect("serializes"),
        };
        let (arch, model_type) = match self.family {
            Family::Llama => ("LlamaForCausalLM", "llama"),
            Family::Olmo2 => ("Olmo2ForCausalLM", "olmo2"),
        };
        let mut v = serde_json::json!({
            "architectures": [arch], "model_type": model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim(), "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": false, "mlp_bias": false, "bos_token_id": serde_json::Value::Null, "torch_dtype": "float32"
        });
        if !self.attention.is_vanilla() {
            v[ATTENTION_KEY] = serde_json::to_value(&self.attention).expect("serializes");
            let family = match self.family {
                Family::Llama => super::hf::RemoteFamily::Llama,
                Family::Olmo2 => super::hf::RemoteFamily::Olmo2,
            };
            super::hf::remote_code(&mut v, family, true);
        }
        v
    }

    /// Inverse frequencies `[hd/2]` (fp32) after scaling (HF `modeling_rope_utils`).
    pub fn inv_freq(&self, device: Device) -> Tensor {
        let hd = self.head_dim() as i64;
        let k = Tensor::arange_start_step(0, hd, 2, (Kind::Float, device));
        let inv = (k * (-self.rope_theta.ln() / hd as f64)).exp();
        match &self.rope_scaling {
            RopeScaling::Default => inv,
            RopeScaling::Linear { factor } => inv / *factor,
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings: old } => {
                let (low_wl, high_wl) = (old / low_freq_factor, old / high_freq_factor);
                let wavelen = (inv.reciprocal() * (2.0 * std::f64::consts::PI)).to_kind(Kind::Float);
                // Long wavelengths (low frequencies) are slowed by `factor`; short ones kept.
                let scaled = inv.where_self(&wavelen.le(low_wl), &(&inv / *factor));
                let smooth = (wavelen.reciprocal() * *old - *low_freq_factor) / (high_freq_factor - low_freq_factor);
                let smoothed: Tensor = (smooth.ones_like() - &smooth) * &scaled / *factor + &smooth * &scaled;
                let medium = wavelen.ge(high_wl).logical_and(&wavelen.le(low_wl));
                smoothed.where_self(&medium, &scaled)
            }
        }
    }
}

/// One decoder layer. The norms present depend on the family (see `Llama`).
pub(crate) struct Block {
    /// Llama only: RMSNorm before attention.
    input_layernorm: Option<Tensor>,
    /// Llama: RMSNorm before the MLP. OLMo 2: RMSNorm of the attention output.
    post_attention_layernorm: Tensor,
    /// OLMo 2 only: RMSNorm of the MLP output.
    post_feedforward_layernorm: Option<Tensor>,
    /// OLMo 2 only: RMSNorm over the whole q / k projection outputs `[H·hd]`, `[H_kv·hd]`.
    qk_norm: Option<(Tensor, Tensor)>,
    pub(crate) q_proj: Linear,
    pub(crate) k_proj: Linear,
    pub(crate) v_proj: Linear,
    pub(crate) o_proj: Linear,
    gate_proj: nn::Linear,
    up_proj: nn::Linear,
    down_proj: nn::Linear,
    /// q / k / v_proj's and gate / up_proj's weights as row blocks of one matrix each, so that an
    /// inference pass multiplies once for each pair of inputs (`Llama::stack_projections`).
    qkv_stack: Stacked,
    gate_up_stack: Stacked,
    /// The layer's attention variant (with the parameters it adds: DAR's bottleneck, STILL's maps, …).
    pub(crate) attn: Layer,
    /// A linearized model's attention before linearization (the teacher's): the target of attention
    /// transfer and the teacher's forward (`Pass::Teacher`). None otherwise.
    pub(crate) teacher: Option<Layer>,
}

/// Which function a forward pass computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// The model (LoRA adapters applied, no dropout).
    Eval,
    /// The model in training (LoRA dropout).
    Train,
    /// A linearized model's teacher: each layer's original attention, base projections without LoRA.
    Teacher,
}

/// A Llama-family decode cache: one `attention::cache::LayerCache` per layer (`Layer::new_cache`),
/// keys and values per KV head.
pub type LlamaCache = DecodeCache;

pub struct Llama {
    pub cfg: LlamaConfig,
    embed_tokens: Tensor,
    pub(crate) layers: Vec<Block>,
    norm: Tensor,
    /// None when tied to embed_tokens.
    lm_head: Option<Tensor>,
    /// RoPE tables made before a decode's device-side steps (`prepare_at`), read by them.
    step_tables: StepTables,
}

fn linear(p: nn::Path, i: usize, o: usize) -> nn::Linear {
    nn::linear(p, i as i64, o as i64, nn::LinearConfig { ws_init: Init::Randn { mean: 0.0, stdev: 0.02 }, bs_init: None, bias: false })
}

/// An attention projection (LoRA-capable), HF's init N(0, 0.02).
fn projection(p: nn::Path, i: usize, o: usize) -> Linear {
    Linear::new(&p, i as i64, o as i64, Init::Randn { mean: 0.0, stdev: 0.02 })
}

/// RMSNorm with statistics in fp32. HF LlamaRMSNorm casts back to the input dtype before the weight;
/// Olmo2RMSNorm multiplies by the weight in fp32 and casts after. On the fp32 residual stream under
/// CUDA autocast both are x·rstd·w in fp32, which `kernels::cuda::rms_norm_half` writes straight in
/// the half dtype the next matmul would cast it to; a half model's inference (decode) takes
/// `kernels::cuda::rms_norm_infer`, each family's rounding kept (both unless `ATTNLAB_RMS_KERNEL=0`).
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, family: Family) -> Tensor {
    let kernel = crate::kernels::cuda::rms_norm_half(x, w, eps).or_else(|| crate::kernels::cuda::rms_norm_infer(x, w, eps, family == Family::Llama));
    if let Some(y) = kernel {
        return y.unwrap_or_else(|e| panic!("RMSNorm kernel failed: {e}"));
    }
    rms_norm_aten(x, w, eps, family)
}

/// silu(gate) · up: one kernel for a half model's inference on CUDA (`kernels::cuda::silu_mul`), aten's
/// two ops elsewhere (training, the CPU).
fn swiglu(gate: &Tensor, up: &Tensor) -> Tensor {
    match crate::kernels::cuda::silu_mul(gate, up) {
        Some(y) => y.unwrap_or_else(|e| panic!("SwiGLU kernel failed: {e}")),
        None => gate.silu() * up,
    }
}

/// [`rms_norm`] in aten ops: what the kernels are checked against (`bench --check`).
pub(crate) fn rms_norm_aten(x: &Tensor, w: &Tensor, eps: f64, family: Family) -> Tensor {
    let xf = x.to_kind(Kind::Float);
    let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    let n = xf * (var + eps).rsqrt();
    match family {
        Family::Llama => w * n.to_kind(x.kind()),
        Family::Olmo2 => (w * n).to_kind(x.kind()),
    }
}

fn rotate_half(x: &Tensor) -> Tensor {
    let h = x.size()[x.dim() - 1] / 2;
    Tensor::cat(&[x.narrow(-1, h, h).neg(), x.narrow(-1, 0, h)], -1)
}

impl Llama {
    /// Build under `root` with HF's init (N(0, 0.02) matrices, unit norms; each layer's attention adds
    /// its own parameters, `attention::Layer::new`). Panics on a
    /// linearized operator's invalid options: use [`Llama::build`] where they come from a user.
    pub fn new(root: &nn::Path, cfg: LlamaConfig) -> Llama {
        Self::build(root, cfg).unwrap_or_else(|e| panic!("Llama::new: {e}"))
    }

    /// [`Llama::new`], with an error for attention options that do not build.
    pub fn build(root: &nn::Path, cfg: LlamaConfig) -> Result<Llama> {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim());
        let (h, kvh) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let olmo = cfg.family == Family::Olmo2;
        let m = root / "model";
        let init = Init::Randn { mean: 0.0, stdev: 0.02 };
        let embed_tokens = (&m / "embed_tokens").var("weight", &[cfg.vocab_size as i64, d as i64], init);
        let ones = |p: nn::Path, n: usize| p.var("weight", &[n as i64], Init::Const(1.0));
        let mut layers = Vec::new();
        for i in 0..cfg.num_hidden_layers {
            let l = &m / "layers" / i;
            let (a, f) = (&l / "self_attn", &l / "mlp");
            let dims = LayerDims { heads: h as i64, head_dim: hd as i64, d_model: d as i64, layer: i as i64 };
            layers.push(Block {
                input_layernorm: (!olmo).then(|| ones(&l / "input_layernorm", d)),
                post_attention_layernorm: ones(&l / "post_attention_layernorm", d),
                post_feedforward_layernorm: olmo.then(|| ones(&l / "post_feedforward_layernorm", d)),
                qk_norm: olmo.then(|| (ones(&a / "q_norm", h * hd), ones(&a / "k_norm", kvh * hd))),
                q_proj: projection(&a / "q_proj", d, h * hd),
                k_proj: projection(&a / "k_proj", d, kvh * hd),
                v_proj: projection(&a / "v_proj", d, kvh * hd),
                o_proj: projection(&a / "o_proj", h * hd, d),
                gate_proj: linear(&f / "gate_proj", d, cfg.intermediate_size),
                up_proj: linear(&f / "up_proj", d, cfg.intermediate_size),
                down_proj: linear(&f / "down_proj", cfg.intermediate_size, d),
                qkv_stack: Stacked::default(),
                gate_up_stack: Stacked::default(),
                attn: Layer::new(&a, &cfg.attention, dims)?,
                teacher: None,
            });
        }
        let norm = ones(&m / "norm", d);
        let lm_head = (!cfg.tie_word_embeddings).then(|| (root / "lm_head").var("weight", &[cfg.vocab_size as i64, d as i64], init));
        Ok(Llama { cfg, embed_tokens, layers, norm, lm_head, step_tables: Default::default() })
    }

    /// Change the softmax attention's options in place, keeping the weights: the implementation, the
    /// window, vanilla ↔ window, DAR ↔ uniform (the bottleneck kept). A change that would need a
    /// bottleneck the model lacks, or drop one it has, is an error (use `add_dar`).
    pub fn set_attention(&mut self, attention: AttentionSpec) -> Result<()> {
        // Every layer switched before any is replaced, so that a refused change leaves the model as it was.
        let switched = self.layers.iter().map(|b| b.attn.reconfigured(&attention)).collect::<Result<Vec<Layer>>>();
        let switched = switched.map_err(|e| Error::Other(format!("set_attention: cannot switch {} to {} in place: {e}", self.cfg.attention.label(), attention.label())))?;
        for (b, attn) in self.layers.iter_mut().zip(switched) {
            b.attn = attn;
        }
        self.cfg.attention = Attention::Softmax(attention);
        Ok(())
    }

    /// The output projection `[V, d]` (the embedding when tied).
    pub fn head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// (cos, sin) `[.., hd]` fp32 for positions `pos` (any shape; HF: cat(freqs, freqs)).
    fn rope_at(&self, pos: &Tensor) -> (Tensor, Tensor) {
        let freqs = pos.to_kind(Kind::Float).unsqueeze(-1) * self.cfg.inv_freq(pos.device());
        let emb = Tensor::cat(&[&freqs, &freqs], -1);
        (emb.cos(), emb.sin())
    }

    /// (cos, sin) `[t, hd]` fp32 for positions start..start+t.
    pub(crate) fn rope(&self, start: i64, t: i64, device: Device) -> (Tensor, Tensor) {
        self.rope_at(&Tensor::arange_start(start, start + t, (Kind::Int64, device)))
    }

    /// Final hidden states `[B, T, d]` (after the last RMSNorm).
    pub fn hidden(&self, ids: &Tensor) -> Tensor {
        self.hidden_docs(ids, None)
    }

    /// Final hidden states `[B, T, d]` of packed rows: `doc_ids` `[B, T]` (i64) labels each token's
    /// document; every run of equal ids is one document. Tokens attend only within their document
    /// (block-diagonal causal mask, combined with the DAR mask) and RoPE positions restart at 0 at every
    /// document, so each document is computed as if it were alone. None: one document per row.
    pub fn hidden_docs(&self, ids: &Tensor, doc_ids: Option<&Tensor>) -> Tensor {
        self.hidden_pass(ids, doc_ids, Pass::Eval)
    }

    /// Final hidden states `[B, T, d]` of the function `pass` names.
    pub fn hidden_pass(&self, ids: &Tensor, doc_ids: Option<&Tensor>, pass: Pass) -> Tensor {
        let (seg, cos, sin) = self.doc_tables(ids, doc_ids);
        let mut x = self.embed(ids);
        for i in 0..self.layers.len() {
            x = self.layer_pass(i, &x, &cos, &sin, seg.as_ref(), pass);
        }
        self.final_norm(&x)
    }

    /// (document segments, cos, sin) for `hidden_docs`: no segments and `[T, hd]` tables for plain
    /// rows, `[B, 1, T, hd]` tables at the in-document positions for packed ones.
    pub(crate) fn doc_tables(&self, ids: &Tensor, doc_ids: Option<&Tensor>) -> (Option<Tensor>, Tensor, Tensor) {
        match doc_ids {
            None => {
                let (c, s) = self.rope(0, ids.size()[1], ids.device());
                (None, c, s)
            }
            Some(docs) => {
                assert_eq!(docs.size(), ids.size(), "doc_ids must have the shape of ids");
                let (seg, pos) = attention::doc_segments(docs);
                let (c, s) = self.rope_at(&pos);
                (Some(seg), c.unsqueeze(1), s.unsqueeze(1))
            }
        }
    }

    /// `[B, T, n·hd]` → `[B, n, T, hd]`.
    fn heads(&self, x: &Tensor, n: usize) -> Tensor {
        let (bs, t) = (x.size()[0], x.size()[1]);
        x.view([bs, t, n as i64, self.cfg.head_dim() as i64]).transpose(1, 2)
    }

    /// Keys `[B, H_kv, T, hd]` from a k projection output: k_norm (OLMo 2), head split, RoPE.
    fn keys(&self, b: &Block, k: Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let k = match &b.qk_norm {
            Some((_, kn)) => rms_norm(&k, kn, self.cfg.rms_norm_eps, Family::Olmo2),
            None => k,
        };
        self.rotated_heads(&k, self.cfg.num_key_value_heads, cos, sin)
    }

    /// [`Llama::heads`] of a projection output `x` `[B, T, n·hd]` turned by RoPE (`cos`, `sin`
    /// `[T, hd]`): on CUDA in half precision by the heads kernel (`kernels::split_rotate` with one
    /// piece, every dim rotated, the tables' first halves read in place; one kernel each way where
    /// aten runs seven, and fp32 angles where aten rounds them to the half dtype first), else aten's
    /// [`apply_rope`] (per-row tables of packed documents too).
    fn rotated_heads(&self, x: &Tensor, n: usize, cos: &Tensor, sin: &Tensor) -> Tensor {
        let hd = self.cfg.head_dim() as i64;
        if cos.dim() == 2 && x.dim() == 3 && cos.size() == [x.size()[1], hd] {
            let half = |t: &Tensor| t.narrow(-1, 0, hd / 2);
            if let Some(r) = crate::kernels::cuda::split_rotate(x, n as i64, 1, 1, &half(cos), &half(sin)) {
                let mut pieces = r.unwrap_or_else(|e| panic!("RoPE kernel failed: {e}"));
                return pieces.swap_remove(0).transpose(1, 2);
            }
        }
        apply_rope(&self.heads(x, n), cos, sin)
    }

    /// x Wᵀ of an attention projection in `pass` (the teacher's pass reads the base weight alone).
    fn project(l: &Linear, x: &Tensor, pass: Pass) -> Tensor {
        match pass {
            Pass::Teacher => x.linear::<Tensor>(&l.weight, None),
            Pass::Eval | Pass::Train => l.forward(x, pass == Pass::Train),
        }
    }

    /// Rotated q `[B, H, n, hd]`, rotated k and v `[B, H_kv, n, hd]` for `a` at positions given by (cos, sin).
    fn qkv(&self, b: &Block, a: &Tensor, cos: &Tensor, sin: &Tensor, pass: Pass) -> (Tensor, Tensor, Tensor) {
        let (q, k, v, _) = self.qkv_projected(b, a, cos, sin, pass);
        (q, k, v)
    }

    /// [`Llama::qkv`], and `a` times the layer's input projection (`LayerOp::input_projection`:
    /// DAR's W_down, STILL's W_g) where it came out of the same stacked multiply.
    fn qkv_projected(&self, b: &Block, a: &Tensor, cos: &Tensor, sin: &Tensor, pass: Pass) -> (Tensor, Tensor, Tensor, Option<Tensor>) {
        let (h, kvh, hd) = (self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim() as i64);
        let (nq, nk) = (h as i64 * hd, kvh as i64 * hd);
        let stacked = Self::stacked_qkv(b, a, pass);
        let projected = stacked.as_ref().and_then(|y| {
            let extra = y.size()[y.dim() - 1] - nq - 2 * nk;
            (extra > 0).then(|| y.narrow(-1, nq + 2 * nk, extra))
        });
        if let (Some(y), None) = (&stacked, &b.qk_norm) {
            // q's and k's columns are side by side in the stacked product: one rotation turns both.
            let qk = self.rotated_heads(&y.narrow(-1, 0, nq + nk), h + kvh, cos, sin);
            let (q, k) = (qk.narrow(1, 0, h as i64), qk.narrow(1, h as i64, kvh as i64));
            return (q, k, self.heads(&y.narrow(-1, nq + nk, nk), kvh), projected);
        }
        let (q, k, v) = match stacked {
            Some(y) => (y.narrow(-1, 0, nq), y.narrow(-1, nq, nk), y.narrow(-1, nq + nk, nk)),
            None => (Self::project(&b.q_proj, a, pass), Self::project(&b.k_proj, a, pass), Self::project(&b.v_proj, a, pass)),
        };
        let q = match &b.qk_norm {
            Some((qn, _)) => rms_norm(&q, qn, self.cfg.rms_norm_eps, Family::Olmo2),
            None => q,
        };
        let q = self.rotated_heads(&q, self.cfg.num_attention_heads, cos, sin);
        let k = self.keys(b, k, cos, sin);
        (q, k, self.heads(&v, self.cfg.num_key_value_heads), projected)
    }

    /// q / k / v_proj of `a` side by side `[.., (H + 2·H_kv)·hd]` (then the layer's input projection's
    /// columns, where [`Llama::qkv_parts`] stacks it), by one multiply, where `pass` reads the base
    /// weights alone (no training, no adapter applied) and the block's are stacked; `None` otherwise.
    fn stacked_qkv(b: &Block, a: &Tensor, pass: Pass) -> Option<Tensor> {
        let base_only = match pass {
            Pass::Train => false,
            Pass::Eval => [&b.q_proj, &b.k_proj, &b.v_proj].iter().all(|l| l.lora.is_none()),
            Pass::Teacher => true,
        };
        base_only.then(|| b.qkv_stack.product(a, &Self::qkv_parts(b))).flatten()
    }

    /// What a block's q / k / v stack holds: the three weights, and the layer's input projection
    /// where it can join them (`stacked::stackable` with q's).
    fn qkv_parts(b: &Block) -> Vec<&Tensor> {
        let mut parts = vec![&b.q_proj.weight, &b.k_proj.weight, &b.v_proj.weight];
        let q = parts[0];
        parts.extend(b.attn.input_projection().filter(|w| super::stacked::stackable(&[q, w])));
        parts
    }

    /// Stack every block's q / k / v_proj (with its attention's input projection) and gate /
    /// up_proj weights (`stacked::Stacked`), where they are not already. The prefill calls it
    /// (eager: never inside a CUDA graph's capture, and before any step of its generation is
    /// captured), so that each step multiplies once per input.
    fn stack_projections(&self) {
        for b in &self.layers {
            b.qkv_stack.stack(&Self::qkv_parts(b));
            b.gate_up_stack.stack(&[&b.gate_proj.ws, &b.up_proj.ws]);
        }
    }

    /// The variant `pass` runs in layer `b`.
    fn layer_variant<'a>(b: &'a Block, pass: Pass) -> &'a Layer {
        match pass {
            Pass::Teacher => b.teacher.as_ref().unwrap_or(&b.attn),
            _ => &b.attn,
        }
    }

    /// Attention heads `[B, H, n, hd]` of layer `i` (before o_proj) for its K/V input `a` at the
    /// positions of (cos, sin); `seg` = document segments of packed rows.
    fn attention_heads(&self, i: usize, a: &Tensor, cos: &Tensor, sin: &Tensor, seg: Option<&Tensor>, pass: Pass) -> Tensor {
        let b = &self.layers[i];
        let (q, k, v) = self.qkv(b, a, cos, sin, pass);
        let kv = LayerKv { model: self, block: b, cos, sin, span: None };
        Self::layer_variant(b, pass).forward(&Heads { q, k, v, input: a, projected: None, seg, kv: &kv, train: pass == Pass::Train })
    }

    /// o_proj of attention heads `[B, H, n, hd]`.
    fn attention_out(&self, i: usize, o: &Tensor, pass: Pass) -> Tensor {
        let (bs, n) = (o.size()[0], o.size()[2]);
        Self::project(&self.layers[i].o_proj, &o.transpose(1, 2).reshape([bs, n, self.cfg.hidden_size as i64]), pass)
    }

    /// An empty decode cache (keys/values per KV head, so grouped-query attention keeps its saving).
    pub fn new_cache(&self, batch: i64, kind: Kind, device: Device) -> LlamaCache {
        let c = &self.cfg;
        let shape = CacheShape { batch, kv_heads: c.num_key_value_heads as i64, head_dim: c.head_dim() as i64, kind, device };
        DecodeCache::new(self.layers.iter().map(|b| b.attn.new_cache(&shape)).collect())
    }

    /// Run `ids` (`[B, n]`, after the cached tokens): logits `[B, n, V]`, cache extended.
    pub fn extend(&self, cache: &mut LlamaCache, ids: &Tensor) -> Tensor {
        self.logits(&self.extend_hidden(cache, ids))
    }

    /// [`Llama::extend`]'s final hidden states `[B, n, d]` (a prefill needs the last one's logits only).
    pub fn extend_hidden(&self, cache: &mut LlamaCache, ids: &Tensor) -> Tensor {
        let _guard = tch::no_grad_guard();
        self.stack_projections();
        let n = ids.size()[1];
        let p0 = cache.len;
        let (cos, sin) = self.rope(p0, n, ids.device());
        let mut x = self.embed(ids);
        // Left-padded rows: their filler is a document of its own in the prefill.
        let seg = cache.prefill_segments(n);
        for (i, b) in self.layers.iter().enumerate() {
            let a = self.kv_input(i, &x);
            let (q, k, v, projected) = self.qkv_projected(b, &a, &cos, &sin, Pass::Eval);
            let kv = LayerKv { model: self, block: b, cos: &cos, sin: &sin, span: None };
            let o = b.attn.decode(&mut cache.layers[i], &Heads { q, k, v, input: &a, projected, seg: seg.as_ref(), kv: &kv, train: false }, p0);
            x = self.layer_finish(i, &x, &o, Pass::Eval);
        }
        cache.len += n;
        self.final_norm(&x)
    }

    /// One token per row, `ids` `[B, 1]`, at the device-side position `at.pos`: final hidden states
    /// `[B, 1, d]`, every layer's cache written in place (`LayerOp::decode_at`) and nothing counted
    /// on the host (`DecodeCache::advance`), so that a CUDA graph captures it. None when the layers'
    /// variant has no such step. [`Llama::prepare_at`] the position first.
    pub fn extend_hidden_at(&self, cache: &mut LlamaCache, ids: &Tensor, at: &StepAt) -> Option<Tensor> {
        let _guard = tch::no_grad_guard();
        // The tables `prepare_at` made for every position the step reads (else made here, inside it).
        let prepared = self.step_tables.covering(at.span, at.pos.device());
        let (cos, sin) = prepared.as_ref().map_or_else(|| self.rope_at(&at.pos), |t| StepTables::rows(t, &at.pos));
        // Key positions 0..span, for DAR's distant keys: made once per step, not per layer.
        let span = SpanTables::new(at.span, prepared.as_ref());
        let mut x = self.embed(ids);
        for (i, b) in self.layers.iter().enumerate() {
            let a = self.kv_input(i, &x);
            let (q, k, v, projected) = self.qkv_projected(b, &a, &cos, &sin, Pass::Eval);
            let kv = LayerKv { model: self, block: b, cos: &cos, sin: &sin, span: Some(&span) };
            let o = b.attn.decode_at(&mut cache.layers[i], &Heads { q, k, v, input: &a, projected, seg: None, kv: &kv, train: false }, at)?;
            x = self.layer_finish(i, &x, &o, Pass::Eval);
        }
        Some(self.final_norm(&x))
    }

    /// Whether every layer's step state is made (`LayerOp::step_state_made`).
    pub fn step_state_made(&self, cache: &mut LlamaCache) -> bool {
        self.layers.iter().zip(cache.layers.iter_mut()).all(|(b, lc)| b.attn.step_state_made(lc))
    }

    /// Before the device-side step at `pos`: every layer's `LayerOp::prepare_at`.
    pub fn prepare_at(&self, cache: &mut LlamaCache, pos: i64, reserved: i64) {
        let device = self.embed_tokens.device();
        self.step_tables.prepare(reserved.max(pos + 1), device, |n| self.rope(0, n, device));
        for (b, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            b.attn.prepare_at(lc, pos, reserved);
        }
    }

    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        hidden.matmul(&self.head_weight().tr())
    }
}

/// A Llama layer's k / v map for DAR's distant keys: the same k_proj / v_proj (base weights, W_up
/// absorbed), k_norm and RoPE as the layer's own keys.
struct LayerKv<'a> {
    model: &'a Llama,
    block: &'a Block,
    /// The forward's RoPE tables.
    cos: &'a Tensor,
    sin: &'a Tensor,
    /// A one-token decode step's tables for key positions 0..span (`extend_hidden_at`): made by the
    /// first layer that asks, shared by the others.
    span: Option<&'a SpanTables>,
}

impl LayerKv<'_> {
    /// RoPE tables `[n, hd]` for key positions 0..n: the step's own (made once for every layer) when they fit.
    fn tables_from_zero(&self, n: i64) -> (Tensor, Tensor) {
        let make = || self.model.rope(0, n, self.cos.device());
        self.span.map_or_else(make, |t| t.get(n, make))
    }
}

impl KvMap for LayerKv<'_> {
    fn kv(&self, w: &Tensor, x: &Tensor, pos: Positions) -> (Tensor, Tensor) {
        let (b, m) = (self.block, self.model);
        let k = x.linear::<Tensor>(&b.k_proj.weight.matmul(w), None);
        let v = x.linear::<Tensor>(&b.v_proj.weight.matmul(w), None);
        let k = match pos {
            Positions::Forward => m.keys(b, k, &forward_prefix(self.cos, x.size()[1]), &forward_prefix(self.sin, x.size()[1])),
            Positions::From(0) => {
                let (c, s) = self.tables_from_zero(x.size()[1]);
                m.keys(b, k, &c, &s)
            }
            Positions::From(start) => {
                let (c, s) = m.rope(start, x.size()[1], x.device());
                m.keys(b, k, &c, &s)
            }
        };
        (k, m.heads(&v, m.cfg.num_key_value_heads))
    }

    /// k_proj / v_proj per KV head with `w` folded in, the whole head rotated (HF's rotate_half
    /// layout); None for OLMo 2, whose k_norm is not linear.
    fn absorbed(&self, w: &Tensor) -> Option<AbsorbedKv> {
        let (b, c) = (self.block, &self.model.cfg);
        if b.qk_norm.is_some() {
            return None;
        }
        let (kvh, hd) = (c.num_key_value_heads as i64, c.head_dim() as i64);
        let per_head = |l: &Linear| l.weight.view([kvh, hd, -1]).matmul(w);
        Some(AbsorbedKv::new(per_head(&b.k_proj), None, per_head(&b.v_proj), None, hd))
    }

    /// cos / sin of positions 0..n `[n, hd/2]`: HF's tables repeat their first half.
    fn rotary_tables(&self, n: i64) -> Option<(Tensor, Tensor)> {
        let half = self.model.cfg.head_dim() as i64 / 2;
        let (cos, sin) = self.tables_from_zero(n);
        Some((cos.narrow(1, 0, half), sin.narrow(1, 0, half)))
    }
}

/// Per-layer pieces, chained by `hidden` and `extend` and reused for linearization
/// (`crate::linearize::student`) and bottleneck calibration (`attention::dar::init`).
impl Llama {
    pub(crate) fn embed(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.embed_tokens, ids, -1, false, false)
    }

    /// (cos, sin) `[T, hd]` for positions 0..t.
    pub(crate) fn rope_tables(&self, t: i64, device: Device) -> (Tensor, Tensor) {
        self.rope(0, t, device)
    }

    /// The attention input of layer `i` (Llama only): RMSNorm(x).
    pub(crate) fn input_norm(&self, i: usize, x: &Tensor) -> Tensor {
        let w = self.layers[i].input_layernorm.as_ref().expect("input_norm: OLMo 2 layers have no input norm");
        rms_norm(x, w, self.cfg.rms_norm_eps, self.cfg.family)
    }

    /// The tensor that feeds q/k/v_proj (and DAR's bottleneck) in layer `i`: input_layernorm(x) for
    /// Llama, x itself for OLMo 2.
    pub(crate) fn kv_input(&self, i: usize, x: &Tensor) -> Tensor {
        match self.cfg.family {
            Family::Llama => self.input_norm(i, x),
            Family::Olmo2 => x.shallow_clone(),
        }
    }

    /// Rotated q, rotated k and v `[B, H_kv, T, hd]` of layer `i` for its attention input `a`.
    pub(crate) fn layer_qkv(&self, i: usize, a: &Tensor, cos: &Tensor, sin: &Tensor, pass: Pass) -> (Tensor, Tensor, Tensor) {
        self.qkv(&self.layers[i], a, cos, sin, pass)
    }

    /// Layer `i`'s attention heads `[B, H, T, hd]` by `variant` (this layer's, or its teacher's) for
    /// the heads the model computed from `a` (linearize's attention transfer compares the two).
    pub(crate) fn layer_attention(&self, i: usize, variant: &Layer, a: &Tensor, qkv: (Tensor, Tensor, Tensor), cos: &Tensor, sin: &Tensor, train: bool) -> Tensor {
        let (q, k, v) = qkv;
        let kv = LayerKv { model: self, block: &self.layers[i], cos, sin, span: None };
        variant.forward(&Heads { q, k, v, input: a, projected: None, seg: None, kv: &kv, train })
    }

    /// x + attention output (OLMo 2: RMSNorm'd by post_attention_layernorm first).
    fn attn_residual(&self, i: usize, x: &Tensor, out: &Tensor) -> Tensor {
        let b = &self.layers[i];
        match self.cfg.family {
            Family::Llama => x + out,
            Family::Olmo2 => x + rms_norm(out, &b.post_attention_layernorm, self.cfg.rms_norm_eps, Family::Olmo2),
        }
    }

    /// h + MLP(post_attention_layernorm(h)) (Llama) or h + post_feedforward_layernorm(MLP(h)) (OLMo 2).
    pub(crate) fn mlp_residual(&self, i: usize, h: &Tensor) -> Tensor {
        let b = &self.layers[i];
        let eps = self.cfg.rms_norm_eps;
        let mlp = |m: &Tensor| {
            let (gate, up) = match b.gate_up_stack.forward(m, &[&b.gate_proj.ws, &b.up_proj.ws]) {
                Some(mut p) => (p.remove(0), p.remove(0)),
                None => (b.gate_proj.forward(m), b.up_proj.forward(m)),
            };
            b.down_proj.forward(&swiglu(&gate, &up))
        };
        match &b.post_feedforward_layernorm {
            None => h + mlp(&rms_norm(h, &b.post_attention_layernorm, eps, Family::Llama)),
            Some(w) => h + rms_norm(&mlp(h), w, eps, Family::Olmo2),
        }
    }

    /// One whole layer; `seg` = document segments of packed rows (`attention::doc_segments`).
    pub(crate) fn layer_forward_docs(&self, i: usize, x: &Tensor, cos: &Tensor, sin: &Tensor, seg: Option<&Tensor>) -> Tensor {
        self.layer_pass(i, x, cos, sin, seg, Pass::Eval)
    }

    /// One whole layer of the function `pass` names.
    pub(crate) fn layer_pass(&self, i: usize, x: &Tensor, cos: &Tensor, sin: &Tensor, seg: Option<&Tensor>, pass: Pass) -> Tensor {
        let o = self.attention_heads(i, &self.kv_input(i, x), cos, sin, seg, pass);
        self.layer_finish(i, x, &o, pass)
    }

    /// The rest of layer `i` after its attention heads `o` `[B, H, T, hd]`: o_proj, the residuals and the MLP.
    pub(crate) fn layer_finish(&self, i: usize, x: &Tensor, o: &Tensor, pass: Pass) -> Tensor {
        self.mlp_residual(i, &self.attn_residual(i, x, &self.attention_out(i, o, pass)))
    }

    pub(crate) fn final_norm(&self, x: &Tensor) -> Tensor {
        rms_norm(x, &self.norm, self.cfg.rms_norm_eps, self.cfg.family)
    }
}

/// RoPE on `[B, H, T, hd]` with (cos, sin) fp32 tables `[T, hd]` (or `[B, 1, T, hd]` for per-row
/// positions), applied in x's dtype (HF casts cos/sin to the activation dtype).
pub(crate) fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (c, s) = (cos.to_kind(x.kind()), sin.to_kind(x.kind()));
    x * &c + rotate_half(x) * &s
}

#[cfg(test)]
mod tests;
