//! Liger-GLA, the STILL paper's third intra-layer hybrid baseline (Table 1 beside LoLCATs; Liger,
//! Lan et al. 2025, linearizes into gated linear attention through the pretrained projections):
//! softmax over a sliding window of the `window` newest tokens (the current one included), gated
//! linear attention over every older token, one normalizer shared by both:
//!
//! y_t = (Σ_Win e^{s_tj−m_t} v_j + Σ_Lin a_tj φ(q_t)·φ(k_j) v_j) / (Σ_Win e^{s_tj−m_t} + Σ_Lin a_tj φ(q_t)·φ(k_j)),
//!
//! s_tj = q_t·k_j/√D, m_t the max over Win, φ = softmax over the head dim of the pretrained (rotated)
//! query / key (no feature-map parameters: the linear branch reads q and k as they are), and the
//! decay a_tj = Π_{i = j+w+1..t} α_i, α_i = σ(mean_d k_i + b_h)^{1/τ} per head: Liger's gate from the
//! pooled key, with a learned per-head bias b (`gate_bias`, what stage 1 trains) and GLA's
//! temperature τ = 16. A token decays from the step it leaves the window, so the recurrent state is
//! S_t = α_t S_{t−1} + φ(k_{t−w}) v_{t−w}ᵀ (z the same without v): the decode cache holds the window's
//! keys / values, S and z, bounded whatever the context.
//!
//! Where we had to choose (the paper gives no formula; these are ours): φ = softmax, the gate's pooling
//! (mean of the rotated key) and bias, one shared normalizer (Liger mixes the two branches' outputs).
//!
//! Paths (tests hold them together): [`LigerGla::forward`], dense and vectorised (O(T²) memory,
//! fp32 math, fp64 for fp64 inputs); [`LigerGla::reference`], the sums above token by token with the
//! decay as a product; decode, token by token through [`LigerCache`].
use super::cache::{CacheShape, KindCache, LayerCache, Padding};
use super::kinds::{AttentionSpec, LineStyle};
use super::layer::{Heads, LayerDims, LayerOp};
use super::HybridKind;
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Kind, Tensor};

/// The per-head gate bias at init: σ(3)^{1/16} ≈ 0.997, a slow decay.
pub const GATE_BIAS_INIT: f64 = 3.0;

/// Liger-GLA's options (`attention: {kind: liger-gla, …}`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LigerGlaConfig {
    /// w, the softmax window (the newest w tokens, the current one included).
    #[serde(default = "default_window")]
    pub window: i64,
    /// τ of the gate α = σ(·)^{1/τ}.
    #[serde(default = "default_temperature")]
    pub gate_temperature: f64,
}

fn default_window() -> i64 {
    64
}
fn default_temperature() -> f64 {
    16.0
}

impl Default for LigerGlaConfig {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("defaults")
    }
}

impl HybridKind for LigerGlaConfig {
    const NAME: &'static str = "liger-gla";
    const TABLE_NAME: &'static str = "Liger-GLA";
    const LINE_STYLE: LineStyle = LineStyle::Dotted;
    const DECODE_BENCH: &'static [(&'static str, &'static str, &'static str)] = &[("liger-gla", "{kind: liger-gla}", "sliding window of 64 + gated linear attention through the pretrained q / k")];
    const WEIGHT_DECAY: f64 = 0.0;
    const EVAL_EVERY: u64 = 100;

    fn layer(&self, p: &nn::Path, dims: LayerDims) -> Result<Box<dyn LayerOp>> {
        if self.window < 1 || self.gate_temperature.is_nan() || self.gate_temperature <= 0.0 {
            return Err(Error::Other(format!("attention: window ({}) must be ≥ 1 and gate_temperature ({}) > 0", self.window, self.gate_temperature)));
        }
        let gate_bias = p.var("gate_bias", &[dims.heads], nn::Init::Const(GATE_BIAS_INIT));
        Ok(Box::new(LigerGla { cfg: self.clone(), heads: dims.heads, head_dim: dims.head_dim, gate_bias }))
    }
}

/// One layer's Liger-GLA: its options and the gate bias `[H]`.
#[derive(Debug)]
pub struct LigerGla {
    pub cfg: LigerGlaConfig,
    pub heads: i64,
    pub head_dim: i64,
    pub gate_bias: Tensor,
}

fn compute_kind(x: &Tensor) -> Kind {
    if x.kind() == Kind::Double { Kind::Double } else { Kind::Float }
}

impl LigerGla {
    /// ln α `[B, H, T]` of keys `[B, H, T, D]` (in their kind).
    fn log_gate(&self, k: &Tensor) -> Tensor {
        let pooled = k.mean_dim(-1, false, k.kind()) + self.gate_bias.to_kind(k.kind()).view([1, self.heads, 1]);
        pooled.log_sigmoid() / self.cfg.gate_temperature
    }

    /// Training / prefill output `[B, H, T, D]` of rotated q, k, v `[B, H, T, D]` (heads expanded).
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let kind = compute_kind(q);
        let (q, k, v) = (q.to_kind(kind), k.to_kind(kind), v.to_kind(kind));
        let (t, d, w) = (q.size()[2], q.size()[3], self.cfg.window);
        let i = Tensor::arange(t, (Kind::Int64, q.device())).unsqueeze(1);
        let j = Tensor::arange(t, (Kind::Int64, q.device())).unsqueeze(0);
        let dist = &i - &j;
        let win = dist.ge(0).logical_and(&dist.lt(w));
        let lin = dist.ge(w);
        let s = q.matmul(&k.transpose(-2, -1)) / (d as f64).sqrt();
        let s = s.masked_fill(&win.logical_not(), f64::NEG_INFINITY);
        let a_sm = (&s - s.amax(-1, true)).exp();
        // a_tj = exp(c_t − c_{j+w}), c the running sum of ln α: −∞ (weight 0) outside Lin.
        let c = self.log_gate(&k).cumsum(-1, kind);
        let exit = (Tensor::arange(t, (Kind::Int64, q.device())) + w).clamp_max(t - 1);
        let c_exit = c.index_select(-1, &exit);
        let decay = (c.unsqueeze(-1) - c_exit.unsqueeze(-2)).masked_fill(&lin.logical_not(), f64::NEG_INFINITY).exp();
        let a_lin = q.softmax(-1, kind).matmul(&k.softmax(-1, kind).transpose(-2, -1)) * decay;
        let a = a_sm + a_lin;
        (a.matmul(&v) / a.sum_dim_intlist(-1, true, kind)).to_kind(v.kind())
    }

    /// The explicit reference: for each query the window's softmax terms and every older token's
    /// gated term, the decay a product of the gates since the token left the window.
    pub fn reference(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let kind = compute_kind(q);
        let (q, k, v) = (q.to_kind(kind), k.to_kind(kind), v.to_kind(kind));
        let (t, d, w) = (q.size()[2], q.size()[3], self.cfg.window);
        let alpha = self.log_gate(&k).exp(); // [B, H, T]
        let (fq, fk) = (q.softmax(-1, kind), k.softmax(-1, kind));
        let col = |x: &Tensor, j: i64| x.narrow(2, j, 1); // [B, H, 1, D]
        let mut rows = Vec::new();
        for ti in 0..t {
            let lo = (ti - w + 1).max(0);
            let scores: Vec<Tensor> = (lo..=ti).map(|j| (col(&q, ti) * col(&k, j)).sum_dim_intlist(-1, true, kind) / (d as f64).sqrt()).collect();
            let m = Tensor::cat(&scores, -1).amax(-1, true);
            let (mut num, mut den) = (col(&v, ti).zeros_like(), m.zeros_like());
            for (s, j) in scores.iter().zip(lo..=ti) {
                let e = (s - &m).exp();
                num = num + &e * col(&v, j);
                den = den + e;
            }
            for j in 0..(ti - w + 1).max(0) {
                let mut a = alpha.narrow(2, 0, 1).ones_like();
                for g in (j + w + 1)..=ti {
                    a = a * alpha.narrow(2, g, 1);
                }
                let e = (col(&fq, ti) * col(&fk, j)).sum_dim_intlist(-1, true, kind) * a.unsqueeze(-1);
                num = num + &e * col(&v, j);
                den = den + e;
            }
            rows.push(num / den);
        }
        Tensor::cat(&rows, 2).to_kind(v.kind())
    }

    /// Decode `n` tokens `[B, H, n, D]` after the cached ones, one at a time; extends the cache.
    pub fn extend(&self, cache: &mut LigerCache, q: &Tensor, k: &Tensor, v: &Tensor) -> Tensor {
        let kind = cache.s.kind();
        let d = q.size()[3];
        let log_alpha = self.log_gate(&k.to_kind(kind));
        let mut outs = Vec::new();
        for n in 0..q.size()[2] {
            let (qt, kt, vt) = (q.narrow(2, n, 1), k.narrow(2, n, 1), v.narrow(2, n, 1));
            let alpha = log_alpha.narrow(2, n, 1).exp(); // [B, H, 1]
            cache.s = &cache.s * alpha.unsqueeze(-1);
            cache.z = &cache.z * &alpha;
            if cache.k.size()[2] == self.cfg.window {
                // The oldest token leaves the window: into the state, undecayed.
                let (ko, vo) = (cache.k.narrow(2, 0, 1).to_kind(kind), cache.v.narrow(2, 0, 1).to_kind(kind));
                let fk = ko.softmax(-1, kind);
                cache.s = &cache.s + fk.transpose(-2, -1).matmul(&vo);
                cache.z = &cache.z + fk.squeeze_dim(2);
                let keep = self.cfg.window - 1;
                cache.k = cache.k.narrow(2, 1, keep);
                cache.v = cache.v.narrow(2, 1, keep);
            }
            cache.k = Tensor::cat(&[&cache.k, &kt.to_kind(cache.k.kind())], 2);
            cache.v = Tensor::cat(&[&cache.v, &vt.to_kind(cache.v.kind())], 2);
            let qf = qt.to_kind(kind);
            let s = qf.matmul(&cache.k.to_kind(kind).transpose(-2, -1)) / (d as f64).sqrt();
            let e = (&s - s.amax(-1, true)).exp();
            let fq = qf.softmax(-1, kind);
            let num = e.matmul(&cache.v.to_kind(kind)) + fq.matmul(&cache.s);
            let den = e.sum_dim_intlist(-1, true, kind) + fq.matmul(&cache.z.unsqueeze(-1));
            outs.push((num / den).to_kind(v.kind()));
        }
        cache.len += q.size()[2];
        Tensor::cat(&outs, 2)
    }
}

/// Liger-GLA's decode state of one layer: the window's keys / values `[B, H, ≤ w, D]` (model dtype)
/// and the decayed state S `[B, H, D, D]`, z `[B, H, D]` (fp32; fp64 for fp64 models).
pub struct LigerCache {
    pub k: Tensor,
    pub v: Tensor,
    pub s: Tensor,
    pub z: Tensor,
    /// Tokens seen.
    pub len: i64,
    window: i64,
}

impl LigerCache {
    /// An empty cache for `b` rows of `h` heads of width `d`, keys / values in `kind`.
    pub fn empty(b: i64, h: i64, d: i64, window: i64, kind: Kind, device: tch::Device) -> Self {
        let state = if kind == Kind::Double { Kind::Double } else { Kind::Float };
        let kv = || Tensor::zeros([b, h, 0, d], (kind, device));
        LigerCache { k: kv(), v: kv(), s: Tensor::zeros([b, h, d, d], (state, device)), z: Tensor::zeros([b, h, d], (state, device)), len: 0, window }
    }
}

impl KindCache for LigerCache {
    fn bytes(&self) -> i64 {
        [&self.k, &self.v, &self.s, &self.z].iter().map(|x| x.numel() as i64 * x.kind().elt_size_in_bytes() as i64).sum()
    }
    /// The window's keys and values, S and z: the same after w tokens whatever the context.
    fn bound(&self, tokens: i64) -> Option<i64> {
        let (kv, st) = (self.k.size(), self.s.size());
        let (b, h, d) = (kv[0], kv[1], kv[3]);
        let kv_bytes = self.k.kind().elt_size_in_bytes() as i64;
        let state_bytes = self.s.kind().elt_size_in_bytes() as i64;
        Some(b * h * (2 * tokens.min(self.window) * d * kv_bytes + (st[2] * st[3] + st[2]) * state_bytes))
    }
    /// The window and state are per row from position 0: one prompt per row, without padding.
    fn set_padding(&mut self, _pad: &Padding) {
        panic!("Liger-GLA caches take one prompt per batch row without padding")
    }
}

/// Liger-GLA behind the model interface. Packed rows are refused (the decay runs across a row).
impl LayerOp for LigerGla {
    fn forward(&self, h: &Heads) -> Tensor {
        assert!(h.seg.is_none(), "Liger-GLA layers take no packed rows");
        let (k, v) = h.expanded_kv();
        LigerGla::forward(self, &h.q, &k, &v)
    }

    fn new_cache(&self, shape: &CacheShape) -> LayerCache {
        LayerCache::new(LigerCache::empty(shape.batch, self.heads, self.head_dim, self.cfg.window, shape.kind, shape.device))
    }

    fn decode(&self, cache: &mut LayerCache, h: &Heads, _p0: i64) -> Tensor {
        let (k, v) = h.expanded_kv();
        self.extend(cache.state::<LigerCache>(), &h.q, &k, &v)
    }

    /// A linearized layer is not switched in place.
    fn reconfigured(&self, _a: &AttentionSpec) -> Option<Box<dyn LayerOp>> {
        None
    }

    /// The gate bias (φ reads the pretrained q / k: no feature-map parameters).
    fn parameters(&self) -> Vec<Tensor> {
        vec![self.gate_bias.shallow_clone()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::tests::grads_of;
    use tch::Device;

    /// The registered layer (as a model builds it), in fp64, with gate biases that differ per head
    /// and gates far from 1, so that the decay matters.
    fn layer(yaml: &str, h: i64, d: i64) -> (nn::VarStore, crate::attention::Layer) {
        let mut vs = nn::VarStore::new(Device::Cpu);
        let cfg: LigerGlaConfig = serde_yaml::from_str(yaml).unwrap();
        let l = crate::attention::Layer::from_op(cfg.layer(&vs.root(), LayerDims { heads: h, head_dim: d, d_model: h * d, layer: 0 }).unwrap());
        vs.double();
        tch::no_grad(|| {
            let _ = l.get::<LigerGla>().unwrap().gate_bias.shallow_clone().copy_(&Tensor::from_slice(&[-1.0, 0.5, 2.0][..h as usize]));
        });
        (vs, l)
    }

    fn qkv(b: i64, h: i64, t: i64, d: i64, seed: i64) -> Vec<Tensor> {
        let _rng = crate::testutil::seeded(seed);
        (0..3).map(|_| Tensor::randn([b, h, t, d], (Kind::Double, Device::Cpu)).set_requires_grad(true)).collect()
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// The dense forward equals the token-by-token reference in outputs and in the gradients of q, k,
    /// v and the gate bias, for windows inside, at and beyond the sequence, with a temperature of 1
    /// (strong decay) and the default.
    #[test]
    fn forward_matches_reference_and_decode() {
        let _rng = crate::testutil::rng();
        for (yaml, t) in [("{window: 3, gate_temperature: 1.0}", 11), ("{window: 4}", 9), ("{window: 20}", 7), ("{window: 1, gate_temperature: 2.0}", 6)] {
            let (vs, layer) = layer(yaml, 3, 4);
            let l = layer.get::<LigerGla>().unwrap();
            let x = qkv(2, 3, t, 4, t);
            let go = qkv(2, 3, t, 4, 100 + t)[0].detach();
            let mut wrt: Vec<Tensor> = x.iter().map(Tensor::shallow_clone).collect();
            wrt.extend(vs.trainable_variables());
            let run = |out: Tensor| (out.detach(), grads_of(&out, &go, &wrt));
            let (o_f, g_f) = run(l.forward(&x[0], &x[1], &x[2]));
            let (o_r, g_r) = run(l.reference(&x[0], &x[1], &x[2]));
            assert!(max_diff(&o_f, &o_r) < 1e-10, "{yaml}: forward vs reference {}", max_diff(&o_f, &o_r));
            for (i, (a, b)) in g_f.iter().zip(&g_r).enumerate() {
                assert!(max_diff(a, b) < 1e-10, "{yaml}: gradient {i}: {}", max_diff(a, b));
            }
            if t > l.cfg.window + 1 {
                assert!(g_f[3].abs().max().double_value(&[]) > 0.0, "{yaml}: the gate bias gets a gradient");
            }
            // Decoding in uneven blocks gives the forward's outputs, the cache within its bound.
            let mut cache = LigerCache::empty(2, 3, 4, l.cfg.window, Kind::Double, Device::Cpu);
            let mut at = 0;
            for n in [2, 1, t - 3] {
                let y = tch::no_grad(|| l.extend(&mut cache, &x[0].narrow(2, at, n), &x[1].narrow(2, at, n), &x[2].narrow(2, at, n)));
                at += n;
                assert!(max_diff(&y, &o_f.narrow(2, at - n, n)) < 1e-10, "{yaml}: decode to {at}");
                assert!(cache.bytes() <= cache.bound(at).unwrap(), "{yaml}: cache over its bound at {at}");
            }
        }
        // A key of another hybrid is refused.
        assert!(serde_yaml::from_str::<LigerGlaConfig>("{feature_dim: 8}").is_err());
    }
}
