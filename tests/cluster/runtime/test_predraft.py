"""Outcome-keyed pre-drafting's odds (`cluster.runtime.predraft`) and its ideal on the simulated
device: the odds cover every outcome exactly once, never guess a rejected token, and on the sim
pair the outcomes chosen from the draft's own distribution are the verdicts a greedy verify
pass really ends in."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.runtime import predraft, sim, sim_source
from cluster.runtime.model_spec import ModelSpec
from cluster.runtime.models import load_model
from cluster.runtime.predraft import Outcome, accept_odds, hit_rate, likely_outcomes

VOCAB = 4_000


def test_accept_odds_are_the_acceptance_model() -> None:
    assert accept_odds(0.8, 4) == pytest.approx((0.2, 0.16, 0.128, 0.1024, 0.4096))
    assert sum(accept_odds(0.37, 7)) == pytest.approx(1.0)
    assert accept_odds(1.0, 3) == (0.0, 0.0, 0.0, 1.0)
    with pytest.raises(ValueError):
        accept_odds(1.2, 3)


@st.composite
def _blocks(draw: st.DrawFn) -> tuple[list[int], list[list[tuple[int, float]]], float]:
    """A block of the draft's tokens and, at each position, its whole distribution over a
    small vocabulary (a token proposed has some mass there, as a sampled draft's has)."""
    vocab = draw(st.integers(2, 6))
    k = draw(st.integers(0, 5))
    alpha = draw(st.floats(0.05, 0.95))
    odds = []
    for _ in range(k + 1):
        weights = draw(st.lists(st.floats(0.01, 1.0), min_size=vocab, max_size=vocab))
        total = sum(weights)
        odds.append([(token, w / total) for token, w in enumerate(weights)])
    block = [draw(st.integers(0, vocab - 1)) for _ in range(k)]
    return block, odds, alpha


@settings(max_examples=200, deadline=None)
@given(_blocks(), st.integers(0, 40))
def test_outcomes_are_ranked_distinct_and_never_a_rejected_token(
    case: tuple[list[int], list[list[tuple[int, float]]], float], fan_out: int
) -> None:
    block, odds, alpha = case
    chosen = likely_outcomes(block, odds, alpha, fan_out)
    everything = likely_outcomes(block, odds, alpha, 10_000)
    assert len(chosen) == min(fan_out, len(everything))
    assert chosen == everything[: len(chosen)]  # the most likely, in order
    assert [p for _, p in chosen] == sorted((p for _, p in chosen), reverse=True)
    assert len({outcome for outcome, _ in everything}) == len(everything)
    for outcome, _ in everything:
        assert 0 <= outcome.accepted <= len(block)
        if outcome.accepted < len(block):  # a correction is never the token just rejected
            assert outcome.token != block[outcome.accepted]
    # Every outcome is covered once: the whole distributions add up to certainty.
    assert hit_rate(everything) == pytest.approx(1.0)
    assert hit_rate(chosen) <= hit_rate(everything) + 1e-9


def test_a_mismatched_odds_length_is_refused() -> None:
    with pytest.raises(ValueError, match="2 positions"):
        likely_outcomes([7], [[(1, 1.0)]], 0.5, 2)


def _argmax(model: torch.nn.Module, ids: list[int]) -> tuple[int, list[tuple[int, float]]]:
    """The model's favourite next token after `ids`, and its three likeliest with their odds."""
    probs = model(torch.tensor([ids])).logits[0, -1].softmax(-1)
    top = probs.topk(3)
    return int(top.indices[0]), list(zip(top.indices.tolist(), top.values.tolist(), strict=True))


@pytest.mark.parametrize("alpha", [0.6, 0.8])
def test_on_the_sim_pair_the_chosen_outcomes_are_the_verdicts(alpha: float) -> None:
    """Draft k tokens greedily, verify them greedily against the sim target, and check the
    verdict against the outcomes chosen from the draft's own odds: with a fan-out as wide as
    its three likeliest tokens at every position every verdict is among them (the sim draft's
    second choice is the target's favourite wherever they differ), and at every fan-out the
    share of hits is near, and never much above, what the ideal assumes."""
    target = load_model(ModelSpec(f"sim://target/instant?vocab={VOCAB}", device="cpu")).model
    draft = load_model(ModelSpec(f"sim://draft/instant?vocab={VOCAB}&alpha={alpha}")).model
    generator = torch.Generator().manual_seed(1)
    k, trials = 4, 300
    hits = {fan_out: 0 for fan_out in range(1, 3 * (k + 1) + 1)}
    for _ in range(trials):
        prompt = torch.randint(10, VOCAB, (3,), generator=generator).tolist()
        block: list[int] = []
        odds = []
        for position in range(k + 1):
            favourite, likeliest = _argmax(draft, prompt + block)
            odds.append(likeliest)
            if position < k:
                block.append(favourite)
        accepted = 0
        while True:
            wanted, _ = _argmax(target, prompt + block[:accepted])
            if accepted == k or wanted != block[accepted]:
                verdict = Outcome(accepted, wanted)
                break
            accepted += 1
        for fan_out in hits:
            chosen = {outcome for outcome, _ in likely_outcomes(block, odds, alpha, fan_out)}
            hits[fan_out] += verdict in chosen
    # Every verdict is among the draft's three likeliest tokens at its position.
    assert hits[3 * (k + 1)] == trials
    for fan_out, hit in hits.items():
        # The ideal ranks outcomes by their true odds, an upper bound; the draft's own odds
        # are less calibrated (its favourite holds about 0.6 of its mass whatever alpha is)
        # and rank a little worse. 300 trials: a standard error of at most 0.029.
        ideal = sim.sim_predraft_hit(alpha, k, fan_out)
        assert ideal - 0.15 < hit / trials < ideal + 0.08, (fan_out, hits)


def test_the_ideal_prices_predrafting_against_its_cost() -> None:
    target, draft = sim_source.PROFILES["h100-8b"], sim_source.PROFILES["a10g-0.5b"]
    one = sim.ideal_rates(target, draft, alpha=0.8, k=4)
    # One stream: drafting six outcomes costs the drafter little more than one; a hit round
    # takes the longer of its verify pass and the branches' k + 1 passes.
    assert one.predraft_fan_out == 6 and one.predraft_hit == pytest.approx(1.0)
    verify_s = target.step_s(5, 256)
    predraft_s = 5 * draft.step_s(6, 6 * 256)
    assert one.predrafted == pytest.approx(one.tokens_per_verify / max(verify_s, predraft_s))
    assert one.predrafted > 1.35 * one.serial > one.pipelined
    # At 64 streams a wide fan-out costs more than it saves: the best is narrower.
    busy = sim.ideal_rates(target, draft, alpha=0.8, k=4, streams=64)
    assert busy.predraft_fan_out < one.predraft_fan_out
    assert busy.predrafted >= busy.serial
    assert [sim.sim_predraft_hit(0.8, 4, f) for f in range(1, 7)] == sorted(
        sim.sim_predraft_hit(0.8, 4, f) for f in range(1, 7)
    )
    assert predraft.hit_rate(predraft.likely_outcomes([], [[(3, 1.0)]], 0.8, 1)) == 1.0
