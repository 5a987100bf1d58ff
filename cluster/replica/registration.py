"""Where a replica announces itself: the cluster's replica registry, as a replica sees it.

Contract: a `Registry` takes a replica's heartbeat (`ReplicaInfo`) and its leaving, waiting for
the answer only when asked to (`wait`); a failed call raises, and the replica host decides what
that means. `RayRegistry` is the application's registry actor, looked up by name through Ray
(imported lazily) and looked up again after a failed call.
"""

from __future__ import annotations

from typing import Any, Protocol

from cluster.wire.replica_info import REGISTRY_NAMESPACE, ReplicaInfo

REGISTER_TIMEOUT_S = 30.0
DEREGISTER_TIMEOUT_S = 5.0


class Registry(Protocol):
    """Where a replica announces itself (the registry actor, or a fake in tests)."""

    def heartbeat(self, info: ReplicaInfo, wait: bool) -> None: ...

    def remove(self, replica_id: str, wait: bool) -> None: ...


class RayRegistry:
    """The application's registry actor, looked up by name (again after a failed call: the
    actor may have restarted)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._actor: Any = None

    def heartbeat(self, info: ReplicaInfo, wait: bool) -> None:
        self._call("heartbeat", info.to_dict(), timeout_s=REGISTER_TIMEOUT_S if wait else None)

    def remove(self, replica_id: str, wait: bool) -> None:
        self._call("remove", replica_id, timeout_s=DEREGISTER_TIMEOUT_S if wait else None)

    def _call(self, method: str, argument: Any, timeout_s: float | None) -> None:
        import ray

        try:
            if self._actor is None:
                self._actor = ray.get_actor(self._name, namespace=REGISTRY_NAMESPACE)
            ref = getattr(self._actor, method).remote(argument)
            if timeout_s is not None:
                ray.get(ref, timeout=timeout_s)
        except Exception:
            self._actor = None
            raise
