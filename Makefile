# Two entry points for a fresh machine (see README):
#   make demo   installs into .venv and runs the main job: FWL heads fine-tuned onto SmolLM2-135M (offline)
#   make test   installs into .venv and runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test demo demo-delta-net bench gpu-wheels clean

$(STAMP): setup.cfg pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# torch==2.13.0 is the CPU wheel on this machine's disk; an unpinned torch would pull a multi-GB CUDA build.
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e '.[test]'
	# the C++ CPU kernels, compiled now (where a compiler exists) instead of on first use; cached per torch version
	$(PY) -m fwp_kernels.build || echo "fwp_kernels: a C++ kernel did not build; its PyTorch path runs instead"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q tests

demo: $(STAMP)
	$(PY) -m training.finetune_fwl

# the from-scratch Delta Net demo (not part of the two set-up commands)
demo-delta-net: $(STAMP)
	$(PY) -m training.demo

bench: $(STAMP)
	$(PY) benchmarks/bench_generation.py

# the wheels benchmarks/gpu_check.sh installs on a GPU machine without network (a lent H100 has torch, triton and
# einops, Python 3.12, x86-64): flash-linear-attention 0.6, this project's transformers and its regex
gpu-wheels:
	mkdir -p .whl
	$(PYTHON) -m pip download --quiet --no-deps -d .whl fla-core==0.6.0 flash-linear-attention==0.6.0 einops==0.8.2 \
		transformers==5.24.0
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
		regex==2026.11.19

clean:
	rm -rf $(VENV) build *.egg-info
