# The two set-up commands of the README are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: build run test lint typecheck pytest bench bench-quick clean

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip "setuptools>=69" wheel
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

# Phony: setuptools leaves a build/ directory, which would make `build` look done and
# skip recompiling a changed C source (build_ext itself only recompiles what changed).
build: $(STAMP)
	$(PY) setup.py --quiet build_ext --inplace

run: build
	$(PY) -m workers.cli demo --with-fleet

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

typecheck: $(STAMP)
	$(VENV)/bin/mypy store shm keeper workers api fleet sitemap

pytest: build
	$(PY) -m pytest -q $(PYTEST_ARGS)

test: lint typecheck pytest

bench: build
	$(PY) -m bench all

bench-quick: build
	$(PY) -m bench all --quick

clean:
	rm -rf $(VENV) build *.egg-info shm/*.so
