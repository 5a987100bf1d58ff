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

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.api.tool_call_layout import CallLayout, DelimitedCallReader, layout_grammar

LAYOUT = CallLayout(
    opening="<tool_call>\n", closing="\n</tool_call>", separator="\n", marker="<tool_call>"
)
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class HermesFormat:
    """`<tool_call>` JSON calls (Qwen2.5, Hermes, and models trained on their template)."""

    name = "hermes"

    def matches(self, chat_template: str) -> bool:
        return "<tool_call>" in chat_template

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        return layout_grammar(LAYOUT, functions, parallel, _JSON_STYLE)

    def reader(self) -> DelimitedCallReader:
        return DelimitedCallReader(LAYOUT)
