"""Tests for verifier.rejection, in the four kinds of docs/architecture.md, "Tests".

1. Exact greedy cases: one-hot targets give the classic longest-matching-prefix rule.
2. Seeded determinism: the generator is the only source of randomness.
3. A plain loop reference of the same rule and draw protocol, compared exactly.
4. Statistics: in test_rejection_statistics.py.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import to_dense, to_sparse
from tests.verifier.rejection_reference import reference_rejection_sample, seeded, token_ids
from verifier.rejection import greedy_accept, rejection_sample


def _one_hot(token_ids: list[int], vocab: int) -> Tensor:
    rows = torch.zeros(len(token_ids), vocab)  # [len(token_ids), vocab]
    rows[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.int64)] = 1.0
    return rows


# ------------------------------------------------------------------- 1. exact greedy cases


@pytest.mark.parametrize(
    ("argmaxes", "draft", "expected", "expected_accepted"),
    [
        ([3, 1, 4, 2], [3, 1, 4], [3, 1, 4, 2], 3),  # all accepted, then the bonus argmax
        ([3, 1, 4, 2], [0, 1, 4], [3], 0),  # first rejected: the argmax replaces it
        ([3, 1, 4, 2], [3, 2, 4], [3, 1], 1),  # rejected in the middle
        ([3, 1, 4, 2], [3, 1, 0], [3, 1, 4], 2),  # last rejected
        ([5], [], [5], 0),  # k = 0: only the bonus position
    ],
)
def test_greedy_target_keeps_the_matching_prefix_then_the_argmax(
    argmaxes: list[int], draft: list[int], expected: list[int], expected_accepted: int
) -> None:
    target = _one_hot(argmaxes, vocab=6)
    for draft_probs in (None, _one_hot(draft, vocab=6)):
        tokens, num_accepted = rejection_sample(target, token_ids(*draft), draft_probs, seeded(0))
        assert tokens.tolist() == expected
        assert tokens.dtype == torch.int64
        assert num_accepted == expected_accepted


def test_greedy_target_matches_the_classic_rule_on_random_blocks() -> None:
    rng = random.Random(11)
    for _ in range(200):
        vocab, k = rng.randint(1, 8), rng.randint(0, 6)
        argmaxes = [rng.randrange(vocab) for _ in range(k + 1)]
        # Agree with the target most of the time, so long accepted prefixes occur.
        draft = [a if rng.random() < 0.7 else rng.randrange(vocab) for a in argmaxes[:k]]
        prefix = 0
        while prefix < k and draft[prefix] == argmaxes[prefix]:
            prefix += 1
        tokens, num_accepted = rejection_sample(
            _one_hot(argmaxes, vocab), token_ids(*draft), None, seeded(rng.randrange(2**31))
        )
        assert num_accepted == prefix
        assert tokens.tolist() == [*draft[:prefix], argmaxes[prefix]]


def test_greedy_target_ignores_a_sampled_draft_distribution() -> None:
    # p one-hot, q soft: p(x) = 1 >= q(x) accepts, p(x) = 0 rejects, the residual is the argmax.
    target = _one_hot([2, 0, 1], vocab=3)
    draft_probs = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2]])
    for seed in range(20):
        tokens, num_accepted = rejection_sample(target, token_ids(2, 0), draft_probs, seeded(seed))
        assert (tokens.tolist(), num_accepted) == ([2, 0, 1], 2)
        tokens, num_accepted = rejection_sample(target, token_ids(2, 1), draft_probs, seeded(seed))
        assert (tokens.tolist(), num_accepted) == ([2, 0], 1)


def test_k_zero_samples_the_bonus_from_the_first_row() -> None:
    target = torch.tensor([[0.1, 0.6, 0.3]])
    tokens, num_accepted = rejection_sample(target, token_ids(), None, seeded(4))
    expected = torch.multinomial(target[0], 1, generator=seeded(4))
    assert num_accepted == 0
    assert torch.equal(tokens, expected)


def test_zero_target_probability_is_always_rejected_and_p_at_least_q_accepted() -> None:
    target = torch.tensor([[0.0, 0.5, 0.5], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    draft_probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]])
    for seed in range(50):
        tokens, num_accepted = rejection_sample(target, token_ids(0, 0), draft_probs, seeded(seed))
        assert (tokens.tolist(), num_accepted) == ([2], 0)  # max(0, p - q) = (0, 0, 0.5)
        tokens, num_accepted = rejection_sample(target, token_ids(1, 0), draft_probs, seeded(seed))
        assert num_accepted == 2 and tokens.tolist() == [1, 0, 0]


# ------------------------------------------------------------------ 2. seeded determinism


def _soft_case() -> tuple[Tensor, Tensor, Tensor]:
    logits = torch.randn(7, 10, generator=seeded(5))
    target = logits_to_probs(logits[:4], SamplingParams(temperature=1.0))
    draft_probs = logits_to_probs(logits[4:], SamplingParams(temperature=1.0))
    draft = torch.multinomial(draft_probs, 1, generator=seeded(6)).squeeze(1)
    return target, draft, draft_probs


def test_same_seed_gives_the_same_output() -> None:
    target, draft, draft_probs = _soft_case()
    for seed in range(30):
        first = rejection_sample(target, draft, draft_probs, seeded(seed))
        second = rejection_sample(target, draft, draft_probs, seeded(seed))
        assert first[0].tolist() == second[0].tolist() and first[1] == second[1]


def test_different_seeds_give_different_outputs() -> None:
    target, draft, draft_probs = _soft_case()
    outputs = {
        tuple(rejection_sample(target, draft, draft_probs, seeded(seed))[0].tolist())
        for seed in range(200)
    }
    assert len(outputs) > 5


# ------------------------------------------------------------------ 3. loop reference


def _random_probs(rows: int, vocab: int, rng: random.Random, gen: torch.Generator) -> Tensor:
    """Rows as a sampler would use them: greedy, tempered, top-k / top-p truncated, masked."""
    logits = 2 * torch.randn(rows, vocab, generator=gen)  # [rows, vocab]
    if rng.random() < 0.3:
        logits[torch.rand(rows, vocab, generator=gen) < 0.4] = -torch.inf
        logits[:, rng.randrange(vocab)] = 0.0  # every row keeps at least one token
    params = SamplingParams(
        temperature=rng.choice([0.0, 0.5, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 1, 2, 4]),
        top_p=rng.choice([1.0, 1.0, 0.5, 0.9]),
    )
    return logits_to_probs(logits, params)


def _random_case(rng: random.Random, gen: torch.Generator) -> tuple[Tensor, Tensor, Tensor | None]:
    vocab, k = rng.randint(1, 12), rng.randint(0, 5)
    target = _random_probs(k + 1, vocab, rng, gen)
    kind = rng.choice(["deterministic", "dense", "sparse"])
    if kind == "deterministic":
        return target, torch.randint(vocab, (k,), generator=gen), None
    draft_probs = _random_probs(k, vocab, rng, gen)
    if kind == "sparse":
        draft_probs = to_dense([to_sparse(row) for row in draft_probs], vocab)
    if rng.random() < 0.2:
        draft_probs[: k // 2] = target[: k // 2]  # p == q at some positions
    draft = torch.multinomial(draft_probs, 1, generator=gen).flatten() if k else token_ids()
    return target, draft, draft_probs


def test_matches_the_loop_reference_exactly() -> None:
    rng, gen = random.Random(2024), seeded(2024)
    num_rejections = 0
    for case in range(600):
        target, draft, draft_probs = _random_case(rng, gen)
        seed = rng.randrange(2**31)
        vectorised, reference = seeded(seed), seeded(seed)
        tokens, num_accepted = rejection_sample(target, draft, draft_probs, vectorised)
        expected, expected_accepted = reference_rejection_sample(
            target, draft, draft_probs, reference
        )
        assert (tokens.tolist(), num_accepted) == (expected.tolist(), expected_accepted), case
        # Same number of draws: the generators end in the same state.
        assert torch.equal(vectorised.get_state(), reference.get_state()), case
        num_rejections += num_accepted < len(draft)
    assert num_rejections > 100  # the recovered-token path was exercised, not only bonuses


def test_deterministic_draft_is_the_same_as_one_hot_draft_probs() -> None:
    rng, gen = random.Random(8), seeded(8)
    for _ in range(100):
        k, vocab = rng.randint(1, 5), rng.randint(2, 9)
        target = _random_probs(k + 1, vocab, rng, gen)
        draft = torch.randint(vocab, (k,), generator=gen)
        seed = rng.randrange(2**31)
        implicit = rejection_sample(target, draft, None, seeded(seed))
        explicit = rejection_sample(target, draft, _one_hot(draft.tolist(), vocab), seeded(seed))
        assert implicit[0].tolist() == explicit[0].tolist() and implicit[1] == explicit[1]


def test_zero_residual_falls_back_to_the_target_row() -> None:
    # p <= q everywhere, so max(0, p - q) is all zero. Between two distributions that happens
    # only through rounding (rejection odds ~1e-7); p is scaled down here to reach the branch.
    target = torch.tensor([[0.4, 0.5], [1.0, 0.0]])
    draft_probs = torch.tensor([[0.5, 0.5]])
    outcomes = set()
    for seed in range(200):
        tokens, num_accepted = rejection_sample(target, token_ids(0), draft_probs, seeded(seed))
        expected = reference_rejection_sample(target, token_ids(0), draft_probs, seeded(seed))
        assert (tokens.tolist(), num_accepted) == (expected[0].tolist(), expected[1])
        outcomes.add(tuple(tokens.tolist()))
    # Rejected, then sampled from p: the rejected token itself can come back.
    assert outcomes == {(0, 0), (0,), (1,)}


@pytest.mark.parametrize(
    ("target", "draft", "draft_probs", "message"),
    [
        (torch.ones(3), token_ids(0, 1), None, "target_probs"),
        (torch.ones(3, 4, dtype=torch.int64), token_ids(0, 1), None, "target_probs"),
        (torch.full((3, 4), 0.25), token_ids(0), None, "k \\+ 1"),
        (torch.full((3, 4), 0.25), token_ids(0, 1).int(), None, "int64"),
        (torch.full((3, 4), 0.25), token_ids(0, 4), None, "draft token ids"),
        (torch.full((3, 4), 0.25), token_ids(-1, 0), None, "draft token ids"),
        (torch.full((3, 4), 0.25), token_ids(0, 1), torch.full((2, 5), 0.2), "shape"),
        (torch.full((3, 4), 0.25), token_ids(0, 1), torch.full((3, 4), 0.25), "shape"),
        (torch.full((3, 4), 0.25), token_ids(0, 1), torch.full((4,), 0.25), "draft_probs"),
        (torch.full((3, 4), 0.25), token_ids(0, 1), _one_hot([0, 2], 4), "probability 0"),
        (torch.full((3, 4), torch.nan), token_ids(0, 1), None, "finite"),
        (torch.zeros(3, 4), token_ids(0, 1), None, "positive mass"),
        (torch.full((3, 4), 0.25), token_ids(0, 1), torch.full((2, 4), -0.25), "draft_probs"),
    ],
)
def test_invalid_inputs_raise(
    target: Tensor, draft: Tensor, draft_probs: Tensor | None, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        rejection_sample(target, draft, draft_probs, seeded(0))


def test_the_greedy_rule_on_argmaxes_is_rejection_sampling_on_one_hot_rows() -> None:
    generator = torch.Generator().manual_seed(5)
    vocab = 6
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=generator))
        targets = torch.randint(0, vocab, (k + 1,), generator=generator).tolist()
        drafts = [t if bool(torch.rand(1, generator=generator) < 0.7) else (t + 1) % vocab
                  for t in targets[:k]]  # fmt: skip
        rows = torch.nn.functional.one_hot(torch.tensor(targets), vocab).float()
        out, accepted = rejection_sample(rows, torch.tensor(drafts, dtype=torch.long), None, None)
        n, tokens, deferred = greedy_accept(drafts, targets)
        assert (n, list(tokens), deferred) == (accepted, out.tolist(), None)
        n, tokens, deferred = greedy_accept(drafts, targets, defer_bonus=True)
        if 0 < k == n:  # all accepted: the bonus waits for the next block
            assert (tokens, deferred) == (tuple(drafts), targets[k])
        else:
            assert deferred is None and tokens[-1] == targets[n]
    with pytest.raises(InvalidArgumentError, match="need 3 target tokens"):
        greedy_accept([1, 2], [1, 2])
