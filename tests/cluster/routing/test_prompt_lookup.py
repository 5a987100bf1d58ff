"""Prompt lookup in the router: greedy stays exact with lookup alone or beside the draft model,
looked-up blocks replace drafter calls, and sampling stays distributed as the target's."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from cluster.local import LocalTandem, text_decoder
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import SamplingParams, logits_to_probs
from drafter.config import NgramConfig
from drafter.drafter import Drafter
from tests.cluster.routing.test_lossless_sampling import (
    ALPHA,
    CONCURRENT_REQUESTS,
    chi_square_p_value,
)
from tests.conftest import MAX_TOKENS, encode

LOOKUP = NgramConfig(enabled=True, max_ngram=4, min_ngram=2)


class CountingDrafter:
    """The real drafter, counting the draft calls that reach it."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.num_drafts = 0

    def open_session(self, *args: Any, **kwargs: Any) -> int:
        return self.drafter.open_session(*args, **kwargs)

    def draft(self, *args: Any) -> Any:
        self.num_drafts += 1
        return self.drafter.draft(*args)

    def close_session(self, session_id: str) -> bool:
        return self.drafter.close_session(session_id)


def router(tandem: LocalTandem, drafter: Any) -> Router:
    decode = text_decoder(tandem.tokenizer)
    return Router(tandem.verifier, drafter, decode, tandem.target.eos_token_ids, ngram=LOOKUP)


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("draft_tokens", [1, 3, 6])
@pytest.mark.parametrize("with_model", [True, False], ids=["lookup+model", "lookup-only"])
def test_greedy_with_lookup_is_lossless(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    draft_tokens: int,
    pipelined: bool,
    with_model: bool,
) -> None:
    counting = CountingDrafter(local_tandem.drafter)
    lookup = router(local_tandem, counting if with_model else None)
    passes = accepted = 0
    try:
        for prompt, expected in target_only.items():
            request = GenerationRequest(
                encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=draft_tokens
            )
            result = lookup.generate(request, pipelined=pipelined)
            assert result.tokens == expected, prompt
            passes += result.stats.num_verify_passes
            accepted += result.stats.num_accepted
    finally:
        lookup.close()
    assert accepted > 0  # looked-up tokens were accepted
    if with_model:
        # Every pass whose block was looked up skipped the drafter.
        assert 0 < counting.num_drafts < passes
    assert local_tandem.drafter.stats().num_sessions == 0
    assert local_tandem.verifier.stats().num_sessions == 0


def joint_first_two(model: LoadedModel, prompt: Sequence[int], sampling: SamplingParams) -> Any:
    """Exact P(t1, t2) of sampling `model` alone after `prompt`: `[vocab, vocab]`."""
    vocab = model.vocab_size
    with torch.inference_mode():
        p1 = logits_to_probs(model.model(torch.tensor([prompt])).logits[:, -1], sampling)[0]
        contexts = torch.tensor([[*prompt, t] for t in range(vocab)])  # [vocab, len + 1]
        p2 = logits_to_probs(model.model(contexts).logits[:, -1], sampling)  # [vocab, vocab]
    return p1[:, None] * p2


def recurring_prompt(model: LoadedModel) -> tuple[int, ...]:
    """`x = T; x = ` for the byte T the target most likes to see repeated there, so that the
    looked-up block (T first) is accepted often enough to exercise both outcomes."""
    head, tail = tuple(b"x = "), tuple(b"; x = ")
    candidates = torch.tensor([[*head, t, *tail] for t in range(256)])  # [256, len]
    with torch.inference_mode():
        last = model.model(candidates).logits[:, -1].softmax(-1)  # [256, vocab]
    best = int(last[torch.arange(256), torch.arange(256)].argmax())
    return (*head, best, *tail)


@pytest.mark.slow
def test_sampled_lookup_follows_the_target(
    local_tandem: LocalTandem, tiny_target: LoadedModel
) -> None:
    """A looked-up block is deterministic (q one-hot). The prompt ends with a recurring
    "x = " so the first block is always looked up; chi-square bound as in
    test_lossless_sampling (a correct sampler fails with probability ALPHA)."""
    prompt = recurring_prompt(tiny_target)
    sampling = SamplingParams(temperature=1.0)
    lookup = router(local_tandem, None)
    counts = torch.zeros(tiny_target.vocab_size, tiny_target.vocab_size)
    drafted = accepted = 0
    requests = [
        GenerationRequest(prompt, 3, sampling, seed=seed, draft_tokens=2) for seed in range(2000)
    ]
    try:
        # Submitted together, the requests share forward passes; each draws from its own seed.
        with ThreadPoolExecutor(max_workers=CONCURRENT_REQUESTS) as pool:
            results = list(pool.map(lambda r: lookup.generate(r, pipelined=False), requests))
        for result in results:
            counts[result.tokens[0], result.tokens[1]] += 1
            drafted += result.stats.num_drafted
            accepted += result.stats.num_accepted
    finally:
        lookup.close()
    assert 0 < accepted < drafted
    joint = joint_first_two(tiny_target, prompt, sampling)
    assert chi_square_p_value(counts, joint) > ALPHA
