"""TextAssembler: streamed text equals the final text; stop sequences cut tokens and text."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence

import pytest

from cluster.local import text_decoder
from cluster.routing.generation import Decode
from cluster.routing.text import REPLACEMENT_CHAR, TextAssembler
from cluster.runtime import tiny


def byte_decode(ids: Sequence[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def stream(text: str, stop: Sequence[str] = (), step: int = 1) -> tuple[list[str], TextAssembler]:
    data = list(text.encode())
    assembler = TextAssembler(byte_decode, stop)
    pieces = []
    for i in range(0, len(data), step):
        out = assembler.add(data[i : i + step])
        pieces.append(out.text)
        if out.stopped:
            return pieces, assembler
    pieces.append(assembler.finish())
    return pieces, assembler


def test_multibyte_characters_are_never_split() -> None:
    pieces, _ = stream("naïve café ☕ done")
    assert "".join(pieces) == "naïve café ☕ done"
    assert all("\ufffd" not in p for p in pieces)


def test_stop_sequence_cuts_text_and_tokens() -> None:
    pieces, assembler = stream("print(1)\nEND\nprint(2)", stop=["END"])
    assert "".join(pieces) == "print(1)\n"
    assert bytes(assembler.tokens).decode() == "print(1)\nEND"


def test_stop_within_a_block_keeps_only_the_tokens_through_it() -> None:
    assembler = TextAssembler(byte_decode, ["\n\n"])
    step = assembler.add(list(b"ab\n\ncd"))
    assert step.stopped and step.text == "ab" and step.num_tokens_kept == 4
    assert assembler.tokens == tuple(b"ab\n\n")


def test_partial_stop_is_held_back_then_released() -> None:
    assembler = TextAssembler(byte_decode, ["STOP"])
    assert assembler.add(list(b"abST")).text == "ab"
    assert assembler.add(list(b"x")).text == "STx"
    assert assembler.add(list(b"ST")).text == ""
    assert assembler.finish() == "ST"


def test_earliest_of_several_stops_wins() -> None:
    pieces, _ = stream("one two three", stop=["three", "two"], step=20)
    assert "".join(pieces) == "one "


# Incremental detokenisation: each round decodes a short window, never the whole output.

TINY_DECODE = text_decoder(tiny.build_tokenizer())
"""The tiny pair's byte-level tokenizer: one token per UTF-8 byte, so a character of n bytes
spans n tokens."""


def stream_in_rounds(
    data: Sequence[int], stop: Sequence[str], rounds: Sequence[int], decode: Decode = byte_decode
) -> tuple[str, tuple[int, ...], bool, list[str]]:
    """Add `data` in rounds of the given sizes (cycled); the text, tokens and stop status."""
    assembler = TextAssembler(decode, stop)
    pieces: list[str] = []
    start = 0
    for size in itertools.cycle(rounds):
        if start >= len(data):
            break
        step = assembler.add(data[start : start + size])
        pieces.append(step.text)
        start += size
        if step.stopped:
            return "".join(pieces), assembler.tokens, True, pieces
    pieces.append(assembler.finish())
    return "".join(pieces), assembler.tokens, False, pieces


@pytest.mark.parametrize("decode", [byte_decode, TINY_DECODE], ids=["bytes", "tiny-tokenizer"])
@pytest.mark.parametrize("size", [1, 2, 3, 5])
def test_characters_split_across_tokens_and_rounds(decode: Decode, size: int) -> None:
    """2-, 3- and 4-byte characters cut at every byte by rounds of every phase."""
    text = "é☕😀a€ü😀☕😀😀x"
    data = list(text.encode())
    for phase in range(size):  # a first round of `phase` tokens shifts every cut
        rounds = [phase, size] if phase else [size]
        joined, tokens, stopped, pieces = stream_in_rounds(data, (), rounds, decode)
        assert joined == text and tokens == tuple(data) and not stopped
        assert all(REPLACEMENT_CHAR not in piece for piece in pieces)


def test_invalid_bytes_decode_as_the_whole_output_does() -> None:
    """Bytes that never become a character (a stray continuation byte, 0xFF, a sequence cut
    short) stay U+FFFD, exactly where a decode of every token puts them."""
    data = [*b"a", 0x80, *b"b", 0xFF, 0xE2, 0x98, *b"c", 0xE2, 0x98]
    for size in (1, 2, 3):
        joined, _, _, _ = stream_in_rounds(data, (), [size])
        assert joined == byte_decode(data) == "a\ufffdb\ufffd\ufffdc\ufffd"


@pytest.mark.parametrize("stop", ["STOP", "\n\n", "a☕", "☕b", "x😀y"])
def test_stop_straddling_rounds_is_found_at_every_cut(stop: str) -> None:
    """However the rounds cut the text (within the stop, within one of its characters), the
    stream stops where the whole output, added at once, does: same text, same tokens."""
    text = f"one {stop[:-1]} two {stop} three {stop}"
    data = list(text.encode())
    expected = text[: text.index(stop, len("one ") + len(stop))]
    expected_tokens = tuple(data[: len(expected.encode()) + len(stop.encode())])
    for first in range(1, len(data)):
        for size in (1, 2, 4):
            joined, tokens, stopped, _ = stream_in_rounds(data, [stop], [first, size])
            assert stopped and joined == expected, (first, size)
            assert tokens == expected_tokens, (first, size)


def test_stop_beginning_before_an_incomplete_character_is_held_back() -> None:
    """ "a", then the first byte of "☕": "a" could begin the stop "a☕", so it is not released
    until the character is known; released, the stop would go unseen."""
    assembler = TextAssembler(byte_decode, ["a☕"])
    assert assembler.add(list(b"xa")).text == "x"
    assert assembler.add(list("☕".encode()[:1])).text == ""
    step = assembler.add(list("☕".encode()[1:]))
    assert step.stopped and step.text == "" and step.num_tokens_kept == 2
    # A different character there ends the hold: the text is released after all.
    assembler = TextAssembler(byte_decode, ["a☕"])
    assert assembler.add(list(b"xa")).text == "x"
    assert assembler.add(list("é".encode()[:1])).text == ""
    assert assembler.add(list("é".encode()[1:])).text == "aé"


def test_long_generation_decodes_short_windows_and_equals_the_full_decode() -> None:
    """Thousands of tokens in uneven rounds: the stream is exactly the full decode, and no
    round decodes more than a few rounds' tokens (a full re-decode would grow to all)."""
    rng = random.Random(0)
    alphabet = [*"abc \n", "é", "☕", "😀", "€"]
    text = "".join(rng.choice(alphabet) for _ in range(4000))
    data = list(text.encode())
    decoded: list[int] = []

    def counting_decode(ids: Sequence[int]) -> str:
        decoded.append(len(ids))
        return TINY_DECODE(ids)

    rounds = [rng.randint(1, 9) for _ in range(100)]
    joined, tokens, stopped, _ = stream_in_rounds(data, ["<END>"], rounds, counting_decode)
    assert joined == text == TINY_DECODE(data) and tokens == tuple(data) and not stopped
    # At most this round, the one before and an incomplete character before that.
    assert max(decoded) <= 2 * max(rounds) + 3
