"""Tests for verifier.rejection, in the four kinds of STYLE.md.

1. Exact greedy cases: one-hot targets give the classic longest-matching-prefix rule.
2. Seeded determinism: the generator is the only source of randomness.
3. A plain loop reference of the same rule and draw protocol, compared exactly.
4. Statistics: emitted tokens are distributed as the target, and a wrong sampler is caught.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from scipy.stats import chi2
from torch import Tensor

from verifier.errors import InvalidArgumentError
from verifier.rejection import rejection_sample
from verifier.sampling import SamplingParams, logits_to_probs, to_dense, to_sparse

Sampler = Callable[[Tensor, Tensor, Tensor | None, torch.Generator], tuple[Tensor, int]]


def _one_hot(token_ids: list[int], vocab: int) -> Tensor:
    rows = torch.zeros(len(token_ids), vocab)  # [len(token_ids), vocab]
    rows[torch.arange(len(token_ids)), torch.tensor(token_ids, dtype=torch.int64)] = 1.0
    return rows


def _tokens(*token_ids: int) -> Tensor:
    return torch.tensor(token_ids, dtype=torch.int64)


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


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
        tokens, num_accepted = rejection_sample(target, _tokens(*draft), draft_probs, _seeded(0))
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
            _one_hot(argmaxes, vocab), _tokens(*draft), None, _seeded(rng.randrange(2**31))
        )
        assert num_accepted == prefix
        assert tokens.tolist() == [*draft[:prefix], argmaxes[prefix]]


def test_greedy_target_ignores_a_sampled_draft_distribution() -> None:
    # p one-hot, q soft: p(x) = 1 >= q(x) accepts, p(x) = 0 rejects, the residual is the argmax.
    target = _one_hot([2, 0, 1], vocab=3)
    draft_probs = torch.tensor([[0.2, 0.3, 0.5], [0.6, 0.2, 0.2]])
    for seed in range(20):
        tokens, num_accepted = rejection_sample(target, _tokens(2, 0), draft_probs, _seeded(seed))
        assert (tokens.tolist(), num_accepted) == ([2, 0, 1], 2)
        tokens, num_accepted = rejection_sample(target, _tokens(2, 1), draft_probs, _seeded(seed))
        assert (tokens.tolist(), num_accepted) == ([2, 0], 1)


def test_k_zero_samples_the_bonus_from_the_first_row() -> None:
    target = torch.tensor([[0.1, 0.6, 0.3]])
    tokens, num_accepted = rejection_sample(target, _tokens(), None, _seeded(4))
    expected = torch.multinomial(target[0], 1, generator=_seeded(4))
    assert num_accepted == 0
    assert torch.equal(tokens, expected)


def test_zero_target_probability_is_always_rejected_and_p_at_least_q_accepted() -> None:
    target = torch.tensor([[0.0, 0.5, 0.5], [0.5, 0.5, 0.0], [1.0, 0.0, 0.0]])
    draft_probs = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.8, 0.0]])
    for seed in range(50):
        tokens, num_accepted = rejection_sample(target, _tokens(0, 0), draft_probs, _seeded(seed))
        assert (tokens.tolist(), num_accepted) == ([2], 0)  # max(0, p - q) = (0, 0, 0.5)
        tokens, num_accepted = rejection_sample(target, _tokens(1, 0), draft_probs, _seeded(seed))
        assert num_accepted == 2 and tokens.tolist() == [1, 0, 0]


# ------------------------------------------------------------------ 2. seeded determinism


def _soft_case() -> tuple[Tensor, Tensor, Tensor]:
    logits = torch.randn(7, 10, generator=_seeded(5))
    target = logits_to_probs(logits[:4], SamplingParams(temperature=1.0))
    draft_probs = logits_to_probs(logits[4:], SamplingParams(temperature=1.0))
    draft = torch.multinomial(draft_probs, 1, generator=_seeded(6)).squeeze(1)
    return target, draft, draft_probs


def test_same_seed_gives_the_same_output() -> None:
    target, draft, draft_probs = _soft_case()
    for seed in range(30):
        first = rejection_sample(target, draft, draft_probs, _seeded(seed))
        second = rejection_sample(target, draft, draft_probs, _seeded(seed))
        assert first[0].tolist() == second[0].tolist() and first[1] == second[1]


def test_different_seeds_give_different_outputs() -> None:
    target, draft, draft_probs = _soft_case()
    outputs = {
        tuple(rejection_sample(target, draft, draft_probs, _seeded(seed))[0].tolist())
        for seed in range(200)
    }
    assert len(outputs) > 5


# ------------------------------------------------------------------ 3. loop reference


def _reference_rejection_sample(
    target_probs: Tensor,  # [k + 1, vocab]
    draft_tokens: Tensor,  # [k]
    draft_probs: Tensor | None,  # [k, vocab]
    generator: torch.Generator,
) -> tuple[Tensor, int]:
    """The rule, one position at a time, with the module's draw protocol."""
    k, vocab = len(draft_tokens), target_probs.shape[1]
    p = target_probs.float()
    q = torch.zeros(k, vocab) if draft_probs is None else draft_probs.float().clone()
    if draft_probs is None:
        for i in range(k):
            q[i, draft_tokens[i]] = 1.0
    u = torch.rand(k, generator=generator) if k > 0 else None
    emitted: list[int] = []
    for i in range(k):
        x = int(draft_tokens[i])
        assert u is not None
        if bool(u[i] < p[i, x] / q[i, x]):
            emitted.append(x)
            continue
        residual = torch.clamp(p[i] - q[i], min=0.0)
        row = residual if float(residual.sum()) > 0 else p[i]
        emitted.append(int(torch.multinomial(row, 1, generator=generator)))
        return torch.tensor(emitted), i
    emitted.append(int(torch.multinomial(p[k], 1, generator=generator)))
    return torch.tensor(emitted), k


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
    draft = torch.multinomial(draft_probs, 1, generator=gen).flatten() if k else _tokens()
    return target, draft, draft_probs


def test_matches_the_loop_reference_exactly() -> None:
    rng, gen = random.Random(2024), _seeded(2024)
    num_rejections = 0
    for case in range(600):
        target, draft, draft_probs = _random_case(rng, gen)
        seed = rng.randrange(2**31)
        vectorised, reference = _seeded(seed), _seeded(seed)
        tokens, num_accepted = rejection_sample(target, draft, draft_probs, vectorised)
        expected, expected_accepted = _reference_rejection_sample(
            target, draft, draft_probs, reference
        )
        assert (tokens.tolist(), num_accepted) == (expected.tolist(), expected_accepted), case
        # Same number of draws: the generators end in the same state.
        assert torch.equal(vectorised.get_state(), reference.get_state()), case
        num_rejections += num_accepted < len(draft)
    assert num_rejections > 100  # the recovered-token path was exercised, not only bonuses


def test_deterministic_draft_is_the_same_as_one_hot_draft_probs() -> None:
    rng, gen = random.Random(8), _seeded(8)
    for _ in range(100):
        k, vocab = rng.randint(1, 5), rng.randint(2, 9)
        target = _random_probs(k + 1, vocab, rng, gen)
        draft = torch.randint(vocab, (k,), generator=gen)
        seed = rng.randrange(2**31)
        implicit = rejection_sample(target, draft, None, _seeded(seed))
        explicit = rejection_sample(target, draft, _one_hot(draft.tolist(), vocab), _seeded(seed))
        assert implicit[0].tolist() == explicit[0].tolist() and implicit[1] == explicit[1]


def test_zero_residual_falls_back_to_the_target_row() -> None:
    # p <= q everywhere, so max(0, p - q) is all zero. Between two distributions that happens
    # only through rounding (rejection odds ~1e-7); p is scaled down here to reach the branch.
    target = torch.tensor([[0.4, 0.5], [1.0, 0.0]])
    draft_probs = torch.tensor([[0.5, 0.5]])
    outcomes = set()
    for seed in range(200):
        tokens, num_accepted = rejection_sample(target, _tokens(0), draft_probs, _seeded(seed))
        expected = _reference_rejection_sample(target, _tokens(0), draft_probs, _seeded(seed))
        assert (tokens.tolist(), num_accepted) == (expected[0].tolist(), expected[1])
        outcomes.add(tuple(tokens.tolist()))
    # Rejected, then sampled from p: the rejected token itself can come back.
    assert outcomes == {(0, 0), (0,), (1,)}


@pytest.mark.parametrize(
    ("target", "draft", "draft_probs", "message"),
    [
        (torch.ones(3), _tokens(0, 1), None, "target_probs"),
        (torch.ones(3, 4, dtype=torch.int64), _tokens(0, 1), None, "target_probs"),
        (torch.full((3, 4), 0.25), _tokens(0), None, "k \\+ 1"),
        (torch.full((3, 4), 0.25), _tokens(0, 1).int(), None, "int64"),
        (torch.full((3, 4), 0.25), _tokens(0, 4), None, "draft token ids"),
        (torch.full((3, 4), 0.25), _tokens(-1, 0), None, "draft token ids"),
        (torch.full((3, 4), 0.25), _tokens(0, 1), torch.full((2, 5), 0.2), "shape"),
        (torch.full((3, 4), 0.25), _tokens(0, 1), torch.full((3, 4), 0.25), "shape"),
        (torch.full((3, 4), 0.25), _tokens(0, 1), torch.full((4,), 0.25), "draft_probs"),
        (torch.full((3, 4), 0.25), _tokens(0, 1), _one_hot([0, 2], 4), "probability 0"),
        (torch.full((3, 4), torch.nan), _tokens(0, 1), None, "finite"),
        (torch.zeros(3, 4), _tokens(0, 1), None, "positive mass"),
        (torch.full((3, 4), 0.25), _tokens(0, 1), torch.full((2, 4), -0.25), "draft_probs"),
    ],
)
def test_invalid_inputs_raise(
    target: Tensor, draft: Tensor, draft_probs: Tensor | None, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        rejection_sample(target, draft, draft_probs, _seeded(0))


# ------------------------------------------------------------------------- 4. statistics

NUM_TRIALS = 15_000  # about 2.5 s per case on a 2-core box
STAT_VOCAB = 6
ALPHA = 1e-4  # fail when the p-value is below this
MIN_EXPECTED = 5.0  # cells expected fewer times are pooled, as Pearson's approximation needs


@dataclass(frozen=True)
class _Case:
    name: str
    target: SamplingParams
    draft: SamplingParams | None  # None: a deterministic (argmax) drafter that sends no q
    seed: int


STAT_CASES = [
    _Case("temperature", SamplingParams(temperature=0.7), SamplingParams(temperature=1.3), 1),
    _Case(
        "top-k",
        SamplingParams(temperature=1.0, top_k=3),
        SamplingParams(temperature=0.8, top_k=4),
        2,
    ),
    _Case(
        "top-p",
        SamplingParams(temperature=1.0, top_p=0.8),
        SamplingParams(temperature=1.2, top_k=5, top_p=0.9),
        3,
    ),
    _Case("deterministic-draft", SamplingParams(temperature=1.0), None, 4),
]


def _case_distributions(case: _Case) -> tuple[Tensor, Tensor, Tensor | None]:
    """Target rows p_1..p_3, and the draft rows q_1, q_2 (or fixed argmax drafts, q = None)."""
    gen = _seeded(case.seed)
    target_logits = 1.5 * torch.randn(3, STAT_VOCAB, generator=gen)  # [k + 1, vocab], k = 2
    # Correlated with the target, as a smaller model of the same family would be, but not equal.
    draft_logits = target_logits[:2] + torch.randn(2, STAT_VOCAB, generator=gen)  # [k, vocab]
    target = logits_to_probs(target_logits, case.target)
    if case.draft is None:
        return target, draft_logits.argmax(dim=-1), None
    draft_probs = logits_to_probs(draft_logits, case.draft)
    return target, torch.empty(0, dtype=torch.int64), draft_probs


def _emitted_triples(
    sampler: Sampler,
    target: Tensor,  # [3, vocab]
    fixed_draft: Tensor,  # [2], used when draft_probs is None
    draft_probs: Tensor | None,  # [2, vocab]
    gen: torch.Generator,
) -> Tensor:  # [NUM_TRIALS, 3]
    """The tokens at the three positions one k = 2 round covers, one row per trial.

    A round that stops early emits fewer than three; a new round would start right after its
    last token. The target rows here do not depend on earlier tokens, so whatever that round
    emits must be distributed as p at its position, and a direct sample from p stands in.
    """
    fresh = torch.multinomial(target, NUM_TRIALS, replacement=True, generator=gen).T
    if draft_probs is None:
        drafts = fixed_draft.expand(NUM_TRIALS, 2)
    else:
        drafts = torch.multinomial(draft_probs, NUM_TRIALS, replacement=True, generator=gen).T
    emitted = fresh.clone()
    for trial in range(NUM_TRIALS):
        tokens, num_accepted = sampler(target, drafts[trial], draft_probs, gen)
        emitted[trial, : num_accepted + 1] = tokens
    return emitted


def _chi_square_p_value(emitted: Tensor, target: Tensor) -> float:  # [n, 3], [3, vocab]
    """Pearson's test of the emitted triples against p_1 x p_2 x p_3 over vocab**3 cells."""
    vocab = target.shape[1]
    cells = (emitted[:, 0] * vocab + emitted[:, 1]) * vocab + emitted[:, 2]
    observed = torch.bincount(cells, minlength=vocab**3).double()
    p1, p2, p3 = target.double()
    probs = torch.einsum("a,b,c->abc", p1, p2, p3).flatten()
    impossible = probs == 0
    assert int(observed[impossible].sum()) == 0, "emitted a token the target excludes"
    expected_counts = probs[~impossible] * len(emitted)
    order = expected_counts.argsort()
    expected: list[float] = expected_counts[order].tolist()
    observed_counts: list[float] = observed[~impossible][order].tolist()
    pooled = 0  # the smallest cells, pooled until the pool and every other cell reach the bar
    while pooled < len(expected) and (
        expected[pooled] < MIN_EXPECTED or 0 < sum(expected[:pooled]) < MIN_EXPECTED
    ):
        pooled += 1
    bins_expected = ([sum(expected[:pooled])] if pooled else []) + expected[pooled:]
    bins_observed = ([sum(observed_counts[:pooled])] if pooled else []) + observed_counts[pooled:]
    statistic = sum((o - e) ** 2 / e for o, e in zip(bins_observed, bins_expected, strict=True))
    return float(chi2.sf(statistic, df=len(bins_expected) - 1))


@pytest.mark.parametrize("case", STAT_CASES, ids=[case.name for case in STAT_CASES])
def test_emitted_tokens_are_distributed_as_the_target(case: _Case) -> None:
    """(t1, t2, t3) from k = 2 rounds must follow p_1 x p_2 x p_3 (accepted, recovered, bonus).

    False-failure odds: trials are independent draws, so under a correct sampler Pearson's
    statistic is (asymptotically) chi-square with bins - 1 degrees of freedom and its p-value
    uniform; a given seed fails with probability ALPHA = 1e-4 per case. The seed is fixed, so
    the test never flakes: it passes on every run or, with those odds, on none.

    Power: the statistic's noncentrality is NUM_TRIALS * chi2(actual || p) >= 4 * NUM_TRIALS *
    TV**2, so with 15,000 trials and at most 215 degrees of freedom any deviation of total
    variation >= 0.052 on the pooled cells is caught with probability >= 99% (noncentral
    chi-square). The wrong samplers below are caught by the same statistic.
    """
    target, fixed_draft, draft_probs = _case_distributions(case)
    if draft_probs is not None:
        assert not torch.allclose(target[:2], draft_probs, atol=0.05)  # q really differs from p
    emitted = _emitted_triples(rejection_sample, target, fixed_draft, draft_probs, _seeded(99))
    assert _chi_square_p_value(emitted, target) >= ALPHA


def _recovers_from_the_target(
    target: Tensor, draft: Tensor, draft_probs: Tensor | None, gen: torch.Generator
) -> tuple[Tensor, int]:
    """Wrong: at a rejection it samples from p instead of norm(max(0, p - q))."""
    assert draft_probs is not None
    u = torch.rand(len(draft), generator=gen)
    for i, x in enumerate(draft.tolist()):
        if not bool(u[i] < target[i, x] / draft_probs[i, x]):
            return torch.cat([draft[:i], torch.multinomial(target[i], 1, generator=gen)]), i
    return torch.cat([draft, torch.multinomial(target[-1], 1, generator=gen)]), len(draft)


def _bonus_from_the_last_draft_row(
    target: Tensor, draft: Tensor, draft_probs: Tensor | None, gen: torch.Generator
) -> tuple[Tensor, int]:
    """Wrong: an off-by-one samples the bonus token from p_k instead of p_(k+1)."""
    tokens, num_accepted = _reference_rejection_sample(target, draft, draft_probs, gen)
    if num_accepted < len(draft):
        return tokens, num_accepted
    return torch.cat([draft, torch.multinomial(target[-2], 1, generator=gen)]), num_accepted


@pytest.mark.parametrize(
    "wrong_sampler", [_recovers_from_the_target, _bonus_from_the_last_draft_row]
)
def test_the_statistic_catches_a_wrong_sampler(wrong_sampler: Sampler) -> None:
    """Negative control: the test above can fail, on the same case, seed and statistic."""
    target, fixed_draft, draft_probs = _case_distributions(STAT_CASES[0])
    emitted = _emitted_triples(wrong_sampler, target, fixed_draft, draft_probs, _seeded(99))
    assert _chi_square_p_value(emitted, target) < ALPHA
