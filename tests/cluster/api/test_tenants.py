"""Tenants: keys stored hashed, authentication, per-request permission, concurrency and
tokens-per-minute quotas with when to retry, usage counters, and the config that declares them."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest

from cluster.api.tenants import (
    ANONYMOUS,
    AuthConfig,
    PermissionDeniedError,
    QuotaExceededError,
    TenantConfig,
    Tenants,
    UnauthenticatedError,
    bearer_key,
    hash_api_key,
    new_api_key,
)
from cluster.config import TandemConfig
from cluster.runtime.errors import InvalidArgumentError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def tenants_of(*configs: TenantConfig, clock: Clock | None = None) -> Tenants:
    return Tenants(AuthConfig(tenants=configs), clock=clock or Clock())


def test_keys_are_random_and_only_their_hash_is_kept() -> None:
    first, second = new_api_key(), new_api_key()
    assert first != second and len(first) > 40
    config = TenantConfig("acme", hash_api_key(first))
    assert first not in repr(config) and config.key_sha256 == hash_api_key(first)
    with pytest.raises(InvalidArgumentError, match="never the key itself"):
        TenantConfig("acme", first)


def test_authentication() -> None:
    key_a, key_b = new_api_key(), new_api_key()
    tenants = tenants_of(
        TenantConfig("a", hash_api_key(key_a)), TenantConfig("b", hash_api_key(key_b))
    )
    assert tenants.authenticate(f"Bearer {key_a}").name == "a"
    assert tenants.authenticate(f"Bearer {key_b}").name == "b"
    for bad, words in [
        (None, "missing API key"),
        (key_a, "must be 'Bearer <key>'"),
        (f"Basic {key_a}", "must be 'Bearer <key>'"),
        ("Bearer ", "unknown API key"),
        (f"Bearer {key_a}x", "unknown API key"),
        (f"Bearer {new_api_key()}", "unknown API key"),
    ]:
        with pytest.raises(UnauthenticatedError, match=words) as error:
            tenants.authenticate(bad)
        assert error.value.status == "UNAUTHENTICATED"
        assert key_a not in str(error.value)


def test_bearer_key_reads_the_authorization_metadata() -> None:
    assert bearer_key([("x", "1"), ("authorization", "Bearer k")]) == "Bearer k"
    assert bearer_key([("Authorization", b"Bearer k")]) == "Bearer k"
    assert bearer_key([("application", "tandem")]) is None


def test_auth_off_only_when_the_config_says_so() -> None:
    with pytest.raises(InvalidArgumentError, match="no tenants are configured"):
        Tenants(AuthConfig())
    with pytest.raises(InvalidArgumentError, match="no tenants"):
        TandemConfig().auth.check_usable()  # the default config: on, and nobody may call
    anonymous = Tenants(AuthConfig(enabled=False)).authenticate(None)
    assert anonymous.name == ANONYMOUS


def test_max_tokens_per_request_is_permission_denied() -> None:
    key = new_api_key()
    tenants = tenants_of(TenantConfig("a", hash_api_key(key), max_tokens_per_request=16))
    tenant = tenants.authenticate(f"Bearer {key}")
    tenants.check(tenant, 16)
    with pytest.raises(PermissionDeniedError, match="at most 16 tokens per request, got 17"):
        tenants.check(tenant, 17)
    assert tenants.usage(tenant).refused == 1


def test_concurrency_limit_is_resource_exhausted_until_a_request_finishes() -> None:
    key = new_api_key()
    tenants = tenants_of(TenantConfig("a", hash_api_key(key), max_concurrent=2))
    tenant = tenants.authenticate(f"Bearer {key}")
    tenants.start(tenant)
    tenants.start(tenant)
    with pytest.raises(QuotaExceededError, match="2 requests running") as error:
        tenants.start(tenant)
    assert error.value.status == "RESOURCE_EXHAUSTED" and error.value.retry_after_s > 0
    tenants.finish(tenant)
    tenants.start(tenant)
    usage = tenants.usage(tenant)
    assert (usage.requests, usage.running, usage.refused) == (3, 2, 1)


def test_tokens_per_minute_refill_and_say_when_to_retry() -> None:
    key, clock = new_api_key(), Clock()
    tenants = tenants_of(TenantConfig("a", hash_api_key(key), tokens_per_minute=600), clock=clock)
    tenant = tenants.authenticate(f"Bearer {key}")
    tenants.start(tenant)
    tenants.charge(tenant, prompt=100, generated=600)  # one request may overdraw: 100 in debt
    tenants.finish(tenant)
    with pytest.raises(QuotaExceededError, match="600 tokens per minute") as error:
        tenants.start(tenant)
    # 600 per minute is 10 per second: 101 tokens to refill is 10.1 s.
    assert error.value.retry_after_s == pytest.approx(10.1)
    assert "retry in 10.1 s" in str(error.value)
    clock.now = 10.0
    with pytest.raises(QuotaExceededError):
        tenants.start(tenant)
    clock.now = 10.2
    tenants.start(tenant)  # out of debt: admitted
    clock.now = 1000.0
    assert tenant.bucket is not None and tenant.bucket.level() == 600  # never above a minute's


def test_usage_counts_each_kind_of_token_per_tenant() -> None:
    key_a, key_b = new_api_key(), new_api_key()
    tenants = tenants_of(
        TenantConfig("a", hash_api_key(key_a)), TenantConfig("b", hash_api_key(key_b))
    )
    a = tenants.authenticate(f"Bearer {key_a}")
    tenants.charge(a, prompt=5, generated=7, drafted=9, accepted=4)
    tenants.charge(a, generated=1)
    usage = tenants.usage(a)
    assert (usage.prompt_tokens, usage.generated_tokens) == (5, 8)
    assert (usage.drafted_tokens, usage.accepted_tokens) == (9, 4)
    assert tenants.usage(tenants.authenticate(f"Bearer {key_b}")).generated_tokens == 0
    assert tenants.all_usage()["a"].generated_tokens == 8


def test_tenant_limits_are_validated() -> None:
    digest = hash_api_key("k")
    for fields, words in [
        ({"name": ""}, "alphanumeric"),
        ({"name": "a b"}, "alphanumeric"),
        ({"max_concurrent": 0}, "max_concurrent"),
        ({"tokens_per_minute": 0}, "tokens_per_minute"),
        ({"max_tokens_per_request": -1}, "max_tokens_per_request"),
        ({"weight": 0}, "weight"),
        ({"weight": float("nan")}, "weight"),
    ]:
        with pytest.raises(InvalidArgumentError, match=words):
            TenantConfig(**{"name": "a", "key_sha256": digest, **fields})  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="unique"):
        AuthConfig(tenants=(TenantConfig("a", digest), TenantConfig("a", hash_api_key("j"))))
    with pytest.raises(InvalidArgumentError, match="same API key"):
        AuthConfig(tenants=(TenantConfig("a", digest), TenantConfig("b", digest)))


def test_tenants_come_from_the_config_file_shape() -> None:
    digest = hash_api_key("k")
    config = TandemConfig.from_dict(
        {"auth": {"tenants": [{"name": "acme", "key_sha256": digest, "weight": 2}]}}
    )
    assert config.auth.tenants == (TenantConfig("acme", digest, weight=2),)
    with pytest.raises(InvalidArgumentError, match=r"auth\.tenants\[0\]\.key: unknown key"):
        TandemConfig.from_dict({"auth": {"tenants": [{"name": "acme", "key": "k"}]}})
    with pytest.raises(InvalidArgumentError, match=r"auth\.tenants must be a list"):
        TandemConfig.from_dict({"auth": {"tenants": {"name": "acme"}}})
    assert TandemConfig.from_dict({"auth": {"enabled": False}}).auth.enabled is False


def test_quota_errors_survive_pickling() -> None:
    """Serve pickles a replica's exceptions on their way to the proxy."""
    error = pickle.loads(pickle.dumps(QuotaExceededError("over", 2.5)))
    assert isinstance(error, QuotaExceededError)
    assert (str(error), error.retry_after_s) == ("over; retry in 2.5 s", 2.5)
    for other in (UnauthenticatedError("no"), PermissionDeniedError("no")):
        assert str(pickle.loads(pickle.dumps(other))) == "no"


def test_serve_without_tenants_serves_a_local_tenant_whose_key_the_home_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cluster.cli import service as cli_service
    from cluster.serve import ray_cluster

    monkeypatch.setenv(ray_cluster.HOME_ENV, str(tmp_path))
    monkeypatch.delenv(ray_cluster.API_KEY_ENV, raising=False)
    assert ray_cluster.api_key() is None  # nothing served yet: the CLI sends no key
    config = cli_service._with_local_tenant(TandemConfig())
    key = ray_cluster.api_key()
    assert key is not None and ray_cluster.local_api_key() == key
    assert (ray_cluster.home() / "api_key").stat().st_mode & 0o777 == 0o600
    (local,) = config.auth.tenants
    assert local.name == "local" and local.key_sha256 == hash_api_key(key)
    assert Tenants(config.auth).authenticate(f"Bearer {key}").name == "local"
    monkeypatch.setenv(ray_cluster.API_KEY_ENV, "tdm_from-env")
    assert ray_cluster.api_key() == "tdm_from-env"  # the environment wins
    # A config that names its tenants, or turns auth off, is served as it is.
    named = TandemConfig(auth=AuthConfig(tenants=(TenantConfig("a", hash_api_key("k")),)))
    assert cli_service._with_local_tenant(named) is named
    off = TandemConfig(auth=AuthConfig(enabled=False))
    assert cli_service._with_local_tenant(off) is off
