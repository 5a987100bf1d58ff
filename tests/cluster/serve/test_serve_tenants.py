"""Tenants through Serve's gRPC proxy, the second door of the session's service
(tests/cluster/conftest.py, `proxy_address`): keys, isolation, limits with when to retry
(trailing metadata through the proxy), usage."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from cluster.api.client import TandemClient, TandemClientError
from tests.cluster.conftest import SMALL_LIMITS, TENANT_KEYS, wait_until_no_sessions
from tests.conftest import CODE_PROMPT

pytestmark = [pytest.mark.ray, pytest.mark.slow]

LONG = int(SMALL_LIMITS["max_tokens_per_request"])


def client(service: dict[str, object], key: str | None) -> TandemClient:
    return TandemClient(str(service["proxy_address"]), timeout_s=120, api_key=key)


def failure(call: Any) -> TandemClientError:
    with pytest.raises(TandemClientError) as error:
        call()
    return error.value


def test_calls_without_a_known_key_are_unauthenticated(service: dict[str, object]) -> None:
    for key, words in [(None, "missing API key"), ("tdm_wrong", "unknown API key")]:
        with client(service, key) as anyone:
            for call in (
                lambda c=anyone: c.generate(CODE_PROMPT, max_tokens=4),
                lambda c=anyone: list(c.stream(CODE_PROMPT, max_tokens=4)),
                lambda c=anyone: c.usage(),
                lambda c=anyone: c.cancel("0" * 32),
            ):
                error = failure(call)
                assert error.code == grpc.StatusCode.UNAUTHENTICATED and words in error.message


def test_isolation_limits_and_usage_through_the_proxy(service: dict[str, object]) -> None:
    main_key, small_key = TENANT_KEYS["main"], TENANT_KEYS["small"]
    with client(service, main_key) as main, client(service, small_key) as small:
        before = small.usage()
        denied = failure(lambda: small.generate(CODE_PROMPT, max_tokens=LONG + 1))
        assert denied.code == grpc.StatusCode.PERMISSION_DENIED and denied.retry_after_s is None

        running = small.stream(CODE_PROMPT, max_tokens=LONG, draft_tokens=0)
        first = next(running)
        busy = failure(lambda: small.generate("x", max_tokens=4))
        assert busy.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert busy.retry_after_s is not None and busy.retry_after_s > 0  # trailer got through
        # Another tenant cannot cancel it: NOT_FOUND, as for an id that never existed.
        assert failure(lambda: main.cancel(first.request_id)).code == grpc.StatusCode.NOT_FOUND
        small.cancel(first.request_id)
        rest = list(running)
        assert rest[-1].finish_reason == "cancelled"
        generated = sum(len(c.tokens) for c in [first, *rest])
        assert 0 < generated < LONG

        done = small.generate("x", max_tokens=5, draft_tokens=2)
        after = small.usage()
    assert after["tenant"] == "small"
    assert int(after["requests"]) - int(before.get("requests", 0)) == 2
    assert int(after["refused"]) - int(before.get("refused", 0)) == 2
    grown = int(after["generated_tokens"]) - int(before.get("generated_tokens", 0))
    assert grown == generated + len(done.tokens)
    assert int(after["drafted_tokens"]) - int(before.get("drafted_tokens", 0)) == done.num_drafted
    assert not any(wait_until_no_sessions(service).values())
