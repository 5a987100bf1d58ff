"""Tool calls that sit between an opening and a closing marker: their grammar, and reading them
as the output streams.

Both formats Tandem knows write a call as `<opening>{"name": "<name>", "arguments": <JSON
object>}<closing>` after any text, calls separated by `separator`: Hermes with `<tool_call>\\n`
and `\\n</tool_call>`, fenced JSON with ```` ```json\\n ```` and ```` \\n``` ````. A
`CallLayout` says where calls start and end; `layout_grammar` is the grammar of "text, or text
then calls" in a layout (`ToolFormat.grammar`):

    start: TEXT | head call (SEPARATOR OPENING call)*
    TEXT: /(?s:.*)/ & ~/(?s:.*)MARKER(?s:.*)/
    head[lazy]: /(?s:.*)OPENING/
    call: %json {"anyOf": [{"name": const, "arguments": parameters}, ...]} CLOSING

`TEXT` is any text without the layout's marker; `head` is lazy, so it ends at the first opening:
text can only contain the marker as the start of a call, and once a call opens its name is one
of the tools and its arguments follow that tool's parameters. A `DelimitedCallReader` is a
`ToolCallReader` (`cluster.api.tool_format`) for any layout:

- text outside calls is passed on as it comes, except what may still turn out to open a call
  (a partial opening marker, and the whitespace before it, which vanishes if a call follows);
- once a call opens, its head (`{"name": "...", "arguments": ` with any JSON whitespace) gives
  the call's name, then its arguments stream as fragments up to the closing marker. The object's
  own closing brace and the whitespace around it are held back until the marker shows where the
  arguments end. JSON strings cannot hold a raw newline, so the closing marker (which starts
  with one) never occurs inside the arguments;
- a call whose head is in another layout (possible only in output generated without the
  grammar) is read whole at its closing marker: as JSON if it is, else under no name, so that it
  counts as a call that is not valid;
- text after the calls is text.

Pure: strings in, a grammar or `ToolEvent`s out.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cluster.api.tool_format import CallArguments, CallStart, TextPiece, ToolEvent

HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
"""A call's JSON up to its arguments, with the name captured (any JSON whitespace)."""
_OBJECT_END = " \t\r\n}"
"""What may end the call's JSON after its arguments: the closing brace and whitespace."""


@dataclass(frozen=True)
class CallLayout:
    """Where calls start and end in a format's output."""

    opening: str
    closing: str
    separator: str
    """What comes between one call's closing marker and the next call's opening marker."""
    marker: str
    """What text outside calls may never contain: the opening marker's own part (without the
    whitespace that follows it)."""


def _regex(text: str) -> str:
    """`text` as a Lark regex that matches it literally."""
    return re.escape(text).replace("\\\n", "\\n").replace("/", "\\/")


def layout_grammar(
    layout: CallLayout,
    functions: Sequence[Mapping[str, Any]],
    parallel: bool,
    json_style: Mapping[str, Any],
) -> str:
    """The Lark grammar (llguidance's dialect) of text, or text then calls to `functions`
    (OpenAI function objects: `name`, `parameters`) in `layout`, at most one call unless
    `parallel`; each call's JSON is written in `json_style` (llguidance's `x-guidance`)."""
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
    schema = {"anyOf": calls, "x-guidance": dict(json_style)}
    next_call = json.dumps(layout.separator + layout.opening)
    more = f" ({next_call} call)*" if parallel else ""
    return "\n".join(
        [
            "%llguidance {}",
            f"start: TEXT | head call{more}",
            f"TEXT: /(?s:.*)/ & ~/(?s:.*){_regex(layout.marker)}(?s:.*)/",
            f"head[lazy]: /(?s:.*){_regex(layout.opening)}/",
            f"call: %json {json.dumps(schema)} {json.dumps(layout.closing)}",
        ]
    )


def held(text: str, marker: str) -> int:
    """How many characters at the end of `text` could begin `marker`."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def _object_tail(text: str) -> int:
    """How many characters at the end of `text` may be the call object's own end."""
    return len(text) - len(text.rstrip(_OBJECT_END))


class DelimitedCallReader:
    """Reads one output in a `CallLayout` as it streams (a `ToolCallReader`)."""

    def __init__(self, layout: CallLayout) -> None:
        self._layout = layout
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
        buffer, opening, closing = self._buffer, self._layout.opening, self._layout.closing
        if self._state == "text":
            at = buffer.find(opening)
            if at >= 0:
                self._text(buffer[:at].rstrip(), events)
                self._buffer, self._state = buffer[at + len(opening) :], "head"
                return
            partial = held(buffer, opening)
            core = buffer[: len(buffer) - partial]
            # Hold back a marker's possible beginning and the whitespace before it: both vanish
            # if a call follows.
            keep = partial + len(core) - len(core.rstrip())
            self._text(buffer[: len(buffer) - keep], events)
            self._buffer = buffer[len(buffer) - keep :]
        elif self._state == "head":
            match = HEAD.match(buffer)
            # The whitespace before the arguments is the head's: wait for what follows it.
            if match is not None and match.end() < len(buffer):
                events.append(CallStart(self._calls, json.loads(f'"{match.group(1)}"')))
                self._buffer, self._state = buffer[match.end() :], "arguments"
            elif closing in buffer:  # another layout: only without the grammar
                block, _, rest = buffer.partition(closing)
                self._whole_call(block, events)
                self._buffer, self._state = rest, "between"
        elif self._state == "arguments":
            at = buffer.find(closing)
            if at >= 0:
                block = buffer[:at].rstrip()
                self._arguments(block[:-1].rstrip() if block.endswith("}") else block, events)
                self._buffer, self._state = buffer[at + len(closing) :], "between"
                self._calls += 1
                return
            partial = held(buffer, closing)
            keep = partial + _object_tail(buffer[: len(buffer) - partial])
            self._arguments(buffer[: len(buffer) - keep], events)
            self._buffer = buffer[len(buffer) - keep :]
        else:
            next_call = self._layout.separator + opening
            if buffer.startswith(next_call):
                self._buffer, self._state = buffer[len(next_call) :], "head"
            elif not next_call.startswith(buffer):  # text after the calls
                self._state = "text"

    @property
    def in_call(self) -> bool:
        return self._state in ("head", "arguments")

    def _whole_call(self, block: str, events: list[ToolEvent]) -> None:
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
