"""The suffix drafter never drafts a request sampled by the rejection rule from text that an
earlier request's random draws made (`drafter.suffix`, `SuffixStore.keep_private`).

The rejection rule is exact only when a draft is independent of the uniforms that test it. A
request sent twice with the same seed tests its drafts with the same random stream as its
first run, whose output came from that stream: drafting the second run from the first's output
would bias it (in a two-token toy case the second run returned the first's token every time).
So such a request drafts from its own text only, and leaves none behind. Greedy and
seed-exact requests share their text as before (a greedy output is no draw; a seed-exact one is
the target's own whatever was drafted)."""

from __future__ import annotations

from cluster.runtime.sampling_params import SamplingParams
from drafter.config import SuffixConfig
from drafter.suffix import SuffixDrafter

CONFIG = SuffixConfig(min_match=2, tokens_per_match=1.0, min_confidence=0.0)
PROMPT = (1, 2, 3)
OUTPUT = (6, 7, 8, 9, 10)
REJECTION = SamplingParams(temperature=0.8)
SEED_EXACT = SamplingParams(temperature=0.8, seed_exact=True)
GREEDY = SamplingParams()


def first_run_then_second(sampling: SamplingParams) -> tuple[int, ...]:
    """A first request writes OUTPUT after PROMPT, with `sampling` and seed 7; a second, the
    same prompt, seed and sampling, has committed "6, 7": what the drafter proposes for it."""
    drafter = SuffixDrafter(CONFIG)
    drafter.open_session("first", PROMPT, sampling, 7, tenant="t")
    drafter.draft("first", len(PROMPT), OUTPUT, 1)
    drafter.close_session("first")
    drafter.open_session("second", PROMPT, sampling, 7, tenant="t")
    block = drafter.draft("second", len(PROMPT), (6, 7), 3)
    drafter.close_session("second")
    return tuple(block.tokens)


def test_a_rejection_rule_request_never_drafts_from_an_earlier_requests_output() -> None:
    assert first_run_then_second(REJECTION) == ()
    # Greedy and seed-exact requests draft from it: the control.
    assert first_run_then_second(GREEDY) == (8, 9, 10)
    assert first_run_then_second(SEED_EXACT) == (8, 9, 10)


def test_a_rejection_rule_request_still_drafts_from_its_own_text() -> None:
    drafter = SuffixDrafter(CONFIG)
    drafter.open_session("edit", (4, 6, 7, 8, 9, 5), REJECTION, 7, tenant="t")
    block = drafter.draft("edit", 6, (6, 7), 3)
    assert tuple(block.tokens) == (8, 9)  # its match "6, 7" is 2 long: 2 tokens
    drafter.close_session("edit")
    assert drafter.index_stats().documents == 0  # nothing left behind
