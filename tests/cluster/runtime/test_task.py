"""`each_alone_if_refused`: a `Batched` handler's one call, and what happens when it refuses.

The drafter's and the verifier's batched handlers (sampling, seed-exact draws, acceptance) turn
a step's payloads into results in one call; a payload with bad input (NaN logits) makes that
call refuse the whole batch. Then each payload is served on its own, so that only the one at
fault gets the error, in its place, and the others their results.
"""

from __future__ import annotations

import pytest

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.task import each_alone_if_refused


class Doubling:
    """A step doubling numbers in one call; a negative number makes it refuse the batch."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, batch: list[int]) -> list[int]:
        self.calls.append(batch)
        if any(n < 0 for n in batch):
            raise InvalidArgumentError(f"negative in {batch}")
        return [2 * n for n in batch]


def test_a_batch_it_takes_is_one_call() -> None:
    step = Doubling()
    assert each_alone_if_refused(step, [1, 2, 3]) == [2, 4, 6]
    assert step.calls == [[1, 2, 3]]


def test_a_refused_batch_fails_only_the_payloads_at_fault() -> None:
    step = Doubling()
    results = each_alone_if_refused(step, [1, -2, 3])
    assert results[0] == 2 and results[2] == 6
    assert isinstance(results[1], InvalidArgumentError)
    assert step.calls == [[1, -2, 3], [1], [-2], [3]]


def test_a_refused_batch_of_one_raises() -> None:
    with pytest.raises(InvalidArgumentError, match="negative"):
        each_alone_if_refused(Doubling(), [-1])


def test_other_errors_are_not_retried() -> None:
    def broken(batch: list[int]) -> list[int]:
        raise RuntimeError("the step itself failed")

    with pytest.raises(RuntimeError):
        each_alone_if_refused(broken, [1, 2])
