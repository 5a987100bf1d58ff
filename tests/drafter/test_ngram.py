"""Prompt lookup: exact proposals on hand-made histories."""

from __future__ import annotations

import pytest

from drafter.ngram import NgramConfig, propose
from verifier.runtime.errors import InvalidArgumentError

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
