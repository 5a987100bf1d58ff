"""Turn committed token ids into streamed text, and find stop sequences.

Pure: the tokenizer's decode function is injected. Text is only released once it is final:
a trailing incomplete UTF-8 character, or a tail that could still grow into a stop sequence,
is held back until the next tokens settle it, so a stream never shows text that the final
result does not have.

Incremental: each `add` costs O(tokens of this round and the last), not O(tokens so far).
Tokens are decoded in a short window, the way vLLM's and Hugging Face's streaming detokenisers
do: the window starts one settle point back (context, for tokenizers whose first token decodes
differently, as SentencePiece's leading space does) and its text past that context is the text
of the unsettled tokens. Each round settles the tokens up to the last whose text does not end
with U+FFFD (an incomplete character the next tokens may complete), looking back a few tokens,
so the window stays about two rounds long. Only the text not yet released is searched for stops
and held back: a stop straddling two rounds starts inside what the earlier one held back. This
is exact, the same text as decoding every token at once, for a `decode` that is prefix-stable
(more tokens never change the text of earlier ones, but for a trailing incomplete character)
and local (a window decodes to the full text's tail): byte-level BPE and SentencePiece are both,
when decode does not clean up tokenization spaces.

`min_tokens`, as vLLM's: a stop sequence counts only if it ends past the text of the first
`min_tokens` tokens (a stop may begin inside that text). That text's length is found once, by
one decode of those tokens, when the output first holds them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# What byte-level tokenizers decode an incomplete UTF-8 sequence to.
REPLACEMENT_CHAR = "\ufffd"
# How far back a round looks for its last token with complete text: an incomplete UTF-8
# character has at most 3 bytes, one token each at worst, and a token may end with a character
# cut short too. Where none is found (a run of bytes that never decode), the window grows.
SETTLE_LOOKBACK = 4


@dataclass(frozen=True)
class TextStep:
    num_tokens_kept: int
    """How many of the tokens just added belong to the output (fewer when a stop hit)."""
    text: str
    """Text newly final."""
    stopped: bool
    """A stop sequence was found; nothing more may be added."""


class TextAssembler:
    """Accumulates generated tokens; releases final text and detects stop sequences."""

    def __init__(
        self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = (), min_tokens: int = 0
    ) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._min_tokens = min_tokens
        self._stop_floor: int | None = 0 if min_tokens == 0 else None
        """Where a stop sequence must end past: the length of the text of the first
        `min_tokens` tokens (a trailing incomplete character left out); None until the output
        holds that many tokens (until then no stop counts)."""
        self._num_released = 0
        """Characters released so far: where the unreleased text begins in the whole text."""
        self._tokens: list[int] = []
        self._window = 0
        """Where the decoding window starts: where the tokens were settled before `_settled`."""
        self._settled = 0
        """Tokens before this are settled: later tokens cannot change their text."""
        self._window_text = ""
        """`decode(tokens[_window:_settled])`: the context the window's text starts with."""
        self._settled_unreleased = ""
        """The end of the settled tokens' text that is not released yet (held back)."""
        self._unsettled_released = 0
        """How much of the unsettled tokens' text is released already."""
        self._unreleased = ""
        """All text not released yet, as of the last `add`."""

    @property
    def tokens(self) -> tuple[int, ...]:
        """Every token of the output (a copy: O(tokens); `num_tokens` is O(1))."""
        return tuple(self._tokens)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    def add(self, tokens: Sequence[int]) -> TextStep:
        start = len(self._tokens)
        self._tokens.extend(tokens)
        if self._stop_floor is None and len(self._tokens) >= self._min_tokens:
            first = self._decode(self._tokens[: self._min_tokens])
            self._stop_floor = len(first.rstrip(REPLACEMENT_CHAR))
        unsettled = self._unsettled_text(len(self._tokens))
        text = self._settled_unreleased + unsettled[self._unsettled_released :]
        hit = self._find_stop(text)
        if hit is not None:
            kept = self._tokens_through_stop(start)
            del self._tokens[start + kept :]
            return TextStep(kept, self._release(text, hit), stopped=True)
        released = self._release(text, len(text) - self._held_back(text))
        self._settle(unsettled)
        return TextStep(len(tokens), released, False)

    def finish(self) -> str:
        """Release whatever was held back: the generation ended without a stop sequence."""
        return self._release(self._unreleased, len(self._unreleased))

    def _unsettled_text(self, end: int) -> str:
        """The text of `tokens[_settled:end]`, decoded after the window's context."""
        return self._decode(self._tokens[self._window : end])[len(self._window_text) :]

    def _settle(self, unsettled: str) -> None:
        """Settle the tokens up to the last whose text is complete (`unsettled`: the text of
        all unsettled tokens); the next window starts where the tokens were settled until now."""
        end, text = len(self._tokens), unsettled
        while text.endswith(REPLACEMENT_CHAR):
            end -= 1
            if end <= self._settled or end < len(self._tokens) - SETTLE_LOOKBACK:
                return
            text = self._unsettled_text(end)
        if end == self._settled:
            return
        # `text` begins `unsettled` (prefix-stable): its unreleased part moves to the settled side.
        self._settled_unreleased += text[self._unsettled_released :]
        self._unsettled_released = max(self._unsettled_released - len(text), 0)
        self._window, self._settled = self._settled, end
        self._window_text = self._decode(self._tokens[self._window : self._settled])

    def _release(self, text: str, end: int) -> str:
        """Release `text[:end]`, where `text` is all the text not released yet."""
        new = text[: max(end, 0)]
        self._num_released += len(new)
        held = len(self._settled_unreleased)
        if len(new) <= held:
            self._settled_unreleased = self._settled_unreleased[len(new) :]
        else:
            self._settled_unreleased = ""
            self._unsettled_released += len(new) - held
        self._unreleased = text[len(new) :]
        return new

    def _find_stop(self, text: str) -> int | None:
        # Only text not yet released can hold a new stop (released text was checked already,
        # and a stop spanning the boundary starts inside the held-back tail). `text` begins
        # `_num_released` characters into the output: a stop must end past `_stop_floor`.
        if self._stop_floor is None:
            return None
        floor = self._stop_floor - self._num_released
        starts = [i for s in self._stop if (i := text.find(s, max(floor - len(s) + 1, 0))) != -1]
        return min(starts) if starts else None

    def _tokens_through_stop(self, start: int) -> int:
        """The fewest of the tokens added since `start` whose text completes a stop sequence."""
        for kept in range(1, len(self._tokens) - start + 1):
            unsettled = self._unsettled_text(start + kept)
            text = self._settled_unreleased + unsettled[self._unsettled_released :]
            if self._find_stop(text) is not None:
                return kept
        return len(self._tokens) - start

    def _held_back(self, text: str) -> int:
        # `text` is the unreleased text only: a tail that could grow into a stop begins inside
        # it (else the round that released its start would have held it back), and holding
        # more than all of it releases nothing either way.
        incomplete = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
        before = text[: len(text) - incomplete]
        held = incomplete
        for stop in self._stop:
            # The character a trailing U+FFFD becomes may continue a stop's beginning that ends
            # just before it ("a" then half of "☕", with stop "a☕"): hold that beginning too.
            held = max(held, _stop_prefix(text, stop), incomplete + _stop_prefix(before, stop))
        return held


def _stop_prefix(text: str, stop: str) -> int:
    """The length of the longest proper beginning of `stop` that `text` ends with."""
    for n in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:n]):
            return n
    return 0
