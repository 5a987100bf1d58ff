"""Client deadlines on the shipped path: Serve's gRPC proxy -> `RouterIngress`.

The proxy hands the ingress the client's metadata but not its gRPC deadline, so a client states
its deadline as `x-tandem-deadline-ms` metadata (what `TandemClient` sends with a timeout). The
ray tests run on the session's service (tests/cluster/conftest.py) and send the metadata with
no gRPC timeout, so a DEADLINE_EXCEEDED there can only be the server's; they call the service's
second door, Serve's gRPC proxy (`proxy_address`), where the metadata is what carries the
deadline (the routers' own server, the default door, gets the gRPC deadline itself).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from cluster.api.caller import Caller
from cluster.api.client import DEADLINE_METADATA_KEY as CLIENT_KEY
from cluster.api.client import TandemClient, TandemClientError, _timed
from cluster.api.grpc_api import GrpcApi
from cluster.api.service import TandemService
from cluster.api.status import status_of
from cluster.api.tenants import Tenants
from cluster.local import LocalTandem
from cluster.runtime.errors import DeadlineExceededError, InvalidArgumentError
from cluster.serve.calls import DEADLINE_METADATA_KEY, deadline_of
from cluster.serve.ingress import _caller
from protos import generate_pb2
from tests.cluster.conftest import (
    TENANT_KEYS,
    live_replicas,
    replica_sessions,
    wait_until_no_sessions,
)
from tests.conftest import CODE_PROMPT

LONG_MAX_TOKENS = 1900
"""The tiny target's greedy run from CODE_PROMPT goes this far without an end-of-sequence:
seconds of rounds with the target alone, far beyond the deadlines below."""
SHORT_DEADLINE_MS = 1000


class Context:
    """What the ingress reads off Serve's `RayServegRPCContext`: the invocation metadata."""

    def __init__(self, metadata: list[tuple[str, str]]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> list[tuple[str, str]]:
        return self._metadata


# --- the metadata, without a cluster --------------------------------------------------------------


def test_the_deadline_metadata_is_milliseconds_left_from_arrival() -> None:
    assert CLIENT_KEY == DEADLINE_METADATA_KEY  # the client and the ingress agree
    now = lambda: 100.0  # noqa: E731
    assert deadline_of([], now) is None
    assert deadline_of([("authorization", "Bearer k")], now) is None
    assert deadline_of([(DEADLINE_METADATA_KEY, "1500")], now) == 101.5
    assert deadline_of([(DEADLINE_METADATA_KEY, " 0 ")], now) == 100.0
    assert deadline_of([(DEADLINE_METADATA_KEY, "-20")], now) == pytest.approx(99.98)
    for bad in ("1.5", "soon", ""):
        with pytest.raises(InvalidArgumentError, match=f"{DEADLINE_METADATA_KEY} metadata"):
            deadline_of([(DEADLINE_METADATA_KEY, bad)], now)


def test_a_call_s_caller_is_its_key_and_the_deadline_its_metadata_states() -> None:
    """As on the router's own server, where every call has its gRPC deadline (Cancel and
    GetUsage have nothing to bound with it)."""
    context = Context([("authorization", "Bearer k"), (DEADLINE_METADATA_KEY, "5000")])
    caller = _caller(context)
    assert caller.authorization == "Bearer k" and caller.deadline is not None
    assert _caller(Context([("authorization", "Bearer k")])) == Caller("Bearer k")
    assert _caller(None) == Caller()


def test_the_client_sends_its_timeout_as_the_deadline_metadata() -> None:
    base = (("authorization", "Bearer k"),)
    assert _timed(base, None) == base
    assert _timed(base, 2.5) == (*base, (DEADLINE_METADATA_KEY, "2500"))
    assert _timed(base, 0.0019) == (*base, (DEADLINE_METADATA_KEY, "1"))  # rounded down


def test_a_deadline_already_passed_runs_nothing(local_tandem: LocalTandem) -> None:
    service = TandemService(
        local_tandem.router, local_tandem.tokenizer, tenants=Tenants.unauthenticated()
    )
    message = generate_pb2.GenerateRequest(text=CODE_PROMPT, max_tokens=8)
    past = _caller(Context([(DEADLINE_METADATA_KEY, "0")]))
    with pytest.raises(DeadlineExceededError, match="had passed when it arrived") as error:
        GrpcApi(service).stream(message, past)
    assert status_of(error.value)[0] == grpc.StatusCode.DEADLINE_EXCEEDED
    assert GrpcApi(service).usage().requests == 0  # never admitted
    assert local_tandem.verifier.stats().num_sessions == 0


# --- through the real service --------------------------------------------------------------------


@pytest.fixture
def timed_client(service: dict[str, object]) -> Iterator[Any]:
    """A client whose calls carry `ms` of deadline in the metadata and no gRPC timeout."""

    def make(ms: str) -> TandemClient:
        return TandemClient(
            str(service["proxy_address"]),
            api_key=TENANT_KEYS["main"],
            metadata=[(DEADLINE_METADATA_KEY, ms)],
        )

    yield make


def _failure(call: Any) -> TandemClientError:
    with pytest.raises(TandemClientError) as error:
        call()
    return error.value


@pytest.mark.ray
@pytest.mark.slow
def test_a_stream_past_its_deadline_ends_deadline_exceeded_and_frees_both_sessions(
    service: dict[str, object], timed_client: Any
) -> None:
    received: list[int] = []

    def stream() -> None:
        with timed_client(str(SHORT_DEADLINE_MS)) as client:
            chunks = client.stream(CODE_PROMPT, max_tokens=LONG_MAX_TOKENS, draft_tokens=0)
            for chunk in chunks:
                received.extend(chunk.tokens)

    error = _failure(stream)
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED, error.message
    assert "deadline passed" in error.message  # the router's words, not a transport timeout
    assert len(received) < LONG_MAX_TOKENS
    assert not any(wait_until_no_sessions(service).values())


@pytest.mark.ray
@pytest.mark.slow
def test_the_shipped_client_timeout_ends_the_request_on_the_server(
    service: dict[str, object],
) -> None:
    address = str(service["proxy_address"])
    # The private tenant: the suffix drafter never drafts CODE_PROMPT's earlier answers for
    # it, so the request is still running when its second is up.
    with TandemClient(
        address, timeout_s=SHORT_DEADLINE_MS / 1000, api_key=TENANT_KEYS["private"]
    ) as c:
        error = _failure(
            lambda: c.generate(CODE_PROMPT, max_tokens=LONG_MAX_TOKENS, draft_tokens=2)
        )
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED, error.message
    assert not any(wait_until_no_sessions(service).values())


@pytest.mark.ray
@pytest.mark.slow
def test_a_deadline_already_passed_opens_no_session(
    service: dict[str, object], timed_client: Any
) -> None:
    proxy = str(service["proxy_address"])
    with TandemClient(proxy, timeout_s=60, api_key=TENANT_KEYS["main"]) as c:
        before = c.usage()
        for ms in ("0", "-250"):
            with timed_client(ms) as client:
                for call in (
                    lambda: client.generate(CODE_PROMPT, max_tokens=LONG_MAX_TOKENS),
                    lambda: list(client.stream(CODE_PROMPT, max_tokens=LONG_MAX_TOKENS)),
                ):
                    error = _failure(call)
                    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED, error.message
                    assert "had passed when it arrived: nothing was run" in error.message
        with timed_client("soon") as client:
            error = _failure(lambda: client.generate(CODE_PROMPT, max_tokens=4))
            assert error.code == grpc.StatusCode.INVALID_ARGUMENT
            assert DEADLINE_METADATA_KEY in error.message
        after = c.usage()
    # Never admitted: no request counted, no prompt read, no session on any replica.
    for counter in ("requests", "prompt_tokens", "generated_tokens"):
        assert after[counter] == before[counter], (before, after)
    assert not any(replica_sessions(service, live_replicas(service)).values())
