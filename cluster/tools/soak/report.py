"""The soak's verdict: what it found (`Findings`), one row per figure with what the figure must
be and whether it is (`rows`), and the table (`format_table`).

Pure: plain data in, rows and text out. A row's verdict is PASS or FAIL where the figure has a
required value, INFO where it is only counted, and FAIL too where a required figure could not be
read (a check that did not run has not passed). `failed(rows)` is what the exit status follows.

Threads, descriptors and memory are compared per process between the reading before the load
(after the warm-up) and the one after it: only processes that lived through the soak, by pid (a
killed replica comes back as a new process, whose start is not comparable); the row says how
many those were. A process may end at most `growth_tolerance` above its start; less is no leak.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

PASS, FAIL, INFO = "pass", "FAIL", "-"
USAGE_FIELDS = ("threads", "fds", "rss_mib")
USAGE_NAMES = {"threads": "threads", "fds": "fds", "rss_mib": "RSS"}


@dataclass
class Findings:
    """What one soak run measured."""

    requests: dict[str, Any]
    """The load's tally (`Tally.to_dict()`)."""
    replicas: list[dict[str, Any]]
    """The registry's live replicas (`ReplicaInfo` dicts), read after the load settled."""
    expected_replicas: int
    settle_s: float
    """Seconds from the last request's end to that reading."""
    engine_counters: dict[str, int | None]
    """Engine counters summed over every replica seen; None: no engine reports it."""
    failovers: dict[str, int] | None
    """By side; None: not read."""
    degraded: dict[str, int] | None
    """By cause; None: the metrics did not answer."""
    processes_start: dict[str, dict[str, Any]]
    """Pid -> deployment and usage, before the load."""
    processes_end: dict[str, dict[str, Any]]
    ray_processes_left: int | None = None
    """The cluster's processes still there after `tandem shutdown`; None: not checked."""
    warmup: dict[str, Any] = field(default_factory=dict)
    kills: list[dict[str, Any]] = field(default_factory=list)
    growth_tolerance: float = 0.10

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Row:
    figure: str
    found: str
    must_be: str
    verdict: str


def rows(findings: Findings) -> list[Row]:
    return [
        _lost_row(findings.requests),
        _greedy_row(findings.requests),
        _replica_row(findings, "kv"),
        _replica_row(findings, "sessions"),
        _counted_row(findings),
        _usage_row(findings),
        _ray_row(findings.ray_processes_left),
        _requests_row(findings),
    ]


def failed(table: list[Row]) -> bool:
    return any(row.verdict == FAIL for row in table)


def _lost_row(requests: Mapping[str, Any]) -> Row:
    failures = requests.get("failed", {})
    count = sum(failures.values())
    detail = ", ".join(f"{code} {n}" for code, n in sorted(failures.items()))
    return Row(
        "requests lost or failed with an error other than their own (deadline, cancel, bad input)",
        f"{count} of {requests.get('requests', 0)}" + (f" ({detail})" if detail else ""),
        "0",
        PASS if count == 0 and requests.get("requests", 0) > 0 else FAIL,
    )


def _greedy_row(requests: Mapping[str, Any]) -> Row:
    compared = requests.get("greedy_compared", 0)
    mismatches = requests.get("greedy_mismatches", 0)
    return Row(
        "greedy outputs that differ from the target alone (fp32)",
        f"{mismatches} of {compared} compared",
        "0",
        PASS if mismatches == 0 and compared > 0 else FAIL,
    )


def _replica_row(findings: Findings, what: str) -> Row:
    """Sessions, or KV blocks in use, on every live replica: all 0, every replica read."""
    replicas = findings.replicas
    expected = findings.expected_replicas
    if what == "kv":
        figure = (
            f"KV blocks in use on every replica, {findings.settle_s:.0f} s after the last request"
        )
        # A suffix drafter holds an index, not a KV cache: it has no engine to report.
        cached = [r for r in replicas if r.get("side") != "suffix"]
        expected -= len(replicas) - len(cached)
        replicas = cached
        values = {r["replica_id"]: (r.get("engine") or {}).get("kv_blocks_used") for r in replicas}
    else:
        figure = "sessions open on every replica"
        values = {r["replica_id"]: r.get("num_sessions") for r in replicas}
    unread = sorted(rid for rid, value in values.items() if value is None)
    busy = {rid: value for rid, value in values.items() if value}
    found = ", ".join(f"{rid} {value}" for rid, value in sorted(busy.items())) or "0"
    found += f" on {len(replicas)} of {expected} replicas"
    if what == "kv" and expected < findings.expected_replicas:
        found += " with a KV cache"
    if unread:
        found += f" (not reported by {', '.join(unread)})"
    complete = len(replicas) == expected and not unread
    return Row(figure, found, "0", PASS if complete and not busy else FAIL)


def _counted_row(findings: Findings) -> Row:
    def count(name: str, value: int | None) -> str:
        return f"{name} {'not reported' if value is None else value}"

    counters = findings.engine_counters
    parts = [
        count("preemptions", counters.get("preemptions")),
        count("recomputed tokens", counters.get("recomputed_tokens")),
        count("engine refusals", counters.get("refusals")),
        _by("failovers", findings.failovers, "not read"),
        _by("degraded", findings.degraded, "metrics unreadable"),
    ]
    return Row(
        "preemptions, recomputations, failovers, degraded requests", "; ".join(parts), "counted",
        INFO,
    )  # fmt: skip


def _by(name: str, counts: Mapping[str, int] | None, missing: str) -> str:
    if counts is None:
        return f"{name} {missing}"
    detail = ", ".join(f"{key} {n}" for key, n in sorted(counts.items()) if n)
    return f"{name} {sum(counts.values())}" + (f" ({detail})" if detail else "")


def usage_growth(
    start: Mapping[str, Mapping[str, Any]], end: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, float]]:
    """Per pid alive at both readings: each usage figure's end over its start, less 1."""
    growth = {}
    for pid in sorted(start.keys() & end.keys()):
        growth[pid] = {
            name: (end[pid][name] - start[pid][name]) / start[pid][name]
            for name in USAGE_FIELDS
            if start[pid][name]
        }
    return growth


def _usage_row(findings: Findings) -> Row:
    figure = "threads, open file descriptors and RSS of each replica, start vs end"
    tolerance = findings.growth_tolerance
    must_be = f"at most {tolerance:.0%} above start"
    growth = usage_growth(findings.processes_start, findings.processes_end)
    gone = len(findings.processes_start) - len(growth)
    if not growth:
        return Row(figure, f"no process lived through the soak ({gone} restarted)", must_be, FAIL)
    over = []
    worst = {}
    for name in USAGE_FIELDS:
        pid, ratio = max(((p, g.get(name, 0.0)) for p, g in growth.items()), key=lambda x: x[1])
        worst[name] = f"{USAGE_NAMES[name]} {ratio:+.0%} ({_label(findings, pid)})"
        over += [
            f"{USAGE_NAMES[name]} of {_label(findings, p)} {g[name]:+.0%}"
            for p, g in growth.items()
            if g.get(name, 0.0) > tolerance
        ]
    survivors = ", ".join(_label(findings, pid) for pid in growth)
    found = (
        f"{len(growth)} lived through ({survivors}); {gone} killed and restarted, not compared; "
        + ("over: " + ", ".join(over) if over else "most grown: " + ", ".join(worst.values()))
    )
    return Row(figure, found, must_be, FAIL if over else PASS)


def _label(findings: Findings, pid: str) -> str:
    return f"{findings.processes_start[pid]['deployment'].lower()} {pid}"


def _ray_row(left: int | None) -> Row:
    figure = "Ray processes left after the soak stops itself"
    if left is None:
        return Row(figure, "not checked", "none", FAIL)
    return Row(figure, "none" if left == 0 else str(left), "none", PASS if left == 0 else FAIL)


def _requests_row(findings: Findings) -> Row:
    requests = findings.requests
    own = ", ".join(f"{code} {n}" for code, n in sorted(requests.get("own_errors", {}).items()))
    kills = ", ".join(
        f"{k['side']} at {k['at_s']:.0f} s" + ("" if "pid" in k else f" ({k.get('error')})")
        for k in findings.kills
    )
    found = (
        f"{requests.get('requests', 0)} requests, {requests.get('tokens', 0)} tokens; "
        f"their own errors: {own or 'none'}; RESOURCE_EXHAUSTED refusals retried: "
        f"{requests.get('refusals_retried', 0)}; replicas killed: {kills or 'none'}"
    )
    warmup = findings.warmup
    if warmup:
        found += (
            f"; warm-up: {warmup.get('requests', 0)} requests, "
            f"{sum(warmup.get('failed', {}).values())} failed"
        )
    return Row("requests sent (for the record)", found, "counted", INFO)


def format_table(table: list[Row]) -> str:
    lines = ["| figure | found | must be | verdict |", "|---|---|---|---|"]
    lines += [f"| {r.figure} | {r.found} | {r.must_be} | {r.verdict} |" for r in table]
    verdict = "FAIL: " + "; ".join(r.figure for r in table if r.verdict == FAIL)
    lines += ["", verdict if failed(table) else "soak passed"]
    return "\n".join(lines) + "\n"
