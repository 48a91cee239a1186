"""attnlab's linearized attention operators for Hugging Face transformers: STILL and LoLCATs students
(attnlab's src/attention/still.rs, lolcats.rs, feature_maps.rs; still.md §2-§4, §7).

For query t in chunk c = t // C, the keys j <= t split into three sets:
  Win  chunk c-1 (all of it) and chunk c up to t (the terrace window)
  Sel  the kappa tokens of every chunk <= c-2 with the highest routing score (STILL only)
  Lin  the other tokens of chunks <= c-2
and, with s_tj = q_t.k_j / sqrt(D), m_t = max over Sel and Win, phi the feature maps:

  STILL:   y_t = (sum_{Sel,Win} e^{s-m} v + g_t * phi_q(q_t)^T S) / (sum_{Sel,Win} e^{s-m} + phi_q(q_t).z + 1e-6)
  LoLCATs: y_t = (gamma_h sum_Win e^{s-m} v + phi_q(q_t)^T S) / (gamma_h sum_Win e^{s-m} + phi_q(q_t).z)

S = sum_Lin phi_k(k_j) v_j^T, z = sum_Lin phi_k(k_j); m_t is not compensated in the linear terms. A
token's routing score is computed once, from its own query over its C most recent keys (itself included).
The prefill builds the sets densely per query (the same function as attnlab's chunked forward); decoding
runs one token at a time from the bounded cache of still.md §6 (`HybridCache`: Sel, the window and its
scores, S and z), routing a chunk when it leaves the window. Options this code does not implement are
refused when the model is built.
"""
import math

import torch
from torch import nn

SCORE_EPS = 1e-8
KINDS = ("still", "lolcats")
ROUTINGS = ("self_saliency", "diag_attention", "diag_attn", "self_logit", "key_norm", "uniform", "none")


class Params(nn.Module):
    """A holder whose parameters carry attnlab's names (`hh.u`, `mlp.layer`)."""

    def __init__(self, **shapes):
        super().__init__()
        for name, shape in shapes.items():
            setattr(self, name, nn.Parameter(torch.zeros(*shape)))


class FeatureMap(nn.Module):
    """phi(x) = clamp_min([softmax(u), softmax(-u)], 1e-12), u = f(x) per head (x [B, H, T, D]).

    STILL's NP-Map: u = W_h (Householder_h x), rescaled to |x| (`norm_reinject`); its `hedgehog` variant
    keeps the reflection without the rescale; LoLCATs' Hedgehog map is u = x W_h alone.
    """

    def __init__(self, heads, d, features, householder, reinject):
        super().__init__()
        if householder:
            self.hh = Params(u=(heads, d))
        self.mlp = Params(layer=(heads, d, features))
        self.reinject = reinject

    def forward(self, x):
        xr = x
        if hasattr(self, "hh"):
            u = self.hh.u.to(x.dtype)
            uhat = u / u.norm(dim=-1, keepdim=True).clamp_min(1e-6)
            proj = (x * uhat[:, None]).sum(-1, keepdim=True)
            xr = x - proj * 2.0 * uhat[:, None]
        f = xr @ self.mlp.layer.to(x.dtype)
        if self.reinject:
            f = f / f.norm(dim=-1, keepdim=True).clamp_min(1e-12) * x.norm(dim=-1, keepdim=True)
        return torch.cat([f.softmax(-1), (-f).softmax(-1)], dim=-1).clamp_min(1e-12)


class HybridOptions:
    """The `attnlab_attention` entry of a linearized export (kind still or lolcats)."""

    def __init__(self, options):
        o = dict(options)
        self.kind = o["kind"]
        if self.kind == "still":
            self.chunk = int(o.get("chunk", 64))
            self.routing = o.get("routing", "self_saliency")
            if self.routing not in ROUTINGS:
                raise NotImplementedError(f"attnlab remote code: STILL routing `{self.routing}` is not implemented ({', '.join(ROUTINGS)})")
            if o.get("budget") is not None:
                raise NotImplementedError("attnlab remote code: STILL with `budget` is not implemented (tokens_per_chunk only)")
            if (o.get("compat") or {}).get("phantom_chunk0_keys"):
                raise NotImplementedError("attnlab remote code: compat.phantom_chunk0_keys is not implemented")
            self.kappa = 0 if self.routing == "none" else min(int(o.get("tokens_per_chunk") or 4), self.chunk)
            self.feature_map = o.get("feature_map", "np_map")
            self.gate = bool(o.get("gate", True))
            self.linear_branch = bool(o.get("linear_branch", True))
            self.compensate = o.get("normalizer", "reference") == "max_compensated"
            self.eps = 1e-6
        elif self.kind == "lolcats":
            self.chunk = int(o.get("window", 64))
            self.feature_dim = int(o.get("feature_dim", 64))
            if o.get("decode_window", "terrace") != "terrace":
                raise NotImplementedError("attnlab remote code: LoLCATs decode_window `sliding` is not implemented (terrace only)")
            self.kappa, self.routing, self.gate, self.linear_branch, self.compensate, self.eps = 0, "none", False, True, False, 0.0
        else:
            raise ValueError(f"not a linearized kind: {self.kind}")

    @property
    def has_bottleneck(self):
        return False


def add_parameters(attn, opts, heads, head_dim, d_model):
    """Give the attention module `attn` the operator's parameters under attnlab's names (relative to
    `self_attn.`): `feature_map_q.*`, `feature_map_k.*`, STILL's `g_proj.weight`, LoLCATs' `window_factors`."""
    if opts.kind == "still":
        attn.feature_map_q = FeatureMap(heads, head_dim, head_dim, True, opts.feature_map == "np_map")
        attn.feature_map_k = FeatureMap(heads, head_dim, head_dim, True, opts.feature_map == "np_map")
        if opts.gate:
            attn.g_proj = nn.Linear(d_model, heads * head_dim, bias=False)
    else:
        attn.feature_map_q = FeatureMap(heads, head_dim, opts.feature_dim, False, False)
        attn.feature_map_k = FeatureMap(heads, head_dim, opts.feature_dim, False, False)
        attn.window_factors = nn.Parameter(torch.zeros(1, heads, 1, 1))


class Hybrid:
    """The operator of one layer; its parameters live on the attention module `attn`."""

    def __init__(self, opts, attn, head_dim):
        self.opts, self.d = opts, head_dim
        self.attn = [attn]  # not a submodule: the parameters are registered on attn itself

    def scores(self, s, pos, kpos, k):
        """Each new token's routing score from its own row of logits s [B, H, n, S] (window: its C most
        recent keys, itself included)."""
        o, inf = self.opts, float("inf")
        window = (kpos[None, :] <= pos[:, None]) & (kpos[None, :] > pos[:, None] - o.chunk)
        is_self = kpos[None, :] == pos[:, None]
        if o.routing in ("none",):
            return torch.zeros(s.shape[:3], dtype=s.dtype, device=s.device)
        if o.routing == "key_norm":
            return k[:, :, -len(pos):].norm(dim=-1)
        if o.routing == "uniform":
            i = pos % o.chunk
            hit = torch.zeros_like(i, dtype=torch.bool)
            for r in range(o.kappa):
                hit |= i == r * o.chunk // max(o.kappa, 1)
            return hit.to(s.dtype)[None, None].expand(s.shape[0], s.shape[1], -1)
        a = s.masked_fill(~window, -inf).softmax(-1)
        if o.routing == "self_logit":
            return (s * is_self).sum(-1)
        if o.routing in ("diag_attention", "diag_attn"):
            return (a * is_self).sum(-1)
        b = s.masked_fill(~(window & ~is_self), -inf).softmax(-1).nan_to_num(0.0)
        return (a * ((a + SCORE_EPS) / (b + SCORE_EPS)).log()).nan_to_num(0.0).sum(-1)

    def selected(self, scores):
        """[B, H, S] bool: the top-kappa tokens of every complete chunk (ties: the lower position)."""
        o = self.opts
        b, h, s = scores.shape
        sel = torch.zeros(b, h, s, dtype=torch.bool, device=scores.device)
        full = s // o.chunk
        if o.kappa == 0 or full == 0:
            return sel
        chunks = scores[:, :, : full * o.chunk].reshape(b, h, full, o.chunk)
        top = chunks.sort(dim=-1, descending=True, stable=True).indices[..., : o.kappa]
        top = top + torch.arange(full, device=scores.device)[:, None] * o.chunk
        return sel.scatter(2, top.reshape(b, h, -1), True)

    def combine(self, qf, n_sm, z_sm, m, n_lin, z_lin, g, kind):
        """y = (softmax terms + gated linear terms) / (their normalizers + eps), as the kind defines."""
        o = self.opts
        if o.kind == "lolcats":
            gamma = torch.sigmoid(self.attn[0].window_factors.to(kind)).view(1, -1, 1, 1)
            n_sm, z_sm = n_sm * gamma, z_sm * gamma
        if g is not None:
            n_lin = n_lin * g.to(kind)
        if not o.linear_branch:
            n_lin, z_lin = n_lin * 0, z_lin * 0
        elif o.compensate:
            n_lin, z_lin = n_lin * (-m).exp(), z_lin * (-m).exp()
        return (n_sm + n_lin) / (z_sm + z_lin + o.eps)

    def dense(self, qf, kf, vf, g, kind):
        """The prefill: every query of a sequence at positions 0..T-1 with its sets built densely.
        Returns the heads and every token's routing score."""
        o, attn = self.opts, self.attn[0]
        pos = torch.arange(qf.shape[2], device=qf.device)
        s = qf @ kf.transpose(-2, -1) / math.sqrt(self.d)
        scores = self.scores(s, pos, pos, kf)
        c = pos // o.chunk
        causal = pos[None, :] <= pos[:, None]
        win = causal & (c[None, :] >= c[:, None] - 1)
        routed = c[None, :] <= c[:, None] - 2
        chosen = self.selected(scores)[:, :, None, :]
        soft = win[None, None] | (routed[None, None] & chosen)
        lin = routed[None, None] & ~chosen
        m = s.masked_fill(~soft, float("-inf")).amax(-1, keepdim=True)
        e = (s - m).exp() * soft
        a = (attn.feature_map_q(qf) @ attn.feature_map_k(kf).transpose(-2, -1)) * lin
        y = self.combine(qf, e @ vf, e.sum(-1, keepdim=True), m, a @ vf, a.sum(-1, keepdim=True), g, kind)
        return y, scores

    def forward(self, q, k, v, g, pos, cache):
        """Heads [B, H, n, D] of queries q at positions pos; k, v [B, H, n, D] already repeated to H heads;
        g = the gate sigma(W_g x) [B, H, n, D] (STILL) or None. With a cache: a prefill (empty cache)
        fills it; later tokens are decoded one at a time from it (still.md §6)."""
        kind = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf, kf, vf = q.to(kind), k.to(kind), v.to(kind)
        if cache is None or cache.seen == 0:
            if int(pos[0]) != 0:
                raise ValueError("a STILL / LoLCATs forward starts at position 0 (or continues a cache)")
            y, scores = self.dense(qf, kf, vf, g, kind)
            if cache is not None:
                cache.fill(self, kf, vf, scores)
            return y.to(q.dtype)
        ys = [self.step(cache, qf[:, :, i:i + 1], kf[:, :, i:i + 1], vf[:, :, i:i + 1], None if g is None else g[:, :, i:i + 1], int(pos[i]), kind) for i in range(qf.shape[2])]
        return torch.cat(ys, 2).to(q.dtype)

    def route(self, cache, keys, values, scores):
        """Chunk `keys` [B, H, C, D] leaves the window: its top-kappa tokens join Sel, the rest S and z."""
        o, attn = self.opts, self.attn[0]
        chosen = self.selected(scores)
        if o.kappa > 0:
            idx = chosen.nonzero(as_tuple=True)[2].view(keys.shape[0], keys.shape[1], -1)
            take = lambda x: x.gather(2, idx[..., None].expand(-1, -1, -1, x.shape[-1]))
            cache.sel_k = take(keys) if cache.sel_k is None else torch.cat([cache.sel_k, take(keys)], 2)
            cache.sel_v = take(values) if cache.sel_v is None else torch.cat([cache.sel_v, take(values)], 2)
        phi = attn.feature_map_k(keys) * (~chosen)[..., None]
        cache.s = cache.s + phi.transpose(-2, -1) @ values
        cache.z = cache.z + phi.sum(2)

    def step(self, cache, q, k, v, g, t, kind):
        """One token at position t (still.md §6): route chunk c-2 when t opens chunk c, store k, v and
        the token's score, attend to Sel and the window in softmax and to S, z linearly."""
        o, attn = self.opts, self.attn[0]
        c, i = divmod(t, o.chunk)
        if i == 0 and c >= 2:
            C = o.chunk
            self.route(cache, cache.win_k[:, :, :C], cache.win_v[:, :, :C], cache.win_scores[:, :, :C])
            cache.win_k, cache.win_v, cache.win_scores = cache.win_k[:, :, C:], cache.win_v[:, :, C:], cache.win_scores[:, :, C:]
        wk, wv = torch.cat([cache.win_k, k], 2), torch.cat([cache.win_v, v], 2)
        wpos = torch.arange(t + 1 - wk.shape[2], t + 1, device=q.device)
        s_win = q @ wk.transpose(-2, -1) / math.sqrt(self.d)
        score = self.scores(s_win, torch.tensor([t], device=q.device), wpos, wk)
        cache.win_k, cache.win_v, cache.win_scores = wk, wv, torch.cat([cache.win_scores, score], 2)
        keys = wk if cache.sel_k is None else torch.cat([cache.sel_k, wk], 2)
        values = wv if cache.sel_v is None else torch.cat([cache.sel_v, wv], 2)
        s = q @ keys.transpose(-2, -1) / math.sqrt(self.d)
        m = s.amax(-1, keepdim=True)
        e = (s - m).exp()
        phi_q = attn.feature_map_q(q)
        y = self.combine(q, e @ values, e.sum(-1, keepdim=True), m, phi_q @ cache.s, phi_q @ cache.z[..., None], g, kind)
        cache.seen = t + 1
        return y


class HybridCache:
    """One layer's bounded decode state (still.md §6), per query head: Sel's keys / values (kappa per
    routed chunk), the window (chunk c-1 and the current chunk) with its routing scores, and the linear
    state S [F, D], z [F] of every other token; nothing grows with the sequence but Sel."""

    def __init__(self):
        self.sel_k = self.sel_v = self.win_k = self.win_v = self.win_scores = self.s = self.z = None
        self.seen = 0

    def fill(self, hybrid, kf, vf, scores):
        """The state after a prefill of T tokens: chunks <= c(T-1)-2 routed, the rest in the window."""
        C, t = hybrid.opts.chunk, kf.shape[2]
        w0 = max(0, (t - 1) // C - 1) * C
        b, h, _, d = kf.shape
        f = hybrid.attn[0].feature_map_k(kf[:, :, :1]).shape[-1]
        self.s = kf.new_zeros(b, h, f, d)
        self.z = kf.new_zeros(b, h, f)
        for r in range(w0 // C):
            sl = slice(r * C, (r + 1) * C)
            hybrid.route(self, kf[:, :, sl], vf[:, :, sl], scores[:, :, sl])
        self.win_k, self.win_v, self.win_scores = kf[:, :, w0:], vf[:, :, w0:], scores[:, :, w0:]
        self.seen = t

    def bytes(self):
        return sum(x.numel() * x.element_size() for x in (self.sel_k, self.sel_v, self.win_k, self.win_v, self.win_scores, self.s, self.z) if x is not None)
