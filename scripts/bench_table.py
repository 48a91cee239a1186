#!/usr/bin/env python3
"""Print the ratio tables of a GPU bench job (scripts/gpu_bench.sh): attnlab training throughput for
vanilla / DAR / uniform against Hugging Face + torch.compile (../shared/bench/hf_pythia_train.py)
measured in the same job, and the attention-op timings. Usage: bench_table.py OUT_DIR"""
import json
import sys
from pathlib import Path

out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")


def rows(name):
    p = out / name
    return [json.loads(l) for l in p.read_text().splitlines() if l.startswith("{")] if p.exists() else []


train = rows("train.jsonl")
peers = {r["size"]: r for r in rows("peers.jsonl") if r.get("mode") == "compile"}
print("| size | micro-batch | attention | attnlab tok/s | MFU | peak GiB | × HF+compile tok/s | × HF peak mem | × own vanilla |")
print("|---|---:|---|---:|---:|---:|---:|---:|---:|")
vanilla = {r["flavor"]: r for r in train if r["attention"] == "vanilla"}
for r in train:
    size = r["flavor"].replace("pythia-", "")
    hf = peers.get(size)
    v = vanilla.get(r["flavor"])
    ratio = f"{r['tokens_per_s'] / hf['tokens_per_s']:.2f}" if hf else "–"
    mem = f"{r['peak_mem_gib'] / hf['peak_mem_gib']:.2f}" if hf else "–"
    own = f"{r['tokens_per_s'] / v['tokens_per_s']:.2f}" if v else "–"
    print(f"| {size} | {r['micro_batch']} | {r['attention']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | {r['peak_mem_gib']:.1f} | {ratio} | {mem} | {own} |")
for size, hf in sorted(peers.items()):
    print(f"| {size} | {hf['batch_size']} | HF + torch.compile | {hf['tokens_per_s']:,.0f} | {100 * hf['mfu']:.1f}% | {hf['peak_mem_gib']:.1f} | 1.00 | 1.00 | – |")

attn = rows("attn.jsonl")
if attn:
    print()
    print("| T | attention | implementation | fwd+bwd ms | × own causal (cuDNN via SDPA) |")
    print("|---:|---|---|---:|---:|")
    base = {r["seq_len"]: r["fwd_bwd_ms"] for r in attn if r["attention"] == "vanilla"}
    for r in attn:
        print(f"| {r['seq_len']} | {r['attention']} | {r['implementation']} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_ms'] / base[r['seq_len']]:.2f} |")

decode = rows("decode.jsonl")
if decode:
    print()
    print("Decode (random-init weights and random tokens: cache memory and speed only; hybrids are Llamas of the same shape):")
    print()
    print("| context | attention | cache bytes | bytes/token | × vanilla cache | prefill s | decode tok/s |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    van = {r["context"]: r["cache_bytes"] for r in decode if r["attention"] == "vanilla"}
    for r in sorted(decode, key=lambda r: (r["context"], r["attention"] != "vanilla", r["attention"])):
        ratio = f"{r['cache_bytes'] / van[r['context']]:.3f}" if r["context"] in van else "–"
        print(f"| {r['context']} | {r['attention']} | {r['cache_bytes']:,} | {r['cache_bytes_per_token']:,.0f} | {ratio} | {r['prefill_s']:.3f} | {r['decode_tokens_per_s']:.1f} |")
