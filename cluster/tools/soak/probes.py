"""What `tandem soak` reads of the service besides its answers, each from where it exists:

- the Serve replica processes of the application (router, drafters, verifiers), found by the
  title Ray gives them, and each one's threads, open file descriptors and resident memory
  (`/proc/<pid>/status`, `/proc/<pid>/fd`);
- the replicas' engine counters since start (`EngineCounters`: `preemptions`,
  `recomputed_tokens`, `refusals`, read with a default of 0 so that an engine that does not
  count them yet reads as "not reported"), kept per replica id across readings so that a
  replica killed later still counts with its last reading;
- the router's counters on the metrics agent's Prometheus page (`degraded`: the requests whose
  drafting stopped on a drafter error, `tandem_drafter_degraded_total{cause}`);
- failovers, which no metric counts: the router logs each one ("request R: <side> <replica>
  failed: <error>", `cluster.routing.failover`), so they are counted in the cluster's log files,
  once per request, side and replica, by side and cause (`failover_cause`).
"""

from __future__ import annotations

import os
import re
import urllib.request
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.metrics.catalog import DRAFTER_DEGRADED
from cluster.metrics.scrape import parse_prometheus
from cluster.serve.loopback import LOOPBACK
from cluster.serve.ray_cluster import cluster_processes

SERVE_REPLICA_TITLE = "ray::ServeReplica:"
"""How Ray titles a Serve replica's process: `ray::ServeReplica:<app>:<deployment>`."""
ENGINE_COUNTERS = ("preemptions", "recomputed_tokens", "refusals")
"""Engine counters since start the soak reports (`EngineStats`, where the engine has them)."""
SCRAPE_TIMEOUT_S = 5.0
FAILOVER_LINE = re.compile(
    r"request (\S+): (drafter|verifier) (\S+) (?:failed|had no room): (.*)$", re.M
)
"""The router's line when a request leaves a failed replica, or a verifier with no room for
it (`Failover.replace`)."""
STATUS_IN_ERROR = re.compile(r"\b([A-Z][A-Z_]{4,}): ")
KV_FULL = "kv_full"
"""The cause of a verifier left for a spare because its KV pool could not hold the session."""
LOG_SUFFIXES = (".err", ".out", ".log")


@dataclass(frozen=True)
class ProcessUsage:
    """One process's threads, open file descriptors and resident memory."""

    threads: int
    fds: int
    rss_mib: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def process_usage(pid: int) -> ProcessUsage | None:
    """`pid`'s usage now; None if it is gone (or not readable)."""
    proc = Path(f"/proc/{pid}")
    try:
        status = dict(
            line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line
        )
        fds = len(os.listdir(proc / "fd"))
        return ProcessUsage(
            threads=int(status["Threads"].split()[0]),
            fds=fds,
            rss_mib=round(int(status["VmRSS"].split()[0]) / 1024, 1),
        )
    except (OSError, KeyError, ValueError):
        return None


def serve_replica_processes(temp_dir: str, app_name: str) -> dict[int, str]:
    """Pid -> deployment (`Router`, `Drafter`, `Verifier`) of the application's Serve replica
    processes in the cluster of Ray temp dir `temp_dir`."""
    prefix = f"{SERVE_REPLICA_TITLE}{app_name}:"
    found = {}
    for pid in cluster_processes(temp_dir):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode().strip()
        except (OSError, UnicodeDecodeError):
            continue
        if title.startswith(prefix):
            found[pid] = title.removeprefix(prefix)
    return found


def usage_of(processes: Mapping[int, str]) -> dict[str, dict[str, Any]]:
    """Per pid (as a string, as JSON keys are): its deployment and usage, for those alive."""
    readings = {}
    for pid, deployment in processes.items():
        usage = process_usage(pid)
        if usage is not None:
            readings[str(pid)] = {"deployment": deployment, **usage.to_dict()}
    return readings


class EngineCounters:
    """The latest reading of each engine counter of every replica ever seen."""

    def __init__(self) -> None:
        self._latest: dict[str, dict[str, int]] = {}
        self._reported: set[str] = set()

    def observe(self, replicas: Iterable[Mapping[str, Any]]) -> None:
        for replica in replicas:
            engine = replica.get("engine") or {}
            self._reported.update(name for name in ENGINE_COUNTERS if name in engine)
            self._latest[str(replica["replica_id"])] = {
                name: int(engine.get(name, 0) or 0) for name in ENGINE_COUNTERS
            }

    def totals(self) -> dict[str, int | None]:
        """Each counter summed over every replica seen; None for one no engine reported."""
        return {
            name: sum(c[name] for c in self._latest.values()) if name in self._reported else None
            for name in ENGINE_COUNTERS
        }

    @property
    def replicas_seen(self) -> int:
        return len(self._latest)


def scrape_degraded(metrics_port: int | None) -> dict[str, int] | None:
    """Requests degraded to the target alone, by cause, from the metrics agent on this
    machine; None if it does not answer."""
    if metrics_port is None:
        return None
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback
    try:
        url = f"http://{LOOPBACK}:{metrics_port}/metrics"
        with direct.open(url, timeout=SCRAPE_TIMEOUT_S) as page:
            samples = parse_prometheus(page.read().decode())
    except OSError:
        return None
    name = DRAFTER_DEGRADED.exported()[0]
    by_cause: Counter[str] = Counter()
    for sample in samples:
        if sample.name == name:
            by_cause[sample.labels.get("cause", "")] += int(sample.value)
    return dict(by_cause)


def failovers_in_logs(log_dir: Path) -> dict[str, int]:
    """Failovers the router logged under `log_dir` (a Ray session's `logs`), by "<side>
    <cause>"; each counted once, however many of the files repeat it."""
    seen: set[tuple[str, str, str, str]] = set()
    for path in sorted(log_dir.rglob("*")):
        if not path.is_file() or path.suffix not in LOG_SUFFIXES:
            continue
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        seen.update((m[1], m[2], m[3], failover_cause(m[4])) for m in FAILOVER_LINE.finditer(text))
    return dict(Counter(f"{side} {cause}" for _, side, _, cause in sorted(seen)))


def failover_cause(error: str) -> str:
    """`KV_FULL`, else the status name the logged error carries (`UNAVAILABLE`, `INTERNAL`...),
    else `other`."""
    if "KV memory" in error:
        return KV_FULL
    status = STATUS_IN_ERROR.search(error)
    return status[1] if status else "other"
