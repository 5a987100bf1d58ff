"""Tenants over the public gRPC API: authentication, isolation (a tenant cannot cancel or see
another's request), per-request permission, quotas with when to retry, the router's bounded
queue, and usage counters that match what was generated.

The service runs the tiny pair in-process behind a real gRPC server; its verifier waits a little
per step (a slower device) so that a long request is still running when the test acts on it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import grpc
import pytest

from cluster.api.client import TandemClient, TandemClientError
from cluster.api.service import TandemService
from cluster.api.service_config import ServiceConfig
from cluster.api.tenants import AuthConfig, TenantConfig, Tenants, hash_api_key, new_api_key
from cluster.local import InProcess, LocalTandem, local_router, text_decoder
from cluster.routing.router import Router
from drafter.config import SuffixConfig
from drafter.suffix import SuffixDrafter
from protos import generate_pb2
from tests.cluster.grpc_front import serve_local
from tests.cluster.routing.fake_ports import Answer, Wrapper
from tests.conftest import CODE_PROMPT
from tests.polling import wait_until
from verifier.verifier import Verifier

LONG = 400
"""Tokens of a request that must still be running when the test acts (~0.01 s per token)."""
KEYS = {name: new_api_key() for name in ("alice", "bob", "small", "metered")}
SERVICES: dict[str, TandemService] = {}
"""The service behind each address `serve` yields: tests that must see its queue look here."""


class SlowVerifier(Wrapper):
    """The tiny verifier as a port, `delay_s` slower per step: each answer of its sessions (a
    posted block's verdict, or a step a running session took alone) waits that long on the
    thread that answered, the verifier's engine thread, before the router hears it."""

    def __init__(self, verifier: Verifier, delay_s: float) -> None:
        super().__init__(verifier)
        self._delay_s = delay_s

    def hand(self, session_id: str, post_id: int | None, answer: Answer) -> Answer | None:
        time.sleep(self._delay_s)
        return answer


def tenant(name: str, **limits: Any) -> TenantConfig:
    return TenantConfig(name, hash_api_key(KEYS[name]), **limits)


def serve(
    local_tandem: LocalTandem, config: ServiceConfig, verifier_advances: bool = True
) -> Iterator[str]:
    # No end-of-sequence ids: a long request runs its full length.
    router = Router(
        SlowVerifier(local_tandem.verifier, 0.01),
        InProcess(local_tandem.drafter),
        text_decoder(local_tandem.tokenizer),
        frozenset(),
        verifier_advances=verifier_advances,
    )
    auth = AuthConfig(
        tenants=(
            tenant("alice"),
            tenant("bob"),
            tenant("small", max_concurrent=1, max_tokens_per_request=8),
            tenant("metered", tokens_per_minute=60),
        )
    )
    service = TandemService(router, local_tandem.tokenizer, config, tenants=Tenants(auth))
    server, port = serve_local(service)
    address = f"127.0.0.1:{port}"
    SERVICES[address] = service
    yield address
    server.stop(None)
    router.close()


@pytest.fixture(scope="module")
def address(local_tandem: LocalTandem) -> Iterator[str]:
    yield from serve(local_tandem, ServiceConfig())


@pytest.fixture(scope="module")
def lockstep_address(local_tandem: LocalTandem) -> Iterator[str]:
    """The same service with a lockstep router (`verifier_advances` off): every round posts a
    drafted block, so a speculative request always drafts (with running sessions the tiny
    drafter's blocks may all come after the verifier took those tokens alone)."""
    yield from serve(local_tandem, ServiceConfig(), verifier_advances=False)


def client(address: str, name: str | None) -> TandemClient:
    return TandemClient(address, timeout_s=60, api_key=KEYS[name] if name else None)


def code_of(call: Any) -> tuple[grpc.StatusCode, str, float | None]:
    with pytest.raises(TandemClientError) as error:
        call()
    return error.value.code, error.value.message, error.value.retry_after_s


def sessions(local_tandem: LocalTandem) -> tuple[int, int]:
    return (
        local_tandem.drafter.stats().num_sessions,
        local_tandem.verifier.stats().num_sessions,
    )


def test_every_call_needs_a_known_key(address: str) -> None:
    for key in (None, "tdm_not-a-key"):
        with TandemClient(address, timeout_s=60, api_key=key) as anyone:
            for call in (
                lambda c=anyone: c.generate(CODE_PROMPT, max_tokens=4),
                lambda c=anyone: list(c.stream(CODE_PROMPT, max_tokens=4)),
                lambda c=anyone: c.cancel("0" * 32),
                lambda c=anyone: c.usage(),
            ):
                code, message, _ = code_of(call)
                assert code == grpc.StatusCode.UNAUTHENTICATED
                assert ("missing API key" if key is None else "unknown API key") in message
    with TandemClient(address, metadata=[("authorization", KEYS["alice"])]) as raw:
        code, message, _ = code_of(lambda: raw.usage())
    assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in message


def test_a_tenant_cannot_cancel_another_tenants_request(
    address: str, local_tandem: LocalTandem
) -> None:
    with client(address, "alice") as alice, client(address, "bob") as bob:
        chunks = alice.stream(CODE_PROMPT, max_tokens=LONG, draft_tokens=0)
        first = next(chunks)
        # Bob learns nothing: another tenant's id is exactly as unknown as a made-up one.
        theirs = code_of(lambda: bob.cancel(first.request_id))
        made_up = code_of(lambda: bob.cancel("f" * 32))
        assert theirs[0] == made_up[0] == grpc.StatusCode.NOT_FOUND
        assert theirs[1].replace(first.request_id, "f" * 32) == made_up[1]
        rest = list(chunks)
    assert rest[-1].finish_reason == "length"
    assert sum(len(c.tokens) for c in [first, *rest]) == LONG
    assert sessions(local_tandem) == (0, 0)


def test_a_tenant_cancels_its_own_request(address: str, local_tandem: LocalTandem) -> None:
    with client(address, "alice") as alice:
        chunks = alice.stream(CODE_PROMPT, max_tokens=LONG, draft_tokens=0)
        first = next(chunks)
        alice.cancel(first.request_id)
        rest = list(chunks)
        assert rest[-1].finish_reason == "cancelled"
        assert rest[-1].stats is not None
        generated = sum(len(c.tokens) for c in [first, *rest])
        assert generated < LONG and rest[-1].stats.num_generated_tokens == generated
        # Once it has ended, its id is unknown even to its own tenant.
        assert code_of(lambda: alice.cancel(first.request_id))[0] == grpc.StatusCode.NOT_FOUND
    assert sessions(local_tandem) == (0, 0)


def test_usage_counts_match_what_each_tenant_got(lockstep_address: str) -> None:
    with client(lockstep_address, "bob") as bob, client(lockstep_address, "alice") as alice:
        before, alice_before = bob.usage(), alice.usage()
        results = [bob.generate(p, max_tokens=12, draft_tokens=3) for p in ("x", CODE_PROMPT)]
        after = bob.usage()
        assert alice.usage() == alice_before  # bob's traffic is not alice's
    assert after["tenant"] == "bob"
    assert set(after) == {field.name for field in generate_pb2.TenantUsage.DESCRIPTOR.fields}
    assert after["running"] == 0  # zero counters are there too

    def grew(field: str) -> int:
        return int(after.get(field, 0)) - int(before.get(field, 0))

    assert grew("requests") == 2
    assert grew("prompt_tokens") == sum(r.num_prompt_tokens for r in results)
    assert grew("generated_tokens") == sum(len(r.tokens) for r in results) == 24
    assert grew("drafted_tokens") == sum(r.num_drafted for r in results) > 0
    assert grew("accepted_tokens") == sum(r.num_accepted for r in results)
    assert after.get("running", 0) == 0


def test_more_than_a_tenant_may_ask_is_permission_denied(address: str) -> None:
    with client(address, "small") as small:
        assert len(small.generate(CODE_PROMPT, max_tokens=8).tokens) == 8
        code, message, retry = code_of(lambda: small.generate(CODE_PROMPT, max_tokens=9))
    assert code == grpc.StatusCode.PERMISSION_DENIED and "at most 8 tokens" in message
    assert retry is None  # retrying cannot help


def test_a_tenant_over_its_concurrency_is_told_when_to_retry(address: str) -> None:
    with client(address, "small") as small:
        running = small.stream(CODE_PROMPT, max_tokens=8, draft_tokens=0)
        next(running)  # admitted and generating
        code, message, retry = code_of(lambda: small.generate("x", max_tokens=4))
        list(running)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "requests running" in message
        assert retry is not None and retry > 0
        assert len(small.generate("x", max_tokens=4).tokens) == 4  # free again


def test_tokens_per_minute(address: str) -> None:
    with client(address, "metered") as metered:
        metered.generate(CODE_PROMPT, max_tokens=64, draft_tokens=0)  # overdraws its 60
        code, message, retry = code_of(lambda: metered.generate("x", max_tokens=4))
        usage = metered.usage()
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "60 tokens per minute" in message
    # At least 64 + the prompt - 60 tokens of debt at one token per second.
    assert retry is not None and 4 < retry < 70
    assert usage["refused"] == 1 and usage["requests"] == 1


@pytest.fixture(scope="module")
def one_at_a_time(local_tandem: LocalTandem) -> Iterator[str]:
    yield from serve(local_tandem, ServiceConfig(max_running_requests=1, max_queued_requests=1))


def test_a_full_router_queue_refuses_at_once(one_at_a_time: str, local_tandem: LocalTandem) -> None:
    with client(one_at_a_time, "alice") as alice, client(one_at_a_time, "bob") as bob:
        running = alice.stream(CODE_PROMPT, max_tokens=LONG, draft_tokens=0)
        next(running)
        queued: list[Sequence[int]] = []
        waiter = threading.Thread(
            target=lambda: queued.append(bob.generate("x", max_tokens=4, draft_tokens=0).tokens)
        )
        waiter.start()
        queue = SERVICES[one_at_a_time].admission
        wait_until(lambda: queue.queued == 1, what="bob's request waiting in the queue")
        code, message, retry = code_of(lambda: bob.generate("x", max_tokens=4))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "at capacity" in message
        assert retry is not None and retry > 0
        alice.cancel(next(running).request_id)
        list(running)
        waiter.join(timeout=60)
        assert len(queued) == 1 and len(queued[0]) == 4  # the queued one ran once there was room
    assert sessions(local_tandem) == (0, 0)


class OpenedFor(SuffixDrafter):
    """A suffix drafter that records whose requests opened a session on it."""

    def __init__(self) -> None:
        super().__init__(SuffixConfig())
        self.opened_for: list[str] = []

    def open_session(self, session_id: str, *args: Any, **kwargs: Any) -> int:
        self.opened_for.append(str(kwargs.get("tenant", "")))
        return super().open_session(session_id, *args, **kwargs)


def test_a_tenant_may_keep_its_text_out_of_the_suffix_index(local_tandem: LocalTandem) -> None:
    """`suffix_index: false` in a tenant's config reaches its requests through the API: the
    suffix drafter opens sessions for alice (by her name), never for the private tenant."""
    suffix = OpenedFor()
    router = local_router(
        local_tandem.verifier, local_tandem.drafter, local_tandem.target, suffix=suffix,
        pipelined=False,
    )  # fmt: skip
    KEYS.setdefault("private", new_api_key())
    auth = AuthConfig(tenants=(tenant("alice"), tenant("private", suffix_index=False)))
    service = TandemService(router, local_tandem.tokenizer, ServiceConfig(), tenants=Tenants(auth))
    server, port = serve_local(service)
    try:
        for name in ("private", "alice", "private"):
            with client(f"127.0.0.1:{port}", name) as caller:
                assert len(caller.generate(CODE_PROMPT, max_tokens=16).tokens) == 16
    finally:
        server.stop(None)
        router.close()
    assert suffix.opened_for == ["alice"]
    assert suffix.index_stats().tokens > 0  # alice's text only
