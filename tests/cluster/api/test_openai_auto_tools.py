"""`tool_choice` "auto" (and tools with no `tool_choice`): text, or calls in the model's format.

Pure parts first: the Hermes grammar (checked with llguidance over the tiny tokenizer: text
never holds the opening tag, a call's name and arguments are held to the tools), the reader
(any split of a stream gives the same text and calls), the OpenAI shapes, the messages agents
send back (`tool` results, assistant `tool_calls`), and the `tool_parser` setting.

Then the real `TandemService` and `OpenAIService` over the tiny pair, in this process, served
over real HTTP (uvicorn, `cluster.serve.http.OpenAIHttp`) to the official `openai` client and to
an OpenAI Agents SDK agent. The tiny model is random and never chooses a call by itself
(`tests.cluster.tool_seams`): with the real Hermes format it answers in text; the call tests
use `ForcedHermes`, the same format whose grammar leaves out the text-only answer, so the
target's constrained greedy choice is a call. Every call's arguments validate against their
tool's schema (jsonschema), and a stream gives the calls the unary response gives.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any, Literal

import jsonschema
import llguidance.hf
import openai
import pytest
import uvicorn
from llguidance import LLMatcher
from starlette.requests import Request
from starlette.types import Receive, Scope, Send

from cluster.api.auto_tool_calls import AutoToolDeltas, auto_message
from cluster.api.openai import OpenAIService
from cluster.api.openai_errors import OpenAIError
from cluster.api.openai_schema import parse_request
from cluster.api.openai_structured import AUTO, parse_structured
from cluster.api.service import TandemService
from cluster.api.service_config import ServiceConfig
from cluster.api.tenants import Tenants
from cluster.api.tool_format import ToolFormat
from cluster.api.tool_format_hermes import HermesFormat
from cluster.api.tool_formats import TOOL_FORMATS, choose_format
from cluster.local import LocalTandem
from cluster.runtime import tiny
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.grammar import LARK
from cluster.serve.http import OpenAIHttp
from tests.cluster.tool_seams import FirstTurnForced, ForcedHermes

MODEL = "tiny"
HERMES = HermesFormat()
WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"enum": ["paris", "oslo", "lima"]},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: dict[str, Any] = {
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
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


# --- the grammar ------------------------------------------------------------------------------


def accepts(grammar: str, text: str) -> bool:
    """Whether the tiny tokenizer's bytes of `text` are a whole output `grammar` allows."""
    tokenizer = tiny.build_tokenizer()
    view = llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer), eos_token=[256])
    matcher = LLMatcher(view, LLMatcher.grammar_from_lark(grammar), log_level=0)
    for byte in text.encode():
        if not matcher.consume_token(byte):
            return False
    return matcher.is_accepting()


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_the_hermes_grammar_allows_text_or_text_then_calls_to_the_tools() -> None:
    functions = [t["function"] for t in TOOLS]
    parallel, single = HERMES.grammar(functions, True), HERMES.grammar(functions, False)
    weather = call_text("get_weather", {"city": "oslo", "unit": "celsius"})
    time_call = call_text("get_time", {"zone": "utc"})
    for text in ["", "Hello <b>there</b>", "a < b and <tool", weather, f"Sure.\n{weather}"]:
        assert accepts(parallel, text) and accepts(single, text), text
    assert accepts(parallel, f"{weather}\n{time_call}")
    assert not accepts(single, f"{weather}\n{time_call}")  # parallel_tool_calls: false
    for bad in [
        "text that writes <tool_call> and goes on",  # the tag only opens a call
        "<tool_call>\n",  # an opened call must be made
        call_text("get_mail", {}),  # not a tool
        call_text("get_time", {"zone": "pst"}),  # arguments outside the schema
        call_text("get_time", {}),
        weather + " and more text",
        weather.replace(": ", ":"),  # the template's own JSON layout
    ]:
        assert not accepts(parallel, bad), bad


# --- the reader and OpenAI's shapes ----------------------------------------------------------


def read(tool_format: ToolFormat, text: str, seed: int) -> list[dict[str, Any]]:
    """`text` streamed in random pieces: every delta."""
    rng, deltas, stream, at = random.Random(seed), [], AutoToolDeltas(tool_format), 0
    while at < len(text):
        size = rng.randint(1, 7)
        deltas += stream.deltas(text[at : at + size], False)
        at += size
    return deltas + stream.deltas("", True)


def fold(deltas: list[dict[str, Any]]) -> tuple[str, list[tuple[str, str]]]:
    content, calls = "", []
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["index"] == len(calls) and call["type"] == "function"
                calls.append((call["function"]["name"], call["function"]["arguments"]))
            else:
                name, arguments = calls[call["index"]]
                calls[call["index"]] = (name, arguments + call["function"]["arguments"])
    return content, calls


def test_any_split_of_a_stream_reads_as_the_unary_message() -> None:
    weather = {"city": "lima", "unit": "fahrenheit"}
    text = f"Let me check.  \n{call_text('get_weather', weather)}\n{call_text('get_time', {})}"
    message, reason = auto_message(HERMES, text, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me check."
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]]
    assert calls == [("get_weather", json.dumps(weather)), ("get_time", "{}")]
    for seed in range(50):
        deltas = read(HERMES, text, seed)
        assert fold(deltas) == ("Let me check.", calls)
        assert not any("<" in d.get("content", "") for d in deltas)  # no half tag leaks
    plain = "No call: 1 < 2, <tool maybe.  "
    assert auto_message(HERMES, plain, "stop") == (
        {"role": "assistant", "content": plain, "refusal": None}, "stop",
    )  # fmt: skip
    assert fold(read(HERMES, plain, 0)) == (plain, [])
    cut, reason = auto_message(HERMES, text[:75], "length")  # a call cut by max_tokens
    assert reason == "length" and cut["tool_calls"][0]["function"]["name"] == "get_weather"
    _, reason = auto_message(HERMES, text[:75], "stop")  # cut by a stop string
    assert reason == "stop"


def test_output_made_without_the_grammar_is_still_read() -> None:
    loose = '<tool_call>\n{"arguments": {"zone": "utc"}, "name": "get_time"}\n</tool_call>'
    message, _ = auto_message(HERMES, f"{loose}\nDone.", "stop")
    assert message["content"] == "\nDone."  # text after the calls, as written
    assert message["tool_calls"][0]["function"] == {"name": "get_time",
                                                    "arguments": '{"zone": "utc"}'}  # fmt: skip
    broken, reason = auto_message(HERMES, "<tool_call>\n{oops\n</tool_call>", "stop")
    assert reason == "tool_calls" and broken["tool_calls"][0]["function"] == {
        "name": "",
        "arguments": "{oops",
    }


# --- requests ---------------------------------------------------------------------------------


def test_auto_and_no_tool_choice_are_the_formats_grammar() -> None:
    for choice in ({"tool_choice": "auto"}, {}):
        structured = parse_structured("chat.completions", {"tools": TOOLS, **choice}, HERMES)
        assert structured.calling is not None and structured.calling.mode == AUTO
        assert structured.grammar is not None and structured.grammar.kind == LARK
        assert structured.source_field == "tools" and len(structured.tools) == 2
        assert structured.grammar.source == HERMES.grammar([t["function"] for t in TOOLS], True)
    single = parse_structured(
        "chat.completions", {"tools": TOOLS, "parallel_tool_calls": False}, HERMES
    )
    assert single.grammar is not None and "call)*" not in single.grammar.source
    with pytest.raises(OpenAIError) as refused:  # a model without a known format
        parse_structured("chat.completions", {"tools": TOOLS})
    assert refused.value.param == "tool_choice" and "tool_parser" in str(refused.value)


def test_the_format_follows_the_template_or_the_setting() -> None:
    assert choose_format("", tiny.CHAT_TEMPLATE) is TOOL_FORMATS["hermes"]
    assert choose_format("", "{{ messages }}") is None and choose_format("", None) is None
    assert choose_format("hermes", None) is TOOL_FORMATS["hermes"]
    assert ServiceConfig(tool_parser="hermes").tool_parser == "hermes"
    with pytest.raises(InvalidArgumentError, match=r"tool_parser must be .* got 'mistral'"):
        ServiceConfig(tool_parser="mistral")


def test_tool_results_and_calls_are_taken_and_rendered() -> None:
    arguments = {"city": "oslo", "unit": "celsius"}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": json.dumps(arguments)}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"},
    ]  # fmt: skip
    request = parse_request("chat.completions", {"model": MODEL, "messages": messages})
    assert request.conversation[1]["tool_calls"][0]["function"]["arguments"] == arguments
    assert request.conversation[2] == {"role": "tool", "content": "4 degrees",
                                       "tool_call_id": "call_1"}  # fmt: skip
    rendered = tiny.build_tokenizer().apply_chat_template(
        list(request.conversation), tools=TOOLS, add_generation_prompt=True, tokenize=False
    )
    assert isinstance(rendered, str)
    assert call_text("get_weather", arguments) in rendered
    assert "<tool_response>\n4 degrees\n</tool_response>" in rendered
    assert rendered.endswith("<|im_start|>assistant\n") and "<tools>" in rendered
    bad = [
        ({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
        ({"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {
            "name": "f", "arguments": "[1]"}}]}, "messages[1].tool_calls[0].function.arguments"),
        ({"role": "user", "content": "x", "tool_call_id": "a"}, "messages[1].tool_call_id"),
        ({"role": "robot", "content": "x"}, "messages[1].role"),
    ]  # fmt: skip
    for message, param in bad:
        with pytest.raises(OpenAIError) as raised:
            parse_request("chat.completions", {"model": MODEL, "messages": [*ASK, message]})
        assert raised.value.param == param


# --- through the service, over HTTP, with the official client ----------------------------------


@pytest.fixture(scope="module")
def service(local_tandem: LocalTandem) -> TandemService:
    config = ServiceConfig(default_draft_tokens=4, default_pipelined=False)
    return TandemService(
        local_tandem.router, local_tandem.tokenizer, config, tenants=Tenants.unauthenticated()
    )


@contextmanager
def serving(openai_service: OpenAIService) -> Iterator[str]:
    """`openai_service` over real HTTP on a free local port: the base URL, `.../v1`."""
    threads = ThreadPoolExecutor(max_workers=8)
    adapter = OpenAIHttp(openai_service, threads)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        response = await adapter(Request(scope, receive))
        await response(scope, receive, send)

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off", log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        threads.shutdown(wait=True)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)


def streamed(http: openai.OpenAI, **fields: Any) -> tuple[str, list[tuple[str, str]], str]:
    """A stream's content, its calls (name, arguments) and its last finish_reason."""
    content, calls, reason = "", [], ""
    order: list[str] = []
    for chunk in http.chat.completions.create(stream=True, **fields):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id:  # id, type and name come first, once
                assert call.function is not None and call.function.name
                calls.append((call.function.name, call.function.arguments or ""))
                order.append("start")
            else:
                assert call.function is not None and call.index == len(calls) - 1
                name, arguments = calls[call.index]
                calls[call.index] = (name, arguments + (call.function.arguments or ""))
        reason = chunk.choices[0].finish_reason or reason
    return content, calls, reason


def test_with_no_call_the_model_answers_in_text(service: TandemService) -> None:
    with serving(OpenAIService(service, MODEL)) as url, client(url) as http:
        for choice in ({"tool_choice": "auto"}, {}):  # left out: "auto"
            fields = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 24,
                      "temperature": 0, **choice}  # fmt: skip
            reply = http.chat.completions.create(**fields)
            message = reply.choices[0].message
            assert message.tool_calls is None and message.content
            assert reply.choices[0].finish_reason in ("stop", "length")
            assert streamed(http, **fields) == (message.content, [], reply.choices[0].finish_reason)


def check_calls(calls: list[tuple[str, str]]) -> None:
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_a_call_is_made_read_and_streamed_alike(service: TandemService) -> None:
    forced = OpenAIService(service, MODEL, tool_format=ForcedHermes(min_calls=2))
    with serving(forced) as url, client(url) as http:
        fields = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 256,
                  "temperature": 0}  # fmt: skip
        for extra in ({"tool_choice": "auto"}, {}):
            reply = http.chat.completions.create(**fields, **extra)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls"
            unary = [
                (c.function.name, c.function.arguments) for c in choice.message.tool_calls or []
            ]
            assert len(unary) >= 2  # parallel calls in one message
            assert all(c.id.startswith("call_") and c.type == "function"
                       for c in choice.message.tool_calls or [])  # fmt: skip
            check_calls(unary)
            assert streamed(http, **fields, **extra) == (
                choice.message.content or "",
                unary,
                "tool_calls",
            )
        single = http.chat.completions.create(**fields, parallel_tool_calls=False)
        calls = single.choices[0].message.tool_calls or []
        assert len(calls) == 1 and single.choices[0].finish_reason == "tool_calls"
        check_calls([(calls[0].function.name, calls[0].function.arguments)])
        sampled = [
            http.chat.completions.create(**fields | {"temperature": 1.0, "seed": seed})
            for seed in range(4)
        ]
        for reply in sampled:
            check_calls([(c.function.name, c.function.arguments)
                         for c in reply.choices[0].message.tool_calls or []])  # fmt: skip


# --- an agent ---------------------------------------------------------------------------------


def test_an_openai_agents_sdk_agent_completes_its_loop(service: TandemService) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        RunConfig,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from agents.items import MessageOutputItem, ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    called: list[tuple[str, dict[str, str]]] = []

    @function_tool
    def get_weather(city: Literal["paris", "oslo"]) -> str:
        """The weather in a city."""
        called.append(("get_weather", {"city": city}))
        return f"sunny in {city}"

    @function_tool
    def get_time(zone: Literal["utc", "cet"]) -> str:
        """The time in a zone."""
        called.append(("get_time", {"zone": zone}))
        return "noon"

    async def run(url: str, streamed: bool) -> Any:
        http = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
        agent = Agent(
            name="assistant",
            instructions="Answer with the tools.",
            tools=[get_weather, get_time],
            model=OpenAIChatCompletionsModel(model=MODEL, openai_client=http),
            model_settings=ModelSettings(temperature=0, max_tokens=160),
        )
        ask, config = "Weather in Paris, and the time?", RunConfig(tracing_disabled=True)
        if not streamed:
            return await Runner.run(agent, ask, max_turns=4, run_config=config)
        result = Runner.run_streamed(agent, ask, max_turns=4, run_config=config)
        async for _ in result.stream_events():  # the calls arrive as streamed deltas
            pass
        return result

    for streamed in (False, True):
        called.clear()
        format_ = FirstTurnForced()
        with serving(OpenAIService(service, MODEL, tool_format=format_)) as url:
            result = asyncio.run(run(url, streamed))
        kinds = [type(item) for item in result.new_items]
        assert ToolCallItem in kinds and ToolCallOutputItem in kinds, kinds
        assert kinds[-1] is MessageOutputItem
        assert called and isinstance(result.final_output, str) and result.final_output
        assert format_.turns == 2  # a call, then the answer: both requests "auto"


def test_a_model_without_a_known_format_refuses_auto_with_a_400(service: TandemService) -> None:
    unknown = OpenAIService(service, MODEL)
    unknown.tool_format = None  # as for a chat template with no tool-call syntax Tandem reads
    with serving(unknown) as url, client(url) as http:
        with pytest.raises(openai.BadRequestError) as refused:
            http.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
        body = refused.value.body
        assert isinstance(body, dict) and body.get("param") == "tool_choice", body
        forced = http.chat.completions.create(  # the other choices still work
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=96, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_time"}},
        )  # fmt: skip
        assert forced.choices[0].message.tool_calls


def test_a_stream_with_usage_ends_with_it(service: TandemService) -> None:
    forced = OpenAIService(service, MODEL, tool_format=ForcedHermes())
    with serving(forced) as url, client(url) as http:
        chunks = list(
            http.chat.completions.create(
                model=MODEL, messages=ASK, tools=TOOLS, max_tokens=160, temperature=0,
                stream=True, stream_options={"include_usage": True},
            )
        )  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-2].choices[0].finish_reason == "tool_calls"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens > 0


def test_a_conversation_with_tool_turns_is_rendered_by_the_template(
    service: TandemService,
) -> None:
    history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": '{"zone": "cet"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
    ]  # fmt: skip
    openai_service = OpenAIService(service, MODEL)
    for tools in ([], TOOLS):  # the tools sent again, as agents do, or not
        body = {"model": MODEL, "messages": history, "max_tokens": 4, "temperature": 0}
        body |= {"tools": tools} if tools else {}
        _, message = openai_service.to_api_request("chat.completions", body)
        rendered = tiny.build_tokenizer().apply_chat_template(
            [*history[:1], {**history[1], "tool_calls": [{**history[1]["tool_calls"][0],
             "function": {"name": "get_time", "arguments": {"zone": "cet"}}}]}, history[2]],
            tools=tools or None, add_generation_prompt=True, tokenize=False,
        )  # fmt: skip
        assert isinstance(rendered, str)
        assert message.prompt == tuple(rendered.encode())
        assert "<tool_response>\nnoon\n</tool_response>" in rendered
