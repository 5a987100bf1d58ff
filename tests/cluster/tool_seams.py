"""Test seams for "auto" tool choice on the tiny pair, whose random weights never choose a call.

The tiny model writes random bytes: under the real Hermes grammar it practically always
answers in text (it would have to write the 12 bytes `<tool_call>\\n` by chance). To see calls
made, read, streamed and checked through the real service, `ForcedHermes` is the Hermes format
with the text-only alternative taken out of its grammar: a short text (at most 12 letters,
spaces or dots, so that `content` is exercised too), then `min_calls` calls or more. Everything
else is Hermes's own: the call syntax, the JSON the arguments must follow, the reader that
turns the output into `tool_calls`. The output is still the target's own constrained choice
(greedy: its argmax among the allowed tokens), so exactness holds under it as under any grammar.

`FirstTurnForced` forces calls for the first request it builds a grammar for and is plain Hermes
afterwards: an agent's first turn calls tools, and its next turn, after the results, may answer
in text and end the loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from cluster.api.tool_format_hermes import HermesFormat

FORCED_TEXT = "/[A-Za-z .]{0,12}<tool_call>\\n/"


class ForcedHermes(HermesFormat):
    """Hermes with a call forced: short text, then at least `min_calls` calls (at most one
    when the request says `parallel_tool_calls: false`)."""

    def __init__(self, min_calls: int = 1) -> None:
        self.min_calls = min_calls

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        lines = super().grammar(functions, parallel).splitlines()
        more = f' ("\\n<tool_call>\\n" call){{{self.min_calls - 1},}}' if parallel else ""
        lines = [line for line in lines if not line.startswith(("start:", "head[lazy]:"))]
        return "\n".join([*lines, f"start: head call{more}", f"head[lazy]: {FORCED_TEXT}"])


class FirstTurnForced(HermesFormat):
    """`ForcedHermes` for the first grammar asked for, plain Hermes after it."""

    def __init__(self) -> None:
        self.turns = 0

    def grammar(self, functions: Sequence[Mapping[str, Any]], parallel: bool) -> str:
        self.turns += 1
        if self.turns == 1:
            return ForcedHermes().grammar(functions, parallel)
        return super().grammar(functions, parallel)
