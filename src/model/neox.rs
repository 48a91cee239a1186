//! GPT-NeoX / Pythia (pythia.md §1), readable in one sitting. Parallel residual, fused head-major
//! QKV, partial rotary, erf GELU, untied output head; parameter names as Hugging Face checkpoints.
//! DAR (dar.md §2) adds `attention.bottleneck_down` / `bottleneck_up` per layer and reads distant
//! keys/values from `LN1(x)·W_down·W_up` through the SAME k/v rows and bias of `query_key_value`.
use super::rope::Rope;
use crate::attention;
use crate::spec::{AttentionImpl, AttentionInit, AttentionKind, DarAct, Gelu, Spec};
use tch::nn::{self, Init, Module};
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
    pub attention: AttentionKind,
    /// Bottleneck width (DAR / uniform only).
    pub d_down: usize,
    /// Keys at distance < window are full width (uniform: 0).
    pub window: usize,
    pub dar_act: DarAct,
    pub attention_impl: AttentionImpl,
    /// How the bottleneck starts, and the seed of its own stream (model::bottleneck::pretraining_start).
    pub init: AttentionInit,
    pub init_seed: u64,
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
            attention: spec.attention.kind,
            d_down: spec.d_down(),
            window: spec.window(),
            dar_act: spec.attention.dar_act,
            attention_impl: spec.attention.implementation,
            init: spec.attention.init.unwrap_or_default(),
            init_seed: spec.train.seed.unwrap_or(1234),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.d_model / self.heads
    }

    fn has_bottleneck(&self) -> bool {
        self.attention.has_bottleneck()
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
    /// DAR bottleneck: `bottleneck_down.weight` `[d_down, d]`, `bottleneck_up.weight` `[d, d_down]`.
    bottleneck: Option<(Tensor, Tensor)>,
}

pub struct GptNeox {
    pub cfg: NeoxConfig,
    embed_in: Tensor,
    layers: Vec<Layer>,
    final_layer_norm: nn::LayerNorm,
    embed_out: Tensor,
    rope: Rope,
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
    /// embeddings, QKV and MLP-in; the DAR bottleneck as `cfg.init` from its own stream, after every
    /// other weight (so those equal a vanilla model's of the same seed); wang_init σ = 2/(L·sqrt(d)) for the
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
                // Zeros for now (no draw from the global generator): filled below from their own stream.
                let bottleneck = cfg.has_bottleneck().then(|| {
                    let init = Init::Const(0.0);
                    let down = (&a / "bottleneck_down").var("weight", &[cfg.d_down as i64, d as i64], init);
                    let up = (&a / "bottleneck_up").var("weight", &[d as i64, cfg.d_down as i64], init);
                    (down, up)
                });
                Layer {
                    input_layernorm: layer_norm(&p / "input_layernorm", d, cfg.ln_eps),
                    post_attention_layernorm: layer_norm(&p / "post_attention_layernorm", d, cfg.ln_eps),
                    query_key_value: linear(&a / "query_key_value", d, 3 * d, small, true),
                    dense: linear(&a / "dense", d, d, wang, true),
                    dense_h_to_4h: linear(&p / "mlp" / "dense_h_to_4h", d, cfg.ffn, small, true),
                    dense_4h_to_h: linear(&p / "mlp" / "dense_4h_to_h", cfg.ffn, d, wang, true),
                    bottleneck,
                }
            })
            .collect();
        let final_layer_norm = layer_norm(&g / "final_layer_norm", d, cfg.ln_eps);
        let embed_out = (root / "embed_out").var("weight", &[cfg.vocab as i64, d as i64], Init::Randn { mean: 0.0, stdev: small });
        tch::no_grad(|| {
            for (i, layer) in layers.iter().enumerate() {
                if let Some((down, up)) = &layer.bottleneck {
                    let (d0, u0) = super::bottleneck::pretraining_start(cfg.init, cfg.init_seed, i, d, cfg.d_down);
                    down.shallow_clone().copy_(&d0);
                    up.shallow_clone().copy_(&u0);
                }
            }
        });
        let rope = Rope::new(cfg.head_dim(), cfg.rotary_pct, cfg.rotary_base);
        GptNeox { cfg, embed_in, layers, final_layer_norm, embed_out, rope }
    }

    /// Final hidden states `[B, T, d]` (after final_layer_norm) for token ids `[B, T]`.
    pub fn hidden(&self, ids: &Tensor) -> Tensor {
        let t = ids.size()[1];
        let (cos, sin) = self.rope.tables(0, t, ids.device());
        let mut x = Tensor::embedding(&self.embed_in, ids, -1, false, false);
        for layer in &self.layers {
            let attn = self.attention(layer, &layer.input_layernorm.forward(&x), &cos, &sin);
            let mlp = self.mlp(layer, &layer.post_attention_layernorm.forward(&x));
            // Parallel residual: both branches read the same x.
            x = x + attn + mlp;
        }
        self.final_layer_norm.forward(&x)
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

    /// Split a `[B, T, H·n·hd]` head-major projection into n tensors `[B, H, T, hd]`.
    fn split_heads(&self, x: &Tensor, n: i64) -> Vec<Tensor> {
        let (b, t) = (x.size()[0], x.size()[1]);
        let (h, hd) = (self.cfg.heads as i64, self.cfg.head_dim() as i64);
        let x = x.view([b, t, h, n, hd]);
        (0..n).map(|s| x.select(3, s).transpose(1, 2)).collect()
    }

    fn attention(&self, layer: &Layer, a: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        let (b, t) = (a.size()[0], a.size()[1]);
        let qkv = self.split_heads(&layer.query_key_value.forward(a), 3);
        let q = self.rope.apply(&qkv[0], cos, sin);
        let k = self.rope.apply(&qkv[1], cos, sin);
        let v = &qkv[2];
        let o = match &layer.bottleneck {
            None if self.cfg.attention == AttentionKind::Window => attention::window::forward(&q, &k, v, self.cfg.window as i64, None, self.cfg.attention_impl),
            None => attention::causal(&q, &k, v, self.cfg.attention_impl),
            Some((down, up)) => {
                let (kg, vg) = self.bottleneck_kv(layer, down, up, a);
                let kg = self.rope.apply(&kg, cos, sin);
                attention::dar(&q, &k, v, &kg, &vg, self.cfg.window as i64, self.cfg.attention_impl)
            }
        };
        let o = o.transpose(1, 2).reshape([b, t, self.cfg.d_model as i64]);
        layer.dense.forward(&o)
    }

    /// Global-path keys and values (before RoPE), absorbed form of dar.md §2:
    /// `(k^g, v^g) = (a·W_down)·(W_kv·W_up)ᵀ + b_kv` — the same function as projecting
    /// `h' = a·W_down·W_up` with the k/v rows of query_key_value, at 6·d·d_down FLOPs per token.
    fn bottleneck_kv(&self, layer: &Layer, down: &Tensor, up: &Tensor, a: &Tensor) -> (Tensor, Tensor) {
        self.kv_from_latent(layer, up, &self.latent(down, a))
    }

    /// h^D = a·W_down (σ of it for `dar_act: sigmoid`): what DAR's decode cache keeps per token.
    fn latent(&self, down: &Tensor, a: &Tensor) -> Tensor {
        let low = a.linear::<Tensor>(down, None);
        if self.cfg.dar_act == DarAct::Sigmoid { low.sigmoid() } else { low }
    }

    /// Keys and values (before RoPE) of the global path from latents: `h^D·(W_kv·W_up)ᵀ + b_kv`,
    /// with W_kv, b_kv the k/v rows of query_key_value (head-major).
    fn kv_from_latent(&self, layer: &Layer, up: &Tensor, latent: &Tensor) -> (Tensor, Tensor) {
        let (h, hd, d) = (self.cfg.heads as i64, self.cfg.head_dim() as i64, self.cfg.d_model as i64);
        let w = layer.query_key_value.ws.view([h, 3, hd, d]).narrow(1, 1, 2).reshape([2 * d, d]);
        let bias = layer.query_key_value.bs.as_ref().expect("qkv has a bias").view([h, 3, hd]).narrow(1, 1, 2).reshape([2 * d]);
        let kv = latent.linear(&w.matmul(up), Some(&bias));
        let mut parts = self.split_heads(&kv, 2).into_iter();
        (parts.next().unwrap(), parts.next().unwrap())
    }

    /// The global-path keys/values by the direct form `h' = (a·W_down)·W_up`, then the k/v projection.
    /// Kept to test that the absorbed form computes the same function.
    #[cfg(test)]
    fn bottleneck_kv_direct(&self, layer: &Layer, a: &Tensor) -> (Tensor, Tensor) {
        let (down, up) = layer.bottleneck.as_ref().unwrap();
        let h_prime = a.linear::<Tensor>(down, None).linear::<Tensor>(up, None);
        let qkv = self.split_heads(&layer.query_key_value.forward(&h_prime), 3);
        (qkv[1].shallow_clone(), qkv[2].shallow_clone())
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
