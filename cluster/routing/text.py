"""Turn committed token ids into streamed text, and find stop sequences.

Pure: the tokenizer's decode function is injected. Text is only released once it is final:
a trailing incomplete UTF-8 character, or a tail that could still grow into a stop sequence,
is held back until the next tokens settle it, so a stream never shows text that the final
result does not have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

# What byte-level tokenizers decode an incomplete UTF-8 sequence to.
REPLACEMENT_CHAR = "\ufffd"


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

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str] = ()) -> None:
        self._decode = decode
        self._stop = tuple(stop)
        self._tokens: list[int] = []
        self._released = 0

    @property
    def tokens(self) -> tuple[int, ...]:
        return tuple(self._tokens)

    def add(self, tokens: Sequence[int]) -> TextStep:
        start = len(self._tokens)
        self._tokens.extend(tokens)
        text = self._decode(self._tokens)
        hit = self._find_stop(text)
        if hit is not None:
            kept = self._tokens_through_stop(start)
            del self._tokens[start + kept :]
            return TextStep(kept, self._release(text[:hit]), stopped=True)
        return TextStep(
            len(tokens), self._release(text[: len(text) - self._held_back(text)]), False
        )

    def finish(self) -> str:
        """Release whatever was held back: the generation ended without a stop sequence."""
        return self._release(self._decode(self._tokens))

    def _release(self, final_text: str) -> str:
        new = final_text[self._released :]
        self._released = max(self._released, len(final_text))
        return new

    def _find_stop(self, text: str) -> int | None:
        # Only text not yet released can hold a new stop (released text was checked already,
        # and a stop spanning the boundary starts inside the held-back tail).
        starts = [i for s in self._stop if (i := text.find(s, self._released)) != -1]
        return min(starts) if starts else None

    def _tokens_through_stop(self, start: int) -> int:
        """The fewest of the tokens added since `start` whose text completes a stop sequence."""
        for kept in range(1, len(self._tokens) - start + 1):
            if self._find_stop(self._decode(self._tokens[: start + kept])) is not None:
                return kept
        return len(self._tokens) - start

    def _held_back(self, text: str) -> int:
        held = 0
        if text.endswith(REPLACEMENT_CHAR):
            held = len(text) - len(text.rstrip(REPLACEMENT_CHAR))
        for stop in self._stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    held = max(held, n)
                    break
        return held
