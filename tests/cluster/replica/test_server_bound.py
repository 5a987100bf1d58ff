"""A replica server holds at most `max_concurrent_rpcs` calls; one more is answered
RESOURCE_EXHAUSTED at once, which a replica client raises as `ResourceExhaustedError`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import grpc
import pytest

from cluster.replica.rpc import start_server
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.runtime.errors import ResourceExhaustedError
from protos import replica_pb2, replica_pb2_grpc

WAIT_S = 30.0
"""Upper bound on waits that end as soon as the server acts; never reached when it works."""


class HeldStats(replica_pb2_grpc.VerifierServicer):
    """Answers Stats only once `release` is set, so the test decides how long a call runs."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def Stats(
        self, request: replica_pb2.StatsRequest, context: grpc.ServicerContext
    ) -> replica_pb2.ReplicaStats:
        self.entered.set()
        self.release.wait(WAIT_S)
        return replica_pb2.ReplicaStats(num_sessions=7)


@pytest.fixture
def held() -> Iterator[tuple[HeldStats, str]]:
    servicer = HeldStats()
    server, port = start_server(
        lambda server: replica_pb2_grpc.add_VerifierServicer_to_server(servicer, server),
        max_workers=4,
        max_concurrent_rpcs=1,
    )
    yield servicer, f"127.0.0.1:{port}"
    servicer.release.set()
    server.stop(None)


def test_a_call_beyond_the_bound_is_refused_while_the_first_runs(
    held: tuple[HeldStats, str],
) -> None:
    servicer, address = held
    with GrpcVerifier(address, timeout_s=WAIT_S) as client, ThreadPoolExecutor(1) as pool:
        first: Future[int] = pool.submit(lambda: client.stats().num_sessions)
        assert servicer.entered.wait(WAIT_S)
        # Workers are free (4), so only the bound can refuse it.
        with pytest.raises(ResourceExhaustedError):
            client.stats()
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as caught:
            replica_pb2_grpc.VerifierStub(channel).Stats(replica_pb2.StatsRequest(), timeout=WAIT_S)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        servicer.release.set()
        assert first.result(WAIT_S) == 7
        assert client.stats().num_sessions == 7  # the place is free again


def test_the_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_concurrent_rpcs must be >= 1"):
        start_server(lambda server: None, max_concurrent_rpcs=0)
