#!/usr/bin/env python3
"""Generate a tiny Hugging Face GPT-NeoX parity fixture for attnlab.

How to run (from the repository root):

    python3 -m venv .venv-fixture \
      && .venv-fixture/bin/pip install torch==2.11.0 transformers safetensors \
      && .venv-fixture/bin/python scripts/make_neox_fixture.py

(.venv-fixture/ is git-ignored. CPU is enough; the script pins itself to one thread.)

What it produces, in tests/fixtures/neox_tiny/:

  model.safetensors     fp32 state dict of a randomly initialised
                        transformers.GPTNeoXForCausalLM, using the Hugging Face
                        *checkpoint* parameter names (gpt_neox.embed_in.weight,
                        gpt_neox.layers.N.attention.query_key_value.weight, ...,
                        embed_out.weight). Non-parameter buffers (rotary inv_freq,
                        legacy attention.bias / masked_bias) are not included.
                        Note: transformers >= 5 calls the output head `lm_head`
                        in memory and renames it to/from `embed_out` on
                        save/load; this file uses the on-disk name `embed_out`.
  config.json           model.config.to_json_file(...)
  expected.safetensors  input_ids  int64   [2, 300]   (positions > 256 included)
                        logits     float32 [2, 300, 128]
                        loss       float32 []  mean next-token cross-entropy
                                   over the batch (targets = inputs shifted by 1)

Model: vocab 128, hidden 64, 2 layers, 4 heads (head_dim 16), intermediate 256,
rotary_pct 0.25 (rotary dims 4), rotary base 10000, parallel residual, erf GELU,
LayerNorm eps 1e-5, untied output head, biased attention, eager attention, fp32.

Every parameter is overwritten with random values (weights N(0, 0.08), biases
N(0, 0.02), LayerNorm weights 1 + N(0, 0.1), LayerNorm biases N(0, 0.05)) so
that no bias / LN affine term is trivially 0 or 1.
"""

import os
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

torch.set_num_threads(1)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "tests", "fixtures", "neox_tiny")

BATCH, SEQ, VOCAB = 2, 300, 128
INPUT_SEED = 1234

# In-memory module name -> on-disk (HF checkpoint) name. transformers >= 5
# renames `embed_out` (checkpoint) to `lm_head` (module) when loading.
RENAME_TO_CHECKPOINT = {"lm_head.weight": "embed_out.weight"}


def build_config() -> GPTNeoXConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        rotary_pct=0.25,
        rotary_emb_base=10000,
        max_position_embeddings=2048,
        use_parallel_residual=True,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        tie_word_embeddings=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="eager",
        dtype="float32",
    )
    if "attention_bias" in GPTNeoXConfig().to_dict():
        kwargs["attention_bias"] = True
    cfg = GPTNeoXConfig(**kwargs)
    cfg._attn_implementation = "eager"

    # Sanity: the legacy rotary kwargs must have taken effect.
    rp = getattr(cfg, "rope_parameters", None)
    if rp is not None:
        assert abs(rp["partial_rotary_factor"] - 0.25) < 1e-12, rp
        assert float(rp["rope_theta"]) == 10000.0, rp
        assert rp.get("rope_type", "default") == "default", rp
    else:  # older transformers
        assert cfg.rotary_pct == 0.25 and cfg.rotary_emb_base == 10000
    return cfg


@torch.no_grad()
def randomize_(model: torch.nn.Module) -> None:
    layer_norm_params = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, torch.nn.LayerNorm):
            prefix = f"{mod_name}." if mod_name else ""
            layer_norm_params.add(prefix + "weight")
            layer_norm_params.add(prefix + "bias")
    for name, p in model.named_parameters():
        if name in layer_norm_params and name.endswith(".weight"):
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        elif name in layer_norm_params and name.endswith(".bias"):
            p.copy_(0.05 * torch.randn_like(p))
        elif name.endswith(".bias"):
            p.copy_(0.02 * torch.randn_like(p))
        else:
            p.copy_(0.08 * torch.randn_like(p))


def main() -> None:
    print(f"transformers {transformers.__version__}")
    print(f"torch {torch.__version__}")

    cfg = build_config()
    torch.manual_seed(0)
    model = GPTNeoXForCausalLM(cfg).to(torch.float32)
    randomize_(model)
    model.eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation

    # State dict: parameters only (no buffers), checkpoint names.
    params = dict(model.named_parameters(remove_duplicate=False))
    assert params["lm_head.weight"].data_ptr() != params["gpt_neox.embed_in.weight"].data_ptr(), "head is tied"
    state = {}
    for name, p in params.items():
        state[RENAME_TO_CHECKPOINT.get(name, name)] = p.detach().to(torch.float32).contiguous().clone()
    assert "embed_out.weight" in state

    # Cross-check names against what save_pretrained would write.
    with tempfile.TemporaryDirectory() as td:
        model.save_pretrained(td, safe_serialization=True)
        saved = load_file(os.path.join(td, "model.safetensors"))
        assert set(saved) == set(state), (sorted(set(saved) ^ set(state)))
        for k in state:
            assert torch.equal(saved[k], state[k]), k

    # Inputs.
    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, dtype=torch.int64)

    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=False, labels=input_ids)
    logits = out.logits.to(torch.float32).contiguous()
    assert logits.shape == (BATCH, SEQ, VOCAB), logits.shape
    loss = F.cross_entropy(
        logits[:, :-1, :].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1), reduction="mean"
    ).to(torch.float32)
    assert torch.allclose(loss, out.loss.float(), rtol=1e-6, atol=1e-6), (loss, out.loss)

    os.makedirs(OUT_DIR, exist_ok=True)
    save_file(state, os.path.join(OUT_DIR, "model.safetensors"), metadata={"format": "pt"})
    model.config.to_json_file(os.path.join(OUT_DIR, "config.json"))
    save_file(
        {"input_ids": input_ids.contiguous(), "logits": logits, "loss": loss.reshape(())},
        os.path.join(OUT_DIR, "expected.safetensors"),
        # One key only: safetensors writes metadata from a hash map, so several keys
        # would come out in random order and the file bytes would change between runs.
        metadata={
            "generator": f"transformers={transformers.__version__} torch={torch.__version__} "
            f"input_seed={INPUT_SEED}",
        },
    )

    # Round trip: reload the fixture through HF and recompute.
    reloaded = GPTNeoXForCausalLM.from_pretrained(OUT_DIR, attn_implementation="eager").eval()
    with torch.no_grad():
        logits2 = reloaded(input_ids=input_ids, use_cache=False).logits
    max_diff = (logits2 - logits).abs().max().item()
    assert max_diff == 0.0, f"round-trip mismatch {max_diff}"

    print("parameters (model.safetensors):")
    for k in sorted(state):
        print(f"  {k:60s} {list(state[k].shape)}")
    print(f"n_params {sum(v.numel() for v in state.values())}")
    print(f"max|logits| {logits.abs().max().item():.6f}")
    print(f"loss {loss.item():.8f}")
    print(f"round-trip max|diff| {max_diff}")
    print(f"wrote {OUT_DIR}")


if __name__ == "__main__":
    sys.exit(main())
