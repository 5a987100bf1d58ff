"""Tandem's metrics: their names and labels, what a request, a round or a heartbeat adds to them,
and how `tandem status` reads them back.

Glossary (the words of `cluster.routing.request.SpeculationStats`): a verify pass checks one drafted
block; of its drafted tokens the first `accepted` are kept, and the pass commits those plus one
token of the target's own. Acceptance at draft position i is accepted_by_position[i] over
drafted_by_position[i]; tokens per verify pass is generated tokens over verify passes.

Three layers:
- `METRICS`: every fixed metric (name, kind, labels, description), the one list the Grafana
  dashboard's queries must stay within (a test checks), plus one gauge per numeric field of the
  replicas' heartbeats (`replica_gauge`), so a load field added to `ReplicaInfo` is exported
  without a change here, and one per figure of a heartbeat's `engine` (`ENGINE_GAUGE_FIELDS`,
  as `engine_<figure>`: batch, tokens per step, KV blocks used and free, queue wait, steps).
- `TandemMetrics`: what the service (a request ended or was refused), the router (draft and
  verify latencies), its admission queue (depth) and the registry (heartbeats) call. It turns
  those events into increments of named metrics on a `Sink`; pure, so tests check it over a
  `MemorySink`.
- Sinks: `RaySink` (`ray.util.metrics`; each node's metrics agent serves them to Prometheus with
  a `ray_` prefix, counters with a `_total` suffix), `MemorySink` (tests), `NullSink` (no Ray
  here: `default_sink`).

Labels stay few and bounded: tenant (from the config), draft position (< MAX_DRAFT_TOKENS),
outcome (a finish reason or an error status), replica id and side (the live replicas), and the
online audit's rule, dtype and cause (a few values each). Ray adds
its own (`WorkerId`, `NodeAddress`...), so two router replicas never write the same series.
"""

from __future__ import annotations

import enum
import re
import sys
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeGuard

if TYPE_CHECKING:  # importing cluster.routing.request would pull in torch for `tandem status`
    from cluster.routing.request import SpeculationStats

RAY_PREFIX = "ray_"
"""What Ray's metrics agent puts before every application metric's name."""
LATENCY_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
"""Draft and verify latency buckets, 1 ms to 10 s. Ray's agent sums a histogram from its buckets'
midpoints, so `_sum` (and a mean from it) is approximate; the quantiles are as fine as these."""
GAUGE_REFRESH_S = 5.0
"""How often `RaySink` sends every gauge's value again. Ray exports only the series recorded
since its last export (every 10 s by default) and its agent forgets a gauge after two silent
intervals, so a queue that stays empty would otherwise vanish from the graphs."""
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


class Sink(Protocol):
    """Where metric values go; `labels` always names every label of `metric`."""

    def add(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None: ...

    def set(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None: ...

    def observe(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None: ...

    def drop(self, metric: Metric, labels: Mapping[str, str]) -> None:
        """A gauge's series is over: it reads 0, then goes."""


Series = tuple[str, tuple[tuple[str, str], ...]]
"""A metric's name and its label pairs, sorted."""


def series(metric: Metric, labels: Mapping[str, str]) -> Series:
    return metric.name, tuple(sorted(labels.items()))


class NullSink:
    def add(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None:
        pass

    def set(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None:
        pass

    def observe(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None:
        pass

    def drop(self, metric: Metric, labels: Mapping[str, str]) -> None:
        pass


class MemorySink:
    """Values in dicts, by series: counters' sums, gauges' last values, histograms' samples."""

    def __init__(self) -> None:
        self.counters: dict[Series, float] = defaultdict(float)
        self.gauges: dict[Series, float] = {}
        self.observations: dict[Series, list[float]] = defaultdict(list)

    def add(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None:
        self.counters[series(metric, labels)] += value

    def set(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None:
        self.gauges[series(metric, labels)] = value

    def observe(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None:
        self.observations[series(metric, labels)].append(value)

    def drop(self, metric: Metric, labels: Mapping[str, str]) -> None:
        self.gauges.pop(series(metric, labels), None)


class RaySink:
    """`ray.util.metrics` objects, made on first use; keeps every gauge alive (see
    `GAUGE_REFRESH_S`) until it is dropped. Thread-safe."""

    def __init__(self, refresh_s: float = GAUGE_REFRESH_S) -> None:
        self._refresh_s = refresh_s
        self._lock = threading.Lock()
        self._made: dict[str, Any] = {}
        self._gauges: dict[Series, tuple[Metric, dict[str, str], float]] = {}
        self._refresher: threading.Thread | None = None
        self._stopped = threading.Event()

    def add(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None:
        if value > 0:  # Ray refuses increments of 0
            self._made_for(metric).inc(value, dict(labels))

    def set(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None:
        gauge = self._made_for(metric)
        with self._lock:  # so that a refresh never sends an older value after this one
            gauge.set(value, dict(labels))
            self._gauges[series(metric, labels)] = (metric, dict(labels), value)
            if self._refresher is None:
                self._refresher = threading.Thread(
                    target=self._refresh, name="metrics-refresh", daemon=True
                )
                self._refresher.start()

    def observe(self, metric: Metric, value: float, labels: Mapping[str, str]) -> None:
        self._made_for(metric).observe(value, dict(labels))

    def drop(self, metric: Metric, labels: Mapping[str, str]) -> None:
        # Ray cannot delete a series; unrefreshed, it leaves the export within two intervals.
        gauge = self._made_for(metric)
        with self._lock:
            gauge.set(0.0, dict(labels))
            self._gauges.pop(series(metric, labels), None)

    def close(self) -> None:
        self._stopped.set()

    def _made_for(self, metric: Metric) -> Any:
        made = self._made.get(metric.name)
        if made is None:
            from ray.util import metrics

            with self._lock:
                made = self._made.get(metric.name)
                if made is None:
                    made = self._make(metrics, metric)
                    self._made[metric.name] = made
        return made

    @staticmethod
    def _make(metrics: Any, metric: Metric) -> Any:
        if metric.kind is Kind.COUNTER:
            return metrics.Counter(metric.name, metric.description, metric.labels)
        if metric.kind is Kind.GAUGE:
            return metrics.Gauge(metric.name, metric.description, metric.labels)
        return metrics.Histogram(
            metric.name, metric.description, list(metric.buckets), metric.labels
        )

    def _refresh(self) -> None:
        while not self._stopped.wait(self._refresh_s):
            with self._lock:
                for metric, labels, value in self._gauges.values():
                    self._made[metric.name].set(value, labels)


def default_sink() -> Sink:
    """Ray's metrics inside a Ray worker or driver, else nothing. Ray is never imported just to
    find out: a process that has not imported it is not in a Ray cluster."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        return RaySink()
    return NullSink()


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


class Sample(NamedTuple):
    """One line of a Prometheus scrape."""

    name: str
    labels: dict[str, str]
    value: float


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')
_UNESCAPE = {"n": "\n", '"': '"', "\\": "\\"}


def parse_prometheus(text: str) -> list[Sample]:
    """The samples of Prometheus' text exposition format (comments skipped)."""
    samples = []
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        pairs = {
            key: re.sub(r"\\(.)", lambda m: _UNESCAPE.get(m[1], m[1]), raw)
            for key, raw in _LABEL.findall(labels or "")
        }
        samples.append(Sample(name, pairs, float(value)))
    return samples


TANDEM_EXPORTED_PREFIX = RAY_PREFIX + "tandem_"
"""How every Tandem metric's name begins where Ray's metrics agent serves it."""
_FAMILY_LINE = re.compile(r"^#\s+(HELP|TYPE)\s+([a-zA-Z_:][a-zA-Z0-9_:]*)")


def tandem_exposition(pages: Iterable[str]) -> str:
    """Tandem's metrics (`TANDEM_EXPORTED_PREFIX`) out of metrics agents' scrapes (Prometheus'
    text format, one page per node), as one page: each family's `# HELP` and `# TYPE` once,
    then its samples from every page, names and labels as the agents served them."""
    comments: dict[str, dict[str, str]] = defaultdict(dict)
    """Family name -> its HELP and TYPE lines, the first page's."""
    samples: dict[str, list[str]] = defaultdict(list)
    for page in pages:
        family = ""
        for line in page.splitlines():
            described = _FAMILY_LINE.match(line)
            if described is not None:
                family = described[2]
                comments[family].setdefault(described[1], line)
            elif (sample := _LINE.match(line)) is not None:
                if not (family and sample[1].startswith(family)):
                    family = sample[1]  # a sample with no family line of its own
                samples[family].append(line)
    return "".join(
        "".join(f"{line}\n" for line in [*comments[family].values(), *samples[family]])
        for family in dict.fromkeys([*comments, *samples])
        if family.startswith(TANDEM_EXPORTED_PREFIX)
    )


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator else None


def summarize(samples: Iterable[Sample]) -> dict[str, Any]:
    """What `tandem status` shows of a scrape (all nodes' samples together): totals since the
    service started, rates as ratios of them, the queue now, and usage per tenant."""
    totals: dict[str, float] = defaultdict(float)
    by_label: dict[tuple[str, str], dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for sample in samples:
        name = sample.name.removeprefix(RAY_PREFIX).removesuffix("_total")
        totals[name] += sample.value
        for label in ("tenant", "position"):
            if label in sample.labels:
                by_label[name, label][sample.labels[label]] += sample.value

    def total(metric: Metric) -> float:
        return totals.get(metric.name, 0.0)

    drafted = by_label[DRAFTED_BY_POSITION.name, "position"]
    accepted = by_label[ACCEPTED_BY_POSITION.name, "position"]
    usage_of = {
        "requests": REQUESTS, "refused": REFUSED, "prompt_tokens": PROMPT_TOKENS,
        "generated_tokens": GENERATED_TOKENS, "drafted_tokens": DRAFTED_TOKENS,
        "accepted_tokens": ACCEPTED_TOKENS,
    }  # fmt: skip
    tenants = sorted({t for (_, label), v in by_label.items() if label == "tenant" for t in v})
    hits, misses = total(PIPELINE_HITS), total(PIPELINE_MISSES)
    return {
        "requests": int(total(REQUESTS)),
        "generated_tokens": int(total(GENERATED_TOKENS)),
        "acceptance_rate": _ratio(total(ACCEPTED_TOKENS), total(DRAFTED_TOKENS)),
        "acceptance_by_position": [
            _ratio(accepted.get(str(i), 0.0), drafted.get(str(i), 0.0)) for i in range(len(drafted))
        ],
        "tokens_per_verify_pass": _ratio(total(GENERATED_TOKENS), total(VERIFY_PASSES)),
        "pipeline_hit_rate": _ratio(hits, hits + misses),
        "running_requests": int(total(RUNNING)),
        "queued_requests": int(total(QUEUED)),
        "tenants": {
            tenant: {
                key: int(by_label[metric.name, "tenant"].get(tenant, 0.0))
                for key, metric in usage_of.items()
            }
            for tenant in tenants
        },
    }
