//! STILL's options (the YAML `attention:` keys of `kind: still`) and κ per routed chunk (§4, §9).
use crate::attention::feature_maps::{FeatureMapKind, ParamInit};
use crate::error::{Error, Result};
use serde::{Deserialize, Serialize};

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

#[cfg(test)]
mod tests {
    use super::super::testkit::cfg;
    use super::*;

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
}
