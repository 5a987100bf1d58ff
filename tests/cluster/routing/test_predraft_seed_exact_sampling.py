"""Seed-exact requests that pre-draft give the seed's own output, token for token.

Under the seed-exact rule every committed token is the target's Gumbel-max draw keyed by
(seed, position) (`cluster.runtime.gumbel`), whatever was proposed, so a request's output is the
same with pre-drafting as without. The branches are drafted seed-exact (`drafter.branches`):
each one's token is a guess of the target's noisy draw, and its block the drafter's own
seed-exact draft after it. The tests run seeded requests through the in-process router with
`predraft_fan_out` F and without pre-drafting, at several block lengths k and F, and need the
same tokens and some hits. The hits come from a lockstep router (`verifier_advances` off: every
token through a posted block, so that the verdicts the branches were drafted for decide what
comes next); the same requests through a router whose verifier sessions run (the default
path, where in-process the verifier mostly takes the tokens alone) give the same tokens again.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from cluster.local import LocalTandem, local_router
from cluster.routing.request import GenerationRequest, GenerationResult
from cluster.runtime.sampling_params import SamplingParams
from tests.conftest import CODE_PROMPT, PROMPTS, encode

SEED_EXACT = SamplingParams(temperature=1.0, seed_exact=True)
SEEDS = (0, 7, 123)
NUM_TOKENS = 32


def seeded_run(
    tandem: LocalTandem,
    fan_out: int,
    sampling: SamplingParams,
    draft_tokens: int,
    prompts: tuple[str, ...] = (CODE_PROMPT, PROMPTS[2]),
    lockstep: bool = True,
) -> list[GenerationResult]:
    """One pipelined request per prompt and seed through a router that pre-drafts `fan_out`
    branches (0: it drafts ahead as if the whole block were accepted); a lockstep one
    (`verifier_advances` off) unless `lockstep` is False."""
    router = local_router(
        tandem.verifier, tandem.drafter, tandem.target, predraft_fan_out=fan_out,
        verifier_advances=not lockstep,
    )  # fmt: skip
    try:
        requests = [
            GenerationRequest(
                encode(tandem, prompt), NUM_TOKENS, sampling, seed=seed, draft_tokens=draft_tokens
            )
            for prompt in prompts
            for seed in SEEDS
        ]
        return [router.generate(request, pipelined=True) for request in requests]
    finally:
        router.close()


@pytest.mark.parametrize("fan_out", [2, 6])
@pytest.mark.parametrize("draft_tokens", [1, 3])
def test_seed_exact_output_is_the_same_with_predrafting(
    local_tandem: LocalTandem, draft_tokens: int, fan_out: int
) -> None:
    plain = seeded_run(local_tandem, 0, SEED_EXACT, draft_tokens)
    predrafted = seeded_run(local_tandem, fan_out, SEED_EXACT, draft_tokens)
    assert [r.tokens for r in predrafted] == [r.tokens for r in plain]
    # The default router (running sessions) gives each seed the same tokens, pre-drafting
    # or not.
    running = seeded_run(local_tandem, fan_out, SEED_EXACT, draft_tokens, lockstep=False)
    assert [r.tokens for r in running] == [r.tokens for r in plain]
    assert all(r.stats.predraft_hits == r.stats.predraft_misses == 0 for r in plain)
    assert sum(r.stats.predraft_hits for r in predrafted) > 0
    # The seeds differ in output: the equality is not the same text every time.
    assert len({r.tokens for r in plain}) == len(plain)
    # Every branch's fork is released. A request no longer waits for branches still being
    # drafted when it ends (the drafter finishes them on its own): their forks go once those
    # tasks end, soon after.
    runner = local_tandem.drafter._runner
    assert eventually(lambda: runner.sequences() == ()), runner.sequences()


def eventually(condition: Callable[[], bool], within_s: float = 30.0) -> bool:
    """Whether `condition` holds, now or before `within_s` has passed (polled)."""
    until = time.monotonic() + within_s
    while not condition():
        if time.monotonic() >= until:
            return False
        time.sleep(0.01)
    return True
