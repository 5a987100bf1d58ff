"""`OpenAIService` without HTTP: OpenAI's shapes, the same tokens as the Tandem API, every bad
field named, errors mapped to HTTP, and streams that free their sessions when closed."""

from __future__ import annotations

import logging
import time
from typing import Any

import pytest

from cluster.api.caller import Caller
from cluster.api.chat import NoChatTemplateError
from cluster.api.convert import prompt_from_proto
from cluster.api.grpc_api import GrpcApi
from cluster.api.openai import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    OpenAIService,
    Route,
    error_response,
    served_model_name,
)
from cluster.api.openai_errors import ModelNotFoundError, OpenAIError
from cluster.api.running import RequestNotFoundError
from cluster.api.service import RequestCancelledError, TandemService
from cluster.api.service_config import ServiceConfig
from cluster.api.tenants import (
    AuthConfig,
    PermissionDeniedError,
    QuotaExceededError,
    TenantConfig,
    Tenants,
    UnauthenticatedError,
    hash_api_key,
    new_api_key,
)
from cluster.config import ModelsConfig
from cluster.local import LocalTandem
from cluster.routing.router import Router
from cluster.runtime import tiny
from cluster.runtime.errors import (
    ClusterSecretError,
    DeadlineExceededError,
    InvalidArgumentError,
    ReplicaUnavailableError,
    ResourceExhaustedError,
)
from protos import generate_pb2
from tests.conftest import CODE_PROMPT

MODEL = "tiny"
LIMIT = 100
CONTEXT = 120
"""The context the service checks against (smaller than the tiny verifier's): room for tests
of the default `max_tokens` and of a request that does not fit."""
ROUTES: tuple[Route, Route] = ("completions", "chat.completions")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": CODE_PROMPT}]
CHAT_PROMPT = (("system", "Be brief."), ("user", CODE_PROMPT))
DROP = object()
"""A field value meaning "leave the field out"."""


CONFIG = ServiceConfig(default_draft_tokens=4, default_pipelined=False, max_tokens_limit=LIMIT)


@pytest.fixture(scope="module")
def service(local_tandem: LocalTandem) -> TandemService:
    return TandemService(
        local_tandem.router,
        local_tandem.tokenizer,
        CONFIG,
        tenants=Tenants.unauthenticated(),
        max_context_tokens=CONTEXT,
    )


@pytest.fixture(scope="module")
def openai(service: TandemService) -> OpenAIService:
    return OpenAIService(service, MODEL)


@pytest.fixture(scope="module")
def lockstep_service(local_tandem: LocalTandem, lockstep: Router) -> TandemService:
    """The same service over the lockstep router (`verifier_advances` off), where the
    speculation counters are the same for the same request every time: not pipelined by
    default, every token through a drafted block. (With running sessions, whether a drafted
    block decides anything is timing.)"""
    return TandemService(
        lockstep,
        local_tandem.tokenizer,
        CONFIG,
        tenants=Tenants.unauthenticated(),
        max_context_tokens=CONTEXT,
    )


@pytest.fixture(scope="module")
def lockstep_openai(lockstep_service: TandemService) -> OpenAIService:
    return OpenAIService(lockstep_service, MODEL)


def body(route: Route, **fields: Any) -> dict[str, Any]:
    """A valid greedy request of 12 tokens for `route`, with `fields` set (or dropped)."""
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 12, "temperature": 0}
    base |= {"prompt": CODE_PROMPT} if route == "completions" else {"messages": MESSAGES}
    base |= fields
    return {key: value for key, value in base.items() if value is not DROP}


def tandem_request(route: Route, max_tokens: int = 12) -> generate_pb2.GenerateRequest:
    """The Tandem request `body(route)` stands for."""
    message = generate_pb2.GenerateRequest(max_tokens=max_tokens)
    if route == "completions":
        message.text = CODE_PROMPT
    else:
        message.chat.messages.extend(
            generate_pb2.ChatMessage(role=role, content=content) for role, content in CHAT_PROMPT
        )
    return message


def assert_sessions_closed(tandem: LocalTandem) -> None:
    assert tandem.verifier.stats().num_sessions == 0
    assert tandem.drafter.stats().num_sessions == 0


def test_models_lists_the_served_model(openai: OpenAIService) -> None:
    listed = openai.models(Caller())
    assert listed == {
        "object": "list",
        "data": [
            {"id": MODEL, "object": "model", "created": listed["data"][0]["created"],
             "owned_by": "tandem"}
        ],
    }  # fmt: skip
    assert isinstance(listed["data"][0]["created"], int)


def test_served_model_name_is_the_preset_or_the_target() -> None:
    assert served_model_name(ModelsConfig()) == "tiny"
    assert served_model_name(ModelsConfig(preset="qwen-coder")) == "qwen-coder"
    assert served_model_name(ModelsConfig(target="tiny://target")) == "tiny://target"


def test_greedy_completion_equals_generate(
    openai: OpenAIService, service: TandemService, local_tandem: LocalTandem
) -> None:
    expected = GrpcApi(service).generate(tandem_request("completions"))
    result = openai.complete("completions", body("completions"))
    assert result["id"].startswith("cmpl-") and len(result["id"]) == len("cmpl-") + 32
    assert result["object"] == "text_completion"
    assert isinstance(result["created"], int) and result["model"] == MODEL
    assert result["choices"] == [
        {"index": 0, "text": expected.text, "logprobs": None, "finish_reason": "length"}
    ]
    num_prompt = len(local_tandem.tokenizer.encode(CODE_PROMPT, add_special_tokens=False))
    usage = result["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (num_prompt, 12)
    assert usage["total_tokens"] == num_prompt + 12
    # The same prompt as token ids, or as a batch of one, is the same request.
    ids = list(local_tandem.tokenizer.encode(CODE_PROMPT, add_special_tokens=False))
    for prompt in (ids, [CODE_PROMPT], [ids]):
        again = openai.complete("completions", body("completions", prompt=prompt))
        assert again["choices"][0]["text"] == expected.text
    assert_sessions_closed(local_tandem)


def test_chat_equals_generate_with_chat_and_with_its_text(
    openai: OpenAIService, service: TandemService
) -> None:
    from_chat = GrpcApi(service).generate(tandem_request("chat.completions"))
    as_text = generate_pb2.GenerateRequest(
        text=service.reader.chat_prompt(CHAT_PROMPT), max_tokens=12
    )
    assert GrpcApi(service).generate(as_text).text == from_chat.text
    result = openai.complete("chat.completions", body("chat.completions"))
    assert result["id"].startswith("chatcmpl-") and result["object"] == "chat.completion"
    assert result["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": from_chat.text, "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert result["usage"]["prompt_tokens"] == from_chat.usage.prompt_tokens
    # Content as a list of text parts is joined with newlines.
    parts = [{"role": "user", "content": [{"type": "text", "text": t} for t in ("a", "b")]}]
    joined = [{"role": "user", "content": "a\nb"}]
    texts = [
        openai.complete("chat.completions", body("chat.completions", messages=m))
        for m in (parts, joined)
    ]
    assert texts[0]["choices"] == texts[1]["choices"]


def test_fields_at_their_neutral_value_are_accepted(openai: OpenAIService) -> None:
    common = {"n": 1, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
              "user": "someone", "stop": None, "seed": None, "service_tier": "auto"}  # fmt: skip
    neutral: dict[Route, dict[str, Any]] = {
        "completions": {"best_of": 1, "logprobs": None, "echo": False, "suffix": ""},
        "chat.completions": {
            "logprobs": False, "top_logprobs": 0, "tools": [], "tool_choice": "none",
            "response_format": {"type": "text"}, "store": False, "metadata": {"a": "b"},
            "parallel_tool_calls": True, "max_completion_tokens": 12,
            "messages": [{"role": "user", "content": "hi", "name": None, "tool_calls": []}],
        },
    }  # fmt: skip
    for route in ROUTES:
        result = openai.complete(route, body(route, **common, **neutral[route]))
        assert result["usage"]["completion_tokens"] == 12


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("include_usage", [False, True])
def test_stream_concatenates_to_the_unary_response(
    lockstep_openai: OpenAIService, local_tandem: LocalTandem, route: Route, include_usage: bool
) -> None:
    openai = lockstep_openai  # the usage chunk's counters equal the unary response's
    unary = openai.complete(route, body(route))
    options = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(openai.stream(route, body(route, stream=True, **options)))
    usage_chunk = chunks.pop() if include_usage else None
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"] != unary["id"]
    chunk_object = "text_completion" if route == "completions" else "chat.completion.chunk"
    assert {c["object"] for c in chunks} == {chunk_object}
    choices = [c["choices"][0] for c in chunks]
    assert [c["finish_reason"] for c in choices] == [None] * (len(choices) - 1) + ["length"]
    if route == "completions":
        text = "".join(c["text"] for c in choices)
        expected = unary["choices"][0]["text"]
    else:
        assert choices[0]["delta"]["role"] == "assistant"
        assert all("role" not in c["delta"] for c in choices[1:])
        text = "".join(c["delta"].get("content", "") for c in choices)
        expected = unary["choices"][0]["message"]["content"]
    assert text == expected
    if usage_chunk is None:
        assert all("usage" not in c for c in chunks)
    else:
        assert all(c["usage"] is None for c in chunks)
        assert usage_chunk["choices"] == [] and usage_chunk["id"] == chunks[0]["id"]
        assert usage_chunk["usage"] == unary["usage"]
    assert_sessions_closed(local_tandem)


def test_usage_speculation_matches_the_tandem_counters(
    lockstep_openai: OpenAIService, lockstep_service: TandemService
) -> None:
    openai, service = lockstep_openai, lockstep_service  # counters the same every time
    expected = GrpcApi(service).generate(tandem_request("completions", max_tokens=30))
    usage = openai.complete("completions", body("completions", max_tokens=30))["usage"]
    stats = expected.speculation
    assert usage["completion_tokens"] == len(expected.token_ids) == 30
    assert usage["speculation"] == {
        "drafted": stats.num_drafted,
        "accepted": stats.num_accepted,
        "acceptance_rate": stats.num_accepted / stats.num_drafted,
        "verify_passes": stats.num_verify_passes,
        "tokens_per_verify_pass": 30 / stats.num_verify_passes,
    }
    assert usage["speculation"]["tokens_per_verify_pass"] > 1  # drafts were accepted
    # Without speculation every target pass commits exactly one token.
    alone = openai.complete("completions", body("completions", draft_tokens=0))["usage"]
    assert alone["speculation"] == {
        "drafted": 0,
        "accepted": 0,
        "acceptance_rate": None,
        "verify_passes": 12,
        "tokens_per_verify_pass": 1.0,
    }


def test_a_seed_repeats_sampling(openai: OpenAIService) -> None:
    sampled = body("completions", temperature=0.9, max_tokens=30, seed=123)
    first = openai.complete("completions", sampled)["choices"][0]["text"]
    assert openai.complete("completions", sampled)["choices"][0]["text"] == first
    # Negative seeds (int64) map to distinct uint64 seeds.
    _, message = openai.to_api_request("completions", body("completions", seed=-1))
    assert message.seed == 2**64 - 1


def test_settings_reach_the_tandem_request(openai: OpenAIService) -> None:
    fields = {"temperature": 0.5, "top_p": 0.9, "top_k": 7, "stop": "\n", "draft_tokens": 2,
              "pipelined": True}  # fmt: skip
    _, message = openai.to_api_request("completions", body("completions", **fields))
    assert (message.sampling.temperature, message.sampling.top_k) == (0.5, 7)
    assert message.sampling.top_p == pytest.approx(0.9)
    assert list(message.stop) == ["\n"]
    assert (message.draft_tokens, message.pipelined) == (2, True)
    # Left out: OpenAI's temperature 1, the server's speculation defaults, a random seed.
    _, message = openai.to_api_request("completions", body("completions", temperature=DROP))
    assert message.sampling.temperature == 1.0
    assert (message.seed, message.draft_tokens, message.pipelined) == (None, None, None)
    _, message = openai.to_api_request("completions", body("completions", top_k=-1))
    assert message.sampling.top_k == 0  # vLLM's "no limit"


def test_default_max_tokens(openai: OpenAIService, service: TandemService) -> None:
    _, completion = openai.to_api_request("completions", body("completions", max_tokens=DROP))
    assert completion.max_tokens == DEFAULT_COMPLETION_MAX_TOKENS
    _, chat = openai.to_api_request("chat.completions", body("chat.completions", max_tokens=DROP))
    # The room the context leaves after the prompt (below the server's limit here).
    num_prompt = len(
        service.reader.prompt_tokens(prompt_from_proto(tandem_request("chat.completions")))
    )
    assert chat.max_tokens == CONTEXT - num_prompt < LIMIT


def test_default_max_tokens_respects_the_tenant_limit(local_tandem: LocalTandem) -> None:
    key = new_api_key()
    tenant = TenantConfig("small", hash_api_key(key), max_tokens_per_request=5)
    tenants = Tenants(AuthConfig(tenants=(tenant,)))
    service = TandemService(local_tandem.router, local_tandem.tokenizer, tenants=tenants)
    openai = OpenAIService(service, MODEL)
    caller = Caller(authorization=f"Bearer {key}")
    for route in ROUTES:
        _, message = openai.to_api_request(route, body(route, max_tokens=DROP), caller)
        assert message.max_tokens == 5
    # Authentication comes first: a caller without a key learns nothing about the body.
    with pytest.raises(UnauthenticatedError):
        openai.complete("completions", {"model": "nope"})
    with pytest.raises(UnauthenticatedError):
        openai.models(Caller())
    assert openai.models(caller)["data"][0]["id"] == MODEL


BAD_FIELDS: list[tuple[Route, dict[str, Any], str | None]] = [
    ("completions", {"n": 2}, "n"),
    ("completions", {"best_of": 3}, "best_of"),
    ("completions", {"logprobs": 1}, "logprobs"),
    ("completions", {"echo": True}, "echo"),
    ("completions", {"suffix": "}"}, "suffix"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias"),
    ("chat.completions", {"n": True}, "n"),
    ("chat.completions", {"logprobs": True}, "logprobs"),
    ("chat.completions", {"presence_penalty": 0.5}, "presence_penalty"),
    ("chat.completions", {"frequency_penalty": -1}, "frequency_penalty"),
    ("chat.completions", {"tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": "sometimes"}, "tool_choice"),
    ("chat.completions", {"tools": [{"type": "function"}], "tool_choice": "required"},
     "tools[0].function"),
    ("chat.completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("chat.completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "foo"}}}}, "response_format.json_schema.schema"),
    ("completions", {"guided_regex": "("}, "guided_regex"),
    ("completions", {"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex"),
    ("completions", {"structured_outputs": {"grammar": "start: foo"}},
     "structured_outputs.grammar"),
    ("completions", {"frobnicate": 1}, "frobnicate"),
    ("completions", {"messages": MESSAGES}, "messages"),
    ("completions", {"max_completion_tokens": 12}, "max_completion_tokens"),
    ("chat.completions", {"prompt": "x"}, "prompt"),
    ("chat.completions", {"temperature": -1}, "temperature"),
    ("completions", {"temperature": "hot"}, "temperature"),
    ("completions", {"temperature": float("nan")}, "temperature"),
    ("completions", {"top_p": 0}, "top_p"),
    ("completions", {"top_p": 1.5}, "top_p"),
    ("completions", {"top_k": -2}, "top_k"),
    ("completions", {"max_tokens": 0}, "max_tokens"),
    ("completions", {"max_tokens": 2.5}, "max_tokens"),
    ("completions", {"max_tokens": True}, "max_tokens"),
    ("completions", {"max_tokens": LIMIT + 1}, "max_tokens"),
    ("chat.completions", {"max_tokens": LIMIT}, "max_tokens"),  # prompt + LIMIT > CONTEXT
    ("chat.completions", {"max_tokens": 5, "max_completion_tokens": 6}, "max_completion_tokens"),
    ("chat.completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("completions", {"stop": 5}, "stop"),
    ("completions", {"stop": ["a", 1]}, "stop"),
    ("completions", {"stop": [""]}, "stop"),
    ("completions", {"stop": ["s"] * 17}, "stop"),
    ("completions", {"seed": "1"}, "seed"),
    ("completions", {"seed": 2**64}, "seed"),
    ("completions", {"draft_tokens": 33}, "draft_tokens"),
    ("completions", {"pipelined": "yes"}, "pipelined"),
    ("completions", {"user": 5}, "user"),
    ("completions", {"stream": "yes"}, "stream"),
    ("completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("completions", {"stream": True, "stream_options": {"include_usage": 1}},
     "stream_options.include_usage"),
    ("completions", {"stream": True, "stream_options": {"extra": True}}, "stream_options.extra"),
    ("completions", {"model": DROP}, "model"),
    ("completions", {"prompt": DROP}, "prompt"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": []}, "prompt"),
    ("completions", {"prompt": ["a", "b"]}, "prompt"),
    ("completions", {"prompt": [1, "a"]}, "prompt"),
    ("completions", {"prompt": [-1]}, "prompt"),
    ("completions", {"prompt": 7}, "prompt"),
    ("chat.completions", {"messages": []}, "messages"),
    ("chat.completions", {"messages": DROP}, "messages"),
    ("chat.completions", {"messages": "hi"}, "messages"),
    ("chat.completions", {"messages": ["hi"]}, "messages[0]"),
    ("chat.completions", {"messages": [{"role": "tool", "content": "x"}]},
     "messages[0].tool_call_id"),
    ("chat.completions", {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    ("chat.completions", {"messages": [{"content": "x"}]}, "messages[0].role"),
    ("chat.completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("chat.completions", {"messages": [{"role": "user", "content": None}]},
     "messages[0].content"),
    ("chat.completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, "messages[0].content"),
    ("chat.completions", {"messages": [{"role": "user", "content": "x", "name": "bob"}]},
     "messages[0].name"),
    ("chat.completions", {"messages": [MESSAGES[0], {"role": "user", "content": "x", "y": 1}]},
     "messages[1].y"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "fields", "param"), BAD_FIELDS)
def test_every_bad_field_is_named(
    openai: OpenAIService,
    local_tandem: LocalTandem,
    route: Route,
    fields: dict[str, Any],
    param: str | None,
) -> None:
    with pytest.raises(OpenAIError) as raised:
        openai.complete(route, body(route, **fields))
    assert raised.value.param == param
    status, error, _ = error_response(raised.value)
    assert (status, error["error"]["param"], error["error"]["type"]) == (
        400,
        param,
        "invalid_request_error",
    )
    # A stream raises the same error at its first next(), before any chunk.
    chunks = openai.stream(route, body(route, **fields))
    with pytest.raises(OpenAIError) as from_stream:
        next(chunks)
    assert (str(from_stream.value), from_stream.value.param) == (str(raised.value), param)
    assert_sessions_closed(local_tandem)


def test_an_unknown_model_is_not_found(openai: OpenAIService) -> None:
    with pytest.raises(ModelNotFoundError) as raised:
        openai.complete("chat.completions", body("chat.completions", model="gpt-4o"))
    assert "'gpt-4o' does not exist: this server serves 'tiny'" in str(raised.value)
    status, error, headers = error_response(raised.value)
    assert (status, headers) == (404, {})
    assert error["error"] | {"message": ""} == {
        "message": "",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }


@pytest.mark.parametrize("route", ROUTES)
def test_the_body_must_be_an_object(openai: OpenAIService, route: Route) -> None:
    with pytest.raises(OpenAIError, match="must be a JSON object") as raised:
        openai.complete(route, ["not", "an", "object"])
    assert raised.value.param is None
    with pytest.raises(OpenAIError):
        openai.wants_stream("text")


def test_wants_stream(openai: OpenAIService) -> None:
    assert openai.wants_stream({}) is False
    assert openai.wants_stream({"stream": None}) is False
    assert openai.wants_stream({"stream": True}) is True
    with pytest.raises(OpenAIError) as raised:
        openai.wants_stream({"stream": 1})
    assert raised.value.param == "stream"


def test_a_model_without_a_template_refuses_chat(local_tandem: LocalTandem) -> None:
    bare = tiny.build_tokenizer()
    bare.chat_template = None
    service = TandemService(local_tandem.router, bare, tenants=Tenants.unauthenticated())
    with pytest.raises(NoChatTemplateError) as raised:
        OpenAIService(service, MODEL).complete("chat.completions", body("chat.completions"))
    status, error, _ = error_response(raised.value)
    assert (status, error["error"]["message"]) == (400, "the model has no chat template")


@pytest.mark.parametrize(
    ("error", "status", "kind", "code", "headers"),
    [
        (InvalidArgumentError("bad"), 400, "invalid_request_error", None, {}),
        (NoChatTemplateError("no template"), 400, "invalid_request_error", None, {}),
        (UnauthenticatedError("who"), 401, "authentication_error", "invalid_api_key", {}),
        (PermissionDeniedError("no"), 403, "permission_error", "permission_denied", {}),
        (RequestNotFoundError("gone"), 404, "invalid_request_error", "not_found", {}),
        (QuotaExceededError("busy", 1.2), 429, "rate_limit_error", "rate_limit_exceeded",
         {"Retry-After": "2"}),
        (QuotaExceededError("busy", 3.0), 429, "rate_limit_error", "rate_limit_exceeded",
         {"Retry-After": "3"}),
        (QuotaExceededError("busy", 0.01), 429, "rate_limit_error", "rate_limit_exceeded",
         {"Retry-After": "1"}),
        (ResourceExhaustedError("full"), 429, "rate_limit_error", "rate_limit_exceeded", {}),
        (DeadlineExceededError("late"), 504, "timeout_error", "deadline_exceeded", {}),
        (ReplicaUnavailableError("down"), 503, "server_error", "service_unavailable", {}),
    ],
)  # fmt: skip
def test_error_response_maps_each_status(
    error: Exception, status: int, kind: str, code: str | None, headers: dict[str, str]
) -> None:
    assert error_response(error) == (
        status,
        {"error": {"message": str(error), "type": kind, "param": None, "code": code}},
        headers,
    )


@pytest.mark.parametrize(
    "error",
    [ValueError("secret detail"), ClusterSecretError("secret detail"),
     RequestCancelledError("secret detail")],
)  # fmt: skip
def test_anything_else_is_a_500_that_leaks_nothing(
    error: Exception, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.ERROR):
        status, body_, headers = error_response(error)
    assert (status, headers) == (500, {})
    assert body_ == {
        "error": {
            "message": "internal error",
            "type": "server_error",
            "param": None,
            "code": "internal_error",
        }
    }
    assert "secret detail" in caplog.text  # logged for the operator, never sent


def test_closing_a_stream_early_frees_the_sessions(
    openai: OpenAIService, local_tandem: LocalTandem
) -> None:
    chunks = openai.stream("completions", body("completions", max_tokens=LIMIT, stream=True))
    next(chunks)
    assert local_tandem.verifier.stats().num_sessions == 1
    # The drafter opens its session in the background while the first token comes.
    opened_by = time.monotonic() + 30
    while local_tandem.drafter.stats().num_sessions == 0 and time.monotonic() < opened_by:
        time.sleep(0.01)
    assert local_tandem.drafter.stats().num_sessions == 1
    chunks.close()
    assert_sessions_closed(local_tandem)


def test_a_unary_request_stops_once_the_client_is_gone(
    openai: OpenAIService, local_tandem: LocalTandem
) -> None:
    asked = 0

    def is_active() -> bool:
        nonlocal asked
        asked += 1
        return asked < 2

    with pytest.raises(RequestCancelledError):
        openai.complete("completions", body("completions", max_tokens=LIMIT), is_active=is_active)
    assert asked == 2
    assert_sessions_closed(local_tandem)


def test_a_cancelled_request_finishes_with_stop(
    openai: OpenAIService, service: TandemService, local_tandem: LocalTandem
) -> None:
    options = {"stream": True, "stream_options": {"include_usage": True}}
    short = [{"role": "user", "content": "x"}]  # leaves room for 60 tokens in CONTEXT
    chunks = openai.stream(
        "chat.completions", body("chat.completions", messages=short, max_tokens=60, **options)
    )
    first = next(chunks)
    request_id = first["id"].removeprefix("chatcmpl-")
    GrpcApi(service).cancel(generate_pb2.CancelRequest(request_id=request_id))
    *rest, usage = list(chunks)
    assert rest[-1]["choices"][0]["finish_reason"] == "stop"
    assert usage["usage"]["completion_tokens"] < 60  # it stopped early, not at max_tokens
    assert_sessions_closed(local_tandem)
