//! Incremental decoding for GPT-NeoX with the decode caches of `crate::attention::cache`:
//! vanilla keeps the rotated keys and values of every token; DAR / uniform keep dar.md §3's latent
//! cache (`attention::dar::DarCache`), whose distant keys/values this model rebuilds from the latents
//! h^D = LN1(x)·W_down with W_up absorbed into the k/v rows of `query_key_value`
//! ((h^D)·(W_kv·W_up)ᵀ + b_kv, then RoPE at each key's own position). Decoding token by token equals
//! the full forward pass on the growing sequence (tested).
use super::{GptNeox, LayerKv};
use crate::attention::cache::{CacheShape, DecodeCache, SpanTables, StepAt, StepTables};
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
        self.stack_projections();
        let (cos, sin) = self.rope.tables(p0, n, ids.device());
        let mut x = Tensor::embedding(&self.embed_in, ids, -1, false, false);
        // Left-padded rows: their filler is a document of its own in the prefill.
        let seg = cache.prefill_segments(n);
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let a = layer.input_layernorm.forward(&x);
            let (q, k, v) = self.qkv(layer, &a, &cos, &sin);
            let kv = LayerKv { model: self, layer, cos: &cos, sin: &sin, span: None };
            let o = layer.attn.decode(lc, &Heads { q, k, v, input: &a, projected: None, seg: seg.as_ref(), kv: &kv, train: false }, p0);
            let mlp = self.mlp(layer, &layer.post_attention_layernorm.forward(&x));
            x = x + self.attention_out(layer, &o) + mlp;
        }
        cache.len += n;
        self.final_layer_norm.forward(&x)
    }

    /// One token per row, `ids` `[B, 1]`, at the device-side position `at.pos`: final hidden states
    /// `[B, 1, d]`, every layer's cache written in place (`LayerOp::decode_at`) and nothing counted
    /// on the host (`DecodeCache::advance`), so that a CUDA graph captures it. None when the layers'
    /// variant has no such step.
    pub fn extend_hidden_at(&self, cache: &mut NeoxCache, ids: &Tensor, at: &StepAt) -> Option<Tensor> {
        // The tables `prepare_at` made for every position the step reads (else made here, inside it).
        let prepared = self.step_tables.covering(at.span, at.pos.device());
        let (cos, sin) = prepared.as_ref().map_or_else(|| self.rope.tables_at(&at.pos), |t| StepTables::rows(t, &at.pos));
        // Key positions 0..span, for DAR's distant keys: made once per step, not per layer.
        let span = SpanTables::new(at.span, prepared.as_ref());
        let mut x = Tensor::embedding(&self.embed_in, ids, -1, false, false);
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            let a = layer.input_layernorm.forward(&x);
            let (q, k, v, projected) = self.qkv_projected(layer, &a, &cos, &sin);
            let kv = LayerKv { model: self, layer, cos: &cos, sin: &sin, span: Some(&span) };
            let o = layer.attn.decode_at(lc, &Heads { q, k, v, input: &a, projected, seg: None, kv: &kv, train: false }, at)?;
            let mlp = self.mlp(layer, &layer.post_attention_layernorm.forward(&x));
            x = x + self.attention_out(layer, &o) + mlp;
        }
        Some(self.final_layer_norm.forward(&x))
    }

    /// Whether every layer's step state is made (`LayerOp::step_state_made`).
    pub fn step_state_made(&self, cache: &mut NeoxCache) -> bool {
        self.layers.iter().zip(cache.layers.iter_mut()).all(|(layer, lc)| layer.attn.step_state_made(lc))
    }

    /// Before the device-side step at `pos`: every layer's `LayerOp::prepare_at`.
    pub fn prepare_at(&self, cache: &mut NeoxCache, pos: i64, reserved: i64) {
        let device = self.embed_in.device();
        self.step_tables.prepare(reserved.max(pos + 1), device, |n| self.rope.tables(0, n, device));
        for (layer, lc) in self.layers.iter().zip(cache.layers.iter_mut()) {
            layer.attn.prepare_at(lc, pos, reserved);
        }
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
    /// the rounding of the fp32 RoPE tables at shifted positions. The single-token steps run through
    /// `extend` and through the device-side step (`extend_hidden_at`; DAR reading its latents
    /// through the absorbed map), whose masks carry the padding the same way.
    #[test]
    fn left_padded_batch_equals_each_row_alone() {
        use crate::attention::cache::StepAt;
        let _rng = crate::testutil::rng();
        for ((kind, d_down, w), device_side) in VARIANTS.into_iter().flat_map(|v| [(v, false), (v, true)]) {
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
            batch.reserve(longest + steps);
            if device_side && matches!(kind, AttentionKind::Dar | AttentionKind::Uniform) {
                batch.layers.iter_mut().for_each(|l| l.state::<DarCache>().set_absorb_from(0));
            }
            let mut got = vec![m.extend(&mut batch, &padded).narrow(1, longest - 1, 1)];
            got.push(m.extend(&mut batch, &next.narrow(1, 0, 3)));
            // DAR's first device-side step makes its absorbed map (what a graph must not record in
            // place of an eager call, `step_state_made`); the other kinds have no such state.
            let lazy = matches!(kind, AttentionKind::Dar | AttentionKind::Uniform);
            assert_eq!(m.step_state_made(&mut batch), !lazy, "{kind:?}: step state before the first step");
            for t in 3..steps {
                let token = next.narrow(1, t, 1);
                got.push(if device_side {
                    let at = StepAt { pos: Tensor::from_slice(&[longest + t]), span: longest + steps };
                    let h = m.extend_hidden_at(&mut batch, &token, &at).expect("GPT-NeoX's softmax kinds step on the device");
                    batch.advance(1);
                    m.logits(&h)
                } else {
                    m.extend(&mut batch, &token)
                });
            }
            assert_eq!(m.step_state_made(&mut batch), device_side || !lazy, "{kind:?} device-side {device_side}: step state after the steps");
            let got = Tensor::cat(&got, 1);
            for r in 0..3 {
                let alone = Tensor::cat(&[prompt(r), next.get(r)], 0).unsqueeze(0);
                let want = m.forward(&alone).narrow(1, lens[r as usize] - 1, steps + 1);
                let e = err(&got.narrow(0, r, 1), &want);
                // RoPE tables are fp32: a row shifted by its padding rotates by angles rounded
                // differently (filler read by a real token would differ by far more).
                assert!(e < 1e-5, "{kind:?} w={w} device-side {device_side} row {r}: {e}");
            }
        }
    }

    /// The device-side step (position a tensor, shapes fixed by the span: what a CUDA graph
    /// captures): after a prefill, one token at a time with spans that change between steps (the
    /// smallest that holds the position, and the whole reservation), every step's logits equal the
    /// full forward pass, rings wrapping (left-padded rows: `left_padded_batch_equals_each_row_alone`).
    /// A span one short of the position would hide the newest keys: it must differ. The steps read
    /// RoPE tables made inside them and, after `prepare_at`, the prepared ones.
    #[test]
    fn device_side_steps_equal_full_forward() {
        use crate::attention::cache::StepAt;
        let _rng = crate::testutil::rng();
        for (kind, d_down, w) in VARIANTS {
            let (_vs, m) = build(cfg(kind, d_down, w), 24);
            let x = ids(2, 16);
            let full = m.forward(&x);
            // With autograd on, every projection multiplies on its own; under no_grad, DAR's and
            // uniform's W_down joins query_key_value's multiply (`Heads::projected`).
            for grad in [true, false] {
                let _g = (!grad).then(tch::no_grad_guard);
                let mut cache = m.new_cache(2, tch::Kind::Double, tch::Device::Cpu);
                cache.reserve(16);
                // DAR: spans of 10 slots and more read the latents through the absorbed k / v map,
                // shorter ones rebuild their keys and values: both paths, switching mid-way.
                if matches!(kind, AttentionKind::Dar | AttentionKind::Uniform) {
                    cache.layers.iter_mut().for_each(|l| l.state::<DarCache>().set_absorb_from(10));
                }
                let _ = m.extend(&mut cache, &x.narrow(1, 0, 4));
                for t in 4..16 {
                    // Without a gradient the steps read the RoPE tables `prepare_at` made (what the
                    // stepper does), with one they make their own.
                    if !grad {
                        m.prepare_at(&mut cache, t, 16);
                    }
                    let at = StepAt { pos: Tensor::from_slice(&[t]), span: if t % 2 == 0 { t + 1 } else { 16 } };
                    let h = m.extend_hidden_at(&mut cache, &x.narrow(1, t, 1), &at).expect("GPT-NeoX's softmax kinds step on the device");
                    cache.advance(1);
                    let got = m.logits(&h);
                    assert!(err(&got, &full.narrow(1, t, 1)) < 1e-10, "{kind:?} w={w} grad {grad} step {t}: {}", err(&got, &full.narrow(1, t, 1)));
                }
                assert_eq!(cache.len, 16);
                let stacked = m.layers.iter().all(|l| {
                    let (w, b) = super::GptNeox::qkv_parts(l);
                    w.len() == 2 && l.qkv_stack.get_biased(&w, &b).is_some()
                });
                assert_eq!(stacked, matches!(kind, AttentionKind::Dar | AttentionKind::Uniform), "{kind:?}: W_down stacked with query_key_value");
            }
            // The span is honoured: too short a span drops keys the token must read.
            let mut short = m.new_cache(2, tch::Kind::Double, tch::Device::Cpu);
            short.reserve(16);
            let _ = m.extend(&mut short, &x.narrow(1, 0, 9));
            let at = StepAt { pos: Tensor::from_slice(&[9i64]), span: 9 };
            let h = m.extend_hidden_at(&mut short, &x.narrow(1, 9, 1), &at).unwrap();
            if kind == AttentionKind::Vanilla {
                assert!(err(&m.logits(&h), &full.narrow(1, 9, 1)) > 1e-6, "vanilla with span 9 at position 9 read its own key");
            }
        }
    }

    /// DAR's latents read through the absorbed k / v map (the query folded into the unrotated key
    /// dims, the output into the values; `dar::read_latents`) equal attention over the keys and
    /// values rebuilt from them (`KvMap::kv`), with a ring of full-width keys beside them and masks
    /// that differ per row, at rotary fractions 0, 1/4 and 1, with and without the ring (uniform).
    #[test]
    fn absorbed_latent_read_equals_rebuilt_keys() {
        use crate::attention::cache::attend_newest;
        use crate::attention::dar::read_latents;
        use crate::attention::{KvMap, Positions};
        use tch::{Device, Kind};
        let _rng = crate::testutil::rng();
        for pct in [0.0, 0.25, 1.0] {
            let mut c = cfg(AttentionKind::Dar, 8, 3);
            c.rotary_pct = pct;
            let (_vs, m) = build(c, 25);
            let (b, s, r, h, hd) = (2i64, 11i64, 5i64, 4i64, 8i64);
            let f = (Kind::Double, Device::Cpu);
            // A bias (zero at init) so that the bias terms of keys and values count.
            let bias = m.layers[1].query_key_value.bs.as_ref().expect("qkv has a bias");
            tch::no_grad(|| bias.shallow_clone().copy_(&Tensor::randn(bias.size(), f)));
            let w = Tensor::randn([32, r], f);
            let lat = Tensor::randn([b, s, r], f);
            let (cos, sin) = m.rope.tables(0, s, Device::Cpu);
            let kv = super::super::LayerKv { model: &m, layer: &m.layers[1], cos: &cos, sin: &sin, span: None };
            let (kg, vg) = kv.kv(&w, &lat, Positions::From(0));
            let a = kv.absorbed(&w).expect("GPT-NeoX absorbs its k / v map");
            let (rc, rs) = kv.rotary_tables(s).expect("and gives its tables");
            let q = Tensor::randn([b, h, 1, hd], f);
            let (rk, rv) = (Tensor::randn([b, h, 3, hd], f), Tensor::randn([b, h, 3, hd], f));
            let ring_mask = Tensor::from_slice(&[true, false, true]).view([1, 1, 1, 3]);
            // Row 0 sees latents 0..8, row 1 (left-padded by 2) latents 2..8.
            let pos = Tensor::arange(s, (Kind::Int64, Device::Cpu));
            let far = pos.lt(8).view([1, 1, 1, s]).logical_and(&pos.view([1, 1, 1, s]).ge_tensor(&Tensor::from_slice(&[0i64, 2]).view([2, 1, 1, 1])));
            let ring = (rk.shallow_clone(), rv.shallow_clone(), ring_mask.shallow_clone());
            let got = read_latents(&q, Some(&ring), &lat, &far, &a, &rc, &rs);
            let want = attend_newest(&q, &[(&rk, &rv, Some(ring_mask.shallow_clone())), (&kg, &vg, Some(far.shallow_clone()))]);
            assert!(err(&got, &want) < 1e-10, "rotary {pct}, with the ring: {}", err(&got, &want));
            let got = read_latents(&q, None, &lat, &far, &a, &rc, &rs);
            let want = attend_newest(&q, &[(&kg, &vg, Some(far.shallow_clone()))]);
            assert!(err(&got, &want) < 1e-10, "rotary {pct}, latents alone: {}", err(&got, &want));
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
