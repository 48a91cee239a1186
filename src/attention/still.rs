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
use super::feature_maps::{FeatureMap, FeatureMapKind, ParamInit};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};
use tch::{nn, Device, Kind, Tensor};

/// ε of the self-saliency score (§4).
pub const SCORE_EPS: f64 = 1e-8;
/// The denominator's epsilon (§3, C8).
pub const OUT_EPS: f64 = 1e-6;

// ---------------------------------------------------------------------------------------------
// Configuration (the future YAML `attention:` options)
// ---------------------------------------------------------------------------------------------

/// STILL options (§4, §9).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StillConfig {
    /// C, the chunk size (64).
    #[serde(default = "default_chunk")]
    pub chunk: i64,
    /// κ, tokens selected per routed chunk, without a cap (default 4 = int(64/16), the reference).
    /// Exclusive with `budget`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokens_per_chunk: Option<i64>,
    /// The paper's fixed per-head budget; κ = λ of §4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<Budget>,
    #[serde(default)]
    pub feature_map: FeatureMapKind,
    /// Output gate σ(W_g x) on the linear numerator; `false` is g ≡ 1 (paper row "w/o Gate").
    #[serde(default = "yes")]
    pub gate: bool,
    #[serde(default)]
    pub routing: Routing,
    /// Seed of `routing: random`.
    #[serde(default)]
    pub seed: u64,
    #[serde(default = "normal_init")]
    pub init: ParamInit,
    #[serde(default)]
    pub compat: StillCompat,
    /// Diagnostic switch: `false` drops the linear branch (Lin tokens leave both the numerator and the
    /// denominator), so only Sel ∪ Win are read. Not a method: a control for the retrieval question.
    #[serde(default = "yes", skip_serializing_if = "is_true")]
    pub linear_branch: bool,
    /// How the linear terms meet the softmax terms' max (§3).
    #[serde(default, skip_serializing_if = "Normalizer::is_reference")]
    pub normalizer: Normalizer,
}

/// The scale at which the linear terms enter the output's normalizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Normalizer {
    /// The reference code (§3): Σ e^{s−m_t} over Sel ∪ Win beside φ_q·Σφ_k, the max not compensated:
    /// every linear token weighs in as if its logit were m_t + ln(φ_q·φ_k), i.e. at the level of the
    /// best-matching softmax key.
    #[default]
    Reference,
    /// The linear terms scaled by e^{−m_t}: φ_q·φ_k stands for e^{s} (not e^{s−m_t}), one scale for both
    /// branches. Where a softmax key matches strongly (m_t ≫ 0) the linear branch recedes.
    MaxCompensated,
}

impl Normalizer {
    fn is_reference(&self) -> bool {
        *self == Normalizer::Reference
    }
}

fn is_true(b: &bool) -> bool {
    *b
}

/// The paper's budget: m softmax slots per head of which W = 2C are the window, for sequences up
/// to `max_len` tokens: λ = ⌊(m − W)/⌈max_len/C⌉⌋ (clamped to C). After m − W selected tokens every
/// later chunk goes to the linear state (our rule; the paper is silent).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Budget {
    pub m: i64,
    pub max_len: i64,
}

/// Behaviours of the reference code that differ from our defaults (§10).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct StillCompat {
    /// C6: in prefill, chunk 0 also sees C zero keys (logit 0, value 0). Decode never has them.
    #[serde(default)]
    pub phantom_chunk0_keys: bool,
}

/// The per-token routing score (§4; higher = selected).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// KL(a ‖ b) of the attention over the token's own window with and without itself (paper, §5.1).
    #[default]
    SelfSaliency,
    /// What the reference prefill computes (§5.2): smoothed, circular columns, column C−1 overridden.
    SelfSaliencyReferenceCode,
    /// a_jj over the same window.
    #[serde(alias = "diag_attn")]
    DiagAttention,
    /// q_j·k_j/√D.
    SelfLogit,
    /// ‖k_j‖.
    KeyNorm,
    /// κ tokens uniformly without replacement, keyed by (seed, layer, head, chunk).
    Random,
    /// Positions ⌊r·C/κ⌋, r = 0..κ−1, of each chunk.
    Uniform,
    /// κ = 0: terrace window plus linear attention (paper row "w/o Self-Saliency").
    None,
    /// Diagnostic, not a method: exactly the positions given at run time ([`Still::set_oracle`], e.g.
    /// RULER's needle spans) join Sel when their chunk is routed, however many a chunk holds (κ is
    /// raised to hold them); every other token goes to Lin. Nothing is selected until positions are set.
    Oracle,
}

fn default_chunk() -> i64 {
    64
}
fn yes() -> bool {
    true
}
fn normal_init() -> ParamInit {
    ParamInit::Normal
}

impl Default for StillConfig {
    fn default() -> Self {
        serde_yaml::from_str("{}").expect("defaults")
    }
}

/// κ per routed chunk: `kappa` for the first `max_chunks` routed chunks, 0 after them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Selection {
    pub kappa: i64,
    pub max_chunks: i64,
}

impl Selection {
    pub const NONE: Selection = Selection { kappa: 0, max_chunks: 0 };

    /// Tokens chunk `chunk` (0-based) sends to Sel.
    pub fn kappa_for(&self, chunk: i64) -> i64 {
        if chunk < self.max_chunks {
            self.kappa
        } else {
            0
        }
    }
}

impl StillConfig {
    /// Resolves κ and the budget cap (§4), or says which option is wrong.
    pub fn selection(&self) -> Result<Selection> {
        let c = self.chunk;
        let bad = |msg: String| Err(Error::Other(format!("attention: {msg}")));
        if c < 1 {
            return bad(format!("chunk must be ≥ 1, got {c}"));
        }
        if self.budget.is_some() && self.tokens_per_chunk.is_some() {
            return bad("give either `tokens_per_chunk` or `budget`, not both".into());
        }
        if self.routing == Routing::Oracle {
            if self.budget.is_some() {
                return bad("`routing: oracle` selects the given positions; it takes no `budget`".into());
            }
            return Ok(Selection { kappa: c, max_chunks: i64::MAX });
        }
        let sel = match self.budget {
            Some(Budget { m, max_len }) => {
                let w = 2 * c;
                if m < w {
                    return bad(format!("budget.m = {m} is smaller than the window 2·chunk = {w}"));
                }
                if max_len < 1 {
                    return bad(format!("budget.max_len must be ≥ 1, got {max_len}"));
                }
                let kappa = ((m - w) / ((max_len + c - 1) / c)).min(c);
                Selection { kappa, max_chunks: if kappa > 0 { (m - w) / kappa } else { 0 } }
            }
            None => {
                let kappa = self.tokens_per_chunk.unwrap_or(4);
                if !(0..=c).contains(&kappa) {
                    return bad(format!("tokens_per_chunk must be in 0..=chunk ({c}), got {kappa}"));
                }
                Selection { kappa, max_chunks: i64::MAX }
            }
        };
        Ok(if self.routing == Routing::None { Selection::NONE } else { sel })
    }
}

/// Shapes of the layer an attention variant sits in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LayerDims {
    /// Query heads H (GQA already expanded).
    pub heads: i64,
    pub head_dim: i64,
    /// Width of the layer input x (for W_g).
    pub d_model: i64,
    /// Layer index (keys `routing: random`).
    pub layer: i64,
}

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
    pub g_lora: Option<crate::train::lora::Lora>,
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

    /// [`Still::gate`] in a training pass (`train`: the adapter's dropout) or not; W_g with its LoRA adapter.
    pub fn gate_for(&self, x: &Tensor, train: bool) -> Option<Tensor> {
        let w = self.g_proj.as_ref()?.to_kind(x.kind());
        let (b, t) = (x.size()[0], x.size()[1]);
        let g = match &self.g_lora {
            Some(l) => l.forward(&w, x, train),
            None => x.matmul(&w.tr()),
        }
        .sigmoid();
        Some(g.view([b, t, self.dims.heads, self.dims.head_dim]).transpose(1, 2))
    }

    fn hybrid(&self) -> Hybrid<'_> {
        Hybrid {
            chunk: self.cfg.chunk,
            fq: &self.feature_map_q,
            fk: &self.feature_map_k,
            selection: self.selection,
            scorer: Some(Scorer { routing: self.cfg.routing, kappa: self.selection.kappa, seed: self.cfg.seed, layer: self.dims.layer }),
            gamma: None,
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

    /// Routing scores `[B, H, T]` (fp32/fp64) of every token (§4).
    pub fn scores(&self, q: &Tensor, k: &Tensor) -> Tensor {
        self.padded_scores(q, k).narrow(2, 0, q.size()[2])
    }

    /// Which tokens join Sel `[B, H, T]` (bool) by the end of the sequence (chunks ≤ c(T−1)−2).
    pub fn selected(&self, q: &Tensor, k: &Tensor) -> Tensor {
        let scores = self.padded_scores(q, k);
        let none = scores.zeros_like().to_kind(Kind::Bool);
        let routed = tch::no_grad(|| self.hybrid().route(&scores));
        routed.map_or(none.shallow_clone(), |r| none.scatter_value(2, &r.pos, 1)).narrow(2, 0, q.size()[2])
    }

    fn padded_scores(&self, q: &Tensor, k: &Tensor) -> Tensor {
        let h = self.hybrid();
        let (qf, kf) = (pad_to(q, h.chunk), pad_to(k, h.chunk));
        tch::no_grad(|| h.scores(&h.window_logits(&qf, &kf), &kf))
    }

    /// An empty decode cache for `batch` sequences whose K/V are stored in `kind` (the model dtype).
    pub fn new_cache(&self, batch: i64, kind: Kind, device: Device) -> HybridCache {
        HybridCache::empty(batch, self.dims.heads, self.dims.head_dim, self.feature_map_k.dim(), kind, device)
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

    /// What the last query of the sequence reads: its Sel and Win sets and the shares of its output's
    /// normalizer held by the Win, Sel and Lin terms (with this layer's normalizer and linear switch).
    /// Computed directly from the sets, beside the chunked path (chunk-0 phantom keys are left out).
    pub fn probe(&self, q: &Tensor, k: &Tensor) -> Probe {
        let (b, h, t, d) = dims4(q);
        let c = self.cfg.chunk;
        let selected = self.selected(q, k);
        tch::no_grad(|| {
            let kind = compute_kind(q);
            let last_chunk = (t - 1) / c;
            let window = Tensor::arange(t, (Kind::Int64, q.device())).ge((last_chunk - 1).max(0) * c).view([1, 1, t]).expand([b, h, t], false);
            let (qt, kf) = (q.narrow(2, t - 1, 1).to_kind(kind), k.to_kind(kind));
            let s = qt.matmul(&kf.transpose(-2, -1)).squeeze_dim(2) / (d as f64).sqrt(); // [B, H, T]
            let soft = window.logical_or(&selected);
            let s_m = s.masked_fill(&soft.logical_not(), f64::NEG_INFINITY);
            let m = s_m.amax(-1, true);
            let e = (&s_m - &m).exp();
            let part = |mask: &Tensor| e.masked_fill(&mask.logical_not(), 0.0).sum_dim_intlist(-1, false, kind);
            let a_lin = self.feature_map_q.forward(&qt).matmul(&self.feature_map_k.forward(&kf).transpose(-2, -1)).squeeze_dim(2);
            let mut z_lin = a_lin.masked_fill(&soft, 0.0).sum_dim_intlist(-1, false, kind);
            if !self.cfg.linear_branch {
                z_lin = z_lin.zeros_like();
            } else if self.cfg.normalizer == Normalizer::MaxCompensated {
                z_lin = z_lin * (-m.squeeze_dim(-1)).exp();
            }
            let z = Tensor::stack(&[part(&window), part(&selected), z_lin], -1);
            let total = z.sum_dim_intlist(-1, true, kind) + OUT_EPS;
            Probe { selected: selected.shallow_clone(), window: window.contiguous(), shares: (z / total).to_kind(Kind::Double) }
        })
    }

    /// The explicit reference: scores by scalar loops (§4, §5), Sel/Win/Lin sets built per (query, key),
    /// dense `[T, T]` softmax and linear weights. Differentiable in q, k, v, g and the feature maps.
    pub fn reference(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> Tensor {
        let (b, h, t, d) = dims4(q);
        let c = self.cfg.chunk;
        let kind = compute_kind(q);
        let (qf, kf, vf) = (q.to_kind(kind), k.to_kind(kind), v.to_kind(kind));
        let s = qf.matmul(&kf.transpose(-2, -1)) / (d as f64).sqrt();
        let sel = self.reference_selection(&s.detach(), &kf.detach());
        let (mut sm, mut lin) = (vec![false; (b * h * t * t) as usize], vec![false; (b * h * t * t) as usize]);
        for bh in 0..(b * h) as usize {
            for ti in 0..t {
                for j in 0..=ti {
                    let (ct, cj) = (ti / c, j / c);
                    let win = cj + 1 >= ct; // chunk c−1 or c, causal
                    let routed = cj + 2 <= ct;
                    let in_sel = routed && sel[bh * t as usize + j as usize];
                    let in_lin = routed && !sel[bh * t as usize + j as usize];
                    assert_eq!(win as u8 + in_sel as u8 + in_lin as u8, 1, "Sel, Win, Lin partition 0..=t");
                    let at = (bh as i64 * t * t + ti * t + j) as usize;
                    sm[at] = win || in_sel;
                    lin[at] = in_lin;
                }
            }
        }
        let to_mask = |m: &[bool]| Tensor::from_slice(m).view([b, h, t, t]).to_device(q.device());
        let (sm, lin) = (to_mask(&sm), to_mask(&lin));
        let s_m = s.masked_fill(&sm.logical_not(), f64::NEG_INFINITY);
        let mut m = s_m.amax(-1, true); // over Sel ∪ Win only
        let chunk0 = Tensor::arange(t, (Kind::Int64, q.device())).lt(c).view([t, 1]);
        let phantom = self.cfg.compat.phantom_chunk0_keys;
        if phantom {
            m = m.clamp_min(0.0).where_self(&chunk0, &m);
        }
        let e = (&s_m - &m).exp();
        let mut z_sm = e.sum_dim_intlist(-1, true, kind);
        if phantom {
            // C zero keys (logit 0, value 0) for the queries of chunk 0 (C6).
            z_sm = z_sm + ((-&m).exp() * c as f64).where_scalarother(&chunk0, 0.0);
        }
        let mut a_lin = self.feature_map_q.forward(&qf).matmul(&self.feature_map_k.forward(&kf).transpose(-2, -1)).masked_fill(&lin.logical_not(), 0.0);
        if !self.cfg.linear_branch {
            a_lin = a_lin.zeros_like();
        } else if self.cfg.normalizer == Normalizer::MaxCompensated {
            a_lin = a_lin * (-&m).exp();
        }
        let mut n_lin = a_lin.matmul(&vf);
        if let Some(g) = g {
            n_lin = n_lin * g.to_kind(kind);
        }
        ((e.matmul(&vf) + n_lin) / (z_sm + a_lin.sum_dim_intlist(-1, true, kind) + OUT_EPS)).to_kind(q.kind())
    }

    /// Scalar routing of the reference: per (b, h), scores from the logits rows, top-κ per routed chunk
    /// with ties to the lower position. Returns "selected" per token `[B·H·T]`.
    pub(crate) fn reference_selection(&self, s: &Tensor, k: &Tensor) -> Vec<bool> {
        let (b, h, t, _) = dims4(k);
        let c = self.cfg.chunk;
        let logits: Vec<f64> = Vec::try_from(s.to_kind(Kind::Double).flatten(0, -1)).expect("logits");
        let knorm: Vec<f64> = Vec::try_from(k.to_kind(Kind::Double).norm_scalaropt_dim(2, -1, false).flatten(0, -1)).expect("norms");
        let mut sel = vec![false; (b * h * t) as usize];
        let last_chunk = (t - 1) / c;
        if let Some(list) = self.oracle_positions() {
            for bh in 0..b * h {
                for &j in list.iter().filter(|&&j| j >= 0 && j / c + 2 <= last_chunk) {
                    sel[(bh * t + j) as usize] = true;
                }
            }
            return sel;
        }
        for bh in 0..b * h {
            let head = bh % h;
            let row = |j: i64| &logits[((bh * t + j) * t) as usize..((bh * t + j + 1) * t) as usize];
            let score = |j: i64| -> f64 { self.reference_score(row(j), j, knorm[(bh * t + j) as usize], head) };
            for chunk in 0..=(last_chunk - 2).max(-1) {
                let kappa = self.selection.kappa_for(chunk);
                let mut members: Vec<(f64, i64)> = (chunk * c..(chunk + 1) * c).map(|j| (score(j), j)).collect();
                members.sort_by(|x, y| y.0.partial_cmp(&x.0).expect("no NaN scores").then(x.1.cmp(&y.1)));
                for &(_, j) in members.iter().take(kappa as usize) {
                    sel[(bh * t + j) as usize] = true;
                }
            }
        }
        sel
    }

    /// Score of token j from its logits row s_j· (scaled), written from the formulas of §4/§5.
    fn reference_score(&self, row: &[f64], j: i64, knorm: f64, head: i64) -> f64 {
        let c = self.cfg.chunk;
        let eps = SCORE_EPS;
        let softmax = |xs: &[f64]| -> Vec<f64> {
            let mx = xs.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = xs.iter().map(|x| (x - mx).exp()).collect();
            let sum: f64 = e.iter().sum();
            e.iter().map(|x| x / sum).collect()
        };
        let lo = (j - c + 1).max(0);
        match self.cfg.routing {
            Routing::SelfSaliency | Routing::DiagAttention => {
                let w: Vec<f64> = (lo..=j).map(|l| row[l as usize]).collect();
                let a = softmax(&w);
                let p = *a.last().unwrap();
                if self.cfg.routing == Routing::DiagAttention {
                    return p;
                }
                // b: softmax over the window without j, b_j = 0; b ≡ 0 if the window is {j}.
                let b: Vec<f64> = if w.len() == 1 {
                    vec![0.0]
                } else {
                    let mut b = softmax(&w[..w.len() - 1]);
                    b.push(0.0);
                    b
                };
                a.iter().zip(&b).map(|(a, b)| a * ((a + eps) / (b + eps)).ln()).sum()
            }
            Routing::SelfSaliencyReferenceCode => {
                // Circular columns: l ≤ i holds cC+l, l > i holds (c−1)C+l (absent in chunk 0); self is column i.
                let (cj, i) = (j / c, j % c);
                let pos = |l: i64| if l <= i { cj * c + l } else { (cj - 1) * c + l };
                let x: Vec<f64> = (0..c).map(|l| if pos(l) >= 0 { row[pos(l) as usize] } else { f64::NEG_INFINITY }).collect();
                let a = softmax(&x);
                let mut xb = x.clone();
                xb[i as usize] = f64::NEG_INFINITY;
                let b = softmax(&xb); // all NaN when only the self column exists (token 0)
                let cf = c as f64;
                let mut score = 0.0;
                for l in 0..c as usize {
                    let big_a = (a[l] + eps) / (1.0 + cf * eps);
                    let big_b = if l == c as usize - 1 { 1.0 / cf + eps } else { (b[l] + eps) / (1.0 + cf * eps + 1.0 / cf) };
                    score += big_a * (big_a / (big_b + eps)).ln();
                }
                if score.is_nan() {
                    f64::INFINITY
                } else {
                    score
                }
            }
            Routing::SelfLogit => row[j as usize],
            Routing::KeyNorm => knorm,
            Routing::Random => random_score(self.cfg.seed, self.dims.layer, head, j / c, j % c),
            Routing::Uniform => uniform_score(j % c, c, self.selection.kappa),
            Routing::None | Routing::Oracle => 0.0,
        }
    }
}

/// [`Still::probe`]: what the last query of a sequence reads.
#[derive(Debug)]
pub struct Probe {
    /// `[B, H, T]` bool: its selected tokens (Sel).
    pub selected: Tensor,
    /// `[B, H, T]` bool: its window (chunk c−1 and its own chunk).
    pub window: Tensor,
    /// `[B, H, 3]` fp64: the shares of its normalizer held by the Win, Sel and Lin terms (they sum to
    /// 1 up to the denominator's ε).
    pub shares: Tensor,
}

/// Uniform in [0, 1) from (seed, layer, head, chunk, index): splitmix64 over the key.
pub fn random_score(seed: u64, layer: i64, head: i64, chunk: i64, index: i64) -> f64 {
    fn mix(mut z: u64) -> u64 {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    let h = [layer, head, chunk, index].iter().fold(mix(seed), |acc, &x| mix(acc ^ x as u64));
    (h >> 11) as f64 / (1u64 << 53) as f64
}

/// 1 at the positions ⌊r·C/κ⌋ (r < κ) of a chunk, 0 elsewhere.
fn uniform_score(i: i64, c: i64, kappa: i64) -> f64 {
    ((0..kappa).any(|r| r * c / kappa.max(1) == i)) as u8 as f64
}

// ---------------------------------------------------------------------------------------------
// The shared hybrid operator (STILL, and LoLCATs with κ = 0 and γ)
// ---------------------------------------------------------------------------------------------

/// Everything the hybrid operator needs besides q, k, v and the gate: §3 for STILL, §7 for LoLCATs.
pub(crate) struct Hybrid<'a> {
    pub chunk: i64,
    pub fq: &'a FeatureMap,
    pub fk: &'a FeatureMap,
    pub selection: Selection,
    /// Routing scores; `None` = nothing is ever selected.
    pub scorer: Option<Scorer>,
    /// γ_h `[H]` multiplying both softmax sums (LoLCATs); `None` = 1.
    pub gamma: Option<Tensor>,
    /// Added to the denominator.
    pub eps: f64,
    pub phantom_chunk0_keys: bool,
    /// Decode only: a sliding window of `chunk` tokens, one token folded per step (LoLCATs' decode).
    pub sliding_decode: bool,
    /// `false`: no linear branch (numerator and denominator).
    pub linear: bool,
    /// Scale the linear terms by e^{−m_t} ([`Normalizer::MaxCompensated`]).
    pub compensate: bool,
    /// `routing: oracle`: the positions to select instead of the top-κ (ascending).
    pub oracle: Option<Vec<i64>>,
}

/// Routing of the complete chunks of a prefill.
struct Routed {
    /// `[B, H, n_sel]` absolute positions of the selected tokens, ascending within each chunk. Slot i
    /// holds a token of the same chunk in every (sequence, head): κ per chunk, or the oracle's list.
    pos: Tensor,
}

impl Routed {
    /// The chunk of each slot `[n_sel]`.
    fn chunks(&self, c: i64) -> Tensor {
        self.pos.select(0, 0).select(0, 0).divide_scalar_mode(c, "floor")
    }
}

impl Hybrid<'_> {
    /// Logits of every query against chunks c−1 and c: `[B, H, n, C, 2C]` (zero keys before chunk 0).
    fn window_logits(&self, qf: &Tensor, kf: &Tensor) -> Tensor {
        let (b, h, tp, d) = dims4(qf);
        let (c, n) = (self.chunk, tp / self.chunk);
        let qc = qf.reshape([b, h, n, c, d]);
        let kw = two_chunks(&kf.reshape([b, h, n, c, d]));
        qc.matmul(&kw.transpose(-2, -1)) / (d as f64).sqrt()
    }

    /// Per-token scores `[B, H, Tp]` from the window logits: each token's own window of the C most
    /// recent keys is cut out of its two-chunk row (column w ↔ position j−C+1+w, self last).
    fn scores(&self, s_win: &Tensor, kf: &Tensor) -> Tensor {
        let Some(scorer) = self.scorer else { return Tensor::zeros([kf.size()[0], kf.size()[1], kf.size()[2]], (kf.kind(), kf.device())) };
        let (b, h, n, c, _) = dims5(s_win);
        let dev = s_win.device();
        let i = Tensor::arange(c, (Kind::Int64, dev)).view([c, 1]);
        let w = Tensor::arange(c, (Kind::Int64, dev)).view([1, c]);
        let col = &i + 1 + &w; // [C, C] column of the two-chunk row
        let s_w = s_win.gather(-1, &col.expand([b, h, n, c, c], false), false).reshape([b, h, n * c, c]);
        let first = Tensor::arange(n, (Kind::Int64, dev)).eq(0).view([n, 1, 1]);
        let valid = first.logical_and(&col.lt(c)).logical_not().reshape([n * c, c]);
        scorer.scores(&s_w, &valid, kf, 0)
    }

    /// Top-κ per routed chunk (chunks that leave Win before the last token).
    fn route(&self, scores: &Tensor) -> Option<Routed> {
        let (b, h, tp) = (scores.size()[0], scores.size()[1], scores.size()[2]);
        let (c, n) = (self.chunk, tp / self.chunk);
        let r = (n - 2).max(0).min(self.selection.max_chunks);
        let kappa = self.selection.kappa.min(c);
        if self.scorer.is_none() || kappa == 0 || r == 0 {
            return None;
        }
        if let Some(list) = &self.oracle {
            let listed: Vec<i64> = list.iter().copied().filter(|&p| p >= 0 && p < r * c).collect();
            if listed.is_empty() {
                return None;
            }
            let pos = Tensor::from_slice(&listed).to_device(scores.device()).view([1, 1, -1]).expand([b, h, listed.len() as i64], false).contiguous();
            return Some(Routed { pos });
        }
        let idx = top_kappa(&scores.narrow(2, 0, r * c).view([b, h, r, c]), kappa); // [B, H, R, κ]
        let pos = (idx + Tensor::arange(r, (Kind::Int64, scores.device())).view([r, 1]) * c).view([b, h, r * kappa]);
        Some(Routed { pos })
    }

    /// The chunked prefill/training path; with `want_cache`, also the decode state after the last token.
    pub fn prefill(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>, want_cache: bool) -> (Tensor, Option<HybridCache>) {
        let (b, h, t, d) = dims4(q);
        let c = self.chunk;
        let (qf, kf, vf) = (pad_to(q, c), pad_to(k, c), pad_to(v, c));
        let (kind, dev) = (qf.kind(), q.device());
        let n = qf.size()[2] / c;
        let chunks = |x: &Tensor| x.reshape([b, h, n, c, x.size()[3]]);

        // Softmax part. Win: chunk c−1 (all) and chunk c (causal); chunk 0 has no previous chunk.
        let s_win = self.window_logits(&qf, &kf);
        let qi = Tensor::arange(c, (Kind::Int64, dev)).view([c, 1]);
        let col = Tensor::arange(2 * c, (Kind::Int64, dev)).view([1, 2 * c]);
        let mut win_ok = col.lt(c).logical_or(&(&col - c).le_tensor(&qi)).expand([n, c, 2 * c], false);
        if !self.phantom_chunk0_keys {
            let first = Tensor::arange(n, (Kind::Int64, dev)).eq(0).view([n, 1, 1]);
            win_ok = win_ok.logical_and(&first.logical_and(&col.lt(c).view([1, 1, 2 * c])).logical_not());
        }
        let scores = tch::no_grad(|| self.scores(&s_win.detach(), &kf.detach()));
        let routed = tch::no_grad(|| self.route(&scores));
        let (mut logits, mut ok) = (vec![s_win], vec![win_ok]);
        let mut sel_kv = None;
        if let Some(r) = &routed {
            // Sel: the κ tokens of every chunk ≤ c−2, visible from query chunk c.
            let nsel = r.pos.size()[2];
            let take = |x: &Tensor| x.gather(2, &r.pos.unsqueeze(-1).expand([b, h, nsel, d], false), false);
            let (ks, vs) = (take(&kf), take(&vf));
            logits.insert(0, chunks(&qf).matmul(&ks.unsqueeze(2).transpose(-2, -1)) / (d as f64).sqrt());
            let key_chunk = r.chunks(c).view([1, 1, nsel]);
            let q_chunk = Tensor::arange(n, (Kind::Int64, dev)).view([n, 1, 1]);
            ok.insert(0, (key_chunk + 2).le_tensor(&q_chunk).expand([n, c, nsel], false));
            sel_kv = Some(vs);
        }
        let s_all = Tensor::cat(&logits, -1).masked_fill(&Tensor::cat(&ok, -1).logical_not(), f64::NEG_INFINITY);
        let m = s_all.amax(-1, true); // over Sel ∪ Win only (and not compensated below, §3)
        let e = (s_all - &m).exp();
        let mut z_sm = e.sum_dim_intlist(-1, true, kind);
        let n_sel = e.size()[4] - 2 * c;
        let mut n_sm = e.narrow(-1, n_sel, 2 * c).matmul(&two_chunks(&chunks(&vf)));
        if let Some(vs) = &sel_kv {
            n_sm = n_sm + e.narrow(-1, 0, n_sel).matmul(&vs.unsqueeze(2));
        }
        if let Some(gamma) = &self.gamma {
            let gamma = gamma.to_kind(kind).view([1, h, 1, 1, 1]);
            n_sm = n_sm * &gamma;
            z_sm = z_sm * gamma;
        }

        // Linear part: per-chunk states of the non-selected tokens, summed over chunks ≤ c−2.
        let phi_k = chunks(&self.fk.forward(&kf));
        let phi_k = match &routed {
            // Lin = every token of chunks ≤ c−2 but the selected ones (capped chunks are all Lin).
            Some(r) => {
                let sel = Tensor::zeros([b, h, n * c], (kind, dev)).scatter_value(2, &r.pos, 1.0);
                phi_k * (-sel + 1.0).reshape([b, h, n, c, 1])
            }
            None => phi_k,
        };
        let ds = phi_k.transpose(-2, -1).matmul(&chunks(&vf)); // [B, H, n, F, D]
        let dz = phi_k.sum_dim_intlist(3, false, kind); // [B, H, n, F]
        let s_state = ds.cumsum(2, kind).constant_pad_nd([0, 0, 0, 0, 2, 0]).narrow(2, 0, n);
        let z_state = dz.cumsum(2, kind).constant_pad_nd([0, 0, 2, 0]).narrow(2, 0, n);
        let phi_q = chunks(&self.fq.forward(&qf));
        let mut n_lin = phi_q.matmul(&s_state);
        let mut z_lin = phi_q.matmul(&z_state.unsqueeze(-1));
        if let Some(g) = g {
            n_lin = n_lin * chunks(&pad_to(g, c));
        }
        (n_lin, z_lin) = self.linear_terms(n_lin, z_lin, &m);
        let y = ((n_sm + n_lin) / (z_sm + z_lin + self.eps)).reshape([b, h, n * c, d]).narrow(2, 0, t).to_kind(q.kind());
        if !want_cache {
            return (y, None);
        }

        // The state after token t−1 (§6): routed chunks ≤ c(t−1)−2 are exactly the R routed above.
        let cache = tch::no_grad(|| {
            let last = (t - 1) / c;
            let (w0, kvk) = ((last - 1).max(0) * c, k.kind());
            let mut cache = HybridCache::empty(b, h, d, self.fk.dim(), kvk, dev);
            cache.pos = t;
            if self.sliding_decode {
                // LoLCATs' decode: the last `chunk` tokens in the window, everything before folded.
                let w0 = (t - c).max(0);
                let phi = self.fk.forward(&kf.narrow(2, 0, w0));
                cache.s = phi.transpose(-2, -1).matmul(&vf.narrow(2, 0, w0));
                cache.z = phi.sum_dim_intlist(2, false, kind);
                cache.win_k = k.narrow(2, w0, t - w0).detach();
                cache.win_v = v.narrow(2, w0, t - w0).detach();
                cache.win_scores = scores.narrow(2, w0, t - w0);
                return cache;
            }
            if let Some(r) = &routed {
                let nsel = r.pos.size()[2];
                let take = |x: &Tensor| x.gather(2, &r.pos.unsqueeze(-1).expand([b, h, nsel, d], false), false);
                cache.sel_k = take(&k.detach());
                cache.sel_v = take(&v.detach());
            }
            cache.win_k = k.narrow(2, w0, t - w0).detach();
            cache.win_v = v.narrow(2, w0, t - w0).detach();
            cache.win_scores = scores.narrow(2, w0, t - w0);
            cache.s = s_state.select(2, n - 1).detach();
            cache.z = z_state.select(2, n - 1).detach();
            cache
        });
        (y, Some(cache))
    }

    /// One decode step (§6): route chunk c−2 when chunk c starts, append, score, attend.
    pub fn step(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> Tensor {
        self.advance(cache, q, k, v, g)
    }

    /// n new tokens (`[B, H, n, hd]`, rotated at positions cache.pos..): the outputs and final state of n
    /// calls of [`Hybrid::step`]. An empty cache takes the vectorised prefill (with the sliding decode
    /// window that is the terrace prefill, as in the reference); otherwise the tokens go one chunk
    /// segment at a time (Sel, S and z only change at chunk starts), or one by one when sliding.
    pub fn extend(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> Tensor {
        let n = q.size()[2];
        if cache.pos == 0 && n > 1 {
            let (y, fresh) = tch::no_grad(|| self.prefill(q, k, v, g, true));
            *cache = fresh.expect("cache requested");
            return y;
        }
        let mut outs = Vec::new();
        let mut at = 0;
        while at < n {
            let len = if self.sliding_decode { 1 } else { (self.chunk - cache.pos % self.chunk).min(n - at) };
            let seg = |x: &Tensor| x.narrow(2, at, len);
            outs.push(self.advance(cache, &seg(q), &seg(k), &seg(v), g.map(seg).as_ref()));
            at += len;
        }
        Tensor::cat(&outs, 2)
    }

    /// `len` new tokens that all fall in the current chunk (one token with the sliding window): route
    /// chunk c−2 if chunk c starts here, append to the window, score each token over its C most recent
    /// keys, attend causally to Sel ∪ window and linearly to S, z (§6).
    fn advance(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> Tensor {
        let _guard = tch::no_grad_guard();
        let (b, h, len, d) = dims4(q);
        let c = self.chunk;
        let kind = cache.s.kind();
        let dev = q.device();
        let (t, i) = (cache.pos, cache.pos % c);
        assert!(i + len <= c || (self.sliding_decode && len == 1), "advance: tokens cross a chunk boundary");
        if !self.sliding_decode && i == 0 && t / c >= 2 {
            self.route_step(cache, t / c - 2);
        }
        cache.win_k = Tensor::cat(&[&cache.win_k, &k.to_kind(cache.win_k.kind())], 2);
        cache.win_v = Tensor::cat(&[&cache.win_v, &v.to_kind(cache.win_v.kind())], 2);
        if self.sliding_decode && cache.win_k.size()[2] > c {
            self.fold(cache, &Tensor::ones([b, h, 1, 1], (kind, dev)), 1);
        }
        let qf = q.to_kind(kind);
        let scale = 1.0 / (d as f64).sqrt();
        let nsel = cache.sel_k.size()[2];
        let nw = cache.win_k.size()[2];
        let keys = Tensor::cat(&[&cache.sel_k, &cache.win_k], 2).to_kind(kind);
        let vals = Tensor::cat(&[&cache.sel_v, &cache.win_v], 2).to_kind(kind);
        let s = qf.matmul(&keys.transpose(-2, -1)) * scale; // [B, H, len, nsel + nw]
        // New token r sits at window index nw − len + r.
        let r = Tensor::arange(len, (Kind::Int64, dev)).view([len, 1]) + (nw - len);

        // Score of each new token over its C most recent keys: column w ↔ window index r − C + 1 + w
        // (self last), invalid before the start of the sequence (as prefill's zero padding).
        let idx = &r - (c - 1) + Tensor::arange(c, (Kind::Int64, dev)).view([1, c]); // [len, C]
        let valid = idx.ge(0);
        let s_w = s.narrow(-1, nsel, nw).gather(-1, &idx.clamp_min(0).expand([b, h, len, c], false), false).masked_fill(&valid.logical_not(), 0.0);
        let score = match self.scorer {
            Some(sc) => sc.scores(&s_w, &valid, &k.to_kind(kind), t),
            None => Tensor::zeros([b, h, len], (kind, dev)),
        };
        cache.win_scores = Tensor::cat(&[&cache.win_scores, &score], 2);

        // Output: softmax over Sel ∪ window (causal inside the window), linear over S, z.
        let col = Tensor::arange(nsel + nw, (Kind::Int64, dev)).view([1, nsel + nw]) - nsel;
        let s = s.masked_fill(&col.gt_tensor(&r), f64::NEG_INFINITY);
        let m = s.amax(-1, true);
        let e = (&s - &m).exp();
        let mut n_sm = e.matmul(&vals);
        let mut z_sm = e.sum_dim_intlist(-1, true, kind);
        if let Some(gamma) = &self.gamma {
            let gamma = gamma.to_kind(kind).view([1, h, 1, 1]);
            n_sm = n_sm * &gamma;
            z_sm = z_sm * gamma;
        }
        let phi_q = self.fq.forward(&qf);
        let mut n_lin = phi_q.matmul(&cache.s);
        let z_lin = phi_q.matmul(&cache.z.unsqueeze(-1));
        if let Some(g) = g {
            n_lin = n_lin * g.to_kind(kind);
        }
        let (n_lin, z_lin) = self.linear_terms(n_lin, z_lin, &m);
        cache.pos += len;
        ((n_sm + n_lin) / (z_sm + z_lin + self.eps)).to_kind(q.kind())
    }

    /// The linear numerator and denominator as they enter the output: dropped without the linear
    /// branch, scaled by e^{−m} (m = the softmax max, broadcast over the last dim) when compensated.
    fn linear_terms(&self, n_lin: Tensor, z_lin: Tensor, m: &Tensor) -> (Tensor, Tensor) {
        if !self.linear {
            return (n_lin.zeros_like(), z_lin.zeros_like());
        }
        if self.compensate {
            let f = (-m).exp();
            return (n_lin * &f, z_lin * f);
        }
        (n_lin, z_lin)
    }

    /// Route chunk `chunk` = the first C window tokens: top-κ (or the oracle's) to Sel, the rest into S and z.
    fn route_step(&self, cache: &mut HybridCache, chunk: i64) {
        let c = self.chunk;
        let (b, h, d) = (cache.win_k.size()[0], cache.win_k.size()[1], cache.win_k.size()[3]);
        let kappa = if self.scorer.is_some() { self.selection.kappa_for(chunk).min(c) } else { 0 };
        let mut lin = Tensor::ones([b, h, c, 1], (cache.s.kind(), cache.s.device()));
        let idx = match &self.oracle {
            Some(list) if kappa > 0 => {
                let inside: Vec<i64> = list.iter().filter(|&&p| p / c == chunk && p >= 0).map(|&p| p - chunk * c).collect();
                (!inside.is_empty()).then(|| Tensor::from_slice(&inside).to_device(cache.s.device()).view([1, 1, -1]).expand([b, h, inside.len() as i64], false).contiguous())
            }
            _ => (kappa > 0).then(|| top_kappa(&cache.win_scores.narrow(2, 0, c), kappa)), // [B, H, κ]
        };
        if let Some(idx) = idx {
            let kappa = idx.size()[2];
            let take = |x: &Tensor| x.narrow(2, 0, c).gather(2, &idx.unsqueeze(-1).expand([b, h, kappa, d], false), false);
            cache.sel_k = Tensor::cat(&[&cache.sel_k, &take(&cache.win_k)], 2);
            cache.sel_v = Tensor::cat(&[&cache.sel_v, &take(&cache.win_v)], 2);
            lin = lin.scatter_value(2, &idx.unsqueeze(-1), 0.0);
        }
        self.fold(cache, &lin, c);
    }

    /// Fold the first `count` window tokens (weighted by `lin` `[B, H, count, 1]`) into S, z and drop them.
    fn fold(&self, cache: &mut HybridCache, lin: &Tensor, count: i64) {
        let kind = cache.s.kind();
        let phi = self.fk.forward(&cache.win_k.narrow(2, 0, count).to_kind(kind)) * lin;
        cache.s = &cache.s + phi.transpose(-2, -1).matmul(&cache.win_v.narrow(2, 0, count).to_kind(kind));
        cache.z = &cache.z + phi.sum_dim_intlist(2, false, kind);
        let drop = |x: &Tensor| x.narrow(2, count, x.size()[2] - count);
        (cache.win_k, cache.win_v, cache.win_scores) = (drop(&cache.win_k), drop(&cache.win_v), drop(&cache.win_scores));
    }
}

/// The per-token routing score, one routine for prefill and decode (C3).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Scorer {
    pub routing: Routing,
    pub kappa: i64,
    pub seed: u64,
    pub layer: i64,
}

impl Scorer {
    /// Scores `[B, H, T']` of tokens at positions pos0.. from their window logits s_w `[B, H, T', C]`
    /// (column w = position j−C+1+w, self last), `valid` `[T', C]` (position ≥ 0) and own keys `[B, H, T', D]`.
    fn scores(&self, s_w: &Tensor, valid: &Tensor, k_self: &Tensor, pos0: i64) -> Tensor {
        let (b, h, tn, c) = dims4(s_w);
        let (kind, dev) = (s_w.kind(), s_w.device());
        let inf = f64::INFINITY;
        let a = s_w.masked_fill(&valid.logical_not(), -inf).softmax(-1, kind);
        let per_position = |f: &dyn Fn(i64, i64) -> f64| {
            let vals: Vec<f64> = (0..h).flat_map(|hh| (pos0..pos0 + tn).map(move |j| (hh, j))).map(|(hh, j)| f(hh, j)).collect();
            Tensor::from_slice(&vals).view([1, h, tn]).to_kind(kind).to_device(dev).expand([b, h, tn], false)
        };
        match self.routing {
            Routing::DiagAttention => a.select(-1, c - 1),
            Routing::SelfLogit => s_w.select(-1, c - 1),
            Routing::KeyNorm => k_self.norm_scalaropt_dim(2, -1, false),
            Routing::Random => per_position(&|hh, j| random_score(self.seed, self.layer, hh, j / c, j % c)),
            Routing::Uniform => per_position(&|_, j| uniform_score(j % c, c, self.kappa)),
            // The oracle routes by its list, not by scores.
            Routing::None | Routing::Oracle => Tensor::zeros([b, h, tn], (kind, dev)),
            Routing::SelfSaliency | Routing::SelfSaliencyReferenceCode => {
                let not_self = Tensor::arange(c, (Kind::Int64, dev)).ne(c - 1);
                // b: the same softmax without the token itself (NaN rows when nothing else is in the window).
                let bb = s_w.masked_fill(&valid.logical_and(&not_self).logical_not(), -inf).softmax(-1, kind);
                if self.routing == Routing::SelfSaliency {
                    let bb = bb.nan_to_num(0.0, None, None); // W_j = {j}: b ≡ 0
                    (&a * ((&a + SCORE_EPS) / (bb + SCORE_EPS)).log()).sum_dim_intlist(-1, false, kind)
                } else {
                    // §5.2. The overridden column C−1 holds the position ≡ C−1 (mod C), i.e. cC−1 for
                    // i < C−1 (w = C−2−i) and the token itself for i = C−1 (w = C−1).
                    let cf = c as f64;
                    let i = (Tensor::arange(tn, (Kind::Int64, dev)) + pos0).remainder(c).view([tn, 1]);
                    let over = Tensor::arange(c, (Kind::Int64, dev)).view([1, c]).eq_tensor(&(-i + (c - 2)).remainder(c));
                    let big_a = (&a + SCORE_EPS) / (1.0 + cf * SCORE_EPS);
                    let big_b = ((bb + SCORE_EPS) / (1.0 + cf * SCORE_EPS + 1.0 / cf)).masked_fill(&over, 1.0 / cf + SCORE_EPS);
                    let sc = (&big_a * (&big_a / (big_b + SCORE_EPS)).log()).sum_dim_intlist(-1, false, kind);
                    sc.masked_fill(&sc.isnan(), inf) // token 0 (C7 compat: NaN ranks first)
                }
            }
        }
    }
}

/// Indices `[…, κ]` of the κ largest scores along the last dim, ties to the lower index, sorted ascending.
fn top_kappa(scores: &Tensor, kappa: i64) -> Tensor {
    let (_, order) = scores.sort_stable(true, -1, true);
    order.narrow(-1, 0, kappa).sort(-1, false).0
}

// ---------------------------------------------------------------------------------------------
// Decode cache
// ---------------------------------------------------------------------------------------------

/// Decode state of one layer, per query head (§6). Its size is bounded by 2C window tokens, the
/// selected tokens (≤ m − 2C with a budget) and the fixed S, z.
#[derive(Debug)]
pub struct HybridCache {
    /// Position of the next token.
    pub pos: i64,
    /// Selected keys/values `[B, H, n_sel, D]` (model dtype), never evicted.
    pub sel_k: Tensor,
    pub sel_v: Tensor,
    /// Chunk c−1 and the current chunk `[B, H, ≤ 2C, D]` (model dtype).
    pub win_k: Tensor,
    pub win_v: Tensor,
    /// Routing scores of the window tokens `[B, H, ≤ 2C]` (fp32).
    pub win_scores: Tensor,
    /// S `[B, H, F, D]` and z `[B, H, F]` over the folded tokens (fp32).
    pub s: Tensor,
    pub z: Tensor,
}

impl HybridCache {
    pub(crate) fn empty(b: i64, h: i64, d: i64, f: i64, kv_kind: Kind, dev: Device) -> Self {
        let state = if kv_kind == Kind::Double { Kind::Double } else { Kind::Float };
        let kv = || Tensor::zeros([b, h, 0, d], (kv_kind, dev));
        HybridCache {
            pos: 0,
            sel_k: kv(),
            sel_v: kv(),
            win_k: kv(),
            win_v: kv(),
            win_scores: Tensor::zeros([b, h, 0], (state, dev)),
            s: Tensor::zeros([b, h, f, d], (state, dev)),
            z: Tensor::zeros([b, h, f], (state, dev)),
        }
    }

    /// Bytes held by the cache's tensors.
    pub fn bytes(&self) -> i64 {
        [&self.sel_k, &self.sel_v, &self.win_k, &self.win_v, &self.win_scores, &self.s, &self.z]
            .iter()
            .map(|x| x.numel() as i64 * x.kind().elt_size_in_bytes() as i64)
            .sum()
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
    use super::*;
    use crate::attention::causal;
    use crate::spec::AttentionImpl;

    const ALL_ROUTINGS: [Routing; 8] = [
        Routing::SelfSaliency,
        Routing::SelfSaliencyReferenceCode,
        Routing::DiagAttention,
        Routing::SelfLogit,
        Routing::KeyNorm,
        Routing::Random,
        Routing::Uniform,
        Routing::None,
    ];

    fn cfg(yaml: &str) -> StillConfig {
        serde_yaml::from_str(yaml).unwrap()
    }

    /// A STILL layer in fp64 on the CPU (H heads of width D, d_model = H·D).
    fn layer(c: &StillConfig, h: i64, d: i64, seed: i64) -> (nn::VarStore, Still) {
        tch::manual_seed(seed);
        let mut vs = nn::VarStore::new(Device::Cpu);
        let st = Still::new(&vs.root(), c, LayerDims { heads: h, head_dim: d, d_model: h * d, layer: 3 }).unwrap();
        vs.double();
        (vs, st)
    }

    /// q, k, v `[B, H, T, D]` and x `[B, T, H·D]`, fp64, requiring grad.
    fn inputs(b: i64, h: i64, t: i64, d: i64, seed: i64) -> Vec<Tensor> {
        tch::manual_seed(seed);
        let r = |shape: &[i64]| Tensor::randn(shape, (Kind::Double, Device::Cpu)).set_requires_grad(true);
        vec![r(&[b, h, t, d]), r(&[b, h, t, d]), r(&[b, h, t, d]), r(&[b, t, h * d])]
    }

    /// Largest |a − b| (equal infinities count as 0: the code variant scores token 0 +∞).
    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        assert_eq!(a.size(), b.size());
        if a.numel() == 0 {
            return 0.0;
        }
        (a - b).abs().where_scalarother(&a.ne_tensor(b), 0.0).max().double_value(&[])
    }

    fn to_bools(x: &Tensor) -> Vec<bool> {
        Vec::<bool>::try_from(x.flatten(0, -1)).unwrap()
    }

    /// Output and the gradients of ⟨out, go⟩ w.r.t. `wrt` (undefined = zero).
    fn grads(out: &Tensor, go: &Tensor, wrt: &[Tensor]) -> Vec<Tensor> {
        let gs = Tensor::run_backward(&[(out * go).sum(Kind::Double)], &wrt.iter().collect::<Vec<_>>(), true, false);
        gs.into_iter().zip(wrt).map(|(g, x)| if g.defined() { g } else { x.zeros_like() }).collect()
    }

    #[test]
    fn config_defaults_aliases_and_unknown_keys() {
        let c = StillConfig::default();
        assert_eq!((c.chunk, c.tokens_per_chunk, c.budget, c.gate, c.routing, c.init), (64, None, None, true, Routing::SelfSaliency, ParamInit::Normal));
        assert_eq!(c.feature_map, FeatureMapKind::NpMap);
        assert_eq!(c.selection().unwrap(), Selection { kappa: 4, max_chunks: i64::MAX });
        let c = cfg("{routing: diag_attn, feature_map: hedgehog_d128, gate: false, compat: {phantom_chunk0_keys: true}}");
        assert_eq!((c.routing, c.feature_map, c.gate, c.compat.phantom_chunk0_keys), (Routing::DiagAttention, FeatureMapKind::Hedgehog, false, true));
        assert!(serde_yaml::from_str::<StillConfig>("{chunks: 64}").is_err());
        assert!(serde_yaml::from_str::<StillConfig>("{budget: {m: 384, n_max: 4096}}").is_err());
        assert!(serde_yaml::from_str::<StillConfig>("{routing: lowest_kl}").is_err());
        // Round trip.
        let c = cfg("{budget: {m: 384, max_len: 4096}, routing: random, seed: 7}");
        assert_eq!(serde_yaml::from_str::<StillConfig>(&serde_yaml::to_string(&c).unwrap()).unwrap(), c);
    }

    /// still.md §12.4: (m, N_max) → λ with C = 64, W = 128.
    #[test]
    fn budget_lambda_formula() {
        let kappa = |m: i64, n: i64| cfg(&format!("{{budget: {{m: {m}, max_len: {n}}}}}")).selection().map(|s| s.kappa);
        assert_eq!(kappa(384, 4096).unwrap(), 4);
        assert_eq!(kappa(352, 4096).unwrap(), 3);
        assert_eq!(kappa(384, 4097).unwrap(), 3);
        assert_eq!(kappa(384, 1000).unwrap(), 16);
        for n in [1, 64, 1000, 100_000] {
            assert_eq!(kappa(128, n).unwrap(), 0, "LoLCATs-like");
            assert!(kappa(100, n).is_err(), "m < W");
        }
        assert_eq!(kappa(1_000_000, 1024).unwrap(), 64, "clamped to C: exact softmax");
        let s = cfg("{budget: {m: 384, max_len: 4096}}").selection().unwrap();
        assert_eq!((s.max_chunks, s.kappa_for(63), s.kappa_for(64)), (64, 4, 0), "|Sel| stops at m − W = 256");
        assert!(cfg("{budget: {m: 384, max_len: 4096}, tokens_per_chunk: 4}").selection().is_err());
        assert!(cfg("{tokens_per_chunk: 65}").selection().is_err());
        assert!(cfg("{chunk: 0}").selection().is_err());
        assert_eq!(cfg("{routing: none}").selection().unwrap().kappa, 0);
    }

    #[test]
    fn parameter_names_and_shapes() {
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

    /// still.md §12.1: the chunked path equals the per-token reference (outputs, selected tokens) for
    /// every routing metric and the lengths around chunk boundaries, C = 64, κ = 4.
    #[test]
    fn fast_matches_reference_every_routing() {
        for routing in ALL_ROUTINGS {
            let c = StillConfig { routing, ..StillConfig::default() };
            let (_, st) = layer(&c, 4, 16, 1);
            for t in [1i64, 63, 64, 65, 127, 128, 129, 200, 1024] {
                let x = inputs(2, 4, t, 16, t);
                let g = st.gate(&x[3]);
                let (fast, slow) = tch::no_grad(|| (st.forward(&x[0], &x[1], &x[2], g.as_ref()), st.reference(&x[0], &x[1], &x[2], g.as_ref())));
                let err = max_diff(&fast, &slow);
                assert!(err < 1e-10, "{routing:?} T={t}: {err}");
                let sel_fast = to_bools(&st.selected(&x[0], &x[1]));
                let sel_ref = st.reference_selection(&(x[0].matmul(&x[1].transpose(-2, -1)) / 4.0).detach(), &x[1].detach());
                assert_eq!(sel_fast, sel_ref, "{routing:?} T={t}: selected tokens");
                let n_sel = sel_fast.iter().filter(|&&s| s).count() as i64;
                let routed_chunks = ((t - 1) / 64 - 1).max(0);
                let want = if routing == Routing::None { 0 } else { 2 * 4 * 4 * routed_chunks };
                assert_eq!(n_sel, want, "{routing:?} T={t}: |Sel| = κ·max(0, c−1) per head");
            }
        }
    }

    /// Gradients w.r.t. q, k, v, the gate input and every parameter agree (C = 8, κ = 2, many chunks),
    /// also with a budget cap, the Hedgehog map, no gate and the phantom chunk-0 keys.
    #[test]
    fn fast_matches_reference_gradients() {
        let variants = [
            "{chunk: 8, tokens_per_chunk: 2}",
            "{chunk: 8, tokens_per_chunk: 2, routing: self_saliency_reference_code}",
            "{chunk: 8, tokens_per_chunk: 3, routing: key_norm, feature_map: hedgehog, init: constructor}",
            "{chunk: 8, budget: {m: 20, max_len: 32}}",
            "{chunk: 8, tokens_per_chunk: 2, gate: false, compat: {phantom_chunk0_keys: true}}",
            "{chunk: 8, routing: none}",
            "{chunk: 8, tokens_per_chunk: 8}",
            "{chunk: 8, tokens_per_chunk: 2, normalizer: max_compensated}",
            "{chunk: 8, tokens_per_chunk: 2, linear_branch: false}",
            "{chunk: 8, routing: oracle}",
        ];
        for (vi, y) in variants.iter().enumerate() {
            let (vs, st) = layer(&cfg(y), 3, 8, 10 + vi as i64);
            st.set_oracle(Some(vec![11, 0, 3, 9, 10, 17, 25, 3]));
            for t in [5i64, 8, 13, 17, 40] {
                let x = inputs(2, 3, t, 8, 100 + t);
                let go = Tensor::randn([2, 3, t, 8], (Kind::Double, Device::Cpu));
                let mut wrt: Vec<Tensor> = x.iter().map(|t| t.shallow_clone()).collect();
                wrt.extend(vs.trainable_variables());
                let run = |reference: bool| {
                    let g = st.gate(&x[3]);
                    let out = if reference { st.reference(&x[0], &x[1], &x[2], g.as_ref()) } else { st.forward(&x[0], &x[1], &x[2], g.as_ref()) };
                    (out.detach(), grads(&out, &go, &wrt))
                };
                let ((o_f, g_f), (o_r, g_r)) = (run(false), run(true));
                assert!(max_diff(&o_f, &o_r) < 1e-10, "{y} T={t}: output");
                for (i, (a, b)) in g_f.iter().zip(&g_r).enumerate() {
                    let err = max_diff(a, b);
                    assert!(err < 1e-10, "{y} T={t}: gradient of input {i}: {err}");
                }
                // The parameters matter (a zero gradient would make the comparison vacuous).
                if t > 16 && !y.contains("tokens_per_chunk: 8") && !y.contains("linear_branch: false") {
                    let fq = &g_f[4 + vs.trainable_variables().iter().position(|p| p.size() == [3, 8, 8]).unwrap()];
                    assert!(fq.abs().max().double_value(&[]) > 0.0, "{y}: feature maps receive gradient");
                }
            }
        }
    }

    fn decode(st: &Still, cache: &mut HybridCache, x: &[Tensor], from: i64, to: i64) -> Tensor {
        let outs: Vec<Tensor> = (from..to)
            .map(|p| {
                let at = |t: &Tensor| t.narrow(2, p, 1);
                let g = st.gate(&x[3].narrow(1, p, 1));
                st.step(cache, &at(&x[0]), &at(&x[1]), &at(&x[2]), g.as_ref())
            })
            .collect();
        Tensor::cat(&outs, 2)
    }

    fn assert_same_cache(a: &HybridCache, b: &HybridCache, what: &str) {
        assert_eq!(a.pos, b.pos, "{what}: pos");
        let pairs = [
            (&a.sel_k, &b.sel_k, "sel_k"),
            (&a.sel_v, &b.sel_v, "sel_v"),
            (&a.win_k, &b.win_k, "win_k"),
            (&a.win_v, &b.win_v, "win_v"),
            (&a.win_scores, &b.win_scores, "scores"),
            (&a.s, &b.s, "S"),
            (&a.z, &b.z, "z"),
        ];
        for (x, y, name) in pairs {
            assert!(max_diff(x, y) < 1e-10, "{what}: {name} differs by {}", max_diff(x, y));
        }
    }

    /// still.md §12.2: prefill(L0) then token-by-token decode to L gives prefill(L)'s outputs and cache,
    /// for every L0 < L (L0 = 0: decoding from an empty cache).
    #[test]
    fn prefill_then_decode_matches_prefill() {
        let lens = [0i64, 1, 7, 8, 9, 15, 16, 17, 30, 45];
        for y in [
            "{chunk: 8, tokens_per_chunk: 2}",
            "{chunk: 8, budget: {m: 20, max_len: 24}, routing: self_saliency_reference_code}",
            "{chunk: 8, tokens_per_chunk: 3, routing: random}",
            "{chunk: 8, routing: uniform, tokens_per_chunk: 3, gate: false}",
            "{chunk: 8, routing: oracle, normalizer: max_compensated}",
            "{chunk: 8, tokens_per_chunk: 2, linear_branch: false}",
        ] {
            let (_, st) = layer(&cfg(y), 2, 8, 5);
            st.set_oracle(Some(vec![2, 3, 4, 12, 20, 21, 22, 23, 30]));
            let x = inputs(2, 2, 45, 8, 6);
            let x = tch::no_grad(|| x.iter().map(|t| t.detach()).collect::<Vec<_>>());
            let cut = |l: i64| -> Vec<Tensor> { x.iter().enumerate().map(|(i, t)| t.narrow(if i == 3 { 1 } else { 2 }, 0, l)).collect() };
            let prefill = |l: i64| {
                let xl = cut(l);
                let g = st.gate(&xl[3]);
                st.prefill(&xl[0], &xl[1], &xl[2], g.as_ref())
            };
            let full: Vec<(Tensor, HybridCache)> = lens
                .iter()
                .map(|&l| if l == 0 { (Tensor::zeros([0], (Kind::Double, Device::Cpu)), st.new_cache(2, Kind::Double, Device::Cpu)) } else { prefill(l) })
                .collect();
            // From each L0, decode to the end, checking outputs and cache whenever a listed L is reached.
            for (a, &l0) in lens.iter().enumerate() {
                let mut cache = if l0 == 0 { st.new_cache(2, Kind::Double, Device::Cpu) } else { prefill(l0).1 };
                let mut outs = vec![];
                for (bi, &l) in lens.iter().enumerate().skip(a + 1) {
                    outs.push(decode(&st, &mut cache, &x, lens[bi - 1].max(l0), l));
                    let y_dec = Tensor::cat(&outs, 2);
                    let err = max_diff(&y_dec, &full[bi].0.narrow(2, l0, l - l0));
                    assert!(err < 1e-10, "{y} L0={l0} L={l}: outputs differ by {err}");
                    assert_same_cache(&cache, &full[bi].1, &format!("{y} L0={l0} L={l}"));
                }
            }
        }
    }

    /// Multi-token `extend` (chunk segments over an existing cache, or the prefill from an empty one)
    /// gives prefill(L)'s outputs and cache whatever the block sizes, blocks crossing chunk boundaries included.
    #[test]
    fn extend_in_blocks_matches_prefill() {
        for y in ["{chunk: 8, tokens_per_chunk: 2}", "{chunk: 8, budget: {m: 20, max_len: 24}, routing: self_saliency_reference_code}", "{chunk: 8, tokens_per_chunk: 3, routing: random, gate: false}"] {
            let (_, st) = layer(&cfg(y), 2, 8, 5);
            let x: Vec<Tensor> = inputs(2, 2, 45, 8, 6).iter().map(|t| t.detach()).collect();
            let g = st.gate(&x[3]);
            let (want, want_cache) = tch::no_grad(|| st.prefill(&x[0], &x[1], &x[2], g.as_ref()));
            for blocks in [vec![45i64], vec![1, 3, 8, 13, 20], vec![10, 1, 1, 17, 16], vec![5, 40]] {
                let mut cache = st.new_cache(2, Kind::Double, Device::Cpu);
                let mut outs = vec![];
                let mut at = 0;
                for n in blocks.iter().copied() {
                    let cut = |t: &Tensor| t.narrow(2, at, n);
                    outs.push(st.extend(&mut cache, &cut(&x[0]), &cut(&x[1]), &cut(&x[2]), g.as_ref().map(cut).as_ref()));
                    at += n;
                }
                let err = max_diff(&Tensor::cat(&outs, 2), &want);
                assert!(err < 1e-10, "{y} blocks {blocks:?}: outputs differ by {err}");
                assert_same_cache(&cache, &want_cache, &format!("{y} blocks {blocks:?}"));
            }
        }
    }

    /// The C6 compat keys exist only in prefill (as in the reference), so decode must disagree on chunk 0.
    #[test]
    fn phantom_keys_break_prefill_decode_agreement() {
        let (_, st) = layer(&cfg("{chunk: 8, tokens_per_chunk: 2, compat: {phantom_chunk0_keys: true}}"), 2, 8, 5);
        let x: Vec<Tensor> = inputs(1, 2, 12, 8, 6).iter().map(|t| t.detach()).collect();
        let g = st.gate(&x[3]);
        let y = tch::no_grad(|| st.forward(&x[0], &x[1], &x[2], g.as_ref()));
        let mut cache = st.new_cache(1, Kind::Double, Device::Cpu);
        let y_dec = tch::no_grad(|| decode(&st, &mut cache, &x, 0, 12));
        assert!(max_diff(&y.narrow(2, 0, 8), &y_dec.narrow(2, 0, 8)) > 1e-3, "chunk 0 must differ");
        assert!(max_diff(&y.narrow(2, 8, 4), &y_dec.narrow(2, 8, 4)) < 1e-10, "later chunks agree");
    }

    /// §6: the cache holds ≤ 2C window tokens, κ·max(0, c−1) selected ones without a budget and at most
    /// m − 2C with one, so with a budget its size stops growing.
    #[test]
    fn decode_cache_is_bounded() {
        for (y, cap) in [("{chunk: 8, tokens_per_chunk: 2}", None), ("{chunk: 8, budget: {m: 22, max_len: 32}}", Some(6))] {
            let (_, st) = layer(&cfg(y), 2, 8, 1);
            let x: Vec<Tensor> = inputs(1, 2, 200, 8, 2).iter().map(|t| t.detach()).collect();
            let mut cache = st.new_cache(1, Kind::Double, Device::Cpu);
            let mut bytes = vec![];
            for p in 0..200 {
                let _ = decode(&st, &mut cache, &x, p, p + 1);
                let (n_sel, n_win) = (cache.sel_k.size()[2], cache.win_k.size()[2]);
                assert!(n_win <= 16 && n_win == (p % 8) + 1 + if p >= 8 { 8 } else { 0 }, "window {n_win} at {p}");
                let c = p / 8;
                match cap {
                    None => assert_eq!(n_sel, 2 * (c - 1).max(0), "at {p}"),
                    Some(cap) => assert!(n_sel <= cap && n_sel == (c - 1).clamp(0, cap), "{n_sel} at {p}"),
                }
                bytes.push(cache.bytes());
            }
            if cap.is_some() {
                // Budget: λ = ⌊6/4⌋ = 1 per chunk for 6 chunks, then constant memory (window full after 16 tokens).
                assert_eq!(bytes[199], bytes[8 * 8 - 1 + 8 * 2]);
                assert!(bytes[199] <= *bytes.iter().max().unwrap());
            } else {
                assert!(bytes[199] > bytes[100]);
            }
        }
    }

    /// S(p) = p·ln((p+ε)/ε) + (1−p)·ln(1−p), with (1−p)·ln(1−p) = 0 at p = 1.
    fn s_of_p(p: f64) -> f64 {
        let tail = if p < 1.0 { (1.0 - p) * (1.0 - p).ln() } else { 0.0 };
        p * ((p + SCORE_EPS) / SCORE_EPS).ln() + tail
    }

    /// still.md §5.1 / §12.5: self-saliency is a function of the windowed diagonal attention a_jj:
    /// 0 ≤ Score − S(a_jj) ≤ (|W|−1)·ε·a_jj, so both metrics pick the same tokens.
    #[test]
    fn self_saliency_is_a_function_of_diagonal_attention() {
        let mut checked = 0;
        for (scale, t) in [(0.1f64, 200i64), (1.0, 200), (3.0, 130), (30.0, 100)] {
            let x = inputs(2, 4, t, 16, (scale * 10.0) as i64);
            let (q, k) = (&x[0] * scale.sqrt(), &x[1] * scale.sqrt());
            let mk = |r: Routing| layer(&StillConfig { routing: r, ..StillConfig::default() }, 4, 16, 0).1;
            let (ss, diag) = (mk(Routing::SelfSaliency), mk(Routing::DiagAttention));
            let score: Vec<f64> = Vec::try_from(ss.scores(&q, &k).flatten(0, -1)).unwrap();
            let p: Vec<f64> = Vec::try_from(diag.scores(&q, &k).flatten(0, -1)).unwrap();
            for (n, (s, p)) in score.iter().zip(&p).enumerate() {
                let w = ((n as i64 % t) + 1).min(64) as f64;
                let gap = s - s_of_p(*p);
                assert!(gap >= -1e-9 && gap <= (w - 1.0) * SCORE_EPS * p + 1e-9, "scale {scale} token {n}: gap {gap}, p {p}");
                checked += 1;
            }
            // Same top-κ sets wherever every a_jj > 1e-6 (ties aside).
            if p.iter().all(|&p| p > 1e-6) {
                assert_eq!(to_bools(&ss.selected(&q, &k)), to_bools(&diag.selected(&q, &k)), "scale {scale}");
            }
            // Token 0 ranks first in chunk 0 (paper: S = ln((1+ε)/ε), the maximum; code variant: NaN → +∞).
            let code = mk(Routing::SelfSaliencyReferenceCode);
            for st in [&ss, &code] {
                let sc = st.scores(&q, &k).narrow(2, 0, 64);
                assert_eq!(sc.argmax(-1, false), Tensor::zeros([2, 4], (Kind::Int64, Device::Cpu)));
            }
            assert!((score[0] - ((1.0 + SCORE_EPS) / SCORE_EPS).ln()).abs() < 1e-12);
        }
        assert!(checked > 4000);
    }

    /// §5.2's closed forms of the reference code's score (chunks ≥ 1), with a_x = attention to cC−1.
    #[test]
    fn reference_code_score_closed_forms() {
        let c = 64i64;
        let x = inputs(2, 4, 256, 16, 3);
        let mk = |r: Routing| layer(&StillConfig { routing: r, ..StillConfig::default() }, 4, 16, 0).1;
        let code: Vec<f64> = Vec::try_from(mk(Routing::SelfSaliencyReferenceCode).scores(&x[0], &x[1]).flatten(0, -1)).unwrap();
        let p: Vec<f64> = Vec::try_from(mk(Routing::DiagAttention).scores(&x[0], &x[1]).flatten(0, -1)).unwrap();
        let logits: Vec<f64> = Vec::try_from((x[0].matmul(&x[1].transpose(-2, -1)) / 4.0).flatten(0, -1)).unwrap();
        let (cf, eps) = (c as f64, SCORE_EPS);
        let mut worst: f64 = 0.0;
        for bh in 0..8usize {
            for j in c..256 {
                let n = bh * 256 + j as usize;
                let i = j % c;
                let row = &logits[n * 256..(n + 1) * 256];
                let lo = j - c + 1;
                let mx = (lo..=j).map(|l| row[l as usize]).fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = (lo..=j).map(|l| (row[l as usize] - mx).exp()).sum();
                let xpos = (j / c) * c - 1;
                let a_x = if xpos >= lo { (row[xpos as usize] - mx).exp() / z } else { 0.0 };
                let pp = p[n];
                let want = if i == c - 1 {
                    pp * (cf * pp).ln() + (1.0 - pp) * ((1.0 - pp).ln() + (1.0 + 1.0 / cf).ln())
                } else {
                    pp * (pp / (eps * (2.0 * cf + 1.0) / (cf + 1.0))).ln()
                        + a_x * (cf * a_x).ln()
                        + (1.0 - pp - a_x) * ((1.0 - pp).ln() + (1.0 + 1.0 / cf).ln())
                };
                worst = worst.max((code[n] - want).abs());
            }
        }
        assert!(worst < 1e-4, "closed forms off by {worst}");
    }

    /// still.md §12.6: the gate multiplies only the linear numerator: y(g) = y(0) + g ⊙ (y(1) − y(0)).
    #[test]
    fn gate_scales_only_the_linear_numerator() {
        let (_, st) = layer(&cfg("{chunk: 8, tokens_per_chunk: 2}"), 2, 8, 4);
        let x = inputs(2, 2, 40, 8, 4);
        let g = st.gate(&x[3]).unwrap();
        let y = |g: Option<&Tensor>| tch::no_grad(|| st.forward(&x[0], &x[1], &x[2], g));
        let (y_g, y_1, y_0) = (y(Some(&g)), y(None), y(Some(&g.zeros_like())));
        assert!(max_diff(&y_g, &(&y_0 + &g * (&y_1 - &y_0))) < 1e-12);
        assert!(max_diff(&y_g, &y_1) > 1e-3, "the gate does something");
        // `gate: false` is g ≡ 1, the dense reference without a gate.
        let (_, off) = layer(&cfg("{chunk: 8, tokens_per_chunk: 2, gate: false}"), 2, 8, 4);
        assert!(off.gate(&x[3]).is_none());
        let y_off = tch::no_grad(|| off.forward(&x[0], &x[1], &x[2], None));
        assert!(max_diff(&y_off, &tch::no_grad(|| off.reference(&x[0], &x[1], &x[2], None))) < 1e-10);
    }

    /// still.md §12.7: with L ≤ 2C, or κ = C, the output is the teacher's causal softmax; with the
    /// phantom chunk-0 keys it is not.
    #[test]
    fn exact_softmax_limits() {
        let teacher = |x: &[Tensor]| causal(&x[0], &x[1], &x[2], AttentionImpl::Reference);
        for (y, t) in [
            ("{chunk: 8, tokens_per_chunk: 2}", 16i64),
            ("{chunk: 8, tokens_per_chunk: 2}", 11),
            ("{chunk: 64}", 60),
            ("{chunk: 8, tokens_per_chunk: 8}", 50),
            ("{chunk: 8, budget: {m: 1000, max_len: 50}}", 50),
        ] {
            let (_, st) = layer(&cfg(y), 2, 8, 7);
            let x = inputs(2, 2, t, 8, 7);
            let g = st.gate(&x[3]);
            let out = tch::no_grad(|| st.forward(&x[0], &x[1], &x[2], g.as_ref()));
            let want = tch::no_grad(|| teacher(&x));
            // Only the 1e-6 of the denominator separates them.
            assert!(max_diff(&out, &want) < 1e-5, "{y} T={t}: {}", max_diff(&out, &want));
        }
        let (_, st) = layer(&cfg("{chunk: 8, compat: {phantom_chunk0_keys: true}}"), 2, 8, 7);
        let x = inputs(2, 2, 16, 8, 7);
        let out = tch::no_grad(|| st.forward(&x[0], &x[1], &x[2], None));
        assert!(max_diff(&out, &tch::no_grad(|| teacher(&x))) > 1e-3);
        // And past 2C without selecting everything, it is not softmax either.
        let (_, st) = layer(&cfg("{chunk: 8, tokens_per_chunk: 2}"), 2, 8, 7);
        let x = inputs(2, 2, 40, 8, 7);
        assert!(max_diff(&tch::no_grad(|| st.forward(&x[0], &x[1], &x[2], None)), &tch::no_grad(|| teacher(&x))) > 1e-3);
    }

    /// §12.8: heads of one GQA group (same k, v after expansion) may select different tokens.
    #[test]
    fn heads_of_a_gqa_group_select_independently() {
        let (_, st) = layer(&cfg("{chunk: 8, tokens_per_chunk: 2}"), 2, 8, 1);
        let x = inputs(1, 1, 40, 8, 9);
        let k = x[1].repeat([1, 2, 1, 1]);
        let q = Tensor::cat(&[x[0].shallow_clone(), x[0].flip([2])], 1);
        let sel = st.selected(&q, &k);
        assert_ne!(to_bools(&sel.select(1, 0)), to_bools(&sel.select(1, 1)));
    }

    /// `uniform` picks ⌊r·C/κ⌋; `random` is keyed by (seed, layer, head, chunk).
    #[test]
    fn uniform_and_random_routing() {
        let x = inputs(1, 2, 40, 8, 2);
        let (_, st) = layer(&cfg("{chunk: 8, tokens_per_chunk: 3, routing: uniform}"), 2, 8, 0);
        let sel = to_bools(&st.selected(&x[0], &x[1]));
        let want: Vec<bool> = (0..2).flat_map(|_| (0..40).map(|j| j < 24 && [0, 2, 5].contains(&(j % 8)))).collect();
        assert_eq!(sel, want);
        let pick = |seed: u64| {
            let (_, st) = layer(&cfg(&format!("{{chunk: 8, tokens_per_chunk: 3, routing: random, seed: {seed}}}")), 2, 8, 0);
            to_bools(&st.selected(&x[0], &x[1]))
        };
        assert_eq!(pick(1), pick(1));
        assert_ne!(pick(1), pick(2));
        let p = pick(1);
        assert_ne!(&p[0..40], &p[40..80], "heads differ");
        assert_ne!(&p[0..8], &p[8..16], "chunks differ");
    }

    /// fp32 inputs: the math runs in fp32 and stays within 1e-4 of the fp64 reference; bf16 runs and
    /// returns bf16.
    #[test]
    fn low_precision_inputs() {
        let (_, st) = layer(&cfg("{chunk: 8, tokens_per_chunk: 2, routing: key_norm}"), 2, 8, 3);
        let x = inputs(2, 2, 40, 8, 3);
        let g = st.gate(&x[3]).unwrap().detach();
        let want = tch::no_grad(|| st.reference(&x[0], &x[1], &x[2], Some(&g)));
        for kind in [Kind::Float, Kind::BFloat16] {
            let c = |t: &Tensor| t.detach().to_kind(kind);
            let out = tch::no_grad(|| st.forward(&c(&x[0]), &c(&x[1]), &c(&x[2]), Some(&c(&g))));
            assert_eq!(out.kind(), kind);
            let rel = ((out.to_kind(Kind::Double) - &want).abs().max() / want.abs().max()).double_value(&[]);
            assert!(rel < if kind == Kind::Float { 1e-4 } else { 5e-2 }, "{kind:?}: {rel}");
            let (_, cache) = tch::no_grad(|| st.prefill(&c(&x[0]), &c(&x[1]), &c(&x[2]), Some(&c(&g))));
            assert_eq!((cache.win_k.kind(), cache.s.kind()), (kind, Kind::Float), "K/V in the model dtype, S in fp32");
        }
    }

    // --- The retrieval question (issue 18 item 6): oracle routing, the linear switch, the normalizer ---

    /// `routing: oracle` selects exactly the listed positions of the routed chunks, in the chunked path,
    /// the reference and the decode cache; with nothing listed, nothing is selected.
    #[test]
    fn oracle_selects_exactly_the_listed_tokens() {
        let (_, st) = layer(&cfg("{chunk: 8, routing: oracle}"), 2, 8, 2);
        let x: Vec<Tensor> = inputs(2, 2, 50, 8, 2).iter().map(|t| t.detach()).collect();
        assert!(!to_bools(&st.selected(&x[0], &x[1])).contains(&true), "no positions set");
        st.set_oracle(Some(vec![49, 0, 3, 9, 10, 11, 17, 25, 40]));
        // The last query (chunk 6) reads Sel from chunks ≤ 4: positions < 40.
        let want: Vec<i64> = vec![0, 3, 9, 10, 11, 17, 25];
        let sel = to_bools(&st.selected(&x[0], &x[1]));
        for bh in 0..4 {
            let got: Vec<i64> = (0..50).filter(|&j| sel[bh * 50 + j as usize]).collect();
            assert_eq!(got, want, "row {bh}");
        }
        let logits = (x[0].matmul(&x[1].transpose(-2, -1)) / 8f64.sqrt()).detach();
        assert_eq!(st.reference_selection(&logits, &x[1]), sel, "reference selection");
        let mut cache = st.new_cache(2, Kind::Double, Device::Cpu);
        let _ = decode(&st, &mut cache, &x, 0, 50);
        assert_eq!(cache.sel_k.size()[2], want.len() as i64, "decode cache holds the listed tokens");
        let picked = x[1].index_select(2, &Tensor::from_slice(&want));
        assert!(max_diff(&cache.sel_k, &picked) < 1e-12, "and exactly their keys");
    }

    /// With the linear branch off and every token selected (κ = C, or the oracle listing everything),
    /// the hybrid is the teacher; with the linear branch off and κ < C it is softmax over Sel ∪ Win
    /// exactly (an explicit masked softmax from the selected set).
    #[test]
    fn linear_branch_off() {
        let teacher = |x: &[Tensor]| causal(&x[0], &x[1], &x[2], AttentionImpl::Reference);
        let x: Vec<Tensor> = inputs(2, 2, 50, 8, 9).iter().map(|t| t.detach()).collect();
        for y in ["{chunk: 8, tokens_per_chunk: 8, linear_branch: false}", "{chunk: 8, routing: oracle, linear_branch: false}"] {
            let (_, st) = layer(&cfg(y), 2, 8, 9);
            st.set_oracle(Some((0..50).collect()));
            let g = st.gate(&x[3]);
            let out = tch::no_grad(|| st.forward(&x[0], &x[1], &x[2], g.as_ref()));
            assert!(max_diff(&out, &teacher(&x)) < 1e-5, "{y}: {}", max_diff(&out, &teacher(&x)));
        }
        let (_, st) = layer(&cfg("{chunk: 8, tokens_per_chunk: 2, linear_branch: false}"), 2, 8, 9);
        let g = st.gate(&x[3]);
        let out = tch::no_grad(|| st.forward(&x[0], &x[1], &x[2], g.as_ref()));
        // Visible to query t: its window (chunks c−1, c, causal) and the selected tokens of chunks ≤ c−2.
        let sel = st.selected(&x[0], &x[1]); // [B, H, T]; a token's selection never changes once routed
        let t = Tensor::arange(50, (Kind::Int64, Device::Cpu));
        let (qc, kc) = (t.divide_scalar_mode(8, "floor").view([50, 1]), t.divide_scalar_mode(8, "floor").view([1, 50]));
        let causal_ok = t.view([1, 50]).le_tensor(&t.view([50, 1]));
        let win = (&kc + 1).ge_tensor(&qc).logical_and(&causal_ok);
        let routed = (&kc + 2).le_tensor(&qc);
        let mask = win.view([1, 1, 50, 50]).logical_or(&routed.view([1, 1, 50, 50]).logical_and(&sel.unsqueeze(2)));
        let want = crate::attention::masked_softmax_attention(&x[0], &[(&x[1], &x[2], &mask)]);
        assert!(max_diff(&out, &want) < 1e-5, "softmax over Sel ∪ Win: {}", max_diff(&out, &want));
        assert!(max_diff(&out, &teacher(&x)) > 1e-3, "and not the teacher");
    }

    /// A planted (key, value) pair in an early chunk, matched strongly by the last query (logit 12
    /// against N(0, 1) elsewhere), at T = 1024, C = 64, D = 64, with the layer's initial feature maps.
    /// Selected by the oracle, it carries its value with the linear branch off and with the
    /// max-compensated normalizer; with the reference normalizer the linear terms take most of the
    /// denominator: the output still points at the value (the linear numerator of random values
    /// nearly cancels) but its size shrinks to the Sel share, and a pair in the window shrinks alike.
    /// `probe` measures the same shares as the output shows.
    #[test]
    fn planted_pair_when_selected() {
        let (t, d, p) = (1024i64, 64i64, 300i64);
        let x: Vec<Tensor> = inputs(1, 2, t, d, 21).iter().map(|t| t.detach()).collect();
        let (q, k, v) = (x[0].shallow_clone(), x[1].copy(), x[2].copy());
        let q_last = q.narrow(2, t - 1, 1);
        let norm2 = q_last.square().sum_dim_intlist(-1, true, Kind::Double);
        k.narrow(2, p, 1).copy_(&(&q_last * (12.0 * (d as f64).sqrt()) / norm2)); // logit q·k/√D = 12
        let value = Tensor::randn([1, 2, 1, d], (Kind::Double, Device::Cpu)) * 3.0;
        v.narrow(2, p, 1).copy_(&value);
        // |y_last| / |value|, the smaller over the heads.
        let gain = |y: &Tensor| (y.narrow(2, t - 1, 1).norm_scalaropt_dim(2, [-1], false) / value.norm_scalaropt_dim(2, [-1], false)).min().double_value(&[]);
        let cosine = |y: &Tensor| {
            let y = y.narrow(2, t - 1, 1);
            ((&y * &value).sum_dim_intlist(-1, false, Kind::Double) / (y.norm_scalaropt_dim(2, [-1], false) * value.norm_scalaropt_dim(2, [-1], false))).min().double_value(&[])
        };
        let teacher = causal(&q, &k, &v, AttentionImpl::Reference);
        assert!(cosine(&teacher) > 0.99, "the teacher retrieves: {}", cosine(&teacher));
        let mut measured = vec![];
        for y in ["{routing: oracle, linear_branch: false}", "{routing: oracle, normalizer: max_compensated}", "{routing: oracle}", "{routing: none}"] {
            let (_, st) = layer(&cfg(y), 2, d, 22);
            st.set_oracle(Some(vec![p]));
            let g = st.gate(&x[3]);
            let out = tch::no_grad(|| st.forward(&q, &k, &v, g.as_ref()));
            let probe = st.probe(&q, &k);
            let sh: Vec<f64> = Vec::try_from(probe.shares.select(0, 0).select(0, 0)).unwrap();
            // Only the planted value, everything else zero: the output is share(Sel) · value.
            let only = v.zeros_like();
            only.narrow(2, p, 1).copy_(&value);
            let y_only = tch::no_grad(|| st.forward(&q, &k, &only, None)).narrow(2, t - 1, 1);
            // Per head: the planted value's coefficient in the output against the probe's Sel share.
            let coef: Vec<f64> = Vec::try_from((&y_only * &value).sum_dim_intlist(-1, false, Kind::Double).flatten(0, -1) / (&value * &value).sum_dim_intlist(-1, false, Kind::Double).flatten(0, -1)).unwrap();
            let head_shares: Vec<f64> = Vec::try_from(probe.shares.select(-1, 1).flatten(0, -1)).unwrap();
            let sel_share = head_shares.iter().sum::<f64>() / 2.0;
            if y.contains("oracle") {
                for (c, s) in coef.iter().zip(&head_shares) {
                    assert!((c - s).abs() < 1e-9, "{y}: probe share {s} vs output coefficient {c}");
                }
            }
            eprintln!("{y:48} cos(y, v) {:.3}  |y|/|v| {:.3}  shares of head 0: window {:.4} selected {:.4} linear {:.4}", cosine(&out), gain(&out), sh[0], sh[1], sh[2]);
            measured.push((cosine(&out), sel_share, gain(&out)));
        }
        // The same pair planted inside the window (50 tokens back) meets the same denominator: the
        // reference normalizer dilutes window and selected tokens alike.
        let (_, st) = layer(&cfg("{routing: oracle}"), 2, d, 22);
        let (kw, vw) = (x[1].copy(), x[2].copy());
        kw.narrow(2, t - 50, 1).copy_(&k.narrow(2, p, 1));
        vw.narrow(2, t - 50, 1).copy_(&value);
        let win_share: f64 = Vec::<f64>::try_from(st.probe(&q, &kw).shares.select(-1, 0).flatten(0, -1)).unwrap().iter().sum::<f64>() / 2.0;
        let y_win = tch::no_grad(|| st.forward(&q, &kw, &vw, st.gate(&x[3]).as_ref()));
        eprintln!("{:48} cos(y, v) {:.3}  |y|/|v| {:.3}  window share (mean of heads) {win_share:.4}", "{routing: oracle}, pair in the window", cosine(&y_win), gain(&y_win));
        assert!((win_share - measured[2].1).abs() < 0.05 * measured[2].1.max(1e-3), "window {win_share} vs selected {}", measured[2].1);
        assert!(measured[0].0 > 0.99 && measured[0].1 > 0.99, "linear off: {:?}", measured[0]);
        assert!(measured[1].0 > 0.99 && measured[1].1 > 0.99, "compensated: {:?}", measured[1]);
        assert!(measured[0].2 > 0.95 && measured[1].2 > 0.95, "full size: {measured:?}");
        assert!(measured[2].1 < 0.5 && measured[2].2 < 0.25, "reference normalizer: the linear terms outweigh the planted key, the value shrinks: {:?}", measured[2]);
        assert!(measured[3].1 == 0.0 && measured[3].0 < 0.5, "not selected, not retrieved: {:?}", measured[3]);
    }

    /// Selection recall on a planted case: tokens whose own query matches their own key strongly
    /// (a_jj ≈ 1) are what self-saliency selects; the probe of the last query reports them selected.
    #[test]
    fn selection_recall_on_planted_tokens() {
        let (t, d) = (512i64, 16i64);
        let x: Vec<Tensor> = inputs(1, 2, t, d, 31).iter().map(|t| t.detach()).collect();
        let k = x[1].copy();
        let planted = [70i64, 133, 200, 260, 300, 310];
        for &j in &planted {
            let qj = x[0].narrow(2, j, 1);
            let n2 = qj.square().sum_dim_intlist(-1, true, Kind::Double);
            k.narrow(2, j, 1).copy_(&(&qj * (10.0 * (d as f64).sqrt()) / n2));
        }
        let recall = |y: &str| {
            let (_, st) = layer(&cfg(y), 2, d, 32);
            let sel = to_bools(&st.probe(&x[0], &k).selected);
            planted.iter().map(|&j| (sel[j as usize] as u8 + sel[(t + j) as usize] as u8) as f64 / 2.0).sum::<f64>() / planted.len() as f64
        };
        assert_eq!(recall("{routing: self_saliency}"), 1.0);
        assert_eq!(recall("{routing: diag_attn}"), 1.0);
        assert_eq!(recall("{routing: none}"), 0.0);
        assert!(recall("{routing: random}") < 0.5);
    }
}
