"""Stop what a measuring tool started, however the tool ends.

`tandem bench --mode service` starts a whole service, `tandem serve` in a private TANDEM_HOME:
a Ray cluster, Serve's controller and proxies, and the replicas. None of it may outlive the
bench. Python runs `finally:` blocks only while an exception unwinds the stack: Ctrl-C does
that (SIGINT raises KeyboardInterrupt), but SIGTERM's default action ends the process on the
spot, `finally:` blocks unrun, and the cluster stays up.

- `signals_raise()`: within the block, SIGTERM raises `Terminated` (a SystemExit with the
  status a shell reports for a process SIGTERM ended, 128 + 15), so the teardown in the
  caller's `finally:` runs. SIGINT keeps Python's handler (KeyboardInterrupt) unless it is
  ignored (a background job of a script): an inherited ignore is kept.
- `signals_held()`: within the block SIGINT and SIGTERM are ignored, so a second Ctrl-C cannot
  cut a teardown short; every step of the teardown below is bounded in time instead.
- `stop_private_service(home, env)`: `tandem shutdown` in that home, then SIGTERM, and after a
  grace SIGKILL, to every process still naming the home's Ray temp dir or holding a file in it
  (a service interrupted while it started never recorded itself for `shutdown`), then the
  home is removed.

Signals reach Python's main thread only: elsewhere the first two change nothing. SIGKILL
cannot be caught: a bench killed that way leaves its service; `TANDEM_HOME=<the home it
printed> tandem shutdown` stops it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import FrameType
from typing import NoReturn

from cluster.serve.ray_cluster import STOP_GRACE_S, cluster_processes

SHUTDOWN_TIMEOUT_S = 180.0
"""The longest `tandem shutdown` may take before its processes are signalled directly."""
SWEEP_ROUNDS = 3
"""How often the processes are looked for again after the SIGKILLs: a process that was
starting others (`ray start`) may have left a child the first look missed."""


class Terminated(SystemExit):
    """SIGTERM arrived inside `signals_raise()`."""


def _raise_terminated(signum: int, frame: FrameType | None) -> NoReturn:
    raise Terminated(128 + signum)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def signals_raise() -> Iterator[None]:
    """Within the block SIGTERM raises `Terminated`; the previous handler is restored after."""
    if not _in_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Within the block SIGINT and SIGTERM are ignored; their handlers are restored after."""
    if not _in_main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def tandem_command() -> str:
    """The `tandem` executable beside this Python."""
    return str(Path(sys.executable).with_name("tandem"))


def stop_private_service(home: Path, env: Mapping[str, str]) -> int:
    """Stop everything the service in `home` (a home this process made, used by nothing
    else) runs, then remove `home`; returns how many processes had to be signalled here."""
    if (home / "cluster.json").exists():
        with contextlib.suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [tandem_command(), "shutdown"],
                env=dict(env),
                capture_output=True,
                timeout=SHUTDOWN_TIMEOUT_S,
                check=False,
            )
    signalled = stop_processes(str(home / "ray"))
    shutil.rmtree(home, ignore_errors=True)
    return signalled


def stop_processes(temp_dir: str, grace_s: float = STOP_GRACE_S) -> int:
    """SIGTERM every process of the Ray temp dir `temp_dir` (as
    `ray_cluster.cluster_processes` finds them), SIGKILL what is left after `grace_s`;
    returns how many were signalled. Unlike `ray_cluster.stop_cluster` it touches no
    `cluster.json`: that belongs to this process's own TANDEM_HOME, not to `temp_dir`'s."""
    signalled: set[int] = set()
    for pid in cluster_processes(temp_dir):
        _signal(pid, signal.SIGTERM)
        signalled.add(pid)
    deadline = time.monotonic() + grace_s
    while cluster_processes(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.2)
    for _ in range(SWEEP_ROUNDS):
        left = cluster_processes(temp_dir)
        if not left:
            break
        for pid in left:
            _signal(pid, signal.SIGKILL)
            signalled.add(pid)
        time.sleep(0.2)
    return len(signalled)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone meanwhile
        os.kill(pid, sig)
