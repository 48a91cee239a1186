"""attnlab's softmax attention kinds for Hugging Face transformers: vanilla, DAR, uniform, window, sink.

A model (attnlab_gpt_neox.py, attnlab_llama.py) computes each layer's rotated queries, keys and values
and hands them here with a `distant` function for the bottleneck kinds. The kind decides which keys a
query at position i reads, by the key's position j (attnlab's src/attention/{vanilla,dar,window,sink}.rs):

  vanilla   j <= i, full-width keys
  dar       0 <= i-j < window: full-width keys; i-j >= window: keys rebuilt from the d_down latent
            h^D_j = a_j W_down through the layer's own k / v map with W_up (dar.md §1); ONE softmax
  uniform   dar with window 0: every key through the bottleneck
  window    0 <= i-j < window only
  sink      0 <= i-j < window, or j < sinks (a document's first tokens)

`LayerCache` is the decode cache of one layer and stays bounded where the kind is: full-width keys of
the last `window` tokens only (window, sink: plus the sinks; dar: plus every token's d_down latent, the
cache of dar.md §3); vanilla keeps everything. Math in fp32 (fp64 inputs stay fp64), as attnlab's
explicit reference.
"""
import math

import torch

KINDS = ("vanilla", "dar", "uniform", "window", "sink")
DEFAULT_WINDOW = 128
DEFAULT_SINKS = 4


class KindOptions:
    """The `attnlab_attention` entry of config.json (attnlab's resolved `attention:` options)."""

    def __init__(self, options):
        options = dict(options or {"kind": "vanilla"})
        self.kind = options.get("kind", "vanilla")
        if self.kind not in KINDS:
            raise ValueError(f"attnlab_attention: kind `{self.kind}` is not one of {KINDS} (this code does not implement it)")
        self.window = int(options.get("window") if options.get("window") is not None else DEFAULT_WINDOW)
        if self.kind == "uniform":
            self.window = 0
        self.sinks = int(options.get("sinks") if options.get("sinks") is not None else DEFAULT_SINKS)
        self.d_down = options.get("d_down")
        self.dar_act = options.get("dar_act", "linear")

    @property
    def has_bottleneck(self):
        return self.kind in ("dar", "uniform")

    def local_mask(self, q_pos, k_pos):
        """[n, S] bool: query at q_pos[i] reads the full-width key at k_pos[j]."""
        d = q_pos[:, None] - k_pos[None, :]
        causal = d >= 0
        if self.kind == "vanilla":
            return causal
        band = causal & (d < self.window)
        if self.kind == "sink":
            return band | (causal & (k_pos[None, :] < self.sinks))
        return band

    def distant_mask(self, q_pos, k_pos):
        """[n, S] bool: query reads the bottleneck key at k_pos[j] (dar / uniform: i - j >= window)."""
        return (q_pos[:, None] - k_pos[None, :]) >= self.window

    def keep_from(self, last):
        """The first position whose full-width key a query after `last` may still read (None: all)."""
        if self.kind == "vanilla":
            return None
        return last + 2 - self.window


def repeat_kv(x, heads):
    """[B, H_kv, S, hd] -> [B, heads, S, hd] (grouped-query attention)."""
    rep = heads // x.shape[1]
    return x if rep == 1 else x.repeat_interleave(rep, dim=1)


def joint_softmax(q, parts):
    """One softmax over the union of key sets: parts = [(k, v, mask [n, S])], k / v [B, H, S, hd]."""
    kind = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf = q.to(kind)
    parts = [p for p in parts if p[0].shape[2] > 0]
    scores = [(qf @ k.to(kind).transpose(-2, -1) * scale).masked_fill(~m, float("-inf")) for k, _, m in parts]
    p = torch.cat(scores, dim=-1).softmax(dim=-1)
    out, at = 0, 0
    for k, v, _ in parts:
        s = k.shape[2]
        out = out + p[..., at:at + s] @ v.to(kind)
        at += s
    return out.to(q.dtype)


class LayerCache:
    """What one layer keeps between decode steps: full-width rotated keys / values with their
    positions (trimmed to what later queries read), and for dar / uniform every token's latent."""

    def __init__(self):
        self.k = self.v = self.pos = self.latent = None
        self.seen = 0

    def bytes(self):
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.latent) if t is not None)


def attend(opts, q, k, v, pos, latent=None, distant=None, cache=None):
    """Attention heads [B, H, n, hd] of queries q at positions pos [n] (int64).

    k, v: this step's rotated keys / values [B, H_kv, n, hd]. For dar / uniform, latent [B, n, d_down]
    is this step's h^D and distant(latents [B, g, d_down]) -> rotated (k_g, v_g) [B, H_kv, g, hd] for
    positions 0..g-1. With a cache, earlier tokens come from it and it is extended (then trimmed).
    """
    if cache is not None and cache.pos is not None:
        k, v, kpos = torch.cat([cache.k, k], 2), torch.cat([cache.v, v], 2), torch.cat([cache.pos, pos])
    else:
        kpos = pos
    if opts.has_bottleneck:
        if cache is not None and cache.latent is not None:
            latent = torch.cat([cache.latent, latent], 1)
    heads = q.shape[1]
    parts = [(repeat_kv(k, heads), repeat_kv(v, heads), opts.local_mask(pos, kpos))]
    if opts.has_bottleneck:
        # Only keys at distance >= window from the newest query are read through the bottleneck.
        g = max(0, int(pos[-1]) - opts.window + 1)
        if g > 0:
            kg, vg = distant(latent[:, :g])
            gpos = torch.arange(g, device=pos.device)
            parts.append((repeat_kv(kg, heads), repeat_kv(vg, heads), opts.distant_mask(pos, gpos)))
    out = joint_softmax(q, parts)
    if cache is not None:
        first = opts.keep_from(int(pos[-1]))
        keep = torch.ones_like(kpos, dtype=torch.bool) if first is None else kpos >= first
        if opts.kind == "sink":
            keep = keep | (kpos < opts.sinks)
        cache.k, cache.v, cache.pos = k[:, :, keep], v[:, :, keep], kpos[keep]
        if opts.has_bottleneck:
            cache.latent = latent
        cache.seen = int(pos[-1]) + 1
    return out


def latent_of(a, down, dar_act):
    """h^D = a W_down (sigmoid of it for dar_act: sigmoid); down: bottleneck_down.weight [d_down, d]."""
    low = torch.nn.functional.linear(a, down)
    return torch.sigmoid(low) if dar_act == "sigmoid" else low
