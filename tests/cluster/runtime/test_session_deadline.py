"""A session opened with a time limit is dropped once it passes, KV cache and all, whether
housekeeping finds it first or a call does; sessions without a limit keep only the idle TTL."""

from __future__ import annotations

import time

import pytest

from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import (
    DeadlineExceededError,
    InvalidArgumentError,
    ResourceExhaustedError,
    SessionNotFoundError,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import TIME_LIMIT_GRACE_S, SessionTable
from cluster.wire.fields import MAX_UINT32, time_limit_from_wire, time_limit_to_wire
from drafter.drafter import Drafter
from protos import replica_pb2
from tests.cluster.runtime.fake_runner import PrefillingTable
from verifier.verifier import Verifier

PROMPT = [5, 6, 7, 8]
GREEDY = SamplingParams()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _table(
    model: LoadedModel,
    clock: Clock,
    max_sessions: int = 8,
    ttl_s: float | None = 100.0,
    grace_s: float = 0.0,
) -> SessionTable:
    return PrefillingTable(
        model, max_sessions, 4096, session_ttl_s=ttl_s, clock=clock, time_limit_grace_s=grace_s
    )


def test_a_session_is_kept_for_the_grace_past_its_time_limit(tiny_target: LoadedModel) -> None:
    """The router closes a session at its request's deadline; the replica's own drop waits
    TIME_LIMIT_GRACE_S more, so that it never races that close."""
    clock = Clock()
    table = _table(tiny_target, clock, grace_s=TIME_LIMIT_GRACE_S)
    table.open("limited", PROMPT, GREEDY, 0, time_limit_s=5.0)
    clock.now = 5.0 + TIME_LIMIT_GRACE_S - 0.1
    assert table.evict_idle() == 0
    table.get("limited")
    clock.now = 5.0 + TIME_LIMIT_GRACE_S
    assert table.evict_idle() == 1 and table.num_expired == 1


@pytest.mark.parametrize("ttl_s", [100.0, None], ids=["with-ttl", "without-ttl"])
def test_evict_idle_drops_sessions_past_their_time_limit_only(
    tiny_target: LoadedModel, ttl_s: float | None
) -> None:
    clock = Clock()
    table = _table(tiny_target, clock, ttl_s=ttl_s)
    table.open("unlimited", PROMPT, GREEDY, 0)
    baseline = table.stats().num_cached_tokens
    table.open("limited", PROMPT, GREEDY, 0, time_limit_s=5.0)
    assert table.stats().num_cached_tokens > baseline
    clock.now = 4.9
    assert table.evict_idle() == 0  # time left
    clock.now = 5.0
    assert table.evict_idle() == 1
    assert table.num_expired == 1 and table.num_evicted == 0
    stats = table.stats()
    assert stats.num_sessions == 1 and stats.num_cached_tokens == baseline
    assert (stats.sessions_expired, stats.sessions_evicted) == (1, 0)
    with pytest.raises(SessionNotFoundError):
        table.get("limited")
    table.get("unlimited")


def test_a_call_on_an_expired_session_raises_deadline_exceeded_and_frees_it(
    tiny_target: LoadedModel,
) -> None:
    clock = Clock()
    table = _table(tiny_target, clock)
    table.open("limited", PROMPT, GREEDY, 0, time_limit_s=2.0)
    clock.now = 1.0
    table.get("limited")  # in time: used like any session
    clock.now = 2.5
    with pytest.raises(DeadlineExceededError, match=r"^session 'limited' passed its deadline$"):
        table.get_at("limited", len(PROMPT))
    assert table.num_expired == 1
    assert table.stats().num_sessions == 0 and table.stats().num_cached_tokens == 0
    with pytest.raises(SessionNotFoundError):  # gone, not expired a second time
        table.get("limited")
    assert table.num_expired == 1


def test_using_a_session_does_not_extend_its_time_limit(tiny_target: LoadedModel) -> None:
    clock = Clock()
    table = _table(tiny_target, clock)
    table.open("limited", PROMPT, GREEDY, 0, time_limit_s=3.0)
    for now in (1.0, 2.0, 2.9):
        clock.now = now
        table.get("limited")
    clock.now = 3.0
    assert table.evict_idle() == 1


def test_a_full_table_makes_room_by_dropping_expired_sessions(tiny_target: LoadedModel) -> None:
    clock = Clock()
    table = _table(tiny_target, clock, max_sessions=1)
    table.open("a", PROMPT, GREEDY, 0, time_limit_s=10.0)
    clock.now = 5.0
    with pytest.raises(ResourceExhaustedError, match="maximum of 1 sessions"):
        table.open("b", PROMPT, GREEDY, 0)
    clock.now = 10.0
    table.open("b", PROMPT, GREEDY, 0)
    assert table.num_expired == 1 and table.stats().num_sessions == 1


@pytest.mark.parametrize("limit", [0.0, -1.0, float("nan")])
def test_the_time_limit_must_be_positive(tiny_target: LoadedModel, limit: float) -> None:
    table = _table(tiny_target, Clock())
    with pytest.raises(InvalidArgumentError, match="time_limit_s must be > 0"):
        table.open("s", PROMPT, GREEDY, 0, time_limit_s=limit)
    assert table.stats().num_sessions == 0


def test_components_drop_their_sessions_past_the_time_limit(
    tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> None:
    verifier, drafter = Verifier(tiny_target), Drafter(tiny_draft)
    for component in (verifier, drafter):
        component.open_session("limited", PROMPT, GREEDY, 0, time_limit_s=0.05)
        component.open_session("unlimited", PROMPT, GREEDY, 0)
    time.sleep(0.1 + TIME_LIMIT_GRACE_S)  # past the limit and its grace (a sleep lasts this long)
    with pytest.raises(DeadlineExceededError, match="passed its deadline"):
        verifier.verify("limited", DraftBlock(base_length=len(PROMPT), tokens=()))
    with pytest.raises(DeadlineExceededError, match="passed its deadline"):
        drafter.draft("limited", len(PROMPT), [], 1)
    verifier.verify("unlimited", DraftBlock(base_length=len(PROMPT), tokens=()))
    drafter.draft("unlimited", len(PROMPT), [], 1)
    for component in (verifier, drafter):
        assert component.stats().num_sessions == 1
        assert component.close_session("unlimited")
        assert component.stats().num_cached_tokens == 0


def test_the_time_limit_crosses_the_wire_in_whole_milliseconds_rounded_up() -> None:
    assert time_limit_to_wire(1.2341) == 1235  # never drops a session early
    assert time_limit_to_wire(1e-6) == 1  # 0 would be refused
    assert time_limit_to_wire(1e12) == MAX_UINT32
    request = replica_pb2.OpenSessionRequest(session_id="s")
    assert time_limit_from_wire(request) is None
    request.time_limit_ms = 1500
    assert time_limit_from_wire(request) == 1.5
    request.time_limit_ms = 0
    with pytest.raises(InvalidArgumentError, match="time_limit_ms must be >= 1 when set"):
        time_limit_from_wire(request)
