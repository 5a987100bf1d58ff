"""Prompt lookup in the router: greedy stays exact with lookup alone or beside the draft model,
looked-up blocks replace drafter calls, and sampling stays distributed as the target's.

Output is checked on routers whose verifier sessions run (the default) and on lockstep ones
(`verifier_advances` off), where looked-up and drafted blocks decide every position: what is
counted (tokens accepted, draft calls against verify passes) is counted there."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from cluster.local import InProcess, LocalTandem, text_decoder
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from drafter.config import NgramConfig
from tests.cluster.routing.fake_ports import Wrapper
from tests.cluster.routing.test_lossless_sampling import (
    ALPHA,
    CONCURRENT_REQUESTS,
    chi_square_p_value,
)
from tests.conftest import MAX_TOKENS, encode

LOOKUP = NgramConfig(enabled=True, max_ngram=4, min_ngram=2)


def router(tandem: LocalTandem, drafter: Any, advances: bool = True) -> Router:
    """A router with prompt lookup over the tandem's verifier and `drafter` (a port, or None:
    lookup alone); lockstep unless `advances`."""
    decode = text_decoder(tandem.tokenizer)
    return Router(
        InProcess(tandem.verifier), drafter, decode, tandem.target.eos_token_ids, ngram=LOOKUP,
        verifier_advances=advances,
    )  # fmt: skip


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("draft_tokens", [1, 3, 6])
@pytest.mark.parametrize("with_model", [True, False], ids=["lookup+model", "lookup-only"])
def test_greedy_with_lookup_is_lossless(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    draft_tokens: int,
    pipelined: bool,
    with_model: bool,
    advances: bool,
) -> None:
    counting = Wrapper(local_tandem.drafter)  # counts the draft calls that reach the drafter
    lookup = router(local_tandem, counting if with_model else None, advances)
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
    if not advances:
        assert accepted > 0  # looked-up tokens were accepted
        if with_model:
            # Every pass whose block was looked up skipped the drafter.
            assert 0 < counting.calls["draft"] < passes
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
@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
def test_sampled_lookup_follows_the_target(
    local_tandem: LocalTandem, tiny_target: LoadedModel, advances: bool
) -> None:
    """A looked-up block is deterministic (q one-hot). The prompt ends with a recurring
    "x = " so the first block is always looked up: a lockstep router verifies it first; one
    whose session runs posts it as the session starts, and the verifier verifies it from where
    the session then stands (or drops it). Chi-square bound as in test_lossless_sampling (a
    correct sampler fails with probability ALPHA)."""
    prompt = recurring_prompt(tiny_target)
    sampling = SamplingParams(temperature=1.0)
    lookup = router(local_tandem, None, advances)
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
    if not advances:  # every first block is verified
        assert 0 < accepted < drafted
    joint = joint_first_two(tiny_target, prompt, sampling)
    assert chi_square_p_value(counts, joint) > ALPHA
