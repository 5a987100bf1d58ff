"""Tool calls written as fenced JSON: ```` ```json ```` blocks holding `{"name", "arguments"}`.

Small instruction-tuned coder models (Qwen2.5-Coder-1.5B-Instruct among them) answer a request
with tools in a Markdown code block rather than in their template's `<tool_call>` tags:

    ```json
    {
      "name": "get_weather",
      "arguments": {"city": "Lisbon"}
    }
    ```

A Hermes parser reads no call in that output, and a Hermes grammar leaves the block as text. This
format makes such a block the call: text may not contain ```` ```json ```` except as the start
of a call, and once a call opens its name is one of the tools and its arguments follow that
tool's parameters (`cluster.api.tool_call_layout`). The JSON keeps whatever whitespace the model
writes (llguidance's flexible whitespace), so it is held to the shape of its calls, not to one
layout it was not trained on. Calls follow each other separated by a blank line.

No chat template asks for this syntax (`matches` is always False): a service chooses it by name
(`tool_parser: json_fence`), or through its preset (`cluster.presets`: `qwen-coder`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.api.tool_call_layout import CallLayout, DelimitedCallReader, layout_grammar

LAYOUT = CallLayout(opening="```json\n", closing="\n```", separator="\n\n", marker="```json")
_JSON_STYLE = {"whitespace_flexible": True}


class FencedJsonFormat:
    """```` ```json ```` blocks of `{"name": ..., "arguments": ...}`."""

    name = "json_fence"

    def matches(self, chat_template: str) -> bool:
        return False

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        return layout_grammar(LAYOUT, functions, parallel, _JSON_STYLE)

    def reader(self) -> DelimitedCallReader:
        return DelimitedCallReader(LAYOUT)
