"""The events Tandem records, as metric values: `TandemMetrics`.

Contract: pure, no I/O of its own. The service (a request ended or was refused, a drafter
degraded), the online audit (a request checked or dropped), the router (draft and verify
latencies), its admission queue (depth) and the registry (a heartbeat, a replica gone) call
it; it turns each event into increments, values or samples of the metrics of
`cluster.metrics.catalog` on its `Sink` (default: `default_sink()`), so tests check it over a
`MemorySink`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cluster.metrics.catalog import (
    ACCEPTED_BY_POSITION,
    ACCEPTED_TOKENS,
    AUDIT_CHECKED,
    AUDIT_DROPPED,
    AUDIT_MISMATCHED,
    DRAFT_LATENCY,
    DRAFTED_BY_POSITION,
    DRAFTED_TOKENS,
    DRAFTER_DEGRADED,
    GENERATED_TOKENS,
    PIPELINE_HITS,
    PIPELINE_MISSES,
    PROMPT_TOKENS,
    QUEUED,
    REFUSED,
    REQUESTS,
    RUNNING,
    VERIFY_LATENCY,
    VERIFY_PASSES,
    replica_gauge,
    replica_measurements,
)
from cluster.metrics.sinks import Sink, default_sink

if TYPE_CHECKING:  # importing cluster.routing.request would pull in torch for `tandem status`
    from cluster.routing.request import SpeculationStats

NO_LABELS: dict[str, str] = {}


class TandemMetrics:
    """The events Tandem records, as metric values on `sink` (default: `default_sink()`)."""

    def __init__(self, sink: Sink | None = None) -> None:
        self.sink = sink if sink is not None else default_sink()

    def request_ended(
        self,
        tenant: str,
        outcome: str,
        stats: SpeculationStats,
        num_prompt_tokens: int,
        num_generated_tokens: int,
    ) -> None:
        """One request is over: `outcome` is its finish reason's value, or its error's status
        in lower case (`deadline_exceeded`...)."""
        add, who = self.sink.add, {"tenant": tenant}
        add(REQUESTS, 1, {"tenant": tenant, "outcome": outcome})
        add(PROMPT_TOKENS, num_prompt_tokens, who)
        add(GENERATED_TOKENS, num_generated_tokens, who)
        add(DRAFTED_TOKENS, stats.num_drafted, who)
        add(ACCEPTED_TOKENS, stats.num_accepted, who)
        add(VERIFY_PASSES, stats.num_verify_passes, who)
        add(PIPELINE_HITS, stats.pipeline_hits, who)
        add(PIPELINE_MISSES, stats.pipeline_misses, who)
        for metric, counts in ((DRAFTED_BY_POSITION, stats.drafted_by_position),
                               (ACCEPTED_BY_POSITION, stats.accepted_by_position)):  # fmt: skip
            for position, count in enumerate(counts):
                if count:
                    add(metric, count, {"position": str(position)})

    def request_refused(self, tenant: str, status: str) -> None:
        self.sink.add(REFUSED, 1, {"tenant": tenant, "status": status})

    def drafter_degraded(self, cause: str) -> None:
        """A request's drafting stopped on a drafter error (`cause`: its status, lower case);
        the request went on with the target alone."""
        self.sink.add(DRAFTER_DEGRADED, 1, {"cause": cause})

    def audit_checked(self, rule: str, dtype: str, cause: str) -> None:
        """The online audit checked one request: `cause` is "match", "near_tie" or
        "divergence" (the last two also count as mismatched)."""
        labels = {"rule": rule, "dtype": dtype, "cause": cause}
        self.sink.add(AUDIT_CHECKED, 1, labels)
        if cause != "match":
            self.sink.add(AUDIT_MISMATCHED, 1, labels)

    def audit_dropped(self, reason: str) -> None:
        """A request drawn for the online audit went unchecked: `queue_full` or `failed`."""
        self.sink.add(AUDIT_DROPPED, 1, {"reason": reason})

    def drafted(self, seconds: float) -> None:
        self.sink.observe(DRAFT_LATENCY, seconds, NO_LABELS)

    def verified(self, seconds: float) -> None:
        self.sink.observe(VERIFY_LATENCY, seconds, NO_LABELS)

    def queue(self, running: int, queued: int) -> None:
        self.sink.set(RUNNING, running, NO_LABELS)
        self.sink.set(QUEUED, queued, NO_LABELS)

    def replica_seen(self, info: Mapping[str, Any]) -> None:
        """A heartbeat: every measurement in it, as the replica's gauges."""
        labels = {"replica_id": str(info["replica_id"]), "side": str(info["side"])}
        for field, value in replica_measurements(info).items():
            self.sink.set(replica_gauge(field), value, labels)

    def replica_gone(self, info: Mapping[str, Any]) -> None:
        labels = {"replica_id": str(info["replica_id"]), "side": str(info["side"])}
        for field in replica_measurements(info):
            self.sink.drop(replica_gauge(field), labels)
