"""The service a soak runs against: `tandem serve --config` in a private TANDEM_HOME on free
ports, started and stopped by the soak alone.

`PrivateService.start` writes the config into a new home under /tmp (short: Ray's socket paths
are limited) and runs `tandem serve --detach` there. `stop` runs `tandem shutdown`, counts the
cluster's processes still there afterwards (the soak's "Ray processes left" figure; none is
the answer), signals those anyway (`cluster.tools.cleanup.stop_processes`) and removes the home,
so that nothing outlives the soak whatever the figure was. It never touches another home's
cluster, the user's `tandem serve` included.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

from cluster.runtime.errors import TandemError
from cluster.serve import loopback
from cluster.serve.ray_cluster import API_KEY_ENV, HOME_ENV, ClusterState, cluster_processes
from cluster.tools import cleanup

SERVE_TIMEOUT_S = 300.0
"""The longest `tandem serve` may take to come up (about a minute on 2 busy cores)."""


class ServiceStartError(TandemError):
    status = "UNAVAILABLE"


class PrivateService:
    """A `tandem serve` of one config in a home of its own."""

    def __init__(self, config: dict[str, Any]) -> None:
        self.home = Path(tempfile.mkdtemp(prefix="tandem-soak-", dir="/tmp"))
        self.temp_dir = str(self.home / "ray")
        self.ports = loopback.free_door_ports()
        self.port = self.ports["--port"]
        self.address = f"{loopback.LOOPBACK}:{self.port}"
        # The home's own key and secret, never the caller's.
        self.env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
        self.env[HOME_ENV] = str(self.home)
        self.config_path = self.home / "soak.yaml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def start(self) -> None:
        """Run `tandem serve --detach` (raises `ServiceStartError` with its output if it fails;
        interrupted, `subprocess.run` kills it, and `stop` stops what it had started)."""
        started = subprocess.run(
            [cleanup.tandem_command(), "serve", "--config", str(self.config_path),
             *loopback.port_arguments(self.ports), "--detach"],
            env=self.env, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, check=False,
        )  # fmt: skip
        if started.returncode != 0:
            raise ServiceStartError(f"tandem serve failed:\n{started.stderr[-3000:]}")

    def state(self) -> ClusterState:
        """What its `cluster.json` records (ports, app name); raises if it records nothing."""
        return ClusterState(**json.loads((self.home / "cluster.json").read_text()))

    @property
    def api_key(self) -> str:
        return (self.home / "api_key").read_text()

    @property
    def log_dir(self) -> Path:
        return Path(self.temp_dir) / "session_latest" / "logs"

    def stop(self) -> int:
        """Stop everything the service runs and remove its home; returns how many of its
        processes were still there after `tandem shutdown`."""
        left = cleanup.stop_private_service(self.home, self.env)
        for _ in range(cleanup.SWEEP_ROUNDS):  # what a sweep missed while it was starting
            if not cluster_processes(self.temp_dir):
                break
            left += cleanup.stop_processes(self.temp_dir)
        shutil.rmtree(self.home, ignore_errors=True)
        return left
