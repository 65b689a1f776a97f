VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: up test check lint fmt bench bench-drain-curve clean

# llama.cpp is compiled from source when it is installed. Build it for a portable x86-64
# baseline (AVX2), not for the build machine: a native build can use instructions (AMX) that the
# CPU advertises but a virtual machine does not enable, and the engine then dies with SIGILL on
# its first real batch. The pip cache is bypassed so a natively built wheel is never reused.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF

$(STAMP): pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install -q --no-cache-dir --force-reinstall --no-deps \
		"$$(grep -o 'llama-cpp-python[^"]*' pyproject.toml)"
	$(PIP) install -q -e '.[dev,local-engine]'
	touch $(STAMP)

up: $(STAMP)
	$(VENV)/bin/backfill up

check: $(STAMP)
	$(VENV)/bin/ruff format --check src tests bench
	$(VENV)/bin/ruff check src tests bench
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

fmt: $(STAMP)
	$(VENV)/bin/ruff format src tests bench
	$(VENV)/bin/ruff check --fix src tests bench

test: check
	$(VENV)/bin/pytest

# Each script prints its figures as ratios against a baseline measured in the same run.
bench: $(STAMP)
	PYTHONPATH=. $(PY) -m bench.validation
	PYTHONPATH=. $(PY) -m bench.drain
	PYTHONPATH=. $(PY) -m bench.drain --engine llama --requests 48 --concurrency 2 --max-tokens 32 --mode both
	PYTHONPATH=. $(PY) -m bench.accept_1m
	PYTHONPATH=. $(PY) -m bench.scale_workers
	PYTHONPATH=. $(PY) -m bench.drain_curve
	PYTHONPATH=. $(PY) -m bench.shared_engine
	PYTHONPATH=. $(PY) -m bench.locality

# One million-line batch, its rate per 5% of progress; writes docs/drain_curve.png.
bench-drain-curve: $(STAMP)
	PYTHONPATH=. $(PY) -m bench.drain_curve

clean:
	rm -rf $(VENV) backfill-data
