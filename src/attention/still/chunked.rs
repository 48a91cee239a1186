//! The shared hybrid operator (STILL, and LoLCATs with κ = 0 and γ): its vectorised prefill /
//! training path over chunks (§3), the softmax part masked blocks per group of chunks (the window's
//! 2C keys, and the selected tokens the group's chunks see), the linear part prefix sums of
//! per-chunk states. On CUDA the routing scores and the softmax part with its merge can run as
//! kernels instead (csrc/cuda/hybrid_prefill.cu, on by default, `ATTNLAB_HYBRID_PREFILL=0` turns them
//! off), and the linear part (csrc/cuda/hybrid_linear.cuh, on as well, `ATTNLAB_HYBRID_LINEAR=0` turns it
//! off); inference only for all but the scores.
use super::{dims4, dims5, pad_to, two_chunks, HybridCache, Routed, Scorer, Selection};
use crate::attention::feature_maps::FeatureMap;
use crate::kernels::cuda;
use tch::{Kind, Tensor};

/// A prefill kernel's output; its failure (a CUDA error past the checks [`cuda::hybrid_prefill_enabled`]
/// made) is fatal, as any other kernel's in a forward pass.
fn kernel_output(out: Option<crate::Result<Tensor>>, which: &str) -> Tensor {
    match out {
        Some(Ok(y)) => y,
        Some(Err(e)) => panic!("{which}: {e}"),
        None => panic!("{which}: the CUDA kernel library lost the prefill kernels"),
    }
}

/// How many selected slots each of `n` query chunks sees: those of chunks ≤ qc − 2, a prefix of the
/// slots, whose chunks (`chunk_of`) ascend.
fn visible_slots(chunk_of: &[i64], n: i64) -> Vec<i32> {
    (0..n).map(|qc| chunk_of.partition_point(|&kc| kc + 2 <= qc) as i32).collect()
}

/// The prefill computes Sel's logits for groups of query chunks, each group against the selected
/// slots its last chunk sees (about half of them on average): at most this many groups, ...
const SEL_GROUPS: i64 = 8;
/// ... of at least this many chunks each (fewer, larger blocks where the sequence is short).
const SEL_GROUP_CHUNKS: i64 = 16;

/// One softmax's unnormalised sums over key blocks (logits masked with −∞, each with its values),
/// without copying the blocks into one: Σ e^{s−m}·v, Σ e^{s−m} and the max m over all of them (the
/// linear terms meet the softmax at this m, §3). A block's values have the logits' shape but for the
/// last two dims (`[.., keys, D]`), or, one dim fewer, are shared by every chunk of a
/// `[B, H, n, C, keys]` block (`[B, H, keys, D]`: the selected tokens).
fn softmax_sums(logits: &[Tensor], values: &[Tensor], kind: Kind) -> (Tensor, Tensor, Tensor) {
    let m = logits.iter().map(|x| x.amax(-1, true)).reduce(|x, y| x.maximum(&y)).expect("a key block");
    let e: Vec<Tensor> = logits.iter().map(|x| (x - &m).exp()).collect();
    let z = e.iter().map(|x| x.sum_dim_intlist(-1, true, kind)).reduce(|x, y| x + y).expect("a key block");
    let num = e.iter().zip(values).map(|(e, v)| by_chunk(e, v)).reduce(|x, y| x + y).expect("a key block");
    (num, z, m)
}

/// a `[B, H, n, C, K]` · b: per chunk against b `[B, H, n, K, N]`, or against one b `[B, H, K, N]` shared
/// by every chunk as one matmul of `[B, H, n·C, K]` (a broadcast b would be expanded into a copy per
/// chunk first). Any other shapes: a plain matmul.
fn by_chunk(a: &Tensor, b: &Tensor) -> Tensor {
    if a.dim() != 5 || b.dim() != 4 {
        return a.matmul(b);
    }
    let (bs, h, n, c, _) = dims5(a);
    a.reshape([bs, h, n * c, -1]).matmul(b).view([bs, h, n, c, -1])
}

/// The linear part's terms (§3): φ(q)·S `[B, H, n, C, D]` and φ(q)·z `[B, H, n, C, 1]` of each query's
/// chunk state (no gate, no compensation), and the state after the sequence (chunks ≤ n − 3) for the
/// decode cache.
struct LinearPart {
    n: Tensor,
    z: Tensor,
    s_last: Tensor,
    z_last: Tensor,
}

/// Everything the hybrid operator needs besides q, k, v and the gate: §3 for STILL, §7 for LoLCATs.
pub(crate) struct Hybrid<'a> {
    pub chunk: i64,
    pub fq: &'a FeatureMap,
    pub fk: &'a FeatureMap,
    pub selection: Selection,
    /// Routing scores; `None` = nothing is ever selected.
    pub scorer: Option<Scorer>,
    /// θ `[H]` (any shape of H numbers) of γ_h = σ(θ_h) multiplying both softmax sums (LoLCATs);
    /// `None`: γ = 1. Kept as θ so that an operator built for a decode step's preparation or replay
    /// runs no sigmoid it does not read (a kernel a layer and step: the decode cache holds γ).
    pub window_factors: Option<&'a Tensor>,
    /// Added to the denominator.
    pub eps: f64,
    pub phantom_chunk0_keys: bool,
    /// Decode only: a sliding window of `chunk` tokens, one token folded per step (LoLCATs' decode).
    pub sliding_decode: bool,
    /// `false`: no linear branch (numerator and denominator).
    pub linear: bool,
    /// Scale the linear terms by e^{−m_t} ([`Normalizer::MaxCompensated`](super::Normalizer::MaxCompensated)).
    pub compensate: bool,
    /// `routing: oracle`: the positions to select instead of the top-κ (ascending).
    pub oracle: Option<Vec<i64>>,
}

impl Hybrid<'_> {
    /// γ `[H]` (see `window_factors`).
    pub fn gamma(&self) -> Option<Tensor> {
        self.window_factors.map(|t| t.sigmoid().flatten(0, -1))
    }

    /// The chunked prefill/training path; with `want_cache`, also the decode state after the last token.
    pub fn prefill(&self, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>, want_cache: bool) -> (Tensor, Option<HybridCache>) {
        let (b, h, t, d) = dims4(q);
        let c = self.chunk;
        // q, k, v in the compute kind padded to whole chunks: for aten's parts only (the kernels read
        // the unpadded bf16 rows), so made where one of them runs.
        let padded = std::cell::OnceCell::new();
        let pads = || padded.get_or_init(|| (pad_to(q, c), pad_to(k, c), pad_to(v, c)));
        let (kind, dev) = (super::compute_kind(q), q.device());
        let n = (t + c - 1) / c;
        let chunks = |x: &Tensor| x.reshape([b, h, n, c, x.size()[3]]);
        // csrc/cuda/hybrid_prefill.cu where it applies: the routing scores always (they carry no
        // gradient), the linear part, the softmax part and the merge where no gradient is recorded (below).
        let kernels = cuda::hybrid_prefill_enabled(q, k, v, c);
        let kernel_score = self.scorer.as_ref().and_then(|s| s.kernel_score()).filter(|_| kernels);
        // The window logits `[B, H, n, C, 2C]` (with their gradient: the softmax part reads them
        // too), where aten computes the scores; the softmax part computes them otherwise.
        let s_win = (self.scorer.is_some() && kernel_score.is_none()).then(|| self.window_logits(&pads().0, &pads().1));
        let scores = tch::no_grad(|| match (&s_win, kernel_score) {
            (Some(s), _) => self.scores(&s.detach(), &pads().1.detach()),
            (None, Some(score)) => kernel_output(cuda::hybrid_prefill_scores(q, k, c, score), "hybrid_prefill_scores"),
            (None, None) => Tensor::zeros([b, h, n * c], (kind, dev)),
        });
        let routed = tch::no_grad(|| self.route(&scores));

        // The kernels have no backward: the linear branch and the mix by kernels only where nothing
        // records a gradient (inference; attention transfer's linear terms carry the feature maps').
        let inputs = [q, k, v].into_iter().chain(g).chain(self.window_factors).map(Tensor::shallow_clone);
        let recorded = crate::util::grad_enabled() && inputs.chain(self.fq.parameters()).chain(self.fk.parameters()).any(|x| x.requires_grad());
        let by_kernels = kernels && !recorded;
        let lin = match by_kernels.then(|| self.linear_by_kernel(q, k, v, routed.as_ref())).flatten() {
            Some(lin) => lin,
            None => {
                let (qf, kf, vf) = pads();
                self.linear_part(qf, kf, vf, routed.as_ref())
            }
        };
        // The gate on the linear numerator: in the mixing kernel where it reads it (bf16, unit last
        // stride: the model's projection, transposed), else as a product here.
        let gate_in_kernel = by_kernels && g.is_some_and(|g| g.kind() == Kind::BFloat16 && g.size() == q.size() && g.stride()[3] == 1);
        let n_lin = match g {
            Some(g) if !gate_in_kernel => &lin.n * chunks(&pad_to(g, c)),
            _ => lin.n.shallow_clone(),
        };

        let y = if by_kernels {
            let seen = routed.as_ref().map(|r| Tensor::from_slice(&visible_slots(&r.chunk_of, n)));
            let (n_flat, z_flat) = (n_lin.reshape([b, h, n * c, d]), lin.z.reshape([b, h, n * c]));
            let gamma = self.gamma();
            let mix = cuda::PrefillMix {
                sel: routed.as_ref().zip(seen.as_ref()).map(|(r, seen)| (&r.pos, seen)),
                linear: self.linear.then_some((&n_flat, &z_flat)),
                gate: g.filter(|_| gate_in_kernel),
                gamma: gamma.as_ref(),
                chunk: c,
                eps: self.eps,
                compensate: self.compensate,
                phantom_chunk0_keys: self.phantom_chunk0_keys,
            };
            kernel_output(cuda::hybrid_prefill_mix(q, k, v, &mix), "hybrid_prefill_mix")
        } else {
            let (qf, kf, vf) = pads();
            let s_win = s_win.unwrap_or_else(|| self.window_logits(qf, kf));
            let (n_sm, z_sm, m) = self.softmax_part(qf, kf, vf, &s_win, routed.as_ref());
            let (n_lin, z_lin) = self.linear_terms(n_lin, lin.z.shallow_clone(), &m);
            ((n_sm + n_lin) / (z_sm + z_lin + self.eps)).reshape([b, h, n * c, d]).narrow(2, 0, t).to_kind(q.kind())
        };
        if !want_cache {
            return (y, None);
        }

        // The state after token t−1 (§6): routed chunks ≤ c(t−1)−2 are exactly the R routed above.
        let cache = tch::no_grad(|| {
            let last = (t - 1) / c;
            let (w0, kvk) = ((last - 1).max(0) * c, k.kind());
            let mut cache = HybridCache::empty(b, h, d, self.fk.dim(), kvk, dev, self.chunk, self.selection);
            cache.pos = t;
            if self.sliding_decode {
                // LoLCATs' decode: the last `chunk` tokens in the window, everything before folded.
                let w0 = (t - c).max(0);
                let (_, kf, vf) = pads();
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
            cache.s = lin.s_last.detach();
            cache.z = lin.z_last.detach();
            cache
        });
        (y, Some(cache))
    }

    /// The linear part (§3) of padded q, k, v in the compute kind: per-chunk states of the tokens
    /// not selected, summed over chunks ≤ c−2, and every query's φ(q)·S, φ(q)·z (no gate).
    fn linear_part(&self, qf: &Tensor, kf: &Tensor, vf: &Tensor, routed: Option<&Routed>) -> LinearPart {
        let (b, h, tp, _) = dims4(qf);
        let (c, kind, dev) = (self.chunk, qf.kind(), qf.device());
        let n = tp / c;
        let chunks = |x: &Tensor| x.reshape([b, h, n, c, x.size()[3]]);
        let phi_k = chunks(&self.fk.forward(kf));
        let phi_k = match routed {
            // Lin = every token of chunks ≤ c−2 but the selected ones (capped chunks are all Lin).
            Some(r) => {
                let sel = Tensor::zeros([b, h, n * c], (kind, dev)).scatter_value(2, &r.pos, 1.0);
                phi_k * (-sel + 1.0).reshape([b, h, n, c, 1])
            }
            None => phi_k,
        };
        let ds = phi_k.transpose(-2, -1).matmul(&chunks(vf)); // [B, H, n, F, D]
        let dz = phi_k.sum_dim_intlist(3, false, kind); // [B, H, n, F]
        let s_state = ds.cumsum(2, kind).constant_pad_nd([0, 0, 0, 0, 2, 0]).narrow(2, 0, n);
        let z_state = dz.cumsum(2, kind).constant_pad_nd([0, 0, 2, 0]).narrow(2, 0, n);
        let phi_q = chunks(&self.fq.forward(qf));
        LinearPart {
            n: phi_q.matmul(&s_state),
            z: phi_q.matmul(&z_state.unsqueeze(-1)),
            s_last: s_state.select(2, n - 1),
            z_last: z_state.select(2, n - 1),
        }
    }

    /// [`Hybrid::linear_part`] by csrc/cuda/hybrid_linear.cuh from the unpadded bf16 q, k, v, where
    /// the kernels take the maps' width (F/2 a multiple of 4, at most 128) and are on
    /// (unless `ATTNLAB_HYBRID_LINEAR=0`); `None` otherwise.
    fn linear_by_kernel(&self, q: &Tensor, k: &Tensor, v: &Tensor, routed: Option<&Routed>) -> Option<LinearPart> {
        let half = self.fq.dim() / 2;
        if self.fk.dim() != self.fq.dim() || half % 4 != 0 || half > 128 {
            return None;
        }
        let (b, h, t, d) = dims4(q);
        let (c, dev) = (self.chunk, q.device());
        let n = (t + c - 1) / c;
        let keep = routed.map(|r| Tensor::ones([b, h, n * c], (Kind::Float, dev)).scatter_value(2, &r.pos, 0.0));
        let (wq, wk) = (self.fq.folded_linear(Kind::Float), self.fk.folded_linear(Kind::Float));
        let m = cuda::PrefillLinear { q_map: (&wq, self.fq.norm_reinject), k_map: (&wk, self.fk.norm_reinject), keep: keep.as_ref(), chunk: c };
        let lin = match cuda::hybrid_prefill_linear(q, k, v, &m)? {
            Ok(lin) => lin,
            Err(e) => panic!("hybrid_prefill_linear: {e}"),
        };
        Some(LinearPart { n: lin.n_lin.view([b, h, n, c, d]), z: lin.z_lin.view([b, h, n, c, 1]), s_last: lin.s, z_last: lin.z })
    }

    /// The softmax part (§3) of padded queries over Win ∪ Sel: its numerator, denominator and max
    /// `[B, H, n, C, ·]` (γ applied), from the window logits `s_win` and the routed tokens.
    fn softmax_part(&self, qf: &Tensor, kf: &Tensor, vf: &Tensor, s_win: &Tensor, routed: Option<&Routed>) -> (Tensor, Tensor, Tensor) {
        let (b, h, tp, d) = dims4(qf);
        let (c, kind, dev) = (self.chunk, qf.kind(), qf.device());
        let n = tp / c;
        let chunks = |x: &Tensor| x.reshape([b, h, n, c, x.size()[3]]);
        // Win: chunk c−1 (all) and chunk c (causal); chunk 0 has no previous chunk.
        let qi = Tensor::arange(c, (Kind::Int64, dev)).view([c, 1]);
        let col = Tensor::arange(2 * c, (Kind::Int64, dev)).view([1, 2 * c]);
        let mut win_ok = col.lt(c).logical_or(&(&col - c).le_tensor(&qi)).expand([n, c, 2 * c], false);
        if !self.phantom_chunk0_keys {
            let first = Tensor::arange(n, (Kind::Int64, dev)).eq(0).view([n, 1, 1]);
            win_ok = win_ok.logical_and(&first.logical_and(&col.lt(c).view([1, 1, 2 * c])).logical_not());
        }
        // Sel: the κ tokens of every chunk ≤ c−2, visible from query chunk c. The selected slots are
        // in chunk order, so a query chunk sees a prefix of them: query chunks go in groups, each
        // against the prefix its last chunk sees, not against every slot behind a mask.
        let sel = routed.map(|r| {
            let nsel = r.pos.size()[2];
            let take = |x: &Tensor| x.gather(2, &r.pos.unsqueeze(-1).expand([b, h, nsel, d], false), false);
            (take(kf), take(vf), &r.chunk_of)
        });
        let qs = chunks(qf) * (1.0 / (d as f64).sqrt());
        let v_win = two_chunks(&chunks(vf));
        let groups = if sel.is_some() { (n / SEL_GROUP_CHUNKS).clamp(1, SEL_GROUPS) } else { 1 };
        // Per group of query chunks: the softmax numerator, denominator and max over Sel ∪ Win.
        let mut per_group = Vec::with_capacity(groups as usize);
        for g in 0..groups {
            let (from, to) = (g * n / groups, (g + 1) * n / groups);
            let len = to - from;
            let mut logits = vec![s_win.narrow(2, from, len).masked_fill(&win_ok.narrow(0, from, len).logical_not(), f64::NEG_INFINITY)];
            let mut values = vec![v_win.narrow(2, from, len)];
            if let Some((ks, vs, key_chunk)) = &sel {
                let seen = key_chunk.iter().take_while(|&&kc| kc + 2 < to).count() as i64;
                if seen > 0 {
                    let kc = Tensor::from_slice(&key_chunk[..seen as usize]).to_device(dev).view([1, 1, seen]);
                    let qc = Tensor::arange_start(from, to, (Kind::Int64, dev)).view([len, 1, 1]);
                    let ok = (kc + 2).le_tensor(&qc).expand([len, c, seen], false);
                    let s_sel = by_chunk(&qs.narrow(2, from, len), &ks.narrow(2, 0, seen).transpose(-2, -1));
                    logits.push(s_sel.masked_fill(&ok.logical_not(), f64::NEG_INFINITY));
                    values.push(vs.narrow(2, 0, seen));
                }
            }
            per_group.push(softmax_sums(&logits, &values, kind));
        }
        let joined = |pick: fn(&(Tensor, Tensor, Tensor)) -> &Tensor| Tensor::cat(&per_group.iter().map(pick).collect::<Vec<_>>(), 2);
        let (mut n_sm, mut z_sm, m) = (joined(|p| &p.0), joined(|p| &p.1), joined(|p| &p.2));
        if let Some(gamma) = self.gamma() {
            let gamma = gamma.to_kind(kind).view([1, h, 1, 1, 1]);
            n_sm = n_sm * &gamma;
            z_sm = z_sm * gamma;
        }
        (n_sm, z_sm, m)
    }

    /// The output (§3) of queries `qf` from their logits over blocks of Sel ∪ Win (masked with −∞),
    /// those keys' values and the linear state S, z; in the compute kind (a decode step's).
    pub(super) fn mix(&self, logits: &[Tensor], values: &[Tensor], qf: &Tensor, g: Option<&Tensor>, state: &Tensor, z: &Tensor) -> Tensor {
        let kind = state.kind();
        let (mut n_sm, mut z_sm, m) = softmax_sums(logits, values, kind);
        if let Some(gamma) = self.gamma() {
            let gamma = gamma.to_kind(kind).view([1, -1, 1, 1]);
            n_sm = n_sm * &gamma;
            z_sm = z_sm * gamma;
        }
        let phi_q = self.fq.forward(qf);
        let mut n_lin = phi_q.matmul(state);
        let z_lin = phi_q.matmul(&z.unsqueeze(-1));
        if let Some(g) = g {
            n_lin = n_lin * g.to_kind(kind);
        }
        let (n_lin, z_lin) = self.linear_terms(n_lin, z_lin, &m);
        (n_sm + n_lin) / (z_sm + z_lin + self.eps)
    }

    /// The linear numerator and denominator as they enter the output: dropped without the linear
    /// branch, scaled by e^{−m} (m = the softmax max, broadcast over the last dim) when compensated.
    pub(super) fn linear_terms(&self, n_lin: Tensor, z_lin: Tensor, m: &Tensor) -> (Tensor, Tensor) {
        if !self.linear {
            return (n_lin.zeros_like(), z_lin.zeros_like());
        }
        if self.compensate {
            let f = (-m).exp();
            return (n_lin * &f, z_lin * f);
        }
        (n_lin, z_lin)
    }
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use crate::attention::causal;
    use crate::spec::AttentionImpl;
    use tch::{Device, Kind, Tensor};

    /// The mixing kernel's per-chunk Sel prefix: chunk qc sees the slots of chunks ≤ qc − 2 (by hand).
    #[test]
    fn each_query_chunk_sees_the_slots_of_chunks_two_back() {
        assert_eq!(super::visible_slots(&[0, 0, 1, 1, 2, 2], 5), vec![0, 0, 2, 4, 6]);
        // An oracle's uneven list: one slot in chunk 0, two in chunk 3.
        assert_eq!(super::visible_slots(&[0, 3, 3], 6), vec![0, 0, 1, 1, 1, 3]);
        assert_eq!(super::visible_slots(&[], 3), vec![0, 0, 0]);
    }

    /// still.md §12.6: the gate multiplies only the linear numerator: y(g) = y(0) + g ⊙ (y(1) − y(0)).
    #[test]
    fn gate_scales_only_the_linear_numerator() {
        let _rng = crate::testutil::rng();
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
        let _rng = crate::testutil::rng();
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

    /// fp32 inputs: the math runs in fp32 and stays within 1e-4 of the fp64 reference; bf16 runs and
    /// returns bf16.
    #[test]
    fn low_precision_inputs() {
        let _rng = crate::testutil::rng();
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

    /// With the linear branch off and every token selected (κ = C, or the oracle listing everything),
    /// the hybrid is the teacher; with the linear branch off and κ < C it is softmax over Sel ∪ Win
    /// exactly (an explicit masked softmax from the selected set).
    #[test]
    fn linear_branch_off() {
        let _rng = crate::testutil::rng();
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
}
