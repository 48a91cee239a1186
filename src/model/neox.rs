//! GPT-NeoX / Pythia (pythia.md §1), readable in one sitting. Parallel residual, fused head-major
//! QKV, partial rotary, erf GELU, untied output head; parameter names as Hugging Face checkpoints.
//! Each layer's attention is a `crate::attention::Layer` (vanilla, DAR, uniform, window); the model
//! hands it the rotated heads, LN1(x) and its k / v map (`KvMap`: the k/v rows and bias of
//! `query_key_value`, then RoPE), through which DAR's distant keys are built.
use super::rope::Rope;
use crate::attention::{AbsorbedKv, Attention, AttentionSpec, Heads, KvMap, Layer as AttentionLayer, LayerDims, Positions, forward_prefix};
use crate::kernels;
use crate::spec::{Gelu, Spec};
use tch::nn::{self, Init, Module};
use crate::attention::cache::SpanTables;
use tch::Tensor;

/// Everything the model needs to know; built from a resolved spec plus the vocabulary size.
#[derive(Debug, Clone, PartialEq)]
pub struct NeoxConfig {
    pub vocab: usize,
    pub d_model: usize,
    pub layers: usize,
    pub heads: usize,
    pub ffn: usize,
    pub rotary_pct: f64,
    pub rotary_base: f64,
    pub ln_eps: f64,
    pub gelu: Gelu,
    /// The layers' attention (a softmax kind) with the seed of its own parameters' start.
    pub attention: AttentionSpec,
}

impl NeoxConfig {
    /// From a resolved spec; `vocab` is the model's embedding rows (spec value or padded tokenizer size).
    pub fn from_spec(spec: &Spec, vocab: usize) -> Self {
        let shape = spec.shape();
        NeoxConfig {
            vocab: spec.model.vocab.unwrap_or(vocab),
            d_model: shape.d_model,
            layers: shape.layers,
            heads: shape.heads,
            ffn: spec.model.ffn.unwrap_or(4 * shape.d_model),
            rotary_pct: spec.model.rotary_pct.unwrap_or(0.25),
            rotary_base: spec.model.rotary_base.unwrap_or(10000.0),
            ln_eps: 1e-5,
            gelu: spec.model.gelu,
            attention: spec.model_attention(),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    /// Matmul weights N_mm = 12·L·d² + V·d (pythia.md §6; excludes embed_in, biases, LayerNorm).
    pub fn matmul_params(&self) -> u64 {
        let (l, d, v) = (self.layers as u64, self.d_model as u64, self.vocab as u64);
        (4 * d * d + 2 * d * self.ffn as u64) * l + v * d
    }

    /// Training FLOPs per token, PaLM convention: 6·N_mm + 12·L·d·T (pythia.md §6).
    pub fn flops_per_token(&self, seq_len: usize) -> f64 {
        6.0 * self.matmul_params() as f64 + 12.0 * (self.layers * self.d_model * seq_len) as f64
    }
}

struct Layer {
    input_layernorm: nn::LayerNorm,
    post_attention_layernorm: nn::LayerNorm,
    query_key_value: nn::Linear,
    dense: nn::Linear,
    dense_h_to_4h: nn::Linear,
    dense_4h_to_h: nn::Linear,
    /// The layer's attention variant (DAR: with its bottleneck under `attention.`).
    attn: AttentionLayer,
    /// query_key_value with the attention's input projection (DAR's W_down), stacked for inference
    /// (`GptNeox::qkv_projected`).
    qkv_stack: super::stacked::Stacked,
}

pub struct GptNeox {
    pub cfg: NeoxConfig,
    embed_in: Tensor,
    layers: Vec<Layer>,
    final_layer_norm: nn::LayerNorm,
    embed_out: Tensor,
    rope: Rope,
    /// RoPE tables made before a decode's device-side steps (`prepare_at`), read by them.
    step_tables: crate::attention::cache::StepTables,
}

fn linear(p: nn::Path, d_in: usize, d_out: usize, std: f64, bias: bool) -> nn::Linear {
    let cfg = nn::LinearConfig { ws_init: Init::Randn { mean: 0.0, stdev: std }, bs_init: Some(Init::Const(0.0)), bias };
    nn::linear(p, d_in as i64, d_out as i64, cfg)
}

fn layer_norm(p: nn::Path, d: usize, eps: f64) -> nn::LayerNorm {
    nn::layer_norm(p, vec![d as i64], nn::LayerNormConfig { eps, ..Default::default() })
}

impl GptNeox {
    /// Build the model under `root` with Pythia's init (pythia.md §4): small_init σ = sqrt(2/(5d)) for
    /// embeddings, QKV and MLP-in; the DAR bottleneck as `cfg.attention.init` from its own stream (so every
    /// other weight equals a vanilla model's of the same seed); wang_init σ = 2/(L·sqrt(d)) for the
    /// two projections that write into the residual stream; biases 0, LayerNorm 1/0.
    pub fn new(root: &nn::Path, cfg: NeoxConfig) -> Self {
        let (d, l) = (cfg.d_model, cfg.layers);
        let small = (2.0 / (5.0 * d as f64)).sqrt();
        let wang = 2.0 / (l as f64 * (d as f64).sqrt());
        let g = root / "gpt_neox";
        let embed_in = (&g / "embed_in").var("weight", &[cfg.vocab as i64, d as i64], Init::Randn { mean: 0.0, stdev: small });
        let layers: Vec<Layer> = (0..l)
            .map(|i| {
                let p = &g / "layers" / i;
                let a = &p / "attention";
                // DAR's bottleneck draws from its own stream, not the global generator.
                let dims = LayerDims { heads: cfg.heads as i64, head_dim: cfg.head_dim() as i64, d_model: d as i64, layer: i as i64 };
                let attn = AttentionLayer::new(&a, &Attention::Softmax(cfg.attention.clone()), dims).expect("softmax attention builds");
                Layer {
                    input_layernorm: layer_norm(&p / "input_layernorm", d, cfg.ln_eps),
                    post_attention_layernorm: layer_norm(&p / "post_attention_layernorm", d, cfg.ln_eps),
                    query_key_value: linear(&a / "query_key_value", d, 3 * d, small, true),
                    dense: linear(&a / "dense", d, d, wang, true),
                    dense_h_to_4h: linear(&p / "mlp" / "dense_h_to_4h", d, cfg.ffn, small, true),
                    dense_4h_to_h: linear(&p / "mlp" / "dense_4h_to_h", cfg.ffn, d, wang, true),
                    attn,
                    qkv_stack: Default::default(),
                }
            })
            .collect();
        let final_layer_norm = layer_norm(&g / "final_layer_norm", d, cfg.ln_eps);
        let embed_out = (root / "embed_out").var("weight", &[cfg.vocab as i64, d as i64], Init::Randn { mean: 0.0, stdev: small });
        let rope = Rope::new(cfg.head_dim(), cfg.rotary_pct, cfg.rotary_base);
        GptNeox { cfg, embed_in, layers, final_layer_norm, embed_out, rope, step_tables: Default::default() }
    }

    /// Final hidden states `[B, T, d]` (after final_layer_norm) for token ids `[B, T]`.
    pub fn hidden(&self, ids: &Tensor) -> Tensor {
        let t = ids.size()[1];
        let (cos, sin) = self.rope.tables(0, t, ids.device());
        let mut x = Tensor::embedding(&self.embed_in, ids, -1, false, false);
        for layer in &self.layers {
            let attn = self.attention(layer, &self.norm(&layer.input_layernorm, &x), &cos, &sin);
            let mlp = self.mlp(layer, &self.norm(&layer.post_attention_layernorm, &x));
            // Parallel residual: both branches read the same x.
            x = x + attn + mlp;
        }
        self.norm(&self.final_layer_norm, &x)
    }

    /// A LayerNorm of the full forward: straight from the fp32 residual stream to autocast's half
    /// dtype where `kernels::cuda::layer_norm_half` applies (unless `ATTNLAB_LN_KERNEL=0`), else aten's.
    fn norm(&self, ln: &nn::LayerNorm, x: &Tensor) -> Tensor {
        if let (Some(w), Some(b)) = (&ln.ws, &ln.bs) {
            if let Some(y) = crate::kernels::cuda::layer_norm_half(x, w, b, self.cfg.ln_eps) {
                return y.unwrap_or_else(|e| panic!("LayerNorm kernel failed: {e}"));
            }
        }
        ln.forward(x)
    }

    /// Logits `[B, T, V]`.
    pub fn forward(&self, ids: &Tensor) -> Tensor {
        self.logits(&self.hidden(ids))
    }

    pub fn logits(&self, hidden: &Tensor) -> Tensor {
        hidden.matmul(&self.embed_out.tr())
    }

    /// The output projection `embed_out.weight` `[V, d]`.
    pub fn head_weight(&self) -> &Tensor {
        &self.embed_out
    }

    /// Next-token loss through full `[B·T, V]` logits (the plain formulation, kept as the test oracle;
    /// training uses `Model::loss`, which never materialises them).
    pub fn loss_unchunked(&self, inputs: &Tensor, targets: &Tensor) -> Tensor {
        let logits = self.forward(inputs);
        logits.reshape([-1, self.cfg.vocab as i64]).cross_entropy_for_logits(&targets.reshape([-1]))
    }

    fn mlp(&self, layer: &Layer, m: &Tensor) -> Tensor {
        let h = layer.dense_h_to_4h.forward(m);
        let h = h.gelu(match self.cfg.gelu {
            Gelu::Erf => "none",
            Gelu::Tanh => "tanh",
        });
        layer.dense_4h_to_h.forward(&h)
    }

    /// Split a `[B, T, H·n·hd]` head-major projection into n tensors `[B, H, T, hd]` by views: the
    /// explicit form `heads_of` is tested against.
    #[cfg(test)]
    fn split_heads(&self, x: &Tensor, n: i64) -> Vec<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (h, hd) = (self.cfg.heads as i64, self.cfg.head_dim() as i64);
        let x = x.view([b, t, h, n, hd]);
        (0..n).map(|s| x.select(3, s).transpose(1, 2)).collect()
    }

    /// The n pieces `[B, H, T, hd]` of a `[B, T, H·n·hd]` head-major projection, the first `rotated`
    /// by RoPE at the positions of (cos, sin): one op whose backward writes the projection's gradient
    /// once (`kernels::split_rotate`), not a zero-filled gradient per piece and per rotated half.
    fn heads_of(&self, x: &Tensor, n: i64, rotated: i64, cos: &Tensor, sin: &Tensor) -> Vec<Tensor> {
        kernels::split_rotate(x, self.cfg.heads as i64, n, rotated, cos, sin)
            .unwrap_or_else(|e| panic!("GPT-NeoX heads: {e}"))
            .into_iter()
            .map(|p| p.transpose(1, 2))
            .collect()
    }

    /// Rotated q, k and v `[B, H, T, hd]` of LN1(x) `a` at the positions of (cos, sin).
    fn qkv(&self, layer: &Layer, a: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor, Tensor) {
        let mut qkv = self.heads_of(&layer.query_key_value.forward(a), 3, 2, cos, sin).into_iter();
        (qkv.next().unwrap(), qkv.next().unwrap(), qkv.next().unwrap())
    }

    /// What a layer's q/k/v stack holds: query_key_value's weight and bias, then the attention's own
    /// input projection (DAR's W_down, no bias) where it has one that can join (`stacked::stackable`).
    fn qkv_parts(layer: &Layer) -> (Vec<&Tensor>, Vec<Option<&Tensor>>) {
        let qkv = &layer.query_key_value.ws;
        let mut parts = (vec![qkv], vec![layer.query_key_value.bs.as_ref()]);
        if let Some(w) = layer.attn.input_projection().filter(|w| super::stacked::stackable(&[qkv, w])) {
            parts.0.push(w);
            parts.1.push(None);
        }
        parts
    }

    /// Stack every layer's query_key_value with its input projection, where it has one (the
    /// prefill calls it: eager, before any step of its generation is captured).
    fn stack_projections(&self) {
        for layer in &self.layers {
            let (w, b) = Self::qkv_parts(layer);
            if w.len() > 1 {
                layer.qkv_stack.stack_biased(&w, &b);
            }
        }
    }

    /// [`GptNeox::qkv`], and `a`·W_downᵀ (`Heads::projected`) where the two came out of one stacked
    /// multiply (a decode step: one GEMM a layer fewer).
    fn qkv_projected(&self, layer: &Layer, a: &Tensor, cos: &Tensor, sin: &Tensor) -> (Tensor, Tensor, Tensor, Option<Tensor>) {
        let (w, b) = Self::qkv_parts(layer);
        if let Some(y) = (w.len() > 1).then(|| layer.qkv_stack.product_biased(a, &w, &b)).flatten() {
            let n = w[0].size()[0];
            let mut qkv = self.heads_of(&y.narrow(-1, 0, n), 3, 2, cos, sin).into_iter();
            let projected = y.narrow(-1, n, y.size()[2] - n);
            return (qkv.next().unwrap(), qkv.next().unwrap(), qkv.next().unwrap(), Some(projected));
        }
        let (q, k, v) = self.qkv(layer, a, cos, sin);
        (q, k, v, None)
    }

    fn attention(&self, layer: &Layer, a: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let (q, k, v) = self.qkv(layer, a, cos, sin);
        let kv = LayerKv { model: self, layer, cos, sin, span: None };
        let o = layer.attn.forward(&Heads { q, k, v, input: a, projected: None, seg: None, kv: &kv, train: false });
        self.attention_out(layer, &o)
    }

    /// `dense` of attention heads `[B, H, n, hd]`.
    fn attention_out(&self, layer: &Layer, o: &Tensor) -> Tensor {
        let (b, n) = (o.size()[0], o.size()[2]);
        layer.dense.forward(&o.transpose(1, 2).reshape([b, n, self.cfg.d_model as i64]))
    }

    /// The k / v projection `[B, n, 2·d]` (head-major) of `x` `[B, n, r]` through the k/v rows of
    /// query_key_value composed with `w` `[d, r]`: `x·(W_kv·w)ᵀ + b_kv`.
    fn kv_projection(&self, layer: &Layer, w: &Tensor, x: &Tensor) -> Tensor {
        let (h, hd, d) = (self.cfg.heads as i64, self.cfg.head_dim() as i64, self.cfg.d_model as i64);
        let wkv = layer.query_key_value.ws.view([h, 3, hd, d]).narrow(1, 1, 2).reshape([2 * d, d]);
        let bias = layer.query_key_value.bs.as_ref().expect("qkv has a bias").view([h, 3, hd]).narrow(1, 1, 2).reshape([2 * d]);
        x.linear(&wkv.matmul(w), Some(&bias))
    }

    /// Keys and values (before RoPE) of `x` through `kv_projection`.
    #[cfg(test)]
    fn kv_through(&self, layer: &Layer, w: &Tensor, x: &Tensor) -> (Tensor, Tensor) {
        let mut parts = self.split_heads(&self.kv_projection(layer, w, x), 2).into_iter();
        (parts.next().unwrap(), parts.next().unwrap())
    }
}

/// A GPT-NeoX layer's k / v map for DAR's distant keys: the k/v rows and bias of query_key_value
/// (W_up absorbed), then RoPE.
struct LayerKv<'a> {
    model: &'a GptNeox,
    layer: &'a Layer,
    cos: &'a Tensor,
    sin: &'a Tensor,
    /// A one-token decode step's tables for key positions 0..span (`extend_hidden_at`): made by the
    /// first layer that asks, shared by the others.
    span: Option<&'a SpanTables>,
}

impl KvMap for LayerKv<'_> {
    fn kv(&self, w: &Tensor, x: &Tensor, pos: Positions) -> (Tensor, Tensor) {
        let kv = self.model.kv_projection(self.layer, w, x);
        let (cos, sin) = match pos {
            Positions::Forward => (forward_prefix(self.cos, x.size()[1]), forward_prefix(self.sin, x.size()[1])),
            Positions::From(0) => self.tables_from_zero(x.size()[1]),
            Positions::From(start) => self.model.rope.tables(start, x.size()[1], x.device()),
        };
        let mut parts = self.model.heads_of(&kv, 2, 1, &cos, &sin).into_iter();
        (parts.next().unwrap(), parts.next().unwrap())
    }

    fn absorbed(&self, w: &Tensor) -> Option<AbsorbedKv> {
        let m = self.model;
        let (h, hd, d) = (m.cfg.heads as i64, m.cfg.head_dim() as i64, m.cfg.d_model as i64);
        let qkv = self.layer.query_key_value.ws.view([h, 3, hd, d]);
        let bias = self.layer.query_key_value.bs.as_ref().map(|b| b.view([h, 3, hd]));
        // The biases contiguous once here, not per step in the fused decode step.
        Some(AbsorbedKv::new(
            qkv.select(1, 1).matmul(w),
            bias.as_ref().map(|b| b.select(1, 1).contiguous()),
            qkv.select(1, 2).matmul(w),
            bias.as_ref().map(|b| b.select(1, 2).contiguous()),
            m.rope.dims,
        ))
    }

    fn rotary_tables(&self, n: i64) -> Option<(Tensor, Tensor)> {
        Some(self.tables_from_zero(n))
    }
}

impl LayerKv<'_> {
    /// RoPE tables for positions 0..n: the step's own (made once for every layer) when they fit.
    fn tables_from_zero(&self, n: i64) -> (Tensor, Tensor) {
        let make = || self.model.rope.tables(0, n, self.cos.device());
        self.span.map_or_else(make, |t| t.get(n, make))
    }
}

/// HF checkpoint entries that are buffers, not parameters (pythia.md §2); loaders skip them.
pub fn is_ignored_buffer(name: &str) -> bool {
    name.ends_with(".attention.bias") || name.ends_with(".attention.masked_bias") || name.ends_with("rotary_emb.inv_freq")
}


/// Parameters that get no weight decay: biases and LayerNorm (every 1-D tensor), as GPT-NeoX.
pub fn no_weight_decay(name: &str, t: &Tensor) -> bool {
    name.ends_with(".bias") || t.dim() == 1
}

pub mod decode;

#[cfg(test)]
pub(crate) mod tests;
