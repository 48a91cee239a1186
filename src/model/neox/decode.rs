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
        self.logits(&self.extend_hidden(cache, ids))
    }

    /// [`GptNeox::extend`]'s final hidden states `[B, n, d]` (a prefill needs the last one's logits only).
    pub fn extend_hidden(&self, cache: &mut NeoxCache, ids: &Tensor) -> Tensor {
        let n = ids.size()[1];
        let p0 = cache.len;
        let (cos, sin) = self.rope.tables(p0, n, ids.device());
        let mut x = Tensor::embedding(&self.embed_in, ids, -1, false, false);
        // Left-padded rows: their filler is a document of its own in the prefill.
        let seg = cache.prefill_segments(n);
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let a = layer.input_layernorm.forward(&x);
            let (q, k, v) = self.qkv(layer, &a, &cos, &sin);
            let kv = LayerKv { model: self, layer, cos: &cos, sin: &sin };
            let o = layer.attn.decode(lc, &Heads { q, k, v, input: &a, seg: seg.as_ref(), kv: &kv, train: false }, p0);
            let mlp = self.mlp(layer, &layer.post_attention_layernorm.forward(&x));
            x = x + self.attention_out(layer, &o) + mlp;
        }
        cache.len += n;
        self.final_layer_norm.forward(&x)
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{build, cfg, ids};
    use crate::attention::cache::Recent;
    use crate::attention::dar::DarCache;
    use crate::spec::AttentionKind;
    use tch::Tensor;

    const VARIANTS: [(AttentionKind, usize, usize); 7] =
        [(AttentionKind::Vanilla, 0, 0), (AttentionKind::Dar, 8, 3), (AttentionKind::Dar, 8, 1), (AttentionKind::Uniform, 8, 0), (AttentionKind::Dar, 8, 40), (AttentionKind::Window, 0, 3), (AttentionKind::Window, 0, 40)];

    fn err(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// Prefill a prompt (through the forward's SDPA kernels), feed a piece of several tokens (the
    /// explicit masked path over the cache), then one token at a time (SDPA over the cache, a ring
    /// that wraps for small windows): every step's logits equal the full forward pass on the growing
    /// sequence; the cache holds T·d_down + 2·min(w, T)·d numbers per layer for DAR, 2·min(w, T)·d
    /// for window.
    #[test]
    fn cached_decoding_equals_full_forward() {
        let _rng = crate::testutil::rng();
        for (kind, d_down, w) in VARIANTS {
            let (_vs, m) = build(cfg(kind, d_down, w), 21);
            let x = ids(2, 14);
            for (prompt, piece) in [(5, 1), (1, 1), (4, 3), (9, 4)] {
                let mut cache = m.new_cache(2, tch::Kind::Double, tch::Device::Cpu);
                let first = m.extend(&mut cache, &x.narrow(1, 0, prompt));
                let full = m.forward(&x);
                assert!(err(&first, &full.narrow(1, 0, prompt)) < 1e-10, "{kind:?} w={w} prefill {prompt}");
                let mut t = prompt;
                while t < 14 {
                    let n = if t == prompt { piece.min(14 - t) } else { 1 };
                    let step = m.extend(&mut cache, &x.narrow(1, t, n));
                    let want = m.forward(&x.narrow(1, 0, t + n)).narrow(1, t, n);
                    assert!(err(&step, &want) < 1e-10, "{kind:?} w={w} prompt {prompt} at {t} (+{n}): {}", err(&step, &want));
                    t += n;
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

    /// Prompts of several lengths, left-padded into one batch (the filler masked as a document of its
    /// own in the prefill, and as keys afterwards): the last prompt token's logits and those of
    /// every decode step (a piece of 3 tokens, then single tokens) equal each prompt run alone, up to
    /// the rounding of the fp32 RoPE tables at shifted positions.
    #[test]
    fn left_padded_batch_equals_each_row_alone() {
        let _rng = crate::testutil::rng();
        for (kind, d_down, w) in VARIANTS {
            let (_vs, m) = build(cfg(kind, d_down, w), 23);
            let lens = [5i64, 9, 2];
            let (longest, steps) = (9, 6);
            let x = ids(3, longest + steps);
            // Row r: its own prompt of lens[r] tokens, then the same continuation tokens for all.
            let prompt = |r: i64| x.get(r).narrow(0, 0, lens[r as usize]);
            let next = x.narrow(1, longest, steps);
            let filler = |r: i64| Tensor::zeros([longest - lens[r as usize]], (tch::Kind::Int64, tch::Device::Cpu));
            let padded = Tensor::stack(&(0..3).map(|r| Tensor::cat(&[filler(r), prompt(r)], 0)).collect::<Vec<_>>(), 0);
            let mut batch = m.new_cache(3, tch::Kind::Double, tch::Device::Cpu);
            batch.set_padding(&Tensor::from_slice(&lens.map(|l| longest - l)));
            let mut got = vec![m.extend(&mut batch, &padded).narrow(1, longest - 1, 1)];
            got.push(m.extend(&mut batch, &next.narrow(1, 0, 3)));
            for t in 3..steps {
                got.push(m.extend(&mut batch, &next.narrow(1, t, 1)));
            }
            let got = Tensor::cat(&got, 1);
            for r in 0..3 {
                let alone = Tensor::cat(&[prompt(r), next.get(r)], 0).unsqueeze(0);
                let want = m.forward(&alone).narrow(1, lens[r as usize] - 1, steps + 1);
                let e = err(&got.narrow(0, r, 1), &want);
                // RoPE tables are fp32: a row shifted by its padding rotates by angles rounded
                // differently (filler read by a real token would differ by far more).
                assert!(e < 1e-5, "{kind:?} w={w} row {r}: {e}");
            }
        }
    }

    /// The buffers every layer's cache writes into, by address.
    fn buffers(cache: &super::NeoxCache) -> Vec<usize> {
        let ptr = |t: &Tensor| t.data_ptr() as usize;
        cache
            .layers
            .iter()
            .flat_map(|l| match (l.get::<Recent>(), l.get::<DarCache>()) {
                (Some(r), _) => vec![ptr(r.storage().0), ptr(r.storage().1)],
                (_, Some(d)) => {
                    let (r, latent) = d.parts();
                    vec![ptr(r.storage().0), ptr(r.storage().1), ptr(latent.storage())]
                }
                _ => panic!("GPT-NeoX's kinds here keep a Recent or a DarCache"),
            })
            .collect()
    }

    /// A cache reserved for the whole request is written in place: after the prefill, no decode step
    /// moves any layer's buffer (no per-token concatenation), and decoding stays exact. Without the
    /// reservation the buffers grow by doubling: they move only at powers of two.
    #[test]
    fn decode_writes_in_place() {
        let _rng = crate::testutil::rng();
        for (kind, d_down, w) in VARIANTS {
            let (_vs, m) = build(cfg(kind, d_down, w), 22);
            let x = ids(1, 20);
            let full = m.forward(&x);
            let mut cache = m.new_cache(1, tch::Kind::Double, tch::Device::Cpu);
            cache.reserve(20);
            let _ = m.extend(&mut cache, &x.narrow(1, 0, 6));
            let at_prefill = buffers(&cache);
            let mut moves = 0;
            let mut grown = m.new_cache(1, tch::Kind::Double, tch::Device::Cpu);
            let _ = m.extend(&mut grown, &x.narrow(1, 0, 6));
            for t in 6..20 {
                let step = m.extend(&mut cache, &x.narrow(1, t, 1));
                assert!(err(&step, &full.narrow(1, t, 1)) < 1e-10, "{kind:?} w={w} step {t}");
                assert_eq!(buffers(&cache), at_prefill, "{kind:?} w={w}: a buffer moved at step {t}");
                let before = buffers(&grown);
                let step = m.extend(&mut grown, &x.narrow(1, t, 1));
                assert!(err(&step, &full.narrow(1, t, 1)) < 1e-10, "{kind:?} w={w} step {t} (grown)");
                moves += usize::from(buffers(&grown) != before);
            }
            // 6 → 12 → 24 slots: two moves at most (a copy per token would make 14); none for a ring
            // of at most 6 slots.
            let want = if kind == AttentionKind::Window && w <= 6 { 0 } else { 2 };
            assert!(moves <= want, "{kind:?} w={w}: {moves} moves");
        }
    }
}
