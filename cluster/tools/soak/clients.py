"""The soak's client streams: each sends its planned requests one after another over gRPC, as
a well-behaved client would, and tallies how each ended (`cluster.tools.soak.outcomes`).

A stream stops starting requests once the load's end has passed or `stop` is set; the request
it is running finishes first (or fails when the client's channel is closed under it). A
request:
- streams with `TandemClient.stream`, with its own deadline (DEADLINE requests) or
  `LOST_AFTER_S` (every other: one not done by then is lost);
- leaving midway (DISCONNECT), closes the stream after its planned tokens, which cancels the
  call;
- refused with RESOURCE_EXHAUSTED and a retry hint before any token, waits the hint (at least
  `MIN_BACKOFF_S`, at most `MAX_BACKOFF_S`) and sends the request again, until `retry_until`
  (then the refusal is its end);
- failed by the service otherwise, its stream waits `FAILURE_BACKOFF_S` before the next
  request, as a client does after an error, rather than hammer a service that is recovering.

The client and the clock are injected, so tests run streams over a fake client.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from cluster.api.client_types import TandemClientError
from cluster.tools.soak.outcomes import Judgement, RequestOutcome, Tally
from cluster.tools.soak.plan import Ending, RequestSpec

LOST_AFTER_S = 300.0
"""A request that set no deadline and is not done after this long is lost."""
MIN_BACKOFF_S = 0.05
MAX_BACKOFF_S = 5.0
FAILURE_BACKOFF_S = 1.0
RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"


def run_request(
    client: Any,
    spec: RequestSpec,
    prompt: str,
    retry_until: float,
    stop: threading.Event,
    clock: Callable[[], float] = time.monotonic,
) -> RequestOutcome:
    """Send `spec` (retrying refusals until `retry_until` on `clock`) and say how it ended."""
    refusals = 0
    while True:
        tokens: list[int] = []
        try:
            finished, closed = _stream(client, spec, prompt, tokens)
            return RequestOutcome(tuple(tokens), finished, None, "", refusals, closed)
        except TandemClientError as error:
            hint = error.retry_after_s
            refused = error.code.name == RESOURCE_EXHAUSTED and hint is not None and not tokens
            backoff_s = min(MAX_BACKOFF_S, max(MIN_BACKOFF_S, hint or 0.0))
            if not refused or clock() + backoff_s > retry_until or stop.is_set():
                return RequestOutcome(
                    tuple(tokens), False, error.code.name, error.message, refusals,
                    retry_hint=hint is not None,
                )  # fmt: skip
            refusals += 1
            stop.wait(backoff_s)


def _stream(client: Any, spec: RequestSpec, prompt: str, tokens: list[int]) -> tuple[bool, bool]:
    """Stream `spec` into `tokens`; returns (finished, closed by the client as planned)."""
    timeout_s = spec.timeout_s if spec.timeout_s is not None else LOST_AFTER_S
    chunks: Iterator[Any] = client.stream(prompt, timeout_s=timeout_s, **spec.settings())
    with contextlib.closing(chunks):  # type: ignore[type-var]
        for chunk in chunks:
            tokens.extend(chunk.tokens)
            if chunk.finish_reason is not None:
                return True, False
            if spec.ending is Ending.DISCONNECT and len(tokens) >= spec.disconnect_after:
                return False, True  # closing the stream cancels the call
    return False, False


def run_stream(
    client: Any,
    specs: Iterator[RequestSpec],
    prompts: Sequence[str],
    references: Mapping[int, Sequence[int]],
    tally: Tally,
    load_ends: float,
    retry_until: float,
    stop: threading.Event,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Send `specs` one after another until `load_ends` (on `clock`) or `stop`."""
    for spec in specs:
        if clock() >= load_ends or stop.is_set():
            return
        outcome = run_request(client, spec, prompts[spec.prompt], retry_until, stop, clock)
        if tally.add(spec, outcome, references.get(spec.prompt)) is Judgement.FAILED:
            stop.wait(FAILURE_BACKOFF_S)
