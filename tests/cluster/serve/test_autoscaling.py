"""Autoscaling on real load, and stopping a replica without losing a request.

- The rule (`desired_replicas`) and Serve's policy entry (`scale_on_load`) on duck-typed
  contexts; the policy's contract with the installed Ray Serve (a class instantiated with
  `policy_kwargs`, wrapped in Serve's delays); the config and the deployment options.
- What a replica reports: busy fraction from `busy_s` deltas, queue depth from calls inside its
  server, KV bytes from the model's config, and the same numbers for Serve's autoscaler.
- Draining: a stopping replica leaves the registry first, keeps serving its open sessions
  until they end, then stops its server; past the drain timeout it stops anyway (the router
  fails those requests over).
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
import torch

from cluster.api.tenants import AuthConfig
from cluster.autoscaling_config import POLICY_PATH, AutoscalingConfig
from cluster.config import ReplicaGroupConfig, TandemConfig
from cluster.replica.host import DRAIN_TIMEOUT_S, SHUTDOWN_GRACE_S, ReplicaHost, ReplicaShell
from cluster.replica.load import kv_cache_bytes_per_token
from cluster.replica.registration import DEREGISTER_TIMEOUT_S
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.waits import run
from cluster.runtime.engine_stats import EngineStats
from cluster.runtime.errors import InvalidArgumentError, ReplicaUnavailableError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import ReplicaStats
from cluster.serve import autoscaling
from cluster.serve.app import GRACEFUL_SHUTDOWN_S, replica_count
from cluster.serve.autoscaling import (
    Load,
    ScaleOnLoad,
    desired_replicas,
    saturated_busy,
    scale_on_load,
)
from cluster.wire.metadata import SECRET_METADATA_KEY
from cluster.wire.replica_info import ReplicaInfo
from protos import replica_pb2_grpc
from tests.polling import wait_until
from verifier.servicer import VerifierServicer
from verifier.verifier import Verifier

SECRET = "0123456789abcdef"
NEVER_S = 3600.0
"""Housekeeping interval for tests that sample by hand: the thread never ticks during them."""

# --- the rule ------------------------------------------------------------------------------


def test_scales_up_on_sessions() -> None:
    for sessions, replicas in [(0, 1), (2, 1), (3, 2), (4, 2), (5, 3), (8, 4)]:
        assert desired_replicas(Load(sessions, 0.0), 2, 0.7, 1, 10) == replicas, sessions


def test_scales_up_on_busy_time_alone() -> None:
    """Few sessions, but each keeps its replica computing: busy time asks for more."""
    assert desired_replicas(Load(2, 0.6), 16, 0.7, 1, 10) == 1
    assert desired_replicas(Load(2, 0.9), 16, 0.7, 1, 10) == 2
    assert desired_replicas(Load(2, 1.9), 16, 0.7, 1, 10) == 3


def test_stays_within_bounds() -> None:
    assert desired_replicas(Load(0, 0.0), 2, 0.7, 2, 4) == 2
    assert desired_replicas(Load(100, 5.0), 2, 0.7, 1, 4) == 4


def test_scales_down_only_once_the_load_fits_fewer_replicas() -> None:
    """From 3 replicas with a target of 2 sessions each: 5 sessions still need 3, 4 fit 2."""
    assert desired_replicas(Load(5, 0.0), 2, 0.7, 1, 10) == 3
    assert desired_replicas(Load(4, 0.0), 2, 0.7, 1, 10) == 2
    # An average that comes out a hair above a multiple of the target is that multiple.
    assert desired_replicas(Load(4 + 1e-9, 0.0), 2, 0.7, 1, 10) == 2


# --- Serve's policy entry -------------------------------------------------------------------


def context(
    metrics: dict[str, dict[str, float]] | None,
    target_num_replicas: int = 1,
    bounds: tuple[int, int] = (1, 4),
) -> Any:
    """What the policy reads of Serve's `AutoscalingContext`."""
    return SimpleNamespace(
        aggregated_metrics=metrics,
        target_num_replicas=target_num_replicas,
        capacity_adjusted_min_replicas=bounds[0],
        capacity_adjusted_max_replicas=bounds[1],
        policy_state={"kept": 1},
    )


def test_policy_sums_what_each_replica_reports() -> None:
    policy = scale_on_load(target_sessions=2, target_busy=0.5)
    sessions = {"r1": 3.0, "r2": 2.0}
    assert policy(context({"sessions": sessions, "busy": {"r1": 0.1, "r2": 0.1}}))[0] == 3
    assert policy(context({"sessions": {"r1": 1.0}, "busy": {"r1": 0.9}}))[0] == 2
    replicas, state = policy(context({"sessions": sessions}, bounds=(1, 2)))
    assert replicas == 2 and state == {"kept": 1}


def test_a_replica_with_a_nearly_full_kv_pool_counts_as_saturated() -> None:
    assert saturated_busy(0.1, kv_used=0.85, queue_wait_s=0.0) == 0.1  # at the limit: not yet
    assert saturated_busy(0.1, kv_used=0.86, queue_wait_s=0.0) == 1.0
    assert saturated_busy(0.1, kv_used=0.5, queue_wait_s=0.0, max_kv_used=0.4) == 1.0


def test_a_replica_whose_calls_wait_past_the_target_counts_as_saturated() -> None:
    assert saturated_busy(0.2, kv_used=0.0, queue_wait_s=0.5) == 0.2
    assert saturated_busy(0.2, kv_used=0.0, queue_wait_s=0.6) == 1.0
    assert saturated_busy(0.2, 0.0, queue_wait_s=0.2, target_queue_wait_s=0.1) == 1.0


def test_policy_scales_up_on_kv_use_and_queue_wait_per_replica() -> None:
    policy = scale_on_load(target_sessions=16, target_busy=0.7)
    idle = {"sessions": {"r1": 2.0, "r2": 2.0}, "busy": {"r1": 0.1, "r2": 0.1}}
    assert policy(context(idle))[0] == 1
    # r1's pool is nearly full: it counts as busy all the time, 1.1 / 0.7 -> 2 replicas,
    # though the average KV use over both replicas (0.45) is far from the limit.
    full = {**idle, "kv_used": {"r1": 0.9, "r2": 0.0}, "queue_wait_s": {"r1": 0.0, "r2": 0.0}}
    assert policy(context(full))[0] == 2
    waiting = {**idle, "kv_used": {"r1": 0.1, "r2": 0.1}, "queue_wait_s": {"r1": 0.0, "r2": 2.0}}
    assert policy(context(waiting))[0] == 2
    both = {**idle, "kv_used": {"r1": 0.95, "r2": 0.1}, "queue_wait_s": {"r1": 0.0, "r2": 2.0}}
    assert policy(context(both))[0] == 3  # 2.0 / 0.7
    # The thresholds are the policy's own.
    lenient = scale_on_load(target_sessions=16, target_busy=0.7, max_kv_used=0.95)
    assert lenient(context(full))[0] == 1


def test_policy_holds_until_replicas_report() -> None:
    policy = scale_on_load()
    assert policy(context(None, target_num_replicas=3))[0] == 3
    assert policy(context({}, target_num_replicas=2))[0] == 2


def test_policy_kwargs_are_checked() -> None:
    for kwargs in (
        {"target_sessions": 0},
        {"target_busy": 0},
        {"target_busy": 1.5},
        {"max_kv_used": 0},
        {"max_kv_used": 1.01},
        {"target_queue_wait_s": 0},
    ):
        with pytest.raises(ValueError):
            scale_on_load(**kwargs)  # type: ignore[arg-type]


def test_the_installed_serve_instantiates_the_policy_with_its_kwargs_and_delays_it() -> None:
    """The contract with Ray Serve as installed: `policy_function` names a class, so Serve
    passes it `policy_kwargs`; Serve wraps it in its delay logic, so a lower replica count is
    acted on only after `downscale_delay_s`."""
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig
    from ray.serve.config import AutoscalingContext

    options = AutoscalingConfig(
        enabled=True,
        target_sessions=3,
        target_busy=0.5,
        max_kv_used=0.9,
        target_queue_wait_s=0.25,
        upscale_delay_s=0,
        downscale_delay_s=60,
    ).serve_options()
    config = ServeAutoscalingConfig(**options)
    policy = _resolve_policy_callable(config.policy)
    assert isinstance(policy, ScaleOnLoad)
    assert (policy.target_sessions, policy.target_busy) == (3, 0.5)
    assert (policy.max_kv_used, policy.target_queue_wait_s) == (0.9, 0.25)
    wrapped = _apply_autoscaling_config(policy)

    def tick(sessions: float, current: int, now: float, state: dict[str, Any]) -> Any:
        return wrapped(
            AutoscalingContext(
                deployment_id=None,  # type: ignore[arg-type]
                deployment_name="Verifier",
                app_name="tandem",
                current_num_replicas=current,
                target_num_replicas=current,
                running_replicas=[],
                total_num_requests=0.0,
                total_queued_requests=0.0,
                aggregated_metrics={"sessions": {"r1": sessions}, "busy": {"r1": 0.0}},
                raw_metrics={},
                capacity_adjusted_min_replicas=1,
                capacity_adjusted_max_replicas=4,
                policy_state=state,
                last_scale_up_time=None,
                last_scale_down_time=None,
                current_time=now,
                config=config,
            )
        )

    replicas, state = tick(7, current=1, now=0, state={})
    assert replicas == 3  # upscale_delay_s 0: at once
    replicas, state = tick(1, current=3, now=1, state=state)
    assert replicas == 3  # wants 1, but the load has been low for less than 60 s


def test_policy_path_names_the_policy() -> None:
    module, name = POLICY_PATH.split(":")
    assert module == autoscaling.__name__ and getattr(autoscaling, name) is ScaleOnLoad


_UNPICKLE_WITHOUT_THE_PROJECT = """
import sys

class NoProject:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cluster", "drafter", "verifier", "protos"):
            raise ImportError(f"the project is not importable here: {name}")
        return None

sys.meta_path.insert(0, NoProject())
from ray import cloudpickle

policy = cloudpickle.loads(sys.stdin.buffer.read())(target_sessions=4, target_busy=0.5)
print(policy.target_sessions, policy.max_kv_used, policy.target_queue_wait_s)
"""


def test_the_policy_loads_where_the_project_cannot_be_imported() -> None:
    """Serve pickles the policy module by value into its controller: what it takes from the
    project (the config's default targets) must travel by value, not as an import."""
    from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

    config = ServeAutoscalingConfig(**AutoscalingConfig(enabled=True).serve_options())
    done = subprocess.run(
        [sys.executable, "-c", _UNPICKLE_WITHOUT_THE_PROJECT],
        input=config.policy.get_serialized_policy_def(),
        capture_output=True,
        cwd=tempfile.gettempdir(),
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()
    assert done.stdout.decode().split() == ["4", "0.85", "0.5"]


def test_replicas_report_the_metrics_the_policy_reads() -> None:
    info = ReplicaInfo("v", "verifier", "a:1", 3, 30, busy_fraction=0.25, queue_depth=2)
    stats = info.autoscaling_stats()
    assert stats == {
        autoscaling.SESSIONS: 3.0,
        autoscaling.BUSY: 0.25,
        autoscaling.QUEUE: 2.0,
        autoscaling.KV_USED: 0.0,  # no engine
        autoscaling.QUEUE_WAIT: 0.0,
    }
    assert all(type(value) is float for value in stats.values())  # what Serve accepts
    engine = EngineStats(kv_blocks_total=200, kv_blocks_used=150, queue_wait_s=0.125, queued=3)
    info = ReplicaInfo("v", "verifier", "a:1", 3, 30, engine=engine.to_dict())
    stats = info.autoscaling_stats()
    assert stats[autoscaling.KV_USED] == 0.75 and stats[autoscaling.QUEUE_WAIT] == 0.125
    assert all(type(value) is float for value in stats.values())


def test_an_engine_without_a_kv_pool_reports_none_used() -> None:
    serial = EngineStats(runner="serial", kv_blocks_total=0, kv_blocks_used=0)
    info = ReplicaInfo("v", "verifier", "a:1", 1, 10, engine=serial.to_dict())
    assert info.kv_used == 0.0 and info.autoscaling_stats()[autoscaling.KV_USED] == 0.0


# --- config and deployment options ----------------------------------------------------------


def test_autoscaling_is_off_by_default_and_parses_per_side() -> None:
    assert replica_count(TandemConfig().verifier) == {"num_replicas": 1}
    config = TandemConfig.from_dict(
        {
            "drafter": {"autoscaling": {"enabled": True, "max_replicas": 3}},
            "verifier": {"autoscaling": {"enabled": True, "target_sessions": 4}},
        }
    )
    drafter = replica_count(config.drafter)["autoscaling_config"]
    verifier = replica_count(config.verifier)["autoscaling_config"]
    assert drafter["max_replicas"] == 3 and verifier["max_replicas"] == 4
    assert drafter["policy"]["policy_function"] == "cluster.serve.autoscaling:scale_on_load"
    assert verifier["policy"]["policy_kwargs"] == {
        "target_sessions": 4,
        "target_busy": 0.7,
        "max_kv_used": 0.85,
        "target_queue_wait_s": 0.5,
    }


def test_serve_accepts_the_options() -> None:
    from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

    options = AutoscalingConfig(enabled=True, min_replicas=2, max_replicas=5).serve_options()
    config = ServeAutoscalingConfig(**options)
    assert (config.min_replicas, config.max_replicas) == (2, 5)
    assert config.policy.policy_kwargs == {
        "target_sessions": 16.0,
        "target_busy": 0.7,
        "max_kv_used": 0.85,
        "target_queue_wait_s": 0.5,
    }


@pytest.mark.parametrize(
    ("autoscaling", "message"),
    [
        ({"min_replicas": 0}, "min_replicas must be >= 1"),
        ({"min_replicas": 3, "max_replicas": 2}, r"max_replicas \(2\) must be >= min_replicas"),
        ({"target_sessions": 0}, "target_sessions must be > 0"),
        ({"target_busy": 1.2}, r"target_busy must be in \(0, 1\]"),
        ({"max_kv_used": 0}, r"max_kv_used must be in \(0, 1\]"),
        ({"target_queue_wait_s": -1}, "target_queue_wait_s must be > 0"),
        ({"downscale_delay_s": -1}, "downscale_delay_s must be >= 0"),
        ({"look_back_period_s": 0}, "look_back_period_s must be > 0"),
        ({"look_back_period_s": 2, "metrics_interval_s": 2}, "must be greater than metrics"),
        ({"target": 3}, r"verifier\.autoscaling\.target: unknown key"),
    ],
)
def test_bad_autoscaling_configs(autoscaling: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        TandemConfig.from_dict({"verifier": {"autoscaling": autoscaling}})


def test_the_router_does_not_scale_on_replica_load() -> None:
    from cluster.serve.app import build_app

    router = ReplicaGroupConfig(autoscaling=AutoscalingConfig(enabled=True))
    with pytest.raises(InvalidArgumentError, match=r"router\.autoscaling"):
        build_app(TandemConfig(router=router, auth=AuthConfig(enabled=False)))


def test_serve_waits_long_enough_for_a_drain() -> None:
    assert GRACEFUL_SHUTDOWN_S > DEREGISTER_TIMEOUT_S + DRAIN_TIMEOUT_S + SHUTDOWN_GRACE_S


# --- what a replica reports -----------------------------------------------------------------


class FakeStats:
    """A component's stats, set by the test."""

    def __init__(self) -> None:
        self.now = ReplicaStats(num_sessions=0, num_cached_tokens=0, busy_s=0.0)

    def __call__(self) -> ReplicaStats:
        return self.now


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def host(stats: Any, **kwargs: Any) -> ReplicaHost:
    options: dict[str, Any] = dict(
        side="verifier",
        add_servicer=lambda server: None,
        stats=stats,
        registry=None,
        host="127.0.0.1",
        secret=SECRET,
        heartbeat_interval_s=NEVER_S,
    )
    return ReplicaHost(**{**options, **kwargs})


def test_busy_fraction_is_the_share_of_each_interval_spent_computing() -> None:
    stats, clock = FakeStats(), Clock()
    stats.now = ReplicaStats(num_sessions=0, num_cached_tokens=0, busy_s=7.0)  # before hosting
    replica = host(stats, clock=clock, kv_bytes_per_token=1024)
    try:
        assert replica.info().busy_fraction == 0.0
        clock.now += 2.0
        stats.now = ReplicaStats(num_sessions=3, num_cached_tokens=50, busy_s=8.5)
        info = replica.sample()
        assert info.busy_fraction == pytest.approx(0.75)  # 1.5 s busy out of 2
        assert info.num_sessions == 3 and info.kv_bytes == 50 * 1024
        assert replica.info() == info
        clock.now += 1.0  # idle second
        assert replica.sample().busy_fraction == 0.0
        assert replica.autoscaling_stats() == {
            "sessions": 3.0,
            "busy": 0.0,
            "queue": 0.0,
            "kv_used": 0.0,
            "queue_wait_s": 0.0,
        }
    finally:
        replica.stop()


def test_each_sample_carries_the_engine_figures() -> None:
    stats = FakeStats()
    replica = host(stats)
    try:
        assert replica.info().engine is None  # no engine runs
        engine = EngineStats(steps=40, kv_blocks_total=64, kv_blocks_used=48, queue_wait_s=0.75)
        stats.now = ReplicaStats(num_sessions=2, num_cached_tokens=700, engine=engine)
        info = replica.sample()
        assert info.engine == engine.to_dict() and info.engine_stats() == engine
        assert info.queue_depth == 0  # the engine's own count of calls waiting for a step
        stats.now = ReplicaStats(2, 700, engine=dataclasses.replace(engine, queued=5))
        assert replica.sample().queue_depth == 5
        info = replica.sample()
        assert replica.autoscaling_stats()["kv_used"] == 0.75
        assert replica.autoscaling_stats()["queue_wait_s"] == 0.75
        # What the registry gets in a heartbeat, and reads back.
        assert ReplicaInfo.from_dict(info.to_dict()) == info
    finally:
        replica.stop()


def test_replica_info_from_other_versions_reads_back() -> None:
    info = ReplicaInfo("v", "verifier", "a:1", 1, 10, engine=EngineStats(steps=3).to_dict())
    # An older replica sends no engine; a newer one sends fields and figures unknown here.
    older = {k: v for k, v in info.to_dict().items() if k != "engine"}
    assert ReplicaInfo.from_dict(older).engine is None
    newer = info.to_dict()
    newer["gpu_bytes"] = 5
    newer["engine"] = {**newer["engine"], "prefix_hits": 9}
    read = ReplicaInfo.from_dict(newer)
    assert read.engine is not None and read.engine["prefix_hits"] == 9
    assert read.engine_stats() == EngineStats(steps=3)
    assert ReplicaInfo.from_dict({**older, "engine": "garbled"}).engine is None
    # An older replica says nothing of its placement; a garbled placement reads as none.
    before_nodes = {k: v for k, v in older.items() if k not in ("node_id", "resources")}
    read = ReplicaInfo.from_dict(before_nodes)
    assert (read.node_id, read.resources) == ("", {})
    garbled = ReplicaInfo.from_dict({**older, "node_id": 7, "resources": ["CPU"]})
    assert (garbled.node_id, garbled.resources) == ("", {})


def test_a_replica_reports_where_ray_placed_it() -> None:
    node_id = "ab" * 28  # a Ray node id: 28 bytes in hex
    resources = {"tandem_verifier_node": 0.01, "CPU": 1.0}
    replica = host(FakeStats(), node_id=node_id, resources=resources)
    try:
        info = replica.sample()
        assert (info.node_id, info.resources) == (node_id, resources)
        assert ReplicaInfo.from_dict(info.to_dict()) == info  # what the registry reads back
    finally:
        replica.stop()


def test_queue_depth_counts_calls_waiting_inside_the_server() -> None:
    release = threading.Event()
    entered = threading.Semaphore(0)

    def wait(request: bytes, context: grpc.ServicerContext) -> bytes:
        entered.release()
        release.wait(timeout=30)
        return b""

    def add(server: grpc.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(wait)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("test.Blocking", {"Wait": handler}),)
        )

    replica = host(FakeStats(), add_servicer=add)
    channel = grpc.insecure_channel(replica.address)
    try:
        call = channel.unary_unary("/test.Blocking/Wait")
        calls: list[Future[bytes]] = [
            call.future(b"", metadata=((SECRET_METADATA_KEY, SECRET),), timeout=30)
            for _ in range(3)
        ]
        for _ in calls:
            assert entered.acquire(timeout=30)
        assert replica.sample().queue_depth == 2  # one served, two waiting
        release.set()
        for done in calls:
            done.result()
        assert replica.sample().queue_depth == 0
    finally:
        release.set()
        channel.close()
        replica.stop()


def test_kv_bytes_per_token_matches_what_the_cache_holds(tiny_target: LoadedModel) -> None:
    tokens = 7
    with torch.no_grad():
        out = tiny_target.model(torch.arange(tokens).unsqueeze(0), use_cache=True)
    held = sum(
        t.numel() * t.element_size()
        for layer in out.past_key_values.layers
        for t in (layer.keys, layer.values)
    )
    assert kv_cache_bytes_per_token(tiny_target.model) * tokens == held


def test_kv_bytes_are_unknown_without_the_config_fields() -> None:
    model = SimpleNamespace(config=SimpleNamespace(), dtype=torch.float32)
    assert kv_cache_bytes_per_token(model) == 0  # type: ignore[arg-type]


class StatsShell(ReplicaShell):
    def __init__(self, stats: FakeStats) -> None:
        self._serve("drafter", lambda server: None, stats, None, "127.0.0.1", SECRET, lambda: 0)


def test_record_autoscaling_stats_is_what_the_replica_last_sampled() -> None:
    stats = FakeStats()
    stats.now = ReplicaStats(num_sessions=5, num_cached_tokens=9)
    shell = StatsShell(stats)
    try:
        assert shell.record_autoscaling_stats() == {
            "sessions": 5.0,
            "busy": 0.0,
            "queue": 0.0,
            "kv_used": 0.0,
            "queue_wait_s": 0.0,
        }
        assert shell.info()["num_sessions"] == 5 and shell.info()["busy_fraction"] == 0.0
        # Outside Ray, no node and no resources (under Serve: `ray_placement`).
        assert (shell.info()["node_id"], shell.info()["resources"]) == ("", {})
    finally:
        stats.now = ReplicaStats(num_sessions=0, num_cached_tokens=0)
        shell.__del__()  # what Serve calls: nothing open, so it stops at once
    assert shell._host.stopped


# --- draining -------------------------------------------------------------------------------


class FakeRegistry:
    """Records what a replica tells the registry, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.removed = threading.Event()

    def heartbeat(self, info: ReplicaInfo, wait: bool) -> None:
        self.events.append(("heartbeat", info.replica_id))

    def remove(self, replica_id: str, wait: bool) -> None:
        self.events.append(("remove", replica_id))
        self.removed.set()


@pytest.fixture
def verifier_replica(tiny_target: LoadedModel) -> Any:
    """A verifier on the tiny target, hosted with a fake registry and fast heartbeats."""
    verifier = Verifier(tiny_target)
    servicer = VerifierServicer(verifier)
    registry = FakeRegistry()
    replica = ReplicaHost(
        side="verifier",
        add_servicer=lambda server: replica_pb2_grpc.add_VerifierServicer_to_server(
            servicer, server
        ),
        stats=verifier.stats,
        registry=registry,
        host="127.0.0.1",
        secret=SECRET,
        evict_idle=verifier.evict_idle,
        heartbeat_interval_s=0.05,
    )
    try:
        yield replica, registry
    finally:
        replica.stop()


def test_a_stopping_replica_leaves_the_registry_then_serves_its_sessions_until_they_end(
    verifier_replica: Any,
) -> None:
    replica, registry = verifier_replica
    with GrpcVerifier(replica.address, timeout_s=30, secret=SECRET) as client:
        run(client.open_session("s1", [1, 2, 3], SamplingParams(), 0))
        run(client.open_session("s2", [4, 5, 6], SamplingParams(), 0))
        stopping = threading.Thread(target=replica.stop, kwargs={"drain_timeout_s": 60})
        stopping.start()
        assert registry.removed.wait(timeout=30)
        # Housekeeping samples the load, then would heartbeat: three fresh samples after the
        # removal mean at least two heartbeat turns that did not register it again.
        samples = [replica.info()]

        def sampled_again() -> bool:
            if replica.info() is not samples[-1]:
                samples.append(replica.info())
            return len(samples) > 3

        wait_until(sampled_again, what="three housekeeping turns after the removal")
        assert registry.events[-1] == ("remove", replica.replica_id)
        assert registry.events.count(("remove", replica.replica_id)) == 1
        # Draining: the server still serves the sessions it holds.
        assert client.stats().num_sessions == 2
        assert run(client.close_session("s1"))
        assert stopping.is_alive()
        assert run(client.close_session("s2"))
        stopping.join(timeout=30)
        assert not stopping.is_alive() and replica.stopped
        with pytest.raises(ReplicaUnavailableError):
            client.stats(timeout_s=5)


def test_a_drain_gives_up_after_its_timeout(verifier_replica: Any) -> None:
    replica, registry = verifier_replica
    with GrpcVerifier(replica.address, timeout_s=30, secret=SECRET) as client:
        run(client.open_session("forgotten", [1, 2, 3], SamplingParams(), 0))
        started = time.monotonic()
        replica.stop(drain_timeout_s=0.5)
        # It waited out the drain timeout for the session nobody closes, then stopped
        # anyway instead of waiting for the session's TTL.
        assert time.monotonic() - started >= 0.5
        assert replica.stopped
        assert registry.events[-1] == ("remove", replica.replica_id)
        with pytest.raises(ReplicaUnavailableError):
            client.stats(timeout_s=5)


def test_a_replica_whose_engine_died_leaves_the_registry_and_fails_its_health_check(
    tiny_target: LoadedModel,
) -> None:
    verifier = Verifier(tiny_target)
    registry = FakeRegistry()
    replica = ReplicaHost(
        side="verifier",
        add_servicer=lambda server: None,
        stats=verifier.stats,
        registry=registry,
        host="127.0.0.1",
        secret=SECRET,
        evict_idle=verifier.evict_idle,
        heartbeat_interval_s=0.05,
        alive=lambda: verifier.alive,
    )
    try:
        replica.check()
        wait_until(lambda: ("heartbeat", replica.replica_id) in registry.events, what="a beat")

        def crash() -> None:
            raise SystemError("a fault in the step loop")

        verifier.engine._step = crash  # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match="engine has stopped"):
            verifier.open_session("s", [1, 2, 3], SamplingParams(), 0)
        assert not verifier.alive
        assert registry.removed.wait(timeout=30)  # no new request is pinned to it
        with pytest.raises(RuntimeError, match="engine has stopped"):
            replica.check()  # Serve's health check fails: Serve replaces the replica
        removed_at = registry.events.index(("remove", replica.replica_id))
        time.sleep(0.3)  # six housekeeping turns
        assert ("heartbeat", replica.replica_id) not in registry.events[removed_at:]
    finally:
        replica.stop()
        verifier.close()
