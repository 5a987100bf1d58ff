"""The replica registry as `tandem soak` reads it: from a child process of its own.

Reading the registry makes a process a Ray driver, which keeps files open in the cluster's Ray
temp dir; `tandem shutdown` stops every process that does, so the soak must not be one. The
child (`python -m cluster.tools.soak.registry INTERVAL_S`, TANDEM_HOME naming the service's
home) prints one JSON line per reading: `{"at": <time.time()>, "replicas": [ReplicaInfo dicts]}`,
or `"error"` instead of `"replicas"` when the registry did not answer, until its stdin closes.
`RegistryWatch` runs it, keeps the latest reading and hands out readings taken after a given
instant; `close` ends the child before the service is stopped.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from typing import IO, Any

from cluster.runtime.errors import TandemError

INTERVAL_S = 1.0
"""Between readings: the replicas heartbeat once a second."""
STOP_GRACE_S = 5.0


class RegistryUnreadable(TandemError):
    status = "UNAVAILABLE"


class RegistryWatch:
    """The latest registry reading of the service whose home `env` names."""

    def __init__(self, env: Mapping[str, str], interval_s: float = INTERVAL_S) -> None:
        self._child = subprocess.Popen(
            [sys.executable, "-m", "cluster.tools.soak.registry", str(interval_s)],
            env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        self._changed = threading.Condition()
        self._latest: dict[str, Any] = {}
        self._reader = threading.Thread(target=self._read, name="soak-registry", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._child.stdout is not None
        for line in self._child.stdout:
            with contextlib.suppress(ValueError), self._changed:
                self._latest = json.loads(line)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def replicas(self, after: float | None = None, timeout_s: float = 30.0) -> list[dict[str, Any]]:
        """The live replicas of a reading taken after `after` (a `time.time()`; default: now);
        raises `RegistryUnreadable` if none comes within `timeout_s`."""
        after = time.time() if after is None else after
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._latest.get("at", 0.0) < after or "replicas" not in self._latest:
                left = deadline - time.monotonic()
                if left <= 0 or self._child.poll() is not None:
                    raise RegistryUnreadable(
                        f"no registry reading: {self._latest.get('error', 'none came')}"
                    )
                self._changed.wait(left)
            return list(self._latest["replicas"])

    def close(self) -> None:
        """End the child (closing its stdin asks it to; then SIGTERM, then SIGKILL)."""
        with contextlib.suppress(OSError):
            if self._child.stdin is not None:
                self._child.stdin.close()
        try:
            self._child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            self._child.terminate()
            try:
                self._child.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._child.kill()
                self._child.wait()


def _watch(interval_s: float, out: IO[str]) -> None:
    """The child: a reading every `interval_s` until stdin closes."""
    from cluster.serve import ray_cluster

    closed = threading.Event()

    def wait_for_eof() -> None:
        sys.stdin.read()
        closed.set()

    threading.Thread(target=wait_for_eof, daemon=True).start()
    while not closed.is_set():
        reading: dict[str, Any] = {"at": time.time()}
        try:
            reading["replicas"] = ray_cluster.live_replicas()
        except Exception as error:  # the registry between restarts: say so, read again
            reading["error"] = f"{type(error).__name__}: {error}"
        try:
            out.write(json.dumps(reading) + "\n")
            out.flush()
        except BrokenPipeError:
            return
        closed.wait(interval_s)


if __name__ == "__main__":
    _watch(float(sys.argv[1]) if len(sys.argv) > 1 else INTERVAL_S, sys.stdout)
