"""`TandemService` without a server: proto conversions, validation, streams, cancellation."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from cluster.api.convert import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    request_from_proto,
    stats_from_proto,
    stats_to_proto,
)
from cluster.api.grpc_api import GrpcApi
from cluster.api.service import RequestCancelledError, TandemService
from cluster.api.service_config import ServiceConfig
from cluster.api.status import INTERNAL_ERROR_MESSAGE, status_of
from cluster.api.tenants import Tenants
from cluster.local import LocalTandem
from cluster.routing.request import FinishReason, GenerationRequest, SpeculationStats
from cluster.routing.router import Router
from cluster.runtime.errors import (
    InvalidArgumentError,
    ReplicaUnavailableError,
    ResourceExhaustedError,
    SessionNotFoundError,
)
from cluster.runtime.sampling_params import SamplingParams
from protos import generate_pb2, sampling_pb2
from tests.conftest import CODE_PROMPT

LIMIT = 100


CONFIG = ServiceConfig(default_draft_tokens=3, default_pipelined=False, max_tokens_limit=LIMIT)


@pytest.fixture(scope="module")
def service(local_tandem: LocalTandem) -> TandemService:
    return TandemService(
        local_tandem.router, local_tandem.tokenizer, CONFIG, tenants=Tenants.unauthenticated()
    )


@pytest.fixture(scope="module")
def lockstep_service(local_tandem: LocalTandem, lockstep: Router) -> TandemService:
    """The same service over the lockstep router (`verifier_advances` off): every token through
    a posted block, so that a seeded request's speculation counters are the same each run
    (with running sessions, whether a drafted block decides anything is timing)."""
    return TandemService(
        lockstep, local_tandem.tokenizer, CONFIG, tenants=Tenants.unauthenticated()
    )


def timing_free(stats: SpeculationStats) -> SpeculationStats:
    """`stats` without the counters that depend on when a block drafted ahead came: before
    the verdict on the block it follows (posted ahead: a pipeline hit, or a miss whose drafted
    tokens count), or after it (then rebased onto what was committed, or never sent)."""
    return dataclasses.replace(stats, num_drafted=0, pipeline_hits=0, pipeline_misses=0)


def request(
    prompt: str | Sequence[int] | None = CODE_PROMPT, **fields: Any
) -> generate_pb2.GenerateRequest:
    """A valid request (12 tokens) with `prompt` (text or ids; None: unset) and `fields`."""
    message = generate_pb2.GenerateRequest(**{"max_tokens": 12, **fields})
    if isinstance(prompt, str):
        message.text = prompt
    elif prompt is not None:
        message.token_ids.ids.extend(prompt)
        message.token_ids.SetInParent()
    return message


def assert_sessions_closed(tandem: LocalTandem) -> None:
    assert tandem.verifier.stats().num_sessions == 0
    assert tandem.drafter.stats().num_sessions == 0


def test_finish_reasons_round_trip() -> None:
    names = set()
    for reason in FinishReason:
        value = finish_reason_to_proto(reason)
        assert finish_reason_from_proto(value) is reason
        names.add(generate_pb2.FinishReason.Name(value))
    assert finish_reason_from_proto(generate_pb2.FINISH_REASON_UNSPECIFIED) is None
    # Every proto reason but UNSPECIFIED has a Python twin.
    assert names == set(generate_pb2.FinishReason.keys()) - {"FINISH_REASON_UNSPECIFIED"}


def test_stats_round_trip() -> None:
    stats = SpeculationStats(
        num_drafted=9, num_accepted=7, num_verify_passes=4, pipeline_hits=2, pipeline_misses=1,
        predraft_hits=3, predraft_misses=5,
    )  # fmt: skip
    assert stats_from_proto(stats_to_proto(stats)) == stats


def test_defaults_fill_unset_fields(service: TandemService, local_tandem: LocalTandem) -> None:
    converted, pipelined = service.reader.to_request(request_from_proto(request()))
    expected_ids = local_tandem.tokenizer.encode(CODE_PROMPT, add_special_tokens=False)
    assert converted == GenerationRequest(
        prompt_tokens=tuple(expected_ids),
        max_tokens=12,
        sampling=SamplingParams(temperature=0.0, top_k=0, top_p=1.0),
        seed=converted.seed,
        stop=(),
        draft_tokens=3,
        predraft_fan_out=0,  # ServiceConfig.default_predraft_fan_out
    )
    assert pipelined is False
    # An unset seed is a fresh random one per request (generate.proto), not a fixed default.
    seeds = {service.reader.to_request(request_from_proto(request()))[0].seed for _ in range(8)}
    assert len(seeds) > 1


def test_set_fields_are_taken_as_sent(service: TandemService) -> None:
    converted, pipelined = service.reader.to_request(
        request_from_proto(
            request(
                [5, 6, 7],
                sampling=sampling_pb2.SamplingParams(temperature=0.5, top_p=0.75, top_k=20),
                seed=2**64 - 1,
                stop=["\n\n", "def"],
                speculation=generate_pb2.SpeculationSettings(
                    draft_tokens=0, pipelined=True, predraft_fan_out=3
                ),
            )
        )
    )
    assert converted.prompt_tokens == (5, 6, 7)
    # A seeded request that names no rule follows the seed-exact rule (api.sampling_rule: auto).
    assert converted.sampling == SamplingParams(
        temperature=0.5, top_k=20, top_p=0.75, seed_exact=True
    )
    assert converted.seed == 2**64 - 1
    assert converted.stop == ("\n\n", "def")
    assert converted.draft_tokens == 0  # set to 0 is not "unset": speculation off
    assert converted.predraft_fan_out == 3
    assert pipelined is True


NAN = float("nan")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt": None}, "prompt is missing: set text or token_ids"),
        ({"prompt": ""}, "prompt text must not be empty"),
        ({"prompt": []}, "prompt token_ids must not be empty"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"max_tokens": -3}, "max_tokens must be >= 1, got -3"),
        ({"max_tokens": LIMIT + 1}, f"max_tokens must be <= {LIMIT} on this server, got 101"),
        ({"sampling": {"temperature": NAN}}, "temperature must be a finite number >= 0, got nan"),
        ({"sampling": {"temperature": -0.5}}, "temperature must be >= 0, got -0.5"),
        ({"sampling": {"top_p": 0.0}}, "top_p must satisfy 0 < top_p <= 1, got 0.0"),
        ({"sampling": {"top_p": 1.5}}, "top_p must satisfy 0 < top_p <= 1, got 1.5"),
        ({"sampling": {"top_p": NAN}}, "top_p must be a finite number"),
        ({"sampling": {"top_k": -1}}, "top_k must be >= 0 (0 = no limit), got -1"),
        ({"speculation": {"draft_tokens": 33}}, "draft_tokens must be in 0..32, got 33"),
        ({"speculation": {"draft_tokens": -1}}, "draft_tokens must be in 0..32, got -1"),
        ({"speculation": {"predraft_fan_out": 9}}, "predraft_fan_out must be in 0..8, got 9"),
        ({"speculation": {"predraft_fan_out": -1}}, "predraft_fan_out must be in 0..8, got -1"),
        ({"stop": ["ok", ""]}, "stop sequences must not be empty strings"),
        ({"stop": ["s"] * 17}, "at most 16 stop sequences, got 17"),
    ],
)
def test_bad_fields_are_invalid_arguments(
    service: TandemService, fields: dict[str, Any], message: str
) -> None:
    message_fields = request(**fields)
    with pytest.raises(InvalidArgumentError) as error:
        service.reader.to_request(request_from_proto(message_fields))
    assert message in str(error.value)
    assert status_of(error.value) == (grpc.StatusCode.INVALID_ARGUMENT, str(error.value))
    # stream() validates at once, before the first chunk is asked for.
    with pytest.raises(InvalidArgumentError):
        GrpcApi(service).stream(message_fields)


def test_out_of_vocabulary_token_is_refused(
    service: TandemService, local_tandem: LocalTandem
) -> None:
    bad = request([1, 300])
    with pytest.raises(InvalidArgumentError, match=r"\[1\] = 300 is outside the vocabulary"):
        GrpcApi(service).generate(bad)
    assert_sessions_closed(local_tandem)


def test_service_config_is_validated() -> None:
    with pytest.raises(InvalidArgumentError, match=r"default_draft_tokens must be in 0\.\.32"):
        ServiceConfig(default_draft_tokens=40)
    with pytest.raises(InvalidArgumentError, match="max_tokens_limit must be >= 1"):
        ServiceConfig(max_tokens_limit=0)
    with pytest.raises(InvalidArgumentError, match=r"default_predraft_fan_out must be in 0\.\.8"):
        ServiceConfig(default_predraft_fan_out=9)


@pytest.mark.parametrize("pipelined", [False, True])
def test_unary_equals_router_and_stream_concatenates_to_it(
    lockstep_service: TandemService, lockstep: Router, local_tandem: LocalTandem, pipelined: bool
) -> None:
    service = lockstep_service
    message = request(
        max_tokens=30,
        sampling=sampling_pb2.SamplingParams(temperature=0.9, top_k=50),
        seed=7,
        speculation=generate_pb2.SpeculationSettings(draft_tokens=4, pipelined=pipelined),
    )
    converted, _ = service.reader.to_request(request_from_proto(message))
    expected = lockstep.generate(converted, pipelined=pipelined)
    same = timing_free if pipelined else lambda stats: stats

    response = GrpcApi(service).generate(message)
    assert tuple(response.token_ids) == expected.tokens
    assert response.text == expected.text
    assert finish_reason_from_proto(response.finish_reason) is expected.finish_reason
    assert same(stats_from_proto(response.speculation)) == same(expected.stats)
    assert response.usage.prompt_tokens == len(converted.prompt_tokens)
    assert response.usage.completion_tokens == len(expected.tokens)
    assert len(response.request_id) == 32

    chunks = list(GrpcApi(service).stream(message))
    *body, last = chunks
    assert [t for c in chunks for t in c.token_ids] == list(response.token_ids)
    assert "".join(c.text for c in chunks) == response.text
    assert {c.request_id for c in chunks} == {chunks[0].request_id}
    assert chunks[0].request_id != response.request_id  # one id per request
    for chunk in body:
        assert chunk.finish_reason == generate_pb2.FINISH_REASON_UNSPECIFIED
        assert not chunk.HasField("usage") and not chunk.HasField("speculation")
    assert last.finish_reason == response.finish_reason
    assert last.usage == response.usage
    assert same(stats_from_proto(last.speculation)) == same(stats_from_proto(response.speculation))
    spec = last.speculation
    if pipelined:
        # A wholly accepted block deferred its bonus token to the block drafted after it:
        # that pass added no token of the target's own. (Whether the block after it counts
        # as a hit or a miss is timing: it may count as neither.)
        assert spec.num_accepted + spec.num_verify_passes > len(response.token_ids)
    else:
        assert spec.pipeline_hits == spec.pipeline_misses == 0
        assert spec.num_accepted + spec.num_verify_passes == len(response.token_ids)
    assert_sessions_closed(local_tandem)


def test_closing_a_stream_early_frees_the_sessions(
    service: TandemService, local_tandem: LocalTandem
) -> None:
    chunks = GrpcApi(service).stream(request(max_tokens=LIMIT))
    next(chunks)
    assert local_tandem.verifier.stats().num_sessions == 1
    # The drafter opens its session in the background while the first token comes.
    opened_by = time.monotonic() + 30
    while local_tandem.drafter.stats().num_sessions == 0 and time.monotonic() < opened_by:
        time.sleep(0.01)
    assert local_tandem.drafter.stats().num_sessions == 1
    chunks.close()
    assert_sessions_closed(local_tandem)


def test_generate_stops_once_the_caller_is_gone(
    service: TandemService, local_tandem: LocalTandem
) -> None:
    asked = 0

    def is_active() -> bool:
        nonlocal asked
        asked += 1
        return asked < 3

    with pytest.raises(RequestCancelledError) as error:
        GrpcApi(service).generate(request(max_tokens=LIMIT), is_active=is_active)
    assert asked == 3  # asked after each verify pass; stopped at the first False
    assert status_of(error.value)[0] == grpc.StatusCode.CANCELLED
    assert_sessions_closed(local_tandem)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgumentError("bad"), grpc.StatusCode.INVALID_ARGUMENT),
        (ResourceExhaustedError("full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (SessionNotFoundError("gone"), grpc.StatusCode.NOT_FOUND),
        (ReplicaUnavailableError("down"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_tandem_errors_keep_their_status_and_message(error: Exception, code: Any) -> None:
    assert status_of(error) == (code, str(error))


def test_a_limit_that_frees_up_says_when_to_retry_in_its_message_too() -> None:
    from cluster.api.client import _retry_after_s

    # A replica's refusal travels through the router and Serve's proxy, which drops trailers.
    code, message = status_of(ResourceExhaustedError("KV memory is full", retry_after_s=1.0))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert message == "KV memory is full; retry in 1.0 s"

    class Failed(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self) -> str:
            return message

        def trailing_metadata(self) -> tuple[()]:
            return ()

    assert _retry_after_s(Failed()) == 1.0
    said_once = ResourceExhaustedError(message, retry_after_s=1.0)
    assert status_of(said_once)[1] == message  # never said twice


def test_unexpected_errors_are_internal_and_never_leak(caplog: pytest.LogCaptureFixture) -> None:
    try:
        math.sqrt(-1)
    except ValueError as error:
        with caplog.at_level(logging.ERROR, logger="cluster.api.status"):
            code, message = status_of(error)
    assert (code, message) == (grpc.StatusCode.INTERNAL, INTERNAL_ERROR_MESSAGE)
    assert "math domain error" in caplog.text  # the traceback is logged, not sent
    assert "Traceback" in caplog.text
