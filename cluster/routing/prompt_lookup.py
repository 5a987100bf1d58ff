"""Prompt lookup: draft tokens by copying what followed an earlier occurrence of the context's
last few tokens. Needs no model, so it costs next to nothing and runs wherever the token
history is (the router holds it).

Pure: token ids in, token ids out. `propose` looks for the longest suffix of `tokens` (from
`max_ngram` down to `min_ngram` tokens) that also occurs earlier in `tokens`, takes its most
recent earlier occurrence, and proposes up to `num_tokens` of the tokens that followed it. A
proposal is deterministic, so its q is one-hot: the verifier's acceptance rule stays exact
for sampled requests too (docs/architecture.md, invariant 1). Code and answers that quote their
prompt repeat long runs of tokens, which is where this pays.

`PromptLookup` proposes the same, incrementally, over a history that only grows (the router's
committed tokens): it indexes each n-gram's latest occurrence once, as the history reaches it,
so a proposal costs O(tokens added since the last one + `ahead`), not O(history). The index
holds one entry per token and n-gram length (a few hundred bytes per token of history).
"""

from __future__ import annotations

from collections.abc import Sequence

from drafter.config import NgramConfig


def propose(tokens: Sequence[int], num_tokens: int, config: NgramConfig) -> tuple[int, ...]:
    """Up to `num_tokens` tokens continuing `tokens`, or () when no suffix recurs."""
    return PromptLookup(config).propose(tokens, num_tokens)


class PromptLookup:
    """`propose` over one growing history, at a cost that does not grow with it."""

    def __init__(self, config: NgramConfig) -> None:
        self._config = config
        self._latest: dict[int, dict[tuple[int, ...], int]] = {
            n: {} for n in range(config.min_ngram, config.max_ngram + 1)
        }
        """Per n-gram length, each n-gram's latest start among those indexed."""
        self._indexed = 0
        """The n-grams ending before this position are indexed: those followed by a token of
        the history seen last (an n-gram ending at its last token is the suffix itself)."""

    def propose(
        self, history: Sequence[int], num_tokens: int, ahead: Sequence[int] = ()
    ) -> tuple[int, ...]:
        """`propose(history + ahead, num_tokens, config)`. `history` must be the history of the
        previous call with tokens appended (it is indexed only from where that one ended);
        `ahead` (a block not yet committed) is searched without being indexed."""
        if len(history) < self._indexed:
            raise ValueError(f"the history shrank: {len(history)} < {self._indexed} tokens")
        self._index(history)
        if num_tokens < 1:
            return ()
        length = len(history) + len(ahead)
        # The only tokens the n-grams not in the index can touch: from `max_ngram` before the
        # end of `history` on. `tail[j]` is token `offset + j` of `history + ahead`.
        offset = max(len(history) - self._config.max_ngram, 0)
        tail = [*history[offset:], *ahead]
        for n in range(min(self._config.max_ngram, length - 1), self._config.min_ngram - 1, -1):
            suffix = tail[len(tail) - n :]
            # Occurrences followed by a token of `ahead` (the latest), then by one of `history`.
            start = next(
                (
                    i + n
                    for i in range(length - 1 - n, max(len(history) - n, 0) - 1, -1)
                    if tail[i - offset : i - offset + n] == suffix
                ),
                None,
            )
            if start is None and (i := self._latest[n].get(tuple(suffix))) is not None:
                start = i + n
            if start is not None:
                return _slice(history, ahead, start, start + num_tokens)
        return ()

    def _index(self, history: Sequence[int]) -> None:
        """Index the n-grams of `history` now followed by a token; they overwrite any earlier
        occurrence, so each entry stays the latest."""
        for end in range(self._indexed, len(history)):
            for n, latest in self._latest.items():
                if end >= n:
                    latest[tuple(history[end - n : end])] = end - n
        self._indexed = max(self._indexed, len(history))


def _slice(history: Sequence[int], ahead: Sequence[int], start: int, stop: int) -> tuple[int, ...]:
    """`(history + ahead)[start:stop]`, copying only the slice."""
    split = len(history)
    from_history = history[min(start, split) : min(stop, split)]
    return (*from_history, *ahead[max(start - split, 0) : max(stop - split, 0)])
