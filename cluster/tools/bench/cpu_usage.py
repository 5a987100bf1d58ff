"""CPU time of a service's processes over a window, by role, and per generated token: the
arithmetic.

Words: a *reading* is one process's CPU time so far (utime + stime of /proc/<pid>/stat, in
clock ticks, every thread counted); a *snapshot* is the readings of every process in scope at
one moment; a *window* is the snapshots from its start to its end. A process's CPU in a window
is its last reading in the window less its first one at the start (0 if it started during the
window): one that ends during the window counts up to its last reading. Processes are keyed by
pid and start time, so that a reused pid is a new process.

`parse_stat` reads a /proc stat line, `descendants` follows parent links, `usage` turns a
window's snapshots into CPU per role (`cluster.tools.bench.process_roles`) and per generated
token (`report`), `add_usage` merges several windows, and `cpu_fields` is what a measured run
adds to its result. Plain Python over text and numbers; `cluster.tools.bench.process_cpu` reads
/proc.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.tools.bench.process_roles import CLIENT, ROLES, SERVICE_TOTAL


@dataclass(frozen=True)
class Reading:
    """One process at one moment."""

    pid: int
    ppid: int
    start_ticks: int
    """When it started, in clock ticks after boot: with the pid, names the process."""
    cpu_ticks: int
    """utime + stime: its CPU time so far, every thread's."""
    role: str
    name: str

    @property
    def key(self) -> tuple[int, int]:
        return (self.pid, self.start_ticks)


Snapshot = Mapping[tuple[int, int], Reading]


def parse_stat(text: str) -> tuple[int, int, int]:
    """(ppid, utime + stime, start time) from the text of /proc/<pid>/stat, in clock ticks.
    The command name (field 2) may hold spaces and parentheses: fields count from its last ')'."""
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15, starttime 22.
    return int(fields[1]), int(fields[11]) + int(fields[12]), int(fields[19])


def descendants(parents: Mapping[int, int], roots: Iterable[int]) -> set[int]:
    """`roots` and every pid whose parent chain (`parents`: pid -> ppid) reaches one of them."""
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = set(), list(roots)
    while stack:
        pid = stack.pop()
        if pid not in found:
            found.add(pid)
            stack.extend(children.get(pid, ()))
    return found


def usage(
    snapshots: Sequence[Snapshot], tokens: int, seconds: float, ticks_per_s: float
) -> dict[str, Any]:
    """CPU per role and per generated token over a window of `snapshots` (oldest first) that
    generated `tokens` in `seconds` (see `report`)."""
    if not snapshots:
        raise ValueError("a window needs at least one snapshot")
    first = snapshots[0]
    last: dict[tuple[int, int], Reading] = {}
    for snapshot in snapshots:
        last.update(snapshot)
    processes = [
        {"pid": r.pid, "role": r.role, "name": r.name,
         "cpu_s": (r.cpu_ticks - (first[key].cpu_ticks if key in first else 0)) / ticks_per_s}
        for key, r in last.items()
    ]  # fmt: skip
    return report(processes, tokens, seconds)


def add_usage(windows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Several windows' `usage` as one (a bench run's calls, say): each process's CPU, the
    tokens and the seconds summed, then reported again."""
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for window in windows:
        for p in window["processes"]:
            entry = merged.setdefault((p["pid"], p["role"]), {**p, "cpu_s": 0.0})
            entry["cpu_s"] += p["cpu_s"]
    return report(
        list(merged.values()),
        sum(int(w["tokens"]) for w in windows),
        sum(float(w["seconds"]) for w in windows),
    )


def report(processes: Sequence[Mapping[str, Any]], tokens: int, seconds: float) -> dict[str, Any]:
    """From each process's `pid`, `role`, `name` and `cpu_s` in a window of `seconds` that
    generated `tokens`: `cpu_s` (seconds per role, `load_client` and `service_total`
    included), `cpu_ms_per_token` (the same per token; None with no token), `cores` (CPU
    seconds per second of window) and `processes` (those that used CPU, by role, busiest first,
    with their own ms per token)."""
    cpu_s = dict.fromkeys((*ROLES, CLIENT), 0.0)
    for p in processes:
        cpu_s[p["role"]] += p["cpu_s"]
    cpu_s[SERVICE_TOTAL] = sum(cpu_s[role] for role in ROLES)

    def per_token(value: float) -> float | None:
        return 1000 * value / tokens if tokens else None

    return {
        "seconds": seconds,
        "tokens": tokens,
        "cpu_s": cpu_s,
        "cpu_ms_per_token": {role: per_token(value) for role, value in cpu_s.items()},
        "cores": {role: value / seconds if seconds > 0 else None for role, value in cpu_s.items()},
        "processes": [
            {**p, "cpu_ms_per_token": per_token(p["cpu_s"])}
            for p in sorted(processes, key=lambda p: (p["role"], -p["cpu_s"]))
            if p["cpu_s"] > 0
        ],
    }


def cpu_fields(window: Mapping[str, Any]) -> dict[str, Any]:
    """What a measured run adds to its result from its window's `usage`: `cpu_ms_per_token` by
    role, and `cpu` (seconds and cores by role, and each process)."""
    return {
        "cpu_ms_per_token": window["cpu_ms_per_token"],
        "cpu": {key: window[key] for key in ("cpu_s", "cores", "processes")},
    }
