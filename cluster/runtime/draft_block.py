"""The two values that travel between drafter, router and verifier: a draft block and a verdict.

Both carry the committed length they were based on (docs/architecture.md, invariant 3), so a
replica can refuse work meant for a different state of the session. Plain frozen dataclasses; the
gRPC transport converts them to and from `protos/replica.proto`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cluster.runtime.sparse_distribution import SparseDistribution


@dataclass(frozen=True)
class StepLoad:
    """How loaded the replica's engine was when it served a call: the batch of the step that
    ran it, and the replica's measured step cost curve (seconds = base + per_token x tokens).
    The router prices draft length with it (a longer block costs every session in the batch)."""

    batch_sequences: int
    """Sessions in the forward pass that served this call (its last one, for a draft)."""
    batch_tokens: int
    """Tokens in that forward pass."""
    cost_base_s: float
    """Fitted seconds of a step, independent of its tokens (reading the weights)."""
    cost_per_token_s: float
    """Fitted extra seconds per token in a step."""

    def step_s(self, tokens: int) -> float:
        """Predicted seconds of a step of `tokens` tokens."""
        return self.cost_base_s + self.cost_per_token_s * tokens


@dataclass(frozen=True)
class DraftBlock:
    """Tokens proposed to continue a session whose committed length is `base_length`."""

    base_length: int
    tokens: tuple[int, ...]
    draft_probs: Sequence[SparseDistribution] | None = None
    """The exact q each token was sampled from, one per token; None when drafted
    deterministically (q is one-hot at the drafted token). A tuple, or on the router a lazy
    sequence over the rows as they came off the wire (`cluster.wire.distributions.WireRows`), which
    the router passes on to the verifier as bytes, never decoded."""
    load: StepLoad | None = None
    """The drafter's load when it drafted this block (None: not reported)."""
    assumed: tuple[int, ...] = ()
    """Tokens between `base_length` and the block's first token that the block takes as
    committed: a block drafted ahead of blocks not yet verified. The verifier verifies it only
    if its session then holds them (and any of the block's own tokens it has committed since)
    exactly; otherwise it drops the block (`Verdict.dropped`)."""

    def __post_init__(self) -> None:
        if self.draft_probs is not None and len(self.draft_probs) != len(self.tokens):
            raise ValueError(
                f"draft block has {len(self.tokens)} tokens but {len(self.draft_probs)} "
                "draft distributions"
            )


@dataclass(frozen=True)
class Verdict:
    """What the verifier decided about a block, and the session's length after committing it."""

    base_length: int
    num_accepted: int
    tokens: tuple[int, ...]
    """The accepted draft tokens, then one recovered or bonus token: `num_accepted + 1` tokens;
    only `num_accepted` when the bonus was deferred."""
    committed_length: int
    bonus_deferred: bool = False
    """Every draft token was accepted and, as asked, no bonus token was sampled: the target's
    distribution for the next position is kept and the next block's first token is verified
    against it (pipelining: a block drafted ahead stays valid)."""
    load: StepLoad | None = None
    """The verifier's load when it verified this block (None: not reported)."""
    num_matched: int = 0
    """The block's first tokens that its session had already committed, the same, by the time
    it was verified (the session advanced on its own meanwhile): they count as accepted, and
    `num_accepted` counts the verified ones after them."""
    dropped: bool = False
    """The block was not verified: its session had committed other tokens than it assumed,
    or all of its own. Nothing was committed; `num_matched` says how many of its tokens
    agreed before it parted from the session."""
