"""`tool_choice` "auto": a model's output, text or calls in its own syntax, in OpenAI's shapes.

The output is read by its `ToolFormat`'s reader (`cluster.api.tool_format`), and the events
become:
- unary (`auto_message`): the message, with `content` the text before the calls (null when
  there is none and there are calls) and `tool_calls` (`id`, `type: "function"`,
  `function.name`, `function.arguments` as JSON text), and `finish_reason` "tool_calls" when a
  call was made and the output ended by itself after a whole call;
- streamed (`AutoToolDeltas`): text as `content` deltas; a call as a delta with its `index`,
  `id`, `type` and `function.name` (and `arguments: ""`), then deltas of argument fragments,
  which concatenate to the arguments' JSON.

The unary message is the fold of the same events the stream sends, so both give the same text
and calls. A call cut by `max_tokens` keeps what it had (`finish_reason: "length"`).
"""

from __future__ import annotations

import uuid
from typing import Any

from cluster.api.tool_format import CallStart, TextPiece, ToolEvent, ToolFormat


def call_id() -> str:
    """A new call id, in OpenAI's form."""
    return f"call_{uuid.uuid4().hex[:24]}"


class AutoToolDeltas:
    """One output's stream of chat deltas."""

    def __init__(self, tool_format: ToolFormat) -> None:
        self._reader = tool_format.reader()
        self.calls = 0

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        """The deltas for the next chunk of output `text` (`finished`: it is the last)."""
        events = self._reader.feed(text)
        if finished:
            events += self._reader.finish()
        return _merged([self._delta(event) for event in events])

    def _delta(self, event: ToolEvent) -> dict[str, Any]:
        if isinstance(event, TextPiece):
            return {"content": event.text}
        if isinstance(event, CallStart):
            self.calls += 1
            function = {"name": event.name, "arguments": ""}
            call = {"index": event.index, "id": call_id(), "type": "function"}
            return {"tool_calls": [call | {"function": function}]}
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.fragment}}]}

    def finish_reason(self, reason: str) -> str:
        """The last chunk's `finish_reason`: "tool_calls" for an output that made calls and
        ended by itself after a whole call (not one cut by a stop string)."""
        whole = self.calls and not self._reader.in_call
        return "tool_calls" if reason == "stop" and whole else reason


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Adjacent text deltas, and adjacent argument fragments of one call, as one delta."""
    merged: list[dict[str, Any]] = []
    for delta in deltas:
        last = merged[-1] if merged else None
        if last is not None and "content" in delta and "content" in last:
            last["content"] += delta["content"]
            continue
        if (
            last is not None
            and "tool_calls" in delta
            and "tool_calls" in last
            and "id" not in delta["tool_calls"][0]
            and "id" not in last["tool_calls"][0]
            and last["tool_calls"][0]["index"] == delta["tool_calls"][0]["index"]
        ):
            last["tool_calls"][0]["function"]["arguments"] += delta["tool_calls"][0]["function"][
                "arguments"
            ]
            continue
        merged.append(delta)
    return merged


def auto_message(
    tool_format: ToolFormat, text: str, finish_reason: str
) -> tuple[dict[str, Any], str]:
    """The chat `message` and `finish_reason` of a finished output `text`."""
    stream = AutoToolDeltas(tool_format)
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for delta in stream.deltas(text, finished=True):
        if "content" in delta:
            content.append(delta["content"])
            continue
        call = delta["tool_calls"][0]
        if "id" in call:
            calls.append({key: value for key, value in call.items() if key != "index"})
            calls[-1]["function"] = dict(call["function"])
        else:
            calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
    joined = "".join(content)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": joined if joined or not calls else None,
        "refusal": None,
    }
    if calls:
        message["tool_calls"] = calls
    return message, stream.finish_reason(finish_reason)
