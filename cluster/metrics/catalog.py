"""Every metric Tandem exports: its name, kind, labels and description, and the heartbeat gauges.

Contract: plain data and pure functions, no I/O. `METRICS` lists every fixed metric, the one
list the Grafana dashboard's queries must stay within (a test checks); `Metric.exported` names
what Prometheus scrapes for one (Ray's metrics agent adds `ray_`, and `_total` to a counter).
Beside them, one gauge per numeric field of the replicas' heartbeats (`replica_gauge`, from
`replica_numbers`), so a load field added to `ReplicaInfo` is exported without a change here,
and one per figure of a heartbeat's `engine` (`ENGINE_GAUGE_FIELDS`, as `engine_<figure>`:
batch, tokens per step, KV blocks used and free, queue wait, steps).

Labels stay few and bounded: tenant (from the config), draft position (< MAX_DRAFT_TOKENS),
outcome (a finish reason or an error status), replica id and side (the live replicas), and the
online audit's rule, dtype and cause (a few values each). Ray adds its own (`WorkerId`,
`NodeAddress`...), so two router replicas never write the same series.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeGuard

RAY_PREFIX = "ray_"
"""What Ray's metrics agent puts before every application metric's name."""
LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Draft and verify latency buckets, 1 ms to 10 s. Ray's agent sums a histogram from its buckets'
midpoints, so `_sum` (and a mean from it) is approximate; the quantiles are as fine as these."""
REPLICA_GAUGE_PREFIX = "tandem_replica_"
NOT_GAUGES = frozenset({"pid"})
"""Numeric heartbeat fields that are not measurements."""
ENGINE_GAUGE_PREFIX = "engine_"
ENGINE_GAUGE_FIELDS = (
    "steps", "batch_sequences", "step_tokens", "kv_blocks_used", "kv_blocks_free", "queue_wait_s",
    "preemptions", "recomputed_tokens", "refusals",
)  # fmt: skip
"""The figures of a heartbeat's `engine` (`EngineStats`) exported as replica gauges:
`kv_blocks_free` is derived (total - used); `steps`, `preemptions`, `recomputed_tokens` and
`refusals` only grow (counters kept as gauges, so that they go with their replica: graph them
with `rate`). `queued` is the heartbeat's own
`queue_depth` already; the rest (the cost curve, the block size, the pool's size, the largest
batch) are settings, fits or records, read in `tandem status --json`."""


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class Metric:
    name: str
    kind: Kind
    description: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()
    """Histogram bucket upper bounds."""

    def exported(self) -> tuple[str, ...]:
        """The names Prometheus scrapes for this metric."""
        base = RAY_PREFIX + self.name
        if self.kind is Kind.COUNTER:
            return (base + "_total",)
        if self.kind is Kind.HISTOGRAM:
            return (base + "_bucket", base + "_sum", base + "_count")
        return (base,)


def _counter(name: str, description: str, *labels: str) -> Metric:
    return Metric(name, Kind.COUNTER, description, labels)


REQUESTS = _counter("tandem_requests", "Requests ended, by outcome", "tenant", "outcome")
REFUSED = _counter("tandem_requests_refused", "Requests refused for a limit", "tenant", "status")
PROMPT_TOKENS = _counter("tandem_prompt_tokens", "Prompt tokens of ended requests", "tenant")
GENERATED_TOKENS = _counter("tandem_generated_tokens", "Tokens sent to clients", "tenant")
DRAFTED_TOKENS = _counter("tandem_drafted_tokens", "Draft tokens verified", "tenant")
ACCEPTED_TOKENS = _counter("tandem_accepted_tokens", "Draft tokens accepted", "tenant")
VERIFY_PASSES = _counter("tandem_verify_passes", "Verify passes", "tenant")
PIPELINE_HITS = _counter("tandem_pipeline_hits", "Blocks drafted ahead and kept", "tenant")
PIPELINE_MISSES = _counter("tandem_pipeline_misses", "Blocks drafted ahead, discarded", "tenant")
DRAFTED_BY_POSITION = _counter(
    "tandem_drafted_by_position", "Verify passes whose block had a token at a position", "position"
)
ACCEPTED_BY_POSITION = _counter(
    "tandem_accepted_by_position", "Verify passes that accepted a block up to a position",
    "position",
)  # fmt: skip
DRAFT_LATENCY = Metric(
    "tandem_draft_latency_seconds", Kind.HISTOGRAM, "Drafter calls, seconds",
    buckets=LATENCY_BUCKETS_S,
)  # fmt: skip
VERIFY_LATENCY = Metric(
    "tandem_verify_latency_seconds", Kind.HISTOGRAM,
    "Posted draft blocks, from the post to their verdict, seconds",
    buckets=LATENCY_BUCKETS_S,
)  # fmt: skip
DRAFTER_DEGRADED = _counter(
    "tandem_drafter_degraded",
    "Requests whose drafting stopped on a drafter error (the target alone went on), by status",
    "cause",
)
AUDIT_CHECKED = _counter(
    "tandem_audit_checked",
    "Finished requests the online audit replayed through the target alone, by cause",
    "rule", "dtype", "cause",
)  # fmt: skip
AUDIT_MISMATCHED = _counter(
    "tandem_audit_mismatched",
    "Audited requests whose served tokens differ from the target's own (near_tie, divergence)",
    "rule", "dtype", "cause",
)  # fmt: skip
AUDIT_DROPPED = _counter(
    "tandem_audit_dropped",
    "Requests drawn for the online audit but not checked (queue_full, failed)",
    "reason",
)
RUNNING = Metric("tandem_router_running_requests", Kind.GAUGE, "Requests generating now")
QUEUED = Metric("tandem_router_queued_requests", Kind.GAUGE, "Requests waiting in the queue")

METRICS = (
    REQUESTS, REFUSED, PROMPT_TOKENS, GENERATED_TOKENS, DRAFTED_TOKENS, ACCEPTED_TOKENS,
    VERIFY_PASSES, PIPELINE_HITS, PIPELINE_MISSES, DRAFTED_BY_POSITION, ACCEPTED_BY_POSITION,
    DRAFT_LATENCY, VERIFY_LATENCY, DRAFTER_DEGRADED, AUDIT_CHECKED, AUDIT_MISMATCHED,
    AUDIT_DROPPED, RUNNING, QUEUED,
)  # fmt: skip
"""Every fixed metric; the replica gauges come from the heartbeats' fields (`replica_gauge`)."""


def replica_gauge(field: str) -> Metric:
    """The gauge of one numeric heartbeat field, per replica."""
    return Metric(
        REPLICA_GAUGE_PREFIX + field, Kind.GAUGE, f"Replica {field}", ("replica_id", "side")
    )


def _is_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def replica_numbers(info: Mapping[str, Any]) -> dict[str, float]:
    """The numeric fields of a heartbeat (`ReplicaInfo` dict) that are measurements."""
    return {
        name: float(value)
        for name, value in info.items()
        if _is_number(value) and name not in NOT_GAUGES
    }


def engine_numbers(info: Mapping[str, Any]) -> dict[str, float]:
    """The engine figures of a heartbeat that are gauges (`ENGINE_GAUGE_FIELDS`), named
    `engine_<figure>`; none when the heartbeat has no engine (or an older replica sent it)."""
    engine = info.get("engine")
    if not isinstance(engine, Mapping):
        return {}
    figures = dict(engine)
    total, used = figures.get("kv_blocks_total"), figures.get("kv_blocks_used")
    if _is_number(total) and _is_number(used):
        figures["kv_blocks_free"] = total - used
    return {
        ENGINE_GAUGE_PREFIX + name: float(figures[name])
        for name in ENGINE_GAUGE_FIELDS
        if _is_number(figures.get(name))
    }


def replica_measurements(info: Mapping[str, Any]) -> dict[str, float]:
    """Every gauge of a heartbeat: its numeric fields and its engine's figures."""
    return {**replica_numbers(info), **engine_numbers(info)}
