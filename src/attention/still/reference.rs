//! The explicit reference the chunked path is tested against: scores by scalar loops straight from
//! §4/§5, Sel/Win/Lin sets built per (query, key), dense `[T, T]` weights.
use super::routing::{random_score, uniform_score};
use super::{compute_kind, dims4, Normalizer, Routing, Still, OUT_EPS, SCORE_EPS};
use tch::{Kind, Tensor};

impl Still {
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

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::StillConfig;
    use super::*;
    use tch::Device;

    /// still.md §12.1: the chunked path equals the per-token reference (outputs, selected tokens) for
    /// every routing metric and the lengths around chunk boundaries, C = 64, κ = 4.
    #[test]
    fn fast_matches_reference_every_routing() {
        let _rng = crate::testutil::rng();
        for routing in ALL_ROUTINGS {
            let c = StillConfig { routing, ..StillConfig::default() };
            let (_, st) = layer(&c, 4, 16, 1);
            // T 2100 = 33 chunks: Sel's logits in two groups of query chunks.
            for t in [1i64, 63, 64, 65, 127, 128, 129, 200, 1024, 2100] {
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

    /// Gradients w.r.t. q, k, v, the gate input and every parameter agree (C = 8, κ = 2, many chunks,
    /// enough for the grouped Sel logits), also with a budget cap, the Hedgehog map, no gate and the
    /// phantom chunk-0 keys.
    #[test]
    fn fast_matches_reference_gradients() {
        let _rng = crate::testutil::rng();
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
            // T 264 = 33 chunks: the prefill computes Sel's logits in two groups of query chunks.
            for t in [5i64, 8, 13, 17, 40, 264] {
                let x = inputs(2, 3, t, 8, 100 + t);
                let go = Tensor::randn([2, 3, t, 8], (Kind::Double, Device::Cpu));
                let mut wrt: Vec<Tensor> = x.iter().map(|t| t.shallow_clone()).collect();
                wrt.extend(vs.trainable_variables());
                let run = |reference: bool| {
                    let g = st.gate(&x[3]);
                    let out = if reference { st.reference(&x[0], &x[1], &x[2], g.as_ref()) } else { st.forward(&x[0], &x[1], &x[2], g.as_ref()) };
                    (out.detach(), crate::attention::tests::grads_of(&out, &go, &wrt))
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
}
