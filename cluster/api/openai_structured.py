"""Structured outputs and forced tool calls in OpenAI bodies: every way to ask, as one `Grammar`.

`parse_structured(route, body)` reads the fields that constrain the output and returns a
`Structured`: the grammar the output must follow (`cluster.runtime.constraint`), the field it
came from (errors about it name that field), and, for tool calls, the tools to render with the
chat template and how the output becomes `tool_calls`. Pure: no tokenizer, no service; the
grammar is compiled and checked by `cluster.api.openai`. Accepted, at most one of them per
request:
- OpenAI's `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}`,
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`;
- vLLM's `structured_outputs` object, with one of `json` (a schema, or its JSON text), `regex`,
  `choice` (a list of strings), `grammar` (Lark, or GBNF with `::=` rules), `json_object`;
- vLLM's older extra fields `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`
  (and `guided_decoding_backend`, any name: there is one engine, and every engine allows the
  same strings);
- chat only: `tools` with `tool_choice` `"required"` (one call or more, `parallel_tool_calls`
  false: exactly one) or `{"type": "function", "function": {"name": ...}}` (that function).
  The output is then JSON constrained by the functions' parameter schemas: for a named
  function its arguments, for "required" a list of `{"name", "arguments"}`. `"none"` renders
  the tools and constrains nothing. `"auto"` (the default when tools are given): the model
  writes text, or text then calls in its own syntax (`ToolFormat`, chosen by the caller from
  the chat template: `cluster.api.tool_formats`), with the grammar of that format holding each
  call's name to the tools and its arguments to the function's schema (`parallel_tool_calls`
  false: at most one call); without a known format it is refused.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from llguidance.gbnf_to_lark import GbnfToLarkError, gbnf_to_lark

from cluster.api.auto_tool_calls import auto_message
from cluster.api.openai_errors import OpenAIError
from cluster.api.openai_fields import STRUCTURED_FIELDS
from cluster.api.openai_schema import Route
from cluster.api.tool_format import ToolFormat
from cluster.runtime.grammar import JSON_OBJECT, JSON_SCHEMA, LARK, REGEX, Grammar

REQUIRED = "required"
NAMED = "named"
AUTO = "auto"


@dataclass(frozen=True)
class ToolCalling:
    """How the output of a request with tools becomes `tool_calls`."""

    mode: str
    """`NAMED` (the output is the function's arguments), `REQUIRED` (a list of calls) or
    `AUTO` (text, then calls in the model's format)."""
    name: str = ""
    """The named function."""
    tool_format: ToolFormat | None = None
    """`AUTO`'s format."""


@dataclass(frozen=True)
class Structured:
    """What a body asks the output to follow."""

    grammar: Grammar | None = None
    source_field: str = ""
    """The body field the grammar came from ("" without one)."""
    tools: tuple[dict[str, Any], ...] = ()
    """Tools for the chat template (OpenAI's `{"type": "function", "function": {...}}`)."""
    calling: ToolCalling | None = None
    """Set when the output is a forced tool call."""
    used: frozenset[str] = field(default_factory=frozenset)
    """The fields read."""


def parse_structured(
    route: Route, body: Mapping[str, Any], tool_format: ToolFormat | None = None
) -> Structured:
    """The grammar and tool calling `body` asks for; `OpenAIError` naming the field at fault.
    `tool_format`: the model's tool-call syntax, which "auto" tool choice needs."""
    found: list[tuple[str, Grammar]] = []
    response_format = body.get("response_format")
    if response_format is not None:
        grammar = _response_format(response_format)
        if grammar is not None:
            schema_given = grammar.kind == JSON_SCHEMA
            found.append(
                ("response_format.json_schema.schema" if schema_given else "response_format",
                 grammar)
            )  # fmt: skip
    structured = body.get("structured_outputs")
    if structured is not None:
        found.append(_structured_outputs(structured))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = body.get(name)
        if value is not None:
            found.append((name, _one(kind, value, name)))
    backend = body.get("guided_decoding_backend")
    if backend is not None and not isinstance(backend, str):
        raise OpenAIError("guided_decoding_backend must be a string", "guided_decoding_backend")
    tools, calling, tool_grammar = _tools(route, body, tool_format)
    if tool_grammar is not None:
        found.append(("tools" if calling and calling.mode == AUTO else "tool_choice",
                      tool_grammar))  # fmt: skip
    if len(found) > 1:
        first, second = (name.split(".")[0] for name, _ in found[:2])
        raise OpenAIError(
            f"{second} and {first} both constrain the output: send one of them", second
        )
    used = frozenset(name for name in STRUCTURED_FIELDS if name in body)
    if not found:
        return Structured(tools=tools, used=used)
    return Structured(found[0][1], found[0][0], tools, calling, used)


def _response_format(value: object) -> Grammar | None:
    where = "response_format"
    if not isinstance(value, dict):
        raise OpenAIError("response_format must be an object", where)
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise OpenAIError(
            f'response_format.type must be "text", "json_object" or "json_schema", got {kind!r}',
            f"{where}.type",
        )
    _only(value, allowed[kind], where)
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar(JSON_OBJECT)
    spec = value.get("json_schema")
    where = f"{where}.json_schema"
    if not isinstance(spec, dict):
        raise OpenAIError("response_format.json_schema must be an object", where)
    _only(spec, {"name", "schema", "strict", "description"}, where)
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise OpenAIError(f"{where}.name must be a string", f"{where}.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise OpenAIError(f"{where}.strict must be a boolean", f"{where}.strict")
    schema = spec.get("schema")
    if schema is None:
        # OpenAI's own default: a schema-less json_schema is any JSON object.
        return Grammar(JSON_OBJECT)
    return _json_schema(schema, f"{where}.schema")


def _structured_outputs(value: object) -> tuple[str, Grammar]:
    where = "structured_outputs"
    if not isinstance(value, dict):
        raise OpenAIError("structured_outputs must be an object", where)
    kinds = ("json", "regex", "choice", "grammar", "json_object")
    _only(value, {*kinds, "disable_any_whitespace", "disable_fallback"}, where)
    set_kinds = [kind for kind in kinds if value.get(kind) not in (None, False)]
    if len(set_kinds) != 1:
        raise OpenAIError(
            f"structured_outputs needs exactly one of {', '.join(kinds)}, got "
            f"{', '.join(set_kinds) or 'none'}",
            where,
        )
    kind = set_kinds[0]
    for flag in ("disable_any_whitespace", "disable_fallback"):
        if value.get(flag) is not None and not isinstance(value[flag], bool):
            raise OpenAIError(f"{where}.{flag} must be a boolean", f"{where}.{flag}")
    if kind == "json_object":
        if value[kind] is not True:
            raise OpenAIError(f"{where}.json_object must be true", f"{where}.json_object")
        return f"{where}.json_object", Grammar(JSON_OBJECT)
    return f"{where}.{kind}", _one(kind, value[kind], f"{where}.{kind}")


def _one(kind: str, value: object, where: str) -> Grammar:
    """One vLLM constraint: `json` (a schema or its text), `regex`, `choice`, `grammar`."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise OpenAIError(f"{where} is not JSON: {error}", where) from None
        return _json_schema(value, where)
    if kind == "choice":
        if (
            not isinstance(value, list)
            or not value
            or not all(isinstance(c, str) and c for c in value)
        ):
            raise OpenAIError(f"{where} must be a non-empty list of non-empty strings", where)
        # A Lark alternation of string literals: JSON's escapes are Lark's.
        return Grammar(LARK, "start: " + " | ".join(json.dumps(c) for c in value))
    if not isinstance(value, str) or not value:
        raise OpenAIError(f"{where} must be a non-empty string", where)
    if kind == "regex":
        return Grammar(REGEX, value)
    if "::=" in value:  # GBNF (llama.cpp's and xgrammar's EBNF): read as Lark
        try:
            return Grammar(LARK, gbnf_to_lark(value))
        except (GbnfToLarkError, ValueError) as error:
            raise OpenAIError(f"{where} is not a grammar: {error}", where) from None
    return Grammar(LARK, value)


def _json_schema(schema: object, where: str) -> Grammar:
    if not isinstance(schema, dict):
        raise OpenAIError(f"{where} must be a JSON schema (an object)", where)
    return Grammar(JSON_SCHEMA, json.dumps(schema))


def _tools(
    route: Route, body: Mapping[str, Any], tool_format: ToolFormat | None
) -> tuple[tuple[dict[str, Any], ...], ToolCalling | None, Grammar | None]:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise OpenAIError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise OpenAIError("tool_choice needs tools", "tool_choice")
        return (), None, None
    if route != "chat.completions":
        raise OpenAIError("tools are taken on /v1/chat/completions only", "tools")
    if not isinstance(tools, list):
        raise OpenAIError("tools must be a list", "tools")
    functions = [_function(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise OpenAIError("tools must have distinct function names", "tools")
    rendered = tuple({"type": "function", "function": f} for f in functions)
    if choice is None or choice == AUTO:
        if tool_format is None:
            raise OpenAIError(
                'tool_choice "auto" (the default with tools) needs the model\'s tool-call '
                "format, and this model's chat template asks for none Tandem knows: set the "
                'service\'s tool_parser, or send "required", a named function '
                '({"type": "function", "function": {"name": ...}}) or "none"',
                "tool_choice",
            )
        grammar = Grammar(LARK, tool_format.grammar(functions, parallel is not False))
        return rendered, ToolCalling(AUTO, tool_format=tool_format), grammar
    if choice == "none":
        return rendered, None, None
    if choice == REQUIRED:
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": _parameters(f)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if parallel is False:
            schema["maxItems"] = 1
        return rendered, ToolCalling(REQUIRED), Grammar(JSON_SCHEMA, json.dumps(schema))
    name = _named(choice)
    if name not in names:
        raise OpenAIError(
            f"tool_choice names {name!r}, which is not one of the tools", "tool_choice"
        )
    parameters = _parameters(functions[names.index(name)])
    return rendered, ToolCalling(NAMED, name), Grammar(JSON_SCHEMA, json.dumps(parameters))


def _function(tool: object, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise OpenAIError(f'{where} must be {{"type": "function", "function": ...}}', where)
    _only(tool, {"type", "function"}, where)
    function = tool.get("function")
    where = f"{where}.function"
    if not isinstance(function, dict):
        raise OpenAIError(f"{where} must be an object", where)
    _only(function, {"name", "description", "parameters", "strict"}, where)
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise OpenAIError(f"{where}.name must be a non-empty string", f"{where}.name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise OpenAIError(f"{where}.parameters must be a JSON schema", f"{where}.parameters")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise OpenAIError(f"{where}.description must be a string", f"{where}.description")
    return {key: value for key, value in function.items() if value is not None}


def _parameters(function: Mapping[str, Any]) -> dict[str, Any]:
    parameters: dict[str, Any] = function.get("parameters") or {
        "type": "object",
        "properties": {},
    }
    return parameters


def _named(choice: object) -> str:
    where = "tool_choice"
    if not isinstance(choice, dict) or choice.get("type") != "function":
        raise OpenAIError(
            'tool_choice must be "none", "auto", "required" or '
            '{"type": "function", "function": {"name": ...}}',
            where,
        )
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise OpenAIError("tool_choice.function.name must be a string", f"{where}.function.name")
    return name


def _only(value: Mapping[str, Any], allowed: set[str], where: str) -> None:
    for key in value:
        if key not in allowed:
            raise OpenAIError(f"unknown field {key!r} in {where}", f"{where}.{key}")


def tool_calls(calling: ToolCalling, text: str) -> list[dict[str, Any]] | None:
    """The `tool_calls` of a finished forced call's output `text`, in OpenAI's shape; None when
    the text is not a whole call (the request hit its token limit)."""
    if calling.mode == NAMED:
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        return [_call(calling.name, text)]
    try:
        calls = json.loads(text)
    except json.JSONDecodeError:
        return None
    return [_call(call["name"], json.dumps(call["arguments"])) for call in calls]


def _call(name: str, arguments: str) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_message(calling: ToolCalling, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
    """The chat `message` and `finish_reason` of a finished forced call: `tool_calls` and no
    content when `text` is a whole call, else the text as content (a call cut by max_tokens);
    for `AUTO`, the text and calls the model's format reads (`auto_message`)."""
    if calling.tool_format is not None:
        return auto_message(calling.tool_format, text, finish_reason)
    calls = tool_calls(calling, text) if finish_reason == "stop" else None
    if calls is None:
        return {"role": "assistant", "content": text, "refusal": None}, finish_reason
    message = {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
    return message, "stop" if calling.mode == NAMED else "tool_calls"


class ToolCallDeltas:
    """A forced call's streamed text as chat deltas: a named function's arguments as they
    come; a "required" list of calls in one delta once it is complete."""

    def __init__(self, calling: ToolCalling) -> None:
        self.calling = calling
        self._text: list[str] = []
        self._id = f"call_{uuid.uuid4().hex[:24]}"

    def delta(self, text: str, first: bool, finish_reason: str | None) -> dict[str, Any] | None:
        """The delta for a chunk of `text` (None: nothing to send); `finish_reason` on the last
        chunk, which `finish` then maps."""
        self._text.append(text)
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if self.calling.mode == NAMED:
            function: dict[str, Any] = {"arguments": text}
            call: dict[str, Any] = {"index": 0, "function": function}
            if first:
                call |= {"id": self._id, "type": "function"}
                function["name"] = self.calling.name
            if text or first:
                delta["tool_calls"] = [call]
            return delta if delta else None
        if finish_reason is not None:
            calls = tool_calls(self.calling, "".join(self._text))
            if calls is None:
                delta["content"] = "".join(self._text)
            else:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
        return delta if delta else None

    def finish(self, finish_reason: str) -> str:
        """The `finish_reason` of the last chunk."""
        if finish_reason != "stop":
            return finish_reason
        if self.calling.mode == NAMED:
            return "stop"
        return "tool_calls" if tool_calls(self.calling, "".join(self._text)) else "stop"
