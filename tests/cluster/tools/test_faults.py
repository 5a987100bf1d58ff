"""The fault side of `tandem loadtest`: which replica is killed, and what memory reads."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
from typing import Any

import pytest

from cluster.runtime.errors import InvalidArgumentError
from cluster.tools import faults
from cluster.tools.bench.loadtest import run_load


def _replica(replica_id: str, side: str, sessions: int, pid: int) -> dict[str, Any]:
    return {"replica_id": replica_id, "side": side, "address": "127.0.0.1:1",
            "num_sessions": sessions, "num_cached_tokens": 10 * sessions, "pid": pid}  # fmt: skip


def test_kill_busiest_signals_the_replica_with_the_most_sessions() -> None:
    idle = subprocess.Popen(["sleep", "60"])
    busy = subprocess.Popen(["sleep", "60"])
    try:
        replicas = [
            _replica("d-idle", "drafter", 0, idle.pid),
            _replica("d-busy", "drafter", 3, busy.pid),
            _replica("v-1", "verifier", 9, os.getpid()),  # the other side: never touched
        ]
        log: list[dict[str, Any]] = []
        faults.kill_busiest("drafter", lambda: replicas, log)()
        assert busy.wait(timeout=10) == -signal.SIGKILL
        assert idle.poll() is None
        assert log[0]["replica_id"] == "d-busy" and log[0]["sessions"] == 3
    finally:
        for process in (idle, busy):
            process.kill()
            process.wait()


def test_kill_with_no_replica_of_the_side_records_why() -> None:
    log: list[dict[str, Any]] = []
    faults.kill_busiest("verifier", lambda: [], log)()
    assert log == [{"side": "verifier", "error": "no live verifier replica to kill"}]
    with pytest.raises(InvalidArgumentError, match="drafter or verifier"):
        faults.kill_busiest("router", lambda: [], log)


def test_memory_sums_each_side() -> None:
    replicas = [_replica("d1", "drafter", 2, os.getpid()), _replica("v1", "verifier", 1, 2**22)]
    memory = faults.memory(lambda: replicas)
    assert memory["drafter"]["sessions"] == 2 and memory["drafter"]["cached_tokens"] == 20
    assert memory["drafter"]["resident_mib"] > 0  # this very process
    assert memory["verifier"]["resident_mib"] == 0  # a pid that is not there


class _Client:
    """Streams fixed tokens; the prompt "fail" raises as a lost request does."""

    async def stream(self, prompt: str, **settings: Any) -> Any:
        from cluster.api.client_types import StreamChunk, TandemClientError

        if prompt == "fail":
            import grpc

            raise TandemClientError(grpc.StatusCode.UNAVAILABLE, "replica gone")
        await asyncio.sleep(0.001)  # a bounded number of requests, as over a network
        yield StreamChunk("r", (1, 2), "ab")
        yield StreamChunk("r", (3,) if prompt == "good" else (4,), "c", finish_reason="length")


def test_run_load_counts_lost_and_corrupted_requests_and_runs_midway_once() -> None:
    calls: list[int] = []
    reference = {"good": (1, 2, 3), "bad": (1, 2, 3), "fail": (1,)}
    result = asyncio.run(
        run_load(_Client(), ["good", "bad", "fail"], 3, 0.2, {}, lambda: calls.append(1), reference)
    )
    assert calls == [1]
    assert result["lost"] == result["errors"]["UNAVAILABLE"] > 0
    assert 0 < result["corrupted"] < result["requests"]  # "bad" only, never "good"
