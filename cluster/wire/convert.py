"""Conversions between `protos/replica.proto` messages and Tandem's plain types.

The one place that knows how each value is laid out on the wire; servicers and clients convert
with these functions and nothing else. `*_to_wire` builds a message from a plain value,
`*_from_wire` reads one back.

What comes off the wire is checked only as far as the wire format can tell: counts that must
agree (a sparse row's ids and probabilities, a block's tokens and distributions), a non-empty
session id, a set time limit that is not zero, and the checks the plain types make when built
(`SamplingParams` rejects a NaN temperature or `top_p = 0`). Everything else needs the
replica's own state and is checked there: token ids against the vocabulary, lengths against
the session, and a sparse row's contents (empty, repeated ids, negative or NaN probabilities)
by `sampling.to_dense`. Each failure is an `InvalidArgumentError` naming the field.

Requests, built from these values, are `cluster.wire.requests`.

Pass-through: a draft block read on the router (`block_from_wire(..., lazy_rows=True)`) keeps
its q rows as the protobuf messages that came off the wire (`WireRows`, decoded only if
indexed; a slice of them is still undecoded), and `block_to_wire` copies those messages into
the verify request as they are: the router never decodes or re-encodes q. A pre-drafted
branch read on the router (`predraft_from_wire(..., lazy_rows=True)`) keeps its q the same way.

Exactness: sparse probabilities travel as raw float32 bytes (ids as int32 bytes, both
little-endian) and `SparseDistribution.probs` is float32, so q round-trips bit for bit
(docs/architecture.md, invariant 1). `SamplingParams.temperature` and `top_p` travel as
float32 too, so a value that float32 cannot hold (0.7) comes back rounded to the nearest one;
the sampling code computes in float32, so the distribution is the same.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np
import torch

from cluster.runtime.constraint import JSON_OBJECT, Constraint, Grammar
from cluster.runtime.draft_block import DraftBlock, StepLoad, Verdict
from cluster.runtime.engine_stats import EngineStats
from cluster.runtime.errors import InvalidArgumentError
from cluster.runtime.predraft import Branch, PreDraft
from cluster.runtime.sampling import NO_TOP_P, SamplingParams, SparseDistribution
from cluster.runtime.session import ReplicaStats
from protos import replica_pb2, sampling_pb2

MAX_INT32 = 2**31 - 1
MAX_UINT32 = 2**32 - 1
MAX_UINT64 = 2**64 - 1
_INT32_LE = np.dtype("<i4")
_FLOAT32_LE = np.dtype("<f4")
"""The byte layout of a sparse row's arrays on the wire, whatever the host's byte order."""


def session_id_from_wire(session_id: str) -> str:
    """The session id of a request; empty (the proto3 default, so also "unset") is refused."""
    if not session_id:
        raise InvalidArgumentError("session_id must not be empty")
    return session_id


def token_ids_to_wire(token_ids: Sequence[int], what: str) -> list[int]:
    """Token ids as the wire's int32s; ids it cannot hold are refused here, naming the first."""
    ids = [int(token) for token in token_ids]
    for position, token in enumerate(ids):
        if not 0 <= token <= MAX_INT32:
            raise InvalidArgumentError(
                f"{what}[{position}] = {token} is not a token id (0..{MAX_INT32})"
            )
    return ids


def uint_to_wire(value: int, what: str, max_value: int = MAX_UINT64) -> int:
    """A count or length for an unsigned wire field, refused if the field cannot hold it."""
    if isinstance(value, bool) or not 0 <= value <= max_value:
        raise InvalidArgumentError(f"{what} must be in 0..{max_value}, got {value!r}")
    return int(value)


def time_limit_to_wire(time_left_s: float) -> int:
    """Seconds a request has left as `OpenSessionRequest.time_limit_ms`: rounded up, so the
    replica never drops a session before its request's deadline; at least 1 (0 is refused on
    the wire) and at most what the field holds (a longer limit is no limit in practice)."""
    return min(max(math.ceil(time_left_s * 1000), 1), MAX_UINT32)


def time_limit_from_wire(request: replica_pb2.OpenSessionRequest) -> float | None:
    """The session's time limit in seconds; None when unset (no limit, only the idle TTL)."""
    if not request.HasField("time_limit_ms"):
        return None
    if request.time_limit_ms == 0:
        raise InvalidArgumentError("time_limit_ms must be >= 1 when set (unset: no limit)")
    return request.time_limit_ms / 1000


def sampling_to_wire(params: SamplingParams) -> sampling_pb2.SamplingParams:
    message = sampling_pb2.SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        rule=(
            sampling_pb2.SAMPLING_RULE_SEED_EXACT
            if params.seed_exact
            else sampling_pb2.SAMPLING_RULE_REJECTION
        ),
    )
    if params.top_p != NO_TOP_P:
        message.top_p = params.top_p
    return message


def grammar_to_wire(grammar: Grammar | None) -> sampling_pb2.Grammar:
    """Unset for None (no grammar)."""
    message = sampling_pb2.Grammar()
    if grammar is None:
        return message
    if grammar.kind == JSON_OBJECT:
        message.json_object = True
    else:
        setattr(message, grammar.kind, grammar.source)
    return message


def grammar_from_wire(message: sampling_pb2.Grammar) -> Grammar | None:
    """None when no kind is set (or `json_object` is false)."""
    kind = message.WhichOneof("kind")
    if kind is None or (kind == JSON_OBJECT and not message.json_object):
        return None
    return Grammar(kind, "" if kind == JSON_OBJECT else getattr(message, kind))


def constraint_to_wire(
    constraint: Constraint | None, request: replica_pb2.OpenSessionRequest
) -> None:
    """Set `request`'s constraint fields (none for None)."""
    if constraint is None:
        return
    request.grammar.CopyFrom(grammar_to_wire(constraint.grammar))
    request.min_tokens = uint_to_wire(constraint.min_tokens, "min_tokens", MAX_UINT32)
    request.end_token_ids.extend(
        token_ids_to_wire(sorted(constraint.end_token_ids), "end_token_ids")
    )
    request.prompt_length = uint_to_wire(constraint.prompt_length, "prompt_length", MAX_UINT32)


def constraint_from_wire(request: replica_pb2.OpenSessionRequest) -> Constraint | None:
    """None when the request constrains nothing."""
    constraint = Constraint(
        grammar=grammar_from_wire(request.grammar),
        min_tokens=request.min_tokens,
        end_token_ids=frozenset(request.end_token_ids),
        prompt_length=(
            request.prompt_length
            if request.HasField("prompt_length")
            else len(request.prompt_token_ids)
        ),
    )
    return constraint if constraint.active else None


def sampling_from_wire(message: sampling_pb2.SamplingParams) -> SamplingParams:
    """Unset `top_p` means no nucleus cut (1.0); a set one, even 0.0, is taken as sent. An
    unspecified rule reads as rejection sampling: the public API resolves a request's rule
    (`cluster.api.sampling_rule.resolve_seed_exact`) before anything reaches a replica."""
    top_p = message.top_p if message.HasField("top_p") else NO_TOP_P
    if message.rule not in _RULES:
        raise InvalidArgumentError(f"sampling.rule {message.rule} is not a SamplingRule")
    return SamplingParams(
        temperature=message.temperature,
        top_k=message.top_k,
        top_p=top_p,
        seed_exact=message.rule == sampling_pb2.SAMPLING_RULE_SEED_EXACT,
    )


_RULES = frozenset(sampling_pb2.SamplingRule.values())


def sparse_to_wire(row: SparseDistribution) -> replica_pb2.SparseDistribution:
    """Ids as little-endian int32 bytes, probabilities as little-endian float32 bytes."""
    ids = row.token_ids.detach().cpu()
    if ids.numel() and not (int(ids.min()) >= 0 and int(ids.max()) <= MAX_INT32):
        bad = int(((ids < 0) | (ids > MAX_INT32)).nonzero()[0, 0])
        raise InvalidArgumentError(
            f"token_ids[{bad}] = {int(ids[bad])} is not a token id (0..{MAX_INT32})"
        )
    return replica_pb2.SparseDistribution(
        token_ids=ids.numpy().astype(_INT32_LE).tobytes(),
        probs=row.probs.detach().cpu().to(torch.float32).numpy().astype(_FLOAT32_LE).tobytes(),
    )


def sparse_from_wire(
    message: replica_pb2.SparseDistribution, what: str = "sparse distribution"
) -> SparseDistribution:
    """Ids and probabilities as sent; only their sizes and counts are checked (see the module
    doc)."""
    check_sparse(message, what)
    ids = np.frombuffer(message.token_ids, dtype=_INT32_LE)
    probs = np.frombuffer(message.probs, dtype=_FLOAT32_LE)
    return SparseDistribution(
        token_ids=torch.from_numpy(ids.astype(np.int64)),
        probs=torch.from_numpy(probs.astype(np.float32)),  # a native, writable copy
    )


def check_sparse(message: replica_pb2.SparseDistribution, what: str) -> None:
    """Refuse a row whose byte arrays are not whole values or whose counts differ, without
    decoding it."""
    for field in ("token_ids", "probs"):
        if len(getattr(message, field)) % 4:
            raise InvalidArgumentError(f"{what}.{field} is not a whole number of 4-byte values")
    num_ids, num_probs = len(message.token_ids) // 4, len(message.probs) // 4
    if num_ids != num_probs:
        raise InvalidArgumentError(f"{what} has {num_ids} token ids but {num_probs} probabilities")


class WireRows(Sequence[SparseDistribution]):
    """A draft block's q rows as they came off the wire: the protobuf messages, each decoded
    into a `SparseDistribution` only if indexed. The router holds a drafter's block this way
    and `block_to_wire` sends the same messages on to the verifier, never decoding q."""

    def __init__(self, messages: Sequence[replica_pb2.SparseDistribution]) -> None:
        """Checks each row's sizes (`check_sparse`); reads no value."""
        for position, message in enumerate(messages):
            check_sparse(message, f"draft_probs[{position}]")
        self.messages = messages
        """The rows as received (the caller must not change them)."""

    def __len__(self) -> int:
        return len(self.messages)

    @overload
    def __getitem__(self, index: int) -> SparseDistribution: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[SparseDistribution]: ...

    def __getitem__(self, index: int | slice) -> SparseDistribution | Sequence[SparseDistribution]:
        if isinstance(index, slice):  # still as received: a prefix goes on undecoded
            return WireRows(self.messages[index])
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"draft_probs[{index}] out of range ({len(self)} rows)")
        return sparse_from_wire(self.messages[index], f"draft_probs[{index}]")

    def __iter__(self) -> Iterator[SparseDistribution]:
        return (self[i] for i in range(len(self)))


def floats_to_wire(values: Sequence[float]) -> bytes:
    """Numbers as raw little-endian float32 bytes (a reference's gaps), laid out like a sparse
    row's probabilities."""
    return np.asarray(values, dtype=np.float32).astype(_FLOAT32_LE).tobytes()


def floats_from_wire(data: bytes, what: str) -> tuple[float, ...]:
    """The float32 values of `floats_to_wire`'s bytes; a length that is not a whole number of
    values is refused, naming `what`."""
    if len(data) % 4:
        raise InvalidArgumentError(f"{what} is not a whole number of 4-byte values")
    return tuple(float(value) for value in np.frombuffer(data, dtype=_FLOAT32_LE))


def load_to_wire(load: StepLoad) -> replica_pb2.StepLoad:
    return replica_pb2.StepLoad(
        batch_sequences=uint_to_wire(load.batch_sequences, "load.batch_sequences", MAX_UINT32),
        batch_tokens=uint_to_wire(load.batch_tokens, "load.batch_tokens", MAX_UINT32),
        cost_base_s=load.cost_base_s,
        cost_per_token_s=load.cost_per_token_s,
    )


def load_from_wire(message: replica_pb2.StepLoad) -> StepLoad:
    return StepLoad(
        batch_sequences=message.batch_sequences,
        batch_tokens=message.batch_tokens,
        cost_base_s=message.cost_base_s,
        cost_per_token_s=message.cost_per_token_s,
    )


def draft_probs_to_wire(
    rows: Sequence[SparseDistribution] | None,
) -> list[replica_pb2.SparseDistribution]:
    """A drafted block's q rows (a `DraftBlock`'s or a `PreDraft`'s `draft_probs`) as the
    wire's repeated field: None and () both empty, `WireRows` as received (not decoded)."""
    if isinstance(rows, WireRows):
        return list(rows.messages)
    return [sparse_to_wire(row) for row in rows or ()]


def draft_probs_from_wire(
    rows: Sequence[replica_pb2.SparseDistribution],
    num_tokens: int,
    what: str,
    lazy_rows: bool = False,
) -> Sequence[SparseDistribution] | None:
    """The q rows of a drafted block of `num_tokens` tokens (`what` names it in an error):
    None when empty (deterministic draft), else one per token, decoded, or with `lazy_rows`
    kept as received (`WireRows`, sizes checked)."""
    if not rows:
        return None
    if len(rows) != num_tokens:
        raise InvalidArgumentError(
            f"{what} has {num_tokens} tokens but {len(rows)} draft distributions: "
            "send one per token, or none for a deterministic draft"
        )
    if lazy_rows:
        return WireRows(rows)
    return tuple(sparse_from_wire(row, f"draft_probs[{i}]") for i, row in enumerate(rows))


def block_to_wire(block: DraftBlock) -> replica_pb2.DraftBlock:
    """`draft_probs` None and () both become an empty field (see `block_from_wire`), and
    `WireRows` are copied as received; a `load` of None leaves the field unset."""
    message = replica_pb2.DraftBlock(
        base_length=uint_to_wire(block.base_length, "base_length"),
        token_ids=token_ids_to_wire(block.tokens, "block.tokens"),
        draft_probs=draft_probs_to_wire(block.draft_probs),
    )
    if block.assumed:
        message.assumed_token_ids.extend(token_ids_to_wire(block.assumed, "block.assumed"))
    if block.load is not None:
        message.load.CopyFrom(load_to_wire(block.load))
    return message


def block_from_wire(message: replica_pb2.DraftBlock, *, lazy_rows: bool = False) -> DraftBlock:
    """An empty `draft_probs` reads back as None (deterministic draft, q one-hot).

    A block of zero tokens drafted by sampling had `draft_probs == ()`, which the wire cannot
    tell from None; with no token to accept, the two mean the same to the verifier.
    `lazy_rows` (the router): q stays as the received messages (`WireRows`, sizes checked),
    for `block_to_wire` to pass on; otherwise every row is decoded here.
    """
    tokens = tuple(message.token_ids)
    return DraftBlock(
        base_length=message.base_length,
        tokens=tokens,
        draft_probs=draft_probs_from_wire(message.draft_probs, len(tokens), "block", lazy_rows),
        load=load_from_wire(message.load) if message.HasField("load") else None,
        assumed=tuple(message.assumed_token_ids),
    )


def branch_to_wire(branch: Branch) -> replica_pb2.PredraftBranch:
    return replica_pb2.PredraftBranch(
        accepted=uint_to_wire(branch.accepted, "branch.accepted", MAX_UINT32),
        rank=uint_to_wire(branch.rank, "branch.rank", MAX_UINT32),
    )


def branch_from_wire(message: replica_pb2.PredraftBranch) -> Branch:
    """As sent: whether `accepted` fits the block is the drafter's check."""
    return Branch(accepted=message.accepted, rank=message.rank)


def predraft_to_wire(branch: PreDraft) -> replica_pb2.PreDraft:
    """q rows as `block_to_wire` sends a block's."""
    message = replica_pb2.PreDraft(
        accepted=uint_to_wire(branch.accepted, "predraft.accepted", MAX_UINT32),
        token=token_ids_to_wire((branch.token,), "predraft.token")[0],
        token_ids=token_ids_to_wire(branch.tokens, "predraft.tokens"),
        draft_probs=draft_probs_to_wire(branch.draft_probs),
    )
    if branch.load is not None:
        message.load.CopyFrom(load_to_wire(branch.load))
    return message


def predraft_from_wire(message: replica_pb2.PreDraft, *, lazy_rows: bool = False) -> PreDraft:
    """q rows as `block_from_wire` reads a block's (`lazy_rows`: the router's, kept as
    received)."""
    tokens = tuple(message.token_ids)
    return PreDraft(
        accepted=message.accepted,
        token=message.token,
        tokens=tokens,
        draft_probs=draft_probs_from_wire(message.draft_probs, len(tokens), "predraft", lazy_rows),
        load=load_from_wire(message.load) if message.HasField("load") else None,
    )


def predrafts_to_wire(branches: Sequence[PreDraft]) -> replica_pb2.PredraftResponse:
    return replica_pb2.PredraftResponse(branches=[predraft_to_wire(b) for b in branches])


def predrafts_from_wire(
    message: replica_pb2.PredraftResponse, *, lazy_rows: bool = False
) -> list[PreDraft]:
    return [predraft_from_wire(b, lazy_rows=lazy_rows) for b in message.branches]


def verdict_to_wire(verdict: Verdict) -> replica_pb2.Verdict:
    """A `load` of None leaves the field unset."""
    message = replica_pb2.Verdict(
        base_length=verdict.base_length,
        num_accepted=verdict.num_accepted,
        token_ids=verdict.tokens,
        committed_length=verdict.committed_length,
        bonus_deferred=verdict.bonus_deferred,
        num_matched=verdict.num_matched,
        dropped=verdict.dropped,
    )
    if verdict.load is not None:
        message.load.CopyFrom(load_to_wire(verdict.load))
    return message


def verdict_from_wire(message: replica_pb2.Verdict) -> Verdict:
    return Verdict(
        base_length=message.base_length,
        num_accepted=message.num_accepted,
        tokens=tuple(message.token_ids),
        committed_length=message.committed_length,
        bonus_deferred=message.bonus_deferred,
        load=load_from_wire(message.load) if message.HasField("load") else None,
        num_matched=message.num_matched,
        dropped=message.dropped,
    )


def engine_stats_to_wire(engine: EngineStats) -> replica_pb2.EngineStats:
    return replica_pb2.EngineStats(
        runner=engine.runner,
        steps=uint_to_wire(engine.steps, "engine.steps"),
        max_batch_sequences=uint_to_wire(
            engine.max_batch_sequences, "engine.max_batch_sequences", MAX_UINT32
        ),
        kv_blocks_total=uint_to_wire(engine.kv_blocks_total, "engine.kv_blocks_total"),
        kv_blocks_used=uint_to_wire(engine.kv_blocks_used, "engine.kv_blocks_used"),
        block_size=uint_to_wire(engine.block_size, "engine.block_size", MAX_UINT32),
        batch_sequences=engine.batch_sequences,
        step_tokens=engine.step_tokens,
        queue_wait_s=engine.queue_wait_s,
        queued=uint_to_wire(engine.queued, "engine.queued", MAX_UINT32),
        cost_base_s=engine.cost_base_s,
        cost_per_token_s=engine.cost_per_token_s,
        busy_s=engine.busy_s,
        forward_s=engine.forward_s,
        device_s=engine.device_s,
        batched_s=engine.batched_s,
        gather_s=engine.gather_s,
        gathers=uint_to_wire(engine.gathers, "engine.gathers"),
        preemptions=uint_to_wire(engine.preemptions, "engine.preemptions"),
        recomputed_tokens=uint_to_wire(engine.recomputed_tokens, "engine.recomputed_tokens"),
        refusals=uint_to_wire(engine.refusals, "engine.refusals"),
        running_sessions=uint_to_wire(engine.running_sessions, "engine.running_sessions"),
        running_stepped=uint_to_wire(engine.running_stepped, "engine.running_stepped"),
        startup_base_s=engine.startup_base_s,
        startup_per_token_s=engine.startup_per_token_s,
        step_running_s=engine.step_running_s,
    )


def engine_stats_from_wire(message: replica_pb2.EngineStats) -> EngineStats:
    return EngineStats(
        runner=message.runner,
        steps=message.steps,
        max_batch_sequences=message.max_batch_sequences,
        kv_blocks_total=message.kv_blocks_total,
        kv_blocks_used=message.kv_blocks_used,
        block_size=message.block_size,
        batch_sequences=message.batch_sequences,
        step_tokens=message.step_tokens,
        queue_wait_s=message.queue_wait_s,
        queued=message.queued,
        cost_base_s=message.cost_base_s,
        cost_per_token_s=message.cost_per_token_s,
        busy_s=message.busy_s,
        forward_s=message.forward_s,
        device_s=message.device_s,
        batched_s=message.batched_s,
        gather_s=message.gather_s,
        gathers=message.gathers,
        preemptions=message.preemptions,
        recomputed_tokens=message.recomputed_tokens,
        refusals=message.refusals,
        running_sessions=message.running_sessions,
        running_stepped=message.running_stepped,
        startup_base_s=message.startup_base_s,
        startup_per_token_s=message.startup_per_token_s,
        step_running_s=message.step_running_s,
    )


def stats_to_wire(stats: ReplicaStats) -> replica_pb2.ReplicaStats:
    """An `engine` of None leaves the field unset."""
    message = replica_pb2.ReplicaStats(
        num_sessions=stats.num_sessions,
        num_cached_tokens=stats.num_cached_tokens,
        busy_s=stats.busy_s,
        frames_sent=uint_to_wire(stats.frames_sent, "frames_sent"),
        results_sent=uint_to_wire(stats.results_sent, "results_sent"),
        frames_received=uint_to_wire(stats.frames_received, "frames_received"),
        entries_received=uint_to_wire(stats.entries_received, "entries_received"),
        sessions_expired=uint_to_wire(stats.sessions_expired, "sessions_expired"),
        sessions_evicted=uint_to_wire(stats.sessions_evicted, "sessions_evicted"),
    )
    if stats.engine is not None:
        message.engine.CopyFrom(engine_stats_to_wire(stats.engine))
    return message


def stats_from_wire(message: replica_pb2.ReplicaStats) -> ReplicaStats:
    """An unset `engine` (no engine runs, or an older replica) reads back as None."""
    return ReplicaStats(
        num_sessions=message.num_sessions,
        num_cached_tokens=message.num_cached_tokens,
        busy_s=message.busy_s,
        engine=engine_stats_from_wire(message.engine) if message.HasField("engine") else None,
        frames_sent=message.frames_sent,
        results_sent=message.results_sent,
        frames_received=message.frames_received,
        entries_received=message.entries_received,
        sessions_expired=message.sessions_expired,
        sessions_evicted=message.sessions_evicted,
    )
