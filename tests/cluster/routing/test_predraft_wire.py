"""Outcome-keyed pre-drafting over the replicas' gRPC data plane.

Real loopback servers (a drafter and a verifier over the tiny pair) and a router driving them
through `GrpcDrafter` / `GrpcVerifier` over their Frames streams: greedy output with
pre-drafting on is the target's alone and branches really are drafted, a stream closed midway
leaves nothing on the drafter, and a bad pre-draft entry fails alone. The routers run in
lockstep (`verifier_advances` off): with running verifier sessions the tiny drafter's blocks
mostly come after the verifier took their tokens alone, so pre-drafted branches would rarely
be verified. The codec's round trips are tests/cluster/wire/test_frame_codec.py's.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from cluster.local import LocalTandem, text_decoder
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.ports import PredraftPort
from cluster.routing.request import GenerationRequest, SpeculationStats
from cluster.routing.router import Router
from cluster.routing.waits import run
from cluster.runtime.errors import InvalidArgumentError, ReplicaUnavailableError
from cluster.runtime.models import LoadedModel
from cluster.runtime.predraft import Branch
from cluster.runtime.sampling_params import SamplingParams
from cluster.wire import requests
from drafter.drafter import Drafter
from drafter.servicer import DrafterServicer
from protos import replica_pb2, replica_pb2_grpc
from tests.conftest import CODE_PROMPT, PROMPTS
from tests.replicas import serve_drafter, serve_replica, serve_verifier
from verifier.verifier import Verifier

MAX_TOKENS = 24
GREEDY = SamplingParams()
TWO_PROMPTS = (PROMPTS[0], PROMPTS[2])


@dataclass
class Replicas:
    """The two servers' addresses and the drafter they serve."""

    drafter: Drafter
    drafter_address: str
    verifier_address: str


@pytest.fixture(scope="module")
def replicas(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> Iterator[Replicas]:
    drafter = Drafter(tiny_draft)
    drafter_server, drafter_port = serve_drafter(drafter)
    verifier_server, verifier_port = serve_verifier(Verifier(tiny_target))
    yield Replicas(drafter, f"127.0.0.1:{drafter_port}", f"127.0.0.1:{verifier_port}")
    drafter_server.stop(None)
    verifier_server.stop(None)


@pytest.fixture(scope="module")
def clients(replicas: Replicas) -> Iterator[tuple[GrpcDrafter, GrpcVerifier]]:
    drafter = GrpcDrafter(replicas.drafter_address, timeout_s=30.0)
    verifier = GrpcVerifier(replicas.verifier_address, timeout_s=30.0)
    yield drafter, verifier
    drafter.close()
    verifier.close()


def predrafting_router(
    clients: tuple[GrpcDrafter, GrpcVerifier], tiny_target: LoadedModel, fan_out: int
) -> Router:
    drafter, verifier = clients
    return Router(
        verifier, drafter, text_decoder(tiny_target.tokenizer), tiny_target.eos_token_ids,
        pipelined=True, predraft_fan_out=fan_out, verifier_advances=False,
    )  # fmt: skip


def encode(tandem: LocalTandem, text: str) -> tuple[int, ...]:
    return tuple(tandem.tokenizer.encode(text, add_special_tokens=False))


def wait_for_no_branch(drafter: Drafter) -> None:
    """A branch still drafting when its session closed releases its fork as it ends."""
    drafter.engine.call(lambda: None)  # after every task queued before it
    deadline = time.monotonic() + 10
    while drafter._runner.sequences() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert drafter._runner.sequences() == ()


@pytest.mark.parametrize("draft_tokens", [1, 4, 8])
@pytest.mark.parametrize("fan_out", [1, 3, 8])
def test_greedy_with_predrafting_over_grpc_equals_the_target_alone(
    replicas: Replicas,
    clients: tuple[GrpcDrafter, GrpcVerifier],
    tiny_target: LoadedModel,
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    fan_out: int,
    draft_tokens: int,
) -> None:
    router = predrafting_router(clients, tiny_target, fan_out)
    total = SpeculationStats()
    try:
        for prompt in TWO_PROMPTS:
            request = GenerationRequest(
                encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=draft_tokens,
                predraft_fan_out=fan_out,
            )  # fmt: skip
            result = router.generate(request, pipelined=True)
            assert result.tokens == target_only[prompt][:MAX_TOKENS], prompt
            total.predraft_hits += result.stats.predraft_hits
            total.predraft_misses += result.stats.predraft_misses
    finally:
        router.close()
    assert total.predraft_hits + total.predraft_misses > 0  # the drafter really pre-drafted
    if fan_out >= 3:  # and branches came back over the wire to be verified
        assert total.predraft_hits > 0
    drafter, verifier = clients
    assert drafter.stats().num_sessions == 0 and verifier.stats().num_sessions == 0
    wait_for_no_branch(replicas.drafter)


def test_closing_a_predrafting_stream_over_grpc_leaves_no_session_or_branch(
    replicas: Replicas,
    clients: tuple[GrpcDrafter, GrpcVerifier],
    tiny_target: LoadedModel,
    local_tandem: LocalTandem,
) -> None:
    router = predrafting_router(clients, tiny_target, 6)
    stats = SpeculationStats()
    try:
        request = GenerationRequest(
            encode(local_tandem, CODE_PROMPT), 60, draft_tokens=4, predraft_fan_out=6
        )
        stream = router.stream(request, stats, pipelined=True)
        for _ in range(3):  # past the opening round, into pre-drafted ones
            next(stream)
        stream.close()
    finally:
        router.close()
    assert stats.predraft_hits + stats.predraft_misses > 0
    drafter, verifier = clients
    assert drafter.stats().num_sessions == 0 and verifier.stats().num_sessions == 0
    wait_for_no_branch(replicas.drafter)


def test_a_bounded_client_predrafts_as_the_drafter_itself_does(
    replicas: Replicas, clients: tuple[GrpcDrafter, GrpcVerifier]
) -> None:
    drafter = clients[0]
    view: PredraftPort = drafter.bounded(time.monotonic() + 30)
    branches = [Branch(0, 0), Branch(2, 0), Branch(1, 1)]
    for session_id in ("over-grpc", "in-process"):
        run(drafter.open_session(session_id, [1, 2, 3], GREEDY, seed=0))
    try:
        got = run(view.predraft("over-grpc", 3, [4], [5, 6], branches, 3))
        want = replicas.drafter.predraft("in-process", 3, [4], [5, 6], branches, 3)
    finally:
        for session_id in ("over-grpc", "in-process"):
            run(drafter.close_session(session_id))
    # The same branches; each carries its drafter's load at the time (not compared).
    assert all(b.load is not None for b in got)
    unloaded = [dataclasses.replace(b, load=None) for b in got]
    assert unloaded == [dataclasses.replace(b, load=None) for b in want]
    assert len(got) == len(branches)
    assert [(b.accepted, len(b.tokens)) for b in got] == [(0, 3), (2, 3), (1, 3)]
    wait_for_no_branch(replicas.drafter)


def test_a_bad_predraft_is_invalid_argument(
    replicas: Replicas, clients: tuple[GrpcDrafter, GrpcVerifier]
) -> None:
    drafter = clients[0]
    run(drafter.open_session("bad-branch", [1, 2, 3], GREEDY, seed=0))
    try:
        with pytest.raises(InvalidArgumentError, match=r"0 <= accepted <= 2"):
            run(drafter.predraft("bad-branch", 3, [], [5, 6], [Branch(3, 0)], 2))
        # The session and the stream carry on.
        assert run(drafter.draft("bad-branch", 3, [], 2)).base_length == 3
    finally:
        run(drafter.close_session("bad-branch"))


def test_a_bad_predraft_entry_fails_alone_in_its_frame(replicas: Replicas) -> None:
    # One frame: open, a pre-draft whose branch accepts more than its block holds, a good
    # pre-draft, close. Only the bad entry fails; the entries after it run.
    session = "frame-entry"
    entries = [
        replica_pb2.FrameEntry(
            tag=1, open=requests.open_request_to_wire(session, [1, 2, 3], GREEDY, 0)
        ),
        replica_pb2.FrameEntry(
            tag=2,
            predraft=requests.predraft_request_to_wire(session, 3, [], [5, 6], [Branch(3, 0)], 2),
        ),
        replica_pb2.FrameEntry(
            tag=3,
            predraft=requests.predraft_request_to_wire(session, 3, [], [5, 6], [Branch(1, 0)], 2),
        ),
        replica_pb2.FrameEntry(tag=4, close=requests.close_request_to_wire(session)),
    ]
    frame = replica_pb2.RouterFrame(version=requests.FRAME_VERSION, entries=entries)
    with grpc.insecure_channel(replicas.drafter_address) as channel:
        replies = list(replica_pb2_grpc.DrafterStub(channel).Frames(iter([frame]), timeout=30))
    results = {result.tag: result for reply in replies for result in reply.results}
    assert {tag: r.WhichOneof("result") for tag, r in results.items()} == {
        1: "opened",
        2: "error",
        3: "predrafted",
        4: "closed",
    }
    assert results[2].error.status == "INVALID_ARGUMENT"
    assert "accepted" in results[2].error.message
    (branch,) = results[3].predrafted.branches
    assert branch.accepted == 1 and len(branch.token_ids) == 2
    assert results[4].closed.existed
    wait_for_no_branch(replicas.drafter)


def test_chaos_fails_predrafts_as_it_fails_drafts(replicas: Replicas) -> None:
    # Soak tests' faulty drafter (`error_fraction`): a pre-draft fails INTERNAL like a draft.
    server, port = serve_replica(DrafterServicer(replicas.drafter, error_fraction=1.0))
    try:
        with GrpcDrafter(f"127.0.0.1:{port}", timeout_s=30.0) as drafter:
            run(drafter.open_session("chaos", [1, 2, 3], GREEDY, seed=0))
            with pytest.raises(ReplicaUnavailableError, match="Predraft failed on purpose"):
                run(drafter.predraft("chaos", 3, [], [5], [Branch(0, 0)], 2))
            with pytest.raises(ReplicaUnavailableError, match="Draft failed on purpose"):
                run(drafter.draft("chaos", 3, [], 2))
            assert run(drafter.close_session("chaos"))
    finally:
        server.stop(None)
