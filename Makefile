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

clean:
	rm -rf $(VENV) backfill-data
