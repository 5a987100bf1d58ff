"""The application builder: three Serve deployments from one config.

Drafter, Verifier and Router (the ingress) are separate deployments, each with its own replica
count and `ray_actor_options`, so the two sides can land on different node types and scale
apart. The deployments are thin shells over plain classes; `serve.deployment` is applied here,
from outside. `app_builder` is the import path for Serve config files (`serve deploy`).
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from cluster.config import TandemConfig
from cluster.ingress import MAX_CONCURRENT_REQUESTS, RouterIngress
from cluster.registry import ensure_registry, registry_name
from drafter.deployment import DrafterReplica
from verifier.deployment import VerifierReplica

GRPC_SERVICER_FUNCTIONS = (
    "protos.generate_pb2_grpc.add_TandemServicer_to_server",
    "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server",
)
"""What Serve's gRPC proxy must serve: the public API and the standard health service."""
HEALTH_CHECK_PERIOD_S = 5.0
# Sessions pinned to a replica that is shutting down get this long to finish.
GRACEFUL_SHUTDOWN_S = 30.0


def build_app(config: TandemConfig) -> Application:
    """Bind the three deployments of `config` into one application (needs a Ray connection)."""
    config.auth.check_usable()
    ensure_registry(config.app_name)
    registry = registry_name(config.app_name)
    pair = config.models.pair()
    # One secret for the whole application: the router carries it, the replicas demand it.
    config = config.with_cluster_secret()
    drafter = serve.deployment(
        name="Drafter",
        num_replicas=config.drafter.num_replicas,
        ray_actor_options=config.drafter.ray_actor_options(),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
    )(DrafterReplica).bind(
        pair.draft,
        config.drafter_limits,
        registry,
        config.cluster_secret,
        config.drafter.torch_threads,
        cpus=tuple(config.drafter.cpus),
    )
    verifier = serve.deployment(
        name="Verifier",
        num_replicas=config.verifier.num_replicas,
        ray_actor_options=config.verifier.ray_actor_options(),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=GRACEFUL_SHUTDOWN_S,
    )(VerifierReplica).bind(
        pair.target,
        config.verifier_limits,
        registry,
        config.cluster_secret,
        config.verifier.torch_threads,
        cpus=tuple(config.verifier.cpus),
    )
    return serve.deployment(
        name="Router",
        num_replicas=config.router.num_replicas,
        ray_actor_options=config.router.ray_actor_options(),
        max_ongoing_requests=MAX_CONCURRENT_REQUESTS,
    )(RouterIngress).bind(config, drafter, verifier)


def app_builder(args: dict[str, Any]) -> Application:
    """Serve config entry point: `import_path: cluster.app:app_builder`, `args:` a TandemConfig."""
    return build_app(TandemConfig.from_dict(args))
