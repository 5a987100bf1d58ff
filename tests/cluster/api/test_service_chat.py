"""Chat messages as a prompt: the public API's `chat` form, the tiny preset's template, and the
clients and `tandem generate --chat` that send it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import pytest

from cluster.api.chat import NoChatTemplateError
from cluster.api.client import TandemClient
from cluster.api.client_types import TandemClientError, build_request
from cluster.api.convert import prompt_from_proto
from cluster.api.grpc_api import GrpcApi
from cluster.api.service import TandemService
from cluster.api.status import status_of
from cluster.api.tenants import Tenants
from cluster.cli.main import main
from cluster.local import LocalTandem
from cluster.runtime import tiny
from cluster.runtime.errors import InvalidArgumentError
from protos import generate_pb2, sampling_pb2
from tests.cluster.grpc_front import serve_local

CONVERSATION = (("system", "You write Python."), ("user", "def add(a, b):"))
RENDERED = (
    "<|im_start|>system\nYou write Python.<|im_end|>\n"
    "<|im_start|>user\ndef add(a, b):<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def service(local_tandem: LocalTandem) -> TandemService:
    return TandemService(
        local_tandem.router, local_tandem.tokenizer, tenants=Tenants.unauthenticated()
    )


@pytest.fixture(scope="module")
def address(service: TandemService) -> Iterator[str]:
    server, port = serve_local(service)
    yield f"127.0.0.1:{port}"
    server.stop(None)


def chat_request(
    messages: tuple[tuple[str, str], ...] = CONVERSATION, max_tokens: int = 12
) -> generate_pb2.GenerateRequest:
    message = generate_pb2.GenerateRequest(max_tokens=max_tokens)
    message.chat.messages.extend(
        generate_pb2.ChatMessage(role=role, content=content) for role, content in messages
    )
    message.chat.SetInParent()
    return message


def test_the_tiny_template_is_chatml(service: TandemService) -> None:
    assert tiny.build_tokenizer().chat_template == tiny.CHAT_TEMPLATE
    assert service.reader.chat_prompt(CONVERSATION) == RENDERED
    # A conversation that ends with the assistant still gets a new assistant turn opened.
    assert service.reader.chat_prompt([("assistant", "x")]) == (
        "<|im_start|>assistant\nx<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_equals_its_rendered_text(service: TandemService, local_tandem: LocalTandem) -> None:
    chat = chat_request()
    as_text = generate_pb2.GenerateRequest(text=RENDERED, max_tokens=12)
    expected_ids = tuple(local_tandem.tokenizer.encode(RENDERED, add_special_tokens=False))
    assert service.reader.prompt_tokens(prompt_from_proto(chat)) == expected_ids
    # Sampled with the same seed: any difference in the prompt would show in the tokens.
    for message in (chat, as_text):
        message.sampling.CopyFrom(sampling_pb2.SamplingParams(temperature=0.8))
        message.seed = 11
    from_chat, from_text = GrpcApi(service).generate(chat), GrpcApi(service).generate(as_text)
    assert list(from_chat.token_ids) == list(from_text.token_ids)
    assert from_chat.usage.prompt_tokens == len(expected_ids)
    assert from_chat.usage.completion_tokens == len(from_chat.token_ids) > 0


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ((), "chat messages must not be empty"),
        (
            (("robot", "hi"),),
            "messages[0].role must be one of system, user, assistant, got 'robot'",
        ),
        ((("user", "hi"), ("", "x")), "messages[1].role must be one of"),
    ],
)
def test_bad_messages_are_invalid_arguments(
    service: TandemService, messages: tuple[tuple[str, str], ...], error: str
) -> None:
    with pytest.raises(InvalidArgumentError) as raised:
        GrpcApi(service).stream(chat_request(messages))
    assert error in str(raised.value)
    assert status_of(raised.value)[0] == grpc.StatusCode.INVALID_ARGUMENT


def test_a_model_without_a_template_refuses_chat(local_tandem: LocalTandem) -> None:
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template = None
    service = TandemService(local_tandem.router, tokenizer, tenants=Tenants.unauthenticated())
    with pytest.raises(NoChatTemplateError) as raised:
        GrpcApi(service).stream(chat_request())
    assert status_of(raised.value) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "the model has no chat template",
    )
    # Text prompts still work on it.
    assert GrpcApi(service).generate(generate_pb2.GenerateRequest(text="x", max_tokens=2)).token_ids


def test_a_template_that_refuses_the_conversation_is_an_invalid_argument(
    local_tandem: LocalTandem,
) -> None:
    tokenizer = tiny.build_tokenizer()
    tokenizer.chat_template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user speaks first') }}"
        "{% endif %}{{ messages[0]['content'] }}"
    )
    service = TandemService(local_tandem.router, tokenizer, tenants=Tenants.unauthenticated())
    assert service.reader.chat_prompt([("user", "hi")]) == "hi"
    with pytest.raises(InvalidArgumentError, match=r"chat template refused .*user speaks first"):
        service.reader.chat_prompt([("system", "hi")])


def test_build_request_takes_messages() -> None:
    message = build_request(messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert message.WhichOneof("prompt") == "chat"
    assert [(m.role, m.content) for m in message.chat.messages] == [("user", "hi")]
    # An empty list still selects `chat`, so that the server names the right error.
    assert build_request(messages=[], max_tokens=3).WhichOneof("prompt") == "chat"
    with pytest.raises(TandemClientError, match="not both"):
        build_request("text", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    with pytest.raises(TandemClientError, match=r"messages\[0\] must have a string role"):
        build_request(messages=[{"role": "user"}], max_tokens=3)


def test_the_client_sends_chat(service: TandemService, address: str) -> None:
    expected = GrpcApi(service).generate(chat_request())
    messages = [{"role": role, "content": content} for role, content in CONVERSATION]
    with TandemClient(address, timeout_s=60) as client:
        result = client.generate(messages=messages, max_tokens=12)
        streamed = list(client.stream(messages=messages, max_tokens=12))
        with pytest.raises(TandemClientError) as error:
            client.generate(messages=[{"role": "tool", "content": "x"}], max_tokens=12)
    assert result.tokens == tuple(expected.token_ids)
    assert "".join(chunk.text for chunk in streamed) == expected.text
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("where", ["--local", "--address"])
def test_generate_chat_sends_one_user_message(
    where: str, service: TandemService, address: str, capsys: pytest.CaptureFixture[str]
) -> None:
    prompt = "def add(a, b):"
    flags = ["--local", "--preset", "tiny"] if where == "--local" else ["--address", address]
    assert main(["generate", *flags, "--max-tokens", "12", "--chat", "--json", prompt]) == 0
    result = json.loads(capsys.readouterr().out)
    expected = GrpcApi(service).generate(chat_request((("user", prompt),)))
    assert result["tokens"] == list(expected.token_ids)
    assert result["num_prompt_tokens"] == len(
        service.reader.chat_prompt([("user", prompt)]).encode()
    )
