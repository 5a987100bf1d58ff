"""`tandem serve`, `tandem status` and `tandem shutdown`: the service on a local Ray cluster.

`serve` joins the cluster recorded under TANDEM_HOME, or starts one on loopback, deploys the three
deployments and prints the addresses of both public APIs at two doors. The default door is the
router replicas' own servers, with no Serve proxy in between (`cluster.serve.front`):
`tandem.v1.Tandem` on gRPC (`--port`, default 9000) and the OpenAI-compatible HTTP API
(`--http-port`, default 8000; its base URL is `http://127.0.0.1:<port>/v1`). The second door is
Serve's proxies, serving the same two APIs: `--proxy-port` (default `--port` + 1) and
`--proxy-http-port` (default the HTTP port + 1; the application is served at the route prefix
`/`). A cluster already running keeps the proxies' ports it was started with (Serve starts its
proxies once per cluster). A config with no tenants
is served to one tenant, `local`, whose key the home keeps and the command line sends; `--detach`
leaves it running, otherwise Ctrl-C stops it. `status` shows deployments, replicas with their Ray
node, address, sessions, load, engine (batch, KV blocks used of total; all its figures in `--json`)
and the resources Ray granted them (their group's: how they were placed), and a summary of the
metrics every node's metrics agent serves (`cluster.metrics`): acceptance, tokens per verify pass,
pipeline hit rate, tokens generated, the queue, usage per tenant. `shutdown` removes the
application and stops the cluster if Tandem started it. Ray is imported only after the cluster
environment is set (see `cluster.serve.ray_cluster`). This module is the commands' I/O (the
cluster, Serve, the metrics agents); the flags and the config they make are
`cluster.cli.serve_flags`, the ports `cluster.cli.doors`, the status text
`cluster.cli.status_table`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cluster.cli import doors
from cluster.cli.serve_flags import add_serve_flags, config_from_flags
from cluster.cli.status_table import status_lines
from cluster.metrics.scrape import parse_prometheus, summarize
from cluster.runtime.errors import TandemError
from cluster.serve import loopback, ray_cluster

if TYPE_CHECKING:
    from cluster.config import ReplicaGroupConfig, TandemConfig

LOCAL_CONCURRENT = 256
"""Concurrent requests of the `local` tenant: the router's whole capacity (the owner's)."""
SCRAPE_TIMEOUT_S = 5.0


def add_to(commands: Any) -> None:
    serve = commands.add_parser("serve", help="start the service on a local Ray cluster")
    add_serve_flags(serve)
    serve.set_defaults(handler=serve_command)

    status = commands.add_parser("status", help="deployments, replicas, load and metrics")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(handler=status_command)

    shutdown = commands.add_parser("shutdown", help="stop the service (and its local cluster)")
    shutdown.set_defaults(handler=shutdown_command)


def _with_local_tenant(config: TandemConfig) -> TandemConfig:
    """With authentication on and no tenants configured, serve one tenant, `local`, whose key
    this home keeps (mode 0600) and the command line's clients send."""
    from cluster.api.tenants import AuthConfig, TenantConfig, hash_api_key

    if not config.auth.enabled or config.auth.tenants:
        return config
    key_hash = hash_api_key(ray_cluster.local_api_key())
    local = TenantConfig(ray_cluster.LOCAL_TENANT, key_hash, max_concurrent=LOCAL_CONCURRENT)
    _say(
        f"no tenants configured: serving tenant '{local.name}', API key in "
        f"{ray_cluster.home() / 'api_key'}"
    )
    return dataclasses.replace(config, auth=AuthConfig(tenants=(local,)))


def _replicas(group: ReplicaGroupConfig) -> str:
    """A group's replica count as deployed: fixed, or the bounds it autoscales within."""
    scaling = group.autoscaling
    if scaling.enabled:
        return f"{scaling.min_replicas}-{scaling.max_replicas} (autoscaled)"
    return str(group.num_replicas)


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _live_state() -> ray_cluster.ClusterState | None:
    state = ray_cluster.load_state()
    gone = state is not None and not ray_cluster.cluster_processes(state.temp_dir)
    if state is not None and gone and state.started_by_tandem:
        ray_cluster.clear_state()  # that cluster is gone; start afresh
        return None
    return state


def _kept_proxies(
    config: TandemConfig, proxy_http_port: int, state: ray_cluster.ClusterState
) -> tuple[TandemConfig, int]:
    """`config` and Serve's HTTP proxy port, with the proxies' ports of a running cluster:
    Serve starts its proxies once per cluster, and they keep their ports."""
    grpc_port = state.proxy_port or config.proxy_grpc_port
    http_port = state.proxy_http_port or proxy_http_port
    if (grpc_port, http_port) != (config.proxy_grpc_port, proxy_http_port):
        _say(
            f"the running cluster keeps Serve's proxies on ports {grpc_port} (gRPC) and "
            f"{http_port} (HTTP); --proxy-port and --proxy-http-port apply to a new cluster"
        )
    return dataclasses.replace(config, proxy_grpc_port=grpc_port), http_port


def serve_command(args: argparse.Namespace) -> int:
    config = config_from_flags(args)
    if config.cluster_secret is None:
        config = dataclasses.replace(config, cluster_secret=ray_cluster.cluster_secret())
    config = _with_local_tenant(config)
    proxy_http_port = doors.proxy_http_port(args, config)
    started = time.monotonic()
    state = _live_state()
    ours = state is None
    if state is None:
        ports = doors.public_ports(config, proxy_http_port)
        doors.check_ports_free(ports)
        # Ray's own servers get free ports too; not the ones this service is about to bind.
        loopback.reserve_ports(*(port for port, _ in ports))
        _say(f"starting a local Ray cluster in {ray_cluster.home()} ...")
        state = ray_cluster.start_cluster(args.num_cpus)
    else:
        config, proxy_http_port = _kept_proxies(config, proxy_http_port, state)
        if state.proxy_port is None:  # a cluster started elsewhere: Serve's proxies bind now
            proxies = (config.proxy_grpc_port, proxy_http_port)
            doors.check_ports_free(list(zip(proxies, doors.PORT_FLAGS[2:], strict=True)))
    step = "connecting to the local Ray cluster"
    try:
        ray_cluster.connect(state)
        step = "starting Serve's proxies"
        state = _start_proxies(config, proxy_http_port, state)
        step = "deploying the service"
        state = _deploy(config, state)
    except (KeyboardInterrupt, TandemError) as error:  # what this command started is stopped
        _say(_failed_start(state, ours, step, error))
        raise  # a TandemError keeps its status: a bad model is the input's fault, not Ray's
    except Exception as error:
        raise ray_cluster.ClusterError(_failed_start(state, ours, step, error)) from error
    _say(f"ready in {time.monotonic() - started:.1f} s")
    for line in doors.door_lines(state):
        print(line, flush=True)
    if args.detach:
        return 0
    _say("press Ctrl-C to stop")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        _say("stopping ...")
        return _shutdown(state)


def _failed_start(
    state: ray_cluster.ClusterState, ours: bool, step: str, error: BaseException
) -> str:
    """Stop what a start that failed at `step` started (the local cluster, if this command
    started it; one already running is left as it was) and return the one line that says what
    failed and what to try."""
    with contextlib.suppress(Exception):
        import ray

        ray.shutdown()  # this process's connection, before its cluster goes
    logs = Path(state.temp_dir) / "session_latest" / "logs"
    if ours:
        count = ray_cluster.stop_cluster(state)
        stopped = f"the local Ray cluster it started is stopped ({count} processes)"
    else:
        stopped = "the Ray cluster running before keeps running (`tandem shutdown` stops it)"
    if isinstance(error, KeyboardInterrupt):
        return f"interrupted while {step}; {stopped}"
    # A Ray task's error (RayTaskError) opens with the task's name: its cause says what failed.
    inner = getattr(error, "cause", None)
    failure = inner if isinstance(inner, BaseException) else error
    lines = str(failure).strip().splitlines()
    cause = f"{type(failure).__name__}: {lines[0] if lines else 'no message'}"
    return (
        f"the service did not start: {step} failed ({cause}); {stopped}. Ray's logs are in "
        f"{logs}. Try again once the machine has CPUs and memory to spare, or with fewer "
        "replicas (--config)"
    )


def _start_proxies(
    config: TandemConfig, proxy_http_port: int, state: ray_cluster.ClusterState
) -> ray_cluster.ClusterState:
    from ray import serve
    from ray.serve.config import gRPCOptions

    from cluster.serve.app import GRPC_SERVICER_FUNCTIONS

    # Serve's proxies: the second door (a Serve already running keeps its own, as recorded).
    serve.start(
        grpc_options=gRPCOptions(
            port=config.proxy_grpc_port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS)
        ),
        http_options={"host": loopback.LOOPBACK, "port": proxy_http_port},
    )
    state = dataclasses.replace(
        state, proxy_port=config.proxy_grpc_port, proxy_http_port=proxy_http_port
    )
    ray_cluster.save_state(state)  # the proxies run now, whatever becomes of the deployment
    return state


def _deploy(config: TandemConfig, state: ray_cluster.ClusterState) -> ray_cluster.ClusterState:
    from ray import serve

    from cluster.serve.app import build_app

    pair = config.pair()
    _say(
        f"deploying {_replicas(config.drafter)} drafter(s) [{pair.draft.source}"
        f"{'' if pair.draft.quantization == 'none' else ', ' + pair.draft.quantization}"
        f"{'' if not pair.draft.trimmed_vocab else f', {pair.draft.trimmed_vocab} ids'}], "
        f"{_replicas(config.verifier)} verifier(s) [{pair.target.source}] and "
        f"{config.router.num_replicas} router(s) ..."
    )
    # Route prefix `/`: OpenAI clients expect their base URL to end in /v1.
    serve.run(build_app(config), name=config.app_name, route_prefix="/")
    state = dataclasses.replace(
        state,
        grpc_port=config.front.grpc_port,
        http_port=config.front.http_port,
        app_name=config.app_name,
    )
    ray_cluster.save_state(state)
    return state


def _require_state() -> ray_cluster.ClusterState:
    state = ray_cluster.load_state()
    if state is None:
        raise ray_cluster.ClusterError(
            f"no Tandem service recorded in {ray_cluster.home()}; start one with tandem serve"
        )
    return state


def status_command(args: argparse.Namespace) -> int:
    state = _require_state()
    ray_cluster.connect(state)
    summary = _status(state)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    for line in status_lines(summary):
        print(line)
    return 0


def _status(state: ray_cluster.ClusterState) -> dict[str, Any]:
    import ray
    from ray import serve

    from cluster.routing.registry import get_registry

    app_name = state.app_name or "tandem"
    application = serve.status().applications.get(app_name)
    if application is None:
        raise ray_cluster.ClusterError(f"no application {app_name!r} is deployed")
    try:
        replicas = ray.get(get_registry(app_name).replicas.remote(), timeout=10)
    except ValueError:
        replicas = []
    endpoints = _metrics_endpoints()
    return {
        "app": app_name,
        # The default door (the routers' own servers; Serve's proxies where the config turns
        # one off), then the second (Serve's proxies).
        "address": doors.grpc_address(state.grpc_port or state.proxy_port),
        "http_address": doors.http_address(state.http_port or state.proxy_http_port),
        "proxy_address": doors.grpc_address(state.proxy_port),
        "proxy_http_address": doors.http_address(state.proxy_http_port),
        "status": _name(application.status),
        "deployments": {
            name: {
                "status": _name(d.status),
                "replicas": {_name(s): n for s, n in d.replica_states.items()},
            }
            for name, d in application.deployments.items()
        },
        "replicas": replicas,
        "metrics_endpoints": endpoints,
        "metrics": _scrape(endpoints),
    }


def _metrics_endpoints() -> list[str]:
    """host:port of every live node's metrics agent (on a local cluster, the `metrics_port`
    of cluster.json)."""
    import ray

    return sorted(
        f"{node['NodeManagerAddress']}:{node['MetricsExportPort']}"
        for node in ray.nodes()
        if node.get("Alive") and node.get("MetricsExportPort")
    )


def _scrape(endpoints: list[str]) -> dict[str, Any] | None:
    """The metrics summary of every endpoint that answers; None if none does."""
    samples = []
    answered = False
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # cluster-internal
    for endpoint in endpoints:
        try:
            with direct.open(f"http://{endpoint}/metrics", timeout=SCRAPE_TIMEOUT_S) as page:
                samples.extend(parse_prometheus(page.read().decode()))
            answered = True
        except OSError as error:
            _say(f"metrics at {endpoint} did not answer: {error}")
    return summarize(samples) if answered else None


def _name(value: Any) -> str:
    """A Serve status enum as its plain value (RUNNING, HEALTHY...)."""
    return str(getattr(value, "value", value))


def shutdown_command(args: argparse.Namespace) -> int:
    return _shutdown(_require_state())


def _shutdown(state: ray_cluster.ClusterState) -> int:
    try:
        ray_cluster.connect(state)
        import ray
        from ray import serve

        from cluster.routing.registry import get_registry

        serve.shutdown()
        with contextlib.suppress(ValueError):  # no registry: nothing to remove
            ray.kill(get_registry(state.app_name or "tandem"))
        ray.shutdown()
    except TandemError as error:
        _say(f"the cluster did not answer ({error}); stopping its processes")
    if state.started_by_tandem:
        count = ray_cluster.stop_cluster(state)
        _say(f"stopped the local Ray cluster ({count} processes)")
    else:
        ray_cluster.clear_state()
    print("Tandem is shut down", flush=True)
    return 0
