"""Measure the data plane: what one block costs over gRPC against the same calls in-process.

`python -m experiments.overhead` finds the drafter and verifier replicas of the running
service
(TANDEM_HOME, as `tandem serve` recorded it) and times, per block, router -> drafter -> router
-> verifier -> router: `draft` then `verify` of a greedy session. The same sessions then run on
in-process copies of the same models. Greedy decoding makes both do identical work, so the
per-round difference is the transport's cost. The in-process side uses the replicas'
intra-op thread count (`--threads`; Ray gives a replica with `num_cpus` 0 one thread). Runs are
interleaved (remote, local, remote...)
and repeated; the report gives p50 and p99 of block time in each mode, of the paired
difference, and of a bare round trip (the two replicas' Stats calls: transport alone).

The tool is the router: it runs where it is started (the head node, for a local cluster). By
default it drives any one replica of each side. `--across-nodes` picks a drafter and a verifier
on two different Ray nodes, so every block crosses from the tool's node to one node and then to
another; the report names the node of each replica and of the tool (`placement`). A replica's
node is the one it reports to the registry; for an older replica that does not, Ray's actor
table's, matched on the replica's host and pid (Tandem's clusters run no dashboard, so Ray's
state API is not there to ask).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from cluster.routing.ports import DrafterPort, VerifierPort
from cluster.routing.session_events import SessionEvents
from cluster.routing.waits import answer, run
from cluster.runtime.sampling_params import SamplingParams
from cluster.serve import ray_cluster
from cluster.tools.cleanup import signals_raise

PROMPT = tuple(b"def add(a, b):\n    return a + b\n\n")
GREEDY = SamplingParams()
SIDES = ("drafter", "verifier")
UNKNOWN_NODE = ""
"""The node of a replica that Ray's actor table does not list (yet, or any more)."""


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _summary(values_s: Sequence[float]) -> dict[str, float]:
    return {
        "p50_ms": 1000 * _percentile(values_s, 0.5),
        "p99_ms": 1000 * _percentile(values_s, 0.99),
        "mean_ms": 1000 * statistics.fmean(values_s),
        "count": len(values_s),
    }


def _session_rounds(
    drafter: DrafterPort, verifier: VerifierPort, rounds: int, draft_tokens: int
) -> list[float]:
    """Block times (s) of one greedy session of `rounds` draft/verify rounds, one at a time
    (the verifier's session does not advance on its own)."""
    session = uuid.uuid4().hex
    run(verifier.open_session(session, PROMPT, GREEDY, 0))
    run(drafter.open_session(session, PROMPT, GREEDY, 0))
    base, behind, times = len(PROMPT), list[int](), list[float]()
    events = SessionEvents()
    try:
        for post_id in range(rounds):
            start = time.perf_counter()
            block = run(drafter.draft(session, base, behind, draft_tokens))
            verifier.post(session, block, False, events, post_id)
            run(answer(events.ready()))
            verdict = events.take()[0].item
            if isinstance(verdict, Exception):
                raise verdict
            times.append(time.perf_counter() - start)
            base, behind = block.base_length, list(verdict.tokens)
    finally:
        run(drafter.close_session(session))
        run(verifier.close_session(session))
    return times


def replica_nodes(replicas: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The Ray node id of each replica (by replica id): as the replica reports it
    (`ReplicaInfo.node_id`), else, for a replica too old to report it, from Ray's actor table
    (`actor_table_nodes`)."""
    reported = {str(r["replica_id"]): str(r.get("node_id") or UNKNOWN_NODE) for r in replicas}
    if UNKNOWN_NODE not in reported.values():
        return reported
    looked_up = actor_table_nodes(replicas)
    return {replica: node or looked_up[replica] for replica, node in reported.items()}


def actor_table_nodes(replicas: Sequence[Mapping[str, Any]]) -> dict[str, str]:
    """The Ray node id of each replica (by replica id; `UNKNOWN_NODE` where none matches) from
    Ray's actor table: the node of the live actor whose pid is the replica's, on the host the
    replica serves at (pids are per machine). Needs a Ray connection."""
    from ray._private import state

    nodes = {
        (actor["Address"]["IPAddress"], int(actor["Pid"])): str(actor["Address"]["NodeID"])
        for actor in state.actors(actor_state_name="ALIVE").values()
    }
    return {
        str(r["replica_id"]): nodes.get(
            (str(r["address"]).rsplit(":", 1)[0], int(r["pid"])), UNKNOWN_NODE
        )
        for r in replicas
    }


def choose_pair(
    replicas: Sequence[Mapping[str, Any]], nodes: Mapping[str, str], across_nodes: bool
) -> dict[str, Mapping[str, Any]]:
    """One replica per side to measure. By default the last listed of each side (what
    `ray_cluster.replica_addresses` returns); `across_nodes`: the first drafter and verifier
    known to be on different nodes. Raises `ClusterError` when there is no such pair."""
    by_side = {side: [r for r in replicas if r["side"] == side] for side in SIDES}
    missing = [side for side in SIDES if not by_side[side]]
    if missing:
        raise ray_cluster.ClusterError(f"the service has no live {' or '.join(missing)} replica")
    if not across_nodes:
        return {side: by_side[side][-1] for side in SIDES}
    for drafter in by_side["drafter"]:
        for verifier in by_side["verifier"]:
            drafter_node = nodes.get(drafter["replica_id"], UNKNOWN_NODE)
            verifier_node = nodes.get(verifier["replica_id"], UNKNOWN_NODE)
            if UNKNOWN_NODE not in (drafter_node, verifier_node) and drafter_node != verifier_node:
                return {"drafter": drafter, "verifier": verifier}
    raise ray_cluster.ClusterError(
        "--across-nodes: no drafter and verifier replicas on different Ray nodes "
        f"(replica nodes: {dict(nodes)})"
    )


def measure(
    sessions: int, rounds: int, draft_tokens: int, threads: int, across_nodes: bool = False
) -> dict[str, Any]:
    replicas = ray_cluster.live_replicas()  # joins the cluster
    import ray

    nodes = replica_nodes(replicas)
    pair = choose_pair(replicas, nodes, across_nodes)
    address = {side: str(pair[side]["address"]) for side in SIDES}
    placement: dict[str, Any] = {
        side: {"address": address[side], "node_id": nodes[str(pair[side]["replica_id"])]}
        for side in SIDES
    }
    placement["tool_node_id"] = ray.get_runtime_context().get_node_id()
    from cluster.local import InProcess, build_local
    from cluster.presets import resolve_pair
    from cluster.routing.grpc_drafter import GrpcDrafter
    from cluster.routing.grpc_verifier import GrpcVerifier

    local = build_local(resolve_pair("tiny", device="cpu"))
    import torch

    torch.set_num_threads(threads)

    remote: list[float] = []
    in_process: list[float] = []
    bare: list[float] = []
    secret = ray_cluster.cluster_secret()
    with (
        GrpcDrafter(address["drafter"], secret=secret) as remote_drafter,
        GrpcVerifier(address["verifier"], secret=secret) as remote_verifier,
    ):
        for i in range(sessions + 1):
            r = _session_rounds(remote_drafter, remote_verifier, rounds, draft_tokens)
            lo = _session_rounds(
                InProcess(local.drafter), InProcess(local.verifier), rounds, draft_tokens
            )
            for _ in range(rounds):
                start = time.perf_counter()
                remote_drafter.stats()
                remote_verifier.stats()
                bare.append(time.perf_counter() - start)
            if i > 0:  # the first pair warms caches and connections
                remote.extend(r)
                in_process.extend(lo)
    paired = [a - b for a, b in zip(remote, in_process, strict=True)]
    return {
        "config": {
            "sessions": sessions,
            "rounds": rounds,
            "draft_tokens": draft_tokens,
            "in_process_threads": threads,
            "across_nodes": across_nodes,
        },
        "placement": placement,
        "remote_block": _summary(remote),
        "in_process_block": _summary(in_process),
        "overhead_per_block": _summary(paired),
        "bare_round_trip": _summary(bare),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--draft-tokens", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="in-process torch threads")
    parser.add_argument(
        "--across-nodes",
        action="store_true",
        help="drive a drafter and a verifier on two different Ray nodes",
    )
    args = parser.parse_args()
    # SIGTERM unwinds like Ctrl-C: each session's `finally` closes it on the replicas.
    with signals_raise():
        report = measure(
            args.sessions, args.rounds, args.draft_tokens, args.threads, args.across_nodes
        )
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
