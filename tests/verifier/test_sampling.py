"""Tests for cluster.runtime.sampling: the distribution actually used, sampling, and sparse
rows."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sampling import (
    SamplingParams,
    SparseDistribution,
    argmax_rows,
    greedy_tokens,
    logits_to_probs,
    sample,
    to_dense,
    to_sparse,
)


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


# ------------------------------------------------------------------------------------ sample


def test_sample_draws_one_token_per_row_from_the_generator() -> None:
    probs = torch.tensor([[0.0, 0.0, 1.0], [0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    tokens = sample(probs, torch.Generator().manual_seed(7))
    assert tokens.dtype == torch.int64 and tokens.shape == (3,)
    assert (int(tokens[0]), int(tokens[2])) == (2, 0)
    again = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(tokens, again)


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
