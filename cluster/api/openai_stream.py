"""OpenAI's streamed chunk bodies, made from the service's domain chunks (`ChunkBodies`).

`OpenAIService.open_stream` returns the service's stream of `ApiChunk`s (`cluster.api.response`)
and a `ChunkBodies` for it; the stream may be merged first (the Serve HTTP face sends a lagging
client what is pending as one chunk: `cluster.serve.calls.stream_merged`), since the bodies
of merged chunks say the same as those of the chunks merged: their text concatenated, the same
finish reason and final usage, `continuous_usage_stats` counting the tokens generated up to each.

Shapes, as `cluster.api.openai`'s docstring states them: one body per piece of newly final
text (the first chat body carries `role`), the one with `finish_reason` last; tool calls as
`cluster.api.openai_structured` (forced calls) and `cluster.api.auto_tool_calls` (`"auto"`)
make their deltas; with `include_usage`, `usage: null` on every body and a last body with no
choices carrying the usage. Pure: text in, dicts out.
"""

from __future__ import annotations

from typing import Any

from cluster.api.auto_tool_calls import AutoToolDeltas
from cluster.api.openai_schema import OpenAIRequest, Route
from cluster.api.openai_structured import Structured, ToolCallDeltas
from cluster.api.response import ApiChunk, Usage
from cluster.routing.request import FinishReason, SpeculationStats

OPENAI_FINISH_REASONS = {
    FinishReason.LENGTH: "length",
    FinishReason.STOP: "stop",
    FinishReason.CANCELLED: "stop",
}
"""Tandem's finish reasons in OpenAI's words (it has none for a cancel: "stop")."""
_ID_PREFIXES = {"completions": "cmpl-", "chat.completions": "chatcmpl-"}


def response_id(route: Route, request_id: str) -> str:
    """`cmpl-<request id>` / `chatcmpl-<request id>`."""
    return _ID_PREFIXES[route] + request_id


def head(route: Route, kind: str, request_id: str, created: int, model: str) -> dict[str, Any]:
    """The fields every response body and chunk body opens with."""
    return {
        "id": response_id(route, request_id),
        "object": kind,
        "created": created,
        "model": model,
        "system_fingerprint": None,
    }


class ChunkBodies:
    """One stream's chunk bodies, chunk by chunk (what came before decides the next)."""

    def __init__(
        self,
        route: Route,
        request: OpenAIRequest,
        structured: Structured,
        num_prompt_tokens: int,
        model: str,
        created: int,
    ) -> None:
        self._route = route
        self._request = request
        self._model = model
        self._created = created
        calling = structured.calling
        self._auto = (
            AutoToolDeltas(calling.tool_format) if calling and calling.tool_format else None
        )
        self._calls = (
            ToolCallDeltas(calling) if calling is not None and self._auto is None else None
        )
        self._object = "text_completion" if route == "completions" else "chat.completion.chunk"
        self._usage: dict[str, Any] = {"usage": None} if request.include_usage else {}
        self._num_prompt_tokens = num_prompt_tokens
        self._num_generated = 0
        self._first = True

    def bodies(self, chunk: ApiChunk) -> list[dict[str, Any]]:
        """The bodies to send for `chunk` (none for a chunk with nothing to say)."""
        top = head(self._route, self._object, chunk.request_id, self._created, self._model)
        self._num_generated += len(chunk.tokens)
        if self._request.continuous_usage:
            self._usage = {"usage": counts(self._num_prompt_tokens, self._num_generated)}
        finish = chunk.finish_reason
        reason = OPENAI_FINISH_REASONS[finish] if finish is not None else None
        out = [
            {**top, "choices": [choice], **self._usage} for choice in self._choices(chunk, reason)
        ]
        if chunk.finished and self._request.include_usage:
            assert chunk.usage is not None and chunk.stats is not None
            out.append({**top, "choices": [], "usage": usage_body(chunk.usage, chunk.stats)})
        return out

    def _choices(self, chunk: ApiChunk, reason: str | None) -> list[dict[str, Any]]:
        finished, text = chunk.finished, chunk.text
        if self._route == "completions":
            if text or finished:
                return [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}]
            return []
        if self._auto is not None:
            deltas = self._auto.deltas(text, finished)
            if finished:
                deltas = deltas or [{}]
            choices = []
            for n, piece in enumerate(deltas):
                last = finished and n == len(deltas) - 1
                if self._first:
                    piece = {"role": "assistant"} | piece
                end = self._auto.finish_reason(reason) if last and reason else None
                choices.append({"index": 0, "delta": piece, "logprobs": None, "finish_reason": end})
                self._first = False
            return choices
        if self._calls is not None:
            delta = self._calls.delta(text, self._first, reason)
            if delta is None and not finished:
                return []
            end = self._calls.finish(reason) if reason is not None else None
            self._first = False
            return [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": end}]
        if not (text or finished or self._first):
            return []
        content: dict[str, Any] = {"role": "assistant"} if self._first else {}
        if text or self._first:
            content["content"] = text
        self._first = False
        return [{"index": 0, "delta": content, "logprobs": None, "finish_reason": reason}]


def counts(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's three token counts."""
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def usage_body(usage: Usage, speculation: SpeculationStats) -> dict[str, Any]:
    """OpenAI's `usage`, plus Tandem's `speculation` counters."""
    prompt, completion = usage.prompt_tokens, usage.completion_tokens
    drafted, accepted = speculation.num_drafted, speculation.num_accepted
    passes = speculation.num_verify_passes
    return {
        **counts(prompt, completion),
        "speculation": {
            "drafted": drafted,
            "accepted": accepted,
            "acceptance_rate": accepted / drafted if drafted else None,
            "verify_passes": passes,
            "tokens_per_verify_pass": completion / passes if passes else None,
        },
    }
