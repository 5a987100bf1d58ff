"""A KV pool too small for the requests running at once: they are delayed, never failed.

Both replicas get a pool of a few blocks, far less than eight concurrent greedy requests grow to,
and admission is told to let them all in (`kv_overcommit`); on the CPU, and on a CUDA device
when there is one. The engine then preempts the newest
sessions for the oldest ones' growth and recomputes them later; every request must still end
with exactly the target's own output, and the preemptions must have happened (or the test
proves nothing).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from cluster.local import LocalTandem, build_local
from cluster.presets import resolve_pair
from cluster.routing.request import GenerationRequest
from cluster.runtime.kv_pool import kv_bytes_per_token
from cluster.runtime.models import load_model
from drafter.config import DrafterConfig
from tests.conftest import PROMPTS, encode
from verifier.config import VerifierConfig

MAX_TOKENS = 64
POOL_BLOCKS = 16
"""Blocks of 16 tokens per replica: one sequence at the context limit, about three requests
at full length."""


DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
        ],
    ),
]


@pytest.fixture(scope="module", params=DEVICES)
def cramped(request: pytest.FixtureRequest) -> Iterator[LocalTandem]:
    pair = resolve_pair("tiny", device=request.param)
    target, draft = load_model(pair.target), load_model(pair.draft)
    per_block = {
        "verifier": 16 * kv_bytes_per_token(target.model),
        "drafter": 16 * kv_bytes_per_token(draft.model),
    }
    limits: dict[str, Any] = {"max_context_tokens": 256, "kv_overcommit": 8.0, "kv_block_size": 16}
    tandem = build_local(
        pair,
        drafter_config=DrafterConfig(kv_cache_bytes=POOL_BLOCKS * per_block["drafter"], **limits),
        verifier_config=VerifierConfig(
            kv_cache_bytes=POOL_BLOCKS * per_block["verifier"], **limits
        ),
    )
    yield tandem
    tandem.router.close()
    tandem.verifier.close()
    tandem.drafter.close()


def test_a_pool_too_small_for_the_requests_at_once_delays_them_and_changes_nothing(
    cramped: LocalTandem,
) -> None:
    requests = [
        GenerationRequest(encode(cramped, prompt), MAX_TOKENS, draft_tokens=4)
        for prompt in PROMPTS[:8]
    ]
    # The target alone, one request at a time: each fits the pool, so nothing is preempted.
    expected = [
        cramped.router.generate(
            GenerationRequest(r.prompt_tokens, MAX_TOKENS, draft_tokens=0)
        ).tokens
        for r in requests
    ]
    assert cramped.verifier.stats().engine.preemptions == 0  # type: ignore[union-attr]
    assert cramped.verifier.stats().engine.kv_blocks_total == POOL_BLOCKS  # type: ignore[union-attr]
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(cramped.router.generate, requests))
    assert [r.tokens for r in results] == expected
    sides = {"verifier": cramped.verifier.stats(), "drafter": cramped.drafter.stats()}
    engines = {side: stats.engine for side, stats in sides.items()}
    preemptions = recomputed = 0
    for engine in engines.values():
        assert engine is not None
        preemptions += engine.preemptions
        recomputed += engine.recomputed_tokens
    assert preemptions > 0 and recomputed > 0, engines
    assert engines["verifier"].refusals == 0  # type: ignore[union-attr]
    for stats in sides.values():
        assert stats.num_sessions == 0
        assert stats.engine.kv_blocks_used == 0  # type: ignore[union-attr]
