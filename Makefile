# `make demo` and `make test` set themselves up on first use: a .venv with the pinned torch
# installed *before* the package (an unpinned torch would pull a multi-GB CUDA build).
# Override the pin with e.g. `make TORCH_SPEC='torch==2.5.1' test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(subst =,_,$(subst <,_,$(subst >,_,$(TORCH_SPEC))))

.PHONY: demo test bench setup clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test,all]"
	rm -f $(VENV)/.installed-*
	touch $@

demo: $(STAMP)
	$(VENV)/bin/wansync demo

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)                      # quick mode, a few minutes; the scripts' defaults give the recorded tables
	$(PY) benchmarks/step_overhead.py --reps 50
	$(PY) benchmarks/sync_cost.py --reps 5
	$(PY) benchmarks/framework_overhead.py --models tiny,cnn --rounds 5 --block 2 --emulator-reps 7
	$(PY) benchmarks/memory_bill.py --models tiny

clean:
	rm -rf $(VENV) runs .pytest_cache
