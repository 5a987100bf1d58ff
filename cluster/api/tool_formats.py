"""The tool-call formats Tandem knows, and which one a model uses.

`TOOL_FORMATS` maps a name (the service config's `tool_parser`) to its `ToolFormat`
(`cluster.api.tool_format`). `choose_format(override, chat_template)` returns the named format
when `override` is set, else the first whose `matches` accepts the model's chat template, else
None (the model has no tool-call syntax Tandem can read: "auto" tool choice is refused). To
add a format: implement `ToolFormat` in a module of its own (see `tool_format_hermes`) and add
it here. Pure: no tokenizer, no engine.
"""

from __future__ import annotations

from cluster.api.tool_format import ToolFormat
from cluster.api.tool_format_fenced import FencedJsonFormat
from cluster.api.tool_format_hermes import HermesFormat
from cluster.runtime.errors import InvalidArgumentError

TOOL_FORMATS: dict[str, ToolFormat] = {"hermes": HermesFormat(), "json_fence": FencedJsonFormat()}
"""Every known format by name, in the order templates are tried."""
DETECT = ""
"""`tool_parser` meaning: pick the format by the model's chat template."""


def check_format_name(name: str, field: str = "tool_parser") -> None:
    """InvalidArgumentError naming `field` unless `name` is "" or a known format."""
    if name != DETECT and name not in TOOL_FORMATS:
        raise InvalidArgumentError(
            f'{field} must be "" (chosen by the chat template) or one of '
            f"{', '.join(sorted(TOOL_FORMATS))}, got {name!r}"
        )


def choose_format(override: str, chat_template: str | None) -> ToolFormat | None:
    """The format named `override`, or the one `chat_template` asks for (None: none known)."""
    check_format_name(override)
    if override != DETECT:
        return TOOL_FORMATS[override]
    if not chat_template:
        return None
    for tool_format in TOOL_FORMATS.values():
        if tool_format.matches(chat_template):
            return tool_format
    return None
