"""The Frames codec: entries and results built from plain values and read back, through serialised
bytes, give the same values (q bit for bit); a drafter's q rows kept as received (`WireRows`)
reach the verify request as the same bytes; entry errors read back as the errors a unary call
raises."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cluster.runtime.draft_block import DraftBlock, StepLoad, Verdict
from cluster.runtime.errors import (
    InvalidArgumentError,
    ReplicaUnavailableError,
    ResourceExhaustedError,
    SessionNotFoundError,
    StaleBaseError,
    TandemError,
)
from cluster.runtime.predraft import Branch, PreDraft
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import ReplicaStats
from cluster.runtime.sparse_distribution import SparseDistribution
from cluster.wire import requests
from cluster.wire.blocks import (
    block_from_wire,
    block_to_wire,
    predraft_from_wire,
    predrafts_from_wire,
    predrafts_to_wire,
    verdict_from_wire,
    verdict_to_wire,
)
from cluster.wire.distributions import WireRows, sparse_to_wire
from cluster.wire.fields import MAX_INT32, MAX_UINT32, MAX_UINT64
from cluster.wire.frame_budget import split_by_size
from cluster.wire.replica_stats import stats_from_wire, stats_to_wire
from cluster.wire.status import entry_error, error_from_entry
from protos import replica_pb2

EXAMPLES = settings(max_examples=60, deadline=None, derandomize=True)

tokens = st.lists(st.integers(0, MAX_INT32), max_size=12).map(tuple)
session_ids = st.text(min_size=1, max_size=20)
tags = st.integers(0, MAX_UINT64)


@st.composite
def rows(draw: st.DrawFn, count: int) -> tuple[SparseDistribution, ...]:
    """`count` sparse rows whose probabilities are any float32 bit patterns (NaN included):
    the codec must carry them bit for bit whatever they are."""
    made = []
    for _ in range(count):
        size = draw(st.integers(0, 6))
        ids = draw(st.lists(st.integers(0, MAX_INT32), min_size=size, max_size=size))
        bits = draw(st.lists(st.integers(0, 2**32 - 1), min_size=size, max_size=size))
        probs = torch.from_numpy(np.asarray(bits, dtype=np.uint32).view(np.float32).copy())
        made.append(SparseDistribution(torch.tensor(ids, dtype=torch.int64), probs))
    return tuple(made)


@st.composite
def blocks(draw: st.DrawFn) -> DraftBlock:
    drafted = draw(tokens)
    sampled = draw(st.booleans()) and len(drafted) > 0
    load = draw(
        st.none()
        | st.builds(StepLoad, st.integers(0, 99), st.integers(0, 999), st.just(0.5), st.just(0.25))
    )
    return DraftBlock(
        base_length=draw(st.integers(0, 10**6)),
        tokens=drafted,
        draft_probs=draw(rows(len(drafted))) if sampled else None,
        load=load,
    )


def over_the_wire(message: replica_pb2.RouterFrame | replica_pb2.ReplicaFrame) -> bytes:
    return message.SerializeToString()


def bits(row: SparseDistribution) -> tuple[list[int], list[int]]:
    return row.token_ids.tolist(), row.probs.view(torch.int32).tolist()


def same_rows(got: object, want: tuple[SparseDistribution, ...] | None) -> bool:
    if want is None:
        return got is None
    assert got is not None
    return [bits(r) for r in got] == [bits(r) for r in want]  # type: ignore[attr-defined]


@EXAMPLES
@given(
    tag=tags,
    session_id=session_ids,
    prompt=tokens.filter(bool),
    seed=st.integers(0, 2**63 - 1),
    max_new_tokens=st.none() | st.integers(0, MAX_UINT32),
    resumed=st.booleans(),
)
def test_an_open_entry_reads_back_as_its_values(
    tag: int,
    session_id: str,
    prompt: tuple[int, ...],
    seed: int,
    max_new_tokens: int | None,
    resumed: bool,
) -> None:
    sampling = SamplingParams(temperature=0.5, top_k=3)
    request = requests.open_request_to_wire(
        session_id, prompt, sampling, seed, max_new_tokens=max_new_tokens, resumed=resumed
    )
    frame = replica_pb2.RouterFrame(
        version=requests.FRAME_VERSION, entries=[replica_pb2.FrameEntry(tag=tag, open=request)]
    )
    (entry,) = replica_pb2.RouterFrame.FromString(over_the_wire(frame)).entries
    assert entry.tag == tag and entry.WhichOneof("call") == "open"
    read = requests.open_request_from_wire(entry.open)
    assert (read.session_id, read.prompt_tokens, read.seed) == (session_id, prompt, seed)
    assert (read.max_new_tokens, read.resumed, read.sampling) == (max_new_tokens, resumed, sampling)
    assert read.time_limit_s is None and read.constraint is None


@EXAMPLES
@given(
    tag=tags,
    session_id=session_ids,
    base=st.integers(0, MAX_UINT64),
    appended=tokens,
    num_tokens=st.integers(0, MAX_UINT32),
    truncate_to=st.none() | st.integers(0, MAX_UINT64),
)
def test_a_draft_entry_reads_back_as_its_values(
    tag: int,
    session_id: str,
    base: int,
    appended: tuple[int, ...],
    num_tokens: int,
    truncate_to: int | None,
) -> None:
    request = requests.draft_request_to_wire(session_id, base, appended, num_tokens, truncate_to)
    frame = replica_pb2.RouterFrame(entries=[replica_pb2.FrameEntry(tag=tag, draft=request)])
    (entry,) = replica_pb2.RouterFrame.FromString(over_the_wire(frame)).entries
    assert entry.tag == tag
    assert requests.draft_request_from_wire(entry.draft) == requests.DraftCall(
        session_id, base, appended, num_tokens, truncate_to
    )


branches = st.lists(
    st.builds(Branch, st.integers(0, MAX_UINT32), st.integers(0, MAX_UINT32)),
    max_size=8,
).map(tuple)


@EXAMPLES
@given(
    tag=tags,
    session_id=session_ids,
    base=st.integers(0, MAX_UINT64),
    appended=tokens,
    block=tokens,
    chosen=branches,
    num_tokens=st.integers(0, MAX_UINT32),
    truncate_to=st.none() | st.integers(0, MAX_UINT64),
)
def test_a_predraft_entry_reads_back_as_its_values(
    tag: int,
    session_id: str,
    base: int,
    appended: tuple[int, ...],
    block: tuple[int, ...],
    chosen: tuple[Branch, ...],
    num_tokens: int,
    truncate_to: int | None,
) -> None:
    request = requests.predraft_request_to_wire(
        session_id, base, appended, block, chosen, num_tokens, truncate_to
    )
    frame = replica_pb2.RouterFrame(entries=[replica_pb2.FrameEntry(tag=tag, predraft=request)])
    (entry,) = replica_pb2.RouterFrame.FromString(over_the_wire(frame)).entries
    assert entry.tag == tag and entry.WhichOneof("call") == "predraft"
    assert requests.predraft_request_from_wire(entry.predraft) == requests.PredraftCall(
        session_id, base, appended, block, chosen, num_tokens, truncate_to
    )


@st.composite
def predrafts(draw: st.DrawFn) -> PreDraft:
    drafted = draw(tokens)
    sampled = draw(st.booleans()) and len(drafted) > 0
    return PreDraft(
        accepted=draw(st.integers(0, MAX_UINT32)),
        token=draw(st.integers(0, MAX_INT32)),
        tokens=drafted,
        draft_probs=draw(rows(len(drafted))) if sampled else None,
        load=draw(
            st.none()
            | st.builds(
                StepLoad, st.integers(0, 99), st.integers(0, 999), st.just(0.5), st.just(0.25)
            )
        ),
    )


@EXAMPLES
@given(tag=tags, drafted=st.lists(predrafts(), max_size=4), session_id=session_ids)
def test_predrafted_branches_read_back_with_q_bit_for_bit_and_pass_through_as_bytes(
    tag: int, drafted: list[PreDraft], session_id: str
) -> None:
    sent = predrafts_to_wire(drafted)
    frame = replica_pb2.ReplicaFrame(results=[replica_pb2.FrameResult(tag=tag, predrafted=sent)])
    (result,) = replica_pb2.ReplicaFrame.FromString(over_the_wire(frame)).results
    assert result.tag == tag and result.WhichOneof("result") == "predrafted"
    decoded = predrafts_from_wire(result.predrafted)
    on_router = predrafts_from_wire(result.predrafted, lazy_rows=True)
    for want, got, kept, as_sent in zip(drafted, decoded, on_router, sent.branches, strict=True):
        for read in (got, kept):
            assert (read.accepted, read.token) == (want.accepted, want.token)
            assert read.tokens == want.tokens and read.load == want.load
            assert same_rows(read.draft_probs, want.draft_probs)
        if want.draft_probs is None:
            continue
        assert not isinstance(got.draft_probs, WireRows)
        assert kept.draft_probs is not None
        # A hit branch is verified as a block: its q, cut to what is left, goes on undecoded.
        cut = len(kept.tokens) - 1
        prefix = kept.draft_probs[:cut]
        assert isinstance(prefix, WireRows)
        block = DraftBlock(base_length=7, tokens=kept.tokens[:cut], draft_probs=prefix)
        request = requests.verify_request_to_wire(session_id, block)
        assert [(r.token_ids, r.probs) for r in request.block.draft_probs] == [
            (r.token_ids, r.probs) for r in as_sent.draft_probs[:cut]
        ]


def test_a_predrafted_branch_with_q_for_some_of_its_tokens_is_refused() -> None:
    row = sparse_to_wire(SparseDistribution(torch.tensor([3]), torch.tensor([1.0])))
    message = replica_pb2.PreDraft(accepted=1, token=4, token_ids=[5, 6], draft_probs=[row])
    try:
        predraft_from_wire(message)
    except InvalidArgumentError as error:
        assert "predraft has 2 tokens but 1 draft distributions" in str(error)
    else:
        raise AssertionError("a branch with q for one of its two tokens was taken")


def test_a_branch_the_wire_cannot_carry_is_refused_before_sending() -> None:
    for bad in (Branch(-1, 0), Branch(0, -2)):
        try:
            requests.predraft_request_to_wire("s", 3, [], [5], [bad], 2)
        except InvalidArgumentError as error:
            assert "branch." in str(error)
        else:
            raise AssertionError(f"{bad} was sent")


@EXAMPLES
@given(tag=tags, session_id=session_ids, block=blocks(), defer_bonus=st.booleans())
def test_a_verify_entry_reads_back_with_q_bit_for_bit(
    tag: int, session_id: str, block: DraftBlock, defer_bonus: bool
) -> None:
    request = requests.verify_request_to_wire(session_id, block, defer_bonus)
    frame = replica_pb2.RouterFrame(entries=[replica_pb2.FrameEntry(tag=tag, verify=request)])
    (entry,) = replica_pb2.RouterFrame.FromString(over_the_wire(frame)).entries
    read = requests.verify_request_from_wire(entry.verify)
    assert (entry.tag, read.session_id, read.defer_bonus) == (tag, session_id, defer_bonus)
    assert (read.block.base_length, read.block.tokens, read.block.load) == (
        block.base_length,
        block.tokens,
        block.load,
    )
    assert same_rows(read.block.draft_probs, block.draft_probs)


@EXAMPLES
@given(tag=tags, block=blocks(), session_id=session_ids)
def test_a_drafted_block_passes_through_the_router_as_the_same_bytes(
    tag: int, block: DraftBlock, session_id: str
) -> None:
    # The drafter answers in a frame; the router keeps q as received and verifies with it.
    sent = block_to_wire(block)
    frame = replica_pb2.ReplicaFrame(results=[replica_pb2.FrameResult(tag=tag, block=sent)])
    (result,) = replica_pb2.ReplicaFrame.FromString(over_the_wire(frame)).results
    on_router = block_from_wire(result.block, lazy_rows=True)
    if block.draft_probs is not None:
        assert isinstance(on_router.draft_probs, WireRows)
    request = requests.verify_request_to_wire(session_id, on_router)
    assert [(r.token_ids, r.probs) for r in request.block.draft_probs] == [
        (r.token_ids, r.probs) for r in sent.draft_probs
    ]
    # Read where it is used (the verifier), q is still what the drafter sampled from.
    verifier_side = requests.verify_request_from_wire(
        replica_pb2.VerifyRequest.FromString(request.SerializeToString())
    )
    assert same_rows(verifier_side.block.draft_probs, block.draft_probs)
    assert same_rows(on_router.draft_probs, block.draft_probs)  # decoded only when indexed


def test_wire_rows_check_sizes_without_decoding_and_refuse_a_bad_row() -> None:
    good = sparse_to_wire(SparseDistribution(torch.tensor([3]), torch.tensor([1.0])))
    bad = replica_pb2.SparseDistribution(token_ids=b"\x01\x00\x00\x00", probs=b"")
    assert len(WireRows([good, good])) == 2
    try:
        WireRows([good, bad])
    except InvalidArgumentError as error:
        assert "draft_probs[1] has 1 token ids but 0 probabilities" in str(error)
    else:
        raise AssertionError("a row with ids and no probabilities was taken")


@EXAMPLES
@given(
    tag=tags,
    num_accepted=st.integers(0, 8),
    committed=st.integers(0, 10**9),
    bonus_deferred=st.booleans(),
)
def test_a_verdict_result_reads_back(
    tag: int, num_accepted: int, committed: int, bonus_deferred: bool
) -> None:
    verdict = Verdict(7, num_accepted, tuple(range(num_accepted + 1)), committed, bonus_deferred)
    frame = replica_pb2.ReplicaFrame(
        results=[replica_pb2.FrameResult(tag=tag, verdict=verdict_to_wire(verdict))]
    )
    (result,) = replica_pb2.ReplicaFrame.FromString(over_the_wire(frame)).results
    assert result.tag == tag and verdict_from_wire(result.verdict) == verdict


ERRORS: list[TandemError] = [
    SessionNotFoundError("no open session 's'"),
    StaleBaseError("has committed length 3, but based on length 5"),
    InvalidArgumentError("block.tokens[0] = 999 is outside the vocabulary"),
    ResourceExhaustedError("the KV pool is full", retry_after_s=1.25),
    ResourceExhaustedError("too many sessions"),
]


@EXAMPLES
@given(tag=tags, error=st.sampled_from(ERRORS))
def test_an_entry_error_reads_back_as_the_error_a_unary_call_raises(
    tag: int, error: TandemError
) -> None:
    retry_after_s = getattr(error, "retry_after_s", None)
    result = replica_pb2.FrameResult(
        tag=tag, error=entry_error(error.status, str(error), retry_after_s)
    )
    frame = replica_pb2.ReplicaFrame(results=[result])
    (back,) = replica_pb2.ReplicaFrame.FromString(over_the_wire(frame)).results
    raised = error_from_entry(back.error, "verifier at here")
    assert type(raised) is type(error) and str(raised) == str(error)
    assert getattr(raised, "retry_after_s", None) == retry_after_s


def test_an_internal_entry_error_reads_back_as_the_replica_unavailable() -> None:
    raised = error_from_entry(entry_error("INTERNAL", "internal error"), "drafter at x:1")
    assert isinstance(raised, ReplicaUnavailableError)
    assert str(raised) == "drafter at x:1: INTERNAL: internal error"


def test_stats_carry_the_frame_counters_both_ways() -> None:
    stats = ReplicaStats(
        2, 10, frames_sent=5, results_sent=40, frames_received=6, entries_received=41
    )
    message = replica_pb2.ReplicaStats.FromString(stats_to_wire(stats).SerializeToString())
    assert stats_from_wire(message) == stats


def test_frames_are_cut_under_the_byte_budget_in_order() -> None:
    blocks = [
        replica_pb2.FrameResult(tag=tag, block=replica_pb2.DraftBlock(token_ids=[1] * size))
        for tag, size in enumerate([10, 10, 200, 10, 10, 10], start=1)
    ]
    sizes = [b.ByteSize() for b in blocks]
    budget = sizes[0] + sizes[1] + 1
    groups = split_by_size(blocks, budget)
    assert [[r.tag for r in g] for g in groups] == [[1, 2], [3], [4, 5], [6]]  # 3 is too big
    assert all(sum(r.ByteSize() for r in g) <= budget for g in groups if len(g) > 1)
    assert split_by_size([], budget) == []
