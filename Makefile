# make demo: set up .venv, get the corpus, train shakespeare-char (once), generate.
# make test: set up .venv with the test extras and run the test suite.
# RETRAIN=1 make demo trains again (the old run directory is kept beside it).
# make lock: rewrite .ci/constraints.txt, the versions `make test` and `make demo` install.
# make device-check: the tests that matter and two benchmarks on an NVIDIA GPU (README).

PYTHON ?= python3
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
VENV := .venv
PY := $(VENV)/bin/python
TRAIN_SECONDS ?= 450
# The lock: pyproject.toml's ranges resolved to the versions the tests passed with (pip -c).
LOCK := .ci/constraints.txt
# The ONNX converter, installed with --no-deps: each release that runs on our jax caps
# orbax-checkpoint below the locked one, and converting imports none of its other
# requirements (pyproject.toml, the onnx extra).
JAX2ONNX := jax2onnx==0.17.1

.PHONY: demo test lock device-check clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.demo-installed: pyproject.toml $(LOCK) | $(VENV)/bin/python
	$(PY) -m pip install -q -c $(LOCK) -e .
	touch $@

# torch first, alone: pip then takes the local CPU-only wheel, not the multi-GB CUDA build.
$(VENV)/.test-installed: pyproject.toml $(LOCK) | $(VENV)/bin/python
	$(PY) -m pip install -q -c $(LOCK) torch==2.13.0
	$(PY) -m pip install -q -c $(LOCK) -e '.[test,hf]'
	$(PY) -m pip install -q --no-deps '$(JAX2ONNX)'
	touch $@

# A fresh venv in a temporary folder, the ranges with every extra installed (torch first, as
# above), frozen: the package itself left out, local build labels dropped (torch's `+cpu`:
# `torch==2.13.0` matches that build and the others alike).
lock:
	tmp=$$(mktemp -d) && trap 'rm -rf "$$tmp"' EXIT && \
	$(PYTHON) -m venv "$$tmp/venv" && \
	"$$tmp/venv/bin/python" -m pip install -q torch==2.13.0 && \
	"$$tmp/venv/bin/python" -m pip install -q -e '.[test,hf,bench]' && \
	"$$tmp/venv/bin/python" -m pip install -q --no-deps '$(JAX2ONNX)' && \
	{ echo "# pip constraints for make test and make demo: pyproject.toml's ranges resolved"; \
	  echo "# (extras test, hf, bench; Python $$("$$tmp/venv/bin/python" -c 'import platform; print(platform.python_version())')). Rewritten by make lock."; \
	  "$$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -v '^#' | \
	    sed -E 's/^([^=]+==[^+]+)\+.*/\1/'; } > $(LOCK).new && \
	mv $(LOCK).new $(LOCK)

demo: $(VENV)/.demo-installed
	$(PY) -m gpt_jax.cli demo --train-seconds $(TRAIN_SECONDS) $(if $(RETRAIN),--retrain)

# The server's page is tested in Debian's chromium, driven through chromedriver (selenium).
$(VENV)/.browser-installed: | $(VENV)/bin/python
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
	    chromium chromium-driver > $(VENV)/apt-browser.log || { tail -20 $(VENV)/apt-browser.log; exit 1; }; }
	touch $@

test: $(VENV)/.test-installed $(VENV)/.browser-installed
	$(PY) -m pytest -q -n 3 --dist loadfile  # three workers on 2 cores: compiling is mostly one core's work, and a worker often waits on a subprocess

# On a machine with an NVIDIA GPU: the CUDA build of jax, the invariant tests on the GPU, two
# benchmarks, one JSON (runs/device-check.json). Without one: one line, exit 1, no install.
device-check:
	@$(PYTHON) .ci/device_check.py

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache  # .pytest_cache holds the tests' compilation cache
