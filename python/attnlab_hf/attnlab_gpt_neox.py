"""An attnlab GPT-NeoX / Pythia model (attnlab's src/model/neox.rs) with attnlab's attention kinds
(attnlab_attention.py), for `AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)` on an
`attnlab export` folder.

Parameter names are Hugging Face GPT-NeoX's (`gpt_neox.layers.N.attention.query_key_value.weight`,
`embed_out.weight`, ...), plus DAR's `gpt_neox.layers.N.attention.bottleneck_down.weight` [d_down, d] and
`bottleneck_up.weight` [d, d_down].

  a = LN1(x); x_next = x + dense(attn(a)) + MLP(LN2(x))      (parallel residual)

QKV is fused and head-major ([B, T, H, 3, hd]); RoPE rotates the first rotary_pct of each head
(rotate-half layout). DAR's distant keys / values are the k / v rows of query_key_value (with their bias)
applied to a·W_down·W_up, W_up absorbed, then RoPE at each key's own position (dar.md §2).
"""
import torch
from torch import nn
from torch.nn import functional as F
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .attnlab_attention import KindOptions, attend, latent_of
from .attnlab_llama import AttnlabCache, check_no_padding, shifted_loss


class AttnlabGPTNeoXConfig(PreTrainedConfig):
    """config.json of an attnlab GPT-NeoX export; the attention kind's options under `attnlab_attention`."""

    model_type = "attnlab_gpt_neox"


class Rope:
    """Partial rotary embedding: the first `dims` of each head rotate, inv_freq[k] = base^(-2k/dims)."""

    def __init__(self, head_dim, pct, base):
        self.dims, self.base = int(head_dim * pct), base

    def tables(self, pos):
        half = self.dims // 2
        inv = torch.exp(torch.arange(half, dtype=torch.float32, device=pos.device) * (-2.0 * torch.log(torch.tensor(float(self.base))) / self.dims))
        theta = pos.float()[:, None] * inv[None, :]
        return theta.cos(), theta.sin()

    def apply(self, x, cos, sin):
        if self.dims == 0:
            return x
        half = self.dims // 2
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        x1, x2, rest = x[..., :half], x[..., half:self.dims], x[..., self.dims:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)


class Attention(nn.Module):
    def __init__(self, d, heads, opts):
        super().__init__()
        self.h, self.hd, self.d, self.opts = heads, d // heads, d, opts
        self.query_key_value = nn.Linear(d, 3 * d)
        self.dense = nn.Linear(d, d)
        if opts.has_bottleneck:
            d_down = int(opts.d_down or d // 4)
            self.bottleneck_down = nn.Linear(d, d_down, bias=False)
            self.bottleneck_up = nn.Linear(d_down, d, bias=False)

    def split(self, x, n):
        """[B, T, H·n·hd] head-major -> n tensors [B, H, T, hd]."""
        b, t, _ = x.shape
        x = x.view(b, t, self.h, n, self.hd)
        return [x[:, :, :, s].transpose(1, 2) for s in range(n)]

    def forward(self, a, rope, pos, cache):
        cos, sin = rope.tables(pos)
        q, k, v = self.split(self.query_key_value(a), 3)
        q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        latent = distant = None
        if self.opts.has_bottleneck:
            latent = latent_of(a, self.bottleneck_down.weight, self.opts.dar_act)

            def distant(lat):
                # The k / v rows (and bias) of query_key_value composed with W_up.
                w = self.query_key_value.weight.view(self.h, 3, self.hd, self.d)[:, 1:3].reshape(2 * self.d, self.d)
                bias = self.query_key_value.bias.view(self.h, 3, self.hd)[:, 1:3].reshape(2 * self.d)
                kg, vg = self.split(F.linear(lat, w @ self.bottleneck_up.weight, bias), 2)
                c, s = rope.tables(torch.arange(lat.shape[1], device=lat.device))
                return rope.apply(kg, c, s), vg

        o = attend(self.opts, q, k, v, pos, latent, distant, cache)
        b, _, n, _ = o.shape
        return self.dense(o.transpose(1, 2).reshape(b, n, self.d))


class Mlp(nn.Module):
    def __init__(self, d, ffn, act):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(d, ffn)
        self.dense_4h_to_h = nn.Linear(ffn, d)
        self.approximate = "none" if act == "gelu" else "tanh"

    def forward(self, x):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(x), approximate=self.approximate))


class Layer(nn.Module):
    def __init__(self, cfg, opts):
        super().__init__()
        d, eps = cfg.hidden_size, cfg.layer_norm_eps
        self.input_layernorm = nn.LayerNorm(d, eps=eps)
        self.post_attention_layernorm = nn.LayerNorm(d, eps=eps)
        self.attention = Attention(d, cfg.num_attention_heads, opts)
        self.mlp = Mlp(d, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x, rope, pos, cache):
        # Parallel residual: both branches read the same x.
        return x + self.attention(self.input_layernorm(x), rope, pos, cache) + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    """`gpt_neox.`: embeddings, layers, final LayerNorm."""

    def __init__(self, cfg, opts):
        super().__init__()
        self.embed_in = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg, opts) for _ in range(cfg.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class AttnlabGPTNeoXForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = AttnlabGPTNeoXConfig
    base_model_prefix = "gpt_neox"
    _no_split_modules = ["Layer"]

    def __init__(self, config):
        super().__init__(config)
        self.opts = KindOptions(getattr(config, "attnlab_attention", None))
        self.gpt_neox = Inner(config, self.opts)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope = Rope(config.hidden_size // config.num_attention_heads, config.rotary_pct, config.rotary_emb_base)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls):
        # The model brings its own cache (AttnlabCache), as recurrent models do.
        return False

    def _init_weights(self, module):
        # Weights come from the export; a fresh model gets a plain start.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def get_input_embeddings(self):
        return self.gpt_neox.embed_in

    def get_output_embeddings(self):
        return self.embed_out

    def forward(self, input_ids=None, attention_mask=None, cache=None, use_cache=None, labels=None, inputs_embeds=None, return_dict=None, **kwargs):
        check_no_padding(attention_mask)
        x = self.gpt_neox.embed_in(input_ids) if inputs_embeds is None else inputs_embeds
        use_cache = getattr(self.config, "use_cache", True) if use_cache is None else use_cache
        if cache is None and use_cache:
            cache = AttnlabCache(len(self.gpt_neox.layers))
        p0 = cache.get_seq_length() if cache is not None else 0
        pos = torch.arange(p0, p0 + x.shape[1], device=x.device)
        for i, layer in enumerate(self.gpt_neox.layers):
            x = layer(x, self.rope, pos, None if cache is None else cache.layers[i])
        logits = self.embed_out(self.gpt_neox.final_layer_norm(x))
        return CausalLMOutputWithPast(loss=shifted_loss(logits, labels), logits=logits, cache=cache if use_cache else None)
