"""`TokenMatcher` on the tiny byte tokenizer (token id == byte value, end of text 256).

Masks of a block (`block_masks`), the allowed count and the rows after a forbidden draft;
`sync` and `rollback` round trips (the matcher ends where it began); `allowed_prefix`; a complete
grammar allows only the end token; `min_tokens`; `mask_logits`; and what `Grammar` and
`Constraint` refuse when built; a server's `warm_up` of its tokenizer's view.
"""

from __future__ import annotations

import pytest
import torch
from llguidance import LLTokenizer

from cluster.runtime.constraint import (
    GRAMMAR_TOKENIZERS,
    Constraint,
    Grammar,
    TokenMatcher,
    grammar_tokenizer_of,
    mask_logits,
    masks_ahead,
    warm_up,
)
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.tiny import END_OF_TEXT_ID, VOCAB_SIZE, build_tokenizer

EOS = END_OF_TEXT_ID
REGEX = Grammar("regex", "ab[cd]x")
"""Four tokens: a, b, c or d, x; then only the end token."""


def ids(text: str) -> list[int]:
    return list(text.encode())


def allowed_set(row: torch.Tensor) -> set[int]:  # row: bool [vocab]
    return set(row.nonzero().flatten().tolist())


@pytest.fixture(scope="module")
def tokenizer() -> LLTokenizer:
    return GRAMMAR_TOKENIZERS.get(build_tokenizer(), VOCAB_SIZE, [EOS])


def matcher_of(
    tokenizer: LLTokenizer | None,
    grammar: Grammar | None = REGEX,
    min_tokens: int = 0,
    end_token_ids: frozenset[int] = frozenset({EOS}),
) -> TokenMatcher:
    constraint = Constraint(grammar, min_tokens, end_token_ids)
    return TokenMatcher(constraint, tokenizer, VOCAB_SIZE)


def current_mask(matcher: TokenMatcher) -> set[int]:
    rows, _ = matcher.block_masks(())
    return allowed_set(rows[0])


# --- block_masks -------------------------------------------------------------------------------


def test_block_masks_follow_the_drafts(tokenizer: LLTokenizer) -> None:
    matcher = matcher_of(tokenizer)
    rows, allowed = matcher.block_masks(ids("abcx"))
    assert rows.shape == (5, VOCAB_SIZE) and rows.dtype == torch.bool
    assert allowed == 4
    assert [allowed_set(r) for r in rows] == [
        {ord("a")},
        {ord("b")},
        {ord("c"), ord("d")},
        {ord("x")},
        {EOS},  # the grammar is complete: only the end token
    ]
    assert matcher.consumed == [] and current_mask(matcher) == {ord("a")}  # where it began


@pytest.mark.parametrize("bad", [ord("z"), EOS, VOCAB_SIZE + 5, -1])
def test_rows_after_a_forbidden_draft_repeat_its_row(tokenizer: LLTokenizer, bad: int) -> None:
    matcher = matcher_of(tokenizer)
    rows, allowed = matcher.block_masks([ord("a"), bad, ord("c"), ord("x")])
    assert allowed == 1
    assert allowed_set(rows[0]) == {ord("a")}
    for row in rows[1:]:  # never reached: the draft at position 1 is rejected
        assert allowed_set(row) == {ord("b")}
    assert matcher.consumed == [] and current_mask(matcher) == {ord("a")}


def test_block_masks_from_where_the_matcher_stands(tokenizer: LLTokenizer) -> None:
    matcher = matcher_of(tokenizer)
    matcher.consume(ids("ab"))
    rows, allowed = matcher.block_masks(ids("d"))
    assert allowed == 1
    assert [allowed_set(r) for r in rows] == [{ord("c"), ord("d")}, {ord("x")}]
    assert matcher.consumed == ids("ab")


def test_masks_ahead_computes_the_same_rows(tokenizer: LLTokenizer) -> None:
    matcher = matcher_of(tokenizer)
    expected, _ = matcher.block_masks(ids("abq"))
    assert torch.equal(masks_ahead(matcher, ids("abq")).result(), expected)


# --- sync, rollback, allowed_prefix --------------------------------------------------------------


def test_sync_and_rollback_round_trip(tokenizer: LLTokenizer) -> None:
    matcher, fresh = matcher_of(tokenizer), matcher_of(tokenizer)
    masks_after = {}
    for n in range(5):  # the mask after each prefix of "abcx", from a fresh matcher
        masks_after[n] = current_mask(fresh)
        if n < 4:
            fresh.consume(ids("abcx")[n : n + 1])
    for history in ["abcx", "a", "abd", "", "abdx", "ab", "abcx", ""]:
        matcher.sync(ids(history))
        assert matcher.consumed == ids(history)
        if history.startswith("abc") or len(history) < 3:
            assert current_mask(matcher) == masks_after[len(history)], history
    matcher.sync(ids("abc"))
    matcher.rollback(2)
    assert matcher.consumed == ids("a") and current_mask(matcher) == {ord("b")}
    matcher.rollback(0)
    assert matcher.consumed == ids("a")


def test_sync_along_a_forbidden_token_stops_before_it(tokenizer: LLTokenizer) -> None:
    matcher = matcher_of(tokenizer)
    with pytest.raises(InvalidArgumentError, match="breaks the request's constraint"):
        matcher.sync(ids("abz"))
    assert matcher.consumed == ids("ab")
    assert current_mask(matcher) == {ord("c"), ord("d")}
    matcher.sync(ids("abcx"))  # and it still follows the grammar from there
    assert matcher.complete


def test_allowed_prefix(tokenizer: LLTokenizer) -> None:
    matcher = matcher_of(tokenizer)
    assert matcher.allowed_prefix(ids("abcxab")) == 4
    # A complete grammar allows the end token, and only it, at every later position.
    assert matcher.allowed_prefix([*ids("abcx"), EOS, EOS, ord("a")]) == 6
    assert matcher.allowed_prefix(ids("ba")) == 0
    assert matcher.allowed_prefix([]) == 0
    assert matcher.consumed == [] and current_mask(matcher) == {ord("a")}
    matcher.consume(ids("ab"))
    assert matcher.allowed_prefix(ids("dxa")) == 2
    assert matcher.consumed == ids("ab")


# --- a complete grammar ---------------------------------------------------------------------------


def test_a_complete_grammar_allows_only_the_end_token(tokenizer: LLTokenizer) -> None:
    matcher = matcher_of(tokenizer)
    matcher.consume(ids("abcx"))
    assert matcher.complete
    assert current_mask(matcher) == {EOS}
    with pytest.raises(InvalidArgumentError):
        matcher.consume(ids("a"))
    assert matcher.consumed == ids("abcx")
    matcher.consume([EOS])
    assert matcher.consumed == [*ids("abcx"), EOS]
    matcher.rollback(2)  # the end token and "x": the grammar is open again
    assert not matcher.complete and current_mask(matcher) == {ord("x")}


def test_a_grammar_that_may_end_allows_the_end_token(tokenizer: LLTokenizer) -> None:
    matcher = matcher_of(tokenizer, Grammar("regex", "a+"))
    matcher.consume(ids("aa"))
    assert current_mask(matcher) == {ord("a"), EOS}


# --- min_tokens ---------------------------------------------------------------------------------


def test_min_tokens_masks_the_end_tokens_until_reached() -> None:
    ends = frozenset({EOS, ord("\n")})
    matcher = matcher_of(None, None, min_tokens=3, end_token_ids=ends)
    rows, allowed = matcher.block_masks(ids("xyzw"))
    assert allowed == 4
    for row in rows[:3]:
        assert allowed_set(row) == set(range(VOCAB_SIZE)) - ends
    for row in rows[3:]:
        assert bool(row.all())
    assert matcher.allowed_prefix([ord("x"), EOS]) == 1
    with pytest.raises(InvalidArgumentError):
        matcher.consume([ord("\n")])
    matcher.consume(ids("xyz"))
    matcher.consume([EOS])
    assert matcher.consumed == [*ids("xyz"), EOS]


def test_min_tokens_with_a_grammar(tokenizer: LLTokenizer) -> None:
    matcher = matcher_of(tokenizer, Grammar("regex", "a+"), min_tokens=3)
    rows, _ = matcher.block_masks(ids("aaa"))
    assert [allowed_set(r) for r in rows] == [{ord("a")}] * 3 + [{ord("a"), EOS}]


def test_a_grammar_that_can_only_end_wins_over_min_tokens(tokenizer: LLTokenizer) -> None:
    matcher = matcher_of(tokenizer, Grammar("regex", "ab"), min_tokens=5)
    matcher.consume(ids("ab"))
    assert current_mask(matcher) == {EOS}
    matcher.consume([EOS])


# --- mask_logits --------------------------------------------------------------------------------


def test_mask_logits() -> None:
    with torch.inference_mode():  # as the forward pass's logits are
        logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(0))
    allowed = torch.tensor([[True, False, True, False, False, False], [False] * 5 + [True]])
    masked = mask_logits(logits, allowed)
    assert torch.equal(masked[allowed], logits[allowed])
    assert bool((masked[~allowed] == float("-inf")).all())
    assert bool(torch.isfinite(logits).all())  # the input is left alone


# --- what is refused ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "source", "message"),
    [
        ("yaml", "a: 1", "grammar kind must be one of"),
        ("json_object", "{}", "grammar.json_object must have no source"),
        ("regex", "", "grammar.regex must not be empty"),
        ("lark", "x" * (256 * 1024 + 1), "grammar.lark must be a string"),
    ],
)
def test_a_bad_grammar_is_refused_when_built(kind: str, source: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        Grammar(kind, source)


@pytest.mark.parametrize(
    ("grammar", "field"),
    [
        (Grammar("json_schema", "{nope"), "grammar.json_schema"),
        (Grammar("json_schema", '"a string"'), "grammar.json_schema"),
        (Grammar("regex", "(a"), "grammar.regex"),
        (Grammar("lark", "start: missing"), "grammar.lark"),
    ],
)
def test_a_grammar_that_does_not_compile_is_refused_by_the_matcher(
    tokenizer: LLTokenizer, grammar: Grammar, field: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=field.replace(".", r"\.")):
        matcher_of(tokenizer, grammar)


def test_a_grammar_needs_a_tokenizer() -> None:
    with pytest.raises(InvalidArgumentError, match="needs the model's tokenizer"):
        matcher_of(None)


def test_constraint_active() -> None:
    assert not Constraint().active
    assert not Constraint(min_tokens=3).active  # no end tokens to hold back
    assert Constraint(min_tokens=3, end_token_ids=frozenset({EOS})).active
    assert Constraint(REGEX).active
    with pytest.raises(InvalidArgumentError):
        Constraint(min_tokens=-1)


# --- warm_up -----------------------------------------------------------------------------------


def test_warm_up_builds_the_view_the_first_request_then_uses() -> None:
    """A server builds its tokenizer's view as it starts: the requests after use that one."""
    fresh = build_tokenizer()  # a tokenizer object no other test has built a view of
    view = grammar_tokenizer_of(fresh, [EOS])
    warm_up(view).join(timeout=60)
    assert GRAMMAR_TOKENIZERS.built(fresh, len(fresh))
    assert view() is view()


def test_warm_up_of_a_tokenizer_llguidance_cannot_read_only_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def unreadable() -> LLTokenizer:
        raise InvalidArgumentError("this model's tokenizer cannot be constrained: slow")

    with caplog.at_level("INFO", logger="cluster.runtime.constraint"):
        warm_up(unreadable).join(timeout=60)
    assert "constrained requests will be refused" in caplog.text
