"""Adaptive draft length: the arithmetic, the estimator, and the router turning speculation
down when drafting does not pay (still exact)."""

from __future__ import annotations

import time
from typing import Any

import pytest

from cluster.local import LocalTandem, text_decoder
from cluster.routing.draft_length import (
    DraftLength,
    DraftLengthConfig,
    Plan,
    best_plan,
    expected_tokens,
    pass_seconds,
    rate,
)
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from tests.conftest import CODE_PROMPT
from verifier.runtime.errors import InvalidArgumentError

ON = DraftLengthConfig(enabled=True)


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


class SlowDrafter:
    """The real drafter, made slower than a verify pass per drafted token."""

    def __init__(self, tandem: LocalTandem, delay_s: float) -> None:
        self.drafter = tandem.drafter
        self.delay_s = delay_s

    def open_session(self, *args: Any) -> int:
        return self.drafter.open_session(*args)

    def draft(self, session_id: str, base: int, appended: Any, num_tokens: int, *rest: Any) -> Any:
        time.sleep(self.delay_s * num_tokens)
        return self.drafter.draft(session_id, base, appended, num_tokens, *rest)

    def close_session(self, session_id: str) -> bool:
        return self.drafter.close_session(session_id)


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
    slow = SlowDrafter(local_tandem, delay_s=0.05)
    adaptive = Router(local_tandem.verifier, slow, decode, eos, draft_length=ON)
    fixed = Router(local_tandem.verifier, slow, decode, eos)
    try:
        result = adaptive.generate(request, pipelined=pipelined)
        baseline = fixed.generate(request, pipelined=pipelined)
    finally:
        adaptive.close()
        fixed.close()
    assert result.tokens == expected == baseline.tokens
    # Most passes ran the target alone; only the first block and the odd probe drafted.
    assert result.stats.num_drafted < baseline.stats.num_drafted / 3
    assert result.stats.num_verify_passes > 20


def test_router_follows_the_plan_round_by_round(
    local_tandem: LocalTandem, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds alternate between pipelined and serial plans: only the pipelined ones draft
    ahead, and the output stays the target's."""
    prompt = tuple(local_tandem.tokenizer.encode(CODE_PROMPT, add_special_tokens=False))
    expected = local_tandem.router.generate(GenerationRequest(prompt, 40, draft_tokens=0)).tokens
    plans = [Plan(3, True), Plan(3, False), Plan(2, False)]
    calls = iter(range(10_000))
    monkeypatch.setattr(DraftLength, "next_plan", lambda self: plans[next(calls) % 3])
    result = local_tandem.router.generate(GenerationRequest(prompt, 40, draft_tokens=3))
    assert result.tokens == expected
    stats = result.stats
    ahead = stats.pipeline_hits + stats.pipeline_misses
    assert 0 < ahead < stats.num_verify_passes
    # A plan is drawn once per round; one round in three drafted ahead.
    assert ahead <= stats.num_verify_passes // 3 + 1
