//! Incremental decoding for GPT-NeoX with the decode caches of `crate::attention::cache`:
//! vanilla keeps the rotated keys and values of every token; DAR / uniform keep dar.md §3's latent
//! cache (`attention::dar::DarCache`), whose distant keys/values this model rebuilds from the latents
//! h^D = LN1(x)·W_down with W_up absorbed into the k/v rows of `query_key_value`
//! ((h^D)·(W_kv·W_up)ᵀ + b_kv, then RoPE at each key's own position). Decoding token by token equals
//! the full forward pass on the growing sequence (tested).
use super::{GptNeox, LayerKv};
use crate::attention::cache::{CacheShape, DecodeCache};
use crate::attention::Heads;
use tch::nn::Module;
use tch::{Kind, Tensor};

/// GPT-NeoX's decode cache: one `attention::cache::LayerCache` per layer.
pub type NeoxCache = DecodeCache;

impl GptNeox {
    /// An empty cache for `batch` sequences, of the kind this model's attention needs.
    pub fn new_cache(&self, batch: i64, kind: Kind, device: tch::Device) -> NeoxCache {
        let shape = CacheShape { batch, kv_heads: self.cfg.heads as i64, head_dim: self.cfg.head_dim() as i64, kind, device };
        DecodeCache::new(self.layers.iter().map(|l| l.attn.new_cache(&shape)).collect())
    }

    /// Run `ids` (`[B, n]`, the tokens after those already cached) and return their logits
    /// `[B, n, V]`, extending the cache.
    pub fn extend(&self, cache: &mut NeoxCache, ids: &Tensor) -> Tensor {
        let n = ids.size()[1];
        let p0 = cache.len;
        let (cos, sin) = self.rope.tables(p0, n, ids.device());
        let mut x = Tensor::embedding(&self.embed_in, ids, -1, false, false);
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let a = layer.input_layernorm.forward(&x);
            let (q, k, v) = self.qkv(layer, &a, &cos, &sin);
            let kv = LayerKv { model: self, layer, cos: &cos, sin: &sin };
            let o = layer.attn.decode(lc, &Heads { q, k, v, input: &a, seg: None, kv: &kv, train: false }, p0);
            let mlp = self.mlp(layer, &layer.post_attention_layernorm.forward(&x));
            x = x + self.attention_out(layer, &o) + mlp;
        }
        cache.len += n;
        self.logits(&self.final_layer_norm.forward(&x))
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{build, cfg, ids};
    use crate::spec::AttentionKind;

    /// Prefill a prompt, then feed tokens one at a time: every step's logits equal the full forward
    /// pass on the growing sequence; the cache holds T·d_down + 2·min(w, T)·d numbers per layer for DAR,
    /// 2·min(w, T)·d for window.
    #[test]
    fn cached_decoding_equals_full_forward() {
        for (kind, d_down, w) in [(AttentionKind::Vanilla, 0, 0), (AttentionKind::Dar, 8, 3), (AttentionKind::Dar, 8, 1), (AttentionKind::Uniform, 8, 0), (AttentionKind::Dar, 8, 40), (AttentionKind::Window, 0, 3), (AttentionKind::Window, 0, 40)] {
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
                // Window: bounded by the last w tokens' keys and values.
                AttentionKind::Window => 2 * (w as i64).min(14) * 32,
                _ => 14 * 8 + 2 * (w as i64).min(14) * 32,
            };
            assert_eq!(cache.bytes(), 2 * 2 * per_layer * 8, "{kind:?} w={w}: batch 2 × 2 layers × f64");
        }
    }
}
