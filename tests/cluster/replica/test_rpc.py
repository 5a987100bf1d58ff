"""The replica servicers over real loopback gRPC: status codes, call handling, the server.

Every session call is an entry of a Frames stream (`rpc Frames`): these tests drive one stream
per replica by hand (`tests.replicas.RawStream`), so they see exactly what any router would:
each entry's answer, or its `EntryError` (the status name and details a unary call would have
failed with) while the stream goes on. Stats is a unary call, sent with the generated stubs:
its status code and details on the wire.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc
import pytest

from cluster.replica import frames
from cluster.replica.rpc import INTERNAL_ERROR_MESSAGE, CallGuard, start_server
from cluster.runtime import errors
from cluster.runtime.call_scope import caller_gone
from cluster.runtime.models import LoadedModel
from drafter.drafter import Drafter
from protos import replica_pb2, replica_pb2_grpc, sampling_pb2
from tests.replicas import RawStream, answer, refusal, serve_drafter, serve_verifier
from tests.wire_messages import raw_sparse
from verifier.config import VerifierConfig
from verifier.verifier import Verifier

PROMPT = list(b"def add(a, b):")
GREEDY = sampling_pb2.SamplingParams()


@dataclass
class Replicas:
    drafter: Drafter
    verifier: Verifier
    drafter_stub: Any
    verifier_stub: Any
    drafter_frames: RawStream
    """One Frames stream to the drafter, kept open for the module (as a router keeps it)."""
    verifier_frames: RawStream


@pytest.fixture(scope="module")
def replicas(tiny_target: LoadedModel, tiny_draft: LoadedModel) -> Iterator[Replicas]:
    drafter, verifier = Drafter(tiny_draft), Verifier(tiny_target, VerifierConfig(max_sessions=4))
    drafter_server, drafter_port = serve_drafter(drafter)
    verifier_server, verifier_port = serve_verifier(verifier)
    drafter_channel = grpc.insecure_channel(f"127.0.0.1:{drafter_port}")
    verifier_channel = grpc.insecure_channel(f"127.0.0.1:{verifier_port}")
    drafter_frames = RawStream(drafter_channel, "Drafter")
    verifier_frames = RawStream(verifier_channel, "Verifier")
    yield Replicas(
        drafter,
        verifier,
        replica_pb2_grpc.DrafterStub(drafter_channel),
        replica_pb2_grpc.VerifierStub(verifier_channel),
        drafter_frames,
        verifier_frames,
    )
    drafter_frames.close()
    verifier_frames.close()
    drafter_channel.close()
    verifier_channel.close()
    drafter_server.stop(None)
    verifier_server.stop(None)


def open_request(session_id: str, **fields: Any) -> replica_pb2.OpenSessionRequest:
    return replica_pb2.OpenSessionRequest(
        session_id=session_id, prompt_token_ids=PROMPT, sampling=GREEDY, **fields
    )


def close_request(session_id: str) -> replica_pb2.CloseSessionRequest:
    return replica_pb2.CloseSessionRequest(session_id=session_id)


@pytest.fixture
def session(replicas: Replicas, request: pytest.FixtureRequest) -> Iterator[str]:
    """A greedy session open on both replicas, closed afterwards."""
    session_id = request.node.name
    for stream in (replicas.drafter_frames, replicas.verifier_frames):
        opened = answer(stream.call("open", open_request(session_id, seed=1)), "opened")
        assert opened.committed_length == len(PROMPT)
    yield session_id
    for stream in (replicas.drafter_frames, replicas.verifier_frames):
        answer(stream.call("close", close_request(session_id)), "closed")


def draft(replicas: Replicas, **fields: Any) -> replica_pb2.FrameResult:
    return replicas.drafter_frames.call("draft", replica_pb2.DraftRequest(**fields))


def verify(replicas: Replicas, session_id: str, block: Any) -> replica_pb2.FrameResult:
    request = replica_pb2.VerifyRequest(session_id=session_id, block=block)
    return replicas.verifier_frames.call("verify", request)


# --- happy path -------------------------------------------------------------------------------


def test_draft_and_verify_round(replicas: Replicas, session: str) -> None:
    block = answer(
        draft(replicas, session_id=session, base_length=len(PROMPT), num_tokens=4), "block"
    )
    assert block.base_length == len(PROMPT) and len(block.token_ids) == 4
    assert not block.draft_probs  # greedy: q is one-hot, nothing sent
    verdict = answer(verify(replicas, session, block), "verdict")
    assert verdict.base_length == len(PROMPT)
    assert verdict.committed_length == len(PROMPT) + verdict.num_accepted + 1
    assert (
        list(verdict.token_ids[: verdict.num_accepted])
        == list(block.token_ids)[: verdict.num_accepted]
    )
    assert not verdict.dropped and verdict.num_matched == 0  # based where the session stood
    stats = replicas.verifier_stub.Stats(replica_pb2.StatsRequest())
    assert stats.num_sessions == 1 and stats.num_cached_tokens > 0
    # Each side's engine reports its load with the call it served, and its figures in Stats.
    assert block.HasField("load") and block.load.batch_sequences >= 1
    assert verdict.HasField("load") and verdict.load.batch_tokens >= 1
    assert stats.HasField("engine") and stats.engine.steps >= 1
    # The entries came over the stream, and its frames are counted.
    assert stats.frames_received >= 1 and stats.entries_received >= 2
    assert stats.results_sent >= 2 and stats.frames_sent >= 1


def test_close_reports_whether_the_session_existed(replicas: Replicas, session: str) -> None:
    stream = replicas.verifier_frames
    assert answer(stream.call("close", close_request(session)), "closed").existed
    assert not answer(stream.call("close", close_request(session)), "closed").existed


# --- status codes -----------------------------------------------------------------------------


def test_stale_base_is_failed_precondition(replicas: Replicas, session: str) -> None:
    status, message = refusal(draft(replicas, session_id=session, base_length=3, num_tokens=2))
    assert status == "FAILED_PRECONDITION"
    assert message == (
        f"session {session!r} has committed length {len(PROMPT)}, "
        "but the request is based on length 3"
    )
    # A verifier refuses a block based past its session. (A block based before it is no
    # longer an error: it is verified from where the session stands, or dropped; below.)
    ahead = len(PROMPT) + 3
    status, message = refusal(verify(replicas, session, replica_pb2.DraftBlock(base_length=ahead)))
    assert status == "FAILED_PRECONDITION"
    assert message == (
        f"session {session!r} has committed length {len(PROMPT)}, "
        f"but the block is based on length {ahead}"
    )


def test_a_block_based_before_the_session_is_dropped_when_it_parts_from_it(
    replicas: Replicas, session: str
) -> None:
    # An empty block based at 3 asks for the target's token at 3; the session already holds
    # the prompt's token there: the block is dropped, nothing committed.
    verdict = answer(verify(replicas, session, replica_pb2.DraftBlock(base_length=3)), "verdict")
    assert verdict.dropped and list(verdict.token_ids) == []
    assert verdict.committed_length == len(PROMPT)
    # A block that drafted the prompt's own tokens from 3 on, then one more, is verified from
    # where the session stands: its tokens the session holds count as matched.
    held = PROMPT[3:]
    block = replica_pb2.DraftBlock(base_length=3, token_ids=[*held, 65])
    verdict = answer(verify(replicas, session, block), "verdict")
    assert not verdict.dropped and verdict.num_matched == len(held)
    assert verdict.base_length == len(PROMPT)
    assert verdict.committed_length == len(PROMPT) + verdict.num_accepted + 1


def test_unknown_session_is_not_found(replicas: Replicas) -> None:
    status, message = refusal(verify(replicas, "nobody", replica_pb2.DraftBlock()))
    assert status == "NOT_FOUND"
    assert message == (
        "no open session 'nobody' "
        "(closed, evicted after idling or past its deadline, or never opened)"
    )
    status, _ = refusal(draft(replicas, session_id="nobody", base_length=1, num_tokens=1))
    assert status == "NOT_FOUND"


def test_out_of_vocab_token_is_invalid_argument(replicas: Replicas, session: str) -> None:
    vocab = replicas.verifier.vocab_size
    block = replica_pb2.DraftBlock(base_length=len(PROMPT), token_ids=[65, vocab])
    status, message = refusal(verify(replicas, session, block))
    assert status == "INVALID_ARGUMENT"
    assert message == f"block.tokens[1] = {vocab} is outside the vocabulary (0..{vocab - 1})"


def test_duplicate_and_too_many_sessions(replicas: Replicas, session: str) -> None:
    stream = replicas.verifier_frames

    def open_session(session_id: str) -> replica_pb2.FrameResult:
        return stream.call("open", open_request(session_id))

    assert refusal(open_session(session))[0] == "ALREADY_EXISTS"
    extra = [f"{session}-{i}" for i in range(3)]  # the verifier holds at most 4 sessions
    for session_id in extra:
        assert answer(open_session(session_id), "opened").committed_length == len(PROMPT)
    assert refusal(open_session("one-too-many"))[0] == "RESOURCE_EXHAUSTED"
    for session_id in extra:
        answer(stream.call("close", close_request(session_id)), "closed")


# Garbage a misbehaving client could send: each field out of what it may hold.
GARBAGE_DRAFTS: dict[str, tuple[dict[str, Any], str, str]] = {
    "empty session id": (
        dict(session_id="", base_length=len(PROMPT), num_tokens=1),
        "INVALID_ARGUMENT",
        "session_id must not be empty",
    ),
    "negative appended token": (
        dict(base_length=len(PROMPT), appended_token_ids=[5, -7], num_tokens=1),
        "INVALID_ARGUMENT",
        "appended_tokens[1] = -7 is outside the vocabulary",
    ),
    "huge base length": (
        dict(base_length=2**64 - 1, num_tokens=1),
        "FAILED_PRECONDITION",
        "based on length 18446744073709551615",
    ),
    "huge num_tokens": (
        dict(base_length=len(PROMPT), num_tokens=2**32 - 1),
        "INVALID_ARGUMENT",
        "num_tokens must be in 1..32, got 4294967295",
    ),
    "zero num_tokens": (
        dict(base_length=len(PROMPT)),
        "INVALID_ARGUMENT",
        "num_tokens must be in 1..32, got 0",
    ),
    "huge truncate_to": (
        dict(base_length=len(PROMPT), num_tokens=1, truncate_to=2**64 - 1),
        "INVALID_ARGUMENT",
        "truncate_to must be in",
    ),
}


@pytest.mark.parametrize("case", GARBAGE_DRAFTS)
def test_garbage_draft_request_gets_a_precise_code(
    replicas: Replicas, session: str, case: str
) -> None:
    fields, code, details = GARBAGE_DRAFTS[case]
    status, message = refusal(draft(replicas, **{"session_id": session, **fields}))
    assert (status, details in message) == (code, True), message


GARBAGE_BLOCKS = {
    "probs for some tokens": (
        replica_pb2.DraftBlock(token_ids=[1, 2], draft_probs=[raw_sparse(token_ids=[1])]),
        "block has 2 tokens but 1 draft distributions",
    ),
    "ids without probs": (
        replica_pb2.DraftBlock(token_ids=[1], draft_probs=[raw_sparse(token_ids=[1])]),
        "draft_probs[0] has 1 token ids but 0 probabilities",
    ),
    "negative q": (
        replica_pb2.DraftBlock(
            token_ids=[1],
            draft_probs=[raw_sparse(token_ids=[1, 2], probs=[1.5, -0.5])],
        ),
        "sparse row 0 has probabilities not finite and >= 0",
    ),
    "q id out of vocab": (
        replica_pb2.DraftBlock(
            token_ids=[1],
            draft_probs=[raw_sparse(token_ids=[-1], probs=[1.0])],
        ),
        "sparse row 0 has token ids outside",
    ),
}


@pytest.mark.parametrize("case", GARBAGE_BLOCKS)
def test_garbage_block_is_invalid_argument(replicas: Replicas, session: str, case: str) -> None:
    block, details = GARBAGE_BLOCKS[case]
    block.base_length = len(PROMPT)
    status, message = refusal(verify(replicas, session, block))
    assert status == "INVALID_ARGUMENT"
    assert details in message


@pytest.mark.parametrize(
    ("sampling", "details"),
    [
        (sampling_pb2.SamplingParams(temperature=float("nan")), "temperature must be"),
        (sampling_pb2.SamplingParams(temperature=1.0, top_p=0.0), "top_p must satisfy"),
    ],
)
def test_garbage_sampling_is_invalid_argument(
    replicas: Replicas, sampling: sampling_pb2.SamplingParams, details: str
) -> None:
    request = replica_pb2.OpenSessionRequest(
        session_id="s", prompt_token_ids=[1], sampling=sampling
    )
    status, message = refusal(replicas.drafter_frames.call("open", request))
    assert status == "INVALID_ARGUMENT"
    assert details in message


def test_unexpected_exception_is_internal_without_traceback(
    replicas: Replicas,
    session: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken_draft(*args: object, **kwargs: object) -> NoReturn:
        raise RuntimeError("secret detail from deep inside")

    # `submit_draft`: what a draft entry goes through.
    monkeypatch.setattr(replicas.drafter, "submit_draft", broken_draft)
    with caplog.at_level(logging.ERROR, logger="cluster.replica.frames"):
        result = draft(replicas, session_id=session, base_length=len(PROMPT), num_tokens=1)
    assert refusal(result) == ("INTERNAL", frames.INTERNAL_ERROR_MESSAGE)
    # The traceback is in the replica's log, and only there.
    [record] = [r for r in caplog.records if r.name == "cluster.replica.frames"]
    assert record.getMessage() == "Drafter frame entry failed unexpectedly"
    assert record.exc_info is not None and "secret detail" in str(record.exc_info[1])
    # The entry failed alone: the stream and the session carry on.
    monkeypatch.undo()
    block = answer(
        draft(replicas, session_id=session, base_length=len(PROMPT), num_tokens=1), "block"
    )
    assert block.base_length == len(PROMPT)


def test_an_unexpected_exception_in_stats_is_internal_without_traceback(
    replicas: Replicas, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Stats stays a unary call under the servicer's `CallGuard`.
    def broken_stats() -> NoReturn:
        raise RuntimeError("secret detail from deep inside")

    monkeypatch.setattr(replicas.drafter, "stats", broken_stats)
    with (
        caplog.at_level(logging.ERROR, logger="cluster.replica.rpc"),
        pytest.raises(grpc.RpcError) as caught,
    ):
        replicas.drafter_stub.Stats(replica_pb2.StatsRequest())
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert caught.value.details() == INTERNAL_ERROR_MESSAGE
    [record] = [r for r in caplog.records if r.name == "cluster.replica.rpc"]
    assert record.getMessage() == "Drafter.Stats failed unexpectedly"
    assert record.exc_info is not None and "secret detail" in str(record.exc_info[1])


# --- rpc building blocks ----------------------------------------------------------------------


class AbortingContext:
    """Stands in for grpc.ServicerContext: the status set on it, and abort raises, as the real
    one does."""

    trailing: tuple[tuple[str, str], ...] = ()
    code: grpc.StatusCode | None = None
    details: str | None = None

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def set_trailing_metadata(self, metadata: Sequence[tuple[str, str]]) -> None:
        self.trailing = tuple(metadata)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Called when the RPC ends (here: when a test says the caller went)."""
        self.callbacks.append(callback)
        return True

    def abort(self, code: grpc.StatusCode, details: str) -> NoReturn:
        raise RuntimeError(f"aborted {code.name}: {details}")


def test_call_guard_lets_calls_run_at_once() -> None:
    # The component's engine batches concurrent calls; a guard that serialised them would cap
    # every batch at one session.
    guard = CallGuard("Fake")
    barrier = threading.Barrier(4, timeout=10)

    def worker() -> None:
        guard.run(AbortingContext(), "Call", barrier.wait)  # all four must be inside at once

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not barrier.broken


def test_call_guard_sends_a_retry_hint_with_a_transient_refusal() -> None:
    context = AbortingContext()

    def call() -> NoReturn:
        raise errors.ResourceExhaustedError("KV pool full", retry_after_s=1.5)

    with pytest.raises(RuntimeError, match="aborted RESOURCE_EXHAUSTED: KV pool full"):
        CallGuard("Fake").run(context, "Call", call)
    assert context.trailing == (("retry-after-ms", "1500"),)


def test_call_guard_tells_the_engine_when_the_caller_goes() -> None:
    context = AbortingContext()
    seen: list[bool] = []

    def call() -> int:
        gone = caller_gone()
        assert gone is not None and not gone.is_set()
        for callback in context.callbacks:
            callback()  # the RPC ends under the call: cancelled, timed out, disconnected
        seen.append(gone.is_set())
        return 7

    assert CallGuard("Fake").run(context, "Call", call) == 7
    assert seen == [True]
    assert caller_gone() is None  # the scope ends with the call


def test_call_guard_maps_tandem_errors_to_their_code() -> None:
    def call() -> NoReturn:
        raise errors.StaleBaseError("base moved")

    with pytest.raises(RuntimeError, match="aborted FAILED_PRECONDITION: base moved"):
        CallGuard("Fake").run(AbortingContext(), "Call", call)


def test_start_server_picks_a_free_port_and_refuses_a_taken_one() -> None:
    server, port = start_server(lambda server: None)
    try:
        assert port > 0
        with pytest.raises(RuntimeError, match=f"cannot bind a gRPC server to 127.0.0.1:{port}"):
            start_server(lambda server: None, port=port)
    finally:
        server.stop(None)


def test_start_server_binds_the_port_it_is_given() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free_port = probe.getsockname()[1]
    server, port = start_server(lambda server: None, port=free_port)
    server.stop(None)
    assert port == free_port
