"""Sampled requests that pre-draft follow the target's exact distribution, with and without
Saguaro-style drafting.

Each test runs NUM_REQUESTS seeded requests for PROMPT through the in-process router over the
tiny pair with pre-drafting on (`predraft_fan_out` >= 2, small blocks, pipelined) in lockstep
(`verifier_advances` off: every token through a posted block, the opening round through the
drafter too), so the first verify pass already has branches drafted beside it: its verdict
often hits one (the test asserts hits happen), and that branch's sampled block is verified
next. A hit proposes the second or third token, so the statistic is the joint distribution of
the first NUM_TOKENS tokens.

Statistic (the repository's exact-cells method, as `tests/cluster/serve/test_service_lossless.py`):
the exact P(t1, t2, t3) = p(t1 | prompt) p(t2 | prompt, t1) p(t3 | prompt, t1, t2) from the
target's own probabilities at the request's settings, in cells named by prefixes: every prefix
whose expected count is at least MIN_EXPECTED names a cell holding the samples whose longest
named prefix it is (a thin cell joins its parent's), and `()` the rest. Pearson's chi-square
test against the observed cells; under a lossless sampler the p-value is (asymptotically)
uniform, so a correct pipeline fails with probability ALPHA. The seeds are fixed and greedy
rounds aside everything is seeded, so a run repeats. Power: `test_predraft_negative.py` runs the
same statistic over a pipeline whose cache reports the wrong q for a branch's tokens, and needs
it to fail.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from cluster.local import LocalTandem, local_router
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from drafter.config import DrafterConfig
from drafter.drafter import Drafter
from tests.exact_cells import Prefix, cell_mass, chi_square_p_value

ALPHA = 1e-3
NUM_REQUESTS = 1500
NUM_TOKENS = 3
MIN_EXPECTED = 5.0
PROMPT = tuple(b"def add(a, b):")
SAMPLING = SamplingParams(temperature=1.0)
CONCURRENT_REQUESTS = 16


@dataclass
class Tally:
    """Speculation counters summed over the requests."""

    drafted: int = 0
    accepted: int = 0
    hits: int = 0
    misses: int = 0


def predrafting_router(tandem: LocalTandem, drafter: Drafter | None, fan_out: int) -> Router:
    """A lockstep router (`verifier_advances` off) over `tandem`'s verifier and `drafter`
    (default: `tandem`'s) that pre-drafts `fan_out` branches and drafts the opening round too:
    every token a test looks at is decided by a posted block."""
    return local_router(
        tandem.verifier, drafter or tandem.drafter, tandem.target, predraft_fan_out=fan_out,
        verifier_advances=False,
    )  # fmt: skip


def sample_first_tokens(
    router: Router, draft_tokens: int, max_tokens: int
) -> tuple[list[Prefix], Tally]:
    """The first NUM_TOKENS tokens of NUM_REQUESTS seeded pipelined requests (fewer where one
    ended with an end token), and their counters."""
    requests = [
        GenerationRequest(PROMPT, max_tokens, SAMPLING, seed=seed, draft_tokens=draft_tokens)
        for seed in range(NUM_REQUESTS)
    ]
    with ThreadPoolExecutor(max_workers=CONCURRENT_REQUESTS) as pool:
        results = list(pool.map(lambda r: router.generate(r, pipelined=True), requests))
    tally = Tally()
    for result in results:
        tally.drafted += result.stats.num_drafted
        tally.accepted += result.stats.num_accepted
        tally.hits += result.stats.predraft_hits
        tally.misses += result.stats.predraft_misses
    return [tuple(result.tokens[:NUM_TOKENS]) for result in results], tally


def _next_probs(model: LoadedModel, contexts: Sequence[Prefix]) -> torch.Tensor:
    """`[len(contexts), vocab]` float64: the target's next-token distribution after each
    context (all of one length), as sampled with SAMPLING."""
    with torch.inference_mode():
        logits = model.model(torch.tensor(contexts, device=model.device)).logits[:, -1]
        return logits_to_probs(logits, SAMPLING).double().cpu()


def exact_cells(model: LoadedModel, end_tokens: Iterable[int]) -> dict[Prefix, float]:
    """The test's cells and their exact probabilities (see the module's docstring). A prefix
    that ends in an end token is never extended: generation stops there."""
    ends = frozenset(end_tokens)
    mass: dict[Prefix, float] = {(): 1.0}
    frontier: list[Prefix] = [()]
    for _ in range(NUM_TOKENS):
        open_ = [p for p in frontier if not (p and p[-1] in ends)]
        if not open_:
            break
        rows = (
            _next_probs(model, [(*PROMPT, *p) for p in open_])
            * torch.tensor([mass[p] for p in open_], dtype=torch.float64)[:, None]
        )
        frontier = []
        for prefix, row in zip(open_, rows, strict=True):
            for token in (row * NUM_REQUESTS >= MIN_EXPECTED).nonzero().flatten().tolist():
                frontier.append((*prefix, token))
                mass[frontier[-1]] = float(row[token])
    for length in range(NUM_TOKENS - 1, 0, -1):
        for prefix in [p for p in mass if len(p) == length]:
            if cell_mass(prefix, mass) * NUM_REQUESTS < MIN_EXPECTED:
                del mass[prefix]
    return {prefix: cell_mass(prefix, mass) for prefix in mass}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saguaro", "fan_out", "draft_tokens", "max_tokens"),
    [
        # One-token blocks: the first pass's verdict names t1 (and t2 when t1 is accepted);
        # the hit branch's token proposes the next.
        (None, 4, 1, 4),
        # Two-token blocks: a branch's block is two sampled tokens, their q's reported.
        (None, 2, 2, 5),
        # Saguaro-style drafting: blocks and branches drawn from (and reporting) the damped q'.
        ((0.3, 2), 4, 1, 4),
        ((0.5, 4), 2, 2, 5),
    ],
    ids=["k1-f4", "k2-f2", "saguaro-k1-f4", "saguaro-k2-f2"],
)
def test_predrafted_sampling_follows_the_target(
    local_tandem: LocalTandem,
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
    saguaro: tuple[float, int] | None,
    fan_out: int,
    draft_tokens: int,
    max_tokens: int,
) -> None:
    drafter = None
    if saguaro is not None:
        scale, top = saguaro
        drafter = Drafter(tiny_draft, DrafterConfig(saguaro_scale=scale, saguaro_top=top))
    router = predrafting_router(local_tandem, drafter, fan_out)
    try:
        samples, tally = sample_first_tokens(router, draft_tokens, max_tokens)
    finally:
        router.close()
        if drafter is not None:
            drafter.close()
    assert tally.hits > 0 and tally.misses > 0  # branches were verified, and redrafts done
    assert 0 < tally.accepted < tally.drafted  # both acceptance and rejection paths
    cells = exact_cells(tiny_target, local_tandem.router._eos_token_ids)
    assert chi_square_p_value(samples, cells, MIN_EXPECTED) > ALPHA
