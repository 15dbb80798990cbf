# make demo: set up .venv, get the corpus, train shakespeare-char (once), generate.
# make test: set up .venv with the test extras and run the test suite.
# RETRAIN=1 make demo trains again (the old run directory is kept beside it).

PYTHON ?= python3
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
VENV := .venv
PY := $(VENV)/bin/python
TRAIN_SECONDS ?= 450

.PHONY: demo test clean

$(VENV)/bin/python:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(VENV)/.demo-installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q -e .
	touch $@

# torch first, alone: pip then takes the local CPU-only wheel, not the multi-GB CUDA build.
$(VENV)/.test-installed: pyproject.toml | $(VENV)/bin/python
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,hf]'
	touch $@

demo: $(VENV)/.demo-installed
	$(PY) -m gpt_jax.cli demo --train-seconds $(TRAIN_SECONDS) $(if $(RETRAIN),--retrain)

# The server's page is tested in Debian's chromium, driven through chromedriver (selenium).
$(VENV)/.browser-installed: | $(VENV)/bin/python
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }
	touch $@

test: $(VENV)/.test-installed $(VENV)/.browser-installed
	$(PY) -m pytest -q -n 3 --dist loadfile  # three workers on 2 cores: compiling is mostly one core's work, and a worker often waits on a subprocess

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache  # .pytest_cache holds the tests' compilation cache
