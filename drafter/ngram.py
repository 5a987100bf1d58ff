"""Prompt lookup: draft tokens by copying what followed an earlier occurrence of the context's
last few tokens. Needs no model, so it costs next to nothing and runs wherever the token
history is (the router holds it).

Pure: token ids in, token ids out. `propose` looks for the longest suffix of `tokens` (from
`max_ngram` down to `min_ngram` tokens) that also occurs earlier in `tokens`, takes its most
recent earlier occurrence, and proposes up to `num_tokens` of the tokens that followed it. A
proposal is deterministic, so its q is one-hot: the verifier's acceptance rule stays exact
for sampled requests too (docs/architecture.md, invariant 1). Code and answers that quote their
prompt repeat long runs of tokens, which is where this pays.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from verifier.runtime.errors import InvalidArgumentError


@dataclass(frozen=True)
class NgramConfig:
    """Whether prompt lookup runs, and which suffix lengths it tries, longest first."""

    enabled: bool = False
    max_ngram: int = 4
    min_ngram: int = 2
    """One-token matches are mostly coincidence; two or more are rarely."""

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise InvalidArgumentError(
                f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}"
            )


def propose(tokens: Sequence[int], num_tokens: int, config: NgramConfig) -> tuple[int, ...]:
    """Up to `num_tokens` tokens continuing `tokens`, or () when no suffix recurs."""
    if num_tokens < 1:
        return ()
    history = torch.tensor(tokens, dtype=torch.long)  # [length]
    length = history.numel()
    for n in range(min(config.max_ngram, length - 1), config.min_ngram - 1, -1):
        # Windows that start early enough to have at least one token after them, all but the
        # suffix itself: [length - n, n].
        windows = history[:-1].unfold(0, n, 1)
        hits = (windows == history[-n:]).all(dim=1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tuple(tokens[start : start + num_tokens])
    return ()
