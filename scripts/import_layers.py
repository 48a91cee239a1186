#!/usr/bin/env python3
"""The import rule of ARCHITECTURE.md, checked: every `crate::` reference between top-level modules of
src/ (a folder or a file: data, eval, linearize, ...) points down the LAYERS below, except the upward
edges listed in KNOWN (each one to remove, never to add), and no modules import each other, even through
others (an import circle, which only modules of one layer could close). Test code (tests.rs, testkit.rs,
conformance.rs and a file's trailing #[cfg(test)] module) may reach up: a test builds a whole model to
test a part.

    python3 scripts/import_layers.py            # exit 1 naming each new upward reference (file:line) or circle
    python3 scripts/import_layers.py --edges    # every edge, then the check
"""
import re, sys
from collections import defaultdict
from pathlib import Path

SRC = Path(__file__).resolve().parent.parent / "src"

# Lowest first; a module may use its own layer and those before it, and no two modules import each
# other, even through others (no import circle).
LAYERS = [
    ["error", "util", "progress", "hub", "kernels", "device", "lora", "run_kind"],
    ["attention"],
    ["spec"],
    ["data", "plots"],
    ["model"],
    ["student_export", "perplexity", "recall", "tensorboard"],
    ["train"],
    ["eval"],
    ["export", "linearize", "finetune", "bench"],
    ["runs"],
    ["sweep", "report"],
]

# Upward edges that exist today (issue 25), to be removed; a fixed one must leave this list.
KNOWN = {
}
ROOT_REEXPORTS = {"Error": "error", "IoContext": "error", "Result": "error"}
SKIP = {"lib", "main", "testutil"}  # the crate root, the binary, test helpers


def top(path):
    rel = path.relative_to(SRC).parts
    return rel[0][:-3] if len(rel) == 1 else rel[0]


def targets(text):
    """Top-level modules named by `crate::x` paths and `crate::{x, y::z}` groups."""
    for m in re.finditer(r"\bcrate::(\{[^}]*\}|\w+)", text):
        g = m.group(1)
        names = [p.strip().split("::")[0] for p in g[1:].split(",")] if g.startswith("{") else [g]
        for n in names:
            n = n.strip("{ }\n")
            if n:
                yield ROOT_REEXPORTS.get(n, n)


def is_module(name):
    return (SRC / f"{name}.rs").exists() or (SRC / name).is_dir()


def graph():
    edges = defaultdict(lambda: defaultdict(list))
    for f in sorted(SRC.rglob("*.rs")):
        a = top(f)
        if a in SKIP or f.name in ("tests.rs", "testkit.rs", "conformance.rs") or "tests" in f.relative_to(SRC).parts:
            continue
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if line.startswith("#[cfg(test)]") and i > 1:
                break  # the file's test module comes last
            if line.lstrip().startswith("//"):
                continue
            for b in targets(line):
                if b != a and b not in SKIP and is_module(b):
                    edges[a][b].append(f"{f.relative_to(SRC.parent)}:{i}")
    return edges


def circles(edges):
    """The sets of two or more modules that each reach the others (strongly connected components)."""
    def reach(a):
        seen, todo = set(), [a]
        while todo:
            for b in edges.get(todo.pop(), {}):
                if b not in seen:
                    seen.add(b)
                    todo.append(b)
        return seen
    r = {a: reach(a) for a in edges}
    out = []
    for a in sorted(r):
        c = sorted({a} | {b for b in r[a] if a in r.get(b, ())})
        if len(c) > 1 and c not in out:
            out.append(c)
    return out


def main():
    edges = graph()
    level = {m: i for i, layer in enumerate(LAYERS) for m in layer}
    errors = []
    for a in sorted(set(edges) | {b for a in edges for b in edges[a]}):
        if a not in level:
            errors.append(f"module `{a}` is in no layer: add it to LAYERS in {Path(__file__).name}")
    if "--edges" in sys.argv:
        for a in sorted(edges):
            print(f"{a} -> {', '.join(sorted(edges[a]))}")
    for a in sorted(edges):
        for b in sorted(edges[a]):
            if a in level and b in level and level[b] > level[a] and (a, b) not in KNOWN:
                errors.append(f"{a} -> {b} points up ({a} is below {b}): " + ", ".join(edges[a][b][:5]))
    # Beside the KNOWN edges (circles through those go when they do), only modules of one layer can
    # close a circle.
    for circle in circles({a: {b: v for b, v in bs.items() if (a, b) not in KNOWN} for a, bs in edges.items()}):
        errors.append("import circle: " + ", ".join(circle) + " (each reaches the others)")
    for (a, b) in sorted(KNOWN):
        if b not in edges.get(a, {}):
            errors.append(f"{a} -> {b} is gone: remove it from KNOWN")
        elif a in level and b in level and level[b] <= level[a]:
            errors.append(f"{a} -> {b} no longer points up: remove it from KNOWN")
    for e in errors:
        print(e)
    if errors:
        sys.exit(1)
    print(f"imports point down: {sum(len(v) for v in edges.values())} edges between {len(level)} modules, {len(KNOWN)} known upward edges left")


if __name__ == "__main__":
    main()
