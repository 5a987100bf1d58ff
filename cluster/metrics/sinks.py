"""Where metric values go: a `Sink`, and the three there are.

Contract: a sink takes a counter's increment (`add`), a gauge's value (`set`, and `drop` when
its series is over) and a histogram's sample (`observe`), each with every label of its metric.
`RaySink` makes `ray.util.metrics` objects on first use (Ray imported then, not before), keeps
every gauge alive until dropped (`GAUGE_REFRESH_S`) and is thread-safe; each node's metrics
agent serves them to Prometheus. `MemorySink` keeps the values in dicts (tests); `NullSink`
drops them. `default_sink` is Ray's inside a Ray worker or driver, else nothing.
"""

from __future__ import annotations

import sys
import threading
from collections import defaultdict
from collections.abc import Mapping
from typing import Any, Protocol

from cluster.metrics.catalog import Kind, Metric

GAUGE_REFRESH_S = 5.0
"""How often `RaySink` sends every gauge's value again. Ray exports only the series recorded
since its last export (every 10 s by default) and its agent forgets a gauge after two silent
intervals, so a queue that stays empty would otherwise vanish from the graphs."""


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
