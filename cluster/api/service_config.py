"""The public API's server-side defaults and limits (`ServiceConfig`), checked when built.

`TandemConfig.api` carries one (cluster/config.py); `TandemService` reads its limits and
queue sizes, and `cluster.api.request_reader` the defaults a request that sets none takes.
Every bad value raises `InvalidArgumentError` naming the field. Plain data, validated when
built, no I/O: it imports no component and no torch (a config is read without them).
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.api.sampling_rule import AUTO, check_rule_name
from cluster.api.tool_formats import DETECT, check_format_name
from cluster.routing.draft_length_config import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import DEFAULT_MAX_CONTEXT_TOKENS, MAX_PREDRAFT_FAN_OUT

DEFAULT_MAX_TOKENS_LIMIT = DEFAULT_MAX_CONTEXT_TOKENS
"""Default ceiling on `max_tokens`: the verifier's default context."""
DEFAULT_MAX_RUNNING = 64
DEFAULT_MAX_QUEUED = 128
"""Together within the Serve ingress's 256 request threads: a queued request holds one."""


@dataclass(frozen=True)
class ServiceConfig:
    """Server-side defaults and limits of the public API."""

    default_draft_tokens: int = DEFAULT_DRAFT_TOKENS
    """Draft block length of a request that sets none; 0 means no speculation."""
    default_pipelined: bool = True
    """Whether a request that does not say drafts the next block during verification."""
    default_predraft_fan_out: int = 0
    """Outcome-keyed pre-drafting for a request that does not say: while a block is
    verified, the next is drafted for up to this many of its likely outcomes (0: off, the
    pipelined guess alone; at most `MAX_PREDRAFT_FAN_OUT`)."""
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT
    """Largest `max_tokens` a request may ask for."""
    max_running_requests: int = DEFAULT_MAX_RUNNING
    """Requests one router replica generates at once; more wait in its queue."""
    max_queued_requests: int = DEFAULT_MAX_QUEUED
    """Requests that may wait; beyond them a request is refused (RESOURCE_EXHAUSTED)."""
    sampling_rule: str = AUTO
    """The rule of a sampled request that names none (`cluster.api.sampling_rule`): `auto`
    (seed-exact when the request carries a seed, rejection sampling otherwise), `seed_exact`
    or `rejection`."""
    tool_parser: str = DETECT
    """The tool-call format read with `tool_choice` "auto" (`cluster.api.tool_formats`): ""
    picks it by the model's chat template; a name (`hermes`) overrides that."""
    stream_interval_tokens: int = 0
    """A stream's chunks are let out once this many tokens have gathered (0: every chunk, at
    most one per verifier step); the first and the last go out at once
    (`cluster.api.stream_interval`)."""
    stream_interval_ms: float = 0.0
    """A stream's chunks are let out once this many milliseconds have passed since the last
    went out (0: no time interval); with `stream_interval_tokens`, whichever comes first."""

    def __post_init__(self) -> None:
        check_rule_name(self.sampling_rule, "sampling_rule")
        check_format_name(self.tool_parser, "tool_parser")
        if not 0 <= self.default_draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidArgumentError(
                f"default_draft_tokens must be in 0..{MAX_DRAFT_TOKENS}, "
                f"got {self.default_draft_tokens}"
            )
        fan_out = self.default_predraft_fan_out
        if isinstance(fan_out, bool) or not 0 <= fan_out <= MAX_PREDRAFT_FAN_OUT:
            raise InvalidArgumentError(
                f"default_predraft_fan_out must be in 0..{MAX_PREDRAFT_FAN_OUT}, got {fan_out}"
            )
        if self.stream_interval_tokens < 0 or self.stream_interval_ms < 0:
            raise InvalidArgumentError(
                "stream_interval_tokens and stream_interval_ms must be >= 0, got "
                f"{self.stream_interval_tokens} and {self.stream_interval_ms}"
            )
        if self.max_tokens_limit < 1:
            raise InvalidArgumentError(
                f"max_tokens_limit must be >= 1, got {self.max_tokens_limit}"
            )
        if self.max_running_requests < 1 or self.max_queued_requests < 0:
            raise InvalidArgumentError(
                "max_running_requests must be >= 1 and max_queued_requests >= 0, got "
                f"{self.max_running_requests} and {self.max_queued_requests}"
            )
