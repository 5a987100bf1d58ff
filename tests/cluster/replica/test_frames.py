"""Frames streams against a real verifier server on the tiny target: bad frames end only their
own stream (or only their entry) and the replica goes on serving; a running session's own
steps come back under its open entry's tag, one per engine step, as the target's greedy
tokens, beside the verdicts of blocks posted to it; one frame per engine step under 32
concurrent sessions; a replica stopped mid-run fails every pending call promptly.

Raw streams (`tests.replicas.RawStream`) send what a broken or hostile router would;
`GrpcVerifier` is the router's own client. Each bad-frame test ends by serving another session
on a fresh stream.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch

from cluster.routing.grpc_verifier import GrpcVerifier
from cluster.routing.waits import run
from cluster.runtime.advance import Advance
from cluster.runtime.draft_block import DraftBlock
from cluster.runtime.errors import ReplicaUnavailableError
from cluster.runtime.models import LoadedModel
from cluster.runtime.sampling_params import SamplingParams
from cluster.wire import requests
from cluster.wire.metadata import MAX_MESSAGE_BYTES, SECRET_METADATA_KEY
from protos import replica_pb2
from tests.replicas import WAIT_S, RawStream, answer, frame, serve_verifier, verify
from verifier.verifier import Verifier

SECRET = "frames-secret-0123456789abcdef01"
AUTH = ((SECRET_METADATA_KEY, SECRET),)
GREEDY = SamplingParams()


@dataclass
class Served:
    verifier: Verifier
    server: grpc.Server
    address: str


def serving(tiny_target: LoadedModel) -> Iterator[Served]:
    """The tiny verifier behind a loopback server that takes SECRET; stopped after the yield."""
    verifier = Verifier(tiny_target)
    server, port = serve_verifier(verifier, secret=SECRET)
    yield Served(verifier, server, f"127.0.0.1:{port}")
    server.stop(None)
    verifier.close()


@pytest.fixture(scope="module")
def served(tiny_target: LoadedModel) -> Iterator[Served]:
    yield from serving(tiny_target)


def open_entry(tag: int, session_id: str) -> replica_pb2.FrameEntry:
    request = requests.open_request_to_wire(session_id, [1, 2, 3], GREEDY, 0)
    return replica_pb2.FrameEntry(tag=tag, open=request)


def verify_entry(tag: int, session_id: str, base_length: int) -> replica_pb2.FrameEntry:
    block = DraftBlock(base_length=base_length, tokens=())
    verify = requests.verify_request_to_wire(session_id, block)
    return replica_pb2.FrameEntry(tag=tag, verify=verify)


def close_entry(tag: int, session_id: str) -> replica_pb2.FrameEntry:
    return replica_pb2.FrameEntry(tag=tag, close=requests.close_request_to_wire(session_id))


def assert_serves(served: Served, session_id: str) -> None:
    """Another session's entries on a fresh stream: open, verify, close, all answered."""
    stream = RawStream(served.address, metadata=AUTH)
    try:
        stream.send(frame(open_entry(1, session_id)))
        assert stream.results(1)[1].opened.committed_length == 3
        stream.send(frame(verify_entry(2, session_id, 3)))
        assert stream.results(1)[2].verdict.committed_length == 4
        stream.send(frame(close_entry(3, session_id)))
        assert stream.results(1)[3].closed.existed
    finally:
        stream.close()
    assert served.verifier.stats().num_sessions == 0


def test_entries_fail_alone_and_the_stream_goes_on(served: Served) -> None:
    stream = RawStream(served.address, metadata=AUTH)
    try:
        stream.send(frame(open_entry(1, "a"), verify_entry(2, "nobody", 3), open_entry(3, "b")))
        first = stream.results(3)
        assert first[1].opened.committed_length == first[3].opened.committed_length == 3
        assert first[2].error.status == "NOT_FOUND"
        assert first[2].error.message.startswith("no open session 'nobody'")
        # A verifier serves no draft entries; an entry with no call is refused too.
        draft = requests.draft_request_to_wire("a", 3, [], 1)
        stream.send(
            frame(
                replica_pb2.FrameEntry(tag=4, draft=draft),
                replica_pb2.FrameEntry(tag=5),
                verify_entry(6, "a", 3),
                verify_entry(7, "b", 3),
            )
        )
        later = stream.results(4)
        assert (later[4].error.status, later[5].error.status) == ("INVALID_ARGUMENT",) * 2
        assert "serves no draft entries" in later[4].error.message
        assert later[6].verdict.committed_length == later[7].verdict.committed_length == 4
        stream.send(frame(close_entry(8, "a"), close_entry(9, "b")))
        assert all(result.closed.existed for result in stream.results(2).values())
    finally:
        stream.close()
    assert_serves(served, "after-entry-errors")


def test_entries_of_one_session_run_in_their_order(served: Served) -> None:
    stream = RawStream(served.address, metadata=AUTH)
    try:
        # Open, three verifies on the lengths each leaves, and the close, in one frame.
        entries = [open_entry(1, "ordered")]
        entries += [verify_entry(2 + i, "ordered", 3 + i) for i in range(3)]
        stream.send(frame(*entries, close_entry(5, "ordered")))
        results = stream.results(5)
        assert [results[2 + i].verdict.committed_length for i in range(3)] == [4, 5, 6]
        assert results[5].closed.existed
    finally:
        stream.close()


RUN_PROMPT = tuple(b"def add(a, b):")
RUN_TOKENS = 24


def greedy_continuation(model: LoadedModel, prompt: tuple[int, ...], count: int) -> list[int]:
    """The target's own greedy tokens after `prompt`: one full forward pass each."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(count):
            tokens.append(int(model.model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt) :]


def test_a_running_session_reports_its_steps_under_its_open_entry(
    served: Served, tiny_target: LoadedModel
) -> None:
    """An open entry with `advance` is answered `opened`, then the session's own steps come
    under the same tag, one verdict per engine step (one token each, as the target alone picks
    it) until max_length; blocks posted to it meanwhile are answered under their own tags,
    verified from where the session then stands, or dropped."""
    expected = greedy_continuation(tiny_target, RUN_PROMPT, RUN_TOKENS)
    start, max_length = len(RUN_PROMPT), len(RUN_PROMPT) + RUN_TOKENS
    opening = requests.open_request_to_wire(
        "running", RUN_PROMPT, GREEDY, 0, advance=Advance(max_length)
    )
    # A right block from the prompt on (its first tokens may be held by the time it runs),
    # and one that assumes a token the session never takes (always dropped).
    right = DraftBlock(start, tuple(expected[:4]))
    wrong = DraftBlock(start, (expected[1],), assumed=((expected[0] + 1) % 256,))
    steps_before = served.verifier.stats().engine
    stream = RawStream(served.address, metadata=AUTH)
    try:
        stream.send(
            frame(
                replica_pb2.FrameEntry(tag=1, open=opening),
                replica_pb2.FrameEntry(
                    tag=2, verify=requests.verify_request_to_wire("running", right)
                ),
                replica_pb2.FrameEntry(
                    tag=3, verify=requests.verify_request_to_wire("running", wrong)
                ),
            )
        )
        assert answer(stream.result(1), "opened").committed_length == start
        reports: list[replica_pb2.Verdict] = []
        posted: dict[int, replica_pb2.Verdict] = {}
        while len(posted) < 2 or not reports or reports[-1].committed_length < max_length:
            [(tag, result)] = stream.results(1).items()
            verdict = answer(result, "verdict")
            if tag == 1:
                reports.append(verdict)
            else:
                assert tag in (2, 3) and tag not in posted, result
                posted[tag] = verdict
        stream.send(frame(close_entry(4, "running")))
        assert answer(stream.result(4), "closed").existed
        stream.half_close()
        assert stream.status() == (grpc.StatusCode.OK, "")
        assert stream.unread() == []  # nothing more under its tag once it reached max_length
    finally:
        stream.close()
    steps_after = served.verifier.stats().engine
    # Each own step: one token, the target's, committed where the session stood.
    for verdict in reports:
        assert len(verdict.token_ids) == 1 and verdict.num_accepted == 0
        assert verdict.committed_length == verdict.base_length + 1
        assert not verdict.dropped and verdict.num_matched == 0
    assert reports[-1].committed_length == max_length
    # One per engine step: no frame carries two of the session's own steps, and there were
    # at least as many steps as reports.
    for sent in stream.frames:
        assert sum(r.tag == 1 and r.HasField("verdict") for r in sent.results) <= 1
    assert steps_before is not None and steps_after is not None
    assert steps_after.steps - steps_before.steps >= len(reports)
    # The wrong block was dropped, committing nothing; the right one was verified from where
    # the session stood (the tokens it already held count as matched), or dropped if the
    # session already held all of it.
    assert posted[3].dropped and list(posted[3].token_ids) == []
    checked = posted[2]
    print(f"right block: dropped {checked.dropped}, matched {checked.num_matched}")
    if not checked.dropped:
        held = checked.base_length - start
        assert checked.num_matched == held and checked.num_accepted == len(right.tokens) - held
        assert checked.committed_length == checked.base_length + len(checked.token_ids)
    # Together, the session's steps and the verified block hold the target's greedy output
    # exactly once each, in order, from the prompt to max_length.
    verified = sorted(
        (v for v in [*reports, *posted.values()] if not v.dropped), key=lambda v: v.base_length
    )
    at, tokens = start, []
    for verdict in verified:
        assert verdict.base_length == at, [(v.base_length, v.committed_length) for v in verified]
        at = verdict.committed_length
        tokens.extend(verdict.token_ids)
    assert at == max_length and tokens == expected
    assert served.verifier.stats().num_sessions == 0


def bad_bytes() -> bytes:
    return frame(open_entry(1, "x")).SerializeToString()[:-3]


@pytest.mark.parametrize(
    ("payload", "code", "details"),
    [
        (bad_bytes(), grpc.StatusCode.INVALID_ARGUMENT, "not a valid request message"),
        (b"\xff\xff\xff garbage", grpc.StatusCode.INVALID_ARGUMENT, "not a valid request"),
        (
            frame(open_entry(1, "x"), version=7).SerializeToString(),
            grpc.StatusCode.INVALID_ARGUMENT,
            "frame version 7 is not supported",
        ),
        (b"\x00" * (MAX_MESSAGE_BYTES + 1), grpc.StatusCode.RESOURCE_EXHAUSTED, ""),
    ],
    ids=["truncated", "garbage", "unknown-version", "oversized"],
)
def test_a_bad_frame_ends_only_its_stream(
    served: Served, payload: bytes, code: grpc.StatusCode, details: str
) -> None:
    stream = RawStream(served.address, metadata=AUTH, serialize=lambda raw: raw)
    try:
        stream.send(payload)
        got_code, got_details = stream.status()
    finally:
        stream.close()
    assert got_code == code and details in got_details
    assert_serves(served, f"after-{code.name}")
    assert served.verifier.stats().num_sessions == 0  # the bad frame opened nothing


@pytest.mark.parametrize("metadata", [None, ((SECRET_METADATA_KEY, "wrong"),)])
def test_a_stream_without_the_secret_is_unauthenticated(served: Served, metadata: Any) -> None:
    stream = RawStream(served.address, metadata=metadata)
    try:
        stream.send(frame(open_entry(1, "intruder")))
        code, details = stream.status()
    finally:
        stream.close()
    assert code == grpc.StatusCode.UNAUTHENTICATED and SECRET_METADATA_KEY in details
    assert served.verifier.stats().num_sessions == 0
    assert_serves(served, "after-intruder")


SESSIONS = 32
ROUNDS = 6


def test_32_sessions_share_frames_at_most_two_per_engine_step(served: Served) -> None:
    # Every verify of a step finishes in that step, and the step listener sends them as one
    # frame; the bound 2 leaves room for a result that completes between steps.
    client = GrpcVerifier(served.address, timeout_s=WAIT_S, secret=SECRET)
    opened, go, rounds_done, counted = (threading.Barrier(SESSIONS + 1) for _ in range(4))
    errors: list[BaseException] = []

    def session(index: int) -> None:
        session_id = f"load-{index}"
        try:
            length = run(client.open_session(session_id, [1, 2, 3, index % 200], GREEDY, 0))
            opened.wait(WAIT_S)
            go.wait(WAIT_S)  # once the counters before the rounds are read
            for _ in range(ROUNDS):
                length = verify(client, session_id, DraftBlock(length, ())).committed_length
            rounds_done.wait(WAIT_S)
            counted.wait(WAIT_S)  # once the counters after the rounds are read
            run(client.close_session(session_id))
        except BaseException as error:
            errors.append(error)
            raise

    threads = [threading.Thread(target=session, args=(i,)) for i in range(SESSIONS)]
    for thread in threads:
        thread.start()
    try:
        opened.wait(WAIT_S)
        before = client.stats()
        go.wait(WAIT_S)
        rounds_done.wait(WAIT_S)
        after = client.stats()
        counted.wait(WAIT_S)
    finally:
        for thread in threads:
            thread.join(WAIT_S)
        client.close()
    assert not errors
    assert before.engine is not None and after.engine is not None
    steps = after.engine.steps - before.engine.steps
    frames = after.frames_sent - before.frames_sent
    results = after.results_sent - before.results_sent
    print(f"{steps} steps, {frames} frames, {results} results over {SESSIONS} sessions")
    assert results == SESSIONS * ROUNDS
    assert 0 < frames <= 2 * steps
    # Batched: a frame carries the results of many sessions (measured: 192 results in 13
    # frames). Without batching each result would be a frame of its own, and this fails.
    assert results > frames
    # The router side batched too: fewer frames than entries arrived.
    assert after.frames_received - before.frames_received <= results


def test_a_replica_stopped_mid_run_fails_every_pending_call_promptly(
    tiny_target: LoadedModel,
) -> None:
    verifier = Verifier(tiny_target)
    server, port = serve_verifier(verifier)
    client = GrpcVerifier(f"127.0.0.1:{port}", timeout_s=WAIT_S)
    running, stopped_at = threading.Barrier(17), [0.0]
    outcomes: list[tuple[BaseException | None, float]] = []

    def session(index: int) -> None:
        session_id = f"doomed-{index}"
        length = run(client.open_session(session_id, [4, 5, 6], GREEDY, 0))
        running.wait(WAIT_S)
        try:
            while True:  # rounds until the replica goes
                length = verify(client, session_id, DraftBlock(length, ())).committed_length
        except BaseException as error:
            outcomes.append((error, time.monotonic()))

    threads = [threading.Thread(target=session, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    try:
        running.wait(WAIT_S)
        time.sleep(0.2)
        stopped_at[0] = time.monotonic()
        server.stop(None)
        for thread in threads:
            thread.join(WAIT_S)
    finally:
        server.stop(None)
        client.close()
        verifier.close()
    assert len(outcomes) == 16
    for error, at in outcomes:
        assert isinstance(error, ReplicaUnavailableError), error
        assert str(error).startswith(f"verifier at 127.0.0.1:{port}: ")
        # Promptly: the stream's end, not the 30 s per-call timeout.
        assert at - stopped_at[0] < 5.0


class HeldEngine:
    """The verifier's engine held between steps (a call on its thread waits) until `release`."""

    def __init__(self, served: Served) -> None:
        self._release = threading.Event()
        self._done = served.verifier.engine.submit_call(lambda: self._release.wait(WAIT_S))

    def release(self) -> None:
        self._release.set()
        self._done.result(WAIT_S)


def test_a_cancelled_entry_is_dropped_before_it_runs_and_never_answered_itself(
    served: Served,
) -> None:
    engine = served.verifier.engine
    stream = RawStream(served.address, metadata=AUTH)
    stats = GrpcVerifier(served.address, timeout_s=WAIT_S, secret=SECRET)
    try:
        stream.send(frame(open_entry(1, "cancelled")))
        assert stream.results(1)[1].opened.committed_length == 3
        abandoned = engine.counters.abandoned
        held = HeldEngine(served)
        cancel = replica_pb2.FrameEntry(tag=3, cancel=replica_pb2.CancelEntry(tag=2))
        received = stats.stats().entries_received
        stream.send(frame(verify_entry(2, "cancelled", 3), cancel))
        deadline = time.monotonic() + WAIT_S
        while stats.stats().entries_received < received + 2:  # read while held
            assert time.monotonic() < deadline, "the frame was not read"
            time.sleep(0.01)
        held.release()
        result = stream.results(1)[2]
        assert result.error.status == "CANCELLED"
        assert engine.counters.abandoned == abandoned + 1
        # The verify never ran: the session is still at 3, and goes on from there.
        stream.send(frame(verify_entry(4, "cancelled", 3)))
        got = stream.results(1)
        assert set(got) == {4}  # the cancel (tag 3) was never answered
        assert got[4].verdict.committed_length == 4
        stream.send(frame(close_entry(5, "cancelled")))
        assert stream.results(1)[5].closed.existed
    finally:
        stream.close()
        stats.close()


def test_a_call_the_router_stops_waiting_for_is_cancelled_on_the_replica(served: Served) -> None:
    # A block is posted (fire and forget: nobody times it out), so the call given up here is
    # an open: the client stops waiting after its timeout and cancels the entry.
    engine = served.verifier.engine
    client = GrpcVerifier(served.address, timeout_s=WAIT_S, secret=SECRET)
    try:
        abandoned = engine.counters.abandoned
        received = client.stats().entries_received
        held = HeldEngine(served)
        with pytest.raises(ReplicaUnavailableError, match="no answer within"):
            run(client.open_session("given-up", [1, 2, 3], GREEDY, 0, timeout_s=0.2))
        # The router's next frame carries the cancel: once the replica has read it (the open
        # and the cancel: two entries), the engine may go on.
        deadline = time.monotonic() + WAIT_S
        while client.stats().entries_received < received + 2:
            assert time.monotonic() < deadline, "the router sent no cancel"
            time.sleep(0.01)
        held.release()
        deadline = time.monotonic() + WAIT_S
        # The cancel arrives with the router's next frame.
        while engine.counters.abandoned == abandoned:
            assert time.monotonic() < deadline, "the replica ran the call nobody waited for"
            time.sleep(0.01)
        # The open never ran: nothing is held under the name, which opens afresh and serves.
        assert served.verifier.stats().num_sessions == 0
        assert run(client.open_session("given-up", [1, 2, 3], GREEDY, 0)) == 3
        assert verify(client, "given-up", DraftBlock(3, ())).committed_length == 4
        assert run(client.close_session("given-up"))
    finally:
        client.close()
