"""The guard behind `make test-fast`'s promise (tests/ray_guard.py): a test that starts a Ray
cluster without the `ray` marker fails; with the marker it passes.

A real cluster takes seconds to start, so the inner session starts a stand-in: a copy of
`sleep` named `gcs_server`, the one process every Ray cluster runs, which the guard watches for.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

REPO_ROOT = Path(__file__).resolve().parents[1]
SLEEP = shutil.which("sleep")

INNER_CONFTEST = """
from tests.ray_guard import RayGuard

def pytest_configure(config):
    guard = RayGuard()
    config.pluginmanager.register(guard, "ray_guard")
    config.add_cleanup(guard.stop)
"""

INNER_TESTS = f"""
import shutil, subprocess, time
import pytest

def start_stand_in(folder):
    executable = folder / "gcs_server"
    shutil.copy({SLEEP!r}, executable)
    process = subprocess.Popen([str(executable), "30"])
    time.sleep(1.0)  # several of the guard's periods
    process.kill()
    process.wait()

@pytest.mark.ray
def test_marked_starts_a_cluster(tmp_path):
    start_stand_in(tmp_path)

def test_unmarked_starts_a_cluster(tmp_path):
    start_stand_in(tmp_path)

def test_unmarked_starts_nothing():
    pass
"""


@pytest.mark.skipif(SLEEP is None or sys.platform != "linux", reason="needs /proc and sleep")
def test_a_cluster_started_without_the_ray_marker_fails(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    pytester.makeconftest(INNER_CONFTEST)
    pytester.makepyfile(test_inner=INNER_TESTS)
    pytester.makeini("[pytest]\nmarkers =\n    ray: starts a cluster\n")
    result = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "--rootdir", str(pytester.path)
    )
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(
        ["*test_unmarked_starts_a_cluster started a Ray cluster*without the `ray` marker*"]
    )
