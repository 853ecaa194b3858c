# Two commands do everything on a fresh machine; each bootstraps .venv first.
#   make serve   run the main job (for now: the router benchmark; see README)
#   make test    lint, type-check and run the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

test: lint
	$(BIN)/pytest -q

bench: $(STAMP)
	$(BIN)/fencepost bench router

serve: bench
