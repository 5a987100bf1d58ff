"""What the in-process benches share for their output: progress lines on stderr, table figures,
and the plotting library the commands' `--plot` draws with. Plain functions, no I/O beyond
stderr."""

from __future__ import annotations

import sys
from typing import Any

from cluster.runtime.errors import InvalidArgumentError


def progress(line: str) -> None:
    """One progress line on stderr, at once (the tables go to stdout)."""
    print(line, file=sys.stderr, flush=True)


def figure(value: float | None, digits: int) -> str:
    """`value` to `digits` places; "-" where there is nothing to divide by."""
    return "-" if value is None else f"{value:.{digits}f}"


def pyplot() -> Any:
    """matplotlib's pyplot on a headless backend (benchmarks run on servers with no display).
    matplotlib is the `plot` extra, not a dependency of the service: InvalidArgumentError
    saying how to install it when it is missing (a `--plot` flag checks this before its run)."""
    try:
        import matplotlib
    except ImportError:
        raise InvalidArgumentError(
            "--plot needs matplotlib, which the service does not install: "
            "pip install 'tandem[plot]'"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
