"""The router loop in-process: lossless greedy for every K, exact sampling, stops and streams."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from cluster.local import LocalTandem
from cluster.metrics import DRAFTER_DEGRADED, MemorySink, TandemMetrics, series
from cluster.routing.ports import DrafterPort
from cluster.routing.request import FinishReason, GenerationRequest
from cluster.routing.router import Router
from cluster.routing.speculation_gate import GateConfig, SpeculationGate
from cluster.routing.waits import Wait
from cluster.runtime import tiny
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import (
    InvalidArgumentError,
    ReplicaUnavailableError,
    StaleBaseError,
    TandemError,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling import SamplingParams
from tests.cluster.routing.stepping import OpensOnSteps
from tests.conftest import CODE_PROMPT, MAX_TOKENS, PROMPTS, encode


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
    target_only: dict[str, tuple[int, ...]],
    draft_tokens: int,
    pipelined: bool,
) -> None:
    drafted = accepted = 0
    for prompt, expected in target_only.items():
        request = GenerationRequest(
            encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=draft_tokens
        )
        result = local_tandem.router.generate(request, pipelined=pipelined)
        assert result.tokens == expected, prompt
        drafted += result.stats.num_drafted
        accepted += result.stats.num_accepted
    # Both paths ran: some drafts accepted, some rejected.
    assert 0 < accepted < drafted
    assert local_tandem.verifier.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0


@pytest.mark.parametrize("pipelined", [False, True])
def test_stats_add_up(local_tandem: LocalTandem, pipelined: bool) -> None:
    result = local_tandem.router.generate(
        GenerationRequest(encode(local_tandem, CODE_PROMPT), 30, draft_tokens=4),
        pipelined=pipelined,
    )
    stats = result.stats
    assert len(result.tokens) == 30
    # A verify pass emits its accepted drafts plus one token of the target's own, except when
    # the block was all accepted and a block drafted ahead takes over (a pipeline hit).
    assert stats.num_accepted + stats.num_verify_passes - stats.pipeline_hits == 30
    assert stats.num_drafted <= 4 * stats.num_verify_passes
    # Per-position counters add up to the totals and never rise with the position.
    assert sum(stats.drafted_by_position) == stats.num_drafted
    assert sum(stats.accepted_by_position) == stats.num_accepted
    assert stats.accepted_by_position == sorted(stats.accepted_by_position, reverse=True)
    assert result.finish_reason is FinishReason.LENGTH
    assert result.num_prompt_tokens == len(CODE_PROMPT)
    if pipelined:
        assert stats.pipeline_hits > 0 and stats.pipeline_misses > 0
    else:
        assert stats.pipeline_hits == stats.pipeline_misses == 0


def test_stream_yields_what_generate_returns(local_tandem: LocalTandem) -> None:
    request = GenerationRequest(
        encode(local_tandem, PROMPTS[2]), 25, SamplingParams(temperature=0.9), seed=5
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


def test_seeded_sampling_repeats(local_tandem: LocalTandem) -> None:
    def run(seed: int) -> tuple[int, ...]:
        request = GenerationRequest(
            encode(local_tandem, CODE_PROMPT), 30, SamplingParams(temperature=1.0), seed=seed
        )
        return local_tandem.router.generate(request).tokens

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_concurrent_requests_in_process_are_exact(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    """One router, drafter and verifier shared by 8 threads: components serialise their calls."""

    def run(prompt: str) -> tuple[int, ...]:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        return local_tandem.router.generate(request).tokens

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(run, PROMPTS))
    assert results == [target_only[p] for p in PROMPTS]
    assert local_tandem.verifier.stats().num_sessions == 0


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_drafts_cut_short_by_confidence_stay_exact(
    local_tandem: LocalTandem,
    tiny_draft: LoadedModel,
    target_only: dict[str, tuple[int, ...]],
    pipelined: bool,
) -> None:
    from cluster.local import text_decoder
    from cluster.routing.router import Router
    from drafter.config import DrafterConfig
    from drafter.drafter import Drafter

    unsure = Drafter(tiny_draft, DrafterConfig(min_confidence=0.5))
    router = Router(local_tandem.verifier, unsure, text_decoder(local_tandem.tokenizer),
                    local_tandem.target.eos_token_ids)  # fmt: skip
    drafted = drafted_in_full = 0
    try:
        for prompt in PROMPTS[:4]:
            request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=6)
            result = router.generate(request, pipelined=pipelined)
            assert result.tokens == target_only[prompt], prompt
            drafted += result.stats.num_drafted
            full = local_tandem.router.generate(request, pipelined=pipelined)
            drafted_in_full += full.stats.num_drafted
    finally:
        router.close()
    assert 0 < drafted < drafted_in_full  # some blocks were cut short


class _SlowToOpen:
    """A drafter whose sessions open only when `opened` is set (its prefill still running)."""

    def __init__(self, drafter: DrafterPort, fail: bool = False) -> None:
        self._drafter = drafter
        self._fail = fail
        self.opened = threading.Event()

    def open_session(
        self,
        session_id: str,
        prompt: Sequence[int],
        sampling: SamplingParams,
        seed: int,
        **kwargs: Any,
    ) -> int:
        assert self.opened.wait(timeout=30)
        if self._fail:
            raise RuntimeError("drafter replica lost")
        return self._drafter.open_session(session_id, prompt, sampling, seed)

    def draft(
        self,
        session_id: str,
        base_length: int,
        appended_tokens: Sequence[int],
        num_tokens: int,
        truncate_to: int | None = None,
    ) -> DraftBlock:
        return self._drafter.draft(
            session_id, base_length, appended_tokens, num_tokens, truncate_to
        )

    def close_session(self, session_id: str) -> bool:
        return self._drafter.close_session(session_id)


def test_a_consumer_that_leaves_while_the_verifier_opens_leaves_no_session(
    local_tandem: LocalTandem,
) -> None:
    """Driven as steps, a request's consumer may leave at any wait, the verifier's open among
    them: the open ends, then both sessions close (none is left to its TTL)."""
    verifier = OpensOnSteps(local_tandem.verifier)
    router = Router(
        verifier,
        local_tandem.drafter,
        local_tandem.router._decode,
        local_tandem.router._eos_token_ids,
    )
    try:
        request = GenerationRequest(encode(local_tandem, CODE_PROMPT), 50, draft_tokens=4)
        steps = router.steps(request)
        first = next(steps)
        assert isinstance(first, Wait) and not first.future.done()  # the open, in flight
        threading.Timer(0.05, verifier.released.set).start()
        steps.close()  # the consumer leaves before the verifier has opened
    finally:
        router.close()
        verifier.settle()
    assert local_tandem.verifier.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0


def _router_over(local_tandem: LocalTandem, drafter: DrafterPort) -> Router:
    return Router(
        local_tandem.verifier,
        drafter,
        local_tandem.router._decode,
        local_tandem.router._eos_token_ids,
    )


def test_first_token_does_not_wait_for_the_drafter(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    prompt, expected = next(iter(target_only.items()))
    drafter = _SlowToOpen(local_tandem.drafter)
    router = _router_over(local_tandem, drafter)
    try:
        stream = router.stream(GenerationRequest(encode(local_tandem, prompt), 12, draft_tokens=4))
        first = next(stream)  # would block (and time out) if it waited for the drafter
        assert first.tokens == expected[:1]
        drafter.opened.set()
        rest = [t for chunk in stream for t in chunk.tokens]
        assert tuple(first.tokens) + tuple(rest) == expected[:12]
    finally:
        router.close()
    assert local_tandem.drafter.stats().num_sessions == 0
    assert local_tandem.verifier.stats().num_sessions == 0


def _router_counting(local_tandem: LocalTandem, drafter: DrafterPort) -> tuple[Router, MemorySink]:
    sink = MemorySink()
    router = Router(
        local_tandem.verifier,
        drafter,
        local_tandem.router._decode,
        local_tandem.router._eos_token_ids,
        metrics=TandemMetrics(sink),
    )
    return router, sink


def test_a_drafter_that_fails_to_open_leaves_the_request_to_the_target_alone(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    prompt, expected = next(iter(target_only.items()))
    drafter = _SlowToOpen(local_tandem.drafter, fail=True)
    drafter.opened.set()
    router, sink = _router_counting(local_tandem, drafter)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), 12, draft_tokens=4)
        assert router.generate(request).tokens == expected[:12]
    finally:
        router.close()
    assert sink.counters[series(DRAFTER_DEGRADED, {"cause": "internal"})] == 1
    assert local_tandem.verifier.stats().num_sessions == 0


class _FailingDrafter:
    """A drafter whose `draft` calls fail with `error` from the `after`-th call on."""

    def __init__(self, drafter: DrafterPort, error: Exception, after: int) -> None:
        self._drafter = drafter
        self._error = error
        self._after = after
        self.calls = 0

    def open_session(self, *args: Any, **kwargs: Any) -> int:
        return self._drafter.open_session(*args, **kwargs)

    def draft(self, *args: Any, **kwargs: Any) -> DraftBlock:
        self.calls += 1
        if self.calls >= self._after:
            raise self._error
        return self._drafter.draft(*args, **kwargs)

    def close_session(self, session_id: str) -> bool:
        return self._drafter.close_session(session_id)


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
    assert drafter.calls == 3  # no call after the failure: drafting stopped for the request
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
    from cluster.local import text_decoder
    from drafter.config import NgramConfig

    decode_all = text_decoder(local_tandem.tokenizer)
    decoded: list[int] = []

    def decode(ids: Sequence[int]) -> str:
        decoded.append(len(ids))
        return decode_all(ids)

    router = Router(local_tandem.verifier, local_tandem.drafter, decode,
                    local_tandem.target.eos_token_ids, ngram=NgramConfig(enabled=True))  # fmt: skip
    prompt = encode(local_tandem, "Café ☕ crème brûlée: ")
    request = GenerationRequest(prompt, 300, SamplingParams(temperature), seed=1, draft_tokens=4)
    try:
        result = router.generate(request, pipelined=pipelined)
    finally:
        router.close()
    assert len(result.tokens) >= 100 and result.text == decode_all(result.tokens)
    assert max(decoded) <= 40


class CountingGate(SpeculationGate):
    """The router's gate, recording what it is told."""

    def __init__(self) -> None:
        super().__init__(GateConfig(), clock=lambda: 0.0)
        self.told: list[str] = []
        self.tokens = 0

    def request_started(self) -> None:
        self.told.append("started")
        super().request_started()

    def request_ended(self) -> None:
        self.told.append("ended")
        super().request_ended()

    def committed(self, tokens: int) -> None:
        self.tokens += tokens
        super().committed(tokens)


def test_only_requests_that_may_speculate_count_in_the_speculation_gate(
    local_tandem: LocalTandem,
) -> None:
    # A target-only request commits as much whichever mode the gate picks: counted, it would
    # blur the comparison (a load test's target-only phase would decide the next phase's mode).
    router = local_tandem.router
    gate, router.gate = router.gate, CountingGate()
    try:
        prompt = encode(local_tandem, CODE_PROMPT)
        router.generate(GenerationRequest(prompt, 6, draft_tokens=0))
        assert router.gate.told == [] and router.gate.tokens == 0  # type: ignore[attr-defined]
        router.generate(GenerationRequest(prompt, 6, draft_tokens=3))
        assert router.gate.told == ["started", "ended"]  # type: ignore[attr-defined]
        assert router.gate.tokens == 6  # type: ignore[attr-defined]
    finally:
        router.gate = gate


class _CountingDrafter:
    """The in-process drafter, counting the sessions opened and closed on it."""

    def __init__(self, drafter: DrafterPort) -> None:
        self._drafter = drafter
        self.opened = 0
        self.closed = 0

    def open_session(self, *args: Any, **kwargs: Any) -> int:
        self.opened += 1
        return self._drafter.open_session(*args, **kwargs)

    def draft(self, *args: Any, **kwargs: Any) -> DraftBlock:
        return self._drafter.draft(*args, **kwargs)

    def close_session(self, session_id: str) -> bool:
        self.closed += 1
        return self._drafter.close_session(session_id)

    def stats(self) -> Any:
        return self._drafter.stats()


class _HoldingGate(SpeculationGate):
    """A gate that holds the target alone for the first `held` rounds, then lets them speculate."""

    def __init__(self, held: int) -> None:
        super().__init__(GateConfig(), clock=lambda: 0.0)
        self.rounds = 0
        self.held = held

    def holds_target(self) -> bool:
        return self.held > 0

    def speculate(self) -> bool:
        self.rounds += 1
        return self.rounds > self.held


@pytest.mark.parametrize("held", [100, 3], ids=["held-throughout", "then-speculating"])
def test_a_request_started_while_the_gate_holds_the_target_opens_its_drafter_only_to_draft(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]], held: int
) -> None:
    prompt, expected = next(iter(target_only.items()))
    drafter = _CountingDrafter(local_tandem.drafter)
    router = _router_over(local_tandem, drafter)  # type: ignore[arg-type]
    router.gate = _HoldingGate(held)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), 16, draft_tokens=3)
        result = router.generate(request)
    finally:
        router.close()
    assert result.tokens == expected[:16]  # lossless either way
    if held > 16:  # never drafted: no session was opened, so none was closed
        assert drafter.opened == drafter.closed == 0 and result.stats.num_drafted == 0
    else:  # opened on the prompt at its first speculating round, caught up, closed
        assert drafter.opened == drafter.closed == 1 and result.stats.num_drafted > 0
    assert local_tandem.drafter.stats().num_sessions == 0
    assert local_tandem.verifier.stats().num_sessions == 0


@pytest.mark.parametrize("fan_out", [1, 8])
@pytest.mark.parametrize("draft_tokens", [1, 3, 8])
def test_greedy_with_outcome_keyed_predrafting_is_lossless(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    draft_tokens: int,
    fan_out: int,
) -> None:
    """Pipelined rounds that pre-draft the likely outcomes of each verify pass: the output is
    the target's alone, and both hits (a branch verified next at once) and misses happen."""
    router = Router(
        local_tandem.verifier, local_tandem.drafter, local_tandem.router._decode,
        local_tandem.router._eos_token_ids, predraft_fan_out=fan_out,
    )  # fmt: skip
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
            # A pre-drafted round commits its whole verdict, the bonus included.
            assert stats.num_accepted + stats.num_verify_passes == len(result.tokens)
            assert stats.pipeline_hits == stats.pipeline_misses == 0
    finally:
        router.close()
    assert hits > 0 and misses > 0
    assert local_tandem.verifier.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0
    # Every branch's fork was released with it.
    assert local_tandem.drafter._runner.sequences() == ()


def _predrafting_once(local_tandem: LocalTandem, drafter: Any) -> Any:
    """The first prompt's result through a router over `drafter` that pre-drafts up to 4."""
    router = Router(
        local_tandem.verifier, drafter, local_tandem.router._decode,
        local_tandem.router._eos_token_ids, predraft_fan_out=4,
    )  # fmt: skip
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


class _DraftCallCounter:
    """The in-process drafter, its `draft` calls counted."""

    def __init__(self, drafter: Any) -> None:
        self._drafter = drafter
        self.drafts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._drafter, name)

    def draft(self, *args: Any, **kwargs: Any) -> Any:
        self.drafts += 1
        return self._drafter.draft(*args, **kwargs)


def test_a_predraft_hit_is_verified_without_asking_the_drafter_again(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    drafter = _DraftCallCounter(local_tandem.drafter)
    result = _predrafting_once(local_tandem, drafter)
    assert result.tokens == target_only[PROMPTS[0]]
    stats = result.stats
    assert stats.predraft_hits > 0
    # Every verify pass's block came from a draft call, a hit, or neither (the opening pass,
    # which verifies nothing drafted): hits cost no draft call.
    assert drafter.drafts + stats.predraft_hits <= stats.num_verify_passes - 1


def test_closing_a_predrafting_stream_leaves_no_session_or_branch(
    local_tandem: LocalTandem,
) -> None:
    router = Router(
        local_tandem.verifier, local_tandem.drafter, local_tandem.router._decode,
        local_tandem.router._eos_token_ids, predraft_fan_out=6,
    )  # fmt: skip
    try:
        request = GenerationRequest(encode(local_tandem, CODE_PROMPT), 60, draft_tokens=4)
        stream = router.stream(request, pipelined=True)
        for _ in range(3):  # past the opening round, into pre-drafted ones
            next(stream)
        stream.close()
    finally:
        router.close()
    assert local_tandem.verifier.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0
    # A branch still drafting when its session closed releases its fork as it ends.
    _wait_for_no_branch(local_tandem)


class _RefusesPredrafts(_DraftCallCounter):
    """A drafter that refuses every pre-draft, as a replica from before pre-drafting does."""

    def __init__(self, drafter: Any) -> None:
        super().__init__(drafter)
        self.refused = 0

    def predraft(self, *args: Any, **kwargs: Any) -> Any:
        self.refused += 1
        raise InvalidArgumentError("a frame entry must carry a call")


def test_a_drafter_that_refuses_predrafts_keeps_the_request_exact_and_stops_the_asking(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    drafter = _RefusesPredrafts(local_tandem.drafter)
    result = _predrafting_once(local_tandem, drafter)
    assert result.tokens == target_only[PROMPTS[0]]
    # Asked once, then never again; the drafter was not failed over for it, and kept drafting
    # from the view it had before the refused call.
    assert drafter.refused == 1
    assert result.stats.drafters == ["drafter"]
    assert drafter.drafts > 1 and result.stats.num_accepted > 0
    assert local_tandem.drafter.stats().num_sessions == 0


class _PredraftsThenFails(_DraftCallCounter):
    """A drafter whose replica is lost during its third pre-draft."""

    def __init__(self, drafter: Any) -> None:
        super().__init__(drafter)
        self.predrafts = 0

    def predraft(self, *args: Any, **kwargs: Any) -> Any:
        self.predrafts += 1
        if self.predrafts == 3:
            raise ReplicaUnavailableError("the drafter replica is gone")
        return self._drafter.predraft(*args, **kwargs)


def test_a_drafter_lost_while_predrafting_drops_its_branches_and_stays_exact(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    """The round whose pre-draft failed hits nothing (its cache is gone with the drafter), the
    request fails over (here to the target alone: no spare), and no session or fork is left."""
    drafter = _PredraftsThenFails(local_tandem.drafter)
    result = _predrafting_once(local_tandem, drafter)
    assert result.tokens == target_only[PROMPTS[0]]
    stats = result.stats
    assert drafter.predrafts == 3  # never asked again after the loss
    # The two pre-drafted rounds before the loss count; the lost one drafted nothing to hit.
    assert stats.predraft_hits + stats.predraft_misses == 2
    assert local_tandem.drafter.stats().num_sessions == 0
    assert local_tandem.verifier.stats().num_sessions == 0
    _wait_for_no_branch(local_tandem)
