#!/usr/bin/env python3
"""lm-evaluation-harness on an attnlab export equals `attnlab eval --task hellaswag` (issue 39).

A tiny DAR run (GPT-NeoX, 2 steps on CPU, experiments/tiny-synthetic-smoke.yaml) is exported with its
remote code. Both score the same local HellaSwag-format documents, 0-shot, offline:

  attnlab eval RUN --task hellaswag --data DOCS --shots 0 --min-context 0
  lm_eval --model hf --model_args pretrained=EXPORT,trust_remote_code=True,dtype=float32 \
          --include_path TASKS --tasks attnlab_hellaswag --log_samples ...

where TASKS holds lm-eval's own `hellaswag` task (its process_docs, prompt and metrics) pointed at the
local file. The documents are written in the synthetic corpus's words, so the tiny model's tokenizer
knows them. Every sample's log-likelihood of every choice must agree within 1e-4 (absolute, summed
over the continuation's tokens), and acc / acc_norm exactly. Then rolling perplexity, as lm-eval's
wikitext task scores it (loglikelihood_rolling over windows of the model's 128 positions) against
`attnlab eval RUN --corpus texts=FILE` on four local documents of 150-330 words: each document's
log-likelihood within 1e-4 relative, and the word perplexity. Exit 1 on any difference.

Usage: hf_lm_eval.py ATTNLAB_BINARY WORK_DIR   (needs lm-eval, torch, transformers)
"""
import glob
import json
import os
import random
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = os.path.join(ROOT, "experiments", "tiny-synthetic-smoke.yaml")
TOL = 1e-4

PEOPLE = ["mira", "tom", "ana", "li"]
CITIES = ["oslo", "rome", "lima", "paris"]
COLORS = ["red", "blue", "green"]


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")
    return p.stdout


def documents(n, seed=3):
    """HellaSwag-shaped documents (ctx_a, ctx_b, four endings, a label) in the synthetic vocabulary."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        who, city, color = rng.choice(PEOPLE), rng.choice(CITIES), rng.choice(COLORS)
        endings = [f"{c} ." for c in rng.sample(CITIES, 4)]
        docs.append({
            "ind": i, "activity_label": "facts", "ctx_a": f"{who} lives in {city} . {who} likes {color} .",
            "ctx_b": f"question : where does {who} live ? answer :", "ctx": "", "endings": endings,
            "source_id": f"attnlab-{i}", "split": "val", "split_type": "indomain", "label": str(endings.index(f"{city} .") if f"{city} ." in endings else 0),
        })
    return docs


TASK_YAML = """task: attnlab_hellaswag
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files: {{validation: {data}}}
output_type: multiple_choice
validation_split: validation
process_docs: !function utils.process_docs
doc_to_text: "{{{{query}}}}"
doc_to_target: "{{{{label}}}}"
doc_to_choice: "choices"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


ROLLING_YAML = """task: attnlab_rolling
dataset_path: json
dataset_name: null
dataset_kwargs:
  data_files: {{test: {data}}}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
"""


def texts(n, seed=5):
    """Documents of 150 to 330 words of the synthetic vocabulary: longer than T = 128 tokens, so both
    sides score them in rolling windows."""
    rng = random.Random(seed)
    words = (PEOPLE + CITIES + COLORS + "lives in likes . question : where does live ? answer the code of is 1 2 3 4 5 6 7".split())
    return [{"text": " ".join(rng.choice(words) for _ in range(150 + 60 * i))} for i in range(n)]


def samples(path):
    return {s["doc_id"]: s for s in map(json.loads, open(path))}


def main():
    attnlab, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    os.makedirs(work, exist_ok=True)
    rundir, hf = os.path.join(work, "run-dar"), os.path.join(work, "hf-dar")
    sets = ["train.steps=2", "attention={kind: dar, d_down: 16, window: 8}", "data.train.synthetic.docs=64",
            "data.eval.synthetic.synthetic.docs=2", "train.batch_size=4"]
    cmd = [attnlab, "train", SPEC, "--out", rundir, "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    run(cmd)
    run([attnlab, "export", rundir, "--out", hf])

    docs_dir, tasks_dir = os.path.join(work, "docs"), os.path.join(work, "tasks")
    os.makedirs(docs_dir, exist_ok=True)
    os.makedirs(tasks_dir, exist_ok=True)
    data = os.path.join(docs_dir, "validation.jsonl")
    with open(data, "w") as f:
        for d in documents(12):
            f.write(json.dumps(d) + "\n")
    open(os.path.join(tasks_dir, "attnlab_hellaswag.yaml"), "w").write(TASK_YAML.format(data=data))
    open(os.path.join(tasks_dir, "utils.py"), "w").write("from lm_eval.tasks.hellaswag.utils import process_docs  # noqa: F401\n")

    run([attnlab, "eval", rundir, "--task", "hellaswag", "--data", docs_dir, "--shots", "0", "--min-context", "0"])
    ours = json.load(open(os.path.join(rundir, "tasks", "hellaswag.json")))
    ours_samples = samples(sorted(glob.glob(os.path.join(rundir, "lm_eval", "samples_hellaswag_*.jsonl")))[-1])

    out = os.path.join(work, "lm_eval_out")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_CACHE=os.path.join(work, "datasets-cache"))
    lm_eval = os.path.join(os.path.dirname(sys.executable), "lm_eval")
    run([lm_eval, "--model", "hf", "--model_args", f"pretrained={hf},trust_remote_code=True,dtype=float32", "--include_path", tasks_dir,
         "--tasks", "attnlab_hellaswag", "--num_fewshot", "0", "--device", "cpu", "--batch_size", "1", "--output_path", out, "--log_samples"], env=env)
    results = json.load(open(sorted(glob.glob(os.path.join(out, "**", "results_*.json"), recursive=True))[-1]))["results"]["attnlab_hellaswag"]
    theirs_samples = samples(sorted(glob.glob(os.path.join(out, "**", "samples_attnlab_hellaswag_*.jsonl"), recursive=True))[-1])

    # Rolling perplexity (lm-eval's loglikelihood_rolling, as its wikitext task) of local documents.
    text = os.path.join(docs_dir, "texts.jsonl")
    with open(text, "w") as f:
        for d in texts(4):
            f.write(json.dumps(d) + "\n")
    open(os.path.join(tasks_dir, "attnlab_rolling.yaml"), "w").write(ROLLING_YAML.format(data=text))
    run([attnlab, "eval", rundir, "--corpus", f"texts={text}"])
    ours_ppl = json.load(open(os.path.join(rundir, "eval.json")))["corpora"]["texts"]
    ours_rolling = samples(sorted(glob.glob(os.path.join(rundir, "lm_eval", "samples_texts_*.jsonl")))[-1])
    out2 = os.path.join(work, "lm_eval_rolling")
    run([lm_eval, "--model", "hf", "--model_args", f"pretrained={hf},trust_remote_code=True,dtype=float32", "--include_path", tasks_dir,
         "--tasks", "attnlab_rolling", "--device", "cpu", "--batch_size", "1", "--output_path", out2, "--log_samples"], env=env)
    rolling_results = json.load(open(sorted(glob.glob(os.path.join(out2, "**", "results_*.json"), recursive=True))[-1]))["results"]["attnlab_rolling"]
    theirs_rolling = samples(sorted(glob.glob(os.path.join(out2, "**", "samples_attnlab_rolling_*.jsonl"), recursive=True))[-1])

    rolling, choices = [], []  # what each check found wrong
    worst_doc = 0.0
    for i in sorted(theirs_rolling):
        a, b = float(ours_rolling[i]["resps"][0][0]), float(theirs_rolling[i]["resps"][0][0])
        worst_doc = max(worst_doc, abs(a - b))
        if abs(a - b) > TOL * max(1.0, abs(a)):
            rolling.append(f"document {i}: rolling log-likelihood attnlab {a} vs lm-eval {b}")
    if len(theirs_rolling) != len(ours_rolling):
        rolling.append(f"rolling: attnlab scored {len(ours_rolling)} documents, lm-eval {len(theirs_rolling)}")
    a, b = ours_ppl["word_ppl"], rolling_results["word_perplexity,none"]
    print(f"word perplexity: attnlab {a:.6f}, lm-eval {b:.6f}; {len(theirs_rolling)} documents of {ours_ppl['tokens']} tokens, max |Δ log-likelihood| {worst_doc:.2e}")
    if abs(a - b) > TOL * a:
        rolling.append(f"word perplexity: attnlab {a} vs lm-eval {b}")
    if sorted(ours_samples) != sorted(theirs_samples):
        choices.append(f"different documents: attnlab {sorted(ours_samples)}, lm-eval {sorted(theirs_samples)}")
    worst = 0.0
    for i in sorted(set(ours_samples) & set(theirs_samples)):
        a = [float(r[0][0]) for r in ours_samples[i]["resps"]]
        b = [float(r[0][0]) for r in theirs_samples[i]["resps"]]
        worst = max([worst] + [abs(x - y) for x, y in zip(a, b)])
        if len(a) != len(b) or any(abs(x - y) > TOL for x, y in zip(a, b)):
            choices.append(f"doc {i}: log-likelihoods attnlab {a} vs lm-eval {b}")
    for metric in ("acc", "acc_norm"):
        a = ours["metrics"][metric] if "metrics" in ours else ours[metric]
        a = a["value"] if isinstance(a, dict) else a
        b = results[f"{metric},none"]
        print(f"{metric}: attnlab {a:.6f}, lm-eval {b:.6f}")
        if abs(a - b) > 1e-9:
            choices.append(f"{metric}: attnlab {a} vs lm-eval {b}")
    print(f"{len(theirs_samples)} documents x 4 choices: max |Δ log-likelihood| {worst:.2e} (tolerance {TOL})")
    for p in rolling + choices:
        print("FAIL " + p)
    failed = int(bool(rolling)) + int(bool(choices))
    print(f"{2 - failed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
