#!/usr/bin/env python3
"""Write tiny Megatron MMapIndexedDataset fixtures (.bin + .idx) with megatron-core's own
IndexedDatasetBuilder, and read them back with its IndexedDataset, for attnlab's reader
(src/data/megatron.rs) to be checked against.

How to run (from the repository root; megatron-core needs torch, any build of it):

    python3 -m venv /tmp/mcore-venv \
      && /tmp/mcore-venv/bin/pip install megatron-core numpy \
      && /tmp/mcore-venv/bin/python scripts/make_megatron_fixture.py

What it produces, under tests/fixtures/megatron/:

  pythia_u16.bin / .idx   dtype uint16 (code 8, as the Pile in Pythia's order): 6 documents of
                          2..40 tokens (ids < 1000, so the built-in tokenizer's vocabulary is not
                          enough: the CLI test uses a small explicit vocab), one of them added as
                          two sequences with add_document, the others with add_item +
                          end_document. Ids include 0 (EOD) at each document's end.
  wide_i32.bin / .idx     dtype int32 (code 4, the builder's default): 3 documents with ids up to
                          200000, beyond u16.
  expected.json           {"megatron_core": version, "datasets": [{"prefix", "dtype_code",
                          "documents": [[ids...]...]  (what was given to the builder),
                          "sequences": [[ids...]...]  (IndexedDataset(prefix)[i] read back)}]}

The documents come from a fixed seed, so the files are reproducible.
"""
import json
import random
from importlib.metadata import version
from pathlib import Path

import numpy
import torch
from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

OUT = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "megatron"


def build(prefix, dtype, docs, split_doc=None):
    """Write docs with the builder; `split_doc` (index) is added as two sequences in one document."""
    builder = IndexedDatasetBuilder(str(OUT / f"{prefix}.bin"), dtype=dtype)
    for i, doc in enumerate(docs):
        if i == split_doc:
            cut = len(doc) // 2
            builder.add_document(torch.tensor(doc), [cut, len(doc) - cut])
        else:
            builder.add_item(torch.tensor(doc))
            builder.end_document()
    builder.finalize(str(OUT / f"{prefix}.idx"))
    ds = IndexedDataset(str(OUT / prefix))
    sequences = [ds[i].tolist() for i in range(len(ds))]
    # The reference reading of documents: sequences doc_idx[d] .. doc_idx[d+1] back to back.
    di = ds.document_indices.tolist()
    reread = [sum((sequences[s] for s in range(di[d], di[d + 1])), []) for d in range(len(di) - 1)]
    assert reread == docs, f"{prefix}: megatron-core reads back other documents"
    return {"prefix": prefix, "dtype_code": int(open(OUT / f"{prefix}.idx", "rb").read()[17]), "documents": docs, "sequences": sequences}


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    rng = random.Random(17)
    pythia = [[rng.randrange(1, 1000) for _ in range(n - 1)] + [0] for n in (40, 2, 17, 33, 9, 25)]
    wide = [[rng.randrange(0, 200_000) for _ in range(n)] for n in (5, 12, 3)]
    sets = [build("pythia_u16", numpy.uint16, pythia, split_doc=3), build("wide_i32", numpy.int32, wide)]
    (OUT / "expected.json").write_text(json.dumps({"megatron_core": version("megatron-core"), "datasets": sets}) + "\n")
    for s in sets:
        print(f"{s['prefix']}: dtype code {s['dtype_code']}, {len(s['documents'])} documents, {len(s['sequences'])} sequences")


if __name__ == "__main__":
    main()
