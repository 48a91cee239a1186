//! Sliding-window attention (`attention: {kind: window, window: W}`): query i reads key j only when
//! 0 ≤ i − j < W, and nothing farther — DAR without its distant keys, the control that asks whether
//! DAR's distant path does anything. Reference: the explicit masked softmax. Fast path: SDPA with the
//! band as a boolean mask (on CPU and CUDA alike: the kernel shim's windowed flash call lives inside
//! DAR's split-merge and is not exposed on its own); W ≥ T is plain causal attention (flash on CUDA).
//! Decode keeps the last W tokens' keys and values (`cache::Recent`): at most 2·W·d_kv per layer.
use super::cache::{decode_recent, decode_recent_at, CacheShape, LayerCache, Recent, StepAt};
use super::dar::DarAct;
use super::kinds::{drop_legacy, resolve_local_window, AttentionImpl, DEFAULT_WINDOW, AttentionSpec, BenchInputs, LineStyle, Settings, SoftmaxKind};
use super::layer::{rebuilt_without_parameters, Heads, LayerDims, LayerOp};
use super::{causal, dar_masks, doc_dar_masks, masked};
use crate::error::Invalid;
use crate::{kernels, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Tensor};

/// `attention: {kind: window, window: W}`.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Window {
    /// Keys at distance < window (the current token included); default 128.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<i64>,
    /// Not an option of this kind: older versions recorded the spec's `dar_act` for every kind, and
    /// config.yaml still writes it so that existing run directories keep their config hash (names).
    #[serde(default)]
    pub dar_act: DarAct,
    #[serde(default, rename = "impl")]
    pub implementation: AttentionImpl,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl SoftmaxKind for Window {
    const NAME: &'static str = "window";
    const ALIASES: &'static [&'static str] = &["window-only", "swa"];
    const TABLE_NAME: &'static str = "Window-only";
    const LINE_STYLE: LineStyle = LineStyle::Dotted;
    const DECODE_BENCH: &'static str = "GPT-NeoX, sliding-window attention only (the spec's window, default 128): K/V of the last w tokens";
    const HAS_BOTTLENECK: bool = false;
    const LOCAL_ONLY: bool = true;

    /// DAR's or a window's local window is kept (the control of that DAR run); others start at 128.
    fn adopt(other: &AttentionSpec) -> Self {
        let s = other.settings();
        let window = s.window.filter(|&w| w > 0).map(|w| w as i64);
        Window { window, dar_act: s.dar_act, implementation: s.implementation, note: None }
    }

    fn resolve(&mut self, _d_model: usize) -> std::result::Result<(), Invalid> {
        let w = resolve_local_window(&mut self.window, Self::NAME)?;
        self.note = Some(format!("window: keys at distance < {w} (the current token included), nothing farther"));
        Ok(())
    }

    fn resolve_finetune(&mut self) -> std::result::Result<(), Invalid> {
        Err(("kind".into(), "finetune keeps vanilla or changes the attention to dar, not to window".into()))
    }

    fn comparable(&self) -> AttentionSpec {
        AttentionSpec::Window(Window { window: self.window.filter(|&w| w >= 0), ..Window::default() })
    }

    fn label(&self) -> String {
        match self.window.filter(|&w| w >= 0) {
            Some(w) => format!("window-only (w {w})"),
            None => "window".into(),
        }
    }

    fn settings(&self) -> Settings {
        Settings { window: self.window.filter(|&w| w >= 0).map(|w| w as usize), dar_act: self.dar_act, implementation: self.implementation, ..Settings::default() }
    }

    fn set_implementation(&mut self, imp: AttentionImpl) {
        self.implementation = imp;
    }

    fn note(&self) -> Option<&str> {
        self.note.as_deref()
    }

    fn layer(&self, _p: &nn::Path, _dims: LayerDims) -> Result<Box<dyn LayerOp>> {
        Ok(Box::new(WindowLayer { window: self.window.unwrap_or(DEFAULT_WINDOW), imp: self.implementation }))
    }

    fn bench_op(x: &BenchInputs) -> Tensor {
        forward(x.q, x.k, x.v, x.window, None, x.imp)
    }

    /// Model configs before issue 25 wrote `d_down: 0`; `compare` carried a DAR spec's `init` over.
    fn upgrade_legacy(map: &mut serde_yaml::Mapping) {
        drop_legacy(map, "d_down", Some(0.into()));
        drop_legacy(map, "init", None);
    }
}

/// A window-only layer: no parameters; decode keeps the last W tokens.
pub struct WindowLayer {
    window: i64,
    imp: AttentionImpl,
}

impl LayerOp for WindowLayer {
    fn forward(&self, h: &Heads) -> Tensor {
        let (k, v) = h.expanded_kv();
        kernels::scope("attn.op", || forward(&h.q, &k, &v, self.window, h.seg, self.imp))
    }

    fn new_cache(&self, shape: &CacheShape) -> LayerCache {
        LayerCache::new(new_cache(shape, self.window))
    }

    fn decode(&self, cache: &mut LayerCache, h: &Heads, p0: i64) -> Tensor {
        decode_recent(|| self.forward(h), cache, h, p0)
    }

    fn decode_at(&self, cache: &mut LayerCache, h: &Heads, at: &StepAt) -> Option<Tensor> {
        Some(decode_recent_at(cache, h, at))
    }

    fn reconfigured(&self, a: &AttentionSpec) -> Option<Box<dyn LayerOp>> {
        rebuilt_without_parameters(a)
    }

    fn parameters(&self) -> Vec<Tensor> {
        Vec::new()
    }
}

/// Attention over heads `[B, H, T, hd]`; `seg`: the document segments of packed rows
/// (`super::doc_segments`), so that no key is read across a document boundary.
pub fn forward(q: &Tensor, k: &Tensor, v: &Tensor, window: i64, seg: Option<&Tensor>, imp: AttentionImpl) -> Tensor {
    let t = q.size()[2];
    let band = match seg {
        None if window >= t && imp != AttentionImpl::Reference => return causal(q, k, v, imp),
        // The flash kernel's own window: O(T·w) work, no [T, T] mask (the 64K prefill's 0.5 s).
        None if !matches!(imp, AttentionImpl::Reference | AttentionImpl::Sdpa) && crate::kernels::flash_supported(q) => return super::flash_heads(q, k, v, window - 1),
        None => dar_masks(t, window, q.device()).0,
        Some(seg) => doc_dar_masks(seg, window).0,
    };
    masked(q, &[(k, v, &band)], imp)
}

/// An empty decode cache: the last `window` tokens.
pub fn new_cache(shape: &CacheShape, window: i64) -> Recent {
    Recent::new(shape, Some(window))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::tests::{grads_of, max_diff, rand};
    use crate::attention::AttentionKind;
    use tch::{Device, Kind};

    /// Independent of every mask helper: for each query, a softmax over the slice of keys in its window.
    fn by_loops(q: &Tensor, k: &Tensor, v: &Tensor, window: i64) -> Tensor {
        let (t, hd) = (q.size()[2], q.size()[3]);
        let rows: Vec<Tensor> = (0..t)
            .map(|i| {
                let lo = (i - window + 1).max(0);
                let (ks, vs) = (k.narrow(2, lo, i + 1 - lo), v.narrow(2, lo, i + 1 - lo));
                let p = (q.narrow(2, i, 1).matmul(&ks.transpose(-2, -1)) / (hd as f64).sqrt()).softmax(-1, Kind::Double);
                p.matmul(&vs)
            })
            .collect();
        Tensor::cat(&rows, 2)
    }

    /// Reference and masked SDPA equal the per-query loop, outputs and every input gradient, for
    /// windows inside, at and beyond the sequence.
    #[test]
    fn fast_and_reference_match_the_loop_forward_and_backward() {
        let _rng = crate::testutil::rng();
        let shape = [2, 3, 11, 8];
        for w in [1i64, 3, 10, 11, 20] {
            let inputs: Vec<Tensor> = (0..3).map(|s| rand(&shape, 10 * w + s)).collect();
            let go = rand(&shape, 99).detach();
            let run = |f: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Tensor| {
                let out = f(&inputs[0], &inputs[1], &inputs[2]);
                (out.detach(), grads_of(&out, &go, &inputs))
            };
            let (o_loop, g_loop) = run(&|q, k, v| by_loops(q, k, v, w));
            for imp in [AttentionImpl::Reference, AttentionImpl::Sdpa, AttentionImpl::Auto] {
                let (o, g) = run(&|q, k, v| forward(q, k, v, w, None, imp));
                assert!(max_diff(&o, &o_loop) < 1e-10, "w={w} {imp:?} forward");
                for (i, (a, b)) in g.iter().zip(&g_loop).enumerate() {
                    assert!(max_diff(a, b) < 1e-10, "w={w} {imp:?} grad of input {i}: {}", max_diff(a, b));
                }
            }
        }
    }

    /// Packed rows: each document's outputs equal the document attended alone, fast and reference.
    #[test]
    fn packed_documents_do_not_see_each_other() {
        let _rng = crate::testutil::rng();
        let (q, k, v) = (rand(&[1, 2, 10, 4], 1), rand(&[1, 2, 10, 4], 2), rand(&[1, 2, 10, 4], 3));
        let docs = Tensor::from_slice(&[5i64, 5, 5, 5, 2, 2, 2, 2, 2, 2]).view([1, 10]);
        let (seg, _) = crate::attention::doc_segments(&docs);
        for imp in [AttentionImpl::Reference, AttentionImpl::Sdpa] {
            let packed = forward(&q, &k, &v, 3, Some(&seg), imp);
            for (at, n) in [(0, 4), (4, 6)] {
                let cut = |x: &Tensor| x.narrow(2, at, n);
                let alone = by_loops(&cut(&q), &cut(&k), &cut(&v), 3);
                assert!(max_diff(&cut(&packed), &alone) < 1e-10, "{imp:?} doc at {at}");
            }
        }
    }

    /// Decoding (a prefill of 4, then one token at a time) equals the forward pass, and the cache never
    /// holds more than the last w tokens: 2·min(w, T)·H_kv·hd elements.
    #[test]
    fn decode_equals_forward_with_a_bounded_cache() {
        let _rng = crate::testutil::rng();
        let (h, t, hd, w) = (2, 12, 4, 3);
        let (q, k, v) = (rand(&[1, h, t, hd], 4).detach(), rand(&[1, h, t, hd], 5).detach(), rand(&[1, h, t, hd], 6).detach());
        let full = forward(&q, &k, &v, w, None, AttentionImpl::Reference);
        let shape = CacheShape { batch: 1, kv_heads: h, head_dim: hd, kind: Kind::Double, device: Device::Cpu };
        let mut cache = new_cache(&shape, w);
        let cut = |x: &Tensor, a: i64, n: i64| x.narrow(2, a, n);
        let mut got = vec![cache.attend(&cut(&q, 0, 4), &cut(&k, 0, 4), &cut(&v, 0, 4), 0)];
        for p in 4..t {
            got.push(cache.attend(&cut(&q, p, 1), &cut(&k, p, 1), &cut(&v, p, 1), p));
            assert_eq!(cache.bytes(), 2 * w.min(p + 1) * h * hd * 8, "after {} tokens", p + 1);
        }
        assert!(max_diff(&Tensor::cat(&got, 2), &full) < 1e-12);
    }

    /// The spec: `{kind: window, window: W}` resolves (window default 128, no d_down); a d_down or a
    /// window below 1 is an error naming the key; `with_attention(Window)` keeps a DAR spec's window.
    #[test]
    fn spec_resolves_and_rejects_bad_keys() {
        let spec = |sets: &[&str]| crate::spec::from_str(crate::spec::BUILTIN_TINY, "tiny.yaml", &sets.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let s = spec(&["attention={kind: window, window: 16}"]).unwrap();
        assert_eq!((s.attention.kind(), s.window(), s.attention.d_down_width()), (AttentionKind::Window, 16, None));
        assert_eq!(spec(&["attention={kind: window}"]).unwrap().window(), 128);
        // A key of another kind is refused by the kind's serde, a bad value by its resolve.
        for (sets, key) in [(&["attention={kind: window, d_down: 8}"][..], "unknown field `d_down`"), (&["attention={kind: window, window: 0}"][..], "`attention.window`")] {
            let e = spec(sets).unwrap_err().to_string();
            assert!(e.contains(key), "{sets:?}: {e}");
        }
        let dar = spec(&["attention.window=8"]).unwrap();
        let w = dar.with_attention(AttentionKind::Window).unwrap();
        assert_eq!((w.attention.kind(), w.window(), w.attention.d_down_width()), (AttentionKind::Window, 8, None));
    }
}
