"""Running verifier sessions: a session opened with an `Advance` is in every engine step,
taking the target's own next token when no block is there, verifying a block sent to it from
where it then stands (`cluster.runtime.rebase.reconcile`), and stopping where its output ends."""

from __future__ import annotations

import queue
import threading

import pytest

from cluster.runtime.advance import Advance
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.models import LoadedModel
from cluster.runtime.rebase import reconcile
from cluster.runtime.sampling_params import SamplingParams
from tests.verifier.test_verifier import GREEDY, PROMPT, greedy_continuation
from verifier.config import VerifierConfig
from verifier.verifier import Verifier

TIMEOUT_S = 30.0


@pytest.fixture
def verifier(tiny_target: LoadedModel) -> Verifier:
    return Verifier(tiny_target, VerifierConfig(max_sessions=8, max_context_tokens=96))


class Sink:
    """A running session's reports, in order."""

    def __init__(self) -> None:
        self.items: queue.SimpleQueue[Verdict | Exception] = queue.SimpleQueue()

    def __call__(self, item: Verdict | Exception) -> None:
        self.items.put(item)

    def tokens(self, count: int) -> list[int]:
        """The tokens of the reports until `count` have come."""
        got: list[int] = []
        while len(got) < count:
            item = self.items.get(timeout=TIMEOUT_S)
            assert isinstance(item, Verdict), item
            got.extend(item.tokens)
        return got


def test_reconcile_rules() -> None:
    # Verified from where the session stands when it holds what the block assumes.
    assert reconcile([], (), (5, 6)).skip == 0
    assert not reconcile([5], (), (5, 6)).dropped and reconcile([5], (), (5, 6)).skip == 1
    assert not reconcile([1, 2, 5], (1, 2), (5, 6)).dropped
    assert reconcile([1, 2, 5], (1, 2), (5, 6)).skip == 1
    # Dropped: parted within the assumed tokens, or its own, or all of it held already.
    assert reconcile([1, 3], (1, 2), (5, 6)).dropped
    assert reconcile([1], (1, 2), (5, 6)).dropped  # stopped inside the assumed tokens
    standing = reconcile([5, 7], (), (5, 6, 8))
    assert standing.dropped and standing.skip == 1
    assert reconcile([5, 6], (), (5, 6)).dropped
    # An empty block wants the target's next token where the session stood, only.
    assert not reconcile([], (), ()).dropped
    assert reconcile([4], (), ()).dropped


def test_a_running_session_advances_alone_as_the_target(
    verifier: Verifier, tiny_target: LoadedModel
) -> None:
    expected = greedy_continuation(tiny_target, PROMPT, 12)
    sink = Sink()
    advance = Advance(max_length=len(PROMPT) + 12)
    verifier.submit_open("s", PROMPT, GREEDY, 0, advance=advance, sink=sink).result(TIMEOUT_S)
    assert sink.tokens(12) == expected
    # It stopped at max_length: nothing more comes, and the engine no longer runs it.
    with pytest.raises(queue.Empty):
        sink.items.get(timeout=0.5)
    stats = verifier.stats()
    assert stats.engine is not None and stats.engine.occupancy == 1.0
    assert verifier.close_session("s")


def test_an_end_token_stops_it_from_the_position_it_counts(
    verifier: Verifier, tiny_target: LoadedModel
) -> None:
    expected = greedy_continuation(tiny_target, PROMPT, 8)
    end = expected[3]
    first_end = expected.index(end)
    # Counted from the fifth output position on: an earlier occurrence does not end it.
    later = [i for i, t in enumerate(expected) if t == end and i >= 4]
    stop_at = later[0] if later else None
    sink = Sink()
    advance = Advance(len(PROMPT) + 8, frozenset({end}), ends_from=len(PROMPT) + 4)
    verifier.submit_open("s", PROMPT, GREEDY, 0, advance=advance, sink=sink).result(TIMEOUT_S)
    count = 8 if stop_at is None else stop_at + 1
    assert sink.tokens(count) == expected[:count]
    with pytest.raises(queue.Empty):
        sink.items.get(timeout=0.5)
    assert first_end <= 3
    verifier.close_session("s")


def test_a_block_is_verified_from_where_the_session_stands(
    verifier: Verifier, tiny_target: LoadedModel
) -> None:
    """A block based before tokens the session took alone meanwhile is verified after them
    when it agrees with them (they count as matched), and dropped when it does not; either
    way the output is the target's."""
    expected = greedy_continuation(tiny_target, PROMPT, 40)
    reports = Sink()
    answers: list[Verdict] = []
    lock = threading.Lock()
    advance = Advance(max_length=len(PROMPT) + 40)
    verifier.submit_open("s", PROMPT, GREEDY, 0, advance=advance, sink=reports).result(TIMEOUT_S)
    got = reports.tokens(2)
    base = len(PROMPT) + len(got)
    # A right block from where the router stood (2 tokens in), and a wrong one.
    right = verifier.submit_verify("s", DraftBlock(base, tuple(expected[2:10])))
    verdict = right.result(TIMEOUT_S)
    with lock:
        answers.append(verdict)
    assert not verdict.dropped
    assert verdict.num_matched + verdict.num_accepted >= 1
    wrong = DraftBlock(len(PROMPT), tuple((t + 1) % 256 for t in expected[:4]))
    assert verifier.verify("s", wrong).dropped
    # Everything committed, in order, is the target's greedy output.
    committed = verifier.engine.call(lambda: verifier._sessions.get("s").kv.committed_tokens)
    generated = list(committed[len(PROMPT) :])
    assert generated == expected[: len(generated)]
    verifier.close_session("s")


def test_sampled_sessions_need_both_advance_and_sink(verifier: Verifier) -> None:
    sampled = SamplingParams(temperature=1.0)
    with pytest.raises(Exception, match="both advance and sink"):
        verifier.submit_open("s", PROMPT, sampled, 0, advance=Advance(20)).result(TIMEOUT_S)
