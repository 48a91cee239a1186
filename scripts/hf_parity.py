#!/usr/bin/env python3
"""Every attnlab export loads in Hugging Face transformers as the model it is (issue 39).

For a tiny run of every attention kind on every family (GPT-NeoX, Llama, OLMo 2 x vanilla, DAR, uniform,
window, sink; 2 training steps on CPU from experiments/tiny-synthetic-smoke.yaml), `attnlab export`
writes a folder, as `attnlab linearize` does for STILL and LoLCATs students of the vanilla Llama and
OLMo 2 runs (1 + 1 steps), and this script checks that:
  - a vanilla export is the stock architecture and carries no remote code;
  - a non-vanilla export names attnlab's architecture: loading it without trust_remote_code fails
    (never a silent load as the stock class), and with it builds attnlab's model;
  - fp32 logits of the transformers model equal `attnlab forward` within 1e-4 (relative to the largest
    logit) on a sequence several windows long, so DAR's distant path, the window and the sinks are read;
  - 16 greedy tokens of `generate()` (the remote code's bounded cache) equal `attnlab generate`;
and that the remote code's Llama / OLMo 2 with kind vanilla equals transformers' own LlamaForCausalLM /
Olmo2ForCausalLM on the vanilla exports' weights with Llama 3.1 RoPE scaling (an independent reference).
Exit 1 naming every case that fails.

Usage: hf_parity.py ATTNLAB_BINARY WORK_DIR [--only NAME,...]   (needs torch, transformers, safetensors)
"""
import argparse
import json
import os
import subprocess
import sys
import time

# Local folders only: never ask the hub (CI reaches PyPI and nothing else).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SPEC = os.path.join(ROOT, "experiments", "tiny-synthetic-smoke.yaml")
KINDS = {
    "vanilla": "{kind: vanilla}",
    "dar": "{kind: dar, d_down: 16, window: 8}",
    "uniform": "{kind: uniform, d_down: 16}",
    "window": "{kind: window, window: 8}",
    "sink": "{kind: sink, window: 8, sinks: 4}",
}
FAMILIES = {"neox": "tiny", "llama": "llama-tiny", "olmo2": "olmo2-tiny"}
# Linearized students of the vanilla Llama / OLMo 2 runs (1 + 1 linearize steps): chunks of 8, so that
# 40 tokens route chunks and fill the linear state.
STUDENTS = {
    "still": "{kind: still, chunk: 8, tokens_per_chunk: 2}",
    "lolcats": "{kind: lolcats, window: 8, feature_dim: 8}",
}
STOCK = {"neox": "GPTNeoXForCausalLM", "llama": "LlamaForCausalLM", "olmo2": "Olmo2ForCausalLM"}
PROMPT = "mira lives in oslo . mira likes red . the code of mira is 4 1 7 . question : where does mira live ? answer :"
NEW_TOKENS = 16
RTOL = 1e-4


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return p.stdout


def train_and_export(attnlab, work, family, kind):
    name = f"{family}-{kind}"
    rundir, hf = os.path.join(work, "runs", name), os.path.join(work, "hf", name)
    sets = ["train.steps=2", "eval.every=0", f"model.flavor={FAMILIES[family]}", f"attention={KINDS[kind]}",
            "data.train.synthetic.docs=64", "data.eval.synthetic.synthetic.docs=2", "train.batch_size=4"]
    cmd = [attnlab, "train", SPEC, "--out", rundir, "--quiet"]
    for s in sets:
        cmd += ["--set", s]
    run(cmd)
    run([attnlab, "export", rundir, "--out", hf])
    return rundir, hf


def linearize(attnlab, work, family, kind):
    """A STILL / LoLCATs student of the family's vanilla run (trained first if missing): its export/."""
    teacher = os.path.join(work, "runs", f"{family}-vanilla")
    if not os.path.isfile(os.path.join(teacher, "DONE")):
        train_and_export(attnlab, work, family, "vanilla")
    name = f"{family}-{kind}"
    rundir = os.path.join(work, "runs", name)
    spec = os.path.join(work, f"{name}.yaml")
    open(spec, "w").write(
        f"teacher: {teacher}\nattention: {STUDENTS[kind]}\nlora: {{rank: 4, alpha: 4}}\n"
        "data: {train: {synthetic: {seed: 1, docs: 16}}, eval: {synthetic: {seed: 2, docs: 2}}, seq_len: 48, batch_size: 2, val_rows: 2}\n"
        f"stage1: {{steps: 1}}\nstage2: {{steps: 1}}\ntrain: {{device: cpu}}\noutput: {rundir}\n")
    run([attnlab, "linearize", spec, "--quiet"])
    return rundir, os.path.join(rundir, "export")


def check(attnlab, work, family, kind):
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    rundir, hf = (linearize if kind in STUDENTS else train_and_export)(attnlab, work, family, kind)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    arch = cfg["architectures"][0]
    remote = [f for f in os.listdir(hf) if f.endswith(".py")]
    problems, refusal = [], None
    if kind == "vanilla":
        if arch != STOCK[family] or "auto_map" in cfg or remote:
            problems.append(f"a vanilla export should be a stock {STOCK[family]} without remote code: {arch}, files {remote}")
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    else:
        if arch == STOCK[family] or "auto_map" not in cfg or not remote:
            problems.append(f"a {kind} export should name attnlab's architecture with remote code: {arch}, files {remote}")
        try:
            AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, trust_remote_code=False)
            problems.append("loaded without trust_remote_code (a silent misload)")
        except Exception as e:  # what transformers raises is its business; that it raises is ours
            refusal = f"{type(e).__name__}: {str(e).splitlines()[0][:60]}…"
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, trust_remote_code=True)
    model.eval()
    if kind != "vanilla" and type(model).__name__ != arch:
        problems.append(f"trust_remote_code built {type(model).__name__}, config names {arch}")

    # Logits: 3 windows of the spec's w = 8 and more, so distant keys and sinks are read.
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 257, (40,), generator=g).tolist()
    tokens, out = os.path.join(work, f"{family}-{kind}.tokens"), os.path.join(work, f"{family}-{kind}.safetensors")
    open(tokens, "w").write(" ".join(map(str, ids)))
    run([attnlab, "forward", rundir, "--tokens", tokens, "--out", out])
    ours = load_file(out)["logits"]
    with torch.no_grad():
        theirs = model(torch.tensor([ids]), use_cache=False).logits[0]
    scale = ours.abs().max().item()
    diff = (theirs - ours).abs().max().item()
    if not diff <= RTOL * scale:
        problems.append(f"logits differ: max |Δ| {diff:.3e} > {RTOL} x max |logit| {scale:.2f}")

    # Greedy generation: attnlab's decode caches vs the remote code's.
    printed = run([attnlab, "generate", rundir, "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), "--greedy"])
    ours_text = printed.rstrip("\n")[len(PROMPT):]
    tok = Tokenizer.from_file(os.path.join(hf, "tokenizer.json"))
    prompt_ids = ([cfg["bos_token_id"]] if cfg.get("bos_token_id") is not None else []) + tok.encode(PROMPT).ids
    eos = cfg.get("eos_token_id")
    if eos is None:  # linearize's export: the tokenizer's EOS as attnlab takes it
        eos = next((i for i in map(tok.token_to_id, ["</s>", "<|end_of_text|>", "<|endoftext|>", "<|eot_id|>"]) if i is not None), 0)
    with torch.no_grad():
        gen = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=eos, pad_token_id=eos)
    new = gen[0, len(prompt_ids):].tolist()
    theirs_text = tok.decode(new)
    if theirs_text != ours_text:
        problems.append(f"greedy tokens differ:\n    attnlab:      {ours_text!r}\n    transformers: {theirs_text!r}")
    detail = f"max |Δlogits| {diff:.1e} (max |logit| {scale:.1f}), {len(new)} greedy tokens equal"
    if kind != "vanilla":
        detail += f"; without trust_remote_code: {refusal}"
    return type(model).__name__, detail, problems


def check_against_stock(work, family):
    """The remote code's vanilla model against transformers' own class on the same weights, with
    Llama 3.1 RoPE scaling (which the tiny runs do not train with): the family's vanilla export,
    its config given `rope_scaling: llama3`, loaded stock and as attnlab's architecture."""
    import shutil

    from transformers import AutoModelForCausalLM

    src, dst = os.path.join(work, "hf", f"{family}-vanilla"), os.path.join(work, "hf", f"{family}-vanilla-as-remote")
    cfg = json.load(open(os.path.join(src, "config.json")))
    # original_max_position_embeddings 16: every wavelength band (kept, smoothed, slowed) occurs at hd 16.
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    json.dump(cfg, open(os.path.join(src, "config.json"), "w"))
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for f in os.listdir(os.path.join(ROOT, "python", "attnlab_hf")):
        if f.startswith("attnlab_"):
            shutil.copy(os.path.join(ROOT, "python", "attnlab_hf", f), dst)
    stem = {"llama": "AttnlabLlama", "olmo2": "AttnlabOlmo2"}[family]
    cfg.update(model_type=f"attnlab_{family}", architectures=[f"{stem}ForCausalLM"], attnlab_attention={"kind": "vanilla"},
               auto_map={"AutoConfig": f"attnlab_{family}.{stem}Config", "AutoModelForCausalLM": f"attnlab_{family}.{stem}ForCausalLM"})
    json.dump(cfg, open(os.path.join(dst, "config.json"), "w"))
    stock = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ours = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32, trust_remote_code=True).eval()
    ids = torch.randint(1, 257, (1, 40), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        a, b = stock(ids).logits, ours(ids, use_cache=False).logits
    diff, scale = (a - b).abs().max().item(), a.abs().max().item()
    problems = [] if diff <= RTOL * scale else [f"{type(ours).__name__} (vanilla) vs {type(stock).__name__}: max |Δ| {diff:.3e} > {RTOL} x {scale:.2f}"]
    return type(stock).__name__, f"= {type(ours).__name__} with kind vanilla, llama3 RoPE scaling: max |Δlogits| {diff:.1e}", problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("attnlab")
    ap.add_argument("work")
    ap.add_argument("--only", help="comma-separated FAMILY-KIND names (default: all)")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    cases = [(f, k) for f in FAMILIES for k in KINDS] + [(f, k) for f in ("llama", "olmo2") for k in STUDENTS]
    if a.only:
        cases = [c for c in cases if f"{c[0]}-{c[1]}" in a.only.split(",")]
    failed = []
    for family, kind in cases:
        t0 = time.time()
        try:
            cls, detail, problems = check(os.path.abspath(a.attnlab), a.work, family, kind)
        except Exception as e:
            cls, detail, problems = "-", "", [f"{type(e).__name__}: {e}"]
        status = "ok  " if not problems else "FAIL"
        print(f"{status} {family}-{kind:8s} {cls:28s} {detail} [{time.time() - t0:.1f}s]", flush=True)
        for p in problems:
            print(f"     {p}", flush=True)
        if problems:
            failed.append(f"{family}-{kind}")
    # The remote code's Llama / OLMo 2 against transformers' own classes (an independent reference).
    for family in ("llama", "olmo2"):
        if not os.path.isdir(os.path.join(a.work, "hf", f"{family}-vanilla")):
            continue
        cases.append((family, "stock"))
        try:
            cls, detail, problems = check_against_stock(a.work, family)
        except Exception as e:
            cls, detail, problems = "-", "", [f"{type(e).__name__}: {e}"]
        print(f"{'ok  ' if not problems else 'FAIL'} {family}-stock    {cls:28s} {detail}", flush=True)
        for p in problems:
            print(f"     {p}", flush=True)
        if problems:
            failed.append(f"{family}-stock")
    print(f"{len(cases) - len(failed)} passed, {len(failed)} failed")
    if failed:
        print("failed: " + ", ".join(failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
