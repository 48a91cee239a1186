#!/usr/bin/env python3
"""Generate the tiny GGUF fixtures of attnlab's GGUF reader (tests/fixtures/gguf_tiny/).

How to run (from the repository root; the venv is git-ignored and shared with make_smollm2_fixture.py):

    make gguf-venv && .venv-fixture/bin/python scripts/make_gguf_fixture.py

The venv pins torch 2.11.0 (CPU is enough), transformers 5.24.0, gguf 0.19.0, numpy 2.4.6 and
accelerate 1.13.0 (transformers needs it to read a GGUF). The output is reproducible for fixed versions.

What it writes:

  tiny.gguf            a random llama model written with the `gguf` package: vocab 264 (3 control
                       tokens, the 256 byte-level characters, 5 merges), hidden 64, 4 query / 2 KV
                       heads (head dim 16), FFN 96, 2 layers, RMSNorm eps 1e-5, rope base 10000, tied
                       embeddings (no output.weight). One tensor per supported storage type:
                       token_embd Q8_0; attn_q Q4_0, attn_k Q4_1 (stored in llama.cpp's interleaved
                       rotary row order, as convert_hf_to_gguf writes them), attn_v F16,
                       attn_output BF16, ffn_gate / ffn_up Q4_1, ffn_down Q8_0 (layer 0) / F32
                       (layer 1), norms F32. Tokenizer metadata: gpt2 model, smollm pre-tokenizer,
                       bos 1, eos 2, no BOS added, a ChatML chat template.
  (unsupported.gguf, kquants.gguf and kquants_expected.safetensors: make_gguf_kquant_fixture.py.)
  wrong_arch.gguf      general.architecture = gpt2, no tensors.
  bad_shape.gguf       llama metadata as tiny.gguf but blk.0.attn_k.weight of 64 rows (the metadata
                       says head_count_kv 2 × 16 = 32).
  expected.safetensors
    deq.<gguf name>    float32, numpy's dequantization (gguf.quants.dequantize) of every tensor of
                       tiny.gguf, in its stored shape (outermost first) and row order.
    input_ids          int64 [1, 24]  random ids
    logits             float32 [1, 24, 264] transformers' logits of tiny.gguf
                       (AutoModelForCausalLM.from_pretrained(dir, gguf_file="tiny.gguf"), fp32)
    text_ids           int64 transformers' tokenizer (from the same GGUF) on TEXT below
    chat_ids           int64 transformers' apply_chat_template(CHAT, add_generation_prompt=True)
"""

import os
import shutil
import sys
import tempfile

import gguf
import numpy as np
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from safetensors.torch import save_file

torch.set_num_threads(1)
OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf_tiny")
TEXT = "the thin tin hen then\nsaid: 42 is 7 x 6!"
CHAT = [{"role": "user", "content": "the hen"}]
TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
D, H, KV, F, L = 64, 4, 2, 96, 2
HD = D // H


def byte_chars():
    """GPT-2's byte → printable-character table (a public fact of byte-level BPE)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġt in"]
TOKENS = CONTROL + byte_chars() + [m.replace(" ", "") for m in MERGES]
V = len(TOKENS)


def permute(w, heads):
    """HF rotate-half rows → llama.cpp's interleaved rows (what convert_hf_to_gguf does)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def metadata(w, vocab=True):
    w.add_block_count(L)
    w.add_context_length(128)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(H)
    w.add_head_count_kv(KV)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(HD)
    w.add_vocab_size(V)
    if vocab:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(TOKENS)
        w.add_token_types([3] * len(CONTROL) + [1] * (V - len(CONTROL)))
        w.add_token_merges(MERGES)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_pad_token_id(2)
        w.add_add_bos_token(False)
        w.add_chat_template(TEMPLATE)


def write(path, arch, fill):
    w = gguf.GGUFWriter(path, arch)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def store(w, deq, name, values, qtype):
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == Q.F32:
        w.add_tensor(name, values)
        raw = values
    elif qtype == Q.F16:
        raw = values.astype(np.float16)
        w.add_tensor(name, raw)
    else:
        raw = gguf.quants.quantize(values, qtype)
        w.add_tensor(name, raw, raw_dtype=qtype)
    if deq is not None:
        deq["deq." + name] = torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(raw, qtype).astype(np.float32)).reshape(values.shape))


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(0)
    g = lambda *s: rng.normal(0, 0.08, s).astype(np.float32)
    norm = lambda n: (1 + rng.normal(0, 0.1, n)).astype(np.float32)
    deq = {}

    def tiny(w):
        metadata(w)
        store(w, deq, "token_embd.weight", g(V, D), Q.Q8_0)
        for i in range(L):
            p = f"blk.{i}."
            store(w, deq, p + "attn_norm.weight", norm(D), Q.F32)
            store(w, deq, p + "attn_q.weight", permute(g(D, D), H), Q.Q4_0)
            store(w, deq, p + "attn_k.weight", permute(g(KV * HD, D), KV), Q.Q4_1)
            store(w, deq, p + "attn_v.weight", g(KV * HD, D), Q.F16)
            store(w, deq, p + "attn_output.weight", g(D, D), Q.BF16)
            store(w, deq, p + "ffn_norm.weight", norm(D), Q.F32)
            store(w, deq, p + "ffn_gate.weight", g(F, D), Q.Q4_1)
            store(w, deq, p + "ffn_up.weight", g(F, D), Q.Q4_1)
            store(w, deq, p + "ffn_down.weight", g(D, F), Q.Q8_0 if i == 0 else Q.F32)
        store(w, deq, "output_norm.weight", norm(D), Q.F32)

    write(os.path.join(OUT, "tiny.gguf"), "llama", tiny)

    write(os.path.join(OUT, "wrong_arch.gguf"), "gpt2", lambda w: w.add_block_count(1))

    def bad_shape(w):
        metadata(w, vocab=False)
        store(w, None, "blk.0.attn_k.weight", g(D, D), Q.F32)

    write(os.path.join(OUT, "bad_shape.gguf"), "llama", bad_shape)

    # transformers' own GGUF loader is the reference for the model and the tokenizer.
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(os.path.join(OUT, "tiny.gguf"), tmp)
        model = transformers.AutoModelForCausalLM.from_pretrained(tmp, gguf_file="tiny.gguf", dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(tmp, gguf_file="tiny.gguf")
    ids = torch.from_numpy(rng.integers(0, V, (1, 24))).long()
    with torch.no_grad():
        logits = model(ids).logits.float()
    text_ids = torch.tensor(tok(TEXT).input_ids, dtype=torch.long)
    chat_ids = torch.tensor(tok.apply_chat_template(CHAT, tokenize=True, add_generation_prompt=True, return_dict=False), dtype=torch.long).reshape(-1)
    save_file({**deq, "input_ids": ids, "logits": logits.contiguous(), "text_ids": text_ids, "chat_ids": chat_ids}, os.path.join(OUT, "expected.safetensors"))
    print(f"wrote {OUT}: vocab {V}, transformers {transformers.__version__}, gguf {gguf.__version__ if hasattr(gguf, '__version__') else '?'}, text ids {text_ids.tolist()}, chat ids {chat_ids.tolist()}", file=sys.stderr)


if __name__ == "__main__":
    main()
