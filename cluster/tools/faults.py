"""Faults on purpose, for `tandem loadtest --kill`: kill a replica process of one side, and
read what the replicas hold in memory before and after.

Only for the service `tandem serve` started on this machine (the registry's pids are this
node's): it signals processes the registry names and nothing else.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from cluster.runtime.errors import InvalidArgumentError

SIDES = ("drafter", "verifier")

Replicas = Callable[[], Sequence[dict[str, Any]]]
"""The registry's live replicas (`ReplicaInfo` dicts); `ray_cluster.live_replicas` by
default, injected in tests."""


def resident_mib(pid: int) -> float | None:
    """A process's resident memory in MiB (None if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def memory(replicas: Replicas) -> dict[str, Any]:
    """Per side: live replicas, their sessions, cached tokens and resident MiB, summed."""
    out: dict[str, Any] = {}
    for side in SIDES:
        mine = [r for r in replicas() if r["side"] == side]
        out[side] = {
            "replicas": len(mine),
            "sessions": sum(r["num_sessions"] for r in mine),
            "cached_tokens": sum(r["num_cached_tokens"] for r in mine),
            "resident_mib": round(sum(resident_mib(r["pid"]) or 0.0 for r in mine), 1),
        }
    return out


def kill_busiest(side: str, replicas: Replicas, log: list[dict[str, Any]]) -> Callable[[], None]:
    """An action that SIGKILLs the live replica of `side` with the most sessions (as last
    reported), and records what it killed, and when, in `log`."""
    if side not in SIDES:
        raise InvalidArgumentError(f"--kill takes drafter or verifier, got {side!r}")

    def kill() -> None:
        mine = [r for r in replicas() if r["side"] == side and r.get("pid")]
        if not mine:
            log.append({"side": side, "error": f"no live {side} replica to kill"})
            return
        victim = max(mine, key=lambda r: r["num_sessions"])
        os.kill(int(victim["pid"]), signal.SIGKILL)
        log.append({"side": side, "replica_id": victim["replica_id"], "pid": victim["pid"],
                    "sessions": victim["num_sessions"], "at": time.time()})  # fmt: skip

    return kill
