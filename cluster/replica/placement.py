"""Where a replica runs: the address others reach it at, its place in Ray and Serve, and its
CPU threads.

Contract: `node_ip_address`, `ray_placement` and `serve_rank` read Ray (imported lazily) and
report nothing outside it (`ray_placement`: no node, no resources; `serve_rank`: None);
`place_threads` pins the process to the CPUs asked for (refused with an
`InvalidArgumentError` naming them when it cannot) and sets torch's intra-op threads, by
default one per CPU the process may run on (`fitted_threads`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from cluster.runtime.errors import InvalidArgumentError


def node_ip_address() -> str:
    """The address other nodes reach this one at, as Ray knows it (127.0.0.1 on a local
    cluster started on loopback)."""
    import ray

    return str(ray.util.get_node_ip_address())


def ray_placement() -> tuple[str, dict[str, float]]:
    """Where Ray placed this replica: its node's id (hex) and the resources Ray granted its
    process (what `ReplicaInfo.node_id` and `resources` report); outside Ray (a process with
    no Ray connection, as in tests), nothing."""
    import ray

    if not ray.is_initialized():
        return "", {}
    context = ray.get_runtime_context()
    granted = context.get_assigned_resources()
    return str(context.get_node_id()), {str(k): float(v) for k, v in granted.items()}


def serve_rank() -> int | None:
    """This replica's rank within its Serve deployment (0 to replicas - 1; a replica Serve
    restarts takes the rank of the one it replaces); None outside a Serve replica."""
    import ray

    if not ray.is_initialized():
        return None
    from ray import serve
    from ray.serve.exceptions import RayServeException

    try:
        rank: Any = serve.get_replica_context().rank  # a `ReplicaRank`; a plain int in older Ray
    except RayServeException:
        return None
    return int(getattr(rank, "rank", rank))


def place_threads(num_threads: int, cpus: Sequence[int] = ()) -> int:
    """Pin this replica process to `cpus` (empty: wherever the OS likes) and set torch's
    intra-op threads; returns the thread count. 0 fits the machine: one thread per CPU the
    process may run on (after pinning), as a model in one plain process would use. Ray
    otherwise gives a replica with no reserved CPUs a single thread, which made the target
    alone slower through the service than in one process. On a small machine, a drafter and a
    verifier that each own a core stop evicting each other's caches while they run at once."""
    if cpus:
        try:
            os.sched_setaffinity(0, set(cpus))
        except (OSError, ValueError) as error:
            raise InvalidArgumentError(
                f"cannot pin the replica to CPUs {sorted(cpus)}: {error}"
            ) from error
    threads = num_threads if num_threads > 0 else fitted_threads()
    torch.set_num_threads(threads)
    return threads


def fitted_threads() -> int:
    """One intra-op thread per CPU this process may run on."""
    return max(1, len(os.sched_getaffinity(0)))
