"""Invalid input to verifier.batch_rejection: each refusal is an InvalidArgumentError whose
message names the session and the problem, raised before any draw (every generator is left as
it was); the checks live in verifier.batch_inputs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from torch import Tensor

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sparse_distribution import SparseDistribution
from tests.verifier.rejection_reference import seeded, token_ids
from verifier.batch_rejection import BatchSession, batch_rejection_sample


def _valid_rows() -> Tensor:
    return torch.full((2 + 3 + 2, 4), 0.25)  # rows of the three sessions below, vocab 4


_DRAFT = token_ids(2, 0, 3, 1)


def _sessions(index: int = 0, **changes: object) -> list[BatchSession]:
    """Greedy k = 1; sampled k = 2 with dense q; sampled k = 1 with sparse q; each draft
    token possible under its q. `changes` go to session `index`."""
    dense_q = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4]])
    sparse_q = (SparseDistribution(token_ids(1, 3), torch.tensor([0.5, 0.5])),)
    sessions = [
        BatchSession(1, greedy=True, generator=seeded(0)),
        BatchSession(2, greedy=False, generator=seeded(1), draft_probs=dense_q),
        BatchSession(1, greedy=False, generator=seeded(2), draft_probs=sparse_q),
    ]
    sessions[index] = replace(sessions[index], **changes)  # type: ignore[arg-type]
    return sessions


def _sparse(ids: list[int], probs: list[float]) -> tuple[SparseDistribution]:
    return (SparseDistribution(torch.tensor(ids), torch.tensor(probs, dtype=torch.float32)),)


def _nan_at(row: int) -> Tensor:
    rows = _valid_rows()
    rows[row, 1] = torch.nan
    return rows


def _shared_generator() -> list[BatchSession]:
    sessions = _sessions()
    return [*sessions[:2], replace(sessions[2], generator=sessions[1].generator)]


_INVALID: list[tuple[str, Callable[[], tuple[Tensor, Tensor, list[BatchSession]]], str]] = [
    ("rank", lambda: (torch.ones(4), _DRAFT, _sessions()), "target_rows"),
    ("int rows", lambda: (_valid_rows().long(), _DRAFT, _sessions()), "target_rows"),
    ("int32 draft", lambda: (_valid_rows(), _DRAFT.int(), _sessions()), "int64"),
    ("rows", lambda: (_valid_rows()[1:], _DRAFT, _sessions()), "need 7 target rows"),
    ("drafts", lambda: (_valid_rows(), _DRAFT[1:], _sessions()), "4 draft tokens"),
    (
        "id too big",
        lambda: (_valid_rows(), token_ids(2, 0, 4, 1), _sessions()),
        "session 1: draft token 4 at position 1 is not a token id",
    ),
    (
        "negative id",
        lambda: (_valid_rows(), token_ids(-1, 0, 3, 1), _sessions()),
        "session 0: draft token -1 at position 0",
    ),
    (
        "dense q(x) = 0",
        lambda: (_valid_rows(), token_ids(2, 2, 3, 1), _sessions()),
        "session 1: draft token 2 at position 0 has probability 0",
    ),
    (
        "sparse q(x) = 0",
        lambda: (_valid_rows(), token_ids(2, 0, 3, 0), _sessions()),
        "session 2: draft token 0 at position 0 has probability 0",
    ),
    (
        "NaN p",
        lambda: (_nan_at(4), _DRAFT, _sessions()),
        "session 1: target rows must be distributions",
    ),
    ("zero p", lambda: (_valid_rows() * 0, _DRAFT, _sessions()), "session 1: target rows must be"),
    ("NaN greedy", lambda: (_nan_at(1), _DRAFT, _sessions()), "session 0: a greedy row has NaN"),
    (
        "negative dense q",
        lambda: (_valid_rows(), _DRAFT, _sessions(1, draft_probs=torch.full((2, 4), -0.5))),
        "session 1: draft_probs rows",
    ),
    (
        "dense q vocab",
        lambda: (_valid_rows(), _DRAFT, _sessions(1, draft_probs=torch.full((2, 5), 0.2))),
        "session 1: draft_probs must have 4 columns",
    ),
    (
        "repeated id",
        lambda: (_valid_rows(), _DRAFT, _sessions(2, draft_probs=_sparse([1, 1], [1, 1]))),
        "session 2: .* repeats an id",
    ),
    (
        "sparse id",
        lambda: (_valid_rows(), _DRAFT, _sessions(2, draft_probs=_sparse([1, 4], [1, 1]))),
        "session 2: .* has bad ids",
    ),
    (
        "negative sparse q",
        lambda: (_valid_rows(), _DRAFT, _sessions(2, draft_probs=_sparse([1, 3], [1, -1]))),
        "session 2: .* not finite, >= 0",
    ),
    (
        "massless sparse q",
        lambda: (_valid_rows(), _DRAFT, _sessions(2, draft_probs=_sparse([1, 3], [0, 0]))),
        "session 2: .* has no \\(finite\\) mass",
    ),
    ("shared", lambda: (_valid_rows(), _DRAFT, _shared_generator()), "sessions 1 and 2 share"),
    (
        "greedy stored id",
        lambda: (_valid_rows()[1:], _DRAFT, _sessions(0, stored_row=9)),
        "session 0: stored_row 9 not in",
    ),
    (
        "sampled stored shape",
        lambda: (_valid_rows()[1:], _DRAFT, _sessions(1, stored_row=torch.ones(5) / 5)),
        "session 1: stored_row must be float \\[4\\]",
    ),
    (
        "greedy stored row",
        lambda: (_valid_rows()[1:], _DRAFT, _sessions(0, stored_row=torch.ones(4))),
        "greedy session's stored_row is its argmax",
    ),
    (
        "sampled stored id",
        lambda: (_valid_rows()[1:], _DRAFT, _sessions(1, stored_row=1)),
        "sampled session's stored_row is a p row",
    ),
    ("no generator", lambda: (_valid_rows(), _DRAFT, _sessions(1, generator=None)), "own torch"),
    ("k", lambda: (_valid_rows(), _DRAFT, _sessions(1, num_draft=-1)), "num_draft"),
    (
        "dense q rows",
        lambda: (_valid_rows(), _DRAFT, _sessions(1, draft_probs=torch.ones(3, 4) / 4)),
        "dense draft_probs must be",
    ),
    (
        "sparse q rows",
        lambda: (_valid_rows(), _DRAFT, _sessions(2, draft_probs=())),
        "sparse draft_probs must be 1",
    ),
]


@pytest.mark.parametrize(
    ("build", "message"), [case[1:] for case in _INVALID], ids=[case[0] for case in _INVALID]
)
def test_invalid_inputs_raise_before_any_draw(
    build: Callable[[], tuple[Tensor, Tensor, list[BatchSession]]], message: str
) -> None:
    fresh = [seeded(seed).get_state() for seed in range(3)]
    with pytest.raises(InvalidArgumentError, match=message):
        rows, draft, sessions = build()
        try:
            batch_rejection_sample(rows, draft, sessions)
        finally:  # a refused batch draws nothing
            for session in sessions:
                if session.generator is not None:
                    assert any(torch.equal(session.generator.get_state(), s) for s in fresh)
