#!/usr/bin/env python3
"""Transformers' outputs for the real SmolLM2-135M-Instruct GGUF (tests/fixtures/smollm2/expected.safetensors).

How to run (from the repository root):

    make smollm2 gguf-venv && .venv-fixture/bin/python scripts/make_smollm2_fixture.py

(`make smollm2` fetches the GGUF into data/cache/smollm2/; `make gguf-venv` makes the pinned venv:
torch 2.11.0, transformers 5.24.0, gguf 0.19.0, numpy 2.4.6, accelerate 1.13.0. CPU, one thread,
about a minute.) The reference is transformers' own GGUF loader, `from_pretrained(dir,
gguf_file=...)`, in fp32: it dequantizes with gguf-py and permutes q / k back itself.

What it writes (kept small: the full-vocabulary logits of one position, a slice of the others):

  paragraph_ids   int64   [56]          PARAGRAPH below, tokenized by transformers (no BOS)
  logits_slice    float32 [56, 1024]    logits of every position for token ids 0..1024
  logits_last     float32 [49152]       every logit of the last position
  logsumexp       float32 [56]          log Σ exp(logits) over the whole vocabulary, per position
  loss            float32 []            mean next-token cross-entropy of the paragraph (55 targets)
  chat_ids        int64                 apply_chat_template([user: QUESTION], add_generation_prompt=True)
  greedy_ids      int64   [32]          32 argmax steps after chat_ids (full recompute each step; EOS
                                        does not stop it)
"""

import os
import shutil
import sys
import tempfile

import torch
import transformers
from safetensors.torch import save_file

torch.set_num_threads(1)
ROOT = os.path.join(os.path.dirname(__file__), "..")
GGUF = os.path.join(ROOT, "data/cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
OUT = os.path.join(ROOT, "tests/fixtures/smollm2")
PARAGRAPH = (
    "The river runs through the old town, past the market and the stone church, before it reaches the sea. "
    "In summer, children swim near the bridge while their parents sit in the shade and talk about the harvest, "
    "the weather and the news from the city."
)
QUESTION = "What is the capital of France?"


def main():
    if not os.path.isfile(GGUF):
        sys.exit(f"{GGUF} is missing: run `make smollm2` first")
    with tempfile.TemporaryDirectory() as tmp:
        os.symlink(os.path.abspath(GGUF), os.path.join(tmp, "m.gguf"))
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, gguf_file="m.gguf", dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(tmp, gguf_file="m.gguf")
    ids = torch.tensor(tok(PARAGRAPH).input_ids, dtype=torch.long)
    with torch.no_grad():
        logits = model(ids[None]).logits[0].float()
        loss = torch.nn.functional.cross_entropy(logits[:-1], ids[1:])
        chat = torch.tensor(tok.apply_chat_template([{"role": "user", "content": QUESTION}], tokenize=True, add_generation_prompt=True, return_dict=False), dtype=torch.long).reshape(-1)
        seq = chat.clone()
        for _ in range(32):
            nxt = model(seq[None]).logits[0, -1].argmax()
            seq = torch.cat([seq, nxt[None]])
    greedy = seq[len(chat):]
    os.makedirs(OUT, exist_ok=True)
    save_file(
        {
            "paragraph_ids": ids,
            "logits_slice": logits[:, :1024].contiguous(),
            "logits_last": logits[-1].contiguous(),
            "logsumexp": torch.logsumexp(logits, -1).contiguous(),
            "loss": loss.reshape(()),
            "chat_ids": chat,
            "greedy_ids": greedy,
        },
        os.path.join(OUT, "expected.safetensors"),
    )
    print(f"paragraph: {len(ids)} tokens, loss {loss.item():.4f} nats/token; greedy: {greedy.tolist()} = {tok.decode(greedy)!r}", file=sys.stderr)


if __name__ == "__main__":
    main()
