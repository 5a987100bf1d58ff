"""The `ray` marker is true: a test that starts a Ray cluster without it fails.

`make test-fast` deselects `ray` tests and promises to start no cluster; a test that starts one
unmarked (a `tandem serve` subprocess, `ray.init`, `ray start`, `ray.cluster_utils.Cluster`)
would break that promise silently. Every way to start a cluster runs exactly one `gcs_server`
process, and every process this test session starts inherits `OWNER_ENV`; a thread watches for
new `gcs_server` processes carrying this session's tag and charges each to the test running
when it appeared. A cluster takes seconds to start, so the watch's period cannot miss one.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

OWNER_ENV = "TANDEM_TEST_SESSION_PID"
"""Set to this pytest process's pid; inherited by everything the tests start."""
WATCH_PERIOD_S = 0.25
GCS_NAME = "gcs_server"


def tagged_gcs_servers(owner: str) -> set[int]:
    """Pids of the live `gcs_server` processes whose environment carries `owner`."""
    found = set()
    tag = f"{OWNER_ENV}={owner}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if (entry / "comm").read_text().strip() != GCS_NAME:
                continue
            if tag in (entry / "environ").read_bytes().split(b"\0"):
                found.add(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


class RayGuard:
    """Watches for clusters started by this session and says which test started each."""

    def __init__(self) -> None:
        self.owner = str(os.getpid())
        os.environ[OWNER_ENV] = self.owner
        self.current: pytest.Item | None = None
        self.seen = tagged_gcs_servers(self.owner)
        self.started_by: dict[str, list[int]] = {}
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.watch, name="ray-guard", daemon=True)
        self.thread.start()

    def watch(self) -> None:
        while not self.stopped.wait(WATCH_PERIOD_S):
            self.poll()

    def poll(self) -> None:
        live = tagged_gcs_servers(self.owner)
        with self.lock:
            new = live - self.seen
            self.seen |= live
            if new and self.current is not None:
                self.started_by.setdefault(self.current.nodeid, []).extend(sorted(new))

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> object:
        with self.lock:
            self.current = item
        yield
        with self.lock:
            self.current = None

    @pytest.hookimpl(trylast=True)  # after the fixtures' own teardown, which must run
    def pytest_runtest_teardown(self, item: pytest.Item) -> None:
        self.poll()  # one last look: a cluster that appeared since the last period
        with self.lock:
            started = self.started_by.pop(item.nodeid, [])
        if started and item.get_closest_marker("ray") is None:
            pytest.fail(
                f"{item.nodeid} started a Ray cluster (gcs_server pid {started}) without the "
                "`ray` marker: mark it `ray` (make test-fast must start no cluster)",
                pytrace=False,
            )

    def stop(self) -> None:
        self.stopped.set()
        self.thread.join()
