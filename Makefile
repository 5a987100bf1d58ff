# Tandem's everyday commands. `make setup` is idempotent: it builds .venv once and reinstalls
# only when pyproject.toml changes. PyTorch's CPU build is installed first, pinned: a looser
# requirement would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
PROMPT ?= def add(a, b):
PORT ?= 9000

.PHONY: setup test lint format protos demo demo-local clean

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

# The main job: start the service on a local Ray cluster (tiny preset: 2 drafters, 2
# verifiers), stream a generation through its gRPC API, show the replicas, shut it all down.
demo: setup
	$(BIN)/tandem serve --preset tiny --drafters 2 --verifiers 2 --port $(PORT) --detach
	status=0; \
	$(BIN)/tandem generate --address 127.0.0.1:$(PORT) --max-tokens 48 "$(PROMPT)" && \
	$(BIN)/tandem generate --address 127.0.0.1:$(PORT) --max-tokens 48 --json "$(PROMPT)" && \
	$(BIN)/tandem status || status=$$?; \
	$(BIN)/tandem shutdown; exit $$status

# The same loop in one process, no Ray.
demo-local: setup
	$(BIN)/tandem generate --local --preset tiny --max-tokens 48 "$(PROMPT)"
	$(BIN)/tandem generate --local --preset tiny --max-tokens 48 --json "$(PROMPT)"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
