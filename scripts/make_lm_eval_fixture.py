"""Pin lm-evaluation-harness's output format: run lm-eval itself, offline, and keep what it writes.

    python3 -m venv /tmp/lme && /tmp/lme/bin/pip install lm-eval
    /tmp/lme/bin/python scripts/make_lm_eval_fixture.py

No model weights or hub datasets are reachable offline, so the model is lm-eval's built-in `dummy`
LM (random log-likelihoods, "lol" generations) and the tasks are lm-eval's own task configs pointed
at tiny local JSON files: `wikitext` (its YAML and preprocess_wikitext.py, loglikelihood_rolling),
a multiple-choice task with lm-eval's acc / acc_norm, a generate_until task with gsm8k's two
filters (strict-match, flexible-extract), and a RULER-style task using lm-eval's
tasks/ruler/common_utils.py (metrics named by sequence length). The numbers are meaningless; the
file layout, key names and value types are lm-eval's. attnlab's tests compare its own lm_eval/
files against these (tests/fixtures/lm_eval/).
"""
import glob
import json
import os
import shutil
import tempfile

import lm_eval
from lm_eval.loggers import EvaluationTracker
from lm_eval.tasks import TaskManager

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "tests", "fixtures", "lm_eval")
PKG = os.path.dirname(lm_eval.__file__)


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main():
    tmp = tempfile.mkdtemp()
    tasks = os.path.join(tmp, "tasks")
    os.makedirs(tasks)
    data = os.path.join(tmp, "data")
    os.makedirs(data)
    write_jsonl(os.path.join(data, "wiki.jsonl"), [{"page": " = Valkyria = \n Senjō no Valkyria 3 is a game . \n"}, {"page": " = Tower = \n The tower is 300 @-@ m tall . \n"}])
    write_jsonl(os.path.join(data, "mc.jsonl"), [{"question": "Where is Mary?", "choices": ["garden", "kitchen"], "label": 1}, {"question": "Who ran?", "choices": ["John", "Sandra"], "label": 0}])
    write_jsonl(os.path.join(data, "gen.jsonl"), [{"question": "1+1?", "answer": "It is 2.\n#### 2"}, {"question": "2+2?", "answer": "#### 4"}])
    write_jsonl(os.path.join(data, "niah.jsonl"), [{"input": "The magic number is 7. What is it?", "outputs": ["7"], "max_length": 4096, "gen_prefix": "Answer:"}])

    # wikitext: lm-eval's YAML with the dataset replaced by a local file.
    shutil.copy(os.path.join(PKG, "tasks", "wikitext", "preprocess_wikitext.py"), tasks)
    wiki = open(os.path.join(PKG, "tasks", "wikitext", "wikitext.yaml")).read()
    wiki = wiki.replace("dataset_path: EleutherAI/wikitext_document_level", f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}/wiki.jsonl")
    wiki = "\n".join(l for l in wiki.splitlines() if not l.startswith(("dataset_name:", "training_split:", "validation_split:")))
    open(os.path.join(tasks, "wikitext.yaml"), "w").write(wiki + "\n")
    open(os.path.join(tasks, "mc_fixture.yaml"), "w").write(f"""task: mc_fixture
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    # gsm8k's filters and metric, verbatim from lm_eval/tasks/gsm8k/gsm8k.yaml.
    gsm = open(os.path.join(PKG, "tasks", "gsm8k", "gsm8k.yaml")).read()
    gsm_tail = gsm[gsm.index("metric_list:"):]
    open(os.path.join(tasks, "gen_fixture.yaml"), "w").write(f"""task: gen_fixture
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
""" + gsm_tail)
    # RULER's scoring functions verbatim, minus the transformers import (used only to build prompts).
    ruler = open(os.path.join(PKG, "tasks", "ruler", "common_utils.py")).read().replace("from transformers import AutoTokenizer", "AutoTokenizer = None")
    open(os.path.join(tasks, "common_utils.py"), "w").write(ruler)
    niah = open(os.path.join(PKG, "tasks", "ruler", "niah_single_1.yaml")).read()
    niah = niah.replace('task: niah_single_1', 'task: niah_fixture').replace('dataset_path: ""', f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}/niah.jsonl")
    niah = "\n".join(l for l in niah.splitlines() if not l.startswith(("custom_dataset:", "dataset_name:", "tag:", "  - longcxt")))
    open(os.path.join(tasks, "niah_fixture.yaml"), "w").write(niah + "\n")

    out = os.path.join(tmp, "out")
    tracker = EvaluationTracker(output_path=out)
    names = ["wikitext", "mc_fixture", "gen_fixture", "niah_fixture"]
    results = lm_eval.simple_evaluate(model="dummy", tasks=names, log_samples=True, task_manager=TaskManager(include_path=tasks), evaluation_tracker=tracker, num_fewshot=0, random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    for name in names:
        tracker.save_results_samples(task_name=name, samples=samples[name])

    os.makedirs(OUT, exist_ok=True)
    for f in glob.glob(os.path.join(OUT, "*.json*")):
        os.remove(f)
    # The files keep lm-eval's names (results_<date>.json, samples_<task>_<date>.jsonl); local paths
    # in the config are replaced so the fixture does not depend on this machine.
    for f in glob.glob(os.path.join(out, "**", "*.json*"), recursive=True):
        text = open(f).read().replace(tmp, "/tmp/lm_eval_fixture")
        open(os.path.join(OUT, os.path.basename(f)), "w").write(text)
    # attnlab's JSON objects have sorted keys, so its doc_hash is lm-eval's hash of the doc with
    # sorted keys: computed here with Python's json for every fixture sample.
    import hashlib

    sorted_hashes = {}
    for f in sorted(glob.glob(os.path.join(OUT, "samples_*.jsonl"))):
        for line in open(f):
            s = json.loads(line)
            text = json.dumps(s["doc"], indent=2, ensure_ascii=False, sort_keys=True)
            sorted_hashes.setdefault(os.path.basename(f).split("_2")[0], []).append(hashlib.sha256(text.encode("utf-8")).hexdigest())
    with open(os.path.join(OUT, "sorted_doc_hashes.json"), "w") as f:
        json.dump(sorted_hashes, f, indent=1, sort_keys=True)
    print("lm-eval", getattr(lm_eval, "__version__", "?"), "wrote", sorted(os.listdir(OUT)))


if __name__ == "__main__":
    main()
