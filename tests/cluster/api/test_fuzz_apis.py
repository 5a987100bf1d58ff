"""Hostile input, thousands of times: every public and internal call with malformed fields or
garbage bytes gets a precise status (never INTERNAL or UNKNOWN), and the servers keep serving.

Over real loopback gRPC: a drafter and a verifier replica server (with the cluster secret,
and calls that carry it, so the fuzz reaches the handlers) and the public API on a plain gRPC
server over the in-process router, with one tenant whose key most calls carry (the rest carry
none, or a made-up one). A replica's session calls are entries of its Frames stream: each kind
of entry (the side's own, the other side's, one with no call, with a cancel beside it) is sent
malformed on one long-lived stream per replica, as a router keeps it, and must be answered
with a precise `EntryError` status while the stream goes on; a running verifier session's own
reports must be verdicts or precise errors too. Garbage bytes go to every replica method (Stats,
Reference, and Frames, whose stream then ends with a precise status). Counts per status are
printed (`pytest -s`) for the record.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cluster.api.service import TandemService
from cluster.api.service_config import ServiceConfig
from cluster.api.tenants import AuthConfig, TenantConfig, Tenants, hash_api_key, new_api_key
from cluster.local import LocalTandem
from cluster.runtime.models import LoadedModel
from cluster.wire.metadata import SECRET_METADATA_KEY
from drafter.drafter import Drafter
from protos import generate_pb2, generate_pb2_grpc, replica_pb2, replica_pb2_grpc, sampling_pb2
from tests.cluster.grpc_front import serve_local
from tests.conftest import encode
from tests.replicas import RawStream, answer, frame, serve_drafter, serve_verifier
from tests.wire_messages import raw_sparse
from verifier.verifier import Verifier

SECRET = "fuzz-secret-0123456789"
AUTH = ((SECRET_METADATA_KEY, SECRET),)
EXAMPLES = 700  # per test; nine tests
KEY = new_api_key()
PRECISE = {
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PRECISE_ENTRY = {code.name for code in PRECISE} | {"DEADLINE_EXCEEDED"}
"""The same, as an `EntryError` names them (an entry is never UNAUTHENTICATED: its stream is),
and DEADLINE_EXCEEDED: a fuzzed close can free "live", and a fuzzed open then re-open it with a
fuzzed time limit, after which a call on it is answered that its session passed its deadline."""
ANSWERS = {
    "open": "opened",
    "draft": "block",
    "predraft": "predrafted",
    "verify": "verdict",
    "close": "closed",
}
"""What each kind of entry is answered with, when it is answered."""
OUTCOMES: Counter[str] = Counter()

int32s = st.integers(-(2**31), 2**31 - 1)
uint64s = st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1))
uint32s = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
floats32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
session_ids = st.one_of(st.just("live"), st.just(""), st.text(max_size=40), st.text(min_size=500))
token_lists = st.one_of(
    st.lists(st.integers(0, 300), max_size=12),
    st.lists(int32s, max_size=12),
    st.just([1] * 5000),  # past every context limit
)
garbage = st.binary(min_size=1, max_size=200)
printable = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60)
authorizations = st.one_of(
    st.just(f"Bearer {KEY}"),
    st.just(f"Bearer {KEY}"),
    st.none(),
    printable,
    printable.map(lambda key: f"Bearer {key}"),
)


def _metadata(authorization: str | None) -> tuple[tuple[str, str], ...]:
    return () if authorization is None else (("authorization", authorization),)


@st.composite
def samplings(draw: st.DrawFn) -> sampling_pb2.SamplingParams:
    usual = st.sampled_from([0.0, 0.7, 1.0])  # valid often enough to reach deeper checks
    message = sampling_pb2.SamplingParams(
        temperature=draw(st.one_of(usual, floats32)),
        top_k=draw(st.one_of(st.integers(0, 50), int32s)),
    )
    if draw(st.booleans()):
        message.top_p = draw(st.one_of(st.sampled_from([0.5, 0.9]), floats32))
    return message


@st.composite
def advances(draw: st.DrawFn) -> replica_pb2.Advance:
    """Where a running session ends: mostly a few tokens past a short prompt, else anything."""
    return replica_pb2.Advance(
        max_length=draw(st.one_of(st.integers(0, 24), uint64s)),
        end_token_ids=draw(st.lists(st.one_of(st.integers(0, 300), int32s), max_size=3)),
        ends_from=draw(uint64s),
    )


@st.composite
def open_requests(draw: st.DrawFn) -> replica_pb2.OpenSessionRequest:
    message = replica_pb2.OpenSessionRequest(
        session_id=draw(session_ids),
        prompt_token_ids=draw(token_lists),
        sampling=draw(samplings()),
        seed=draw(uint64s),
    )
    if draw(st.booleans()):
        message.time_limit_ms = draw(uint32s)
    if draw(st.booleans()):
        message.max_new_tokens = draw(uint32s)
    if draw(st.booleans()):  # a running session on a verifier; ignored by a drafter
        message.advance.CopyFrom(draw(advances()))
    return message


@st.composite
def draft_requests(draw: st.DrawFn) -> replica_pb2.DraftRequest:
    message = replica_pb2.DraftRequest(
        session_id=draw(session_ids),
        base_length=draw(uint64s),
        appended_token_ids=draw(token_lists),
        num_tokens=draw(uint32s),
    )
    if draw(st.booleans()):
        message.truncate_to = draw(uint64s)
    return message


@st.composite
def predraft_requests(draw: st.DrawFn) -> replica_pb2.PredraftRequest:
    branches = st.builds(replica_pb2.PredraftBranch, accepted=uint32s, rank=uint32s)
    message = replica_pb2.PredraftRequest(
        session_id=draw(session_ids),
        base_length=draw(uint64s),
        appended_token_ids=draw(token_lists),
        block_token_ids=draw(st.lists(st.one_of(st.integers(0, 300), int32s), max_size=6)),
        branches=draw(st.lists(branches, max_size=9)),
        num_tokens=draw(uint32s),
    )
    if draw(st.booleans()):
        message.truncate_to = draw(uint64s)
    return message


@st.composite
def blocks(draw: st.DrawFn) -> replica_pb2.DraftBlock:
    tokens = draw(st.lists(st.one_of(st.integers(0, 300), int32s), max_size=6))
    rows = draw(
        st.lists(
            st.one_of(
                st.builds(
                    raw_sparse,
                    token_ids=st.lists(st.one_of(st.integers(0, 300), int32s), max_size=5),
                    probs=st.lists(floats32, max_size=5),
                ),
                # Bytes that are no whole number of 4-byte values, or anything at all.
                st.builds(
                    replica_pb2.SparseDistribution,
                    token_ids=st.binary(max_size=22),
                    probs=st.binary(max_size=22),
                ),
            ),
            max_size=7,
        )
    )
    assumed = draw(st.lists(st.one_of(st.integers(0, 300), int32s), max_size=4))
    return replica_pb2.DraftBlock(
        base_length=draw(uint64s), token_ids=tokens, draft_probs=rows, assumed_token_ids=assumed
    )


@st.composite
def verify_requests(draw: st.DrawFn) -> replica_pb2.VerifyRequest:
    return replica_pb2.VerifyRequest(
        session_id=draw(session_ids), block=draw(blocks()), defer_bonus=draw(st.booleans())
    )


def close_requests() -> st.SearchStrategy[replica_pb2.CloseSessionRequest]:
    return st.builds(replica_pb2.CloseSessionRequest, session_id=session_ids)


def entries(
    **requests: st.SearchStrategy[Any],
) -> st.SearchStrategy[tuple[str | None, Any]]:
    """(kind, request) of a frame entry: one of `requests` by kind, or an entry with no call."""
    kinds = [st.tuples(st.just(kind), strategy) for kind, strategy in requests.items()]
    return st.one_of(*kinds, st.just((None, None)))


# A cancel beside the entry: none, of the entry itself, or of any tag at all.
cancels = st.one_of(st.none(), st.just("own"), uint64s)


@st.composite
def reference_requests(draw: st.DrawFn) -> replica_pb2.ReferenceRequest:
    sampling = draw(samplings())
    sampling.rule = draw(st.sampled_from([*sampling_pb2.SamplingRule.values(), 7]))
    return replica_pb2.ReferenceRequest(
        prompt_token_ids=draw(token_lists),
        served_token_ids=draw(token_lists),
        sampling=sampling,
        seed=draw(uint64s),
        dtype=draw(st.one_of(st.sampled_from(["", "float32"]), st.text(max_size=8))),
    )


@st.composite
def generate_requests(draw: st.DrawFn) -> generate_pb2.GenerateRequest:
    message = generate_pb2.GenerateRequest(
        max_tokens=draw(st.one_of(st.integers(-2, 10), st.integers(1, 8), int32s)),
        sampling=draw(samplings()),
        stop=draw(st.lists(st.text(max_size=8), max_size=3)),
    )
    prompt = draw(st.sampled_from(["text", "ids", "none"]))
    if prompt == "text":
        message.text = draw(st.text(max_size=60))
    elif prompt == "ids":
        message.token_ids.ids.extend(draw(token_lists))
    if draw(st.booleans()):
        message.seed = draw(uint64s)
    if draw(st.booleans()):
        message.speculation.draft_tokens = draw(st.one_of(st.integers(-2, 40), int32s))
    if draw(st.booleans()):
        message.speculation.pipelined = draw(st.booleans())
    return message


@dataclass
class Servers:
    drafter: grpc.Channel
    verifier: grpc.Channel
    public: grpc.Channel
    drafter_frames: RawStream
    """The fuzz's one Frames stream to the drafter, kept open throughout (as a router's)."""
    verifier_frames: RawStream


@pytest.fixture(scope="module")
def servers(
    local_tandem: LocalTandem, tiny_target: LoadedModel, tiny_draft: LoadedModel
) -> Iterator[Servers]:
    drafter_server, drafter_port = serve_drafter(Drafter(tiny_draft), secret=SECRET)
    verifier_server, verifier_port = serve_verifier(Verifier(tiny_target), secret=SECRET)
    service = TandemService(
        local_tandem.router,
        tiny_target.tokenizer,
        ServiceConfig(max_tokens_limit=10),
        tenants=Tenants(
            AuthConfig(tenants=(TenantConfig("fuzz", hash_api_key(KEY), max_tokens_per_request=8),))
        ),
    )
    public_server, public_port = serve_local(service)
    channels = [
        grpc.insecure_channel(f"127.0.0.1:{port}")
        for port in (drafter_port, verifier_port, public_port)
    ]
    streams = [
        RawStream(channels[0], "Drafter", metadata=AUTH),
        RawStream(channels[1], "Verifier", metadata=AUTH),
    ]
    # A live session on each replica, so that calls naming it reach the base-length checks.
    live = replica_pb2.OpenSessionRequest(session_id="live", prompt_token_ids=[5, 6, 7])
    for stream in streams:
        assert answer(stream.call("open", live), "opened").committed_length == 3
    yield Servers(*channels, *streams)
    for stream in streams:
        stream.close()
    for channel in channels:
        channel.close()
    for server in (drafter_server, verifier_server, public_server):
        server.stop(None)
    print("\nfuzz outcomes:", dict(sorted(OUTCOMES.items())))


def _record(api: str, call: Callable[[], Any]) -> None:
    try:
        result = call()
        if isinstance(result, Iterator):
            for _ in result:
                pass
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
    OUTCOMES[f"{api} {code.name}"] += 1
    assert code in PRECISE, f"{api}: {code}"


def _raw(channel: grpc.Channel, method: str, streaming: bool = False) -> Any:
    return (channel.unary_stream if streaming else channel.unary_unary)(method)


def _entry_outcome(
    api: str, result: replica_pb2.FrameResult, kind: str | None, cancelled: bool
) -> str:
    """Count `result` and check it: a precise status (CANCELLED only for an entry whose cancel
    came with it), or the answer its kind of entry gets. Its status name ("OK": answered)."""
    got = result.WhichOneof("result")
    status = result.error.status if got == "error" else "OK"
    OUTCOMES[f"{api} {status}"] += 1
    allowed = PRECISE_ENTRY | ({"CANCELLED"} if cancelled else set())
    assert status in allowed, f"{api}: {status}: {result.error.message}"
    if got != "error":
        assert kind is not None and got == ANSWERS[kind], (api, got)
    return status


def _send_entry(
    stream: RawStream, side: str, kind: str | None, request: Any, cancel: Any
) -> replica_pb2.FrameResult:
    """Send one entry (with a cancel beside it, if asked) in a frame of its own and check
    its result; then the reports that came meanwhile (a running session's own steps)."""
    tag = stream.next_tag()
    entry = replica_pb2.FrameEntry(tag=tag) if kind is None else stream.entry(kind, request, tag)
    sent = [entry]
    cancelled = False
    if cancel is not None:
        target = tag if cancel == "own" else cancel
        cancelled = target == tag
        sent.append(
            replica_pb2.FrameEntry(
                tag=stream.next_tag(), cancel=replica_pb2.CancelEntry(tag=target)
            )
        )
    stream.send(frame(*sent))
    result = stream.result(tag)
    _entry_outcome(f"{side}.{kind or 'empty'}", result, kind, cancelled)
    for report in stream.take_unread():
        _entry_outcome(f"{side}.report", report, "verify", cancelled=False)
    return result


def _close_after(
    stream: RawStream, side: str, opened: replica_pb2.FrameResult, request: Any, close: bool
) -> None:
    """Close a session the fuzz opened: when asked, and always a running one (it would take
    every engine step until its end); never the live one."""
    if request.session_id == "live" or opened.WhichOneof("result") != "opened":
        return
    if close or request.HasField("advance"):
        closing = replica_pb2.CloseSessionRequest(session_id=request.session_id)
        _send_entry(stream, side, "close", closing, None)


@FUZZ
@given(
    call=entries(
        open=open_requests(),
        draft=draft_requests(),
        predraft=predraft_requests(),
        close=close_requests(),
        verify=verify_requests(),  # not a drafter's: refused per entry
    ),
    cancel=cancels,
    close=st.booleans(),
)
def test_drafter_answers_malformed_entries_precisely(
    servers: Servers, call: tuple[str | None, Any], cancel: Any, close: bool
) -> None:
    kind, request = call
    result = _send_entry(servers.drafter_frames, "drafter", kind, request, cancel)
    if kind == "open":
        _close_after(servers.drafter_frames, "drafter", result, request, close)


@FUZZ
@given(
    call=entries(
        open=open_requests(),
        verify=verify_requests(),
        close=close_requests(),
        draft=draft_requests(),  # not a verifier's: refused per entry
        predraft=predraft_requests(),
    ),
    cancel=cancels,
    close=st.booleans(),
)
def test_verifier_answers_malformed_entries_precisely(
    servers: Servers, call: tuple[str | None, Any], cancel: Any, close: bool
) -> None:
    kind, request = call
    result = _send_entry(servers.verifier_frames, "verifier", kind, request, cancel)
    if kind == "open":
        _close_after(servers.verifier_frames, "verifier", result, request, close)


@FUZZ
@given(request=reference_requests())
def test_verifier_answers_malformed_reference_calls_precisely(
    servers: Servers, request: replica_pb2.ReferenceRequest
) -> None:
    stub = replica_pb2_grpc.VerifierStub(servers.verifier)
    _record("verifier.Reference", lambda: stub.Reference(request, metadata=AUTH, timeout=30))


REPLICA_METHODS = [
    f"/tandem.v1.{side}/{method}"
    for side, methods in (
        ("Drafter", ("Stats", "Frames")),
        ("Verifier", ("Stats", "Reference", "Frames")),
    )
    for method in methods
]


def _garbage_frames(channel: grpc.Channel, service: str, payload: bytes) -> grpc.StatusCode:
    """`payload` as the only message of a Frames stream, which is then half-closed: the
    stream's status (bytes that happen to parse as a frame of this version are served, and
    their entries' statuses checked)."""
    with RawStream(channel, service, metadata=AUTH, serialize=lambda raw: raw) as stream:
        stream.send(payload)
        stream.half_close()
        code, _ = stream.status()
        for result in stream.take_unread():
            status = result.error.status if result.WhichOneof("result") == "error" else "OK"
            OUTCOMES[f"replica frame entry {status}"] += 1
            assert status in PRECISE_ENTRY, (status, result.error.message)
    return code


@FUZZ
@given(method=st.sampled_from(REPLICA_METHODS), payload=garbage)
def test_replicas_answer_garbage_bytes_precisely(
    servers: Servers, method: str, payload: bytes
) -> None:
    channel = servers.drafter if "Drafter" in method else servers.verifier
    if method.endswith("/Frames"):
        service = "Drafter" if "Drafter" in method else "Verifier"
        code = _garbage_frames(channel, service, payload)
        OUTCOMES[f"replica frames {code.name}"] += 1
        assert code in PRECISE, f"{method}: {code}"
        return
    _record("replica bytes", lambda: _raw(channel, method)(payload, metadata=AUTH, timeout=30))


@FUZZ
@given(request=generate_requests(), streaming=st.booleans(), authorization=authorizations)
def test_public_api_answers_malformed_requests_precisely(
    servers: Servers,
    request: generate_pb2.GenerateRequest,
    streaming: bool,
    authorization: str | None,
) -> None:
    stub = generate_pb2_grpc.TandemStub(servers.public)
    metadata = _metadata(authorization)
    if streaming:
        _record(
            "public.GenerateStream",
            lambda: stub.GenerateStream(request, timeout=60, metadata=metadata),
        )
    else:
        _record("public.Generate", lambda: stub.Generate(request, timeout=60, metadata=metadata))


@FUZZ
@given(
    request=generate_requests(),
    dtype=st.one_of(st.just(""), st.text(max_size=8)),
    authorization=authorizations,
)
def test_public_audit_answers_malformed_requests_precisely(
    servers: Servers, request: generate_pb2.GenerateRequest, dtype: str, authorization: str | None
) -> None:
    stub = generate_pb2_grpc.TandemStub(servers.public)
    audit = generate_pb2.AuditRequest(request=request, dtype=dtype)
    metadata = _metadata(authorization)
    _record("public.Audit", lambda: stub.Audit(audit, timeout=60, metadata=metadata))


@FUZZ
@given(request_id=st.one_of(st.text(max_size=40), printable), authorization=authorizations)
def test_cancel_and_usage_answer_anything_precisely(
    servers: Servers, request_id: str, authorization: str | None
) -> None:
    stub = generate_pb2_grpc.TandemStub(servers.public)
    metadata = _metadata(authorization)
    cancel = generate_pb2.CancelRequest(request_id=request_id)
    _record("public.Cancel", lambda: stub.Cancel(cancel, timeout=30, metadata=metadata))
    usage = generate_pb2.UsageRequest()
    _record("public.GetUsage", lambda: stub.GetUsage(usage, timeout=30, metadata=metadata))


PUBLIC_METHODS = [
    ("/tandem.v1.Tandem/" + method, method == "GenerateStream")
    for method in ("Generate", "GenerateStream", "Cancel", "GetUsage", "Audit")
]


@FUZZ
@given(method=st.sampled_from(PUBLIC_METHODS), payload=garbage, authorization=authorizations)
def test_public_api_answers_garbage_bytes_precisely(
    servers: Servers, method: tuple[str, bool], payload: bytes, authorization: str | None
) -> None:
    call = _raw(servers.public, *method)
    metadata = _metadata(authorization)
    _record("public bytes", lambda: call(payload, timeout=60, metadata=metadata))


def test_after_the_fuzz_everything_still_serves_exactly(
    servers: Servers, local_tandem: LocalTandem, target_only: dict[str, tuple[int, ...]]
) -> None:
    prompt, expected = next(iter(target_only.items()))
    request = generate_pb2.GenerateRequest(max_tokens=8)
    request.token_ids.ids.extend(encode(local_tandem, prompt))
    response = generate_pb2_grpc.TandemStub(servers.public).Generate(
        request, timeout=60, metadata=_metadata(f"Bearer {KEY}")
    )
    assert tuple(response.token_ids) == expected[:8]
    for channel, stub_class in (
        (servers.drafter, replica_pb2_grpc.DrafterStub),
        (servers.verifier, replica_pb2_grpc.VerifierStub),
    ):
        stats = stub_class(channel).Stats(replica_pb2.StatsRequest(), metadata=AUTH, timeout=30)
        assert stats.num_sessions <= 256
    # The replicas' streams that took the fuzz still serve a session exactly: the drafter
    # drafts, the verifier commits the target's own tokens.
    greedy = sampling_pb2.SamplingParams()
    prompt_tokens = encode(local_tandem, prompt)
    opening = replica_pb2.OpenSessionRequest(
        session_id="after-fuzz", prompt_token_ids=prompt_tokens, sampling=greedy
    )
    closing = replica_pb2.CloseSessionRequest(session_id="after-fuzz")
    drafter = servers.drafter_frames
    assert answer(drafter.call("open", opening), "opened").committed_length == len(prompt_tokens)
    drafting = replica_pb2.DraftRequest(
        session_id="after-fuzz", base_length=len(prompt_tokens), num_tokens=3
    )
    block = answer(drafter.call("draft", drafting), "block")
    assert block.base_length == len(prompt_tokens) and len(block.token_ids) == 3
    assert answer(drafter.call("close", closing), "closed").existed
    verifier = servers.verifier_frames
    assert answer(verifier.call("open", opening), "opened").committed_length == len(prompt_tokens)
    tokens: list[int] = []
    while len(tokens) < 8:
        empty = replica_pb2.DraftBlock(base_length=len(prompt_tokens) + len(tokens))
        verifying = replica_pb2.VerifyRequest(session_id="after-fuzz", block=empty)
        tokens.extend(answer(verifier.call("verify", verifying), "verdict").token_ids)
    assert tuple(tokens) == expected[:8]
    assert answer(verifier.call("close", closing), "closed").existed
    # And a running session there: its own steps, reported under its open entry, are the
    # target's tokens up to its end.
    running = replica_pb2.OpenSessionRequest(
        session_id="after-fuzz",
        prompt_token_ids=prompt_tokens,
        sampling=greedy,
        advance=replica_pb2.Advance(max_length=len(prompt_tokens) + 8),
    )
    tag = verifier.next_tag()
    verifier.send(frame(verifier.entry("open", running, tag)))
    assert answer(verifier.result(tag), "opened").committed_length == len(prompt_tokens)
    reported: list[int] = []
    while len(reported) < 8:
        reported.extend(answer(verifier.result(tag), "verdict").token_ids)
    assert tuple(reported) == expected[:8]
    assert answer(verifier.call("close", closing), "closed").existed
