//! LoLCATs attention, STILL's baseline (`../shared/specs/still.md` §7): the terrace window of
//! still.md §3 (chunk c−1 plus chunk c causally, chunks of `window` = 64 tokens) in softmax, Hedgehog
//! linear attention over everything older, and a per-head factor γ_h = σ(θ_h) on the softmax terms:
//!
//! y_t = (γ_h Σ_Win e^{s_tj−m_t} v_j + φ_q(q_t)ᵀS) / (γ_h Σ_Win e^{s_tj−m_t} + φ_q(q_t)·z),
//!
//! m_t over Win only and not compensated in the linear terms, no epsilon, no gate (LoLCATs Eq. 7).
//! This is STILL's operator with κ = 0, the Hedgehog map, no gate and the γ factor: the fast path
//! and the decode cache are `still.rs`'s; [`Lolcats::reference`] is written separately here.
//!
//! Parameters (relative to the layer's path, e.g. `model.layers.N.self_attn.`):
//! `feature_map_q.mlp.layer` and `feature_map_k.mlp.layer` `[H, D, F]` (untied; F = 64, so φ has 128
//! features), `window_factors` `[1, H, 1, 1]` (θ, initialised to −2.1972245773362196, γ = 0.1).
//!
//! The reference's decode uses a plain sliding window of 64 tokens, folding one token per step, which
//! differs from its prefill; our default is the terrace in decode too (`decode_window: sliding` is the
//! compat switch, §7).
use super::feature_maps::{FeatureMap, ParamInit};
use super::still::{compute_kind, dims4, Hybrid, HybridCache, Selection};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};

/// θ at init: σ(θ) = 0.1.
pub const WINDOW_FACTOR_INIT: f64 = -2.1972245773362196;

/// LoLCATs options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LolcatsConfig {
    /// Terrace chunk size w (64).
    #[serde(default = "default_window")]
    pub window: i64,
    /// F of the Hedgehog map (64; φ has 2F features).
    #[serde(default = "default_feature_dim")]
    pub feature_dim: i64,
    /// W_h init; LoLCATs converts after loading, so its kaiming-uniform constructor init stands.
    #[serde(default = "constructor")]
    pub init: ParamInit,
    #[serde(default)]
    pub decode_window: DecodeWindow,
}

/// The decode-time window (§7).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum DecodeWindow {
    /// The same terrace as prefill: decode equals prefill.
    #[default]
    Terrace,
    /// The reference decode: the `window` most recent tokens (the current one included); older tokens
    /// are folded into the state one at a time.
    #[serde(alias = "sliding64")]
    Sliding,
}

fn default_window() -> i64 {
    64
}
fn default_feature_dim() -> i64 {
    64
}
fn constructor() -> ParamInit {
    ParamInit::Constructor
}

impl Default for LolcatsConfig {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("defaults")
    }
}

/// LoLCATs' attention parameters for one layer.
#[derive(Debug)]
pub struct Lolcats {
    pub cfg: LolcatsConfig,
    pub heads: i64,
    pub head_dim: i64,
    pub feature_map_q: FeatureMap,
    pub feature_map_k: FeatureMap,
    /// θ `[1, H, 1, 1]`; γ = σ(θ).
    pub window_factors: Tensor,
}

impl Lolcats {
    pub fn new(p: &nn::Path, cfg: &LolcatsConfig, heads: i64, head_dim: i64) -> Result<Self> {
        if cfg.window < 1 || cfg.feature_dim < 1 {
            return Err(Error::Other(format!("attention: window ({}) and feature_dim ({}) must be ≥ 1", cfg.window, cfg.feature_dim)));
        }
        let map = |name: &str| FeatureMap::hedgehog(&(p / name), heads, head_dim, cfg.feature_dim, cfg.init);
        let window_factors = p.var("window_factors", &[1, heads, 1, 1], nn::Init::Const(WINDOW_FACTOR_INIT));
        Ok(Lolcats { cfg: cfg.clone(), heads, head_dim, feature_map_q: map("feature_map_q"), feature_map_k: map("feature_map_k"), window_factors })
    }

    /// γ_h = σ(θ_h) `[H]`.
    pub fn gamma(&self) -> Tensor {
        self.window_factors.sigmoid().flatten(0, -1)
    }

    fn hybrid(&self) -> Hybrid<'_> {
        Hybrid {
            chunk: self.cfg.window,
            fq: &self.feature_map_q,
            fk: &self.feature_map_k,
            selection: Selection::NONE,
            scorer: None,
            window_factors: Some(&self.window_factors),
            eps: 0.0,
            phantom_chunk0_keys: false,
            sliding_decode: self.cfg.decode_window == DecodeWindow::Sliding,
            linear: true,
            compensate: false,
            oracle: None,
        }
    }

    /// Prefill / training output `[B, H, T, hd]` of q, k, v `[B, H, T, hd]`.
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        self.hybrid().prefill(q, k, v, None, false).0
    }

    /// [`Lolcats::forward`] plus the decode cache after the last token.
    pub fn prefill(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> (Tensor, HybridCache) {
        let (y, cache) = self.hybrid().prefill(q, k, v, None, true);
        (y, cache.expect("cache requested"))
    }

    pub fn new_cache(&self, batch: i64, kind: Kind, device: Device) -> HybridCache {
        HybridCache::empty(batch, self.heads, self.head_dim, self.feature_map_k.dim(), kind, device, self.cfg.window, Selection::NONE)
    }

    /// Decode one token (`[B, H, 1, hd]` each); returns `[B, H, 1, hd]`.
    pub fn step(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        self.hybrid().step(cache, q, k, v, None)
    }

    /// Decode n tokens at once: n [`Lolcats::step`]s. An empty cache takes the (terrace) prefill, so with
    /// `decode_window: sliding` the prompt is attended as in prefill and later tokens slide, as in the reference.
    pub fn extend(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        self.hybrid().extend(cache, q, k, v, None)
    }

    /// Explicit reference: dense masks of the terrace window, Eq. 7 with γ.
    pub fn reference(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        self.dense(q, k, v, DecodeWindow::Terrace)
    }

    /// Dense Eq. 7 with either window rule; `Sliding` is what the reference's decode computes.
    fn dense(&self, q: &Tensor, k: &Tensor, v: &Tensor, rule: DecodeWindow) -> Tensor {
        let (_, _, t, d) = dims4(q);
        let w = self.cfg.window;
        let kind = compute_kind(q);
        let (qf, kf, vf) = (q.to_kind(kind), k.to_kind(kind), v.to_kind(kind));
        let mut win = vec![false; (t * t) as usize];
        let mut lin = vec![false; (t * t) as usize];
        for i in 0..t {
            for j in 0..=i {
                let in_window = match rule {
                    DecodeWindow::Terrace => j / w + 1 >= i / w,
                    DecodeWindow::Sliding => i - j < w,
                };
                win[(i * t + j) as usize] = in_window;
                lin[(i * t + j) as usize] = !in_window;
            }
        }
        let mask = |m: &[bool]| Tensor::from_slice(m).view([t, t]).to_device(q.device());
        let (win, lin) = (mask(&win), mask(&lin));
        let s = (qf.matmul(&kf.transpose(-2, -1)) / (d as f64).sqrt()).masked_fill(&win.logical_not(), f64::NEG_INFINITY);
        let gamma = self.gamma().to_kind(kind).view([1, self.heads, 1, 1]);
        let a_sm = (&s - s.amax(-1, true)).exp() * gamma;
        let a_lin = self.feature_map_q.forward(&qf).matmul(&self.feature_map_k.forward(&kf).transpose(-2, -1)).masked_fill(&lin.logical_not(), 0.0);
        let a = a_sm + a_lin;
        (a.matmul(&vf) / a.sum_dim_intlist(-1, true, kind)).to_kind(q.kind())
    }
}

/// LoLCATs as a registered hybrid (`hybrid_kinds!` in `attention/mod.rs`).
impl super::HybridKind for LolcatsConfig {
    const NAME: &'static str = "lolcats";
    const TABLE_NAME: &'static str = "LoLCATs";
    const LINE_STYLE: super::LineStyle = super::LineStyle::Dashed;
    const DECODE_BENCH: &'static [(&'static str, &'static str, &'static str)] = &[("lolcats", "{kind: lolcats}", "terrace window of 64, Hedgehog linear attention")];
    const WEIGHT_DECAY: f64 = 0.0;
    const EVAL_EVERY: u64 = 100;

    fn layer(&self, p: &nn::Path, dims: super::LayerDims) -> Result<Box<dyn super::LayerOp>> {
        Ok(Box::new(Lolcats::new(p, self, dims.heads, dims.head_dim)?))
    }
}

/// A LoLCATs layer behind the model interface. Packed rows are refused: chunks count from position 0.
impl super::LayerOp for Lolcats {
    fn forward(&self, h: &super::Heads) -> Tensor {
        assert!(h.seg.is_none(), "LoLCATs layers take no packed rows");
        let (k, v) = h.expanded_kv();
        Lolcats::forward(self, &h.q, &k, &v)
    }

    fn new_cache(&self, shape: &super::cache::CacheShape) -> super::cache::LayerCache {
        super::cache::LayerCache::new(Lolcats::new_cache(self, shape.batch, shape.kind, shape.device))
    }

    fn decode(&self, cache: &mut super::cache::LayerCache, h: &super::Heads, _p0: i64) -> Tensor {
        let (k, v) = h.expanded_kv();
        self.extend(cache.state::<HybridCache>(), &h.q, &k, &v)
    }

    /// The terrace window only: the sliding compat window folds a token per step.
    fn decode_at(&self, cache: &mut super::cache::LayerCache, h: &super::Heads, at: &super::cache::StepAt) -> Option<Tensor> {
        let hybrid = self.hybrid();
        if !hybrid.steps_on_device() {
            return None;
        }
        let (k, v) = h.expanded_kv();
        Some(hybrid.step_at(cache.state::<HybridCache>(), &h.q, &k, &v, None, at))
    }

    fn prepare_at(&self, cache: &mut super::cache::LayerCache, pos: i64, reserved: i64) {
        let hybrid = self.hybrid();
        if hybrid.steps_on_device() {
            hybrid.prepare_at(cache.state::<HybridCache>(), pos, reserved)
        }
    }

    /// A linearized layer is not switched in place.
    fn reconfigured(&self, _a: &super::AttentionSpec) -> Option<Box<dyn super::LayerOp>> {
        None
    }

    /// The feature maps and the window factors θ.
    fn parameters(&self) -> Vec<Tensor> {
        let mut out = self.feature_map_q.parameters();
        out.extend(self.feature_map_k.parameters());
        out.push(self.window_factors.shallow_clone());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::tests::grads_of;

    fn layer(yaml: &str, h: i64, d: i64, seed: i64) -> (nn::VarStore, Lolcats) {
        let _rng = crate::testutil::seeded(seed);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let l = Lolcats::new(&vs.root(), &serde_yaml::from_str(yaml).unwrap(), h, d).unwrap();
        vs.double();
        (vs, l)
    }

    fn qkv(b: i64, h: i64, t: i64, d: i64, seed: i64) -> Vec<Tensor> {
        let _rng = crate::testutil::seeded(seed);
        (0..3).map(|_| Tensor::randn([b, h, t, d], (Kind::Double, Device::Cpu)).set_requires_grad(true)).collect()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        assert_eq!(a.size(), b.size());
        if a.numel() == 0 {
            return 0.0;
        }
        (a - b).abs().max().double_value(&[])
    }

    #[test]
    fn config_parameters_and_init() {
        let _rng = crate::testutil::rng();
        let c = LolcatsConfig::default();
        assert_eq!((c.window, c.feature_dim, c.init, c.decode_window), (64, 64, ParamInit::Constructor, DecodeWindow::Terrace));
        assert!(serde_yaml::from_str::<LolcatsConfig>("{window_size: 64}").is_err());
        assert_eq!(serde_yaml::from_str::<LolcatsConfig>("{decode_window: sliding64}").unwrap().decode_window, DecodeWindow::Sliding);
        let (vs, l) = layer("{}", 4, 16, 0);
        let mut names: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(k, v)| (k, v.size())).collect();
        names.sort();
        assert_eq!(
            names,
            [("feature_map_k.mlp.layer", vec![4, 16, 64]), ("feature_map_q.mlp.layer", vec![4, 16, 64]), ("window_factors", vec![1, 4, 1, 1])]
                .map(|(k, s)| (k.to_string(), s))
                .to_vec()
        );
        // σ(θ_init) = 0.1 (θ is stored in fp32); kaiming-uniform bound √(6/(D·F)) for the 3-d layer; φ has 2F = 128 features.
        assert!((l.gamma() - 0.1).abs().max().double_value(&[]) < 1e-8);
        let bound = (6.0f64 / (16.0 * 64.0)).sqrt();
        let wmax = l.feature_map_q.layer.abs().max().double_value(&[]);
        assert!(wmax <= bound && wmax > 0.9 * bound);
        assert_eq!(l.feature_map_q.dim(), 128);
        assert!(max_diff(&l.feature_map_q.layer, &l.feature_map_k.layer) > 0.0, "untied q and k maps");
    }

    /// still.md §12.9: the shared operator with κ = 0, the Hedgehog map, no gate and γ equals the dense
    /// LoLCATs terrace formula, in outputs and in the gradients of q, k, v, both maps and θ.
    #[test]
    fn fast_matches_reference() {
        let _rng = crate::testutil::rng();
        let (vs, l) = layer("{window: 8, feature_dim: 4}", 3, 8, 1);
        for t in [1i64, 7, 8, 9, 16, 17, 40] {
            let x = qkv(2, 3, t, 8, t);
            let go = Tensor::randn([2, 3, t, 8], (Kind::Double, Device::Cpu));
            let mut wrt: Vec<Tensor> = x.iter().map(|t| t.shallow_clone()).collect();
            wrt.extend(vs.trainable_variables());
            let run = |out: Tensor| (out.detach(), grads_of(&out, &go, &wrt));
            let (o_f, g_f) = run(l.forward(&x[0], &x[1], &x[2]));
            let (o_r, g_r) = run(l.reference(&x[0], &x[1], &x[2]));
            assert!(max_diff(&o_f, &o_r) < 1e-10, "T={t}");
            for (i, (a, b)) in g_f.iter().zip(&g_r).enumerate() {
                assert!(max_diff(a, b) < 1e-10, "T={t}: gradient {i}: {}", max_diff(a, b));
            }
            if t > 16 {
                assert!(g_f[3..].iter().all(|g| g.abs().max().double_value(&[]) > 0.0), "every parameter gets a gradient");
            }
        }
        // The default width (w = 64) on a longer sequence.
        let (_, l) = layer("{}", 2, 16, 2);
        let x = qkv(1, 2, 200, 16, 3);
        assert!(max_diff(&tch::no_grad(|| l.forward(&x[0], &x[1], &x[2])), &tch::no_grad(|| l.reference(&x[0], &x[1], &x[2]))) < 1e-10);
    }

    fn decode(l: &Lolcats, cache: &mut HybridCache, x: &[Tensor], from: i64, to: i64) -> Tensor {
        let outs: Vec<Tensor> = (from..to).map(|p| l.step(cache, &x[0].narrow(2, p, 1), &x[1].narrow(2, p, 1), &x[2].narrow(2, p, 1))).collect();
        Tensor::cat(&outs, 2)
    }

    /// Terrace decode equals prefill (outputs and cache) from any prefix; the sliding compat decode equals
    /// the dense sliding-window formula instead, and so differs from prefill.
    #[test]
    fn decode_matches_prefill_or_the_sliding_formula() {
        let _rng = crate::testutil::rng();
        let x: Vec<Tensor> = qkv(2, 2, 40, 8, 4).iter().map(|t| t.detach()).collect();
        let cut = |l: i64| -> Vec<Tensor> { x.iter().map(|t| t.narrow(2, 0, l)).collect() };
        for yaml in ["{window: 8, feature_dim: 4}", "{window: 8, feature_dim: 4, decode_window: sliding}"] {
            let (_, l) = layer(yaml, 2, 8, 5);
            let sliding = l.cfg.decode_window == DecodeWindow::Sliding;
            let want = if sliding { l.dense(&x[0], &x[1], &x[2], DecodeWindow::Sliding) } else { l.forward(&x[0], &x[1], &x[2]) };
            let (_, full_cache) = l.prefill(&x[0], &x[1], &x[2]);
            for l0 in [0i64, 1, 8, 9, 16, 23] {
                let mut cache = if l0 == 0 {
                    l.new_cache(2, Kind::Double, Device::Cpu)
                } else {
                    let c = cut(l0);
                    l.prefill(&c[0], &c[1], &c[2]).1
                };
                let y = decode(&l, &mut cache, &x, l0, 40);
                assert!(max_diff(&y, &want.narrow(2, l0, 40 - l0)) < 1e-10, "{yaml} L0={l0}: {}", max_diff(&y, &want.narrow(2, l0, 40 - l0)));
                for (a, b) in [(&cache.win_k, &full_cache.win_k), (&cache.s, &full_cache.s), (&cache.z, &full_cache.z)] {
                    assert!(max_diff(a, b) < 1e-10, "{yaml} L0={l0}: cache");
                }
                assert!(cache.win_k.size()[2] <= if sliding { 8 } else { 16 });
            }
            if sliding {
                assert!(max_diff(&want, &l.forward(&x[0], &x[1], &x[2])) > 1e-3, "the reference's decode differs from its prefill");
            }
        }
    }
}
