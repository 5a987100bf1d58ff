"""The router loop in-process: lossless greedy for every K, exact sampling, stops and streams.

Two routers over the same tiny pair: the tandem's own, whose verifier sessions run (the
verifier takes the target's own tokens while no block of the router's is there), and the
`lockstep` one (tests/conftest.py), whose every token goes through a posted block. Output is
the same on both; counts of drafted, accepted and pre-drafted tokens are taken on lockstep
routers, where drafted tokens decide every position (the in-process tiny drafter is no faster
than its verifier: with running sessions its blocks mostly come after the verifier took those
tokens alone)."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from cluster.local import InProcess, LocalTandem, local_router, text_decoder
from cluster.metrics.catalog import DRAFTER_DEGRADED
from cluster.metrics.recorder import TandemMetrics
from cluster.metrics.sinks import MemorySink, series
from cluster.routing.request import FinishReason, GenerationRequest
from cluster.routing.router import Router
from cluster.routing.session_events import SessionEvents
from cluster.routing.speculation_gate import SpeculationGate
from cluster.routing.waits import Wait, Waits
from cluster.runtime import tiny
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.runtime.errors import (
    InvalidArgumentError,
    ReplicaUnavailableError,
    StaleBaseError,
    TandemError,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.predraft import PreDraft
from cluster.runtime.sampling_params import SamplingParams
from drafter.config import DrafterConfig, NgramConfig
from drafter.drafter import Drafter
from tests.cluster.routing.fake_ports import Answer, Wrapper
from tests.cluster.routing.lockstep_routers import HeldVerifier
from tests.cluster.routing.stepping import OpensOnSteps
from tests.conftest import CODE_PROMPT, MAX_TOKENS, PROMPTS, encode


@pytest.fixture(params=["running", "lockstep"])
def router(request: pytest.FixtureRequest, local_tandem: LocalTandem, lockstep: Router) -> Router:
    """The tandem's router (its verifier sessions run), then the `lockstep` one."""
    return local_tandem.router if request.param == "running" else lockstep


def _router_over(
    local_tandem: LocalTandem,
    drafter: Any,
    verifier: Any = None,
    **options: Any,
) -> Router:
    """A router over `drafter` and `verifier` (ports; by default the tandem's verifier), with
    the tandem's decoding and `options` (`RouterOptions`)."""
    return Router(
        InProcess(local_tandem.verifier) if verifier is None else verifier,
        drafter,
        local_tandem.router._decode,
        local_tandem.router._eos_token_ids,
        **options,
    )


def test_target_only_equals_hugging_face_generate(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    model = local_tandem.verifier._target.model
    for prompt, tokens in target_only.items():
        ids = torch.tensor([encode(local_tandem, prompt)])
        with torch.inference_mode():
            reference = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        assert list(tokens) == reference[0, ids.shape[1] :].tolist(), prompt


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("draft_tokens", range(1, 9))
def test_greedy_speculation_is_lossless(
    local_tandem: LocalTandem,
    router: Router,
    target_only: dict[str, tuple[int, ...]],
    draft_tokens: int,
    pipelined: bool,
) -> None:
    drafted = accepted = 0
    for prompt, expected in target_only.items():
        request = GenerationRequest(
            encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=draft_tokens
        )
        result = router.generate(request, pipelined=pipelined)
        assert result.tokens == expected, prompt
        drafted += result.stats.num_drafted
        accepted += result.stats.num_accepted
    if not router.verifier_advances:
        # Both paths ran: some drafts accepted, some rejected.
        assert 0 < accepted < drafted
    assert local_tandem.verifier.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0


class _Recording(Wrapper):
    """A verifier port that records every block posted to it with its answer (a lockstep
    router's: its sessions take no step alone)."""

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        self.posted: dict[tuple[str, int], DraftBlock] = {}
        self.answers: list[tuple[DraftBlock, Answer]] = []

    def post(
        self,
        session_id: str,
        block: DraftBlock,
        defer_bonus: bool,
        events: SessionEvents,
        post_id: int,
    ) -> None:
        self.posted[session_id, post_id] = block
        super().post(session_id, block, defer_bonus, events, post_id)

    def hand(self, session_id: str, post_id: int | None, answer: Answer) -> Answer | None:
        assert post_id is not None, "a lockstep session takes no step alone"
        self.answers.append((self.posted[session_id, post_id], answer))
        return answer


class _DraftSizes(Wrapper):
    """A drafter port that counts the tokens its draft calls drafted."""

    def __init__(self, drafter: Drafter) -> None:
        super().__init__(drafter)
        self.drafted = 0

    def draft(self, *args: Any) -> Waits[DraftBlock]:
        block = yield from super().draft(*args)
        self.drafted += len(block.tokens)
        return block


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_stats_add_up(local_tandem: LocalTandem, pipelined: bool) -> None:
    """A lockstep router, its verifier holding a block whose bonus is deferred until the block
    drafted ahead of it is posted (`HeldVerifier`, so that pipelined blocks are verified ahead,
    or dropped): the request's counters add up to the verdicts the verifier gave."""
    verifier = _Recording(HeldVerifier(local_tandem.verifier))
    drafter = _DraftSizes(local_tandem.drafter)
    router = _router_over(local_tandem, drafter, verifier, verifier_advances=False)
    result = router.generate(
        GenerationRequest(encode(local_tandem, CODE_PROMPT), 30, draft_tokens=4),
        pipelined=pipelined,
    )
    stats = result.stats
    assert len(result.tokens) == 30
    assert all(isinstance(verdict, Verdict) for _, verdict in verifier.answers)  # no error
    answers = [(block, v) for block, v in verifier.answers if isinstance(v, Verdict)]
    passes = [(block, verdict) for block, verdict in answers if not verdict.dropped]
    dropped = [block for block, verdict in answers if verdict.dropped]
    assert stats.num_verify_passes == len(passes)
    # A verify pass emits its accepted drafts plus one token of the target's own, unless it
    # deferred that token to the block drafted ahead of it.
    for _, verdict in passes:
        assert len(verdict.tokens) == verdict.num_accepted + (not verdict.bonus_deferred)
    assert sum(len(verdict.tokens) for _, verdict in passes) == 30
    deferred = sum(verdict.bonus_deferred for _, verdict in passes)
    # Accepted: the passes' accepted drafts, and the drafted tokens the history already held
    # when a block verified ahead came (matched by the verifier, or cut off in the router).
    verified_accepted = sum(verdict.num_accepted for _, verdict in passes)
    matched = stats.num_accepted - verified_accepted
    assert matched >= sum(verdict.num_matched for _, verdict in passes)
    # So the pass count and the accepted drafts add up to the tokens, less what passes ahead
    # took over: a deferred bonus token, or a token matched. Each block verified ahead (a
    # pipeline hit) took over one; each dropped (at the verifier, or stale in the router) is a
    # miss.
    assert stats.num_accepted + stats.num_verify_passes - deferred - matched == 30
    assert stats.pipeline_hits >= sum(bool(block.assumed) for block, _ in passes)
    assert stats.pipeline_hits <= deferred + matched
    assert stats.pipeline_misses >= len(dropped) and all(block.assumed for block in dropped)
    # Every drafted token is counted once, posted or not, and no block is longer than 4.
    posted = sum(len(block.tokens) for block, _ in answers)
    assert posted <= stats.num_drafted <= drafter.drafted <= 4 * drafter.calls["draft"]
    # Per-position counters add up to the verified blocks' totals and never rise with the
    # position.
    assert sum(stats.drafted_by_position) == sum(len(block.tokens) for block, _ in passes)
    assert sum(stats.accepted_by_position) == verified_accepted + sum(
        verdict.num_matched for _, verdict in passes
    )
    assert stats.accepted_by_position == sorted(stats.accepted_by_position, reverse=True)
    assert result.finish_reason is FinishReason.LENGTH
    assert result.num_prompt_tokens == len(CODE_PROMPT)
    if pipelined:
        assert stats.pipeline_hits > 0 and stats.pipeline_misses > 0
    else:
        # Nothing drafted ahead: every pass emits its accepted drafts and one token, and every
        # drafted token was verified.
        assert stats.pipeline_hits == stats.pipeline_misses == deferred == matched == 0
        assert stats.num_accepted + stats.num_verify_passes == 30
        assert not dropped and stats.num_drafted == posted == drafter.drafted


def test_stream_yields_what_generate_returns(local_tandem: LocalTandem) -> None:
    # Seed-exact: the output is the seed's whichever tokens the running session took alone (a
    # rejection-rule sample depends on the lengths of the blocks verified, which vary from run
    # to run with sessions that run).
    request = GenerationRequest(
        encode(local_tandem, PROMPTS[2]),
        25,
        SamplingParams(temperature=0.9, seed_exact=True),
        seed=5,
    )
    chunks = list(local_tandem.router.stream(request))
    result = local_tandem.router.generate(request)
    assert tuple(t for c in chunks for t in c.tokens) == result.tokens
    assert "".join(c.text for c in chunks) == result.text
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1].finish_reason is result.finish_reason


def test_closing_a_stream_frees_both_sessions(local_tandem: LocalTandem) -> None:
    stream = local_tandem.router.stream(GenerationRequest(encode(local_tandem, CODE_PROMPT), 50))
    next(stream)
    assert local_tandem.verifier.stats().num_sessions == 1
    assert local_tandem.drafter.stats().num_sessions == 1
    stream.close()
    assert local_tandem.verifier.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0


def test_stop_sequence(local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]) -> None:
    prompt = PROMPTS[0]
    full_text = local_tandem.tokenizer.decode(target_only[prompt])
    stop = full_text[10:12]
    cut = full_text.index(stop)
    result = local_tandem.router.generate(
        GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, stop=(stop,), draft_tokens=5)
    )
    assert result.finish_reason is FinishReason.STOP
    assert result.text == full_text[:cut]
    assert result.tokens == target_only[prompt][: len(result.tokens)]


def test_end_of_text_stops_generation(local_tandem: LocalTandem) -> None:
    """Sample hot until some generation draws the end-of-text token: it must end there."""
    router = local_tandem.router
    for seed in range(200):
        request = GenerationRequest(
            (seed % 256,), 60, SamplingParams(temperature=1.5), seed=seed, draft_tokens=3
        )
        result = router.generate(request)
        if result.tokens[-1] == tiny.END_OF_TEXT_ID:
            assert result.finish_reason is FinishReason.STOP
            assert tiny.END_OF_TEXT_ID not in result.tokens[:-1]
            return
    pytest.fail("no sampled generation reached the end-of-text token")


def test_max_tokens_one(local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]) -> None:
    result = local_tandem.router.generate(
        GenerationRequest(encode(local_tandem, PROMPTS[0]), 1, draft_tokens=8)
    )
    assert result.tokens == target_only[PROMPTS[0]][:1]
    assert result.stats.num_drafted == 0


@pytest.mark.parametrize("seed_exact", [False, True], ids=["rejection", "seed-exact"])
def test_seeded_sampling_repeats(
    local_tandem: LocalTandem, lockstep: Router, seed_exact: bool
) -> None:
    """A seed fixes the output under the seed-exact rule on any router; under the rejection
    rule only at the same draft block lengths (docs/architecture.md, invariant 5): there, on a
    lockstep router, whose blocks do not depend on timing (with sessions that run, which
    tokens the verifier takes alone does)."""
    router = local_tandem.router if seed_exact else lockstep

    def run(seed: int) -> tuple[int, ...]:
        sampling = SamplingParams(temperature=1.0, seed_exact=seed_exact)
        request = GenerationRequest(encode(local_tandem, CODE_PROMPT), 30, sampling, seed=seed)
        return router.generate(request).tokens

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_concurrent_requests_in_process_are_exact(
    local_tandem: LocalTandem, router: Router, target_only: dict[str, tuple[int, ...]]
) -> None:
    """One router, drafter and verifier shared by 8 threads: components serialise their calls."""

    def run(prompt: str) -> tuple[int, ...]:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        return router.generate(request).tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, PROMPTS))
    assert results == [target_only[p] for p in PROMPTS]
    assert local_tandem.verifier.stats().num_sessions == 0


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_drafts_cut_short_by_confidence_stay_exact(
    local_tandem: LocalTandem,
    lockstep: Router,
    tiny_draft: LoadedModel,
    target_only: dict[str, tuple[int, ...]],
    pipelined: bool,
    advances: bool,
) -> None:
    unsure = Drafter(tiny_draft, DrafterConfig(min_confidence=0.5))
    router = local_router(
        local_tandem.verifier, unsure, local_tandem.target, verifier_advances=advances
    )
    drafted = drafted_in_full = 0
    try:
        for prompt in PROMPTS[:4]:
            request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=6)
            result = router.generate(request, pipelined=pipelined)
            assert result.tokens == target_only[prompt], prompt
            drafted += result.stats.num_drafted
            if not advances:
                full = lockstep.generate(request, pipelined=pipelined)
                drafted_in_full += full.stats.num_drafted
    finally:
        router.close()
        unsure.close()
    if not advances:  # counted where every token goes through a drafted block
        assert 0 < drafted < drafted_in_full  # some blocks were cut short


def test_a_consumer_that_leaves_while_the_verifier_opens_leaves_no_session(
    local_tandem: LocalTandem,
) -> None:
    """Driven as waits, a request's consumer may leave at any wait, the verifier's open among
    them: the open ends, then both sessions close (none is left to its TTL)."""
    verifier = OpensOnSteps(local_tandem.verifier)
    router = _router_over(local_tandem, InProcess(local_tandem.drafter), verifier)
    try:
        request = GenerationRequest(encode(local_tandem, CODE_PROMPT), 50, draft_tokens=4)
        steps = router.stream_waits(request)
        first = next(steps)
        assert isinstance(first, Wait) and not first.future.done()  # the open, in flight
        threading.Timer(0.05, verifier.released.set).start()
        steps.close()  # the consumer leaves before the verifier has opened
    finally:
        router.close()
        verifier.settle()
    assert local_tandem.verifier.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0


def test_first_token_does_not_wait_for_the_drafter(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    """The default router: the verifier's session runs from its open on, while the drafter's
    still opens (its prefill running)."""
    prompt, expected = next(iter(target_only.items()))
    drafter = OpensOnSteps(local_tandem.drafter)
    router = _router_over(local_tandem, drafter)
    try:
        stream = router.stream(GenerationRequest(encode(local_tandem, prompt), 12, draft_tokens=4))
        first = next(stream)  # would block (and time out) if it waited for the drafter
        # One chunk per batch of the session's reports: its first token, or the first few if
        # they came before the router read them.
        assert first.tokens and first.tokens == expected[: len(first.tokens)]
        assert len(drafter.opening) == 1 and not drafter.opening[0].done()
        drafter.released.set()
        rest = [t for chunk in stream for t in chunk.tokens]
        assert tuple(first.tokens) + tuple(rest) == expected[:12]
    finally:
        drafter.released.set()
        router.close()
        drafter.settle()
    assert local_tandem.drafter.stats().num_sessions == 0
    assert local_tandem.verifier.stats().num_sessions == 0


def _router_counting(local_tandem: LocalTandem, drafter: Any) -> tuple[Router, MemorySink]:
    sink = MemorySink()
    return _router_over(local_tandem, drafter, metrics=TandemMetrics(sink)), sink


def test_a_drafter_that_fails_to_open_leaves_the_request_to_the_target_alone(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    prompt, expected = next(iter(target_only.items()))
    drafter = OpensOnSteps(local_tandem.drafter, error=RuntimeError("drafter replica lost"))
    drafter.released.set()
    router, sink = _router_counting(local_tandem, drafter)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), 12, draft_tokens=4)
        assert router.generate(request).tokens == expected[:12]
    finally:
        router.close()
        drafter.settle()
    assert sink.counters[series(DRAFTER_DEGRADED, {"cause": "internal"})] == 1
    assert local_tandem.verifier.stats().num_sessions == 0


class _FailingDrafter(Wrapper):
    """A drafter whose draft calls fail with `error` from the `after`-th call on."""

    def __init__(self, drafter: Drafter, error: Exception, after: int) -> None:
        super().__init__(drafter)
        self._error = error
        self._after = after

    def draft(self, *args: Any) -> Waits[DraftBlock]:
        if self.calls["draft"] + 1 >= self._after:
            self.calls["draft"] += 1
            raise self._error
        return (yield from super().draft(*args))


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (TandemError("the drafter's engine stopped"), "internal"),
        (
            InvalidArgumentError("block.tokens[0] = -1 is outside the vocabulary"),
            "invalid_argument",
        ),
        (StaleBaseError("session has committed length 9"), "failed_precondition"),
        (RuntimeError("a bug"), "internal"),
    ],
)
@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_any_drafter_error_mid_request_degrades_to_the_target_alone(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    error: Exception,
    cause: str,
    pipelined: bool,
) -> None:
    prompt, expected = next(iter(target_only.items()))
    drafter = _FailingDrafter(local_tandem.drafter, error, after=3)
    router, sink = _router_counting(local_tandem, drafter)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), 24, draft_tokens=3)
        result = router.generate(request, pipelined=pipelined)
    finally:
        router.close()
    assert result.tokens == expected[:24]
    # No call after the failure: drafting stopped for the request.
    assert drafter.calls["draft"] == 3
    assert sink.counters[series(DRAFTER_DEGRADED, {"cause": cause})] == 1
    assert local_tandem.drafter.stats().num_sessions == 0
    assert local_tandem.verifier.stats().num_sessions == 0


@pytest.mark.parametrize(
    ("temperature", "pipelined"), [(0.0, True), (1.0, False)], ids=["greedy", "sampled"]
)
def test_long_generation_text_is_the_full_decode_from_short_windows(
    local_tandem: LocalTandem, temperature: float, pipelined: bool
) -> None:
    """Hundreds of tokens of the tiny pair (byte tokens: characters split across rounds, bytes
    that never decode), prompt lookup on: the text is the decode of all the tokens, and no round
    decodes more than a few rounds' tokens (a full re-decode reaches them all)."""
    decode_all = text_decoder(local_tandem.tokenizer)
    decoded: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        decoded.append(len(ids))
        return decode_all(ids)

    router = Router(InProcess(local_tandem.verifier), InProcess(local_tandem.drafter), decode,
                    local_tandem.target.eos_token_ids, ngram=NgramConfig(enabled=True))  # fmt: skip
    prompt = encode(local_tandem, "Café ☕ crème brûlée: ")
    # Seed-exact, so that the sampled text (and its length) is the seed's however the running
    # session's steps and the blocks interleave.
    sampling = SamplingParams(temperature, seed_exact=temperature > 0)
    request = GenerationRequest(prompt, 300, sampling, seed=1, draft_tokens=4)
    try:
        result = router.generate(request, pipelined=pipelined)
    finally:
        router.close()
    assert len(result.tokens) >= 100 and result.text == decode_all(result.tokens)
    assert max(decoded) <= 40


class _GateSpy:
    """What a router's speculation gate is told: its own methods wrapped on the instance (the
    router and its loop both hold the gate)."""

    def __init__(self, gate: SpeculationGate, monkeypatch: pytest.MonkeyPatch) -> None:
        self.told: list[str] = []
        self.tokens = 0
        started, ended, committed = gate.request_started, gate.request_ended, gate.committed

        def request_started() -> None:
            self.told.append("started")
            started()

        def request_ended() -> None:
            self.told.append("ended")
            ended()

        def committed_tokens(tokens: int) -> None:
            self.tokens += tokens
            committed(tokens)

        monkeypatch.setattr(gate, "request_started", request_started)
        monkeypatch.setattr(gate, "request_ended", request_ended)
        monkeypatch.setattr(gate, "committed", committed_tokens)


def test_only_requests_that_may_speculate_count_in_the_speculation_gate(
    local_tandem: LocalTandem, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A target-only request commits as much whichever mode the gate picks: counted, it would
    # blur the comparison (a load test's target-only phase would decide the next phase's mode).
    router = local_router(local_tandem.verifier, local_tandem.drafter, local_tandem.target)
    gate = _GateSpy(router.gate, monkeypatch)
    prompt = encode(local_tandem, CODE_PROMPT)
    router.generate(GenerationRequest(prompt, 6, draft_tokens=0))
    assert gate.told == [] and gate.tokens == 0
    router.generate(GenerationRequest(prompt, 6, draft_tokens=3))
    assert gate.told == ["started", "ended"]
    assert gate.tokens == 6


def _hold_gate(gate: SpeculationGate, held: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Make `gate` hold the target alone for its first `held` rounds (the rounds that ask it
    whether to speculate), then let them speculate."""
    rounds = itertools.count(1)
    monkeypatch.setattr(gate, "holds_target", lambda: held > 0)
    monkeypatch.setattr(gate, "speculate", lambda: next(rounds) > held)


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
@pytest.mark.parametrize("held", [100, 3], ids=["held-throughout", "then-speculating"])
def test_a_request_started_while_the_gate_holds_the_target_opens_its_drafter_only_to_draft(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    monkeypatch: pytest.MonkeyPatch,
    held: int,
    advances: bool,
) -> None:
    prompt, expected = next(iter(target_only.items()))
    drafter = Wrapper(local_tandem.drafter)
    router = _router_over(local_tandem, drafter, verifier_advances=advances)
    _hold_gate(router.gate, held, monkeypatch)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), 16, draft_tokens=3)
        result = router.generate(request)
    finally:
        router.close()
    assert result.tokens == expected[:16]  # lossless either way
    opened, closed = drafter.calls["open"], drafter.calls["close"]
    if held > 16:  # never drafted: no session was opened, so none was closed
        assert opened == closed == 0 and result.stats.num_drafted == 0
    elif advances:
        # A running session commits tokens without the router: on a loaded host it may end the
        # request before a fourth round asks the gate. A session opened is always closed.
        assert opened == closed <= 1
    else:  # opened on the prompt at its first speculating round, caught up, closed, and every
        # round's block is verified: the drafted ones too
        assert opened == closed == 1 and result.stats.num_drafted > 0
    assert local_tandem.drafter.stats().num_sessions == 0
    assert local_tandem.verifier.stats().num_sessions == 0


def _predrafting_router(
    local_tandem: LocalTandem, drafter: Any, fan_out: int, advances: bool = False
) -> Router:
    """A router over `drafter` that pre-drafts up to `fan_out` branches, lockstep unless
    `advances`."""
    return _router_over(local_tandem, drafter, predraft_fan_out=fan_out, verifier_advances=advances)


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
@pytest.mark.parametrize("fan_out", [1, 8])
@pytest.mark.parametrize("draft_tokens", [1, 3, 8])
def test_greedy_with_outcome_keyed_predrafting_is_lossless(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    draft_tokens: int,
    fan_out: int,
    advances: bool,
) -> None:
    """Pipelined rounds that pre-draft the likely outcomes of each verify pass: the output is
    the target's alone, and (counted on a lockstep router) both hits (a branch verified next at
    once) and misses happen."""
    router = _predrafting_router(local_tandem, InProcess(local_tandem.drafter), fan_out, advances)
    hits = misses = 0
    try:
        for prompt, expected in target_only.items():
            request = GenerationRequest(
                encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=draft_tokens
            )
            result = router.generate(request, pipelined=True)
            assert result.tokens == expected, prompt
            stats = result.stats
            hits, misses = hits + stats.predraft_hits, misses + stats.predraft_misses
            if not advances:
                # A pre-drafted round commits its whole verdict, the bonus included.
                assert stats.num_accepted + stats.num_verify_passes == len(result.tokens)
                assert stats.pipeline_hits == stats.pipeline_misses == 0
    finally:
        router.close()
    if not advances:
        assert hits > 0 and misses > 0
    assert local_tandem.verifier.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0
    # Every branch's fork was released with it.
    _wait_for_no_branch(local_tandem)


def _predrafting_once(local_tandem: LocalTandem, drafter: Any) -> Any:
    """The first prompt's result through a lockstep router over `drafter` that pre-drafts up
    to 4."""
    router = _predrafting_router(local_tandem, drafter, 4)
    try:
        request = GenerationRequest(encode(local_tandem, PROMPTS[0]), MAX_TOKENS, draft_tokens=4)
        return router.generate(request, pipelined=True)
    finally:
        router.close()


def _wait_for_no_branch(local_tandem: LocalTandem) -> None:
    """Assert every branch's fork is released: a branch still drafting when its session
    closed releases its fork as it ends."""
    local_tandem.drafter.engine.call(lambda: None)  # after every task queued before it
    deadline = time.monotonic() + 10
    while local_tandem.drafter._runner.sequences() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert local_tandem.drafter._runner.sequences() == ()


def test_a_predraft_hit_is_verified_without_asking_the_drafter_again(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    drafter = Wrapper(local_tandem.drafter)
    result = _predrafting_once(local_tandem, drafter)
    assert result.tokens == target_only[PROMPTS[0]]
    stats = result.stats
    assert stats.predraft_hits > 0
    # Every verify pass's block came from a draft call, a hit, or neither (an empty block, the
    # target's own token): hits cost no draft call. (A lockstep round waits for its drafter:
    # no pass of the target alone opens the request any more.)
    assert drafter.calls["draft"] + stats.predraft_hits <= stats.num_verify_passes


@pytest.mark.parametrize("advances", [False, True], ids=["lockstep", "running"])
def test_closing_a_predrafting_stream_leaves_no_session_or_branch(
    local_tandem: LocalTandem, advances: bool
) -> None:
    router = _predrafting_router(local_tandem, InProcess(local_tandem.drafter), 6, advances)
    try:
        request = GenerationRequest(encode(local_tandem, CODE_PROMPT), 60, draft_tokens=4)
        stream = router.stream(request, pipelined=True)
        for _ in range(3):  # past the first rounds, into pre-drafted ones
            next(stream)
        stream.close()
    finally:
        router.close()
    assert local_tandem.verifier.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0
    # A branch still drafting when its session closed releases its fork as it ends.
    _wait_for_no_branch(local_tandem)


class _RefusesPredrafts(Wrapper):
    """A drafter that refuses every pre-draft, as a replica from before pre-drafting does."""

    def predraft(self, *args: Any, **kwargs: Any) -> Waits[list[PreDraft]]:
        self.calls["predraft"] += 1
        raise InvalidArgumentError("a frame entry must carry a call")
        yield  # pragma: no cover - steps, as every port call is


def test_a_drafter_that_refuses_predrafts_keeps_the_request_exact_and_stops_the_asking(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    drafter = _RefusesPredrafts(local_tandem.drafter)
    result = _predrafting_once(local_tandem, drafter)
    assert result.tokens == target_only[PROMPTS[0]]
    # Asked once, then never again; the drafter was not failed over for it, and kept drafting
    # from the view it had before the refused call.
    assert drafter.calls["predraft"] == 1
    assert result.stats.drafters == ["drafter"]
    assert drafter.calls["draft"] > 1 and result.stats.num_accepted > 0
    assert local_tandem.drafter.stats().num_sessions == 0


class _PredraftsThenFails(Wrapper):
    """A drafter whose replica is lost during its third pre-draft."""

    def predraft(self, *args: Any, **kwargs: Any) -> Waits[list[PreDraft]]:
        if self.calls["predraft"] == 2:
            self.calls["predraft"] += 1
            raise ReplicaUnavailableError("the drafter replica is gone")
        return (yield from super().predraft(*args, **kwargs))


def test_a_drafter_lost_while_predrafting_drops_its_branches_and_stays_exact(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    """The round whose pre-draft failed hits nothing (its cache is gone with the drafter), the
    request fails over (here to the target alone: no spare), and no session or fork is left."""
    drafter = _PredraftsThenFails(local_tandem.drafter)
    result = _predrafting_once(local_tandem, drafter)
    assert result.tokens == target_only[PROMPTS[0]]
    stats = result.stats
    assert drafter.calls["predraft"] == 3  # never asked again after the loss
    # The two pre-drafted rounds before the loss count; the lost one drafted nothing to hit.
    assert stats.predraft_hits + stats.predraft_misses == 2
    assert local_tandem.drafter.stats().num_sessions == 0
    assert local_tandem.verifier.stats().num_sessions == 0
    _wait_for_no_branch(local_tandem)
