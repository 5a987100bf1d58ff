"""The OpenAI-compatible HTTP API: `cluster.serve.http` alone, then on the session's service.

Without a cluster: `OpenAIHttp` driven as Serve drives it (a starlette `Request` in, the
response run as an ASGI app), over a scripted stand-in for `OpenAIService`: routing, body
checks, error statuses, SSE framing, and that a response ended early (the client gone) closes
the stream it was reading.

On the session's service (tests/cluster/conftest.py, marked `ray` and `slow`), through its
default door (the routers' own HTTP server): the official `openai` client, sync and async,
streaming and not, against the same prompts sent through the gRPC API; errors as the client's
exception classes; tenants' quotas and usage; a client that disconnects mid-stream (at both
doors: Serve's HTTP proxy too); and the raw wire (`httpx2`, the HTTP client the `openai` package
uses).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2
import openai
import pytest
from starlette.requests import Request
from starlette.responses import Response

from cluster.api.caller import Caller
from cluster.api.chat import render_chat
from cluster.api.client import TandemClient
from cluster.api.response import ApiChunk
from cluster.api.tenants import QuotaExceededError, UnauthenticatedError
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.tiny import build_tokenizer
from cluster.serve.http import DONE_EVENT, OpenAIHttp
from tests.cluster.conftest import (
    SMALL_LIMITS,
    TENANT_KEYS,
    live_replicas,
    replica_sessions,
    wait_until_no_sessions,
)
from tests.conftest import CODE_PROMPT

MODEL = "tiny"
"""The served model's name: the preset the session's service runs."""
MAX_TOKENS = 24
LONG = int(SMALL_LIMITS["max_tokens_per_request"])
VERY_LONG = 1900
"""The tiny target's greedy run from CODE_PROMPT goes this far without an end-of-sequence:
seconds of rounds (as in test_serve_deadlines)."""
CHAT: Any = [{"role": "user", "content": "Write a function that adds two numbers."}]
"""One user message: what both APIs get (`Any`: each client types it its own way)."""
GOOD_KEY = "good"


# --- the adapter, without a cluster ---------------------------------------------------------------


class ScriptedOpenAI:
    """What `OpenAIHttp` uses of `OpenAIService`, scripted by the body: `fail_at` (a chunk
    index whose step raises), `quota` (refused before the first chunk), `chunks` (how many),
    `paced` (each chunk takes a millisecond)."""

    waits_without_threads = False  # its streams block: they run on the adapter's threads

    def __init__(self) -> None:
        self.closed = threading.Event()
        self.is_active: Callable[[], bool] | None = None
        self.callers: list[Caller] = []

    def authenticate(self, caller: Caller) -> None:
        if caller.authorization != f"Bearer {GOOD_KEY}":
            raise UnauthenticatedError("unknown API key")

    def _authenticate(self, caller: Caller) -> None:
        self.callers.append(caller)
        if caller.authorization != f"Bearer {GOOD_KEY}":
            raise UnauthenticatedError("unknown API key")

    def models(self, caller: Caller) -> dict[str, Any]:
        self._authenticate(caller)
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    def wants_stream(self, body: object) -> bool:
        return bool(isinstance(body, dict) and body.get("stream"))

    def complete(
        self, route: str, body: object, caller: Caller, is_active: Callable[[], bool] = lambda: True
    ) -> dict[str, Any]:
        self._authenticate(caller)
        self.is_active = is_active
        assert isinstance(body, dict)
        if body.get("hold"):  # runs until the request is given up
            while is_active():
                threading.Event().wait(0.01)
        return {"object": route, "echo": body}

    def open_stream(
        self, route: str, body: object, caller: Caller
    ) -> tuple[Iterator[ApiChunk], IndexBodies]:
        self._authenticate(caller)
        assert isinstance(body, dict)
        return self._chunks(body), IndexBodies(route)

    def _chunks(self, body: dict[str, Any]) -> Iterator[ApiChunk]:
        try:
            if body.get("quota"):
                raise QuotaExceededError("tenant t already has 1 requests running", 1.2)
            for i in range(int(body.get("chunks", 3))):
                if i == body.get("fail_at"):
                    raise InvalidArgumentError("the stream broke")
                if body.get("paced"):  # a generation that takes its time (10 s for 10,000)
                    threading.Event().wait(0.001)
                yield ApiChunk("r", (i,), "")
        finally:
            self.closed.set()


class IndexBodies:
    """One body per token of a chunk, whose `index` is the token: so the events are the same
    however the adapter merges pending chunks."""

    def __init__(self, route: str) -> None:
        self._route = route

    def bodies(self, chunk: ApiChunk) -> list[dict[str, Any]]:
        return [{"object": self._route, "index": token} for token in chunk.tokens]


def scope_of(method: str, path: str, headers: dict[str, str], spec: str = "2.4") -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": spec},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()],
        "server": ("127.0.0.1", 8000),
    }


class Exchange:
    """One request through `OpenAIHttp`, its response run as Serve runs it."""

    def __init__(self, method: str, path: str, body: bytes | object = b"", key: str = GOOD_KEY):
        self.scope = scope_of(method, path, {"authorization": f"Bearer {key}"})
        self.body = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.messages: list[MutableMapping[str, Any]] = []
        self._received = False

    async def receive(self) -> dict[str, Any]:
        if not self._received:
            self._received = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await asyncio.Event().wait()  # the client stays: no disconnect message
        raise AssertionError("unreachable")

    async def send(self, message: MutableMapping[str, Any]) -> None:
        self.messages.append(message)

    async def run(self, adapter: OpenAIHttp) -> Response:
        response = await adapter(Request(self.scope, self.receive))
        await response(self.scope, self.receive, self.send)
        return response

    @property
    def status(self) -> int:
        return int(self.messages[0]["status"])

    @property
    def headers(self) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in self.messages[0]["headers"]}

    @property
    def content(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages[1:])

    def json(self) -> Any:
        return json.loads(self.content)


@pytest.fixture
def scripted() -> Iterator[tuple[ScriptedOpenAI, OpenAIHttp]]:
    fake = ScriptedOpenAI()
    with ThreadPoolExecutor(4) as threads:
        yield fake, OpenAIHttp(fake, threads)  # type: ignore[arg-type]  # the stand-in


def exchange(adapter: OpenAIHttp, *args: Any, **kwargs: Any) -> Exchange:
    done = Exchange(*args, **kwargs)
    asyncio.run(done.run(adapter))
    return done


def assert_openai_error(done: Exchange, status: int, words: str) -> dict[str, Any]:
    assert done.status == status, done.content
    error = done.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and words in error["message"]
    return dict(error)


def events(content: bytes) -> list[bytes]:
    """The SSE events of a body; each must be one `data:` line."""
    assert content.endswith(b"\n\n"), content[-40:]
    parts = content[:-2].split(b"\n\n")
    assert all(p.startswith(b"data: ") and b"\n" not in p for p in parts), parts
    return [p.removeprefix(b"data: ") for p in parts]


def test_routes_methods_and_bodies(scripted: tuple[ScriptedOpenAI, OpenAIHttp]) -> None:
    fake, adapter = scripted
    models = exchange(adapter, "GET", "/v1/models")
    assert models.status == 200 and models.json()["data"][0]["id"] == MODEL
    assert exchange(adapter, "GET", "/v1/models/").status == 200  # a trailing slash is the same
    unary = exchange(adapter, "POST", "/v1/chat/completions", {"model": MODEL})
    assert unary.status == 200 and unary.json() == {
        "object": "chat.completions",
        "echo": {"model": MODEL},
    }
    assert exchange(adapter, "POST", "/v1/completions", {}).json()["object"] == "completions"

    assert_openai_error(exchange(adapter, "POST", "/v1/embeddings", {}), 404, "/v1/embeddings")
    wrong = exchange(adapter, "GET", "/v1/completions")
    assert_openai_error(wrong, 405, "takes POST")
    assert wrong.headers["allow"] == "POST"
    bad_bodies = [
        (b"{not json", "not valid JSON"),
        (b"\xff", "not valid JSON"),
        (b"", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got list"),
        (b'{"prompt": "ok \\ud800"}', "body.prompt holds a lone UTF-16 surrogate (\\ud800)"),
        (b"[" * 5000 + b"]" * 5000, "nested too deeply"),
        (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", "nested too deeply at body.a"),
    ]
    for body, words in bad_bodies:
        assert_openai_error(exchange(adapter, "POST", "/v1/completions", body), 400, words)
    assert_openai_error(exchange(adapter, "GET", "/v1/models", key="bad"), 401, "unknown API key")
    # The key and the deadline header reach the service as a Caller.
    assert fake.callers[-1].authorization == "Bearer bad" and fake.callers[-1].deadline is None


def test_the_deadline_header_reaches_the_service(
    scripted: tuple[ScriptedOpenAI, OpenAIHttp],
) -> None:
    fake, adapter = scripted
    done = Exchange("POST", "/v1/completions", {"model": MODEL})
    done.scope["headers"].append((b"x-tandem-deadline-ms", b"60000"))
    asyncio.run(done.run(adapter))
    assert done.status == 200 and fake.callers[-1].deadline is not None
    bad = Exchange("POST", "/v1/completions", {"model": MODEL})
    bad.scope["headers"].append((b"x-tandem-deadline-ms", b"soon"))
    asyncio.run(bad.run(adapter))
    assert_openai_error(bad, 400, "x-tandem-deadline-ms")


def test_a_stream_is_server_sent_events_ending_with_done(
    scripted: tuple[ScriptedOpenAI, OpenAIHttp],
) -> None:
    fake, adapter = scripted
    done = exchange(adapter, "POST", "/v1/completions", {"stream": True, "chunks": 3})
    assert done.status == 200
    assert done.headers["content-type"].startswith("text/event-stream")
    assert done.content.endswith(DONE_EVENT)
    *chunks, last = events(done.content)
    assert [json.loads(c)["index"] for c in chunks] == [0, 1, 2] and last == b"[DONE]"
    assert fake.closed.is_set()
    empty = exchange(adapter, "POST", "/v1/completions", {"stream": True, "chunks": 0})
    assert events(empty.content) == [b"[DONE]"]


def test_an_error_before_the_first_chunk_is_an_ordinary_error_response(
    scripted: tuple[ScriptedOpenAI, OpenAIHttp],
) -> None:
    _, adapter = scripted
    refused = exchange(adapter, "POST", "/v1/completions", {"stream": True, "quota": True})
    assert_openai_error(refused, 429, "already has 1 requests running")
    assert refused.headers["retry-after"] == "2"  # 1.2 s, in whole seconds rounded up
    unknown = exchange(adapter, "POST", "/v1/completions", {"stream": True}, key="bad")
    assert_openai_error(unknown, 401, "unknown API key")
    broken = exchange(adapter, "POST", "/v1/completions", {"stream": True, "fail_at": 0})
    assert_openai_error(broken, 400, "the stream broke")


def test_an_error_mid_stream_is_one_error_event_and_no_done(
    scripted: tuple[ScriptedOpenAI, OpenAIHttp],
) -> None:
    fake, adapter = scripted
    done = exchange(adapter, "POST", "/v1/completions", {"stream": True, "fail_at": 2})
    assert done.status == 200  # already sent with the first chunk
    first, second, error = [json.loads(e) for e in events(done.content)]
    assert (first["index"], second["index"]) == (0, 1)
    assert "the stream broke" in error["error"]["message"]
    assert not done.content.endswith(DONE_EVENT) and fake.closed.is_set()


@pytest.mark.parametrize("spec", ["2.3", "2.4"])  # starlette listens for a disconnect below 2.4
def test_a_response_cancelled_while_sending_closes_the_stream(
    scripted: tuple[ScriptedOpenAI, OpenAIHttp], spec: str
) -> None:
    """Serve cancels the request when the client disconnects; here the cancellation lands
    while the response awaits `send` between two chunks (a slow client), where starlette
    itself would leave the body iterator, and so the Tandem stream, open."""
    fake, adapter = scripted

    async def scenario() -> int:
        # Checked before the loop ends: asyncio.run closes every async generator left open.
        body = {"stream": True, "chunks": 10_000, "paced": True}
        done = Exchange("POST", "/v1/completions", body)
        done.scope["asgi"]["spec_version"] = spec
        blocked = asyncio.Event()

        async def slow_send(message: MutableMapping[str, Any]) -> None:
            done.messages.append(message)
            if len(done.messages) == 3:  # the start and one chunk went out
                blocked.set()
                await asyncio.Event().wait()

        response = await adapter(Request(done.scope, done.receive))
        task = asyncio.ensure_future(response(done.scope, done.receive, slow_send))
        await blocked.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await asyncio.to_thread(fake.closed.wait, 10), "the stream was left open"
        return len(done.messages)

    assert asyncio.run(scenario()) == 3


def test_a_unary_call_given_up_stops_its_generation(
    scripted: tuple[ScriptedOpenAI, OpenAIHttp],
) -> None:
    fake, adapter = scripted

    async def scenario() -> None:
        done = Exchange("POST", "/v1/completions", {"hold": True})
        task = asyncio.ensure_future(adapter(Request(done.scope, done.receive)))
        while fake.is_active is None:
            await asyncio.sleep(0.01)
        assert fake.is_active()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    assert fake.is_active is not None and not fake.is_active()


# --- through the service's doors, with the official client ----------------------------------------


def grpc_client(service: dict[str, object], tenant: str = "main") -> TandemClient:
    return TandemClient(str(service["address"]), timeout_s=120, api_key=TENANT_KEYS[tenant])


def openai_client(service: dict[str, object], tenant: str = "main") -> openai.OpenAI:
    # No retries: a 429 must reach the test, not be waited out.
    return openai.OpenAI(
        base_url=str(service["http_url"]), api_key=TENANT_KEYS[tenant], max_retries=0, timeout=120
    )


@pytest.mark.ray
@pytest.mark.slow
def test_greedy_completions_are_exactly_the_grpc_text(service: dict[str, object]) -> None:
    with grpc_client(service) as grpc_api, openai_client(service) as http:
        expected = grpc_api.generate(CODE_PROMPT, max_tokens=MAX_TOKENS)
        reply = http.completions.create(
            model=MODEL, prompt=CODE_PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
    assert reply.model == MODEL and reply.object == "text_completion"
    (choice,) = reply.choices
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    assert reply.usage is not None
    assert reply.usage.prompt_tokens == expected.num_prompt_tokens
    assert reply.usage.completion_tokens == len(expected.tokens) == MAX_TOKENS
    assert reply.usage.total_tokens == expected.num_prompt_tokens + MAX_TOKENS


@pytest.mark.ray
@pytest.mark.slow
def test_chat_is_exactly_the_templated_prompt_through_grpc(service: dict[str, object]) -> None:
    templated = render_chat(build_tokenizer(), [(m["role"], m["content"]) for m in CHAT])
    assert templated.endswith("<|im_start|>assistant\n")  # the tiny pair's ChatML
    with grpc_client(service) as grpc_api, openai_client(service) as http:
        as_text = grpc_api.generate(templated, max_tokens=MAX_TOKENS)
        as_chat = grpc_api.generate(messages=CHAT, max_tokens=MAX_TOKENS)  # the chat form
        reply = http.chat.completions.create(
            model=MODEL,
            messages=CHAT,
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
    assert as_chat.text == as_text.text and as_chat.num_prompt_tokens == as_text.num_prompt_tokens
    (choice,) = reply.choices
    assert choice.message.role == "assistant" and choice.message.content == as_text.text
    assert reply.usage is not None and reply.usage.prompt_tokens == as_text.num_prompt_tokens
    assert reply.usage.completion_tokens == len(as_text.tokens)


@pytest.mark.ray
@pytest.mark.slow
def test_streamed_deltas_are_the_unary_text_and_usage_comes_last(
    service: dict[str, object],
) -> None:
    with openai_client(service) as http:
        unary = http.completions.create(
            model=MODEL, prompt=CODE_PROMPT, max_tokens=MAX_TOKENS, temperature=0
        )
        chunks = list(
            http.completions.create(
                model=MODEL, prompt=CODE_PROMPT, max_tokens=MAX_TOKENS, temperature=0,
                stream=True, stream_options={"include_usage": True},
            )
        )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == unary.choices[0].text
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage is not None
    # Token counts, not the speculation counters: which replica a request lands on, and a
    # failover in an earlier test, may change how a greedy run was drafted, never its tokens.
    streamed = chunks[-1].usage
    assert (streamed.prompt_tokens, streamed.completion_tokens, streamed.total_tokens) == (
        unary.usage.prompt_tokens, unary.usage.completion_tokens, unary.usage.total_tokens,
    )  # fmt: skip
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert len({c.id for c in chunks}) == 1


@pytest.mark.ray
@pytest.mark.slow
def test_the_async_client_streams_chat_as_it_answers_it(service: dict[str, object]) -> None:
    async def both() -> tuple[str | None, list[str]]:
        async with openai.AsyncOpenAI(
            base_url=str(service["http_url"]), api_key=TENANT_KEYS["main"], max_retries=0
        ) as http:
            settings: dict[str, Any] = {"model": MODEL, "messages": CHAT, "temperature": 0}
            unary = await http.chat.completions.create(max_tokens=MAX_TOKENS, **settings)
            stream = await http.chat.completions.create(
                max_completion_tokens=MAX_TOKENS, stream=True, **settings
            )
            deltas = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return unary.choices[0].message.content, deltas

    text, deltas = asyncio.run(both())
    assert text and "".join(deltas) == text
    assert sum(1 for d in deltas if d) > 1  # it did stream


@pytest.mark.ray
@pytest.mark.slow
def test_errors_are_the_clients_exceptions(service: dict[str, object]) -> None:
    wrong = openai.OpenAI(base_url=str(service["http_url"]), api_key="tdm_wrong", max_retries=0)
    with wrong, pytest.raises(openai.AuthenticationError, match="unknown API key"):
        wrong.completions.create(model=MODEL, prompt="x", max_tokens=4)
    with openai_client(service) as http:
        with pytest.raises(openai.BadRequestError) as several:
            http.completions.create(model=MODEL, prompt="x", max_tokens=4, n=2)
        assert several.value.param == "n" and "n" in str(several.value.message)
        with pytest.raises(openai.BadRequestError) as extra:
            http.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=4,
                extra_body={"n": 3},
            )
        assert extra.value.param == "n"
        with pytest.raises(openai.NotFoundError) as model:
            http.completions.create(model="gpt-4o", prompt="x", max_tokens=4)
        assert model.value.code == "model_not_found" and "gpt-4o" in str(model.value.message)
        assert [m.id for m in http.models.list()] == [MODEL]


@pytest.mark.ray
@pytest.mark.slow
def test_a_tenants_limits_are_403_and_429_with_retry_after(service: dict[str, object]) -> None:
    small_key = TENANT_KEYS["small"]
    with grpc_client(service, "small") as small_grpc, openai_client(service, "small") as http:
        with pytest.raises(openai.PermissionDeniedError, match=f"at most {LONG} tokens"):
            http.completions.create(model=MODEL, prompt="x", max_tokens=LONG + 1)

        # Its one concurrent request is a long gRPC stream: HTTP waits its turn like gRPC.
        running = small_grpc.stream(CODE_PROMPT, max_tokens=LONG, draft_tokens=0)
        first = next(running)
        try:
            with pytest.raises(openai.RateLimitError, match="requests running"):
                http.completions.create(model=MODEL, prompt="x", max_tokens=4)
            with pytest.raises(openai.RateLimitError, match="requests running"):
                http.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, stream=True)
            raw = httpx2.post(
                f"{service['http_url']}/completions",
                headers={"Authorization": f"Bearer {small_key}"},
                json={"model": MODEL, "prompt": "x", "max_tokens": 4},
                timeout=60,
            )
            assert raw.status_code == 429 and int(raw.headers["retry-after"]) >= 1
            assert raw.json()["error"]["type"]
        finally:
            small_grpc.cancel(first.request_id)
            assert list(running)[-1].finish_reason == "cancelled"
    assert not any(wait_until_no_sessions(service).values())


@pytest.mark.ray
@pytest.mark.slow
def test_http_usage_is_the_callers_tenants_only(service: dict[str, object]) -> None:
    with grpc_client(service, "main") as main, grpc_client(service, "small") as small:
        main_before, small_before = main.usage(), small.usage()
        with openai_client(service, "small") as http:
            reply = http.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0)
        main_after, small_after = main.usage(), small.usage()
    assert reply.usage is not None and reply.usage.completion_tokens == 5
    assert int(small_after["requests"]) - int(small_before["requests"]) == 1
    grown = int(small_after["generated_tokens"]) - int(small_before["generated_tokens"])
    assert grown == reply.usage.completion_tokens
    prompt_grown = int(small_after["prompt_tokens"]) - int(small_before["prompt_tokens"])
    assert prompt_grown == reply.usage.prompt_tokens
    assert main_after == main_before  # the other tenant saw none of it


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.parametrize("door", ["http_url", "proxy_http_url"])
def test_a_client_that_disconnects_mid_stream_frees_both_sessions(
    service: dict[str, object], door: str
) -> None:
    body = {"model": MODEL, "prompt": CODE_PROMPT, "max_tokens": VERY_LONG, "temperature": 0,
            "stream": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {TENANT_KEYS['main']}"}
    replicas = live_replicas(service)  # asked first: `tandem status` takes seconds
    with grpc_client(service) as main:
        before = main.usage()
        with httpx2.stream(
            "POST", f"{service[door]}/completions", json=body, headers=headers, timeout=60
        ) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # kept: dropping it would close the connection
            assert next(lines).startswith("data: {")
            # The generation runs: it holds a session on a drafter and one on a verifier.
            open_now = replica_sessions(service, replicas)
            for side in ("drafter", "verifier"):
                assert sum(n for replica, n in open_now.items() if replica.startswith(side)) == 1
        # Closed after the first event: the server (the routers' own, or Serve's proxy, which
        # cancels the ingress's call) stops reading the stream, which closes it.
        assert not any(wait_until_no_sessions(service).values())
        generated = int(main.usage()["generated_tokens"]) - int(before["generated_tokens"])
    assert 0 < generated < VERY_LONG  # stopped, not run to its end


@pytest.mark.ray
@pytest.mark.slow
def test_the_raw_wire(service: dict[str, object]) -> None:
    url = str(service["http_url"])
    headers = {"Authorization": f"Bearer {TENANT_KEYS['main']}"}
    body = {"model": MODEL, "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True}
    streamed = httpx2.post(f"{url}/chat/completions", json=body, headers=headers, timeout=60)
    assert streamed.status_code == 200
    assert streamed.headers["content-type"].startswith("text/event-stream")
    *chunks, done = events(streamed.content)
    assert done == b"[DONE]" and chunks
    assert {json.loads(c)["object"] for c in chunks} == {"chat.completion.chunk"}

    not_json = httpx2.post(
        f"{url}/completions",
        content=b"{oops",
        headers={**headers, "Content-Type": "application/json"},
    )
    assert not_json.status_code == 400
    error = not_json.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and "JSON" in error["message"]
    unknown = httpx2.get(f"{url}/engines", headers=headers)
    assert unknown.status_code == 404 and set(unknown.json()["error"]) >= {"message", "type"}
    assert httpx2.get(f"{url}/chat/completions", headers=headers).status_code == 405
