#!/usr/bin/env python3
"""Generate tiny Hugging Face Llama parity fixtures for attnlab.

How to run (from the repository root):

    python3 -m venv .venv-fixture \
      && .venv-fixture/bin/pip install torch==2.11.0 transformers safetensors \
      && .venv-fixture/bin/python scripts/make_llama_fixture.py

(.venv-fixture/ is git-ignored. CPU is enough; the script pins itself to one thread.
The output is byte-for-byte reproducible for a fixed torch/transformers version.)

What it produces, under tests/fixtures/:

  llama_tiny/                 grouped-query attention, llama3 rope scaling, tied head
    config.json               model.config.to_json_file(...) (after save_pretrained, so
                              `architectures` is filled in). transformers >= 5 writes the
                              rope settings as `rope_parameters` (not `rope_scaling`).
    model.safetensors         exactly the file save_pretrained writes: fp32, HF checkpoint
                              names (model.embed_tokens.weight, model.layers.N.self_attn.
                              q_proj.weight, ..., model.norm.weight). Non-persistent buffers
                              (rotary inv_freq) are not included. With tied embeddings
                              save_pretrained does NOT write lm_head.weight: a loader must
                              use model.embed_tokens.weight as the output head.
    expected.safetensors      input_ids int64   [2, 200]
                              logits    float32 [2, 200, 128]
                              loss      float32 []  mean next-token cross-entropy over the
                                        batch (targets = inputs shifted by 1)

  llama_tiny_untied/          plain multi-head attention, default rope, untied head
    config.json, model.safetensors (includes lm_head.weight), expected.safetensors
                              as above.
    sharded/                  the same weights written by save_pretrained with a small
                              max_shard_size: model.safetensors.index.json +
                              model-0000K-of-0000N.safetensors, plus a copy of config.json.

Models (both): vocab 128, hidden 64, intermediate 176, 2 layers, 4 query heads
(head_dim 16), RMSNorm eps 1e-5, SiLU gated MLP, no biases, eager attention, fp32.
  llama_tiny:        num_key_value_heads 2, rope_theta 500000, rope type llama3
                     (factor 8, low_freq_factor 1, high_freq_factor 4,
                     original_max_position_embeddings 64: small on purpose so that the
                     high / smoothed / low frequency bands all occur at head_dim 16 and
                     the adjustment matters within 200 positions), tie_word_embeddings.
  llama_tiny_untied: num_key_value_heads 4, rope_theta 10000, default rope, untied.

Every parameter is overwritten with random values (weights N(0, 0.08), RMSNorm weights
1 + N(0, 0.1)) after torch.manual_seed(0), so no norm gain is trivially 1.
"""

import json
import math
import os
import shutil
import sys
import tempfile

import torch
import torch.nn.functional as F
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRMSNorm

torch.set_num_threads(1)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES_DIR = os.path.join(REPO_ROOT, "tests", "fixtures")

BATCH, SEQ, VOCAB = 2, 200, 128
INPUT_SEED = 1234
SHARD_SIZE = "200KB"  # the untied model is ~470 kB of fp32 -> 3 shards

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}

FIXTURES = {
    "llama_tiny": dict(
        num_key_value_heads=2,
        rope_theta=500000.0,
        rope_scaling=LLAMA3_ROPE,
        tie_word_embeddings=True,
    ),
    "llama_tiny_untied": dict(
        num_key_value_heads=4,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
    ),
}


def build_config(num_key_value_heads, rope_theta, rope_scaling, tie_word_embeddings) -> LlamaConfig:
    kwargs = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        attention_dropout=0.0,
        use_cache=False,
        attn_implementation="eager",
        dtype="float32",
    )
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)
    cfg = LlamaConfig(**kwargs)
    cfg._attn_implementation = "eager"

    # Sanity: the rope kwargs must have taken effect.
    rp = getattr(cfg, "rope_parameters", None)
    if rp is not None:  # transformers >= 5
        assert float(rp["rope_theta"]) == rope_theta, rp
        if rope_scaling is None:
            assert rp.get("rope_type", "default") == "default", rp
        else:
            for k, v in rope_scaling.items():
                assert rp[k] == v, (k, rp)
    else:  # older transformers
        assert cfg.rope_theta == rope_theta and cfg.rope_scaling == rope_scaling
    assert cfg.head_dim == 16 and cfg.num_key_value_heads == num_key_value_heads
    assert cfg.tie_word_embeddings == tie_word_embeddings
    return cfg


@torch.no_grad()
def randomize_(model: torch.nn.Module) -> None:
    norm_params = set()
    for mod_name, mod in model.named_modules():
        if isinstance(mod, LlamaRMSNorm):
            prefix = f"{mod_name}." if mod_name else ""
            norm_params.add(prefix + "weight")
    assert len(norm_params) == 2 * model.config.num_hidden_layers + 1, norm_params
    # named_parameters() de-duplicates, so a tied head is randomised once (via embed_tokens).
    for name, p in model.named_parameters():
        if name in norm_params:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
        else:
            assert not name.endswith(".bias"), name
            p.copy_(0.08 * torch.randn_like(p))


@torch.no_grad()
def check_rope(model: LlamaForCausalLM, cfg: LlamaConfig) -> None:
    """Independently recompute inv_freq (llama3 formula or plain) and compare to the module's buffer."""
    rp = cfg.rope_parameters
    dim = cfg.head_dim
    inv = 1.0 / (rp["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rp["rope_type"] == "llama3":
        factor, lo, hi = rp["factor"], rp["low_freq_factor"], rp["high_freq_factor"]
        old = rp["original_max_position_embeddings"]
        out = []
        bands = []
        for f in inv.tolist():
            wl = 2 * math.pi / f
            if wl < old / hi:
                out.append(f)
                bands.append("high")
            elif wl > old / lo:
                out.append(f / factor)
                bands.append("low")
            else:
                s = (old / wl - lo) / (hi - lo)
                out.append((1 - s) * f / factor + s * f)
                bands.append("mid")
        # The fixture is only useful if every band is exercised.
        assert {"high", "mid", "low"} <= set(bands), bands
        print(f"  llama3 bands per frequency: {bands}")
        inv = torch.tensor(out, dtype=torch.float32)
    else:
        assert rp["rope_type"] == "default", rp
    got = model.model.rotary_emb.inv_freq
    assert torch.allclose(got, inv, rtol=1e-6, atol=0), (got, inv)
    assert model.model.rotary_emb.attention_scaling == 1.0, model.model.rotary_emb.attention_scaling
    print(f"  inv_freq {[f'{x:.6g}' for x in got.tolist()]}")


def logits_of(model, input_ids):
    with torch.no_grad():
        return model(input_ids=input_ids, use_cache=False).logits.to(torch.float32)


def make_fixture(name: str, spec: dict) -> dict:
    print(f"== {name}")
    out_dir = os.path.join(FIXTURES_DIR, name)
    cfg = build_config(**spec)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    randomize_(model)
    model.eval()
    assert model.config._attn_implementation == "eager", model.config._attn_implementation

    head = model.lm_head.weight
    emb = model.model.embed_tokens.weight
    tied = head.data_ptr() == emb.data_ptr()
    assert tied == spec["tie_word_embeddings"], (tied, spec)
    check_rope(model, cfg)

    params = dict(model.named_parameters(remove_duplicate=False))

    # Inputs.
    gen = torch.Generator().manual_seed(INPUT_SEED)
    input_ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen, dtype=torch.int64)

    with torch.no_grad():
        out = model(input_ids=input_ids, use_cache=False, labels=input_ids)
    logits = out.logits.to(torch.float32).contiguous()
    assert logits.shape == (BATCH, SEQ, VOCAB), logits.shape
    assert torch.isfinite(logits).all()
    loss = F.cross_entropy(
        logits[:, :-1, :].reshape(-1, VOCAB), input_ids[:, 1:].reshape(-1), reduction="mean"
    ).to(torch.float32)
    assert torch.allclose(loss, out.loss.float(), rtol=1e-6, atol=1e-6), (loss, out.loss)

    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        # Single-file checkpoint: keep exactly what save_pretrained writes.
        model.save_pretrained(td, safe_serialization=True)
        saved = load_file(os.path.join(td, "model.safetensors"))
        with safe_open(os.path.join(td, "model.safetensors"), "pt") as f:
            st_meta = f.metadata()
        # Every saved tensor is a parameter with identical values; every parameter is saved
        # except (possibly) the tied head.
        for k, v in saved.items():
            assert k in params, k
            assert v.dtype == torch.float32 and torch.equal(v, params[k].detach()), k
        missing = set(params) - set(saved)
        assert missing <= {"lm_head.weight"}, missing
        if not tied:
            assert not missing, missing
        shutil.copyfile(os.path.join(td, "model.safetensors"), os.path.join(out_dir, "model.safetensors"))
    # config.json written after save_pretrained has set `architectures`.
    model.config.to_json_file(os.path.join(out_dir, "config.json"))
    save_file(
        {"input_ids": input_ids.contiguous(), "logits": logits, "loss": loss.reshape(())},
        os.path.join(out_dir, "expected.safetensors"),
        # One key only: safetensors writes metadata from a hash map, so several keys
        # would come out in random order and the file bytes would change between runs.
        metadata={
            "generator": f"transformers={transformers.__version__} torch={torch.__version__} "
            f"input_seed={INPUT_SEED}",
        },
    )

    # Round trip: reload the fixture through HF and recompute.
    reloaded = LlamaForCausalLM.from_pretrained(out_dir, attn_implementation="eager").eval()
    if tied:
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    max_diff = (logits_of(reloaded, input_ids) - logits).abs().max().item()
    assert max_diff == 0.0, f"round-trip mismatch {max_diff}"
    # Expected file round trip.
    exp = load_file(os.path.join(out_dir, "expected.safetensors"))
    assert torch.equal(exp["input_ids"], input_ids) and torch.equal(exp["logits"], logits)
    assert exp["loss"].shape == () and torch.equal(exp["loss"], loss)

    shard_info = None
    if not tied:
        shard_dir = os.path.join(out_dir, "sharded")
        if os.path.isdir(shard_dir):
            shutil.rmtree(shard_dir)
        os.makedirs(shard_dir)
        with tempfile.TemporaryDirectory() as td:
            model.save_pretrained(td, safe_serialization=True, max_shard_size=SHARD_SIZE)
            with open(os.path.join(td, "model.safetensors.index.json")) as f:
                index = json.load(f)
            shard_files = sorted(set(index["weight_map"].values()))
            assert len(shard_files) >= 2, shard_files
            assert set(index["weight_map"]) == set(saved), sorted(set(index["weight_map"]) ^ set(saved))
            for fn in ["model.safetensors.index.json"] + shard_files:
                shutil.copyfile(os.path.join(td, fn), os.path.join(shard_dir, fn))
        shutil.copyfile(os.path.join(out_dir, "config.json"), os.path.join(shard_dir, "config.json"))
        # Shards hold the same tensors as the single file.
        merged = {}
        for fn in shard_files:
            part = load_file(os.path.join(shard_dir, fn))
            assert not (set(part) & set(merged))
            for k in part:
                assert index["weight_map"][k] == fn, k
            merged.update(part)
        assert set(merged) == set(saved) and all(torch.equal(merged[k], saved[k]) for k in saved)
        resharded = LlamaForCausalLM.from_pretrained(shard_dir, attn_implementation="eager").eval()
        shard_diff = (logits_of(resharded, input_ids) - logits).abs().max().item()
        assert shard_diff == 0.0, f"sharded round-trip mismatch {shard_diff}"
        shard_info = dict(index=index, files=shard_files, max_diff=shard_diff)

    print(f"  lm_head.weight in model.safetensors: {'lm_head.weight' in saved} (tied={tied})")
    print(f"  model.safetensors metadata: {st_meta}")
    print("  parameters (model.safetensors):")
    for k in sorted(saved):
        print(f"    {k:50s} {list(saved[k].shape)}")
    print(f"  n_params {sum(v.numel() for v in saved.values())}")
    print(f"  max|logits| {logits.abs().max().item():.6f}")
    print(f"  loss {loss.item():.8f}")
    print(f"  round-trip max|diff| {max_diff}")
    if shard_info is not None:
        print(f"  shards {shard_info['files']}  sharded round-trip max|diff| {shard_info['max_diff']}")
        print(f"  index metadata {shard_info['index']['metadata']}")
    print(f"  wrote {out_dir}")
    return dict(loss=loss.item(), max_logit=logits.abs().max().item())


def main() -> None:
    print(f"transformers {transformers.__version__}")
    print(f"torch {torch.__version__}")
    for name, spec in FIXTURES.items():
        make_fixture(name, spec)

    total = 0
    print("files:")
    for name in FIXTURES:
        for root, _, files in sorted(os.walk(os.path.join(FIXTURES_DIR, name))):
            for fn in sorted(files):
                p = os.path.join(root, fn)
                sz = os.path.getsize(p)
                total += sz
                print(f"  {os.path.relpath(p, FIXTURES_DIR):60s} {sz:>9d}")
    print(f"  total {total} bytes")
    assert total < 2 * 1024 * 1024, total


if __name__ == "__main__":
    sys.exit(main())
