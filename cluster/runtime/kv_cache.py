"""A session's token sequence over a replica engine's runner: prefix reuse and rollback.

`SequenceKV` is the one record of a session's tokens on a replica: committed tokens, then a
tentative tail (a draft being built, a block being verified); the runner's paged KV holds a
prefix of it, whose length only the runner counts. Changing the sequence rolls back the KV
positions whose token changed, and asking for "the logits at the last positions" leaves the rest
for the engine to run, so drafter and verifier say what they need and never track cache offsets
by hand. Every round costs O(new tokens). It knows nothing of sampling, sessions or the network.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.runtime.block_runner import ModelRunner, SequenceWork
from cluster.runtime.errors import InvalidArgumentError

SHORT_PREFIX = 16
"""Sequences up to this long are compared token by token (`common_prefix_length`)."""


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Called on every forward with the whole context, so it compares list slices (a C loop)
    instead of stepping through tokens in Python: one comparison in the usual case, where one
    sequence extends the other, and a binary search over prefix lengths otherwise.
    """
    n = min(len(a), len(b))
    if n <= SHORT_PREFIX:  # a block's worth: a plain loop beats making lists
        i = 0
        while i < n and a[i] == b[i]:
            i += 1
        return i
    a, b = list(a), list(b)  # a list never equals a tuple: compare like with like
    if a[:n] == b[:n]:
        return n
    low, high = 0, n  # a[:low] == b[:low] and a[:high] != b[:high]
    while high - low > 1:
        middle = (low + high) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle
    return low


class SequenceKV:
    """One session's token sequence on a replica: the one record of its tokens and lengths.

    The sequence is the committed tokens (prompt plus every committed token) followed by a
    tentative tail: the tokens drafted so far, or the block under verification. The runner's
    paged KV holds a prefix of it, and how long a prefix is the runner's own count
    (`num_cached_tokens`), never a second one kept here: a failed step leaves nothing to
    reconcile. Every change costs O(tokens changed), never O(context).

    Engine thread only. `commit_at` and `extend` change the sequence (a KV position whose token
    changed is rolled back, whole blocks going back to the pool); `work` turns "the logits at
    the last positions" into the runner's unit of work for what the KV still lacks.
    """

    def __init__(self, runner: ModelRunner, seq_id: str, tokens: Sequence[int] = ()) -> None:
        """A sequence whose tokens are all committed; the runner must hold nothing of it yet."""
        self._runner = runner
        self.seq_id = seq_id
        self._tokens: list[int] = list(tokens)
        self._committed = len(self._tokens)

    @property
    def committed_length(self) -> int:
        return self._committed

    @property
    def length(self) -> int:
        """Committed tokens plus the tentative tail."""
        return len(self._tokens)

    @property
    def num_cached_tokens(self) -> int:
        """Positions the runner's KV holds (a prefix of the sequence)."""
        return self._runner.length(self.seq_id)

    @property
    def committed_tokens(self) -> tuple[int, ...]:
        """A copy of the committed tokens: O(context), for checks and tests, not the hot path."""
        return tuple(self._tokens[: self._committed])

    def committed_from(self, start: int) -> list[int]:
        """The committed tokens from `start` on (a request's generated tokens): O(those)."""
        return self._tokens[start : self._committed]

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        """A copy of the tokens the KV holds: O(context), for checks and tests."""
        return tuple(self._tokens[: self.num_cached_tokens])

    def commit_at(self, start: int, tokens: Sequence[int]) -> None:
        """Make `self[:start] + tokens` the committed sequence; the tail after it goes.

        `start` may be below the committed length (the router undoes tokens it let this replica
        assume). Only the KV positions whose token changed are rolled back: a block's accepted
        drafts stay cached, the rejected ones go."""
        self._replace_tail(start, tokens)
        self._committed = len(self._tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Put tentative tokens after the sequence (a drafted token, a block to verify)."""
        self._tokens.extend(tokens)

    def drop_tentative(self) -> None:
        """Forget the tentative tail (its cached positions too)."""
        if len(self._tokens) > self._committed:
            self._replace_tail(self._committed, ())

    def _replace_tail(self, start: int, tokens: Sequence[int]) -> None:
        if not 0 <= start <= len(self._tokens):
            raise InvalidArgumentError(
                f"a sequence of {len(self._tokens)} tokens cannot be rewritten from {start}"
            )
        unchanged = common_prefix_length(self._tokens[start : start + len(tokens)], tokens)
        self.rollback(start + unchanged)
        del self._tokens[start:]
        self._tokens.extend(tokens)
        self._committed = min(self._committed, len(self._tokens))

    def rollback(self, length: int) -> None:
        """Forget every cached position from `length` on (no copy: whole blocks are freed); the
        sequence itself stays."""
        if length < 0:
            raise InvalidArgumentError(f"rollback length must be >= 0, got {length}")
        if length < self.num_cached_tokens:
            self._runner.truncate(self.seq_id, length)

    def work(self, num_logits: int, upto: int | None = None) -> SequenceWork | None:
        """What the runner must append for its KV to hold the sequence's first `upto` tokens
        (default: all), with logits at the last `num_logits` of them (row i predicts the token
        after position `upto - num_logits + i`); None when nothing is to run (`num_logits` 0
        and those tokens all cached). Once the step has run, the runner's length says so:
        nothing is recorded here."""
        end = len(self._tokens) if upto is None else upto
        if not 0 <= end <= len(self._tokens):
            raise InvalidArgumentError(f"upto must be in 0..{len(self._tokens)}, got {upto}")
        if not 0 <= num_logits <= end:
            raise InvalidArgumentError(
                f"num_logits must be in 0..{end} for {end} tokens, got {num_logits}"
            )
        self.rollback(end - num_logits)  # positions whose logits are wanted must run again
        cached = self.num_cached_tokens
        new_tokens = tuple(self._tokens[cached:end])
        if not new_tokens:
            return None
        first_logit = len(new_tokens) - num_logits
        return SequenceWork(self.seq_id, new_tokens, tuple(range(first_logit, len(new_tokens))))

    def release(self) -> None:
        """Give every block back to the pool."""
        self._runner.release(self.seq_id)
