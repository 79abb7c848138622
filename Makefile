# Two entry points for a fresh machine (see README):
#   make demo   installs into .venv and runs the main job: FWL heads fine-tuned onto SmolLM2-135M (offline)
#   make test   installs into .venv and runs the test suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test demo demo-delta-net bench clean

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

clean:
	rm -rf $(VENV) build *.egg-info
