"""A client that goes away frees its request on both sides within a second.

Through the session's service (tests/cluster/conftest.py) at its second door (`proxy_address`:
Serve's gRPC proxy, the router ingress, two drafter and two verifier replicas, a suffix drafter;
test_front covers the default door, the routers' own server), as a tenant kept out of the
suffix index (TENANT_KEY): a stream the client leaves after a few chunks, and a unary
Generate whose client deadline runs out, as gRPC's deadline alone (the proxy cancels the
call; the router learns nothing else) and as the shipped client sends it (also in the
metadata, so the router ends the request itself, and each replica was told the time left).
Once the client's call has ended, every replica must hold no session and no KV block within
RELEASE_S, read from each replica's Stats RPC (exact, no heartbeat lag), polled.

Why a second is safe: the router finishes the round in flight (one tiny-model pass,
milliseconds), then closes both sessions, one loopback call each, which frees their blocks;
measured here, both sides were free 30 to 70 ms after the client's call ended. Without that
close, a stream's or a gRPC-deadline call's sessions stay until the replicas' idle TTL (600
s). The shipped client's sessions also have a time limit on each replica, the time left plus
a grace (`TIME_LIMIT_GRACE_S`, 2 s) past which the replica's sweep drops them itself: a
backstop for a router that died. So that the test cannot pass by the backstop, each case also
asserts that no replica dropped a session at its time limit meanwhile (`sessions_expired` in
each replica's Stats, unchanged).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from cluster.api.client import TandemClient, TandemClientError
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from protos import generate_pb2, generate_pb2_grpc
from tests.cluster.conftest import TENANT_KEYS, live_replicas
from tests.conftest import CODE_PROMPT
from tests.polling import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

RELEASE_S = 1.0
"""How soon after the client's call ends both sides must hold nothing (the bound asserted)."""
LONG_MAX_TOKENS = 1900
"""Seconds of generation from CODE_PROMPT (greedy, no end-of-sequence this early): the request
is still running when the client goes."""
DEADLINE_S = 2.0
CHUNKS_READ = 3
POLL_S = 0.01

TENANT_KEY = TENANT_KEYS["private"]
"""A tenant kept out of the suffix index: after the earlier tests' requests, the suffix drafter
would draft CODE_PROMPT's answer whole, and LONG_MAX_TOKENS would end within DEADLINE_S."""
MODEL_SIDES = {"drafter", "verifier"}
"""The sides that hold the tenant's running request (never the suffix drafter: see TENANT_KEY)."""
Held = dict[str, tuple[int, int]]
"""(sessions, KV blocks in use) per replica id."""


def holds_any(held: Held) -> bool:
    return any(sessions or blocks for sessions, blocks in held.values())


class Replicas:
    """Stats clients of every live replica, kept open so that a poll is one call each."""

    def __init__(self, service: dict[str, object]) -> None:
        self._ports: dict[str, GrpcDrafter | GrpcVerifier] = {}
        self.sides: dict[str, str] = {}
        for replica in live_replicas(service):
            replica_id, side = str(replica["replica_id"]), str(replica["side"])
            kind = GrpcVerifier if side == "verifier" else GrpcDrafter
            self._ports[replica_id] = kind(
                str(replica["address"]), timeout_s=10, secret=str(service["secret"])
            )
            self.sides[replica_id] = side

    def held(self) -> Held:
        held = {}
        for replica_id, port in self._ports.items():
            stats = port.stats()
            if self.sides[replica_id] == "suffix":  # an index, no KV cache: sessions only
                assert stats.engine is None
                held[replica_id] = (stats.num_sessions, 0)
                continue
            assert stats.engine is not None  # every model replica runs a batching engine
            held[replica_id] = (stats.num_sessions, stats.engine.kv_blocks_used)
        return held

    def expired(self) -> dict[str, int]:
        """Sessions each replica has dropped at their time limit since it started."""
        return {
            replica_id: port.stats().sessions_expired for replica_id, port in self._ports.items()
        }

    def holding_sides(self) -> set[str]:
        """The sides with a replica that holds a session (and KV blocks, if it has a cache)."""
        return {
            self.sides[r]
            for r, (sessions, blocks) in self.held().items()
            if sessions and (blocks or self.sides[r] == "suffix")
        }

    def close(self) -> None:
        for port in self._ports.values():
            port.close()


@pytest.fixture(scope="module")
def stats_clients(service: dict[str, object]) -> Iterator[Replicas]:
    ports = Replicas(service)
    yield ports
    ports.close()


@pytest.fixture
def replicas(stats_clients: Replicas) -> Replicas:
    """Every live replica, once none holds anything (an earlier request may still be closing)."""
    wait_until(lambda: not holds_any(stats_clients.held()), what="no session before the test")
    return stats_clients


def released_within(replicas: Replicas, ended: float) -> tuple[float, Held]:
    """Poll until no replica holds anything or RELEASE_S has passed since `ended`; the time
    it took (since `ended`) and what was held at the last reading."""
    while True:
        held = replicas.held()
        elapsed = time.monotonic() - ended
        if not holds_any(held) or elapsed > RELEASE_S:
            return elapsed, held
        time.sleep(POLL_S)


def assert_released(replicas: Replicas, ended: float, expired_before: dict[str, int]) -> None:
    """Nothing held within RELEASE_S of `ended`, and freed by the router's close: no replica
    dropped a session at its time limit since `expired_before` was read."""
    elapsed, held = released_within(replicas, ended)
    print(f"{elapsed:.3f} s after the client's call ended, (sessions, KV blocks): {held}")
    assert not holds_any(held), f"still held after {elapsed:.2f} s: {held}"
    expired_after = replicas.expired()
    assert expired_after == expired_before, (
        f"a replica dropped a session at its time limit: {expired_before} -> {expired_after}"
    )


def test_leaving_a_stream_frees_both_sides_within_a_second(
    service: dict[str, object], replicas: Replicas
) -> None:
    expired_before = replicas.expired()
    with TandemClient(str(service["proxy_address"]), api_key=TENANT_KEY) as client:
        chunks = client.stream(CODE_PROMPT, max_tokens=LONG_MAX_TOKENS)
        for _ in range(CHUNKS_READ):
            assert next(chunks).finish_reason is None
        # The request is mid-stream: its drafter and its verifier both hold it.
        wait_until(lambda: replicas.holding_sides() == MODEL_SIDES, what="sessions")
        chunks.close()  # cancels the call, as leaving the loop does
        ended = time.monotonic()
    assert_released(replicas, ended, expired_before)


def grpc_deadline_only(service: dict[str, object]) -> None:
    """Generate with a gRPC deadline and no deadline metadata: only the proxy knows it."""
    with grpc.insecure_channel(str(service["proxy_address"])) as channel:
        request = generate_pb2.GenerateRequest(text=CODE_PROMPT, max_tokens=LONG_MAX_TOKENS)
        auth = [("authorization", f"Bearer {TENANT_KEY}")]
        try:
            generate_pb2_grpc.TandemStub(channel).Generate(
                request, timeout=DEADLINE_S, metadata=auth
            )
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED, error
            return
    raise AssertionError("the request finished before its deadline")


def shipped_client(service: dict[str, object]) -> None:
    """Generate with the shipped client's timeout: a gRPC deadline and the same in metadata."""
    address, key = str(service["proxy_address"]), TENANT_KEY
    with (
        TandemClient(address, timeout_s=DEADLINE_S, api_key=key) as client,
        pytest.raises(TandemClientError) as error,
    ):
        client.generate(CODE_PROMPT, max_tokens=LONG_MAX_TOKENS)
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, error.value.message


@pytest.mark.parametrize("call", [grpc_deadline_only, shipped_client], ids=lambda f: f.__name__)
def test_a_unary_call_past_its_client_deadline_frees_both_sides_within_a_second(
    service: dict[str, object], replicas: Replicas, call: Callable[[dict[str, object]], None]
) -> None:
    outcome: list[BaseException | float] = []
    expired_before = replicas.expired()

    def run() -> None:
        try:
            call(service)
            outcome.append(time.monotonic())
        except BaseException as error:  # re-raised on the test's thread
            outcome.append(error)

    caller = threading.Thread(target=run)
    caller.start()
    try:
        # The request runs on both sides before its deadline passes.
        wait_until(lambda: replicas.holding_sides() == MODEL_SIDES, what="sessions")
    finally:
        caller.join()
    (ended,) = outcome
    if isinstance(ended, BaseException):
        raise ended
    assert_released(replicas, ended, expired_before)
