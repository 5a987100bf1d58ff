"""The suffix index: exact proposals on hand-made corpora, the fast index against a plain loop
over the whole corpus, incremental building, and eviction under the memory cap (accounted and
real)."""

from __future__ import annotations

import gc
import itertools
import random
import tracemalloc
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.runtime.errors import InvalidArgumentError
from drafter.config import SuffixConfig
from drafter.suffix_index import NO_PROPOSAL, Proposal, SuffixIndex

CONFIG = SuffixConfig(
    min_match=2, max_match=8, max_tokens=8, min_confidence=0.0, tokens_per_match=0.0
)


def index_of(*docs: Sequence[int], config: SuffixConfig = CONFIG) -> SuffixIndex:
    index = SuffixIndex(config)
    for number, tokens in enumerate(docs):
        index.extend(f"doc{number}", tokens)
    return index


def test_proposes_what_followed_a_repeated_span() -> None:
    index = index_of([1, 2, 3, 4, 5, 6])
    assert index.propose([9, 2, 3], 8) == Proposal(tokens=(4, 5, 6), confidence=1.0, match_length=2)
    assert index.propose([1, 2, 3], 8).match_length == 3


def test_the_block_ends_where_the_occurrences_diverge_below_the_confidence() -> None:
    # [1, 2] is followed by 3, 4 twice; then 5 once and 6 once.
    index = index_of([1, 2, 3, 4, 5], [1, 2, 3, 4, 6])
    proposal = index.propose([1, 2], 8)
    assert (proposal.tokens, proposal.confidence) == ((3, 4, 6), 0.5)  # 6: the newest's
    strict = index_of([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], config=_with(min_confidence=0.6))
    assert strict.propose([1, 2], 8) == Proposal(tokens=(3, 4), confidence=1.0, match_length=2)


def test_the_majority_continuation_wins_and_sets_the_confidence() -> None:
    index = index_of([7, 8, 1], [7, 8, 2], [7, 8, 1], [7, 8, 3], [7, 8, 1])
    proposal = index.propose([0, 7, 8], 4)
    assert proposal.tokens == (1,)
    assert proposal.confidence == pytest.approx(3 / 5)


def test_a_tie_goes_to_the_most_recent_occurrence() -> None:
    assert index_of([7, 8, 1], [7, 8, 2]).propose([7, 8], 1).tokens == (2,)
    assert index_of([7, 8, 2], [7, 8, 1]).propose([7, 8], 1).tokens == (1,)
    # Within one document too: the later occurrence is the more recent.
    assert index_of([7, 8, 1, 7, 8, 2]).propose([7, 8], 1).tokens == (2,)


@pytest.mark.parametrize("longest_first", [True, False])
def test_the_longest_match_is_drafted_from(longest_first: bool) -> None:
    # [2, 3] occurs three times; only one occurrence also matches [1, 2, 3] backwards, and
    # it is drafted from though the two others agree on another token.
    docs = [[1, 2, 3, 4], [5, 2, 3, 6], [9, 2, 3, 6]]
    index = index_of(*(docs[::-1] if longest_first else docs))
    assert index.propose([1, 2, 3], 4) == Proposal(tokens=(4,), confidence=1.0, match_length=3)
    proposal = index.propose([0, 2, 3], 4)
    assert (proposal.tokens, proposal.match_length) == ((6,), 2)


def test_the_confidence_is_the_running_product_of_the_shares() -> None:
    # After [1, 2]: 3 or 4 (a tie: the newest's, 4), then 5 or 6 (the newest's, 6).
    docs = [[1, 2, 3, 5], [1, 2, 3, 6], [1, 2, 4, 5], [1, 2, 4, 6]]
    assert index_of(*docs).propose([1, 2], 4) == Proposal(
        tokens=(4, 6), confidence=0.25, match_length=2
    )
    # Each share is 1/2, but the second token would take the product to 1/4.
    assert index_of(*docs, config=_with(min_confidence=0.3)).propose([1, 2], 4) == Proposal(
        tokens=(4,), confidence=0.5, match_length=2
    )


def test_max_tokens_is_respected() -> None:
    index = index_of(list(range(40)), config=_with(max_tokens=5))
    assert index.propose([0, 1], 3).tokens == (2, 3, 4)
    assert index.propose([0, 1], 100).tokens == (2, 3, 4, 5, 6)  # the config's bound
    assert index.propose([0, 1], 0) == NO_PROPOSAL


def test_a_short_match_drafts_a_short_block() -> None:
    """`tokens_per_match`: at most that many tokens per matched token, at least one."""
    text = list(range(40))
    index = index_of(text, config=_with(tokens_per_match=1.0))
    assert index.propose([99, 3, 4], 8) == Proposal((5, 6), 1.0, 2)  # matched 2: drafts 2
    assert index.propose([2, 3, 4], 8).tokens == (5, 6, 7)  # matched 3
    assert index.propose([0, 1, 2, 3, 4, 5], 8).tokens == tuple(range(6, 12))
    halved = index_of(text, config=_with(tokens_per_match=0.4))
    assert halved.propose([99, 3, 4], 8).tokens == (5,)  # at least one
    assert index_of(text).propose([99, 3, 4], 8).tokens == tuple(range(5, 13))  # 0: no cap
    with pytest.raises(InvalidArgumentError, match="tokens_per_match"):
        _with(tokens_per_match=-1.0)


def test_nothing_when_nothing_recurs() -> None:
    index = index_of([1, 2, 3, 4])
    assert index.propose([], 4) == NO_PROPOSAL
    assert index.propose([2], 4) == NO_PROPOSAL  # shorter than min_match
    assert index.propose([4, 3], 4) == NO_PROPOSAL
    assert index.propose([1, -2], 4) == NO_PROPOSAL
    assert SuffixIndex(CONFIG).propose([1, 2], 4) == NO_PROPOSAL


def test_the_contexts_own_tail_is_not_a_match() -> None:
    # The request's document is the context itself: its last n-gram has no next token.
    index = index_of([5, 1, 2, 3])
    assert index.propose([5, 1, 2, 3], 4) == NO_PROPOSAL
    # An earlier occurrence in the same document is one; it may run into the tail.
    index.extend("doc0", [1, 2])
    assert index.propose([5, 1, 2, 3, 1, 2], 4).tokens == (3, 1, 2)


def test_only_max_candidates_newest_occurrences_are_weighed() -> None:
    config = _with(max_candidates=3)
    # Ten old occurrences go on with 1, the three newest with 2: only the newest count.
    index = index_of(*[[7, 8, 1]] * 10, *[[7, 8, 2]] * 3, config=config)
    assert index.propose([7, 8], 1) == Proposal(tokens=(2,), confidence=1.0, match_length=2)
    assert index_of(*[[7, 8, 1]] * 10, *[[7, 8, 2]] * 3).propose([7, 8], 1).tokens == (1,)


def test_drop_removes_a_document_and_its_entries() -> None:
    index = index_of([1, 2, 3])
    before = index.nbytes
    index.extend("other", [1, 2, 4, 1, 2, 5])
    assert index.propose([1, 2], 1).tokens == (5,)
    index.drop("other")
    index.drop("unknown")
    assert "other" not in index
    assert (index.documents, index.tokens, index.nbytes) == (1, 3, before)
    assert index.propose([1, 2], 1).tokens == (3,)
    index.drop("doc0")
    assert (index.documents, index.tokens, index.nbytes) == (0, 0, 0)
    assert index.propose([1, 2], 1) == NO_PROPOSAL


def test_bad_token_ids_are_refused() -> None:
    index = SuffixIndex(CONFIG)
    for tokens in ([1, -1], [2**31], [1.5]):
        with pytest.raises(InvalidArgumentError, match="token ids"):
            index.extend("doc", tokens)  # type: ignore[arg-type]


def reference(
    extends: Sequence[tuple[str, Sequence[int]]],
    context: Sequence[int],
    max_tokens: int,
    config: SuffixConfig,
) -> Proposal:
    """The contract as plain loops over the whole corpus: occurrences in the order they were
    indexed, the newest `max_candidates` weighed, the longest-matching kept, the walk forward."""
    docs: dict[str, list[int]] = {}
    order: list[tuple[str, int]] = []  # (document, offset of the next token), oldest first
    for name, tokens in extends:
        held = docs.setdefault(name, [])
        for token in tokens:
            if len(held) >= config.min_match:
                order.append((name, len(held)))
            held.append(token)
    m, budget = config.min_match, min(max_tokens, config.max_tokens)
    if budget < 1 or len(context) < m:
        return NO_PROPOSAL
    bounded = config.tokens_per_match > 0
    found = [(n, e) for n, e in reversed(order) if docs[n][e - m : e] == list(context[-m:])]
    lengths = []
    for name, end in found[: config.max_candidates]:
        length = m
        while (
            length < min(config.max_match, len(context), end)
            and docs[name][end - length - 1] == context[-length - 1]
        ):
            length += 1
        lengths.append(length)
    best = max(lengths, default=0)
    survivors = [(n, e) for (n, e), x in zip(found, lengths, strict=False) if x == best]
    if bounded:
        budget = min(budget, max(1, int(config.tokens_per_match * best)))
    drafted: list[int] = []
    confidence = 1.0
    while len(drafted) < budget:
        nexts = [docs[n][e] for n, e in survivors if e < len(docs[n])]
        if not nexts:
            break
        token = max(nexts, key=lambda t: (nexts.count(t), -nexts.index(t)))
        share = nexts.count(token) / len(nexts)
        if confidence * share < config.min_confidence:
            break
        confidence *= share
        drafted.append(token)
        survivors = [(n, e + 1) for n, e in survivors if e < len(docs[n]) and docs[n][e] == token]
    return Proposal(tuple(drafted), confidence, best)


configs = st.builds(
    lambda m, extra, candidates, confidence, tokens, per_match: _with(
        min_match=m,
        max_match=m + extra,
        max_candidates=candidates,
        min_confidence=confidence,
        max_tokens=tokens,
        tokens_per_match=per_match,
    ),
    st.integers(1, 3),
    st.integers(0, 3),
    st.integers(1, 6),
    st.sampled_from([0.0, 0.3, 0.6]),
    st.integers(1, 6),
    st.sampled_from([0.0, 0.5, 1.0, 2.0]),
)
token_lists = st.lists(st.integers(0, 3), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    config=configs,
    extends=st.lists(st.tuples(st.sampled_from("abc"), token_lists), max_size=8),
    contexts=st.lists(token_lists, min_size=1, max_size=4),
)
def test_proposes_as_the_plain_loop_does(
    config: SuffixConfig, extends: list[tuple[str, list[int]]], contexts: list[list[int]]
) -> None:
    index = SuffixIndex(config)
    for name, tokens in extends:
        index.extend(name, tokens)
    texts: dict[str, list[int]] = {}
    for name, tokens in extends:
        texts.setdefault(name, []).extend(tokens)
    for context in [*contexts, *texts.values()]:
        assert index.propose(context, 8) == reference(extends, context, 8, config)


@settings(max_examples=100, deadline=None)
@given(
    config=configs,
    docs=st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=4),
    cuts=st.lists(st.integers(0, 30), max_size=6),
    contexts=st.lists(token_lists, min_size=1, max_size=4),
)
def test_incremental_extends_equal_one_extend(
    config: SuffixConfig, docs: list[list[int]], cuts: list[int], contexts: list[list[int]]
) -> None:
    whole, pieces = SuffixIndex(config), SuffixIndex(config)
    for number, tokens in enumerate(docs):
        whole.extend(str(number), tokens)
        bounds = [0, *sorted(cut for cut in cuts if cut < len(tokens)), len(tokens)]
        for start, stop in itertools.pairwise(bounds):
            pieces.extend(str(number), tokens[start:stop])
    assert (pieces.nbytes, pieces.tokens, pieces.documents) == (
        whole.nbytes,
        whole.tokens,
        whole.documents,
    )
    for context in [*contexts, *docs]:
        assert pieces.propose(context, 8) == whole.propose(context, 8)


def test_a_stream_under_a_small_cap_stays_under_it_oldest_evicted_first() -> None:
    """24 documents of 2000 random tokens (few n-grams recur) under a cap that holds about
    three of them; checked after every 16-token extend."""
    cap = 1_000_000
    rng = random.Random(0)
    gc.collect()
    tracemalloc.start()
    try:
        baseline = tracemalloc.get_traced_memory()[0]
        index = SuffixIndex(_with(tenant_bytes=cap))
        names = [f"request-{number}" for number in range(24)]
        for name in names:
            for _ in range(2000 // 16):
                index.extend(name, [rng.randrange(1000) for _ in range(16)])
                assert index.nbytes <= cap
        gc.collect()
        real = tracemalloc.get_traced_memory()[0] - baseline
    finally:
        tracemalloc.stop()
    held = [name in index for name in names]
    assert held == sorted(held) and 2 <= sum(held) <= 4  # a run of the newest
    assert index.nbytes > cap // 2
    # The accounting is calibrated on this layout; dict slack after deletions (dicts shrink only
    # when they next grow) and allocator rounding stay well inside a factor of two.
    assert cap // 4 < real < 2 * index.nbytes


def test_a_document_alone_over_the_cap_stops_growing_and_the_index_stays_usable() -> None:
    cap = 20_000
    index = SuffixIndex(_with(tenant_bytes=cap))
    index.extend("old", [1, 2, 3])
    index.extend("huge", list(range(10, 2010)))
    assert "old" not in index and "huge" in index
    assert index.nbytes <= cap
    held = index.tokens
    assert 0 < held < 2000
    index.extend("huge", [10, 11, 12])  # its later tokens would not follow the ones held
    assert (index.tokens, index.nbytes <= cap) == (held, True)
    assert index.propose([10, 11], 3).tokens == (12, 13, 14)
    index.extend("next", [7, 8, 9])
    assert "next" in index and index.nbytes <= cap
    assert index.propose([7, 8], 3).tokens == (9,)


def _with(**changes: object) -> SuffixConfig:
    fields = {
        "min_match": CONFIG.min_match,
        "max_match": CONFIG.max_match,
        "max_tokens": CONFIG.max_tokens,
        "min_confidence": CONFIG.min_confidence,
        "tokens_per_match": CONFIG.tokens_per_match,
    }
    return SuffixConfig(**{**fields, **changes})  # type: ignore[arg-type]
