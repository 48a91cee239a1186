# attnlab set-up and everyday commands. Everything builds in release mode (GPU.md §8: one cold
# release build is ~32 min on 2 cores, measured from a fresh clone; tests reuse it).
.PHONY: demo test setup build gpu-bin fixture clean-results

setup:
	@./scripts/setup-libtorch.sh

build: setup
	cargo build --release

# The main job on the built-in default: tiny vanilla, DAR and uniform models on the synthetic corpus.
demo: build
	./target/release/attnlab compare

# Library tests run one at a time: libtorch's random generator is process-wide, and tests that seed it
# (e.g. an interrupted-and-resumed run compared with an uninterrupted one) must not interleave.
test: setup
	cargo test --release --lib -- --test-threads=1
	cargo test --release --test cli

# Lean training binary for the GPU host (no polars/plotters/hf-hub), stripped, in .gpu/.
gpu-bin: setup
	cargo build --release --no-default-features
	mkdir -p .gpu && cp target/release/attnlab .gpu/attnlab && strip .gpu/attnlab
	cargo build --release
	@ls -la .gpu/attnlab

# Regenerate the Hugging Face parity fixture (needs torch + transformers in .venv-fixture).
fixture:
	.venv-fixture/bin/python scripts/make_neox_fixture.py

clean-results:
	rm -rf results/tiny results/compare
