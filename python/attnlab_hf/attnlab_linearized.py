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
This file computes the sets densely per query (the same function as attnlab's chunked forward). Its
decode cache keeps every token's keys, values and score: correct, but not the bounded cache of
still.md §6. Options this code does not implement are refused when the model is built.
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

    def forward(self, q, k, v, g, pos, cache):
        """Heads [B, H, n, D] of queries q at positions pos; k, v [B, H, n, D] already repeated to H heads;
        g = the gate sigma(W_g x) [B, H, n, D] (STILL) or None. With a cache, earlier tokens come from it."""
        o = self.opts
        kind = torch.float64 if q.dtype == torch.float64 else torch.float32
        qf, kf, vf = q.to(kind), k.to(kind), v.to(kind)
        if cache is not None and cache.k is not None:
            kf, vf = torch.cat([cache.k, kf], 2), torch.cat([cache.v, vf], 2)
        kpos = torch.arange(kf.shape[2], device=q.device)
        s = qf @ kf.transpose(-2, -1) / math.sqrt(self.d)
        new_scores = self.scores(s, pos, kpos, kf)
        scores = new_scores if cache is None or cache.scores is None else torch.cat([cache.scores, new_scores], 2)
        ct, cj = pos // o.chunk, kpos // o.chunk
        causal = kpos[None, :] <= pos[:, None]
        win = causal & (cj[None, :] >= ct[:, None] - 1)
        routed = cj[None, :] <= ct[:, None] - 2
        chosen = self.selected(scores)[:, :, None, :]
        soft = win[None, None] | (routed[None, None] & chosen)
        lin = routed[None, None] & ~chosen
        m = s.masked_fill(~soft, float("-inf")).amax(-1, keepdim=True)
        e = (s - m).exp() * soft
        n_sm, z_sm = e @ vf, e.sum(-1, keepdim=True)
        if o.kind == "lolcats":
            gamma = torch.sigmoid(self.attn[0].window_factors.to(kind)).view(1, -1, 1, 1)
            n_sm, z_sm = n_sm * gamma, z_sm * gamma
        attn = self.attn[0]
        a = (attn.feature_map_q(qf) @ attn.feature_map_k(kf).transpose(-2, -1)) * lin
        n_lin, z_lin = a @ vf, a.sum(-1, keepdim=True)
        if g is not None:
            n_lin = n_lin * g.to(kind)
        if not o.linear_branch:
            n_lin, z_lin = n_lin * 0, z_lin * 0
        elif o.compensate:
            n_lin, z_lin = n_lin * (-m).exp(), z_lin * (-m).exp()
        y = (n_sm + n_lin) / (z_sm + z_lin + o.eps)
        if cache is not None:
            cache.k, cache.v, cache.scores = kf, vf, scores
            cache.seen = int(pos[-1]) + 1
        return y.to(q.dtype)


class HybridCache:
    """One layer's decode state: every token's keys, values (per query head) and routing score."""

    def __init__(self):
        self.k = self.v = self.scores = None
        self.seen = 0

    def bytes(self):
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.scores) if t is not None)
