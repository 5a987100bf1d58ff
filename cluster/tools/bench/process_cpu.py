"""CPU time of a service's processes over a window, read from /proc. Linux only.

Scope (which processes count): `cluster_scope(temp_dir)` takes the processes of the Ray
cluster whose temp dir that is (those naming it on their command line or holding a file open in
it, `cluster.serve.ray_cluster.cluster_processes`) and their descendants: exactly one
service's processes, even beside another Ray cluster of the same user. `user_scope()` is the
fallback for a service this machine did not start with `tandem serve` (no temp dir to go by):
every process of the current user whose command line has a role
(`cluster.tools.bench.process_roles`), which also counts any other Ray cluster the user runs.
The load client (this process and its descendants) is set apart whatever the scope.

`read_snapshot` reads every process in scope now, `reread` the processes of a snapshot again.
`CpuWindow` takes snapshots from its start to its stop, polled every second by default, so a
process killed in the window loses at most a second of its CPU (one that starts and ends
between two scans for new processes is missed); `CpuCalls` puts a window around each call of
some runs. What the snapshots add up to is `cluster.tools.bench.cpu_usage`'s arithmetic.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.tools.bench.cpu_usage import (
    Reading,
    Snapshot,
    add_usage,
    cpu_fields,
    descendants,
    parse_stat,
    usage,
)
from cluster.tools.bench.process_roles import CLIENT, classify, process_name

PROC = Path("/proc")


@dataclass(frozen=True)
class Scope:
    """Which processes count: `select(parents, cmdlines)` (every pid's parent and command line)
    gives their pids; the load client is set apart after."""

    description: str
    select: Callable[[Mapping[int, int], Mapping[int, str]], set[int]]


def cluster_scope(temp_dir: str) -> Scope:
    """The processes of the Ray cluster of `temp_dir` and their descendants."""
    from cluster.serve.ray_cluster import cluster_processes

    def select(parents: Mapping[int, int], cmdlines: Mapping[int, str]) -> set[int]:
        return descendants(parents, cluster_processes(temp_dir))

    return Scope(f"the Ray cluster of {temp_dir} and its descendants", select)


def user_scope(uid: int | None = None) -> Scope:
    """Every process of `uid` (default: this user) whose command line has a role."""
    owner = os.getuid() if uid is None else uid

    def select(parents: Mapping[int, int], cmdlines: Mapping[int, str]) -> set[int]:
        mine = set()
        for pid, cmdline in cmdlines.items():
            if classify(cmdline) is None:
                continue
            try:
                if (PROC / str(pid)).stat().st_uid == owner:
                    mine.add(pid)
            except OSError:  # ended meanwhile
                continue
        return mine

    return Scope(f"every process of uid {owner} with a Ray or Tandem role", select)


def read_snapshot(
    scope: Scope, client_pid: int | None = None, *, ticks_last: bool = False
) -> dict[tuple[int, int], Reading]:
    """Every process in `scope`, and the load client (`client_pid`, default this process, and
    its descendants), read now; a process that ends while being read is left out.

    Finding the scope's processes costs this process CPU (~10 ms: every process's open files),
    which must not count in a window: a window's first snapshot reads the CPU times after
    finding them (`ticks_last`), its last one before."""
    stats: dict[int, tuple[int, int, int]] = {}
    cmdlines: dict[int, str] = {}
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stats[int(entry.name)] = parse_stat((entry / "stat").read_text())
            cmdlines[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError, IndexError):
            stats.pop(int(entry.name), None)
    parents = {pid: stat[0] for pid, stat in stats.items()}
    client = descendants(parents, [os.getpid() if client_pid is None else client_pid])
    service = scope.select(parents, cmdlines) - client
    if ticks_last:
        for pid in client | service:
            try:
                stats[pid] = parse_stat((PROC / str(pid) / "stat").read_text())
            except (OSError, ValueError, IndexError):
                stats.pop(pid, None)
    snapshot = {}
    for pid in client | service:
        if pid not in stats:
            continue
        ppid, cpu_ticks, start_ticks = stats[pid]
        role = CLIENT if pid in client else (classify(cmdlines[pid]) or "other")
        reading = Reading(pid, ppid, start_ticks, cpu_ticks, role, process_name(cmdlines[pid]))
        snapshot[reading.key] = reading
    return snapshot


def reread(snapshot: Snapshot) -> dict[tuple[int, int], Reading]:
    """The processes of `snapshot` read again (those still there, by pid and start time): a
    poll that costs a few stat reads, not a scan of every process's open files."""
    again = {}
    for key, old in snapshot.items():
        try:
            ppid, cpu_ticks, start_ticks = parse_stat((PROC / str(old.pid) / "stat").read_text())
        except (OSError, ValueError, IndexError):
            continue  # ended
        if start_ticks == old.start_ticks:
            again[key] = Reading(old.pid, ppid, start_ticks, cpu_ticks, old.role, old.name)
    return again


class CpuWindow:
    """Snapshots from `start()` to `stop(tokens)`, and every `interval_s` in between when given
    (a background thread), so that a process that ends in the window keeps most of its CPU. A
    poll rereads the processes already found, and every `FULL_SCAN_EVERY`th one looks for new
    ones too: finding them costs ~10 ms of this process's CPU, which at one stream (~100
    tokens/s) would add 0.1 ms per token to the load client's figure if done every second."""

    FULL_SCAN_EVERY = 5

    def __init__(self, scope: Scope, interval_s: float | None = 1.0) -> None:
        self.scope = scope
        self.interval_s = interval_s
        self.ticks_per_s = float(os.sysconf("SC_CLK_TCK"))
        self._snapshots: list[Snapshot] = []
        self._stopped = threading.Event()
        self._poller: threading.Thread | None = None

    def start(self) -> None:
        self._snapshots = [read_snapshot(self.scope, ticks_last=True)]
        self._stopped.clear()
        if self.interval_s is not None:
            self._poller = threading.Thread(target=self._poll, name="cpu-window", daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        assert self.interval_s is not None
        polls = itertools.count(1)
        while not self._stopped.wait(self.interval_s):
            if next(polls) % self.FULL_SCAN_EVERY == 0:
                self._snapshots.append(read_snapshot(self.scope))
            else:
                self._snapshots.append(reread(self._snapshots[-1]))

    def close(self) -> None:
        """Stop polling (idempotent): what an interrupted window does instead of `stop`."""
        self._stopped.set()
        if self._poller is not None:
            self._poller.join()
            self._poller = None

    def stop(self, tokens: int, seconds: float) -> dict[str, Any]:
        """The window's `usage`, with its scope; `seconds`: the window's length as the caller
        timed it (per-core figures), `tokens`: what it generated."""
        self.close()
        self._snapshots.append(read_snapshot(self.scope))
        result = usage(self._snapshots, tokens, seconds, self.ticks_per_s)
        result["scope"] = self.scope.description
        return result


class CpuCalls:
    """CPU per process role of each call of some runs (`tandem bench --mode service`): a
    window around each call, without polling (a call is short, and no process ends in it), then
    one report per run over all its calls."""

    def __init__(self, scope: Scope, runs: Iterable[str]) -> None:
        self.scope = scope
        self.windows: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}

    def open(self, name: str) -> Callable[[int, float], None] | None:
        """Start a window for a call of run `name` and return what ends it, given the call's
        tokens and seconds; None for a run not counted."""
        if name not in self.windows:
            return None
        window = CpuWindow(self.scope, interval_s=None)
        window.start()
        return lambda tokens, seconds: self.windows[name].append(window.stop(tokens, seconds))

    def fields(self) -> dict[str, dict[str, Any]]:
        """Per run, what its result gains: `cpu_ms_per_token` by role and `cpu`."""
        return {name: cpu_fields(add_usage(w)) for name, w in self.windows.items() if w}
