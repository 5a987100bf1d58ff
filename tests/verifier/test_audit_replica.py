"""The verifier's side of the audit: a replay that yields to the engine, and the Reference RPC.

`wait_until_idle` over a scripted engine state (a fake clock: no real waiting); a replay on a
real `Verifier` that holds still while its engine runs a call and goes on once it is done; and
the Reference RPC over real gRPC, which must give back exactly what the in-process call gives.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.ports import VerifierPort
from cluster.runtime.errors import (
    CancelledError,
    InvalidArgumentError,
    ReplicaUnavailableError,
)
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from tests.polling import wait_until
from tests.replicas import serve_verifier
from verifier.audit_replica import ReferenceReplayer, wait_until_idle
from verifier.reference import Replay, replay
from verifier.verifier import Verifier

PROMPT = (5, 17, 42, 99, 3)
SERVED = (7, 8, 9, 10, 11, 12, 13, 14, 15, 16)
SEED_EXACT = SamplingParams(temperature=0.8, top_k=20, seed_exact=True)


class FakeTime:
    """A clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds


def busy_for(polls: int) -> tuple[list[bool], object]:
    """An engine state that answers `has_work` True `polls` times, then False for good."""
    answers = [True] * polls

    def has_work() -> bool:
        return answers.pop(0) if answers else False

    return answers, has_work


def test_wait_until_idle_waits_while_the_engine_has_work_then_for_the_quiet_time() -> None:
    fake = FakeTime()
    _, has_work = busy_for(5)
    waited = wait_until_idle(
        has_work,  # type: ignore[arg-type]
        poll_s=0.002,
        quiet_s=0.004,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    # Five busy polls (10 ms), then idle polls until 4 ms of quiet: 7 sleeps in all.
    assert fake.sleeps == 7 and waited == pytest.approx(0.014)


def test_wait_until_idle_returns_at_once_on_an_idle_engine_without_quiet_time() -> None:
    fake = FakeTime()
    waited = wait_until_idle(lambda: False, quiet_s=0.0, clock=fake.clock, sleep=fake.sleep)
    assert waited == 0.0 and fake.sleeps == 0


def test_quiet_time_restarts_when_work_comes_back() -> None:
    fake = FakeTime()
    answers = [False, True, False, False, False]  # idle 2 ms, busy again, then idle
    waited = wait_until_idle(
        lambda: answers.pop(0) if answers else False,
        poll_s=0.002,
        quiet_s=0.004,
        clock=fake.clock,
        sleep=fake.sleep,
    )
    assert waited == pytest.approx(0.008)  # the quiet time counts from the last busy poll


def test_a_gone_caller_stops_the_wait() -> None:
    gone = threading.Event()
    fake = FakeTime()

    def has_work() -> bool:
        if fake.sleeps == 3:
            gone.set()
        return True

    with pytest.raises(CancelledError):
        wait_until_idle(has_work, gone=gone, clock=fake.clock, sleep=fake.sleep)


def test_before_chunk_runs_before_every_chunk_and_waits_for_the_engine(
    tiny_target: LoadedModel,
) -> None:
    """A replayer whose engine is busy for its first 3 polls of every chunk: every chunk
    waits, and the result is the plain replay's."""
    polls: list[int] = []

    def has_work() -> bool:
        polls.append(1)
        return len(polls) % 8 < 3  # busy at the start of each wait, then idle

    replayer = ReferenceReplayer(tiny_target, has_work, chunk_tokens=4, poll_s=0.0005)
    result = replayer.reference(PROMPT, SERVED, SamplingParams(), 0)
    assert result == replay(tiny_target, PROMPT, SERVED, SamplingParams(), 0, chunk_tokens=4)
    # prompt + served[:-1] = 14 tokens in chunks of 4.
    assert replayer.chunks == 4 and replayer.waited_s > 0


@pytest.fixture(scope="module")
def verifier(tiny_target: LoadedModel) -> Iterator[Verifier]:
    component = Verifier(tiny_target)
    yield component
    component.close()


def test_engine_has_work_while_a_call_runs(verifier: Verifier) -> None:
    release = threading.Event()
    assert not verifier.engine.has_work()
    caller = threading.Thread(
        target=verifier.engine.call, args=(lambda: release.wait(10),), kwargs={"key": "busy"}
    )
    caller.start()
    try:
        wait_until(verifier.engine.has_work, timeout_s=5)
    finally:
        release.set()
        caller.join(10)
    wait_until(lambda: not verifier.engine.has_work(), timeout_s=5)


def test_a_reference_waits_while_the_engine_serves_a_call(verifier: Verifier) -> None:
    release = threading.Event()
    busy = threading.Thread(
        target=verifier.engine.call, args=(lambda: release.wait(10),), kwargs={"key": "busy"}
    )
    busy.start()
    wait_until(verifier.engine.has_work, timeout_s=5)
    chunks_before = verifier.replayer.chunks
    results: list[object] = []
    audit = threading.Thread(
        target=lambda: results.append(verifier.reference(PROMPT, SERVED, SEED_EXACT, 11))
    )
    started = time.monotonic()
    audit.start()
    time.sleep(0.2)
    # The engine is busy: not one chunk has run.
    assert results == [] and verifier.replayer.chunks == chunks_before
    release.set()
    audit.join(30)
    busy.join(10)
    assert len(results) == 1 and time.monotonic() - started >= 0.2
    expected = replay(verifier._target, PROMPT, SERVED, SEED_EXACT, 11)
    assert results[0] == expected
    assert verifier.replayer.chunks > chunks_before


def on_the_wire(replay: Replay) -> Replay:
    """`replay` as it comes back over gRPC: its gaps rounded to float32."""

    def rounded(values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(float(np.float32(v)) for v in values)

    return dataclasses.replace(
        replay, gaps=rounded(replay.gaps), served_gaps=rounded(replay.served_gaps)
    )


def test_reference_over_grpc_gives_what_the_component_gives(
    verifier: Verifier, tiny_target: LoadedModel
) -> None:
    server, port = serve_verifier(verifier)
    try:
        with GrpcVerifier(f"127.0.0.1:{port}", timeout_s=60) as client:
            port_: VerifierPort = client  # the router's port, over the network
            for sampling, seed in ((SamplingParams(), 0), (SEED_EXACT, 2**64 - 1)):
                remote = port_.reference(PROMPT, SERVED, sampling, seed)
                local = verifier.reference(PROMPT, SERVED, sampling, seed)
                assert remote == on_the_wire(local) and remote.dtype == "float32"
                assert len(remote.tokens) == len(SERVED) == len(remote.gaps)
            fp32 = client.reference(PROMPT, SERVED, SamplingParams(), 0, "float32")
            assert fp32 == on_the_wire(verifier.reference(PROMPT, SERVED, SamplingParams(), 0))
            empty = client.reference(PROMPT, (), SamplingParams(), 0)
            assert empty.tokens == () and empty.gaps == ()
            refusals = [
                ((PROMPT, SERVED, SamplingParams(temperature=1.0), 3), "rejection rule"),
                ((PROMPT, SERVED, SamplingParams(), 0, "bfloat8"), "dtype must be one of"),
                (((), SERVED, SamplingParams(), 0), "prompt"),
                ((PROMPT, (tiny_target.vocab_size,), SamplingParams(), 0), "vocabulary"),
            ]
            for args, words in refusals:
                with pytest.raises(InvalidArgumentError, match=words):
                    client.reference(*args)  # type: ignore[arg-type]
    finally:
        server.stop(None)


def test_a_float32_copy_of_a_float32_target_is_the_target_itself(verifier: Verifier) -> None:
    assert verifier.replayer._fp32_target() is verifier._target


def test_a_reference_call_given_up_never_runs_its_chunks(verifier: Verifier) -> None:
    """A Reference RPC that times out while the replica is busy is dropped: once the engine is
    free again, none of its chunks runs (`call_scope`: the replay sees its caller gone)."""
    release = threading.Event()
    busy = threading.Thread(
        target=verifier.engine.call, args=(lambda: release.wait(10),), kwargs={"key": "busy"}
    )
    busy.start()
    wait_until(verifier.engine.has_work, timeout_s=5)
    server, port = serve_verifier(verifier)
    chunks_before = verifier.replayer.chunks
    try:
        with GrpcVerifier(f"127.0.0.1:{port}") as client:
            with pytest.raises(ReplicaUnavailableError, match="DEADLINE_EXCEEDED"):
                client.reference(PROMPT, SERVED, SamplingParams(), 0, timeout_s=0.3)
            time.sleep(0.1)  # the server sees the call end
            release.set()
            busy.join(10)
            time.sleep(0.2)
            assert verifier.replayer.chunks == chunks_before
    finally:
        release.set()
        server.stop(None)
