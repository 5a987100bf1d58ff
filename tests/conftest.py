"""Shared fixtures: the tiny model pair, loaded once per test session (CPU, fp32)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from cluster.local import LocalTandem, build_local, local_router
from cluster.presets import resolve_pair
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.model_spec import TINY_DRAFT, TINY_TARGET, ModelSpec
from cluster.runtime.models import LoadedModel, load_model
from cluster.runtime.pack_catalog import CACHE_ENV
from cluster.serve.loopback import SERVER_PORTS, SERVER_PORTS_ENV
from tests.ray_guard import RayGuard
from tests.xdist_groups import GroupScheduling, name_groups_file, write_groups

# The tiny models are far too small to gain from intra-op threads, and pipelined tests run
# drafter and verifier at once: one thread each keeps 2 cores from being oversubscribed.
torch.set_num_threads(1)

SERVICE_GROUP = "service"
"""The xdist group of every test on the session's service (tests/cluster/conftest.py): one
worker starts it once and runs them all; the other workers take the rest."""


def pytest_configure(config: pytest.Config) -> None:
    name_groups_file(config)
    guard = RayGuard()
    config.pluginmanager.register(guard, "ray_guard")
    config.add_cleanup(guard.stop)
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and SERVER_PORTS_ENV not in os.environ:
        # Each xdist worker, and every service it starts, picks ports from its own slice.
        index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
        size = len(SERVER_PORTS) // count
        low = SERVER_PORTS.start + index * size
        os.environ[SERVER_PORTS_ENV] = f"{low}-{low + size - 1}"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The session service's tests form one xdist group, and the longest work comes first.

    xdist hands each worker a module (or the group) at a time, in this order when run with
    `--no-loadscope-reorder` (`make test`): the group first, then the modules that start a
    cluster of their own, then the other slow ones, then the rest, which fill in at the end.
    The sort is stable, so tests keep their order within a module."""
    on_service = set()
    for item in items:
        # The last definition is the one the test gets (modules may define their own).
        definitions = item._fixtureinfo.name2fixturedefs.get("service", ())  # type: ignore[attr-defined]
        if definitions and definitions[-1].baseid == "tests/cluster":
            item.add_marker(pytest.mark.xdist_group(SERVICE_GROUP))
            on_service.add(item)
    write_groups(config, {item.nodeid: SERVICE_GROUP for item in on_service})
    rank: dict[str, int] = {}
    for item in items:
        if item not in on_service:
            mark = (
                1 if item.get_closest_marker("ray") else 2 if item.get_closest_marker("slow") else 3
            )
            rank[item.path.as_posix()] = min(mark, rank.get(item.path.as_posix(), 3))
    items.sort(key=lambda item: 0 if item in on_service else rank[item.path.as_posix()])


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> GroupScheduling | None:
    """`--dist loadgroup` that keeps each group on one worker (tests/xdist_groups.py)."""
    return GroupScheduling(config, log) if config.getvalue("dist") == "loadgroup" else None  # type: ignore[arg-type]


CODE_PROMPT = "def add(a, b):"
PROMPTS = (
    CODE_PROMPT,
    "x",
    "The quick brown fox jumps over the lazy dog. ",
    '{"name": "tandem", "version": 1, "tags": [',
    "import numpy as np\nimport torch\n\nclass Model:\n    def __init__(self):\n",
    "Once upon a time, in a land far away, ",
    "SELECT id, name FROM users WHERE",
    "Zürich – naïve café ☕ ",
)
MAX_TOKENS = 40
"""Tokens generated per prompt by the `target_only` reference."""


def encode(tandem: LocalTandem, text: str) -> tuple[int, ...]:
    return tuple(tandem.tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="session")
def tiny_target() -> LoadedModel:
    return load_model(ModelSpec(TINY_TARGET, device="cpu"))


@pytest.fixture(scope="session")
def tiny_draft() -> LoadedModel:
    return load_model(ModelSpec(TINY_DRAFT, device="cpu"))


@pytest.fixture(scope="session")
def local_tandem() -> LocalTandem:
    """Drafter, verifier and router over the tiny pair, in this process."""
    return build_local(resolve_pair("tiny", device="cpu"))


@pytest.fixture(scope="session")
def lockstep(local_tandem: LocalTandem) -> Router:
    """A router over the same drafter and verifier whose verifier sessions do not run: one
    round at a time, every token through a posted block, the first round waiting for the
    drafter (`verifier_advances` off), so that drafted tokens decide every position a test
    looks at. The in-process tiny drafter is no faster than its verifier: with sessions that
    run, its blocks mostly come after the verifier has taken those tokens alone."""
    return local_router(
        local_tandem.verifier, local_tandem.drafter, local_tandem.target, verifier_advances=False
    )


@pytest.fixture(scope="session")
def target_only(local_tandem: LocalTandem) -> dict[str, tuple[int, ...]]:
    """Greedy target-only output (`draft_tokens=0`, MAX_TOKENS tokens) per prompt: the
    reference every lossless greedy test compares with."""
    return {
        prompt: local_tandem.router.generate(
            GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=0)
        ).tokens
        for prompt in PROMPTS
    }


TRIMMED_VOCAB = 48
"""The trimmed tiny draft scores this many of its 257 ids (the corpus's commonest bytes)."""


@contextmanager
def models_cache(path: Path) -> Iterator[None]:
    """The model cache (where token frequency tables of non-folder models are stored) moved
    to `path` while the block runs, so that tests never write to the user's cache."""
    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(path)
    try:
        yield
    finally:
        if saved is None:
            del os.environ[CACHE_ENV]
        else:
            os.environ[CACHE_ENV] = saved


@pytest.fixture(scope="session")
def vocab_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model cache for the session's trimmed drafts: their table is counted once."""
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def trimmed_tandem(vocab_cache: Path) -> Iterator[LocalTandem]:
    """The tiny pair with its draft trimmed to TRIMMED_VOCAB ids, in this process."""
    pair = resolve_pair("tiny", device="cpu")
    draft = dataclasses.replace(pair.draft, trimmed_vocab=TRIMMED_VOCAB)
    with models_cache(vocab_cache):
        tandem = build_local(dataclasses.replace(pair, draft=draft))
    yield tandem
    tandem.router.close()
