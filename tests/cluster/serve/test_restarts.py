"""Restarts: `tandem serve` right after `tandem shutdown` works, on the same ports, cycle after
cycle; `shutdown` returns only once the cluster's processes are gone and its ports are free.

Cycles: `TANDEM_RESTART_CYCLES`; by default 5, and 2 in CI (`CI` set), where every cycle still
serves, generates and shuts down on the same ports; 20 is the full check, by hand."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from cluster.config import CLUSTER_SECRET_ENV
from cluster.serve.loopback import free_door_ports, port_arguments, port_is_free
from cluster.serve.ray_cluster import API_KEY_ENV, cluster_processes
from tests.cluster.conftest import SERVE_TIMEOUT_S, TANDEM

CYCLES = int(os.environ.get("TANDEM_RESTART_CYCLES", "2" if os.environ.get("CI") else "5"))
CYCLE_BUDGET_S = 120  # a cycle takes 40-50 s on 2 busy cores

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def run(
    env: dict[str, str], *args: str, timeout_s: float = 180
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TANDEM, *args], env=env, capture_output=True, text=True, timeout=timeout_s, check=False
    )


@pytest.mark.timeout(60 + CYCLE_BUDGET_S * CYCLES)
def test_serve_generate_shutdown_cycles_on_the_same_ports() -> None:
    home = Path("/tmp") / f"tandem-restarts-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_SECRET_ENV, API_KEY_ENV)}
    env["TANDEM_HOME"] = str(home)
    ports = free_door_ports()
    port, proxy_port = ports["--port"], ports["--proxy-port"]
    try:
        for cycle in range(CYCLES):
            serve = run(
                env, "serve", "--preset", "tiny", *port_arguments(ports), "--detach",
                timeout_s=SERVE_TIMEOUT_S,
            )  # fmt: skip
            assert serve.returncode == 0, f"cycle {cycle}: {serve.stderr[-3000:]}"
            generated = run(  # the default door: the routers' own server
                env, "generate", "--address", f"127.0.0.1:{port}", "--max-tokens", "8", "def f(",
            )  # fmt: skip
            assert generated.returncode == 0, f"cycle {cycle}: {generated.stderr[-3000:]}"
            proxied = run(  # the second door: Serve's proxy
                env, "generate", "--address", f"127.0.0.1:{proxy_port}", "--max-tokens", "8",
                "def f(",
            )  # fmt: skip
            assert proxied.returncode == 0, f"cycle {cycle}: {proxied.stderr[-3000:]}"
            assert proxied.stdout == generated.stdout, f"cycle {cycle}"  # greedy: the same
            down = run(env, "shutdown")
            assert down.returncode == 0, f"cycle {cycle}: {down.stderr[-3000:]}"
            # When shutdown returns, nothing of the cluster is left and its ports are free.
            assert cluster_processes(str(home / "ray")) == [], f"cycle {cycle}"
            assert all(port_is_free(p) for p in ports.values()), f"cycle {cycle}"
            print(f"cycle {cycle + 1} of {CYCLES}: served, generated, shut down", flush=True)
    finally:
        if (home / "cluster.json").exists():
            run(env, "shutdown")
        for pid in cluster_processes(str(home / "ray")):  # a cycle cut off mid-start
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(home, ignore_errors=True)
