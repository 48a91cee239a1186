#!/usr/bin/env python3
"""Issue 34: a decode call's wall time split into a per-call cost and a per-step one, from
`scripts/gpu_bench.sh dtiming`'s rows (OUT/decode_tokens.jsonl: bench-decode at two numbers of new
tokens, rows tagged "switch"). A call of n new tokens runs n − 1 steps in t(n) = (n − 1) / tok/s;
with two n, per step = (t(n2) − t(n1)) / (n2 − n1) and per call = t(n1) − (n1 − 1) · per step.
Medians over the repeats. Prints a Markdown table per switch value.

    python3 scripts/dtiming_table.py OUT/decode_tokens.jsonl
"""
import json
import statistics
import sys
from collections import defaultdict


def main(path):
    rows = [json.loads(line) for line in open(path) if line.startswith("{")]
    tps = defaultdict(list)
    for r in rows:
        tps[(r.get("switch", 1), r["attention"], r["context"], r["new_tokens"])].append(r["decode_tokens_per_s"])
    for switch in sorted({k[0] for k in tps}, reverse=True):
        keys = sorted({(k[1], k[2]) for k in tps if k[0] == switch}, key=lambda k: (k[1], k[0]))
        ns = sorted({k[3] for k in tps if k[0] == switch})
        if len(ns) < 2:
            sys.exit(f"{path}: need rows at two numbers of new tokens, found {ns}")
        n1, n2 = ns[0], ns[-1]
        print(f"\n### switch {switch}: {n1} and {n2} new tokens (medians of {len(next(iter(tps.values())))} repeats)\n")
        print(f"| context | attention | tok/s at {n1} | tok/s at {n2} | per step ms | per call ms |")
        print("|---:|---|---:|---:|---:|---:|")
        for att, ctx in keys:
            a, b = (tps.get((switch, att, ctx, n)) for n in (n1, n2))
            if not a or not b:
                continue
            a, b = statistics.median(a), statistics.median(b)
            t1, t2 = (n1 - 1) / a, (n2 - 1) / b
            step = (t2 - t1) / (n2 - n1)
            call = t1 - (n1 - 1) * step
            print(f"| {ctx} | {att} | {a:,.0f} | {b:,.0f} | {step * 1e3:.3f} | {call * 1e3:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
