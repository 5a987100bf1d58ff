"""The Ray cluster `tandem serve` runs on this machine: find it, start it on loopback, stop only
it (the ports its servers get: `cluster.serve.loopback`).

State lives under `TANDEM_HOME` (default /tmp/tandem): the Ray temp dir and `cluster.json`,
which records the cluster's address, whether Tandem started it, and the ports it serves on
(the public APIs', at both doors: the routers' own servers, then Serve's proxies; the metrics
agent's, `metrics_port`, whose `/metrics` page Prometheus scrapes for Tandem's metrics,
`cluster.metrics`, beside Ray's own).
Separate homes never collide, so tests and a user's cluster can run side by side.

The cluster is started with `ray start --head` bound to 127.0.0.1 so that it outlives the
command that started it (`--detach`) and every replica's internal gRPC server listens on
loopback only (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` stops Ray from swapping 127.0.0.1 for
the machine's interface address; Ray reads it when first imported, so `connect` must run
before anything imports Ray). Ray's token authentication is on, with a token generated once
per home (`auth_token`, mode 0600) handed to every Ray process through the environment.
Stopping signals exactly the processes whose command line names this home's Ray temp dir
(`ray stop` would stop every Ray cluster of the user).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from cluster.runtime.errors import TandemError
from cluster.serve.loopback import LOOPBACK, free_port, wait_ports_free

logger = logging.getLogger(__name__)

HOME_ENV = "TANDEM_HOME"
DEFAULT_HOME = "/tmp/tandem"
STOP_GRACE_S = 10.0
START_TIMEOUT_S = 120.0


class ClusterError(TandemError):
    status = "UNAVAILABLE"


@dataclass(frozen=True)
class ClusterState:
    """What `cluster.json` records."""

    address: str
    """The Ray GCS address, host:port."""
    temp_dir: str
    started_by_tandem: bool
    grpc_port: int | None = None
    """The public gRPC API, the default door: the router replicas' own server
    (`cluster.serve.front`); None: none."""
    http_port: int | None = None
    """The OpenAI-compatible API, the default door: the router replicas' own server; None:
    none."""
    app_name: str | None = None
    proxy_port: int | None = None
    """Serve's gRPC proxy: the same gRPC API, the second door."""
    proxy_http_port: int | None = None
    """Serve's HTTP proxy: the same OpenAI-compatible API, the second door. Serve starts it
    once per cluster: a cluster keeps the port it was first served on."""
    metrics_port: int | None = None
    """Where the head node's metrics agent serves Prometheus (`/metrics`); None: unknown (a
    cluster Tandem did not start, or one started before Tandem recorded it)."""

    def serves_grpc_on(self, port: str | int) -> bool:
        """`port` is this service's gRPC API: the routers' own server or Serve's proxy."""
        return str(port) in {str(p) for p in (self.grpc_port, self.proxy_port) if p}


_OLD_DOORS = ("direct_port", "direct_http_port")
"""What `cluster.json` named the routers' own servers when Serve's proxies were the first door
(`grpc_port`, `http_port`)."""


def _state_of(record: dict[str, Any]) -> ClusterState:
    """A `cluster.json` record as a state; one written before the routers' own servers became
    the default door is read with its ports in their new places."""
    if any(key in record for key in _OLD_DOORS):
        record = {key: value for key, value in record.items() if key not in _OLD_DOORS} | {
            "grpc_port": record.get("direct_port"),
            "http_port": record.get("direct_http_port"),
            "proxy_port": record.get("grpc_port"),
            "proxy_http_port": record.get("http_port"),
        }
    return ClusterState(**record)


def home() -> Path:
    return Path(os.environ.get(HOME_ENV, DEFAULT_HOME))


def _state_path() -> Path:
    return home() / "cluster.json"


def load_state() -> ClusterState | None:
    try:
        return _state_of(dict(json.loads(_state_path().read_text())))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as error:
        raise ClusterError(f"{_state_path()} is unreadable ({error}); remove it") from error


def save_state(state: ClusterState) -> None:
    _state_path().parent.mkdir(parents=True, exist_ok=True)
    _state_path().write_text(json.dumps(asdict(state), indent=2) + "\n")


def clear_state() -> None:
    _state_path().unlink(missing_ok=True)


WORKER_NICENESS = "0"
"""Niceness of the cluster's worker processes (Ray's default is 15). The replicas are the
workload: at 15, any of Ray's own daemons that wakes up takes a core from a model forward at
once, and with two or more intra-op threads the other threads then wait for the straggler at
every operator. Measured on 2 cores (the round profiler of that time, qwen-coder, two intra-op
threads per replica): the target alone 1056 ms/token at 15, 766 at 0."""


def _private_token(name: str) -> Path:
    """A file of this home holding a random token, made (mode 0600) if missing."""
    path = home() / name
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_hex(32))
    return path


def cluster_secret() -> str:
    """The shared secret of this home's service's internal API: $TANDEM_CLUSTER_SECRET, else
    one made once per home (`cluster_secret`, mode 0600). `tandem serve` deploys with it and
    the measuring tools that call replicas directly send it."""
    from cluster.config import CLUSTER_SECRET_ENV

    return os.environ.get(CLUSTER_SECRET_ENV) or _private_token("cluster_secret").read_text()


API_KEY_ENV = "TANDEM_API_KEY"
"""Environment variable holding the API key the command line's clients send."""
LOCAL_TENANT = "local"


def local_api_key() -> str:
    """The key of the `local` tenant that `tandem serve` adds when its config names no
    tenants: made once per home (`api_key`, mode 0600)."""
    return _private_token("api_key").read_text()


def api_key() -> str | None:
    """The API key the command line sends: $TANDEM_API_KEY, else this home's local key (if
    `tandem serve` made one), else None."""
    key = os.environ.get(API_KEY_ENV)
    if key:
        return key
    path = home() / "api_key"
    return path.read_text() if path.exists() else None


def ray_environment() -> dict[str, str]:
    """Environment for every Ray process of this home's cluster (token created if missing)."""
    token = _private_token("auth_token")
    return {
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN_PATH": str(token),
        "RAY_worker_niceness": WORKER_NICENESS,
    }


def _ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def start_cluster(num_cpus: int, extra_arguments: Sequence[str] = ()) -> ClusterState:
    """Start a Ray head node on loopback, in this home; returns its state (saved).
    `extra_arguments`: more `ray start` flags (`cluster.tools.demo_nodes` moves the head's
    other fixed ports)."""
    temp_dir = home() / "ray"
    temp_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    metrics_port = free_port()
    command = [
        _ray_bin(), "start", "--head",
        f"--node-ip-address={LOOPBACK}", f"--port={port}", f"--temp-dir={temp_dir}",
        f"--num-cpus={num_cpus}", "--include-dashboard=false", "--disable-usage-stats",
        f"--metrics-export-port={metrics_port}", *extra_arguments,
    ]  # fmt: skip
    _start(command, "ray start failed")
    state = ClusterState(
        address=f"{LOOPBACK}:{port}",
        temp_dir=str(temp_dir),
        started_by_tandem=True,
        metrics_port=metrics_port,
    )
    save_state(state)
    return state


def worker_node_options(
    head_address: str,
    temp_dir: Path,
    num_cpus: int,
    resources: Mapping[str, float],
    env: Mapping[str, str] | None = None,
    object_store_bytes: int | None = None,
) -> dict[str, Any]:
    """Ray's `RayParams` of a worker node joining `head_address` on loopback, in its own
    `temp_dir`, offering `resources`: the options `ray start --address` would set, with a free
    port for whatever Ray would put on a fixed one (other nodes on 127.0.0.1 hold those).
    `env`: its raylet's environment on top of this process's (its workers inherit it)."""
    return {
        "gcs_address": head_address, "node_ip_address": LOOPBACK, "temp_dir": str(temp_dir),
        "num_cpus": num_cpus, "resources": dict(resources), "env_vars": dict(env or {}),
        "object_store_memory": object_store_bytes,
        "dashboard_agent_listen_port": free_port(), "metrics_export_port": free_port(),
        "node_manager_port": 0, "min_worker_port": 0, "max_worker_port": 0,
        # One log monitor per machine is enough (the head's); the driver takes no logs.
        "include_log_monitor": False,
    }  # fmt: skip


def start_worker_node(options: Mapping[str, Any]) -> None:
    """Start a worker node of this home's cluster from its `worker_node_options`
    (`cluster.serve.worker_node`, which says why not `ray start --address`); its processes
    outlive this one and stop with the processes of its temp dir."""
    command = [sys.executable, "-m", "cluster.serve.worker_node", json.dumps(dict(options))]
    _start(command, f"the node in {options['temp_dir']} did not start")


def _start(command: Sequence[str], failure: str) -> None:
    """Run a command that starts a node, in this home's Ray environment; raises ClusterError
    (`failure`, then its output) if it fails."""
    result = subprocess.run(
        list(command),
        capture_output=True,
        text=True,
        timeout=START_TIMEOUT_S,
        check=False,
        env={**os.environ, **ray_environment()},
    )
    if result.returncode != 0:
        raise ClusterError(f"{failure}:\n{result.stdout}{result.stderr}")


def connect(state: ClusterState) -> None:
    """Join the cluster as a driver (no-op if already connected)."""
    os.environ.update(ray_environment())
    import ray
    from ray._private import ray_constants

    if ray.is_initialized():
        return
    if ray_constants.ENABLE_RAY_CLUSTER:
        raise ClusterError(
            "Ray was imported before the cluster environment was set; "
            "call connect() before importing ray"
        )
    try:
        ray.init(
            address=state.address,
            namespace="tandem",
            logging_level=logging.WARNING,
            log_to_driver=False,
            _node_ip_address=LOOPBACK,
        )
    except ConnectionError as error:
        raise ClusterError(f"no Ray cluster answers at {state.address}: {error}") from error


def live_replicas() -> list[dict[str, Any]]:
    """Join the service `tandem serve` started and return its registry's live replicas
    (`ReplicaInfo` dicts: id, side, address, sessions, cached tokens, pid)."""
    state = load_state()
    if state is None:
        raise ClusterError("no running service: start one with tandem serve")
    connect(state)
    import ray

    from cluster.routing.registry import get_registry

    return list(ray.get(get_registry(state.app_name or "tandem").replicas.remote()))


def replica_addresses() -> dict[str, str]:
    """The internal gRPC address of one replica per side (`drafter`, `verifier`): what
    the measuring tools (`experiments.overhead`) drive
    directly."""
    addresses = {r["side"]: r["address"] for r in live_replicas()}
    missing = {"drafter", "verifier"} - addresses.keys()
    if missing:
        raise ClusterError(f"the service has no live {' or '.join(sorted(missing))} replica")
    return addresses


def cluster_processes(temp_dir: str) -> list[int]:
    """Pids of the processes whose command line names `temp_dir`, or that hold a file open in
    it: Ray's dashboard and runtime-env agents retitle themselves (`ray::DashboardAgent`), and
    outlive the raylet unless they are signalled too."""
    needle = temp_dir.encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle in (entry / "cmdline").read_bytes() or _holds_file_in(entry, temp_dir):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def _holds_file_in(process: Path, folder: str) -> bool:
    prefix = folder.rstrip("/") + "/"
    for fd in (process / "fd").iterdir():
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(fd).startswith(prefix):
                return True
    return False


def stop_cluster(state: ClusterState) -> int:
    """Stop the cluster of `state` (SIGTERM, then SIGKILL after a grace) and return once its
    processes are gone and its ports can be bound again, so that a new cluster can start at
    once; returns how many processes were signalled. Forgets the state."""
    pids = cluster_processes(state.temp_dir)
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and cluster_processes(state.temp_dir):
        time.sleep(0.2)
    for pid in cluster_processes(state.temp_dir):
        _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline and cluster_processes(state.temp_dir):
        time.sleep(0.1)  # a killed process is gone once the kernel has reaped it
    held = wait_ports_free(cluster_ports(state), STOP_GRACE_S)
    if held:
        logger.warning("ports %s are still held after the cluster stopped", held)
    clear_state()
    return len(pids)


def cluster_ports(state: ClusterState) -> list[int]:
    """The ports a cluster of `state` listened on: its GCS, the public APIs (both doors), the
    metrics."""
    ports = [
        state.grpc_port, state.http_port, state.proxy_port, state.proxy_http_port,
        state.metrics_port,
    ]  # fmt: skip
    _, _, gcs_port = state.address.rpartition(":")
    if gcs_port.isdigit():
        ports.append(int(gcs_port))
    return [port for port in ports if port]


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited on its own meanwhile
        os.kill(pid, sig)
