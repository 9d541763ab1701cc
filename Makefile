# The two set-up commands of the README are `make run` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: build run cluster test test-stress lint typecheck pytest sanitize bench bench-quick soak soak-quick clean

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

# Three nodes on the local PostgreSQL (database renderqueue_demo, created if missing) and
# a simulated fleet across them; Ctrl-C stops it all.
cluster: build
	$(PY) -m workers.cli demo --cluster 3

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# stubtest imports the built extensions and checks the .pyi stubs against them (the C
# methods carry text signatures for it).
typecheck: build
	$(VENV)/bin/mypy store shm keeper workers api wire fleet sitemap bench tests
	$(PY) -m mypy.stubtest --mypy-config-file pyproject.toml shm._atomics keeper._native

# Twice as many test processes as cores (pytest-xdist): the suite waits (on node
# processes, PostgreSQL, subprocesses, conditions) more than it computes, so one a core
# leaves the cores idle. PYTEST_ARGS="-n0" runs them in one process.
PYTEST_WORKERS ?= $(shell echo $$(( 2 * $$(nproc) )))
pytest: build
	$(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal $(PYTEST_ARGS)

test: lint typecheck pytest

# `make test` STRESS_RUNS (3) times back to back with two CPU hogs beside it: the suite
# must not flake on a loaded machine. The hogs start first and stop however the runs end
# (the trap); the first failing run fails the target. CI runs plain `make test`.
STRESS_RUNS ?= 3
STRESS      ?= stress-ng --cpu 2 --quiet
test-stress: build
	@command -v $(firstword $(STRESS)) >/dev/null || \
	  { echo "test-stress: $(firstword $(STRESS)) is missing (apt-get install stress-ng)" >&2; exit 1; }
	@$(STRESS) & hogs=$$!; \
	trap 'kill $$hogs 2>/dev/null; wait $$hogs 2>/dev/null' EXIT INT TERM; \
	for run in $$(seq $(STRESS_RUNS)); do \
	  echo "test-stress: run $$run of $(STRESS_RUNS) under $(STRESS)"; \
	  $(MAKE) --no-print-directory test || { echo "test-stress: run $$run FAILED" >&2; exit 1; }; \
	done; \
	echo "test-stress: $(STRESS_RUNS) runs passed"

# The C under AddressSanitizer and UndefinedBehaviorSanitizer: both extensions built
# into build/sanitize (the in-place ones are left alone) beside copies of their
# packages' Python, then the shared-memory tests (their cross-process races included),
# the feed ring's (Words.seqlock_run) and the keeper's C paths' tests run against them;
# the first command proves the sanitized builds are the ones imported. Python itself is
# not instrumented, so the ASan runtime is preloaded; PYTHONMALLOC=malloc puts every
# Python allocation (the C's PyMem scratch too) under ASan's redzones; leaks are not
# checked (the interpreter keeps memory at exit by design). Any report aborts the run;
# --capture=sys leaves stderr alone so the report is printed.
SAN_DIR   := build/sanitize
SAN_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer
SAN_TESTS := tests/test_shm_*.py tests/test_keeper_native.py tests/test_keeper_queue.py \
             tests/test_keeper_select.py tests/test_keeper_skips.py tests/test_keeper_slots.py \
             tests/test_keeper_core.py \
             tests/test_store_sqlite_feed_ring.py
SAN_ENV    = LD_PRELOAD="$$(gcc -print-file-name=libasan.so)" PYTHONMALLOC=malloc \
             ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 \
             UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
             PYTHONPATH="$(CURDIR)/$(SAN_DIR)/lib:$(CURDIR)"
sanitize: $(STAMP)
	rm -rf $(SAN_DIR)
	RENDERQUEUE_CFLAGS="$(SAN_FLAGS) -O1 -g" RENDERQUEUE_LDFLAGS="$(SAN_FLAGS)" \
	  $(PY) setup.py --quiet build_ext --force --build-temp $(SAN_DIR)/tmp --build-lib $(SAN_DIR)/lib
	cp shm/*.py $(SAN_DIR)/lib/shm/
	cp keeper/*.py $(SAN_DIR)/lib/keeper/
	cd $(SAN_DIR)/lib && $(SAN_ENV) $(CURDIR)/$(PY) -c \
	  'import shm._atomics as a, keeper._native as n; \
	   assert all("/$(SAN_DIR)/lib/" in m.__file__ for m in (a, n)), (a.__file__, n.__file__)'
	cd $(SAN_DIR)/lib && $(SAN_ENV) $(CURDIR)/$(PY) -m pytest -q --capture=sys \
	  -n $(PYTEST_WORKERS) -p no:cacheprovider $(addprefix $(CURDIR)/,$(SAN_TESTS))

bench: build
	$(PY) -m bench all

# Quick sections check rows, not figures, and mostly wait: two run side by side.
BENCH_QUICK_JOBS ?= 2
bench-quick: build
	$(PY) -m bench all --quick --jobs $(BENCH_QUICK_JOBS)

# The node under a fleet, writers and faults for SOAK_MINUTES (10), then every invariant
# checked from the clients' own logs (bench/sections/soak.py); soak-quick is CI's 2-minute one.
SOAK_MINUTES ?= 10
soak: build
	$(PY) -m bench soak --minutes $(SOAK_MINUTES)

soak-quick: build
	$(PY) -m bench soak --quick

clean:
	rm -rf $(VENV) build *.egg-info shm/*.so keeper/*.so
