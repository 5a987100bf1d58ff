"""What the in-process benches share for their output: progress lines on stderr and table
figures. Plain functions, no I/O beyond stderr."""

from __future__ import annotations

import sys


def progress(line: str) -> None:
    """One progress line on stderr, at once (the tables go to stdout)."""
    print(line, file=sys.stderr, flush=True)


def figure(value: float | None, digits: int) -> str:
    """`value` to `digits` places; "-" where there is nothing to divide by."""
    return "-" if value is None else f"{value:.{digits}f}"
