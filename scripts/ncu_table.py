#!/usr/bin/env python3
"""Summarise `scripts/gpu_bench.sh ncu`'s Nsight Compute CSV (raw page, one block per "== KIND LEN"
line) as a Markdown table per (kind, length, kernel): launches, mean duration, grid, registers,
occupancy, DRAM throughput, and the largest warp-stall reasons (cycles per issued instruction)."""
import csv
import io
import re
import sys
from collections import defaultdict


def blocks(path):
    tag, lines = None, []
    for line in open(path, encoding="utf-8", errors="replace"):
        if line.startswith("== "):
            if tag and lines:
                yield tag, lines
            tag, lines = line[3:].strip(), []
        elif line.startswith('"'):
            lines.append(line)
    if tag and lines:
        yield tag, lines


def num(x):
    try:
        return float(str(x).replace(",", ""))
    except ValueError:
        return None


def short(name):
    name = re.sub(r"\(anonymous namespace\)::", "", name)
    return name.split("(")[0][:60]


def main(path):
    want = {
        "gpu__time_duration.sum": "µs",
        "launch__grid_size": "grid",
        "launch__registers_per_thread": "regs",
        "sm__warps_active.avg.pct_of_peak_sustained_active": "occ %",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram %",
        "smsp__cycles_active.avg": "cycles",
    }
    for tag, lines in blocks(path):
        rows = list(csv.reader(io.StringIO("".join(lines))))
        if len(rows) < 3:
            print(f"### {tag}\n\nno kernels profiled\n")
            continue
        head, units, data = rows[0], rows[1], rows[2:]
        col = {h: i for i, h in enumerate(head)}
        kname = col.get("Kernel Name")
        stalls = [h for h in head if "warp_latency_issue_stalled" in h or "average_warps_issue_stalled" in h]
        groups = defaultdict(list)
        for r in data:
            if kname is not None and len(r) == len(head):
                groups[short(r[kname])].append(r)
        print(f"### {tag}\n")
        print("| kernel | n | " + " | ".join(want.values()) + " | top stalls (per issued instr.) |")
        print("|---|---:|" + "---:|" * len(want) + "---|")
        for k, rs in groups.items():
            cells = []
            for m, label in want.items():
                vals = [num(r[col[m]]) for r in rs] if m in col else []
                vals = [v for v in vals if v is not None]
                v = sum(vals) / len(vals) if vals else None
                if v is not None and m == "gpu__time_duration.sum" and units[col[m]].strip() in ("ns", "nsecond"):
                    v /= 1000
                if v is not None and m == "gpu__time_duration.sum" and units[col[m]].strip() in ("ms", "msecond"):
                    v *= 1000
                cells.append("" if v is None else f"{v:.3g}")
            st = []
            for h in stalls:
                vals = [num(r[col[h]]) for r in rs]
                vals = [v for v in vals if v is not None]
                if vals:
                    st.append((sum(vals) / len(vals), re.sub(r".*stalled_", "", h).split(".")[0]))
            st.sort(reverse=True)
            print(f"| {k} | {len(rs)} | " + " | ".join(cells) + " | " + ", ".join(f"{n} {v:.2g}" for v, n in st[:5]) + " |")
        print()


if __name__ == "__main__":
    main(sys.argv[1])
