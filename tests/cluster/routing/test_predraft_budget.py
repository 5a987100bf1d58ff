"""The pre-drafting budget: the adaptive plan prices a fan-out against plain pipelining and serial
rounds with the drafter's step cost curve and load, and the request's measured hit rate."""

from __future__ import annotations

import pytest

from cluster.local import LocalTandem
from cluster.routing.draft_length import DraftLength
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.goodput import Plan, best_plan, rate
from cluster.routing.predraft_budget import (
    PredraftCost,
    branch_odds,
    branch_steps,
    hit_odds,
    predrafted_seconds,
)
from cluster.routing.predrafting import choose_branches
from cluster.routing.request import GenerationRequest
from cluster.runtime.draft_block import StepLoad
from cluster.runtime.limits import MAX_PREDRAFT_FAN_OUT
from cluster.runtime.predraft import accept_odds
from tests.cluster.routing.lockstep_routers import held_lockstep_router
from tests.conftest import MAX_TOKENS, encode

ON = DraftLengthConfig(enabled=True)
VERIFY_S = 0.0065
"""A verify pass, as on `sim-h100-8b` at one stream."""


def test_branch_odds_cover_every_outcome_likeliest_first() -> None:
    odds = branch_odds(0.8, 4)
    probabilities = [p for p, _, _ in odds]
    assert probabilities == sorted(probabilities, reverse=True)
    # Every accept length is there, and the ranks of each share its odds by the prior.
    for accepted, p in enumerate(accept_odds(0.8, 4)):
        named = sum(q for q, a, _ in odds if a == accepted)
        assert 0 < named <= p + 1e-12
    assert [(a, r) for _, a, r in odds[:3]] == [
        (b.accepted, b.rank) for b in choose_branches(0.8, 4, 3)
    ]


def test_hit_odds_grow_with_the_fan_out_and_stay_below_one() -> None:
    previous = 0.0
    for fan_out in range(0, MAX_PREDRAFT_FAN_OUT + 1):
        odds = hit_odds(0.8, 4, fan_out)
        assert previous <= odds <= 1.0
        previous = odds
    assert hit_odds(0.8, 4, 0) == 0.0
    # The whole block accepted and the draft's favourite next is the likeliest outcome.
    assert hit_odds(0.8, 4, 1) == pytest.approx(0.8**4 * 0.8)


def test_a_predrafted_round_waits_for_the_longer_side_then_redrafts_on_a_miss() -> None:
    assert predrafted_seconds(1.0, 0.006, 0.004, 0.005) == 0.006
    assert predrafted_seconds(0.5, 0.006, 0.008, 0.004) == pytest.approx(0.008 + 0.002)
    assert branch_steps(4) == 5


def _cost(step_s: float, per_row_s: float, hit_scale: float = 1.0) -> PredraftCost:
    return PredraftCost(MAX_PREDRAFT_FAN_OUT, lambda f: step_s + per_row_s * f, hit_scale)


def test_a_cheap_drafter_pre_drafts_wide_and_a_dear_one_does_not() -> None:
    # A flat curve: F rows cost about one; the plan takes the widest fan-out that pays.
    cheap = best_plan(0.8, 4, 0.0008, VERIFY_S, True, predraft=_cost(0.0008, 0.00001))
    assert cheap.pipelined and cheap.fan_out >= 3
    # Each row costs a whole step (a CPU drafter): pre-drafting loses to plain pipelining or
    # serial rounds.
    dear = best_plan(0.8, 4, 0.0008, VERIFY_S, True, predraft=_cost(0.0, 0.0015))
    assert dear.fan_out <= 1
    # A drafter as slow as the verifier (the two sides sharing the cores) never pre-drafts.
    shared = best_plan(0.8, 4, VERIFY_S / 2, VERIFY_S, True, predraft=_cost(VERIFY_S / 2, 0.001))
    assert shared.fan_out == 0


def test_a_pre_drafted_plan_keeps_the_bonus_token() -> None:
    cost = _cost(0.0008, 0.0)
    plain = rate(1.0, Plan(4, True), 0.0008, VERIFY_S)
    predrafted = rate(1.0, Plan(4, True, 1), 0.0008, VERIFY_S, predraft=cost)
    # Every draft accepted: both hit every round; the pre-drafted round keeps its bonus token
    # (5 tokens a round against 4) at one drafter step more.
    assert predrafted / plain == pytest.approx((5 / VERIFY_S) / (4 / VERIFY_S))


def test_a_request_whose_branches_miss_narrows_its_fan_out() -> None:
    cost = _cost(0.0008, 0.00001)
    assert best_plan(0.8, 4, 0.0008, VERIFY_S, True, predraft=cost).fan_out > 0
    missing = _cost(0.0008, 0.00001, hit_scale=0.05)
    assert best_plan(0.8, 4, 0.0008, VERIFY_S, True, predraft=missing).fan_out == 0


def _timed(lengths: DraftLength, drafter_batch: int, per_token_s: float) -> None:
    """Rounds timed as a drafter whose steps cost 0.8 ms plus `per_token_s` a row, in a batch
    of `drafter_batch` sessions, would time them; verify passes of VERIFY_S; acceptance 0.8."""
    load = StepLoad(drafter_batch, drafter_batch, 0.0008, per_token_s)
    step_s = load.step_s(drafter_batch)
    for overlapped in (False, True):
        lengths.observe_draft(4, 4 * step_s, overlapped, load=load)
        lengths.observe_verify(VERIFY_S, overlapped)
    for _ in range(20):
        lengths.observe(4, 3)
        lengths.observe(4, 4)


def test_the_fan_out_follows_the_drafters_load() -> None:
    idle = DraftLength(ON, max_k=4, pipelined=True, max_fan_out=MAX_PREDRAFT_FAN_OUT)
    _timed(idle, drafter_batch=1, per_token_s=0.00002)
    assert idle.next_plan().fan_out >= 3
    loaded = DraftLength(ON, max_k=4, pipelined=True, max_fan_out=MAX_PREDRAFT_FAN_OUT)
    _timed(loaded, drafter_batch=64, per_token_s=0.00002)
    assert loaded.next_plan().fan_out < idle.next_plan().fan_out


def test_measured_pre_drafts_and_hits_correct_the_price() -> None:
    lengths = DraftLength(ON, max_k=4, pipelined=True, max_fan_out=MAX_PREDRAFT_FAN_OUT)
    _timed(lengths, drafter_batch=1, per_token_s=0.00002)
    assert lengths.next_plan().fan_out > 0
    # Pre-drafts measured ten times as slow as the curve says: no longer worth it.
    for _ in range(20):
        lengths.observe_predraft(10 * branch_steps(4) * 0.0009 * 4, 4, 4)
    assert lengths.next_plan().fan_out == 0


def test_branches_that_never_hit_turn_pre_drafting_off() -> None:
    lengths = DraftLength(ON, max_k=4, pipelined=True, max_fan_out=MAX_PREDRAFT_FAN_OUT)
    _timed(lengths, drafter_batch=1, per_token_s=0.00002)
    assert lengths.next_plan().fan_out > 0
    for _ in range(40):
        lengths.observe_predraft_outcome(False, 0.8)
    assert lengths.hit_scale < 0.2
    assert lengths.next_plan().fan_out == 0


def test_without_a_budget_or_before_timing_the_request_gets_what_it_asked() -> None:
    never = DraftLength(ON, max_k=4, pipelined=True)
    _timed(never, drafter_batch=1, per_token_s=0.00002)
    assert never.next_plan().fan_out == 0
    untimed = DraftLength(ON, max_k=4, pipelined=True, max_fan_out=3)
    assert untimed.next_plan() == Plan(4, True, 0)  # pre-drafting waits for a price
    fixed = DraftLength(DraftLengthConfig(enabled=False), max_k=4, pipelined=True, max_fan_out=3)
    _timed(fixed, drafter_batch=64, per_token_s=0.01)
    assert fixed.next_plan() == Plan(4, True, 3)


def test_a_drafter_loaded_meanwhile_narrows_the_fan_out_through_its_branches_loads() -> None:
    """While every round hits, no plain draft reports the drafter's load: the branches' do."""
    lengths = DraftLength(ON, max_k=4, pipelined=True, max_fan_out=MAX_PREDRAFT_FAN_OUT)
    _timed(lengths, drafter_batch=1, per_token_s=0.00002)
    idle = lengths.next_plan().fan_out
    assert idle >= 3
    # Each of 64 sessions pre-drafts `idle` branches: a step holds 64 x idle rows.
    load = StepLoad(64 * idle, 64 * idle, 0.0008, 0.00002)
    for _ in range(20):
        lengths.observe_predraft(branch_steps(4) * load.step_s(64 * idle), idle, 4, load)
    assert lengths.next_plan().fan_out < idle
    # The batch is taken per session: 64 sessions, not 64 x idle rows each.
    drafter = lengths._drafter_load
    assert drafter is not None and drafter.sequences == pytest.approx(64, rel=0.05)


def test_the_routers_predraft_gate_turns_pre_drafting_off_and_keeps_output_exact(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    """Where the router measured rounds without pre-drafting faster, no round pre-drafts.

    A lockstep router (`verifier_advances` off), its verifier holding a pipelined block until
    the block drafted ahead of it is posted (`lockstep_routers`): every token is decided by a
    posted block, so that branches are verified (hits) with the gate open, and blocks are
    verified ahead (pipeline hits and misses) with it shut."""
    router = held_lockstep_router(
        local_tandem.verifier, local_tandem.drafter, local_tandem.target, predraft_fan_out=4
    )
    try:
        prompt, expected = next(iter(target_only.items()))
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=4)
        on = router.generate(request, pipelined=True)
        router.predraft_gate.speculate = lambda: False  # type: ignore[method-assign]
        off = router.generate(request, pipelined=True)
    finally:
        router.close()
    assert on.tokens == off.tokens == expected
    assert on.stats.predraft_hits > 0
    assert off.stats.predraft_hits == off.stats.predraft_misses == 0
    assert off.stats.pipeline_hits + off.stats.pipeline_misses > 0  # plain pipelining instead
