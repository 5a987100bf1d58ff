"""A drafter or verifier replica's gRPC server on its own (no Serve, no registry), and ways to
call it, for tests.

`serve_replica` starts a server with one side's servicer (see `cluster.replica.rpc.start_server`
for the options); `serve_drafter` and `serve_verifier` build that servicer over a component.

Every session call travels on the replicas' Frames stream (`rpc Frames`, protos/replica.proto):
`RawStream` drives one such stream by hand, as a broken or hostile router would (frames or raw
bytes out, every `FrameResult` in, by tag; how the stream ended); `verify` is one block posted
through a `VerifierPort` (the router's clients post fire-and-forget) and its verdict waited for.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable
from typing import Any

import grpc

from cluster.replica.rpc import DEFAULT_MAX_CONCURRENT_RPCS, DEFAULT_MAX_WORKERS, start_server
from cluster.replica.servicer import SessionServicer
from cluster.routing.ports import VerifierPort
from cluster.routing.session_events import SessionEvents
from cluster.runtime.draft_block import DraftBlock, Verdict
from cluster.wire.requests import FRAME_VERSION
from drafter.drafter import Drafter
from drafter.servicer import DrafterServicer
from protos import replica_pb2
from verifier.servicer import VerifierServicer
from verifier.verifier import Verifier

WAIT_S = 30.0
"""Upper bound on waits that end as soon as the replica answers; never reached when it works."""


def serve_replica(
    servicer: SessionServicer[Any],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = DEFAULT_MAX_WORKERS,
    secret: str | None = None,
    max_concurrent_rpcs: int = DEFAULT_MAX_CONCURRENT_RPCS,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for `servicer`; returns it and its port."""
    return start_server(
        servicer.add_to_server, host, port, max_workers, secret, max_concurrent_rpcs
    )


def serve_drafter(drafter: Drafter, **options: Any) -> tuple[grpc.Server, int]:
    """`serve_replica` for a drafter."""
    return serve_replica(DrafterServicer(drafter), **options)


def serve_verifier(verifier: Verifier, **options: Any) -> tuple[grpc.Server, int]:
    """`serve_replica` for a verifier."""
    return serve_replica(VerifierServicer(verifier), **options)


def frame(
    *entries: replica_pb2.FrameEntry, version: int = FRAME_VERSION
) -> replica_pb2.RouterFrame:
    """A `RouterFrame` holding `entries`, in this order."""
    return replica_pb2.RouterFrame(version=version, entries=entries)


class StreamEnded(AssertionError):
    """The stream ended (or went silent for `WAIT_S`) while a test waited for a result."""


class RawStream:
    """One Frames call driven by hand: `send` frames (or raw bytes), read the replica's results.

    `target`: an open channel (left open) or a "host:port" address (a channel opened here and
    closed by `close`); `service`: "Drafter" or "Verifier"; `metadata`: sent when the stream
    opens (the cluster's secret); `serialize`: how a sent item becomes bytes (the identity, to
    send raw bytes). A thread reads the replica's frames as they come, so every wait here is
    bounded by `WAIT_S` (a replica that never answers fails the test instead of hanging it).
    """

    def __init__(
        self,
        target: grpc.Channel | str,
        service: str = "Verifier",
        metadata: Any = None,
        serialize: Callable[[Any], bytes] = replica_pb2.RouterFrame.SerializeToString,
        timeout_s: float | None = None,
    ) -> None:
        if isinstance(target, str):
            self._channel: grpc.Channel | None = grpc.insecure_channel(target)
            channel = self._channel
        else:
            self._channel, channel = None, target
        self._outgoing: queue.SimpleQueue[Any] = queue.SimpleQueue()
        call = channel.stream_stream(
            f"/tandem.v1.{service}/Frames",
            request_serializer=serialize,
            response_deserializer=replica_pb2.ReplicaFrame.FromString,
        )
        self._responses = call(iter(self._outgoing.get, None), metadata=metadata, timeout=timeout_s)
        self._incoming: queue.SimpleQueue[replica_pb2.ReplicaFrame | None] = queue.SimpleQueue()
        self._unread: deque[replica_pb2.FrameResult] = deque()
        """Results received and not yet taken, in the order they came."""
        self.frames: list[replica_pb2.ReplicaFrame] = []
        """Every frame received so far."""
        self.ended: tuple[grpc.StatusCode, str] | None = None
        """How the call ended, once it has (`OK` for a stream the replica finished)."""
        self._tags = itertools.count(1)
        self._reader = threading.Thread(target=self._read, name="raw-frames", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for received in self._responses:
                self._incoming.put(received)
        except grpc.RpcError as error:
            self.ended = (error.code(), error.details() or "")
        else:
            self.ended = (grpc.StatusCode.OK, "")
        self._incoming.put(None)

    def send(self, item: Any) -> None:
        """Send a frame (or whatever `serialize` takes) as the next message."""
        self._outgoing.put(item)

    def next_tag(self) -> int:
        """A tag not used yet by `entry` on this stream."""
        return next(self._tags)

    def entry(self, kind: str, request: Any, tag: int | None = None) -> replica_pb2.FrameEntry:
        """A `FrameEntry` carrying `request` in its `kind` field ("open", "draft", ...), with
        `tag` (default: the stream's next)."""
        return replica_pb2.FrameEntry(
            tag=self.next_tag() if tag is None else tag, **{kind: request}
        )

    def call(self, kind: str, request: Any) -> replica_pb2.FrameResult:
        """Send `request` as the only entry of a frame and wait for its result (results
        under other tags that come first stay unread)."""
        entry = self.entry(kind, request)
        self.send(frame(entry))
        return self.result(entry.tag)

    def _receive(self) -> None:
        """Wait for the next frame and queue its results; `StreamEnded` if none comes."""
        try:
            received = self._incoming.get(timeout=WAIT_S)
        except queue.Empty:
            raise StreamEnded(f"no frame within {WAIT_S:g} s") from None
        if received is None:
            self._incoming.put(None)  # every later wait sees the end too
            raise StreamEnded(f"the stream ended: {self.ended}")
        self.frames.append(received)
        self._unread.extend(received.results)

    def result(self, tag: int) -> replica_pb2.FrameResult:
        """The first unread result under `tag`, waiting for it."""
        while True:
            for result in self._unread:
                if result.tag == tag:
                    self._unread.remove(result)
                    return result
            self._receive()

    def results(self, count: int) -> dict[int, replica_pb2.FrameResult]:
        """The next `count` unread results, by tag (one per tag)."""
        got: dict[int, replica_pb2.FrameResult] = {}
        while len(got) < count:
            if not self._unread:
                self._receive()
                continue
            result = self._unread.popleft()
            got[result.tag] = result
        return got

    def unread(self) -> list[replica_pb2.FrameResult]:
        """The results received and not yet taken (without waiting for more)."""
        return list(self._unread)

    def take_unread(self) -> list[replica_pb2.FrameResult]:
        """`unread`, taken: they are no longer kept."""
        taken = list(self._unread)
        self._unread.clear()
        return taken

    def half_close(self) -> None:
        """Send nothing more: the replica ends the stream once every entry is answered."""
        self._outgoing.put(None)

    def status(self) -> tuple[grpc.StatusCode, str]:
        """How the call ended, reading whatever results come before (kept unread)."""
        while self.ended is None or not self._incoming.empty():
            try:
                self._receive()
            except StreamEnded:
                break
        if self.ended is None:
            raise StreamEnded(f"the stream did not end within {WAIT_S:g} s")
        return self.ended

    def close(self) -> None:
        self._outgoing.put(None)
        self._responses.cancel()
        self._reader.join(WAIT_S)
        if self._channel is not None:
            self._channel.close()

    def __enter__(self) -> RawStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def answer(result: replica_pb2.FrameResult, kind: str) -> Any:
    """`result`'s answer, which must be of `kind` ("opened", "block", "verdict", "closed",
    "predrafted"); an error or another kind fails the test with what came instead."""
    got = result.WhichOneof("result")
    if got != kind:
        came = f"{result.error.status}: {result.error.message}" if got == "error" else got
        raise AssertionError(f"entry {result.tag}: wanted {kind}, got {came}")
    return getattr(result, kind)


def refusal(result: replica_pb2.FrameResult) -> tuple[str, str]:
    """The status name and message of `result`'s `EntryError`; an answer fails the test."""
    got = result.WhichOneof("result")
    assert got == "error", f"entry {result.tag}: wanted an error, got {got}: {result}"
    return result.error.status, result.error.message


def verify(
    port: VerifierPort,
    session_id: str,
    block: DraftBlock,
    defer_bonus: bool = False,
    timeout_s: float = WAIT_S,
) -> Verdict:
    """Post `block` for a session that is not running and wait for its verdict (raising the
    error it failed with): what a blocking verify was before ports only posted."""
    events = SessionEvents()
    port.post(session_id, block, defer_bonus, events, 0)
    events.ready().result(timeout_s)
    [event] = events.take()
    assert event.post_id == 0, event
    if isinstance(event.item, Exception):
        raise event.item
    return event.item
