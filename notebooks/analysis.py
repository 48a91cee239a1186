# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # attnlab results: perplexity curves, Rel.% against vanilla, Tables 1–3
#
# Reads a results folder the way `attnlab report` leaves it:
#
# - `REPORT/runs.parquet` (one row per run and logged step: the run's config as columns beside
#   every metric, `eval/<corpus>/ppl`, `eval/<corpus>/word_ppl`, `loss`, …),
# - every run's `eval.json` (final perplexities) and `tasks/*.json` (downstream scores).
#
# Set `ATTNLAB_RESULTS` (default `results/dar-smoke`) and optionally `ATTNLAB_REPORT` (default
# `RESULTS/report`). Figures go to `ATTNLAB_NOTEBOOK_OUT` (default `REPORT/notebook`); nothing is
# written into run directories. `make notebook` runs this headless on a fresh smoke sweep.
# Paired with `analysis.ipynb` by jupytext: edit either, then `jupytext --sync notebooks/analysis.py`.

# %%
import json
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

RESULTS = Path(os.environ.get("ATTNLAB_RESULTS", "results/dar-smoke"))
REPORT = Path(os.environ.get("ATTNLAB_REPORT", RESULTS / "report"))
OUT = Path(os.environ.get("ATTNLAB_NOTEBOOK_OUT", REPORT / "notebook"))
OUT.mkdir(parents=True, exist_ok=True)
runs = pd.read_parquet(REPORT / "runs.parquet")
assert len(runs) > 0, f"{REPORT / 'runs.parquet'} has no rows"
for col in ["run", "kind", "d_down", "window", "d_model", "step", "scale", "recipe"]:
    assert col in runs.columns, f"runs.parquet lacks column {col!r}"
# Seeds: a `seed` column when the report has one; otherwise every run is its own seed.
SEED = "seed" if "seed" in runs.columns else None
print(f"{runs['run'].nunique()} runs, {len(runs)} rows, seed column: {SEED}")
runs.head()

# %% [markdown]
# ## eval.json and tasks/*.json of every run

# %%
def run_dirs(root):
    """Run directories below root (folders holding config.yaml), as the report finds them."""
    return sorted(p.parent for p in root.rglob("config.yaml") if "checkpoints" not in p.parts)


meta_cols = [c for c in ["run", "kind", "d_down", "window", "d_model", "layers", "scale", "recipe", SEED] if c]
meta = runs[meta_cols].drop_duplicates("run").set_index("run")

eval_rows, task_rows = [], []
for d in run_dirs(RESULTS):
    rel = d.relative_to(RESULTS).as_posix()
    e = d / "eval.json"
    if e.is_file():
        ev = json.loads(e.read_text())
        for corpus, r in ev.get("corpora", {}).items():
            eval_rows.append({"run": rel, "step": ev["step"], "corpus": corpus, **{k: r[k] for k in ["ppl", "word_ppl", "loss", "bits_per_byte"]}})
    for t in sorted((d / "tasks").glob("*.json")):
        tr = json.loads(t.read_text())
        for metric, v in tr["metrics"].items():
            task_rows.append({"run": rel, "task": tr["task"], "metric": metric, "value": v, "primary": metric == tr["primary_metric"], "step": tr["model"]["step"], "docs": tr["docs"]})
evals = pd.DataFrame(eval_rows).join(meta, on="run") if eval_rows else pd.DataFrame()
tasks = pd.DataFrame(task_rows).join(meta, on="run") if task_rows else pd.DataFrame()
assert not evals.empty, f"no eval.json below {RESULTS}"
print(f"eval.json: {evals['run'].nunique()} runs × {evals['corpus'].nunique()} corpora; tasks: {0 if tasks.empty else tasks['task'].nunique()}")
evals.head()

# %% [markdown]
# ## Perplexity against step, per attention kind
#
# One line per run, one colour per kind (vanilla black), from the `eval/<corpus>/ppl` columns.

# %%
KIND_COLOR = {"vanilla": "black", "dar": "tab:blue", "uniform": "tab:orange"}
ppl_cols = sorted(c for c in runs.columns if c.startswith("eval/") and c.endswith("/ppl"))
assert ppl_cols, "runs.parquet has no eval/<corpus>/ppl column"
corpus_col = ppl_cols[0]
fig, ax = plt.subplots(figsize=(7, 4))
for run, g in runs.dropna(subset=[corpus_col]).groupby("run"):
    kind = g["kind"].iloc[0]
    ax.plot(g["step"], g[corpus_col], marker="o", ms=3, color=KIND_COLOR.get(kind, "tab:gray"), alpha=0.8, label=kind)
handles, labels = ax.get_legend_handles_labels()
uniq = dict(zip(labels, handles))
ax.legend(uniq.values(), uniq.keys())
ax.set(xlabel="step", ylabel=f"{corpus_col} (token-level)", yscale="log", title="Validation perplexity")
fig.savefig(OUT / "ppl_vs_step.png", dpi=100, bbox_inches="tight")

# %% [markdown]
# ## Rel.% against vanilla
#
# Rel.(%) = 100 · mean over corpora of PPL(run) / PPL(vanilla) at the same step, vanilla being the run
# of the same scale and recipe (and seed, when there are seeds). With several seeds per configuration
# the line is their mean and the band ±1 standard deviation.

# %%
long = runs.melt(id_vars=[c for c in ["run", "kind", "d_down", "window", "scale", "recipe", "step", SEED] if c], value_vars=ppl_cols, var_name="corpus", value_name="ppl").dropna(subset=["ppl"])
keys = ["scale", "recipe", "step", "corpus"] + ([SEED] if SEED else [])
van = long[long["kind"] == "vanilla"].groupby(keys)["ppl"].mean().rename("vanilla_ppl")
rel = long[long["kind"] != "vanilla"].join(van, on=keys).dropna(subset=["vanilla_ppl"])
rel["ratio"] = rel["ppl"] / rel["vanilla_ppl"]
rel = rel.groupby(["run", "kind", "d_down", "window", "scale", "recipe", "step"] + ([SEED] if SEED else []), dropna=False)["ratio"].mean().mul(100).rename("rel").reset_index()
config = ["kind", "d_down", "window", "scale"]
bands = rel.groupby(config + ["step"], dropna=False)["rel"].agg(["mean", "std", "count"]).reset_index()
fig, ax = plt.subplots(figsize=(7, 4))
for i, (cfg, g) in enumerate(bands.groupby(config, dropna=False)):
    g = g.sort_values("step")
    kind, d_down, window, scale = cfg
    label = f"{kind} d_down={d_down:g}" + ("" if pd.isna(window) else f" w={window:g}")
    line = "-" if kind == "dar" else "--"
    (h,) = ax.plot(g["step"], g["mean"], line, marker="o", ms=3, label=label, color=f"C{i % 10}")
    if (g["count"] > 1).any():
        ax.fill_between(g["step"], g["mean"] - g["std"].fillna(0), g["mean"] + g["std"].fillna(0), color=h.get_color(), alpha=0.2)
ax.axhline(100, color="black", lw=1)
ax.set(xlabel="step", ylabel="Rel. (%) vs vanilla", title="Rel.% against vanilla (100% = vanilla)")
ax.legend(fontsize=7)
fig.savefig(OUT / "rel_vs_step.png", dpi=100, bbox_inches="tight")
rel.tail()

# %% [markdown]
# ## Tables 1–3 as frames (final evaluation, eval.json)
#
# Word-level perplexity (lm-eval's `word_perplexity`) of every corpus and Rel.% against the vanilla
# run of the same scale and recipe. Table 1: the bottleneck sweep (vanilla, DAR and uniform over
# d_down at the most common width); Table 2: vanilla against DAR at d_down = d_model / 4 for every
# width; Table 3: DAR at d_down = d_model / 4 over windows.

# %%
corpora = sorted(evals["corpus"].unique())
# One row per run: its word PPL per corpus beside its config (vanilla has no d_down / window).
final = evals.pivot(index="run", columns="corpus", values="word_ppl").join(meta).reset_index()
final.columns.name = None
vkeys = ["scale", "recipe"] + ([SEED] if SEED else [])
vanilla = final[final["kind"] == "vanilla"].groupby(vkeys)[corpora].mean()
final["rel"] = final.apply(lambda r: 100 * np.mean([r[c] / vanilla.loc[tuple(r[k] for k in vkeys), c] for c in corpora]) if tuple(r[k] for k in vkeys) in vanilla.index else np.nan, axis=1)
width = final["d_model"].mode().iloc[0]
table1 = final[final["d_model"] == width].sort_values(["kind", "d_down"], ascending=[False, False])[["kind", "d_down", "window"] + corpora + ["rel"]]
table2 = final[(final["kind"] == "vanilla") | ((final["kind"] == "dar") & (final["d_down"] == final["d_model"] / 4))].pivot_table(index="d_model", columns="kind", values=corpora[0], aggfunc="mean")
table3 = final[(final["kind"] == "dar") & (final["d_model"] == width) & (final["d_down"] == width / 4)].sort_values("window", ascending=False)[["window"] + corpora + ["rel"]]
print("Table 1 (bottleneck sweep):\n", table1.to_string(index=False), "\n")
print("Table 2 (scaling, word PPL of", corpora[0], "):\n", table2.to_string(), "\n")
print("Table 3 (windows):\n", table3.to_string(index=False))
assert final["run"].is_unique and len(final) == evals["run"].nunique()
assert len(table1) > 0 and table1.loc[table1["kind"] != "vanilla", "rel"].notna().all(), "Table 1 lacks Rel.% (no vanilla run of the same scale and recipe?)"
assert (table1.loc[table1["kind"] == "vanilla", "rel"] == 100).all()

# %% [markdown]
# The same Rel.% as the report's own Tables 1 and 3 (`REPORT/tables/*.csv`, computed in Rust):

# %%
checked = 0
for csv in sorted(c for c in (REPORT / "tables").glob("table[13]-*.csv") if not c.stem.endswith("-paired")):
    t = pd.read_csv(csv)
    ours = final.assign(name=final["run"].map(lambda r: Path(r).name)).set_index("name")["rel"]
    for _, row in t.dropna(subset=["Rel.% (word)"]).iterrows():
        name = Path(str(row["run"])).name
        if name in ours.index:
            assert abs(ours[name] - row["Rel.% (word)"]) < 1e-6, f"{csv.name} {name}: report {row['Rel.% (word)']} vs notebook {ours[name]}"
            checked += 1
print(f"{checked} Rel.% values agree with the report's tables")
assert checked > 0 or not list((REPORT / "tables").glob("table1-*.csv"))

# %% [markdown]
# ## Downstream tasks (tasks/*.json)

# %%
if tasks.empty:
    print("no tasks/*.json below", RESULTS)
else:
    primary = tasks[tasks["primary"]].pivot(index="run", columns="task", values="value").join(meta[["kind", "d_down", "window"]])
    print(primary.to_string())
    assert primary.notna().any().any()
