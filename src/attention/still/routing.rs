//! Routing (§4, §5): the per-token score, computed once from the token's own query over the C most
//! recent keys, one routine for prefill and decode (C3), and the top-κ of each chunk leaving Win.
use super::{dims4, dims5, pad_to, two_chunks, Hybrid, Routing, Still, SCORE_EPS};
use tch::{Kind, Tensor};

impl Still {
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
pub(super) fn uniform_score(i: i64, c: i64, kappa: i64) -> f64 {
    ((0..kappa).any(|r| r * c / kappa.max(1) == i)) as u8 as f64
}

/// Routing of the complete chunks of a prefill.
pub(super) struct Routed {
    /// `[B, H, n_sel]` absolute positions of the selected tokens, ascending within each chunk. Slot i
    /// holds a token of the same chunk in every (sequence, head): κ per chunk, or the oracle's list.
    pub(super) pos: Tensor,
    /// The chunk of each slot (ascending), known on the host.
    pub(super) chunk_of: Vec<i64>,
}

impl Hybrid<'_> {
    /// Logits of every query against chunks c−1 and c: `[B, H, n, C, 2C]` (zero keys before chunk 0).
    pub(super) fn window_logits(&self, qf: &Tensor, kf: &Tensor) -> Tensor {
        window_logits(self.chunk, qf, kf)
    }

    /// Per-token scores `[B, H, Tp]` from the window logits: each token's own window of the C most
    /// recent keys is cut out of its two-chunk row (column w ↔ position j−C+1+w, self last).
    pub(super) fn scores(&self, s_win: &Tensor, kf: &Tensor) -> Tensor {
        let Some(scorer) = self.scorer else { return Tensor::zeros([kf.size()[0], kf.size()[1], kf.size()[2]], (kf.kind(), kf.device())) };
        window_scores(&scorer, s_win, kf)
    }

    /// Top-κ per routed chunk (chunks that leave Win before the last token).
    pub(super) fn route(&self, scores: &Tensor) -> Option<Routed> {
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
            return Some(Routed { pos, chunk_of: listed.iter().map(|p| p / c).collect() });
        }
        let idx = top_kappa(&scores.narrow(2, 0, r * c).view([b, h, r, c]), kappa); // [B, H, R, κ]
        let pos = (idx + Tensor::arange(r, (Kind::Int64, scores.device())).view([r, 1]) * c).view([b, h, r * kappa]);
        Some(Routed { pos, chunk_of: (0..r * kappa).map(|i| i / kappa).collect() })
    }
}

/// Logits of every query against chunks c−1 and c: `[B, H, n, C, 2C]` (zero keys before chunk 0), for
/// q, k padded to a multiple of C.
fn window_logits(c: i64, qf: &Tensor, kf: &Tensor) -> Tensor {
    let (b, h, tp, d) = dims4(qf);
    let n = tp / c;
    // 1/√D on the queries (T·D numbers), not on the logits (T·2C).
    let qc = (qf * (1.0 / (d as f64).sqrt())).reshape([b, h, n, c, d]);
    let kw = two_chunks(&kf.reshape([b, h, n, c, d]));
    qc.matmul(&kw.transpose(-2, -1))
}

/// Per-token scores `[B, H, Tp]` from the window logits `[B, H, n, C, 2C]`: each token's own window of
/// the C most recent keys is cut out of its two-chunk row (column w ↔ position j−C+1+w, self last).
fn window_scores(scorer: &Scorer, s_win: &Tensor, kf: &Tensor) -> Tensor {
    let (b, h, n, c, _) = dims5(s_win);
    let dev = s_win.device();
    let i = Tensor::arange(c, (Kind::Int64, dev)).view([c, 1]);
    let w = Tensor::arange(c, (Kind::Int64, dev)).view([1, c]);
    let col = &i + 1 + &w; // [C, C] column of the two-chunk row
    let s_w = s_win.gather(-1, &col.expand([b, h, n, c, c], false), false).reshape([b, h, n * c, c]);
    let first = Tensor::arange(n, (Kind::Int64, dev)).eq(0).view([n, 1, 1]);
    let valid = first.logical_and(&col.lt(c)).logical_not().reshape([n * c, c]);
    scorer.scores(&s_w, &valid, kf, &Tensor::from(0i64).to_device(dev))
}

/// Routing scores `[B, H, T]` (in q's kind, fp32 at least) that a STILL layer with options `cfg` at
/// layer index `layer` gives the tokens of q `[B, H, T, D]` and k `[B, H, T, D]` (k expanded to q's
/// heads): the same routine as [`Still::scores`], without a layer's parameters, so that a teacher's
/// own q and k can be scored (`attnlab saliency-words`). `routing: oracle` / `none` have no scores.
pub fn routing_scores(cfg: &super::StillConfig, layer: i64, q: &Tensor, k: &Tensor) -> crate::Result<Tensor> {
    if matches!(cfg.routing, Routing::Oracle | Routing::None) {
        return Err(crate::Error::Other(format!("routing {:?} selects by a list or not at all: it has no per-token scores", cfg.routing)));
    }
    let selection = cfg.selection()?;
    let scorer = Scorer { routing: cfg.routing, kappa: selection.kappa, seed: cfg.seed, layer };
    let c = cfg.chunk;
    let kind = if q.kind() == Kind::Double { Kind::Double } else { Kind::Float };
    let (qf, kf) = (pad_to(&q.to_kind(kind), c), pad_to(&k.to_kind(kind), c));
    Ok(tch::no_grad(|| window_scores(&scorer, &window_logits(c, &qf, &kf), &kf)).narrow(2, 0, q.size()[2]))
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
    /// Scores `[B, H, T']` of tokens at positions pos0.. (`pos0`: one i64 on s_w's device) from their
    /// window logits s_w `[B, H, T', C]` (column w = position j−C+1+w, self last), `valid` `[T', C]`
    /// (position ≥ 0) and own keys `[B, H, T', D]`. Only random and uniform routing read pos0 on the
    /// host ([`Scorer::by_position`]), so the others can run inside a CUDA graph.
    pub(super) fn scores(&self, s_w: &Tensor, valid: &Tensor, k_self: &Tensor, pos0: &Tensor) -> Tensor {
        let (b, h, tn, c) = dims4(s_w);
        let (kind, dev) = (s_w.kind(), s_w.device());
        let inf = f64::INFINITY;
        if self.by_position() {
            return self.position_scores(b, h, c, pos0.int64_value(&[]), tn, kind, dev).expect("a score by position");
        }
        let a = s_w.masked_fill(&valid.logical_not(), -inf).softmax(-1, kind);
        match self.routing {
            Routing::DiagAttention => a.select(-1, c - 1),
            Routing::SelfLogit => s_w.select(-1, c - 1),
            Routing::KeyNorm => k_self.norm_scalaropt_dim(2, -1, false),
            Routing::Random | Routing::Uniform => unreachable!("scored by position above"),
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
                    let i = (Tensor::arange(tn, (Kind::Int64, dev)) + pos0.reshape([1])).remainder(c).view([tn, 1]);
                    let over = Tensor::arange(c, (Kind::Int64, dev)).view([1, c]).eq_tensor(&(-i + (c - 2)).remainder(c));
                    let big_a = (&a + SCORE_EPS) / (1.0 + cf * SCORE_EPS);
                    let big_b = ((bb + SCORE_EPS) / (1.0 + cf * SCORE_EPS + 1.0 / cf)).masked_fill(&over, 1.0 / cf + SCORE_EPS);
                    let sc = (&big_a * (&big_a / (big_b + SCORE_EPS)).log()).sum_dim_intlist(-1, false, kind);
                    sc.masked_fill(&sc.isnan(), inf) // token 0 (C7 compat: NaN ranks first)
                }
            }
        }
    }

    /// The score the decode step's mixing kernel computes itself (csrc/cuda/hybrid_step.cuh), where it
    /// does: self-saliency (the paper's form), a_tt and the own logit.
    pub(super) fn kernel_score(&self) -> Option<crate::kernels::cuda::KernelScore> {
        use crate::kernels::cuda::KernelScore;
        match self.routing {
            Routing::SelfSaliency => Some(KernelScore::SelfSaliency),
            Routing::DiagAttention => Some(KernelScore::DiagAttention),
            Routing::SelfLogit => Some(KernelScore::SelfLogit),
            _ => None,
        }
    }

    /// Whether the score is a function of the position alone (random, uniform routing): computed on
    /// the host, so a device-side decode step leaves it to the chunk's routing.
    pub(super) fn by_position(&self) -> bool {
        matches!(self.routing, Routing::Random | Routing::Uniform)
    }

    /// The scores `[B, H, n]` of positions pos0..pos0 + n in chunks of `c` where they depend on the
    /// position alone (None for the other routings).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn position_scores(&self, b: i64, h: i64, c: i64, pos0: i64, n: i64, kind: Kind, dev: tch::Device) -> Option<Tensor> {
        let f: Box<dyn Fn(i64, i64) -> f64> = match self.routing {
            Routing::Random => Box::new(move |hh, j| random_score(self.seed, self.layer, hh, j / c, j % c)),
            Routing::Uniform => Box::new(move |_, j| uniform_score(j % c, c, self.kappa)),
            _ => return None,
        };
        let vals: Vec<f64> = (0..h).flat_map(|hh| (pos0..pos0 + n).map(move |j| (hh, j))).map(|(hh, j)| f(hh, j)).collect();
        Some(Tensor::from_slice(&vals).view([1, h, n]).to_kind(kind).to_device(dev).expand([b, h, n], false))
    }
}

/// Indices `[…, κ]` of the κ largest scores along the last dim, ties to the lower index, sorted ascending
/// (on CUDA by one kernel with `ATTNLAB_TOPK_KERNEL=1`, `kernels::cuda::top_kappa`).
pub fn top_kappa(scores: &Tensor, kappa: i64) -> Tensor {
    if let Some(idx) = crate::kernels::cuda::top_kappa(scores, kappa) {
        return idx.unwrap_or_else(|e| panic!("STILL routing: the top-κ kernel failed: {e}"));
    }
    let (_, order) = scores.sort_stable(true, -1, true);
    order.narrow(-1, 0, kappa).sort(-1, false).0
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::StillConfig;
    use super::*;
    use tch::Device;

    /// S(p) = p·ln((p+ε)/ε) + (1−p)·ln(1−p), with (1−p)·ln(1−p) = 0 at p = 1.
    fn s_of_p(p: f64) -> f64 {
        let tail = if p < 1.0 { (1.0 - p) * (1.0 - p).ln() } else { 0.0 };
        p * ((p + SCORE_EPS) / SCORE_EPS).ln() + tail
    }

    /// still.md §5.1 / §12.5: self-saliency is a function of the windowed diagonal attention a_jj:
    /// 0 ≤ Score − S(a_jj) ≤ (|W|−1)·ε·a_jj, so both metrics pick the same tokens.
    #[test]
    fn self_saliency_is_a_function_of_diagonal_attention() {
        let _rng = crate::testutil::rng();
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
        let _rng = crate::testutil::rng();
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

    /// `routing_scores` (no layer, for a teacher's q and k) is the layer's own `scores`, for every
    /// routing with scores.
    #[test]
    fn routing_scores_without_a_layer_match_the_layer() {
        let _rng = crate::testutil::rng();
        let x = inputs(1, 2, 150, 8, 5);
        for r in ["self_saliency", "self_saliency_reference_code", "diag_attn", "key_norm", "random", "uniform"] {
            let c = cfg(&format!("{{chunk: 16, routing: {r}, seed: 3}}"));
            let (_, st) = layer(&c, 2, 8, 1);
            let want = st.scores(&x[0], &x[1]);
            let got = routing_scores(&c, 3, &x[0], &x[1]).unwrap(); // testkit layers are layer 3
            assert!(max_diff(&want, &got) == 0.0, "{r}");
        }
        assert!(routing_scores(&cfg("{routing: oracle}"), 0, &x[0], &x[1]).is_err());
    }

    /// §12.8: heads of one GQA group (same k, v after expansion) may select different tokens.
    #[test]
    fn heads_of_a_gqa_group_select_independently() {
        let _rng = crate::testutil::rng();
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
        let _rng = crate::testutil::rng();
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

    // --- The retrieval question (issue 18 item 6): oracle routing, the linear switch, the normalizer ---

    /// `routing: oracle` selects exactly the listed positions of the routed chunks, in the chunked path,
    /// the reference and the decode cache; with nothing listed, nothing is selected.
    #[test]
    fn oracle_selects_exactly_the_listed_tokens() {
        let _rng = crate::testutil::rng();
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

    /// Selection recall on a planted case: tokens whose own query matches their own key strongly
    /// (a_jj ≈ 1) are what self-saliency selects; the probe of the last query reports them selected.
    #[test]
    fn selection_recall_on_planted_tokens() {
        let _rng = crate::testutil::rng();
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
