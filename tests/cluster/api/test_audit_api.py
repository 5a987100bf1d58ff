"""The audit API and the online audit, in process on the tiny pair (fp32), without Ray.

`TandemService.audit` reports every token matched for greedy and seed-exact requests on a
healthy verifier, and mismatches with their evidence when the verifier accepts every drafted
token (`AcceptAllVerifier`); a rejection-rule request is INVALID_ARGUMENT
before anything runs. The same over real gRPC (`tests.cluster.grpc_front`), over replicas
behind their own gRPC servers (a registry pool, as the Serve ingress runs it) and over HTTP
(`POST /v1/audit`, `OpenAIHttp` driven as Serve drives it). The online audit at fraction 1
checks every finished greedy or seed-exact request and counts it in the metrics (and the
mismatches under the fault, logged with their evidence); at fraction 0 nothing runs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest

from cluster.api.audit import Served
from cluster.api.audit_config import AuditConfig
from cluster.api.caller import Caller
from cluster.api.client import TandemClient, TandemClientError, build_request
from cluster.api.grpc_api import GrpcApi
from cluster.api.online_audit import OnlineAudit
from cluster.api.openai import OpenAIService
from cluster.api.service import TandemService
from cluster.api.service_config import ServiceConfig
from cluster.api.tenants import Tenants
from cluster.config import TandemConfig
from cluster.local import LocalTandem, local_router, text_decoder
from cluster.metrics.catalog import AUDIT_CHECKED, AUDIT_DROPPED, AUDIT_MISMATCHED, REQUESTS
from cluster.metrics.recorder import TandemMetrics
from cluster.metrics.sinks import MemorySink
from cluster.routing.directory import RegistryPool
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.audit import AuditReport
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.serve.http import OpenAIHttp
from cluster.wire.replica_info import ReplicaInfo
from drafter.drafter import Drafter
from protos import generate_pb2, generate_pb2_grpc, sampling_pb2
from tests.cluster.broken_verifiers import AcceptAllVerifier
from tests.cluster.grpc_front import serve_local
from tests.cluster.serve.test_openai_http import Exchange
from tests.conftest import CODE_PROMPT, PROMPTS
from tests.replicas import serve_drafter, serve_verifier
from verifier.verifier import Verifier

MAX_TOKENS = 16
SEED = 1234


def request(prompt: str = CODE_PROMPT, **fields: Any) -> generate_pb2.GenerateRequest:
    return generate_pb2.GenerateRequest(text=prompt, **{"max_tokens": MAX_TOKENS, **fields})


def sampled(temperature: float = 0.8, **fields: Any) -> sampling_pb2.SamplingParams:
    return sampling_pb2.SamplingParams(temperature=temperature, top_k=40, **fields)


def audit_of(message: generate_pb2.GenerateRequest, dtype: str = "") -> generate_pb2.AuditRequest:
    return generate_pb2.AuditRequest(request=message, dtype=dtype)


def new_service(router: Router, tokenizer: Any, **options: Any) -> TandemService:
    return TandemService(
        router,
        tokenizer,
        ServiceConfig(default_draft_tokens=4, default_pipelined=True),
        tenants=Tenants.unauthenticated(),
        **options,
    )


@pytest.fixture(scope="module")
def sink() -> MemorySink:
    return MemorySink()


@pytest.fixture(scope="module")
def service(local_tandem: LocalTandem, sink: MemorySink) -> Iterator[TandemService]:
    service = new_service(local_tandem.router, local_tandem.tokenizer, metrics=TandemMetrics(sink))
    yield service
    service.close()


@pytest.fixture(scope="module")
def faulty_router(local_tandem: LocalTandem) -> Iterator[Router]:
    """A router over the shared drafter and a verifier that accepts every drafted token, in
    lockstep (`verifier_advances` off): every token goes through a drafted block, so drafted
    tokens decide the output (with running sessions, the tiny drafter's blocks mostly come
    after the verifier took those tokens alone, and the fault would rarely show)."""
    verifier = AcceptAllVerifier(local_tandem.target)
    router = local_router(
        verifier, local_tandem.drafter, local_tandem.target, verifier_advances=False
    )
    yield router
    router.close()
    verifier.close()


def assert_matched(response: generate_pb2.AuditResponse, rule: str, drafter: str) -> None:
    assert response.total == len(response.token_ids) > 0
    assert response.matched == response.total and response.cause == "match"
    assert not response.HasField("first_divergence") and not response.HasField("gap")
    assert (response.rule, response.drafter, response.dtype) == (rule, drafter, "float32")
    assert len(response.request_id) == 32


@pytest.mark.parametrize("prompt", PROMPTS[:4])
def test_greedy_and_seed_exact_requests_match_the_target_alone(
    service: TandemService, prompt: str
) -> None:
    assert_matched(GrpcApi(service).audit(audit_of(request(prompt))), "greedy", "drafter")
    seeded = request(prompt, sampling=sampled(), seed=SEED)
    assert_matched(GrpcApi(service).audit(audit_of(seeded)), "seed_exact", "drafter")


def test_audit_variants_match_too(service: TandemService) -> None:
    # Seed-exact named without a seed: the service picks one and replays with it.
    named = request(sampling=sampled(rule=sampling_pb2.SAMPLING_RULE_SEED_EXACT))
    assert_matched(GrpcApi(service).audit(audit_of(named)), "seed_exact", "drafter")
    # The target alone served it: no drafter.
    alone = request(speculation=generate_pb2.SpeculationSettings(draft_tokens=0))
    assert_matched(GrpcApi(service).audit(audit_of(alone)), "greedy", "none")
    # An fp32 copy of an fp32 target is the target: the same verdict.
    assert_matched(GrpcApi(service).audit(audit_of(request(), "float32")), "greedy", "drafter")
    # The served tokens are Generate's own.
    generated = GrpcApi(service).generate(request())
    audited = GrpcApi(service).audit(audit_of(request()))
    assert list(audited.token_ids) == list(generated.token_ids)


def test_a_verifier_that_accepts_every_draft_is_caught_with_evidence(
    faulty_router: Router, local_tandem: LocalTandem
) -> None:
    service = new_service(faulty_router, local_tandem.tokenizer)
    for message in (request(), request(sampling=sampled(), seed=SEED)):
        response = GrpcApi(service).audit(audit_of(message))
        assert response.cause == "divergence" and response.matched < response.total
        position = response.first_divergence
        assert response.HasField("first_divergence") and 0 <= position < response.total
        assert response.served_token == response.token_ids[position]
        assert response.served_token != response.reference_token
        assert response.HasField("gap") and response.gap >= 0
        assert response.worst_gap >= response.served_gap > 0
        assert response.drafter == "drafter" and response.dtype == "float32"
    service.close()


def test_a_rejection_rule_request_is_refused_before_it_runs(
    service: TandemService, sink: MemorySink
) -> None:
    ended = sum(v for (name, _), v in sink.counters.items() if name == REQUESTS.name)
    unseeded = request(sampling=sampled(temperature=1.0))
    with pytest.raises(InvalidArgumentError, match=r"^request\.seed: only greedy and seed-exact"):
        GrpcApi(service).audit(audit_of(unseeded))
    named = request(sampling=sampled(rule=sampling_pb2.SAMPLING_RULE_REJECTION), seed=SEED)
    with pytest.raises(InvalidArgumentError, match=r"^request\.sampling\.rule: "):
        GrpcApi(service).audit(audit_of(named))
    with pytest.raises(InvalidArgumentError, match="dtype must be one of"):
        GrpcApi(service).audit(audit_of(request(), "bfloat16"))
    with pytest.raises(InvalidArgumentError, match="max_tokens"):
        GrpcApi(service).audit(audit_of(request(max_tokens=0)))
    assert sum(v for (name, _), v in sink.counters.items() if name == REQUESTS.name) == ended


def test_audit_over_grpc(service: TandemService) -> None:
    server, port = serve_local(service)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = generate_pb2_grpc.TandemStub(channel)
            response = stub.Audit(audit_of(request(sampling=sampled(), seed=SEED)), timeout=60)
            assert_matched(response, "seed_exact", "drafter")
            with pytest.raises(grpc.RpcError) as refused:
                stub.Audit(audit_of(request(sampling=sampled())), timeout=60)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request.seed" in (refused.value.details() or "")
    finally:
        server.stop(None)


def test_the_client_audits_a_request_and_reports_its_refusals(service: TandemService) -> None:
    server, port = serve_local(service)
    try:
        with TandemClient(f"127.0.0.1:{port}") as client:
            message = build_request(CODE_PROMPT, max_tokens=12, temperature=0.8, seed=SEED)
            assert_matched(client.audit_request(message), "seed_exact", "drafter")
            greedy = build_request(CODE_PROMPT, max_tokens=12)
            assert_matched(client.audit_request(greedy, dtype="float32"), "greedy", "drafter")
            with pytest.raises(TandemClientError) as refused:
                client.audit_request(build_request(CODE_PROMPT, max_tokens=12, temperature=0.8))
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        server.stop(None)


def test_audit_over_replicas_on_grpc_within_a_deadline(
    local_tandem: LocalTandem, tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> None:
    """The distributed path: replicas behind their own gRPC servers, pinned from a registry
    pool over bounded clients; the API's audit and the online audit both reach the verifier's
    Reference RPC."""
    verifier, drafter = Verifier(tiny_target), Drafter(tiny_draft)
    (verifier_server, verifier_port), (drafter_server, drafter_port) = (
        serve_verifier(verifier),
        serve_drafter(drafter),
    )
    entries = [
        ReplicaInfo("verifier-0", "verifier", f"127.0.0.1:{verifier_port}", 0, 0).to_dict(),
        ReplicaInfo("drafter-0", "drafter", f"127.0.0.1:{drafter_port}", 0, 0).to_dict(),
    ]
    pool = RegistryPool(lambda: entries, refresh_s=0.0, rpc_timeout_s=60)
    decode = text_decoder(local_tandem.tokenizer)
    router = Router.over_pool(pool, decode, local_tandem.target.eos_token_ids)
    sink = MemorySink()
    service = new_service(
        router, local_tandem.tokenizer, metrics=TandemMetrics(sink), audit=AuditConfig(1.0)
    )
    try:
        caller = Caller(deadline=time.monotonic() + 60)
        response = GrpcApi(service).audit(audit_of(request(sampling=sampled(), seed=SEED)), caller)
        assert_matched(response, "seed_exact", "drafter-0")
        assert service.online_audit.wait_idle(60)
        key = (("cause", "match"), ("dtype", "float32"), ("rule", "seed_exact"))
        assert counted(sink, AUDIT_CHECKED) == {key: 1}  # the same request, audited online too
        assert pool.pinned_counts() == {}
    finally:
        service.close()
        router.close()
        pool.close()
        verifier_server.stop(None)
        drafter_server.stop(None)
        verifier.close()
        drafter.close()


@pytest.fixture(scope="module")
def http(service: TandemService) -> Iterator[OpenAIHttp]:
    with ThreadPoolExecutor(4) as threads:
        yield OpenAIHttp(OpenAIService(service, "tiny"), threads)


def post_audit(adapter: OpenAIHttp, body: dict[str, Any]) -> Exchange:
    done = Exchange("POST", "/v1/audit", body)
    asyncio.run(done.run(adapter))
    return done


def test_post_v1_audit_answers_the_report_as_json(http: OpenAIHttp) -> None:
    body = {"model": "tiny", "prompt": CODE_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    greedy = post_audit(http, body)
    assert greedy.status == 200, greedy.content
    report = greedy.json()
    assert report["object"] == "audit" and report["cause"] == "match" and report["ok"] is True
    assert report["matched"] == report["total"] == len(report["token_ids"]) > 0
    assert report["first_divergence"] is None and report["rule"] == "greedy"
    assert report["dtype"] == "float32" and report["drafter"] == "drafter"
    seeded = post_audit(http, {**body, "temperature": 0.8, "seed": SEED, "audit_dtype": "float32"})
    assert seeded.status == 200 and seeded.json()["rule"] == "seed_exact"
    assert seeded.json()["cause"] == "match"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": 1.0}, "seed"),  # OpenAI's default temperature, no seed
        ({"temperature": 1.0, "seed": 3, "sampling_rule": "rejection"}, "sampling_rule"),
        ({"temperature": 0, "audit_dtype": "bf16"}, "audit_dtype"),
        ({"temperature": 0, "audit_dtype": 32}, "audit_dtype"),
        ({"temperature": 0, "stream": True}, "stream"),
        ({"temperature": 0, "max_tokens": 0}, "max_tokens"),
    ],
)
def test_post_v1_audit_errors_name_the_field(
    http: OpenAIHttp, extra: dict[str, Any], param: str
) -> None:
    done = post_audit(http, {"model": "tiny", "prompt": "x", "max_tokens": 8, **extra})
    assert done.status == 400, done.content
    assert done.json()["error"]["param"] == param


# --- the online audit --------------------------------------------------------------------------


def counted(sink: MemorySink, metric: Any) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: v for (name, labels), v in sink.counters.items() if name == metric.name}


def test_fraction_1_audits_every_finished_greedy_or_seed_exact_request(
    local_tandem: LocalTandem,
) -> None:
    sink = MemorySink()
    service = new_service(
        local_tandem.router,
        local_tandem.tokenizer,
        metrics=TandemMetrics(sink),
        audit=AuditConfig(fraction=1.0),
    )
    try:
        for prompt in PROMPTS[:3]:
            GrpcApi(service).generate(request(prompt))
        GrpcApi(service).generate(request(sampling=sampled(), seed=SEED))
        GrpcApi(service).generate(request(sampling=sampled()))  # the rejection rule: not replayable
        assert service.online_audit.wait_idle(60)
        labels = (("cause", "match"), ("dtype", "float32"))
        assert counted(sink, AUDIT_CHECKED) == {
            (*labels, ("rule", "greedy")): 3,
            (*labels, ("rule", "seed_exact")): 1,
        }
        assert counted(sink, AUDIT_MISMATCHED) == {} and counted(sink, AUDIT_DROPPED) == {}
    finally:
        service.close()
    assert not any(t.name == "online-audit" for t in threading.enumerate())


def test_the_online_audit_counts_and_logs_mismatches(
    faulty_router: Router, local_tandem: LocalTandem, caplog: pytest.LogCaptureFixture
) -> None:
    sink = MemorySink()
    service = new_service(
        faulty_router,
        local_tandem.tokenizer,
        metrics=TandemMetrics(sink),
        audit=AuditConfig(fraction=1.0),
    )
    try:
        with caplog.at_level(logging.WARNING, logger="cluster.api.online_audit"):
            response = GrpcApi(service).generate(request())
            assert service.online_audit.wait_idle(60)
    finally:
        service.close()
    key = (("cause", "divergence"), ("dtype", "float32"), ("rule", "greedy"))
    assert counted(sink, AUDIT_CHECKED) == {key: 1}
    assert counted(sink, AUDIT_MISMATCHED) == {key: 1}
    [record] = [r for r in caplog.records if "audit mismatch" in r.getMessage()]
    message = record.getMessage()
    assert record.levelno == logging.WARNING and response.request_id in message
    assert "rule greedy" in message and "dtype float32" in message
    assert "first at position" in message and "top-2 gap" in message


def test_fraction_0_audits_nothing(local_tandem: LocalTandem) -> None:
    sink = MemorySink()
    service = new_service(local_tandem.router, local_tandem.tokenizer, metrics=TandemMetrics(sink))
    assert not service.online_audit.enabled
    assert not any(t.name == "online-audit" for t in threading.enumerate())
    GrpcApi(service).generate(request())
    assert counted(sink, AUDIT_CHECKED) == {} and counted(sink, AUDIT_DROPPED) == {}
    service.close()


def served(seed: int = 0, temperature: float = 0.0, seed_exact: bool = False) -> Served:
    sampling = SamplingParams(temperature=temperature, seed_exact=seed_exact)
    return Served("r", GenerationRequest((1, 2), 4, sampling, seed), (3, 4), "drafter")


def report(rule: str = "greedy") -> AuditReport:
    return AuditReport(2, 2, None, None, None, None, rule, "drafter", "float32")


def test_a_full_queue_drops_and_counts_and_a_failed_audit_is_counted() -> None:
    sink = MemorySink()
    release = threading.Event()
    calls: list[Served] = []

    def check(item: Served) -> AuditReport:
        calls.append(item)
        release.wait(10)
        if item.request.seed == 2:
            raise RuntimeError("the verifier went away")
        return report()

    audit = OnlineAudit(AuditConfig(fraction=1.0, max_pending=1), check, TandemMetrics(sink))
    try:
        assert audit.offer(served(seed=1))  # taken by the worker...
        wait = threading.Event()
        while not calls:
            wait.wait(0.01)
        assert audit.offer(served(seed=2))  # ...this one waits...
        assert not audit.offer(served(seed=3))  # ...and this one finds the queue full
        assert not audit.offer(served(temperature=1.0))  # rejection rule: never drawn
        release.set()
        assert audit.wait_idle(10)
    finally:
        audit.close()
    assert counted(sink, AUDIT_DROPPED) == {
        (("reason", "queue_full"),): 1,
        (("reason", "failed"),): 1,
    }
    assert counted(sink, AUDIT_CHECKED) == {
        (("cause", "match"), ("dtype", "float32"), ("rule", "greedy")): 1
    }
    assert not audit.offer(served())  # closed


def test_an_audit_is_not_bound_by_its_requests_deadline() -> None:
    seen: list[Served] = []
    audit = OnlineAudit(
        AuditConfig(fraction=1.0),
        lambda item: seen.append(item) or report(),  # type: ignore[func-returns-value]
        TandemMetrics(MemorySink()),
    )
    try:
        item = served()
        assert audit.offer(dataclasses.replace(item, request=replace_deadline(item, 1.0)))
        assert audit.wait_idle(10)
    finally:
        audit.close()
    assert [s.request.deadline for s in seen] == [None] and seen[0].tokens == item.tokens


def replace_deadline(item: Served, deadline: float) -> GenerationRequest:
    return dataclasses.replace(item.request, deadline=deadline)


def test_the_draws_follow_the_explicit_generator() -> None:
    checked: list[int] = []
    audit = OnlineAudit(
        AuditConfig(fraction=0.25, max_pending=1000),
        lambda item: checked.append(item.request.seed) or report(),  # type: ignore[func-returns-value]
        TandemMetrics(MemorySink()),
        rng=random.Random(7),
    )
    try:
        taken = [audit.offer(served(seed=i, temperature=0.5, seed_exact=True)) for i in range(400)]
        assert audit.wait_idle(10)
    finally:
        audit.close()
    expected_rng = random.Random(7)
    expected = [expected_rng.random() < 0.25 for _ in range(400)]
    assert taken == expected and sorted(checked) == [i for i, t in enumerate(taken) if t]
    assert 60 < sum(taken) < 140


def test_the_audit_config_parses_and_checks_its_values() -> None:
    config = TandemConfig.from_dict(
        {"audit": {"fraction": 0.01, "dtype": "float32", "max_pending": 8}}
    )
    assert config.audit == AuditConfig(fraction=0.01, dtype="float32", max_pending=8)
    assert TandemConfig().audit.fraction == 0.0
    assert TandemConfig.from_dict({"audit": {"fraction": 1}}).audit.fraction == 1.0
    bad = [
        ({"fraction": 1.5}, r"^audit: fraction must be in \[0, 1\]"),
        ({"fraction": math.nan}, r"fraction must be in \[0, 1\]"),
        ({"fraction": "0.1"}, r"^audit\.fraction must be a number"),
        ({"dtype": "bfloat16"}, r"^audit: dtype must be one of"),
        ({"max_pending": 0}, r"^audit: max_pending must be >= 1"),
        ({"fractoin": 0.1}, r"^audit\.fractoin: unknown key"),
    ]
    for data, message in bad:
        with pytest.raises(InvalidArgumentError, match=message):
            TandemConfig.from_dict({"audit": data})
