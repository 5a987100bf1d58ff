"""Shared fixtures: the tiny model pair, loaded once per test session (CPU, fp32)."""

from __future__ import annotations

import pytest
import torch

from cluster.local import LocalTandem, build_local
from cluster.presets import resolve_pair
from cluster.routing.request import GenerationRequest
from verifier.runtime.models import TINY_DRAFT, TINY_TARGET, LoadedModel, ModelSpec, load_model

# The tiny models are far too small to gain from intra-op threads, and pipelined tests run
# drafter and verifier at once: one thread each keeps 2 cores from being oversubscribed.
torch.set_num_threads(1)

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
def target_only(local_tandem: LocalTandem) -> dict[str, tuple[int, ...]]:
    """Greedy target-only output (`draft_tokens=0`, MAX_TOKENS tokens) per prompt: the
    reference every lossless greedy test compares with."""
    return {
        prompt: local_tandem.router.generate(
            GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=0)
        ).tokens
        for prompt in PROMPTS
    }
