"""The clients against a real gRPC server on 127.0.0.1, over the in-process tiny models.

End to end: `TandemClient` / `AsyncTandemClient` → gRPC → `TandemServicer` → `TandemService`
→ the router of the `local_tandem` fixture. Checks exact tokens against the router itself,
exact status codes, and that a deadline or a cancelled stream frees the replicas' sessions.
Tests that compare speculation counters between requests run on the `lockstep` router: with
running sessions, whether a drafted block decides anything is a matter of timing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import aclosing
from typing import Any

import grpc
import pytest

from cluster.api.client import AsyncTandemClient, TandemClient, TandemClientError
from cluster.api.client_types import GenerateResult, StreamChunk
from cluster.api.service import TandemService
from cluster.api.tenants import Tenants
from cluster.local import LocalTandem
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from tests.cluster.grpc_front import serve_local
from tests.conftest import CODE_PROMPT

MAX_TOKENS = 24
LONG_MAX_TOKENS = 2000
"""Greedy on CODE_PROMPT runs ~2000 tokens (~8 s on a 2-core box) before it stops."""
FREED_WITHIN_S = 3.0
"""A stopped request frees its sessions within one verify pass (milliseconds); 3 s is far less
than a long request's full run, so freeing in time means the server stopped early."""


def _serve(router: Router, local_tandem: LocalTandem) -> Iterator[str]:
    service = TandemService(router, local_tandem.tokenizer, tenants=Tenants.unauthenticated())
    server, port = serve_local(service)
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.fixture(scope="module")
def address(local_tandem: LocalTandem) -> Iterator[str]:
    yield from _serve(local_tandem.router, local_tandem)


@pytest.fixture(scope="module")
def lockstep_address(local_tandem: LocalTandem, lockstep: Router) -> Iterator[str]:
    """The same service over the lockstep router (`verifier_advances` off): every token
    through a posted block, so a request's accepted tokens and verify passes are the same
    each run (greedy, or seeded) and the counters of two requests can be compared."""
    yield from _serve(lockstep, local_tandem)


def router_result(tandem: LocalTandem, prompt: str | list[int]) -> tuple[int, ...]:
    if isinstance(prompt, str):
        prompt = tandem.tokenizer.encode(prompt, add_special_tokens=False)
    request = GenerationRequest(tuple(prompt), MAX_TOKENS)
    return tandem.router.generate(request).tokens


def wait_until_freed(tandem: LocalTandem) -> None:
    deadline = time.monotonic() + FREED_WITHIN_S
    while time.monotonic() < deadline:
        if tandem.verifier.stats().num_sessions == 0 and tandem.drafter.stats().num_sessions == 0:
            return
        time.sleep(0.01)
    pytest.fail(
        f"sessions still open {FREED_WITHIN_S} s after the call ended: "
        f"verifier {tandem.verifier.stats()}, drafter {tandem.drafter.stats()}"
    )


def check_stream_matches(chunks: list[StreamChunk], result: GenerateResult) -> None:
    *body, last = chunks
    assert tuple(t for c in chunks for t in c.tokens) == result.tokens
    assert "".join(c.text for c in chunks) == result.text
    assert {c.request_id for c in chunks} == {last.request_id}
    assert all(c.finish_reason is None and c.stats is None for c in body)
    assert last.finish_reason == result.finish_reason
    assert last.stats is not None
    assert last.stats.num_prompt_tokens == result.num_prompt_tokens
    assert last.stats.num_generated_tokens == result.num_generated_tokens
    assert last.stats.num_verify_passes == result.num_verify_passes
    assert last.stats.num_accepted == result.num_accepted


@pytest.mark.parametrize("prompt", [CODE_PROMPT, [100, 101, 102, 32]], ids=["text", "ids"])
def test_sync_generate_and_stream_equal_the_router(
    lockstep_address: str, local_tandem: LocalTandem, prompt: str | list[int]
) -> None:
    with TandemClient(lockstep_address, timeout_s=60) as client:
        result = client.generate(prompt, max_tokens=MAX_TOKENS)
        chunks = list(client.stream(prompt, max_tokens=MAX_TOKENS))
        serial = client.generate(prompt, max_tokens=MAX_TOKENS, pipelined=False)
    assert result.tokens == serial.tokens == router_result(local_tandem, prompt)
    assert result.finish_reason == "length"
    assert result.num_generated_tokens == MAX_TOKENS
    # Each verify pass adds one token of the target's own, except where a wholly accepted
    # block deferred its bonus to the block drafted after it (pipelined). That block is a
    # pipeline hit only when it reached the verifier ahead of the verdict; drafted after it,
    # it is a plain block (when is timing), so hits are at most the deferred bonuses. A
    # serial request defers none: its count is exact.
    assert result.num_accepted + result.num_verify_passes - result.pipeline_hits >= MAX_TOKENS
    assert serial.num_accepted + serial.num_verify_passes == MAX_TOKENS
    assert len(result.request_id) == 32
    check_stream_matches(chunks, result)
    assert chunks[-1].request_id != result.request_id


def test_async_generate_and_stream_equal_the_router(
    lockstep_address: str, local_tandem: LocalTandem
) -> None:
    async def run() -> tuple[GenerateResult, GenerateResult, list[StreamChunk]]:
        async with AsyncTandemClient(lockstep_address, timeout_s=60) as client:
            result = await client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS)
            alone = await client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS, draft_tokens=0)
            chunks = [c async for c in client.stream(CODE_PROMPT, max_tokens=MAX_TOKENS)]
            return result, alone, chunks

    result, alone, chunks = asyncio.run(run())
    assert result.tokens == alone.tokens == router_result(local_tandem, CODE_PROMPT)
    assert alone.num_drafted == 0 and alone.num_verify_passes == MAX_TOKENS
    check_stream_matches(chunks, result)


def test_sampling_settings_and_seed_reach_the_server(lockstep_address: str) -> None:
    settings: dict[str, Any] = {"temperature": 0.8, "top_p": 0.9, "top_k": 40, "seed": 11}
    with TandemClient(lockstep_address, timeout_s=60) as client:
        first = client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS, **settings)
        again = client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS, **settings)
        other = client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS, **{**settings, "seed": 12})
        serial = client.generate(CODE_PROMPT, max_tokens=MAX_TOKENS, pipelined=False, **settings)
    assert first.tokens == again.tokens
    assert first.tokens != other.tokens
    # The service's default is pipelined: a wholly accepted block deferred its bonus token
    # (whether the block after it then counts as a hit or a miss is timing, so may be
    # neither). A serial request defers none, nor counts any hit or miss.
    assert first.num_accepted + first.num_verify_passes > MAX_TOKENS
    assert serial.pipeline_hits == serial.pipeline_misses == 0
    assert serial.num_accepted + serial.num_verify_passes == MAX_TOKENS


BAD_REQUESTS = [
    pytest.param(CODE_PROMPT, {"max_tokens": 0}, "max_tokens must be >= 1, got 0", id="max0"),
    pytest.param(
        CODE_PROMPT,
        {"max_tokens": 4, "temperature": float("nan")},
        "temperature must be a finite number >= 0, got nan",
        id="nan",
    ),
    pytest.param("", {"max_tokens": 4}, "prompt text must not be empty", id="empty"),
    pytest.param(
        [1, 300], {"max_tokens": 4}, "prompt_tokens[1] = 300 is outside the vocabulary", id="oov"
    ),
]


@pytest.mark.parametrize(("prompt", "settings", "message"), BAD_REQUESTS)
def test_bad_requests_are_invalid_argument(
    address: str, prompt: str | list[int], settings: dict[str, Any], message: str
) -> None:
    with TandemClient(address, timeout_s=60) as client:
        with pytest.raises(TandemClientError) as unary:
            client.generate(prompt, **settings)
        with pytest.raises(TandemClientError) as streamed:
            list(client.stream(prompt, **settings))
    for error in (unary.value, streamed.value):
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert message in error.message
        assert str(error).startswith("INVALID_ARGUMENT: ")


@pytest.mark.parametrize(("prompt", "settings", "message"), BAD_REQUESTS)
def test_async_bad_requests_are_invalid_argument(
    address: str, prompt: str | list[int], settings: dict[str, Any], message: str
) -> None:
    async def run() -> list[TandemClientError]:
        errors = []
        async with AsyncTandemClient(address, timeout_s=60) as client:
            try:
                await client.generate(prompt, **settings)
            except TandemClientError as error:
                errors.append(error)
            try:
                async for _ in client.stream(prompt, **settings):
                    pass
            except TandemClientError as error:
                errors.append(error)
        return errors

    errors = asyncio.run(run())
    assert len(errors) == 2
    assert all(e.code == grpc.StatusCode.INVALID_ARGUMENT and message in e.message for e in errors)


def test_values_the_wire_cannot_carry_fail_before_any_call() -> None:
    # No server at this address: the error must come from the client itself.
    client = TandemClient("127.0.0.1:1")
    with pytest.raises(TandemClientError) as error:
        client.generate("hi", max_tokens=4, seed=-1)
    assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.message == "seed must be in 0..2**64-1, got -1"
    with pytest.raises(TandemClientError, match=r"max_tokens must be in -2\*\*31"):
        client.stream("hi", max_tokens=2**31)
    client.close()


def test_no_server_is_unavailable() -> None:
    with (
        TandemClient("127.0.0.1:1", timeout_s=10) as client,
        pytest.raises(TandemClientError) as error,
    ):
        client.generate("hi", max_tokens=4)
    assert error.value.code == grpc.StatusCode.UNAVAILABLE


def test_deadline_exceeded_frees_the_sessions(address: str, local_tandem: LocalTandem) -> None:
    with TandemClient(address) as client, pytest.raises(TandemClientError) as error:
        client.generate(CODE_PROMPT, max_tokens=LONG_MAX_TOKENS, timeout_s=0.3)
    assert error.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until_freed(local_tandem)


def test_leaving_a_stream_cancels_it_and_frees_the_sessions(
    address: str, local_tandem: LocalTandem
) -> None:
    with TandemClient(address) as client:
        chunks = client.stream(CODE_PROMPT, max_tokens=LONG_MAX_TOKENS)
        next(chunks)
        next(chunks)
        assert local_tandem.verifier.stats().num_sessions == 1
        assert local_tandem.drafter.stats().num_sessions == 1
        chunks.close()
    wait_until_freed(local_tandem)


def test_leaving_an_async_stream_cancels_it_and_frees_the_sessions(
    address: str, local_tandem: LocalTandem
) -> None:
    async def run() -> None:
        async with AsyncTandemClient(address) as client:
            stream = client.stream(CODE_PROMPT, max_tokens=LONG_MAX_TOKENS)
            async with aclosing(stream) as chunks:
                async for _ in chunks:
                    break

    asyncio.run(run())
    wait_until_freed(local_tandem)


class _MetadataRecorder(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        self.seen: list[tuple[tuple[str, str], ...]] = []

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        self.seen.append(tuple(details.invocation_metadata))
        return await continuation(details)


def test_metadata_and_application_go_with_every_call(local_tandem: LocalTandem) -> None:
    recorder = _MetadataRecorder()
    service = TandemService(
        local_tandem.router, local_tandem.tokenizer, tenants=Tenants.unauthenticated()
    )
    server, port = serve_local(service, interceptors=[recorder])
    try:
        with TandemClient(
            f"127.0.0.1:{port}", metadata=[("tenant", "acme")], application="tandem"
        ) as client:
            client.generate("x", max_tokens=2)
            list(client.stream("x", max_tokens=2))
    finally:
        server.stop(None)
    assert len(recorder.seen) == 2
    for metadata in recorder.seen:
        assert ("tenant", "acme") in metadata
        assert ("application", "tandem") in metadata
