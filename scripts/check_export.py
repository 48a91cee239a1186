#!/usr/bin/env python3
"""Cross-check `attnlab export` with Hugging Face transformers: load the exported folder with
AutoModelForCausalLM (with trust_remote_code: a non-vanilla export runs the attnlab modeling code it
carries) and compare its fp32 logits with `attnlab forward` on the same token ids.
Usage: check_export.py HF_DIR TOKENS_FILE ATTNLAB_LOGITS.safetensors  (needs torch, transformers)."""
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

hf_dir, tokens, logits_file = sys.argv[1:4]
ids = torch.tensor([[int(t) for t in open(tokens).read().split()]])
model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, trust_remote_code=True).eval()
with torch.no_grad():
    hf = model(ids).logits[0]
ours = load_file(logits_file)["logits"]
diff = (hf - ours).abs().max().item()
scale = max(1.0, hf.abs().max().item())
print(f"{type(model).__name__}: max |Δlogits| = {diff:.3e} (max |logits| {hf.abs().max().item():.2f})")
sys.exit(0 if diff <= 1e-4 * scale else 1)
