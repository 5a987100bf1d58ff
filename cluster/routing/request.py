"""A generation request as the router sees it, and what comes back: chunks, stats, the result.

Plain frozen dataclasses, validated when built, so that the CLI, the local mode and the gRPC
ingress all reject the same bad input with the same message.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from cluster.routing.draft_length_config import DEFAULT_DRAFT_TOKENS, MAX_DRAFT_TOKENS
from cluster.runtime.constraint import Constraint, Grammar
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.limits import MAX_PREDRAFT_FAN_OUT
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import MAX_SEED

MAX_STOP_SEQUENCES = 16


class FinishReason(enum.Enum):
    LENGTH = "length"
    """max_tokens reached."""
    STOP = "stop"
    """An end-of-sequence token or a stop sequence."""
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class GenerationRequest:
    """One request: prompt token ids, limits, sampling and speculation settings."""

    prompt_tokens: tuple[int, ...]
    max_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    """Seeds every random draw of the request (drafter and verifier each derive their own)."""
    stop: tuple[str, ...] = ()
    """Generation ends before the first occurrence of any of these strings."""
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    """Draft block length; 0 decodes with the target alone through the same path."""
    predraft_fan_out: int | None = None
    """Outcome-keyed pre-drafting: while a block is verified, the next is drafted for up to
    this many of the verification's likely outcomes (0: off); None: the router's default."""
    deadline: float | None = None
    """A `time.monotonic()` instant after which the request must stop (DEADLINE_EXCEEDED) and
    free its sessions; None: no deadline."""
    grammar: Grammar | None = None
    """What the output must match (`cluster.runtime.constraint`); None: unconstrained."""
    min_tokens: int = 0
    """End-of-sequence and `stop_token_ids` are masked out until this many tokens exist."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the generation as end-of-sequence does (finish reason stop)."""
    ignore_eos: bool = False
    """Generate past end-of-sequence tokens (until max_tokens or a stop)."""
    skip_special_tokens: bool = True
    """Leave special tokens out of the text."""
    tenant: str = ""
    """Whose request it is (set by the service from the caller's key): a suffix drafter drafts
    from that tenant's earlier text only. "" for the anonymous tenant (in process)."""
    suffix_index: bool = True
    """Whether the suffix drafter may hold this request's text and draft for it (its tenant's
    `suffix_index`)."""

    def __post_init__(self) -> None:
        if len(self.prompt_tokens) == 0:
            raise InvalidArgumentError("prompt must not be empty")
        if isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidArgumentError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0 <= self.seed <= MAX_SEED:
            raise InvalidArgumentError(f"seed must be in 0..2**64-1, got {self.seed}")
        if not 0 <= self.draft_tokens <= MAX_DRAFT_TOKENS:
            raise InvalidArgumentError(
                f"draft_tokens must be in 0..{MAX_DRAFT_TOKENS}, got {self.draft_tokens}"
            )
        fan_out = self.predraft_fan_out
        if fan_out is not None and (
            isinstance(fan_out, bool) or not 0 <= fan_out <= MAX_PREDRAFT_FAN_OUT
        ):
            raise InvalidArgumentError(
                f"predraft_fan_out must be in 0..{MAX_PREDRAFT_FAN_OUT}, got {fan_out}"
            )
        if len(self.stop) > MAX_STOP_SEQUENCES:
            raise InvalidArgumentError(
                f"at most {MAX_STOP_SEQUENCES} stop sequences, got {len(self.stop)}"
            )
        if any(s == "" for s in self.stop):
            raise InvalidArgumentError("stop sequences must not be empty strings")
        if isinstance(self.min_tokens, bool) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgumentError(
                f"min_tokens must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}"
            )
        if any(isinstance(t, bool) or t < 0 for t in self.stop_token_ids):
            raise InvalidArgumentError(
                f"stop_token_ids must be token ids >= 0, got {list(self.stop_token_ids)}"
            )
        if self.deadline is not None and math.isnan(self.deadline):
            raise InvalidArgumentError("deadline must be a time.monotonic() instant, got NaN")

    def constraint(self, eos_token_ids: frozenset[int]) -> Constraint | None:
        """What the request's sessions must follow: its grammar, and the model's end tokens
        and its `stop_token_ids` forbidden until `min_tokens`; None when nothing is."""
        constraint = Constraint(
            grammar=self.grammar,
            min_tokens=self.min_tokens,
            end_token_ids=eos_token_ids | frozenset(self.stop_token_ids),
            prompt_length=len(self.prompt_tokens),
        )
        return constraint if constraint.active else None


@dataclass
class SpeculationStats:
    """Counters of one request's speculation."""

    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_passes: int = 0
    pipeline_hits: int = 0
    pipeline_misses: int = 0
    predraft_hits: int = 0
    """Pre-drafted rounds whose verdict was one of the outcomes drafted for: the next block
    was ready at once (no bonus deferred, unlike a pipeline hit)."""
    predraft_misses: int = 0
    suffix_drafted: int = 0
    """Of `num_drafted`: tokens the suffix drafter proposed (`cluster.routing.suffix_drafting`)."""
    suffix_accepted: int = 0
    """Of `num_accepted`: those of them accepted."""
    model_drafted: int = 0
    """Of `num_drafted`: tokens the draft model proposed (the rest: suffix and lookup)."""
    model_accepted: int = 0
    """Of `num_accepted`: those of them accepted."""
    draft_mode: str = ""
    """How the request drafted last (`cluster.routing.draft_modes`); empty: no speculation
    asked for."""
    draft_mode_reason: str = ""
    drafted_by_position: list[int] = field(default_factory=list)
    """Per draft position i: verify passes whose block had a token at position i."""
    accepted_by_position: list[int] = field(default_factory=list)
    """Per draft position i: verify passes that accepted the block's first i + 1 tokens."""
    drafters: list[str] = field(default_factory=list, compare=False)
    """The drafter replicas pinned to the request, in order (a failover adds one); empty
    when none drafted for it. Not a counter and not on the public wire (nor compared): the
    audit reports it."""

    def record_block(self, num_drafted: int, num_accepted: int) -> None:
        """Count one verify pass of a block of `num_drafted` tokens, `num_accepted` accepted."""
        for counts, n in ((self.drafted_by_position, num_drafted),
                          (self.accepted_by_position, num_accepted)):  # fmt: skip
            counts.extend([0] * (n - len(counts)))
            for i in range(n):
                counts[i] += 1

    @property
    def acceptance_rate(self) -> float:
        """Accepted over drafted draft tokens; NaN when nothing was drafted."""
        return self.num_accepted / self.num_drafted if self.num_drafted else math.nan


@dataclass(frozen=True)
class GenerationChunk:
    """Tokens newly committed, and their text; the last chunk carries the finish reason."""

    tokens: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None


@dataclass(frozen=True)
class GenerationResult:
    """A whole generation."""

    tokens: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    num_prompt_tokens: int
    stats: SpeculationStats
