"""What the public API sends back, in domain terms: `ApiChunk`s, and how pending ones merge.

`TandemService.stream` yields `ApiChunk`s (the router's `GenerationChunk` plus the request id
and, on the last one, the usage and speculation counters); the gRPC face converts each to a
`GenerateChunk` (`cluster.api.convert`), the OpenAI-compatible face to server-sent events
(`cluster.api.openai`).

Merging: a client that reads slower than tokens are committed lets chunks pile up; the Serve
faces send what is pending as one chunk (`cluster.serve.calls.stream_merged`), as vLLM's
per-request output collector does, so each chunk crossing Serve's proxy carries as many tokens
as are ready. `merge` makes one chunk of a run of consecutive chunks of one request: tokens
and text concatenated, the last finish reason, usage and counters kept. `coalesce` merges what
is pending into as few chunks as may be: a chunk with a finish reason ends its run (nothing
follows it in a well-formed stream, but a run never reaches past one). Pure, no I/O; a merged
stream concatenates to exactly the same tokens and text, ending with the same finish reason
(tests/cluster/api/test_response.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from cluster.routing.request import FinishReason, SpeculationStats


@dataclass(frozen=True)
class Usage:
    """A request's token counts: its prompt's, and those generated so far."""

    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True)
class ApiChunk:
    """Tokens newly committed for request `request_id`, and their text; the last chunk of a
    stream carries its finish reason, usage and speculation counters, the others None."""

    request_id: str
    tokens: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    stats: SpeculationStats | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def merge(chunks: Sequence[ApiChunk]) -> ApiChunk:
    """One chunk for a non-empty run of consecutive chunks of one request: their tokens and
    text concatenated, the last one's finish reason, usage and counters."""
    if not chunks:
        raise ValueError("merge needs at least one chunk")
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    return dataclasses.replace(
        last,
        tokens=tuple(token for chunk in chunks for token in chunk.tokens),
        text="".join(chunk.text for chunk in chunks),
    )


def coalesce(chunks: Sequence[ApiChunk]) -> list[ApiChunk]:
    """`chunks` (consecutive chunks of one request) merged into as few as may be: each run
    ends at a chunk with a finish reason, or at the end."""
    merged: list[ApiChunk] = []
    start = 0
    for end, chunk in enumerate(chunks, start=1):
        if chunk.finished:
            merged.append(merge(chunks[start:end]))
            start = end
    if start < len(chunks):
        merged.append(merge(chunks[start:]))
    return merged
