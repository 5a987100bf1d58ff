"""Abandoned sessions are evicted after their TTL, KV cache and all; used ones stay."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.replica.host import ReplicaHost
from cluster.runtime.errors import (
    InvalidArgumentError,
    ResourceExhaustedError,
    SessionNotFoundError,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import ReplicaStats, SessionTable
from drafter.config import DrafterConfig
from drafter.drafter import Drafter
from tests.cluster.runtime.fake_runner import PrefillingTable
from verifier.config import VerifierConfig
from verifier.verifier import Verifier

PROMPT = [5, 6, 7, 8]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _table(model: LoadedModel, clock: Clock, max_sessions: int = 8) -> SessionTable:
    return PrefillingTable(model, max_sessions, 4096, session_ttl_s=100.0, clock=clock)


def test_idle_sessions_go_and_used_ones_stay(tiny_target: LoadedModel) -> None:
    clock = Clock()
    table = _table(tiny_target, clock)
    table.open("used", PROMPT, SamplingParams(), 0)
    table.open("abandoned", PROMPT, SamplingParams(), 0)
    cached = table.stats().num_cached_tokens
    clock.now = 60.0
    table.get("used")  # every call of a live request touches its session
    clock.now = 100.0
    assert table.evict_idle() == 0  # not past the TTL yet
    clock.now = 100.5
    assert table.evict_idle() == 1
    assert table.stats().num_sessions == 1
    assert table.stats().num_cached_tokens == cached // 2  # its KV cache went with it
    assert table.num_evicted == 1
    with pytest.raises(SessionNotFoundError, match="evicted after idling"):
        table.get("abandoned")
    table.get("used")


def test_a_full_table_makes_room_by_evicting_idle_sessions_only(tiny_target: LoadedModel) -> None:
    clock = Clock()
    table = _table(tiny_target, clock, max_sessions=2)
    table.open("a", PROMPT, SamplingParams(), 0)
    table.open("b", PROMPT, SamplingParams(), 0)
    clock.now = 50.0
    with pytest.raises(ResourceExhaustedError):
        table.open("c", PROMPT, SamplingParams(), 0)  # both still in use
    clock.now = 150.0
    table.open("c", PROMPT, SamplingParams(), 0)
    assert table.stats().num_sessions == 1


def test_without_a_ttl_nothing_is_evicted(tiny_target: LoadedModel) -> None:
    clock = Clock()
    table = PrefillingTable(tiny_target, 8, 4096, session_ttl_s=None, clock=clock)
    table.open("kept", PROMPT, SamplingParams(), 0)
    clock.now = 1e9
    assert table.evict_idle() == 0 and table.stats().num_sessions == 1


@pytest.mark.parametrize("ttl", [0.0, -1.0, float("nan")])
def test_the_ttl_must_be_positive(ttl: float) -> None:
    with pytest.raises(InvalidArgumentError, match="session_ttl_s"):
        VerifierConfig(session_ttl_s=ttl)
    with pytest.raises(InvalidArgumentError, match="session_ttl_s"):
        DrafterConfig(session_ttl_s=ttl)


def test_replica_memory_returns_to_its_baseline_after_a_burst(
    tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> None:
    verifier = Verifier(tiny_target, VerifierConfig(session_ttl_s=0.2))
    drafter = Drafter(tiny_draft, DrafterConfig(session_ttl_s=0.2))
    for component in (verifier, drafter):
        for i in range(6):
            component.open_session(f"burst-{i}", PROMPT, SamplingParams(), i)
        assert component.stats().num_cached_tokens > 0
    time.sleep(0.3)
    assert verifier.evict_idle() == 6 and drafter.evict_idle() == 6
    for component in (verifier, drafter):
        stats = component.stats()
        assert stats.num_sessions == 0 and stats.num_cached_tokens == 0


def test_the_replica_host_sweeps_every_second_without_a_registry() -> None:
    swept = threading.Event()

    def evict_idle() -> int:
        swept.set()
        return 0

    host = ReplicaHost(
        side="verifier",
        add_servicer=lambda server: None,
        stats=lambda: ReplicaStats(num_sessions=0, num_cached_tokens=0),
        registry=None,
        host="127.0.0.1",
        secret="0123456789abcdef",
        evict_idle=evict_idle,
    )
    try:
        assert swept.wait(timeout=10)
        host.check()
    finally:
        host.stop()
