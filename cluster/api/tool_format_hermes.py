"""The Hermes tool-call syntax, as Qwen2.5's chat template asks for it (vLLM's `hermes` parser).

A call is written `<tool_call>\\n{"name": "<name>", "arguments": <JSON object>}\\n</tool_call>`,
after any text, and calls follow each other separated by a newline; the turn then ends. The
call's JSON is written as the template writes calls back (`tojson`: `", "` between items,
`": "` after keys), so the model is held to the exact shape it was trained on.

The grammar (`HermesFormat.grammar`):

    start: TEXT | head call ("\\n<tool_call>\\n" call)*
    TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/
    head[lazy]: /(?s:.*)<tool_call>\\n/
    call: %json {"anyOf": [{"name": const, "arguments": parameters}, ...]} "\\n</tool_call>"

`TEXT` is any text without the opening tag; `head` is lazy, so it ends at the first tag: text
can only contain `<tool_call>` as the start of a call. In Qwen's tokenizer `<tool_call>` is an
added token that is not special, so llguidance matches it as its text, whichever tokens spell
it. The reader undoes exactly this layout; the text before a call loses the whitespace that
separates it from the tag. Output generated without the grammar (a benchmark's baseline) may
stray from it: a call in another JSON layout is read as JSON, text after the calls is text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from cluster.api.tool_format import CallArguments, CallStart, TextPiece, ToolEvent

OPEN = "<tool_call>\n"
CLOSE = "}\n</tool_call>"
"""The end of a call: its JSON object's closing brace, then the closing tag. A JSON string
cannot hold a raw newline, so this never occurs inside the arguments."""
SEPARATOR = "\n"
_HEAD = re.compile(r'\{"name": "((?:[^"\\]|\\.)*)", "arguments": ')
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class HermesFormat:
    """`<tool_call>` JSON calls (Qwen2.5, Hermes, and models trained on their template)."""

    name = "hermes"

    def matches(self, chat_template: str) -> bool:
        return "<tool_call>" in chat_template

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object", "properties": {}},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = {"anyOf": calls, "x-guidance": _JSON_STYLE}
        more = ' ("\\n<tool_call>\\n" call)*' if parallel else ""
        return "\n".join(
            [
                "%llguidance {}",
                f"start: TEXT | head call{more}",
                "TEXT: /(?s:.*)/ & ~/(?s:.*)<tool_call>(?s:.*)/",
                "head[lazy]: /(?s:.*)<tool_call>\\n/",
                f'call: %json {json.dumps(schema)} "\\n</tool_call>"',
            ]
        )

    def reader(self) -> HermesReader:
        return HermesReader()


def _held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class HermesReader:
    """Reads one Hermes output as it streams (`cluster.api.tool_format.ToolCallReader`)."""

    def __init__(self) -> None:
        self._buffer = ""
        self._state = "text"  # text -> head -> arguments -> between -> head ...
        self._calls = 0

    def feed(self, text: str) -> list[ToolEvent]:
        self._buffer += text
        events: list[ToolEvent] = []
        while True:
            before = (self._state, len(self._buffer))
            self._step(events)
            if (self._state, len(self._buffer)) == before:
                return events

    def _step(self, events: list[ToolEvent]) -> None:
        buffer = self._buffer
        if self._state == "text":
            at = buffer.find(OPEN)
            if at >= 0:
                self._text(buffer[:at].rstrip(), events)
                self._buffer, self._state = buffer[at + len(OPEN) :], "head"
                return
            partial = _held(buffer, OPEN)
            core = buffer[: len(buffer) - partial]
            # Hold back a tag's possible beginning and the whitespace before it: both vanish
            # if a call follows.
            keep = partial + len(core) - len(core.rstrip())
            self._text(buffer[: len(buffer) - keep], events)
            self._buffer = buffer[len(buffer) - keep :]
        elif self._state == "head":
            match = _HEAD.match(buffer)
            if match is not None:
                events.append(CallStart(self._calls, json.loads(f'"{match.group(1)}"')))
                self._buffer, self._state = buffer[match.end() :], "arguments"
            elif "\n</tool_call>" in buffer:  # another layout: only without the grammar
                block, _, rest = buffer.partition("\n</tool_call>")
                self._whole_call(block, events)
                self._buffer, self._state = rest, "between"
        elif self._state == "arguments":
            at = buffer.find(CLOSE)
            if at >= 0:
                self._arguments(buffer[:at], events)
                self._buffer, self._state = buffer[at + len(CLOSE) :], "between"
                self._calls += 1
                return
            keep = _held(buffer, CLOSE)
            self._arguments(buffer[: len(buffer) - keep], events)
            self._buffer = buffer[len(buffer) - keep :]
        elif buffer.startswith(SEPARATOR + OPEN):
            self._buffer, self._state = buffer[len(SEPARATOR + OPEN) :], "head"
        elif not (SEPARATOR + OPEN).startswith(buffer):  # text after the calls
            self._state = "text"

    @property
    def in_call(self) -> bool:
        return self._state in ("head", "arguments")

    def _whole_call(self, block: str, events: list[ToolEvent]) -> None:
        """A call whose JSON is not in the template's layout (possible only when the output
        was not generated under the grammar): read as JSON if it is, else kept as it is, under
        no name, so that it counts as a call that is not valid."""
        try:
            call = json.loads(block)
        except ValueError:
            call = None
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments")
            events.append(CallStart(self._calls, call["name"]))
            fragment = arguments if isinstance(arguments, str) else json.dumps(arguments)
        else:
            events.append(CallStart(self._calls, ""))
            fragment = block
        self._arguments(fragment, events)
        self._calls += 1

    def _text(self, text: str, events: list[ToolEvent]) -> None:
        if text:
            events.append(TextPiece(text))

    def _arguments(self, fragment: str, events: list[ToolEvent]) -> None:
        if fragment:
            events.append(CallArguments(self._calls, fragment))

    def finish(self) -> list[ToolEvent]:
        """What is left: held-back text is text; a call cut short gives what it has."""
        events = self.feed("")
        rest, self._buffer = self._buffer, ""
        if self._state == "text":
            self._text(rest, events)
        elif self._state == "arguments":
            self._arguments(rest, events)
        return events
