//! Decode with a bounded cache (§6): route chunk c−2 when chunk c starts, append, score, attend.
use super::routing::top_kappa;
use super::{dims4, Hybrid, Selection};
use tch::{Device, Kind, Tensor};

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
    /// C and κ per routed chunk: what bounds the window and the selected tokens (`bound`).
    chunk: i64,
    selection: Selection,
    /// While device-side steps decode ([`Hybrid::step_at`]): the fixed-shape buffers that hold Sel
    /// and the window instead of the fields above (S and z stay, updated in place).
    fixed: Option<Fixed>,
}

/// A [`HybridCache`]'s Sel and window in buffers whose shapes never change, so that one CUDA graph
/// replays a decode step at every position: the window as a ring of 2C slots (position p in slot
/// p mod 2C, the slots of chunk c−2 reused by chunk c once it is routed), Sel in a buffer sized for
/// the reserved tokens, its filled length on the device for the step's mask. Made from, and turned
/// back into, the growing form by [`Hybrid::prepare_at`] / [`Hybrid::settle`].
#[derive(Debug)]
struct Fixed {
    /// `[B, H, capacity, D]`: Sel in chunk order in the first `n_sel` slots.
    sel_k: Tensor,
    sel_v: Tensor,
    n_sel: i64,
    /// `n_sel` on the device `[1]` (i64).
    n_sel_at: Tensor,
    /// `[B, H, 2C, D]` and `[B, H, 2C]`.
    win_k: Tensor,
    win_v: Tensor,
    win_scores: Tensor,
    /// Chunks routed so far (0..routed): the window starts at routed·C.
    routed: i64,
    /// The query feature map's folded matrix `[H, D, F/2]` (fp32) for the mixing kernel, made once
    /// with the fixed form (the parameters do not change during a generation).
    fq_folded: Tensor,
    /// γ `[H]` (LoLCATs), made once with the fixed form: a step's graph runs no sigmoid.
    gamma: Option<Tensor>,
    /// One int32 arrival counter a (row, head), zero between steps: the mixing kernel split over
    /// blocks counts its blocks in on it (`kernels::cuda::Mix::arrived`).
    arrived: Tensor,
}

impl crate::attention::cache::KindCache for HybridCache {
    fn bytes(&self) -> i64 {
        HybridCache::bytes(self)
    }
    /// still.md §6's memory after `tokens` tokens: H·[2·(n_sel + n_win)·D·b_kv + (F·D + F)·4 + n_win·4]
    /// per row, n_win ≤ 2C the window of chunks c−1 and c, n_sel ≤ κ per routed chunk, capped by the
    /// budget (LoLCATs: κ = 0): exact for the terrace window, an upper bound for the sliding one.
    fn bound(&self, tokens: i64) -> Option<i64> {
        let c = self.chunk;
        let routed = ((tokens - 1).div_euclid(c) - 1).max(0);
        let n_sel = (0..routed).map(|i| self.selection.kappa_for(i)).sum::<i64>();
        let n_win = (tokens - routed * c).min(2 * c);
        let (kv, st) = (self.win_k.size(), self.s.size());
        let (b, h, d, f) = (kv[0], kv[1], kv[3], st[2]);
        let (b_kv, b_state) = (self.win_k.kind().elt_size_in_bytes() as i64, self.s.kind().elt_size_in_bytes() as i64);
        Some(b * h * (2 * (n_sel + n_win) * d * b_kv + (f * d + f) * b_state + n_win * b_state))
    }
    /// STILL's / LoLCATs' chunks are counted from position 0, so a shifted row would be routed
    /// differently: one prompt per batch row, without padding.
    fn set_padding(&mut self, _pad: &crate::attention::cache::Padding) {
        panic!("STILL / LoLCATs caches take one prompt per batch row without padding")
    }
    fn advance(&mut self, n: i64) {
        assert!(self.fixed.is_some(), "advance counts device-side steps, which write the fixed form");
        self.pos += n;
    }
}

impl HybridCache {
    /// An empty cache for `b` rows of `h` heads of width `d`, φ of `f` features, chunks of `chunk`
    /// tokens routed by `selection`.
    pub(crate) fn empty(b: i64, h: i64, d: i64, f: i64, kv_kind: Kind, dev: Device, chunk: i64, selection: Selection) -> Self {
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
            chunk,
            selection,
            fixed: None,
        }
    }

    /// Bytes held by the cache's tensors (in the fixed form: by its filled slots, as the growing
    /// form would hold them).
    pub fn bytes(&self) -> i64 {
        let size = |x: &Tensor| x.numel() as i64 * x.kind().elt_size_in_bytes() as i64;
        let Some(f) = &self.fixed else {
            return [&self.sel_k, &self.sel_v, &self.win_k, &self.win_v, &self.win_scores, &self.s, &self.z].iter().map(|x| size(x)).sum();
        };
        let kv = f.win_k.size();
        let (b, h, d) = (kv[0], kv[1], kv[3]);
        let n_win = self.pos - f.routed * self.chunk;
        let (b_kv, b_state) = (f.win_k.kind().elt_size_in_bytes() as i64, self.s.kind().elt_size_in_bytes() as i64);
        b * h * (2 * (f.n_sel + n_win) * d * b_kv + n_win * b_state) + size(&self.s) + size(&self.z)
    }
}

impl Hybrid<'_> {
    /// One decode step (§6): route chunk c−2 when chunk c starts, append, score, attend.
    pub fn step(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> Tensor {
        self.settle(cache);
        self.advance(cache, q, k, v, g)
    }

    /// n new tokens (`[B, H, n, hd]`, rotated at positions cache.pos..): the outputs and final state of n
    /// calls of [`Hybrid::step`]. An empty cache takes the vectorised prefill (with the sliding decode
    /// window that is the terrace prefill, as in the reference); otherwise the tokens go one chunk
    /// segment at a time (Sel, S and z only change at chunk starts), or one by one when sliding.
    pub fn extend(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor, g: Option<&Tensor>) -> Tensor {
        let n = q.size()[2];
        self.settle(cache);
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
        let s = (&qf * scale).matmul(&keys.transpose(-2, -1)); // [B, H, len, nsel + nw]
        // New token r sits at window index nw − len + r.
        let r = Tensor::arange(len, (Kind::Int64, dev)).view([len, 1]) + (nw - len);

        // Score of each new token over its C most recent keys: column w ↔ window index r − C + 1 + w
        // (self last), invalid before the start of the sequence (as prefill's zero padding).
        let idx = &r - (c - 1) + Tensor::arange(c, (Kind::Int64, dev)).view([1, c]); // [len, C]
        let valid = idx.ge(0);
        let s_w = s.narrow(-1, nsel, nw).gather(-1, &idx.clamp_min(0).expand([b, h, len, c], false), false).masked_fill(&valid.logical_not(), 0.0);
        let score = match self.scorer {
            Some(sc) => sc.scores(&s_w, &valid, &k.to_kind(kind), &Tensor::from(t).to_device(dev)),
            None => Tensor::zeros([b, h, len], (kind, dev)),
        };
        cache.win_scores = Tensor::cat(&[&cache.win_scores, &score], 2);

        // Output: softmax over Sel ∪ window (causal inside the window), linear over S, z.
        let col = Tensor::arange(nsel + nw, (Kind::Int64, dev)).view([1, nsel + nw]) - nsel;
        let s = s.masked_fill(&col.gt_tensor(&r), f64::NEG_INFINITY);
        cache.pos += len;
        self.mix(&[s], &[vals], &qf, g, &cache.s, &cache.z).to_kind(q.kind())
    }

    /// Route chunk `chunk` = the first C window tokens: top-κ (or the oracle's) to Sel, the rest into S and z.
    fn route_step(&self, cache: &mut HybridCache, chunk: i64) {
        let c = self.chunk;
        let (b, h, d) = (cache.win_k.size()[0], cache.win_k.size()[1], cache.win_k.size()[3]);
        let mut lin = Tensor::ones([b, h, c, 1], (cache.s.kind(), cache.s.device()));
        if let Some(idx) = self.pick(chunk, &cache.win_scores.narrow(2, 0, c)) {
            let kappa = idx.size()[2];
            let take = |x: &Tensor| x.narrow(2, 0, c).gather(2, &idx.unsqueeze(-1).expand([b, h, kappa, d], false), false);
            cache.sel_k = Tensor::cat(&[&cache.sel_k, &take(&cache.win_k)], 2);
            cache.sel_v = Tensor::cat(&[&cache.sel_v, &take(&cache.win_v)], 2);
            lin = lin.scatter_value(2, &idx.unsqueeze(-1), 0.0);
        }
        self.fold(cache, &lin, c);
    }

    /// Back to the growing form after device-side steps (nothing to do in it already): Sel and the
    /// window in position order, as [`Hybrid::advance`] reads and appends them, and the scores the
    /// steps left to the routing (random, uniform: by position) filled in.
    fn settle(&self, cache: &mut HybridCache) {
        let Some(f) = cache.fixed.take() else { return };
        let start = f.routed * self.chunk;
        let slots = Tensor::arange_start(start, cache.pos, (Kind::Int64, f.win_k.device())).remainder(2 * self.chunk);
        cache.win_k = f.win_k.index_select(2, &slots);
        cache.win_v = f.win_v.index_select(2, &slots);
        let (b, h) = (f.win_k.size()[0], f.win_k.size()[1]);
        let by_position = self.scorer.and_then(|sc| sc.position_scores(b, h, self.chunk, start, cache.pos - start, f.win_scores.kind(), f.win_scores.device()));
        cache.win_scores = by_position.unwrap_or_else(|| f.win_scores.index_select(2, &slots));
        cache.sel_k = f.sel_k.narrow(2, 0, f.n_sel).copy();
        cache.sel_v = f.sel_v.narrow(2, 0, f.n_sel).copy();
    }

    /// κ of chunk `chunk` (0 without a scorer) and, routing by a list (oracle), its positions
    /// inside the chunk.
    fn routing_of(&self, chunk: i64) -> (i64, Option<Vec<i64>>) {
        let c = self.chunk;
        let kappa = if self.scorer.is_some() { self.selection.kappa_for(chunk).min(c) } else { 0 };
        let listed = self.oracle.as_ref().filter(|_| kappa > 0).map(|list| list.iter().filter(|&&p| p >= 0 && p / c == chunk).map(|&p| p - chunk * c).collect());
        (kappa, listed)
    }

    /// The tokens chunk `chunk` sends to Sel `[B, H, κ']` (indices inside the chunk, ascending) by
    /// its tokens' scores `[B, H, C]`: the top κ, or the oracle's positions in it; None: nothing.
    fn pick(&self, chunk: i64, scores: &Tensor) -> Option<Tensor> {
        let (b, h) = (scores.size()[0], scores.size()[1]);
        match self.routing_of(chunk) {
            (_, Some(inside)) => (!inside.is_empty()).then(|| Tensor::from_slice(&inside).to_device(scores.device()).view([1, 1, -1]).expand([b, h, inside.len() as i64], false).contiguous()),
            (kappa, None) => (kappa > 0).then(|| top_kappa(scores, kappa)),
        }
    }

    /// How many tokens chunk `chunk` sends to Sel ([`Hybrid::pick`]'s count, known in advance).
    fn selects(&self, chunk: i64) -> i64 {
        match self.routing_of(chunk) {
            (_, Some(inside)) => inside.len() as i64,
            (kappa, None) => kappa,
        }
    }

    /// Whether this operator decodes in device-side steps ([`Hybrid::step_at`]): LoLCATs' sliding
    /// compat window folds a token per step, which it does not do.
    pub fn steps_on_device(&self) -> bool {
        !self.sliding_decode
    }

    /// Before the device-side step at position `pos` (`cache.pos`), outside any CUDA graph: turn the
    /// cache into its fixed form (Sel sized for `reserved` tokens in all) and, where chunk c starts,
    /// route chunk c−2 (its top-κ into Sel, the rest folded into S and z), all in place.
    pub fn prepare_at(&self, cache: &mut HybridCache, pos: i64, reserved: i64) {
        let _guard = tch::no_grad_guard();
        assert_eq!(cache.pos, pos, "prepare_at: the cache is at position {}, not {pos}", cache.pos);
        let c = self.chunk;
        if cache.fixed.is_none() {
            self.fix(cache, reserved);
        }
        let f = cache.fixed.as_mut().expect("fixed above");
        if pos % c != 0 || pos / c < 2 || f.routed >= pos / c - 1 {
            return;
        }
        let chunk = pos / c - 2;
        assert_eq!(f.routed, chunk, "prepare_at: chunks route in order");
        // Chunk c−2 fills the ring's slots from (c−2)·C mod 2C (= 0 or C).
        let first = (chunk * c) % (2 * c);
        let (b, h, d) = (f.win_k.size()[0], f.win_k.size()[1], f.win_k.size()[3]);
        let kind = cache.s.kind();
        let scores = match self.scorer.and_then(|sc| sc.position_scores(b, h, c, chunk * c, c, kind, cache.s.device())) {
            Some(by_position) => by_position,
            None => f.win_scores.narrow(2, first, c),
        };
        let (keys, vals) = (f.win_k.narrow(2, first, c), f.win_v.narrow(2, first, c));
        let picked = self.pick(chunk, &scores);
        if let Some(idx) = &picked {
            let kappa = idx.size()[2];
            let at = idx.unsqueeze(-1).expand([b, h, kappa, d], false);
            let _ = keys.gather_out(&f.sel_k.narrow(2, f.n_sel, kappa), 2, &at, false);
            let _ = vals.gather_out(&f.sel_v.narrow(2, f.n_sel, kappa), 2, &at, false);
            f.n_sel += kappa;
            let _ = f.n_sel_at.fill_(f.n_sel);
        }
        // The rest into S and z: by the prefill's state kernel where it takes them (a kernel for
        // about fifteen host-side ops a layer; `ATTNLAB_HYBRID_FOLD=0` turns it off), else φ of the
        // keys with the selected rows zeroed.
        let keep = |kind: Kind| picked.as_ref().map(|idx| Tensor::ones([b, h, c], (kind, keys.device())).scatter_value(2, idx, 0.0));
        if crate::kernels::cuda::hybrid_fold_available(&keys, &cache.s, self.fk.dim() / 2) {
            let wk = self.fk.folded_linear(Kind::Float);
            let keep = keep(Kind::Float);
            if let Some(Err(e)) = crate::kernels::cuda::hybrid_fold_chunk(&keys, &vals, (&wk, self.fk.norm_reinject), keep.as_ref(), &cache.s, &cache.z) {
                panic!("STILL / LoLCATs decode: folding a routed chunk failed: {e}");
            }
        } else {
            let mut phi = self.fk.forward(&keys.to_kind(kind));
            if let Some(keep) = keep(kind) {
                phi = phi * keep.unsqueeze(-1);
            }
            let _ = cache.s.g_add_(&phi.transpose(-2, -1).matmul(&vals.to_kind(kind)));
            let _ = cache.z.g_add_(&phi.sum_dim_intlist(2, false, kind));
        }
        f.routed += 1;
    }

    /// The growing form → the fixed one (see [`Fixed`]).
    fn fix(&self, cache: &mut HybridCache, reserved: i64) {
        assert!(self.steps_on_device(), "the sliding decode window has no device-side step");
        let c = self.chunk;
        let (b, h) = (cache.win_k.size()[0], cache.win_k.size()[1]);
        let dev = cache.win_k.device();
        let n_win = cache.win_k.size()[2];
        let start = cache.pos - n_win;
        assert!(start % c == 0, "the window starts at a chunk");
        let routed = start / c;
        // Chunks routed by the time the last reserved position (reserved − 1) is stepped.
        let last = ((reserved - 1) / c - 1).max(routed);
        let n_sel = cache.sel_k.size()[2];
        let capacity = n_sel + (routed..last).map(|i| self.selects(i)).sum::<i64>();
        // Zeros before and after x along the token dim, in one kernel (a few hundred fewer host-side
        // ops in a decode's first step than zeros and copies).
        let pad = |x: &Tensor, before: i64, after: i64| {
            let mut p = vec![0i64; 2 * (x.dim() as usize - 3)];
            p.extend([before, after]);
            x.constant_pad_nd(p)
        };
        let sel = |x: &Tensor| pad(x, 0, capacity - n_sel);
        // Position p in slot p mod 2C: the window (n_win ≤ 2C tokens from a chunk start) is one run
        // of slots from 0 or C, or, longer than C from C, the run from C wrapping round to 0.
        let ring = |x: &Tensor| {
            let from = start % (2 * c);
            if from + n_win <= 2 * c {
                pad(x, from, 2 * c - n_win - from)
            } else {
                pad(x, 0, 2 * c - n_win).roll([-c], [2])
            }
        };
        cache.fixed = Some(Fixed {
            sel_k: sel(&cache.sel_k),
            sel_v: sel(&cache.sel_v),
            n_sel,
            n_sel_at: Tensor::full([1], n_sel, (Kind::Int64, dev)),
            win_k: ring(&cache.win_k),
            win_v: ring(&cache.win_v),
            win_scores: ring(&cache.win_scores),
            routed,
            fq_folded: self.fq.folded_linear(Kind::Float),
            gamma: self.gamma(),
            arrived: Tensor::zeros([b * h], (Kind::Int, dev)),
        });
        // The growing form's tensors are stale while the fixed one is in use.
        let empty = |x: &Tensor| x.narrow(2, 0, 0);
        (cache.sel_k, cache.sel_v, cache.win_k, cache.win_v, cache.win_scores) =
            (empty(&cache.sel_k), empty(&cache.sel_v), empty(&cache.win_k), empty(&cache.win_v), empty(&cache.win_scores));
    }

    /// One token per row at the device-side position `at.pos` (after [`Hybrid::prepare_at`] for it):
    /// what [`Hybrid::step`] returns, with every shape fixed and nothing read back to the host, so
    /// that a CUDA graph captures it. The ring's slot of chunk c−2 that this token takes was routed
    /// by `prepare_at`; slots the window does not hold are masked.
    /// `gate_logits`: the output gate before its sigmoid, W_g x `[B, H, 1, D]` (the mixing kernel
    /// takes σ itself: one kernel a layer fewer).
    pub fn step_at(&self, cache: &mut HybridCache, q: &Tensor, k: &Tensor, v: &Tensor, gate_logits: Option<&Tensor>, at: &crate::attention::cache::StepAt) -> Tensor {
        let _guard = tch::no_grad_guard();
        let c = self.chunk;
        let (state, z) = (cache.s.shallow_clone(), cache.z.shallow_clone());
        let f = cache.fixed.as_mut().expect("step_at: prepare_at first");
        let (kind, dev, d) = (state.kind(), q.device(), q.size()[3]);
        // The new token's ring slot, computed once if the ring or the scores are written here.
        let slot = std::cell::OnceCell::new();
        let slot = || slot.get_or_init(|| at.pos.remainder(2 * c));
        // The mixing kernel (csrc/cuda/hybrid_step.cu) computes the logits and φ(q) itself, and from
        // the logits the new token's routing score where it can (`score_in_kernel`); what it leaves
        // is computed here.
        let fused = crate::kernels::cuda::hybrid_mix_enabled(q) && f.win_k.kind() == q.kind() && f.sel_k.kind() == q.kind();
        let scorer = self.scorer.filter(|sc| !sc.by_position());
        let score_in_kernel = scorer.and_then(|sc| sc.kernel_score()).filter(|_| fused && f.win_scores.kind() == Kind::Float);
        let aten_logits = !fused || (scorer.is_some() && score_in_kernel.is_none());
        // Where nothing here reads the window, the kernel writes the new key and value into it
        // (two index_copy kernels fewer a layer).
        let kernel_writes = !aten_logits && crate::kernels::cuda::hybrid_fresh_enabled() && k.size() == q.size() && v.size() == q.size() && k.kind() == q.kind() && v.kind() == q.kind();
        if !kernel_writes {
            let slot = slot();
            let _ = f.win_k.index_copy_(2, slot, &k.to_kind(f.win_k.kind()));
            let _ = f.win_v.index_copy_(2, slot, &v.to_kind(f.win_v.kind()));
        }
        let qf = aten_logits.then(|| q.to_kind(kind));
        let qs = qf.as_ref().map(|qf| qf * (1.0 / (d as f64).sqrt()));
        let s_win = qs.as_ref().map(|qs| qs.matmul(&f.win_k.to_kind(kind).transpose(-2, -1))); // [B, H, 1, 2C]

        // The new token's score over its C most recent keys (positions pos − C + 1 .. pos). Without
        // a scorer the ring holds zeros from `fix` on and keeps them; a score of the position alone
        // (random, uniform) is recomputed wherever it is read (`prepare_at`, `settle`): neither is
        // written here (three kernels a layer fewer).
        if let (None, Some(sc), Some(s_win)) = (score_in_kernel, scorer, &s_win) {
            let recent = Tensor::arange(c, (Kind::Int64, dev)) + (&at.pos - (c - 1));
            let valid = recent.ge(0).view([1, c]);
            let s_w = s_win.index_select(-1, &recent.remainder(2 * c)).masked_fill(&valid.logical_not(), 0.0);
            let score = sc.scores(&s_w, &valid, &k.to_kind(kind), &at.pos);
            let _ = f.win_scores.index_copy_(2, slot(), &score.to_kind(f.win_scores.kind()));
        }
        if fused {
            let cap = f.sel_k.size()[2];
            let m = crate::kernels::cuda::Mix {
                q,
                fq_folded: &f.fq_folded,
                reinject_norm: self.fq.norm_reinject,
                win_k: &f.win_k,
                win_v: &f.win_v,
                sel: (cap > 0).then_some((&f.sel_k, &f.sel_v, &f.n_sel_at)),
                s: &state,
                z: &z,
                gate_logits,
                gamma: f.gamma.as_ref(),
                pos: &at.pos,
                chunk: c,
                eps: self.eps,
                linear: self.linear,
                compensate: self.compensate,
                score: score_in_kernel.map(|kind| (&f.win_scores, kind)),
                new_kv: kernel_writes.then_some((k, v)),
                arrived: crate::kernels::cuda::hybrid_split_enabled().then_some(&f.arrived),
            };
            // Some: `fused` asked hybrid_mix_enabled (and the score, if the kernel took it, is written).
            let y = crate::kernels::cuda::hybrid_mix(&m).expect("the mixing kernel is enabled");
            return y.unwrap_or_else(|e| panic!("STILL / LoLCATs decode mix failed: {e}"));
        }
        let (qf, qs, s_win) = (qf.expect("aten_logits"), qs.expect("aten_logits"), s_win.expect("aten_logits"));

        // Slot s holds the latest position ≤ pos congruent to it; the window is chunks c − 1 and c.
        let held = crate::attention::cache::ring_positions(&at.pos, &Tensor::arange(2 * c, (Kind::Int64, dev)), 2 * c);
        let from = ((at.pos.divide_scalar_mode(c, "floor") - 1) * c).clamp_min(0);
        let in_window = held.ge_tensor(&from);
        let mut logits = vec![s_win.masked_fill(&in_window.logical_not(), f64::NEG_INFINITY)];
        let mut values = vec![f.win_v.to_kind(kind)];
        let cap = f.sel_k.size()[2];
        if cap > 0 {
            let filled = Tensor::arange(cap, (Kind::Int64, dev)).lt_tensor(&f.n_sel_at);
            logits.push(qs.matmul(&f.sel_k.to_kind(kind).transpose(-2, -1)).masked_fill(&filled.logical_not(), f64::NEG_INFINITY));
            values.push(f.sel_v.to_kind(kind));
        }
        let g = gate_logits.map(Tensor::sigmoid);
        self.mix(&logits, &values, &qf, g.as_ref(), &state, &z).to_kind(q.kind())
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

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::*;

    /// still.md §12.2: prefill(L0) then token-by-token decode to L gives prefill(L)'s outputs and cache,
    /// for every L0 < L (L0 = 0: decoding from an empty cache).
    #[test]
    fn prefill_then_decode_matches_prefill() {
        let _rng = crate::testutil::rng();
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
        let _rng = crate::testutil::rng();
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
        let _rng = crate::testutil::rng();
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
        let _rng = crate::testutil::rng();
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
}
