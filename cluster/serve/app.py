"""The application builder: three or four Serve deployments from one config.

Drafter, Verifier and Router (the ingress) are separate deployments, each with its own replica count
and `ray_actor_options`, so the two sides can land on different node types and scale apart; with
`suffix_drafter.enabled` (the default) a fourth, SuffixDrafter, asks for CPUs only
(`drafter.suffix_deployment`), so its replicas land on any node, accelerator or none: with
`autoscaling.enabled`, Serve scales a side on the load its replicas report, by the policy in
cluster/serve/autoscaling.py. The deployments are thin shells over plain classes; `serve.deployment`
is applied here, from outside. `app_builder` is the import path for Serve config files (`serve
deploy`).

The public APIs have two doors. The default: the Router replicas' own gRPC and HTTP servers
(`config.front`, on by default: 9000 and 8000; `cluster.serve.front`), which the ingress starts.
The second: Serve's proxies, which whoever starts Serve sets up (`tandem serve`; a Serve config's
`grpc_options`, on `config.proxy_grpc_port`, with `GRPC_SERVICER_FUNCTIONS`, and
`http_options`).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from cluster.config import ReplicaGroupConfig, TandemConfig
from cluster.replica.host import DRAIN_TIMEOUT_S, SHUTDOWN_GRACE_S
from cluster.replica.registration import DEREGISTER_TIMEOUT_S
from cluster.routing.registry import ensure_registry, registry_name
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import SessionLimits
from cluster.runtime.model_spec import ModelSpec
from cluster.serve.ingress import MAX_CONCURRENT_REQUESTS, RouterIngress
from drafter.deployment import DrafterReplica
from drafter.suffix_deployment import SuffixReplica
from verifier.deployment import VerifierReplica

GRPC_SERVICER_FUNCTIONS = (
    "protos.generate_pb2_grpc.add_TandemServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
)
"""What Serve's gRPC proxy (the second door) must serve: the public API and the standard
health service."""
HEALTH_CHECK_PERIOD_S = 5.0
GRACEFUL_SHUTDOWN_S = DEREGISTER_TIMEOUT_S + DRAIN_TIMEOUT_S + SHUTDOWN_GRACE_S + 3.0
"""How long Serve lets a stopping replica take: to leave the registry, let its sessions end
(drain), and stop its server, with a margin; then Serve kills it."""


def replica_count(group: ReplicaGroupConfig) -> dict[str, Any]:
    """`serve.deployment` options that set a drafter or verifier group's size: fixed, or scaled
    on load (Serve then forbids `num_replicas`)."""
    if group.autoscaling.enabled:
        return {"autoscaling_config": group.autoscaling.serve_options()}
    return {"num_replicas": group.num_replicas}


def build_app(config: TandemConfig) -> Application:
    """Bind the three deployments of `config` into one application (needs a Ray connection)."""
    config.auth.check_usable()
    if config.router.autoscaling.enabled:
        raise InvalidArgumentError(
            "router.autoscaling: only drafters and verifiers scale on load; size the router "
            "with router.num_replicas"
        )
    ensure_registry(config.app_name)
    registry = registry_name(config.app_name)
    pair = config.pair()
    # One secret for the whole application: the router carries it, the replicas demand it.
    config = config.with_cluster_secret()
    drafter = _replica_deployment(
        "Drafter",
        DrafterReplica,
        config.drafter,
        pair.draft,
        config.drafter_limits,
        registry,
        config.cluster_secret,
    )
    verifier = _replica_deployment(
        "Verifier",
        VerifierReplica,
        config.verifier,
        pair.target,
        config.verifier_limits,
        registry,
        config.cluster_secret,
    )
    # The suffix drafter asks Ray for CPUs only: it lands on any node, accelerator or not.
    suffix = (
        serve.deployment(
            name="SuffixDrafter",
            **replica_count(config.suffix),
            ray_actor_options=config.suffix.ray_actor_options(),
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
        )(SuffixReplica).bind(config.suffix_drafter, registry, config.cluster_secret)
        if config.suffix_drafter.enabled
        else None
    )
    return serve.deployment(
        name="Router",
        num_replicas=config.router.num_replicas,
        ray_actor_options=config.router.ray_actor_options(),
        max_ongoing_requests=MAX_CONCURRENT_REQUESTS,
    )(RouterIngress).bind(config, drafter, verifier, suffix)


def app_builder(args: dict[str, Any]) -> Application:
    """Serve config entry point: `import_path: cluster.serve.app:app_builder`, `args:` a
    TandemConfig."""
    return build_app(TandemConfig.from_dict(args))


def _replica_deployment(
    name: str,
    body: type,
    group: ReplicaGroupConfig,
    model: ModelSpec,
    limits: SessionLimits,
    registry: str,
    secret: str | None,
) -> Application:
    """One side's replicas as a bound Serve deployment: its count or autoscaling, placement,
    health checks and drain time from `group`; the body gets its model, limits and placement."""
    return serve.deployment(
        name=name,
        **replica_count(group),
        ray_actor_options=group.ray_actor_options(),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
    )(body).bind(model, limits, registry, secret, group.torch_threads, cpus=tuple(group.cpus))
