"""Concurrent streaming load against a running service: throughput and latency under load.

`run_load` keeps `concurrency` streams busy for `duration_s` seconds: each worker streams one
request after another (prompts taken round-robin), then the run waits for the requests still in
flight, so every request counts whole. It records time to first token, inter-token latency
(a chunk's gap split evenly over its tokens: speculation commits several tokens at once) and
failures by gRPC status name. The loop is bounded in time and count and talks only to the
address it is given. The client is injected (an `AsyncTandemClient`: `stream` gives an async
iterator of chunks), so the same loop runs against any server; so is the clock
(`time.perf_counter` by default), which every duration, latency and the deadline are read from.

Every stream is a task on one asyncio event loop, on one thread: at 64 streams the client
costs about a quarter less CPU per token than with a blocking stream per thread, and no
thread hand-off per chunk (`tandem loadtest` reports its CPU apart as `load_client`,
`cluster.tools.bench.process_cpu`; docs/benchmarks.md has the figures).

Fault injection: `midway` is called once, half way through the duration (`tandem loadtest
--kill` kills a replica there). Every request that started and did not complete is `lost`
(whatever its status); with `reference` (a fault-free greedy output per prompt), a completed
request whose tokens differ from it is `corrupted`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cluster.api.client_types import TandemClientError

MAX_REQUESTS_PER_WORKER = 10_000
"""A hard bound on one worker's requests, whatever the duration."""


@dataclass
class LoadLog:
    """What the workers saw (all on one event loop: no lock)."""

    tokens: int = 0
    requests: int = 0
    first_token_s: list[float] = field(default_factory=list)
    inter_token_s: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    corrupted: int = 0
    speculation: Counter[str] = field(default_factory=Counter)
    """Sums of the finished requests' counters (`SPECULATION_FIELDS`), and how many drafted."""


SPECULATION_FIELDS = ("num_drafted", "num_accepted", "num_verify_passes", "suffix_drafted")
"""The per-request counters a run sums (from each stream's last chunk)."""


def percentile(values: Sequence[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _one_request(
    client: Any,
    prompt: str,
    settings: dict[str, Any],
    log: LoadLog,
    expected: tuple[int, ...] | None,
    clock: Callable[[], float],
) -> None:
    started = last = clock()
    first: float | None = None
    gaps: list[float] = []
    received: list[int] = []
    try:
        async for chunk in client.stream(prompt, **settings):
            now = clock()
            if chunk.tokens:
                if first is None:
                    first = now - started
                else:
                    gaps.extend([(now - last) / len(chunk.tokens)] * len(chunk.tokens))
                last = now
                received.extend(chunk.tokens)
            if chunk.stats is not None:
                for name in SPECULATION_FIELDS:
                    log.speculation[name] += getattr(chunk.stats, name)
                log.speculation["requests_drafted"] += chunk.stats.num_drafted > 0
    except TandemClientError as error:
        log.errors[error.code.name] += 1
        return
    log.requests += 1
    log.tokens += len(received)
    log.corrupted += expected is not None and tuple(received) != expected
    if first is not None:
        log.first_token_s.append(first)
    log.inter_token_s.extend(gaps)


async def run_load(
    client: Any,
    prompts: Sequence[str],
    concurrency: int,
    duration_s: float,
    settings: dict[str, Any],
    midway: Callable[[], None] | None = None,
    reference: Mapping[str, tuple[int, ...]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Any]:
    """Drive `concurrency` streams for `duration_s` on this event loop; `settings` go to every
    `client.stream` (`client`: one client, or a list whose clients take the streams in turn);
    `midway`, if given, runs once half way through (in real time, on a thread of its own: it may
    block); `reference` counts corrupted outputs; `clock` (seconds) times everything else."""
    log = LoadLog()
    deadline = clock() + duration_s
    counter = itertools.count()

    clients = client if isinstance(client, list) else [client]

    async def worker(own: Any) -> None:
        for _ in range(MAX_REQUESTS_PER_WORKER):
            if clock() >= deadline:
                return
            prompt = prompts[next(counter) % len(prompts)]
            expected = reference.get(prompt) if reference is not None else None
            await _one_request(own, prompt, settings, log, expected, clock)

    started = clock()
    timer = threading.Timer(duration_s / 2, midway) if midway is not None else None
    if timer is not None:
        timer.start()
    try:
        await asyncio.gather(*(worker(clients[i % len(clients)]) for i in range(concurrency)))
    except BaseException:
        if timer is not None:
            timer.cancel()  # interrupted: midway need not run
        raise
    finally:
        if timer is not None:
            timer.join()
    seconds = clock() - started
    return {
        "concurrency": concurrency,
        "seconds": seconds,
        "requests": log.requests,
        "tokens": log.tokens,
        "tokens_per_s": log.tokens / seconds,
        "ttft_ms": _millis(log.first_token_s),
        "itl_ms": _millis(log.inter_token_s),
        "errors": dict(log.errors),
        "lost": sum(log.errors.values()),
        "corrupted": log.corrupted if reference is not None else None,
        "speculation": speculation_summary(log),
    }


def speculation_summary(log: LoadLog) -> dict[str, float | int]:
    """How much the run speculated: the counters summed over its finished requests, with
    drafted tokens and verify passes per generated token and the share of requests that drafted
    at all (where the speculation gate held the target alone, few did)."""
    counts = {name: log.speculation[name] for name in SPECULATION_FIELDS}
    tokens, requests = max(1, log.tokens), max(1, log.requests)
    return {
        **counts,
        "drafted_per_token": counts["num_drafted"] / tokens,
        "passes_per_token": counts["num_verify_passes"] / tokens,
        "acceptance": counts["num_accepted"] / max(1, counts["num_drafted"]),
        "requests_drafted": log.speculation["requests_drafted"] / requests,
    }


def _millis(values: Sequence[float]) -> dict[str, float | None]:
    return {
        name: None if (v := percentile(values, q)) is None else 1000 * v
        for name, q in (("p50", 0.5), ("p99", 0.99))
    }


def speculation_line(summary: dict[str, float | int]) -> str:
    """`speculation_summary` in a few words, for progress lines."""
    return (
        f"drafted {summary['drafted_per_token']:.2f}/token (suffix {summary['suffix_drafted']}), "
        f"accepted {summary['acceptance']:.0%}, {summary['passes_per_token']:.2f} passes/token, "
        f"{summary['requests_drafted']:.0%} of requests drafted"
    )
