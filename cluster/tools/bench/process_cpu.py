"""CPU time of a service's processes over a window, by role, and per generated token.

Words: a *reading* is one process's CPU time so far (utime + stime of /proc/<pid>/stat, in
clock ticks, every thread counted); a *snapshot* is the readings of every process in scope at
one moment; a *window* is the snapshots from its start to its end. A process's CPU in a window
is its last reading in the window less its first one at the start (0 if it started during the
window): one that ends during the window counts up to its last reading, so a window polled
every second (`CpuWindow(interval_s=1.0)`) loses at most a second of a process killed in it
(one that starts and ends between two scans for new processes is missed).
Processes are keyed by pid and start time, so that a reused pid is a new process.

Roles (`classify`, from the command line Ray workers retitle themselves with):

- `router`, `drafter`, `verifier`: `ray::ServeReplica:<app>:Router` (the ingress), `:Drafter`,
  `:Verifier` (the deployment names of `cluster.serve.app`); each replica is also listed apart
  in `processes`.
- `proxy`: `ray::ProxyActor`, Serve's HTTP and gRPC proxy; `controller`: `ray::ServeController`;
  `registry`: `ray::ReplicaRegistry`, Tandem's replica registry actor.
- `ray`: Ray's own processes: gcs_server, raylet, the dashboard and its agents, the log
  monitor, the autoscaler monitor, the Ray client server, and any other `ray::` worker.
- `other`: a process of the cluster that is none of these (another driver, or a Serve replica
  of another deployment).
- `load_client`: this process and its descendants, whatever their command line: reported
  apart, and never in `service_total`. The window's own polls count here.

Scope (which processes count): `cluster_scope(temp_dir)` takes the processes of the Ray
cluster whose temp dir that is (those naming it on their command line or holding a file open in
it, `cluster.serve.ray_cluster.cluster_processes`) and their descendants: exactly one
service's processes, even beside another Ray cluster of the same user. `user_scope()` is the
fallback for a service this machine did not start with `tandem serve` (no temp dir to go by):
every process of the current user whose command line has a role above, which also counts any
other Ray cluster the user runs.

The arithmetic (`parse_stat`, `classify`, `process_name`, `usage`) is plain Python over text and
numbers; only the scopes, `read_snapshot`, `reread` and `CpuWindow` read /proc. Linux only.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROLES = (
    "router", "proxy", "controller", "registry", "drafter", "verifier", "suffix", "ray", "other",
)  # fmt: skip
"""The service's roles, in report order; `service_total` is their sum."""
CLIENT = "load_client"
SERVICE_TOTAL = "service_total"

DEPLOYMENT_ROLES = {
    "Router": "router", "Drafter": "drafter", "Verifier": "verifier", "SuffixDrafter": "suffix",
}  # fmt: skip
"""Serve deployment name (cluster.serve.app) -> role."""
ACTOR_ROLES = {
    "ProxyActor": "proxy",
    "ServeController": "controller",
    "ReplicaRegistry": "registry",
}
"""The title after `ray::` of the other actors with a role of their own -> role."""
RAY_TITLE = "ray::"
SERVE_REPLICA = "ServeReplica:"
RAY_PROGRAMS = (
    "ray/core/src/ray/gcs/gcs_server", "ray/core/src/ray/raylet/raylet",
    "ray/dashboard/dashboard.py", "ray/dashboard/agent.py", "ray/_private/log_monitor.py",
    "ray/autoscaler/_private/monitor.py", "ray/_private/runtime_env/agent/main.py",
    "ray/_private/workers/default_worker.py", "ray.util.client.server",
)  # fmt: skip
"""Fragments of the program (or script, or module) of Ray's own processes, as they read
before a `ray::` title, or without one."""


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


def classify(cmdline: str) -> str | None:
    """The role of a process from its command line (NUL-separated as in /proc, or with spaces);
    None: not a Ray or Tandem process."""
    actor = _ray_actor(cmdline)
    if actor is not None:
        if actor.startswith(SERVE_REPLICA):
            return DEPLOYMENT_ROLES.get(actor.rpartition(":")[2], "other")
        return ACTOR_ROLES.get(actor, "ray")
    words = cmdline.replace("\0", " ").split()
    if any(program in word for word in words[:4] for program in RAY_PROGRAMS):
        return "ray"
    return None


def process_name(cmdline: str) -> str:
    """A short name: a Ray worker's title without `ray::` and the method it runs now, else the
    program (or the script a Python runs, or its `-m` module)."""
    actor = _ray_actor(cmdline)
    if actor is not None:
        return actor
    words = cmdline.replace("\0", " ").split()
    if not words:
        return "?"
    program = os.path.basename(words[0])
    if program.startswith("python"):
        rest = [w for w in words[1:] if not w.startswith("-") or w == "-m"]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return rest[1]
        if rest:
            return os.path.basename(rest[0])
    return program


def _ray_actor(cmdline: str) -> str | None:
    """What a Ray worker's title names, without the method it runs now: `ray::ServeController
    .listen_for_change` -> `ServeController`, `ray::ServeReplica:tandem:Router.handle_request`
    -> `ServeReplica:tandem:Router`; None for a process with no `ray::` title."""
    words = cmdline.replace("\0", " ").split(maxsplit=1)
    if not words or not words[0].startswith(RAY_TITLE):
        return None
    title = words[0].removeprefix(RAY_TITLE)
    if title.startswith(SERVE_REPLICA):  # the app's name may hold a dot; a deployment's not
        head, _, deployment = title.rpartition(":")
        return f"{head}:{deployment.split('.')[0]}"
    return title.split(".")[0]


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


# -- reading /proc ----------------------------------------------------------------------------

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


def cpu_fields(window: Mapping[str, Any]) -> dict[str, Any]:
    """What a measured run adds to its result from its window's `usage`: `cpu_ms_per_token` by
    role, and `cpu` (seconds and cores by role, and each process)."""
    return {
        "cpu_ms_per_token": window["cpu_ms_per_token"],
        "cpu": {key: window[key] for key in ("cpu_s", "cores", "processes")},
    }


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


# -- the printed forms ------------------------------------------------------------------------

TABLE_COLUMNS = (*ROLES, SERVICE_TOTAL, CLIENT)


CpuRow = tuple[Sequence[str], Mapping[str, Any]]


def cpu_table(labels: Sequence[str], rows: Sequence[CpuRow]) -> str:
    """Markdown: CPU ms per generated token by role, a row per window; `labels` name the leading
    cells each row brings (`rows`: (those cells, its `cpu_ms_per_token`))."""
    header = [*labels, *TABLE_COLUMNS]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for cells, per_token in rows:
        figures = [_ms(per_token.get(role)) for role in TABLE_COLUMNS]
        lines.append("| " + " | ".join([*cells, *figures]) + " |")
    return "\n".join(lines) + "\n"


def cpu_section(labels: Sequence[str], rows: Sequence[CpuRow], scope: str | None) -> list[str]:
    """`cpu_table` under a title naming the scope, as lines to append to a printed result;
    nothing when there is no row."""
    if not rows:
        return []
    title = f"CPU ms per generated token, by process role ({scope}):"
    return ["", title, "", cpu_table(labels, rows).rstrip("\n")]


def cpu_line(per_token: Mapping[str, Any]) -> str:
    """One line for a progress message: the service's total, its roles busiest first (those
    above 0.005 ms), and the load client's."""
    roles = sorted((r for r in ROLES if (per_token.get(r) or 0) >= 0.005),
                   key=lambda r: -per_token[r])  # fmt: skip
    parts = ", ".join(f"{role} {per_token[role]:.2f}" for role in roles)
    return (f"CPU ms/token: service {_ms(per_token.get(SERVICE_TOTAL))} ({parts}), "
            f"load client {_ms(per_token.get(CLIENT))}")  # fmt: skip


def _ms(value: float | None) -> str:
    return "–" if value is None else f"{value:.3f}"
