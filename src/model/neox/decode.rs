//! Incremental decoding for GPT-NeoX with a KV cache per attention variant.
//!
//! - vanilla: the rotated keys and the values of every token.
//! - DAR / uniform: dar.md §3's cheap cache — full keys/values only for the last `w` tokens, and the
//!   d_down-wide latent h^D = LN1(x)·W_down of every token. Keys/values of the global path are rebuilt
//!   from the latents at each step with W_up absorbed into the k/v rows of `query_key_value`
//!   ((h^D)·(W_kv·W_up)ᵀ + b_kv, then RoPE at each key's own position), so a sequence of T ≥ w tokens
//!   holds T·d_down + 2·w·d numbers per layer instead of 2·T·d.
//! Attention over cached + new tokens uses the explicit masked softmax (exact for any number of new
//! tokens); decoding token by token equals the full forward pass on the growing sequence (tested).
use super::{GptNeox, Layer};
use crate::attention::masked_softmax_attention;
use tch::nn::Module;
use tch::{Kind, Tensor};

/// Decode state of one layer.
pub enum LayerCache {
    /// Vanilla: rotated keys and values `[B, H, T, hd]`.
    Full { k: Tensor, v: Tensor },
    /// DAR: rotated keys/values of the last `w` tokens `[B, H, ≤w, hd]` and the latent of every token `[B, T, d_down]`.
    Dar { k: Tensor, v: Tensor, latent: Tensor },
}

pub struct NeoxCache {
    pub layers: Vec<LayerCache>,
    /// Tokens seen so far.
    pub len: i64,
}

impl NeoxCache {
    /// Bytes held by the cache (all layers).
    pub fn bytes(&self) -> i64 {
        let b = |t: &Tensor| t.numel() as i64 * t.kind().elt_size_in_bytes() as i64;
        self.layers
            .iter()
            .map(|l| match l {
                LayerCache::Full { k, v } => b(k) + b(v),
                LayerCache::Dar { k, v, latent } => b(k) + b(v) + b(latent),
            })
            .sum()
    }
}

impl GptNeox {
    /// An empty cache for `batch` sequences, of the kind this model's attention needs.
    pub fn new_cache(&self, batch: i64, kind: Kind, device: tch::Device) -> NeoxCache {
        let (h, hd) = (self.cfg.heads as i64, self.cfg.head_dim() as i64);
        let empty = || Tensor::zeros([batch, h, 0, hd], (kind, device));
        let layers = self
            .layers
            .iter()
            .map(|l| match &l.bottleneck {
                None => LayerCache::Full { k: empty(), v: empty() },
                Some(_) => LayerCache::Dar { k: empty(), v: empty(), latent: Tensor::zeros([batch, 0, self.cfg.d_down as i64], (kind, device)) },
            })
            .collect();
        NeoxCache { layers, len: 0 }
    }

    /// Run `ids` (`[B, n]`, the tokens after those already cached) and return their logits
    /// `[B, n, V]`, extending the cache.
    pub fn extend(&self, cache: &mut NeoxCache, ids: &Tensor) -> Tensor {
        let n = ids.size()[1];
        let p0 = cache.len;
        let (cos, sin) = self.rope.tables(p0, n, ids.device());
        let mut x = Tensor::embedding(&self.embed_in, ids, -1, false, false);
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let attn = self.cached_attention(layer, lc, &layer.input_layernorm.forward(&x), p0, &cos, &sin);
            let mlp = self.mlp(layer, &layer.post_attention_layernorm.forward(&x));
            x = x + attn + mlp;
        }
        cache.len += n;
        self.logits(&self.final_layer_norm.forward(&x))
    }

    fn cached_attention(&self, layer: &Layer, lc: &mut LayerCache, a: &Tensor, p0: i64, cos: &Tensor, sin: &Tensor) -> Tensor {
        let (b, n) = (a.size()[0], a.size()[1]);
        let qkv = self.split_heads(&layer.query_key_value.forward(a), 3);
        let q = self.rope.apply(&qkv[0], cos, sin);
        let k = self.rope.apply(&qkv[1], cos, sin);
        let device = a.device();
        let qpos = Tensor::arange_start(p0, p0 + n, (Kind::Int64, device)).unsqueeze(1);
        // dist[i, j] = query position − key position, for keys at positions `start ..`.
        let dist = |start: i64, len: i64| &qpos - Tensor::arange_start(start, start + len, (Kind::Int64, device)).unsqueeze(0);
        let o = match lc {
            LayerCache::Full { k: ck, v: cv } => {
                *ck = Tensor::cat(&[&*ck, &k], 2);
                *cv = Tensor::cat(&[&*cv, &qkv[2]], 2);
                let causal = dist(0, p0 + n).ge(0);
                masked_softmax_attention(&q, &[(&*ck, &*cv, &causal)])
            }
            LayerCache::Dar { k: ck, v: cv, latent } => {
                let (down, up) = layer.bottleneck.as_ref().expect("DAR layer has a bottleneck");
                let w = self.cfg.window as i64;
                *latent = Tensor::cat(&[&*latent, &self.latent(down, a)], 1);
                let local_k = Tensor::cat(&[&*ck, &k], 2);
                let local_v = Tensor::cat(&[&*cv, &qkv[2]], 2);
                let local_start = p0 + n - local_k.size()[2];
                let mut parts: Vec<(Tensor, Tensor, Tensor)> = Vec::new();
                if w > 0 {
                    let d = dist(local_start, local_k.size()[2]);
                    parts.push((local_k.shallow_clone(), local_v.shallow_clone(), d.ge(0).logical_and(&d.lt(w))));
                }
                // Global keys: every position the newest query sees at distance ≥ w.
                let g = (p0 + n - w).max(0);
                if g > 0 {
                    let (kg, vg) = self.kv_from_latent(layer, up, &latent.narrow(1, 0, g));
                    let (gcos, gsin) = self.rope.tables(0, g, device);
                    parts.push((self.rope.apply(&kg, &gcos, &gsin), vg, dist(0, g).ge(w)));
                }
                // Keep only the last w tokens' full keys/values.
                let keep = w.min(local_k.size()[2]);
                let total = local_k.size()[2];
                *ck = local_k.narrow(2, total - keep, keep);
                *cv = local_v.narrow(2, total - keep, keep);
                let refs: Vec<(&Tensor, &Tensor, &Tensor)> = parts.iter().map(|(k, v, m)| (k, v, m)).collect();
                masked_softmax_attention(&q, &refs)
            }
        };
        let o = o.transpose(1, 2).reshape([b, n, self.cfg.d_model as i64]);
        layer.dense.forward(&o)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{build, cfg, ids};
    use crate::spec::AttentionKind;

    /// Prefill a prompt, then feed tokens one at a time: every step's logits equal the full forward
    /// pass on the growing sequence; the cache holds T·d_down + 2·min(w, T)·d numbers per layer for DAR.
    #[test]
    fn cached_decoding_equals_full_forward() {
        for (kind, d_down, w) in [(AttentionKind::Vanilla, 0, 0), (AttentionKind::Dar, 8, 3), (AttentionKind::Dar, 8, 1), (AttentionKind::Uniform, 8, 0), (AttentionKind::Dar, 8, 40)] {
            let (_vs, m) = build(cfg(kind, d_down, w), 21);
            let x = ids(2, 14);
            let mut cache = m.new_cache(2, tch::Kind::Double, tch::Device::Cpu);
            let prompt = 5;
            let first = m.extend(&mut cache, &x.narrow(1, 0, prompt));
            let full = m.forward(&x);
            let err = |a: &tch::Tensor, b: &tch::Tensor| (a - b).abs().max().double_value(&[]);
            assert!(err(&first, &full.narrow(1, 0, prompt)) < 1e-10, "{kind:?} w={w} prefill");
            for t in prompt..14 {
                let step = m.extend(&mut cache, &x.narrow(1, t, 1));
                let want = m.forward(&x.narrow(1, 0, t + 1)).narrow(1, t, 1);
                assert!(err(&step, &want) < 1e-10, "{kind:?} w={w} step {t}: {}", err(&step, &want));
            }
            let per_layer = match kind {
                AttentionKind::Vanilla => 2 * 14 * 32,
                _ => 14 * 8 + 2 * (w as i64).min(14) * 32,
            };
            assert_eq!(cache.bytes(), 2 * 2 * per_layer * 8, "{kind:?} w={w}: batch 2 × 2 layers × f64");
        }
    }
}
