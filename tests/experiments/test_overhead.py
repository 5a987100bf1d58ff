"""Which replicas `experiments.overhead` drives: any one per side, or a drafter and a
verifier
on two different Ray nodes (`--across-nodes`). The choice is plain data in, data out."""

from __future__ import annotations

import pytest

from cluster.serve.ray_cluster import ClusterError
from experiments.overhead import UNKNOWN_NODE, choose_pair, replica_nodes


def replica(replica_id: str) -> dict[str, object]:
    return {"replica_id": replica_id, "side": replica_id.split("-")[0], "address": "", "pid": 1}


REPLICAS = [replica(r) for r in ("drafter-a", "drafter-b", "verifier-a", "verifier-b")]


def chosen(nodes: dict[str, str], across_nodes: bool) -> tuple[object, object]:
    pair = choose_pair(REPLICAS, nodes, across_nodes)
    return pair["drafter"]["replica_id"], pair["verifier"]["replica_id"]


def test_by_default_the_last_replica_of_each_side_wherever_it_runs() -> None:
    same = {str(r["replica_id"]): "node-1" for r in REPLICAS}
    assert chosen(same, across_nodes=False) == ("drafter-b", "verifier-b")
    assert chosen({}, across_nodes=False) == ("drafter-b", "verifier-b")


def test_across_nodes_takes_the_first_pair_on_different_nodes() -> None:
    nodes = {"drafter-a": "n1", "drafter-b": "n2", "verifier-a": "n1", "verifier-b": "n3"}
    assert chosen(nodes, across_nodes=True) == ("drafter-a", "verifier-b")


def test_across_nodes_skips_replicas_whose_node_is_unknown() -> None:
    nodes = {"drafter-a": UNKNOWN_NODE, "drafter-b": "n2", "verifier-a": UNKNOWN_NODE}
    with pytest.raises(ClusterError, match="no drafter and verifier replicas on different"):
        chosen(nodes, across_nodes=True)
    nodes["verifier-b"] = "n1"
    assert chosen(nodes, across_nodes=True) == ("drafter-b", "verifier-b")


def test_a_side_with_no_replica_is_named() -> None:
    with pytest.raises(ClusterError, match="no live verifier replica"):
        choose_pair(REPLICAS[:2], {}, across_nodes=False)


def test_a_replica_s_node_is_the_one_it_reports() -> None:
    reported = [{**r, "node_id": f"node-of-{r['replica_id']}"} for r in REPLICAS]
    assert replica_nodes(reported) == {
        r["replica_id"]: f"node-of-{r['replica_id']}" for r in REPLICAS
    }
