# Tandem's everyday commands. `make setup` is idempotent: it builds .venv once and reinstalls
# only when pyproject.toml changes. PyTorch's CPU build is installed first, pinned: a looser
# requirement would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
PROMPT ?= def add(a, b):

.PHONY: setup test lint format protos demo clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The README's test command: lint, type checks, generated-code drift, then the test suite.
test: lint
	$(BIN)/python -m pytest

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/python -m protos.build --check

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protos: setup
	$(BIN)/python -m protos.build

# The main job: a speculative generation in-process on the tiny preset, streamed to the terminal.
demo: setup
	$(BIN)/tandem generate --local --preset tiny --max-tokens 48 "$(PROMPT)"
	$(BIN)/tandem generate --local --preset tiny --max-tokens 48 --json "$(PROMPT)"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
