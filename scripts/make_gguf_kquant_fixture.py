#!/usr/bin/env python3
"""Generate the k-quant and Q5 fixtures of attnlab's GGUF reader (tests/fixtures/gguf_tiny/).

How to run (from the repository root; needs only gguf and numpy, e.g. in the venv of
make_gguf_fixture.py, or `python3 -m venv v && v/bin/pip install gguf==0.19.0 numpy==2.4.6
safetensors==0.8.0`):

    .venv-fixture/bin/python scripts/make_gguf_kquant_fixture.py

What it writes (reproducible: a fixed seed):

  kquants.gguf         one tensor per type Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, named
                       `kq.<TYPE>`, 2 rows of 2 blocks each. The blocks are random bytes (every
                       bit pattern of the packed scales and quants occurs) with their fp16 scale
                       fields set to finite values of either sign.
  kquants_expected.safetensors
    deq.kq.<TYPE>      float32, numpy's dequantization (gguf.quants.dequantize) of that tensor.
  unsupported.gguf     llama metadata (make_gguf_fixture.py's tiny model, no vocabulary) and one
                       IQ4_NL tensor `blk.0.attn_q.weight` (an error naming tensor and type).
"""

import os

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from safetensors.numpy import save_file

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "gguf_tiny")

# Byte offsets of each type's fp16 fields (ggml-common.h's block structs).
HALVES = {
    Q.Q5_0: [0],
    Q.Q5_1: [0, 2],
    Q.Q2_K: [80, 82],
    Q.Q3_K: [108],
    Q.Q4_K: [0, 2],
    Q.Q5_K: [0, 2],
    Q.Q6_K: [208],
}


def write(path, fill):
    w = gguf.GGUFWriter(path, "llama")
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main():
    rng = np.random.default_rng(20261205)
    expected = {}

    def kquants(w):
        for qtype, halves in HALVES.items():
            _, size = gguf.GGML_QUANT_SIZES[qtype]
            raw = rng.integers(0, 256, size=(4, size), dtype=np.uint8)
            for off in halves:
                h = (rng.uniform(0.01, 0.2, size=4) * rng.choice([-1.0, 1.0], size=4)).astype(np.float16)
                raw[:, off : off + 2] = h.view(np.uint8).reshape(4, 2)
            raw = raw.reshape(2, 2 * size)  # 2 rows of 2 blocks
            name = f"kq.{qtype.name}"
            w.add_tensor(name, raw, raw_dtype=qtype)
            expected["deq." + name] = np.ascontiguousarray(gguf.quants.dequantize(raw, qtype).astype(np.float32))

    write(os.path.join(OUT, "kquants.gguf"), kquants)
    save_file(expected, os.path.join(OUT, "kquants_expected.safetensors"))

    def unsupported(w):
        # make_gguf_fixture.py's tiny llama: 2 layers, hidden 64, 4 / 2 heads, FFN 96.
        w.add_block_count(2)
        w.add_context_length(128)
        w.add_embedding_length(64)
        w.add_feed_forward_length(96)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_rope_freq_base(10000.0)
        w.add_rope_dimension_count(16)
        w.add_vocab_size(264)
        _, size = gguf.GGML_QUANT_SIZES[Q.IQ4_NL]
        w.add_tensor("blk.0.attn_q.weight", rng.integers(0, 256, size=(64, 2 * size), dtype=np.uint8), raw_dtype=Q.IQ4_NL)

    write(os.path.join(OUT, "unsupported.gguf"), unsupported)


if __name__ == "__main__":
    main()
