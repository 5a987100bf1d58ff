"""The device never waits on the router (docs/architecture.md, "The verifier drives each
session"): with the router slowed down on purpose, far below the verifier's pace, every running
session is still in every verifier step, and the output is still the target's own.

The slowed router is a decode function (the router's per-request text work) that sleeps longer
than a simulated verifier step (`sim-h100-8b`: about 6.5 ms at a few sessions) every time it
runs: the router then reads each session's reports several steps late. Counted from the
verifier engine's own counters (`EngineStats.running_sessions`, `running_stepped`), not from
any clock. The negative control runs the same load on a lockstep router (sessions that do not
run, one round at a time, as the loop was before): there the verifier's steps carry only the
sessions whose router has turned around, far fewer than run.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import pytest

from cluster.local import InProcess, LocalTandem, build_local, text_decoder
from cluster.presets import resolve_pair
from cluster.routing.request import GenerationRequest
from cluster.routing.router import Router
from cluster.runtime.engine_stats import EngineStats

STREAMS = 8
MAX_TOKENS = 48
ROUTER_DELAY_S = 0.02
"""Longer than a simulated verifier step at STREAMS sessions (6.3 ms + per-token terms)."""


@pytest.fixture(scope="module")
def sim() -> Iterator[LocalTandem]:
    tandem = build_local(resolve_pair("sim-h100-8b", device="cpu"))
    yield tandem
    tandem.verifier.close()
    tandem.drafter.close()


def slow_router(sim: LocalTandem, verifier_advances: bool) -> Router:
    decode = text_decoder(sim.tokenizer)

    def slow_decode(ids: Sequence[int]) -> str:
        time.sleep(ROUTER_DELAY_S)
        return decode(ids)

    return Router(
        InProcess(sim.verifier),
        InProcess(sim.drafter),
        slow_decode,
        sim.target.eos_token_ids,
        verifier_advances=verifier_advances,
    )


def run_load(router: Router, sim: LocalTandem, draft_tokens: int) -> list[tuple[int, ...]]:
    def one(stream: int) -> tuple[int, ...]:
        prompt = tuple(sim.tokenizer.encode(f"stream {stream}: once upon a time"))
        request = GenerationRequest(prompt, MAX_TOKENS, draft_tokens=draft_tokens)
        return router.generate(request).tokens

    with ThreadPoolExecutor(STREAMS) as pool:
        return list(pool.map(one, range(STREAMS)))


def engine(sim: LocalTandem) -> EngineStats:
    stats = sim.verifier.stats().engine
    assert stats is not None
    return stats


@pytest.mark.parametrize("draft_tokens", [0, 4], ids=["target-alone", "speculative"])
def test_a_slow_router_leaves_every_running_session_in_every_step(
    sim: LocalTandem, draft_tokens: int
) -> None:
    reference = run_load(Router(InProcess(sim.verifier), None, text_decoder(sim.tokenizer),
                                sim.target.eos_token_ids), sim, 0)  # fmt: skip
    before = engine(sim)
    got = run_load(slow_router(sim, verifier_advances=True), sim, draft_tokens)
    after = engine(sim)
    assert got == reference  # greedy: the target's own output, however late the router reads
    running = after.running_sessions - before.running_sessions
    stepped = after.running_stepped - before.running_stepped
    steps = after.steps - before.steps
    # Every step carried every running session (a new session's prefill chunk shares steps).
    assert running > 0 and stepped / running >= 0.9
    assert stepped / steps >= 0.5 * STREAMS  # most steps carried most of the streams


def test_a_lockstep_router_leaves_the_device_waiting(sim: LocalTandem) -> None:
    """The negative control: the same slow router in lockstep (its sessions do not run) leaves
    the steps short, each carrying only sessions whose router turned around: the check above
    tells the two loops apart."""
    before = engine(sim)
    run_load(slow_router(sim, verifier_advances=False), sim, 0)
    after = engine(sim)
    assert after.running_sessions == before.running_sessions  # nothing runs on its own
    steps = after.steps - before.steps
    tokens = STREAMS * MAX_TOKENS
    assert tokens / steps < 0.5 * STREAMS  # the steps carried few sessions each
