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

import torch

from verifier.rejection import rejection_sample
from verifier.runtime.block import DraftBlock, Verdict
from verifier.runtime.errors import InvalidArgumentError
from verifier.runtime.models import LoadedModel
from verifier.runtime.sampling import SamplingParams, logits_to_probs, to_dense
from verifier.runtime.session import (
    BusyLock,
    ReplicaSession,
    ReplicaStats,
    SessionTable,
    check_token_ids,
    synchronized,
)


@dataclass(frozen=True)
class VerifierConfig:
    """Limits of one verifier replica."""

    max_sessions: int = 256
    """Sessions held at once; one more is refused with RESOURCE_EXHAUSTED."""
    max_context_tokens: int = 4096
    """Committed tokens plus a block may not exceed this."""
    session_ttl_s: float = 600.0
    """A session unused this long is evicted (its client or router is gone); requests touch
    their sessions every round, so only abandoned ones idle this long."""
    max_block_tokens: int = 32
    """Longest draft block accepted."""

    def __post_init__(self) -> None:
        for name in ("max_sessions", "max_context_tokens", "max_block_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.session_ttl_s > 0:
            raise InvalidArgumentError(f"session_ttl_s must be > 0, got {self.session_ttl_s}")


class Verifier:
    """Verifies draft blocks against the target model, one session per request."""

    def __init__(self, target: LoadedModel, config: VerifierConfig | None = None) -> None:
        self._lock = BusyLock()
        self.config = config or VerifierConfig()
        self._target = target
        self._sessions = SessionTable(
            target,
            self.config.max_sessions,
            self.config.max_context_tokens,
            self.config.session_ttl_s,
        )

    @property
    def vocab_size(self) -> int:
        return self._target.vocab_size

    @synchronized
    def open_session(
        self,
        session_id: str,
        prompt_tokens: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        *,
        time_limit_s: float | None = None,
    ) -> int:
        """Open a session and prefill its cache; returns the committed length.

        `time_limit_s`: seconds the request has left; once they pass the session is dropped
        and a call on it raises `DeadlineExceededError` (None: only the idle TTL applies)."""
        session = self._sessions.open(session_id, prompt_tokens, sampling, seed, time_limit_s)
        return len(session.tokens)

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

    @synchronized
    def close_session(self, session_id: str) -> bool:
        """Free the session; True if it existed."""
        return self._sessions.remove(session_id)

    @synchronized
    def evict_idle(self) -> int:
        """Evict the sessions past their time limit or idle past the TTL (the replica host
        calls this every second); returns how many went."""
        return self._sessions.evict_idle()

    @synchronized
    def stats(self) -> ReplicaStats:
        return self._sessions.stats(busy_s=self._lock.busy_s)
