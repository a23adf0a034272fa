# `make demo` and `make test` set themselves up on first use: a .venv with the pinned torch
# installed *before* the package (an unpinned torch would pull a multi-GB CUDA build).
# Override the pin with e.g. `make TORCH_SPEC='torch==2.14.1' test`, inside pyproject.toml's range (a torch outside it
# makes the package's install replace it); `make test-latest` runs the newest release tested.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(subst =,_,$(subst <,_,$(subst >,_,$(TORCH_SPEC))))
# Fashion-MNIST, the vision docs' and tests' data set: the system package, where the package manager is usable
FMNIST_DIR := /usr/share/datasets/fashion-mnist
DATA_STAMP := $(VENV)/.data-checked

.PHONY: demo test test-latest lint gpu-check bench results setup clean

setup: $(STAMP) $(DATA_STAMP)

# pip byte-compiles on one core; compileall does it on every core (~20 s less on 2 cores) and, like pip,
# passes over the few files of a newer Python's syntax that torch ships. Not the packages' own tests, nor the
# ~560 model families of transformers but the one wansync builds (llama) and its registry (auto): 37 % of the
# files, never imported here (a module left out is compiled when first imported, as pip would leave it).
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --no-compile "$(TORCH_SPEC)"
	$(PY) -m pip install -q --no-compile -e ".[test,all,lint]"
	$(PY) -m compileall -qq -j 0 -x '/tests?/|/transformers/models/(?!auto/|llama/)[^/]+/' $(VENV)/lib || true
	rm -f $(VENV)/.installed-*
	touch $@

# Once per venv: install dataset-fashion-mnist if it is missing and apt-get can (root, a reachable mirror),
# else say in one line that its tests will be skipped (they skip, each with that reason, in the summary).
$(DATA_STAMP): $(STAMP)
	@if [ -f $(FMNIST_DIR)/train-images-idx3-ubyte.gz ]; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	     && (apt-get update -qq && apt-get install -y -qq dataset-fashion-mnist) >/dev/null 2>&1; then \
	     echo "setup: installed dataset-fashion-mnist ($(FMNIST_DIR))"; \
	else echo "setup: Fashion-MNIST is not installed and apt-get cannot install it here (needs root and a mirror: apt-get install dataset-fashion-mnist); its tests will be skipped"; fi
	@if command -v wireguard-go >/dev/null 2>&1 && command -v wg >/dev/null 2>&1; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] \
	     && (apt-get install -y -qq wireguard-go wireguard-tools || (apt-get update -qq && apt-get install -y -qq wireguard-go wireguard-tools)) >/dev/null 2>&1; then \
	     echo "setup: installed wireguard-go and wireguard-tools (the test bed's tunnels)"; \
	else echo "setup: wireguard-go is not installed and apt-get cannot install it here; the tunnelled bed's tests will be skipped"; fi
	@touch $@

demo: $(STAMP) $(DATA_STAMP)
	$(VENV)/bin/wansync demo

# Byte-compiled first, and with bytecode written (a PYTHONDONTWRITEBYTECODE of the environment would have every
# process the suite starts compile wansync again, and each pytest worker rewrite every test file's asserts).
# Two workers on two cores (tests/conftest.py keeps a file that waits beside one that computes). Three kept the
# cores 98 % busy, not 87 % (324-359 s of pytest, not ~380-400 s), but beside two busy loops the timing of
# test_adapt's link drop failed: CI shares its cores.
test: $(STAMP) $(DATA_STAMP)         # two pytest workers, one test file each at a time (pytest-xdist)
	$(PY) -m compileall -q -j 0 src tests > /dev/null
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder

# The suite on the newest torch release, pyproject.toml's ceiling, in a venv of its own so that .venv keeps the pin.
# PyPI's build of it carries CUDA (several GB, downloaded once); the suite runs on its CPU path.
LATEST_TORCH_SPEC ?= torch==2.15.0
LATEST_VENV ?= .venv-latest
test-latest:
	$(MAKE) test VENV=$(LATEST_VENV) TORCH_SPEC='$(LATEST_TORCH_SPEC)'

lint: $(STAMP)                       # ruff's checks, its format check and mypy (pyproject.toml: what each covers)
	$(VENV)/bin/ruff check src tests benchmarks examples
	$(VENV)/bin/ruff format --check src tests benchmarks examples
	$(VENV)/bin/mypy

# On a GPU machine (< 5 min): every strategy on NCCL, bf16 and FSDP2 inside a worker, the codecs' and sparse
# kernels' GB/s, a ~1B model's bf16 step and the FLOP/s it implies, memory against the planner's bill.
# Without CUDA: one line, exit 0. Writes runs/gpu-check/gpu_check.json and gpu_check.md.
gpu-check: $(STAMP)
	$(PY) benchmarks/gpu_check.py

# Every table of docs/results.md, 3 seeds per cell, into runs/results/ (resumable: finished runs are
# skipped), then the page is rewritten; about three hours on 2 idle cores (the dry run's estimate).
# `make results --dry-run` (or RESULTS_FLAGS=--dry-run) lists every table, cell and seed with its
# estimated time and trains nothing: the `+` line runs under make's own -n/--dry-run too, with
# --dry-run passed on.
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
	rm -rf $(VENV) $(LATEST_VENV) runs .pytest_cache
