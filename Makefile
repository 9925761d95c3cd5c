# Two commands do everything on a fresh machine: `make demo` (the main job) and `make test`.
PY := .venv/bin/python
STAMP := .venv/.installed

.PHONY: setup test demo bench study study-transfer

setup: $(STAMP)

$(STAMP): requirements.txt
	@echo "make setup: creating .venv and installing the pinned requirements.txt into it (about 2 minutes, once)"
	test -x $(PY) || python3 -m venv .venv
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet --disable-pip-version-check --no-compile -r requirements.txt
	@echo "make setup: compiling the installed packages' bytecode on every core"
	@# the bytecode on every core (pip compiles on one: make setup took 155 s on 2 cores, this way 119 s). Like pip, it skips
	@# what does not compile (one torch test file in Python 3.12 syntax), hence the `|| true`
	$(PY) -m compileall -qq -j 0 .venv/lib > /dev/null || true
	touch $(STAMP)
	@echo "make setup: done; enter the venv with: source .venv/bin/activate"

# two pytest-xdist workers (CI has 2 cores); tests/scheduling.py says which tests share a worker, longest first
TEST_WORKERS ?= 2
test: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --durations=15 tests

demo: setup
	$(PY) -m pretrain.demo

study: setup
	$(PY) -m pretrain.study --config configs/study/cpu.yaml

study-transfer: setup
	$(PY) -m pretrain.study --config configs/study/cpu_transfer.yaml

bench: setup
	$(PY) -m bench.model
	OMP_NUM_THREADS=1 $(PY) -m bench.data
	OMP_NUM_THREADS=1 $(PY) -m bench.documents
	OMP_NUM_THREADS=1 $(PY) -m bench.zero_memory --dp 2 4
	$(PY) -m bench.throughput
