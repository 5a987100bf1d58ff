"""Structured outputs and forced tool calls on the OpenAI-compatible API.

Pure parsing (`cluster.api.openai_structured`) first; then the official `openai` client against
the tiny service (Ray, Serve's HTTP proxy): `response_format` with a JSON schema, the client's
`parse` with a pydantic model (unary and streamed), vLLM's extra fields, forced tool calls
(unary and streamed) whose arguments validate against the tool's schema, and clear 400s for
bad schemas. The tiny pair is random, so every schema bounds its strings and numbers: the
constraint alone decides that the output is whole JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from cluster.api.openai_errors import OpenAIError
from cluster.api.openai_structured import (
    NAMED,
    REQUIRED,
    ToolCallDeltas,
    ToolCalling,
    parse_structured,
    tool_message,
)
from cluster.runtime.constraint import JSON_OBJECT, JSON_SCHEMA, LARK, REGEX
from tests.cluster.conftest import TENANT_KEYS

PET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "kind": {"enum": ["cat", "dog", "fish"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["utc", "cet"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = (WEATHER_TOOL, TIME_TOOL)
MESSAGES = [{"role": "user", "content": "Tell me about a pet, as JSON."}]


# --- parsing ----------------------------------------------------------------------------------


def test_each_way_of_asking_becomes_one_grammar() -> None:
    cases: list[tuple[dict[str, Any], str, str]] = [
        ({"response_format": {"type": "json_object"}}, JSON_OBJECT, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p",
                                 "schema": PET_SCHEMA, "strict": True}}},
            JSON_SCHEMA, "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "[ab]+"}}, REGEX, "structured_outputs.regex"),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, LARK, "structured_outputs.choice"),
        ({"structured_outputs": {"json_object": True}}, JSON_OBJECT,
         "structured_outputs.json_object"),
        ({"guided_json": json.dumps(PET_SCHEMA)}, JSON_SCHEMA, "guided_json"),
        ({"guided_regex": "a+"}, REGEX, "guided_regex"),
        ({"guided_choice": ["a", 'b"c']}, LARK, "guided_choice"),
        ({"guided_grammar": 'root ::= "x" | "y"', "guided_decoding_backend": "xgrammar"},
         LARK, "guided_grammar"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required"}, JSON_SCHEMA, "tool_choice"),
    ]  # fmt: skip
    for fields, kind, field in cases:
        structured = parse_structured("chat.completions", fields)
        assert structured.grammar is not None and structured.grammar.kind == kind, fields
        assert structured.source_field == field
    assert parse_structured("completions", {"response_format": {"type": "text"}}).grammar is None


def test_a_named_tool_constrains_to_its_parameters_and_required_to_a_list_of_calls() -> None:
    named = parse_structured(
        "chat.completions",
        {"tools": [WEATHER_TOOL, TIME_TOOL],
         "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
    )  # fmt: skip
    assert named.calling == ToolCalling(NAMED, "get_time")
    assert named.grammar is not None
    assert json.loads(named.grammar.source) == TIME_TOOL["function"]["parameters"]
    assert len(named.tools) == 2
    required = parse_structured(
        "chat.completions",
        {"tools": [WEATHER_TOOL, TIME_TOOL], "tool_choice": "required",
         "parallel_tool_calls": False},
    )  # fmt: skip
    assert required.grammar is not None
    schema = json.loads(required.grammar.source)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "utc"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"city": "x"}}], schema)
    none = parse_structured("chat.completions", {"tools": [WEATHER_TOOL], "tool_choice": "none"})
    assert none.grammar is None and none.tools


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": "json"}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object", "x": 1}}, "response_format.x"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"structured_outputs": {"whatever": 1}}, "structured_outputs.whatever"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"tools": [WEATHER_TOOL]}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                   "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER_TOOL, WEATHER_TOOL], "tool_choice": "required"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "parallel_tool_calls": 1},
         "parallel_tool_calls"),
    ],
)  # fmt: skip
def test_bad_structured_fields_are_named(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(OpenAIError) as raised:
        parse_structured("chat.completions", fields)
    assert raised.value.param == param


def test_tool_messages_and_deltas_take_openai_shapes() -> None:
    named = ToolCalling(NAMED, "get_time")
    message, reason = tool_message(named, '{"zone":"utc"}', "stop")
    assert reason == "stop" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {
        "name": "get_time",
        "arguments": '{"zone":"utc"}',
    }
    assert re.fullmatch(r"call_[0-9a-f]{24}", message["tool_calls"][0]["id"])
    cut, reason = tool_message(named, '{"zone":"u', "length")
    assert reason == "length" and cut["content"] == '{"zone":"u' and "tool_calls" not in cut
    required = ToolCalling(REQUIRED)
    message, reason = tool_message(required, '[{"name":"f","arguments":{"a":1}}]', "stop")
    assert reason == "tool_calls"
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"a": 1}
    deltas = ToolCallDeltas(named)
    first = deltas.delta('{"zo', True, None)
    assert first is not None and first["tool_calls"][0]["function"]["name"] == "get_time"
    last = deltas.delta('ne":"cet"}', False, "stop")
    assert last is not None and last["tool_calls"][0]["function"] == {"arguments": 'ne":"cet"}'}
    assert deltas.finish("stop") == "stop"
    listed = ToolCallDeltas(required)
    assert listed.delta('[{"name":"f",', True, None) == {"role": "assistant"}
    end = listed.delta('"arguments":{}}]', False, "stop")
    assert end is not None and end["tool_calls"][0]["function"]["name"] == "f"
    assert listed.finish("stop") == "tool_calls"


# --- through the service, with the official client ---------------------------------------------


def client(service: dict[str, object]) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=str(service["http_url"]), api_key=TENANT_KEYS["main"], max_retries=0, timeout=120
    )


class Pet(BaseModel):
    name: str = Field(max_length=6)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog", "fish"]


@pytest.mark.ray
@pytest.mark.slow
def test_response_format_gives_json_that_validates(service: dict[str, object]) -> None:
    with client(service) as http:
        for seed in range(3):
            reply = http.chat.completions.create(
                model="tiny",
                messages=MESSAGES,
                max_tokens=96,
                temperature=1.0,
                seed=seed,
                response_format={
                    "type": "json_schema",
                    "json_schema": {"name": "pet", "schema": PET_SCHEMA, "strict": True},
                },
            )
            choice = reply.choices[0]
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.message.content or ""), PET_SCHEMA)
        anything = http.completions.create(
            model="tiny", prompt="{", max_tokens=64, temperature=0,
            extra_body={"structured_outputs": {"regex": "[a-c]{2,5}!"}},
        )  # fmt: skip
        assert re.fullmatch("[a-c]{2,5}!", anything.choices[0].text)
        assert anything.choices[0].finish_reason == "stop"


@pytest.mark.ray
@pytest.mark.slow
def test_the_clients_parse_returns_the_pydantic_model_unary_and_streamed(
    service: dict[str, object],
) -> None:
    with client(service) as http:
        parsed = http.beta.chat.completions.parse(
            model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=96, temperature=0,
        )  # fmt: skip
        pet = parsed.choices[0].message.parsed
        assert isinstance(pet, Pet)
        with http.beta.chat.completions.stream(
            model="tiny", messages=MESSAGES, response_format=Pet, max_tokens=96, temperature=0,
        ) as stream:  # fmt: skip
            chunks = sum(1 for _ in stream)
            final = stream.get_final_completion()
        assert chunks > 1
        assert final.choices[0].message.parsed == pet  # greedy: the same either way


@pytest.mark.ray
@pytest.mark.slow
def test_a_forced_tool_call_returns_arguments_that_validate(service: dict[str, object]) -> None:
    parameters = WEATHER_TOOL["function"]["parameters"]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    with client(service) as http:
        named = http.chat.completions.create(
            model="tiny", messages=ask, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=96,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
        )  # fmt: skip
        message = named.choices[0].message
        assert message.content is None and message.tool_calls
        call = message.tool_calls[0]
        assert call.type == "function" and call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), parameters)
        required = http.chat.completions.create(
            model="tiny", messages=ask, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=128,
            tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=5,
        )  # fmt: skip
        assert required.choices[0].finish_reason == "tool_calls"
        calls = required.choices[0].message.tool_calls or []
        assert len(calls) == 1
        schemas = {
            t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)
        }
        jsonschema.validate(
            json.loads(calls[0].function.arguments), schemas[calls[0].function.name]
        )
        streamed = http.chat.completions.create(
            model="tiny", messages=ask, tools=[WEATHER_TOOL], max_tokens=96, stream=True,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=0,
        )  # fmt: skip
        arguments, names, reasons = [], [], []
        for chunk in streamed:
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                if delta_call.function and delta_call.function.name:
                    names.append(delta_call.function.name)
                if delta_call.function and delta_call.function.arguments:
                    arguments.append(delta_call.function.arguments)
            reasons.append(chunk.choices[0].finish_reason)
        assert names == ["get_weather"] and reasons[-1] == "stop"
        assert "".join(arguments) == call.function.arguments


@pytest.mark.ray
@pytest.mark.slow
def test_bad_schemas_get_a_400_naming_the_field(service: dict[str, object]) -> None:
    bad: list[tuple[dict[str, Any], str]] = [
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "format": "weird"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"$ref": "#/nowhere"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "if": {"required": ["a"]},
                                    "then": {"required": ["b"]}}}}},
         "response_format.json_schema.schema"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
    ]  # fmt: skip
    with client(service) as http:
        for fields, param in bad:
            with pytest.raises(openai.BadRequestError) as raised:
                http.chat.completions.create(
                    model="tiny",
                    messages=MESSAGES,
                    max_tokens=8,
                    **fields,
                )
            assert raised.value.status_code == 400
            body = raised.value.body
            assert isinstance(body, dict) and body.get("param") == param, body


def test_the_grpc_client_and_the_cli_send_grammars(tmp_path: Any) -> None:
    from cluster.api.client_types import build_request
    from cluster.cli.generate import _grammar
    from cluster.cli.main import build_parser
    from cluster.runtime.grammar import Grammar

    request = build_request("x", max_tokens=4, grammar=Grammar(REGEX, "[ab]+"))
    assert request.grammar.WhichOneof("kind") == "regex" and request.grammar.regex == "[ab]+"
    assert build_request("x", max_tokens=4, grammar=Grammar(JSON_OBJECT)).grammar.json_object
    assert not build_request("x", max_tokens=4).HasField("grammar")
    schema_file = tmp_path / "pet.json"
    schema_file.write_text(json.dumps(PET_SCHEMA))
    parser = build_parser()
    for flags, expected in [
        (["--json-schema", f"@{schema_file}"], Grammar(JSON_SCHEMA, json.dumps(PET_SCHEMA))),
        (["--json-object"], Grammar(JSON_OBJECT)),
        (["--regex", "a+"], Grammar(REGEX, "a+")),
        (["--grammar", 'start: "x"'], Grammar(LARK, 'start: "x"')),
        ([], None),
    ]:
        args = parser.parse_args(["generate", "--local", *flags, "hi"])
        assert _grammar(args) == expected
    with pytest.raises(SystemExit):  # one constraint at most
        parser.parse_args(["generate", "--local", "--regex", "a", "--json-object", "hi"])
