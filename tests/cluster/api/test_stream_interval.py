"""`StreamInterval`: chunks held back to a token or time interval, the first and last at once."""

from __future__ import annotations

import pytest

from cluster.api.response import ApiChunk, Usage
from cluster.api.stream_interval import StreamInterval
from cluster.routing.request import FinishReason
from cluster.runtime.errors import InvalidArgumentError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chunk(n: int) -> ApiChunk:
    return ApiChunk("r", (n,), f"<{n}>")


def test_no_interval_lets_every_chunk_out() -> None:
    interval = StreamInterval()
    assert [interval.offer(chunk(n)) for n in range(3)] == [chunk(n) for n in range(3)]


def test_a_token_interval_merges_chunks_the_first_and_last_at_once() -> None:
    interval = StreamInterval(tokens=3, clock=Clock())
    out = [interval.offer(chunk(n)) for n in range(7)]
    assert out[0] == chunk(0)  # the first token goes out at once
    sent = [o for o in out[1:] if o is not None]
    assert [o.tokens for o in sent] == [(1, 2, 3), (4, 5, 6)]
    last = ApiChunk("r", (7,), "end", FinishReason.STOP, Usage(1, 8))
    interval.offer(chunk(7))
    final = interval.offer(last)
    assert final is not None and final.tokens == (7, 7) and final.finish_reason is FinishReason.STOP
    assert final.usage == Usage(1, 8)


def test_a_time_interval_lets_held_chunks_out_once_it_has_passed() -> None:
    clock = Clock()
    interval = StreamInterval(ms=50, clock=clock)
    assert interval.offer(chunk(0)) == chunk(0)
    clock.now = 0.02
    assert interval.offer(chunk(1)) is None
    clock.now = 0.04
    assert interval.offer(chunk(2)) is None
    clock.now = 0.051
    out = interval.offer(chunk(3))
    assert out is not None and out.tokens == (1, 2, 3) and out.text == "<1><2><3>"


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="stream interval"):
        StreamInterval(tokens=-1)
