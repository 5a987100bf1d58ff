"""deploy/serve-local.yaml, deployed the way deploy/README.md says: `ray start --head` with Ray
token authentication, then `serve deploy` (Serve's own CLI, through the dashboard's REST API)
with the token, then generation through both doors: the router replicas' own servers (the
file's `args.front`, the default door) and Serve's proxies (its `grpc_options` and
`http_options`), each with its gRPC API and its OpenAI-compatible API.

The cluster is this test's own: its own TANDEM_HOME (Ray temp dir and token, as
`cluster.serve.ray_cluster` keeps them), free ports for everything Ray would otherwise put on a
fixed one (GCS, dashboard, dashboard agent, client server) and for the public APIs' four
ports (the config is copied with its ports rewritten), so it runs beside the session's `tandem
serve` cluster (tests/cluster/conftest.py). It is stopped by signalling exactly its own processes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from cluster.api.client import TandemClient
from cluster.config import CLUSTER_SECRET_ENV
from cluster.serve.loopback import LOOPBACK, free_port
from cluster.serve.ray_cluster import (
    API_KEY_ENV,
    HOME_ENV,
    ClusterState,
    cluster_processes,
    ray_environment,
    stop_cluster,
)
from tests.conftest import CODE_PROMPT

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SERVE_LOCAL = Path(__file__).resolve().parents[2] / "deploy" / "serve-local.yaml"
BIN = Path(sys.executable).parent
START_TIMEOUT_S = 240
DASHBOARD_STARTUP_TIMEOUT_S = 150
DEPLOY_TIMEOUT_S = 240
CLI_TIMEOUT_S = 120
STOP_TIMEOUT_S = 10
MAX_TOKENS = 24
INDEXED_WITHIN_S = 10.0


@dataclass(frozen=True)
class RayHead:
    env: dict[str, str]
    """Environment of every command that talks to it (RAY_AUTH_MODE=token and the token)."""
    dashboard: str
    """The dashboard's address: what `serve` commands talk to."""


@pytest.fixture
def ray_head(monkeypatch: pytest.MonkeyPatch) -> Iterator[RayHead]:
    """A Ray head on loopback with token authentication and a dashboard (which `serve deploy`
    talks to), in a TANDEM_HOME of its own; stopped, and its home removed, afterwards."""
    home = Path("/tmp") / f"tandem-deploy-{os.getpid()}"  # short: Ray's socket paths are limited
    monkeypatch.setenv(HOME_ENV, str(home))
    ports = {name: free_port() for name in ("gcs", "dashboard", "agent", "client")}
    env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_SECRET_ENV, API_KEY_ENV)}
    env |= {HOME_ENV: str(home), **ray_environment()}  # RAY_AUTH_MODE=token and the token
    # Ray gives its dashboard 60 s to come up; 2 cores shared with other clusters (the
    # session's service, other suites) can take longer, and `serve deploy` needs it.
    env["RAY_DASHBOARD_STARTUP_TIMEOUT_S"] = str(DASHBOARD_STARTUP_TIMEOUT_S)
    state = ClusterState(
        address=f"{LOOPBACK}:{ports['gcs']}", temp_dir=str(home / "ray"), started_by_tandem=True
    )
    try:
        started = subprocess.run(
            [str(BIN / "ray"), "start", "--head", f"--node-ip-address={LOOPBACK}",
             f"--port={ports['gcs']}", f"--temp-dir={state.temp_dir}", "--num-cpus=2",
             "--include-dashboard=true", f"--dashboard-host={LOOPBACK}",
             f"--dashboard-port={ports['dashboard']}",
             f"--dashboard-agent-listen-port={ports['agent']}",
             f"--ray-client-server-port={ports['client']}", "--disable-usage-stats"],
            env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False,
        )  # fmt: skip
        assert started.returncode == 0, started.stderr[-3000:]
        yield RayHead(env, dashboard=f"http://{LOOPBACK}:{ports['dashboard']}")
    finally:
        stop_cluster(state)
        # Killed processes can take a moment to be gone from /proc.
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while cluster_processes(state.temp_dir) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert cluster_processes(state.temp_dir) == []
        shutil.rmtree(home, ignore_errors=True)


def serve_cli(
    head: RayHead, *args: str, timeout_s: float = CLI_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "serve"), *args, "--address", head.dashboard],
        env=head.env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )


def test_serve_deploy_of_the_local_config_serves_exactly_the_target_output(
    ray_head: RayHead, tmp_path: Path
) -> None:
    config = yaml.safe_load(SERVE_LOCAL.read_text())
    (app,) = config["applications"]
    # Serve's proxies (the second door) and the routers' own servers (the default door).
    proxy_port = config["grpc_options"]["port"] = app["args"]["proxy_grpc_port"] = free_port()
    proxy_http_port = config["http_options"]["port"] = free_port()
    grpc_port = app["args"]["front"]["grpc_port"] = free_port()
    # The plan's rounds, not the measured modes: on a CPU the tiny pair's start-up steps say
    # the draft model cannot pay, and a request would then start with lookup only; this test
    # shows the file's drafter drafting.
    app["args"]["draft_length"] = {"enabled": True, "measured_modes": False}
    http_port = app["args"]["front"]["http_port"] = free_port()
    copy = tmp_path / "serve-local.yaml"
    copy.write_text(yaml.safe_dump(config))

    deployed = serve_cli(ray_head, "deploy", str(copy))
    assert deployed.returncode == 0, deployed.stderr[-3000:]
    status = wait_until_running(ray_head, app["name"])
    assert set(status["deployments"]) == {"Router", "Drafter", "Verifier", "SuffixDrafter"}

    with TandemClient(f"{LOOPBACK}:{grpc_port}", timeout_s=120) as client:
        speculative = client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS)
        target_only = client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS, draft_tokens=0)
        # The file turns the CPU-only suffix drafter on: the same prompt again is drafted from
        # the first answer, held in the (anonymous) tenant's index, and stays exact. An answer
        # enters the index only through a suffix session, which a request opens once the router
        # knows the suffix replica (from the registry, a moment after Serve reports it running)
        # and which closes as the client gets the answer: asked again until drafted from it.
        deadline = time.monotonic() + INDEXED_WITHIN_S
        while True:
            again = client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS, pipelined=False)
            assert again.tokens == target_only.tokens
            if again.suffix_accepted > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    assert again.suffix_accepted > 0, f"not drafted from the index in {INDEXED_WITHIN_S} s"
    # Greedy decoding is lossless: the tiny pair, fp32, same numerics on both paths.
    assert speculative.tokens == target_only.tokens
    assert len(speculative.tokens) == MAX_TOKENS and target_only.num_drafted == 0
    # The file's drafter is the target's own int4 copy: it drafted (not only the suffix drafter).
    assert speculative.num_drafted - speculative.suffix_drafted > 0
    # The second door: the same API through Serve's gRPC proxy.
    with TandemClient(f"{LOOPBACK}:{proxy_port}", timeout_s=120) as client:
        assert client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS).tokens == target_only.tokens
    # The OpenAI-compatible API at both doors, at the base URLs the file promises.
    body = {"model": "tiny", "prompt": CODE_PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback
    for port in (http_port, proxy_http_port):
        completion = direct.open(
            urllib.request.Request(
                f"http://{LOOPBACK}:{port}/v1/completions",
                data=json.dumps(body).encode(),
                headers={"Content-Type": "application/json"},
            ),
            timeout=120,
        )
        assert json.load(completion)["choices"][0]["text"] == target_only.text, port


def wait_until_running(head: RayHead, app_name: str) -> dict[str, Any]:
    """The app's entry in `serve status` once it is RUNNING; fails at once if it failed."""
    deadline = time.monotonic() + DEPLOY_TIMEOUT_S
    app: dict[str, Any] = {}
    while True:
        try:
            result = serve_cli(head, "status", timeout_s=max(1, deadline - time.monotonic()))
            apps = (yaml.safe_load(result.stdout) or {}).get("applications") or {}
            app = apps.get(app_name, {})
        except subprocess.TimeoutExpired:
            pass  # a busy machine: the deadline below decides
        assert app.get("status") != "DEPLOY_FAILED", app.get("message")
        if app.get("status") == "RUNNING":
            return dict(app)
        assert time.monotonic() < deadline, f"not RUNNING after {DEPLOY_TIMEOUT_S} s: {app}"
        time.sleep(2)
