"""Hosting a drafter or verifier replica: its own gRPC server, heartbeats, load, and draining.

Per-block traffic must not go through Serve (docs/architecture.md, invariant 4), so every replica
serves the internal API on its own port (to callers holding the cluster's shared secret only),
evicts sessions left idle past their TTL or past their request's time limit, and tells the cluster's
replica registry (`cluster.replica.registration`) where it is (its address, its Ray node and the
resources Ray granted it: `cluster.replica.placement`) and how loaded it is, once per heartbeat.
The registry forgets a replica whose heartbeats stop, so a dead replica drops out by itself.

Load is measured here, where it is real: open sessions, the share of the last heartbeat interval
the component spent computing (`busy_fraction`, from its `ReplicaStats.busy_s`), calls waiting
for it (`queue_depth`), the bytes its KV caches hold (`kv_bytes`; `cluster.replica.load`) and its
batching engine's own figures (`engine`: batch, KV pool, queue wait; `EngineStats`). Serve's
request counts see none of it, since blocks bypass Serve; the registry gets it in every heartbeat
and Serve's autoscaler through `ReplicaShell.record_autoscaling_stats` (see
cluster/serve/autoscaling.py).

A replica that Serve stops (scaled down, redeployed) drains: it leaves the registry first, so no
new request is pinned to it, keeps serving while the sessions it holds end with their requests,
for up to `DRAIN_TIMEOUT_S`, and only then stops its server. A request still pinned to it after
that fails over in the router (re-pinned, re-prefilled from its token history), so a scale-down
costs time at worst, never tokens. This is the adapter layer: the components below it never
import Ray.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from cluster.replica.load import InFlightCalls
from cluster.replica.placement import node_ip_address, ray_placement
from cluster.replica.registration import RayRegistry, Registry
from cluster.replica.rpc import start_server
from cluster.runtime.session import ReplicaStats
from cluster.wire.replica_info import ReplicaInfo

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
