#!/usr/bin/env python3
"""Summarize `attnlab eval --task ruler:…` per-sample records of a STILL run (ruler_samples/*.jsonl,
src/eval/ruler/diagnose.rs) for the STILL retrieval diagnosis (BENCHMARKS.md): per cell, accuracy
overall and split by where the needle's value tokens are at the answer position (all inside the 2C
window / outside), how many of the outside value tokens are selected (by ≥ 1 head, and over
(head, token) pairs), and the normalizer shares [window, selected, linear] averaged over layers.
Usage: scripts/still_diag_summary.py RUN_DIR [HEADS] [--layers]   (HEADS per layer, default 6; --layers: shares per layer)
"""
import json, pathlib, sys

run = pathlib.Path(sys.argv[1]); heads = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 6
rows = []
for f in sorted((run / "ruler_samples").glob("*.jsonl")):
    recs = [json.loads(l) for l in f.open()]
    name = f.stem
    length = recs[0]["length"]
    tag = name.split(f"-{length}", 1)[1].lstrip("-") or "(none)"
    if not recs[0].get("layers"):  # not a hybrid: accuracy only
        rows.append(dict(tag=tag, length=length, n=len(recs), acc=sum(r["score"] for r in recs) / len(recs), n_in=0, acc_in=float("nan"), n_out=0, acc_out=float("nan"),
                         any=float("nan"), pairs=float("nan"), n_full=0, acc_full=float("nan"), shares=[], layer_shares=[], pair_layers=[]))
        continue
    inwin = [r for r in recs if r["layers"][0]["value_neither"] + r["layers"][0]["value_selected"] == 0]
    out = [r for r in recs if r not in inwin]
    acc = lambda rs: (sum(r["score"] for r in rs) / len(rs)) if rs else float("nan")  # score is already %
    # outside-window value tokens: per (sample, layer, token) selected by ≥1 head; per (…, head)
    any_sel = tot = pair_sel = 0
    full = []  # samples whose every outside value token is selected by every head in every layer
    for r in out:
        ok = True
        for l in r["layers"]:
            outside = l["value_selected"] + l["value_neither"]
            tot += outside
            any_sel += l["value_selected"]
            pair_sel += sum(l["heads_selecting"])  # 0 for window tokens
            if sum(l["heads_selecting"]) < outside * heads:
                ok = False
        full.append(ok)
    layers = recs[0]["layers"] or []
    # per layer: share of (head, outside value token) pairs selected
    pair_layers = [100.0 * sum(sum(r["layers"][i]["heads_selecting"]) for r in out) / max(heads * sum(len(r["layers"][i]["heads_selecting"]) for r in out), 1) for i in range(len(layers))]
    shares = [sum(r["layers"][i]["shares_mean"][k] for r in recs) / len(recs) for i in range(len(layers)) for k in range(3)]
    mean_sh = [sum(shares[i * 3 + k] for i in range(len(layers))) / max(len(layers), 1) for k in range(3)]
    rows.append(dict(tag=tag, length=length, n=len(recs), acc=acc(recs), n_in=len(inwin), acc_in=acc(inwin), n_out=len(out), acc_out=acc(out),
                     any=100.0 * any_sel / tot if tot else float("nan"), pairs=100.0 * pair_sel / (tot * heads) if tot else float("nan"),
                     n_full=sum(full), acc_full=acc([r for r, f in zip(out, full) if f]), shares=mean_sh,
                     layer_shares=[shares[i * 3:(i + 1) * 3] for i in range(len(layers))], pair_layers=pair_layers))
print("| overrides | T | n | S-NIAH-1 % | in window: n / % | outside: n / % | outside value tokens selected, ≥1 head % | (head, token) pairs % | outside samples fully selected: n / % | shares win / sel / lin (mean over layers) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
for r in sorted(rows, key=lambda r: (r["tag"], r["length"])):
    f = lambda x: "–" if x != x else f"{x:.1f}"
    print(f"| {r['tag']} | {r['length']} | {r['n']} | {f(r['acc'])} | {r['n_in']} / {f(r['acc_in'])} | {r['n_out']} / {f(r['acc_out'])} | {f(r['any'])} | {f(r['pairs'])} | {r['n_full']} / {f(r['acc_full'])} | "
          + " / ".join(f"{100*s:.1f}" for s in r["shares"]) + " |")
if "--layers" in sys.argv:
    for r in sorted(rows, key=lambda r: (r["tag"], r["length"])):
        print(r["tag"], r["length"], "shares per layer [win,sel,lin]:", " ".join("[" + ",".join(f"{100*s:.0f}" for s in ls) + "]" for ls in r["layer_shares"]),
              "| (head, value token) pairs selected per layer %:", " ".join(f"{p:.0f}" for p in r["pair_layers"]))
