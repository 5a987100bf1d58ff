"""The HTTP face's probes (`GET /health`, `/version`, `/metrics`, open to every caller) and
vLLM's extra parameters through the service's default door (the routers' own HTTP server).

Without a cluster: `OpenAIHttp` over the scripted `OpenAIService` of test_openai_http and
stand-in probes, and `tandem_exposition` on made-up scrapes. On the session's service
(tests/cluster/conftest.py, marked `ray` and `slow`): the probes as a load balancer and
Prometheus call them, and the official `openai` client sending vLLM's extras in `extra_body`.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2
import openai
import pytest

from cluster.metrics.scrape import parse_prometheus, tandem_exposition
from cluster.runtime import tiny
from cluster.serve.http import OpenAIHttp
from cluster.serve.ingress import MetricsUnavailableError
from tests.cluster.conftest import TENANT_KEYS
from tests.cluster.serve.test_openai_http import Exchange, ScriptedOpenAI, exchange
from tests.conftest import CODE_PROMPT

MODEL = "tiny"
EXPORT_TIMEOUT_S = 60.0
"""Ray exports application metrics every 10 s by default; a loaded 2-core machine is slower."""
TANDEM_PAGE = (
    "# HELP ray_tandem_requests_total Requests ended, by outcome\n"
    "# TYPE ray_tandem_requests_total counter\n"
    'ray_tandem_requests_total{outcome="length",tenant="main"} 3.0\n'
)


class Probes:
    """What the ingress's probes report, scripted."""

    def __init__(self) -> None:
        self.health: bool | Exception = True
        self.metrics: str | Exception = TANDEM_PAGE

    def healthy(self) -> bool:
        if isinstance(self.health, Exception):
            raise self.health
        return self.health

    def metrics_text(self) -> str:
        if isinstance(self.metrics, Exception):
            raise self.metrics
        return self.metrics


@pytest.fixture
def probed() -> Iterator[tuple[ScriptedOpenAI, Probes, OpenAIHttp]]:
    fake, probes = ScriptedOpenAI(), Probes()
    with ThreadPoolExecutor(2) as threads:
        yield fake, probes, OpenAIHttp(fake, threads, probes)  # type: ignore[arg-type]


def unauthenticated(adapter: OpenAIHttp, method: str, path: str) -> Exchange:
    """One request with no `authorization` header at all."""
    done = Exchange(method, path)
    done.scope["headers"] = []
    asyncio.run(done.run(adapter))
    return done


def test_health_is_200_or_503_with_an_empty_body_and_no_key(
    probed: tuple[ScriptedOpenAI, Probes, OpenAIHttp],
) -> None:
    fake, probes, adapter = probed
    healthy = unauthenticated(adapter, "GET", "/health")
    assert (healthy.status, healthy.content) == (200, b"")
    probes.health = False
    down = unauthenticated(adapter, "GET", "/health")
    assert (down.status, down.content) == (503, b"")
    probes.health = ConnectionError("the registry is gone")
    broken = unauthenticated(adapter, "GET", "/health")
    assert (broken.status, broken.content) == (503, b"")
    assert fake.callers == []  # no probe asked the service to authenticate anyone


def test_version_is_the_installed_packages(
    probed: tuple[ScriptedOpenAI, Probes, OpenAIHttp],
) -> None:
    _, _, adapter = probed
    done = unauthenticated(adapter, "GET", "/version")
    assert done.status == 200 and done.json() == {"version": importlib.metadata.version("tandem")}
    assert exchange(adapter, "GET", "/version", key="not a key").status == 200


def test_metrics_is_prometheus_text_and_no_key(
    probed: tuple[ScriptedOpenAI, Probes, OpenAIHttp],
) -> None:
    _, probes, adapter = probed
    done = unauthenticated(adapter, "GET", "/metrics")
    assert done.status == 200 and done.content.decode() == TANDEM_PAGE
    assert done.headers["content-type"].startswith("text/plain; version=0.0.4")
    probes.metrics = MetricsUnavailableError("no node's metrics agent answered")
    unavailable = unauthenticated(adapter, "GET", "/metrics")
    assert unavailable.status == 503 and "metrics agent" in unavailable.json()["error"]["message"]


def test_probes_take_get_only_and_exist_only_with_probes(
    probed: tuple[ScriptedOpenAI, Probes, OpenAIHttp],
) -> None:
    fake, _, adapter = probed
    for path in ("/health", "/version", "/metrics"):
        posted = unauthenticated(adapter, "POST", path)
        assert posted.status == 405 and posted.headers["allow"] == "GET"
    with ThreadPoolExecutor(1) as threads:
        bare = OpenAIHttp(fake, threads)  # type: ignore[arg-type]
        assert unauthenticated(bare, "GET", "/health").status == 404
    # The API itself still asks for a key.
    assert unauthenticated(adapter, "GET", "/v1/models").status == 401


def test_tandem_exposition_keeps_tandems_families_once_each() -> None:
    node_a = TANDEM_PAGE + (
        "# HELP ray_node_cpu_utilization Ray's own\n"
        "# TYPE ray_node_cpu_utilization gauge\n"
        'ray_node_cpu_utilization{ip="a"} 12.0\n'
        "# HELP ray_tandem_draft_latency_seconds Drafter calls, seconds\n"
        "# TYPE ray_tandem_draft_latency_seconds histogram\n"
        'ray_tandem_draft_latency_seconds_bucket{le="0.001"} 1.0\n'
        'ray_tandem_draft_latency_seconds_bucket{le="+Inf"} 2.0\n'
        "ray_tandem_draft_latency_seconds_count 2.0\n"
        "ray_tandem_draft_latency_seconds_sum 0.01\n"
    )
    node_b = TANDEM_PAGE.replace('tenant="main"} 3.0', 'tenant="small"} 1.0')
    merged = tandem_exposition([node_a, node_b])
    lines = merged.splitlines()
    assert merged.endswith("\n") and "ray_node_cpu_utilization" not in merged
    assert lines.count("# TYPE ray_tandem_requests_total counter") == 1
    assert lines.count("# TYPE ray_tandem_draft_latency_seconds histogram") == 1
    # Each family's samples follow its own HELP and TYPE lines, from every node.
    assert lines[:4] == [*TANDEM_PAGE.splitlines(), node_b.splitlines()[-1]]
    samples = parse_prometheus(merged)
    assert {s.name for s in samples} == {
        "ray_tandem_requests_total",
        "ray_tandem_draft_latency_seconds_bucket",
        "ray_tandem_draft_latency_seconds_count",
        "ray_tandem_draft_latency_seconds_sum",
    }
    assert sum(s.value for s in samples if s.name == "ray_tandem_requests_total") == 4.0
    assert tandem_exposition([]) == "" and tandem_exposition(["# nothing\n"]) == ""


# --- through the routers' own HTTP server, on the session's service -------------------------------


def root_url(service: dict[str, object]) -> str:
    return str(service["http_url"]).removesuffix("/v1")


@pytest.mark.ray
@pytest.mark.slow
def test_the_services_probes_answer_without_a_key(service: dict[str, object]) -> None:
    root = root_url(service)
    health = httpx2.get(f"{root}/health", timeout=60)
    assert (health.status_code, health.content) == (200, b"")
    version = httpx2.get(f"{root}/version", timeout=60)
    assert version.json() == {"version": importlib.metadata.version("tandem")}
    with openai.OpenAI(
        base_url=str(service["http_url"]), api_key=TENANT_KEYS["main"], max_retries=0
    ) as http:
        http.completions.create(model=MODEL, prompt="x", max_tokens=4, temperature=0)
    deadline = time.monotonic() + EXPORT_TIMEOUT_S
    while True:
        page = httpx2.get(f"{root}/metrics", timeout=60)
        assert page.status_code == 200, page.text
        assert page.headers["content-type"].startswith("text/plain; version=0.0.4")
        samples = parse_prometheus(page.text)
        if any(s.name == "ray_tandem_requests_total" for s in samples):
            break
        assert time.monotonic() < deadline, f"no request counted in {EXPORT_TIMEOUT_S} s"
        time.sleep(1.0)
    assert samples and all(s.name.startswith("ray_tandem_") for s in samples)
    described = [line.split()[2] for line in page.text.splitlines() if line.startswith("# TYPE")]
    assert len(described) == len(set(described))


@pytest.mark.ray
@pytest.mark.slow
def test_vllms_extras_through_the_official_client(service: dict[str, object]) -> None:
    ends_early: dict[str, Any] = {"prompt": CODE_PROMPT, "temperature": 1.0, "seed": 16}
    with openai.OpenAI(
        base_url=str(service["http_url"]), api_key=TENANT_KEYS["main"], max_retries=0, timeout=120
    ) as http:
        ended = http.completions.create(
            model=MODEL, max_tokens=24, extra_body={"skip_special_tokens": False}, **ends_early
        )
        assert ended.choices[0].finish_reason == "stop" and ended.usage is not None
        assert ended.usage.completion_tokens == 13 and tiny.END_OF_TEXT not in ended.choices[0].text
        past = http.completions.create(
            model=MODEL, max_tokens=24, **ends_early,
            extra_body={"ignore_eos": True, "skip_special_tokens": False},
        )  # fmt: skip
        assert past.choices[0].finish_reason == "length" and past.usage is not None
        assert past.usage.completion_tokens == 24 and tiny.END_OF_TEXT in past.choices[0].text

        options: Any = {"include_usage": True, "continuous_usage_stats": True}  # vLLM's key too
        chunks = list(
            http.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=8,
                temperature=0, stream=True, stream_options=options,
            )
        )  # fmt: skip
        *with_choices, last = chunks
        assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 8
        counts = [c.usage.completion_tokens for c in with_choices if c.usage is not None]
        assert len(counts) == len(with_choices) and counts[-1] == 8 and counts == sorted(counts)

        with pytest.raises(openai.BadRequestError) as refused:
            http.completions.create(
                model=MODEL, prompt="x", max_tokens=4, extra_body={"repetition_penalty": 1.2}
            )
        assert refused.value.param == "repetition_penalty"
    raw = httpx2.post(
        f"{service['http_url']}/completions",
        headers={"Authorization": f"Bearer {TENANT_KEYS['main']}"},
        json={"model": MODEL, "prompt": "x", "max_tokens": 4, "stop_token_ids": [-1]},
        timeout=60,
    )
    assert raw.status_code == 400 and json.loads(raw.content)["error"]["param"] == "stop_token_ids"
