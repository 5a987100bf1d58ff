"""`make demo-nodes` (cluster/tools/demo_nodes.py): Tandem over three local Ray nodes.

Its pure parts first, without Ray: which node offers what, the flags that keep three nodes on
one address apart, the node of each type from Ray's node table, and the placement verdict. Then
the whole demo as a user runs it, a process of its own: it must end with `placement ok`, and,
finished or terminated half way, leave no process of any of its nodes and no home behind.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.config import ReplicaGroupConfig, TandemConfig
from cluster.runtime.errors import InvalidArgumentError
from cluster.serve.ray_cluster import HOME_ENV, cluster_processes
from cluster.tools import demo_nodes
from cluster.tools.cleanup import stop_processes
from cluster.tools.demo_nodes import (
    DemoFailed,
    NodeType,
    check_placement,
    node_types,
    nodes_by_type,
    worker_options,
)
from tests.polling import wait_until

REPO_ROOT = Path(__file__).resolve().parents[3]
DRAFTER_NODE = "d" * 56  # Ray node ids: 28 bytes in hex
VERIFIER_NODE = "e" * 56
HEAD_NODE = "f" * 56
NODE_DIRS = ("ray", "drafter", "verifier")
"""The temp dir of each node of the demo's home: the head's (`ray_cluster`'s), then one per
side."""


def test_each_worker_node_offers_what_its_sides_replicas_ask_for() -> None:
    types = node_types(TandemConfig.from_yaml(demo_nodes.DEFAULT_CONFIG))
    assert types == [
        NodeType("drafter", {"tandem_drafter_node": 1}),
        NodeType("verifier", {"tandem_verifier_node": 1}),
    ]
    # Enough for every replica: three asking for half a node each need a node offering 2.
    config = TandemConfig(
        drafter=ReplicaGroupConfig(num_replicas=3, resources={"small_gpu": 0.5}),
        verifier=ReplicaGroupConfig(resources={"big_gpu": 1, "node:__internal_head__": 0.01}),
    )
    assert [t.resources for t in node_types(config)] == [{"small_gpu": 2}, {"big_gpu": 1}]


def test_a_side_placed_by_no_custom_resource_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match=r"drafter\.resources names no custom resource"):
        node_types(TandemConfig())


def test_the_head_resource_is_rays() -> None:
    from ray._common.constants import HEAD_NODE_RESOURCE_NAME

    assert demo_nodes.HEAD_NODE_RESOURCE == HEAD_NODE_RESOURCE_NAME


def test_a_worker_node_joins_on_loopback_with_ports_of_its_own() -> None:
    from ray._private.parameter import RayParams

    node = NodeType("drafter", {"tandem_drafter_node": 1})
    options = worker_options("127.0.0.1:6400", Path("/tmp/tandem-nodes-x/drafter"), node)
    RayParams(**options)  # options Ray knows
    assert options["gcs_address"] == "127.0.0.1:6400"
    assert options["node_ip_address"] == "127.0.0.1"
    assert options["temp_dir"] == "/tmp/tandem-nodes-x/drafter"
    assert options["resources"] == {"tandem_drafter_node": 1}
    # Nothing on Ray's fixed defaults, which the other nodes on 127.0.0.1 would hold too.
    assert options["dashboard_agent_listen_port"] not in (None, 52365)
    assert (options["min_worker_port"], options["max_worker_port"]) == (0, 0)
    assert options["metrics_export_port"] > 0
    proxies = options["env_vars"]
    assert set(proxies) == {"RAY_SERVE_WORKER_PROXY_HTTP_PORT", "RAY_SERVE_WORKER_PROXY_GRPC_PORT"}
    assert len(set(proxies.values())) == 2
    assert not any("--port=" in flag or "10001" in flag for flag in demo_nodes.head_arguments())


def ray_node(node_id: str, resources: dict[str, float], alive: bool = True) -> dict[str, object]:
    """An entry of `ray.nodes()`, the fields the demo reads."""
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 2.0, **resources}}


TYPES = node_types(TandemConfig.from_yaml(demo_nodes.DEFAULT_CONFIG))


def test_each_node_type_is_found_in_rays_node_table() -> None:
    nodes = [
        ray_node(HEAD_NODE, {"node:__internal_head__": 1.0}),
        ray_node(VERIFIER_NODE, {"tandem_verifier_node": 1.0}),
        ray_node(DRAFTER_NODE, {"tandem_drafter_node": 1.0}),
        ray_node("0" * 56, {"tandem_drafter_node": 1.0}, alive=False),  # an earlier one, gone
    ]
    assert nodes_by_type(nodes, TYPES) == {
        "head": HEAD_NODE,
        "drafter": DRAFTER_NODE,
        "verifier": VERIFIER_NODE,
    }
    # Not yet joined, or ambiguous: nothing, so the demo keeps waiting.
    assert nodes_by_type(nodes[:2], TYPES) == {}
    assert nodes_by_type([*nodes, ray_node("1" * 56, {"tandem_drafter_node": 1.0})], TYPES) == {}


NODE_IDS = {"head": HEAD_NODE, "drafter": DRAFTER_NODE, "verifier": VERIFIER_NODE}
COUNTS = {"drafter": 2, "verifier": 1}


def replica(replica_id: str, side: str, node_id: str | None) -> dict[str, object]:
    entry: dict[str, object] = {"replica_id": replica_id, "side": side, "address": "127.0.0.1:1"}
    if node_id is not None:
        entry["node_id"] = node_id
    return entry


def test_the_verdict_names_the_node_of_each_side() -> None:
    replicas = [
        replica("drafter-a", "drafter", DRAFTER_NODE),
        replica("drafter-b", "drafter", DRAFTER_NODE),
        replica("verifier-a", "verifier", VERIFIER_NODE),
    ]
    assert check_placement(replicas, NODE_IDS, COUNTS) == (
        f"placement ok: 2 drafters on node {DRAFTER_NODE}, 1 verifier on node {VERIFIER_NODE}"
    )


def test_a_replica_off_its_node_or_missing_fails_the_check() -> None:
    replicas = [
        replica("drafter-a", "drafter", DRAFTER_NODE),
        replica("drafter-b", "drafter", HEAD_NODE),
        replica("verifier-a", "verifier", None),  # a replica too old to say
    ]
    with pytest.raises(DemoFailed) as failed:
        check_placement(replicas, NODE_IDS, COUNTS)
    message = str(failed.value)
    assert f"drafter-b runs on node {HEAD_NODE}, not the drafter node {DRAFTER_NODE}" in message
    assert "verifier-a runs on node (not reported), not the verifier node" in message
    with pytest.raises(DemoFailed, match=re.escape("1 drafter replica(s) registered, 2 deployed")):
        check_placement(replicas[:1] + replicas[2:], NODE_IDS, COUNTS)


# --- the demo, end to end ------------------------------------------------------------------

DEMO_TIMEOUT_S = 540.0
"""Bounds the whole demo on a loaded 2-core machine (it takes about two minutes alone), below
pytest's own timeout (600 s)."""
UP_TIMEOUT_S = 240.0
EXIT_TIMEOUT_S = 240.0
"""Bounds the teardown: `tandem shutdown` (at most 180 s), then the kill sweeps."""
VERDICT = re.compile(
    r"placement ok: 2 drafters on node [0-9a-f]{56}, 1 verifier on node [0-9a-f]{56}"
)


class Demo:
    """`python -m cluster.tools.demo_nodes` as a child process, its output collected."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        env = {k: v for k, v in os.environ.items() if k != HOME_ENV}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cluster.tools.demo_nodes"],
            cwd=REPO_ROOT, env=env, text=True,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line.rstrip("\n"))

    def home(self) -> Path | None:
        """The private home the demo announced with its first node, once it has."""
        for line in self.lines:
            found = re.search(r" in (/tmp/tandem-nodes-[^/ ]+)/ray \.\.\.$", line)
            if found:
                return Path(found.group(1))
        return None

    def said(self, text: str) -> bool:
        return any(text in line for line in self.lines)

    def exited(self) -> bool:
        return self.process.poll() is not None

    def output(self) -> str:
        return "\n".join(self.lines)[-4000:]


@pytest.fixture
def demo() -> Iterator[Demo]:
    started = Demo()
    try:
        yield started
    finally:
        # Only if the test failed half way: nothing of the demo may outlive it.
        if not started.exited():
            started.process.kill()
            started.process.wait()
        home = started.home()
        if home is not None:
            for name in NODE_DIRS:
                stop_processes(str(home / name))
            shutil.rmtree(home, ignore_errors=True)


def _left_behind(home: Path) -> list[int]:
    return [pid for name in NODE_DIRS for pid in cluster_processes(str(home / name))]


@pytest.mark.ray
@pytest.mark.slow
def test_the_demo_places_each_side_on_its_node_and_leaves_nothing_behind(demo: Demo) -> None:
    wait_until(demo.exited, DEMO_TIMEOUT_S, "the demo ending")
    assert demo.process.returncode == 0, demo.output()
    assert VERDICT.fullmatch(demo.lines[-1]), demo.output()
    drafter_node, verifier_node = re.findall(r"[0-9a-f]{56}", demo.lines[-1])
    assert drafter_node != verifier_node
    assert demo.said("same tokens as the target alone: yes")
    # `tandem status` showed each replica's resources, its group's.
    assert demo.said("tandem_drafter_node=0.01") and demo.said("tandem_verifier_node=0.01")
    home = demo.home()
    assert home is not None
    wait_until(lambda: not _left_behind(home), 30, "no process of the demo's nodes left")
    assert not home.exists()


@pytest.mark.ray
@pytest.mark.slow
def test_a_terminated_demo_stops_all_three_nodes(demo: Demo) -> None:
    wait_until(
        lambda: demo.said("starting the verifier node") or demo.exited(),
        UP_TIMEOUT_S,
        "the demo starting its last node",
    )
    assert not demo.exited(), demo.output()
    home = demo.home()
    assert home is not None
    wait_until(lambda: cluster_processes(str(home / "drafter")), UP_TIMEOUT_S, "a drafter node")

    demo.process.send_signal(signal.SIGTERM)

    wait_until(demo.exited, EXIT_TIMEOUT_S, "the demo exiting")
    assert demo.process.returncode == 128 + signal.SIGTERM, demo.output()
    assert demo.lines[-1] == "demo-nodes terminated", demo.output()
    wait_until(lambda: not _left_behind(home), 30, "no process of the demo's nodes left")
    assert not home.exists()
