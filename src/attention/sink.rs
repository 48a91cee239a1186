//! Attention sinks (StreamingLLM, Xiao et al. 2023): query i reads key j of its own document when
//! j is one of the document's first `sinks` tokens or when 0 ≤ i − j < `window`; nothing else.
//! `attention: {kind: sink, window: 128, sinks: 4}`. The sinks keep the softmax's mass somewhere
//! stable when the window slides, a standard baseline for long-context memory at bounded cost.
//!
//! Reference: the explicit masked softmax; fast path: SDPA with the same boolean mask (packed rows:
//! positions count from each document's start). Decode keeps the first `sinks` tokens (after a row's
//! left padding) and a ring of the last `window`: at most 2·(sinks + padding + window)·d_kv elements
//! per layer and sequence, whatever the length.
use super::cache::{attend_newest, distances, masked_parts, CacheShape, KindCache, LayerCache, Padding, Recent};
use super::kinds::{resolve_local_window, AttentionImpl, AttentionSpec, DEFAULT_WINDOW, BenchInputs, LineStyle, Settings, SoftmaxKind};
use super::layer::{rebuilt_without_parameters, Heads, LayerDims, LayerOp};
use super::{dar_masks, doc_dar_masks, doc_segments, masked};
use crate::error::Invalid;
use crate::{kernels, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};

/// `attention: {kind: sink, window, sinks}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sink {
    /// Keys at distance < window (the current token included); default 128.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<i64>,
    /// The first tokens of each document every later token reads; default 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sinks: Option<i64>,
    #[serde(default, rename = "impl")]
    pub implementation: AttentionImpl,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

const DEFAULT_SINKS: i64 = 4;

impl SoftmaxKind for Sink {
    const NAME: &'static str = "sink";
    const ALIASES: &'static [&'static str] = &["sinks", "streaming"];
    const TABLE_NAME: &'static str = "Sinks + window";
    const LINE_STYLE: LineStyle = LineStyle::Dotted;
    const DECODE_BENCH: &'static str = "GPT-NeoX, attention sinks: K/V of the first 4 tokens and of the last w (the spec's window, default 128)";
    const HAS_BOTTLENECK: bool = false;
    const LOCAL_ONLY: bool = false;

    /// A local window carries over (the sinks' control of a DAR or window-only run).
    fn adopt(other: &AttentionSpec) -> Self {
        let s = other.settings();
        Sink { window: s.window.filter(|&w| w > 0).map(|w| w as i64), sinks: None, implementation: s.implementation, note: None }
    }

    fn resolve(&mut self, _d_model: usize) -> std::result::Result<(), Invalid> {
        let w = resolve_local_window(&mut self.window, Self::NAME)?;
        let n = *self.sinks.get_or_insert(DEFAULT_SINKS);
        if n < 1 {
            return Err(("sinks".into(), format!("{n}: kind: sink needs at least one sink (none is kind: window)")));
        }
        self.note = Some(format!("sink: each document's first {n} tokens and keys at distance < {w} (the current token included)"));
        Ok(())
    }

    fn resolve_finetune(&mut self) -> std::result::Result<(), Invalid> {
        Err(("kind".into(), "finetune keeps vanilla or changes the attention to dar, not to sink".into()))
    }

    fn comparable(&self) -> AttentionSpec {
        AttentionSpec::Sink(Sink { window: self.window, sinks: self.sinks, ..Sink::default() })
    }

    fn label(&self) -> String {
        match (self.window, self.sinks) {
            (Some(w), Some(n)) => format!("sinks (w {w}, {n} sinks)"),
            _ => "sink".into(),
        }
    }

    fn settings(&self) -> Settings {
        Settings { window: self.window.filter(|&w| w >= 0).map(|w| w as usize), implementation: self.implementation, ..Settings::default() }
    }

    fn set_implementation(&mut self, imp: AttentionImpl) {
        self.implementation = imp;
    }

    fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    fn layer(&self, _p: &nn::Path, _dims: LayerDims) -> Result<Box<dyn LayerOp>> {
        Ok(Box::new(SinkLayer { window: self.window.unwrap_or(DEFAULT_WINDOW), sinks: self.sinks.unwrap_or(DEFAULT_SINKS), imp: self.implementation }))
    }

    fn bench_op(x: &BenchInputs) -> Tensor {
        forward(x.q, x.k, x.v, x.window, DEFAULT_SINKS, None, x.imp)
    }
}

/// The mask `[T, T]` (packed rows: `[B, 1, T, T]`) of the keys each query reads: DAR's local band,
/// and of its distant keys only the sinks (a key's position in its document < sinks).
fn mask(t: i64, window: i64, sinks: i64, seg: Option<&Tensor>, device: Device) -> Tensor {
    let ((local, far), sink_keys) = match seg {
        None => (dar_masks(t, window, device), Tensor::arange(t, (Kind::Int64, device)).lt(sinks).unsqueeze(0)),
        Some(seg) => (doc_dar_masks(seg, window), doc_segments(seg).1.lt(sinks).view([seg.size()[0], 1, 1, t])),
    };
    local.logical_or(&far.logical_and(&sink_keys))
}

/// Attention sinks over heads `[B, H, T, hd]`; `seg`: document segments of packed rows.
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, window: i64, sinks: i64, seg: Option<&Tensor>, imp: AttentionImpl) -> Tensor {
    let m = mask(q.size()[2], window, sinks, seg, q.device());
    masked(q, &[(k, v, &m)], imp)
}

/// A sink layer: no parameters.
pub struct SinkLayer {
    window: i64,
    sinks: i64,
    imp: AttentionImpl,
}

impl LayerOp for SinkLayer {
    fn forward(&self, h: &Heads) -> Tensor {
        let (k, v) = h.expanded_kv();
        kernels::scope("attn.op", || forward(&h.q, &k, &v, self.window, self.sinks, h.seg, self.imp))
    }

    fn new_cache(&self, shape: &CacheShape) -> LayerCache {
        LayerCache::new(SinkCache::new(shape, self.window, self.sinks))
    }

    fn decode(&self, cache: &mut LayerCache, h: &Heads, p0: i64) -> Tensor {
        let c = cache.state::<SinkCache>();
        if p0 == 0 {
            let out = self.forward(h);
            c.push(&h.k, &h.v);
            return out;
        }
        c.attend(&h.q, &h.k, &h.v, p0)
    }

    fn reconfigured(&self, a: &AttentionSpec) -> Option<Box<dyn LayerOp>> {
        rebuilt_without_parameters(a)
    }

    fn parameters(&self) -> Vec<Tensor> {
        Vec::new()
    }
}

/// The first tokens (every row's sinks, after its left padding) and a ring of the last `window`.
pub struct SinkCache {
    /// Keys / values of positions 0..head_len, written once.
    head: Recent,
    head_len: i64,
    ring: Recent,
    window: i64,
    sinks: i64,
    seen: i64,
    pad: Option<Padding>,
}

impl SinkCache {
    fn new(shape: &CacheShape, window: i64, sinks: i64) -> Self {
        SinkCache { head: Recent::new(shape, None), head_len: sinks, ring: Recent::new(shape, Some(window)), window, sinks, seen: 0, pad: None }
    }

    fn push(&mut self, k: &Tensor, v: &Tensor) {
        let take = (self.head_len - self.seen).clamp(0, k.size()[2]);
        if take > 0 {
            self.head.push(&k.narrow(2, 0, take), &v.narrow(2, 0, take));
        }
        self.ring.push(k, v);
        self.seen += k.size()[2];
    }

    /// `[.., len]`: whether the held head positions are sinks of their row (`[len]` or `[B, 1, 1, len]`).
    fn sink_keys(&self, pos: &Tensor) -> Tensor {
        match &self.pad {
            None => pos.lt(self.sinks),
            Some(p) => p.keys(pos).logical_and(&p.keys(&(pos - self.sinks)).logical_not()),
        }
    }

    /// The new queries at p0.. over the sinks beyond their window and the ring (plus the new keys);
    /// stores the new tokens.
    fn attend(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, p0: i64) -> Tensor {
        let (n, device) = (q.size()[2], q.device());
        // The held sinks the band does not already hold: distance ≥ window.
        let far_sinks = |c: &SinkCache, n: i64| {
            let held = c.head.filled();
            distances(p0, n, 0, held, device).ge(c.window).logical_and(&c.sink_keys(&Tensor::arange(held, (Kind::Int64, device))))
        };
        if n == 1 {
            self.push(k, v);
            let (hk, hv) = self.head.held();
            let (rk, rv) = self.ring.held();
            let ring_mask = self.pad.as_ref().map(|p| p.keys(&self.ring.positions(device)));
            return attend_newest(q, &[(&rk, &rv, ring_mask), (&hk, &hv, Some(far_sinks(self, 1)))]);
        }
        let mut parts = self.ring.parts_before_push(k, v, p0);
        if self.head.filled() > 0 {
            let (hk, hv) = self.head.held();
            parts.push((hk, hv, far_sinks(self, n)));
        }
        // New tokens that are sinks themselves, read beyond the band within this piece.
        let new_pos = Tensor::arange_start(p0, p0 + n, (Kind::Int64, device));
        let d = distances(p0, n, p0, n, device);
        parts.push((k.shallow_clone(), v.shallow_clone(), d.ge(self.window).logical_and(&self.sink_keys(&new_pos))));
        let out = masked_parts(q, &parts);
        self.push(k, v);
        out
    }
}

impl KindCache for SinkCache {
    fn bytes(&self) -> i64 {
        self.head.bytes() + self.ring.bytes()
    }

    /// The sinks (after the largest padding) and the window, whatever the length.
    fn bound(&self, tokens: i64) -> Option<i64> {
        Some(self.head.bound(tokens.min(self.head_len)) + self.ring.bound(tokens))
    }

    fn reserve(&mut self, tokens: i64) {
        self.head.reserve(tokens.min(self.head_len));
        self.ring.reserve(tokens);
    }

    /// The head holds every row's sinks: `sinks` positions after the largest padding.
    fn set_padding(&mut self, pad: &Padding) {
        self.head_len = self.sinks + pad.largest();
        self.ring.set_padding(pad);
        self.pad = Some(pad.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::tests::{grads_of, max_diff, rand};

    /// Independent of the masks: for each query, a softmax over the keys it reads, picked by index.
    fn by_loops(q: &Tensor, k: &Tensor, v: &Tensor, window: i64, sinks: i64) -> Tensor {
        let (t, hd) = (q.size()[2], q.size()[3]);
        let rows: Vec<Tensor> = (0..t)
            .map(|i| {
                let picked: Vec<i64> = (0..=i).filter(|&j| j < sinks || i - j < window).collect();
                let idx = Tensor::from_slice(&picked);
                let (ks, vs) = (k.index_select(2, &idx), v.index_select(2, &idx));
                let p = (q.narrow(2, i, 1).matmul(&ks.transpose(-2, -1)) / (hd as f64).sqrt()).softmax(-1, Kind::Double);
                p.matmul(&vs)
            })
            .collect();
        Tensor::cat(&rows, 2)
    }

    /// Reference and SDPA equal the per-query loop, outputs and input gradients, for windows and
    /// sink counts inside and beyond the sequence.
    #[test]
    fn fast_and_reference_match_the_loop() {
        let _rng = crate::testutil::rng();
        let shape = [2, 3, 13, 8];
        for (w, n) in [(1i64, 1i64), (3, 4), (5, 2), (13, 4), (4, 20)] {
            let inputs: Vec<Tensor> = (0..3).map(|s| rand(&shape, 10 * w + n + s)).collect();
            let go = rand(&shape, 99).detach();
            let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Tensor| {
                let out = f(&inputs[0], &inputs[1], &inputs[2]);
                (out.detach(), grads_of(&out, &go, &inputs))
            };
            let (want, want_g) = run(&|q, k, v| by_loops(q, k, v, w, n));
            for imp in [AttentionImpl::Reference, AttentionImpl::Sdpa] {
                let (got, got_g) = run(&|q, k, v| forward(q, k, v, w, n, None, imp));
                assert!(max_diff(&got, &want) < 1e-10, "w {w} sinks {n} {imp:?}");
                for (a, b) in got_g.iter().zip(&want_g) {
                    assert!(max_diff(a, b) < 1e-10, "w {w} sinks {n} {imp:?} gradient");
                }
            }
        }
    }

    /// Packed documents: each document has its own sinks (its first tokens), as when run alone.
    #[test]
    fn packed_documents_have_their_own_sinks() {
        let _rng = crate::testutil::rng();
        let (q, k, v) = (rand(&[1, 2, 11, 4], 1), rand(&[1, 2, 11, 4], 2), rand(&[1, 2, 11, 4], 3));
        let docs = Tensor::from_slice(&[5i64, 5, 5, 5, 2, 2, 2, 2, 2, 2, 2]).view([1, 11]);
        let (seg, _) = doc_segments(&docs);
        for imp in [AttentionImpl::Reference, AttentionImpl::Sdpa] {
            let packed = forward(&q, &k, &v, 2, 2, Some(&seg), imp);
            for (at, n) in [(0, 4), (4, 7)] {
                let cut = |x: &Tensor| x.narrow(2, at, n);
                assert!(max_diff(&cut(&packed), &by_loops(&cut(&q), &cut(&k), &cut(&v), 2, 2)) < 1e-10, "{imp:?} doc at {at}");
            }
        }
    }

    /// Decoding (a prefill, a piece of several tokens, then one at a time) equals the forward pass,
    /// and the cache stays at the sinks plus the window: 2·(sinks + min(w, T))·H_kv·hd elements.
    #[test]
    fn decode_equals_forward_with_a_bounded_cache() {
        let _rng = crate::testutil::rng();
        let (h, t, hd) = (2, 16, 4);
        for (w, n, prompt, piece) in [(3i64, 2i64, 1i64, 6i64), (4, 4, 5, 3), (2, 1, 2, 1)] {
            let (q, k, v) = (rand(&[1, h, t, hd], 4).detach(), rand(&[1, h, t, hd], 5).detach(), rand(&[1, h, t, hd], 6).detach());
            let full = forward(&q, &k, &v, w, n, None, AttentionImpl::Reference);
            let shape = CacheShape { batch: 1, kv_heads: h, head_dim: hd, kind: Kind::Double, device: Device::Cpu };
            let mut cache = SinkCache::new(&shape, w, n);
            let cut = |x: &Tensor, a: i64, len: i64| x.narrow(2, a, len);
            let pre = forward(&cut(&q, 0, prompt), &cut(&k, 0, prompt), &cut(&v, 0, prompt), w, n, None, AttentionImpl::Reference);
            cache.push(&cut(&k, 0, prompt), &cut(&v, 0, prompt));
            let mut got = vec![pre];
            got.push(cache.attend(&cut(&q, prompt, piece), &cut(&k, prompt, piece), &cut(&v, prompt, piece), prompt));
            for p in prompt + piece..t {
                got.push(cache.attend(&cut(&q, p, 1), &cut(&k, p, 1), &cut(&v, p, 1), p));
                let held = n.min(p + 1) + w.min(p + 1);
                assert_eq!(KindCache::bytes(&cache), 2 * held * h * hd * 8, "w {w} sinks {n}: after {} tokens", p + 1);
            }
            assert!(max_diff(&Tensor::cat(&got, 2), &full) < 1e-12, "w {w} sinks {n} prompt {prompt} piece {piece}");
        }
    }

    /// The spec: defaults, refusals naming the key, and a key of another kind refused by serde.
    #[test]
    fn spec_resolves_and_refuses() {
        let spec = |yaml: &str| crate::spec::from_str(crate::spec::BUILTIN_TINY, "tiny.yaml", &[format!("attention={yaml}")]);
        let s = spec("{kind: sink}").unwrap();
        assert_eq!(s.attention, AttentionSpec::Sink(Sink { window: Some(128), sinks: Some(4), note: s.attention.note().map(String::from), ..Sink::default() }));
        assert_eq!(s.attention.label(), "sinks (w 128, 4 sinks)");
        for (yaml, want) in [("{kind: sink, sinks: 0}", "`attention.sinks`"), ("{kind: sink, window: 0}", "`attention.window`"), ("{kind: sink, d_down: 8}", "unknown field `d_down`"), ("{kind: dar, sinks: 4}", "unknown field `sinks`")] {
            let e = spec(yaml).unwrap_err().to_string();
            assert!(e.contains(want), "{yaml}: {e}");
        }
    }
}
