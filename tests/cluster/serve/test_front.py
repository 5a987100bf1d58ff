"""The two doors of the session's service agree: the router replicas' own servers
(`cluster.serve.front`, the default door: the public gRPC and HTTP APIs with no Serve proxy in
between) answer exactly what Serve's proxies (the second door) answer.

`tandem serve` starts both (`--port` and `--http-port` for the routers' own, `--proxy-port` and
`--proxy-http-port` for the proxies; tests/cluster/conftest.py gives them free ports). The
outputs are compared with the target alone in process (greedy) and with the proxy's answer to
the same request.
"""

from __future__ import annotations

import json

import grpc
import httpx2
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cluster.api.client import TandemClient
from cluster.api.client_types import TandemClientError
from cluster.local import LocalTandem
from cluster.routing.request import GenerationRequest
from tests.cluster.conftest import MAX_TOKENS, TENANT_KEYS, wait_until_no_sessions
from tests.conftest import PROMPTS

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@pytest.fixture(scope="module")
def direct(service: dict[str, object]) -> TandemClient:
    """A client of the default door: the routers' own gRPC server."""
    with TandemClient(str(service["address"]), timeout_s=120, api_key=TENANT_KEYS["main"]) as c:
        yield c  # type: ignore[misc]


@pytest.fixture(scope="module")
def proxied(service: dict[str, object]) -> TandemClient:
    """A client of the second door: Serve's gRPC proxy."""
    with TandemClient(
        str(service["proxy_address"]), timeout_s=120, api_key=TENANT_KEYS["main"]
    ) as client:
        yield client  # type: ignore[misc]


def target_alone(local_tandem: LocalTandem, prompt: str, max_tokens: int) -> tuple[int, ...]:
    ids = tuple(local_tandem.tokenizer.encode(prompt, add_special_tokens=False))
    return local_tandem.router.generate(GenerationRequest(ids, max_tokens, draft_tokens=0)).tokens


@pytest.mark.parametrize("draft_tokens", [0, 3])
def test_greedy_over_the_routers_own_server_equals_the_target_alone(
    direct: TandemClient, local_tandem: LocalTandem, draft_tokens: int
) -> None:
    for prompt in PROMPTS[:3]:
        expected = target_alone(local_tandem, prompt, MAX_TOKENS)
        unary = direct.generate(prompt, max_tokens=MAX_TOKENS, draft_tokens=draft_tokens)
        assert unary.tokens == expected, prompt
        chunks = list(direct.stream(prompt, max_tokens=MAX_TOKENS, draft_tokens=draft_tokens))
        assert tuple(t for c in chunks for t in c.tokens) == expected, prompt
        assert "".join(c.text for c in chunks) == unary.text
        assert chunks[-1].finish_reason == unary.finish_reason


def test_sampled_output_is_the_proxys(direct: TandemClient, proxied: TandemClient) -> None:
    kwargs = dict(max_tokens=32, temperature=0.9, top_p=0.95, seed=5, draft_tokens=3)
    through_proxy = proxied.generate(PROMPTS[3], **kwargs)  # type: ignore[arg-type]
    direct_result = direct.generate(PROMPTS[3], **kwargs)  # type: ignore[arg-type]
    assert direct_result.tokens == through_proxy.tokens


def test_errors_keep_their_status(service: dict[str, object], direct: TandemClient) -> None:
    with pytest.raises(TandemClientError) as error:
        direct.generate("hello", max_tokens=0)
    assert error.value.code is grpc.StatusCode.INVALID_ARGUMENT
    address = str(service["address"])
    with (
        TandemClient(address, timeout_s=30, api_key="wrong") as stranger,
        pytest.raises(TandemClientError) as error,
    ):
        stranger.generate("hello", max_tokens=4)
    assert error.value.code is grpc.StatusCode.UNAUTHENTICATED


def test_the_clients_grpc_deadline_ends_the_request_and_frees_both_sessions(
    service: dict[str, object], direct: TandemClient
) -> None:
    with pytest.raises(TandemClientError) as error:
        direct.generate(PROMPTS[0], max_tokens=4000, timeout_s=0.5)
    assert error.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
    assert not any(wait_until_no_sessions(service).values())


def test_a_cancelled_stream_frees_both_sessions(
    service: dict[str, object], direct: TandemClient
) -> None:
    stream = direct.stream(PROMPTS[0], max_tokens=2000, draft_tokens=4)
    next(stream)
    stream.close()
    assert not any(wait_until_no_sessions(service).values())


def test_grpc_health_on_the_routers_own_server(service: dict[str, object]) -> None:
    with grpc.insecure_channel(str(service["address"])) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=30
        )
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_openai_http_on_the_routers_own_server(service: dict[str, object]) -> None:
    base = str(service["http_url"])
    key = TENANT_KEYS["main"]
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    headers = {"Authorization": f"Bearer {key}"}
    with httpx2.Client(timeout=60) as http:
        proxied = http.post(f"{service['proxy_http_url']}/completions", json=body, headers=headers)
        answered = http.post(f"{base}/completions", json=body, headers=headers)
        assert answered.status_code == 200, answered.text
        assert answered.json()["choices"][0]["text"] == proxied.json()["choices"][0]["text"]
        assert http.post(f"{base}/completions", json=body).status_code == 401
        assert http.post(f"{base}/completions", content=b"{", headers=headers).status_code == 400
        assert http.get(f"{base}/nowhere", headers=headers).status_code == 404
        assert http.get(base.removesuffix("/v1") + "/health").status_code == 200
        events = http.post(
            f"{base}/completions", json={**body, "stream": True}, headers=headers
        ).text.split("\n\n")
    data = [event.removeprefix("data: ") for event in events if event]
    assert data[-1] == "[DONE]"
    streamed = "".join(json.loads(d)["choices"][0]["text"] for d in data[:-1])
    assert streamed == proxied.json()["choices"][0]["text"]
    # The official client, streaming a chat.
    with openai.OpenAI(base_url=base, api_key=key, max_retries=0) as client:
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Add two numbers."}],
            max_tokens=8,
            temperature=0,
            stream=True,
        )
        pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert pieces and "".join(pieces)
