"""Progress of long steps on stderr: byte counters and timed phases.

`Progress.say` prints one line. `Progress.counting(label, total_bytes)` counts bytes through a
step (a download, an assembly, a hash check); `Progress.timed(label)` wraps a step whose progress
cannot be counted (a model conversion) and shows its elapsed time.

On a terminal a counter is a redrawing tqdm bar (bytes done/total, rate, time left) and a phase a
line whose elapsed time ticks every second. Elsewhere (a log file, a docker build, a test) both
become plain lines, so that logs stay readable: a counter prints at each tenth of its total, on
every note, and a summary at the end; a phase prints when it starts, every `heartbeat_s` while it
runs and when it ends, with its duration.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from tqdm import tqdm  # type: ignore[import-untyped]

TICK_S = 1.0
BYTES_BAR = "{l_bar}{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


def megabytes(n_bytes: int) -> str:
    """Decimal megabytes, as pip and tqdm print them."""
    return f"{n_bytes / 1e6:,.0f} MB"


def rate(n_bytes: int, elapsed_s: float) -> str:
    return f"{n_bytes / 1e6 / max(elapsed_s, 1e-6):,.0f} MB/s"


class Counter:
    """Bytes done in one counted step; `add` after each chunk or file."""

    def __init__(self, progress: Progress, label: str, total_bytes: int) -> None:
        self.label = label
        self.total_bytes = total_bytes
        self.done_bytes = 0
        self._progress = progress
        self._started = time.monotonic()
        self._next_tenth = 1
        self._bar: Any = None
        if progress.bars:
            self._bar = tqdm(
                total=total_bytes, desc=label, unit="B", unit_scale=True, unit_divisor=1000,
                bar_format=BYTES_BAR, file=sys.stderr, dynamic_ncols=True, leave=True,
            )  # fmt: skip

    def add(self, n_bytes: int, note: str | None = None) -> None:
        """Count `n_bytes` more; `note` (e.g. "part 3/22, 52 MB") is always shown."""
        self.done_bytes += n_bytes
        if self._bar is not None:
            if note is not None:
                self._bar.set_postfix_str(note, refresh=False)
            self._bar.update(n_bytes)
            return
        tenth = self.done_bytes * 10 // max(self.total_bytes, 1)
        if note is None and not self._next_tenth <= tenth < 10:
            return
        self._next_tenth = tenth + 1
        elapsed_s = time.monotonic() - self._started
        prefix = f"{note}; " if note is not None else ""
        self._progress.say(
            f"{self.label}: {prefix}{megabytes(self.done_bytes)}/{megabytes(self.total_bytes)}"
            f" ({rate(self.done_bytes, elapsed_s)})"
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            return
        elapsed_s = time.monotonic() - self._started
        self._progress.say(
            f"{self.label}: {megabytes(self.done_bytes)} in {elapsed_s:.1f} s"
            f" ({rate(self.done_bytes, elapsed_s)})"
        )


class Progress:
    """Where long steps report. `write` takes one plain line (default: stderr, prefixed with
    the seconds since this object was made); `bars` redraws tqdm bars on stderr instead of
    printing counter and phase lines (default: when stderr is a terminal and `write` is not
    given)."""

    def __init__(
        self,
        write: Callable[[str], None] | None = None,
        *,
        bars: bool | None = None,
        heartbeat_s: float = 30.0,
    ) -> None:
        self._started = time.monotonic()
        self._write = write
        self.bars = bars if bars is not None else write is None and sys.stderr.isatty()
        self.heartbeat_s = heartbeat_s

    def say(self, text: str) -> None:
        if self._write is not None:
            self._write(text)
            return
        line = f"[{time.monotonic() - self._started:6.1f}s] {text}"
        if self.bars:
            tqdm.write(line, file=sys.stderr)  # keeps a live bar intact
        else:
            print(line, file=sys.stderr, flush=True)

    @contextmanager
    def counting(self, label: str, total_bytes: int) -> Iterator[Counter]:
        counter = Counter(self, label, total_bytes)
        try:
            yield counter
        finally:
            counter.close()

    @contextmanager
    def timed(self, label: str) -> Iterator[None]:
        """Show `label` with its elapsed time while the body runs."""
        started = time.monotonic()
        bar: Any = None
        if self.bars:
            bar = tqdm(
                total=None, desc=label, bar_format="{desc}: {elapsed}", file=sys.stderr,
                dynamic_ncols=True, leave=True,
            )  # fmt: skip
        else:
            self.say(f"{label} ...")
        stop = threading.Event()

        def tick() -> None:
            # The body is one blocking call (e.g. from_pretrained); only a thread can show that
            # it is still alive.
            interval_s = TICK_S if bar is not None else self.heartbeat_s
            while not stop.wait(interval_s):
                if bar is not None:
                    bar.refresh()
                else:
                    self.say(f"{label}: {time.monotonic() - started:.0f} s so far")

        ticker = threading.Thread(target=tick, name="progress-tick", daemon=True)
        ticker.start()
        outcome = "failed after"
        try:
            yield
            outcome = "done in"
        finally:
            stop.set()
            ticker.join()
            if bar is not None:
                bar.close()
            if bar is None or outcome == "failed after":
                self.say(f"{label}: {outcome} {time.monotonic() - started:.1f} s")
