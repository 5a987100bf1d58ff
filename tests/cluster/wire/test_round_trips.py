"""cluster.wire's conversions: every plain value survives a trip through serialised replica.proto
bytes."""

from __future__ import annotations

import math
import re
from typing import TypeVar

import pytest
import torch
from google.protobuf.message import Message

from cluster.runtime.draft_block import DraftBlock, StepLoad, Verdict
from cluster.runtime.engine_stats import EngineStats
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.sampling_params import SamplingParams
from cluster.runtime.session import ReplicaStats
from cluster.runtime.sparse_distribution import SparseDistribution, to_dense
from cluster.wire.blocks import block_from_wire, block_to_wire, verdict_from_wire, verdict_to_wire
from cluster.wire.distributions import sparse_from_wire, sparse_to_wire
from cluster.wire.fields import MAX_UINT32, session_id_from_wire, uint_to_wire
from cluster.wire.replica_stats import stats_from_wire, stats_to_wire
from cluster.wire.sampling_settings import sampling_from_wire, sampling_to_wire
from protos import replica_pb2, sampling_pb2
from tests.wire_messages import raw_sparse

M = TypeVar("M", bound=Message)


def over_the_wire(message: M) -> M:
    """The message as the other side parses it."""
    return type(message).FromString(message.SerializeToString())


def sparse(ids: list[int], probs: list[float]) -> SparseDistribution:
    return SparseDistribution(
        token_ids=torch.tensor(ids, dtype=torch.int64),
        probs=torch.tensor(probs, dtype=torch.float32),
    )


def assert_same_rows(
    got: tuple[SparseDistribution, ...] | None, want: tuple[SparseDistribution, ...] | None
) -> None:
    assert (got is None) == (want is None)
    for got_row, want_row in zip(got or (), want or (), strict=True):
        assert got_row.token_ids.dtype == torch.int64 and got_row.probs.dtype == torch.float32
        assert torch.equal(got_row.token_ids, want_row.token_ids)
        # Bitwise: q must arrive exactly as sampled from (docs/architecture.md, invariant 1).
        assert torch.equal(got_row.probs.view(torch.int32), want_row.probs.view(torch.int32))


# --- SamplingParams ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.5),
        SamplingParams(temperature=1.25, top_k=7, top_p=0.75),
        SamplingParams(temperature=2.0, top_p=0.5),
    ],
)
def test_sampling_round_trips(params: SamplingParams) -> None:
    # Values float32 can hold exactly come back equal.
    assert sampling_from_wire(over_the_wire(sampling_to_wire(params))) == params


def test_default_top_p_travels_unset_and_unset_reads_as_no_cut() -> None:
    assert not sampling_to_wire(SamplingParams(temperature=1.0)).HasField("top_p")
    params = sampling_from_wire(sampling_pb2.SamplingParams(temperature=1.0))
    assert params.top_p == 1.0


def test_temperature_travels_as_float32() -> None:
    params = sampling_from_wire(over_the_wire(sampling_to_wire(SamplingParams(0.7))))
    assert params.temperature == torch.tensor(0.7, dtype=torch.float32).item() != 0.7


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (sampling_pb2.SamplingParams(temperature=1.0, top_p=0.0), "top_p"),
        (sampling_pb2.SamplingParams(temperature=math.nan), "temperature"),
        (sampling_pb2.SamplingParams(temperature=-1.0), "temperature"),
        (sampling_pb2.SamplingParams(temperature=1.0, top_k=-3), "top_k"),
    ],
)
def test_bad_sampling_from_the_wire_is_refused(
    message: sampling_pb2.SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=field):
        sampling_from_wire(message)


# --- SparseDistribution -----------------------------------------------------------------------


def test_sparse_q_round_trips_bit_for_bit() -> None:
    generator = torch.Generator().manual_seed(0)
    probs = torch.rand(1000, generator=generator) ** 8  # many tiny values
    probs[:3] = torch.tensor([1e-45, 1.1754942e-38, 1.0])  # subnormal, smallest normal, one
    ids = torch.randperm(150_000, generator=generator)[:1000]
    row = SparseDistribution(token_ids=ids, probs=probs)

    back = sparse_from_wire(over_the_wire(sparse_to_wire(row)))

    assert_same_rows((back,), (row,))


def test_sparse_with_mismatched_counts_is_refused_naming_the_row() -> None:
    message = raw_sparse(token_ids=[1, 2, 3], probs=[0.5, 0.5])
    with pytest.raises(InvalidArgumentError, match=r"draft_probs\[4\] has 3 token ids but 2"):
        sparse_from_wire(message, "draft_probs[4]")


@pytest.mark.parametrize(
    ("ids", "probs", "reason"),
    [
        ([1, 2], [0.5, -0.5], "not finite and >= 0"),
        ([1, 2], [0.5, math.nan], "not finite and >= 0"),
        ([3, 3], [0.5, 0.5], "repeats a token id"),
        ([], [], "empty"),
        ([1, 99], [0.5, 0.5], "outside"),
    ],
)
def test_sparse_contents_are_left_to_to_dense(
    ids: list[int], probs: list[float], reason: str
) -> None:
    # The wire cannot know the vocabulary; to_dense, which the verifier runs, rejects these.
    row = sparse_from_wire(raw_sparse(token_ids=ids, probs=probs))
    with pytest.raises(InvalidArgumentError, match=reason):
        to_dense([row], vocab_size=10)


# --- DraftBlock -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "block",
    [
        DraftBlock(base_length=17, tokens=(42, 7, 0)),
        DraftBlock(base_length=0, tokens=()),
        DraftBlock(
            base_length=2**40,
            tokens=(42, 7),
            draft_probs=(sparse([42, 3, 9], [0.5, 0.3, 0.2]), sparse([7], [1.0])),
        ),
    ],
    ids=["deterministic", "empty", "sampled"],
)
def test_block_round_trips(block: DraftBlock) -> None:
    back = block_from_wire(over_the_wire(block_to_wire(block)))
    assert (back.base_length, back.tokens) == (block.base_length, block.tokens)
    assert_same_rows(back.draft_probs, block.draft_probs)


LOAD = StepLoad(batch_sequences=12, batch_tokens=57, cost_base_s=0.0125, cost_per_token_s=3.5e-5)


@pytest.mark.parametrize("load", [LOAD, StepLoad(0, 0, 0.0, 0.0), None], ids=str)
def test_block_load_round_trips(load: StepLoad | None) -> None:
    block = DraftBlock(base_length=9, tokens=(1, 2), load=load)
    message = over_the_wire(block_to_wire(block))
    assert message.HasField("load") == (load is not None)  # all zeros is still a report
    assert block_from_wire(message).load == load


def test_block_load_the_wire_cannot_hold_is_refused() -> None:
    block = DraftBlock(base_length=9, tokens=(1,), load=StepLoad(-1, 5, 0.0, 0.0))
    with pytest.raises(InvalidArgumentError, match=r"load\.batch_sequences"):
        block_to_wire(block)


def test_sampled_empty_block_reads_back_as_deterministic() -> None:
    # With no token to accept, () and None mean the same; the wire cannot tell them apart.
    block = DraftBlock(base_length=5, tokens=(), draft_probs=())
    assert block_from_wire(over_the_wire(block_to_wire(block))).draft_probs is None


def test_block_with_wrong_number_of_distributions_is_refused() -> None:
    message = replica_pb2.DraftBlock(
        base_length=3,
        token_ids=[1, 2],
        draft_probs=[raw_sparse(token_ids=[1], probs=[1.0])],
    )
    with pytest.raises(InvalidArgumentError, match="2 tokens but 1 draft distributions"):
        block_from_wire(message)


def test_block_row_mismatch_names_its_position() -> None:
    message = replica_pb2.DraftBlock(
        token_ids=[1, 2],
        draft_probs=[
            raw_sparse(token_ids=[1], probs=[1.0]),
            raw_sparse(token_ids=[2], probs=[0.5, 0.5]),
        ],
    )
    with pytest.raises(InvalidArgumentError, match=r"draft_probs\[1\] has 1 token ids but 2"):
        block_from_wire(message)


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (DraftBlock(base_length=-1, tokens=()), "base_length"),
        (DraftBlock(base_length=1, tokens=(5, -2)), r"block.tokens\[1\] = -2"),
        (DraftBlock(base_length=1, tokens=(2**31,)), r"block.tokens\[0\]"),
    ],
)
def test_block_the_wire_cannot_hold_is_refused_before_sending(
    block: DraftBlock, message: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        block_to_wire(block)


# --- Verdict, ReplicaStats, scalars -----------------------------------------------------------


@pytest.mark.parametrize(
    "verdict",
    [
        Verdict(base_length=17, num_accepted=2, tokens=(42, 7, 99), committed_length=20),
        Verdict(
            base_length=17,
            num_accepted=3,
            tokens=(42, 7, 99),
            committed_length=20,
            bonus_deferred=True,
        ),
        Verdict(base_length=4, num_accepted=0, tokens=(0,), committed_length=5),
        Verdict(base_length=4, num_accepted=0, tokens=(0,), committed_length=5, load=LOAD),
        Verdict(
            base_length=4,
            num_accepted=0,
            tokens=(0,),
            committed_length=5,
            load=StepLoad(0, 0, 0.0, 0.0),
        ),
    ],
    ids=["rejected", "bonus_deferred", "none_accepted", "with_load", "zero_load"],
)
def test_verdict_round_trips(verdict: Verdict) -> None:
    assert verdict_from_wire(over_the_wire(verdict_to_wire(verdict))) == verdict


def test_stats_round_trip() -> None:
    stats = ReplicaStats(
        num_sessions=3,
        num_cached_tokens=2**40,
        busy_s=12.375,
        sessions_expired=4,
        sessions_evicted=5,
    )
    message = over_the_wire(stats_to_wire(stats))
    assert not message.HasField("engine")
    assert stats_from_wire(message) == stats  # engine None: no engine runs


ENGINE = EngineStats(
    runner="serial",
    steps=2**40,
    max_batch_sequences=32,
    kv_blocks_total=4096,
    kv_blocks_used=1000,
    block_size=16,
    batch_sequences=7.25,
    step_tokens=123.5,
    queue_wait_s=0.0375,
    queued=3,
    cost_base_s=0.011,
    cost_per_token_s=2.5e-5,
    busy_s=12.5,
    forward_s=10.25,
    device_s=9.75,
    batched_s=0.5,
    gather_s=0.125,
    gathers=17,
)


@pytest.mark.parametrize("engine", [ENGINE, EngineStats()], ids=["busy", "fresh"])
def test_stats_with_engine_round_trip(engine: EngineStats) -> None:
    stats = ReplicaStats(num_sessions=3, num_cached_tokens=77, busy_s=1.5, engine=engine)
    back = stats_from_wire(over_the_wire(stats_to_wire(stats)))
    assert back == stats and back.engine is not None
    assert back.engine.kv_blocks_free == engine.kv_blocks_free


def test_every_engine_figure_has_a_wire_field() -> None:
    # A field added to EngineStats but not to the proto would be dropped silently.
    fields = set(replica_pb2.EngineStats.DESCRIPTOR.fields_by_name)
    assert fields == set(EngineStats.__dataclass_fields__)
    assert set(replica_pb2.StepLoad.DESCRIPTOR.fields_by_name) == set(StepLoad.__dataclass_fields__)


def test_engine_figures_the_wire_cannot_hold_are_refused() -> None:
    stats = ReplicaStats(1, 1, engine=EngineStats(kv_blocks_used=-1))
    with pytest.raises(InvalidArgumentError, match=r"engine\.kv_blocks_used"):
        stats_to_wire(stats)


def test_empty_session_id_is_refused() -> None:
    assert session_id_from_wire("s-1") == "s-1"
    with pytest.raises(InvalidArgumentError, match="session_id must not be empty"):
        session_id_from_wire("")


@pytest.mark.parametrize("value", [-1, 2**32, True])
def test_uint_out_of_field_range_is_refused(value: int) -> None:
    with pytest.raises(
        InvalidArgumentError, match=re.escape("num_tokens must be in 0..4294967295")
    ):
        uint_to_wire(value, "num_tokens", MAX_UINT32)
