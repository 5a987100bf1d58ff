"""TextAssembler: streamed text equals the final text; stop sequences cut tokens and text."""

from __future__ import annotations

from collections.abc import Sequence

from cluster.routing.text import TextAssembler


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
