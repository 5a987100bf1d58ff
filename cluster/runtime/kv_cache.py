"""Per-session KV bookkeeping over a replica engine's runner: prefix reuse and rollback.

`SequenceKV` remembers which token ids a session's KV (in the runner's paged pool) holds. Asking
it for the work behind "the logits after these tokens" reuses the longest cached prefix, drops
what disagrees (rollback) and leaves the rest for the engine to run, so drafter and verifier
express what they need ("the next-token logits after these tokens", "the logits of this block")
and never track cache offsets by hand. It knows nothing of sampling, sessions or the network.
"""

from __future__ import annotations

from collections.abc import Sequence

from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.runner import ModelRunner, SequenceWork


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences.

    Called on every forward with the whole context, so it compares list slices (a C loop)
    instead of stepping through tokens in Python: one comparison in the usual case, where one
    sequence extends the other, and a binary search over prefix lengths otherwise.
    """
    a, b = list(a), list(b)  # a list never equals a tuple: compare like with like
    n = min(len(a), len(b))
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
    """One session's token sequence in a replica engine's runner: which tokens its KV holds.

    Engine thread only. `work` turns "the logits after these tokens" into the runner's unit of
    work: it keeps the longest cached prefix, rolls back what disagrees (whole KV blocks go back
    to the pool) and returns the rest as a `SequenceWork`; once the engine has run it, `holds`
    records the new contents (`resync` after a failed step: the runner's length is the truth).
    """

    def __init__(self, runner: ModelRunner, seq_id: str) -> None:
        self._runner = runner
        self.seq_id = seq_id
        self._tokens: list[int] = []

    @property
    def num_cached_tokens(self) -> int:
        return len(self._tokens)

    @property
    def cached_tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def rollback(self, length: int) -> None:
        """Forget every cached position from `length` on (no copy: whole blocks are freed)."""
        if length < 0:
            raise InvalidArgumentError(f"rollback length must be >= 0, got {length}")
        if length < len(self._tokens):
            self._runner.truncate(self.seq_id, length)
            del self._tokens[length:]

    def work(self, tokens: Sequence[int], num_logits: int) -> SequenceWork | None:
        """What the runner must append for its KV to hold `tokens`, with logits at the last
        `num_logits` positions (row i predicts the token after
        `tokens[len(tokens) - num_logits + i]`); None when nothing is to run (`num_logits` 0
        and every token cached)."""
        if not 0 <= num_logits <= len(tokens):
            raise InvalidArgumentError(
                f"num_logits must be in 0..{len(tokens)} for {len(tokens)} tokens, got {num_logits}"
            )
        keep = min(common_prefix_length(self._tokens, tokens), len(tokens) - num_logits)
        self.rollback(keep)
        new_tokens = tuple(tokens[keep:])
        if not new_tokens:
            return None
        first_logit = len(new_tokens) - num_logits
        return SequenceWork(self.seq_id, new_tokens, tuple(range(first_logit, len(new_tokens))))

    def holds(self, tokens: Sequence[int]) -> None:
        """Record that the runner now holds exactly `tokens` (after running `work(tokens)`)."""
        self._tokens = list(tokens)

    def resync(self) -> None:
        """After a failed step: keep only what the runner really holds."""
        del self._tokens[self._runner.length(self.seq_id) :]

    def release(self) -> None:
        """Give every block back to the pool."""
        self._runner.release(self.seq_id)
        self._tokens = []
