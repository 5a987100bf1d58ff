"""Seed-exact sampling end to end: a seeded request's tokens are plain Hugging Face generation's.

The promise of `SamplingParams.seed_exact` (`cluster.runtime.gumbel`): a sampled request's
output is a function of its prompt, seed, sampling settings and target model alone. The ground
truth is `cluster.tools.baselines.hf_reference.reference_generate`: `model.generate` over the
target with
a logits processor applying the same noise, with no drafter, engine, batching or pipelining.
Here the in-process router's output must equal it token for token under every drafter kind (the
tiny draft model, its int8 and int8-dynamic quantizations, its trimmed vocabulary, prompt
lookup alone or before the model, the adaptive block length, no drafter at all), every block
length 0..8, serial and pipelined rounds, on the default router (its verifier sessions run: they
take the target's own tokens whenever no block is there, so that in-process drafted tokens
rarely decide anything) and on a lockstep one (`verifier_advances` off: every token, the first
included, through a posted block, a pipelined block's successor verified ahead of its verdict:
`tests.cluster.routing.lockstep_routers`), a request alone and among 16 concurrent ones that share
the engines' steps, and across a failover to a spare replica or to the target alone.

Exact equality has no statistical bound to choose: a single differing token fails. It is not
vacuous: each case asserts that drafts were made and that some were accepted and some rejected
(a rejected draft is where a wrong rule would show), and the sanity checks below show that the
rejection rule, given the same request, gives other tokens, and other tokens again when only its
block length changes: equality across drafters is what seed-exact adds.

The un-slow cases cover two sampling settings at block lengths 0, 1, 4 and 8 in three round
modes (serial and pipelined lockstep, pipelined on the default router; about two minutes on a
busy 2-core box, all tests of the file); the slow sweep adds every other block length, two
more settings and another seed.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from cluster.local import LocalTandem, local_router
from cluster.routing.draft_length_config import DraftLengthConfig
from cluster.routing.request import GenerationRequest, GenerationResult
from cluster.routing.router import Router
from cluster.runtime.model_spec import TINY_DRAFT, ModelSpec
from cluster.runtime.models import LoadedModel, load_model
from cluster.runtime.sampling import logits_to_probs
from cluster.runtime.sampling_params import SamplingParams
from cluster.tools.baselines.hf_reference import reference_generate
from drafter.config import NgramConfig
from drafter.drafter import Drafter
from tests.cluster.routing.fake_ports import Dying
from tests.cluster.routing.lockstep_routers import Routers, held_lockstep_router, router_pair
from tests.cluster.routing.test_failover import Pool
from tests.conftest import CODE_PROMPT, PROMPTS, encode
from verifier.verifier import Verifier

MAX_TOKENS = 32
LOOKUP = NgramConfig(enabled=True, max_ngram=4, min_ngram=2)

SAMPLINGS = {
    "t0.7": SamplingParams(temperature=0.7, seed_exact=True),
    "t1-top-p0.9": SamplingParams(temperature=1.0, top_p=0.9, seed_exact=True),
}
SLOW_SAMPLINGS = {
    **SAMPLINGS,
    "t1": SamplingParams(temperature=1.0, seed_exact=True),
    "t0.8-top-k20-top-p0.8": SamplingParams(temperature=0.8, top_k=20, top_p=0.8, seed_exact=True),
}
Run = tuple[int, bool, bool]
"""(draft_tokens, pipelined, lockstep) of one generation: `lockstep` on the kind's lockstep
router, else on its default one (verifier sessions run)."""
RUNS: list[Run] = [
    (0, False, False),
    *((k, pipelined, lockstep) for k in (1, 4, 8) for pipelined, lockstep in
      [(False, True), (True, False), (True, True)]),
]  # fmt: skip
"""The un-slow runs of each case: no drafts, then short, middling and the longest blocks, in
serial lockstep rounds (the first token drafted too), pipelined ones on the default router
(the first tokens the target's alone) and pipelined lockstep ones."""
KINDS = ["draft", "int8", "int8-dynamic", "trimmed", "lookup", "lookup+draft", "adaptive", "none"]
"""Drafter kinds: what proposes a request's blocks (`routers`)."""
LOOKUP_KINDS = ("lookup", "lookup+draft")


class Reference:
    """`reference_generate` on the tiny target, each request computed once."""

    def __init__(self, target: LoadedModel) -> None:
        self._target = target
        self._cache: dict[tuple[Any, ...], tuple[int, ...]] = {}

    def __call__(
        self, prompt: tuple[int, ...], sampling: SamplingParams, seed: int, max_tokens: int
    ) -> tuple[int, ...]:
        key = (prompt, sampling, seed, max_tokens)
        if key not in self._cache:
            self._cache[key] = reference_generate(
                self._target, prompt, max_tokens, sampling, seed, sorted(self._target.eos_token_ids)
            )
        return self._cache[key]


@pytest.fixture(scope="module")
def reference(tiny_target: LoadedModel) -> Reference:
    return Reference(tiny_target)


@pytest.fixture(scope="module")
def quantized_drafters() -> Iterator[dict[str, Drafter]]:
    drafters = {
        q: Drafter(load_model(ModelSpec(TINY_DRAFT, device="cpu", quantization=q)))
        for q in ("int8", "int8-dynamic")
    }
    yield drafters
    for drafter in drafters.values():
        drafter.close()


@pytest.fixture(scope="module")
def routers(
    local_tandem: LocalTandem, trimmed_tandem: LocalTandem, quantized_drafters: dict[str, Drafter]
) -> Iterator[dict[str, Routers]]:
    """The routers of each drafter kind, over the session's target verifier (the trimmed
    draft's over its own pair's)."""
    verifier, drafter, target = local_tandem.verifier, local_tandem.drafter, local_tandem.target
    built = {
        "draft": router_pair(verifier, drafter, target),
        "int8": router_pair(verifier, quantized_drafters["int8"], target),
        "int8-dynamic": router_pair(verifier, quantized_drafters["int8-dynamic"], target),
        "trimmed": router_pair(trimmed_tandem.verifier, trimmed_tandem.drafter, target),
        "lookup": router_pair(verifier, None, target, ngram=LOOKUP),
        "lookup+draft": router_pair(verifier, drafter, target, ngram=LOOKUP),
        "adaptive": router_pair(
            verifier, drafter, target, draft_length=DraftLengthConfig(enabled=True)
        ),
        "none": router_pair(verifier, None, target),
    }
    yield built
    for pair in built.values():
        pair.close()


@dataclass
class Tally:
    drafted: int = 0
    accepted: int = 0
    pipeline_hits: int = 0
    runs: int = 0


def first_difference(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))


def check_equal_to_reference(
    routers: Routers,
    reference: Reference,
    prompt: tuple[int, ...],
    sampling: SamplingParams,
    seeds: tuple[int, ...],
    runs: list[Run],
) -> Tally:
    """Generate each of `runs` for each seed through `routers`; fail naming each run whose
    tokens differ from the reference (and where). Returns the summed speculation counters."""
    tally = Tally()
    mismatches = []
    for seed in seeds:
        expected = reference(prompt, sampling, seed, MAX_TOKENS)
        for k, pipelined, lockstep in runs:
            request = GenerationRequest(prompt, MAX_TOKENS, sampling, seed=seed, draft_tokens=k)
            result = routers(lockstep).generate(request, pipelined=pipelined)
            if result.tokens != expected:
                at = first_difference(result.tokens, expected)
                mode = "lockstep" if lockstep else "running"
                mismatches.append(f"seed={seed} k={k} pipelined={pipelined} {mode}: {at}")
            tally.drafted += result.stats.num_drafted
            tally.accepted += result.stats.num_accepted
            tally.pipeline_hits += result.stats.pipeline_hits
            tally.runs += 1
    assert not mismatches, "differs from reference_generate at token: " + "; ".join(mismatches)
    return tally


@pytest.fixture(scope="module")
def recurring_prompt(tiny_target: LoadedModel) -> tuple[int, ...]:
    """`x = T; x = T; x = T; x = ` for the byte T the target most likes to see repeated there:
    prompt lookup proposes T (and what followed it) at once, and the target draws T often
    enough (p about 0.6 here) that looked-up tokens are accepted as well as rejected."""
    head, tail = tuple(b"x = "), tuple(b"; x = ")
    candidates = torch.tensor([[*head, *((t, *tail) * 3)] for t in range(256)])  # [256, 31]
    with torch.inference_mode():
        last = tiny_target.model(candidates).logits[:, -1]  # [256, vocab]
    probs = logits_to_probs(last, SamplingParams(temperature=1.0, top_p=0.9))
    best = int(probs[torch.arange(256), torch.arange(256)].argmax())
    return tuple(candidates[best].tolist())


def assert_speculated(kind: str, tally: Tally) -> None:
    """Drafts were made (by lookup alone for `lookup`), some accepted and some rejected, and
    a drafter model drafted ahead in pipelined rounds (the lockstep runs see to all of it). The
    adaptive plan picks block lengths (0 included) from measured latencies, so whether it
    drafted is not asserted."""
    if kind == "none":
        assert tally.drafted == 0
        return
    if kind == "adaptive":
        return
    assert 0 < tally.accepted < tally.drafted, tally
    if kind != "lookup":
        assert tally.pipeline_hits > 0, tally


@pytest.mark.parametrize("sampling_name", list(SAMPLINGS))
@pytest.mark.parametrize("kind", KINDS)
def test_seeded_output_equals_hugging_face_generate(
    routers: dict[str, Routers],
    reference: Reference,
    local_tandem: LocalTandem,
    recurring_prompt: tuple[int, ...],
    kind: str,
    sampling_name: str,
) -> None:
    prompt = recurring_prompt if kind in LOOKUP_KINDS else encode(local_tandem, CODE_PROMPT)
    tally = check_equal_to_reference(
        routers[kind], reference, prompt, SAMPLINGS[sampling_name], seeds=(0,), runs=RUNS
    )
    assert_speculated(kind, tally)


@pytest.mark.slow
@pytest.mark.parametrize("sampling_name", list(SLOW_SAMPLINGS))
@pytest.mark.parametrize("kind", KINDS)
def test_every_block_length_seed_and_setting_equals_hugging_face_generate(
    routers: dict[str, Routers],
    reference: Reference,
    local_tandem: LocalTandem,
    recurring_prompt: tuple[int, ...],
    kind: str,
    sampling_name: str,
) -> None:
    """Block lengths 0..8 in the three round modes of RUNS, another seed, two more
    settings."""
    prompt = recurring_prompt if kind in LOOKUP_KINDS else encode(local_tandem, CODE_PROMPT)
    lengths = range(9) if kind != "none" else (0, 4)
    modes = [(False, True), (True, False), (True, True)]
    runs = [(k, pipelined, lockstep) for k in lengths for pipelined, lockstep in modes]
    tally = check_equal_to_reference(
        routers[kind], reference, prompt, SLOW_SAMPLINGS[sampling_name], (1,), runs
    )
    assert_speculated(kind, tally)


def test_every_prompt_and_the_largest_seed_equal_hugging_face_generate(
    routers: dict[str, Routers], reference: Reference, local_tandem: LocalTandem
) -> None:
    for i, text in enumerate(PROMPTS):
        sampling = list(SAMPLINGS.values())[i % 2]
        check_equal_to_reference(
            routers["draft"],
            reference,
            encode(local_tandem, text),
            sampling,
            seeds=(2**64 - 1 - i,),
            runs=[(3, i % 2 == 0, lockstep) for lockstep in (True, False)],
        )


# --- batched ------------------------------------------------------------------------------------


def run_concurrently(
    router: Router, requests: list[tuple[GenerationRequest, bool]]
) -> list[GenerationResult]:
    """Every request from its own thread, all released at once by a barrier, so that the
    engines batch their steps."""
    results: list[GenerationResult | BaseException | None] = [None] * len(requests)
    barrier = threading.Barrier(len(requests))

    def run(i: int) -> None:
        request, pipelined = requests[i]
        try:
            barrier.wait()
            results[i] = router.generate(request, pipelined=pipelined)
        except BaseException as error:  # reported by the test thread below
            results[i] = error

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for result in results:
        if isinstance(result, BaseException):
            raise result
    return [r for r in results if isinstance(r, GenerationResult)]


def test_sixteen_concurrent_requests_sharing_steps_each_equal_the_reference(
    local_tandem: LocalTandem,
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
    reference: Reference,
) -> None:
    """16 seeded requests (8 prompts, 2 settings, block lengths 0..8, serial and pipelined)
    at once through a lockstep router over fresh replicas (drafted tokens decide: some are
    accepted), then at once through the default one over the same replicas: each equals its
    reference and what it gets alone. The fresh replicas' engine figures show that the steps
    were shared."""
    verifier, drafter = Verifier(tiny_target), Drafter(tiny_draft)
    router = held_lockstep_router(verifier, drafter, tiny_target)
    running = local_router(verifier, drafter, tiny_target)
    samplings = list(SAMPLINGS.values())
    requests = [
        (
            GenerationRequest(
                encode(local_tandem, PROMPTS[i % len(PROMPTS)]),
                MAX_TOKENS,
                samplings[i % 2],
                seed=1000 + i,
                draft_tokens=i % 9,
            ),
            i % 4 < 2,
        )
        for i in range(16)
    ]
    try:
        together = run_concurrently(router, requests)
        verifier_batch = verifier.stats().engine
        drafter_batch = drafter.stats().engine
        together_running = run_concurrently(running, requests)
        alone = [router.generate(request, pipelined=p) for request, p in requests]
    finally:
        router.close()
        running.close()
        verifier.close()
        drafter.close()
    assert verifier_batch is not None and drafter_batch is not None
    assert verifier_batch.max_batch_sequences > 1 and drafter_batch.max_batch_sequences > 1
    results = zip(requests, together, together_running, alone, strict=True)
    for (request, _), batched, batched_running, single in results:
        expected = reference(request.prompt_tokens, request.sampling, request.seed, MAX_TOKENS)
        assert batched.tokens == expected == single.tokens, request.seed
        assert batched_running.tokens == expected, request.seed
    assert sum(r.stats.num_accepted for r in together) > 0


# --- failover -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spares(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> Iterator[tuple[Verifier, Drafter]]:
    verifier, drafter = Verifier(tiny_target), Drafter(tiny_draft)
    yield verifier, drafter
    verifier.close()
    drafter.close()


def over_pool(local_tandem: LocalTandem, pool: Pool, pipelined: bool, lockstep: bool) -> Router:
    """A router over `pool`: a lockstep one (every token through a posted block, the first
    included), or the default one (verifier sessions run)."""
    return Router.over_pool(
        pool,
        local_tandem.router._decode,
        local_tandem.target.eos_token_ids,
        pipelined=pipelined,
        verifier_advances=not lockstep,
    )


MODES = pytest.mark.parametrize("lockstep", [True, False], ids=["lockstep", "running"])
"""A failover test on a lockstep router and on the default one."""


@MODES
@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("calls", [1, 4])
@pytest.mark.parametrize("side", ["verifier", "drafter"])
def test_a_request_that_fails_over_mid_stream_still_equals_the_reference(
    local_tandem: LocalTandem,
    spares: tuple[Verifier, Drafter],
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
    reference: Reference,
    side: str,
    calls: int,
    pipelined: bool,
    lockstep: bool,
) -> None:
    """The replica dies after `calls` calls (its sessions' answers counted as calls); the
    spare takes the session over from the router's committed tokens, and its draws at the
    next positions are the same noise's."""
    spare_verifier, spare_drafter = spares
    component: Verifier | Drafter = (
        Verifier(tiny_target) if side == "verifier" else Drafter(tiny_draft)
    )
    first = Dying(component, calls)
    verifiers = [first, spare_verifier] if side == "verifier" else [local_tandem.verifier]
    drafters = [first, spare_drafter] if side == "drafter" else [local_tandem.drafter]
    router = over_pool(local_tandem, Pool(verifiers, drafters), pipelined, lockstep)
    prompt, sampling = encode(local_tandem, CODE_PROMPT), SAMPLINGS["t1-top-p0.9"]
    try:
        request = GenerationRequest(prompt, MAX_TOKENS, sampling, seed=5 + calls, draft_tokens=3)
        result = router.generate(request)
    finally:
        router.close()
        component.close()
    assert first.refused > 0  # it died while the request ran
    assert result.tokens == reference(prompt, sampling, 5 + calls, MAX_TOKENS)
    if lockstep:  # drafted tokens decided some positions (in-process, running sessions
        assert result.stats.num_accepted > 0  # mostly take them alone before a block comes)


@MODES
@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_a_request_whose_drafter_is_lost_for_good_equals_the_reference(
    local_tandem: LocalTandem,
    tiny_draft: LoadedModel,
    reference: Reference,
    pipelined: bool,
    lockstep: bool,
) -> None:
    """No spare drafter: the request goes on with the target alone, mid-stream."""
    component = Drafter(tiny_draft)
    drafter = Dying(component, calls=3)
    pool = Pool([local_tandem.verifier], [drafter])
    router = over_pool(local_tandem, pool, pipelined, lockstep)
    prompt, sampling = encode(local_tandem, CODE_PROMPT), SAMPLINGS["t0.7"]
    try:
        request = GenerationRequest(prompt, MAX_TOKENS, sampling, seed=21, draft_tokens=4)
        result = router.generate(request)
    finally:
        router.close()
        component.close()
    assert drafter.refused > 0
    if lockstep:  # its blocks decided some positions before it was lost
        assert result.stats.num_accepted > 0
    assert result.stats.num_verify_passes > MAX_TOKENS // 2  # mostly the target alone
    assert result.tokens == reference(prompt, sampling, 21, MAX_TOKENS)


# --- what the rule leaves alone, and what it changes ---------------------------------------------


def test_greedy_requests_are_unaffected_by_the_rule(
    routers: dict[str, Routers],
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    tiny_target: LoadedModel,
) -> None:
    """`seed_exact` on a greedy request changes nothing: argmax needs no noise (on the default
    router and on a lockstep one)."""
    for prompt in PROMPTS[:4]:
        tokens = encode(local_tandem, prompt)
        expected = target_only[prompt]  # greedy target-only output, 40 tokens
        for seed_exact, lockstep in itertools.product((False, True), (False, True)):
            greedy = SamplingParams(seed_exact=seed_exact)
            request = GenerationRequest(tokens, len(expected), greedy, seed=9, draft_tokens=4)
            result = routers["draft"](lockstep).generate(request)
            assert result.tokens == expected, (prompt, seed_exact, lockstep)
        greedy = SamplingParams(seed_exact=True)
        ref = reference_generate(
            tiny_target, tokens, len(expected), greedy, 9, sorted(tiny_target.eos_token_ids)
        )
        assert ref == expected[: len(ref)]
        assert greedy.draws_seed_exact is False


def test_the_rejection_rule_gives_other_tokens_that_depend_on_the_block_length(
    routers: dict[str, Routers], local_tandem: LocalTandem, reference: Reference
) -> None:
    """Sanity: the same seeded request under rejection sampling is another (exact) sample, and
    its tokens change with the block length alone; seed-exact's do not (the tests above). On
    the lockstep router, where drafted tokens decide every position."""
    router = routers["draft"].lockstep
    prompt = encode(local_tandem, CODE_PROMPT)
    seed_exact = SAMPLINGS["t1-top-p0.9"]
    rejection = SamplingParams(temperature=1.0, top_p=0.9)

    def run(sampling: SamplingParams, seed: int, k: int) -> tuple[int, ...]:
        request = GenerationRequest(prompt, MAX_TOKENS, sampling, seed=seed, draft_tokens=k)
        return router.generate(request, pipelined=False).tokens

    seeds = range(6)
    assert any(run(rejection, s, 4) != run(seed_exact, s, 4) for s in seeds)
    assert any(run(rejection, s, 0) != run(rejection, s, 4) for s in seeds)
    assert all(run(seed_exact, s, 4) == reference(prompt, seed_exact, s, MAX_TOKENS) for s in seeds)
