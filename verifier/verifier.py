"""The verifier component: the target model checks a draft block in one forward pass.

A plain class (no Ray, no gRPC): sessions by id, each with the committed tokens, a KV cache on
the target model, the request's sampling settings and a seeded generator. `verify` runs the
target once over the last committed token plus the block, turns the `k + 1` rows of logits into
the distribution actually sampled from (temperature, top-k, top-p), applies `rejection_sample`,
commits the emitted tokens and rolls the cache back past the rejected positions. A block with no
tokens is plain target decoding through the same path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from verifier.rejection import rejection_sample
from verifier.runtime.block import DraftBlock, Verdict
from verifier.runtime.component import SessionComponent
from verifier.runtime.errors import InvalidArgumentError
from verifier.runtime.models import LoadedModel
from verifier.runtime.sampling import logits_to_probs, to_dense
from verifier.runtime.session import (
    MAX_BLOCK_TOKENS,
    ReplicaSession,
    SessionLimits,
    check_token_ids,
    synchronized,
)


@dataclass(frozen=True)
class VerifierConfig(SessionLimits):
    """Limits of one verifier replica."""

    max_block_tokens: int = MAX_BLOCK_TOKENS
    """Longest draft block accepted."""

    _counts: ClassVar[tuple[str, ...]] = (*SessionLimits._counts, "max_block_tokens")


class Verifier(SessionComponent[VerifierConfig]):
    """Verifies draft blocks against the target model, one session per request."""

    def __init__(self, target: LoadedModel, config: VerifierConfig | None = None) -> None:
        super().__init__(target, config or VerifierConfig())
        self._target = target

    @synchronized
    def verify(self, session_id: str, block: DraftBlock, defer_bonus: bool = False) -> Verdict:
        """Check `block` against the target, commit what is emitted, return the verdict.

        With `defer_bonus`, a block whose every token is accepted emits no bonus token: the
        target's distribution at the next position is kept, and the next block's first token
        is verified against it. This is the same acceptance rule applied across two passes,
        so it stays lossless; it lets a block drafted ahead (pipelining) be used as it is.
        """
        session = self._sessions.get_at(session_id, block.base_length)
        num_draft = len(block.tokens)
        if num_draft > self.config.max_block_tokens:
            raise InvalidArgumentError(
                f"block of {num_draft} tokens exceeds the limit of {self.config.max_block_tokens}"
            )
        check_token_ids(block.tokens, self.vocab_size, "block.tokens")
        self._sessions.check_context(len(session.tokens) + num_draft + 1)
        draft_probs = None
        if block.draft_probs is not None:
            draft_probs = to_dense(block.draft_probs, self.vocab_size).to(self._target.device)

        target_probs = self._target_probs(session, block.tokens)  # [k + 1, vocab]
        draft_tokens = torch.tensor(block.tokens, dtype=torch.long, device=self._target.device)
        emitted, num_accepted = rejection_sample(
            target_probs, draft_tokens, draft_probs, session.generator
        )
        deferred = defer_bonus and num_draft > 0 and num_accepted == num_draft
        if deferred:
            # Every position is now in the cache; the bonus row waits for the next block.
            session.next_probs = target_probs[num_draft]
            emitted = emitted[:num_draft]
        else:
            session.next_probs = None
            # Keep the accepted drafts; the newly emitted last token is fed next time.
            session.kv.rollback(block.base_length + num_accepted)
        tokens = tuple(int(t) for t in emitted.tolist())
        session.tokens.extend(tokens)
        return Verdict(
            base_length=block.base_length,
            num_accepted=num_accepted,
            tokens=tokens,
            committed_length=len(session.tokens),
            bonus_deferred=deferred,
        )

    def _target_probs(self, session: ReplicaSession, block: Sequence[int]) -> torch.Tensor:
        """The target's p at each block position plus the bonus position: `[k + 1, vocab]`."""
        context = session.tokens + list(block)
        kept = session.next_probs
        if kept is None:
            # The last committed token is not in the cache yet: feeding it gives the first row.
            return logits_to_probs(session.kv.logits(context, len(block) + 1), session.sampling)
        if not block:
            return kept[None]
        rows = logits_to_probs(session.kv.logits(context, len(block)), session.sampling)
        return torch.cat([kept[None], rows])
