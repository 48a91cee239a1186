"""Print attnlab's lm-eval-format results with lm-evaluation-harness's own `make_table`, and check
the files against the layout lm-eval itself writes (tests/fixtures/lm_eval/, from
scripts/make_lm_eval_fixture.py).

    python3 -m venv /tmp/lme && /tmp/lme/bin/pip install lm-eval
    /tmp/lme/bin/python scripts/check_lm_eval_format.py RUN/lm_eval/results_<date>.json [...]

Exits non-zero when a file lacks one of lm-eval's keys or make_table cannot print it.
"""
import glob
import json
import os
import sys

from lm_eval.utils import make_table

FIXTURE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "lm_eval")


def fixture_keys():
    (res,) = glob.glob(os.path.join(FIXTURE, "results_*.json"))
    sample_keys = set()
    for f in glob.glob(os.path.join(FIXTURE, "samples_*.jsonl")):
        for line in open(f):
            d = json.loads(line)
            sample_keys |= {k for k in d if k not in d["metrics"]}
    return set(json.load(open(res))), sample_keys


def check(path, top, sample_top):
    r = json.load(open(path))
    missing = {"results", "versions", "n-shot", "higher_is_better", "n-samples", "config", "configs"} - set(r)
    assert not missing, f"{path}: missing {missing}"
    extra = set(r) - top - {"attnlab_version"}
    assert not extra, f"{path}: keys lm-eval does not write: {extra}"
    for task, res in r["results"].items():
        assert str(r["versions"][task]).startswith("attnlab-"), f"{task}: version {r['versions'][task]}"
        for k in res:
            if k != "alias":
                m, _, f = k.partition(",")
                assert f, f"{task}: {k} is not <metric>,<filter>"
                other = f"{m[:-7]},{f}" if m.endswith("_stderr") else f"{m}_stderr,{f}"
                assert other in res, f"{task}: {k} without {other}"
        date = os.path.basename(path)[len("results_"):-len(".json")]
        sp = os.path.join(os.path.dirname(path), f"samples_{task}_{date}.jsonl")
        n = 0
        for line in open(sp):
            s = json.loads(line)
            keys = {k for k in s if k not in s["metrics"]}
            assert keys == sample_top, f"{sp}: sample keys {sorted(keys)} != lm-eval's {sorted(sample_top)}"
            assert all(m in s for m in s["metrics"]), f"{sp}: a listed metric has no value"
            n += 1
        print(f"{task}: {n} samples in {os.path.basename(sp)}")
    print(make_table(r))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    top, sample_top = fixture_keys()
    for p in sys.argv[1:]:
        check(p, top, sample_top)
