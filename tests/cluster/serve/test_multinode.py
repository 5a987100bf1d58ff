"""Disaggregation across real Ray nodes: each side on nodes of its own type, and a node lost under
load costs time, never tokens.

One cluster for the module (`multinode`, tests/cluster/multinode.py): a head node that runs the
router, a drafter node and two verifier nodes, every node a Ray node of its own on loopback.
The drafter and verifier groups select their nodes by custom resource, one replica per node, so
the second verifier node holds the spare. Fixed rounds (no adaptive plan, no prompt lookup): a
request drafts exactly when it has a drafter, so `num_drafted` says whether it speculated.

The last two tests remove a node under concurrent greedy streams (its raylet and every process on
it killed), then add a new node of the same type, and print how long recovery took.
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import pytest

from cluster.api.client import TandemClient
from cluster.api.tenants import AuthConfig
from cluster.config import FrontConfig, ModelsConfig, ReplicaGroupConfig, TandemConfig
from cluster.local import LocalTandem
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.request import GenerationRequest
from cluster.runtime.errors import ClusterSecretError
from cluster.serve.loopback import LOOPBACK, free_port
from cluster.serve.ray_cluster import cluster_processes
from drafter.config import NgramConfig, SuffixConfig
from experiments.overhead import actor_table_nodes, measure
from tests.cluster.multinode import (
    DRAFTER_NODE,
    REPLICA_SHARE,
    ROUTER_NODE,
    SIDE_NODES,
    VERIFIER_NODE,
    LocalNodes,
    local_nodes,
    on_nodes,
)
from tests.conftest import PROMPTS, encode
from tests.polling import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SECRET = secrets.token_hex(32)
STREAM_TOKENS = 48
DRAFT_TOKENS = 3
NUM_STREAMS = 3
RECOVERY_TIMEOUT_S = 150.0
"""Bounds a wait for the cluster to recover (a node starting, a replica loading); never asserted."""
READ_PAUSE_S = 0.25
"""Pause between readings of the cluster's state (each asks Ray or a replica)."""


@dataclass(frozen=True)
class MultiNode:
    nodes: LocalNodes
    address: str
    """The public gRPC API through Serve's proxy on the head node (the routers' own servers
    are off here: what is under test is where the replicas run, not the door)."""


@pytest.fixture(scope="module")
def multinode() -> Iterator[MultiNode]:
    home = Path("/tmp") / f"tandem-mn-{os.getpid()}"  # short: Ray's socket paths are limited
    with local_nodes(home, SECRET) as nodes:
        for node_type in (DRAFTER_NODE, VERIFIER_NODE, VERIFIER_NODE):
            nodes.add(node_type)
        config = TandemConfig(
            proxy_grpc_port=free_port(),
            front=FrontConfig(grpc_port=None, http_port=None),
            models=ModelsConfig(preset="tiny"),
            auth=AuthConfig(enabled=False),
            draft_length=DraftLengthConfig(enabled=False),
            prompt_lookup=NgramConfig(enabled=False),
            # The model sides' placement is what is under test: no CPU-only suffix drafter.
            suffix_drafter=SuffixConfig(enabled=False),
            router=ReplicaGroupConfig(resources={ROUTER_NODE: REPLICA_SHARE}),
            drafter=on_nodes(DRAFTER_NODE),
            verifier=on_nodes(VERIFIER_NODE, num_replicas=2),
            cluster_secret=SECRET,
        )
        started = time.monotonic()
        nodes.deploy(config)
        print(f"4 nodes up, Tandem deployed in {time.monotonic() - started:.1f} s")
        yield MultiNode(nodes, f"{LOOPBACK}:{config.proxy_grpc_port}")
    assert cluster_processes(str(home / "ray")) == []  # every node's processes are gone


@pytest.fixture(scope="module")
def expected(local_tandem: LocalTandem) -> dict[str, tuple[int, ...]]:
    """Greedy target-only output of STREAM_TOKENS tokens per prompt, in this process."""
    return {
        prompt: local_tandem.router.generate(
            GenerationRequest(encode(local_tandem, prompt), STREAM_TOKENS, draft_tokens=0)
        ).tokens
        for prompt in PROMPTS
    }


def wait_for(predicate: Callable[[], object], what: str) -> None:
    """`wait_until` at a pace suited to readings of the cluster."""

    def paced() -> object:
        time.sleep(READ_PAUSE_S)
        return predicate()

    wait_until(paced, RECOVERY_TIMEOUT_S, what)


def sessions_on(replica: dict[str, Any]) -> int:
    kind = GrpcVerifier if replica["side"] == "verifier" else GrpcDrafter
    with kind(str(replica["address"]), timeout_s=10, secret=SECRET) as port:
        return port.stats().num_sessions


def test_each_replica_runs_on_a_node_of_its_type(multinode: MultiNode) -> None:
    import ray

    nodes = multinode.nodes
    replicas = nodes.replicas()
    assert sorted(r["side"] for r in replicas) == ["drafter", "verifier", "verifier"]
    for replica in replicas:
        assert nodes.types[replica["node_id"]] == {SIDE_NODES[replica["side"]]}, replica
    verifier_nodes = {r["node_id"] for r in replicas if r["side"] == "verifier"}
    assert len(verifier_nodes) == 2  # one on each verifier node: either is the other's spare
    # Each replica serves at the address of its own node (where other nodes reach it).
    node_ips = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    for replica in replicas:
        assert replica["address"].rsplit(":", 1)[0] == node_ips[replica["node_id"]]
    # Where each replica says it runs is where Ray's actor table has it.
    assert {r["replica_id"]: r["node_id"] for r in replicas} == actor_table_nodes(replicas)
    assert nodes.actor_nodes(":Router") == [nodes.head_id]
    # The registry too: a request would fail while it restarted after its node was lost.
    assert nodes.actor_nodes("ReplicaRegistry") == [nodes.head_id]


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_greedy_across_nodes_is_the_target_alone(
    multinode: MultiNode, expected: dict[str, tuple[int, ...]], pipelined: bool
) -> None:
    with TandemClient(multinode.address, timeout_s=120) as client:
        for prompt in PROMPTS[:3]:
            result = client.generate(
                prompt, max_tokens=STREAM_TOKENS, draft_tokens=DRAFT_TOKENS, pipelined=pipelined
            )
            assert result.tokens == expected[prompt], prompt
            assert result.num_drafted > 0  # the drafter node really drafted
            alone = client.generate(prompt, max_tokens=STREAM_TOKENS, draft_tokens=0)
            assert alone.tokens == expected[prompt] and alone.num_drafted == 0


def test_a_replica_on_another_node_refuses_calls_without_the_secret(
    multinode: MultiNode,
) -> None:
    import ray

    driver_node = ray.get_runtime_context().get_node_id()
    for replica in multinode.nodes.replicas():
        assert replica["node_id"] != driver_node
        kind = GrpcVerifier if replica["side"] == "verifier" else GrpcDrafter
        for secret in (None, "x" * len(SECRET)):
            with (
                kind(replica["address"], timeout_s=10, secret=secret) as port,
                pytest.raises(ClusterSecretError),
            ):
                port.stats()
        assert sessions_on(replica) == 0  # and with the secret it answers


def test_the_data_plane_across_nodes(multinode: MultiNode) -> None:
    """`python -m experiments.overhead --across-nodes`, shortened: the tool on the head, its
    drafter and verifier on two other nodes."""
    report = measure(sessions=4, rounds=10, draft_tokens=4, threads=1, across_nodes=True)
    placement = report["placement"]
    types = multinode.nodes.types
    assert types[placement["drafter"]["node_id"]] == {DRAFTER_NODE}
    assert types[placement["verifier"]["node_id"]] == {VERIFIER_NODE}
    assert placement["tool_node_id"] == multinode.nodes.head_id
    assert report["remote_block"]["count"] == 40 and report["bare_round_trip"]["p50_ms"] > 0
    print(
        "across nodes, p50 per block: "
        + ", ".join(f"{name} {report[name]['p50_ms']:.1f} ms" for name in (
            "remote_block", "in_process_block", "overhead_per_block", "bare_round_trip"))
    )  # fmt: skip


@dataclass(frozen=True)
class Finished:
    """A request that completed, exact."""

    started: float
    ended: float
    """`time.monotonic()` when the client sent it and when its last chunk came."""
    num_drafted: int


class Streams:
    """NUM_STREAMS clients that stream greedy requests back to back until the block ends. Each
    request is checked against the target alone: one that differs is corrupted, one that raises
    is lost (and its client stops)."""

    def __init__(self, address: str, expected: dict[str, tuple[int, ...]]) -> None:
        self._address = address
        self._expected = expected
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), name=f"stream-{i}")
            for i in range(NUM_STREAMS)
        ]
        self._finished: list[Finished] = []
        self.lost: list[str] = []
        self.corrupted: list[str] = []

    def __enter__(self) -> Streams:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)
            assert not thread.is_alive()

    def since(self, moment: float) -> list[Finished]:
        """The requests sent after `moment`; raises if any request was lost or corrupted."""
        self.check()
        with self._lock:
            return [f for f in self._finished if f.started > moment]

    def across(self, moment: float) -> list[Finished]:
        """The requests that were running at `moment`."""
        with self._lock:
            return [f for f in self._finished if f.started < moment < f.ended]

    def check(self) -> None:
        assert not self.lost, self.lost[:3]
        assert not self.corrupted, self.corrupted[:3]

    def _run(self, index: int) -> None:
        with TandemClient(self._address, timeout_s=120) as client:
            turn = index
            while not self._stop.is_set():
                prompt = PROMPTS[turn % len(PROMPTS)]
                turn += 1
                started = time.monotonic()
                try:
                    chunks = list(
                        client.stream(prompt, max_tokens=STREAM_TOKENS, draft_tokens=DRAFT_TOKENS)
                    )
                except Exception as error:
                    with self._lock:
                        self.lost.append(f"{prompt!r}: {error!r}")
                    return
                tokens = tuple(t for chunk in chunks for t in chunk.tokens)
                stats = chunks[-1].stats
                with self._lock:
                    if tokens != self._expected[prompt] or stats is None:
                        self.corrupted.append(f"{prompt!r}: {tokens} (stats {stats})")
                    else:
                        finished = Finished(started, time.monotonic(), stats.num_drafted)
                        self._finished.append(finished)


def test_losing_the_drafter_node_leaves_requests_to_the_target_alone_until_one_is_back(
    multinode: MultiNode,
    expected: dict[str, tuple[int, ...]],
    record_property: Callable[[str, object], None],
) -> None:
    nodes = multinode.nodes
    [drafter] = nodes.replicas("drafter")
    with Streams(multinode.address, expected) as streams:
        wait_for(lambda: streams.since(0) and sessions_on(drafter) > 0, "streams drafting")
        lost_at = time.monotonic()
        nodes.remove(drafter["node_id"])
        # Requests sent after the loss run on the target alone, exactly.
        wait_for(lambda: streams.since(lost_at), "a request on the target alone")
        added_at = time.monotonic()
        new_node = nodes.add(DRAFTER_NODE)
        wait_for(
            lambda: any(f.num_drafted > 0 for f in streams.since(lost_at)), "speculation again"
        )
    streams.check()
    after = streams.since(lost_at)
    resumed_at = min(f.started for f in after if f.num_drafted > 0)
    assert all(f.num_drafted == 0 for f in after if f.started < added_at)
    assert streams.across(lost_at)  # requests were streaming when the node went
    assert [r["node_id"] for r in nodes.replicas("drafter")] == [new_node]
    record_property("speculation_resumed_after_drafter_node_lost_s", resumed_at - lost_at)
    record_property("speculation_resumed_after_drafter_node_added_s", resumed_at - added_at)
    print(
        f"drafter node lost: {sum(f.num_drafted == 0 for f in after)} requests on the target "
        f"alone; speculation resumed {resumed_at - lost_at:.1f} s after the loss, "
        f"{resumed_at - added_at:.1f} s after a new drafter node was added; "
        f"{len(streams.since(0))} requests, lost 0, corrupted 0"
    )


def test_losing_a_verifier_node_fails_over_to_the_spare_on_the_other(
    multinode: MultiNode,
    expected: dict[str, tuple[int, ...]],
    record_property: Callable[[str, object], None],
) -> None:
    nodes = multinode.nodes
    verifiers = nodes.replicas("verifier")
    assert len({r["node_id"] for r in verifiers}) == 2
    with Streams(multinode.address, expected) as streams:
        wait_for(lambda: streams.since(0) and max(map(sessions_on, verifiers)) > 0, "streams")
        busiest = max(verifiers, key=sessions_on)
        [spare] = [r for r in verifiers if r is not busiest]
        lost_at = time.monotonic()
        nodes.remove(busiest["node_id"])
        # The spare on the other verifier node serves on; speculation never stops.
        wait_for(lambda: len(streams.since(lost_at)) >= NUM_STREAMS, "requests on the spare")
        added_at = time.monotonic()
        new_node = nodes.add(VERIFIER_NODE)
        wait_for(
            lambda: (
                {r["node_id"] for r in nodes.replicas("verifier")} == {spare["node_id"], new_node}
            ),
            "a verifier on the new node",
        )
        back_at = time.monotonic()
        wait_for(lambda: len(streams.since(back_at)) >= NUM_STREAMS, "requests on both")
    streams.check()
    assert streams.across(lost_at)  # requests were streaming when the node went
    assert all(f.num_drafted > 0 for f in streams.since(0))
    record_property("verifier_back_after_node_added_s", back_at - added_at)
    print(
        f"verifier node lost: the spare served on with speculation; a replacement verifier was "
        f"live {back_at - added_at:.1f} s after its node was added "
        f"({back_at - lost_at:.1f} s after the loss); "
        f"{len(streams.since(0))} requests, lost 0, corrupted 0"
    )
