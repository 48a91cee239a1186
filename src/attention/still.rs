//! STILL hybrid attention (`../shared/specs/still.md`, cited as §n), per query head on `[B, H, T, hd]`
//! inputs that are already rotated and GQA-expanded (§1).
//!
//! For query t in chunk c (chunks of C tokens), three sets partition {0..t} (§3):
//! **Win** = chunk c−1 and chunk c up to t; **Sel** = the κ tokens picked from every chunk ≤ c−2;
//! **Lin** = the rest of chunks ≤ c−2. With s_tj = q_t·k_j/√D and m_t = max over Sel∪Win,
//!
//! y_t = (Σ_{Sel∪Win} e^{s_tj−m_t} v_j + g_t ⊙ φ_q(q_t)ᵀS) / (Σ_{Sel∪Win} e^{s_tj−m_t} + φ_q(q_t)·z + 1e-6),
//! S = Σ_Lin φ_k(k_j)v_jᵀ, z = Σ_Lin φ_k(k_j).
//!
//! The max is deliberately not compensated in the linear terms, the gate scales only the linear
//! numerator and nothing decays (§3). A chunk is routed when it leaves Win (delayed selection, §4): its
//! top-κ tokens by a per-token score (computed once, from the token's own query over the C most recent
//! keys) join Sel for good, the others are folded into S and z.
//!
//! Paths (tests hold them together):
//! - [`Still::forward`] / [`Still::prefill`]: vectorised over chunks; the softmax part is one masked
//!   `[C, κ·#chunks + 2C]` block per chunk, the linear part prefix sums of per-chunk states. fp32 math
//!   (fp64 for fp64 inputs), padding to a multiple of C masked by causality.
//! - [`Still::reference`]: dense `[T, T]` weights from Sel/Win/Lin sets built token by token, with the
//!   scores computed by scalar loops straight from §4/§5.
//! - [`Still::step`]: decode with a bounded [`HybridCache`] (§6).
//!
//! Parameters (relative to the layer's path, e.g. `model.layers.N.self_attn.`): `feature_map_q.hh.u`
//! `[H, D]`, `feature_map_q.mlp.layer` `[H, D, D]`, the same under `feature_map_k.` (untied copies,
//! see `feature_maps.rs`), and `g_proj.weight` `[H·D, d_model]` (no bias; absent with `gate: false`).
//!
//! Choices where the code and paper disagree (§10), default first, switch in brackets:
//! routing `self_saliency` as the paper (C2; `self_saliency_reference_code`), one score definition for
//! prefill and decode (C3; the reference decode's scoring is not implemented), κ = 4 uncapped (C5;
//! `budget`), no phantom keys in chunk 0 (C6; `compat.phantom_chunk0_keys`, prefill only, as in the
//! reference), token 0's paper score is ln((1+ε)/ε) (C7; the code variant's NaN becomes +∞), the output
//! gate σ(W_g x) on the linear numerator (C1), 1e-6 in the denominator in prefill and decode (C8), S and z
//! in fp32 (C9), W_g and W_h ~ N(0, 0.02) (C10; `init`), top-κ takes the largest scores (C12).
//!
//! Files, one concept each: `config.rs` (the options and κ), `routing.rs` (per-token scores and
//! top-κ, one routine for prefill and decode), `chunked.rs` (the shared hybrid operator's vectorised
//! forward), `reference.rs` (the explicit reference it is tested against), `decode.rs` (the bounded
//! [`HybridCache`] and its step), `probe.rs` (what the last query reads). This file: the layer itself.
mod chunked;
mod config;
mod decode;
mod probe;
mod reference;
mod routing;
#[cfg(test)]
mod testkit;

pub(crate) use chunked::Hybrid;
pub use config::{Budget, Normalizer, Routing, Selection, StillCompat, StillConfig};
pub use decode::HybridCache;
pub use probe::Probe;
pub use routing::{random_score, routing_scores, top_kappa};
use routing::{Routed, Scorer};
/// The layer shapes live with the interface (`attention::LayerDims`); this path stays for callers.
pub use super::layer::LayerDims;

use super::feature_maps::{FeatureMap, ParamInit};
use crate::error::Result;
use tch::{nn, Device, Kind, Tensor};

/// ε of the self-saliency score (§4).
pub const SCORE_EPS: f64 = 1e-8;
/// The denominator's epsilon (§3, C8).
pub const OUT_EPS: f64 = 1e-6;

// ---------------------------------------------------------------------------------------------
// The STILL layer
// ---------------------------------------------------------------------------------------------

/// STILL's attention parameters and options for one layer. See the module comment.
#[derive(Debug)]
pub struct Still {
    pub cfg: StillConfig,
    pub selection: Selection,
    pub dims: LayerDims,
    pub feature_map_q: FeatureMap,
    pub feature_map_k: FeatureMap,
    /// W_g `[H·D, d_model]`; `None` with `gate: false`.
    pub g_proj: Option<Tensor>,
    /// A LoRA adapter on W_g (`g_proj.lora_A` / `lora_B`, linearize's stage 2).
    pub g_lora: Option<crate::lora::Lora>,
    /// `routing: oracle`: the positions to select (ascending), set per sample by the evaluator.
    oracle: std::sync::Mutex<Option<Vec<i64>>>,
}

impl Still {
    pub fn new(p: &nn::Path, cfg: &StillConfig, dims: LayerDims) -> Result<Self> {
        let selection = cfg.selection()?;
        let LayerDims { heads, head_dim, d_model, .. } = dims;
        // Untied q and k maps, equal in distribution at init (the reference deep-copies q's map; §2).
        let feature_map_q = FeatureMap::still(&(p / "feature_map_q"), cfg.feature_map, heads, head_dim, cfg.init);
        let feature_map_k = FeatureMap::still(&(p / "feature_map_k"), cfg.feature_map, heads, head_dim, cfg.init);
        let g_proj = cfg.gate.then(|| {
            let init = match cfg.init {
                ParamInit::Constructor => nn::Init::Const(1.0), // the constructor's fill (C10)
                _ => nn::Init::Randn { mean: 0.0, stdev: 0.02 },
            };
            (p / "g_proj").var("weight", &[heads * head_dim, d_model], init)
        });
        Ok(Still { cfg: cfg.clone(), selection, dims, feature_map_q, feature_map_k, g_proj, g_lora: None, oracle: Default::default() })
    }

    /// The positions `routing: oracle` selects from now on (sorted, deduplicated; `None` = nothing).
    /// Shared by every sequence of a batch and every head. Other routings ignore it.
    pub fn set_oracle(&self, positions: Option<Vec<i64>>) {
        let positions = positions.map(|mut p| {
            p.sort_unstable();
            p.dedup();
            p
        });
        *self.oracle.lock().expect("oracle lock") = positions;
    }

    fn oracle_positions(&self) -> Option<Vec<i64>> {
        if self.cfg.routing != Routing::Oracle {
            return None;
        }
        Some(self.oracle.lock().expect("oracle lock").clone().unwrap_or_default())
    }

    /// g = σ(W_g x) as `[B, H, T, hd]` from the layer input x `[B, T, d_model]` (after the input norm),
    /// or `None` with `gate: false`.
    pub fn gate(&self, x: &Tensor) -> Option<Tensor> {
        self.gate_for(x, false)
    }

    /// The gate of a decode pass before its sigmoid, W_g x `[B, H, T, hd]`: from the model's product
    /// of the input with W_g where it made one (`Heads::projected`), else as [`Still::gate_for`].
    fn decode_gate_logits(&self, h: &crate::attention::Heads) -> Option<Tensor> {
        match &h.projected {
            Some(p) => {
                let (b, t) = (p.size()[0], p.size()[1]);
                Some(p.view([b, t, self.dims.heads, self.dims.head_dim]).transpose(1, 2))
            }
            None => self.gate_logits_for(h.input, false),
        }
    }

    /// [`Still::gate`] in a training pass (`train`: the adapter's dropout) or not; W_g with its LoRA adapter.
    pub fn gate_for(&self, x: &Tensor, train: bool) -> Option<Tensor> {
        self.gate_logits_for(x, train).map(|g| g.sigmoid())
    }

    /// W_g x before the sigmoid, `[B, H, T, hd]`.
    fn gate_logits_for(&self, x: &Tensor, train: bool) -> Option<Tensor> {
        let w = self.g_proj.as_ref()?.to_kind(x.kind());
        let (b, t) = (x.size()[0], x.size()[1]);
        let g = match &self.g_lora {
            Some(l) => l.forward(&w, x, train),
            None => x.matmul(&w.tr()),
        };
        Some(g.view([b, t, self.dims.heads, self.dims.head_dim]).transpose(1, 2))
    }

    fn hybrid(&self) -> Hybrid<'_> {
        Hybrid {
            chunk: self.cfg.chunk,
            fq: &self.feature_map_q,
            fk: &self.feature_map_k,
            selection: self.selection,
            scorer: Some(Scorer { routing: self.cfg.routing, kappa: self.selection.kappa, seed: self.cfg.seed, layer: self.dims.layer }),
            window_factors: None,
            eps: OUT_EPS,
            phantom_chunk0_keys: self.cfg.compat.phantom_chunk0_keys,
            sliding_decode: false,
            linear: self.cfg.linear_branch,
            compensate: self.cfg.normalizer == Normalizer::MaxCompensated,
            oracle: self.oracle_positions(),
        }
    }

    /// Prefill / training output `[B, H, T, hd]` (in q's kind) of q, k, v `[B, H, T, hd]` and the gate
    /// values g = [`Still::gate`]`(x)` (`None` = g ≡ 1).
    pub fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> Tensor {
        self.hybrid().prefill(q, k, v, g, false).0
    }

    /// [`Still::forward`] plus the decode cache after the last token (equal to decoding them one by one).
    pub fn prefill(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> (Tensor, HybridCache) {
        let (y, cache) = self.hybrid().prefill(q, k, v, g, true);
        (y, cache.expect("cache requested"))
    }

    /// An empty decode cache for `batch` sequences whose K/V are stored in `kind` (the model dtype).
    pub fn new_cache(&self, batch: i64, kind: Kind, device: Device) -> HybridCache {
        HybridCache::empty(batch, self.dims.heads, self.dims.head_dim, self.feature_map_k.dim(), kind, device, self.cfg.chunk, self.selection)
    }

    /// Decode one token: q_t, k_t, v_t `[B, H, 1, hd]` (rotated at position `cache.pos`), g_t = gate(x_t).
    /// Returns `[B, H, 1, hd]` and advances the cache (§6).
    pub fn step(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> Tensor {
        self.hybrid().step(cache, q, k, v, g)
    }

    /// Decode n tokens at once (`[B, H, n, hd]`): the outputs and cache of n [`Still::step`]s (an empty
    /// cache takes the vectorised prefill).
    pub fn extend(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> Tensor {
        self.hybrid().extend(cache, q, k, v, g)
    }
}

/// STILL as a registered hybrid (`hybrid_kinds!` in `attention/mod.rs`).
impl super::HybridKind for StillConfig {
    const NAME: &'static str = "still";
    const TABLE_NAME: &'static str = "STILL";
    const LINE_STYLE: super::LineStyle = super::LineStyle::Solid;
    const DECODE_BENCH: &'static [(&'static str, &'static str, &'static str)] = &[
        ("still", "{kind: still}", "still.md's reference (C = 64, κ = 4 per chunk, uncapped)"),
        ("still-budget", "{kind: still, budget: {m: 384, max_len: 4096}}", "still.md §6's worked budget, flat memory"),
    ];
    const WEIGHT_DECAY: f64 = 0.01;
    const EVAL_EVERY: u64 = 200;

    fn layer(&self, p: &nn::Path, dims: LayerDims) -> Result<Box<dyn super::LayerOp>> {
        Ok(Box::new(Still::new(p, self, dims)?))
    }

    /// The component ablations (routing, gate, feature map, random routing's seed) reset.
    fn recipe_form(&self) -> Self {
        StillConfig { routing: Default::default(), gate: true, feature_map: Default::default(), seed: 0, ..self.clone() }
    }
}

/// A STILL layer behind the model interface. Packed rows are refused: chunks count from position 0.
impl crate::attention::LayerOp for Still {
    fn forward(&self, h: &crate::attention::Heads) -> Tensor {
        assert!(h.seg.is_none(), "STILL layers take no packed rows");
        let (k, v) = h.expanded_kv();
        Still::forward(self, &h.q, &k, &v, self.gate_for(h.input, h.train).as_ref())
    }

    fn new_cache(&self, shape: &crate::attention::cache::CacheShape) -> crate::attention::cache::LayerCache {
        crate::attention::cache::LayerCache::new(Still::new_cache(self, shape.batch, shape.kind, shape.device))
    }

    fn decode(&self, cache: &mut crate::attention::cache::LayerCache, h: &crate::attention::Heads, _p0: i64) -> Tensor {
        let (k, v) = h.expanded_kv();
        self.extend(cache.state::<HybridCache>(), &h.q, &k, &v, self.decode_gate_logits(h).map(|g| g.sigmoid()).as_ref())
    }

    fn decode_at(&self, cache: &mut crate::attention::cache::LayerCache, h: &crate::attention::Heads, at: &crate::attention::cache::StepAt) -> Option<Tensor> {
        let (k, v) = h.expanded_kv();
        Some(self.hybrid().step_at(cache.state::<HybridCache>(), &h.q, &k, &v, self.decode_gate_logits(h).as_ref(), at))
    }

    fn prepare_at(&self, cache: &mut crate::attention::cache::LayerCache, pos: i64, reserved: i64) {
        self.hybrid().prepare_at(cache.state::<HybridCache>(), pos, reserved)
    }

    /// A linearized layer is not switched in place.
    fn reconfigured(&self, _a: &crate::attention::AttentionSpec) -> Option<Box<dyn crate::attention::LayerOp>> {
        None
    }

    /// The feature maps and the gate (its LoRA adapter is stage 2's).
    fn parameters(&self) -> Vec<Tensor> {
        let mut out = self.feature_map_q.parameters();
        out.extend(self.feature_map_k.parameters());
        out.extend(self.g_proj.iter().map(Tensor::shallow_clone));
        out
    }

    /// W_g, where no adapter sits on it.
    fn input_projection(&self) -> Option<&Tensor> {
        self.g_proj.as_ref().filter(|_| self.g_lora.is_none())
    }
}

// ---------------------------------------------------------------------------------------------
// Small helpers
// ---------------------------------------------------------------------------------------------

/// fp64 stays fp64 (tests); everything else is computed in fp32 (§3).
pub(crate) fn compute_kind(x: &Tensor) -> Kind {
    if x.kind() == Kind::Double {
        Kind::Double
    } else {
        Kind::Float
    }
}

/// x `[B, H, T, ·]` in the compute kind, zero-padded along T to a multiple of `c`.
pub(crate) fn pad_to(x: &Tensor, c: i64) -> Tensor {
    let t = x.size()[2];
    x.to_kind(compute_kind(x)).constant_pad_nd([0, 0, 0, (t + c - 1) / c * c - t])
}

/// `[B, H, n, C, ·]` → the previous and the current chunk side by side `[B, H, n, 2C, ·]` (zeros before chunk 0).
fn two_chunks(x: &Tensor) -> Tensor {
    let n = x.size()[2];
    let prev = x.constant_pad_nd([0, 0, 0, 0, 1, 0]).narrow(2, 0, n);
    Tensor::cat(&[prev, x.shallow_clone()], 3)
}

pub(crate) fn dims4(x: &Tensor) -> (i64, i64, i64, i64) {
    let s = x.size();
    (s[0], s[1], s[2], s[3])
}

fn dims5(x: &Tensor) -> (i64, i64, i64, i64, i64) {
    let s = x.size();
    (s[0], s[1], s[2], s[3], s[4])
}

#[cfg(test)]
mod tests {
    use super::testkit::{cfg, layer};
    use super::*;

    #[test]
    fn parameter_names_and_shapes() {
        let _rng = crate::testutil::rng();
        let (vs, _) = layer(&StillConfig::default(), 4, 16, 0);
        let mut names: Vec<(String, Vec<i64>)> = vs.variables().into_iter().map(|(k, v)| (k, v.size())).collect();
        names.sort();
        let want = [
            ("feature_map_k.hh.u", vec![4, 16]),
            ("feature_map_k.mlp.layer", vec![4, 16, 16]),
            ("feature_map_q.hh.u", vec![4, 16]),
            ("feature_map_q.mlp.layer", vec![4, 16, 16]),
            ("g_proj.weight", vec![64, 64]),
        ];
        assert_eq!(names, want.iter().map(|(k, s)| (k.to_string(), s.clone())).collect::<Vec<_>>());
        let (vs, _) = layer(&cfg("{gate: false}"), 4, 16, 0);
        assert!(!vs.variables().contains_key("g_proj.weight"));
    }
}
