"""Tenants: who may call the public API, within which limits, and what each has used.

Configuration (`AuthConfig`, part of `TandemConfig`): each tenant has a name, the SHA-256 of
its API key (the key itself is never stored, logged or sent back; `tandem keys new` makes a key
and prints its hash for the config) and its limits: concurrent requests, tokens per minute,
max tokens per request, and a weight for its fair share of the router when requests queue
(`cluster.api.admission`). Authentication is on unless the config says `enabled: false`
explicitly; on, with no tenants, the application refuses to build.

A client sends `authorization: Bearer <key>` metadata. Outcomes, each its own status:
- no key, not a bearer key, or a key no tenant has: UNAUTHENTICATED;
- asking for more than the tenant may ever have (max_tokens over its per-request limit):
  PERMISSION_DENIED, since retrying the same request cannot help;
- over a limit that frees up with time (concurrent requests, tokens per minute):
  `QuotaExceededError`, RESOURCE_EXHAUSTED with when to retry (`retry_after_s`, sent as the
  `retry-after-ms` trailing metadata and in the message).

Tokens per minute is a token bucket: it holds up to `tokens_per_minute` and refills at that rate
per minute; a request's prompt is charged when it starts and each generated token as it is
committed. A request starts only while the bucket is not in debt, so one long request may
overdraw it and the tenant then waits until it refills: never more than one request's worth.

Counters per tenant (`TenantUsage`): requests, prompt, generated, drafted and accepted tokens,
and requests refused. They live in the router replica that served the request.
"""

from __future__ import annotations

import hashlib
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from cluster.runtime.errors import InvalidArgumentError, ResourceExhaustedError, TandemError

AUTHORIZATION_METADATA_KEY = "authorization"
BEARER_PREFIX = "Bearer "
KEY_PREFIX = "tdm_"
HASH_PREFIX = "sha256:"
ANONYMOUS = "anonymous"
"""The tenant every call belongs to when authentication is off."""
CONCURRENCY_RETRY_S = 1.0
"""When to retry after the concurrent-requests limit: requests end at unknown times."""


class UnauthenticatedError(TandemError):
    """The call carries no API key, or one that belongs to no tenant."""

    status = "UNAUTHENTICATED"


class PermissionDeniedError(TandemError):
    """The tenant asked for more than its limits ever allow."""

    status = "PERMISSION_DENIED"


class QuotaExceededError(ResourceExhaustedError):
    """Over a limit that frees up with time; `retry_after_s` says when to try again."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(f"{message}; retry in {retry_after_s:.1f} s", retry_after_s)
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, float | None]]:
        # Ray pickles a Serve replica's exceptions: rebuild from both arguments.
        return (type(self), (self.message, self.retry_after_s))


def new_api_key() -> str:
    """A fresh random API key (256 bits)."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> str:
    """What the config stores for `key`: "sha256:<hex digest>"."""
    return HASH_PREFIX + hashlib.sha256(key.encode()).hexdigest()


@dataclass(frozen=True)
class TenantConfig:
    """One tenant: its key's hash and its limits."""

    name: str
    key_sha256: str
    """`hash_api_key(key)`: "sha256:" and 64 hex digits."""
    max_concurrent: int = 8
    """Requests running or queued at once."""
    tokens_per_minute: int | None = None
    """Prompt plus generated tokens per minute (None: no limit)."""
    max_tokens_per_request: int | None = None
    """Largest max_tokens a request may ask for (None: the server's limit only)."""
    weight: float = 1.0
    """Share of the router when requests queue, relative to other tenants' weights."""
    suffix_index: bool = True
    """False: the suffix drafter never holds this tenant's prompts or outputs, nor drafts for
    its requests (nothing of its text outlives a request on the drafting side)."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise InvalidArgumentError(
                f"tenant name must be alphanumeric (with - or _), got {self.name!r}"
            )
        digest = self.key_sha256.removeprefix(HASH_PREFIX)
        if (
            not self.key_sha256.startswith(HASH_PREFIX)
            or len(digest) != 64
            or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise InvalidArgumentError(
                f"tenant {self.name}: key_sha256 must be 'sha256:' and 64 lowercase hex digits "
                "(`tandem keys new` prints one), never the key itself"
            )
        if self.max_concurrent < 1:
            raise InvalidArgumentError(
                f"tenant {self.name}: max_concurrent must be >= 1, got {self.max_concurrent}"
            )
        for name in ("tokens_per_minute", "max_tokens_per_request"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidArgumentError(f"tenant {self.name}: {name} must be >= 1, got {value}")
        if not (math.isfinite(self.weight) and self.weight > 0):
            raise InvalidArgumentError(
                f"tenant {self.name}: weight must be a positive number, got {self.weight}"
            )


@dataclass(frozen=True)
class AuthConfig:
    """Who may call the public API."""

    enabled: bool = True
    """False only for local development: every call is then the anonymous tenant's."""
    tenants: tuple[TenantConfig, ...] = ()

    def __post_init__(self) -> None:
        names = [tenant.name for tenant in self.tenants]
        hashes = [tenant.key_sha256 for tenant in self.tenants]
        if len(set(names)) != len(names):
            raise InvalidArgumentError(f"tenant names must be unique, got {names}")
        if len(set(hashes)) != len(hashes):
            raise InvalidArgumentError("two tenants have the same API key")

    def check_usable(self) -> None:
        """Refuse a config under which nobody could call the service."""
        if self.enabled and not self.tenants:
            raise InvalidArgumentError(
                "authentication is on but no tenants are configured: add auth.tenants "
                "(`tandem keys new` makes a key), or set auth.enabled: false for local "
                "development"
            )


@dataclass
class TenantUsage:
    """What one tenant has used since this router replica started."""

    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    refused: int = 0
    """Requests refused for a limit (quota, concurrency, queue, permission)."""
    running: int = 0
    """Requests running or queued now."""


class TokenBucket:
    """Tokens per minute: holds up to `per_minute`, refills continuously, may go into debt."""

    def __init__(self, per_minute: int, clock: Callable[[], float]) -> None:
        self._rate = per_minute / 60.0
        self._capacity = float(per_minute)
        self._level = float(per_minute)
        self._clock = clock
        self._at = clock()

    def level(self) -> float:
        now = self._clock()
        self._level = min(self._capacity, self._level + (now - self._at) * self._rate)
        self._at = now
        return self._level

    def wait_s(self) -> float:
        """Seconds until the bucket is out of debt (0 if it is not)."""
        level = self.level()
        return 0.0 if level > 0 else (1.0 - level) / self._rate

    def charge(self, tokens: int) -> None:
        self.level()
        self._level -= tokens


@dataclass
class Tenant:
    """A tenant at run time: its config, usage and token bucket."""

    config: TenantConfig
    usage: TenantUsage = field(default_factory=TenantUsage)
    bucket: TokenBucket | None = None

    @property
    def name(self) -> str:
        return self.config.name


def bearer_key(metadata: Iterable[tuple[str, str | bytes]]) -> str | None:
    """The value of the call's `authorization` metadata, if any."""
    for key, value in metadata:
        if key.lower() == AUTHORIZATION_METADATA_KEY:
            return value.decode() if isinstance(value, bytes) else value
    return None


class Tenants:
    """Authenticates calls and holds every tenant's limits and counters; thread-safe."""

    def __init__(self, config: AuthConfig, clock: Callable[[], float] = time.monotonic) -> None:
        config.check_usable()
        self.enabled = config.enabled
        self._lock = threading.Lock()
        self._by_hash: dict[str, Tenant] = {}
        for tenant_config in config.tenants:
            bucket = (
                TokenBucket(tenant_config.tokens_per_minute, clock)
                if tenant_config.tokens_per_minute is not None
                else None
            )
            self._by_hash[tenant_config.key_sha256] = Tenant(tenant_config, bucket=bucket)
        self._anonymous = Tenant(TenantConfig(ANONYMOUS, HASH_PREFIX + "0" * 64, 2**31 - 1))

    @classmethod
    def unauthenticated(cls) -> Tenants:
        """No authentication: every call is the anonymous tenant's (local development)."""
        return cls(AuthConfig(enabled=False))

    def authenticate(self, authorization: str | None) -> Tenant:
        """The tenant whose key `authorization` ("Bearer <key>") carries."""
        if not self.enabled:
            return self._anonymous
        if authorization is None:
            raise UnauthenticatedError(
                "missing API key: send 'authorization: Bearer <key>' metadata"
            )
        if not authorization.startswith(BEARER_PREFIX):
            raise UnauthenticatedError("authorization metadata must be 'Bearer <key>'")
        tenant = self._by_hash.get(hash_api_key(authorization.removeprefix(BEARER_PREFIX)))
        if tenant is None:
            raise UnauthenticatedError("unknown API key")
        return tenant

    def check(self, tenant: Tenant, max_tokens: int) -> None:
        """Refuse a request for more than `tenant` may ever ask (PERMISSION_DENIED)."""
        limit = tenant.config.max_tokens_per_request
        if limit is not None and max_tokens > limit:
            self.refused(tenant)
            raise PermissionDeniedError(
                f"tenant {tenant.name} may ask for at most {limit} tokens per request, "
                f"got {max_tokens}"
            )

    def start(self, tenant: Tenant) -> None:
        """Admit one request of `tenant` within its concurrency and rate limits, or raise
        `QuotaExceededError`; an admitted request must `finish`."""
        limits = tenant.config
        with self._lock:
            if tenant.usage.running >= limits.max_concurrent:
                tenant.usage.refused += 1
                raise QuotaExceededError(
                    f"tenant {tenant.name} already has {tenant.usage.running} requests "
                    "running, its limit",
                    CONCURRENCY_RETRY_S,
                )
            wait_s = tenant.bucket.wait_s() if tenant.bucket is not None else 0.0
            if wait_s > 0:
                tenant.usage.refused += 1
                raise QuotaExceededError(
                    f"tenant {tenant.name} used its {limits.tokens_per_minute} tokens per minute",
                    wait_s,
                )
            tenant.usage.running += 1
            tenant.usage.requests += 1

    def refused(self, tenant: Tenant) -> None:
        """Count a request refused for a limit."""
        with self._lock:
            tenant.usage.refused += 1

    def charge(
        self,
        tenant: Tenant,
        prompt: int = 0,
        generated: int = 0,
        drafted: int = 0,
        accepted: int = 0,
    ) -> None:
        """Add to the tenant's counters; prompt and generated tokens count against its rate."""
        with self._lock:
            usage = tenant.usage
            usage.prompt_tokens += prompt
            usage.generated_tokens += generated
            usage.drafted_tokens += drafted
            usage.accepted_tokens += accepted
            if tenant.bucket is not None and prompt + generated:
                tenant.bucket.charge(prompt + generated)

    def finish(self, tenant: Tenant) -> None:
        with self._lock:
            tenant.usage.running -= 1

    def usage(self, tenant: Tenant) -> TenantUsage:
        """A copy of the tenant's counters."""
        with self._lock:
            return TenantUsage(**vars(tenant.usage))

    def all_usage(self) -> dict[str, TenantUsage]:
        with self._lock:
            tenants: Sequence[Tenant] = [*self._by_hash.values(), self._anonymous]
            return {t.name: TenantUsage(**vars(t.usage)) for t in tenants}
