"""Adaptive draft length: the arithmetic, the estimator, and the router turning speculation
down when drafting does not pay (still exact)."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from cluster.local import InProcess, LocalTandem, text_decoder
from cluster.routing.draft_calls import DraftCalls
from cluster.routing.draft_length import DraftLength, usable_load
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.goodput import Plan, best_plan, expected_tokens, pass_seconds, rate
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.routing.session_events import SessionEvents
from cluster.routing.waits import Waits, answer, returning
from cluster.runtime.draft_block import DraftBlock, StepLoad, Verdict
from cluster.runtime.errors import InvalidArgumentError
from tests.cluster.routing.lockstep_routers import held_lockstep_router
from tests.conftest import CODE_PROMPT

ON = DraftLengthConfig(enabled=True, measured_modes=False)
"""The plan alone: these tests price its blocks (the measured modes: test_draft_modes.py)."""


def test_expected_tokens() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 3) == pytest.approx((1 - 0.5**4) / (1 - 0.5))
    # Pipelined, an all-accepted block defers its bonus token to the next round.
    assert expected_tokens(1.0, 4, pipelined=True) == 4.0
    assert expected_tokens(0.5, 0, pipelined=True) == 1.0


def test_pass_seconds_serial_and_pipelined() -> None:
    assert pass_seconds(0.8, 0, 0.1, 0.3, pipelined=True) == pytest.approx(0.3)
    assert pass_seconds(0.8, 4, 0.1, 0.3, pipelined=False) == pytest.approx(0.7)
    # All accepted for sure: the draft hides behind the longer of the two.
    assert pass_seconds(1.0, 4, 0.1, 0.3, pipelined=True) == pytest.approx(0.4)
    # Never accepted: the round waits for the wasted draft ahead, then drafts afresh.
    assert pass_seconds(0.0, 4, 0.1, 0.3, pipelined=True) == pytest.approx(0.8)
    assert pass_seconds(0.0, 2, 0.1, 0.3, pipelined=True) == pytest.approx(0.5)


def _serial_k(acceptance: float, draft_s: float, verify_s: float) -> int:
    return best_plan(acceptance, 8, draft_s, verify_s, may_pipeline=False).k


def test_best_serial_length() -> None:
    # Cheap drafts, high acceptance: the longest block.
    assert _serial_k(0.95, draft_s=0.01, verify_s=0.3) == 8
    # Nothing is accepted: the target alone.
    assert _serial_k(0.0, draft_s=0.01, verify_s=0.3) == 0
    # A draft step as dear as a verify pass never pays serially at 0.6 acceptance.
    assert _serial_k(0.6, draft_s=0.3, verify_s=0.3) == 0
    # A middling case picks a middling length.
    assert 0 < _serial_k(0.8, draft_s=0.1, verify_s=0.3) < 8


def test_best_pipelined_block_drafts_in_about_one_verify_pass() -> None:
    # A block drafted longer than a verify pass stalls every round (k d <= v).
    rates = {k: rate(0.95, Plan(k, True), draft_s=0.1, verify_s=0.3) for k in range(1, 9)}
    assert max(rates, key=lambda k: rates[k]) == 3


def test_disabled_or_unmeasured_uses_the_request_length() -> None:
    off = DraftLength(DraftLengthConfig(), max_k=5, pipelined=False)
    off.observe_draft(4, 10.0)
    off.observe_verify(0.01)
    assert off.next_plan().k == 5
    on = DraftLength(ON, max_k=5, pipelined=False)
    on.observe_verify(0.01)
    assert on.next_plan().k == 5  # no draft latency yet


def test_rejections_stop_speculation_and_the_prior_brings_it_back() -> None:
    # A draft step costs 2/3 of a verify pass: drafting pays above about 0.67 acceptance.
    lengths = DraftLength(ON, max_k=4, pipelined=False)
    lengths.observe_draft(4, 0.8)
    lengths.observe_verify(0.3)
    assert lengths.next_plan().k > 0
    for _ in range(10):
        lengths.observe(4, 0)
    assert lengths.acceptance < 0.3 and lengths.next_plan().k == 0
    # Passes of the target alone observe nothing; the estimate drifts back to the prior
    # (0.75), and speculation is tried again.
    passes = 0
    while lengths.next_plan().k == 0:
        lengths.observe(0, 0)
        passes += 1
    assert 5 < passes < 60


def test_config_is_checked() -> None:
    with pytest.raises(InvalidArgumentError, match="decay"):
        DraftLengthConfig(decay=1.0)
    with pytest.raises(InvalidArgumentError, match="prior"):
        DraftLengthConfig(prior_accepted=0)


def test_best_plan_pipelines_only_when_the_draft_ahead_pays() -> None:
    # A block drafts within one verify pass and is usually accepted: pipelined.
    assert best_plan(0.9, 4, draft_s=0.1, verify_s=0.3, may_pipeline=True) == Plan(3, True)
    # The request did not allow pipelining: the best serial plan instead.
    assert best_plan(0.9, 4, draft_s=0.1, verify_s=0.3, may_pipeline=False) == Plan(4, False)
    # Drafting outlasts verifying and half the blocks miss: the draft ahead is wasted wait.
    serial = best_plan(0.6, 4, draft_s=0.09, verify_s=0.3, may_pipeline=True)
    assert serial.pipelined is False and serial.k > 0
    # Low acceptance: neither pays, the target alone.
    assert best_plan(0.2, 4, draft_s=0.1, verify_s=0.3, may_pipeline=True) == Plan(0, False)


def test_overlapped_latencies_price_pipelined_rounds() -> None:
    # Alone a draft step costs 0.1 s and a verify pass 0.3 s; at once, sharing the cores,
    # each takes twice as long.
    assert pass_seconds(1.0, 3, 0.1, 0.3, True, overlapped=(0.2, 0.6)) == pytest.approx(0.6)
    # A miss redrafts alone.
    assert pass_seconds(0.0, 3, 0.1, 0.3, True, overlapped=(0.2, 0.6)) == pytest.approx(0.9)
    assert best_plan(0.9, 4, 0.1, 0.3, True) == Plan(3, True)
    shared = best_plan(0.9, 4, 0.1, 0.3, True, overlapped=(0.2, 0.6))
    assert shared == best_plan(0.9, 4, 0.1, 0.3, False)  # serial, as if pipelining were off


def test_a_pipelined_request_times_one_round_alone_then_prices_both() -> None:
    lengths = DraftLength(ON, max_k=4, pipelined=True)
    lengths.observe_draft(4, 0.8, overlapped=True)  # 0.2 s per token beside a verify pass
    lengths.observe_verify(0.6, overlapped=True)
    assert lengths.next_plan() == Plan(4, False)  # nothing timed alone yet: a serial round
    lengths.observe_draft(4, 0.4)  # 0.1 s per token alone
    lengths.observe_verify(0.3)
    for _ in range(30):  # every block accepted: acceptance near 1
        lengths.observe(4, 4)
    assert lengths.next_plan().pipelined is False  # sharing the cores costs more than it hides
    fair = DraftLength(ON, max_k=4, pipelined=True)
    for overlapped in (True, False):  # the same latencies alone and beside: one core each
        fair.observe_draft(4, 0.4, overlapped)
        fair.observe_verify(0.3, overlapped)
    for _ in range(30):
        fair.observe(4, 4)
    assert fair.next_plan().pipelined is True


def test_plan_follows_the_request_until_measured() -> None:
    lengths = DraftLength(ON, max_k=4, pipelined=True)
    assert lengths.next_plan() == Plan(4, True)
    assert DraftLength(ON, max_k=0, pipelined=True).next_plan() == Plan(0, False)
    lengths.observe_draft(4, 0.4)  # 0.1 s per token
    lengths.observe_verify(0.3)
    for _ in range(30):  # two of each five accepted: acceptance settles near 2/3
        lengths.observe(5, 2)
    assert lengths.next_plan().pipelined is False


class SlowDrafter(InProcess):
    """The real drafter as a port, made slower than a verify pass per drafted token (the
    delay runs on a thread of its own, as a remote drafter's would: the router's loop goes on
    reading its verifier meanwhile)."""

    def __init__(self, tandem: LocalTandem, delay_s: float) -> None:
        super().__init__(tandem.drafter)
        self.delay_s = delay_s
        self._pool = ThreadPoolExecutor(2)

    def draft(self, *args: Any) -> Waits[DraftBlock]:
        num_tokens = args[3]

        def slow_draft() -> DraftBlock:
            time.sleep(self.delay_s * num_tokens)
            return self.component.draft(*args)

        return (yield from answer(self._pool.submit(slow_draft)))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_router_stops_drafting_when_drafts_cost_more_than_they_save(
    local_tandem: LocalTandem, pipelined: bool
) -> None:
    prompt = tuple(local_tandem.tokenizer.encode(CODE_PROMPT, add_special_tokens=False))
    request = GenerationRequest(prompt, 40, draft_tokens=4)
    expected = local_tandem.router.generate(GenerationRequest(prompt, 40, draft_tokens=0)).tokens
    decode = text_decoder(local_tandem.tokenizer)
    eos = local_tandem.target.eos_token_ids
    # A tiny-model verify pass takes a few ms; 50 ms per drafted token can never pay.
    # Lockstep routers (`verifier_advances` off): every token waits for its round's block, so
    # a fixed-length router drafts every round, and the counts below compare rounds. (With
    # running sessions the verifier takes the tokens alone while a slow draft is in flight.)
    slow = SlowDrafter(local_tandem, delay_s=0.05)
    verifier = InProcess(local_tandem.verifier)
    adaptive = Router(verifier, slow, decode, eos, draft_length=ON, verifier_advances=False)
    fixed = Router(verifier, slow, decode, eos, verifier_advances=False)
    try:
        result = adaptive.generate(request, pipelined=pipelined)
        baseline = fixed.generate(request, pipelined=pipelined)
    finally:
        adaptive.close()
        fixed.close()
        slow.close()
    assert result.tokens == expected == baseline.tokens
    # Most passes ran the target alone; only the first block and the odd probe drafted.
    assert result.stats.num_drafted < baseline.stats.num_drafted / 3
    assert result.stats.num_verify_passes > 20


def test_router_follows_the_plan_round_by_round(
    local_tandem: LocalTandem, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds alternate between pipelined and serial plans: only the pipelined ones draft
    ahead, and the output stays the target's.

    On a lockstep router whose verifier holds a pipelined block until the block drafted ahead
    of it is posted (`lockstep_routers`), so that blocks ahead are verified ahead (hits and
    misses). A plan is drawn for each block drafted now; a block drafted ahead goes on the
    plan of the block it follows (and a hit's successor on it too), so the check is that
    every block drafted ahead was drafted while the plan last drawn pipelines."""
    prompt = tuple(local_tandem.tokenizer.encode(CODE_PROMPT, add_special_tokens=False))
    expected = local_tandem.router.generate(GenerationRequest(prompt, 40, draft_tokens=0)).tokens
    plans = [Plan(3, True), Plan(3, False), Plan(2, False)]
    calls = iter(range(10_000))
    drawn: list[Plan] = []

    def next_plan(self: DraftLength) -> Plan:
        drawn.append(plans[next(calls) % 3])
        return drawn[-1]

    ahead_under: list[Plan] = []
    draft_ahead = DraftCalls.ahead

    def ahead(self: DraftCalls, gen: Any, block: DraftBlock, num_tokens: int) -> Any:
        ahead_under.append(drawn[-1])
        return draft_ahead(self, gen, block, num_tokens)

    monkeypatch.setattr(DraftLength, "next_plan", next_plan)
    monkeypatch.setattr(DraftCalls, "ahead", ahead)
    router = held_lockstep_router(local_tandem.verifier, local_tandem.drafter, local_tandem.target)
    request = GenerationRequest(prompt, 40, draft_tokens=3)
    result = router.generate(request)
    assert result.tokens == expected
    stats = result.stats
    ahead_blocks = stats.pipeline_hits + stats.pipeline_misses
    assert 0 < ahead_blocks < stats.num_verify_passes
    assert ahead_under and all(plan.pipelined for plan in ahead_under), ahead_under
    assert any(not plan.pipelined for plan in drawn)  # serial rounds were drawn, and ran
    # The default router (running sessions) follows the same plans: still the target's output.
    assert local_tandem.router.generate(request).tokens == expected


# Load (a batching replica): the verify pass priced with the batch it runs in.

GPU_CURVE = (0.010, 0.0002)
"""A step costs 10 ms to read the weights and 0.2 ms per token: flat for a few sessions,
steep for hundreds."""
OVERHEAD_S = 0.002
"""What a call's wall time holds beyond its step (transport, sampling)."""


def _load(batch: int, k: int, curve: tuple[float, float] = GPU_CURVE) -> StepLoad:
    """The verifier's load when `batch` sessions each verify a k-token block."""
    return StepLoad(batch, batch * (k + 1), *curve)


def _serve(lengths: DraftLength, batch: int, rounds: int = 30) -> None:
    """Run `rounds` rounds to `lengths`' plan in a batch of `batch` sessions that do as this one
    does: each verify pass takes what its step costs, each drafted token 1 ms, and each is
    accepted with probability 0.8 (a seeded draw: the same every run)."""
    draws = random.Random(batch)
    for _ in range(rounds):
        k = lengths.next_plan().k
        load = _load(batch, k)
        if k > 0:
            lengths.observe_draft(k, 0.001 * k, load=StepLoad(batch, batch, 0.001, 0.0))
        lengths.observe_verify(OVERHEAD_S + load.step_s(load.batch_tokens), load=load)
        accepted = next((i for i in range(k) if draws.random() >= 0.8), k)
        lengths.observe(k, accepted)


def test_speculation_follows_the_batch_down_to_none_and_back() -> None:
    lengths = DraftLength(ON, max_k=6, pipelined=False)
    _serve(lengths, batch=1)
    alone = lengths.next_plan().k
    assert alone > 0  # a step of a few tokens costs about what one of one token does
    _serve(lengths, batch=16)
    busy = lengths.next_plan().k
    assert 0 < busy < alone
    _serve(lengths, batch=256)
    assert lengths.next_plan() == Plan(0, False)  # 256 (k + 1) tokens cost k + 1 steps
    _serve(lengths, batch=1)
    assert lengths.next_plan().k == alone  # the batch shrank: speculation is back


def test_a_pipelined_request_also_falls_to_the_target_alone_under_load() -> None:
    lengths = DraftLength(ON, max_k=6, pipelined=True)
    _serve(lengths, batch=1)
    assert lengths.next_plan().k > 0
    _serve(lengths, batch=512)
    assert lengths.next_plan() == Plan(0, False)


def _priced_plan(
    acceptance_of_4: int, batch: int, per_token_s: float, pipelined: bool, draft_s: float
) -> Plan:
    lengths = DraftLength(ON, max_k=8, pipelined=pipelined)
    curve = (0.010, per_token_s)
    for overlapped in (False, True):
        load = _load(batch, 4, curve)
        lengths.observe_draft(4, 4 * draft_s, overlapped, load=StepLoad(batch, batch, 0.001, 0.0))
        lengths.observe_verify(OVERHEAD_S + load.step_s(load.batch_tokens), overlapped, load)
    for _ in range(30):
        lengths.observe(4, acceptance_of_4)
    return lengths.next_plan()


PER_TOKEN_COSTS = (0.0, 0.00001, 0.0001, 0.0005, 0.002, 0.01)
BATCHES = (1, 2, 8, 32, 128, 512)
SPECULATIONS = tuple(itertools.product((2, 3, 4), (0.0005, 0.002, 0.008)))
"""(accepted of 4 drafted, seconds per drafted token)."""


def _rows(pipelined: bool) -> list[list[Plan]]:
    """Plans along rows of rising per-token cost (at each batch) and of rising batch (at each
    per-token cost)."""
    rows = []
    for accepted, draft_s in SPECULATIONS:
        for batch in BATCHES:
            rows.append(
                [_priced_plan(accepted, batch, c, pipelined, draft_s) for c in PER_TOKEN_COSTS]
            )
        for c in PER_TOKEN_COSTS:
            rows.append([_priced_plan(accepted, b, c, pipelined, draft_s) for b in BATCHES])
    return rows


def test_dearer_tokens_or_bigger_batches_never_lengthen_serial_blocks() -> None:
    for row in _rows(pipelined=False):
        ks = [plan.k for plan in row]
        assert ks == sorted(ks, reverse=True), ks
    # The grid spans both ends: long blocks when tokens are free, none when they are dear.
    assert _priced_plan(4, 1, 0.0, False, 0.0005).k == 8
    assert _priced_plan(3, 512, 0.01, False, 0.0005).k == 0


def test_dearer_tokens_or_bigger_batches_never_turn_pipelined_speculation_back_on() -> None:
    """A pipelined block drafts behind its verify pass, so a dearer pass can hide a longer
    draft (the plan then lengthens it: the stream gains and, priced with the whole batch, so
    does the replica); but once speculation does not pay, dearer tokens never bring it back."""
    for row in _rows(pipelined=True):
        ks = [plan.k for plan in row]
        if 0 in ks:
            assert set(ks[ks.index(0) :]) == {0}, ks
    assert _priced_plan(3, 512, 0.01, True, 0.0005) == Plan(0, False)


def test_without_load_plans_are_priced_as_before() -> None:
    """No load reported: the measured constants price every plan, as `best_plan` does."""
    grid = itertools.product(
        (False, True), (0.005, 0.05, 0.3), (0.01, 0.3), (0, 2, 4), (None, 0.02), (None, 0.5)
    )
    for pipelined, draft_s, verify_s, accepted, draft_beside, verify_beside in grid:
        lengths = DraftLength(ON, max_k=6, pipelined=pipelined)
        lengths.observe_draft(6, 6 * draft_s, load=None)
        lengths.observe_verify(verify_s, load=None)
        if draft_beside is not None:
            lengths.observe_draft(6, 6 * draft_beside, overlapped=True)
        if verify_beside is not None:
            lengths.observe_verify(verify_beside, overlapped=True)
        for _ in range(7):
            lengths.observe(4, accepted)
        overlapped = None
        if draft_beside is not None and verify_beside is not None:
            overlapped = (draft_beside, verify_beside)
        expected = best_plan(lengths.acceptance, 6, draft_s, verify_s, pipelined, overlapped)
        assert lengths.next_plan() == expected


def test_a_flat_cost_curve_prices_as_without_load() -> None:
    for batch, accepted in itertools.product((1, 64, 1024), (1, 2, 3, 4)):
        priced = DraftLength(ON, max_k=6, pipelined=True)
        plain = DraftLength(ON, max_k=6, pipelined=True)
        for lengths, flat in ((priced, _load(batch, 6, (0.02, 0.0))), (plain, None)):
            drafter = StepLoad(batch, batch, 0.003, 0.0) if flat else None
            lengths.observe_draft(6, 0.03, load=drafter)
            lengths.observe_verify(0.02, load=flat)
            for _ in range(10):
                lengths.observe(4, accepted)
        assert priced.next_plan() == plain.next_plan()


def test_a_call_without_load_drops_the_pricing() -> None:
    lengths = DraftLength(ON, max_k=6, pipelined=False)
    _serve(lengths, batch=512)
    assert lengths.next_plan().k == 0
    # A spare that reports no load: its measured time is all the plan has.
    lengths.observe_verify(OVERHEAD_S + _load(1, 0).step_s(1), load=None)
    assert lengths.next_plan().k > 0


def test_unusable_loads_are_ignored() -> None:
    assert usable_load(None) is None
    assert usable_load(StepLoad(0, 0, 0.01, 0.001)) is None  # no batch
    assert usable_load(StepLoad(4, 8, 0.0, 0.0)) is None  # predicts no time at all
    assert usable_load(StepLoad(4, 8, float("nan"), 0.001)) is None
    noisy = usable_load(StepLoad(4, 8, 0.01, -0.0001))  # a slightly negative fit: flat
    assert noisy is not None and noisy.step_s(1000) == pytest.approx(0.01)


class OracleDrafter:
    """Drafts the target's own continuation, so every drafted token is accepted (a port whose
    calls wait for nothing)."""

    def __init__(self, sequence: tuple[int, ...]) -> None:
        self.sequence = sequence
        """The prompt, then the target's output."""
        self.lengths: dict[str, int] = {}

    def open_session(
        self, session_id: str, prompt_tokens: Any, *rest: Any, **kw: Any
    ) -> Waits[int]:
        self.lengths[session_id] = len(prompt_tokens)
        return (yield from returning(len(prompt_tokens)))

    def draft(
        self,
        session_id: str,
        base_length: int,
        appended: Any,
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> Waits[DraftBlock]:
        assert self.lengths[session_id] == base_length
        length = (base_length if truncate_to is None else truncate_to) + len(appended)
        self.lengths[session_id] = length
        block = DraftBlock(length, tuple(self.sequence[length : length + num_tokens]))
        return (yield from returning(block))

    def close_session(self, session_id: str) -> Waits[bool]:
        return (yield from returning(self.lengths.pop(session_id, None) is not None))


class LoadedVerifier(InProcess):
    """The real verifier as a port, reporting that each block's pass ran in a batch of `batch`
    sessions that each verified a block like it, on a curve of 1 ms a step and 1 ms a
    token."""

    def __init__(self, tandem: LocalTandem, batch: int) -> None:
        super().__init__(tandem.verifier)
        self.batch = batch

    def post(
        self,
        session_id: str,
        block: DraftBlock,
        defer_bonus: bool,
        events: SessionEvents,
        post_id: int,
    ) -> None:
        verifying = self.component.submit_verify(session_id, block, defer_bonus)
        loaded: Future[Verdict] = Future()
        load = StepLoad(self.batch, self.batch * (len(block.tokens) + 1), 0.001, 0.001)

        def verified(done: Future[Verdict]) -> None:
            error = done.exception()
            if error is not None:
                loaded.set_exception(error)
            else:
                loaded.set_result(dataclasses.replace(done.result(), load=load))

        verifying.add_done_callback(verified)
        events.answer(post_id, loaded)


def test_router_prices_blocks_with_the_verifiers_batch(local_tandem: LocalTandem) -> None:
    """Every draft is accepted; alone the router speculates, in a batch of 4096 sessions
    (where 4096 (k + 1) tokens cost about k + 1 steps) it verifies the target's own token only,
    once a round has been timed. The output is the target's either way."""
    prompt = tuple(local_tandem.tokenizer.encode(CODE_PROMPT, add_special_tokens=False))
    expected = local_tandem.router.generate(GenerationRequest(prompt, 40, draft_tokens=0)).tokens
    decode = text_decoder(local_tandem.tokenizer)
    eos = local_tandem.target.eos_token_ids
    request = GenerationRequest(prompt, 40, draft_tokens=4)
    results = {}
    for batch in (1, 4096):
        verifier = LoadedVerifier(local_tandem, batch)
        drafter = OracleDrafter(prompt + expected)
        # Lockstep: every token is verified in a posted block, whose verdict reports the load
        # (a running session's steps alone report the engine's own, not this batch).
        router = Router(verifier, drafter, decode, eos, draft_length=ON, verifier_advances=False)
        try:
            results[batch] = router.generate(request, pipelined=False)
        finally:
            router.close()
    assert results[1].tokens == results[4096].tokens == expected
    assert results[1].stats.num_drafted > 20
    assert results[4096].stats.num_drafted <= 2 * request.draft_tokens
    assert results[4096].stats.num_verify_passes > 30
