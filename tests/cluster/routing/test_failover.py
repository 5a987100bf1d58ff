"""A replica that dies mid-generation loses nothing: the router fails over to a spare (or, for
a drafter with no spare, to the target alone) and greedy output stays exactly the target's.

A verifier fails a request through its session's reports (`tests/cluster/routing/fake_ports`):
the error comes in place of a verdict, whether of a block the router posted or of a step the
running session took alone, and the router moves the request on from there."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from cluster.local import InProcess, LocalTandem
from cluster.routing.ports import Pinned, Spare
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.routing.waits import Wait, Waits
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import (
    DeadlineExceededError,
    ReplicaUnavailableError,
    ResourceExhaustedError,
    SessionNotFoundError,
    TandemError,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from drafter.drafter import Drafter
from tests.cluster.routing.fake_ports import Dying, Refusing, Wrapper
from tests.cluster.routing.stepping import OpensOnSteps
from tests.conftest import encode
from verifier.config import VerifierConfig
from verifier.verifier import Verifier

MAX_TOKENS = 24


def _port(replica: Any) -> Any:
    """`replica` as a port: a plain component wrapped in `InProcess`; a port as it is."""
    return InProcess(replica) if isinstance(replica, (Verifier, Drafter)) else replica


class Pool:
    """A first replica of each side, and spares in order (ports, or plain components)."""

    def __init__(self, verifiers: list[Any], drafters: list[Any]) -> None:
        self._replicas = {
            "verifier": [_port(v) for v in verifiers],
            "drafter": [_port(d) for d in drafters],
        }
        self.spares_given: list[str] = []

    def pin(
        self,
        speculate: bool,
        deadline: float | None = None,
        tenant: str = "",
        suffix: bool = True,
    ) -> Pinned:
        drafters = self._replicas["drafter"]
        return Pinned(
            self._replicas["verifier"][0],
            drafters[0] if speculate and drafters else None,
            verifier_id="verifier-0",
            drafter_id="drafter-0",
        )

    def spare(
        self, side: str, avoid: frozenset[str], deadline: float | None = None
    ) -> Spare | None:
        for i, port in enumerate(self._replicas[side]):
            if f"{side}-{i}" not in avoid:
                self.spares_given.append(f"{side}-{i}")
                return Spare(port, f"{side}-{i}")
        return None


@pytest.fixture(scope="module")
def spares(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> tuple[Verifier, Drafter]:
    return Verifier(tiny_target), Drafter(tiny_draft)


def _fully_planned(local_tandem: LocalTandem, tiny_target: LoadedModel) -> Verifier:
    """A verifier whose admission plan is full: one session planned to its whole context
    (64 tokens, its pool's floor, under an overcommit of 1); it refuses any new one."""
    config = VerifierConfig(max_context_tokens=64, kv_cache_bytes=1, kv_overcommit=1.0)
    verifier = Verifier(tiny_target, config)
    holder = list(encode(local_tandem, "def add(a, b):"))
    verifier.open_session("holder", holder, SamplingParams(), 0, max_new_tokens=64)
    return verifier


def _router(local_tandem: LocalTandem, pool: Pool, pipelined: bool) -> Router:
    router = local_tandem.router
    return Router.over_pool(pool, router._decode, router._eos_token_ids, pipelined=pipelined)


def _expected(target_only: dict[str, tuple[int, ...]]) -> tuple[str, tuple[int, ...]]:
    prompt, tokens = next(iter(target_only.items()))
    return prompt, tokens[:MAX_TOKENS]


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
@pytest.mark.parametrize("calls", [0, 1, 2, 5])
@pytest.mark.parametrize("side", ["verifier", "drafter"])
def test_a_replica_dying_mid_generation_fails_over_to_a_spare_exactly(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    spares: tuple[Verifier, Drafter],
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
    side: str,
    calls: int,
    pipelined: bool,
) -> None:
    spare_verifier, spare_drafter = spares
    # A replica of its own: what a dead one held is gone with it.
    first = Dying(Verifier(tiny_target) if side == "verifier" else Drafter(tiny_draft), calls)
    verifiers = [first, spare_verifier] if side == "verifier" else [local_tandem.verifier]
    drafters = [first, spare_drafter] if side == "drafter" else [local_tandem.drafter]
    router = _router(local_tandem, Pool(verifiers, drafters), pipelined)
    prompt, expected = _expected(target_only)
    spare = spare_verifier if side == "verifier" else spare_drafter
    busy_before = spare.stats().busy_s
    try:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        result = router.generate(request)
    finally:
        router.close()
    assert result.tokens == expected
    assert first.refused > 0  # it really died while the request ran
    assert spare.stats().busy_s > busy_before  # and the spare took over
    for component in (spare_verifier, spare_drafter, local_tandem.verifier, local_tandem.drafter):
        assert component.stats().num_sessions == 0  # nothing left open where it moved


@pytest.mark.parametrize("pipelined", [False, True], ids=["serial", "pipelined"])
def test_a_lost_drafter_with_no_spare_leaves_the_request_to_the_target_alone(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    tiny_draft: LoadedModel,
    pipelined: bool,
) -> None:
    drafter = Dying(Drafter(tiny_draft), calls=3)
    router = _router(local_tandem, Pool([local_tandem.verifier], [drafter]), pipelined)
    prompt, expected = _expected(target_only)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        result = router.generate(request)
    finally:
        router.close()
    assert result.tokens == expected
    assert result.stats.num_verify_passes > MAX_TOKENS // 2  # mostly one token per pass
    assert local_tandem.verifier.stats().num_sessions == 0


def test_a_lost_verifier_with_no_spare_fails_the_request_and_frees_the_drafter(
    local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]], tiny_target: LoadedModel
) -> None:
    verifier = Dying(Verifier(tiny_target), calls=2)
    router = _router(local_tandem, Pool([verifier], [local_tandem.drafter]), pipelined=True)
    prompt, _ = _expected(target_only)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        with pytest.raises(ReplicaUnavailableError, match="the replica is gone"):
            router.generate(request)
    finally:
        router.close()
    assert local_tandem.drafter.stats().num_sessions == 0


def test_sampled_requests_complete_across_a_failover(
    local_tandem: LocalTandem,
    spares: tuple[Verifier, Drafter],
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
) -> None:
    spare_verifier, spare_drafter = spares
    verifiers = [Dying(Verifier(tiny_target), calls=4), spare_verifier]
    drafters = [Dying(Drafter(tiny_draft), calls=3), spare_drafter]
    router = _router(local_tandem, Pool(verifiers, drafters), pipelined=True)
    try:
        request = GenerationRequest(
            encode(local_tandem, "Once upon a time"),
            MAX_TOKENS,
            SamplingParams(temperature=0.9),
            seed=7,
            draft_tokens=3,
        )
        result = router.generate(request)
    finally:
        router.close()
    assert len(result.tokens) == MAX_TOKENS
    assert spare_verifier.stats().num_sessions == spare_drafter.stats().num_sessions == 0


def test_a_verifier_whose_kv_pool_is_full_hands_the_request_to_a_spare_exactly(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    spares: tuple[Verifier, Drafter],
    tiny_target: LoadedModel,
) -> None:
    spare_verifier, _ = spares
    full = ResourceExhaustedError("the KV pool cannot hold this work", retry_after_s=0.5)
    first = Refusing(Verifier(tiny_target), answers=2, error=full)
    pool = Pool([first, spare_verifier], [local_tandem.drafter])
    router = _router(local_tandem, pool, pipelined=True)
    prompt, expected = _expected(target_only)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        assert router.generate(request).tokens == expected
    finally:
        router.close()
    assert first.refused == 1 and pool.spares_given == ["verifier-1"]
    for component in (first, spare_verifier, local_tandem.drafter):
        assert component.stats().num_sessions == 0  # the full one's session closed at once


def test_a_verifier_that_cannot_plan_for_a_request_hands_it_to_a_spare_at_open(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    spares: tuple[Verifier, Drafter],
    tiny_target: LoadedModel,
) -> None:
    spare_verifier, _ = spares
    full = _fully_planned(local_tandem, tiny_target)
    pool = Pool([full, spare_verifier], [local_tandem.drafter])
    router = _router(local_tandem, pool, pipelined=True)
    prompt, expected = _expected(target_only)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        assert router.generate(request).tokens == expected
        engine = full.stats().engine
        assert engine is not None and engine.refusals == 1
    finally:
        router.close()
        full.close()
    assert pool.spares_given == ["verifier-1"]
    assert spare_verifier.stats().num_sessions == local_tandem.drafter.stats().num_sessions == 0


def test_a_spare_whose_plan_is_full_still_takes_a_request_that_fails_over_midway(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    tiny_target: LoadedModel,
) -> None:
    # The spare's plan is full: it would refuse a new request, but this one already runs.
    spare = _fully_planned(local_tandem, tiny_target)
    first = Refusing(Verifier(tiny_target), answers=2, error=ReplicaUnavailableError("gone"))
    pool = Pool([first, spare], [local_tandem.drafter])
    router = _router(local_tandem, pool, pipelined=True)
    prompt, expected = _expected(target_only)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        assert router.generate(request).tokens == expected
        engine = spare.stats().engine
        assert engine is not None and engine.refusals == 0
    finally:
        router.close()
        spare.close()
    assert first.refused == 1 and pool.spares_given == ["verifier-1"]


def test_a_verifier_that_was_full_takes_the_request_back_when_its_spare_is_lost(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    tiny_target: LoadedModel,
) -> None:
    # verifier-0 has no room at open: the request goes to verifier-1, which is then lost.
    # With verifier-0 the only one left, the request goes back there, admitted as resumed.
    full = _fully_planned(local_tandem, tiny_target)
    lost = Refusing(Verifier(tiny_target), answers=2, error=ReplicaUnavailableError("gone"))
    pool = Pool([full, lost], [local_tandem.drafter])
    router = _router(local_tandem, pool, pipelined=True)
    prompt, expected = _expected(target_only)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        assert router.generate(request).tokens == expected
    finally:
        router.close()
        full.close()
    assert pool.spares_given == ["verifier-1", "verifier-0"]


@pytest.mark.parametrize(
    "error",
    [DeadlineExceededError("out of time"), ResourceExhaustedError("replica full")],
    ids=["deadline", "full-no-spare"],
)
def test_a_deadline_or_a_full_replica_with_no_spare_ends_the_request(
    local_tandem: LocalTandem,
    spares: tuple[Verifier, Drafter],
    tiny_target: LoadedModel,
    error: TandemError,
) -> None:
    spare_verifier, _ = spares
    first = Refusing(Verifier(tiny_target), answers=2, error=error)
    # A deadline never fails over; a full verifier does, but here has no spare to go to.
    full = isinstance(error, ResourceExhaustedError)
    pool = Pool([first] if full else [first, spare_verifier], [local_tandem.drafter])
    router = _router(local_tandem, pool, pipelined=True)
    try:
        request = GenerationRequest(encode(local_tandem, "def add(a, b):"), MAX_TOKENS)
        with pytest.raises(type(error), match=str(error)):
            router.generate(request)
    finally:
        router.close()
    assert first.refused == 1
    assert pool.spares_given == []  # no failover
    assert first.stats().num_sessions == local_tandem.drafter.stats().num_sessions == 0


def test_a_session_lost_past_the_deadline_is_not_failed_over(
    local_tandem: LocalTandem, spares: tuple[Verifier, Drafter], tiny_target: LoadedModel
) -> None:
    # The replica dropped the session because its time was up: the call finds it gone, and
    # the deadline has passed by the time the router hears of it.
    first = Refusing(Verifier(tiny_target), answers=2, error=SessionNotFoundError("no session"))
    pool = Pool([first, spares[0]], [local_tandem.drafter])
    decode, eos = local_tandem.router._decode, local_tandem.router._eos_token_ids
    router = Router.over_pool(pool, decode, eos, clock=lambda: 100.0 if first.refused else 0.0)
    request = GenerationRequest(encode(local_tandem, "x"), MAX_TOKENS, deadline=100.0)
    try:
        with pytest.raises(DeadlineExceededError):
            router.generate(request)
    finally:
        router.close()
    assert first.refused == 1
    assert pool.spares_given == []
    assert first.stats().num_sessions == local_tandem.drafter.stats().num_sessions == 0


CUT_OFF = ReplicaUnavailableError("DEADLINE_EXCEEDED: the call timed out")


class DraftCutOff(Wrapper):
    """A drafter whose `calls`-th draft call is cut off (a per-call timeout, a dropped
    connection) while the replica itself lives on and still holds the session."""

    def __init__(self, drafter: Drafter, calls: int) -> None:
        super().__init__(drafter)
        self._cut_at = calls

    def draft(self, *args: Any) -> Waits[DraftBlock]:
        if self.calls["draft"] + 1 == self._cut_at:
            self.calls["draft"] += 1
            raise CUT_OFF
        return (yield from super().draft(*args))


@pytest.mark.parametrize("side", ["verifier", "drafter"])
def test_a_replica_failed_over_from_has_its_session_closed(
    local_tandem: LocalTandem,
    target_only: dict[str, tuple[int, ...]],
    spares: tuple[Verifier, Drafter],
    tiny_target: LoadedModel,
    tiny_draft: LoadedModel,
    side: str,
) -> None:
    spare_verifier, spare_drafter = spares
    first: Wrapper
    if side == "verifier":
        # Its session's third report is cut off: the replica still holds the session.
        first = Refusing(Verifier(tiny_target), answers=2, error=CUT_OFF)
        pool = Pool([first, spare_verifier], [local_tandem.drafter])
    else:
        first = DraftCutOff(Drafter(tiny_draft), calls=3)
        pool = Pool([local_tandem.verifier], [first, spare_drafter])
    router = _router(local_tandem, pool, pipelined=False)
    prompt, expected = _expected(target_only)
    try:
        request = GenerationRequest(encode(local_tandem, prompt), MAX_TOKENS, draft_tokens=3)
        assert router.generate(request).tokens == expected
    finally:
        router.close()
    # The cut-off replica still lives: the router closed the session it left there, rather
    # than leaving its KV blocks held until the idle TTL.
    assert first.component.stats().num_sessions == 0
    first.component.close()


def test_a_consumer_that_leaves_while_a_spare_verifier_opens_leaves_no_session(
    local_tandem: LocalTandem, tiny_target: LoadedModel
) -> None:
    """The first verifier is lost after the first round; the request's steps are left while
    its spare opens the session over the history: that open ends, then it is closed."""
    lost = Dying(Verifier(tiny_target), calls=2)  # the open and one report of its session
    spare = OpensOnSteps(Verifier(tiny_target))
    router = _router(local_tandem, Pool([lost, spare], [local_tandem.drafter]), pipelined=False)
    try:
        request = GenerationRequest(encode(local_tandem, "def add(a, b):"), MAX_TOKENS)
        steps = router.stream_waits(request)
        for item in steps:
            if isinstance(item, Wait):
                if item.future in spare.opening:
                    break  # the spare's open is in flight
                item.block()
        assert lost.refused >= 1 and len(spare.opening) == 1  # it was lost; its spare opens
        threading.Timer(0.05, spare.released.set).start()
        steps.close()
    finally:
        router.close()
        spare.settle()
    assert spare.stats().num_sessions == 0
    assert local_tandem.drafter.stats().num_sessions == 0
