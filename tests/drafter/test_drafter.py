"""The drafter component: greedy and sampled drafts, exact sparse q, commits and stale bases."""

from __future__ import annotations

import pytest
import torch

from cluster.runtime.errors import InvalidArgumentError, StaleBaseError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import to_dense
from drafter.config import DrafterConfig
from drafter.drafter import Drafter, draft_sampling

PROMPT = tuple(b"def add(a, b):")
GREEDY = SamplingParams()


def greedy_continuation(model: LoadedModel, tokens: list[int], n: int) -> list[int]:
    tokens = list(tokens)
    start = len(tokens)
    with torch.inference_mode():
        for _ in range(n):
            tokens.append(int(model.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[start:]


def test_greedy_draft_is_the_draft_models_argmax(tiny_draft: LoadedModel) -> None:
    drafter = Drafter(tiny_draft)
    drafter.open_session("s", PROMPT, GREEDY, seed=0)
    block = drafter.draft("s", len(PROMPT), (), 6)
    assert block.base_length == len(PROMPT)
    assert block.draft_probs is None
    assert list(block.tokens) == greedy_continuation(tiny_draft, list(PROMPT), 6)


def test_appended_tokens_commit_before_drafting(tiny_draft: LoadedModel) -> None:
    """After a verdict (two drafts kept, then a correction) the drafter continues from it."""
    drafter = Drafter(tiny_draft)
    drafter.open_session("s", PROMPT, GREEDY, seed=0)
    first = drafter.draft("s", len(PROMPT), (), 4)
    verdict_tokens = (*first.tokens[:2], 65)
    second = drafter.draft("s", len(PROMPT), verdict_tokens, 3)
    assert second.base_length == len(PROMPT) + 3
    expected = greedy_continuation(tiny_draft, [*PROMPT, *verdict_tokens], 3)
    assert list(second.tokens) == expected
    # All-accepted case: the last drafted token was never fed to the cache.
    third = drafter.draft("s", second.base_length, (*second.tokens, 66), 2)
    context = [*PROMPT, *verdict_tokens, *second.tokens, 66]
    assert list(third.tokens) == greedy_continuation(tiny_draft, context, 2)


def test_sampled_draft_sends_the_exact_truncated_q(tiny_draft: LoadedModel) -> None:
    drafter = Drafter(tiny_draft, DrafterConfig(top_k=8))
    sampling = SamplingParams(temperature=1.0, top_p=0.95)
    drafter.open_session("s", PROMPT, sampling, seed=3)
    block = drafter.draft("s", len(PROMPT), (), 3)
    assert block.draft_probs is not None and len(block.draft_probs) == 3
    used = draft_sampling(sampling, 8)
    assert used.top_k == 8 and used.top_p == 0.95
    context = list(PROMPT)
    for token, q in zip(block.tokens, block.draft_probs, strict=True):
        with torch.inference_mode():
            logits = tiny_draft.model(torch.tensor([context])).logits[0, -1:]
        expected = logits_to_probs(logits, used)[0]
        torch.testing.assert_close(to_dense([q], tiny_draft.vocab_size)[0], expected)
        assert len(q.token_ids) <= 8
        assert token in q.token_ids.tolist()
        context.append(token)


def test_draft_sampling_keeps_the_tighter_top_k() -> None:
    assert draft_sampling(SamplingParams(temperature=1.0, top_k=5), 64).top_k == 5
    assert draft_sampling(SamplingParams(temperature=1.0), 64).top_k == 64
    assert draft_sampling(SamplingParams(temperature=1.0), 0).top_k == 0
    assert draft_sampling(GREEDY, 64) == GREEDY


def test_seeded_drafts_repeat(tiny_draft: LoadedModel) -> None:
    def run(seed: int) -> tuple[int, ...]:
        drafter = Drafter(tiny_draft)
        drafter.open_session("s", PROMPT, SamplingParams(temperature=1.5), seed=seed)
        return drafter.draft("s", len(PROMPT), (), 8).tokens

    assert run(11) == run(11)
    assert run(11) != run(12)


def test_stale_base_and_bad_requests(tiny_draft: LoadedModel) -> None:
    drafter = Drafter(tiny_draft, DrafterConfig(max_draft_tokens=8))
    drafter.open_session("s", PROMPT, GREEDY, seed=0)
    with pytest.raises(StaleBaseError):
        drafter.draft("s", len(PROMPT) + 1, (), 2)
    with pytest.raises(InvalidArgumentError, match=r"num_tokens must be in 1\.\.8"):
        drafter.draft("s", len(PROMPT), (), 9)
    with pytest.raises(InvalidArgumentError, match="num_tokens"):
        drafter.draft("s", len(PROMPT), (), 0)
    with pytest.raises(InvalidArgumentError, match=r"appended_tokens\[0\]"):
        drafter.draft("s", len(PROMPT), (257,), 2)
    # Refused requests changed nothing.
    assert drafter.draft("s", len(PROMPT), (), 2).base_length == len(PROMPT)


@pytest.mark.parametrize("field", ["max_sessions", "max_context_tokens", "max_draft_tokens"])
def test_config_validation(field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        DrafterConfig(**{field: 0})
    with pytest.raises(InvalidArgumentError, match="top_k"):
        DrafterConfig(top_k=-1)


@pytest.mark.parametrize(
    ("scale", "top", "field"),
    [(0.0, 4, "saguaro_scale"), (1.5, 4, "saguaro_scale"), (0.5, 0, "saguaro_top")],
)
def test_saguaro_settings_are_validated(scale: float, top: int, field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        DrafterConfig(saguaro_scale=scale, saguaro_top=top)
    assert DrafterConfig().saguaro_scale is None  # off by default
    assert DrafterConfig(saguaro_scale=1.0, saguaro_top=1).saguaro_scale == 1.0


def test_bad_seed_is_reported_as_sent(tiny_draft: LoadedModel) -> None:
    drafter = Drafter(tiny_draft)
    with pytest.raises(InvalidArgumentError, match="got -5"):
        drafter.open_session("s", PROMPT, SamplingParams(temperature=1.0), seed=-5)
    assert drafter.stats().num_sessions == 0


def test_a_block_ends_after_the_first_unsure_token(tiny_draft: LoadedModel) -> None:
    tokens = list(PROMPT)
    best: list[float] = []  # the draft model's top probability at each greedy step
    with torch.inference_mode():
        for _ in range(6):
            probs = tiny_draft.model(torch.tensor([tokens])).logits[0, -1].softmax(-1)
            best.append(float(probs.max()))
            tokens.append(int(probs.argmax()))
    # A threshold just above the least confident step: every earlier step clears it.
    weakest = min(range(6), key=best.__getitem__)
    gap = min(b - best[weakest] for i, b in enumerate(best) if i != weakest)
    threshold = best[weakest] + gap / 2
    drafter = Drafter(tiny_draft, DrafterConfig(min_confidence=threshold))
    drafter.open_session("s", PROMPT, GREEDY, seed=0)
    block = drafter.draft("s", len(PROMPT), (), 6)
    assert list(block.tokens) == tokens[len(PROMPT) : len(PROMPT) + weakest + 1]
    with pytest.raises(InvalidArgumentError, match="min_confidence"):
        DrafterConfig(min_confidence=1.5)
