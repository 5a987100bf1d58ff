"""The fenced-JSON tool-call format (`cluster.api.tool_format_fenced`): the grammar holds the
calls a coder model writes in ```` ```json ```` blocks to the tools, and the reader reads any split
of such a stream as the unary message, with the calls' arguments exactly as written."""

from __future__ import annotations

import json
from typing import Any

from cluster.api.auto_tool_calls import auto_message
from cluster.api.tool_format_fenced import FencedJsonFormat
from cluster.api.tool_formats import TOOL_FORMATS, choose_format
from cluster.config import ModelsConfig
from cluster.presets import PRESETS
from cluster.runtime import tiny
from cluster.runtime.model_spec import TINY_TARGET
from tests.cluster.api.test_openai_auto_tools import TOOLS, accepts, fold, read

FENCED = FencedJsonFormat()


def fenced(name: str, arguments: dict[str, Any], indent: int | None = 2) -> str:
    """A call as Qwen2.5-Coder-1.5B writes one: an indented JSON object in a json block."""
    return f"```json\n{json.dumps({'name': name, 'arguments': arguments}, indent=indent)}\n```"


def test_the_grammar_allows_text_or_text_then_fenced_calls_to_the_tools() -> None:
    functions = [t["function"] for t in TOOLS]
    parallel, single = FENCED.grammar(functions, True), FENCED.grammar(functions, False)
    weather = fenced("get_weather", {"city": "oslo", "unit": "celsius"})
    time_call = fenced("get_time", {"zone": "utc"}, indent=None)  # any JSON whitespace
    code = "Plain text, with ```python\nprint(1)\n``` in it"
    for text in ["", code, weather, f"Sure.\n{weather}"]:
        assert accepts(parallel, text) and accepts(single, text), text
    assert accepts(parallel, f"{weather}\n\n{time_call}")
    assert not accepts(single, f"{weather}\n\n{time_call}")  # parallel_tool_calls: false
    for bad in [
        "a json block ```json\n[1, 2]\n``` is only a call",
        fenced("get_mail", {}),  # not a tool
        fenced("get_time", {"zone": "pst"}),  # arguments outside the schema
        weather + " and more text",
    ]:
        assert not accepts(parallel, bad), bad


def test_any_split_of_a_fenced_stream_reads_as_the_unary_message() -> None:
    weather = {"city": "lima", "unit": "fahrenheit"}
    text = f"Let me check.\n\n{fenced('get_weather', weather)}\n\n{fenced('get_time', {})}"
    message, reason = auto_message(FENCED, text, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me check."
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert [(name, json.loads(arguments)) for name, arguments in calls] == [
        ("get_weather", weather),
        ("get_time", {}),
    ]
    assert calls[0][1] == json.dumps(weather, indent=2).replace("\n", "\n  ")  # as written
    for seed in range(50):
        deltas = read(FENCED, text, seed)
        assert fold(deltas) == ("Let me check.", calls)
        assert not any("`" in d.get("content", "") for d in deltas)  # no half fence leaks


def test_the_fenced_format_is_chosen_by_name_only() -> None:
    assert choose_format("json_fence", tiny.CHAT_TEMPLATE) is TOOL_FORMATS["json_fence"]
    assert choose_format("", tiny.CHAT_TEMPLATE) is TOOL_FORMATS["hermes"]


def test_a_preset_names_the_format_its_model_writes_unless_the_target_is_replaced() -> None:
    assert PRESETS["qwen-coder"].tool_parser == "json_fence"
    assert ModelsConfig(preset="tiny").tool_parser() == ""
    assert ModelsConfig(preset="qwen-coder").tool_parser() == "json_fence"
    replaced = ModelsConfig(preset="qwen-coder", target=TINY_TARGET)
    assert replaced.tool_parser() == ""
