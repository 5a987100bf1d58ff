"""The service as a user starts it, once per test session, for every module that needs it.

`service`: `tandem serve --preset tiny --drafters 2 --verifiers 2 --detach` (with the default
CPU-only suffix drafter) in its own TANDEM_HOME and on free ports, with a config that names its
tenants (`TENANT_KEYS`: `main`, whose key the command line gets through $TANDEM_API_KEY,
`small`, with tight limits, and `private`, kept out of the suffix index); stopped by `tandem
shutdown` at the end. Its two doors: the default, the router replicas' own servers, at `address`
(gRPC) and `http_url` (the OpenAI-compatible API's base URL); the second, Serve's proxies, at
`proxy_address` and `proxy_http_url`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cluster.api.client import TandemClient
from cluster.api.tenants import hash_api_key, new_api_key
from cluster.config import CLUSTER_SECRET_ENV
from cluster.routing.grpc_drafter import GrpcDrafter
from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.serve.loopback import free_door_ports, port_arguments
from cluster.serve.ray_cluster import API_KEY_ENV, cluster_processes

TENANT_KEYS = {"main": new_api_key(), "small": new_api_key(), "private": new_api_key()}
SMALL_LIMITS = {"max_concurrent": 1, "max_tokens_per_request": 400}
TANDEM = str(Path(sys.executable).with_name("tandem"))
SERVE_TIMEOUT_S = 300
MAX_TOKENS = 32


@pytest.fixture(scope="session")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    home = Path("/tmp") / f"tandem-test-{os.getpid()}"  # short: Ray's socket paths are limited
    # The service settles its own cluster secret in its home (none from the environment).
    env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_SECRET_ENV, API_KEY_ENV)}
    env["TANDEM_HOME"] = str(home)
    env[API_KEY_ENV] = TENANT_KEYS["main"]  # what `tandem generate`, `loadtest`... send
    config = tmp_path_factory.mktemp("config") / "tenants.yaml"
    tenants = [
        {"name": "main", "key_sha256": hash_api_key(TENANT_KEYS["main"]), "max_concurrent": 64},
        {"name": "small", "key_sha256": hash_api_key(TENANT_KEYS["small"]), **SMALL_LIMITS},
        # Its text never enters the suffix index: its repeated requests run at the model's pace.
        {
            "name": "private",
            "key_sha256": hash_api_key(TENANT_KEYS["private"]),
            "max_concurrent": 8,
            "suffix_index": False,
        },
    ]
    config.write_text(yaml.safe_dump({"auth": {"tenants": tenants}}))
    ports = free_door_ports()
    port, http_port, proxy_port, proxy_http_port = ports.values()
    started = time.monotonic()
    serve = subprocess.run(
        # Fixed rounds (no adaptive plan, no lookup): the tests count blocks and pipeline hits.
        [TANDEM, "serve", "--preset", "tiny", "--drafters", "2", "--verifiers", "2",
         "--no-adaptive-draft", "--no-prompt-lookup", *port_arguments(ports), "--detach",
         "--config", str(config)],
        env=env, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, check=False,
    )  # fmt: skip
    cold_start_s = time.monotonic() - started
    try:
        assert serve.returncode == 0, serve.stderr[-3000:]
        # The default door: the router replicas' own servers (cluster.serve.front).
        address = f"127.0.0.1:{port}"
        http_url = f"http://127.0.0.1:{http_port}/v1"  # the OpenAI-compatible API's base URL
        # The second door: the same two APIs through Serve's proxies.
        proxy_address = f"127.0.0.1:{proxy_port}"
        proxy_http_url = f"http://127.0.0.1:{proxy_http_port}/v1"
        doors = [  # printed in this order: the default door first
            f"gRPC API on {address} (tandem.v1.Tandem)",
            f"OpenAI-compatible API on {http_url}",
            f"through Serve's proxies: gRPC {proxy_address}, HTTP {proxy_http_url}",
        ]
        assert "\n".join(doors) in serve.stdout, serve.stdout
        status = subprocess.run(
            [TANDEM, "status", "--json"], env=env, capture_output=True, text=True,
            timeout=120, check=True,
        )  # fmt: skip
        yield {
            "address": address,
            "http_url": http_url,
            "proxy_address": proxy_address,
            "proxy_http_url": proxy_http_url,
            "env": env,
            "home": home,
            "status": json.loads(status.stdout),
            "cold_start_s": cold_start_s,
            "secret": (home / "cluster_secret").read_text(),
        }
    finally:
        down = subprocess.run(
            [TANDEM, "shutdown"], env=env, capture_output=True, text=True, timeout=180,
            check=False,
        )  # fmt: skip
        assert down.returncode == 0, down.stderr[-3000:]
        # Every process of the cluster is gone, Ray's retitled agents included.
        assert cluster_processes(str(home / "ray")) == []


@pytest.fixture(scope="session")
def client(service: dict[str, object]) -> Iterator[TandemClient]:
    with TandemClient(str(service["address"]), timeout_s=120, api_key=TENANT_KEYS["main"]) as c:
        yield c


def replica_sessions(
    service: dict[str, object], replicas: list[dict[str, object]] | None = None
) -> dict[str, int]:
    """Open sessions per replica, asked of each replica directly: `replicas`, else those of
    the service's first status reading (fast to poll; stale once a test killed a replica)."""
    counts = {}
    for replica in replicas if replicas is not None else service["status"]["replicas"]:  # type: ignore[attr-defined]
        kind = GrpcVerifier if replica["side"] == "verifier" else GrpcDrafter
        with kind(replica["address"], timeout_s=10, secret=service["secret"]) as port:
            counts[replica["replica_id"]] = port.stats().num_sessions
    return counts


def wait_until_no_sessions(service: dict[str, object], timeout_s: float = 30) -> dict[str, int]:
    """Open sessions per live replica, once none are left or after `timeout_s`."""
    replicas = live_replicas(service)
    deadline = time.monotonic() + timeout_s
    while True:
        counts = replica_sessions(service, replicas)
        if not any(counts.values()) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def live_replicas(service: dict[str, object], side: str | None = None) -> list[dict[str, object]]:
    """The registry's live replicas (of `side`, if given) now, not the fixture's first reading."""
    status = subprocess.run(
        [TANDEM, "status", "--json"], env=service["env"], capture_output=True, text=True,  # type: ignore[arg-type]
        timeout=120, check=True,
    )  # fmt: skip
    replicas: list[dict[str, object]] = json.loads(status.stdout)["replicas"]
    return [r for r in replicas if side is None or r["side"] == side]
