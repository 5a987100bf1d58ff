"""Tests for cluster.runtime.sampling (the distribution actually used), sampling_params,
token_choice (argmax and draws) and sparse_distribution (sparse rows)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sampling import logits_to_probs, logits_to_probs_rows
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.sparse_distribution import SparseDistribution, to_dense, to_sparse
from cluster.runtime.token_choice import argmax_rows, greedy_tokens, sample, sample_rows


def _row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)  # [1, vocab]


# ---------------------------------------------------------------------------- SamplingParams


def test_defaults_are_greedy_with_no_truncation() -> None:
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p) == (0.0, 0, 1.0)
    assert params.is_greedy
    assert not SamplingParams(temperature=0.8).is_greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_p": -math.inf}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidArgumentError, match=field) as raised:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert repr(next(iter(kwargs.values()))) in str(raised.value)
    assert raised.value.status == "INVALID_ARGUMENT"


def test_sampling_params_accepts_boundary_values() -> None:
    SamplingParams(temperature=0, top_k=0, top_p=1.0)
    SamplingParams(temperature=2, top_k=1, top_p=1e-9)


# --------------------------------------------------------------------------- logits_to_probs


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_greedy_is_one_hot_at_argmax_lowest_index_on_ties(dtype: torch.dtype) -> None:
    logits = torch.tensor([[0.0, 3.0, -1.0, 3.0], [-math.inf, -2.0, -math.inf, -5.0]], dtype=dtype)
    probs = logits_to_probs(logits, SamplingParams())
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    assert probs.dtype == torch.float32
    assert torch.equal(probs, expected)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 1.7])
def test_temperature_scales_logits_before_softmax(temperature: float) -> None:
    logits = torch.randn(4, 11, generator=torch.Generator().manual_seed(3))
    probs = logits_to_probs(logits, SamplingParams(temperature=temperature))
    expected = torch.exp(logits / temperature)
    expected = expected / expected.sum(dim=-1, keepdim=True)
    torch.testing.assert_close(probs, expected)


def test_tiny_temperature_stays_finite() -> None:
    probs = logits_to_probs(_row(1.0, 2.0, 0.5), SamplingParams(temperature=1e-30))
    assert torch.equal(probs, _row(0.0, 1.0, 0.0))


def test_masked_logits_get_zero_probability() -> None:
    probs = logits_to_probs(_row(0.0, -math.inf, 0.0), SamplingParams(temperature=1.0))
    assert torch.equal(probs, _row(0.5, 0.0, 0.5))


@pytest.mark.parametrize("top_k", [1, 5, 49])
def test_top_k_keeps_exactly_the_k_most_probable(top_k: int) -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(top_k))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
    kept = probs > 0
    assert kept.sum(dim=-1).tolist() == [top_k] * 8
    largest = logits.topk(top_k, dim=-1).indices
    assert torch.equal(kept, torch.zeros_like(kept).scatter_(1, largest, True))
    expected = torch.softmax(logits.masked_fill(~kept, -math.inf), dim=-1)
    torch.testing.assert_close(probs, expected)


def test_top_k_ties_at_the_boundary_keep_the_lowest_ids() -> None:
    probs = logits_to_probs(_row(0.0, 1.0, 1.0, 1.0), SamplingParams(temperature=1.0, top_k=2))
    assert torch.equal(probs, _row(0.0, 0.5, 0.5, 0.0))


@settings(max_examples=100, deadline=None)
@given(
    levels=st.lists(st.integers(0, 4), min_size=2, max_size=40),
    rows=st.integers(1, 3),
    top_k=st.integers(1, 39),
)
def test_top_k_on_heavily_tied_rows_keeps_the_k_most_probable_lowest_ids_first(
    levels: list[int], rows: int, top_k: int
) -> None:
    """Few distinct values, many ties: the kept set is what a full stable sort would keep."""
    logits = torch.tensor([levels] * rows, dtype=torch.float32)
    logits[1:] = logits[1:].roll(1, dims=-1)  # rows that differ
    top_k = min(top_k, len(levels) - 1)
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=top_k))
    _, order = logits.sort(dim=-1, descending=True, stable=True)
    expected = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, order[:, :top_k], True)
    assert torch.equal(probs > 0, expected)


def test_top_k_at_least_vocab_keeps_everything() -> None:
    logits = _row(0.1, 0.2, 0.3)
    full = logits_to_probs(logits, SamplingParams(temperature=1.0))
    assert torch.equal(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=3)), full)
    assert torch.equal(logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=9)), full)


# Probabilities 0.15, 0.5, 0.05, 0.3 (ids 0..3); by rank: id 1 (0.5), id 3 (0.3), id 0 (0.15),
# id 2 (0.05). Masses before each rank: 0, 0.5, 0.8, 0.95.
@pytest.mark.parametrize(
    ("top_p", "expected"),
    [
        (0.4, [0.0, 1.0, 0.0, 0.0]),  # 0.5 already reaches 0.4
        (0.7, [0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]),  # 0.5 < 0.7 <= 0.8
        (0.9, [0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95]),  # 0.8 < 0.9 <= 0.95
        (0.99, [0.15, 0.5, 0.05, 0.3]),  # needs every token
    ],
)
def test_top_p_keeps_the_minimal_nucleus(top_p: float, expected: list[float]) -> None:
    logits = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p))
    torch.testing.assert_close(probs, torch.tensor([expected]))
    assert torch.equal(probs > 0, torch.tensor([expected]) > 0)


def test_top_p_always_keeps_at_least_one_token() -> None:
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=1e-9))
    assert torch.equal(probs, logits_to_probs(logits, SamplingParams()))


def test_top_p_measures_mass_after_top_k_renormalises() -> None:
    # Top-2 of (0.4, 0.3, 0.2, 0.1) renormalises to (4/7, 3/7); 4/7 >= 0.55 keeps one token,
    # where the unrenormalised 0.4 < 0.55 would have kept two.
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    probs = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.55))
    assert torch.equal(probs, _row(1.0, 0.0, 0.0, 0.0))


@settings(max_examples=150, deadline=None)
@given(
    logits=st.lists(st.floats(-5.0, 5.0), min_size=1, max_size=12),
    temperature=st.sampled_from([0.0, 0.5, 1.0, 2.0]),
    top_k=st.integers(0, 14),
    top_p=st.floats(0.05, 1.0),
)
def test_rows_are_distributions_and_the_nucleus_is_minimal(
    logits: list[float], temperature: float, top_k: int, top_p: float
) -> None:
    row = torch.tensor([logits])
    probs = logits_to_probs(row, SamplingParams(temperature, top_k, top_p))
    assert probs.shape == row.shape and probs.dtype == torch.float32
    assert bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(1))
    if temperature == 0:
        return
    before_top_p = logits_to_probs(row, SamplingParams(temperature, top_k))
    kept = probs > 0  # logits in [-5, 5] and temperature >= 0.5: no softmax underflow
    mass = float(before_top_p[kept].sum())
    assert mass >= top_p - 1e-5
    assert mass - float(before_top_p[kept].min()) < top_p + 1e-5
    torch.testing.assert_close(probs[kept], before_top_p[kept] / mass)


@pytest.mark.parametrize(
    "logits",
    [
        torch.zeros(4),
        torch.zeros(2, 3, dtype=torch.int64),
        torch.zeros(2, 0),
        _row(0.0, math.nan),
        _row(0.0, math.inf),
        _row(-math.inf, -math.inf),
    ],
    ids=["rank-1", "integer", "empty-vocab", "nan", "plus-inf", "all-masked"],
)
def test_logits_to_probs_rejects_bad_logits(logits: torch.Tensor) -> None:
    with pytest.raises(InvalidArgumentError, match="logits"):
        logits_to_probs(logits, SamplingParams(temperature=1.0))


# ---------------------------------------------------------------------- logits_to_probs_rows


def _reference_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`logits_to_probs` for one row `[vocab]`, spelled out with a full stable sort."""
    if params.is_greedy:
        return torch.zeros(row.shape[0]).index_fill_(0, row.argmax(), 1.0)
    weights = torch.exp((row.float() - row.float().max()) / params.temperature)
    probs = weights / weights.sum()
    order = probs.argsort(descending=True, stable=True)  # ties: the lowest id first
    if 0 < params.top_k < row.shape[0]:
        order = order[: params.top_k]
    if params.top_p < 1.0:
        nucleus = probs[order] / probs[order].sum()
        mass_before = nucleus.cumsum(0) - nucleus
        order = order[mass_before < params.top_p]
    kept = torch.zeros_like(probs).index_copy_(0, order, probs[order])
    return kept / kept.sum()


def _assert_same_distribution(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal within float32 rounding, with exactly the same tokens kept."""
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


# One row of each kind; `_mixed_logits` gives rows 0, 4 and 9 ties and rows 1, 5 and 8 masks.
# With those logits no cumulative mass lies within 1e-5 of its row's top_p, so float32 rounding
# (sums over other shapes) cannot move a cut.
_MIXED_ROWS = {
    "greedy": SamplingParams(),
    "temperature": SamplingParams(temperature=0.7),
    "tiny-temperature": SamplingParams(temperature=1e-6),
    "top-k": SamplingParams(temperature=1.0, top_k=5),
    "top-k-tied-boundary": SamplingParams(temperature=1.3, top_k=3),
    "top-p": SamplingParams(temperature=0.9, top_p=0.8),
    "top-k-top-p": SamplingParams(temperature=1.0, top_k=20, top_p=0.6),
    "top-k-past-vocab": SamplingParams(temperature=2.0, top_k=10_000),
    "top-p-masked": SamplingParams(temperature=1.0, top_p=0.95),
    "top-k-1-tied": SamplingParams(temperature=0.5, top_k=1),
    "top-k-2-top-p": SamplingParams(temperature=0.8, top_k=2, top_p=0.3),
}


def _mixed_logits(vocab: int) -> torch.Tensor:  # [len(_MIXED_ROWS), vocab]
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(len(_MIXED_ROWS), vocab, generator=generator) * 2
    logits[0, [7, 3]] = 20.0  # greedy tie: id 3
    logits[4, [30, 2, 17, 9]] = 20.0  # top-3 boundary tie: 40, then ids 2 and 9
    logits[4, 40] = 21.0
    logits[9, [12, 11]] = 20.0  # top-1 tie: id 11
    for row in (1, 5, 8):
        logits[row, torch.rand(vocab, generator=generator) < 0.3] = -math.inf
    return logits


@pytest.mark.parametrize("vocab", [64, 3000])
@pytest.mark.parametrize(
    "kinds",
    [
        list(_MIXED_ROWS),
        [kind for kind in _MIXED_ROWS if kind != "greedy"],
        [kind for kind in _MIXED_ROWS if not kind.startswith("top-p")],
        ["top-k", "top-k-tied-boundary", "top-k-top-p", "top-k-1-tied", "top-k-2-top-p"],
        ["top-p", "top-p-masked", "greedy"],
    ],
    ids=["all", "no-greedy", "no-full-sort", "top-k-only", "top-p-only"],
)
@pytest.mark.parametrize("shuffle", [0, 1])
def test_mixed_rows_match_logits_to_probs_row_by_row(
    vocab: int, kinds: list[str], shuffle: int
) -> None:
    names = list(_MIXED_ROWS)
    rows = [names.index(kind) for kind in kinds]
    if shuffle:
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(shuffle))
        rows = [rows[i] for i in order.tolist()]
    logits = _mixed_logits(vocab)[rows]
    params = [_MIXED_ROWS[names[row]] for row in rows]
    probs = logits_to_probs_rows(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for index, row_params in enumerate(params):
        alone = logits_to_probs(logits[index : index + 1], row_params)[0]
        _assert_same_distribution(probs[index], alone)
        _assert_same_distribution(probs[index], _reference_probs(logits[index], row_params))


def test_mixed_rows_keep_the_expected_tokens() -> None:
    logits = _mixed_logits(64)
    probs = logits_to_probs_rows(logits, list(_MIXED_ROWS.values()))
    kept = {
        kind: torch.nonzero(row).flatten().tolist()
        for kind, row in zip(_MIXED_ROWS, probs, strict=True)
    }
    assert kept["greedy"] == [3]
    assert kept["top-k-tied-boundary"] == [2, 9, 40]
    assert kept["top-k-1-tied"] == [11]
    assert kept["top-k"] == sorted(logits[3].topk(5).indices.tolist())
    # The larger of two renormalised probabilities is >= 0.5, which reaches top_p 0.3.
    assert kept["top-k-2-top-p"] == [int(logits[10].argmax())]
    assert kept["top-k-past-vocab"] == list(range(64))
    assert kept["temperature"] == torch.isfinite(logits[1]).nonzero().flatten().tolist()


def test_mixed_rows_are_distributions() -> None:
    probs = logits_to_probs_rows(_mixed_logits(3000), list(_MIXED_ROWS.values()))
    assert bool((probs >= 0).all())
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(_MIXED_ROWS)))


def test_each_row_gets_its_own_top_k_on_the_same_tied_logits() -> None:
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0]] * 4)
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (1, 2, 3, 0)]
    probs = logits_to_probs_rows(logits, params)
    third = 1 / 3
    expected = torch.tensor(
        [
            [0.0, 1.0, 0.0, 0.0, 0.0],
            [0.0, 0.5, 0.5, 0.0, 0.0],
            [0.0, third, third, third, 0.0],
            torch.softmax(logits[0], dim=-1).tolist(),
        ]
    )
    torch.testing.assert_close(probs, expected)
    assert torch.equal(probs > 0, expected > 0)


def test_each_row_gets_its_own_temperature_and_top_p() -> None:
    # Probabilities at temperature 1: 0.15, 0.5, 0.05, 0.3 (see the top-p cases above).
    row = torch.tensor([[0.15, 0.5, 0.05, 0.3]]).log()
    params = [
        SamplingParams(temperature=1.0, top_p=0.4),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.5),
    ]
    probs = logits_to_probs_rows(row.expand(4, 4), params)
    squared = torch.tensor([0.15, 0.5, 0.05, 0.3]) ** 2
    expected = torch.stack(
        [
            torch.tensor([0.0, 1.0, 0.0, 0.0]),
            torch.tensor([0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8]),
            torch.tensor([0.15, 0.5, 0.05, 0.3]),
            squared / squared.sum(),
        ]
    )
    torch.testing.assert_close(probs, expected)


def test_a_row_without_top_p_keeps_its_tail_beside_rows_that_cut_by_top_p() -> None:
    # Row 0's cumulative mass rounds to exactly 1.0 in float32 after its first token, so a
    # `mass_before < 1.0` test would drop its tiny (but nonzero) tail; it has no top-p cut.
    logits = torch.tensor([[0.0] + [-20.0] * 9, [0.0] * 10])
    params = [
        SamplingParams(temperature=1.0, top_k=9),
        SamplingParams(temperature=1.0, top_k=9, top_p=0.5),
    ]
    probs = logits_to_probs_rows(logits, params)
    assert (probs[0] > 0).tolist() == [True] * 9 + [False]
    assert (probs[1] > 0).tolist() == [True] * 5 + [False] * 5
    _assert_same_distribution(probs[0], logits_to_probs(logits[:1], params[0])[0])


@settings(max_examples=100, deadline=None)
@given(
    levels=st.lists(st.lists(st.integers(-3, 3), min_size=6, max_size=6), min_size=1, max_size=5),
    choices=st.lists(
        st.tuples(
            st.sampled_from([0.0, 0.5, 1.0, 2.0]),
            st.integers(0, 7),
            st.sampled_from([1.0, 0.3, 0.55, 0.85]),
        ),
        min_size=5,
        max_size=5,
    ),
)
def test_any_mix_of_rows_matches_the_reference(
    levels: list[list[int]], choices: list[tuple[float, int, float]]
) -> None:
    """Integer logits: many ties. Enumerating every row of six such logits shows that no
    cumulative mass comes within 4e-5 of a top_p used here, so rounding cannot move a cut."""
    logits = torch.tensor(levels, dtype=torch.float32)
    params = [SamplingParams(*choice) for choice in choices[: len(levels)]]
    probs = logits_to_probs_rows(logits, params)
    for row, row_params, got in zip(logits, params, probs, strict=True):
        _assert_same_distribution(got, _reference_probs(row, row_params))


def test_logits_to_probs_is_logits_to_probs_rows_with_one_params_per_row() -> None:
    logits = torch.randn(4, 500, generator=torch.Generator().manual_seed(5))
    for params in _MIXED_ROWS.values():
        single = logits_to_probs(logits, params)
        assert torch.equal(single, logits_to_probs_rows(logits, [params] * 4))
        for row, got in zip(logits, single, strict=True):
            _assert_same_distribution(got, _reference_probs(row, params))


@pytest.mark.parametrize("count", [2, 4])
def test_logits_to_probs_rows_needs_one_params_per_row(count: int) -> None:
    with pytest.raises(InvalidArgumentError, match="3 rows") as raised:
        logits_to_probs_rows(torch.zeros(3, 5), [SamplingParams()] * count)
    assert raised.value.status == "INVALID_ARGUMENT"
    with pytest.raises(InvalidArgumentError, match="SamplingParams"):
        logits_to_probs_rows(torch.zeros(1, 5), [0.5])  # type: ignore[list-item]


def test_logits_to_probs_rows_takes_no_rows() -> None:
    assert logits_to_probs_rows(torch.zeros(0, 5), []).shape == (0, 5)
    assert logits_to_probs(torch.zeros(0, 5), SamplingParams(temperature=1.0)).shape == (0, 5)


@pytest.mark.parametrize(
    ("logits", "message"),
    [
        (torch.zeros(4), "2-D floating-point"),
        (torch.zeros(1, 0), "vocabulary"),
        (_row(0.0, math.nan), "NaN or \\+inf"),
        (_row(0.0, math.inf), "NaN or \\+inf"),
        (_row(-math.inf, -math.inf), "at least one finite entry"),
        (torch.tensor([[-math.inf, -math.inf], [0.0, math.nan]]), "NaN or \\+inf"),
    ],
    ids=["rank-1", "empty-vocab", "nan", "plus-inf", "all-masked", "all-masked-and-nan"],
)
def test_logits_to_probs_rows_rejects_bad_logits(logits: torch.Tensor, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        logits_to_probs_rows(logits, [SamplingParams(temperature=1.0)] * len(logits))


# ------------------------------------------------------------------------------------ sample


def test_sample_draws_one_token_per_row_from_the_generator() -> None:
    probs = torch.tensor([[0.0, 0.0, 1.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    tokens = sample(probs, torch.Generator().manual_seed(7))
    assert tokens.dtype == torch.int64 and tokens.shape == (3,)
    assert (int(tokens[0]), int(tokens[2])) == (2, 0)
    again = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(tokens, again)


def _seeded(seeds: list[int | None]) -> list[torch.Generator | None]:
    """A generator per seed (None stays None), each already past a few draws."""
    generators: list[torch.Generator | None] = []
    for seed in seeds:
        if seed is None:
            generators.append(None)
            continue
        generator = torch.Generator().manual_seed(seed)
        torch.rand(seed % 5, generator=generator)
        generators.append(generator)
    return generators


def _clone(generator: torch.Generator | None) -> torch.Generator | None:
    if generator is None:
        return None
    clone = torch.Generator()
    clone.set_state(generator.get_state())
    return clone


def test_sample_rows_draws_what_sample_draws_row_by_row() -> None:
    logits = torch.randn(6, 1000, generator=torch.Generator().manual_seed(2)) * 0.1
    params = [SamplingParams(temperature=1.0, top_k=k) for k in (0, 0, 50, 0, 7, 0)]
    params[3] = SamplingParams()
    probs = logits_to_probs_rows(logits, params)
    ours = _seeded([11, 12, 13, None, 11, 17])
    theirs = [_clone(generator) for generator in ours]
    with torch.random.fork_rng():  # row 3 draws from the global generator
        torch.manual_seed(99)
        tokens = sample_rows(probs, ours)
        torch.manual_seed(99)
        expected = [
            int(sample(probs[i : i + 1], generator)[0]) for i, generator in enumerate(theirs)
        ]
    assert tokens == expected
    assert all(isinstance(token, int) for token in tokens)
    assert tokens[3] == int(probs[3].argmax())
    for mine, reference in zip(ours, theirs, strict=True):
        if mine is not None and reference is not None:
            assert torch.equal(mine.get_state(), reference.get_state())  # advanced alike


def test_sample_rows_rejects_bad_arguments() -> None:
    assert sample_rows(torch.zeros(0, 3), []) == []
    with pytest.raises(InvalidArgumentError, match="one generator"):
        sample_rows(torch.ones(2, 3) / 3, [None])
    with pytest.raises(InvalidArgumentError, match="2-D"):
        sample_rows(torch.ones(3) / 3, [None])


# ------------------------------------------------------------------------ sparse distributions


def test_to_sparse_to_dense_round_trip_is_exact() -> None:
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    probs = logits_to_probs(logits, SamplingParams(temperature=0.9, top_k=6, top_p=0.8))
    rows = [to_sparse(row) for row in probs]
    for row, dense_row in zip(rows, probs, strict=True):
        assert row.token_ids.dtype == torch.int64 and row.probs.dtype == torch.float32
        assert torch.equal(row.token_ids, torch.nonzero(dense_row).flatten())
        assert bool((row.token_ids.diff() > 0).all())
    assert torch.equal(to_dense(rows, vocab_size=20), probs)


def test_to_dense_keeps_the_probabilities_as_sent() -> None:
    row = SparseDistribution(torch.tensor([4, 1]), torch.tensor([0.25, 0.5]))
    assert torch.equal(to_dense([row], 5), torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.25]]))
    assert to_dense([], 5).shape == (0, 5)


@pytest.mark.parametrize(
    ("token_ids", "probs", "message"),
    [
        ([0, 5], [0.5, 0.5], "outside"),
        ([-1, 2], [0.5, 0.5], "outside"),
        ([2, 2], [0.5, 0.5], "repeats"),
        ([0, 1], [math.nan, 1.0], "finite"),
        ([0, 1], [math.inf, 1.0], "finite"),
        ([0, 1], [-0.1, 1.1], ">= 0"),
        ([], [], "empty"),
    ],
)
def test_to_dense_rejects_invalid_rows(
    token_ids: list[int], probs: list[float], message: str
) -> None:
    row = SparseDistribution(
        torch.tensor(token_ids, dtype=torch.int64), torch.tensor(probs, dtype=torch.float32)
    )
    with pytest.raises(InvalidArgumentError, match=message):
        to_dense([row], vocab_size=5)


def test_to_dense_rejects_a_bad_vocab_size() -> None:
    with pytest.raises(InvalidArgumentError, match="vocab_size"):
        to_dense([], vocab_size=0)


@pytest.mark.parametrize(
    ("token_ids", "probs"),
    [
        (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0.5, 0.5])),
        (torch.tensor([0, 1]), torch.tensor([0.5, 0.5], dtype=torch.float64)),
        (torch.tensor([0, 1]), torch.tensor([1.0])),
        (torch.tensor([[0, 1]]), torch.tensor([[0.5, 0.5]])),
    ],
    ids=["int32-ids", "float64-probs", "length-mismatch", "rank-2"],
)
def test_sparse_distribution_rejects_bad_tensors(
    token_ids: torch.Tensor, probs: torch.Tensor
) -> None:
    with pytest.raises(InvalidArgumentError, match="SparseDistribution"):
        SparseDistribution(token_ids, probs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_argmax_rows_is_torch_argmax_ties_and_nan_included(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(7, 5000, generator=generator).to(dtype)
    rows[1, 10] = rows[1, 20] = rows[1].max() + 1  # a tie: the lower id wins
    rows[2, :] = float("-inf")  # no finite entry: id 0, as torch says
    rows[3, 4000] = float("nan")  # a NaN counts as the maximum
    rows[4, 30] = rows[4, 3000] = float("nan")
    got = argmax_rows(rows)
    assert got.dtype == torch.long
    assert torch.equal(got, rows.argmax(dim=-1))
    assert got[1:5].tolist() == [10, 0, 4000, 30]
    view = rows[:, 100:]  # a view with a row stride wider than its width
    assert torch.equal(argmax_rows(view), view.argmax(dim=-1))


def test_greedy_tokens_are_the_argmaxes_and_refuse_a_row_without_a_finite_best() -> None:
    rows = torch.tensor([[0.0, 3.0, 3.0], [5.0, -1.0, 2.0]])
    assert greedy_tokens(rows) == [1, 0]
    assert greedy_tokens(rows.double()) == [1, 0]  # the torch path
    for bad in (float("nan"), float("inf")):
        broken = rows.clone()
        broken[1, 2] = bad
        with pytest.raises(InvalidArgumentError, match="greedy row"):
            greedy_tokens(broken)
    with pytest.raises(InvalidArgumentError, match="greedy row"):
        greedy_tokens(torch.full((1, 3), float("-inf")))
