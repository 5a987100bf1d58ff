"""Metrics of the session's service (tests/cluster/conftest.py) as Prometheus scrapes them from
the local cluster's metrics agent, and as `tandem status` sums them up.

Other tests share the service, so counts are compared as deltas, and exactly only for the
`small` tenant, which no other test uses while this one runs (tests run one at a time). Ray
exports application metrics every few seconds: every check polls.
"""

from __future__ import annotations

import json
import subprocess
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from cluster.api.client import TandemClient, TandemClientError
from cluster.metrics.catalog import replica_measurements
from cluster.metrics.scrape import Sample, parse_prometheus
from tests.cluster.conftest import SMALL_LIMITS, TANDEM, TENANT_KEYS, live_replicas
from tests.conftest import CODE_PROMPT

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXPORT_TIMEOUT_S = 60.0
"""Ray exports every 10 s by default; a loaded 2-core machine may be slower still."""
NUM_REQUESTS = 3
MAX_TOKENS = 16


def metrics_url(service: dict[str, object]) -> str:
    state = json.loads((Path(str(service["home"])) / "cluster.json").read_text())
    assert state["metrics_port"], state
    return f"http://127.0.0.1:{state['metrics_port']}/metrics"


def scrape(url: str) -> list[Sample]:
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with direct.open(url, timeout=10) as page:
        return parse_prometheus(page.read().decode())


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """The sum over every series of `name` whose labels include `labels` (all workers)."""
    return sum(s.value for s in samples if s.name == name and labels.items() <= s.labels.items())


def poll(url: str, ready: Callable[[list[Sample]], bool]) -> list[Sample]:
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while True:
        samples = scrape(url)
        if ready(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(1.0)


def status(service: dict[str, object], *flags: str) -> str:
    return subprocess.run(
        [TANDEM, "status", *flags], env=service["env"], capture_output=True, text=True,  # type: ignore[arg-type]
        timeout=120, check=True,
    ).stdout  # fmt: skip


def test_requests_reach_the_metrics_endpoint(service: dict[str, object]) -> None:
    url = metrics_url(service)

    def small(samples: list[Sample], name: str, **labels: str) -> float:
        return total(samples, name, tenant="small", **labels)

    results = []
    with TandemClient(str(service["address"]), timeout_s=120, api_key=TENANT_KEYS["small"]) as c:
        # Start from a scrape that holds every earlier request of `small` (the router's own
        # usage counters say how many ended), so that the deltas are this test's alone.
        usage = c.usage()
        before = poll(
            url,
            lambda samples: (
                small(samples, "ray_tandem_requests_total") == usage["requests"]
                and small(samples, "ray_tandem_requests_refused_total") == usage["refused"]
            ),
        )
        for seed in range(NUM_REQUESTS):
            results.append(c.generate(CODE_PROMPT, max_tokens=MAX_TOKENS, seed=seed))
        too_long = int(SMALL_LIMITS["max_tokens_per_request"]) + 1
        with pytest.raises(TandemClientError):
            c.generate(CODE_PROMPT, max_tokens=too_long)
    generated = sum(len(r.tokens) for r in results)
    expected = {
        "ray_tandem_requests_total": NUM_REQUESTS,
        "ray_tandem_generated_tokens_total": generated,
        "ray_tandem_prompt_tokens_total": sum(r.num_prompt_tokens for r in results),
        "ray_tandem_drafted_tokens_total": sum(r.num_drafted for r in results),
        "ray_tandem_accepted_tokens_total": sum(r.num_accepted for r in results),
        "ray_tandem_verify_passes_total": sum(r.num_verify_passes for r in results),
        "ray_tandem_pipeline_hits_total": sum(r.pipeline_hits for r in results),
    }
    refused = "ray_tandem_requests_refused_total"

    def delta(samples: list[Sample], name: str, **labels: str) -> float:
        return small(samples, name, **labels) - small(before, name, **labels)

    def exported(samples: list[Sample]) -> bool:
        return all(delta(samples, n) == v for n, v in expected.items()) and (
            delta(samples, refused, status="PERMISSION_DENIED") == 1
        )

    after = poll(url, exported)
    for name, value in expected.items():
        assert delta(after, name) == value, name
    assert delta(after, refused, status="PERMISSION_DENIED") == 1
    assert delta(after, "ray_tandem_requests_total", outcome="length") == sum(
        r.finish_reason == "length" for r in results
    )

    # Across every tenant: rates in range, latencies timed, the queue reported.
    drafted = total(after, "ray_tandem_drafted_tokens_total")
    accepted = total(after, "ray_tandem_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted / drafted <= 1
    passes = total(after, "ray_tandem_verify_passes_total")
    assert total(after, "ray_tandem_generated_tokens_total") / passes >= 1
    for position in range(4):  # the service drafts blocks of 4
        d = total(after, "ray_tandem_drafted_by_position_total", position=str(position))
        a = total(after, "ray_tandem_accepted_by_position_total", position=str(position))
        assert 0 <= a <= d, position
    assert total(after, "ray_tandem_draft_latency_seconds_count") > 0
    assert total(after, "ray_tandem_verify_latency_seconds_count") > 0
    names = {s.name for s in after}
    assert {"ray_tandem_router_running_requests", "ray_tandem_router_queued_requests"} <= names


def test_every_live_replica_has_its_gauges(service: dict[str, object]) -> None:
    url = metrics_url(service)
    replicas = live_replicas(service)
    fields = {str(r["replica_id"]): set(replica_measurements(r)) for r in replicas}
    for replica in replicas:
        own = fields[str(replica["replica_id"])]
        assert {"num_sessions", "num_cached_tokens"} <= own
        if replica["side"] == "suffix":  # an index on CPUs, no engine
            assert {"index_bytes", "index_proposals", "index_proposed"} <= own
            assert not any(field.startswith("engine_") for field in own)
        else:
            assert {"engine_batch_sequences", "engine_kv_blocks_free", "engine_steps"} <= own
    assert {str(r["side"]) for r in replicas} == {"drafter", "verifier", "suffix"}

    def seen(samples: list[Sample]) -> set[tuple[str, str, str]]:
        return {
            (s.name, s.labels.get("replica_id", ""), s.labels.get("side", ""))
            for s in samples
            if s.name.startswith("ray_tandem_replica_")
        }

    wanted = {
        (f"ray_tandem_replica_{field}", str(r["replica_id"]), str(r["side"]))
        for r in replicas
        for field in fields[str(r["replica_id"])]
    }
    samples = poll(url, lambda s: wanted <= seen(s))
    assert wanted <= seen(samples)
    assert not any(name.endswith("_pid") for name, _, _ in seen(samples))


def test_status_sums_up_the_metrics(service: dict[str, object]) -> None:
    with TandemClient(str(service["address"]), timeout_s=120, api_key=TENANT_KEYS["small"]) as c:
        c.generate(CODE_PROMPT, max_tokens=8)
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while True:
        summary = json.loads(status(service, "--json"))
        metrics = summary["metrics"]
        if (metrics and "small" in metrics["tenants"]) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert metrics_url(service).split("/")[2] in summary["metrics_endpoints"]
    assert summary["replicas"] and summary["deployments"]  # what other tests read
    assert metrics is not None and metrics["requests"] >= 1
    assert 0 <= metrics["acceptance_rate"] <= 1
    assert metrics["tokens_per_verify_pass"] >= 1
    assert 0 <= metrics["pipeline_hit_rate"] <= 1
    assert metrics["tenants"]["small"]["generated_tokens"] >= 8
    text = status(service)
    assert "acceptance" in text and "tokens per verify pass" in text and "small" in text
