"""A model's own tool-call syntax: the interface every format implements, and what its reader says.

With `tool_choice` "auto" the model answers in text or calls tools in the syntax it was trained
on (Qwen's Hermes style: `<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`). A
`ToolFormat` knows one such syntax and gives two things:

- `grammar(functions, parallel)`: a Lark grammar (llguidance's dialect) of "text, or text
  followed by calls": the text may never contain the opening of a call, and once a call opens
  its name is one of `functions` and its arguments follow that function's parameter schema;
  `parallel` False allows at most one call.
- `reader()`: a `ToolCallReader` that turns the output, fed chunk by chunk as it streams, into
  `ToolEvent`s: pieces of text, the start of a call (its name) and fragments of its arguments.
  The fragments of a whole call concatenate to its arguments' JSON. Text that may still turn out
  to open a call is held back until it is known (so streamed content never shows half a tag).

Pure: no tokenizer and no engine. `cluster.api.tool_formats` lists the formats and picks one by
the model's chat template; `cluster.api.auto_tool_calls` turns events into OpenAI's shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class TextPiece:
    """Text the model wrote outside any call (the message's `content`)."""

    text: str


@dataclass(frozen=True)
class CallStart:
    """Call number `index` (from 0) opened, naming function `name`."""

    index: int
    name: str


@dataclass(frozen=True)
class CallArguments:
    """A fragment of call `index`'s arguments JSON."""

    index: int
    fragment: str


ToolEvent = TextPiece | CallStart | CallArguments


class ToolCallReader(Protocol):
    """Reads one output in a format, as it streams."""

    def feed(self, text: str) -> list[ToolEvent]:
        """The events that `text`, the next chunk of output, makes certain."""
        ...

    def finish(self) -> list[ToolEvent]:
        """The events left once the output has ended (text held back is text after all)."""
        ...

    @property
    def in_call(self) -> bool:
        """Whether the output so far ends inside a call (one cut short when it ends here)."""
        ...


class ToolFormat(Protocol):
    """A model family's tool-call syntax."""

    @property
    def name(self) -> str:
        """What the service config's `tool_parser` calls it."""
        ...

    def matches(self, chat_template: str) -> bool:
        """Whether a chat template asks for this syntax."""
        ...

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        """The Lark grammar of "text, or text then calls to `functions`" (OpenAI function
        objects: `name`, `parameters`); at most one call unless `parallel`."""
        ...

    def reader(self) -> ToolCallReader:
        """A fresh reader for one output."""
        ...
