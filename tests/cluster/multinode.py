"""A Ray cluster of several nodes on this machine, for tests, with Tandem deployed on it.

`local_nodes(home)` starts a `ray.cluster_utils.Cluster` the way `tandem serve` starts its
one-node cluster (`cluster.serve.ray_cluster`): every node on 127.0.0.1, Ray's token
authentication on (the token in `home`), workers at normal priority, the Ray temp dir under
`home`, so that runs never collide. The driver is this process, connected to the head node.

Nodes are typed by the custom resources they offer (`ROUTER_NODE` on the head, `DRAFTER_NODE`
or `VERIFIER_NODE` on the others, or both on one node), one replica's worth of each
(`REPLICA_SHARE`): a node holds one replica of each side it offers, and the replica of a lost
node waits for a new node of its type.
`LocalNodes.deploy` runs the application with Serve's proxies on the head only (every node
here is 127.0.0.1, so proxies on several nodes would all want the same ports).
`LocalNodes.remove` kills a node's raylet and every process on it, as losing the machine would.
The cluster is recorded in `home` (`cluster.json`), so the measuring tools find it as they find
the service `tandem serve` started (`TANDEM_HOME=<home>`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from cluster.config import CLUSTER_SECRET_ENV, ReplicaGroupConfig, TandemConfig
from cluster.serve import loopback, ray_cluster
from experiments.overhead import replica_nodes
from tests.polling import wait_until

ROUTER_NODE = "tandem_router_node"
DRAFTER_NODE = "tandem_drafter_node"
VERIFIER_NODE = "tandem_verifier_node"
SIDE_NODES = {"drafter": DRAFTER_NODE, "verifier": VERIFIER_NODE}
REPLICA_SHARE = 1
"""What each replica asks of its node type's resource, and what each node offers of it: one
replica per node and side (a node's resources must be whole numbers)."""
HEAD_CPUS = 1
"""The head's logical CPUs; the other nodes advertise none (every replica reserves none)."""
STOP_TIMEOUT_S = 30.0
"""Bounds the wait for a removed node's processes to be gone."""


def on_nodes(node_type: str, num_replicas: int = 1) -> ReplicaGroupConfig:
    """A replica group placed on nodes of `node_type`, one replica per node, one intra-op
    thread each (several replicas share 2 cores)."""
    return ReplicaGroupConfig(
        num_replicas=num_replicas, resources={node_type: REPLICA_SHARE}, torch_threads=1
    )


class LocalNodes:
    """The cluster's nodes by type; adds, removes and reads them (needs the driver connected)."""

    def __init__(self, cluster: Any, temp_dir: Path) -> None:
        self._cluster = cluster
        self._temp_dir = temp_dir
        self.types: dict[str, frozenset[str]] = {}
        """The types of every node ever added, by Ray node id."""
        self._nodes: dict[str, Any] = {}

    def add(self, *node_types: str) -> str:
        """Start a node offering one replica's share of each of `node_types` (a drafter and a
        verifier node at once, say); returns its node id."""
        node = self._cluster.add_node(
            node_ip_address=loopback.LOOPBACK,
            temp_dir=str(self._temp_dir),
            num_cpus=HEAD_CPUS if not self._nodes else 0,
            resources=dict.fromkeys(node_types, REPLICA_SHARE),
            include_dashboard=False,
        )
        self.types[node.node_id] = frozenset(node_types)
        self._nodes[node.node_id] = node
        return str(node.node_id)

    def remove(self, node_id: str) -> None:
        """Kill the node's raylet and every process on it, its replicas included, at once (no
        grace), as losing the machine would; returns once they are all gone."""
        from ray._private import ray_constants

        node = self._nodes.pop(node_id)
        raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
        workers = _descendants(raylet)  # the raylet's workers: replicas, idle workers
        self._cluster.remove_node(node, allow_graceful=False)
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):  # it went with its raylet
                os.kill(pid, signal.SIGKILL)
        wait_until(
            lambda: not any(map(_running, workers)), STOP_TIMEOUT_S, "the node's workers gone"
        )

    @property
    def head_id(self) -> str:
        return str(self._cluster.head_node.node_id)

    @property
    def address(self) -> str:
        return str(self._cluster.address)

    def deploy(self, config: TandemConfig) -> None:
        """Run Tandem's application on the cluster, as `tandem serve` does, proxies on the head
        (and the routers' own servers wherever the routers run, if `config.front` has ports)."""
        from ray import serve
        from ray.serve.config import gRPCOptions

        from cluster.serve.app import GRPC_SERVICER_FUNCTIONS, build_app

        proxy_http_port = loopback.free_port()
        serve.start(
            proxy_location="HeadOnly",
            grpc_options=gRPCOptions(
                port=config.proxy_grpc_port,
                grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS),
            ),
            http_options={"host": loopback.LOOPBACK, "port": proxy_http_port},
        )
        serve.run(build_app(config), name=config.app_name, route_prefix="/")
        state = ray_cluster.load_state()
        assert state is not None
        ray_cluster.save_state(
            dataclasses.replace(
                state,
                grpc_port=config.front.grpc_port,
                http_port=config.front.http_port,
                proxy_port=config.proxy_grpc_port,
                proxy_http_port=proxy_http_port,
                app_name=config.app_name,
            )
        )

    def replicas(self, side: str | None = None) -> list[dict[str, Any]]:
        """The registry's live replicas (of `side`, if given), each with its `node_id`."""
        replicas = [r for r in ray_cluster.live_replicas() if side in (None, r["side"])]
        nodes = replica_nodes(replicas)
        return [{**r, "node_id": nodes[r["replica_id"]]} for r in replicas]

    def actor_nodes(self, class_suffix: str) -> list[str]:
        """Node ids of the live actors whose class name ends with `class_suffix`."""
        from ray._private import state

        return [
            str(actor["Address"]["NodeID"])
            for actor in state.actors(actor_state_name="ALIVE").values()
            if str(actor["ActorClassName"]).endswith(class_suffix)
        ]


def _descendants(pid: int) -> list[int]:
    """The pids of every process below `pid` (children, theirs...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        with contextlib.suppress(OSError, ValueError):  # gone meanwhile; not a process
            # /proc/<pid>/stat: "pid (comm) state ppid ...": comm may hold spaces, not ")".
            ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def _running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie, dead but not yet reaped, is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@contextmanager
def local_nodes(home: Path, secret: str) -> Iterator[LocalNodes]:
    """A head node (`ROUTER_NODE`) in `home`, this process connected to it as the driver;
    `secret` is the cluster secret the application and the measuring tools settle on. Every
    process of the cluster is stopped at the end, and `home` removed."""
    temp_dir = home / "ray"
    temp_dir.mkdir(parents=True)
    from ray._private.authentication_test_utils import reset_auth_token_state

    try:
        yield from _started(home, temp_dir, secret)
    finally:
        reset_auth_token_state()  # back to this process's own environment
        shutil.rmtree(home, ignore_errors=True)


def _started(home: Path, temp_dir: Path, secret: str) -> Iterator[LocalNodes]:
    """`local_nodes` within `home`, which exists."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(ray_cluster.HOME_ENV, str(home))
        patch.setenv(CLUSTER_SECRET_ENV, secret)
        patch.setenv("RAY_TMPDIR", str(home))  # Ray's default temp dir: <home>/ray
        for name, value in ray_cluster.ray_environment().items():
            patch.setenv(name, value)  # inherited by every node's processes
        from ray._private import ray_constants
        from ray._private.authentication_test_utils import reset_auth_token_state
        from ray.cluster_utils import Cluster

        # This process may have read Ray's config (auth mode, token) before; read it again.
        reset_auth_token_state()
        # Ray read RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER when this process first imported it, before
        # the fixture ran; off, it leaves 127.0.0.1 as it is instead of swapping in the
        # machine's interface address.
        patch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        cluster = Cluster()
        try:
            nodes = LocalNodes(cluster, temp_dir)
            nodes.add(ROUTER_NODE)
            state = ray_cluster.ClusterState(
                address=nodes.address, temp_dir=str(temp_dir), started_by_tandem=False
            )
            ray_cluster.save_state(state)
            ray_cluster.connect(state)
            yield nodes
        finally:
            _stop(cluster, temp_dir)


def _stop(cluster: Any, temp_dir: Path) -> None:
    """Disconnect, stop every node, then signal whatever still names the temp dir."""
    import ray

    try:
        ray.shutdown()
        cluster.shutdown()
    finally:
        leftover = ray_cluster.ClusterState(
            address="", temp_dir=str(temp_dir), started_by_tandem=True
        )
        ray_cluster.stop_cluster(leftover)
