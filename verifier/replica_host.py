"""Hosting a drafter or verifier replica: its own gRPC server, and heartbeats to the registry.

Per-block traffic must not go through Serve (DESIGN.md invariant 4), so every replica serves
the internal API on its own port (to callers holding the cluster's shared secret only), evicts
sessions left idle past their TTL or past their request's time limit, and tells the cluster's
replica registry (a named Ray actor that the app builder creates) where it is and how loaded it
is, once per heartbeat. The registry forgets a replica whose heartbeats stop, so a dead replica
drops out by itself.

The registry is reached by name through Ray, imported lazily: this module is the adapter
layer, and the components below it never import Ray.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import grpc
import torch

from verifier.errors import InvalidArgumentError
from verifier.rpc import start_server
from verifier.session import ReplicaStats

logger = logging.getLogger(__name__)

REGISTRY_NAMESPACE = "tandem"
"""Ray namespace of the replica registry actor."""
HEARTBEAT_INTERVAL_S = 1.0
SHUTDOWN_GRACE_S = 2.0


@dataclass(frozen=True)
class ReplicaInfo:
    """What a replica reports about itself in each heartbeat."""

    replica_id: str
    side: str
    """`drafter` or `verifier`."""
    address: str
    """host:port of its internal gRPC server."""
    num_sessions: int
    num_cached_tokens: int
    pid: int = 0
    """The replica's process id on its node (what `tandem loadtest --kill` signals)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReplicaInfo:
        return cls(**data)


def node_ip_address() -> str:
    """The address other nodes reach this one at, as Ray knows it (127.0.0.1 on a local
    cluster started on loopback)."""
    import ray

    return str(ray.util.get_node_ip_address())


def place_threads(num_threads: int, cpus: Sequence[int] = ()) -> None:
    """Pin this replica process to `cpus` (empty: wherever the OS likes) and set torch's
    intra-op threads (0 keeps torch's default). On a small machine, a drafter and a verifier
    that each own a core stop evicting each other's caches and stealing each other's time
    while they run at once (pipelining)."""
    if cpus:
        try:
            os.sched_setaffinity(0, set(cpus))
        except (OSError, ValueError) as error:
            raise InvalidArgumentError(
                f"cannot pin the replica to CPUs {sorted(cpus)}: {error}"
            ) from error
    if num_threads > 0:
        torch.set_num_threads(num_threads)


class ReplicaHost:
    """Runs a replica's gRPC server and its housekeeping thread: every second it evicts the
    sessions idle past their TTL or past their time limit, then heartbeats to the registry (if
    there is one)."""

    def __init__(
        self,
        side: str,
        add_servicer: Callable[[grpc.Server], None],
        stats: Callable[[], ReplicaStats],
        registry_name: str | None,
        host: str,
        secret: str,
        port: int = 0,
        evict_idle: Callable[[], int] = lambda: 0,
    ) -> None:
        """`secret`: the cluster's shared secret, required of every call to this replica.
        `evict_idle`: the component's eviction of idle and expired sessions; returns how many
        went."""
        self.side = side
        self.replica_id = f"{side}-{uuid.uuid4().hex[:12]}"
        self._server, bound_port = start_server(add_servicer, host=host, port=port, secret=secret)
        self.address = f"{host}:{bound_port}"
        self._stats = stats
        self._evict_idle = evict_idle
        self._registry_name = registry_name
        self._registry: Any = None
        self._stopped = threading.Event()
        if registry_name is not None:
            # Register before the constructor returns, so a replica Serve calls ready is
            # already discoverable.
            self._beat(wait=True)
        self._thread = threading.Thread(
            target=self._housekeeping, name=f"{side}-housekeeping", daemon=True
        )
        self._thread.start()

    def info(self) -> ReplicaInfo:
        stats = self._stats()
        return ReplicaInfo(
            replica_id=self.replica_id,
            side=self.side,
            address=self.address,
            num_sessions=stats.num_sessions,
            num_cached_tokens=stats.num_cached_tokens,
            pid=os.getpid(),
        )

    def _registry_actor(self) -> Any:
        if self._registry is None:
            import ray

            assert self._registry_name is not None
            self._registry = ray.get_actor(self._registry_name, namespace=REGISTRY_NAMESPACE)
        return self._registry

    def _beat(self, wait: bool = False) -> None:
        try:
            ref = self._registry_actor().heartbeat.remote(self.info().to_dict())
            if wait:
                import ray

                ray.get(ref, timeout=30)
        except Exception:
            # The registry may be restarting; look it up afresh on the next beat.
            self._registry = None
            logger.warning("heartbeat to the replica registry failed", exc_info=True)

    def _housekeeping(self) -> None:
        while not self._stopped.wait(HEARTBEAT_INTERVAL_S):
            try:
                evicted = self._evict_idle()
            except Exception:
                logger.exception("evicting idle sessions failed")
            else:
                if evicted:
                    logger.info(
                        "%s evicted %d idle or expired session(s)", self.replica_id, evicted
                    )
            if self._registry_name is not None:
                self._beat()

    def stop(self) -> None:
        """Deregister, stop heartbeats and the server; safe to call twice."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        if self._registry_name is not None:
            try:
                self._registry_actor().remove.remote(self.replica_id)
            except Exception:
                logger.warning("could not deregister %s", self.replica_id, exc_info=True)
        self._server.stop(SHUTDOWN_GRACE_S)

    def check(self) -> None:
        """Raise if the replica cannot serve (Serve's health check calls this)."""
        if self._stopped.is_set():
            raise RuntimeError(f"{self.replica_id} has stopped")
        if not self._thread.is_alive():
            raise RuntimeError(f"{self.replica_id} housekeeping thread died")


class ReplicaShell:
    """What the drafter and verifier Serve deployment bodies share: hosting, info, health."""

    _host: ReplicaHost

    def _serve(
        self,
        side: str,
        add_servicer: Callable[[grpc.Server], None],
        stats: Callable[[], ReplicaStats],
        registry_name: str | None,
        bind_host: str | None,
        secret: str,
        evict_idle: Callable[[], int],
    ) -> None:
        self._host = ReplicaHost(
            side=side,
            add_servicer=add_servicer,
            stats=stats,
            registry_name=registry_name,
            host=bind_host or node_ip_address(),
            secret=secret,
            evict_idle=evict_idle,
        )

    def info(self) -> dict[str, Any]:
        return self._host.info().to_dict()

    def check_health(self) -> None:
        self._host.check()

    def __del__(self) -> None:
        # Serve calls __del__ when it shuts a replica down.
        host = getattr(self, "_host", None)
        if host is not None:
            host.stop()
