VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: up test check lint fmt bench clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
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
	PYTHONPATH=. $(PY) -m bench.drain --engine llama --requests 48 --concurrency 2 --max-tokens 32
	PYTHONPATH=. $(PY) -m bench.accept_1m
	PYTHONPATH=. $(PY) -m bench.scale_workers

clean:
	rm -rf $(VENV) backfill-data
