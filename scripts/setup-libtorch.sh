#!/usr/bin/env bash
# Installs libtorch from the PyPI torch==2.11.0 wheel into .libtorch/ (git-ignored) when missing,
# exactly as ../shared/GPU.md §2: no import of torch, no CUDA toolkit; the two small nvidia wheels
# provide libcudart/libcupti that the cu130 libtorch_cpu.so links against. 543 MB, ~15 s.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -f .libtorch/torch/lib/libtorch_cpu.so ]; then
  exit 0
fi
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "setup: python3 with pip is needed to fetch libtorch from PyPI" >&2; exit 1; }
rm -rf .libtorch
"$PY" -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target .libtorch \
  torch==2.11.0 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cupti==13.0.85
test -f .libtorch/torch/lib/libtorch_cpu.so || { echo "setup: libtorch missing after pip install" >&2; exit 1; }
echo "setup: libtorch 2.11.0 installed in .libtorch/"
