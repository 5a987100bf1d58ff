"""Autoscaling on a real local Ray cluster: both sides scale up on load and back down, and no
stream is lost or corrupted on the way.

Its own service (`tandem serve --config` in its own TANDEM_HOME, on a free port), with
autoscaling on for drafters and verifiers (1 to 2 replicas, 2 sessions per replica, short
windows and delays) and fixed rounds (no adaptive plan, no prompt lookup), so every stream
opens a session on both sides. Concurrent greedy streams raise the load until Serve runs 2
replicas of each side; then all but one stop, and Serve goes back to 1 of each while that one
keeps streaming, so a replica is stopped (drained) with a stream possibly pinned to it. Every
stream's tokens must equal the target-only reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from cluster.api.client import TandemClient
from cluster.config import CLUSTER_SECRET_ENV
from cluster.local import LocalTandem
from cluster.routing.request import GenerationRequest
from cluster.serve.loopback import free_door_ports, port_arguments
from cluster.serve.ray_cluster import API_KEY_ENV, cluster_processes
from tests.cluster.conftest import SERVE_TIMEOUT_S, TANDEM
from tests.conftest import PROMPTS, encode

pytestmark = [pytest.mark.ray, pytest.mark.slow]

AUTOSCALING = {
    "enabled": True,
    "min_replicas": 1,
    "max_replicas": 2,
    "target_sessions": 2,
    "target_busy": 1.0,  # scale on sessions only: busy time depends on the machine
    "upscale_delay_s": 0,
    "downscale_delay_s": 3,
    "look_back_period_s": 2,
    "metrics_interval_s": 0.5,
}
DEPLOYMENTS = ("Drafter", "Verifier")
STREAM_TOKENS = 120
DRAFT_TOKENS = 3
HIGH_LOAD = 4
"""Concurrent streams: up to 4 sessions per side, 2 replicas' worth."""
SCALE_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def autoscaled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, object]]:
    home = Path("/tmp") / f"tandem-as-{os.getpid()}"  # short: Ray's socket paths are limited
    env = {k: v for k, v in os.environ.items() if k not in (CLUSTER_SECRET_ENV, API_KEY_ENV)}
    env["TANDEM_HOME"] = str(home)
    config = tmp_path_factory.mktemp("autoscale") / "tandem.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "models": {"preset": "tiny"},
                "auth": {"enabled": False},
                "draft_length": {"enabled": False},
                "prompt_lookup": {"enabled": False},
                "drafter": {"autoscaling": AUTOSCALING},
                "verifier": {"autoscaling": AUTOSCALING},
            }
        )
    )
    ports = free_door_ports()
    port = ports["--port"]
    serve = subprocess.run(
        [TANDEM, "serve", "--config", str(config), *port_arguments(ports), "--detach"],
        env=env, capture_output=True, text=True, timeout=SERVE_TIMEOUT_S, check=False,
    )  # fmt: skip
    try:
        assert serve.returncode == 0, serve.stderr[-3000:]
        yield {"address": f"127.0.0.1:{port}", "env": env}
    finally:
        down = subprocess.run(
            [TANDEM, "shutdown"], env=env, capture_output=True, text=True, timeout=180,
            check=False,
        )  # fmt: skip
        assert down.returncode == 0, down.stderr[-3000:]
        assert cluster_processes(str(home / "ray")) == []


def status(service: dict[str, object]) -> dict[str, object]:
    out = subprocess.run(
        [TANDEM, "status", "--json"], env=service["env"], capture_output=True, text=True,  # type: ignore[arg-type]
        timeout=120, check=True,
    )  # fmt: skip
    result: dict[str, object] = json.loads(out.stdout)
    return result


def replica_states(reading: dict[str, object]) -> dict[str, dict[str, int]]:
    deployments = reading["deployments"]
    assert isinstance(deployments, dict)
    return {name: deployments[name]["replicas"] for name in DEPLOYMENTS}


def wait_for(
    service: dict[str, object], wanted: dict[str, int], still_ok: Callable[[], None]
) -> tuple[float, dict[str, object]]:
    """Poll `tandem status` until each deployment's replicas are exactly `wanted[...]`
    RUNNING (nothing starting or stopping); returns the seconds it took and the last reading.
    `still_ok` raises if the load has already failed."""
    started = time.monotonic()
    while True:
        reading = status(service)
        states = replica_states(reading)
        if all(states[name] == {"RUNNING": n} for name, n in wanted.items()):
            return time.monotonic() - started, reading
        still_ok()
        assert time.monotonic() - started < SCALE_TIMEOUT_S, f"wanted {wanted}, have {states}"
        time.sleep(1)


class Streams:
    """Clients that each stream greedy requests back to back until told to stop, checking
    every stream against the target-only reference."""

    def __init__(self, address: str, expected: dict[str, tuple[int, ...]]) -> None:
        self._address = address
        self._expected = expected
        self._threads: list[tuple[threading.Thread, threading.Event]] = []
        self.completed = 0
        self.errors: list[str] = []
        self._lock = threading.Lock()

    def start(self, count: int) -> None:
        for _ in range(count):
            stop = threading.Event()
            thread = threading.Thread(target=self._run, args=(len(self._threads), stop))
            self._threads.append((thread, stop))
            thread.start()

    def stop(self, keep: int = 0) -> None:
        """Stop all but the first `keep` clients (each after its current stream)."""
        for _, stop in self._threads[keep:]:
            stop.set()
        for thread, _ in self._threads[keep:]:
            thread.join(timeout=120)
            assert not thread.is_alive()
        del self._threads[keep:]

    def check(self) -> None:
        assert not self.errors, self.errors[:3]

    def _run(self, index: int, stop: threading.Event) -> None:
        with TandemClient(self._address, timeout_s=120) as client:
            turn = index
            while not stop.is_set():
                prompt = PROMPTS[turn % len(PROMPTS)]
                turn += 1
                try:
                    chunks = client.stream(
                        prompt, max_tokens=STREAM_TOKENS, draft_tokens=DRAFT_TOKENS
                    )
                    tokens = tuple(t for chunk in chunks for t in chunk.tokens)
                except Exception as error:  # a lost request
                    with self._lock:
                        self.errors.append(f"{prompt!r}: {error!r}")
                    return
                with self._lock:
                    if tokens != self._expected[prompt]:  # a corrupted one
                        self.errors.append(f"{prompt!r}: tokens differ from the target's")
                    self.completed += 1


def test_both_sides_scale_up_on_load_and_down_without_losing_a_stream(
    autoscaled: dict[str, object], local_tandem: LocalTandem
) -> None:
    expected = {
        prompt: local_tandem.router.generate(
            GenerationRequest(encode(local_tandem, prompt), STREAM_TOKENS, draft_tokens=0)
        ).tokens
        for prompt in PROMPTS
    }
    before = replica_states(status(autoscaled))
    assert before == {"Drafter": {"RUNNING": 1}, "Verifier": {"RUNNING": 1}}, before

    streams = Streams(str(autoscaled["address"]), expected)
    try:
        streams.start(HIGH_LOAD)
        up_s, reading = wait_for(autoscaled, {"Drafter": 2, "Verifier": 2}, streams.check)
        live = reading["replicas"]
        assert isinstance(live, list)
        sides = [r["side"] for r in live]
        assert sides.count("drafter") == 2 and sides.count("verifier") == 2, live
        assert sides.count("suffix") == 1, live
        completed_up = streams.completed
        # One client keeps streaming while Serve stops a replica of each side (draining it).
        streams.stop(keep=1)
        down_s, reading = wait_for(autoscaled, {"Drafter": 1, "Verifier": 1}, streams.check)
        live = reading["replicas"]
        assert isinstance(live, list)
        # The suffix drafter (on by default, a fixed count) is neither side and stays.
        assert sorted(r["side"] for r in live) == ["drafter", "suffix", "verifier"], live
        # The survivors serve on: a few more streams after the scale-down.
        target = streams.completed + 2
        deadline = time.monotonic() + 60
        while streams.completed < target and time.monotonic() < deadline:
            streams.check()
            time.sleep(0.2)
    finally:
        streams.stop()
    streams.check()
    assert streams.completed >= target
    print(
        f"scaled up in {up_s:.1f} s ({completed_up} streams), down in {down_s:.1f} s; "
        f"{streams.completed} streams, all exact"
    )
