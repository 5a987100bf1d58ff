"""vLLM's extra request parameters on the OpenAI-compatible API, without HTTP: `ignore_eos`,
`min_tokens`, `stop_token_ids`, `skip_special_tokens` and `stream_options.continuous_usage_stats`
parsed, carried onto the Tandem request and honoured by the router on the tiny pair; vLLM's
parameters Tandem does not implement refused naming the field, except at their neutral value.

Exact outputs use the seed-exact rule (a seeded sampled request): its tokens are a function of
the prompt, seed and settings alone, so a request that ignores end-of-sequence draws the very
tokens the same request draws up to its end-of-sequence, whatever the blocks drafted.
"""

from __future__ import annotations

from typing import Any

import pytest

from cluster.api.client import TandemClientError, build_request
from cluster.api.convert import request_from_proto
from cluster.api.openai import OpenAIService, Route, error_response
from cluster.api.openai_errors import OpenAIError
from cluster.api.response import ApiChunk
from cluster.api.service import TandemService
from cluster.api.service_config import ServiceConfig
from cluster.api.tenants import Tenants
from cluster.local import InProcess, LocalTandem, text_decoder
from cluster.routing.request import FinishReason, GenerationRequest
from cluster.routing.router import Router
from cluster.routing.text import TextAssembler
from cluster.runtime import tiny
from cluster.runtime.errors import InvalidArgumentError
from protos import generate_pb2
from tests.conftest import CODE_PROMPT, encode

MODEL = "tiny"
ROUTES: tuple[Route, Route] = ("completions", "chat.completions")
EOS = tiny.END_OF_TEXT_ID
EOS_TEXT = tiny.END_OF_TEXT
ENDS_EARLY: dict[str, Any] = {"prompt": CODE_PROMPT, "temperature": 1.0, "seed": 16}
"""A seed-exact sampled completion that draws end-of-sequence as its 13th token (found by
search over seeds; `test_ignore_eos_generates_past_end_of_sequence` checks it still does)."""
EOS_AT = 12
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def service(local_tandem: LocalTandem) -> TandemService:
    return TandemService(
        local_tandem.router,
        local_tandem.tokenizer,
        ServiceConfig(default_draft_tokens=4),
        tenants=Tenants.unauthenticated(),
    )


@pytest.fixture(scope="module")
def openai(service: TandemService) -> OpenAIService:
    return OpenAIService(service, MODEL)


def body(route: Route, **fields: Any) -> dict[str, Any]:
    """A greedy request of MAX_TOKENS tokens for `route`, with `fields` set."""
    base: dict[str, Any] = {"model": MODEL, "max_tokens": MAX_TOKENS, "temperature": 0}
    if route == "completions":
        base["prompt"] = fields.pop("prompt", CODE_PROMPT)
    else:
        content = fields.pop("prompt", CODE_PROMPT)
        base["messages"] = [{"role": "user", "content": content}]
    return base | fields


def run(openai: OpenAIService, route: Route, **fields: Any) -> tuple[ApiChunk, dict[str, Any]]:
    """The Tandem response (token ids) and the OpenAI response (text, usage) of one body."""
    _, message = openai.to_api_request(route, body(route, **fields))
    tandem = openai.service.generate(openai.service.authenticate(), message)
    return tandem, openai.complete(route, body(route, **fields))


def decode(tandem: LocalTandem, tokens: Any, skip_special_tokens: bool = True) -> str:
    return str(tandem.tokenizer.decode(list(tokens), skip_special_tokens=skip_special_tokens))


def test_ignore_eos_generates_past_end_of_sequence(openai: OpenAIService) -> None:
    ended, ended_reply = run(openai, "completions", **ENDS_EARLY)
    assert list(ended.tokens).index(EOS) == EOS_AT == len(ended.tokens) - 1
    assert ended_reply["choices"][0]["finish_reason"] == "stop"
    assert ended_reply["usage"]["completion_tokens"] == EOS_AT + 1

    ignoring, reply = run(openai, "completions", **ENDS_EARLY, ignore_eos=True)
    assert len(ignoring.tokens) == MAX_TOKENS and reply["choices"][0]["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == MAX_TOKENS
    # The same draws up to and through the end-of-sequence token, then more of them.
    assert ignoring.tokens[: EOS_AT + 1] == ended.tokens
    assert ignoring.tokens[EOS_AT] == EOS


def test_skip_special_tokens_false_keeps_them_in_the_text(
    openai: OpenAIService, local_tandem: LocalTandem
) -> None:
    kept, reply = run(
        openai, "completions", **ENDS_EARLY, ignore_eos=True, skip_special_tokens=False
    )
    assert kept.tokens[EOS_AT] == EOS
    assert kept.text == decode(local_tandem, kept.tokens, skip_special_tokens=False)
    assert EOS_TEXT in kept.text and reply["choices"][0]["text"] == kept.text
    skipped, reply = run(openai, "completions", **ENDS_EARLY, ignore_eos=True)
    assert skipped.tokens == kept.tokens
    assert skipped.text == decode(local_tandem, skipped.tokens) and EOS_TEXT not in skipped.text
    assert reply["choices"][0]["text"] == skipped.text


def test_the_token_that_ends_the_output_is_not_in_its_text(
    openai: OpenAIService, local_tandem: LocalTandem
) -> None:
    """As in vLLM: the end token is the output's last token, its text is never decoded."""
    ended, reply = run(openai, "completions", **ENDS_EARLY, skip_special_tokens=False)
    assert ended.tokens[-1] == EOS and reply["choices"][0]["finish_reason"] == "stop"
    assert ended.text == decode(local_tandem, ended.tokens[:-1], skip_special_tokens=False)
    assert EOS_TEXT not in ended.text


@pytest.mark.parametrize("route", ROUTES)
def test_a_stop_token_id_ends_the_output_with_stop(
    openai: OpenAIService, local_tandem: LocalTandem, route: Route
) -> None:
    reference, _ = run(openai, route)
    tokens = list(reference.tokens)
    assert len(tokens) == MAX_TOKENS
    # The first token not seen before it, past the first few: the output must end right there.
    at = next(i for i in range(3, MAX_TOKENS) if tokens[i] not in tokens[:i])
    stopped, reply = run(openai, route, stop_token_ids=[tokens[at]])
    assert list(stopped.tokens) == tokens[: at + 1]
    assert stopped.finish_reason == FinishReason.STOP
    (choice,) = reply["choices"]
    assert choice["finish_reason"] == "stop" and reply["usage"]["completion_tokens"] == at + 1
    text = choice["text"] if route == "completions" else choice["message"]["content"]
    assert text == stopped.text == decode(local_tandem, tokens[:at])


def test_min_tokens_holds_end_tokens_back(openai: OpenAIService) -> None:
    reference, _ = run(openai, "completions")
    tokens = list(reference.tokens)
    at = next(i for i in range(3, MAX_TOKENS) if tokens[i] not in tokens[:i])
    min_tokens = at + 4
    held, reply = run(openai, "completions", stop_token_ids=[tokens[at]], min_tokens=min_tokens)
    output = list(held.tokens)
    # At least min_tokens tokens; the stop token ends it only at or past min_tokens.
    assert len(output) > min_tokens or reply["choices"][0]["finish_reason"] == "length"
    assert tokens[at] not in output[min_tokens:-1]
    if reply["choices"][0]["finish_reason"] == "stop":
        assert output[-1] == tokens[at]


def test_the_extras_reach_the_router_request(openai: OpenAIService) -> None:
    fields = {"ignore_eos": True, "min_tokens": 5, "stop_token_ids": [7, 9],
              "skip_special_tokens": False}  # fmt: skip
    for route in ROUTES:
        _, message = openai.to_api_request(route, body(route, **fields))
        assert (message.ignore_eos, message.min_tokens, list(message.stop_token_ids)) == (
            True, 5, [7, 9],
        )  # fmt: skip
        assert not message.skip_special_tokens
        request, _ = openai.service.reader.to_request(message)
        assert (request.ignore_eos, request.min_tokens, request.stop_token_ids) == (True, 5, (7, 9))
        assert request.skip_special_tokens is False
    _, message = openai.to_api_request("completions", body("completions"))
    assert message.skip_special_tokens  # unset: true, the server's default
    request, _ = openai.service.reader.to_request(message)
    assert (request.ignore_eos, request.min_tokens, request.stop_token_ids) == (False, 0, ())
    assert request.skip_special_tokens is True


def test_grpc_stop_token_ids_outside_the_vocabulary_are_refused(service: TandemService) -> None:
    message = generate_pb2.GenerateRequest(text="x", max_tokens=4, stop_token_ids=[tiny.VOCAB_SIZE])
    with pytest.raises(InvalidArgumentError, match=r"stop_token_ids must be token ids in 0\.\.256"):
        service.reader.to_request(request_from_proto(message))
    message = generate_pb2.GenerateRequest(text="x", max_tokens=4, min_tokens=5)
    with pytest.raises(InvalidArgumentError, match=r"min_tokens must be in 0\.\.max_tokens"):
        service.reader.to_request(request_from_proto(message))


@pytest.mark.parametrize("route", ROUTES)
def test_continuous_usage_stats_puts_the_usage_so_far_in_every_chunk(
    openai: OpenAIService, route: Route
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    *chunks, last = list(openai.stream(route, body(route, stream=True, stream_options=options)))
    final = last["usage"]
    assert last["choices"] == [] and final["completion_tokens"] == MAX_TOKENS
    assert len(chunks) > 1 and all(c["choices"] for c in chunks)
    usages = [c["usage"] for c in chunks]
    assert all(set(u) == {"prompt_tokens", "completion_tokens", "total_tokens"} for u in usages)
    assert {u["prompt_tokens"] for u in usages} == {final["prompt_tokens"]}
    assert all(u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"] for u in usages)
    generated = [u["completion_tokens"] for u in usages]
    assert generated == sorted(generated) and generated[-1] == MAX_TOKENS
    assert generated[0] < MAX_TOKENS  # counts so far, not the total repeated
    # vLLM counts continuous_usage_stats only with include_usage.
    alone = {"continuous_usage_stats": True}
    plain = list(openai.stream(route, body(route, stream=True, stream_options=alone)))
    assert all("usage" not in c for c in plain)


REFUSED: list[tuple[Route, dict[str, Any], str]] = [
    ("completions", {"repetition_penalty": 1.1}, "repetition_penalty"),
    ("chat.completions", {"repetition_penalty": 0.9}, "repetition_penalty"),
    ("completions", {"min_p": 0.05}, "min_p"),
    ("chat.completions", {"logit_bias": {"7": 3}}, "logit_bias"),
    ("completions", {"bad_words": ["x"]}, "bad_words"),
    ("chat.completions", {"allowed_token_ids": [1, 2]}, "allowed_token_ids"),
    ("completions", {"use_beam_search": True}, "use_beam_search"),
    ("chat.completions", {"best_of": 2}, "best_of"),
    ("completions", {"length_penalty": 0.5}, "length_penalty"),
    ("completions", {"prompt_logprobs": 1}, "prompt_logprobs"),
    ("chat.completions", {"truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ("completions", {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ("completions", {"add_special_tokens": True}, "add_special_tokens"),
    ("chat.completions", {"echo": True}, "echo"),
    ("chat.completions", {"add_generation_prompt": False}, "add_generation_prompt"),
    ("chat.completions", {"continue_final_message": True}, "continue_final_message"),
    ("chat.completions", {"chat_template": "{{ messages }}"}, "chat_template"),
    ("completions", {"priority": 1}, "priority"),
    ("completions", {"ignore_eos": "yes"}, "ignore_eos"),
    ("chat.completions", {"skip_special_tokens": 0}, "skip_special_tokens"),
    ("completions", {"min_tokens": -1}, "min_tokens"),
    ("completions", {"min_tokens": 2.0}, "min_tokens"),
    ("chat.completions", {"min_tokens": MAX_TOKENS + 1}, "min_tokens"),
    ("completions", {"max_tokens": None, "min_tokens": 17}, "min_tokens"),  # the default is 16
    ("completions", {"stop_token_ids": 7}, "stop_token_ids"),
    ("completions", {"stop_token_ids": [7, True]}, "stop_token_ids"),
    ("chat.completions", {"stop_token_ids": [-1]}, "stop_token_ids"),
    ("chat.completions", {"stop_token_ids": [tiny.VOCAB_SIZE]}, "stop_token_ids"),
    ("completions", {"stream": True, "stream_options": {"continuous_usage_stats": 1}},
     "stream_options.continuous_usage_stats"),
]  # fmt: skip


@pytest.mark.parametrize(("route", "fields", "param"), REFUSED)
def test_what_tandem_cannot_honour_is_refused_naming_the_field(
    openai: OpenAIService, route: Route, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(OpenAIError) as raised:
        openai.complete(route, body(route, **fields))
    assert raised.value.param == param and param.split(".")[-1] in str(raised.value)
    status, error, _ = error_response(raised.value)
    assert (status, error["error"]["param"]) == (400, param)


def test_vllms_parameters_at_their_neutral_values_are_accepted(openai: OpenAIService) -> None:
    common = {"repetition_penalty": 1.0, "min_p": 0, "bad_words": [], "use_beam_search": False,
              "length_penalty": 1, "include_stop_str_in_output": False, "priority": 0,
              "spaces_between_special_tokens": True, "add_special_tokens": False,
              "truncate_prompt_tokens": None, "allowed_token_ids": None, "best_of": 1,
              "ignore_eos": False, "min_tokens": 0, "stop_token_ids": [],
              "skip_special_tokens": True}  # fmt: skip
    chat = {"echo": False, "add_generation_prompt": True, "continue_final_message": False,
            "chat_template_kwargs": {}, "chat_template": None}  # fmt: skip
    plain = openai.complete("completions", body("completions"))["choices"]
    assert openai.complete("completions", body("completions", **common))["choices"] == plain
    plain = openai.complete("chat.completions", body("chat.completions"))["choices"]
    with_chat = openai.complete("chat.completions", body("chat.completions", **common, **chat))
    assert with_chat["choices"] == plain


def test_which_end_token_ends_the_output(local_tandem: LocalTandem) -> None:
    """The router's rule alone (the replicas also mask end tokens before `min_tokens`): the
    first end token at output position `min_tokens` or later ends the output."""
    from cluster.routing.output import end_at as router_end_at

    eos_token_ids = local_tandem.router._eos_token_ids

    def end_at(request: GenerationRequest, num_before: int, tokens: list[int]) -> int | None:
        return router_end_at(request, num_before, tokens, eos_token_ids)

    prompt = encode(local_tandem, "x")

    def request(**fields: Any) -> GenerationRequest:
        return GenerationRequest(prompt, 16, **fields)

    assert end_at(request(), 0, [1, EOS, 2, EOS]) == 1
    assert end_at(request(ignore_eos=True), 0, [1, EOS, 2, EOS]) is None
    assert end_at(request(stop_token_ids=(2,)), 0, [1, 2, EOS]) == 1
    assert end_at(request(ignore_eos=True, stop_token_ids=(2,)), 0, [1, EOS, 2]) == 2
    assert end_at(request(min_tokens=3), 0, [EOS, 1, EOS, EOS, 1]) == 3
    assert end_at(request(min_tokens=3), 2, [EOS, EOS, 1]) == 1  # 2 tokens came before
    assert end_at(request(min_tokens=3, stop_token_ids=(7,)), 5, [7]) == 0


def test_a_router_without_decode_special_refuses_skip_special_tokens_false(
    local_tandem: LocalTandem,
) -> None:
    router = Router(  # not `local_router`: that one gives the router its decode_special
        InProcess(local_tandem.verifier),
        InProcess(local_tandem.drafter),
        text_decoder(local_tandem.tokenizer),
        local_tandem.target.eos_token_ids,
    )
    request = GenerationRequest(encode(local_tandem, "x"), 4, skip_special_tokens=False)
    try:
        with pytest.raises(InvalidArgumentError, match="skip_special_tokens false"):
            router.generate(request)
        assert router.generate(GenerationRequest(encode(local_tandem, "x"), 4)).tokens
    finally:
        router.close()


# --- min_tokens and stop strings (cluster.routing.text) -------------------------------------------


def byte_decode(ids: Any) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def assemble(data: bytes, stop: list[str], min_tokens: int, step: int = 1) -> tuple[str, int]:
    """The text and the number of tokens of `data` (one token per byte) streamed in rounds."""
    assembler = TextAssembler(byte_decode, stop, min_tokens=min_tokens)
    pieces = []
    for i in range(0, len(data), step):
        added = assembler.add(list(data[i : i + step]))
        pieces.append(added.text)
        if added.stopped:
            return "".join(pieces), assembler.num_tokens
    return "".join(pieces) + assembler.finish(), assembler.num_tokens


@pytest.mark.parametrize("step", [1, 2, 5, 100])
def test_a_stop_string_counts_only_past_the_first_min_tokens(step: int) -> None:
    """As vLLM: a stop string must end past the text of the first `min_tokens` tokens."""
    assert assemble(b"xab-cab-d", ["ab"], min_tokens=0, step=step) == ("x", 3)
    assert assemble(b"xab-cab-d", ["ab"], min_tokens=3, step=step) == ("xab-c", 7)
    # A stop may begin inside that text and end past it.
    assert assemble(b"xab-cab-d", ["ab"], min_tokens=2, step=step) == ("x", 3)
    assert assemble(b"xab-cab-d", ["ab"], min_tokens=9, step=step) == ("xab-cab-d", 9)


def test_min_tokens_counts_a_character_once_it_is_complete() -> None:
    """A character cut by the min_tokens-th token belongs to the text past it, as vLLM's
    detokenizer releases a character only with its last byte."""
    data = "a☕b".encode()  # ☕ is 3 bytes: tokens 1..3
    assert assemble(data, ["☕"], min_tokens=2) == ("a", 4)
    assert assemble(data, ["☕"], min_tokens=4) == ("a☕b", 5)


# --- the Python client ----------------------------------------------------------------------------


def test_build_request_carries_the_extras() -> None:
    request = build_request(
        "x", max_tokens=8, min_tokens=2, stop_token_ids=[3, 4], ignore_eos=True,
        skip_special_tokens=False,
    )  # fmt: skip
    assert (request.min_tokens, list(request.stop_token_ids), request.ignore_eos) == (
        2,
        [3, 4],
        True,
    )
    assert request.HasField("skip_special_tokens") and not request.skip_special_tokens
    default = build_request("x", max_tokens=8)
    assert not default.HasField("skip_special_tokens") and not default.ignore_eos
    with pytest.raises(TandemClientError, match="min_tokens"):
        build_request("x", max_tokens=8, min_tokens=-1)
    with pytest.raises(TandemClientError, match=r"stop_token_ids\[1\]"):
        build_request("x", max_tokens=8, stop_token_ids=[1, 2**31])
