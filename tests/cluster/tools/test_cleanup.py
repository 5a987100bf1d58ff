"""An interrupted `tandem bench --mode service` stops the service it started.

The bench runs as a user runs it, a process of its own, and starts `tandem serve` (a whole Ray
cluster) in a private TANDEM_HOME, which it names on stderr. The test waits for a moment when
that cluster is up, signals the bench alone (as `kill PID` would; the service's processes get
nothing from the test), and then checks that the bench exits with the signal's status and that
no process of that home is left (`ray_cluster.cluster_processes`: the processes whose command
line names its Ray temp dir or that hold a file in it), and the home is gone.

- SIGTERM while the service is still starting: the cluster is up (`cluster.json` written, Ray's
  processes running) but `tandem serve` has not finished deploying, so the bench is inside
  `subprocess.run` and the service never reported an address.
- SIGINT (what Ctrl-C sends) while the bench is measuring through the service.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.serve.ray_cluster import cluster_processes
from cluster.tools.cleanup import stop_processes, tandem_command
from tests.polling import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.slow]

UP_TIMEOUT_S = 240.0
"""Bounds the wait for the cluster (or the measuring) to start on a loaded machine."""
EXIT_TIMEOUT_S = 240.0
"""Bounds the bench's teardown: `tandem shutdown` (at most 180 s), then the kill sweep.
Both bounds together stay below pytest's own timeout (600 s)."""


class Bench:
    """`tandem bench --mode service` as a child process, its stderr collected line by line."""

    def __init__(self, prompts: Path) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen(
            [tandem_command(), "bench", "--mode", "service", "--preset", "tiny",
             "--prompts", str(prompts), "--max-tokens", "16", "--repeats", "1000"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            # As in a terminal: Python turns SIGINT into KeyboardInterrupt only if it is not
            # ignored when it starts, and a test runner in the background may ignore it.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for line in self.process.stderr:
            self.lines.append(line)

    def home(self) -> Path | None:
        """The private TANDEM_HOME the bench announced, once it has."""
        for line in self.lines:
            if "starting tandem serve" in line and " in /" in line:
                return Path(line.split(" in ", 1)[1].split(" (", 1)[0])
        return None

    def measuring(self) -> bool:
        return any("repeat 1 prompt 1" in line for line in self.lines)

    def exited(self) -> bool:
        return self.process.poll() is not None

    def output(self) -> str:
        return "".join(self.lines)[-3000:]


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):", "category": "code"}) + "\n")
    started = Bench(prompts)
    try:
        yield started
    finally:
        # Only if the test failed half way: nothing of the bench may outlive it.
        if not started.exited():
            started.process.kill()
            started.process.wait()
        home = started.home()
        if home is not None:
            stop_processes(str(home / "ray"))
            shutil.rmtree(home, ignore_errors=True)


def _cluster_up(bench: Bench) -> bool:
    home = bench.home()
    return (
        home is not None
        and (home / "cluster.json").exists()
        and bool(cluster_processes(str(home / "ray")))
    )


@pytest.mark.parametrize(
    ("sig", "moment", "status"),
    [(signal.SIGTERM, "starting", 128 + signal.SIGTERM), (signal.SIGINT, "measuring", 1)],
    ids=["sigterm-while-starting", "sigint-while-measuring"],
)
def test_an_interrupted_bench_stops_its_service(
    bench: Bench, sig: signal.Signals, moment: str, status: int
) -> None:
    ready = _cluster_up if moment == "starting" else Bench.measuring
    wait_until(
        lambda: ready(bench) or bench.exited(), UP_TIMEOUT_S, f"the bench {moment} its service"
    )
    assert not bench.exited(), bench.output()
    if moment == "starting":
        assert not bench.measuring()  # the service was not ready yet
    home = bench.home()
    assert home is not None
    ray_dir = str(home / "ray")
    assert cluster_processes(ray_dir)

    bench.process.send_signal(sig)

    wait_until(bench.exited, EXIT_TIMEOUT_S, "the bench exiting")
    assert bench.process.returncode == status, bench.output()
    assert f"stopping the service in {home}" in bench.output()
    wait_until(lambda: not cluster_processes(ray_dir), 30, "no process of the home left")
    assert not home.exists()
