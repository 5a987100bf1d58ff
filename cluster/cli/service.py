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
environment is set (see `cluster.serve.local_cluster`).
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

from cluster.metrics.catalog import replica_numbers
from cluster.metrics.scrape import parse_prometheus, summarize
from cluster.runtime.errors import InvalidArgumentError, TandemError
from cluster.runtime.model_spec import QUANTIZATIONS
from cluster.serve import local_cluster

if TYPE_CHECKING:
    from cluster.config import FrontConfig, ReplicaGroupConfig, TandemConfig

DEFAULT_NUM_CPUS = 8
"""Logical CPUs the local cluster advertises (replicas reserve none by default)."""
LOCAL_CONCURRENT = 256
"""Concurrent requests of the `local` tenant: the router's whole capacity (the owner's)."""
SCRAPE_TIMEOUT_S = 5.0
DEFAULT_PROXY_HTTP_PORT = 8001
"""Serve's HTTP proxy where the routers serve no HTTP of their own (`front.http_port: null`)
and no flag names one; otherwise the routers' HTTP port + 1."""
PORT_FLAGS = ("--port", "--http-port", "--proxy-port", "--proxy-http-port")
"""The flags that set the four public ports: the routers' own gRPC and HTTP servers (the
default door), Serve's gRPC and HTTP proxies (the second door)."""


def add_to(commands: Any) -> None:
    serve = commands.add_parser("serve", help="start the service on a local Ray cluster")
    serve.add_argument("--preset", help="model pair (default: tiny)")
    serve.add_argument("--config", help="YAML file with a TandemConfig")
    serve.add_argument("--drafters", type=int, help="drafter replicas")
    serve.add_argument("--verifiers", type=int, help="verifier replicas")
    serve.add_argument(
        "--port",
        type=_port,
        metavar="PORT",
        help="gRPC port of the public API, served by the router replicas themselves "
        "(default 9000, or the config's front.grpc_port)",
    )
    serve.add_argument(
        "--http-port",
        type=_port,
        metavar="PORT",
        help="port of the OpenAI-compatible HTTP API, served by the router replicas "
        "themselves (default 8000, or the config's front.http_port)",
    )
    serve.add_argument(
        "--proxy-port",
        type=_port,
        metavar="PORT",
        help="gRPC port of Serve's proxy, the same API through Serve: the second door "
        "(default: --port + 1, or the config's proxy_grpc_port)",
    )
    serve.add_argument(
        "--proxy-http-port",
        type=_port,
        metavar="PORT",
        help="port of Serve's HTTP proxy, the same OpenAI-compatible API through Serve: the "
        "second door (default: the HTTP port + 1)",
    )
    serve.add_argument(
        "--prompt-lookup",
        action=argparse.BooleanOptionalAction,
        help="copy recurring text before drafting (default: the config's, on)",
    )
    serve.add_argument(
        "--suffix-drafter",
        action=argparse.BooleanOptionalAction,
        help="draft from the tenant's earlier text on CPU-only replicas before the model "
        "(default: the config's, on)",
    )
    serve.add_argument("--suffix-drafters", type=int, help="suffix drafter replicas")
    serve.add_argument(
        "--adaptive-draft",
        action=argparse.BooleanOptionalAction,
        help="choose each round's length and pipelining per request (default: the config's, on)",
    )
    serve.add_argument(
        "--stream-interval-tokens",
        type=int,
        metavar="N",
        help="let a stream's chunks out once N tokens have gathered; the first and last at "
        "once (default: the config's, 0: every verifier step's)",
    )
    serve.add_argument(
        "--stream-interval-ms",
        type=float,
        metavar="MS",
        help="let a stream's chunks out once MS milliseconds have passed since the last "
        "(default: the config's, 0: none)",
    )
    serve.add_argument(
        "--draft-quantization",
        choices=QUANTIZATIONS,
        help="the draft model's weights (default: the config's, else the preset's)",
    )
    serve.add_argument(
        "--draft-vocab",
        type=int,
        metavar="N",
        help="the draft scores only the N most frequent token ids, 0 all of them "
        "(default: the config's, else the preset's)",
    )
    serve.add_argument("--num-cpus", type=int, default=DEFAULT_NUM_CPUS, help="for a new cluster")
    serve.add_argument("--detach", action="store_true", help="return once the service is up")
    serve.set_defaults(handler=serve_command)

    status = commands.add_parser("status", help="deployments, replicas, load and metrics")
    status.add_argument("--json", action="store_true", help="print one JSON object")
    status.set_defaults(handler=status_command)

    shutdown = commands.add_parser("shutdown", help="stop the service (and its local cluster)")
    shutdown.set_defaults(handler=shutdown_command)


def _config(args: argparse.Namespace) -> TandemConfig:
    # Imported here: it pulls in torch, which `tandem generate --address` must not wait for.
    from cluster.config import FrontConfig, TandemConfig

    config = TandemConfig.from_yaml(args.config) if args.config else TandemConfig()
    changes: dict[str, Any] = {}
    if args.preset:
        changes["models"] = dataclasses.replace(config.models, preset=args.preset)
    drafter = config.drafter
    if args.drafters is not None:
        drafter = dataclasses.replace(drafter, num_replicas=args.drafters)
    if args.draft_quantization is not None:
        drafter = dataclasses.replace(drafter, quantization=args.draft_quantization)
    if args.draft_vocab is not None:
        drafter = dataclasses.replace(drafter, trimmed_vocab=args.draft_vocab)
    if drafter is not config.drafter:
        changes["drafter"] = drafter
    if args.verifiers is not None:
        changes["verifier"] = dataclasses.replace(config.verifier, num_replicas=args.verifiers)
    changes["front"] = FrontConfig(
        grpc_port=_given(args.port, config.front.grpc_port),
        http_port=_given(args.http_port, config.front.http_port),
        host=local_cluster.LOOPBACK,
    )
    changes["proxy_grpc_port"] = _proxy_grpc_port(args, config, changes["front"])
    if args.prompt_lookup is not None:
        changes["prompt_lookup"] = dataclasses.replace(
            config.prompt_lookup, enabled=args.prompt_lookup
        )
    if args.suffix_drafter is not None:
        changes["suffix_drafter"] = dataclasses.replace(
            config.suffix_drafter, enabled=args.suffix_drafter
        )
    if args.suffix_drafters is not None:
        changes["suffix"] = dataclasses.replace(config.suffix, num_replicas=args.suffix_drafters)
    if args.adaptive_draft is not None:
        changes["draft_length"] = dataclasses.replace(
            config.draft_length, enabled=args.adaptive_draft
        )
    interval = {
        name: value
        for name, value in (
            ("stream_interval_tokens", args.stream_interval_tokens),
            ("stream_interval_ms", args.stream_interval_ms),
        )
        if value is not None
    }
    if interval:
        changes["api"] = dataclasses.replace(config.api, **interval)
    return dataclasses.replace(config, **changes)


def _port(text: str) -> int:
    """A port flag's value: a TCP port number."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 0 < port < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1..65535)")
    return port


def _given(flag: int | None, configured: int | None) -> int | None:
    return configured if flag is None else flag


def _proxy_grpc_port(args: argparse.Namespace, config: TandemConfig, front: FrontConfig) -> int:
    """Serve's gRPC proxy: `--proxy-port`, else the config's `proxy_grpc_port` where it sets one
    of its own, else one above the routers' gRPC port (9001 by default)."""
    from cluster.config import DEFAULT_PROXY_GRPC_PORT

    if args.proxy_port is not None:
        return int(args.proxy_port)
    if config.proxy_grpc_port != DEFAULT_PROXY_GRPC_PORT or front.grpc_port is None:
        return config.proxy_grpc_port
    return front.grpc_port + 1


def _proxy_http_port(args: argparse.Namespace, config: TandemConfig) -> int:
    """Serve's HTTP proxy: `--proxy-http-port`, else one above the routers' HTTP port."""
    if args.proxy_http_port is not None:
        return int(args.proxy_http_port)
    http_port = config.front.http_port
    return DEFAULT_PROXY_HTTP_PORT if http_port is None else http_port + 1


def _with_local_tenant(config: TandemConfig) -> TandemConfig:
    """With authentication on and no tenants configured, serve one tenant, `local`, whose key
    this home keeps (mode 0600) and the command line's clients send."""
    from cluster.api.tenants import AuthConfig, TenantConfig, hash_api_key

    if not config.auth.enabled or config.auth.tenants:
        return config
    key_hash = hash_api_key(local_cluster.local_api_key())
    local = TenantConfig(local_cluster.LOCAL_TENANT, key_hash, max_concurrent=LOCAL_CONCURRENT)
    _say(
        f"no tenants configured: serving tenant '{local.name}', API key in "
        f"{local_cluster.home() / 'api_key'}"
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


def _public_ports(config: TandemConfig, proxy_http_port: int) -> list[tuple[int, str]]:
    """The public ports `config` serves on, each with the flag that sets it (`PORT_FLAGS`):
    the routers' own (none where the config turns one off), then Serve's proxies."""
    ports = (config.front.grpc_port, config.front.http_port, config.proxy_grpc_port,
             proxy_http_port)  # fmt: skip
    return [(port, flag) for port, flag in zip(ports, PORT_FLAGS, strict=True) if port]


def _check_ports_free(ports: list[tuple[int, str]]) -> None:
    """Every public port differs from the others and is free, else the error names the flag
    that sets it. As the servers bind them (SO_REUSEADDR): a port whose last server just
    stopped is free, its closed connections in TIME_WAIT notwithstanding; one a server listens
    on is not."""
    flags: dict[int, str] = {}
    for port, flag in ports:
        if port in flags:
            raise InvalidArgumentError(
                f"{flags[port]} and {flag} are both port {port}; give each its own"
            )
        flags[port] = flag
        if not local_cluster.port_is_free(port):
            raise InvalidArgumentError(f"port {port} is in use; choose another with {flag}")


def _live_state() -> local_cluster.ClusterState | None:
    state = local_cluster.load_state()
    gone = state is not None and not local_cluster.cluster_processes(state.temp_dir)
    if state is not None and gone and state.started_by_tandem:
        local_cluster.clear_state()  # that cluster is gone; start afresh
        return None
    return state


def _kept_proxies(
    config: TandemConfig, proxy_http_port: int, state: local_cluster.ClusterState
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
    config = _config(args)
    if config.cluster_secret is None:
        config = dataclasses.replace(config, cluster_secret=local_cluster.cluster_secret())
    config = _with_local_tenant(config)
    proxy_http_port = _proxy_http_port(args, config)
    started = time.monotonic()
    state = _live_state()
    ours = state is None
    if state is None:
        ports = _public_ports(config, proxy_http_port)
        _check_ports_free(ports)
        # Ray's own servers get free ports too; not the ones this service is about to bind.
        local_cluster.reserve_ports(*(port for port, _ in ports))
        _say(f"starting a local Ray cluster in {local_cluster.home()} ...")
        state = local_cluster.start_cluster(args.num_cpus)
    else:
        config, proxy_http_port = _kept_proxies(config, proxy_http_port, state)
    step = "connecting to the local Ray cluster"
    try:
        local_cluster.connect(state)
        step = "starting Serve's proxies"
        state = _start_proxies(config, proxy_http_port, state)
        step = "deploying the service"
        state = _deploy(config, state)
    except (KeyboardInterrupt, TandemError) as error:  # what this command started is stopped
        _say(_failed_start(state, ours, step, error))
        raise  # a TandemError keeps its status: a bad model is the input's fault, not Ray's
    except Exception as error:
        raise local_cluster.ClusterError(_failed_start(state, ours, step, error)) from error
    _say(f"ready in {time.monotonic() - started:.1f} s")
    for line in door_lines(state):
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
    state: local_cluster.ClusterState, ours: bool, step: str, error: BaseException
) -> str:
    """Stop what a start that failed at `step` started (the local cluster, if this command
    started it; one already running is left as it was) and return the one line that says what
    failed and what to try."""
    with contextlib.suppress(Exception):
        import ray

        ray.shutdown()  # this process's connection, before its cluster goes
    logs = Path(state.temp_dir) / "session_latest" / "logs"
    if ours:
        count = local_cluster.stop_cluster(state)
        stopped = f"the local Ray cluster it started is stopped ({count} processes)"
    else:
        stopped = "the Ray cluster running before keeps running (`tandem shutdown` stops it)"
    if isinstance(error, KeyboardInterrupt):
        return f"interrupted while {step}; {stopped}"
    lines = str(error).strip().splitlines()
    cause = f"{type(error).__name__}: {lines[0] if lines else 'no message'}"
    return (
        f"the service did not start: {step} failed ({cause}); {stopped}. Ray's logs are in "
        f"{logs}. Try again once the machine has CPUs and memory to spare, or with fewer "
        "replicas (--config)"
    )


def _start_proxies(
    config: TandemConfig, proxy_http_port: int, state: local_cluster.ClusterState
) -> local_cluster.ClusterState:
    from ray import serve
    from ray.serve.config import gRPCOptions

    from cluster.serve.app import GRPC_SERVICER_FUNCTIONS

    # Serve's proxies: the second door (a Serve already running keeps its own, as recorded).
    serve.start(
        grpc_options=gRPCOptions(
            port=config.proxy_grpc_port, grpc_servicer_functions=list(GRPC_SERVICER_FUNCTIONS)
        ),
        http_options={"host": local_cluster.LOOPBACK, "port": proxy_http_port},
    )
    state = dataclasses.replace(
        state, proxy_port=config.proxy_grpc_port, proxy_http_port=proxy_http_port
    )
    local_cluster.save_state(state)  # the proxies run now, whatever becomes of the deployment
    return state


def _deploy(config: TandemConfig, state: local_cluster.ClusterState) -> local_cluster.ClusterState:
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
    local_cluster.save_state(state)
    return state


def door_lines(state: local_cluster.ClusterState) -> list[str]:
    """What `tandem serve` prints once the service is up: the default door first (the routers'
    own servers: the gRPC API, then the OpenAI-compatible API's base URL), then the second
    (Serve's proxies)."""
    lines = []
    if state.grpc_port:
        lines.append(f"gRPC API on {grpc_address(state.grpc_port)} (tandem.v1.Tandem)")
    if state.http_port:
        lines.append(f"OpenAI-compatible API on {http_address(state.http_port)}")
    proxies = [
        *([f"gRPC {grpc_address(state.proxy_port)}"] if state.proxy_port else []),
        *([f"HTTP {http_address(state.proxy_http_port)}"] if state.proxy_http_port else []),
    ]
    if proxies:
        lines.append(f"through Serve's proxies: {', '.join(proxies)}")
    return lines


def grpc_address(port: int | None) -> str:
    """The gRPC API's address on this machine (what `--address` takes)."""
    return f"{local_cluster.LOOPBACK}:{port}"


def http_address(port: int | None) -> str:
    """The OpenAI-compatible API's base URL on this machine (what OpenAI clients take)."""
    return f"http://{local_cluster.LOOPBACK}:{port}/v1"


def _require_state() -> local_cluster.ClusterState:
    state = local_cluster.load_state()
    if state is None:
        raise local_cluster.ClusterError(
            f"no Tandem service recorded in {local_cluster.home()}; start one with tandem serve"
        )
    return state


def status_command(args: argparse.Namespace) -> int:
    state = _require_state()
    local_cluster.connect(state)
    summary = _status(state)
    if args.json:
        print(json.dumps(summary, indent=2))
        return 0
    print(f"Tandem app {summary['app']!r}: {summary['status']}")
    print(f"  gRPC API on {summary['address']}; OpenAI-compatible API on {summary['http_address']}")
    print(
        f"  through Serve's proxies: gRPC {summary['proxy_address']}, "
        f"HTTP {summary['proxy_http_address']}"
    )
    for name, deployment in summary["deployments"].items():
        replicas = ", ".join(f"{n} {s}" for s, n in deployment["replicas"].items())
        print(f"  {name:<9} {deployment['status']:<10} {replicas}")
    _print_replicas(summary["replicas"])
    ratio_line = step_ratio_line(summary["replicas"])
    if ratio_line is not None:
        print(ratio_line)
    if summary["metrics"] is not None:
        _print_metrics(summary["metrics"])
    return 0


def _print_replicas(replicas: list[dict[str, Any]]) -> None:
    for line in replica_lines(replicas):
        print(line)


NODE_ID_CHARS = 12
"""How much of a Ray node id the replica table shows: enough to tell nodes apart (the ids are
random); `--json` has the whole id."""


def replica_lines(replicas: list[dict[str, Any]]) -> list[str]:
    """The replica table of `tandem status`: a header, then one line per replica: its Ray node
    (the id's first `NODE_ID_CHARS` hex digits) and internal gRPC address, its load fields, its
    engine's batch (smoothed, and the most since start) and KV blocks used of total, and the
    resources Ray granted it (its group's). `-` where there is nothing to show: no engine runs,
    no resources were asked for, or a replica too old to report its node."""
    shown = {"num_sessions", "num_cached_tokens"}
    load = sorted({f for r in replicas for f in replica_numbers(r)} - shown)
    lines = [
        f"  {'replica':<22} {'side':<8} {'node':<{NODE_ID_CHARS}} {'address':<17} "
        f"{'sessions':>8} {'cached tokens':>14}"
        + "".join(f" {field:>{max(len(field), 12)}}" for field in load)
        + f" {'batch (max)':>12} {'kv blocks':>15}  resources"
    ]
    for replica in replicas:
        batch, kv_blocks = _engine_columns(replica.get("engine"))
        node = str(replica.get("node_id") or "-")[:NODE_ID_CHARS]
        lines.append(
            f"  {replica['replica_id']:<22} {replica['side']:<8} {node:<{NODE_ID_CHARS}} "
            f"{replica['address']:<17} "
            f"{replica['num_sessions']:>8} {replica['num_cached_tokens']:>14}"
            + "".join(f" {_number(replica.get(f)):>{max(len(f), 12)}}" for f in load)
            + f" {batch:>12} {kv_blocks:>15}  {resource_list(replica.get('resources'))}"
        )
    return lines


def step_ratio(replicas: list[dict[str, Any]]) -> tuple[float, float, float] | None:
    """(draft step / target step, draft step s, target step s): one-token steps as the
    replicas measured them at start-up (`EngineStats.startup_base_s`), the mean over each
    side's model replicas; None where a side has none that measured (no drafter model, or
    replicas too old to report it)."""
    steps: dict[str, list[float]] = {"drafter": [], "verifier": []}
    for replica in replicas:
        engine = replica.get("engine")
        if not isinstance(engine, dict) or replica.get("side") not in steps:
            continue
        step_s = float(engine.get("startup_base_s") or 0) + float(
            engine.get("startup_per_token_s") or 0
        )
        if step_s > 0:
            steps[str(replica["side"])].append(step_s)
    if not steps["drafter"] or not steps["verifier"]:
        return None
    draft_s = sum(steps["drafter"]) / len(steps["drafter"])
    target_s = sum(steps["verifier"]) / len(steps["verifier"])
    return draft_s / target_s, draft_s, target_s


def step_ratio_line(replicas: list[dict[str, Any]]) -> str | None:
    """The measured draft-to-target step ratio in words; None where it is not known."""
    ratio = step_ratio(replicas)
    if ratio is None:
        return None
    value, draft_s, target_s = ratio
    return (
        f"  draft step / target step, measured at start-up: {value:.2f} "
        f"(drafter {1000 * draft_s:.1f} ms, verifier {1000 * target_s:.1f} ms a one-token step)"
    )


def resource_list(resources: Any) -> str:
    """Ray resources as `name=amount`, comma-separated by name (`-` for none)."""
    if not isinstance(resources, dict) or not resources:
        return "-"
    return ",".join(f"{name}={amount:g}" for name, amount in sorted(resources.items()))


def _engine_columns(engine: Any) -> tuple[str, str]:
    """Batch and KV columns of a replica's `engine` object, `-` where it has none."""
    if not isinstance(engine, dict):
        return "-", "-"
    figure = {name: _number(engine.get(name)) for name in _ENGINE_COLUMNS}
    batch = f"{figure['batch_sequences']} ({figure['max_batch_sequences']})"
    return batch, f"{figure['kv_blocks_used']}/{figure['kv_blocks_total']}"


_ENGINE_COLUMNS = ("batch_sequences", "max_batch_sequences", "kv_blocks_used", "kv_blocks_total")


def _number(value: Any) -> str:
    if value is None:
        return "-"
    return (
        f"{value:.2f}" if isinstance(value, float) and not value.is_integer() else str(int(value))
    )


def _print_metrics(metrics: dict[str, Any]) -> None:
    by_position = " ".join(_number(a) for a in metrics["acceptance_by_position"])
    print(
        f"  metrics: {metrics['requests']} requests, {metrics['generated_tokens']} tokens "
        f"generated; acceptance {_number(metrics['acceptance_rate'])} (by position: "
        f"{by_position or '-'}); {_number(metrics['tokens_per_verify_pass'])} tokens per "
        f"verify pass; pipeline hit rate {_number(metrics['pipeline_hit_rate'])}; "
        f"{metrics['running_requests']} running, {metrics['queued_requests']} queued"
    )
    columns = ("requests", "refused", "prompt_tokens", "generated_tokens", "drafted_tokens",
               "accepted_tokens")  # fmt: skip
    print(f"  {'tenant':<16}" + "".join(f" {c.removesuffix('_tokens'):>10}" for c in columns))
    for tenant, usage in metrics["tenants"].items():
        print(f"  {tenant:<16}" + "".join(f" {usage[c]:>10}" for c in columns))


def _status(state: local_cluster.ClusterState) -> dict[str, Any]:
    import ray
    from ray import serve

    from cluster.routing.registry import get_registry

    app_name = state.app_name or "tandem"
    application = serve.status().applications.get(app_name)
    if application is None:
        raise local_cluster.ClusterError(f"no application {app_name!r} is deployed")
    try:
        replicas = ray.get(get_registry(app_name).replicas.remote(), timeout=10)
    except ValueError:
        replicas = []
    endpoints = _metrics_endpoints()
    return {
        "app": app_name,
        # The default door (the routers' own servers; Serve's proxies where the config turns
        # one off), then the second (Serve's proxies).
        "address": grpc_address(state.grpc_port or state.proxy_port),
        "http_address": http_address(state.http_port or state.proxy_http_port),
        "proxy_address": grpc_address(state.proxy_port),
        "proxy_http_address": http_address(state.proxy_http_port),
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


def _shutdown(state: local_cluster.ClusterState) -> int:
    try:
        local_cluster.connect(state)
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
        count = local_cluster.stop_cluster(state)
        _say(f"stopped the local Ray cluster ({count} processes)")
    else:
        local_cluster.clear_state()
    print("Tandem is shut down", flush=True)
    return 0
