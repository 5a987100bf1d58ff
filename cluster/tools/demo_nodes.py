"""`make demo-nodes`: Tandem over three Ray nodes on this machine, with its placement checked.

Three Ray nodes on loopback make one Ray cluster, each with its own temp dir in a private home
(/tmp/tandem-nodes-XXXXXXXX): the head (`ray start --head`: Serve's controller and proxy, and
the router; no custom resource), a drafter node and a verifier node (`cluster.serve.worker_node`,
which says why not `ray start --address`), each advertising the custom resources its side's
replicas ask for in the config (deploy/placement/nodes.yaml: `tandem_drafter_node`,
`tandem_verifier_node`). `tandem serve` deploys the tiny preset on that
cluster with the config. The demo then generates through the public gRPC API (speculative, and
the target alone: greedy, so both give the same tokens), prints `tandem status`, and checks the
registry's entries (each replica reports its Ray node, `ReplicaInfo.node_id`): every drafter
must run on the drafter node and every verifier on the verifier node. The last line is the
verdict, `placement ok: ...` with exit status 0, or what went wrong with 1.

Whatever ends it (success, failure, Ctrl-C, SIGTERM), everything it started is stopped and the
home removed (`stop_nodes`): the processes of each node, found by the node's temp dir, SIGTERM
then SIGKILL (`cluster.tools.cleanup.stop_processes`). Not `ray stop`: that would stop every Ray
cluster of the user on this machine.

The nodes share 127.0.0.1 (and the machine with any other Ray cluster), so whatever Ray and
Serve would put on a fixed port gets a free one per node: the dashboard and metrics agents, Ray
client's server, the workers' ports, and the worker nodes' Serve proxies (Serve runs a proxy on
every node that holds a replica, as on a real cluster; `RAY_SERVE_WORKER_PROXY_*_PORT`), so the
public API's ports are the head's alone. All three run with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
(`ray_cluster.ray_environment`), which keeps Ray from swapping 127.0.0.1 for the machine's
address.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import ReplicaGroupConfig, TandemConfig
from cluster.routing.registry import HEAD_NODE_RESOURCE
from cluster.runtime.errors import InvalidArgumentError, TandemError
from cluster.serve import loopback, ray_cluster
from cluster.tools import cleanup

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "placement" / "nodes.yaml"
PRESET = "tiny"
SIDES = ("drafter", "verifier")
HEAD = "head"
HEAD_TEMP_DIR = "ray"
"""The head's temp dir in the home (`ray_cluster.start_cluster`'s); each worker node's is
named after its side."""
NODE_CPUS = 2
"""Logical CPUs each node advertises (replicas reserve none unless the config says so)."""
OBJECT_STORE_BYTES = 150 * 1024 * 1024
"""Each node's object store: Ray's default is 30% of the machine's memory per node, three times
over here, and the demo moves next to nothing through it."""
PROMPT = "def fibonacci(n):"
MAX_TOKENS = 24
NODES_TIMEOUT_S = 120.0
DEPLOY_TIMEOUT_S = 420.0
"""`tandem serve` waits for every replica to run; one that fits no node would wait forever."""
STATUS_TIMEOUT_S = 120.0
CLIENT_TIMEOUT_S = 120.0
REGISTRY_TIMEOUT_S = 30.0
POLL_S = 0.5


class DemoFailed(RuntimeError):
    """The demo ran, and what it checks does not hold."""


@dataclass(frozen=True)
class NodeType:
    """A worker node the demo starts: the side it is for and the custom resources it offers."""

    side: str
    resources: dict[str, int]


def node_types(config: TandemConfig) -> list[NodeType]:
    """One worker node per side, offering each custom resource the side's replicas ask for,
    enough for all of them (at least 1). A side that asks for none could run on any node:
    refused, there would be nothing to check."""
    nodes = []
    for side in SIDES:
        group: ReplicaGroupConfig = getattr(config, side)
        custom = {k: v for k, v in group.resources.items() if not k.startswith("node:")}
        if not custom:
            raise InvalidArgumentError(
                f"{side}.resources names no custom resource (a node type) to place it by"
            )
        offered = {k: max(1, math.ceil(v * group.num_replicas)) for k, v in custom.items()}
        nodes.append(NodeType(side, offered))
    return nodes


def head_arguments() -> list[str]:
    """`ray start --head` flags beyond `ray_cluster.start_cluster`'s: no fixed ports (Ray's
    defaults put every node's dashboard agent on 52365, its workers on 10002-19999 and the
    client server on 10001)."""
    return [
        f"--ray-client-server-port={loopback.free_port()}",
        f"--dashboard-agent-listen-port={loopback.free_port()}",
        "--min-worker-port=0", "--max-worker-port=0",
        f"--object-store-memory={OBJECT_STORE_BYTES}",
    ]  # fmt: skip


def worker_options(head_address: str, temp_dir: Path, node: NodeType) -> dict[str, Any]:
    """The Ray options of `node`, joining `head_address` (`ray_cluster.worker_node_options`),
    with its own Serve proxy ports: Serve runs a proxy on every node that holds a replica."""
    proxy_ports = {
        "RAY_SERVE_WORKER_PROXY_HTTP_PORT": str(loopback.free_port()),
        "RAY_SERVE_WORKER_PROXY_GRPC_PORT": str(loopback.free_port()),
    }
    return ray_cluster.worker_node_options(
        head_address, temp_dir, NODE_CPUS, node.resources, proxy_ports, OBJECT_STORE_BYTES
    )


def nodes_by_type(nodes: Sequence[Mapping[str, Any]], types: Sequence[NodeType]) -> dict[str, str]:
    """The node id of the head and of each side's node (`ray.nodes()` entries: the alive
    node offering the head's resource, or the type's); empty while one is missing."""
    alive = [n for n in nodes if n.get("Alive")]
    wanted = {HEAD: {HEAD_NODE_RESOURCE}} | {t.side: set(t.resources) for t in types}
    found: dict[str, str] = {}
    for name, resources in wanted.items():
        matches = [str(n["NodeID"]) for n in alive if resources <= set(n.get("Resources", {}))]
        if len(matches) != 1:
            return {}
        found[name] = matches[0]
    return found


def check_placement(
    replicas: Sequence[Mapping[str, Any]], node_ids: Mapping[str, str], counts: Mapping[str, int]
) -> str:
    """The verdict line when every replica of each side runs on its side's node and each side
    has as many as `counts` says (the config's, autoscaling off); raises `DemoFailed` naming
    each problem otherwise."""
    problems = []
    for side in SIDES:
        mine = [r for r in replicas if r.get("side") == side]
        if len(mine) != counts[side]:
            problems.append(f"{len(mine)} {side} replica(s) registered, {counts[side]} deployed")
        problems += [
            f"{r['replica_id']} runs on node {r.get('node_id') or '(not reported)'}, "
            f"not the {side} node {node_ids[side]}"
            for r in mine
            if r.get("node_id") != node_ids[side]
        ]
    if problems:
        raise DemoFailed("placement: " + "; ".join(problems))
    return "placement ok: " + ", ".join(
        f"{counts[side]} {side}{'' if counts[side] == 1 else 's'} on node {node_ids[side]}"
        for side in SIDES
    )


@contextmanager
def _driver(state: ray_cluster.ClusterState) -> Iterator[Any]:
    """This process as a driver of the cluster (yields the `ray` module); disconnects after."""
    ray_cluster.connect(state)
    import ray

    try:
        yield ray
    finally:
        ray.shutdown()


def _wait_for_nodes(ray: Any, types: Sequence[NodeType]) -> dict[str, str]:
    deadline = time.monotonic() + NODES_TIMEOUT_S
    while not (found := nodes_by_type(ray.nodes(), types)):
        if time.monotonic() > deadline:
            raise DemoFailed(f"the three nodes did not all join within {NODES_TIMEOUT_S:.0f} s")
        time.sleep(POLL_S)
    return found


def _tandem(*arguments: str, timeout_s: float) -> None:
    """Run a `tandem` command (this process's TANDEM_HOME), its output shown as it comes."""
    try:
        done = subprocess.run([cleanup.tandem_command(), *arguments], timeout=timeout_s)
    except subprocess.TimeoutExpired as error:
        raise DemoFailed(f"tandem {arguments[0]} took longer than {timeout_s:.0f} s") from error
    if done.returncode != 0:
        raise DemoFailed(f"tandem {arguments[0]} failed (exit status {done.returncode})")


def _generate(address: str, api_key: str, say: Callable[[str], None]) -> None:
    from cluster.api.client import TandemClient

    with TandemClient(address, timeout_s=CLIENT_TIMEOUT_S, api_key=api_key) as client:
        speculative = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
        alone = client.generate(PROMPT, max_tokens=MAX_TOKENS, temperature=0.0, draft_tokens=0)
    say(
        f"generated {len(speculative.tokens)} tokens through the gRPC API on {address}: "
        f"{speculative.num_drafted} drafted, {speculative.num_accepted} accepted, "
        f"{speculative.num_verify_passes} verify passes"
    )
    if speculative.tokens != alone.tokens:
        raise DemoFailed("the speculative tokens differ from the target alone's (greedy, fp32)")
    say("same tokens as the target alone: yes")


def run(config_path: Path, home: Path, say: Callable[[str], None]) -> str:
    """Start the nodes in `home` (this process's TANDEM_HOME), deploy, generate, show the
    status and check the placement; returns the verdict line."""
    config = TandemConfig.from_yaml(config_path)
    types = node_types(config)
    head_dir = home / HEAD_TEMP_DIR
    say(f"starting the head node (Serve's controller and proxy, the router) in {head_dir} ...")
    state = ray_cluster.start_cluster(NODE_CPUS, head_arguments())
    for node in types:
        offered = ", ".join(f"{k}: {v}" for k, v in node.resources.items())
        say(f"starting the {node.side} node ({offered}) in {home / node.side} ...")
        ray_cluster.start_worker_node(worker_options(state.address, home / node.side, node))
    with _driver(state) as ray:
        node_ids = _wait_for_nodes(ray, types)
        say("nodes up: " + ", ".join(f"{name} {node_id}" for name, node_id in node_ids.items()))
        ports = loopback.free_door_ports()
        say(f"deploying the {PRESET} preset placed by {config_path} (tandem serve) ...")
        _tandem(
            "serve", "--config", str(config_path), "--preset", PRESET,
            *loopback.port_arguments(ports), "--detach", timeout_s=DEPLOY_TIMEOUT_S,
        )  # fmt: skip
        address = f"{loopback.LOOPBACK}:{ports['--port']}"
        _generate(address, (home / "api_key").read_text(), say)
        say("tandem status:")
        _tandem("status", timeout_s=STATUS_TIMEOUT_S)
        from cluster.routing.registry import get_registry

        registry = get_registry(config.app_name)
        replicas = ray.get(registry.replicas.remote(), timeout=REGISTRY_TIMEOUT_S)
    counts = {side: getattr(config, side).num_replicas for side in SIDES}
    return check_placement(replicas, node_ids, counts)


def stop_nodes(home: Path) -> int:
    """Stop every process of the nodes in `home` (the worker nodes first) and remove it;
    returns how many processes were signalled. Not `tandem shutdown`: it signals whatever
    holds a file in the head's temp dir, and this process does, having been a driver."""
    temp_dirs = [home / side for side in SIDES] + [home / HEAD_TEMP_DIR]
    signalled = sum(cleanup.stop_processes(str(temp_dir)) for temp_dir in temp_dirs)
    shutil.rmtree(home, ignore_errors=True)
    return signalled


def _say(message: str) -> None:
    print(message, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cluster.tools.demo_nodes",
        description="Tandem on three local Ray nodes (head, drafter, verifier), placement checked",
    )
    parser.add_argument(
        "--config", type=Path, default=DEFAULT_CONFIG, help="a TandemConfig placing each side"
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    with cleanup.signals_raise():
        home = Path(tempfile.mkdtemp(prefix="tandem-nodes-", dir="/tmp"))  # short: Ray's sockets
        # This process's own home: `ray_cluster` and the `tandem` commands run here find the
        # cluster in it.
        os.environ[ray_cluster.HOME_ENV] = str(home)
        try:
            verdict, status = run(args.config.resolve(), home, _say), 0
        except (DemoFailed, TandemError) as error:
            verdict, status = f"demo-nodes failed: {error}", 1
        except KeyboardInterrupt:
            verdict, status = "demo-nodes interrupted", 130
        except cleanup.Terminated as error:
            verdict, status = "demo-nodes terminated", int(error.code or 1)
        except Exception as error:  # anything else: its traceback, then the verdict line
            traceback.print_exc()
            verdict, status = f"demo-nodes failed: {type(error).__name__}: {error}", 1
        finally:
            with cleanup.signals_held():
                _say(f"stopping the three nodes and removing {home} ...")
                stop_nodes(home)
    _say(f"took {time.monotonic() - started:.0f} s, teardown included")
    print(verdict, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
