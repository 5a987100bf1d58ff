"""One grammar engine on one workload, measured in-process into a `WorkloadReport`.

`measure` reports the tokenizer-info build time; the compile time (schema, regex or grammar to a
matcher ready for its first mask); the full-vocabulary mask time at each token of the walk
(first, median, p90, max on a fresh matcher, then median and p90 on the same matcher reset);
whether rolling back `ROLLBACK_TOKENS` tokens gives the same mask again (checked at every
position); the masks of a block of k + 1 positions (k = `DRAFT_TOKENS` drafted tokens), by the
plain loop (mask, consume, ... , roll back k) and by the engine's own speculative-decoding call
where it has one, checked equal and timed both ways. Whether an engine holds the GIL is measured
with a second Python thread that yields the GIL at each turn: the longest time it could not run
during the compile, and the share of long mask calls during which it ran (a call that holds the
GIL lets it run in none).
"""

from __future__ import annotations

import threading
import time
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING

import numpy as np

from experiments.grammar.engines import GrammarEngine, Matcher, Words
from experiments.grammar.workloads import Workload

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

ROLLBACK_TOKENS = 4
DRAFT_TOKENS = 4
LONG_CALL_S = 100e-6
"""Mask calls at least this long count for the GIL probe: a shorter call can end before the
other thread has woken up, GIL or no GIL."""
GIL_PROBE_CALLS = 50
GIL_PROBE_WALKS = 10
"""The GIL probe walks again until it has seen `GIL_PROBE_CALLS` long calls, at most this often."""
OK = "ok"
UNSUPPORTED = "unsupported"


@dataclass
class WorkloadReport:
    """One engine on one workload; times in seconds (`_s`) or microseconds (`_us`)."""

    status: str = OK
    tokenizer_build_s: float | None = None
    compile_s: float | None = None
    compile_stall_ms: float | None = None
    walk_tokens: int = 0
    first_mask_us: float | None = None
    mask_median_us: float | None = None
    mask_p90_us: float | None = None
    mask_max_us: float | None = None
    warm_mask_median_us: float | None = None
    warm_mask_p90_us: float | None = None
    end_allowed: bool | None = None
    rollback_verified: bool | None = None
    block_median_us: float | None = None
    native_block_median_us: float | None = None
    native_block_matches: bool | None = None
    gil_free_share: float | None = None


class WalkError(Exception):
    """The constraint forbids a token of its own valid output."""


def _allowed(mask: Words, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def _us(seconds: Sequence[float], q: float) -> float:
    return float(np.percentile(seconds, q)) * 1e6


def measure(
    grammar_engine: GrammarEngine,
    tokenizer: PreTrainedTokenizerFast,
    vocab_size: int,
    workload: Workload,
    on_compile: Callable[[], None] = lambda: None,
) -> WorkloadReport:
    """Everything the module docstring lists, for one engine on one workload, in-process;
    `on_compile` is called as the compile starts."""
    report = WorkloadReport()
    start = time.perf_counter()
    grammar_engine.load(tokenizer, vocab_size)
    report.tokenizer_build_s = time.perf_counter() - start
    if workload.kind not in grammar_engine.kinds:
        report.status = UNSUPPORTED
        return report
    on_compile()
    with _Ticker() as ticker:
        start = time.perf_counter()
        matcher = grammar_engine.compile(workload)
        end = time.perf_counter()
    report.compile_s = end - start
    report.compile_stall_ms = ticker.longest_stall(start, end) * 1e3
    tokens = tokenizer.encode(workload.text, add_special_tokens=False)
    report.walk_tokens = len(tokens)
    mask = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
    try:
        fresh = _walk(matcher, tokens, mask)
    except WalkError as error:
        report.status = f"failed: {error}"
        return report
    report.end_allowed = _allowed(mask, tokenizer.eos_token_id)
    report.first_mask_us = fresh[0] * 1e6
    report.mask_median_us, report.mask_p90_us = _us(fresh, 50), _us(fresh, 90)
    report.mask_max_us = max(fresh) * 1e6
    matcher.reset()
    warm = _walk(matcher, tokens, mask)
    report.warm_mask_median_us, report.warm_mask_p90_us = _us(warm, 50), _us(warm, 90)
    report.rollback_verified = _rollback_holds(matcher, tokens, mask)
    plain, native, report.native_block_matches = _blocks(matcher, tokens, mask.size)
    report.block_median_us = _us(plain, 50)
    report.native_block_median_us = _us(native, 50) if native else None
    report.gil_free_share = _gil_free_share(matcher, tokens, mask)
    return report


def _walk(matcher: Matcher, tokens: Sequence[int], mask: Words) -> list[float]:
    """Each position's mask time along `tokens`; `mask` ends as the mask after them."""
    times = []
    for i, token in enumerate(tokens):
        start = time.perf_counter()
        matcher.fill(mask)
        times.append(time.perf_counter() - start)
        if not _allowed(mask, token) or not matcher.consume(token):
            raise WalkError(f"token {i} of the valid output ({token}) is forbidden")
    matcher.fill(mask)
    return times


def _rollback_holds(matcher: Matcher, tokens: Sequence[int], mask: Words) -> bool:
    """At each position: the mask, then `ROLLBACK_TOKENS` tokens consumed and rolled back,
    then the mask again; True if every pair is equal."""
    again = np.empty_like(mask)
    matcher.reset()
    for i in range(len(tokens) - ROLLBACK_TOKENS):
        matcher.fill(mask)
        for token in tokens[i : i + ROLLBACK_TOKENS]:
            matcher.consume(token)
        matcher.rollback(ROLLBACK_TOKENS)
        matcher.fill(again)
        if not np.array_equal(mask, again):
            return False
        matcher.consume(tokens[i])
    return True


def _blocks(
    matcher: Matcher, tokens: Sequence[int], words: int
) -> tuple[list[float], list[float], bool | None]:
    """Block times at each position, by the plain loop and the native call, and whether the
    two gave the same masks everywhere (None without a native call)."""
    plain = np.empty((DRAFT_TOKENS + 1, words), dtype=np.int32)
    native = np.empty_like(plain)
    plain_s: list[float] = []
    native_s: list[float] = []
    matches = True
    matcher.reset()
    for i in range(len(tokens) - DRAFT_TOKENS):
        drafts = tokens[i : i + DRAFT_TOKENS]
        start = time.perf_counter()
        matcher.fill_block(drafts, plain)
        plain_s.append(time.perf_counter() - start)
        if matcher.has_native_block:
            native.fill(0)
            start = time.perf_counter()
            matcher.fill_block_native(drafts, native)
            native_s.append(time.perf_counter() - start)
            matches = matches and np.array_equal(plain, native)
        matcher.consume(tokens[i])
    return plain_s, native_s, matches if matcher.has_native_block else None


class _Ticker:
    """A second Python thread that notes the time at each turn and yields the GIL after it:
    while another thread holds the GIL, it makes no turn."""

    def __init__(self) -> None:
        self.ticks: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.ticks.append(time.perf_counter())
            time.sleep(0)

    def __enter__(self) -> _Ticker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def ran_during(self, start: float, end: float) -> bool:
        return bisect_right(self.ticks, start) < bisect_right(self.ticks, end)

    def longest_stall(self, start: float, end: float) -> float:
        """The longest time between turns within [start, end]."""
        inside = self.ticks[bisect_right(self.ticks, start) : bisect_right(self.ticks, end)]
        points = [start, *inside, end]
        return max(b - a for a, b in pairwise(points))


def _gil_free_share(matcher: Matcher, tokens: Sequence[int], mask: Words) -> float | None:
    """The share of mask calls of at least `LONG_CALL_S` (over walks along `tokens`, until
    `GIL_PROBE_CALLS` of them) during which the ticker ran; None without such calls."""
    spans: list[tuple[float, float]] = []
    with _Ticker() as ticker:
        for _ in range(GIL_PROBE_WALKS):
            matcher.reset()
            for token in tokens:
                start = time.perf_counter()
                matcher.fill(mask)
                end = time.perf_counter()
                if end - start >= LONG_CALL_S:
                    spans.append((start, end))
                matcher.consume(token)
            if len(spans) >= GIL_PROBE_CALLS:
                break
    if not spans:
        return None
    return sum(ticker.ran_during(s, e) for s, e in spans) / len(spans)
