# `make demo` and `make test` set themselves up on first use: a .venv with the pinned torch
# installed *before* the package (an unpinned torch would pull a multi-GB CUDA build).
# Override the pin with e.g. `make TORCH_SPEC='torch==2.5.1' test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(subst =,_,$(subst <,_,$(subst >,_,$(TORCH_SPEC))))

.PHONY: demo test bench results setup clean

setup: $(STAMP)

# pip byte-compiles on one core; compileall does it on every core (~20 s less on 2 cores) and, like pip,
# passes over the few files of a newer Python's syntax that torch ships.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-compile -e ".[test,all]"
	$(PY) -m compileall -qq -j 0 $(VENV)/lib || true
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/wansync demo

test: $(STAMP)                       # two pytest workers, one test file each at a time (pytest-xdist)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# Every table of docs/results.md, 3 seeds per cell, into runs/results/ (resumable: finished runs are
# skipped), then the page is rewritten; about 90 minutes on 2 idle cores. `make results --dry-run`
# (or RESULTS_FLAGS=--dry-run) lists every table, cell and seed with its estimated time and trains
# nothing: the `+` line runs under make's own -n/--dry-run too, with --dry-run passed on.
RESULTS_FLAGS ?=
DRY := $(if $(findstring n,$(firstword -$(MAKEFLAGS))),--dry-run)
results: $(STAMP)
	+$(PY) -m wansync results $(DRY) $(RESULTS_FLAGS)

bench: $(STAMP)                      # quick mode, a few minutes; the scripts' defaults give the recorded tables
	$(PY) benchmarks/step_overhead.py --reps 50
	$(PY) benchmarks/sync_cost.py --reps 5
	$(PY) benchmarks/framework_overhead.py --models tiny,cnn --rounds 5 --block 2 --emulator-reps 7
	$(PY) benchmarks/memory_bill.py --models tiny

clean:
	rm -rf $(VENV) runs .pytest_cache
