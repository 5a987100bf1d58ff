"""Saguaro-style draft distributions (`cluster.runtime.saguaro`): q with its top tokens damped."""

from __future__ import annotations

import pytest
import torch

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.saguaro import saguaro_probs

Q = torch.tensor(
    [
        [0.5, 0.2, 0.15, 0.1, 0.05, 0.0],
        [0.0, 0.1, 0.3, 0.3, 0.2, 0.1],  # a tie at the boundary of the top 2... and 3
    ]
)


@pytest.mark.parametrize("scale", [0.05, 0.5, 0.9])
@pytest.mark.parametrize("top", [1, 2, 3, 6, 10])
def test_rows_sum_to_one_and_only_the_top_tokens_change_relative_mass(
    scale: float, top: int
) -> None:
    damped = saguaro_probs(Q, scale, top)
    torch.testing.assert_close(damped.sum(-1), torch.ones(2))
    assert bool((damped[Q == 0] == 0).all())  # the support is q's
    for q_row, row in zip(Q, damped, strict=True):
        kth = q_row.topk(min(top, 6)).values[-1]
        top_set = (q_row >= kth) & (q_row > 0)
        ratio = row[q_row > 0] / q_row[q_row > 0]  # the weights, up to the normaliser
        weights = torch.where(top_set[q_row > 0], scale, 1.0)
        torch.testing.assert_close(ratio / ratio.max(), weights / weights.max())


def test_the_damped_tokens_lose_mass_to_the_others() -> None:
    damped = saguaro_probs(Q, 0.5, 1)
    assert damped[0, 0] < Q[0, 0] and bool((damped[0, 1:5] > Q[0, 1:5]).all())
    # Tied at the top: both damped alike, whatever order topk returns them in.
    assert damped[1, 2] == damped[1, 3] < Q[1, 2]
    assert bool((damped[1, [1, 4, 5]] > Q[1, [1, 4, 5]]).all())


def test_a_row_whose_support_is_all_damped_is_unchanged() -> None:
    row = torch.tensor([[0.0, 0.25, 0.75]])
    torch.testing.assert_close(saguaro_probs(row, 0.2, 2), row)


def test_scale_one_is_the_identity() -> None:
    assert saguaro_probs(Q, 1.0, 3) is Q


@pytest.mark.parametrize(("scale", "top"), [(0.0, 1), (1.5, 1), (-0.1, 1), (0.5, 0), (0.5, -2)])
def test_bad_settings_are_refused(scale: float, top: int) -> None:
    with pytest.raises(InvalidArgumentError, match="Saguaro"):
        saguaro_probs(Q, scale, top)
