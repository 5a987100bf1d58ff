"""Prompt lookup: exact proposals on hand-made histories; the incremental index proposes the
same as a brute-force search, reading only the history's new end."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest

from cluster.routing.prompt_lookup import PromptLookup, propose
from cluster.runtime.errors import InvalidArgumentError
from drafter.config import NgramConfig

CONFIG = NgramConfig(max_ngram=3, min_ngram=2)


def test_copies_what_followed_the_suffix() -> None:
    #          [1, 2, 3] recurs at the end; 4, 5, 6 followed it.
    history = [1, 2, 3, 4, 5, 6, 9, 1, 2, 3]
    assert propose(history, 2, CONFIG) == (4, 5)
    assert propose(history, 10, CONFIG) == (4, 5, 6, 9, 1, 2, 3)


def test_prefers_the_longest_suffix_then_the_latest_occurrence() -> None:
    # [2, 3] occurs twice earlier; only the second also matches the 3-gram [7, 2, 3].
    history = [7, 2, 3, 8, 0, 2, 3, 5, 7, 2, 3]
    assert propose(history, 1, CONFIG) == (8,)
    # Without a 3-gram match, the latest 2-gram occurrence wins.
    history = [2, 3, 8, 0, 2, 3, 5, 6, 2, 3]
    assert propose(history, 1, CONFIG) == (5,)


def test_nothing_when_no_suffix_recurs() -> None:
    assert propose([1, 2, 3, 4, 5], 4, CONFIG) == ()
    assert propose([5, 5], 4, CONFIG) == ()  # the suffix itself is not an earlier occurrence
    assert propose([], 4, CONFIG) == ()
    assert propose([1, 2, 1, 2], 0, CONFIG) == ()


def test_single_token_matches_only_when_allowed() -> None:
    history = [4, 9, 1, 4]
    assert propose(history, 2, CONFIG) == ()
    assert propose(history, 2, NgramConfig(max_ngram=3, min_ngram=1)) == (9, 1)


def test_overlapping_repeats() -> None:
    # A run of one token: the latest earlier [5, 5] is followed by the final 5.
    assert propose([5, 5, 5], 3, CONFIG) == (5,)


@pytest.mark.parametrize(("low", "high"), [(0, 3), (3, 2)])
def test_config_is_checked(low: int, high: int) -> None:
    with pytest.raises(InvalidArgumentError, match="min_ngram"):
        NgramConfig(max_ngram=high, min_ngram=low)


def reference(tokens: Sequence[int], num_tokens: int, config: NgramConfig) -> tuple[int, ...]:
    """The contract, by brute force: the longest recurring suffix, its latest occurrence."""
    length = len(tokens)
    for n in range(min(config.max_ngram, length - 1), config.min_ngram - 1, -1):
        for i in range(length - 1 - n, -1, -1):
            if tokens[i : i + n] == tokens[length - n :]:
                return tuple(tokens[i + n : i + n + num_tokens])
    return ()


@pytest.mark.parametrize("seed", range(4))
def test_lookup_proposes_as_propose_does_as_the_history_grows(seed: int) -> None:
    """Random histories over few token ids (many recurrences), grown a few tokens at a time,
    each proposal with a block `ahead` (searched, not indexed) of up to 5 tokens."""
    rng = random.Random(seed)
    for _ in range(50):
        high = rng.randint(1, 5)
        config = NgramConfig(enabled=True, max_ngram=high, min_ngram=rng.randint(1, high))
        tokens = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randrange(80))]
        lookup = PromptLookup(config)
        committed = 0
        while committed <= len(tokens):
            ahead = tokens[committed : committed + rng.randrange(6)]
            num_tokens = rng.randrange(8)
            expected = reference(tokens[:committed] + ahead, num_tokens, config)
            assert lookup.propose(tokens[:committed], num_tokens, ahead) == expected
            assert propose(tokens[:committed] + ahead, num_tokens, config) == expected
            committed += rng.randint(1, 4)


def test_a_match_in_the_block_ahead_is_the_latest() -> None:
    lookup = PromptLookup(CONFIG)
    # [1, 2] occurs in the history (then 3) and in the block ahead (then 7): the later wins.
    assert lookup.propose([1, 2, 3, 1, 2], 2, ahead=[7, 1, 2]) == (7, 1)
    assert lookup.propose([1, 2, 3, 1, 2], 2) == (3, 1)  # the block ahead was not indexed
    # What follows a match may run from the history on into the block ahead.
    assert lookup.propose([1, 2, 3, 1, 2, 9], 4, ahead=[1, 2]) == (9, 1, 2)


class CountsReads(list[int]):
    """A history that counts the tokens read from it."""

    num_read = 0

    def __getitem__(self, index: Any) -> Any:
        items = super().__getitem__(index)
        self.num_read += len(items) if isinstance(index, slice) else 1
        return items


def test_a_proposal_reads_a_bounded_part_of_the_history() -> None:
    """After the first call, a proposal reads the tokens added since the last one (and the
    `max_ngram` before them), once per n-gram length, and the tokens it proposes: O(new
    tokens), however long the history (a scan of the history would read all 5000)."""
    rng = random.Random(0)
    history = CountsReads(rng.randrange(3) for _ in range(5000))
    lookup = PromptLookup(CONFIG)
    lookup.propose(history, 4)
    ngram_lengths = CONFIG.max_ngram - CONFIG.min_ngram + 1
    for _ in range(50):
        added = [rng.randrange(3) for _ in range(rng.randint(1, 5))]
        history.extend(added)
        history.num_read = 0
        assert lookup.propose(history, 4, ahead=[1, 2]) == reference([*history, 1, 2], 4, CONFIG)
        bound = len(added) * CONFIG.max_ngram * ngram_lengths + CONFIG.max_ngram + 4
        assert history.num_read <= bound


def test_a_shrunk_history_is_refused() -> None:
    lookup = PromptLookup(CONFIG)
    lookup.propose([1, 2, 3, 1, 2], 1)
    with pytest.raises(ValueError, match="shrank"):
        lookup.propose([1, 2, 3], 1)
