"""The verifier component: greedy verdicts, commits, stale blocks, limits and bad input."""

from __future__ import annotations

import time

import pytest
import torch

from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    SessionExistsError,
    SessionNotFoundError,
    StaleBaseError,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import SparseDistribution
from verifier.config import VerifierConfig
from verifier.verifier import Verifier

GREEDY = SamplingParams()
PROMPT = tuple(b"def add(a, b):")


def greedy_continuation(model: LoadedModel, prompt: tuple[int, ...], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            tokens.append(int(model.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


@pytest.fixture
def verifier(tiny_target: LoadedModel) -> Verifier:
    return Verifier(tiny_target, VerifierConfig(max_sessions=4, max_context_tokens=64))


def test_empty_block_is_greedy_target_decoding(
    verifier: Verifier, tiny_target: LoadedModel
) -> None:
    expected = greedy_continuation(tiny_target, PROMPT, 5)
    assert verifier.open_session("s", PROMPT, GREEDY, seed=0) == len(PROMPT)
    got = []
    for step in range(5):
        verdict = verifier.verify("s", DraftBlock(base_length=len(PROMPT) + step, tokens=()))
        assert verdict.num_accepted == 0 and len(verdict.tokens) == 1
        assert verdict.committed_length == len(PROMPT) + step + 1
        got.extend(verdict.tokens)
    assert got == expected


def test_correct_draft_is_accepted_with_bonus(verifier: Verifier, tiny_target: LoadedModel) -> None:
    expected = greedy_continuation(tiny_target, PROMPT, 5)
    verifier.open_session("s", PROMPT, GREEDY, seed=0)
    verdict = verifier.verify("s", DraftBlock(len(PROMPT), tuple(expected[:4])))
    assert verdict.num_accepted == 4
    assert list(verdict.tokens) == expected
    assert verdict.base_length == len(PROMPT)
    assert verdict.committed_length == len(PROMPT) + 5


def test_wrong_token_is_replaced_and_the_rest_dropped(
    verifier: Verifier, tiny_target: LoadedModel
) -> None:
    expected = greedy_continuation(tiny_target, PROMPT, 4)
    wrong = (expected[1] + 1) % 256
    verifier.open_session("s", PROMPT, GREEDY, seed=0)
    started = time.perf_counter()
    verdict = verifier.verify("s", DraftBlock(len(PROMPT), (expected[0], wrong, 7, 8)))
    assert verdict.num_accepted == 1
    assert list(verdict.tokens) == expected[:2]
    # The cache keeps the prompt and the accepted draft; the correction is fed next round.
    assert verifier.stats().num_cached_tokens == len(PROMPT) + 1
    busy_before = verifier.stats().busy_s
    follow = verifier.verify("s", DraftBlock(len(PROMPT) + 2, ()))
    busy_after = verifier.stats().busy_s
    elapsed_s = time.perf_counter() - started
    # A forward pass is compute: the busy counter grows by its time, and only by engine time.
    # The engine's clock is this one. `stats` reads the counter from this thread, while the
    # first call's step may still be running after it resolved the call: the rest of that step
    # is counted when it ends, possibly after `busy_before`. So the window starts before the
    # first call: every step counted between the two reads ran inside it.
    assert 0 < busy_after - busy_before <= elapsed_s
    assert list(follow.tokens) == expected[2:3]


def test_future_blocks_are_refused_and_stale_ones_dropped(verifier: Verifier) -> None:
    """Invariant 3: a block based past the session's committed length is refused; one based
    before it is verified only from where the session stands, if the session holds what the
    block would put there, and is otherwise dropped, committing nothing."""
    verifier.open_session("s", PROMPT, GREEDY, seed=0)
    with pytest.raises(StaleBaseError, match="committed length 14"):
        verifier.verify("s", DraftBlock(len(PROMPT) + 1, (1, 2)))
    dropped = verifier.verify("s", DraftBlock(len(PROMPT) - 1, (1, 2)))
    assert dropped.dropped and dropped.tokens == () and dropped.committed_length == len(PROMPT)
    first = verifier.verify("s", DraftBlock(len(PROMPT), (1, 2)))
    assert not first.dropped
    replayed = verifier.verify("s", DraftBlock(len(PROMPT), (1, 2)))  # now stale
    assert replayed.dropped and replayed.committed_length == first.committed_length


def test_sessions_open_close_and_limits(verifier: Verifier) -> None:
    for i in range(4):
        verifier.open_session(f"s{i}", PROMPT, GREEDY, seed=i)
    assert verifier.stats().num_sessions == 4
    assert verifier.stats().num_cached_tokens == 4 * (len(PROMPT) - 1)
    with pytest.raises(ResourceExhaustedError, match="maximum of 4 sessions"):
        verifier.open_session("s4", PROMPT, GREEDY, seed=0)
    with pytest.raises(SessionExistsError):
        verifier.open_session("s0", PROMPT, GREEDY, seed=0)
    assert verifier.close_session("s0") is True
    assert verifier.close_session("s0") is False
    with pytest.raises(SessionNotFoundError, match="no open session 's0'"):
        verifier.verify("s0", DraftBlock(len(PROMPT), ()))
    for i in range(1, 4):
        verifier.close_session(f"s{i}")
    assert verifier.stats().num_sessions == 0
    assert verifier.stats().num_cached_tokens == 0


@pytest.mark.parametrize(
    ("prompt", "seed", "message"),
    [
        ((), 0, "at least one token"),
        ((1, 2, 300), 0, r"prompt_tokens\[2\] = 300 is outside the vocabulary"),
        ((1, -1), 0, "outside the vocabulary"),
        ((1, 2), -5, "seed"),
        ((1, 2), 2**64, "seed"),
    ],
)
def test_bad_open_requests(
    verifier: Verifier, prompt: tuple[int, ...], seed: int, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        verifier.open_session("s", prompt, GREEDY, seed=seed)
    assert verifier.stats().num_sessions == 0


def test_bad_blocks(verifier: Verifier) -> None:
    verifier.open_session("s", PROMPT, SamplingParams(temperature=1.0), seed=0)
    base = len(PROMPT)
    with pytest.raises(InvalidArgumentError, match="outside the vocabulary"):
        verifier.verify("s", DraftBlock(base, (1, 999)))
    with pytest.raises(InvalidArgumentError, match="exceeds the limit"):
        verifier.verify("s", DraftBlock(base, tuple(range(33))))
    bad_q = SparseDistribution(torch.tensor([1, 2]), torch.tensor([0.5, float("nan")]))
    with pytest.raises(InvalidArgumentError):
        verifier.verify("s", DraftBlock(base, (1,), (bad_q,)))
    # Nothing above was applied.
    assert verifier.verify("s", DraftBlock(base, ())).base_length == base


def test_context_limit(tiny_target: LoadedModel) -> None:
    verifier = Verifier(tiny_target, VerifierConfig(max_context_tokens=20))
    verifier.open_session("s", PROMPT, GREEDY, seed=0)
    with pytest.raises(
        ResourceExhaustedError, match="context of 25 tokens exceeds the limit of 20"
    ):
        verifier.verify("s", DraftBlock(len(PROMPT), tuple(range(10))))
    with pytest.raises(ResourceExhaustedError, match="exceeds the limit of 20"):
        verifier.open_session("t", tuple(range(21)), GREEDY, seed=0)


def test_same_seed_same_samples(tiny_target: LoadedModel) -> None:
    def run(seed: int) -> list[int]:
        v = Verifier(tiny_target)
        v.open_session("s", PROMPT, SamplingParams(temperature=1.0), seed=seed)
        out: list[int] = []
        for _ in range(12):
            out.extend(v.verify("s", DraftBlock(len(PROMPT) + len(out), ())).tokens)
        return out

    assert run(7) == run(7)
    assert run(7) != run(8)
