"""A stream's chunks held back to an interval, for clients that want fewer, larger chunks.

The router emits at most one chunk per verifier step for a request (what that step committed),
and a face merges what a slow reader has pending. A client that wants fewer chunks still (a
browser repainting per chunk, a proxy paying per item) can ask the server for an interval, as
SGLang's `--stream-interval` does: `StreamInterval` holds chunks until `tokens` tokens or `ms`
milliseconds have gathered since the last it let out, then lets them out as one
(`cluster.api.response.merge`). The first chunk (the time to first token) and the last (its
finish reason, usage and counters) always go out at once. Pure bookkeeping over a clock; no
timers: held tokens leave with the first chunk after the interval has passed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.api.response import ApiChunk, merge
from cluster.runtime.errors import InvalidArgumentError


@dataclass
class StreamInterval:
    """One stream's interval (0 and 0: every chunk at once)."""

    tokens: int = 0
    """Let chunks out once this many tokens have gathered (0: no token interval)."""
    ms: float = 0.0
    """Let chunks out once this long has passed since the last went out (0: no time
    interval); with both set, whichever comes first."""
    clock: Callable[[], float] = time.monotonic
    _held: list[ApiChunk] = field(default_factory=list)
    _held_tokens: int = 0
    _last_out: float | None = None

    def __post_init__(self) -> None:
        if self.tokens < 0 or self.ms < 0:
            raise InvalidArgumentError(
                f"a stream interval must be >= 0 tokens and ms, got {self.tokens}, {self.ms}"
            )

    @property
    def every_chunk(self) -> bool:
        return self.tokens <= 1 and self.ms <= 0

    def offer(self, chunk: ApiChunk) -> ApiChunk | None:
        """The chunk to send now, `chunk` merged after those held; None: held for later."""
        if self.every_chunk:
            return chunk
        self._held.append(chunk)
        self._held_tokens += len(chunk.tokens)
        now = self.clock()
        last = self._last_out
        due = (
            last is None
            or chunk.finished
            or (self.tokens > 1 and self._held_tokens >= self.tokens)
            or (self.ms > 0 and (now - last) * 1000 >= self.ms)
        )
        if not due:
            return None
        out = merge(self._held)
        self._held, self._held_tokens, self._last_out = [], 0, now
        return out
