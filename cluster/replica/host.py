"""Hosting a drafter or verifier replica: its own gRPC server, heartbeats, load, and draining.

Per-block traffic must not go through Serve (docs/architecture.md, invariant 4), so every replica
serves the internal API on its own port (to callers holding the cluster's shared secret only),
evicts sessions left idle past their TTL or past their request's time limit, and tells the cluster's
replica registry (a named Ray actor that the app builder creates) where it is (its address, its
Ray node and the resources Ray granted it) and how loaded it is, once per heartbeat. The
registry forgets a replica whose heartbeats stop, so a dead replica drops out by itself.

Load is measured here, where it is real: open sessions, the share of the last heartbeat interval
the component spent computing (`busy_fraction`, from its `ReplicaStats.busy_s`), calls waiting
for it (`queue_depth`), the bytes its KV caches hold (`kv_bytes`) and its batching engine's own
figures (`engine`: batch, KV pool, queue wait; `EngineStats`). Serve's request counts see none
of it, since blocks bypass Serve; the registry gets it in every heartbeat and Serve's
autoscaler through `ReplicaShell.record_autoscaling_stats` (see cluster/serve/autoscaling.py).

A replica that Serve stops (scaled down, redeployed) drains: it leaves the registry first, so no
new request is pinned to it, keeps serving while the sessions it holds end with their requests,
for up to `DRAIN_TIMEOUT_S`, and only then stops its server. A request still pinned to it after
that fails over in the router (re-pinned, re-prefilled from its token history), so a scale-down
costs time at worst, never tokens.

The registry is reached by name through Ray, imported lazily: this module is the adapter
layer, and the components below it never import Ray.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import grpc
import torch
from transformers import PreTrainedModel

from cluster.replica.rpc import start_server
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.session import ReplicaStats
from cluster.wire.replica_info import REGISTRY_NAMESPACE, ReplicaInfo

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
SHUTDOWN_GRACE_S = 2.0
"""How long a stopping server lets calls already running finish."""
DRAIN_TIMEOUT_S = 25.0
"""How long a stopping replica waits for its open sessions to end (out of Serve's graceful
shutdown period, `cluster.serve.app.GRACEFUL_SHUTDOWN_S`, which must cover this, the server's grace
and
deregistering)."""
DRAIN_POLL_S = 0.1
REGISTER_TIMEOUT_S = 30.0
DEREGISTER_TIMEOUT_S = 5.0


def kv_cache_bytes_per_token(model: PreTrainedModel) -> int:
    """KV cache bytes per cached token: layers x 2 (key and value) x KV heads x head size x
    element size, from the model's config; 0 if the config lacks one of them."""
    config = model.config
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None)
    hidden = getattr(config, "hidden_size", None)
    if head_dim is None and hidden is not None and heads:
        head_dim = hidden // heads
    if not (layers and kv_heads and head_dim):
        return 0
    return int(layers) * 2 * int(kv_heads) * int(head_dim) * model.dtype.itemsize


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


class InFlightCalls(grpc.ServerInterceptor):
    """Counts the calls inside a server's unary handlers (running, or waiting for the
    component's lock): cheap, exact, and what tells a queue from a busy replica."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count = 0

    @property
    def count(self) -> int:
        return self._count

    def _add(self, delta: int) -> None:
        with self._lock:
            self._count += delta

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Any],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        unary = handler.unary_unary

        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            self._add(1)
            try:
                return unary(request, context)
            finally:
                self._add(-1)

        return grpc.unary_unary_rpc_method_handler(
            counted,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


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


class ReplicaHost:
    """Runs a replica's gRPC server and its housekeeping thread: every second it evicts the
    sessions idle past their TTL or past their time limit, samples the replica's load, then
    heartbeats to the registry (if there is one)."""

    def __init__(
        self,
        side: str,
        add_servicer: Callable[[grpc.Server], None],
        stats: Callable[[], ReplicaStats],
        registry: Registry | None,
        host: str,
        secret: str,
        port: int = 0,
        evict_idle: Callable[[], int] = lambda: 0,
        kv_bytes_per_token: int = 0,
        clock: Callable[[], float] = time.monotonic,
        heartbeat_interval_s: float = HEARTBEAT_INTERVAL_S,
        node_id: str = "",
        resources: Mapping[str, float] | None = None,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        """`secret`: the cluster's shared secret, required of every call to this replica.
        `alive`: whether the component can serve (its engine runs); once it cannot, the replica
        leaves the registry (no new request is pinned to it) and fails Serve's health check (Serve
        replaces it).
        `evict_idle`: the component's eviction of idle and expired sessions; returns how many
        went. `kv_bytes_per_token`: see `kv_cache_bytes_per_token` (0: unknown). `node_id` and
        `resources`: where Ray placed it (`ray_placement`), reported as they are. `clock` and
        `heartbeat_interval_s` (how often housekeeping runs) are for tests."""
        self.side = side
        self._node_id = node_id
        self._resources = dict(resources or {})
        self.replica_id = f"{side}-{uuid.uuid4().hex[:12]}"
        self._in_flight = InFlightCalls()
        self._server, bound_port = start_server(
            add_servicer, host=host, port=port, secret=secret, interceptors=(self._in_flight,)
        )
        self.address = f"{host}:{bound_port}"
        self._stats = stats
        self._alive = alive
        self._evict_idle = evict_idle
        self._kv_bytes_per_token = kv_bytes_per_token
        self._clock = clock
        self._interval_s = heartbeat_interval_s
        self._registry = registry
        # Held while a heartbeat is sent, so that leaving the registry can wait out one
        # already on its way (it would register the replica again).
        self._beat_lock = threading.Lock()
        self._leaving = threading.Event()
        self._stopped = threading.Event()
        self._sample_lock = threading.Lock()
        self._sampled_at = clock()
        self._sampled_busy_s = stats().busy_s  # busy time from before hosting is not load
        self._latest = self.sample()
        if registry is not None:
            # Register before the constructor returns, so a replica Serve calls ready is
            # already discoverable.
            self._beat(wait=True)
        self._thread = threading.Thread(
            target=self._housekeeping, name=f"{side}-housekeeping", daemon=True
        )
        self._thread.start()

    def info(self) -> ReplicaInfo:
        """This replica as of its last sample (at most a heartbeat interval old)."""
        return self._latest

    def autoscaling_stats(self) -> dict[str, float]:
        return self._latest.autoscaling_stats()

    def sample(self) -> ReplicaInfo:
        """Read the component's stats and the load since the previous sample, and keep them as
        this replica's `info` (housekeeping does, every heartbeat)."""
        with self._sample_lock:
            stats = self._stats()
            now = self._clock()
            elapsed = now - self._sampled_at
            busy = stats.busy_s - self._sampled_busy_s
            self._sampled_at, self._sampled_busy_s = now, stats.busy_s
            self._latest = ReplicaInfo(
                replica_id=self.replica_id,
                side=self.side,
                address=self.address,
                num_sessions=stats.num_sessions,
                num_cached_tokens=stats.num_cached_tokens,
                pid=os.getpid(),
                busy_fraction=min(1.0, max(0.0, busy / elapsed)) if elapsed > 0 else 0.0,
                queue_depth=(
                    max(0, self._in_flight.count - 1)
                    if stats.engine is None
                    else stats.engine.queued
                ),
                kv_bytes=stats.num_cached_tokens * self._kv_bytes_per_token,
                engine=None if stats.engine is None else stats.engine.to_dict(),
                index_bytes=stats.index_bytes,
                index_proposals=stats.index_proposals,
                index_proposed=stats.index_proposed,
                node_id=self._node_id,
                resources=dict(self._resources),
            )
            return self._latest

    def _beat(self, wait: bool = False) -> None:
        assert self._registry is not None
        with self._beat_lock:
            if self._leaving.is_set():
                return
            try:
                self._registry.heartbeat(self._latest, wait=wait)
            except Exception:
                logger.warning("heartbeat to the replica registry failed", exc_info=True)

    def _housekeeping(self) -> None:
        while not self._stopped.wait(self._interval_s):
            if not self._alive():
                # Nothing this replica is asked can succeed: let no new request be pinned here.
                if not self._leaving.is_set():
                    logger.error(
                        "%s: its engine has stopped; leaving the registry", self.replica_id
                    )
                    self.leave()
                continue
            try:
                evicted = self._evict_idle()
            except Exception:
                logger.exception("evicting idle sessions failed")
            else:
                if evicted:
                    logger.info(
                        "%s evicted %d idle or expired session(s)", self.replica_id, evicted
                    )
            try:
                self.sample()
            except Exception:
                logger.exception("sampling the replica's load failed")
            if self._registry is not None:
                self._beat()

    def leave(self) -> None:
        """Stop heartbeating and leave the registry, so no new request is pinned here; the
        server goes on serving the sessions already open."""
        with self._beat_lock:
            self._leaving.set()
        if self._registry is not None:
            try:
                self._registry.remove(self.replica_id, wait=True)
            except Exception:
                # It drops out by itself once its heartbeats are missed.
                logger.warning("could not deregister %s", self.replica_id, exc_info=True)

    def drain(self, timeout_s: float) -> int:
        """Leave the registry, then wait up to `timeout_s` for the open sessions to end
        (closed by their requests, or evicted); returns how many are still open."""
        self.leave()
        started = self._clock()
        at_start = open_sessions = self._stats().num_sessions
        while open_sessions and self._clock() < started + timeout_s:
            time.sleep(DRAIN_POLL_S)
            open_sessions = self._stats().num_sessions
        logger.info(
            "%s drained: %d of %d open session(s) ended in %.1f s",
            self.replica_id,
            at_start - open_sessions,
            at_start,
            self._clock() - started,
        )
        return int(open_sessions)

    def stop(self, drain_timeout_s: float = 0.0) -> None:
        """Drain for up to `drain_timeout_s` (0: leave at once), then stop housekeeping and the
        server; safe to call twice. Requests whose sessions are still open fail over."""
        if self._stopped.is_set():
            return
        if drain_timeout_s > 0:
            left = self.drain(drain_timeout_s)
            if left:
                logger.warning(
                    "%s stops with %d session(s) still open; their requests fail over",
                    self.replica_id,
                    left,
                )
        else:
            self.leave()
        self._stopped.set()
        self._server.stop(SHUTDOWN_GRACE_S).wait(SHUTDOWN_GRACE_S + 1.0)

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def check(self) -> None:
        """Raise if the replica cannot serve (Serve's health check calls this)."""
        if self._stopped.is_set():
            raise RuntimeError(f"{self.replica_id} has stopped")
        if not self._thread.is_alive():
            raise RuntimeError(f"{self.replica_id} housekeeping thread died")
        if not self._alive():
            raise RuntimeError(f"{self.replica_id}: its engine has stopped")


class ReplicaShell:
    """What the drafter and verifier Serve deployment bodies share: hosting, info, load,
    health, and draining when Serve stops the replica."""

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
        kv_bytes_per_token: int = 0,
        alive: Callable[[], bool] = lambda: True,
    ) -> None:
        node_id, resources = ray_placement()
        self._host = ReplicaHost(
            side=side,
            add_servicer=add_servicer,
            stats=stats,
            registry=None if registry_name is None else RayRegistry(registry_name),
            host=bind_host or node_ip_address(),
            secret=secret,
            evict_idle=evict_idle,
            kv_bytes_per_token=kv_bytes_per_token,
            node_id=node_id,
            resources=resources,
            alive=alive,
        )

    def info(self) -> dict[str, Any]:
        return self._host.info().to_dict()

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metrics hook: this replica's load as last sampled
        (cheap: no call into the component)."""
        return self._host.autoscaling_stats()

    def check_health(self) -> None:
        self._host.check()

    def __del__(self) -> None:
        # Serve calls __del__ when it stops a replica (scale-down, redeploy, shutdown), within
        # its graceful shutdown period.
        host = getattr(self, "_host", None)
        if host is not None:
            host.stop(drain_timeout_s=DRAIN_TIMEOUT_S)
