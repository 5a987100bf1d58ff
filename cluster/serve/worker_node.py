"""`python -m cluster.serve.worker_node OPTIONS_JSON`: one more node of a local Ray cluster.

What `ray start --address` does for a worker node, with the head's address taken as given:
start a Ray `Node` from `RayParams(**options)` (`ray_cluster.worker_node_options` makes them)
and return once it runs; its processes outlive this one, as `ray start`'s do. Ray's own
one-machine clusters (`ray.cluster_utils`) start their nodes the same way.

Why not `ray start --address`: under a local cluster's environment
(RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, which keeps Ray on loopback) it refuses to start a worker
node, and without it swaps the head's 127.0.0.1 for the machine's interface address, where a
head on loopback does not listen. A process of its own, like `ray start`: the caller neither
forks Ray's processes (a signal handler's exception raised during a fork is lost) nor holds
their files open.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    (options_json,) = sys.argv[1:] if argv is None else argv
    options = json.loads(options_json)
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    Node(RayParams(**options), head=False, shutdown_at_exit=False, spawn_reaper=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
