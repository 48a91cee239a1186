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
//! DAR (dar.md §1, §4.2) sits on the tensor that feeds k_proj/v_proj: `input_layernorm(x)` for Llama,
//! the residual stream x for OLMo 2. `self_attn.bottleneck_down` / `bottleneck_up` map it to
//! `h' = h·W_down·W_up`, projected by the SAME k_proj/v_proj (so with GQA the global path also has
//! kv_heads heads), then k_norm (OLMo 2) and RoPE at the key's own position as the local keys.
//! Packed rows: `hidden_docs` takes per-token document ids (block-diagonal mask, positions restarting
//! at every document).
use crate::attention;
use crate::attention::cache::{CacheShape, DecodeCache};
use crate::attention::dar::Distant;
use crate::spec::{AttentionImpl, AttentionInit, AttentionKind, DarAct};
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

/// The attention of a Llama-family model: vanilla, or DAR / uniform with its bottleneck (dar.md §1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DarConfig {
    pub kind: AttentionKind,
    /// Bottleneck width (DAR / uniform only).
    pub d_down: usize,
    /// Keys at distance < window are full width (uniform: 0).
    pub window: usize,
    pub dar_act: DarAct,
    /// Not part of the model's function: which implementation computes it.
    #[serde(rename = "impl")]
    pub implementation: AttentionImpl,
    /// How `Llama::new` starts the bottleneck, and the seed of its own stream
    /// (model::bottleneck::pretraining_start). Not part of a checkpoint's config.
    #[serde(default, skip_serializing)]
    pub init: AttentionInit,
    #[serde(default, skip_serializing)]
    pub init_seed: u64,
}

impl Default for DarConfig {
    fn default() -> Self {
        DarConfig { kind: AttentionKind::Vanilla, d_down: 0, window: 0, dar_act: DarAct::Linear, implementation: AttentionImpl::Auto, init: AttentionInit::SmallInit, init_seed: 0 }
    }
}

impl DarConfig {
    /// The `attention:` section of a resolved spec.
    pub fn from_spec(spec: &crate::spec::Spec) -> Self {
        let a = &spec.attention;
        let (init, init_seed) = (a.init.unwrap_or_default(), spec.train.seed.unwrap_or(1234));
        DarConfig { kind: a.kind, d_down: spec.d_down(), window: spec.window(), dar_act: a.dar_act, implementation: a.implementation, init, init_seed }
    }

    pub fn has_bottleneck(&self) -> bool {
        self.kind.has_bottleneck()
    }
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
    /// Vanilla unless DAR was added (spec `attention:` or `add_dar`).
    #[serde(default)]
    pub attention: DarConfig,
}

/// config.json key holding the DAR settings of an attnlab model (Hugging Face ignores unknown keys).
const DAR_KEY: &str = "attnlab_attention";

impl LlamaConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Read a Hugging Face `config.json` (`rope_scaling` of transformers 4, or `rope_parameters` of 5);
    /// `model_type` llama (or absent) or olmo2.
    pub fn from_hf_json(text: &str) -> Result<LlamaConfig> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        let get = |k: &str| v.get(k).filter(|x| !x.is_null());
        let family = match get("model_type").and_then(|x| x.as_str()) {
            None | Some("llama") | Some("mistral") => Family::Llama,
            Some("olmo2") => Family::Olmo2,
            Some(other) => return Err(Error::Data(format!("config.json: model_type `{other}` is not supported (llama, olmo2)"))),
        };
        let attention = match get(DAR_KEY) {
            None => DarConfig::default(),
            Some(a) => serde_json::from_value(a.clone()).map_err(|e| Error::Data(format!("config.json: {DAR_KEY}: {e}")))?,
        };
        let num = |k: &str| get(k).and_then(|x| x.as_f64()).ok_or_else(|| Error::Data(format!("config.json: missing number `{k}`")));
        let heads = num("num_attention_heads")? as usize;
        let scaling = get("rope_scaling").or_else(|| get("rope_parameters"));
        let theta = scaling.and_then(|s| s.get("rope_theta")).and_then(|x| x.as_f64()).or_else(|| get("rope_theta").and_then(|x| x.as_f64())).unwrap_or(10000.0);
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
        if let Some(hd) = get("head_dim").and_then(|x| x.as_u64()) {
            if hd as usize * heads != num("hidden_size")? as usize {
                return Err(Error::Data("config.json: head_dim × heads ≠ hidden_size is not supported".into()));
            }
        }
        Ok(LlamaConfig {
            vocab_size: num("vocab_size")? as usize,
            hidden_size: num("hidden_size")? as usize,
            intermediate_size: num("intermediate_size")? as usize,
            num_hidden_layers: num("num_hidden_layers")? as usize,
            num_attention_heads: heads,
            num_key_value_heads: get("num_key_value_heads").and_then(|x| x.as_u64()).map_or(heads, |x| x as usize),
            rms_norm_eps: get("rms_norm_eps").and_then(|x| x.as_f64()).unwrap_or(1e-6),
            rope_theta: theta,
            rope_scaling,
            tie_word_embeddings: get("tie_word_embeddings").and_then(|x| x.as_bool()).unwrap_or(false),
            max_position_embeddings: get("max_position_embeddings").and_then(|x| x.as_u64()).unwrap_or(2048) as usize,
            family,
            attention,
        })
    }

    /// A Hugging Face `config.json` for this model (architectures LlamaForCausalLM or Olmo2ForCausalLM;
    /// DAR settings under `attnlab_attention`, which only attnlab reads).
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
        if self.attention.kind != AttentionKind::Vanilla {
            v[DAR_KEY] = serde_json::to_value(self.attention).expect("serializes");
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
struct Block {
    /// Llama only: RMSNorm before attention.
    input_layernorm: Option<Tensor>,
    /// Llama: RMSNorm before the MLP. OLMo 2: RMSNorm of the attention output.
    post_attention_layernorm: Tensor,
    /// OLMo 2 only: RMSNorm of the MLP output.
    post_feedforward_layernorm: Option<Tensor>,
    /// OLMo 2 only: RMSNorm over the whole q / k projection outputs `[H·hd]`, `[H_kv·hd]`.
    qk_norm: Option<(Tensor, Tensor)>,
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    o_proj: nn::Linear,
    gate_proj: nn::Linear,
    up_proj: nn::Linear,
    down_proj: nn::Linear,
    /// DAR: `self_attn.bottleneck_down.weight` `[d_down, d]`, `self_attn.bottleneck_up.weight` `[d, d_down]`.
    bottleneck: Option<(Tensor, Tensor)>,
}

/// A Llama-family decode cache: one `attention::cache::LayerCache` per layer, keys and values per
/// KV head (vanilla: every token; DAR: dar.md §3's latent cache, `attention::dar::DarCache`).
pub type LlamaCache = DecodeCache;

pub struct Llama {
    pub cfg: LlamaConfig,
    embed_tokens: Tensor,
    layers: Vec<Block>,
    norm: Tensor,
    /// None when tied to embed_tokens.
    lm_head: Option<Tensor>,
}

fn linear(p: nn::Path, i: usize, o: usize) -> nn::Linear {
    nn::linear(p, i as i64, o as i64, nn::LinearConfig { ws_init: Init::Randn { mean: 0.0, stdev: 0.02 }, bs_init: None, bias: false })
}

/// RMSNorm with statistics in fp32. HF LlamaRMSNorm casts back to the input dtype before the weight;
/// Olmo2RMSNorm multiplies by the weight in fp32 and casts after.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64, family: Family) -> Tensor {
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

/// The bottleneck of one layer, `(down [d_down, d], up [d, d_down])`, as `small_init` (dar.md §2):
/// N(0, 2/(5d)) for both, the GPT-NeoX recipe, drawn from the global generator (`add_dar`); with
/// `zeros`, no draw at all (`Llama::new` fills it from its own stream afterwards).
fn new_bottleneck(attn: &nn::Path, d: usize, d_down: usize, zeros: bool) -> (Tensor, Tensor) {
    let init = if zeros { Init::Const(0.0) } else { Init::Randn { mean: 0.0, stdev: (2.0 / (5.0 * d as f64)).sqrt() } };
    let down = (attn / "bottleneck_down").var("weight", &[d_down as i64, d as i64], init);
    let up = (attn / "bottleneck_up").var("weight", &[d as i64, d_down as i64], init);
    (down, up)
}

impl Llama {
    /// Build under `root` with HF's init (N(0, 0.02) matrices, unit norms; DAR bottlenecks as
    /// `cfg.attention.init`, from their own stream after every other weight).
    pub fn new(root: &nn::Path, cfg: LlamaConfig) -> Llama {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim());
        let (h, kvh) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let olmo = cfg.family == Family::Olmo2;
        let m = root / "model";
        let init = Init::Randn { mean: 0.0, stdev: 0.02 };
        let embed_tokens = (&m / "embed_tokens").var("weight", &[cfg.vocab_size as i64, d as i64], init);
        let ones = |p: nn::Path, n: usize| p.var("weight", &[n as i64], Init::Const(1.0));
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = &m / "layers" / i;
                let (a, f) = (&l / "self_attn", &l / "mlp");
                Block {
                    input_layernorm: (!olmo).then(|| ones(&l / "input_layernorm", d)),
                    post_attention_layernorm: ones(&l / "post_attention_layernorm", d),
                    post_feedforward_layernorm: olmo.then(|| ones(&l / "post_feedforward_layernorm", d)),
                    qk_norm: olmo.then(|| (ones(&a / "q_norm", h * hd), ones(&a / "k_norm", kvh * hd))),
                    q_proj: linear(&a / "q_proj", d, h * hd),
                    k_proj: linear(&a / "k_proj", d, kvh * hd),
                    v_proj: linear(&a / "v_proj", d, kvh * hd),
                    o_proj: linear(&a / "o_proj", h * hd, d),
                    gate_proj: linear(&f / "gate_proj", d, cfg.intermediate_size),
                    up_proj: linear(&f / "up_proj", d, cfg.intermediate_size),
                    down_proj: linear(&f / "down_proj", cfg.intermediate_size, d),
                    bottleneck: cfg.attention.has_bottleneck().then(|| new_bottleneck(&a, d, cfg.attention.d_down, true)),
                }
            })
            .collect::<Vec<Block>>();
        let norm = ones(&m / "norm", d);
        let lm_head = (!cfg.tie_word_embeddings).then(|| (root / "lm_head").var("weight", &[cfg.vocab_size as i64, d as i64], init));
        // The bottlenecks last, from their own stream: every other weight equals a vanilla model's.
        tch::no_grad(|| {
            for (i, b) in layers.iter().enumerate() {
                if let Some((down, up)) = &b.bottleneck {
                    let (d0, u0) = super::bottleneck::pretraining_start(cfg.attention.init, cfg.attention.init_seed, i, d, cfg.attention.d_down);
                    down.shallow_clone().copy_(&d0);
                    up.shallow_clone().copy_(&u0);
                }
            }
        });
        Llama { cfg, embed_tokens, layers, norm, lm_head }
    }

    /// Turn a vanilla model (e.g. a pretrained checkpoint just loaded under `root`) into a DAR / uniform
    /// one: adds `self_attn.bottleneck_{down,up}.weight` to every layer, small_init (calibrate them
    /// afterwards with `model::bottleneck::calibrate_pca` for the PCA start).
    pub fn add_dar(&mut self, root: &nn::Path, attention: DarConfig) -> Result<()> {
        let d = self.cfg.hidden_size;
        if !attention.has_bottleneck() {
            return Err(Error::Other(format!("add_dar: attention kind {:?} has no bottleneck", attention.kind)));
        }
        if self.cfg.attention.has_bottleneck() {
            return Err(Error::Other("add_dar: the model already has DAR bottlenecks".into()));
        }
        if attention.d_down == 0 || attention.d_down > d {
            return Err(Error::Other(format!("add_dar: d_down {} is not in 1..={d}", attention.d_down)));
        }
        if attention.kind == AttentionKind::Uniform && attention.window != 0 {
            return Err(Error::Other(format!("add_dar: uniform is DAR with window 0, got window {}", attention.window)));
        }
        let m = root / "model";
        for (i, b) in self.layers.iter_mut().enumerate() {
            b.bottleneck = Some(new_bottleneck(&(&m / "layers" / i / "self_attn"), d, attention.d_down, false));
        }
        self.cfg.attention = attention;
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
        let (seg, cos, sin) = self.doc_tables(ids, doc_ids);
        let mut x = self.embed(ids);
        for i in 0..self.layers.len() {
            x = self.layer_forward_docs(i, &x, &cos, &sin, seg.as_ref());
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
        apply_rope(&self.heads(&k, self.cfg.num_key_value_heads), cos, sin)
    }

    /// Rotated q `[B, H, n, hd]`, rotated k and v `[B, H_kv, n, hd]` for `a` at positions given by (cos, sin).
    fn qkv(&self, b: &Block, a: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor, Tensor) {
        let q = b.q_proj.forward(a);
        let q = match &b.qk_norm {
            Some((qn, _)) => rms_norm(&q, qn, self.cfg.rms_norm_eps, Family::Olmo2),
            None => q,
        };
        let q = apply_rope(&self.heads(&q, self.cfg.num_attention_heads), cos, sin);
        let k = self.keys(b, b.k_proj.forward(a), cos, sin);
        (q, k, self.heads(&b.v_proj.forward(a), self.cfg.num_key_value_heads))
    }

    /// Bottleneck keys (rotated) and values `[B, H_kv, n, hd]` of DAR's global path: k_proj / v_proj of
    /// `h' = a·W_down·W_up`, computed in the absorbed form `(a·W_down)·(W_k·W_up)ᵀ` (dar.md §2: same
    /// function, 2·kv·d_down instead of 2·kv·d per token after the latent), then k_norm and RoPE as local keys.
    fn bottleneck_kv(&self, b: &Block, a: &Tensor, cos: &Tensor, sin: &Tensor) -> Option<(Tensor, Tensor)> {
        let (down, up) = b.bottleneck.as_ref()?;
        Some(self.kv_from_latent(b, up, &self.latent(down, a), cos, sin))
    }

    /// h^D = a·W_down (σ of it for `dar_act: sigmoid`): what DAR's decode cache keeps per token.
    fn latent(&self, down: &Tensor, a: &Tensor) -> Tensor {
        let latent = a.linear::<Tensor>(down, None);
        if self.cfg.attention.dar_act == DarAct::Sigmoid { latent.sigmoid() } else { latent }
    }

    /// Distant keys (k_norm'd after the absorbed up-projection, then rotated by (cos, sin)) and values
    /// `[B, H_kv, n, hd]` from latents `[B, n, d_down]`.
    fn kv_from_latent(&self, b: &Block, up: &Tensor, latent: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor) {
        let k = latent.linear::<Tensor>(&b.k_proj.ws.matmul(up), None);
        let v = latent.linear::<Tensor>(&b.v_proj.ws.matmul(up), None);
        (self.keys(b, k, cos, sin), self.heads(&v, self.cfg.num_key_value_heads))
    }

    /// Grouped-query attention: each KV head serves h / kvh consecutive query heads (HF repeat_kv).
    fn repeat_kv(&self, x: &Tensor) -> Tensor {
        let rep = (self.cfg.num_attention_heads / self.cfg.num_key_value_heads) as i64;
        if rep == 1 { x.shallow_clone() } else { x.repeat_interleave_self_int(rep, 1, None) }
    }

    /// Attention sublayer output (after o_proj) for the K/V input `a`; `seg` = document segments of packed rows.
    fn attention(&self, b: &Block, a: &Tensor, cos: &Tensor, sin: &Tensor, seg: Option<&Tensor>) -> Tensor {
        let (bs, t) = (a.size()[0], a.size()[1]);
        let (q, k, v) = self.qkv(b, a, cos, sin);
        let (k, v) = (self.repeat_kv(&k), self.repeat_kv(&v));
        let global = self.bottleneck_kv(b, a, cos, sin).map(|(kg, vg)| (self.repeat_kv(&kg), self.repeat_kv(&vg)));
        let imp = self.cfg.attention.implementation;
        let w = self.cfg.attention.window as i64;
        let o = match (&global, seg) {
            (None, _) if self.cfg.attention.kind == AttentionKind::Window => attention::window::forward(&q, &k, &v, w, seg, imp),
            (None, None) => attention::causal(&q, &k, &v, imp),
            (Some((kg, vg)), None) => attention::dar(&q, &k, &v, kg, vg, w, imp),
            (None, Some(seg)) => {
                let (local, _) = attention::doc_dar_masks(seg, t);
                attention::masked(&q, &[(&k, &v, &local)], imp)
            }
            (Some((kg, vg)), Some(seg)) => {
                let (local, far) = attention::doc_dar_masks(seg, w);
                attention::masked(&q, &[(&k, &v, &local), (kg, vg, &far)], imp)
            }
        };
        b.o_proj.forward(&o.transpose(1, 2).reshape([bs, t, self.cfg.hidden_size as i64]))
    }

    /// An empty decode cache (keys/values per KV head, so grouped-query attention keeps its saving).
    pub fn new_cache(&self, batch: i64, kind: Kind, device: Device) -> LlamaCache {
        let c = &self.cfg;
        let shape = CacheShape { batch, kv_heads: c.num_key_value_heads as i64, head_dim: c.head_dim() as i64, kind, device };
        DecodeCache::new(c.num_hidden_layers, c.attention.kind, c.attention.window as i64, c.attention.d_down as i64, &shape)
    }

    /// Run `ids` (`[B, n]`, after the cached tokens): logits `[B, n, V]`, cache extended.
    pub fn extend(&self, cache: &mut LlamaCache, ids: &Tensor) -> Tensor {
        let (bs, n) = (ids.size()[0], ids.size()[1]);
        let p0 = cache.len;
        let device = ids.device();
        let (cos, sin) = self.rope(p0, n, device);
        let mut x = self.embed(ids);
        for (i, b) in self.layers.iter().enumerate() {
            let a = self.kv_input(i, &x);
            let (q, k, v) = self.qkv(b, &a, &cos, &sin);
            let lc = &mut cache.layers[i];
            let o = match &b.bottleneck {
                None => lc.attend(&q, &k, &v, p0, None),
                Some((down, up)) => {
                    // Distant keys at positions 0..g, through the same k_norm and RoPE as the full forward.
                    let kv = |latent: &Tensor| {
                        let (gcos, gsin) = self.rope(0, latent.size()[1], device);
                        self.kv_from_latent(b, up, latent, &gcos, &gsin)
                    };
                    lc.attend(&q, &k, &v, p0, Some(Distant { latent: self.latent(down, &a), kv: &kv }))
                }
            };
            let h = self.attn_residual(i, &x, &b.o_proj.forward(&o.transpose(1, 2).reshape([bs, n, self.cfg.hidden_size as i64])));
            x = self.mlp_residual(i, &h);
        }
        cache.len += n;
        self.logits(&self.final_norm(&x))
    }

    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        hidden.matmul(&self.head_weight().tr())
    }
}

/// Per-layer pieces, chained by `hidden` and `extend` and reused for layer surgery (`model::hybrid`)
/// and bottleneck calibration (`model::bottleneck`).
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

    /// Layer `i`'s DAR bottleneck `(down [d_down, d], up [d, d_down])`, if any.
    pub(crate) fn bottleneck(&self, i: usize) -> Option<&(Tensor, Tensor)> {
        self.layers[i].bottleneck.as_ref()
    }

    /// Rotated q and rotated, GQA-expanded k and v `[B, H, T, hd]` of layer `i` for its attention input `a`.
    pub(crate) fn layer_qkv(&self, i: usize, a: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor, Tensor) {
        let (q, k, v) = self.qkv(&self.layers[i], a, cos, sin);
        (q, self.repeat_kv(&k), self.repeat_kv(&v))
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
        let mlp = |m: &Tensor| b.down_proj.forward(&(b.gate_proj.forward(m).silu() * b.up_proj.forward(m)));
        match &b.post_feedforward_layernorm {
            None => h + mlp(&rms_norm(h, &b.post_attention_layernorm, eps, Family::Llama)),
            Some(w) => h + rms_norm(&mlp(h), w, eps, Family::Olmo2),
        }
    }

    /// One whole layer, as in `hidden`.
    pub(crate) fn layer_forward(&self, i: usize, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        self.layer_forward_docs(i, x, cos, sin, None)
    }

    /// One whole layer; `seg` = document segments of packed rows (`attention::doc_segments`).
    pub(crate) fn layer_forward_docs(&self, i: usize, x: &Tensor, cos: &Tensor, sin: &Tensor, seg: Option<&Tensor>) -> Tensor {
        let out = self.attention(&self.layers[i], &self.kv_input(i, x), cos, sin, seg);
        self.mlp_residual(i, &self.attn_residual(i, x, &out))
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
