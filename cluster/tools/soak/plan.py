"""What `tandem soak` runs, decided before it starts, from its settings and seed alone.

Pure: numbers in, plans out; no I/O and no clock, so the same seed gives the same plan.

- `SoakSettings`: the run's knobs, checked when built.
- `RequestSpec`: one request of a client stream: its prompt, length and sampling, and how it
  is meant to end (`Ending`): completed; left midway (the client closes the stream after some
  tokens); cut off by a deadline it set; or refused as bad input.
- `stream_requests(settings, stream, num_prompts)`: one stream's requests, an endless sequence
  fixed by the seed: the n-th request of a stream is the same in every run of that seed, however
  fast the service answers (only how many of them run depends on it).
- `kill_plan`: when a replica is SIGKILLed, and of which side, the sides alternating.
- `verifier_pool`: the verifier's KV pool and context, sized from the target's KV bytes per
  token so that the verifiers together hold about `kv_long_requests` long requests, and
  `concurrency` streams overflow them.
"""

from __future__ import annotations

import enum
import math
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from cluster.runtime.errors import InvalidArgumentError

NUM_DRAFTERS = 2
NUM_VERIFIERS = 2
KILL_SIDES = ("verifier", "drafter")
"""The side of the first kill, then the other, alternating."""
MAX_DURATION_S = 24 * 3600.0
MAX_CONCURRENCY = 256
BAD_INPUTS: tuple[Mapping[str, Any], ...] = (
    {"max_tokens": 0},
    {"temperature": -1.0},
    {"top_p": 1.5},
    {"max_tokens": 1_000_000},  # past the verifier's context
)
"""Settings the service must refuse with INVALID_ARGUMENT (a bad-input request takes one)."""


class Ending(enum.Enum):
    """How a request is meant to end."""

    COMPLETE = "complete"
    """Runs to its end: every error is the service's."""
    DISCONNECT = "disconnect"
    """The client closes the stream after `disconnect_after` tokens (CANCELLED is its own)."""
    DEADLINE = "deadline"
    """Sent with a short `timeout_s` (DEADLINE_EXCEEDED is its own; finishing in time is too)."""
    BAD_INPUT = "bad_input"
    """Sent with a setting the service must refuse (INVALID_ARGUMENT is its own)."""


ENDING_WEIGHTS = {
    Ending.COMPLETE: 0.70,
    Ending.DISCONNECT: 0.12,
    Ending.DEADLINE: 0.12,
    Ending.BAD_INPUT: 0.06,
}


@dataclass(frozen=True)
class SoakSettings:
    """The knobs of one soak run."""

    duration_s: float = 600.0
    """Seconds of load (streams start no request after it; those running finish)."""
    seed: int = 0
    concurrency: int = 16
    """Client streams, each sending one request after another."""
    kill_interval_s: float = 60.0
    """A replica is SIGKILLed every this many seconds (0: never)."""
    drafter_error_fraction: float = 0.05
    """Share of Draft calls the chaos drafter answers INTERNAL (`DrafterConfig.error_fraction`)."""
    kv_long_requests: int = 8
    """Long requests the verifiers' KV pools hold together (fewer than `concurrency`)."""
    warmup_s: float = 10.0
    """Seconds of short requests at twice the concurrency before the load, so that thread pools
    and allocators reach their working size before the processes are first read."""
    settle_s: float = 5.0
    """Seconds after the last request before the replicas are read."""
    short_tokens: tuple[int, int] = (8, 32)
    long_tokens: tuple[int, int] = (120, 200)
    long_share: float = 0.4
    greedy_share: float = 0.5
    """Of requests meant to complete or be left midway: share decoded greedily (compared with
    the target alone); the others sample with a seed."""
    deadline_s: tuple[float, float] = (0.3, 1.5)
    """A deadline request's timeout range: shorter than a long request takes."""
    growth_tolerance: float = 0.10
    """How far above its start a surviving replica's threads, descriptors and RSS may end."""

    def __post_init__(self) -> None:
        if not 0 < self.duration_s <= MAX_DURATION_S:
            raise InvalidArgumentError(f"duration must be in (0, {MAX_DURATION_S:.0f}] seconds")
        if not 1 <= self.concurrency <= MAX_CONCURRENCY:
            raise InvalidArgumentError(f"concurrency must be in 1..{MAX_CONCURRENCY}")
        if not (math.isfinite(self.kill_interval_s) and self.kill_interval_s >= 0):
            raise InvalidArgumentError("kill interval must be >= 0 seconds (0: no kills)")
        if not 0.0 <= self.drafter_error_fraction <= 1.0:
            raise InvalidArgumentError("drafter error fraction must be in [0, 1]")
        if self.kv_long_requests < 1:
            raise InvalidArgumentError("kv long requests must be >= 1")
        for name in ("warmup_s", "settle_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise InvalidArgumentError(f"{name} must be >= 0")
        for name in ("short_tokens", "long_tokens"):
            low, high = getattr(self, name)
            if not 1 <= low <= high:
                raise InvalidArgumentError(f"{name} must be a range 1 <= low <= high")
        for name in ("long_share", "greedy_share", "growth_tolerance"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise InvalidArgumentError(f"{name} must be in [0, 1]")
        low_s, high_s = self.deadline_s
        if not 0 < low_s <= high_s:
            raise InvalidArgumentError("deadline_s must be a range 0 < low <= high")


@dataclass(frozen=True)
class RequestSpec:
    """One request of one stream, as planned."""

    stream: int
    index: int
    """Its place in its stream's sequence."""
    prompt: int
    """Index into the prompt set."""
    max_tokens: int
    ending: Ending
    temperature: float = 0.0
    """0: greedy."""
    top_p: float = 1.0
    seed: int | None = None
    disconnect_after: int = 0
    """DISCONNECT: tokens received before the client closes the stream."""
    timeout_s: float | None = None
    """DEADLINE: the request's deadline, seconds after it is sent."""
    bad_input: Mapping[str, Any] = field(default_factory=dict)
    """BAD_INPUT: the settings that replace the planned ones."""

    @property
    def greedy(self) -> bool:
        """Decoded greedily with valid settings: its tokens must be the target alone's."""
        return self.temperature == 0.0 and self.ending is not Ending.BAD_INPUT

    def settings(self) -> dict[str, Any]:
        """The keyword arguments of `TandemClient.stream` (without the prompt and timeout)."""
        sent: dict[str, Any] = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }
        sent.update(self.bad_input)
        return sent


def stream_requests(settings: SoakSettings, stream: int, num_prompts: int) -> Iterator[RequestSpec]:
    """Stream `stream`'s requests, without end, each drawn from a generator seeded by the
    run's seed and the stream alone."""
    if num_prompts < 1:
        raise InvalidArgumentError("the prompt set is empty")
    rng = random.Random(f"tandem-soak/{settings.seed}/{stream}")
    index = 0
    while True:
        yield _draw(settings, rng, stream, index, num_prompts)
        index += 1


def warmup_requests(settings: SoakSettings, stream: int, num_prompts: int) -> Iterator[RequestSpec]:
    """Warm-up stream `stream`'s requests: short, meant to complete, greedy or sampled."""
    rng = random.Random(f"tandem-soak-warmup/{settings.seed}/{stream}")
    index = 0
    while True:
        sampled = rng.random() >= settings.greedy_share
        yield RequestSpec(
            stream=stream,
            index=index,
            prompt=rng.randrange(num_prompts),
            max_tokens=rng.randint(*settings.short_tokens),
            ending=Ending.COMPLETE,
            temperature=0.8 if sampled else 0.0,
            seed=rng.getrandbits(32) if sampled else None,
        )
        index += 1


def _draw(
    settings: SoakSettings, rng: random.Random, stream: int, index: int, num_prompts: int
) -> RequestSpec:
    ending = rng.choices(list(ENDING_WEIGHTS), weights=list(ENDING_WEIGHTS.values()))[0]
    long = rng.random() < settings.long_share
    max_tokens = rng.randint(*(settings.long_tokens if long else settings.short_tokens))
    sampled = rng.random() >= settings.greedy_share
    spec: dict[str, Any] = {
        "stream": stream,
        "index": index,
        "prompt": rng.randrange(num_prompts),
        "max_tokens": max_tokens,
        "ending": ending,
        "temperature": 0.8 if sampled else 0.0,
        "top_p": 0.95 if sampled else 1.0,
        "seed": rng.getrandbits(32) if sampled else None,
    }
    if ending is Ending.DISCONNECT:
        spec["disconnect_after"] = rng.randint(1, max(1, max_tokens // 2))
    elif ending is Ending.DEADLINE:
        # Long, so that the deadline usually passes mid-generation.
        spec["max_tokens"] = settings.long_tokens[1]
        spec["timeout_s"] = round(rng.uniform(*settings.deadline_s), 3)
    elif ending is Ending.BAD_INPUT:
        spec["bad_input"] = BAD_INPUTS[rng.randrange(len(BAD_INPUTS))]
    return RequestSpec(**spec)


@dataclass(frozen=True)
class Kill:
    """A replica SIGKILLed `at_s` seconds into the load: `side`'s busiest."""

    at_s: float
    side: str


def kill_plan(duration_s: float, interval_s: float) -> list[Kill]:
    """A kill every `interval_s` seconds, the sides alternating (a verifier first), none in the
    last half interval, so that the last replica killed is back before the load ends."""
    if interval_s <= 0:
        return []
    kills: list[Kill] = []
    at_s = interval_s
    while at_s <= duration_s - interval_s / 2:
        kills.append(Kill(at_s, KILL_SIDES[len(kills) % len(KILL_SIDES)]))
        at_s += interval_s
    return kills


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


@dataclass(frozen=True)
class VerifierPool:
    """The verifier limits the soak deploys."""

    kv_cache_bytes: int
    """Bytes of each verifier's KV pool."""
    max_context_tokens: int
    """Each verifier's context: the longest prompt, a long request and a block, in whole KV
    blocks. A replica's pool holds at least one such sequence, whatever its bytes."""
    long_request_blocks: int
    """KV blocks a long request on the mean prompt holds at its end."""
    long_requests_per_pool: int
    """Such requests one verifier's pool holds."""


def verifier_pool(
    kv_bytes_per_token: int,
    block_size: int,
    prompt_tokens: list[int],
    settings: SoakSettings,
    num_verifiers: int = NUM_VERIFIERS,
) -> VerifierPool:
    """Each verifier's pool holds its share of `kv_long_requests` long requests of the longest
    planned length on the mean prompt, with the block and bonus a verifier reserves when a
    session opens (and never less than one whole context)."""
    # Imported here: the session module pulls in torch, which `tandem --help` must not wait for.
    from cluster.runtime.limits import MAX_BLOCK_TOKENS

    if kv_bytes_per_token < 1 or block_size < 1 or not prompt_tokens:
        raise InvalidArgumentError("KV bytes per token, block size and prompts must be positive")
    headroom = MAX_BLOCK_TOKENS + 1  # what a verifier finds room for on opening: a block, a bonus
    longest = settings.long_tokens[1]
    mean_prompt = math.ceil(sum(prompt_tokens) / len(prompt_tokens))
    long_blocks = blocks_for(mean_prompt + longest + headroom, block_size)
    context_blocks = blocks_for(max(prompt_tokens) + longest + headroom, block_size)
    per_pool = max(1, math.ceil(settings.kv_long_requests / num_verifiers))
    blocks = max(per_pool * long_blocks, context_blocks)
    return VerifierPool(
        kv_cache_bytes=blocks * block_size * kv_bytes_per_token,
        max_context_tokens=context_blocks * block_size,
        long_request_blocks=long_blocks,
        long_requests_per_pool=per_pool,
    )


def service_config(settings: SoakSettings, pool: VerifierPool, preset: str) -> dict[str, Any]:
    """The `TandemConfig` (as YAML data) the soak serves: the preset's pair in float32, two
    drafters (one of them erring on purpose) and two verifiers with small KV pools."""
    return {
        "models": {"preset": preset, "dtype": "float32"},
        "drafter": {"num_replicas": NUM_DRAFTERS},
        "verifier": {"num_replicas": NUM_VERIFIERS},
        "drafter_limits": {"error_fraction": settings.drafter_error_fraction},
        # The plan's rounds without the measured modes: the soak exercises the drafters (one
        # errs on purpose, one is killed), and on a CPU the tiny pair's start-up steps would
        # turn the draft model off (`cluster.routing.draft_modes`).
        "draft_length": {"enabled": True, "measured_modes": False},
        "verifier_limits": {
            "kv_cache_bytes": pool.kv_cache_bytes,
            "max_context_tokens": pool.max_context_tokens,
        },
    }
