"""Run notebooks/analysis.ipynb headless (`make notebook`; `make test` runs it too).

Checks first that the .ipynb and its jupytext pair notebooks/analysis.py hold the same code (so
the two cannot drift), then executes the notebook with nbclient in a fresh kernel; a failing cell
fails the command. The executed copy goes to $ATTNLAB_NOTEBOOK_OUT/analysis.ipynb, never over the
committed one.

    python scripts/run_notebook.py            # ATTNLAB_RESULTS / ATTNLAB_REPORT say what it reads
    python scripts/run_notebook.py --sync     # rewrite analysis.ipynb from analysis.py
"""
import os
import sys
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
PY = ROOT / "notebooks" / "analysis.py"
NB = ROOT / "notebooks" / "analysis.ipynb"


def code(nb):
    return [c.source.strip() for c in nb.cells if c.cell_type == "code"]


def main():
    paired = jupytext.read(PY)
    if "--sync" in sys.argv:
        jupytext.write(paired, NB)
        print("wrote", NB)
        return
    nb = nbformat.read(NB, as_version=4)
    if code(nb) != code(paired):
        sys.exit(f"{NB.name} and {PY.name} differ: edit one, then `python scripts/run_notebook.py --sync` (or jupytext --sync)")
    out = Path(os.environ.get("ATTNLAB_NOTEBOOK_OUT", ROOT / "target" / "notebook"))
    os.environ["ATTNLAB_NOTEBOOK_OUT"] = str(out)
    out.mkdir(parents=True, exist_ok=True)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    nbformat.write(nb, out / "analysis.ipynb")
    figs = sorted(p.name for p in out.glob("*.png"))
    print(f"executed {NB.relative_to(ROOT)} ({len(code(nb))} code cells) → {out / 'analysis.ipynb'}; figures: {', '.join(figs)}")


if __name__ == "__main__":
    main()
