"""Acceptance tables from JSON, and the rate-to-alpha conversion of a bench result."""

from __future__ import annotations

import pytest

from cluster.plan.inputs import acceptance_from_json, alpha_from_rate
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sim import expected_tokens


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 0.95])
def test_alpha_from_rate_inverts_the_block_formula(alpha: float) -> None:
    k = 4
    rate = (expected_tokens(alpha, k) - 1) / k  # accepted of k drafted; the rest is the bonus
    assert alpha_from_rate(rate, k) == pytest.approx(alpha, abs=1e-6)


def test_a_plain_table_and_a_bench_result() -> None:
    assert acceptance_from_json({"a": {"model": 0.5, "suffix": 0.9}}) == {
        "a": {"model": 0.5, "suffix": 0.9}
    }
    bench = {"config": {"draft_tokens": 4}, "by_category": {"code": {"acceptance_rate": 1.0}}}
    assert acceptance_from_json(bench)["code"]["model"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize(
    "data", [[], {}, {"a": 0.5}, {"a": {"model": "high"}}, {"a": {"model": -0.1}}]
)
def test_bad_tables_are_invalid(data: object) -> None:
    with pytest.raises(InvalidArgumentError):
        acceptance_from_json(data)
