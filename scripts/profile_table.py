#!/usr/bin/env python3
"""Where the time goes (issue 28): summarise the traces of `attnlab bench --profile DIR`.

Reads DIR/runs.jsonl (one line per trace: trace file, repetitions, the measurement) and each Chrome
trace, files every device event (kernel, memcpy, memset) under a label, and prints one markdown table
per trace: label, ms per repetition, share of device time, events per repetition, the largest kernel.
Writes DIR/where_time_goes.csv (trace, label, ms_per_rep, share, events_per_rep, top_kernel) and
DIR/top_kernels.csv (trace, kernel, ms_per_rep, calls_per_rep).

A device event's label: the innermost named scope (attnlab's `dar.*` / `attn.*` scopes, csrc and
src/attention/layer.rs) around the host call that launched it, else the outermost host op around
that call (e.g. `aten::linear`, `autograd::engine::evaluate_function: MmBackward0`), else
`(unattributed)`. The `bench.*` scopes only mark repetitions. On a CPU-only trace (no device events)
the host ops are summarised the same way, by their own time.

Usage: profile_table.py DIR        profile_table.py --self-test
Fails (exit 1) when a CUDA trace holds no device events or a trace is missing.
"""
import bisect
import collections
import csv
import json
import os
import sys

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
LAUNCH_CATS = {"cuda_runtime", "cuda_driver"}


def fail(msg):
    print(f"profile_table.py: {msg}", file=sys.stderr)
    sys.exit(1)


class Threads:
    """Per-thread host intervals (named scopes and ops), answering 'what encloses ts on tid'."""

    def __init__(self, events):
        by_tid = collections.defaultdict(list)
        for e in events:
            cat = e.get("cat")
            if e.get("ph") == "X" and cat in ("user_annotation", "cpu_op"):
                kind = "scope" if cat == "user_annotation" else "op"
                by_tid[(e.get("pid"), e.get("tid"))].append((e["ts"], e["ts"] + e.get("dur", 0), e["name"], kind))
        self.by_tid = by_tid
        self.cache = {}

    def label(self, key, ts):
        if key not in self.by_tid:
            return "(unattributed)"
        if key not in self.cache:
            self.cache[key] = Sweep(self.by_tid[key])
        stack = self.cache[key].at(ts)
        scopes = [iv for iv in stack if iv[3] == "scope" and not iv[2].startswith("bench.")]
        if scopes:
            return scopes[-1][2]
        ops = [iv for iv in stack if iv[3] == "op"]
        return ops[0][2] if ops else "(unattributed)"


class Sweep:
    """Intervals of one thread, properly nested: the containing stack of a time by bisection over a
    flattened nesting (each interval keeps its parent)."""

    def __init__(self, intervals):
        intervals = sorted(intervals, key=lambda x: (x[0], -x[1]))
        self.starts = [iv[0] for iv in intervals]
        self.ivs = intervals
        self.parent = []
        stack = []
        for i, iv in enumerate(intervals):
            while stack and intervals[stack[-1]][1] < iv[0]:
                stack.pop()
            self.parent.append(stack[-1] if stack else -1)
            stack.append(i)

    def at(self, ts):
        i = bisect.bisect_right(self.starts, ts) - 1
        # Walk up from the latest interval starting at or before ts to the ones containing ts.
        while i >= 0 and self.ivs[i][1] < ts:
            i = self.parent[i]
        chain = []
        while i >= 0:
            chain.append(self.ivs[i])
            i = self.parent[i]
        return chain[::-1]


def summarise(events):
    """-> (rows {label: [us, count, Counter(kernel->us)]}, kernels {name: [us, count]}, device?)"""
    threads = Threads(events)
    launches = {}
    for e in events:
        if e.get("cat") in LAUNCH_CATS and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = ((e.get("pid"), e.get("tid")), e["ts"])
    # Fallback link: a device event's "External id" names the host op that launched it.
    ops = {}
    for e in events:
        ext = e.get("args", {}).get("External id")
        if e.get("cat") == "cpu_op" and ext is not None:
            ops.setdefault(ext, ((e.get("pid"), e.get("tid")), e["ts"]))
    device = [e for e in events if e.get("cat") in DEVICE_CATS and e.get("ph") == "X"]
    rows = collections.defaultdict(lambda: [0.0, 0, collections.Counter()])
    kernels = collections.defaultdict(lambda: [0.0, 0])
    if device:
        for e in device:
            args = e.get("args", {})
            launch = launches.get(args.get("correlation")) or ops.get(args.get("External id"))
            label = threads.label(*launch) if launch else "(unattributed)"
            add(rows, kernels, label, e["name"], e.get("dur", 0.0))
        return rows, kernels, True
    # CPU only: every host op that no other op encloses, by its own duration.
    for key, ivs in threads.by_tid.items():
        sweep = Sweep(ivs)
        for i, iv in enumerate(sweep.ivs):
            if iv[3] != "op":
                continue
            p = sweep.parent[i]
            while p >= 0 and sweep.ivs[p][3] != "op":
                p = sweep.parent[p]
            if p >= 0:
                continue
            add(rows, kernels, label_of(sweep, i), iv[2], iv[1] - iv[0])
    return rows, kernels, False


def label_of(sweep, i):
    """The innermost non-bench scope above interval i, else its own name."""
    p = sweep.parent[i]
    while p >= 0:
        iv = sweep.ivs[p]
        if iv[3] == "scope" and not iv[2].startswith("bench."):
            return iv[2]
        p = sweep.parent[p]
    return sweep.ivs[i][2]


def add(rows, kernels, label, name, us):
    r = rows[label]
    r[0] += us
    r[1] += 1
    r[2][name] += us
    kernels[name][0] += us
    kernels[name][1] += 1


def short(name, n=70):
    return name if len(name) <= n else name[: n - 1] + "…"


def table(title, rows, reps, device, wall_ms):
    total = sum(r[0] for r in rows.values()) or 1.0
    unit = "device" if device else "host (CPU trace)"
    out = [f"### {title}", ""]
    out.append(f"{unit} time {total / 1e3 / reps:.3f} ms per repetition"
               + (f"; wall {wall_ms:.3f} ms per repetition under the profiler" if wall_ms else ""))
    out += ["", "| where | ms / rep | share | events / rep | largest kernel |", "|---|---:|---:|---:|---|"]
    for label, (us, n, ks) in sorted(rows.items(), key=lambda kv: -kv[1][0]):
        top = ks.most_common(1)[0][0] if ks else ""
        out.append(f"| {label} | {us / 1e3 / reps:.3f} | {100 * us / total:.1f}% | {n / reps:.1f} | {short(top)} |")
    return "\n".join(out) + "\n"


def main(d):
    runs_path = os.path.join(d, "runs.jsonl")
    if not os.path.exists(runs_path):
        fail(f"{runs_path} missing: run `attnlab bench --profile {d}` first")
    runs = [json.loads(l) for l in open(runs_path) if l.strip()]
    if not runs:
        fail(f"{runs_path} is empty")
    summary, tops = [], []
    for run in runs:
        path = os.path.join(d, run["trace"])
        if not os.path.exists(path):
            fail(f"trace {path} missing")
        events = json.load(open(path)).get("traceEvents", [])
        reps = max(1, int(run["reps"]))
        rows, kernels, device = summarise(events)
        r = run["result"]
        if "cuda" in str(r.get("device", "")).lower() and not device:
            fail(f"{path}: a CUDA run with no device events in its trace")
        wall = r.get("step_ms") or r.get("fwd_bwd_ms")
        what = f"{run['what']} {r.get('attention', '')} {r.get('implementation', '')}".strip()
        shape = (f"B·H {r['batch_heads']} T {r['seq_len']} hd {r['head_dim']} w {r['window']}" if run["what"] == "op"
                 else f"{r.get('flavor', '')} micro-batch {r.get('micro_batch')} × T {r.get('seq_len')}")
        print(table(f"{what} ({shape}; {run['trace']}, {reps} reps)", rows, reps, device, wall))
        total = sum(v[0] for v in rows.values()) or 1.0
        for label, (us, n, ks) in rows.items():
            top = ks.most_common(1)[0][0] if ks else ""
            summary.append([run["trace"], label, f"{us / 1e3 / reps:.4f}", f"{us / total:.4f}", f"{n / reps:.2f}", top])
        for name, (us, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]:
            tops.append([run["trace"], name, f"{us / 1e3 / reps:.4f}", f"{n / reps:.2f}"])
    with open(os.path.join(d, "where_time_goes.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trace", "label", "ms_per_rep", "share", "events_per_rep", "top_kernel"])
        w.writerows(summary)
    with open(os.path.join(d, "top_kernels.csv"), "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["trace", "kernel", "ms_per_rep", "calls_per_rep"])
        w.writerows(tops)


def self_test():
    """A hand-built trace: two threads (forward, autograd), scopes, ops, launches and kernels."""
    X = lambda cat, name, ts, dur, tid, **args: {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid, "args": args}
    ev = [
        X("user_annotation", "bench.op", 0, 100, 1),
        X("cpu_op", "aten::linear", 1, 9, 1),
        X("cpu_op", "aten::addmm", 2, 5, 1),
        X("cuda_runtime", "cudaLaunchKernel", 3, 1, 1, correlation=1),
        X("user_annotation", "attn.op", 20, 30, 1),
        X("user_annotation", "dar.merge", 21, 10, 1),
        X("cpu_op", "aten::mul", 22, 5, 1),
        X("cuda_runtime", "cudaLaunchKernel", 23, 1, 1, correlation=2),
        X("cpu_op", "aten::exp", 40, 5, 1),  # in attn.op (20–50), after dar.merge (21–31)
        X("cuda_runtime", "cudaLaunchKernel", 41, 1, 1, correlation=4),
        X("cpu_op", "autograd::engine::evaluate_function: MmBackward0", 60, 10, 2),
        X("cpu_op", "aten::mm", 61, 5, 2),
        X("cuda_runtime", "cudaLaunchKernel", 62, 1, 2, correlation=3),
        X("kernel", "sm90_gemm", 5, 5, 7, correlation=1),
        X("kernel", "elementwise_mul", 25, 3, 7, correlation=2),
        X("kernel", "elementwise_exp", 45, 2, 7, correlation=4),
        X("kernel", "sm90_gemm", 70, 7, 7, correlation=3),
        X("gpu_memcpy", "Memcpy DtoD", 80, 4, 7, correlation=99),
        X("cpu_op", "aten::copy_", 28, 2, 1, **{"External id": 5}),  # in dar.merge, after aten::mul
        X("gpu_memset", "Memset", 90, 1, 7, correlation=98, **{"External id": 5}),
    ]
    rows, kernels, device = summarise(ev)
    got = {k: (v[0], v[1]) for k, v in rows.items()}
    want = {"aten::linear": (5.0, 1), "dar.merge": (4.0, 2), "attn.op": (2.0, 1),
            "autograd::engine::evaluate_function: MmBackward0": (7.0, 1), "(unattributed)": (4.0, 1)}
    assert device and got == want, got
    assert kernels["sm90_gemm"] == [12.0, 2], kernels
    # CPU-only: top-level ops by their own time, under their innermost scope.
    cpu = [e for e in ev if e["cat"] in ("user_annotation", "cpu_op")]
    rows, _, device = summarise(cpu)
    got = {k: (v[0], v[1]) for k, v in rows.items()}
    want = {"aten::linear": (9.0, 1), "dar.merge": (7.0, 2), "attn.op": (5.0, 1),
            "autograd::engine::evaluate_function: MmBackward0": (10.0, 1)}
    assert not device and got == want, got
    print("self-test ok")


if __name__ == "__main__":
    if sys.argv[1:] == ["--self-test"]:
        self_test()
    elif len(sys.argv) == 2:
        main(sys.argv[1])
    else:
        fail(__doc__)
