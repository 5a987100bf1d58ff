"""Reading Tandem's metrics back: Prometheus' text format, and what `tandem status` shows.

Contract: pure functions of text and samples, no I/O (the caller fetches the pages).
`parse_prometheus` reads the samples of one scrape (comments skipped, label values
unescaped); `tandem_exposition` merges metrics agents' pages (one per node) into one page of
Tandem's metrics, each family's `# HELP` and `# TYPE` once; `summarize` turns all nodes'
samples into totals since the service started, rates as ratios of them (None where the
denominator is 0), the queue now, and usage per tenant.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from typing import Any, NamedTuple

from cluster.metrics.catalog import (
    ACCEPTED_BY_POSITION,
    ACCEPTED_TOKENS,
    DRAFTED_BY_POSITION,
    DRAFTED_TOKENS,
    GENERATED_TOKENS,
    PIPELINE_HITS,
    PIPELINE_MISSES,
    PROMPT_TOKENS,
    QUEUED,
    RAY_PREFIX,
    REFUSED,
    REQUESTS,
    RUNNING,
    VERIFY_PASSES,
    Metric,
)


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
