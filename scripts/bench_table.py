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

# gpu_bench.sh peers410: 410M at a micro-batch HF's peer fits on an 80 GB card, interleaved rounds.
ours410, hf410 = rows("train_410m.jsonl"), [r for r in rows("peers_410m.jsonl") if r.get("mode") == "compile"]
if ours410 and hf410:
    from statistics import median as _med
    a, h = _med(r["tokens_per_s"] for r in ours410), _med(r["tokens_per_s"] for r in hf410)
    am, hm = max(r["peak_mem_gib"] for r in ours410), max(r["peak_mem_gib"] for r in hf410)
    print()
    print(f"Pythia-410M at micro-batch {ours410[0]['micro_batch']} (medians of {len(ours410)} / {len(hf410)} interleaved runs):")
    print()
    print("| | tok/s | peak GiB |")
    print("|---|---:|---:|")
    print(f"| attnlab vanilla | {a:,.0f} | {am:.1f} |")
    print(f"| HF + torch.compile | {h:,.0f} | {hm:.1f} |")
    print(f"| ratio | **{a / h:.2f}×** | {am / hm:.2f}× |")

attn = rows("attn.jsonl")
if attn:
    print()
    print("| T | attention | implementation | fwd+bwd ms | × own causal (cuDNN via SDPA) |")
    print("|---:|---|---|---:|---:|")
    base = {r["seq_len"]: r["fwd_bwd_ms"] for r in attn if r["attention"] == "vanilla"}
    for r in attn:
        print(f"| {r['seq_len']} | {r['attention']} | {r['implementation']} | {r['fwd_bwd_ms']:.3f} | {r['fwd_bwd_ms'] / base[r['seq_len']]:.2f} |")

decode = rows("decode.jsonl")
peer = rows("decode_peer.jsonl")
if decode:
    from statistics import median

    def med(rs, key):
        return median(r[key] for r in rs) if rs else None

    print()
    print("Decode, medians over repeats (random-init weights and random tokens: cache memory and speed only;")
    print("hybrids are Llamas of the same shape; HF = ../shared/bench/hf_decode.py in the same job):")
    print()
    print("| context | attention | runs | cache bytes | × vanilla cache | prefill s | × HF eager prefill | decode tok/s | × HF static+compile | × HF eager |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    van = {r["context"]: r["cache_bytes"] for r in decode if r["attention"] == "vanilla"}
    hf = {}
    for r in peer:
        hf.setdefault((r["mode"], r["context"]), []).append(r)
    keys = sorted({(r["context"], r["attention"]) for r in decode}, key=lambda k: (k[0], k[1] != "vanilla", k[1]))
    for ctx, att in keys:
        rs = [r for r in decode if r["context"] == ctx and r["attention"] == att]
        pre, dec = med(rs, "prefill_s"), med(rs, "decode_tokens_per_s")
        eager, static = hf.get(("eager", ctx), []), hf.get(("static-compile", ctx), [])
        ratio = f"{rs[0]['cache_bytes'] / van[ctx]:.3f}" if ctx in van else "–"
        x_pre = f"{pre / med(eager, 'prefill_s'):.2f}" if eager else "–"
        x_static = f"{dec / med(static, 'decode_tok_s'):.2f}" if static else "–"
        x_eager = f"{dec / med(eager, 'decode_tok_s'):.2f}" if eager else "–"
        print(f"| {ctx} | {att} | {len(rs)} | {rs[0]['cache_bytes']:,} | {ratio} | {pre:.4f} | {x_pre} | {dec:.1f} | {x_static} | {x_eager} |")
    for (mode, ctx), rs in sorted(hf.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"| {ctx} | HF {mode} | {len(rs)} | – | – | {med(rs, 'prefill_s'):.4f} | – | {med(rs, 'decode_tok_s'):.1f} | – | – |")

# gpu_bench.sh prefill: a process's second prefill at each length (repeat 1: every per-shape plan
# built), flash and, from 16K, cuDNN (prefill_cudnn.jsonl), beside HF eager timed after two warm-ups.
prefill, prefill_cudnn, prefill_peer = rows("prefill.jsonl"), rows("prefill_cudnn.jsonl"), rows("prefill_peer.jsonl")
if prefill:
    eager = {r["context"]: r["prefill_s"] for r in prefill_peer if r["mode"] == "eager"}
    warm = lambda rs, a, c: [r["prefill_s"] for r in rs if r["attention"] == a and r["context"] == c and r["repeat"] == max(x["repeat"] for x in rs)]
    atts = list(dict.fromkeys(r["attention"] for r in prefill))
    cud = list(dict.fromkeys(r["attention"] for r in prefill_cudnn))
    cell = lambda v, c: f"{v[0]:.4f} ({v[0] / eager[c]:.2f})" if v and c in eager else (f"{v[0]:.4f}" if v else "–")
    print()
    print("Prefill, warm (the process's last repeat at each length; seconds, × HF eager in brackets):")
    print()
    print("| context | HF eager | " + " | ".join(atts + [f"{a}, cuDNN" for a in cud]) + " |")
    print("|---:|---:|" + "---:|" * (len(atts) + len(cud)))
    for c in sorted({r["context"] for r in prefill}):
        cells = [cell(warm(prefill, a, c), c) for a in atts] + [cell(warm(prefill_cudnn, a, c), c) if prefill_cudnn else "–" for a in cud]
        print(f"| {c} | {eager.get(c, float('nan')):.4f} | " + " | ".join(cells) + " |")

# Speed switches measured side by side (gpu_bench.sh kernels / band / fused): medians over repeats,
# each as a ratio to the switch's baseline in the same job.
from statistics import median as _median


def _ratio_table(title, rs, key, base, label):
    """Rows grouped by flavor; `key(r)` the variant, `base` the baseline variant's key."""
    if not rs:
        return
    print()
    print(title)
    print()
    print("| size | variant | runs | tok/s (median) | × baseline |")
    print("|---|---|---:|---:|---:|")
    by = {}
    for r in rs:
        by.setdefault((r["flavor"], key(r)), []).append(r["tokens_per_s"])
    for (flavor, variant), v in sorted(by.items()):
        b = by.get((flavor, base))
        x = f"{_median(v) / _median(b):.3f}" if b else "–"
        print(f"| {flavor.replace('pythia-', '')} | {label(variant)} | {len(v)} | {_median(v):,.0f} | {x} |")


_kernel_rows = rows("train_kernels.jsonl")
if any("variant" in r for r in _kernel_rows):
    _ratio_table("Vanilla training with each kernel switch (train_kernels.jsonl; baseline: the defaults):", _kernel_rows,
                 lambda r: r.get("variant", "?"), "base",
                 lambda v: {"base": "defaults", "heads": "heads kernel", "ce": "loss head held", "heads+ce": "heads kernel + loss head held",
                            "noheads": "aten heads op", "noln": "aten LayerNorm"}.get(v, v))
else:  # jobs before 2026-12-06: rows tagged ln_kernel / heads_kernel, baseline aten's
    _ratio_table("Vanilla training with our LayerNorm / heads kernels (train_kernels.jsonl; baseline: aten's):", _kernel_rows,
                 lambda r: (r.get("ln_kernel", 0), r.get("heads_kernel", 0)), (0, 0),
                 lambda v: {(0, 0): "aten", (1, 0): "LayerNorm kernel", (0, 1): "heads kernel", (1, 1): "both"}[v])
_ratio_table("DAR training, band kernels vs split-merge-fused (train_band.jsonl):", rows("train_band.jsonl"),
             lambda r: r.get("impl", "?"), "split-merge-fused", lambda v: v)
for _att in dict.fromkeys(r["attention"] for r in rows("train_rms.jsonl")):
    _ratio_table(f"{_att} training, RMSNorm kernel vs aten's (train_rms.jsonl):", [r for r in rows("train_rms.jsonl") if r["attention"] == _att],
                 lambda r: r.get("rms", 0), 0, lambda v: "RMSNorm kernel" if v else "aten")

fused = {p.stem.replace("decode_fused", "") or "?": rows(p.name) for p in sorted(out.glob("decode_fused*.jsonl"))}
if fused:
    names = {"1": "default", "batched": "batched", "absorbed": "rope-absorbed", "fresh": "absorbed + fresh", "scalar": "scalar", "0": "aten"}
    modes = [m for m in ["1", "batched", "absorbed", "fresh", "scalar", "0"] if m in fused] + [m for m in fused if m not in names]
    print()
    print("Decode tok/s by step (decode_fused*.jsonl, medians over repeats; × the default step):")
    print()
    print("| context | attention | " + " | ".join(names.get(m, m) for m in modes) + " |")
    print("|---:|---|" + "---:|" * len(modes))
    cells = {}
    for m, rs in fused.items():
        for r in rs:
            cells.setdefault((r["context"], r["attention"], m), []).append(r["decode_tokens_per_s"])
    for ctx, att in sorted({(c, a) for c, a, _ in cells}, key=lambda k: (k[0], k[1])):
        base = cells.get((ctx, att, "1"))
        row = []
        for m in modes:
            v = cells.get((ctx, att, m))
            row.append("–" if not v else f"{_median(v):,.0f}" + (f" ({_median(v) / _median(base):.2f}×)" if base and m != "1" else ""))
        print(f"| {ctx} | {att} | " + " | ".join(row) + " |")

hybrid = rows("decode_hybrid.jsonl")
if hybrid:
    print()
    print("STILL / LoLCATs decode tok/s with the mixing kernel (decode_hybrid.jsonl, medians; × the aten mix, and × vanilla):")
    print()
    print("| context | attention | aten mix | mixing kernel | × aten | kernel × vanilla |")
    print("|---:|---|---:|---:|---:|---:|")
    cell = {}
    for r in hybrid:
        cell.setdefault((r["context"], r["attention"], r.get("hybrid_kernel", 0)), []).append(r["decode_tokens_per_s"])
    for ctx, att in sorted({(c, a) for c, a, _ in cell if a != "vanilla"}):
        a, k = cell.get((ctx, att, 0)), cell.get((ctx, att, 1))
        v = cell.get((ctx, "vanilla", 0), []) + cell.get((ctx, "vanilla", 1), [])
        fmt = lambda x: f"{_median(x):,.0f}" if x else "–"
        ratio = f"{_median(k) / _median(a):.2f}" if a and k else "–"
        xv = f"{_median(k) / _median(v):.2f}" if k and v else "–"
        print(f"| {ctx} | {att} | {fmt(a)} | {fmt(k)} | {ratio} | {xv} |")
