#!/usr/bin/env python3
"""Generate a tiny Hugging Face OLMo-2 parity fixture for attnlab (tests/fixtures/olmo2_tiny).

How to run (from the repository root; the venv is the one of make_llama_fixture.py):

    .venv-fixture/bin/python scripts/make_olmo2_fixture.py

Output (byte-for-byte reproducible for a fixed torch/transformers version):

  olmo2_tiny/
    config.json            model.config.to_json_file(...) after save_pretrained (model_type olmo2,
                           architectures Olmo2ForCausalLM; transformers >= 5 writes `rope_parameters`).
    model.safetensors      exactly what save_pretrained writes: fp32, HF names (model.embed_tokens.weight,
                           model.layers.N.self_attn.{q,k,v,o}_proj.weight, self_attn.q_norm.weight [H*hd],
                           self_attn.k_norm.weight [H_kv*hd], post_attention_layernorm.weight,
                           post_feedforward_layernorm.weight, mlp.{gate,up,down}_proj.weight,
                           model.norm.weight, lm_head.weight). No input_layernorm: OLMo 2 has none.
    expected.safetensors   input_ids int64 [2, 64], logits float32 [2, 64, 128],
                           loss float32 [] (mean next-token cross-entropy, targets = inputs shifted by 1)

Model: vocab 128, hidden 64, intermediate 176, 2 layers, 4 query heads / 2 KV heads (head_dim 16),
RMSNorm eps 1e-6, rope_theta 500000 (default rope), untied head (as OLMo-2-1B), eager attention, fp32.
Every parameter is overwritten after torch.manual_seed(0): weights N(0, 0.08), RMSNorm weights
1 + N(0, 0.1), so no norm gain (q_norm/k_norm included) is trivially 1.
"""

import os
import sys

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import Olmo2Config, Olmo2ForCausalLM
from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

torch.set_num_threads(1)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "tests", "fixtures", "olmo2_tiny")
BATCH, SEQ, VOCAB = 2, 64, 128
INPUT_SEED = 1234


def main() -> None:
    cfg = Olmo2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        tie_word_embeddings=False, attention_bias=False, hidden_act="silu", use_cache=False,
        pad_token_id=None, eos_token_id=None, bos_token_id=None,
    )
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Olmo2ForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        norms = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, Olmo2RMSNorm)}
        # q_norm, k_norm, post_attention, post_feedforward per layer + final norm.
        assert len(norms) == 4 * cfg.num_hidden_layers + 1, norms
        for name, p in model.named_parameters():
            assert not name.endswith(".bias"), name
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if name in norms else 0.08 * torch.randn_like(p))
    assert model.model.rotary_emb.attention_scaling == 1.0
    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, dtype=torch.int64)
    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=False, labels=input_ids)
    logits = out.logits.to(torch.float32).contiguous()
    assert logits.shape == (BATCH, SEQ, VOCAB) and torch.isfinite(logits).all()
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1)).to(torch.float32)
    assert torch.allclose(loss, out.loss.float(), rtol=1e-6, atol=1e-6), (loss, out.loss)

    os.makedirs(OUT_DIR, exist_ok=True)
    model.save_pretrained(OUT_DIR, safe_serialization=True)
    for extra in ("generation_config.json",):
        p = os.path.join(OUT_DIR, extra)
        if os.path.exists(p):
            os.remove(p)
    model.config.to_json_file(os.path.join(OUT_DIR, "config.json"))
    saved = load_file(os.path.join(OUT_DIR, "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(saved) == set(params), sorted(set(saved) ^ set(params))
    assert all(torch.equal(saved[k], params[k].detach()) for k in saved)
    save_file(
        {"input_ids": input_ids.contiguous(), "logits": logits, "loss": loss.reshape(())},
        os.path.join(OUT_DIR, "expected.safetensors"),
        metadata={"generator": f"transformers={transformers.__version__} torch={torch.__version__} input_seed={INPUT_SEED}"},
    )
    reloaded = Olmo2ForCausalLM.from_pretrained(OUT_DIR, attn_implementation="eager").eval()
    with torch.no_grad():
        diff = (reloaded(input_ids=input_ids, use_cache=False).logits - logits).abs().max().item()
    assert diff == 0.0, diff
    for k in sorted(saved):
        print(f"  {k:55s} {list(saved[k].shape)}")
    print(f"transformers {transformers.__version__} torch {torch.__version__}")
    print(f"max|logits| {logits.abs().max().item():.6f} loss {loss.item():.8f}")
    total = sum(os.path.getsize(os.path.join(OUT_DIR, f)) for f in os.listdir(OUT_DIR))
    print(f"wrote {OUT_DIR} ({total} bytes)")
    assert total < 1024 * 1024, total


if __name__ == "__main__":
    sys.exit(main())
