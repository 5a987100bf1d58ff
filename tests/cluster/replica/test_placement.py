"""Placing a replica's threads: pinned to the CPUs asked for, or a clear error."""

from __future__ import annotations

import subprocess
import sys

import pytest

from cluster.replica.placement import place_threads
from cluster.runtime.errors import InvalidArgumentError


def test_pins_the_process_and_sets_threads() -> None:
    # In a child process: pinning this one would slow the rest of the suite.
    code = (
        "import os, torch; from cluster.replica.placement import place_threads; "
        "place_threads(1, [0]); print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split("\n")[-2] == "[0] 1"


def test_zero_threads_fits_the_cpus_the_process_may_use() -> None:
    code = (
        "import os, torch; from cluster.replica.placement import place_threads; "
        "n = place_threads(0, [0]); m = place_threads(0); "
        "print(n, torch.get_num_threads(), m == len(os.sched_getaffinity(0)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.split("\n")[-2] == "1 1 True"


def test_a_cpu_that_does_not_exist_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="cannot pin the replica to CPUs"):
        place_threads(0, [4096])
