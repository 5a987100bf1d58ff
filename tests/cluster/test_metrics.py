"""Metrics without Ray: what a request, a refusal, a queue change and a heartbeat record; the
Prometheus reader and the replica table behind `tandem status`; the Grafana dashboard's
queries."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from cluster.api.admission import Admission
from cluster.api.caller import Caller
from cluster.api.grpc_api import GrpcApi
from cluster.api.service import RequestCancelledError, TandemService
from cluster.api.tenants import (
    AuthConfig,
    PermissionDeniedError,
    TenantConfig,
    Tenants,
    hash_api_key,
)
from cluster.cli.status_table import replica_lines
from cluster.local import LocalTandem
from cluster.metrics.catalog import (
    ACCEPTED_BY_POSITION,
    ACCEPTED_TOKENS,
    DRAFT_LATENCY,
    DRAFTED_BY_POSITION,
    DRAFTED_TOKENS,
    GENERATED_TOKENS,
    METRICS,
    PIPELINE_HITS,
    PIPELINE_MISSES,
    PROMPT_TOKENS,
    QUEUED,
    REFUSED,
    REQUESTS,
    RUNNING,
    VERIFY_LATENCY,
    VERIFY_PASSES,
    Kind,
    Metric,
    engine_numbers,
    replica_gauge,
    replica_measurements,
    replica_numbers,
)
from cluster.metrics.recorder import TandemMetrics
from cluster.metrics.scrape import parse_prometheus, summarize
from cluster.metrics.sinks import MemorySink, NullSink, RaySink, default_sink, series
from cluster.routing.registry import ReplicaRegistry
from cluster.routing.request import SpeculationStats
from cluster.routing.router import Router
from cluster.runtime.engine_stats import EngineStats
from cluster.serve import ray_cluster
from cluster.wire.replica_info import ReplicaInfo
from protos import generate_pb2
from tests.conftest import CODE_PROMPT
from tests.polling import wait_until

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "tandem-dashboard.json"
KEYS = {"main": "tdm_main-key", "small": "tdm_small-key"}


def counter(sink: MemorySink, metric: Metric, **labels: str) -> float:
    return sink.counters.get(series(metric, labels), 0.0)


def three_passes() -> SpeculationStats:
    """Blocks of 3, 3 and 2 tokens, 2, 3 and 0 accepted; one pipeline hit, one miss."""
    stats = SpeculationStats(
        num_drafted=8, num_accepted=5, num_verify_passes=3, pipeline_hits=1, pipeline_misses=1
    )
    for drafted, accepted in ((3, 2), (3, 3), (2, 0)):
        stats.record_block(drafted, accepted)
    return stats


def test_an_ended_request_adds_its_stats_to_its_tenants_counters() -> None:
    sink = MemorySink()
    metrics = TandemMetrics(sink)
    metrics.request_ended("main", "length", three_passes(), 7, 9)
    metrics.request_ended("main", "stop", three_passes(), 5, 4)
    metrics.request_ended("small", "length", SpeculationStats(num_verify_passes=2), 3, 2)
    assert counter(sink, REQUESTS, tenant="main", outcome="length") == 1
    assert counter(sink, REQUESTS, tenant="main", outcome="stop") == 1
    assert counter(sink, REQUESTS, tenant="small", outcome="length") == 1
    expected = {
        PROMPT_TOKENS: 12, GENERATED_TOKENS: 13, DRAFTED_TOKENS: 16, ACCEPTED_TOKENS: 10,
        VERIFY_PASSES: 6, PIPELINE_HITS: 2, PIPELINE_MISSES: 2,
    }  # fmt: skip
    for metric, value in expected.items():
        assert counter(sink, metric, tenant="main") == value, metric.name
    assert counter(sink, GENERATED_TOKENS, tenant="small") == 2
    assert counter(sink, VERIFY_PASSES, tenant="small") == 2
    # drafted_by_position [3, 3, 2] and accepted_by_position [2, 2, 1], twice.
    for position, (drafted, accepted) in enumerate(((6, 4), (6, 4), (4, 2))):
        assert counter(sink, DRAFTED_BY_POSITION, position=str(position)) == drafted
        assert counter(sink, ACCEPTED_BY_POSITION, position=str(position)) == accepted
    positions = {labels for (name, labels) in sink.counters if name == DRAFTED_BY_POSITION.name}
    assert len(positions) == 3  # no series for positions never drafted


def test_every_recorded_series_has_exactly_its_metrics_labels() -> None:
    sink = MemorySink()
    metrics = TandemMetrics(sink)
    metrics.request_ended("main", "length", three_passes(), 7, 9)
    metrics.request_refused("main", "RESOURCE_EXHAUSTED")
    metrics.drafted(0.01)
    metrics.verified(0.02)
    metrics.drafter_degraded("internal")
    metrics.audit_checked("greedy", "float32", "divergence")
    metrics.audit_dropped("queue_full")
    metrics.queue(1, 0)
    by_name = {m.name: m for m in METRICS}
    recorded = [*sink.counters, *sink.gauges, *sink.observations]
    assert {name for name, _ in recorded} == set(by_name)
    for name, labels in recorded:
        assert tuple(sorted(k for k, _ in labels)) == tuple(sorted(by_name[name].labels)), name


def test_latencies_and_queue_depth() -> None:
    sink = MemorySink()
    metrics = TandemMetrics(sink)
    metrics.drafted(0.004)
    metrics.drafted(0.006)
    metrics.verified(0.03)
    metrics.queue(2, 5)
    metrics.queue(1, 0)
    assert sink.observations[series(DRAFT_LATENCY, {})] == [0.004, 0.006]
    assert sink.observations[series(VERIFY_LATENCY, {})] == [0.03]
    assert sink.gauges[series(RUNNING, {})] == 1
    assert sink.gauges[series(QUEUED, {})] == 0


def test_the_admission_queue_reports_every_change() -> None:
    changes: list[tuple[int, int]] = []
    admission = Admission(
        max_running=1, max_queued=1, on_change=lambda r, q: changes.append((r, q))
    )
    admission.enter("a")
    waiter = threading.Thread(target=admission.enter, args=("b",))
    waiter.start()
    wait_until(lambda: admission.queued == 1, what="b waiting in the queue")
    admission.leave("a")  # b runs now
    waiter.join(timeout=10)
    admission.leave("b")
    assert changes == [(1, 0), (1, 1), (1, 0), (0, 0)]


def heartbeat(replica_id: str, side: str, sessions: int) -> dict[str, Any]:
    return ReplicaInfo(replica_id, side, "127.0.0.1:1", sessions, 10 * sessions, 4321).to_dict()


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_heartbeats_set_replica_gauges_and_departures_drop_them() -> None:
    sink = MemorySink()
    clock = Clock()
    registry = ReplicaRegistry(ttl_s=5.0, clock=clock, metrics=TandemMetrics(sink))
    registry.heartbeat(heartbeat("v1", "verifier", 2))
    registry.heartbeat(heartbeat("d1", "drafter", 1))
    registry.heartbeat(heartbeat("v1", "verifier", 3))

    def gauge(field: str, replica_id: str, side: str) -> float | None:
        return sink.gauges.get(
            series(replica_gauge(field), {"replica_id": replica_id, "side": side})
        )

    assert gauge("num_sessions", "v1", "verifier") == 3
    assert gauge("num_cached_tokens", "v1", "verifier") == 30
    assert gauge("num_sessions", "d1", "drafter") == 1
    assert gauge("pid", "v1", "verifier") is None  # an id, not a measurement
    # Every numeric field of a heartbeat but the pid is a gauge, load fields included.
    fields = set(replica_numbers(heartbeat("v1", "verifier", 3)))
    assert "pid" not in fields and {"num_sessions", "num_cached_tokens"} <= fields
    assert {name for name, _ in sink.gauges} == {replica_gauge(f).name for f in fields}

    assert registry.remove("d1")
    assert gauge("num_sessions", "d1", "drafter") is None
    clock.now = 6.0  # v1 silent past the TTL: gone at the next heartbeat of anyone
    registry.heartbeat(heartbeat("v2", "verifier", 0))
    assert gauge("num_sessions", "v1", "verifier") is None
    assert gauge("num_sessions", "v2", "verifier") == 0
    assert [r["replica_id"] for r in registry.replicas()] == ["v2"]


ENGINE = EngineStats(
    steps=900,
    max_batch_sequences=16,
    kv_blocks_total=512,
    kv_blocks_used=200,
    block_size=16,
    batch_sequences=6.5,
    step_tokens=41.25,
    queue_wait_s=0.02,
    queued=2,
    cost_base_s=0.01,
    cost_per_token_s=1e-5,
)


def test_engine_figures_become_replica_gauges() -> None:
    sink = MemorySink()
    registry = ReplicaRegistry(ttl_s=5.0, clock=Clock(), metrics=TandemMetrics(sink))
    info = ReplicaInfo("v1", "verifier", "127.0.0.1:1", 3, 30, engine=ENGINE.to_dict())
    registry.heartbeat(info.to_dict())

    def gauge(field: str) -> float | None:
        labels = {"replica_id": "v1", "side": "verifier"}
        return sink.gauges.get(series(replica_gauge(field), labels))

    assert gauge("engine_batch_sequences") == 6.5
    assert gauge("engine_step_tokens") == 41.25
    assert gauge("engine_kv_blocks_used") == 200
    assert gauge("engine_kv_blocks_free") == 312  # derived: total - used
    assert gauge("engine_queue_wait_s") == 0.02
    assert gauge("engine_steps") == 900
    assert gauge("engine_queued") is None  # the replica's queue_depth already
    assert replica_gauge("engine_steps").name == "tandem_replica_engine_steps"
    # Settings and fits stay out of the metrics (they are in `tandem status --json`).
    assert gauge("engine_cost_base_s") is None and gauge("engine_block_size") is None
    assert gauge("num_sessions") == 3  # the heartbeat's own fields as before
    # What `tandem status --json` lists: the registry's entries, each with its engine object.
    (listed,) = registry.replicas()
    assert listed["engine"] == ENGINE.to_dict()
    assert {"steps", "max_batch_sequences", "kv_blocks_total", "kv_blocks_used"} <= set(
        listed["engine"]
    )
    assert json.loads(json.dumps(listed)) == listed  # printable as JSON as it is

    assert registry.remove("v1")
    assert not sink.gauges  # the engine's gauges go with the replica


def test_a_heartbeat_without_an_engine_has_no_engine_gauges() -> None:
    plain = ReplicaInfo("v1", "verifier", "127.0.0.1:1", 3, 30).to_dict()
    assert engine_numbers(plain) == {} and replica_measurements(plain) == replica_numbers(plain)
    older = {k: v for k, v in plain.items() if k != "engine"}  # from before engines
    assert engine_numbers(older) == {}
    # A newer engine's figures that are not gauges here are ignored; a missing one is skipped.
    partial = {**plain, "engine": {"steps": 4, "kv_blocks_used": 3, "new_figure": 1.0}}
    assert engine_numbers(partial) == {"engine_steps": 4.0, "engine_kv_blocks_used": 3.0}


def test_replica_numbers_skip_text_flags_and_the_pid() -> None:
    info = {"replica_id": "v1", "side": "verifier", "pid": 7, "up": True, "load": 0.5, "n": 3}
    assert replica_numbers(info) == {"load": 0.5, "n": 3.0}


class FakeRayGauge:
    def __init__(self) -> None:
        self.values: list[tuple[float, dict[str, str]]] = []

    def set(self, value: float, tags: dict[str, str]) -> None:
        self.values.append((value, tags))


def test_ray_sink_keeps_sending_a_gauge_until_it_is_dropped() -> None:
    sink = RaySink(refresh_s=0.01)
    fake, kept = FakeRayGauge(), FakeRayGauge()
    sink._made[RUNNING.name] = fake  # no Ray: the sink's own bookkeeping only
    sink._made[QUEUED.name] = kept  # a gauge left set: counts the refresh passes
    try:
        sink.set(RUNNING, 3, {})
        sink.set(QUEUED, 1, {})
        wait_until(lambda: len(fake.values) >= 3, what="three refreshes")
        assert {v for v, _ in fake.values} == {3}
        sink.drop(RUNNING, {})
        dropped_at, kept_at = len(fake.values), len(kept.values)
        assert fake.values[-1] == (0.0, {})
        # A refresh pass sends every gauge it holds: three more passes sent the kept one.
        wait_until(lambda: len(kept.values) >= kept_at + 3, what="three refreshes after the drop")
        assert len(fake.values) == dropped_at
    finally:
        sink.close()


def test_no_ray_no_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "ray", raising=False)
    assert isinstance(default_sink(), NullSink)
    assert isinstance(TandemMetrics().sink, NullSink)


@pytest.fixture()
def metered(local_tandem: LocalTandem) -> tuple[TandemService, MemorySink]:
    sink = MemorySink()
    auth = AuthConfig(
        tenants=(
            TenantConfig("main", hash_api_key(KEYS["main"])),
            TenantConfig("small", hash_api_key(KEYS["small"]), max_tokens_per_request=8),
        )
    )
    service = TandemService(
        local_tandem.router,
        local_tandem.tokenizer,
        tenants=Tenants(auth),
        metrics=TandemMetrics(sink),
    )
    return service, sink


def as_tenant(name: str) -> Caller:
    return Caller(authorization=f"Bearer {KEYS[name]}")


def test_the_service_records_what_each_request_got(
    metered: tuple[TandemService, MemorySink],
) -> None:
    service, sink = metered
    responses = [
        GrpcApi(service).generate(
            generate_pb2.GenerateRequest(text=CODE_PROMPT, max_tokens=n, seed=1),
            caller=as_tenant("main"),
        )
        for n in (5, 9)
    ]
    assert counter(sink, REQUESTS, tenant="main", outcome="length") == 2
    usage = [r.usage for r in responses]
    spec = [r.speculation for r in responses]
    assert counter(sink, GENERATED_TOKENS, tenant="main") == sum(u.completion_tokens for u in usage)
    assert counter(sink, PROMPT_TOKENS, tenant="main") == sum(u.prompt_tokens for u in usage)
    assert counter(sink, DRAFTED_TOKENS, tenant="main") == sum(s.num_drafted for s in spec)
    assert counter(sink, ACCEPTED_TOKENS, tenant="main") == sum(s.num_accepted for s in spec)
    assert counter(sink, VERIFY_PASSES, tenant="main") == sum(s.num_verify_passes for s in spec)
    assert counter(sink, PIPELINE_HITS, tenant="main") == sum(s.pipeline_hits for s in spec)
    assert counter(sink, PIPELINE_MISSES, tenant="main") == sum(s.pipeline_misses for s in spec)
    assert counter(sink, DRAFTED_BY_POSITION, position="0") == sum(
        s.drafted_by_position[0] for s in spec if s.drafted_by_position
    )
    # Both requests are over: nothing runs or waits.
    assert sink.gauges[series(RUNNING, {})] == 0 and sink.gauges[series(QUEUED, {})] == 0


def test_the_service_counts_refusals_and_cancellations(
    metered: tuple[TandemService, MemorySink],
) -> None:
    service, sink = metered
    with pytest.raises(PermissionDeniedError):
        GrpcApi(service).generate(
            generate_pb2.GenerateRequest(text=CODE_PROMPT, max_tokens=9), caller=as_tenant("small")
        )
    assert counter(sink, REFUSED, tenant="small", status="PERMISSION_DENIED") == 1
    asked = 0

    def is_active() -> bool:
        nonlocal asked
        asked += 1
        return asked < 2

    with pytest.raises(RequestCancelledError):
        GrpcApi(service).generate(
            generate_pb2.GenerateRequest(text=CODE_PROMPT, max_tokens=50),
            is_active=is_active,
            caller=as_tenant("main"),
        )
    assert counter(sink, REQUESTS, tenant="main", outcome="cancelled") == 1
    assert counter(sink, GENERATED_TOKENS, tenant="main") > 0


def test_the_router_times_drafts_and_verify_passes(
    metered: tuple[TandemService, MemorySink],
    local_tandem: LocalTandem,
    lockstep: Router,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, sink = metered
    # The router times the verdict on every block it posts (never the steps a running session
    # takes alone). On the lockstep router every verify pass is a posted block's, the first
    # included (it waits for the drafter), so every pass is timed.
    service = TandemService(
        lockstep, local_tandem.tokenizer, tenants=metered[0].tenants, metrics=TandemMetrics(sink)
    )
    monkeypatch.setattr(lockstep, "metrics", TandemMetrics(sink))
    started = time.perf_counter()  # the router's clock
    response = GrpcApi(service).generate(
        generate_pb2.GenerateRequest(text=CODE_PROMPT, max_tokens=12, seed=3),
        caller=as_tenant("main"),
    )
    request_s = time.perf_counter() - started
    verified = sink.observations[series(VERIFY_LATENCY, {})]
    drafted = sink.observations[series(DRAFT_LATENCY, {})]
    # Every verify pass is timed, and so is the verdict on a block posted ahead that the
    # verifier dropped (a pipeline miss: whether a block goes ahead before the verdict it
    # follows is timing); drafts run ahead too, so at least one.
    stats = response.speculation
    passes = stats.num_verify_passes
    assert passes <= len(verified) <= passes + stats.pipeline_misses
    # Each is the time of one call made during the request.
    assert drafted and all(0 < s <= request_s for s in [*verified, *drafted])


SCRAPE = r"""# HELP ray_tandem_requests_total Requests ended, by outcome
# TYPE ray_tandem_requests_total counter
ray_tandem_requests_total{WorkerId="w1",outcome="length",tenant="main"} 3.0
ray_tandem_requests_total{WorkerId="w2",outcome="stop",tenant="main"} 1.0
ray_tandem_requests_total{WorkerId="w1",outcome="length",tenant="small"} 2.0
ray_tandem_requests_refused_total{WorkerId="w1",status="RESOURCE_EXHAUSTED",tenant="small"} 4.0
ray_tandem_generated_tokens_total{WorkerId="w1",tenant="main"} 40.0
ray_tandem_generated_tokens_total{WorkerId="w1",tenant="small"} 10.0
ray_tandem_prompt_tokens_total{WorkerId="w1",tenant="main"} 12.0
ray_tandem_drafted_tokens_total{WorkerId="w1",tenant="main"} 30.0
ray_tandem_accepted_tokens_total{WorkerId="w1",tenant="main"} 21.0
ray_tandem_verify_passes_total{WorkerId="w1",tenant="main"} 20.0
ray_tandem_pipeline_hits_total{WorkerId="w1",tenant="main"} 6.0
ray_tandem_pipeline_misses_total{WorkerId="w1",tenant="main"} 2.0
ray_tandem_drafted_by_position_total{position="0"} 10.0
ray_tandem_drafted_by_position_total{position="1"} 10.0
ray_tandem_accepted_by_position_total{position="0"} 8.0
ray_tandem_accepted_by_position_total{position="1"} 5.0
ray_tandem_draft_latency_seconds_bucket{le="0.01"} 3.0
ray_tandem_router_running_requests{WorkerId="w1"} 2.0
ray_tandem_router_queued_requests{WorkerId="w1"} 1.0
ray_tandem_router_queued_requests{WorkerId="w2"} 3.0
ray_tandem_replica_num_sessions{replica_id="v1",side="verifier",note="a \"quoted\" \\ value"} 2.0
"""


def test_a_scrape_is_parsed_and_summarized() -> None:
    samples = parse_prometheus(SCRAPE)
    assert len(samples) == 21  # comments skipped
    assert samples[-1].labels["note"] == 'a "quoted" \\ value'
    assert samples[-1].labels["side"] == "verifier" and samples[-1].value == 2.0
    summary = summarize(samples)
    assert summary["requests"] == 6 and summary["generated_tokens"] == 50
    assert summary["acceptance_rate"] == pytest.approx(21 / 30)
    assert summary["acceptance_by_position"] == pytest.approx([0.8, 0.5])
    assert summary["tokens_per_verify_pass"] == pytest.approx(50 / 20)
    assert summary["pipeline_hit_rate"] == pytest.approx(6 / 8)
    assert (summary["running_requests"], summary["queued_requests"]) == (2, 4)
    assert summary["tenants"]["main"] == {
        "requests": 4, "refused": 0, "prompt_tokens": 12, "generated_tokens": 40,
        "drafted_tokens": 30, "accepted_tokens": 21,
    }  # fmt: skip
    assert summary["tenants"]["small"]["refused"] == 4
    assert summary["tenants"]["small"]["requests"] == 2


def test_an_empty_scrape_has_no_rates() -> None:
    summary = summarize([])
    assert summary["acceptance_rate"] is None and summary["tokens_per_verify_pass"] is None
    assert summary["requests"] == 0 and summary["tenants"] == {}


def test_status_shows_each_replicas_batch_and_kv_blocks() -> None:
    engine = ENGINE.to_dict()
    with_engine = ReplicaInfo("verifier-a", "verifier", "127.0.0.1:1", 3, 30, engine=engine)
    without = ReplicaInfo("drafter-b", "drafter", "127.0.0.1:2", 1, 10)
    header, engine_line, plain_line = replica_lines([with_engine.to_dict(), without.to_dict()])
    assert "batch (max)" in header and "kv blocks" in header
    assert engine_line.split()[-4:-1] == ["6.50", "(16)", "200/512"]
    assert plain_line.split()[-3:-1] == ["-", "-"]  # no engine runs
    # The engine is its own columns, not one per figure among the load fields.
    assert "steps" not in header and "engine" not in header


NODE_ID = "3f9c1a2b7d4e" + "0" * 44  # a Ray node id: 28 bytes in hex


def test_status_shows_each_replicas_node_address_and_resources() -> None:
    drafter = ReplicaInfo(
        "drafter-a", "drafter", "127.0.0.1:41000", 1, 10, node_id=NODE_ID,
        resources={"tandem_drafter_node": 0.01, "accelerator_type:L4": 0.001, "GPU": 1.0},
    )  # fmt: skip
    plain = ReplicaInfo("v", "verifier", "127.0.0.1:41001", 0, 0).to_dict()
    older = {k: v for k, v in plain.items() if k not in ("node_id", "resources")}
    header, line, older_line = replica_lines([drafter.to_dict(), older])
    assert header.split()[:4] == ["replica", "side", "node", "address"]
    assert header.split()[-1] == "resources"
    # The node as its first 12 hex digits (--json has the whole id); the address in full.
    assert line.split()[:4] == ["drafter-a", "drafter", "3f9c1a2b7d4e", "127.0.0.1:41000"]
    assert line.split()[-1] == "GPU=1,accelerator_type:L4=0.001,tandem_drafter_node=0.01"
    # A replica from before nodes were reported still gets a row.
    assert older_line.split()[:4] == ["v", "verifier", "-", "127.0.0.1:41001"]
    assert older_line.split()[-1] == "-"
    # `tandem status --json` lists the registry's entries as they are: the whole node id.
    assert json.loads(json.dumps(drafter.to_dict()))["node_id"] == NODE_ID


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", ())]
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries.append(variable["definition"])
    return queries


def exported_names() -> dict[str, Metric]:
    """Every name Prometheus scrapes for a metric cluster.metrics defines, heartbeat gauges
    included (one per numeric field of today's ReplicaInfo and per engine gauge)."""
    info = ReplicaInfo("r", "verifier", "127.0.0.1:1", 0, 0, engine=EngineStats().to_dict())
    fields = replica_measurements(info.to_dict())
    metrics = [*METRICS, *(replica_gauge(f) for f in fields)]
    return {name: metric for metric in metrics for name in metric.exported()}


def test_every_dashboard_query_names_only_defined_metrics() -> None:
    known = exported_names()
    used: set[str] = set()
    for query in dashboard_queries():
        names = set(re.findall(r"\bray_[a-zA-Z0-9_]+", query))
        assert names, f"no Tandem metric in {query!r}"
        unknown = names - known.keys()
        assert not unknown, f"{query!r} names metrics cluster.metrics does not define: {unknown}"
        used |= {known[n].name for n in names}
    # And every metric is on the dashboard somewhere.
    assert used == {m.name for m in known.values()}


def test_the_dashboard_asks_for_its_prometheus_datasource() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


def test_metric_kinds_map_to_prometheus_names() -> None:
    assert REQUESTS.exported() == ("ray_tandem_requests_total",)
    assert RUNNING.exported() == ("ray_tandem_router_running_requests",)
    assert DRAFT_LATENCY.kind is Kind.HISTOGRAM
    assert DRAFT_LATENCY.exported()[0] == "ray_tandem_draft_latency_seconds_bucket"


def test_an_older_cluster_json_without_a_metrics_port_still_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ray_cluster.HOME_ENV, str(tmp_path))
    old = {"address": "127.0.0.1:1", "temp_dir": "/tmp/x", "started_by_tandem": True,
           "grpc_port": 9000, "http_port": 8000, "app_name": "tandem"}  # fmt: skip
    (tmp_path / "cluster.json").write_text(json.dumps(old))
    state = ray_cluster.load_state()
    assert state is not None and state.metrics_port is None and state.grpc_port == 9000
