//! Llama (Llama-2/3.x, and the small teachers attnlab trains): RMSNorm, SwiGLU MLP, RoPE over the
//! whole head with the `rope_scaling` variants of Llama-3.x configs, grouped-query attention, tied
//! or untied embeddings. Parameter names are Hugging Face's (`model.layers.N.self_attn.q_proj.weight`,
//! …, `lm_head.weight`), so checkpoints load as they are.
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
}

impl LlamaConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Read a Hugging Face `config.json` (`rope_scaling` of transformers 4, or `rope_parameters` of 5).
    pub fn from_hf_json(text: &str) -> Result<LlamaConfig> {
        let v: serde_json::Value = serde_json::from_str(text)?;
        let get = |k: &str| v.get(k).filter(|x| !x.is_null());
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
        })
    }

    /// A Hugging Face `config.json` for this model (architectures LlamaForCausalLM).
    pub fn to_hf_json(&self) -> serde_json::Value {
        let scaling = match &self.rope_scaling {
            RopeScaling::Default => serde_json::Value::Null,
            s => serde_json::to_value(s).expect("serializes"),
        };
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers, "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim(), "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta, "rope_scaling": scaling, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings, "hidden_act": "silu",
            "attention_bias": false, "mlp_bias": false, "bos_token_id": serde_json::Value::Null, "torch_dtype": "float32"
        })
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

struct Block {
    input_layernorm: Tensor,
    post_attention_layernorm: Tensor,
    q_proj: nn::Linear,
    k_proj: nn::Linear,
    v_proj: nn::Linear,
    o_proj: nn::Linear,
    gate_proj: nn::Linear,
    up_proj: nn::Linear,
    down_proj: nn::Linear,
}

/// Keys and values per layer `[B, H_kv, T, hd]` (rotated keys).
pub struct LlamaCache {
    pub layers: Vec<(Tensor, Tensor)>,
    pub len: i64,
}

impl LlamaCache {
    pub fn bytes(&self) -> i64 {
        self.layers.iter().map(|(k, v)| (k.numel() + v.numel()) as i64 * k.kind().elt_size_in_bytes() as i64).sum()
    }
}

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

/// HF LlamaRMSNorm: statistics in fp32, weight applied after casting back to the input dtype.
fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Tensor {
    let xf = x.to_kind(Kind::Float);
    let var = xf.pow_tensor_scalar(2).mean_dim(-1, true, Kind::Float);
    w * (xf * (var + eps).rsqrt()).to_kind(x.kind())
}

fn rotate_half(x: &Tensor) -> Tensor {
    let h = x.size()[3] / 2;
    Tensor::cat(&[x.narrow(3, h, h).neg(), x.narrow(3, 0, h)], 3)
}

impl Llama {
    /// Build under `root` with HF's init (N(0, 0.02) matrices, unit norms).
    pub fn new(root: &nn::Path, cfg: LlamaConfig) -> Llama {
        let (d, hd) = (cfg.hidden_size, cfg.head_dim());
        let m = root / "model";
        let init = Init::Randn { mean: 0.0, stdev: 0.02 };
        let embed_tokens = (&m / "embed_tokens").var("weight", &[cfg.vocab_size as i64, d as i64], init);
        let ones = |p: nn::Path| p.var("weight", &[d as i64], Init::Const(1.0));
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let l = &m / "layers" / i;
                let (a, f) = (&l / "self_attn", &l / "mlp");
                Block {
                    input_layernorm: ones(&l / "input_layernorm"),
                    post_attention_layernorm: ones(&l / "post_attention_layernorm"),
                    q_proj: linear(&a / "q_proj", d, cfg.num_attention_heads * hd),
                    k_proj: linear(&a / "k_proj", d, cfg.num_key_value_heads * hd),
                    v_proj: linear(&a / "v_proj", d, cfg.num_key_value_heads * hd),
                    o_proj: linear(&a / "o_proj", cfg.num_attention_heads * hd, d),
                    gate_proj: linear(&f / "gate_proj", d, cfg.intermediate_size),
                    up_proj: linear(&f / "up_proj", d, cfg.intermediate_size),
                    down_proj: linear(&f / "down_proj", cfg.intermediate_size, d),
                }
            })
            .collect();
        let norm = ones(&m / "norm");
        let lm_head = (!cfg.tie_word_embeddings).then(|| (root / "lm_head").var("weight", &[cfg.vocab_size as i64, d as i64], init));
        Llama { cfg, embed_tokens, layers, norm, lm_head }
    }

    /// The output projection `[V, d]` (the embedding when tied).
    pub fn head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// (cos, sin) `[t, hd]` fp32 for positions start..start+t (HF: cat(freqs, freqs)).
    pub(crate) fn rope(&self, start: i64, t: i64, device: Device) -> (Tensor, Tensor) {
        let pos = Tensor::arange_start(start, start + t, (Kind::Float, device));
        let freqs = pos.unsqueeze(1) * self.cfg.inv_freq(device).unsqueeze(0);
        let emb = Tensor::cat(&[&freqs, &freqs], 1);
        (emb.cos(), emb.sin())
    }

    /// Final hidden states `[B, T, d]` (after the last RMSNorm).
    pub fn hidden(&self, ids: &Tensor) -> Tensor {
        let t = ids.size()[1];
        let (cos, sin) = self.rope(0, t, ids.device());
        let mut x = self.embed(ids);
        for i in 0..self.layers.len() {
            x = self.layer_forward(i, &x, &cos, &sin);
        }
        self.final_norm(&x)
    }

    /// Rotated q `[B, H, n, hd]`, rotated k and v `[B, H_kv, n, hd]` for `a` at positions given by (cos, sin).
    fn qkv(&self, b: &Block, a: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor, Tensor) {
        let (bs, t) = (a.size()[0], a.size()[1]);
        let (h, kvh, hd) = (self.cfg.num_attention_heads as i64, self.cfg.num_key_value_heads as i64, self.cfg.head_dim() as i64);
        let heads = |x: Tensor, n: i64| x.view([bs, t, n, hd]).transpose(1, 2);
        let (q, k, v) = (heads(b.q_proj.forward(a), h), heads(b.k_proj.forward(a), kvh), heads(b.v_proj.forward(a), kvh));
        (apply_rope(&q, cos, sin), apply_rope(&k, cos, sin), v)
    }

    /// Grouped-query attention: each KV head serves h / kvh consecutive query heads (HF repeat_kv).
    fn repeat_kv(&self, x: &Tensor) -> Tensor {
        let rep = (self.cfg.num_attention_heads / self.cfg.num_key_value_heads) as i64;
        if rep == 1 { x.shallow_clone() } else { x.repeat_interleave_self_int(rep, 1, None) }
    }

    fn attention(&self, b: &Block, a: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let (bs, t) = (a.size()[0], a.size()[1]);
        let (q, k, v) = self.qkv(b, a, cos, sin);
        let o = crate::attention::causal(&q, &self.repeat_kv(&k), &self.repeat_kv(&v), crate::spec::AttentionImpl::Auto);
        b.o_proj.forward(&o.transpose(1, 2).reshape([bs, t, self.cfg.hidden_size as i64]))
    }

    /// An empty KV cache (keys/values per KV head, so grouped-query attention keeps its saving).
    pub fn new_cache(&self, batch: i64, kind: Kind, device: Device) -> LlamaCache {
        let shape = [batch, self.cfg.num_key_value_heads as i64, 0, self.cfg.head_dim() as i64];
        LlamaCache { layers: (0..self.cfg.num_hidden_layers).map(|_| (Tensor::zeros(shape, (kind, device)), Tensor::zeros(shape, (kind, device)))).collect(), len: 0 }
    }

    /// Run `ids` (`[B, n]`, after the cached tokens): logits `[B, n, V]`, cache extended.
    pub fn extend(&self, cache: &mut LlamaCache, ids: &Tensor) -> Tensor {
        let (bs, n) = (ids.size()[0], ids.size()[1]);
        let p0 = cache.len;
        let device = ids.device();
        let (cos, sin) = self.rope(p0, n, device);
        let qpos = Tensor::arange_start(p0, p0 + n, (Kind::Int64, device)).unsqueeze(1);
        let causal = (&qpos - Tensor::arange(p0 + n, (Kind::Int64, device)).unsqueeze(0)).ge(0);
        let mut x = self.embed(ids);
        for (i, (b, (ck, cv))) in self.layers.iter().zip(cache.layers.iter_mut()).enumerate() {
            let (q, k, v) = self.qkv(b, &self.input_norm(i, &x), &cos, &sin);
            *ck = Tensor::cat(&[&*ck, &k], 2);
            *cv = Tensor::cat(&[&*cv, &v], 2);
            let o = crate::attention::masked_softmax_attention(&q, &[(&self.repeat_kv(ck), &self.repeat_kv(cv), &causal)]);
            let h = &x + b.o_proj.forward(&o.transpose(1, 2).reshape([bs, n, self.cfg.hidden_size as i64]));
            x = self.mlp_residual(i, &h);
        }
        cache.len += n;
        self.logits(&self.final_norm(&x))
    }

    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        hidden.matmul(&self.head_weight().tr())
    }
}

/// Per-layer pieces, chained by `hidden` and `extend` and reused for layer surgery (`model::hybrid`).
impl Llama {
    pub(crate) fn embed(&self, ids: &Tensor) -> Tensor {
        Tensor::embedding(&self.embed_tokens, ids, -1, false, false)
    }

    /// (cos, sin) `[T, hd]` for positions 0..t.
    pub(crate) fn rope_tables(&self, t: i64, device: Device) -> (Tensor, Tensor) {
        self.rope(0, t, device)
    }

    /// The attention input of layer `i`: RMSNorm(x).
    pub(crate) fn input_norm(&self, i: usize, x: &Tensor) -> Tensor {
        rms_norm(x, &self.layers[i].input_layernorm, self.cfg.rms_norm_eps)
    }

    /// Rotated q and rotated, GQA-expanded k and v `[B, H, T, hd]` of layer `i` for its attention input `a`.
    pub(crate) fn layer_qkv(&self, i: usize, a: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor, Tensor) {
        let (q, k, v) = self.qkv(&self.layers[i], a, cos, sin);
        (q, self.repeat_kv(&k), self.repeat_kv(&v))
    }

    /// h + MLP(post_attention_layernorm(h)) of layer `i`.
    pub(crate) fn mlp_residual(&self, i: usize, h: &Tensor) -> Tensor {
        let b = &self.layers[i];
        let m = rms_norm(h, &b.post_attention_layernorm, self.cfg.rms_norm_eps);
        h + b.down_proj.forward(&(b.gate_proj.forward(&m).silu() * b.up_proj.forward(&m)))
    }

    /// One whole (softmax-attention) layer, as in `hidden`.
    pub(crate) fn layer_forward(&self, i: usize, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let b = &self.layers[i];
        let h = x + self.attention(b, &self.input_norm(i, x), cos, sin);
        self.mlp_residual(i, &h)
    }

    pub(crate) fn final_norm(&self, x: &Tensor) -> Tensor {
        rms_norm(x, &self.norm, self.cfg.rms_norm_eps)
    }
}

/// RoPE on `[B, H, T, hd]` with (cos, sin) `[T, hd]` fp32 tables, applied in x's dtype (HF casts
/// cos/sin to the activation dtype).
pub(crate) fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
    let (c, s) = (cos.to_kind(x.kind()), sin.to_kind(x.kind()));
    x * &c + rotate_half(x) * &s
}

#[cfg(test)]
mod tests;
