"""An attnlab Llama-family model (Llama and, with `family = "olmo2"`, OLMo 2; attnlab's src/model/llama.rs)
with attnlab's attention kinds (attnlab_attention.py), for `AutoModelForCausalLM.from_pretrained(DIR,
trust_remote_code=True)` on an `attnlab export` folder.

Parameter names are attnlab's, which are Hugging Face's (`model.layers.N.self_attn.q_proj.weight`, ...),
plus DAR's `model.layers.N.self_attn.bottleneck_down.weight` [d_down, d] and `bottleneck_up.weight` [d, d_down].

  Llama:  a = RMSNorm_in(x); h = x + o_proj(attn(a)); out = h + MLP(RMSNorm_post(h))
  OLMo 2: a = x; q, k RMSNorm'd over the whole projection before the head split;
          h = x + RMSNorm_post_attn(o_proj(attn(a))); out = h + RMSNorm_post_ff(MLP(h))

DAR's distant keys / values are k_proj / v_proj of a·W_down·W_up (W_up absorbed into the projections),
then k_norm (OLMo 2) and RoPE at each key's own position, as the layer's own keys.
"""
import math

import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attnlab_linearized import KINDS as LINEARIZED, Hybrid, HybridCache, HybridOptions, add_parameters
from .attnlab_attention import KindOptions, LayerCache, attend, latent_of


class AttnlabLlamaConfig(PreTrainedConfig):
    """config.json of an attnlab Llama export; the attention kind's options under `attnlab_attention`."""

    model_type = "attnlab_llama"
    family = "llama"
    # transformers 5 folds `rope_theta` / `rope_scaling` into this dict (rope_options reads either).
    rope_parameters: dict | None = None

    def __post_init__(self, **kwargs):
        # RoPE validation (llama3 scaling) reads these before the other keys become attributes.
        for key in ("max_position_embeddings", "hidden_size", "num_attention_heads", "head_dim"):
            if key in kwargs:
                setattr(self, key, kwargs[key])
        super().__post_init__(**kwargs)


def rms_norm(x, w, eps, family):
    """RMSNorm with fp32 statistics; Llama casts back before the weight, OLMo 2 after."""
    xf = x.float()
    n = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * n.to(x.dtype) if family == "llama" else (w * n).to(x.dtype)


def rope_options(cfg):
    """(theta, scaling dict or None) from `rope_parameters` (transformers 5) or `rope_theta` / `rope_scaling`."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(cfg, "rope_theta", None) or 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    return float(theta), (None if kind == "default" else dict(params, rope_type=kind))


def inv_freq(head_dim, theta, scaling):
    """Inverse RoPE frequencies [hd/2] (fp32) after the default / linear / llama3 scaling."""
    inv = torch.exp(torch.arange(0, head_dim, 2, dtype=torch.float32) * (-math.log(theta) / head_dim))
    if scaling is None:
        return inv
    if scaling["rope_type"] == "linear":
        return inv / scaling["factor"]
    if scaling["rope_type"] == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / low, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old / high) & (wavelen <= old / low)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope scaling `{scaling['rope_type']}` is not supported (default, linear, llama3)")


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


class Block(nn.Module):
    """One decoder layer; which norms exist depends on the family."""

    def __init__(self, cfg, opts, family):
        super().__init__()
        d, h, kvh, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
        self.family, self.opts, self.eps = family, opts, cfg.rms_norm_eps
        self.heads, self.kv_heads, self.head_dim = h, kvh, hd
        if family == "llama":
            self.input_layernorm = RmsWeight(d)
        self.post_attention_layernorm = RmsWeight(d)
        if family == "olmo2":
            self.post_feedforward_layernorm = RmsWeight(d)
        self.self_attn = SelfAttention(d, h, kvh, hd, opts, family)
        self.mlp = Mlp(d, cfg.intermediate_size)

    def forward(self, x, rope, pos, cache):
        a = rms_norm(x, self.input_layernorm.weight, self.eps, "llama") if self.family == "llama" else x
        o = self.self_attn(a, rope, pos, cache, self.eps)
        if self.family == "llama":
            h = x + o
            return h + self.mlp(rms_norm(h, self.post_attention_layernorm.weight, self.eps, "llama"))
        h = x + rms_norm(o, self.post_attention_layernorm.weight, self.eps, "olmo2")
        return h + rms_norm(self.mlp(h), self.post_feedforward_layernorm.weight, self.eps, "olmo2")


class RmsWeight(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))


class Mlp(nn.Module):
    def __init__(self, d, ffn):
        super().__init__()
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    def __init__(self, d, h, kvh, hd, opts, family):
        super().__init__()
        self.h, self.kvh, self.hd, self.opts, self.family = h, kvh, hd, opts, family
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kvh * hd, bias=False)
        self.v_proj = nn.Linear(d, kvh * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)
        if family == "olmo2":
            self.q_norm = RmsWeight(h * hd)
            self.k_norm = RmsWeight(kvh * hd)
        if opts.has_bottleneck:
            d_down = int(opts.d_down or d // 4)
            self.bottleneck_down = nn.Linear(d, d_down, bias=False)
            self.bottleneck_up = nn.Linear(d_down, d, bias=False)
        self.hybrid = None
        if opts.kind in LINEARIZED:
            add_parameters(self, opts, h, hd, d)
            self.hybrid = Hybrid(opts, self, hd)

    def split(self, x, n):
        b, t, _ = x.shape
        return x.view(b, t, n, self.hd).transpose(1, 2)

    def keys(self, k, cos, sin, eps):
        """Rotated keys [B, H_kv, n, hd] of a k projection: k_norm (OLMo 2), head split, RoPE."""
        if self.family == "olmo2":
            k = rms_norm(k, self.k_norm.weight, eps, "olmo2")
        return apply_rope(self.split(k, self.kvh), cos, sin)

    def forward(self, a, rope, pos, cache, eps):
        """Attention of LN'd input a [B, n, d] at positions pos; rope(positions) -> (cos, sin)."""
        cos, sin = rope(pos)
        q = self.q_proj(a)
        if self.family == "olmo2":
            q = rms_norm(q, self.q_norm.weight, eps, "olmo2")
        q = apply_rope(self.split(q, self.h), cos, sin)
        k = self.keys(self.k_proj(a), cos, sin, eps)
        v = self.split(self.v_proj(a), self.kvh)
        if self.hybrid is not None:
            rep = self.h // self.kvh
            g = None
            if getattr(self, "g_proj", None) is not None:
                g = torch.sigmoid(self.g_proj(a)).view(a.shape[0], a.shape[1], self.h, self.hd).transpose(1, 2)
            o = self.hybrid.forward(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), g, pos, cache)
            b, _, n, _ = o.shape
            return self.o_proj(o.transpose(1, 2).reshape(b, n, self.h * self.hd))
        latent = distant = None
        if self.opts.has_bottleneck:
            latent = latent_of(a, self.bottleneck_down.weight, self.opts.dar_act)

            def distant(lat):
                up = self.bottleneck_up.weight
                g = lat.shape[1]
                c, s = rope(torch.arange(g, device=lat.device))
                kg = self.keys(F.linear(lat, self.k_proj.weight @ up), c, s, eps)
                vg = self.split(F.linear(lat, self.v_proj.weight @ up), self.kvh)
                return kg, vg

        o = attend(self.opts, q, k, v, pos, latent, distant, cache)
        b, _, n, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(b, n, self.h * self.hd))


def apply_rope(x, cos, sin):
    """RoPE on [B, H, T, hd] with fp32 tables [T, hd] applied in x's dtype."""
    return x * cos.to(x.dtype) + rotate_half(x) * sin.to(x.dtype)


class Inner(nn.Module):
    """`model.`: embeddings, layers, final norm."""

    def __init__(self, cfg, opts, family):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Block(cfg, opts, family) for _ in range(cfg.num_hidden_layers)])
        self.norm = RmsWeight(cfg.hidden_size)


class AttnlabCache:
    """The decode cache `generate()` carries between steps: one `LayerCache` per layer (bounded as the
    attention kind is: see attnlab_attention.py). Not a transformers `Cache`: the model makes its own."""

    is_compileable = False
    is_croppable = False

    def __init__(self, layers, make=LayerCache):
        self.layers = [make() for _ in range(layers)]

    def get_seq_length(self, layer_idx=0):
        return self.layers[0].seen

    @property
    def is_linear(self):
        return [False]

    def bytes(self):
        return sum(c.bytes() for c in self.layers)


class AttnlabLlamaForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AttnlabLlamaConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]

    def __init__(self, config):
        super().__init__(config)
        self.family = type(config).family
        options = getattr(config, "attnlab_attention", None) or {"kind": "vanilla"}
        linear = options.get("kind") in LINEARIZED
        self.opts = HybridOptions(options) if linear else KindOptions(options)
        self.make_cache = HybridCache if linear else LayerCache
        self.model = Inner(config, self.opts, self.family)
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # The model brings its own cache (AttnlabCache), as recurrent models do.
        return False

    def _init_weights(self, module):
        # Weights come from the export; a fresh model starts as attnlab's Llama (N(0, 0.02), unit norms).
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        elif isinstance(module, RmsWeight):
            nn.init.ones_(module.weight)

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def rope_tables(self, pos):
        """(cos, sin) [n, hd] fp32 at positions pos (HF layout: cat(freqs, freqs))."""
        hd = self.config.hidden_size // self.config.num_attention_heads
        freqs = pos.float()[:, None] * inv_freq(hd, *rope_options(self.config)).to(pos.device)[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, labels=None, inputs_embeds=None, return_dict=None, **kwargs):
        check_no_padding(attention_mask)
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = AttnlabCache(len(self.model.layers), self.make_cache)
        p0 = cache.get_seq_length() if cache is not None else 0
        pos = torch.arange(p0, p0 + x.shape[1], device=x.device)
        for i, block in enumerate(self.model.layers):
            x = block(x, self.rope_tables, pos, None if cache is None else cache.layers[i])
        x = rms_norm(x, self.model.norm.weight, self.config.rms_norm_eps, self.family)
        head = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        logits = x @ head.t()
        return CausalLMOutputWithPast(loss=shifted_loss(logits, labels), logits=logits, cache=cache if use_cache else None)


def check_no_padding(attention_mask):
    """Padded batches are refused rather than computed wrong (the kinds' masks know no padding)."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.bool().all()):
        raise NotImplementedError("attnlab remote code: batches with padding (zeros in attention_mask) are not supported; run prompts one at a time or pad on the right without a mask")


def shifted_loss(logits, labels):
    if labels is None:
        return None
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1), ignore_index=-100)
